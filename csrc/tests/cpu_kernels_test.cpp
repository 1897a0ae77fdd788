// C++ unit tests of the CPU kernels, run by ctest. Each kernel is called through the
// dispatcher (as Python does) and compared with a naive double-precision loop written
// here, independently of the kernel code.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../cpu/isa.h"

namespace {

int failures = 0;
int passes = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s  %s\n", ok ? "PASS" : "FAIL", what.c_str());
  failures += !ok;
  passes += ok;
}

double rel_err(const at::Tensor& out, const at::Tensor& ref) {
  const at::Tensor o = out.to(at::kDouble), r = ref.to(at::kDouble);
  return (o - r).norm().item<double>() / std::max(r.norm().item<double>(), 1e-300);
}

template <typename Fn>
bool throws_value_error(Fn&& fn) {
  try {
    fn();
  } catch (const c10::ValueError&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

// Naive WiolaRMSNorm: y = w (x + s) / sqrt(mean((x + s)^2) + eps), row by row in double.
at::Tensor naive_rms_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, double eps) {
  const at::Tensor xd = x.to(at::kDouble).contiguous(), wd = w.to(at::kDouble), sd = s.to(at::kDouble);
  at::Tensor y = at::empty_like(xd);
  const int64_t rows = xd.size(0), d = xd.size(1);
  auto X = xd.accessor<double, 2>();
  auto Y = y.accessor<double, 2>();
  auto W = wd.accessor<double, 1>();
  auto S = sd.accessor<double, 1>();
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += (X[r][i] + S[i]) * (X[r][i] + S[i]);
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    for (int64_t i = 0; i < d; ++i) Y[r][i] = W[i] * (X[r][i] + S[i]) * inv;
  }
  return y;
}

void test_rms_norm() {
  auto fwd = op("wiola::rms_norm")
                 .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                           const std::optional<at::Tensor>&, double, bool)>();
  auto bwd = op("wiola::rms_norm_backward")
                 .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&,
                                                                       const std::optional<at::Tensor>&,
                                                                       const at::Tensor&)>();
  for (int64_t d : {1, 7, 64, 1000}) {
    for (int64_t rows : {1, 37}) {
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
        const at::Tensor x = at::randn({rows, d}).to(dtype), w = at::rand({d}).add(0.5), s = at::randn({d}).mul(0.3);
        auto [y, rstd] = fwd.call(x, w, s, 1e-6, false);
        const double tol = dtype == at::kBFloat16 ? 1e-2 : (dtype == at::kFloat ? 1e-5 : 1e-12);
        const double err = rel_err(y, naive_rms_norm(x, w, s, 1e-6));
        expect(err <= tol && y.scalar_type() == dtype,
               "rms_norm fwd rows=" + std::to_string(rows) + " d=" + std::to_string(d) + " " +
                   c10::toString(dtype) + " rel err " + std::to_string(err));
        // Backward: the directional derivative <g, dy> for a perturbation of x must
        // match <dx, v> (finite differences of the naive forward in double).
        if (dtype == at::kDouble) {
          const at::Tensor g = at::randn({rows, d}, at::kDouble), v = at::randn({rows, d}, at::kDouble);
          auto [dx, dw, ds] = bwd.call(g, x, w.to(at::kDouble), s.to(at::kDouble), rstd);
          const double h = 1e-6;
          const double fd = ((naive_rms_norm(x + h * v, w, s, 1e-6) - naive_rms_norm(x - h * v, w, s, 1e-6)) * g)
                                .sum().item<double>() / (2 * h);
          const double an = (dx * v).sum().item<double>();
          expect(std::abs(fd - an) <= 1e-6 * std::max(1.0, std::abs(fd)),
                 "rms_norm bwd dx (finite differences) d=" + std::to_string(d));
          const at::Tensor vs = at::randn({d}, at::kDouble);
          const double fds = ((naive_rms_norm(x, w, s + h * vs, 1e-6) - naive_rms_norm(x, w, s - h * vs, 1e-6)) * g)
                                 .sum().item<double>() / (2 * h);
          expect(std::abs(fds - (ds * vs).sum().item<double>()) <= 1e-6 * std::max(1.0, std::abs(fds)),
                 "rms_norm bwd dshift (finite differences) d=" + std::to_string(d));
          const double fdw = ((naive_rms_norm(x, w + h * vs, s, 1e-6) - naive_rms_norm(x, w - h * vs, s, 1e-6)) * g)
                                 .sum().item<double>() / (2 * h);
          expect(std::abs(fdw - (dw * vs).sum().item<double>()) <= 1e-6 * std::max(1.0, std::abs(fdw)),
                 "rms_norm bwd dweight (finite differences) d=" + std::to_string(d));
        }
      }
    }
  }
  expect(throws_value_error([&] { fwd.call(at::randn({4, 8}), at::ones({7}), at::zeros({8}), 1e-6, false); }),
         "rms_norm rejects a weight of the wrong size with ValueError");
  {  // any strides: a non-contiguous x is read through one copy, same values
    const at::Tensor x = at::randn({8, 4}), w = at::rand({4}).add(0.5), s = at::randn({4});
    auto [y, rstd] = fwd.call(x.t().contiguous().t(), w, s, 1e-6, false);
    expect(rel_err(y, naive_rms_norm(x, w, s, 1e-6)) <= 1e-5 && rstd.sizes() == at::IntArrayRef({8}),
           "rms_norm takes a non-contiguous x");
  }
  expect(throws_value_error([&] { fwd.call(at::randn({4, 0}), at::ones({0}), at::zeros({0}), 1e-6, false); }),
         "rms_norm rejects d = 0 with ValueError");
  expect(throws_value_error([&] { fwd.call(at::randn({4, 8}), at::ones({8}), at::zeros({8}), -1.0, false); }),
         "rms_norm rejects eps <= 0 with ValueError");

  // Huge rows: Σz² overflows float (float/bf16 inputs) or double (double inputs), so the
  // kernel rescales them. Oracle: the plain SPEC §3 formulas in long double, whose 15-bit
  // exponent holds Σz² of any finite double row (skipped where long double is double).
  // Rows 0, 1, 3 are huge (up to ~the dtype's maximum), row 2 normal, row 4 holds an inf.
  struct HugeCase {
    at::ScalarType dtype;
    double scale, tol;
  };
  const bool wide_long_double = std::numeric_limits<long double>::max_exponent >= 2 * 1024;
  for (const HugeCase& hc : {HugeCase{at::kFloat, 1e25, 1e-5}, HugeCase{at::kFloat, 1.1e38, 1e-5},
                             HugeCase{at::kBFloat16, 1e37, 1e-2}, HugeCase{at::kDouble, 1e200, 1e-12},
                             HugeCase{at::kDouble, 5e307, 1e-12}}) {
    if (hc.dtype == at::kDouble && !wide_long_double) continue;
    const int64_t rows = 5, d = 1003;  // d: vector loops and a scalar tail
    const auto acc = hc.dtype == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor xd = at::randn({rows, d}, at::kDouble).clamp(-3, 3) * hc.scale;
    xd[2].div_(hc.scale);
    xd[4][0] = std::numeric_limits<double>::infinity();
    const at::Tensor x = xd.to(hc.dtype), w = at::rand({d}, at::kDouble).add(0.5).to(acc),
                     s = at::randn({d}, at::kDouble).mul(0.3).to(acc), g = at::randn({rows, d}).to(hc.dtype);
    auto [y, rstd] = fwd.call(x, w, s, 1e-6, false);
    const at::Tensor x4 = x.narrow(0, 0, 4).contiguous(), g4 = g.narrow(0, 0, 4).contiguous();
    auto [dx, dw, ds] = bwd.call(g4, x4, w, s, rstd.narrow(0, 0, 4).contiguous());
    const at::Tensor Xt = x.to(at::kDouble), Gt = g.to(at::kDouble), Wt = w.to(at::kDouble), St = s.to(at::kDouble);
    auto X = Xt.accessor<double, 2>();
    auto G = Gt.accessor<double, 2>();
    auto W = Wt.accessor<double, 1>();
    auto S = St.accessor<double, 1>();
    // dx of a huge row is ~1/scale (subnormal near the maximum): compare it times the
    // row's scale, so the norms in rel_err stay normal.
    at::Tensor y_ref = at::empty({4, d}, at::kDouble), dx_ref = at::empty({4, d}, at::kDouble);
    std::vector<long double> dw_ref(d, 0), ds_ref(d, 0);
    bool rows_ok = true, rstd_ok = true;
    const double gtol = hc.dtype == at::kBFloat16 ? 1e-1 : hc.tol;  // bf16 grads sum many rounded terms
    for (int64_t r = 0; r < 4; ++r) {
      const double row_scale = r == 2 ? 1.0 : hc.scale;
      long double ss = 0, dot = 0;
      for (int64_t i = 0; i < d; ++i) {
        const long double z = (long double)X[r][i] + S[i];
        ss += z * z;
        dot += (long double)W[i] * G[r][i] * z;
      }
      const long double inv = 1.0L / std::sqrt(ss / d + 1e-6L);
      for (int64_t i = 0; i < d; ++i) {
        const long double z = (long double)X[r][i] + S[i];
        const long double dz = inv * ((long double)W[i] * G[r][i] - z * inv * inv * dot / d);
        y_ref[r][i] = double(W[i] * z * inv);
        dx_ref[r][i] = double(dz * row_scale);
        dw_ref[i] += G[r][i] * z * inv;
        ds_ref[i] += dz;
      }
      rows_ok = rows_ok && rel_err(y[r], y_ref[r]) <= hc.tol &&
                rel_err(dx[r].to(at::kDouble) * row_scale, dx_ref[r]) <= gtol;
      // rstd is subnormal once r > 2^126 (float) / 2^1022 (double), with ≥ 21 / 50 bits
      // left; the bound here is the statistic's summation error over d = 1003 terms.
      const long double rel = hc.dtype == at::kDouble ? 1e-14L : 4e-6L;
      rstd_ok = rstd_ok && std::abs(rstd[r].item<double>() - inv) <= rel * inv;
    }
    std::vector<double> dw_d(dw_ref.begin(), dw_ref.end()), ds_d(ds_ref.begin(), ds_ref.end());
    char scale_str[32];
    std::snprintf(scale_str, sizeof scale_str, "%g", hc.scale);
    const std::string what = std::string(c10::toString(hc.dtype)) + " scale " + scale_str;
    expect(rows_ok && rstd_ok, "rms_norm huge rows match the long double oracle (y, dx per row, rstd): " + what);
    expect(rel_err(dw, at::tensor(dw_d, at::kDouble)) <= gtol && rel_err(ds, at::tensor(ds_d, at::kDouble)) <= gtol,
           "rms_norm huge rows: dweight, dshift match the long double oracle: " + what);
    expect(!at::isfinite(y[4]).all().item<bool>() && at::isfinite(y.narrow(0, 0, 4)).all().item<bool>(),
           "rms_norm huge rows: the inf row is non-finite, the others finite: " + what);
  }
}


