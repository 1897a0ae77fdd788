// Device plumbing shared by the torch bindings of the CUDA kernels (csrc/cuda/*_binding.cpp):
// with the real CUDA build, tensors live on the GPU and kernels go to the current stream;
// compiled with -DWIOLA_CUDA_EMU (csrc/cuda/emu/bindings_emu.cpp), the same bindings —
// the same argument checks — take CPU tensors and run the kernels in the SIMT emulator,
// registered as torch.ops.wiola_cuda_emu.* (the test backend cuda_emu).
#pragma once

#include <ATen/ops/from_blob.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include "wiola/dtype.h"
#include "wiola/empty_output.h"

#ifdef WIOLA_CUDA_EMU
#include "emu/runtime.h"

// A namespace of its own: a GPU build links both variants, whose inline functions must not
// share a symbol.
#define WIOLA_CUDA_BINDING_NS cuda_emu_binding
namespace wiola::cuda_emu_binding {
constexpr const char* kDevice = "CPU (cuda_emu)";
inline bool on_kernel_device(const at::Tensor& t) { return t.is_cpu(); }
struct DeviceGuard {
  explicit DeviceGuard(c10::Device) {}
};
inline cudaStream_t current_stream() { return nullptr; }

// Device memory of the emulated kernels (wiola_emu::device_alloc): every buffer a kernel
// gets ends at a guard page, so a kernel reading or writing past the end of a tensor faults
// as on the device instead of touching its neighbour in the host heap.
inline at::Tensor device_empty_strided(at::IntArrayRef sizes, at::IntArrayRef strides, const at::TensorOptions& options,
                                       size_t phase = 0) {
  int64_t span = 1;  // elements from the first to one past the last (strides are >= 0 in torch)
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) span = 0;
    if (span != 0) span += (sizes[i] - 1) * strides[i];
  }
  const size_t bytes = static_cast<size_t>(span) * options.dtype().itemsize();
  void* p = wiola_emu::device_alloc(bytes, phase);
  return at::from_blob(p, sizes, strides, [](void* q) { wiola_emu::device_free(q); }, options.device(at::kCPU));
}

// A kernel's input in device memory: a copy with the same strides (contiguous for an
// overlapping or sparse t) at an address with the same alignment (mod 16) as t's, so that a
// misaligned view stays misaligned for the kernel.
inline at::Tensor kernel_input(const at::Tensor& t) {
  const size_t phase = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % wiola_emu::kGuardAlign;
  at::Tensor d = t.is_non_overlapping_and_dense()
                     ? device_empty_strided(t.sizes(), t.strides(), t.options(), phase)
                     : device_empty_strided(t.sizes(), c10::contiguous_strides(t.sizes()), t.options(), phase);
  d.copy_(t);
  return d;
}

// Outputs and workspaces in device memory, which starts as 0xFF bytes (NaN, -1): an
// element a kernel skips is always visible (WIOLA_POISON_OUTPUTS or not).
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return device_empty_strided(sizes, c10::contiguous_strides(sizes), options);
}
inline at::Tensor empty_workspace(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return empty_output(sizes, options);
}
}  // namespace wiola::cuda_emu_binding

// The CPU key of torch.ops.wiola.* is the C++ CPU kernels': the emulated ones get a namespace.
#define WIOLA_CUDA_KERNELS_IMPL(m) TORCH_LIBRARY_IMPL(wiola_cuda_emu, CPU, m)
#else
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define WIOLA_CUDA_BINDING_NS cuda_binding
namespace wiola::cuda_binding {
constexpr const char* kDevice = "CUDA";
inline bool on_kernel_device(const at::Tensor& t) { return t.is_cuda(); }
using DeviceGuard = c10::cuda::CUDAGuard;
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

// The GPU's own memory: inputs as they are, outputs from the caching allocator.
inline const at::Tensor& kernel_input(const at::Tensor& t) { return t; }
using wiola::empty_output;
inline at::Tensor empty_workspace(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::empty(sizes, options);
}
}  // namespace wiola::cuda_binding

#define WIOLA_CUDA_KERNELS_IMPL(m) TORCH_LIBRARY_IMPL(wiola, CUDA, m)
#endif

// The checks every binding makes, once per variant (the namespaces above: a GPU build links
// both, and cudaGetErrorString differs between them).
namespace wiola::WIOLA_CUDA_BINDING_NS {

// The kernels' storage dtype of t; a TypeError naming `name` for any other dtype.
inline DType kernel_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, float16 or bfloat16 for the CUDA kernels, got ",
                       t.scalar_type());
  }
  return DType::kFloat32;
}

// Whether t's data can be read with vector accesses of `bytes` (its address a multiple of
// them); a ValueError naming `name` otherwise. The kernels read contiguous tensors with 8-
// and 16-byte vectors: a contiguous view at an element offset (x[1:]) would be a misaligned
// address on the device, which kills the CUDA context.
inline void check_aligned(const char* name, const at::Tensor& t, int64_t bytes) {
  const auto address = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  TORCH_CHECK_VALUE(address % static_cast<uintptr_t>(bytes) == 0, name, " must start at an address aligned to ", bytes,
                    " bytes for the CUDA kernels' vector loads, got one at ", address % static_cast<uintptr_t>(bytes),
                    " mod ", bytes, " (a view at an element offset? pass a copy)");
}

// A launcher's status: an error naming `what` unless cudaSuccess.
inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "wiola ", what, " launch failed: ", cudaGetErrorString(err));
}

}  // namespace wiola::WIOLA_CUDA_BINDING_NS
