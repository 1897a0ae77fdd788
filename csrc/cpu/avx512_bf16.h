// bf16 blocks on AVX-512 (isa.h), shared by the CPU kernels that have AVX-512 bf16 loops
// (rms_norm.cpp, add_rms_norm through it, glu.cpp). A block of 32 bf16 is read as 16 dwords:
// dword j holds elements 2j (low half) and 2j + 1 (high half), so one shift and one mask
// make the floats of the even and of the odd elements (no widening shuffle), and one
// AVX512-BF16 conversion plus one word permutation writes them back interleaved. Compiled
// with a function target attribute inside the x86-64-v3 build: call only from a kernel
// whose kernel_isa() is Isa::kAvx512Bf16.
#pragma once

#include "isa.h"

#if defined(WIOLA_HAVE_AVX512_TARGET)
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace wiola::cpu::avx512 {

using BF16 = at::BFloat16;

// Nearest even, NaN -> 0xffff: at::vec::cvtfp32_bf16's rounding, for the 16 floats of v.
WIOLA_TARGET_AVX512_BF16 inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0xffff));
  return _mm512_cvtepi32_epi16(r);
}

struct Split {
  __m512 even, odd;
};

WIOLA_TARGET_AVX512_BF16 inline Split load_bf16x32(const BF16* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xffff0000u))))};
}

// Rounds the even and odd floats of a block to bf16, the 32 interleaved.
// AVX512-BF16's conversion rounds to nearest even too, but flushes subnormals to zero and
// keeps NaN payloads: blocks holding those (fpclass: QNaN 0x01, subnormal 0x20, SNaN 0x80)
// take round_bf16, so every output is the one the AVX2 rows write for the same float.
WIOLA_TARGET_AVX512_BF16 inline __m512i pack_bf16x32(__m512 even, __m512 odd) {
  if (C10_UNLIKELY((_mm512_fpclass_ps_mask(even, 0xA1) | _mm512_fpclass_ps_mask(odd, 0xA1)) != 0)) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(round_bf16(even)),
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(round_bf16(odd)), 16));
  }
  // cvtne2ps puts `even` in words 0..15 and `odd` in 16..31; word 2j takes j, 2j+1 takes 16+j.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// Stores the 64 bytes of v at p (kStream: non-temporal; p at least 32-byte aligned).
template <bool kStream>
WIOLA_TARGET_AVX512_BF16 inline void store_packed(__m512i v, void* p) {
  if (kStream && reinterpret_cast<uintptr_t>(p) % 64 == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
  } else if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(v));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p) + 1, _mm512_extracti64x4_epi64(v, 1));
  } else {
    _mm512_storeu_si512(p, v);
  }
}

template <bool kStream>
WIOLA_TARGET_AVX512_BF16 inline void store_bf16x32(__m512 even, __m512 odd, BF16* p) {
  store_packed<kStream>(pack_bf16x32(even, odd), p);
}

}  // namespace wiola::cpu::avx512
#endif