// ---- SRPE (SPEC §4) -----------------------------------------------------------------------

// Naive SRPE in double: pair (j, j + half) rotated by Θ = p·af_j and scaled by r = 1 + a·sin(p·rf_j);
// `transpose` rotates by −Θ (the backward); `scale` multiplies the output.
at::Tensor naive_srpe(const at::Tensor& x, const at::Tensor& pos, const std::vector<double>& af,
                      const std::vector<double>& rf, double amp, bool transpose, double scale = 1.0) {
  const at::Tensor xd = x.to(at::kDouble).contiguous();
  at::Tensor y = at::empty_like(xd);
  auto X = xd.accessor<double, 4>();
  auto Y = y.accessor<double, 4>();
  auto P = pos.accessor<int64_t, 2>();
  const int64_t half = xd.size(3) / 2;
  for (int64_t b = 0; b < xd.size(0); ++b)
    for (int64_t h = 0; h < xd.size(1); ++h)
      for (int64_t t = 0; t < xd.size(2); ++t)
        for (int64_t j = 0; j < half; ++j) {
          const double p = static_cast<double>(P[b][t]);
          const double r = scale * (1.0 + amp * std::sin(p * rf[j]));
          const double c = r * std::cos(p * af[j]), s = (transpose ? -r : r) * std::sin(p * af[j]);
          const double a = X[b][h][t][j], e = X[b][h][t][j + half];
          Y[b][h][t][j] = a * c - e * s;
          Y[b][h][t][j + half] = a * s + e * c;
        }
  return y;
}

