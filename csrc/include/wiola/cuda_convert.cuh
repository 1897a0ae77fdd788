// Conversions between the storage types of the CUDA kernels (float, half, bfloat16)
// and their float32 accumulators. Torch-free, shared by every csrc/cuda/*.cu.
#pragma once

#ifdef WIOLA_CUDA_EMU
#include "../../cuda/emu/cuda_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#endif

#include "wiola/dtype.h"

namespace wiola::cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Calls fn(scalar_t{}) with the storage type of `dtype` (float, __half, __nv_bfloat16)
// and returns its status; cudaErrorInvalidValue for a dtype without kernels.
template <typename Fn>
cudaError_t dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(float{});
    case DType::kFloat16:
      return fn(__half{});
    case DType::kBFloat16:
      return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace wiola::cuda
