// Vector (8- and 16-byte) global and shared memory accesses of csrc/cuda/*.cu, written once.
// Every reinterpret_cast of an element pointer to a wider type goes through vector_cast:
// on the device a misaligned vector access is cudaErrorMisalignedAddress (the context is
// lost); in the SIMT emulator (WIOLA_CUDA_EMU) vector_cast checks the address and makes
// the same mistake a device fault of the launch, where x86 would quietly load it.
#pragma once

#ifdef WIOLA_CUDA_EMU
#include "../../cuda/emu/cuda_emu.h"
#endif

#include <cstring>
#include <type_traits>

#include "wiola/cuda_convert.cuh"

namespace wiola::cuda {

// The bits of one element, in the low bits of a word.
__device__ __forceinline__ unsigned element_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned element_bits(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ unsigned element_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// kBytes of memory as one aligned object of 32-bit words.
template <int kBytes>
struct alignas(kBytes) Words {
  unsigned w[kBytes / 4];
};

// p as a V* (V const when p is): V's alignment must hold at p.
template <typename V, typename T>
__device__ __forceinline__ V* vector_cast(T* p) {
  static_assert(std::is_const_v<V> || !std::is_const_v<T>, "vector_cast would drop const");
  static_assert((alignof(V) & (alignof(V) - 1)) == 0 && alignof(V) >= sizeof(V), "V must be aligned to its size");
#ifdef WIOLA_CUDA_EMU
  wiola_emu::check_vector_alignment(p, alignof(V));
#endif
  return reinterpret_cast<V*>(p);
}

// One store of N elements (4, 8 or 16 bytes) at global dst, aligned to that size: a
// single st.global.v4/v2.u32 (STG.E.128 / STG.E.64). NVVM split a plain store of an
// aligned struct of elements, or of a uint4 built from them, into the elements' own stores
// in the GCLA kernels (4 × 16-bit for 8 bytes of bf16, 4 × 32-bit for 16 bytes of fp32),
// depending on the code around it; the PTX is therefore written out. (__stwb would do it
// too, but its st.global.wb becomes a STRONG.SM store.)
template <typename T, int N>
__device__ __forceinline__ void store_elements(T* dst, const T (&v)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "4-, 8- or 16-byte stores");
  unsigned w[kBytes / 4];
#pragma unroll
  for (int i = 0; i < kBytes / 4; ++i) {
    w[i] = 0u;
#pragma unroll
    for (int k = 0; k < kPerWord; ++k) w[i] |= element_bits(v[i * kPerWord + k]) << (16 * k);
  }
  unsigned* p = vector_cast<Words<kBytes>>(dst)->w;
#ifdef WIOLA_CUDA_EMU
  memcpy(p, w, kBytes);
#else
  if constexpr (kBytes == 16) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
  } else if constexpr (kBytes == 8) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(w[0]), "r"(w[1]) : "memory");
  } else {
    asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(w[0]) : "memory");
  }
#endif
}

// One load of N elements (4, 8 or 16 bytes) at src, aligned to that size (nvcc emits
// one LDG.E.64 / LDG.E.128 for these).
template <typename T, int N>
__device__ __forceinline__ void load_elements(const T* src, T (&v)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "4-, 8- or 16-byte loads");
  const Words<kBytes> w = *vector_cast<const Words<kBytes>>(src);
  memcpy(v, &w, kBytes);
}

}  // namespace wiola::cuda
