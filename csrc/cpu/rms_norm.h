// The row kernels of WiolaRMSNorm (csrc/cpu/rms_norm.cpp), shared by the rms_norm and
// add_rms_norm ops (csrc/cpu/add_rms_norm.cpp). The callers check their arguments first
// (wiola/checks.h); these check only what the backward receives from the forward.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace wiola::cpu {

// WiolaRMSNorm over the last dimension of x (..., d): (y, s, rstd). With `residual` (x's
// shape and dtype, any strides) the rows normalised are s = x + residual, rounded once to
// x's dtype and returned as s; without it s is undefined and x's rows are normalised.
// y and s are contiguous; rstd (x.shape[:-1]) is float32 (float64 for double x).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_rows_forward(const at::Tensor& x,
                                                                     const std::optional<at::Tensor>& residual,
                                                                     const at::Tensor& weight,
                                                                     const std::optional<at::Tensor>& shift,
                                                                     double eps, bool hf_order);

// The backward of the norm on the rows it normalised (`x`: rms_norm's x, add_rms_norm's s;
// `x_name` is what error messages call it): (∂x, ∂γ, ∂δ), ∂δ undefined without shift. With
// `grad_s`, ∂x = grad_s + the norm's ∂x, summed in float and rounded once.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_rows_backward(const char* x_name, const at::Tensor& grad_y,
                                                                      const std::optional<at::Tensor>& grad_s,
                                                                      const at::Tensor& x, const at::Tensor& weight,
                                                                      const std::optional<at::Tensor>& shift,
                                                                      const at::Tensor& rstd);

}  // namespace wiola::cpu
