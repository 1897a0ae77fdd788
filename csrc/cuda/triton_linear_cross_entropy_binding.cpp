// wiola::linear_cross_entropy and its backward on CUDA: the op's checks (wiola/checks.h, as the
// CPU kernel's), outputs from at::empty on the current device, and the Python launchers' chunk
// loop (wiola_kernels/triton/linear_cross_entropy.py lce_forward, lce_reduce) made here: the
// Triton kernels launched from the cubin tables (triton_launch.h) with the launches, chunking and
// workspace of wiola/triton_linear_cross_entropy.h, the GEMMs through ATen on the current stream
// (at::mm_out, Tensor::addmm_). Nothing is read on the host: the mean's divisor (num_items or the
// counted rows) and the backward's factor are computed by _lce_reduce_kernel on the device; a
// num_items tensor on the CPU, whose value the checks read, reaches the device through a fill
// whose launch carries it (graph-safe, no copy from host memory). Every Triton launch of a call is
// looked up before any runs; where one is in neither table, the op runs the Python Triton
// launcher (wiola::_triton_linear_cross_entropy(_backward)), which registers what it compiles so
// that the next such call launches from C++, or warns once why it cannot.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "triton_launch.h"
#include "wiola/checks.h"
#include "wiola/empty_output.h"
#include "wiola/triton_linear_cross_entropy.h"

namespace wiola::triton {
namespace {

using lce::Ptr;

Ptr ptr(const at::Tensor& t) { return {t.const_data_ptr(), dtype_name(t)}; }

// The Triton launches of one call, made in two passes over the same code: `plan` looks every
// launch up (nothing runs: a missing variant leaves nothing half done, and each miss is pending
// for the Python launcher to register); `run` launches them, the ATen work in between.
class Calls {
 public:
  explicit Calls(int device) : device_(device) {}

  void triton(const Launch& l) {
    if (!running_) {
      const Kernel* k = lookup(l, device_, why_);
      missing_ = missing_ || k == nullptr;
      kernels_.push_back(k);
    } else if (!failed_ && !launch(*kernels_.at(next_++), l, device_, why_)) {
      failed_ = true;  // the driver refused a cubin: the Python launcher recomputes every output
    }
  }

  template <typename F>
  void aten(F&& f) {
    if (running_ && !failed_) f();
  }

  // Runs `body` to plan, then (every variant found) to launch; false (the reason in why()) when
  // the op must run the Python launcher instead.
  template <typename Body>
  bool run(Body&& body) {
    body(*this);
    if (missing_) return false;
    running_ = true;
    body(*this);
    return !failed_;
  }

  const std::string& why() const { return why_; }

 private:
  int device_;
  bool running_ = false, missing_ = false, failed_ = false;
  size_t next_ = 0;
  std::vector<const Kernel*> kernels_;
  std::string why_;
};

// num_items where _lce_reduce_kernel reads it (triton/linear_cross_entropy.py device_num_items):
// a device tensor as it is, a CPU tensor's value (read by the checks) in a float64 device scalar
// written by a fill; undefined when the reduction is not a mean or none is given.
at::Tensor device_items(const std::optional<at::Tensor>& num_items, const std::optional<double>& value, bool mean,
                        const at::Tensor& like) {
  if (!mean || !num_items.has_value()) return at::Tensor();
  if (num_items->device() == like.device()) return *num_items;
  return at::full({}, *value, like.options().dtype(at::kDouble));
}

Ptr maybe(const at::Tensor& t, const char* dtype_if_none) {
  return t.defined() ? ptr(t) : Ptr{nullptr, dtype_if_none};
}

// One call's operands and options, as lce_forward takes them.
struct Call {
  at::Tensor h2, W, y;  // (n, d), (V, d), int64 (n,)
  int64_t n, V, d;
  at::ScalarType acc;
  lce::Problem problem;
};

Call make_call(const at::Tensor& h, const at::Tensor& W, const at::Tensor& y, int64_t n, int64_t ignore_index,
               double eps, std::optional<double> softcap, double z_loss) {
  const int64_t d = h.size(-1), V = W.size(0);
  Call c{h.reshape({n, d}), W, y, n, V, d, h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat, {}};
  c.problem = lce::Problem{ptr(c.h2), ptr(W), ptr(y), c.acc == at::kDouble ? "fp64" : "fp32", V, d, c.h2.stride(0),
                           c.h2.stride(1), W.stride(0), W.stride(1), softcap.has_value(), softcap.value_or(1.0), eps,
                           z_loss, ignore_index};
  return c;
}

// lce_forward's chunk loop (n > 0, gradients wanted or the backward's recomputation): per chunk
// logits → rows (the forward) → dlogits → ∂h GEMM → ∂W (GEMM, or _lce_dw_kernel into the float32
// accumulator, copied into grad_W at the end). `lse` is written (forward) or read (backward:
// `backward`, `g` the per-row gradient of "none" or undefined).
struct Chunks {
  const Call& call;
  lce::Plan plan;
  at::Tensor ws, buf, dz, dw_acc;
  Ptr stats;

