// C++ unit tests of the CPU kernels, run by ctest. Each kernel is called through the
// dispatcher (as Python does) and compared with a naive double-precision loop written
// here, independently of the kernel code.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

int failures = 0;
int passes = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s  %s\n", ok ? "PASS" : "FAIL", what.c_str());
  failures += !ok;
  passes += ok;
}

double rel_err(const at::Tensor& out, const at::Tensor& ref) {
  const at::Tensor o = out.to(at::kDouble), r = ref.to(at::kDouble);
  return (o - r).norm().item<double>() / std::max(r.norm().item<double>(), 1e-300);
}

template <typename Fn>
bool throws_value_error(Fn&& fn) {
  try {
    fn();
  } catch (const c10::ValueError&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

// Naive WiolaRMSNorm: y = w (x + s) / sqrt(mean((x + s)^2) + eps), row by row in double.
at::Tensor naive_rms_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, double eps) {
  const at::Tensor xd = x.to(at::kDouble).contiguous(), wd = w.to(at::kDouble), sd = s.to(at::kDouble);
  at::Tensor y = at::empty_like(xd);
  const int64_t rows = xd.size(0), d = xd.size(1);
  auto X = xd.accessor<double, 2>();
  auto Y = y.accessor<double, 2>();
  auto W = wd.accessor<double, 1>();
  auto S = sd.accessor<double, 1>();
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += (X[r][i] + S[i]) * (X[r][i] + S[i]);
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    for (int64_t i = 0; i < d; ++i) Y[r][i] = W[i] * (X[r][i] + S[i]) * inv;
  }
  return y;
}

void test_rms_norm() {
  auto fwd = op("wiola::_rms_norm_fwd").typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                                const at::Tensor&, double)>();
  auto bwd = op("wiola::_rms_norm_bwd")
                 .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&)>();
  for (int64_t d : {1, 7, 64, 1000}) {
    for (int64_t rows : {1, 37}) {
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
        const at::Tensor x = at::randn({rows, d}).to(dtype), w = at::rand({d}).add(0.5), s = at::randn({d}).mul(0.3);
        auto [y, rstd] = fwd.call(x, w, s, 1e-6);
        const double tol = dtype == at::kBFloat16 ? 1e-2 : (dtype == at::kFloat ? 1e-5 : 1e-12);
        const double err = rel_err(y, naive_rms_norm(x, w, s, 1e-6));
        expect(err <= tol && y.scalar_type() == dtype,
               "rms_norm fwd rows=" + std::to_string(rows) + " d=" + std::to_string(d) + " " +
                   c10::toString(dtype) + " rel err " + std::to_string(err));
        // Backward: the directional derivative <g, dy> for a perturbation of x must
        // match <dx, v> (finite differences of the naive forward in double).
        if (dtype == at::kDouble) {
          const at::Tensor g = at::randn({rows, d}, at::kDouble), v = at::randn({rows, d}, at::kDouble);
          auto [dx, dw, ds] = bwd.call(g, x, w.to(at::kDouble), s.to(at::kDouble), rstd);
          const double h = 1e-6;
          const double fd = ((naive_rms_norm(x + h * v, w, s, 1e-6) - naive_rms_norm(x - h * v, w, s, 1e-6)) * g)
                                .sum().item<double>() / (2 * h);
          const double an = (dx * v).sum().item<double>();
          expect(std::abs(fd - an) <= 1e-6 * std::max(1.0, std::abs(fd)),
                 "rms_norm bwd dx (finite differences) d=" + std::to_string(d));
          const at::Tensor vs = at::randn({d}, at::kDouble);
          const double fds = ((naive_rms_norm(x, w, s + h * vs, 1e-6) - naive_rms_norm(x, w, s - h * vs, 1e-6)) * g)
                                 .sum().item<double>() / (2 * h);
          expect(std::abs(fds - (ds * vs).sum().item<double>()) <= 1e-6 * std::max(1.0, std::abs(fds)),
                 "rms_norm bwd dshift (finite differences) d=" + std::to_string(d));
          const double fdw = ((naive_rms_norm(x, w + h * vs, s, 1e-6) - naive_rms_norm(x, w - h * vs, s, 1e-6)) * g)
                                 .sum().item<double>() / (2 * h);
          expect(std::abs(fdw - (dw * vs).sum().item<double>()) <= 1e-6 * std::max(1.0, std::abs(fdw)),
                 "rms_norm bwd dweight (finite differences) d=" + std::to_string(d));
        }
      }
    }
  }
  expect(throws_value_error([&] { fwd.call(at::randn({4, 8}), at::ones({7}), at::zeros({8}), 1e-6); }),
         "rms_norm rejects a weight of the wrong size with ValueError");
  expect(throws_value_error([&] { fwd.call(at::randn({4, 8}).t(), at::ones({4}), at::zeros({4}), 1e-6); }),
         "rms_norm rejects a non-contiguous x with ValueError");
}

}  // namespace

int main() {
  at::manual_seed(0);
  test_rms_norm();
  std::printf("%d passed, %d failed\n", passes, failures);
  return failures == 0 ? 0 : 1;
}