void test_srpe() {
  using Fn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                                                double, double, const std::optional<at::Tensor>&, double);
  auto srpe_fwd = op("wiola::srpe").typed<Fn>();
  auto srpe_bwd = op("wiola::srpe_backward").typed<Fn>();  // applies R(p)ᵀ
  const double theta = 10000.0, k_s = 8.0, f_s = 0.01, amp = 0.1;
  for (int64_t dh : {2, 6, 16, 34}) {
    std::vector<double> af(dh / 2), rf(dh / 2);
    for (int64_t j = 0; j < dh / 2; ++j) {
      const double omega = std::pow(theta, -2.0 * j / dh);
      af[j] = omega * (1.0 + 1.0 / k_s);
      rf[j] = omega * f_s;
    }
    for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
      for (bool transpose : {false, true}) {
        const int64_t B = 2, H = 4, Hkv = 2, T = 19;
        const at::Tensor q = at::randn({B, H, T, dh}).to(dtype), k = at::randn({B, Hkv, T, dh}).to(dtype);
        const at::Tensor pos = at::randint(0, 1 << 20, {B, T}, at::kLong);
        auto [qo, ko] = (transpose ? srpe_bwd : srpe_fwd).call(q, k, pos, theta, k_s, amp, f_s, std::nullopt, 1.0);
        // SPEC §9: float64 is held to max(1e-12, 8·max|p·ω_0·(1 + 1/k_s)|·2^-52), the rounding
        // of the angle itself in any float64 evaluation (ω_0 = 1, positions below 2^20).
        const double tol64 = std::max(1e-12, 8.0 * std::ldexp(1.0, 20) * (1.0 + 1.0 / k_s) * std::ldexp(1.0, -52));
        const double tol = dtype == at::kBFloat16 ? 1e-2 : (dtype == at::kFloat ? 1e-5 : tol64);
        const double eq = rel_err(qo, naive_srpe(q, pos, af, rf, amp, transpose));
        const double ek = rel_err(ko, naive_srpe(k, pos, af, rf, amp, transpose));
        expect(eq <= tol && ek <= tol && qo.scalar_type() == dtype && ko.sizes() == k.sizes(),
               "srpe dh=" + std::to_string(dh) + " " + c10::toString(dtype) + (transpose ? " transpose" : "") +
                   " rel err q " + std::to_string(eq) + " k " + std::to_string(ek));
      }
    }
    // Given frequencies (a rope type's inv_freq, float32 here: read in float64) and an output scale.
    const at::Tensor inv_freq = at::rand({dh / 2}, at::kFloat) * 0.9 + 0.01;
    std::vector<double> gaf(dh / 2), grf(dh / 2);
    for (int64_t j = 0; j < dh / 2; ++j) {
      const double omega = static_cast<double>(inv_freq[j].item<float>());
      gaf[j] = omega * (1.0 + 1.0 / k_s);
      grf[j] = omega * f_s;
    }
    for (bool transpose : {false, true}) {
      const at::Tensor q = at::randn({2, 4, 7, dh}), k = at::randn({2, 2, 7, dh});
      const at::Tensor pos = at::randint(0, 1 << 20, {2, 7}, at::kLong);
      auto [qo, ko] = (transpose ? srpe_bwd : srpe_fwd).call(q, k, pos, theta, k_s, amp, f_s, inv_freq, 1.25);
      const double eq = rel_err(qo, naive_srpe(q, pos, gaf, grf, amp, transpose, 1.25));
      const double ek = rel_err(ko, naive_srpe(k, pos, gaf, grf, amp, transpose, 1.25));
      expect(eq <= 1e-5 && ek <= 1e-5, "srpe inv_freq dh=" + std::to_string(dh) + (transpose ? " transpose" : "") +
                                           " rel err q " + std::to_string(eq) + " k " + std::to_string(ek));
    }
  }
  expect(throws_value_error([&] {
           srpe_fwd.call(at::randn({1, 2, 3, 6}), at::randn({1, 2, 3, 6}), at::zeros({1, 3}, at::kLong), theta, k_s,
                         amp, f_s, at::ones({4}), 1.0);
         }),
         "srpe rejects inv_freq of the wrong length with ValueError");
  expect(throws_value_error([&] {
           srpe_fwd.call(at::randn({1, 2, 3, 5}), at::randn({1, 2, 3, 5}), at::zeros({1, 3}, at::kLong), theta, k_s,
                         amp, f_s, std::nullopt, 1.0);
         }),
         "srpe rejects an odd head dim with ValueError");
  expect(throws_value_error([&] {
           srpe_fwd.call(at::randn({1, 3, 3, 6}), at::randn({1, 2, 3, 6}), at::zeros({1, 3}, at::kLong), theta, k_s,
                         amp, f_s, std::nullopt, 1.0);
         }),
         "srpe rejects H not a multiple of H_kv with ValueError");
  expect(throws_value_error([&] {
           srpe_fwd.call(at::randn({1, 2, 3, 6}), at::randn({1, 2, 3, 6}), at::full({1, 3}, int64_t(1) << 40, at::kLong),
                         theta, k_s, amp, f_s, std::nullopt, 1.0);
         }),
         "srpe rejects positions beyond the accurate range with ValueError");
}

// ---- GCLA attention (SPEC §5.5) -----------------------------------------------------------

struct GclaInputs {
  at::Tensor q_rot, k_rot, v, q, kc, vc, gate;
  std::optional<at::Tensor> lengths;
};

// Naive GCLA in double: O_i = Σ_{j ≤ i, j < len} softmax(c q̃_i·k̃_j) v_j + σ(g_h) Σ_λ softmax_λ(c q_i·kc) vc,
// rows i ≥ len zero; also returns the self-attention lse (0 on rows past the length).
std::pair<at::Tensor, at::Tensor> naive_gcla(const GclaInputs& in) {
  auto D = [](const at::Tensor& t) { return t.to(at::kDouble).contiguous(); };
  const at::Tensor qr = D(in.q_rot), kr = D(in.k_rot), vv = D(in.v), qq = D(in.q), kc = D(in.kc), vc = D(in.vc),
                   g = D(in.gate);
  const int64_t B = qr.size(0), H = qr.size(1), T = qr.size(2), dh = qr.size(3), Hkv = kr.size(1);
  const int64_t S = kc.size(2), L = kc.size(3);
  const double c = 1.0 / std::sqrt(static_cast<double>(dh));
  at::Tensor out = at::zeros_like(qr), lse = at::zeros({B, H, T}, at::kDouble);
  auto Qr = qr.accessor<double, 4>(), Kr = kr.accessor<double, 4>(), V = vv.accessor<double, 4>(),
       Q = qq.accessor<double, 4>(), O = out.accessor<double, 4>();
  auto KC = kc.accessor<double, 5>(), VC = vc.accessor<double, 5>();
  auto G = g.accessor<double, 1>();
  auto LSE = lse.accessor<double, 3>();
  std::vector<double> s(std::max<int64_t>(T, L));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = in.lengths ? in.lengths->to(at::kLong)[b].item<int64_t>() : T;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t grp = h % Hkv;
      const double sig = 1.0 / (1.0 + std::exp(-G[h]));
      for (int64_t i = 0; i < std::min(T, len); ++i) {
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < dh; ++e) dot += Qr[b][h][i][e] * Kr[b][grp][j][e];
          s[j] = c * dot;
          m = std::max(m, s[j]);
        }
        double l = 0;
        for (int64_t j = 0; j <= i; ++j) l += std::exp(s[j] - m);
        LSE[b][h][i] = m + std::log(l);
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t e = 0; e < dh; ++e) O[b][h][i][e] += std::exp(s[j] - m) / l * V[b][grp][j][e];
        if (L == 0) continue;
        const int64_t si = S == 1 ? 0 : i;
        double mc = -INFINITY;
        for (int64_t a = 0; a < L; ++a) {
          double dot = 0;
          for (int64_t e = 0; e < dh; ++e) dot += Q[b][h][i][e] * KC[b][h][si][a][e];
          s[a] = c * dot;
          mc = std::max(mc, s[a]);
        }
        double lc = 0;
        for (int64_t a = 0; a < L; ++a) lc += std::exp(s[a] - mc);
        for (int64_t a = 0; a < L; ++a)
          for (int64_t e = 0; e < dh; ++e) O[b][h][i][e] += sig * std::exp(s[a] - mc) / lc * VC[b][h][si][a][e];
      }
    }
  }
  return {out, lse};
}