  Chunks(const Call& c, const lce::Plan& p, const at::Tensor& workspace) : call(c), plan(p), ws(workspace) {
    const auto* base = static_cast<const char*>(ws.const_data_ptr());
    stats = {base + p.stats_offset, c.problem.acc};
    if (!p.chunked) return;
    const int64_t acc_size = c.acc == at::kDouble ? 8 : 4, rows_v = p.rows_max * c.V;
    buf = ws.narrow(0, 0, rows_v * acc_size).view(c.acc).view({p.rows_max, c.V});
    dz = p.dz_offset == 0 ? buf
                          : ws.narrow(0, p.dz_offset, rows_v * c.h2.element_size())
                                .view(c.h2.scalar_type())
                                .view({p.rows_max, c.V});
    if (p.dw_acc_offset >= 0) dw_acc = ws.narrow(0, p.dw_acc_offset, c.V * c.d * 4).view(at::kFloat).view({c.V, c.d});
  }

  void operator()(Calls& k, const at::Tensor& lse, const at::Tensor& loss, const at::Tensor& g, at::Tensor* grad_h,
                  at::Tensor* grad_W, bool want_sum) const {
    const lce::Problem& p = call.problem;
    const lce::Config& cfg = plan.cfg;
    const int stages = default_num_stages();
    const bool backward = !loss.defined();
    for (int64_t row0 = 0; row0 < call.n; row0 += plan.rows_max) {
      const int64_t rows = std::min(plan.rows_max, call.n - row0);
      const lce::Split& s = rows == plan.rows_max ? plan.full : plan.last;
      k.triton(lce::logits(p, cfg, s, true, ptr(buf), stats, row0, rows, want_sum && !backward));
      if (!backward) k.triton(lce::rows(p, cfg, s.splits, stats, ptr(lse), ptr(loss), row0, rows, stages));
      k.triton(lce::dlogits(p, cfg, ptr(buf), ptr(dz), ptr(lse), g.defined(), maybe(g, p.acc), row0, rows, stages));
      if (grad_h != nullptr) {
        k.aten([&] {
          at::Tensor out = grad_h->narrow(0, row0, rows);
          at::mm_out(out, dz.narrow(0, 0, rows), call.W);
        });
      }
      if (grad_W == nullptr) continue;
      if (dw_acc.defined()) {
        k.triton(lce::dw(p, cfg, ptr(dz), ptr(dw_acc), row0, rows, row0 == 0));
        continue;
      }
      k.aten([&] {  // float32 / float64: cuBLAS accumulates in the output
        const at::Tensor dzt = dz.narrow(0, 0, rows).t(), hc = call.h2.narrow(0, row0, rows);
        if (row0 == 0) {
          at::mm_out(*grad_W, dzt, hc);
        } else {
          grad_W->addmm_(dzt, hc);
        }
      });
    }
    if (grad_W != nullptr && dw_acc.defined()) k.aten([&] { grad_W->copy_(dw_acc); });
  }
};

using LceSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, c10::string_view, double, std::optional<double>,
    double, const std::optional<at::Tensor>&, std::array<bool, 2>);
using LceBwdSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&, int64_t, c10::string_view, double, std::optional<double>,
                       double, bool);

