// The decoding kernels one decoding kernel calls from another (decode_block runs the GEMV,
// decode_step runs the block and the GEMV): plain C++ calls, each defined in its own file
// and registered there as the op of the same name. The argument meanings are the ops'
// schemas (csrc/wiola_ops.cpp, with the other schemas of no public op).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace wiola::cpu {

// wiola::_decode_gemv (decode_gemv.cpp)
at::Tensor decode_gemv(const at::Tensor& x, at::TensorList weights, bool split_input);

// wiola::_decode_block (decode_block.cpp): (x'', next-normed x'' or empty, new summary sum or
// empty, summary or empty)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_block(
    const at::Tensor& x, const at::Tensor& normed, at::TensorList weights, const at::Tensor& ffn_norm_weight,
    const std::optional<at::Tensor>& ffn_norm_shift, double ffn_norm_eps,
    const std::optional<at::Tensor>& next_norm_weight, const std::optional<at::Tensor>& next_norm_shift,
    double next_norm_eps, const at::Tensor& beta, const at::Tensor& gate, at::Tensor& k_cache, at::Tensor& v_cache,
    int64_t past, const at::Tensor& position_ids, int64_t n_head, double theta, double spiral_divisor,
    double radial_amplitude, double radial_frequency, const std::optional<at::Tensor>& context,
    const std::optional<at::Tensor>& summary_sum);

}  // namespace wiola::cpu
