// A whole cached decoding step of a Wiola model on the CPU, in one call (SPEC §2, §5.1, §8).
//
// For input_ids (B, 1) — one new token per row, no padding — this runs what the model's forward
// runs for a decoding step, in the same order and with the same kernels:
//   x = E[input_ids];  normed = WRMSNorm_0(x)                    (wiola::rms_norm)
//   for each layer ℓ:  the block (wiola::_decode_block) with the context slots
//       C = stack(the last Λ' layers' causal summaries), the next norm WRMSNorm_ℓ₊₁ (the final
//       norm after the last layer), the layer's running summary sum
//   logits = W_head · normed (the tied head: W_head = E)          (wiola::_decode_gemv)
// The blocks write their new keys and values into the cache buffers at index `past`.
//
// Why one call: between the blocks the model's Python (the loop, the context stack, the cache
// bookkeeping, each block's argument list) ran cold after every block had streamed ~40 MB of
// weights through the caches — a tenth of a wiola-360m bf16 step (docs/history.md).
// Every kernel here is the one the Python step calls (the block and the GEMV directly,
// decode_kernels.h), so the two paths agree bit for bit (tests/test_model_decode_step.py).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"
#include "decode_kernels.h"

namespace wiola::cpu {
namespace {

using Opt = std::optional<at::Tensor>;
constexpr int64_t kBlockWeights = 12;  // decode_block's weight list, per layer

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, const Opt& shift, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wiola::rms_norm", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const Opt&,
                                                                 double, bool)>();
  return std::get<0>(op.call(x, weight, shift, eps, false));
}

// Returns (logits (B, 1, V), the layers' new running summary sums — one per entry of summary_sums).
std::tuple<at::Tensor, std::vector<at::Tensor>> decode_step(
    const at::Tensor& input_ids, const at::Tensor& embed_weight, at::TensorList weights, at::TensorList norm_weights,
    const c10::List<std::optional<at::Tensor>>& norm_shifts, at::ArrayRef<double> norm_eps, at::TensorList betas,
    at::TensorList gates, at::TensorList k_caches, at::TensorList v_caches, int64_t past,
    const at::Tensor& position_ids, int64_t n_head, double theta, double spiral_divisor, double radial_amplitude,
    double radial_frequency, int64_t lookback, at::TensorList summary_sums, const at::Tensor& head_weight) {
  const int64_t layers = static_cast<int64_t>(betas.size());
  WIOLA_CHECK_ARG(layers >= 1, "betas must hold one (d,) tensor per layer, got none");
  WIOLA_CHECK_ARG(static_cast<int64_t>(weights.size()) == kBlockWeights * layers, "weights must hold ",
                  kBlockWeights, " matrices per layer (", kBlockWeights * layers, " for ", layers, " layers), got ",
                  weights.size());
  const int64_t norms = 2 * layers + 1;  // WRMSNorm_ℓ, WRMSNorm'_ℓ per layer, then the final norm
  WIOLA_CHECK_ARG(static_cast<int64_t>(norm_weights.size()) == norms &&
                      static_cast<int64_t>(norm_shifts.size()) == norms &&
                      static_cast<int64_t>(norm_eps.size()) == norms,
                  "norm_weights, norm_shifts and norm_eps must hold 2·layers + 1 = ", norms, " entries, got ",
                  norm_weights.size(), ", ", norm_shifts.size(), " and ", norm_eps.size());
  WIOLA_CHECK_ARG(static_cast<int64_t>(gates.size()) == layers && static_cast<int64_t>(k_caches.size()) == layers &&
                      static_cast<int64_t>(v_caches.size()) == layers,
                  "gates, k_caches and v_caches must hold one tensor per layer (", layers, "), got ", gates.size(),
                  ", ", k_caches.size(), " and ", v_caches.size());
  WIOLA_CHECK_ARG(lookback >= 0, "lookback must be >= 0, got ", lookback);
  const int64_t summed = lookback > 0 ? layers - 1 : 0;  // the last layer's summary is never read
  WIOLA_CHECK_ARG(static_cast<int64_t>(summary_sums.size()) == summed, "summary_sums must hold ", summed,
                  " tensors (one per layer but the last with lookback > 0, none without), got ",
                  summary_sums.size());
  TORCH_CHECK_TYPE(input_ids.scalar_type() == at::kLong, "input_ids must be int64, got ", input_ids.scalar_type());
  WIOLA_CHECK_ARG(input_ids.dim() == 2 && input_ids.size(1) == 1 && input_ids.size(0) >= 1 && input_ids.is_cpu(),
                  "input_ids must be a CPU (B, 1) tensor, got ", input_ids.sizes(), " on ", input_ids.device());
  WIOLA_CHECK_ARG(embed_weight.dim() == 2 && embed_weight.is_cpu(), "embed_weight must be a CPU (V, d) tensor, got ",
                  embed_weight.sizes(), " on ", embed_weight.device());
  const int64_t vocab = embed_weight.size(0), b = input_ids.size(0), d = embed_weight.size(1);
  const at::Tensor ids = input_ids.contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const auto [lo, hi] = std::minmax_element(id, id + b);
  WIOLA_CHECK_ARG(*lo >= 0 && *hi < vocab, "input_ids must lie in [0, vocab_size) = [0, ", vocab,
                  "), got values in [", *lo, ", ", *hi, "]");  // the model's own message

  at::Tensor x = embed_weight.index_select(0, ids.view({b})).view({b, 1, d});  // X⁰
  at::Tensor normed = rms_norm(x, norm_weights[0], norm_shifts.get(0), norm_eps[0]);
  std::vector<at::Tensor> summaries;  // the last Λ' layers' causal summaries (B, 1, d), oldest first
  std::vector<at::Tensor> new_sums(summed);
  for (int64_t l = 0; l < layers; ++l) {
    Opt context;
    if (!summaries.empty()) context = at::stack(summaries, 2);  // (B, 1, Λ', d)
    const int64_t ffn = 2 * l + 1, next = 2 * l + 2;  // next: WRMSNorm_ℓ₊₁, or the final norm
    const Opt sum = l < summed ? Opt(summary_sums[l]) : std::nullopt;
    at::Tensor k = k_caches[l], v = v_caches[l];
    auto [out, y, s, summary] =
        decode_block(x, normed, weights.slice(kBlockWeights * l, kBlockWeights), norm_weights[ffn], norm_shifts.get(ffn),
              norm_eps[ffn], norm_weights[next], norm_shifts.get(next), norm_eps[next], betas[l], gates[l], k, v,
              past, position_ids, n_head, theta, spiral_divisor, radial_amplitude, radial_frequency, context, sum);
    x = std::move(out);
    normed = std::move(y);
    if (sum.has_value()) {
      new_sums[l] = std::move(s);
      summaries.push_back(std::move(summary));
      if (static_cast<int64_t>(summaries.size()) > lookback) summaries.erase(summaries.begin());
    }
  }
  return {decode_gemv(normed, {head_weight}, false), std::move(new_sums)};
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CPU, m) { m.impl("_decode_step", &decode_step); }

}  // namespace wiola::cpu