// Naive decoding attention of one new position per row (double): SRPE of q and k at pos,
// softmax over the cached keys and the new one, head h reading group h mod H_kv, plus the
// gated softmax over the context slots with the unrotated q. Returns (out (B, H·d_h), k̃ (B, H_kv, d_h)).
std::pair<at::Tensor, at::Tensor> naive_decode_attention(const at::Tensor& qkv, const at::Tensor& kc,
                                                         const at::Tensor& vc, int64_t past, const at::Tensor& pos,
                                                         int64_t H, const std::vector<double>& af,
                                                         const std::vector<double>& rf, double amp,
                                                         const at::Tensor& ck, const at::Tensor& cv,
                                                         const at::Tensor& gate) {
  const int64_t B = qkv.size(0), Hkv = kc.size(1), dh = kc.size(3), T = past + 1;
  const at::Tensor x = qkv.to(at::kDouble);
  const at::Tensor q = x.narrow(1, 0, H * dh).view({B, H, 1, dh});
  const at::Tensor k = x.narrow(1, H * dh, Hkv * dh).view({B, Hkv, 1, dh});
  const at::Tensor v = x.narrow(1, (H + Hkv) * dh, Hkv * dh).view({B, Hkv, 1, dh});
  const at::Tensor qr = naive_srpe(q, pos.view({B, 1}), af, rf, amp, false);
  const at::Tensor kr = naive_srpe(k, pos.view({B, 1}), af, rf, amp, false);
  const at::Tensor keys = at::cat({kc.narrow(2, 0, past).to(at::kDouble), kr}, 2);
  const at::Tensor values = at::cat({vc.narrow(2, 0, past).to(at::kDouble), v}, 2);
  at::Tensor out = at::zeros({B, H, dh}, at::kDouble);
  const int64_t slots = cv.defined() ? cv.size(1) : 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h % Hkv;
      std::vector<double> sc(T);
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < T; ++j) {
        sc[j] = (qr[b][h][0] * keys[b][g][j]).sum().item<double>() / std::sqrt(double(dh));
        m = std::max(m, sc[j]);
      }
      for (int64_t j = 0; j < T; ++j) sum += (sc[j] = std::exp(sc[j] - m));
      for (int64_t j = 0; j < T; ++j) out[b][h] += values[b][g][j] * (sc[j] / sum);
      if (slots == 0) continue;
      std::vector<double> a(slots);
      double ma = -INFINITY, sa = 0;
      for (int64_t l = 0; l < slots; ++l) {
        a[l] = (q[b][h][0] * ck[b][l].narrow(0, h * dh, dh).to(at::kDouble)).sum().item<double>() / std::sqrt(double(dh));
        ma = std::max(ma, a[l]);
      }
      for (int64_t l = 0; l < slots; ++l) sa += (a[l] = std::exp(a[l] - ma));
      const double sig = 1.0 / (1.0 + std::exp(-gate[h].item<double>()));
      for (int64_t l = 0; l < slots; ++l) out[b][h] += cv[b][l].narrow(0, h * dh, dh).to(at::kDouble) * (sig * a[l] / sa);
    }
  }
  return {out.view({B, H * dh}), kr.view({B, Hkv, dh})};
}

// The decoding GEMV on every path this CPU runs (generic, AVX2, AVX-512), float32/bf16/fp16,
// with row, column and vector tails: under AddressSanitizer a load past a weight row, x or the
// output fails here, not only a wrong number. Reference: x Wᵀ in double.
void test_decode_gemv() {
  auto gemv = op("wiola::_decode_gemv").typed<at::Tensor(const at::Tensor&, at::TensorList, bool)>();
  const int best = static_cast<int>(wiola::cpu::cpu_best_isa());
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    if (static_cast<int>(wiola::cpu::parse_isa(isa)) > best) continue;
    wiola::cpu::set_cpu_isa(isa);
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
      for (int64_t rows : {1, 3, 16}) {
        for (auto [n, k] : {std::pair<int64_t, int64_t>{1, 1}, {3, 7}, {17, 33}, {33, 100}, {130, 257}, {5, 1027}}) {
          const at::Tensor x = at::randn({rows, k}).to(dtype);
          // W whole (a read past its last row's end leaves the allocation), and W's rows as a
          // slice of wider rows (stride k + 5, not adjacent in memory).
          for (bool sliced : {false, true}) {
            const at::Tensor w = sliced ? at::randn({n, k + 5}).to(dtype).narrow(1, 2, k) : at::randn({n, k}).to(dtype);
            const at::Tensor out = gemv.call(x, {w}, false);
            const double e = rel_err(out, at::mm(x.to(at::kDouble), w.to(at::kDouble).t()));
            expect(e <= tol, std::string("decode_gemv ") + isa + " " + c10::toString(dtype) + " rows=" +
                                 std::to_string(rows) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                                 (sliced ? " sliced W" : "") + " rel err " + std::to_string(e));
          }
        }
        // Several weights: each reads all of x, or (split_input) its own columns of x.
        const at::Tensor w0 = at::randn({9, 40}).to(dtype), w1 = at::randn({20, 40}).to(dtype);
        const at::Tensor w2 = at::randn({7, 13}).to(dtype), w3 = at::randn({11, 27}).to(dtype);
        const at::Tensor x = at::randn({rows, 40}).to(dtype), xd = x.to(at::kDouble);
        const at::Tensor both = gemv.call(x, {w0, w1}, false);
        const at::Tensor split = gemv.call(x, {w2, w3}, true);
        const at::Tensor ref_both = at::cat({at::mm(xd, w0.to(at::kDouble).t()), at::mm(xd, w1.to(at::kDouble).t())}, 1);
        const at::Tensor ref_split = at::cat({at::mm(xd.narrow(1, 0, 13), w2.to(at::kDouble).t()),
                                              at::mm(xd.narrow(1, 13, 27), w3.to(at::kDouble).t())}, 1);
        const double e = std::max(rel_err(both, ref_both), rel_err(split, ref_split));
        expect(e <= tol, std::string("decode_gemv ") + isa + " " + c10::toString(dtype) + " rows=" +
                             std::to_string(rows) + " two weights, shared and split x: rel err " + std::to_string(e));
      }
    }
  }
  wiola::cpu::set_cpu_isa("auto");
  expect(throws_value_error([&] { gemv.call(at::randn({17, 8}), {at::randn({4, 8})}, false); }),
         "decode_gemv rejects 17 rows with ValueError");
  expect(throws_value_error([&] { gemv.call(at::randn({2, 8}), {at::randn({4, 7})}, false); }),
         "decode_gemv rejects a weight of another k with ValueError");
}