int64_t chunk_override() { return lce::parse_chunk_override(std::getenv("WIOLA_LCE_CHUNK_ROWS")); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lce_fwd(
    const at::Tensor& h, const at::Tensor& W, const at::Tensor& labels, int64_t ignore_index,
    c10::string_view reduction, double label_smoothing, std::optional<double> softcap, double z_loss,
    const std::optional<at::Tensor>& num_items, std::array<bool, 2> grad_mask) {
  const checks::LinearCrossEntropyArgs a =
      checks::linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss, num_items);
  const bool none = reduction == "none", mean = reduction == "mean";
  TORCH_CHECK_VALUE(!(grad_mask[0] || grad_mask[1]) || !none,
                    "grad_mask: the forward computes gradients for reduction 'mean' or 'sum' only, got 'none'");
  const PendingScope pending_misses;
  const c10::cuda::CUDAGuard guard(h.device());
  const Call c = make_call(h, W, a.labels, a.n, ignore_index, label_smoothing, softcap, z_loss);
  const int64_t n = c.n, V = c.V, d = c.d;
  const auto opts = h.options();
  const bool want_h = grad_mask[0], want_W = grad_mask[1];
  at::Tensor lse = empty_output({n}, opts.dtype(c.acc));
  at::Tensor rows_loss = empty_output({n}, opts.dtype(c.acc));
  at::Tensor grad_h = want_h ? empty_output({n, d}, opts) : at::empty({0}, opts);
  at::Tensor grad_W = want_W ? empty_output({V, d}, W.options()) : at::empty({0}, W.options());
  at::Tensor loss = none ? rows_loss : at::empty({}, opts.dtype(c.acc));
  const at::Tensor items = device_items(num_items, a.num_items, mean, h);
  const int device = h.get_device();
  const bool chunked = want_h || want_W;
  const lce::Plan plan = lce::plan(std::max<int64_t>(n, 1), V, d, c.problem.h.dtype, h.element_size(),
                                   sm_count(device), chunked, want_W && W.scalar_type() != c.acc, chunk_override());
  const at::Tensor ws = n == 0 ? at::Tensor() : at::empty({plan.total}, opts.dtype(at::kByte));
  const bool want_sum = label_smoothing != 0.0;
  const int stages = default_num_stages();
  Calls k(device);
  const bool ok = k.run([&](Calls& k) {
    if (n == 0) {
      if (want_W) k.aten([&] { grad_W.zero_(); });
    } else if (!chunked) {  // the loss alone: one launch over every row, nothing stored
      const Ptr stats = ptr(ws.view(c.acc));
      k.triton(lce::logits(c.problem, plan.cfg, plan.full, false, stats, stats, 0, n, want_sum));
      k.triton(lce::rows(c.problem, plan.cfg, plan.full.splits, stats, ptr(lse), ptr(rows_loss), 0, n, stages));
    } else {
      Chunks(c, plan, ws)(k, lse, rows_loss, at::Tensor(), want_h ? &grad_h : nullptr, want_W ? &grad_W : nullptr,
                          want_sum);
    }
    if (!none) {  // one launch, the divisor read on the device
      k.triton(lce::reduce(ptr(rows_loss), ptr(c.y), items.defined(), maybe(items, "fp64"), false, ptr(loss),
                           ptr(loss), n, ignore_index, mean, stages));
    }
  });
  if (ok) return {loss, lse, grad_h, grad_W};
  static std::once_flag once;
  warn_fallback(once, "linear_cross_entropy", k.why());
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("wiola::_triton_linear_cross_entropy", "").typed<LceSig>();
  return op.call(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss, num_items, grad_mask);
}

