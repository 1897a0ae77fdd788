// Residual add + WiolaRMSNorm on the CPU (SPEC §10.3): s = x + residual, y = WiolaRMSNorm(s).
//
// The kernels are rms_norm's (csrc/cpu/rms_norm.cpp, through rms_norm.h), with the add
// folded into their row loop: each row of x and the residual is read once, s is formed in
// float, rounded once to the input dtype, written out (non-temporal when large) and kept in
// L1 as the row the norm then reads, so y is the norm of s as stored (bf16 included) and
// the rows are read from memory once. The backward is rms_norm's on s, with the gradient of
// s added to ∂x inside the same pass (one rounding); ∂x is also the residual's gradient.
#include <torch/library.h>

#include "common.h"
#include "rms_norm.h"
#include "wiola/checks.h"

namespace wiola::cpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_fwd(const at::Tensor& x, const at::Tensor& residual,
                                                                const at::Tensor& weight,
                                                                const std::optional<at::Tensor>& shift, double eps,
                                                                bool hf_order) {
  checks::add_rms_norm(x, residual, weight, shift);
  checks::positive("eps", eps);
  return rms_norm_rows_forward(x, residual, weight, shift, eps, hf_order);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_bwd(const at::Tensor& grad_y,
                                                                const std::optional<at::Tensor>& grad_s,
                                                                const at::Tensor& s, const at::Tensor& weight,
                                                                const std::optional<at::Tensor>& shift,
                                                                const at::Tensor& rstd) {
  checks::rms_norm(s, weight, shift);
  return rms_norm_rows_backward("s", grad_y, grad_s, s, weight, shift, rstd);
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm_fwd);
  m.impl("add_rms_norm_backward", &add_rms_norm_bwd);
}

}  // namespace wiola::cpu