// Linear cross-entropy's loss, lse and gradients in double, written from SPEC §10.1: z = h Wᵀ
// (softcapped), ℓ = (1 − ε)(lse − z_y) + ε(lse − mean z) + ζ lse², 0 on ignored rows; dz the
// gradient of Σ g_i ℓ_i with respect to z; ∂h = dz W, ∂W = dzᵀ h.
struct LceRef {
  at::Tensor loss, lse, grad_h, grad_W;
};
LceRef naive_linear_cross_entropy(const at::Tensor& h, const at::Tensor& W, const at::Tensor& y, double eps,
                                  std::optional<double> cap, double zeta, const at::Tensor& g) {
  const at::Tensor hd = h.to(at::kDouble), Wd = W.to(at::kDouble);
  at::Tensor z = at::mm(hd, Wd.t());
  if (cap) z = *cap * at::tanh(z / *cap);
  const int64_t V = W.size(0);
  const at::Tensor lse = at::logsumexp(z, {1});
  const at::Tensor valid = y.ne(-100);
  const at::Tensor yc = at::where(valid, y, at::zeros_like(y));
  const at::Tensor zy = z.gather(1, yc.unsqueeze(1)).squeeze(1);
  at::Tensor loss = (1 - eps) * (lse - zy) + eps * (lse - z.mean({1})) + zeta * lse * lse;
  loss = at::where(valid, loss, at::zeros_like(loss));
  at::Tensor dz = at::softmax(z, 1) * (1 + 2 * zeta * lse).unsqueeze(1) - eps / V;
  dz.scatter_add_(1, yc.unsqueeze(1), at::full({h.size(0), 1}, -(1 - eps), dz.options()));
  if (cap) dz = dz * (1 - (z / *cap) * (z / *cap));
  dz = dz * (g.to(at::kDouble) * valid.to(at::kDouble)).unsqueeze(1);
  return {loss, lse, at::mm(dz, Wd), at::mm(dz.t(), hd)};
}

// Several chunks of rows (WIOLA_LCE_CHUNK_ROWS = 32 over 70 rows: 32 + 32 + 6) and a vocabulary
// that is no multiple of a block or a vector, ignored rows, and every option; float32, and
// bf16 on both of its paths (float32 GEMMs on widened operands below AVX512_BF16, bf16 GEMMs
// at it). The forward's gradients ("sum") and the backward's recomputation ("none", rows
// weighted) against the double loop above; ASan sees every chunk's and block's edges.
void test_linear_cross_entropy() {
  using Opt = std::optional<at::Tensor>;
  auto fwd = op("wiola::linear_cross_entropy")
                 .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, c10::string_view, double,
                     std::optional<double>, double, const Opt&, std::array<bool, 2>)>();
  auto bwd = op("wiola::linear_cross_entropy_backward")
                 .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const Opt&, const Opt&, const Opt&, int64_t, c10::string_view, double,
                             std::optional<double>, double, bool)>();
  setenv("WIOLA_LCE_CHUNK_ROWS", "32", 1);
  const int64_t n = 70, d = 24, V = 8300;
  const int best = static_cast<int>(wiola::cpu::cpu_best_isa());
  struct Case {
    at::ScalarType dtype;
    const char* isa;
  };
  for (const Case c : {Case{at::kFloat, "avx2"}, Case{at::kBFloat16, "avx2"}, Case{at::kBFloat16, "avx512_bf16"}}) {
    if (static_cast<int>(wiola::cpu::parse_isa(c.isa)) > best) continue;
    wiola::cpu::set_cpu_isa(c.isa);
    const double tol = c.dtype == at::kFloat ? 1e-4 : 1e-2;
    for (const bool options : {false, true}) {
      const double eps = options ? 0.1 : 0.0, zeta = options ? 1e-4 : 0.0;
      const std::optional<double> cap = options ? std::optional<double>(3.0) : std::nullopt;
      const at::Tensor h = at::randn({n, d}).to(c.dtype), W = (at::randn({V, d}) * 0.5).to(c.dtype);
      at::Tensor y = at::randint(0, V, {n}, at::kLong);
      y.index_put_({at::arange(0, n, 7)}, -100);
      y[1] = V - 1;  // the last column, in the vocabulary's tail
      const std::string name = std::string("linear_cross_entropy ") + c10::toString(c.dtype) + " " + c.isa +
                               (options ? " ε=0.1 softcap=3 ζ=1e-4" : "");
      // "sum" with the forward's gradients: those of Σ ℓ_i (g = 1).
      const auto [loss, lse, gh, gW] = fwd.call(h, W, y, -100, "sum", eps, cap, zeta, std::nullopt, {true, true});
      const LceRef r = naive_linear_cross_entropy(h, W, y, eps, cap, zeta, at::ones({n}, at::kDouble));
      const double e_loss = std::abs(loss.item<double>() - r.loss.sum().item<double>()) /
                            std::abs(r.loss.sum().item<double>());
      const at::Tensor valid = y.ne(-100);
      const double e_lse = rel_err(lse.masked_select(valid), r.lse.masked_select(valid));
      const double e_h = rel_err(gh, r.grad_h), e_W = rel_err(gW, r.grad_W);
      expect(e_loss <= tol && e_lse <= tol && e_h <= tol && e_W <= tol,
             name + " sum: rel err loss " + std::to_string(e_loss) + " lse " + std::to_string(e_lse) + " dh " +
                 std::to_string(e_h) + " dW " + std::to_string(e_W));
      // "none": the backward recomputes, rows weighted by grad_loss.
      const at::Tensor g = at::randn({n}, at::kFloat);
      const auto [rows_loss, lse_none, unused_h, unused_W] =
          fwd.call(h, W, y, -100, "none", eps, cap, zeta, std::nullopt, {false, false});
      at::Tensor bh = at::full({n, d}, std::nan(""), h.options()), bW = at::full({V, d}, std::nan(""), W.options());
      bwd.call(g, h, W, y, lse_none, std::nullopt, bh, bW, -100, "none", eps, cap, zeta, false);
      const LceRef rg = naive_linear_cross_entropy(h, W, y, eps, cap, zeta, g);
      const double e_rows = rel_err(rows_loss, r.loss), e_bh = rel_err(bh, rg.grad_h), e_bW = rel_err(bW, rg.grad_W);
      expect(e_rows <= tol && e_bh <= tol && e_bW <= tol,
             name + " none + backward: rel err loss " + std::to_string(e_rows) + " dh " + std::to_string(e_bh) +
                 " dW " + std::to_string(e_bW));
    }
  }
  wiola::cpu::set_cpu_isa("auto");
  unsetenv("WIOLA_LCE_CHUNK_ROWS");
  expect(throws_value_error([&] {
           fwd.call(at::randn({4, 8}), at::randn({10, 7}), at::zeros({4}, at::kLong), -100, "mean", 0.0, std::nullopt,
                    0.0, std::nullopt, {false, false});
         }),
         "linear_cross_entropy rejects W of another d with ValueError");
}

