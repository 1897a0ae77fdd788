// SIMT emulation of the CUDA runtime for the wiola kernels: the host side
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
#include <string>

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

// --- How harsh a launch is ----------------------------------------------------------
// The order in which the threads of a block run between two meeting points (barriers,
// warp collectives). A kernel that depends on it has a race the device may or may not
// show; the tests run every kernel under several orders.
//   forward        thread 0, 1, 2, ... (the order of the first emulator)
//   reverse        the last thread first
//   shuffle:<seed> a fresh permutation at every meeting point, from (seed, block, round):
//                  reproducible whatever the number of worker threads
struct Schedule {
  enum Kind : int { kForward, kReverse, kShuffle };
  Kind kind = kForward;
  uint64_t seed = 0;
};
// "forward", "reverse" or "shuffle:<seed>" (decimal); std::invalid_argument otherwise.
Schedule parse_schedule(const std::string& text);
std::string schedule_name(Schedule s);
// The schedule of the next launches: set_schedule's when set, else $WIOLA_EMU_SCHEDULE
// (read at every launch), else forward.
Schedule current_schedule();
void set_schedule(const Schedule& s);
void clear_schedule();  // back to $WIOLA_EMU_SCHEDULE

// Flush-to-zero, as the device's -ftz=true (--use_fast_math builds, setup.py): the fibers
// run with MXCSR FTZ set, so a float32 result that would be subnormal is zero.
// set_flush_to_zero's when set, else $WIOLA_EMU_FTZ ("0": off), else on. x86-64 only
// (elsewhere always off). Where the device differs: it also reads subnormal float32 inputs
// as zero (MXCSR DAZ would, but for doubles too, which the device never flushes: a double
// τ = -5e-324 in atm.cu must stay below 0), and it never flushes a double result (MXCSR
// FTZ does, below 2^-1022, which the kernels' double paths do not reach).
bool flush_to_zero();
void set_flush_to_zero(bool on);
void clear_flush_to_zero();

// --- Device memory that ends at a guard page ------------------------------------------
// device_alloc(bytes, phase) returns memory whose address is ≡ phase (mod kGuardAlign) and
// whose end lies at most kGuardAlign - 1 bytes before a PROT_NONE page (a page before it is
// PROT_NONE too). An access by a kernel into a guard page is a device fault (the launch
// throws, naming the buffer and the offset); the bytes between the buffer and the guards
// are 0xFF (NaN / -1 when read) and a launch that wrote them throws. `phase` lets a copy
// keep the alignment of the memory it copies (a misaligned view stays misaligned).
constexpr size_t kGuardAlign = 16;  // the widest vector access
void* device_alloc(size_t bytes, size_t phase = 0);
void device_free(void* p) noexcept;

}  // namespace wiola_emu

using namespace wiola_emu;  // NOLINT: CUDA's runtime names are global
