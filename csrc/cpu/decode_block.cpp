// One Wiola block of a cached decoding step on the CPU, in one call (SPEC §2 with a KV cache).
//
// For x (B, 1, d) — one new position per row — and normed = WRMSNorm_ℓ(x), this runs what the
// model's decoding step runs for the block, in the same order and with the same kernels:
//   qkv = [W_Q | W_K | W_V] normed                          (wiola::_decode_gemv)
//   ctx = [W_Kc | W_Vc] context slots (W_Vc only for one)   (wiola::_decode_gemv)
//   o   = decode_attention(qkv, cache, ctx, gate)           (wiola::_decode_attention)
//   h', x' = add_rms_norm(W_O o, x, WRMSNorm'_ℓ)             (wiola::_decode_gemv, then here)
//   u   = [W_n1 | W_n3 | W_w1 | W_w3] h'; a = [SiLU-GLU(u_n) | GELU-GLU(u_w)]   (glu_math.h)
//   f   = lerp(W_w2 a_w, W_n2 a_n, σ(β))                   (one split-input GEMV, at::lerp)
//   y, x'' = add_rms_norm(f, x', next norm)  (or x'' = x' + f without one)
//   the running causal summary: S ← S + x'', s = S / (past + 1) in x's dtype (SPEC §5.1).
//
// The model's step (python/wiola/model.py) runs the same kernels in the same order, so the two
// are equal bit for bit: both norms are the add_rms_norm op's own rows (rms_norm_rows_forward,
// rms_norm.h: its rounding order and its overflow guard), and the blend is ATen's lerp and
// sigmoid, as the model's DSFF calls them (tests/test_model_decode.py,
// test_model_decode_step.py).
//
// Why: at batch 1 each of these is a few microseconds of arithmetic, yet through Python and
// ATen each cost 10–50 µs: the interpreter, the dispatcher, TensorIterator's setup, and — after
// every GEMV has streamed tens of MB of weights through the caches — the cold code and
// metadata of each op (a fifth of a wiola-360m bf16 step: docs/history.md).
// So the GEMVs (called directly, decode_kernels.h) and the attention (through the dispatcher)
// run their own kernels, and what lies between them — the two gated activations, the
// summary — is plain vectorised loops over the d-wide rows here, with the roundings of the
// model's Python step (each op's output rounded to the model's dtype; statistics in float32);
// the add-and-norms call the op's row code directly, without the dispatcher.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/lerp.h>
#include <ATen/ops/sigmoid.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common.h"
#include "decode_kernels.h"
#include "glu_math.h"
#include "rms_norm.h"

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
  const at::Tensor xc = x.contiguous();
  // h', x' = add_rms_norm(A, x, WRMSNorm'_ℓ): the op's rows
  auto [hf, x1, rstd1] = rms_norm_rows_forward(a, xc, ffn_norm_weight, ffn_norm_shift, ffn_norm_eps, false);
  const at::Tensor u = decode_gemv(hf, weights.slice(kN1, 4), false);  // [u_n1 | u_n3 | u_w1 | u_w3]
  const auto opts = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor act = empty_output({b, 1, n + w}, opts);
  const int64_t widest = std::max(d, std::max(n, w));
  float* z = scratch(0, widest).data();
  float* z2 = scratch(2, widest).data();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "decode_block", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_INTERNAL_ASSERT(false, "decode_block: float64 is not a decoding GEMV dtype");
    } else {
      for (int64_t r = 0; r < b; ++r) {
        const scalar_t* ur = u.const_data_ptr<scalar_t>() + r * u.stride(0);
        scalar_t* yr = act.mutable_data_ptr<scalar_t>() + r * (n + w);
        glu_span<GluActivation::kSilu>(ur, ur + n, yr, n, z, z2);
        glu_span<GluActivation::kGeluTanh>(ur + 2 * n, ur + 2 * n + w, yr + n, w, z, z2);
      }
    }
  });
  const at::Tensor down = decode_gemv(act, weights.slice(kN2, 2), true);  // [narrow | wide]
  // F = λ·narrow + (1 − λ)·wide as the model's DSFF computes it: lerp(wide, narrow, σ(β))
  const at::Tensor f = at::lerp(down.narrow(2, d, d), down.narrow(2, 0, d), at::sigmoid(beta));
  at::Tensor x2, y = at::empty({0}, opts);
  if (next_norm_weight.has_value()) {  // y, X'' = add_rms_norm(F, X', next norm): the op's rows
    auto [yn, s2, rstd2] = rms_norm_rows_forward(f, x1, *next_norm_weight, next_norm_shift, next_norm_eps, false);
    x2 = s2;
    y = yn;
  } else {
    x2 = at::add(x1, f).contiguous();  // X'' = X' + F, as the model adds them
  }
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