// The decoding attention through the dispatcher against the naive loop, at head sizes that are
// and are not multiples of the vector widths, group sizes that take every register path, and
// key counts around multiples of 8; under the sanitizer build any access past the cache rows,
// the scratch or the output faults.
void test_decode_attention() {
  using Opt = std::optional<at::Tensor>;
  auto attn = op("wiola::_decode_attention")
                  .typed<at::Tensor(const at::Tensor&, at::Tensor&, at::Tensor&, int64_t, const at::Tensor&, int64_t,
                                    double, double, double, double, const Opt&, const Opt&, const Opt&)>();
  const double theta = 10000.0, k_s = 8.0, f_s = 0.01, amp = 0.1;
  for (int64_t dh : {6, 24, 64}) {
    std::vector<double> af(dh / 2), rf(dh / 2);
    for (int64_t j = 0; j < dh / 2; ++j) {
      const double omega = std::pow(theta, -2.0 * j / dh);
      af[j] = omega * (1.0 + 1.0 / k_s);
      rf[j] = omega * f_s;
    }
    for (auto [H, Hkv] : {std::pair<int64_t, int64_t>{7, 1}, {6, 2}, {8, 2}}) {
      for (int64_t past : {0, 9, 40}) {
        for (auto dtype : {at::kFloat, at::kBFloat16}) {
          const int64_t B = 2, slots = 2;
          const at::Tensor qkv = at::randn({B, (H + 2 * Hkv) * dh}).to(dtype);
          at::Tensor kc = at::randn({B, Hkv, past + 1, dh}).to(dtype), vc = at::randn({B, Hkv, past + 1, dh}).to(dtype);
          const at::Tensor kc0 = kc.clone(), vc0 = vc.clone();
          const at::Tensor ck = at::randn({B, slots, H * dh}).to(dtype), cv = at::randn({B, slots, H * dh}).to(dtype);
          const at::Tensor gate = at::randn({H}).to(dtype), pos = at::randint(past, past + 100, {B}, at::kLong);
          const at::Tensor out = attn.call(qkv, kc, vc, past, pos, H, theta, k_s, amp, f_s, ck, cv, gate);
          auto [ref, kr] = naive_decode_attention(qkv, kc0, vc0, past, pos, H, af, rf, amp, ck, cv, gate);
          const double tol = dtype == at::kFloat ? 1e-4 : 1e-2;
          const double e = rel_err(out, ref), ek = rel_err(kc.select(2, past), kr);
          expect(e <= tol && ek <= tol && at::equal(kc.narrow(2, 0, past), kc0.narrow(2, 0, past)) &&
                     at::equal(vc.select(2, past), qkv.narrow(1, (H + Hkv) * dh, Hkv * dh).view({B, Hkv, dh})),
                 "decode_attention dh=" + std::to_string(dh) + " H=" + std::to_string(H) + "/" +
                     std::to_string(Hkv) + " past=" + std::to_string(past) + " " + c10::toString(dtype) +
                     " rel err " + std::to_string(e) + " key " + std::to_string(ek));
        }
      }
    }
  }
  at::Tensor kc = at::zeros({1, 2, 4, 8}), vc = at::zeros({1, 2, 4, 8});
  expect(throws_value_error([&] {
           attn.call(at::zeros({1, 64}), kc, vc, 4, at::zeros({1}, at::kLong), 4, theta, k_s, amp, f_s, std::nullopt,
                     std::nullopt, std::nullopt);
         }),
         "decode_attention rejects past = capacity with ValueError");
}

void test_gcla_attention() {
  using Fwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const std::optional<at::Tensor>&);
  using Bwd = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
      const at::Tensor&);
  auto fwd = op("wiola::gcla_attention").typed<Fwd>();
  auto bwd = op("wiola::gcla_attention_backward").typed<Bwd>();
  struct Case {
    int64_t B, H, Hkv, T, dh, S, L;
    bool with_lengths;
  };
  // T = 70 crosses a 64-row query block; S = 1 and S = T; Λ' = 0; lengths 0, partial, T.
  for (const Case& cs : {Case{2, 4, 2, 70, 16, 70, 3, true}, Case{1, 2, 1, 1, 6, 1, 2, false},
                         Case{3, 3, 3, 21, 10, 1, 0, true}, Case{2, 2, 1, 9, 8, 9, 1, false}}) {
    for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
      const auto mk = [&](std::initializer_list<int64_t> shape) { return at::randn(shape).to(dtype); };
      GclaInputs in{mk({cs.B, cs.H, cs.T, cs.dh}),          mk({cs.B, cs.Hkv, cs.T, cs.dh}),
                    mk({cs.B, cs.Hkv, cs.T, cs.dh}),        mk({cs.B, cs.H, cs.T, cs.dh}),
                    mk({cs.B, cs.H, cs.S, cs.L, cs.dh}),    mk({cs.B, cs.H, cs.S, cs.L, cs.dh}),
                    at::randn({cs.H}),                      std::nullopt};
      if (cs.with_lengths) {
        std::vector<int64_t> len(cs.B);
        for (int64_t b = 0; b < cs.B; ++b) len[b] = b == 0 ? cs.T : (b == 1 ? 0 : cs.T / 2 + 1);
        in.lengths = at::tensor(len, at::kLong);
      }
      auto [out, lse] = fwd.call(in.q_rot, in.k_rot, in.v, in.q, in.kc, in.vc, in.gate, in.lengths);
      auto [want, want_lse] = naive_gcla(in);
      const double tol = dtype == at::kBFloat16 ? 1e-2 : (dtype == at::kFloat ? 1e-4 : 1e-10);
      const double err = rel_err(out, want), err_lse = rel_err(lse, want_lse);
      const std::string name = "gcla B=" + std::to_string(cs.B) + " H=" + std::to_string(cs.H) + "/" +
                               std::to_string(cs.Hkv) + " T=" + std::to_string(cs.T) + " dh=" +
                               std::to_string(cs.dh) + " S=" + std::to_string(cs.S) + " L=" +
                               std::to_string(cs.L) + (cs.with_lengths ? " lengths " : " ") + c10::toString(dtype);
      expect(err <= tol && err_lse <= std::max(tol, 1e-5) && out.scalar_type() == dtype,
             name + " fwd rel err " + std::to_string(err) + " lse " + std::to_string(err_lse));
      if (dtype != at::kDouble) continue;
      // Backward: <dX, V> must equal the directional derivative of <G, naive(X)> along V,
      // for each of the seven differentiable inputs (central differences in double).
      const at::Tensor g = at::randn(out.sizes(), at::kDouble);
      auto grads = bwd.call(g, in.q_rot, in.k_rot, in.v, in.q, in.kc, in.vc, in.gate, in.lengths, out, lse);
      const std::vector<at::Tensor> dx = {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads),
                                          std::get<3>(grads), std::get<4>(grads), std::get<5>(grads),
                                          std::get<6>(grads)};
      const char* names[] = {"q_rot", "k_rot", "v", "q", "kc", "vc", "gate"};
      at::Tensor GclaInputs::*members[] = {&GclaInputs::q_rot, &GclaInputs::k_rot, &GclaInputs::v, &GclaInputs::q,
                                           &GclaInputs::kc,    &GclaInputs::vc,    &GclaInputs::gate};
      for (int a = 0; a < 7; ++a) {
        if ((in.*members[a]).numel() == 0) continue;
        const at::Tensor dir = at::randn((in.*members[a]).sizes(), at::kDouble);
        const double h = 1e-6;
        GclaInputs plus = in, minus = in;
        plus.*members[a] = in.*members[a] + h * dir;
        minus.*members[a] = in.*members[a] - h * dir;
        const double fd = ((naive_gcla(plus).first - naive_gcla(minus).first) * g).sum().item<double>() / (2 * h);
        const double an = (dx[a] * dir).sum().item<double>();
        expect(dx[a].sizes() == (in.*members[a]).sizes() && std::abs(fd - an) <= 1e-6 * std::max(1.0, std::abs(fd)),
               name + " bwd d" + names[a] + " (finite differences) " + std::to_string(an) + " vs " +
                   std::to_string(fd));
      }
    }
  }
  const auto r = [](std::initializer_list<int64_t> shape) { return at::randn(shape); };
  expect(throws_value_error([&] {
           fwd.call(r({1, 3, 4, 8}), r({1, 2, 4, 8}), r({1, 2, 4, 8}), r({1, 3, 4, 8}), r({1, 3, 1, 1, 8}),
                    r({1, 3, 1, 1, 8}), r({3}), std::nullopt);
         }),
         "gcla rejects H not a multiple of H_kv with ValueError");
  expect(throws_value_error([&] {
           fwd.call(r({1, 2, 4, 8}), r({1, 2, 4, 8}), r({1, 2, 4, 8}), r({1, 2, 4, 8}), r({1, 2, 3, 1, 8}),
                    r({1, 2, 3, 1, 8}), r({2}), std::nullopt);
         }),
         "gcla rejects summaries with S not in {1, T} with ValueError");
}

