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

// The op's schemas, declared once, here beside its CPU kernels: every build of the op compiles this file.
// set_python_module names the module that registers the op's fakes and Python kernels.
TORCH_LIBRARY_FRAGMENT(wiola, m) {
  m.set_python_module("wiola_kernels.ops.add_rms_norm");
  // x, residual (..., d) of one dtype, any strides; weight, shift, eps, hf_order as for rms_norm.
  // s = x + residual rounded to x's dtype, y = rms_norm(s): y, s contiguous like x; rstd as for
  // rms_norm. The backward takes grad_s None when no gradient reached s; grad_x is the gradient
  // of x and of residual alike.
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, Tensor? shift, float eps=1e-06,"
        " bool hf_order=False) -> (Tensor y, Tensor s, Tensor rstd)");
  m.def("add_rms_norm_backward(Tensor grad_y, Tensor? grad_s, Tensor s, Tensor weight, Tensor? shift,"
        " Tensor rstd) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");
  // The Python Triton launchers, as rms_norm's (csrc/cuda/triton_rms_norm_binding.cpp).
  m.def("_triton_add_rms_norm(Tensor x, Tensor residual, Tensor weight, Tensor? shift, float eps=1e-06,"
        " bool hf_order=False) -> (Tensor y, Tensor s, Tensor rstd)");
  m.def("_triton_add_rms_norm_backward(Tensor grad_y, Tensor? grad_s, Tensor s, Tensor weight, Tensor? shift,"
        " Tensor rstd) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");
}

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm_fwd);
  m.impl("add_rms_norm_backward", &add_rms_norm_bwd);
}

}  // namespace wiola::cpu
