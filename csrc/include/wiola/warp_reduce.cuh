// Warp reductions of csrc/cuda/*.cu, written once. A fixed xor butterfly over the full
// warp: the same order on every run (deterministic), the result in every lane. All 32
// lanes must call it (the SIMT emulator reports a lane that does not).
#pragma once

#ifdef WIOLA_CUDA_EMU
#include "../../cuda/emu/cuda_emu.h"
#endif

namespace wiola::cuda {

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o > v ? o : v;
  }
  return v;
}

}  // namespace wiola::cuda