// ---- ATM (SPEC §6) ------------------------------------------------------------------------

// Naive greedy merge in double. Inputs are small integers so D = <x_t, x_t+1> and N = |x_t|²|x_t+1|²
// are exact; s = D / sqrt(N) > τ is decided exactly (τ ∈ {−0.5, 0, 0.5} is a binary fraction).
struct NaiveMerge {
  at::Tensor merged, positions, lengths, index_map;
};

bool cos_above(double D, double N, double tau) {
  if (N == 0) return 0.0 > tau;
  if (tau >= 0) return D > 0 && D * D > tau * tau * N;
  return D >= 0 || D * D < tau * tau * N;
}

NaiveMerge naive_merge(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& len, double tau) {
  const at::Tensor xd = x.to(at::kDouble).contiguous();
  const int64_t B = xd.size(0), T = xd.size(1), d = xd.size(2);
  NaiveMerge r{at::zeros_like(xd), at::zeros({B, T}, at::kLong), at::zeros({B}, at::kLong),
               at::zeros({B, T}, at::kLong)};
  auto X = xd.accessor<double, 3>();
  auto M = r.merged.accessor<double, 3>();
  auto P = pos.accessor<int64_t, 2>();
  auto MP = r.positions.accessor<int64_t, 2>();
  auto MAP = r.index_map.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = len[b].item<int64_t>();
    int64_t slot = 0, t = 0;
    while (t < n) {
      bool take = false;
      if (t + 1 < n) {
        double D = 0, n0 = 0, n1 = 0;
        for (int64_t e = 0; e < d; ++e) {
          D += X[b][t][e] * X[b][t + 1][e];
          n0 += X[b][t][e] * X[b][t][e];
          n1 += X[b][t + 1][e] * X[b][t + 1][e];
        }
        take = tau < 1 && cos_above(D, n0 * n1, tau);
      }
      MP[b][slot] = P[b][t];
      for (int64_t e = 0; e < d; ++e) M[b][slot][e] = take ? (X[b][t][e] + X[b][t + 1][e]) / 2 : X[b][t][e];
      MAP[b][t] = slot;
      if (take) MAP[b][t + 1] = slot;
      t += take ? 2 : 1;
      ++slot;
    }
    r.lengths[b] = slot;
    for (int64_t u = n; u < T; ++u) MAP[b][u] = slot + (u - n);
  }
  return r;
}

// Decisions at the edges of each dtype's range, against the unscaled pattern's decision:
// s_t > τ is homogeneous in each token, so scaling tokens by powers of two changes nothing.
void test_atm_extreme_magnitudes() {
  using Merge = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                           double, const std::optional<at::Tensor>&);
  auto merge = op("wiola::atm_merge").typed<Merge>();
  // Pattern (d = 3): t0 = t1 (merge), t2 ⟂ t1, t3 ∥ t2 (merge), t4 = −t3 (s = −1), t5 = t4 (merge).
  const std::vector<std::vector<double>> u = {{1.5, -1, 0.5}, {1.5, -1, 0.5}, {1, 1.5, 0},
                                              {2, 3, 0},      {-2, -3, 0},    {-2, -3, 0}};
  struct Scales {
    at::ScalarType dtype;
    std::vector<int> exps;  // per token: x_t = u_t · 2^exps[t]
  };
  for (const Scales& sc : {Scales{at::kFloat, {120, 120, -140, 120, -140, -140}},
                           Scales{at::kFloat, {-145, -145, -130, -60, 70, 70}},
                           Scales{at::kBFloat16, {120, -125, -125, 120, 0, -120}},
                           Scales{at::kDouble, {1000, 1000, -1070, 1000, -1070, -1070}},
                           Scales{at::kDouble, {-1060, -1060, 500, -500, 1020, 1020}}}) {
    for (const int64_t B : {int64_t{1}, int64_t{7}}) {  // phased and row-parallel paths
      at::Tensor xd = at::empty({B, 6, 3}, at::kDouble);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t t = 0; t < 6; ++t) {
          for (int64_t e = 0; e < 3; ++e) xd[b][t][e] = std::ldexp(u[t][e], sc.exps[t]);
        }
      }
      const at::Tensor x = xd.to(sc.dtype);
      const bool exact = at::equal(x.to(at::kDouble), xd);
      const at::Tensor pos = at::arange(6, at::kLong).expand({B, 6}).contiguous(), len = at::full({B}, 6, at::kLong);
      const std::string name = std::string("atm extreme magnitudes ") + c10::toString(sc.dtype) + " exps[0]=" +
                               std::to_string(sc.exps[0]) + " B=" + std::to_string(B);
      auto [merged, mpos, mlen, map] = merge.call(x, pos, 0.5, len);
      const at::Tensor want_map = at::tensor({0, 0, 1, 1, 2, 2}, at::kLong).expand({B, 6});
      const bool finite = at::isfinite(merged.to(at::kDouble)).all().item<bool>();
      expect(exact && at::equal(map, want_map) && finite, name + " tau=0.5 (pairs merge, s=-1 does not)");
      auto [m1, p1, l1, map1] = merge.call(x, pos, 1.0, len);
      expect(at::equal(l1, at::full({B}, 6, at::kLong)), name + " tau=1 never merges");
      auto [m2, p2, l2, map2] = merge.call(x, pos, -1.0, len);  // every edge but (t3, t4): s = −1
      const at::Tensor want_map2 = at::tensor({0, 0, 1, 1, 2, 2}, at::kLong).expand({B, 6});
      expect(at::equal(map2, want_map2), name + " tau=-1");
    }
  }
  // A NaN/Inf token never merges, even at τ = −1; a tiny τ keeps its sign (s = 0 > −5e-324).
  at::Tensor x = at::ones({1, 4, 3});
  x[0][1][2] = std::numeric_limits<float>::infinity();
  const at::Tensor pos = at::arange(4, at::kLong).unsqueeze(0), len = at::full({1}, 4, at::kLong);
  expect(at::equal(std::get<3>(merge.call(x, pos, -1.0, len)), at::tensor({0, 1, 2, 2}, at::kLong).unsqueeze(0)),
         "atm Inf token never merges at tau=-1");
  const at::Tensor orth = at::tensor({1.0, 0.0, 0.0, 1.0}, at::kDouble).reshape({1, 2, 2});
  const at::Tensor pos2 = at::arange(2, at::kLong).unsqueeze(0), len2 = at::full({1}, 2, at::kLong);
  expect(std::get<2>(merge.call(orth, pos2, -5e-324, len2)).item<int64_t>() == 1 &&
             std::get<2>(merge.call(orth, pos2, 5e-324, len2)).item<int64_t>() == 2,
         "atm tiny tau: s = 0 > -5e-324, not > 5e-324");
}

