// The gated activations' vector arithmetic (SPEC §10.2), shared by the GLU kernel (glu.cpp)
// and the decoding block (decode_block.cpp), so both compute act(a) ⊙ b the same way: both
// activations as a·σ(h(a)), σ from a low-instruction exp, a clamped so nothing overflows
// (glu.cpp's header comment has the derivation).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "wiola/checks.h"

namespace wiola::cpu::glu_math {

using checks::GluActivation;

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

constexpr double kGeluK = 0.7978845608028654;  // √(2/π)
constexpr double kGeluC = 0.044715;

// h(a), h'(a) and the clamp T of one activation in the accumulation dtype acc_t.
template <GluActivation kAct, typename acc_t>
struct Gate {
  using V = Vec<acc_t>;
  // T with σ(h(T)) = 1 and σ(h(−T)) = 0 exactly in acc_t: 1 + e^{−h(T)} rounds to 1, and
  // e^{−h(−T)} overflows to inf (float: with the clamp of one_plus_exp_neg, at its 2^128).
  static constexpr acc_t kClamp = kAct == GluActivation::kSilu ? (std::is_same_v<acc_t, float> ? 89 : 710)
                                                               : (std::is_same_v<acc_t, float> ? 10.125 : 21.5);
  static V h(const V& a) {
    if constexpr (kAct == GluActivation::kSilu) {
      return a;
    } else {
      return a * at::vec::fmadd(a * a, V(acc_t(2 * kGeluK * kGeluC)), V(acc_t(2 * kGeluK)));
    }
  }
  static V dh(const V& a) {
    if constexpr (kAct == GluActivation::kSilu) {
      return V(acc_t(1));
    } else {
      return at::vec::fmadd(a * a, V(acc_t(6 * kGeluK * kGeluC)), V(acc_t(2 * kGeluK)));
    }
  }
};

// 1 + e^{−h}, the denominator of σ(h). float on AVX2: e^x with x = −h clamped to [−87, 89],
// x = n·ln2 + r (n by the 1.5·2^23 shifter, ln2 in two parts), e^r ≈ 1 + r + r²·P(r) with a
// cubic P fitted for the least maximum relative error on |r| ≤ ln2/2 (1.8e-7 evaluated in
// float), 2^n from n's bits; 2^n is a normal number or, at n = 128 (x ≳ 88.4, where σ is 0 to
// float precision anyway), +inf. Elsewhere at::vec's exp.
template <typename acc_t>
inline Vec<acc_t> one_plus_exp_neg(const Vec<acc_t>& h) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m256 hc = _mm256_max_ps(_mm256_min_ps(h, _mm256_set1_ps(87.0f)), _mm256_set1_ps(-89.0f));
    const __m256 shifter = _mm256_set1_ps(12582912.0f + 127.0f);  // 1.5·2^23, plus the exponent bias
    const __m256 t = _mm256_fnmadd_ps(hc, _mm256_set1_ps(1.44269504088896341f), shifter);  // n + bias in the low bits
    const __m256 n = _mm256_sub_ps(t, shifter);
    __m256 r = _mm256_fnmsub_ps(n, _mm256_set1_ps(0.693359375f), hc);  // −h − n·ln2, ln2 in two parts
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(8.3125262e-3f), r, _mm256_set1_ps(4.1890115e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6667114e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.9999231e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));  // e^r
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));  // 2^n
    return _mm256_fmadd_ps(p, scale, _mm256_set1_ps(1.0f));
  }
#endif
  return Vec<acc_t>(acc_t(1)) + (Vec<acc_t>(acc_t(0)) - h).exp();
}

// a with values below −T (−inf included) replaced by −T, and `both`: that clamped above at
// T too. NaN stays NaN: x86's max/min return their second operand when one is NaN.
template <typename acc_t>
struct Clamped {
  Vec<acc_t> low, both;
};

template <typename acc_t>
inline Clamped<acc_t> clamp(const Vec<acc_t>& a, acc_t t) {
  using V = Vec<acc_t>;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m256 lo = _mm256_max_ps(_mm256_set1_ps(-t), a);
    return {lo, _mm256_min_ps(_mm256_set1_ps(t), lo)};
  } else {
    const __m256d lo = _mm256_max_pd(_mm256_set1_pd(-t), a);
    return {lo, _mm256_min_pd(_mm256_set1_pd(t), lo)};
  }
#endif
  const V lo = V::blendv(a, V(-t), a < V(-t));
  return {lo, V::blendv(lo, V(t), lo > V(t))};
}

// y = a·b/(1 + e^{−h(a)}): the division last, off the critical path of a·b (and one multiply
// fewer than a·b·σ).
template <GluActivation kAct, typename acc_t>
inline Vec<acc_t> glu_vec(const Vec<acc_t>& a, const Vec<acc_t>& b) {
  const Clamped<acc_t> c = clamp(a, Gate<kAct, acc_t>::kClamp);
  return c.low * b / one_plus_exp_neg<acc_t>(Gate<kAct, acc_t>::h(c.both));
}

}  // namespace wiola::cpu::glu_math
