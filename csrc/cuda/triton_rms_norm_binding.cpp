// wiola::rms_norm, wiola::add_rms_norm and their backwards on CUDA: the op's checks
// (wiola/checks.h, as the CPU kernels'), outputs from at::empty, and the launches of the Triton
// kernels compiled ahead of time (the cubin table, triton_launch.h), made as the Python launchers
// (wiola_kernels/triton/rms_norm.py norm_fwd / norm_bwd) make them: γ and δ passed as stored (the
// kernels convert them in registers), the forward one launch, the backward two (the rows into one
// buffer of per-program partials, then their column sums into ∂γ and ∂δ in γ's and δ's dtypes).
// The variants are looked up by the dtype of every pointer; where neither the table nor the
// runtime table has one, the op runs the Python Triton launcher (wiola::_triton_<op>), which
// registers what it compiles (the next such call launches from C++) or warns once why it cannot.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <vector>

#include "triton_launch.h"
#include "wiola/checks.h"
#include "wiola/empty_output.h"
#include "wiola/triton_rms_norm.h"

namespace wiola::triton {
namespace {

using rms_norm::Ptr;

Ptr ptr(const at::Tensor& t) { return {t.const_data_ptr(), dtype_name(t)}; }

at::ScalarType acc_type(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// norm_fwd: (y, sum, rstd) of x (rows, d), contiguous; residual for add_rms_norm. Returns
// nullopt when the table has no variant (the reason in `why`).
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> norm_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
    const std::optional<at::Tensor>& shift, double eps, bool hf_order, std::string& why) {
  const int64_t rows = x.size(0), d = x.size(1);
  const at::ScalarType acc = acc_type(x);
  at::Tensor y = empty_output({rows, d}, x.options());
  at::Tensor sum = residual.has_value() ? empty_output({rows, d}, x.options()) : at::Tensor();
  at::Tensor rstd = empty_output({rows}, x.options().dtype(acc));
  if (rows == 0) return std::make_tuple(y, sum, rstd);
  const int device = x.get_device();
  const at::Tensor w = weight.contiguous();
  const std::optional<at::Tensor> s =
      shift.has_value() ? std::optional<at::Tensor>(shift->contiguous()) : std::nullopt;
  rms_norm::Forward f{ptr(x), residual.has_value() ? ptr(*residual) : ptr(x), ptr(residual.has_value() ? sum : y),
                      ptr(w), s.has_value() ? ptr(*s) : ptr(w), ptr(y), ptr(rstd), x.element_size(), rows, d, eps,
                      acc == at::kDouble, s.has_value(), hf_order, residual.has_value()};
  if (!launch(rms_norm::forward(f, sm_count(device), default_num_stages()), device, why)) return std::nullopt;
  return std::make_tuple(y, sum, rstd);
}

// norm_bwd: (grad_x, grad_weight, grad_shift) on contiguous rows, in the dtypes of x, weight
// and shift. Both variants are looked up before either kernel runs, so a missing one launches
// nothing (nullopt, the reason in `why`; the caller runs the Python launcher).
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> norm_bwd(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_s, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& shift, const at::Tensor& rstd, std::string& why) {
  const int64_t rows = x.size(0), d = x.size(1);
  at::Tensor grad_x = empty_output({rows, d}, x.options());
  if (rows == 0) {
    return std::make_tuple(grad_x, at::zeros_like(weight), shift.has_value() ? at::zeros_like(*shift) : at::Tensor());
  }
  const int device = x.get_device();
  const int64_t sms = sm_count(device);
  const int stages = default_num_stages();
  const at::Tensor w = weight.contiguous();
  const std::optional<at::Tensor> s =
      shift.has_value() ? std::optional<at::Tensor>(shift->contiguous()) : std::nullopt;
  const int64_t programs = rms_norm::backward_config(rows, d, x.element_size(), grad_s.has_value(), sms).programs;
  // One buffer for both partials, in rstd's (the accumulation) dtype, laid out as norm_bwd's.
  const rms_norm::Partials layout = rms_norm::partials_layout(programs, d, s.has_value());
  at::Tensor partials = empty_output({layout.total}, x.options().dtype(rstd.scalar_type()));
  const char* acc = dtype_name(partials);
  const auto* base = static_cast<const char*>(partials.const_data_ptr());
  const Ptr dw_partial{base, acc};
  const Ptr ds_partial{base + layout.ds_offset * partials.element_size(), acc};
  at::Tensor grad_w = empty_output({d}, w.options());
  at::Tensor grad_shift = s.has_value() ? empty_output({d}, s->options()) : at::Tensor();
  rms_norm::Backward b{ptr(grad_y), grad_s.has_value() ? ptr(*grad_s) : ptr(grad_y), ptr(x), ptr(w),
                       s.has_value() ? ptr(*s) : ptr(w), ptr(rstd), ptr(grad_x), dw_partial, ds_partial,
                       x.element_size(), rows, d, s.has_value(), grad_s.has_value()};
  const Launch rows_launch = rms_norm::backward(b, sms, stages);
  rms_norm::PartialsSum p{dw_partial, ds_partial, ptr(grad_w), s.has_value() ? ptr(grad_shift) : ptr(grad_w),
                          programs, d, s.has_value()};
  const Launch sum_launch = rms_norm::partials_sum(p, stages);
  // Both looked up before either returns: each miss is pending, for the Python launcher to register.
  std::string why_sum;
  const Kernel* rows_kernel = lookup(rows_launch, device, why);
  const Kernel* sum_kernel = lookup(sum_launch, device, why_sum);
  if (rows_kernel == nullptr) return std::nullopt;
  if (sum_kernel == nullptr) {
    why = why_sum;
    return std::nullopt;
  }
  // A cubin the driver refuses (false) after the first launch: the fallback recomputes every
  // output from the inputs, so the first launch's work is only wasted.
  if (!launch(*rows_kernel, rows_launch, device, why) || !launch(*sum_kernel, sum_launch, device, why)) {
    return std::nullopt;
  }
  return std::make_tuple(grad_x, grad_w, grad_shift);
}

std::vector<int64_t> leading(const at::Tensor& x) { return {x.sizes().begin(), x.sizes().end() - 1}; }

template <typename Sig>
c10::TypedOperatorHandle<Sig> fallback_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using RmsNormSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const std::optional<at::Tensor>&, double, bool);
using RmsNormBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                     const at::Tensor&,
                                                                     const std::optional<at::Tensor>&,
                                                                     const at::Tensor&);
using AddRmsNormSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                     const at::Tensor&,
                                                                     const std::optional<at::Tensor>&, double, bool);
using AddRmsNormBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, const at::Tensor&);

// The backward's checks beyond the op's (rms_norm_rows_backward's in csrc/cpu/rms_norm.cpp).
void check_backward(const char* x_name, const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_s,
                    const at::Tensor& x, const at::Tensor& rstd) {
  const auto same_as_x = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK_VALUE(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() && t.device() == x.device(), name,
                      " must have the shape and dtype of ", x_name, " ", checks::shape_str(x.sizes()), ", got ",
                      checks::shape_str(t.sizes()), " ", checks::dtype_name(t.scalar_type()));
  };
  same_as_x("grad_y", grad_y);
  if (grad_s.has_value()) same_as_x("grad_s", *grad_s);
  const at::ScalarType acc = acc_type(x);
  TORCH_CHECK_VALUE(rstd.sizes() == x.sizes().slice(0, x.dim() - 1) && rstd.scalar_type() == acc &&
                        rstd.device() == x.device(),
                    "rstd must have shape ", x_name, ".shape[:-1] = ", checks::shape_str(x.sizes().slice(0, x.dim() - 1)),
                    " and dtype ", checks::dtype_name(acc), " (the forward's), got ", checks::shape_str(rstd.sizes()),
                    " ", checks::dtype_name(rstd.scalar_type()));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& shift, double eps, bool hf_order) {
  checks::rms_norm(x, weight, shift);
  checks::positive("eps", eps);
  const PendingScope pending_misses;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t d = x.size(-1);
  std::string why;
  if (x.numel() > 0 || d > 0) {
    const at::Tensor rows = x.reshape({-1, d}).contiguous();
    if (auto out = norm_fwd(rows, std::nullopt, weight, shift, eps, hf_order, why)) {
      auto& [y, unused, rstd] = *out;
      return {y.view(x.sizes()), rstd.view(leading(x))};
    }
  } else {
    why = "d = 0";
  }
  static std::once_flag once;
  warn_fallback(once, "rms_norm", why);
  static const auto op = fallback_op<RmsNormSig>("wiola::_triton_rms_norm");
  return op.call(x, weight, shift, eps, hf_order);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_y, const at::Tensor& x,
                                                            const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& shift,
                                                            const at::Tensor& rstd) {
  checks::rms_norm(x, weight, shift);
  check_backward("x", grad_y, std::nullopt, x, rstd);
  const PendingScope pending_misses;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t d = x.size(-1);
  std::string why = "d = 0";
  if (d > 0) {
    if (auto out = norm_bwd(grad_y.reshape({-1, d}).contiguous(), std::nullopt, x.reshape({-1, d}).contiguous(),
                            weight, shift, rstd.reshape({-1}).contiguous(), why)) {
      auto& [grad_x, grad_w, grad_s] = *out;
      return {grad_x.view(x.sizes()), grad_w, grad_s};
    }
  }
  static std::once_flag once;
  warn_fallback(once, "rms_norm_backward", why);
  static const auto op = fallback_op<RmsNormBwdSig>("wiola::_triton_rms_norm_backward");
  return op.call(grad_y, x, weight, shift, rstd);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_fwd(const at::Tensor& x, const at::Tensor& residual,
                                                                const at::Tensor& weight,
                                                                const std::optional<at::Tensor>& shift, double eps,
                                                                bool hf_order) {
  checks::add_rms_norm(x, residual, weight, shift);
  checks::positive("eps", eps);
  const PendingScope pending_misses;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t d = x.size(-1);
  std::string why = "d = 0";
  if (d > 0) {
    if (auto out = norm_fwd(x.reshape({-1, d}).contiguous(), residual.reshape({-1, d}).contiguous(), weight, shift,
                            eps, hf_order, why)) {
      auto& [y, s, rstd] = *out;
      return {y.view(x.sizes()), s.view(x.sizes()), rstd.view(leading(x))};
    }
  }
  static std::once_flag once;
  warn_fallback(once, "add_rms_norm", why);
  static const auto op = fallback_op<AddRmsNormSig>("wiola::_triton_add_rms_norm");
  return op.call(x, residual, weight, shift, eps, hf_order);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_bwd(const at::Tensor& grad_y,
                                                                const std::optional<at::Tensor>& grad_s,
                                                                const at::Tensor& s, const at::Tensor& weight,
                                                                const std::optional<at::Tensor>& shift,
                                                                const at::Tensor& rstd) {
  checks::rms_norm(s, weight, shift);
  check_backward("s", grad_y, grad_s, s, rstd);
  const PendingScope pending_misses;
  const c10::cuda::CUDAGuard guard(s.device());
  const int64_t d = s.size(-1);
  std::string why = "d = 0";
  if (d > 0) {
    const std::optional<at::Tensor> gs =
        grad_s.has_value() ? std::optional<at::Tensor>(grad_s->reshape({-1, d}).contiguous()) : std::nullopt;
    if (auto out = norm_bwd(grad_y.reshape({-1, d}).contiguous(), gs, s.reshape({-1, d}).contiguous(), weight, shift,
                            rstd.reshape({-1}).contiguous(), why)) {
      auto& [grad_x, grad_w, grad_shift] = *out;
      return {grad_x.view(s.sizes()), grad_w, grad_shift};
    }
  }
  static std::once_flag once;
  warn_fallback(once, "add_rms_norm_backward", why);
  static const auto op = fallback_op<AddRmsNormBwdSig>("wiola::_triton_add_rms_norm_backward");
  return op.call(grad_y, grad_s, s, weight, shift, rstd);
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CUDA, m) {
  m.impl("rms_norm", &rms_norm_fwd);
  m.impl("rms_norm_backward", &rms_norm_bwd);
  m.impl("add_rms_norm", &add_rms_norm_fwd);
  m.impl("add_rms_norm_backward", &add_rms_norm_bwd);
}

}  // namespace wiola::triton
