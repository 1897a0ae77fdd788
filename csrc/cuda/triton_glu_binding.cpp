// wiola::glu and wiola::glu_backward on CUDA: the op's checks (wiola/checks.h, as the CPU
// kernel's), outputs from at::empty, and a launch of the Triton kernel compiled ahead of time
// (the cubin table, triton_launch.h) chosen exactly as the Python launcher
// (wiola_kernels/triton/glu.py) chooses it. Where the table has no such variant (another
// architecture, a shape the table was not built for, a build without the table) the op runs
// the Python Triton launcher, registered as wiola::_triton_glu(_backward), which compiles the
// variant and registers it in the runtime table (the next such call launches from C++), or
// warns once why it cannot.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

#include "triton_launch.h"
#include "wiola/checks.h"
#include "wiola/empty_output.h"
#include "wiola/triton_glu.h"

namespace wiola::triton {
namespace {

// t as (rows, n) with unit column stride (triton/glu.py's _rows).
at::Tensor as_rows(const at::Tensor& t, int64_t n) {
  at::Tensor r = t;
  if (r.dim() > 0 && r.size(-1) > 1 && r.stride(-1) != 1) r = r.contiguous();
  return r.reshape({-1, n});
}

at::Tensor glu_fwd(const at::Tensor& a, const std::optional<at::Tensor>& b, c10::string_view activation) {
  const checks::GluActivation act = checks::glu(a, b, activation);
  const PendingScope pending_misses;
  const int64_t width = a.size(-1);
  const int64_t n = b.has_value() ? width : width / 2;
  std::vector<int64_t> out_shape(a.sizes().begin(), a.sizes().end());
  out_shape.back() = n;
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor y = empty_output(out_shape, a.options());
  if (y.numel() == 0) return y;
  const at::Tensor a_rows = as_rows(a, width);
  const at::Tensor b_rows = b.has_value() ? as_rows(*b, width) : a_rows;
  const int64_t rows = a_rows.size(0);
  const int64_t esize = a.element_size();
  const char* bytes = static_cast<const char*>(b_rows.const_data_ptr());
  glu::Forward f{dtype_name(a), esize, a.scalar_type() == at::kDouble, act == checks::GluActivation::kSilu ? 0 : 1,
                 a_rows.const_data_ptr(), b.has_value() ? bytes : bytes + n * esize, y.mutable_data_ptr(), rows, n,
                 a_rows.stride(0), b_rows.stride(0)};
  const int device = a.get_device();
  std::string why;
  if (launch(glu::forward(f, sm_count(device), default_num_stages()), device, why)) return y;
  static std::once_flag once;
  warn_fallback(once, "glu", why);
  static const auto fallback = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("wiola::_triton_glu", "")
                                   .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                                                     c10::string_view)>();
  return fallback.call(a, b, activation);
}

std::tuple<at::Tensor, at::Tensor> glu_bwd(const at::Tensor& grad_y, const at::Tensor& a,
                                           const std::optional<at::Tensor>& b, c10::string_view activation) {
  const checks::GluActivation act = checks::glu(a, b, activation);
  const PendingScope pending_misses;
  const int64_t width = a.size(-1);
  const int64_t n = b.has_value() ? width : width / 2;
  std::vector<int64_t> y_shape(a.sizes().begin(), a.sizes().end());
  y_shape.back() = n;
  TORCH_CHECK_VALUE(grad_y.sizes() == at::IntArrayRef(y_shape) && grad_y.scalar_type() == a.scalar_type() &&
                        grad_y.device() == a.device(),
                    "grad_y must have the shape and dtype of y ", checks::shape_str(y_shape), " ",
                    checks::dtype_name(a.scalar_type()), ", got ", checks::shape_str(grad_y.sizes()), " ",
                    checks::dtype_name(grad_y.scalar_type()));
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor grad_a = empty_output(a.sizes(), a.options());
  at::Tensor grad_b = b.has_value() ? empty_output(a.sizes(), a.options()) : at::Tensor();
  if (grad_y.numel() == 0) return {grad_a, grad_b};
  const at::Tensor a_rows = as_rows(a, width);
  const at::Tensor b_rows = b.has_value() ? as_rows(*b, width) : a_rows;
  const at::Tensor g = as_rows(grad_y, n);
  const int64_t rows = a_rows.size(0);
  const int64_t esize = a.element_size();
  const char* b_bytes = static_cast<const char*>(b_rows.const_data_ptr());
  char* da = static_cast<char*>(grad_a.mutable_data_ptr());
  // Packed: [∂a | ∂b] in one (rows, 2n) gradient, row stride 2n; else two (rows, n).
  void* db = b.has_value() ? grad_b.mutable_data_ptr() : da + n * esize;
  glu::Backward bw{dtype_name(a), esize, a.scalar_type() == at::kDouble, act == checks::GluActivation::kSilu ? 0 : 1,
                   g.const_data_ptr(), a_rows.const_data_ptr(), b.has_value() ? b_bytes : b_bytes + n * esize,
                   da, db, rows, n, g.stride(0), a_rows.stride(0), b_rows.stride(0), width};
  const int device = a.get_device();
  std::string why;
  if (launch(glu::backward(bw, sm_count(device), default_num_stages()), device, why)) return {grad_a, grad_b};
  static std::once_flag once;
  warn_fallback(once, "glu_backward", why);
  static const auto fallback =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("wiola::_triton_glu_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&, c10::string_view)>();
  return fallback.call(grad_y, a, b, activation);
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CUDA, m) {
  m.impl("glu", &glu_fwd);
  m.impl("glu_backward", &glu_bwd);
}

}  // namespace wiola::triton
