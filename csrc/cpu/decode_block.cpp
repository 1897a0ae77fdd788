// One Wiola block of a cached decoding step on the CPU, in one call (SPEC §2 with a KV cache).
//
// For x (B, 1, d) — one new position per row — and normed = WRMSNorm_ℓ(x), this runs what the
// model's decoding step runs for the block, in the same order and with the same kernels:
//   qkv = [W_Q | W_K | W_V] normed                          (wiola::_decode_gemv)
//   ctx = [W_Kc | W_Vc] context slots (W_Vc only for one)   (wiola::_decode_gemv)
//   o   = decode_attention(qkv, cache, ctx, gate)           (wiola::_decode_attention)
//   h', x' = add_rms_norm(W_O o, x, WRMSNorm'_ℓ)             (wiola::_decode_gemv, wiola::add_rms_norm)
//   u   = [W_n1 | W_n3 | W_w1 | W_w3] h'; a = [SiLU-GLU(u_n) | GELU-GLU(u_w)]   (wiola::glu)
//   f   = lerp(W_w2 a_w, W_n2 a_n, σ(β))                    (one split-input GEMV)
//   y, x'' = add_rms_norm(f, x', next norm)  (or x'' = x' + f without one)
//   the running causal summary: S ← S + x'', s = S / (past + 1) in x's dtype (SPEC §5.1).
//
// Why: at batch 1 each of these is a few microseconds of arithmetic, and through Python each
// cost ~10–30 µs of dispatch and interpreter time (a wiola-360m bf16 step spent ~1 ms a block
// there, ~20 % of the step). Called from C++ through the dispatcher the same kernels cost
// about a microsecond each. The arithmetic is the Python path's own (the same ops, in the same
// order, with the same roundings), so the two paths agree bit for bit.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace wiola::cpu {
namespace {

// Indices into the block's weight list (the order the Python caller passes them).
enum Weight : int { kQ, kK, kV, kO, kKc, kVc, kN1, kN3, kW1, kW3, kN2, kW2, kWeightCount };

using Opt = std::optional<at::Tensor>;

at::Tensor gemv(const at::Tensor& x, at::TensorList weights, bool split_input = false) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wiola::_decode_gemv", "")
                       .typed<at::Tensor(const at::Tensor&, at::TensorList, bool)>();
  return op.call(x, weights, split_input);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                            const at::Tensor& weight, const Opt& shift, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wiola::add_rms_norm", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                             const at::Tensor&, const Opt&, double,
                                                                             bool)>();
  return op.call(x, residual, weight, shift, eps, false);
}

at::Tensor glu(const at::Tensor& ab, c10::string_view activation) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wiola::glu", "")
                       .typed<at::Tensor(const at::Tensor&, const Opt&, c10::string_view)>();
  return op.call(ab, std::nullopt, activation);
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
  WIOLA_CHECK_ARG(weights[kQ].size(0) == n_head * k_cache.size(3), "weights[0] (W_Q) must have n_head·d_h = ",
                  n_head * k_cache.size(3), " rows, got ", weights[kQ].size(0));

  // Attention: projections, the context slots' keys and values, the fused attention, W_O.
  const at::Tensor qkv = gemv(normed, weights.slice(kQ, 3)).view({b, -1});
  Opt context_k, context_v, gate_arg;
  if (context.has_value() && context->size(2) > 0) {
    WIOLA_CHECK_ARG(context->dim() == 4 && context->size(0) == b && context->size(1) == 1 && context->size(3) == d,
                    "context must have shape (B, 1, slots, d), got ", context->sizes());
    const int64_t n_ctx = context->size(2);
    const at::Tensor rows = context->reshape({b * n_ctx, d});
    if (n_ctx == 1) {  // one slot: softmax weight 1, no keys needed
      context_v = gemv(rows, weights.slice(kVc, 1)).view({b, 1, hd});
    } else {
      const at::Tensor kv = gemv(rows, weights.slice(kKc, 2)).view({b, n_ctx, 2 * hd});
      context_k = kv.narrow(2, 0, hd);
      context_v = kv.narrow(2, hd, hd);
    }
    gate_arg = gate;
  }
  const at::Tensor o = attention(qkv, k_cache, v_cache, past, position_ids, n_head, theta, spiral_divisor,
                                 radial_amplitude, radial_frequency, context_k, context_v, gate_arg);
  const at::Tensor a = gemv(o.view({b, 1, hd}), weights.slice(kO, 1));
  auto [hf, x1, rstd1] = add_rms_norm(a, x, ffn_norm_weight, ffn_norm_shift, ffn_norm_eps);

  // DSFF: one up product, the two streams' gated activations, one split-input down product.
  const int64_t n = weights[kN1].size(0), w = weights[kW1].size(0);
  const at::Tensor u = gemv(hf, weights.slice(kN1, 4));
  const at::Tensor act = at::cat({glu(u.narrow(-1, 0, 2 * n), "silu"), glu(u.narrow(-1, 2 * n, 2 * w), "gelu_tanh")},
                                 -1);
  const at::Tensor down = gemv(act, weights.slice(kN2, 2), true);
  const at::Tensor f = at::lerp(down.narrow(-1, d, d), down.narrow(-1, 0, d), at::sigmoid(beta));  // λ·narrow + (1−λ)·wide

  at::Tensor x2, y;
  if (next_norm_weight.has_value()) {
    auto [y2, s2, rstd2] = add_rms_norm(f, x1, *next_norm_weight, next_norm_shift, next_norm_eps);
    x2 = s2;
    y = y2;
  } else {
    x2 = x1 + f;
    y = at::empty({0}, x.options());
  }
  at::Tensor sum_out = at::empty({0}, x.options().dtype(at::kFloat)), summary = at::empty({0}, x.options());
  if (summary_sum.has_value()) {  // WiolaCache.summary's one-step form: S + x'' in float32, then S / (past + 1)
    sum_out = *summary_sum + x2.select(1, 0).to(summary_sum->scalar_type());
    summary = (sum_out.unsqueeze(1) / static_cast<double>(past + 1)).to(x.scalar_type());
  }
  return {x2, y, sum_out, summary};
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CPU, m) { m.impl("_decode_block", &decode_block); }

}  // namespace wiola::cpu
