// SRPE's rotation for one position (SPEC §4), shared by the SRPE kernel (srpe.cpp) and the
// decoding attention (decode_attention.cpp), so a cached decoding step rotates q and k with
// the same (c, s) table, bit for bit, as the op does: float64 angles reduced modulo π/2
// (Cody–Waite), fdlibm's sin/cos polynomials, then the rotation in the accumulation type.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common.h"

namespace wiola::cpu::srpe_rotation {

// Per-pair float64 frequencies for pairs j < d_h/2 (SPEC §4): angle ω_j (1 + 1/k_s), radial
// f_s ω_j, with ω_j = omega[j] when given (a rope type's inv_freq, float64), else
// θ^(−2j/d_h); k_s = ±inf gives the plain RoPE angle (1/±inf = 0). `padded`: the vectors'
// length, zero-filled past d_h/2 (position_table reads whole VD lanes).
inline void pair_frequencies(int64_t dh, double theta, double spiral_divisor, double radial_frequency,
                             int64_t padded, std::vector<double>& angle_freq, std::vector<double>& radial_freq,
                             const double* omega_given = nullptr) {
  angle_freq.assign(std::max(padded, dh / 2), 0.0);
  radial_freq.assign(std::max(padded, dh / 2), 0.0);
  const double stretch = 1.0 + 1.0 / spiral_divisor;
  for (int64_t j = 0; j < dh / 2; ++j) {
    const double omega = omega_given != nullptr
                             ? omega_given[j]
                             : std::pow(theta, static_cast<double>(j) * (-2.0 / static_cast<double>(dh)));
    angle_freq[j] = omega * stretch;
    radial_freq[j] = omega * radial_frequency;
  }
}

using VD = at::vec::Vectorized<double>;

// Vectorised double sin/cos of any finite x (four lanes with AVX2).
//
// Range reduction x = n·π/2 + r, |r| ≤ π/4 (Cody–Waite): n·pio2_hi is exact while
// |n| < 2^20 (pio2_hi has 33 significant bits), so r keeps ~1e-16 absolute accuracy for
// |x| up to ~1.6e6 (every position < 2^20 at the default frequencies); beyond that it
// degrades gracefully, like the rounding of p·freq itself. On [−π/4, π/4], fdlibm's
// minimax polynomials (error below ~1 ulp). Returns r, and q = n mod 4 ∈ {0, 1, 2, 3}.
inline VD reduce_pio2(const VD& x, VD& q) {
  const VD two_over_pi(0.63661977236758134308);
  const VD pio2_hi(1.57079632673412561417e+00);   // first 33 bits of π/2
  const VD pio2_lo(6.07710050650619224932e-11);   // π/2 − pio2_hi
  const VD n = (x * two_over_pi).round();          // nearest integer (ties to even)
  q = n - VD(4.0) * (n * VD(0.25)).floor();
  return at::vec::fmadd(n, -pio2_lo, at::vec::fmadd(n, -pio2_hi, x));
}

// sin r on |r| ≤ π/4: r + r³ (S1 + z (S2 + … + z S6)), z = r².
inline VD sin_kernel(const VD& r, const VD& z) {
  VD ps(1.58969099521155010221e-10);
  ps = at::vec::fmadd(ps, z, VD(-2.50507602534068634195e-08));
  ps = at::vec::fmadd(ps, z, VD(2.75573137070700676789e-06));
  ps = at::vec::fmadd(ps, z, VD(-1.98412698298579493134e-04));
  ps = at::vec::fmadd(ps, z, VD(8.33333333332248946124e-03));
  ps = at::vec::fmadd(ps, z, VD(-1.66666666666666324348e-01));
  return at::vec::fmadd(ps * z, r, r);
}

// cos r on |r| ≤ π/4: 1 − z/2 + z² (C1 + z (C2 + … + z C6)).
inline VD cos_kernel(const VD& z) {
  VD pc(-1.13596475577881948265e-11);
  pc = at::vec::fmadd(pc, z, VD(2.08757232129817482790e-09));
  pc = at::vec::fmadd(pc, z, VD(-2.75573143513906633035e-07));
  pc = at::vec::fmadd(pc, z, VD(2.48015872894767294178e-05));
  pc = at::vec::fmadd(pc, z, VD(-1.38888888888741095749e-03));
  pc = at::vec::fmadd(pc, z, VD(4.16666666666666019037e-02));
  return at::vec::fmadd(pc * z, z, at::vec::fmadd(z, VD(-0.5), VD(1.0)));
}

// By quadrant q:   q   sin  cos
//                  0   sr   cr
//                  1   cr  −sr
//                  2  −sr  −cr
//                  3  −cr   sr
inline void sincos_vec(const VD& x, VD& sin_out, VD& cos_out) {
  VD q;
  const VD r = reduce_pio2(x, q);
  const VD z = r * r;
  const VD sr = sin_kernel(r, z), cr = cos_kernel(z);
  const VD odd = (q == VD(1.0)) | (q == VD(3.0));
  const VD s0 = VD::blendv(sr, cr, odd);
  const VD c0 = VD::blendv(cr, sr, odd);
  sin_out = VD::blendv(s0, s0.neg(), q >= VD(2.0));
  cos_out = VD::blendv(c0, c0.neg(), (q == VD(1.0)) | (q == VD(2.0)));
}

inline VD sin_vec(const VD& x) {
  VD q;
  const VD r = reduce_pio2(x, q);
  const VD z = r * r;
  const VD odd = (q == VD(1.0)) | (q == VD(3.0));
  const VD s0 = VD::blendv(sin_kernel(r, z), cos_kernel(z), odd);
  return VD::blendv(s0, s0.neg(), q >= VD(2.0));
}

// (c, s) of one position for every pair, written as acc_t; frequencies padded to a
// multiple of VD::size() (the padding lanes are computed and dropped). `scale`: the output
// scale m (SPEC §4, a rope type's attention factor), folded into r in float64.
template <typename acc_t>
inline void position_table(double p, const double* angle_freq, const double* radial_freq, int64_t half,
                           int64_t half_padded, double amplitude, bool transpose, acc_t* c_out, acc_t* s_out,
                           double* scratch /* 2·half_padded */, double scale = 1.0) {
  double* cd = scratch;
  double* sd = scratch + half_padded;
  const VD vp(p), va(amplitude), vm(scale);
  for (int64_t j = 0; j < half_padded; j += VD::size()) {
    VD sin_t, cos_t;
    sincos_vec(vp * VD::loadu(angle_freq + j), sin_t, cos_t);
    // a_s = 0 (plain RoPE): r = m exactly, without the radial sine.
    const VD radius =
        amplitude == 0.0 ? vm : vm * at::vec::fmadd(va, sin_vec(vp * VD::loadu(radial_freq + j)), VD(1.0));
    (radius * cos_t).store(cd + j);
    (transpose ? (radius * sin_t).neg() : radius * sin_t).store(sd + j);
  }
  if constexpr (std::is_same_v<acc_t, double>) {
    std::copy(cd, cd + half, c_out);
    std::copy(sd, sd + half, s_out);
  } else {
    at::vec::convert(cd, c_out, half);
    at::vec::convert(sd, s_out, half);
  }
}

// out[j] = x1 c − x2 s, out[j + half] = x1 s + x2 c for one row (acc_t in and out).
template <typename acc_t, bool kStream = false>
inline void rotate_row(const acc_t* x, const acc_t* c, const acc_t* s, acc_t* out, int64_t half) {
  using V = at::vec::Vectorized<acc_t>;
  int64_t j = 0;
  for (; j + V::size() <= half; j += V::size()) {
    const V x1 = V::loadu(x + j), x2 = V::loadu(x + half + j);
    const V vc = V::loadu(c + j), vs = V::loadu(s + j);
    const V y1 = at::vec::fmsub(x1, vc, x2 * vs), y2 = at::vec::fmadd(x1, vs, x2 * vc);
    store_vec<kStream>(y1, out + j);
    store_vec<kStream>(y2, out + half + j);
  }
  for (; j < half; ++j) {
    const acc_t x1 = x[j], x2 = x[half + j];
    out[j] = x1 * c[j] - x2 * s[j];
    out[half + j] = x1 * s[j] + x2 * c[j];
  }
}

}  // namespace wiola::cpu::srpe_rotation
