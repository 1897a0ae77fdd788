// One Wiola block of a cached decoding step on the CPU, in one call (SPEC §2 with a KV cache).
//
// For x (B, 1, d) — one new position per row — and normed = WRMSNorm_ℓ(x), this runs what the
// model's decoding step runs for the block, in the same order and with the same kernels:
//   qkv = [W_Q | W_K | W_V] normed                          (wiola::_decode_gemv)
//   ctx = [W_Kc | W_Vc] context slots (W_Vc only for one)   (wiola::_decode_gemv)
//   o   = decode_attention(qkv, cache, ctx, gate)           (wiola::_decode_attention)
//   h', x' = add_rms_norm(W_O o, x, WRMSNorm'_ℓ)             (wiola::_decode_gemv, then here)
//   u   = [W_n1 | W_n3 | W_w1 | W_w3] h'; a = [SiLU-GLU(u_n) | GELU-GLU(u_w)]   (glu_math.h)
//   f   = σ(β)·(W_n2 a_n) + (1 − σ(β))·(W_w2 a_w)          (one split-input GEMV, then here)
//   y, x'' = add_rms_norm(f, x', next norm)  (or x'' = x' + f without one)
//   the running causal summary: S ← S + x'', s = S / (past + 1) in x's dtype (SPEC §5.1).
//
// Why: at batch 1 each of these is a few microseconds of arithmetic, yet through Python and
// ATen each cost 10–50 µs: the interpreter, the dispatcher, TensorIterator's setup, and — after
// every GEMV has streamed tens of MB of weights through the caches — the cold code and
// metadata of each op (a wiola-360m bf16 step spent ~1 ms a block there, ~20 % of the step).
// So the GEMVs (called directly, decode_kernels.h) and the attention (through the dispatcher)
// run their own kernels, and everything between them — both add-and-norms, the two gated
// activations, the DSFF blend, the summary — is plain vectorised loops over the d-wide rows
// here, with the roundings of the model's Python step (each op's output rounded to the model's
// dtype; statistics in float32): the two paths agree to rounding (tests/test_model_decode.py).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common.h"
#include "decode_kernels.h"
#include "glu_math.h"

