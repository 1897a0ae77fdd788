// The storage dtypes of the CUDA kernels, written once: the parameter structs of
// wiola/atm.h and wiola/gcla_attention.h carry one, the bindings fill it
// (csrc/cuda/binding_device.h, kernel_dtype) and the kernels dispatch on it
// (wiola/cuda_convert.cuh, dispatch_dtype). Torch- and CUDA-free.
#pragma once

namespace wiola {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace wiola
