// Device plumbing shared by the torch bindings of the CUDA kernels (csrc/cuda/*_binding.cpp):
// with the real CUDA build, tensors live on the GPU and kernels go to the current stream;
// compiled with -DWIOLA_CUDA_EMU (csrc/cuda/emu/bindings_emu.cpp), the same bindings —
// the same argument checks — take CPU tensors and run the kernels in the SIMT emulator,
// registered as torch.ops.wiola_cuda_emu.* (the test backend cuda_emu).
#pragma once

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
}  // namespace wiola::cuda_binding

#define WIOLA_CUDA_KERNELS_IMPL(m) TORCH_LIBRARY_IMPL(wiola, CUDA, m)
#endif

// The checks every binding makes, once per variant (the namespaces above: a GPU build links
// both, and cudaGetErrorString differs between them).
namespace wiola::WIOLA_CUDA_BINDING_NS {

using wiola::empty_output;

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

// A launcher's status: an error naming `what` unless cudaSuccess.
inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "wiola ", what, " launch failed: ", cudaGetErrorString(err));
}

}  // namespace wiola::WIOLA_CUDA_BINDING_NS