namespace wiola::cpu {
namespace {

// Indices into the block's weight list (the order the Python caller passes them).
enum Weight : int { kQ, kK, kV, kO, kKc, kVc, kN1, kN3, kW1, kW3, kN2, kW2, kWeightCount };

using Opt = std::optional<at::Tensor>;

// Per-thread float scratch rows (slots 0–2), reused across calls: no allocation per block.
std::vector<float>& scratch(int k, int64_t n) {
  thread_local std::vector<float> rows[3];
  if (static_cast<int64_t>(rows[k].size()) < n) rows[k].resize(n);
  return rows[k];
}

using Vf = at::vec::Vectorized<float>;
using glu_math::GluActivation;

// A (d,) parameter as float32 (norm weights and shifts, β: the model's dtype).
float* as_float(const at::Tensor& t, std::vector<float>& buf) {
  const at::Tensor c = t.stride(0) == 1 ? t : t.contiguous();
  buf.resize(c.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.scalar_type(), "decode_block_param", [&] {
    const scalar_t* p = c.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < c.numel(); ++i) buf[i] = static_cast<float>(p[i]);
  });
  return buf.data();
}

// The residual add and WiolaRMSNorm of one d-wide row (SPEC §3, §10.3): s = a + x rounded to
// scalar_t (the residual stream), z = s + δ, y = γ ⊙ z / √(mean z² + ε) rounded (y skipped
// where null). Statistics in float32; `z` is d floats of scratch.
template <typename scalar_t>
void add_norm_row(const scalar_t* a, const scalar_t* x, scalar_t* s, scalar_t* y, const float* gamma,
                  const float* delta, float eps, int64_t d, float* z) {
  std::vector<float>& xa = scratch(1, d);
  load_row(a, z, d);
  load_row(x, xa.data(), d);
  for (int64_t i = 0; i < d; ++i) z[i] += xa[i];
  store_row(z, s, d);
  if (y == nullptr) return;
  load_row(s, z, d);  // the rounded sum is what the norm reads
  Vf acc(0.f);
  int64_t i = 0;
  for (; i + Vf::size() <= d; i += Vf::size()) {
    Vf v = Vf::loadu(z + i);
    if (delta != nullptr) v = v + Vf::loadu(delta + i);
    v.store(z + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sumsq = at::vec::vec_reduce_all<float>([](Vf& p, Vf& q) { return p + q; }, acc);
  for (; i < d; ++i) {
    if (delta != nullptr) z[i] += delta[i];
    sumsq += z[i] * z[i];
  }
  const float inv = 1.0f / std::sqrt(sumsq / static_cast<float>(d) + eps);
  for (i = 0; i < d; ++i) z[i] = gamma[i] * (z[i] * inv);
  store_row(z, y, d);
}

// y = act(a) ⊙ b over n elements, rounded to scalar_t (glu_math.h's arithmetic).
template <GluActivation kAct, typename scalar_t>
void glu_span(const scalar_t* a, const scalar_t* b, scalar_t* y, int64_t n, float* fa, float* fb) {
  load_row(a, fa, n);
  load_row(b, fb, n);
  int64_t i = 0;
  for (; i + Vf::size() <= n; i += Vf::size()) {
    glu_math::glu_vec<kAct, float>(Vf::loadu(fa + i), Vf::loadu(fb + i)).store(fa + i);
  }
  if (i < n) {
    const int64_t m = n - i;
    glu_math::glu_vec<kAct, float>(Vf::loadu(fa + i, m), Vf::loadu(fb + i, m)).store(fa + i, m);
  }
  store_row(fa, y, n);
}

at::Tensor attention(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, int64_t past,
                     const at::Tensor& position_ids, int64_t n_head, double theta, double spiral_divisor,
                     double radial_amplitude, double radial_frequency, const Opt& context_k, const Opt& context_v,
                     const Opt& gate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wiola::_decode_attention", "")
                       .typed<at::Tensor(const at::Tensor&, at::Tensor&, at::Tensor&, int64_t, const at::Tensor&,
                                         int64_t, double, double, double, double, const Opt&, const Opt&,
                                         const Opt&)>();
  return op.call(qkv, k_cache, v_cache, past, position_ids, n_head, theta, spiral_divisor, radial_amplitude,
                 radial_frequency, context_k, context_v, gate);
}

}  // namespace

// Returns (x'', y or an empty tensor without a next norm, S or empty, s or empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_block(
    const at::Tensor& x, const at::Tensor& normed, at::TensorList weights, const at::Tensor& ffn_norm_weight,
    const Opt& ffn_norm_shift, double ffn_norm_eps, const Opt& next_norm_weight, const Opt& next_norm_shift,
    double next_norm_eps, const at::Tensor& beta, const at::Tensor& gate, at::Tensor& k_cache, at::Tensor& v_cache,
    int64_t past, const at::Tensor& position_ids, int64_t n_head, double theta, double spiral_divisor,
    double radial_amplitude, double radial_frequency, const Opt& context, const Opt& summary_sum) {
  WIOLA_CHECK_ARG(weights.size() == kWeightCount, "weights must be [W_Q, W_K, W_V, W_O, W_Kc, W_Vc, W_n1, W_n3, W_w1, "
                  "W_w3, W_n2, W_w2] (", int(kWeightCount), " tensors), got ", weights.size());
  WIOLA_CHECK_ARG(x.dim() == 3 && x.size(1) == 1 && normed.sizes() == x.sizes(),
                  "x and normed must have shape (B, 1, d), got ", x.sizes(), " and ", normed.sizes());
  const int64_t b = x.size(0), d = x.size(2), hd = weights[kQ].size(0);
  TORCH_CHECK_TYPE(x.scalar_type() == normed.scalar_type() && x.scalar_type() == weights[kQ].scalar_type(),
                   "x, normed and the weights must share one dtype, got ", x.scalar_type(), ", ",
                   normed.scalar_type(), " and ", weights[kQ].scalar_type());
  const auto check_vector = [&](const char* name, const at::Tensor& t) {
    WIOLA_CHECK_ARG(t.dim() == 1 && t.size(0) == d && t.device().is_cpu(), name,
                    " must be a CPU tensor of shape (d = ", d, ",), got ", t.sizes(), " on ", t.device());
  };
  check_vector("ffn_norm_weight", ffn_norm_weight);
  if (ffn_norm_shift.has_value()) check_vector("ffn_norm_shift", *ffn_norm_shift);
  if (next_norm_weight.has_value()) check_vector("next_norm_weight", *next_norm_weight);
  if (next_norm_shift.has_value()) check_vector("next_norm_shift", *next_norm_shift);
  check_vector("beta", beta);
  WIOLA_CHECK_ARG(weights[kQ].size(0) == n_head * k_cache.size(3), "weights[0] (W_Q) must have n_head·d_h = ",
                  n_head * k_cache.size(3), " rows, got ", weights[kQ].size(0));

  // Attention: projections, the context slots' keys and values, the fused attention, W_O.
  const at::Tensor qkv = decode_gemv(normed, weights.slice(kQ, 3), false).view({b, -1});
  Opt context_k, context_v, gate_arg;
  if (context.has_value() && context->size(2) > 0) {
    WIOLA_CHECK_ARG(context->dim() == 4 && context->size(0) == b && context->size(1) == 1 && context->size(3) == d,
                    "context must have shape (B, 1, slots, d), got ", context->sizes());
    const int64_t n_ctx = context->size(2);
    const at::Tensor rows = context->reshape({b * n_ctx, d});
    if (n_ctx == 1) {  // one slot: softmax weight 1, no keys needed
      context_v = decode_gemv(rows, weights.slice(kVc, 1), false).view({b, 1, hd});
    } else {
      const at::Tensor kv = decode_gemv(rows, weights.slice(kKc, 2), false).view({b, n_ctx, 2 * hd});
      context_k = kv.narrow(2, 0, hd);
      context_v = kv.narrow(2, hd, hd);
    }
    gate_arg = gate;
  }
  const at::Tensor o = attention(qkv, k_cache, v_cache, past, position_ids, n_head, theta, spiral_divisor,
                                 radial_amplitude, radial_frequency, context_k, context_v, gate_arg);
  const at::Tensor a = decode_gemv(o.view({b, 1, hd}), weights.slice(kO, 1), false);
  const int64_t n = weights[kN1].size(0), w = weights[kW1].size(0);
  std::vector<float> gamma1, delta1, gamma2, delta2, beta_f;
  const float* g1 = as_float(ffn_norm_weight, gamma1);
  const float* d1 = ffn_norm_shift.has_value() ? as_float(*ffn_norm_shift, delta1) : nullptr;
  const bool has_next = next_norm_weight.has_value();
  const float* g2 = has_next ? as_float(*next_norm_weight, gamma2) : nullptr;
  const float* d2 = has_next && next_norm_shift.has_value() ? as_float(*next_norm_shift, delta2) : nullptr;
  // λ = σ(β) once per call, with the GLU's exp (glu_math.h)
  float* lam = as_float(beta, beta_f);
  {
    int64_t i = 0;
    for (; i + Vf::size() <= d; i += Vf::size()) {
      (Vf(1.0f) / glu_math::one_plus_exp_neg<float>(Vf::loadu(lam + i))).store(lam + i);
    }
    for (; i < d; ++i) lam[i] = 1.0f / (1.0f + std::exp(-lam[i]));
  }
  const auto opts = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor hf = empty_output(x.sizes(), opts), x1 = empty_output(x.sizes(), opts);
  at::Tensor act = empty_output({b, 1, n + w}, opts);
  at::Tensor x2 = empty_output(x.sizes(), opts), y = has_next ? empty_output(x.sizes(), opts) : at::empty({0}, opts);
  const at::Tensor xc = x.contiguous();
  const int64_t widest = std::max(d, std::max(n, w));
  float* z = scratch(0, widest).data();
  float* z2 = scratch(2, widest).data();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "decode_block", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_INTERNAL_ASSERT(false, "decode_block: float64 is not a decoding GEMV dtype");
    } else {
      const scalar_t* ap = a.const_data_ptr<scalar_t>();
      for (int64_t r = 0; r < b; ++r) {  // h', x' = add_rms_norm(A, x, WRMSNorm'_ℓ)
        add_norm_row(ap + r * d, xc.const_data_ptr<scalar_t>() + r * d, x1.mutable_data_ptr<scalar_t>() + r * d,
                     hf.mutable_data_ptr<scalar_t>() + r * d, g1, d1, static_cast<float>(ffn_norm_eps), d, z);
      }
      const at::Tensor u = decode_gemv(hf, weights.slice(kN1, 4), false);  // [u_n1 | u_n3 | u_w1 | u_w3]
      for (int64_t r = 0; r < b; ++r) {
        const scalar_t* ur = u.const_data_ptr<scalar_t>() + r * u.stride(0);
        scalar_t* yr = act.mutable_data_ptr<scalar_t>() + r * (n + w);
        glu_span<GluActivation::kSilu>(ur, ur + n, yr, n, z, z2);
        glu_span<GluActivation::kGeluTanh>(ur + 2 * n, ur + 2 * n + w, yr + n, w, z, z2);
      }
      const at::Tensor down = decode_gemv(act, weights.slice(kN2, 2), true);  // [narrow | wide]
      std::vector<scalar_t> f(d);
      for (int64_t r = 0; r < b; ++r) {
        // F = λ·narrow + (1 − λ)·wide, λ = σ(β), rounded; then X'' = X' + F and its next norm.
        const scalar_t* dr = down.const_data_ptr<scalar_t>() + r * down.stride(0);
        load_row(dr, z, d);
        load_row(dr + d, z2, d);
        for (int64_t i = 0; i < d; ++i) z[i] = z2[i] + lam[i] * (z[i] - z2[i]);
        store_row(z, f.data(), d);
        add_norm_row(f.data(), x1.const_data_ptr<scalar_t>() + r * d, x2.mutable_data_ptr<scalar_t>() + r * d,
                     has_next ? y.mutable_data_ptr<scalar_t>() + r * d : nullptr, g2, d2,
                     static_cast<float>(next_norm_eps), d, z);
      }
    }
  });
  at::Tensor sum_out = at::empty({0}, x.options().dtype(at::kFloat)), summary = at::empty({0}, x.options());
  if (summary_sum.has_value()) {  // WiolaCache.summary's one-step form: S + x'' in float32, then S / (past + 1)
    WIOLA_CHECK_ARG(summary_sum->scalar_type() == at::kFloat && summary_sum->sizes() == at::IntArrayRef({b, d}),
                    "summary_sum must be a float32 (B, d) tensor, got ", summary_sum->scalar_type(), " ",
                    summary_sum->sizes());
    sum_out = empty_output({b, d}, summary_sum->options());
    summary = empty_output({b, 1, d}, opts);
    const at::Tensor sc = summary_sum->contiguous();
    const float count = static_cast<float>(past + 1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "decode_block_summary", [&] {
      for (int64_t r = 0; r < b; ++r) {
        load_row(x2.const_data_ptr<scalar_t>() + r * d, z, d);
        const float* sr = sc.const_data_ptr<float>() + r * d;
        float* out = sum_out.mutable_data_ptr<float>() + r * d;
        for (int64_t i = 0; i < d; ++i) {
          out[i] = sr[i] + z[i];
          z[i] = out[i] / count;
        }
        store_row(z, summary.mutable_data_ptr<scalar_t>() + r * d, d);
      }
    });
  }
  return {x2, y, sum_out, summary};
}

TORCH_LIBRARY_IMPL(wiola, CPU, m) { m.impl("_decode_block", &decode_block); }

}  // namespace wiola::cpu