void lce_bwd(const at::Tensor& grad_loss, const at::Tensor& h, const at::Tensor& W, const at::Tensor& labels,
             const at::Tensor& lse_in, const std::optional<at::Tensor>& num_items,
             const std::optional<at::Tensor>& grad_h_opt, const std::optional<at::Tensor>& grad_W_opt,
             int64_t ignore_index, c10::string_view reduction, double label_smoothing, std::optional<double> softcap,
             double z_loss, bool precomputed) {
  const checks::LinearCrossEntropyArgs a = checks::linear_cross_entropy_backward(
      grad_loss, h, W, labels, lse_in, num_items, grad_h_opt, grad_W_opt, ignore_index, reduction, label_smoothing,
      softcap, z_loss, precomputed);
  const int64_t d = h.size(-1), V = W.size(0), n = a.n;
  const at::ScalarType acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const bool none = reduction == "none", mean = reduction == "mean";
  const bool want_h = grad_h_opt.has_value() && grad_h_opt->defined();
  const bool want_W = grad_W_opt.has_value() && grad_W_opt->defined();
  if (!want_h && !want_W) return;
  const bool recompute = !precomputed;
  if (recompute) {
    TORCH_CHECK_VALUE(!want_h || grad_h_opt->is_contiguous(), "grad_h must be contiguous");
    TORCH_CHECK_VALUE(!want_W || grad_W_opt->is_contiguous(), "grad_W must be contiguous");
  }
  const PendingScope pending_misses;
  const c10::cuda::CUDAGuard guard(h.device());
  at::Tensor grad_h = want_h ? *grad_h_opt : at::Tensor();
  at::Tensor grad_W = want_W ? *grad_W_opt : at::Tensor();
  const Call c = make_call(h, W, a.labels, n, ignore_index, label_smoothing, softcap, z_loss);
  const int device = h.get_device();
  const at::Tensor lse = lse_in.contiguous();
  const at::Tensor g = recompute && none ? grad_loss.reshape({n}).to(acc).contiguous() : at::Tensor();
  const at::Tensor items = device_items(num_items, a.num_items, mean, h);
  const at::Tensor scale = none ? at::Tensor() : at::empty({}, h.options().dtype(acc));
  const lce::Plan plan = lce::plan(std::max<int64_t>(n, 1), V, d, c.problem.h.dtype, h.element_size(),
                                   sm_count(device), true, want_W && W.scalar_type() != acc, chunk_override());
  const at::Tensor ws = recompute && n > 0 ? at::empty({plan.total}, h.options().dtype(at::kByte)) : at::Tensor();
  const int stages = default_num_stages();
  Calls k(device);
  const bool ok = k.run([&](Calls& k) {
    if (recompute) {
      if (n == 0) {
        if (want_W) k.aten([&] { grad_W.zero_(); });
      } else {
        Chunks(c, plan, ws)(k, lse, at::Tensor(), g, want_h ? &grad_h : nullptr, want_W ? &grad_W : nullptr, false);
      }
    }
    if (!none) {  // grad_loss (÷ n) in one launch, applied to both gradients in one more
      k.triton(lce::reduce(ptr(c.y), ptr(c.y), items.defined(), maybe(items, "fp64"), true, ptr(grad_loss),
                           ptr(scale), n, ignore_index, mean, stages));
      k.aten([&] {
        std::vector<at::Tensor> grads;
        if (want_h) grads.push_back(grad_h);
        if (want_W) grads.push_back(grad_W);
        at::_foreach_mul_(grads, scale);
      });
    }
  });
  if (ok) return;
  static std::once_flag once;
  warn_fallback(once, "linear_cross_entropy_backward", k.why());
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("wiola::_triton_linear_cross_entropy_backward", "")
                             .typed<LceBwdSig>();
  op.call(grad_loss, h, W, labels, lse_in, num_items, grad_h_opt, grad_W_opt, ignore_index, reduction,
          label_smoothing, softcap, z_loss, precomputed);
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CUDA, m) {
  m.impl("linear_cross_entropy", &lce_fwd);
  m.impl("linear_cross_entropy_backward", &lce_bwd);
}

}  // namespace wiola::triton
