// SIMT emulation of the CUDA runtime for the wiola kernels (issue 10 §1): the host side
// (types, errors, launches) of the emulator. csrc/cuda/emu/cuda_emu.h adds the device
// side (thread indices, barriers, warp collectives, bf16/fp16, intrinsics, cub subset).
//
// Test-only: every .cu compiles as host C++ with -DWIOLA_CUDA_EMU against these headers,
// kernel bodies unchanged, and runs each block as blockDim fibers on one OS thread
// (csrc/cuda/emu/runtime.cpp says why fibers). Everything lives in namespace wiola_emu
// (made visible with a using-directive), so an emulated object never shares a symbol
// with the real CUDA objects linked into the same extension.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace wiola_emu {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorInvalidConfiguration = 9,
};
enum cudaFuncAttribute : int { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

struct Stream;  // one host-synchronous stream: launches run to completion
using cudaStream_t = Stream*;

// Device limits checked at launch (an H200, sm_90).
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr size_t kDefaultDynamicSmem = 48 * 1024;    // without cudaFuncSetAttribute
constexpr size_t kMaxSmemPerBlock = 227 * 1024;      // opt-in maximum per block
constexpr unsigned kMaxGridY = 65535, kMaxGridZ = 65535;

cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t err);
cudaError_t set_func_attribute(const void* func, cudaFuncAttribute attr, int value);

template <typename F>
cudaError_t cudaFuncSetAttribute(F* func, cudaFuncAttribute attr, int value) {
  return set_func_attribute(reinterpret_cast<const void*>(func), attr, value);
}

// Runs `body` once per thread of every block; throws std::runtime_error on a device fault
// (a divergent collective or barrier), sets the last error on an invalid configuration.
cudaError_t launch(const void* func, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   const std::function<void()>& body);

// extern __shared__ arrays: the wrapper TU that includes a .cu defines each one with
// WIOLA_EMU_EXTERN_SHARED (cuda_emu.h) in the kernel's namespace, which registers it here
// so that each block starts with its dynamic shared memory poisoned (0xFF: NaN floats).
void register_dynamic_shared(void* (*address)());

}  // namespace wiola_emu

using namespace wiola_emu;  // NOLINT: CUDA's runtime names are global