void test_atm() {
  using Merge = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                           double, const std::optional<at::Tensor>&);
  auto merge = op("wiola::atm_merge").typed<Merge>();
  auto merge_bwd = op("wiola::atm_merge_backward")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  auto unmerge = op("wiola::atm_unmerge").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  auto unmerge_bwd = op("wiola::atm_unmerge_backward").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  struct Case {
    int64_t B, T, d;
  };
  // B = 1 and B = 7 take the kernel's two merge paths (fewer rows than threads / row-parallel).
  for (const Case& cs : {Case{1, 1, 3}, Case{1, 40, 5}, Case{7, 33, 9}, Case{3, 2, 1}}) {
    for (double tau : {-1.0, -0.5, 0.0, 0.5, 1.0}) {
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
        // Few distinct small-integer rows, so many adjacent pairs are similar (and some are zero).
        const at::Tensor x = at::randint(-1, 2, {cs.B, cs.T, cs.d}).to(dtype);
        const at::Tensor pos = at::randint(0, 1000, {cs.B, cs.T}, at::kLong);
        const at::Tensor len = at::randint(0, cs.T + 1, {cs.B}, at::kLong);
        len[0] = cs.T;
        auto [merged, mpos, mlen, map] = merge.call(x, pos, tau, len);
        const NaiveMerge want = naive_merge(x, pos, len, tau);
        const std::string name = "atm B=" + std::to_string(cs.B) + " T=" + std::to_string(cs.T) + " d=" +
                                 std::to_string(cs.d) + " tau=" + std::to_string(tau) + " " + c10::toString(dtype);
        const bool same_decisions = at::equal(mlen, want.lengths) && at::equal(map, want.index_map) &&
                                    at::equal(mpos, want.positions);
        expect(same_decisions && merged.scalar_type() == dtype && at::equal(merged.to(at::kDouble), want.merged),
               name + " merge (lengths, map, positions, values exact)");
        if (!same_decisions) continue;
        // Merge backward: w_t · g[map(t)], w = 1/2 in a pair, 1 alone, 0 padding.
        const at::Tensor g = at::randn({cs.B, cs.T, cs.d}).to(dtype);
        const at::Tensor gd = g.to(at::kDouble);
        at::Tensor want_gx = at::zeros({cs.B, cs.T, cs.d}, at::kDouble);
        at::Tensor want_un = at::zeros({cs.B, cs.T, cs.d}, at::kDouble);
        at::Tensor want_gy = at::zeros({cs.B, cs.T, cs.d}, at::kDouble);
        auto MAP = want.index_map.accessor<int64_t, 2>();
        for (int64_t b = 0; b < cs.B; ++b) {
          const int64_t ml = want.lengths[b].item<int64_t>();
          for (int64_t t = 0; t < cs.T; ++t) {
            const int64_t s = MAP[b][t];
            const bool pair = (t > 0 && MAP[b][t - 1] == s) || (t + 1 < cs.T && MAP[b][t + 1] == s);
            const double w = s >= ml ? 0.0 : (pair ? 0.5 : 1.0);
            want_gx[b][t] = w * gd[b][s];
            want_un[b][t] = gd[b][s];
            want_gy[b][s] += gd[b][t];
          }
        }
        const double tol = dtype == at::kBFloat16 ? 1e-2 : (dtype == at::kFloat ? 1e-6 : 1e-14);
        const double e1 = rel_err(merge_bwd.call(g, map, mlen), want_gx);
        const double e2 = rel_err(unmerge.call(g, map), want_un);
        const double e3 = rel_err(unmerge_bwd.call(g, map), want_gy);
        expect(e1 <= tol && e2 <= tol && e3 <= tol, name + " merge_bwd/unmerge/unmerge_bwd rel err " +
                                                        std::to_string(e1) + " " + std::to_string(e2) + " " +
                                                        std::to_string(e3));
      }
    }
  }
  const at::Tensor x = at::randn({2, 5, 4});
  const at::Tensor pos = at::zeros({2, 5}, at::kLong), len = at::full({2}, 5, at::kLong);
  expect(throws_value_error([&] { merge.call(x, pos, 1.5, len); }), "atm_merge rejects threshold 1.5 with ValueError");
  expect(throws_value_error([&] { merge.call(x, pos, 0.5, at::full({2}, 6, at::kLong)); }),
         "atm_merge rejects lengths > T with ValueError");
  expect(throws_value_error([&] { unmerge.call(x, at::full({2, 5}, 5, at::kLong)); }),
         "atm_unmerge rejects an index_map value >= T with ValueError");
  expect(throws_value_error([&] { unmerge_bwd.call(x, at::full({2, 5}, -1, at::kLong)); }),
         "atm_unmerge_bwd rejects a negative index_map value with ValueError");
  test_atm_extreme_magnitudes();
}

}  // namespace

int main() {
  at::manual_seed(0);
  test_rms_norm();
  test_srpe();
  test_gcla_attention();
  test_decode_attention();
  test_decode_gemv();
  test_linear_cross_entropy();
  test_atm();
  std::printf("%d passed, %d failed\n", passes, failures);
  return failures == 0 ? 0 : 1;
}
