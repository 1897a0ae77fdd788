// wiola::srpe and wiola::srpe_backward on CUDA: the op's checks (wiola/checks.h, as the CPU
// kernel's), outputs from at::empty_like, and one launch of the Triton kernel compiled ahead of
// time (the cubin table, triton_launch.h) chosen exactly as the Python launcher
// (wiola_kernels/triton/srpe.py srpe_apply) chooses it. The kernel reads two float64 tables:
// ω (θ₀^(−2j/d_h), or the given inv_freq read at every call) and six constants; both are built
// once per configuration and device and kept, as the Python launcher's caches keep them. Where
// neither table of variants has the call's (another architecture, a shape the table was not built
// for), the op runs the Python Triton launcher (wiola::_triton_srpe(_backward)), which registers
// what it compiles so that the next such call launches from C++, or warns once why it cannot;
// likewise while a CUDA graph is captured before the tables of its configuration exist (no copy
// from the host then).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "triton_launch.h"
#include "wiola/checks.h"
#include "wiola/empty_output.h"
#include "wiola/triton_srpe.h"

namespace wiola::triton {
namespace {

constexpr double kTwoPi = 2.0 * 3.141592653589793;  // triton/srpe.py's _TWO_PI (2·math.pi)

uint64_t bits(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// `values` as a float64 tensor on `device` (a copy from the host: outside a capture only).
at::Tensor to_device(const std::vector<double>& values, const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kDouble));
  std::memcpy(host.mutable_data_ptr<double>(), values.data(), values.size() * sizeof(double));
  return host.to(at::TensorOptions().device(device).dtype(at::kDouble));
}

// The kernel's ω and constants tables on `device` (triton/srpe.py _kernel_tables): built once
// per configuration and device and never freed (a captured graph may read them); nullopt when
// one must be built while the stream is captured.
std::optional<std::pair<at::Tensor, at::Tensor>> kernel_tables(int64_t dh, double theta, double spiral_divisor,
                                                               double radial_amplitude, double radial_frequency,
                                                               const std::optional<at::Tensor>& inv_freq, double scale,
                                                               const at::Device& device, bool capturing) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int64_t, uint64_t>, at::Tensor> omegas;
  static std::map<std::tuple<int, uint64_t, uint64_t, uint64_t, uint64_t>, at::Tensor> constants;
  const int index = device.index();
  at::Tensor omega;
  if (inv_freq.has_value()) omega = inv_freq->to(at::TensorOptions().device(device).dtype(at::kDouble)).contiguous();
  std::lock_guard<std::mutex> lock(mutex);
  if (!omega.defined()) {
    const auto key = std::make_tuple(index, dh, bits(theta));
    auto it = omegas.find(key);
    if (it == omegas.end()) {
      if (capturing) return std::nullopt;
      // srpe_tables.kernel_omega: C's pow, as Python's float pow and the CPU kernel.
      std::vector<double> w(static_cast<size_t>(dh / 2));
      for (int64_t j = 0; j < dh / 2; ++j) w[j] = std::pow(theta, static_cast<double>(j) * (-2.0 / static_cast<double>(dh)));
      it = omegas.emplace(key, to_device(w, device)).first;
    }
    omega = it->second;
  }
  const auto key = std::make_tuple(index, bits(spiral_divisor), bits(radial_frequency), bits(radial_amplitude),
                                   bits(scale));
  auto it = constants.find(key);
  if (it == constants.end()) {
    if (capturing) return std::nullopt;
    it = constants
             .emplace(key, to_device({1.0 + 1.0 / spiral_divisor, radial_frequency, radial_amplitude, kTwoPi,
                                      1.0 / kTwoPi, scale},
                                     device))
             .first;
  }
  return std::make_pair(omega, it->second);
}

using SrpeSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                   double, double, double, const std::optional<at::Tensor>&, double);

std::tuple<at::Tensor, at::Tensor> srpe_apply(bool transpose, const at::Tensor& q_in, const at::Tensor& k_in,
                                              const at::Tensor& position_ids, double theta, double spiral_divisor,
                                              double radial_amplitude, double radial_frequency,
                                              const std::optional<at::Tensor>& inv_freq, double scale) {
  const char* q_name = transpose ? "grad_q" : "q";
  const char* k_name = transpose ? "grad_k" : "k";
  const at::Tensor positions = checks::srpe(q_name, q_in, k_name, k_in, position_ids, theta, spiral_divisor,
                                            radial_amplitude, radial_frequency, inv_freq, scale);
  const PendingScope pending_misses;
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = checks::unit_last_stride(q_in), k = checks::unit_last_stride(k_in);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), dh = q.size(3), H_kv = k.size(1);
  at::Tensor q_out = empty_output_like(q);
  at::Tensor k_out = empty_output_like(k);
  if (B * T == 0 || dh / 2 == 0) return {q_out, k_out};
  const int device = q.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  std::string why;
  const auto tables = kernel_tables(dh, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq, scale,
                                    q.device(), capture != cudaStreamCaptureStatusNone);
  if (tables.has_value()) {
    const auto& [omega, constants] = *tables;
    srpe::Call c{dtype_name(q), static_cast<int64_t>(q.element_size()), q.scalar_type() == at::kDouble, transpose,
                 q.const_data_ptr(), k.const_data_ptr(), positions.const_data_ptr(), omega.const_data_ptr(),
                 constants.const_data_ptr(), q_out.mutable_data_ptr(), k_out.mutable_data_ptr(), B, T, H, H_kv,
                 dh / 2, positions.stride(0), positions.stride(1),
                 {q.stride(0), q.stride(1), q.stride(2)}, {k.stride(0), k.stride(1), k.stride(2)},
                 {q_out.stride(0), q_out.stride(1), q_out.stride(2)}, {k_out.stride(0), k_out.stride(1), k_out.stride(2)}};
    if (launch(srpe::launch(c, sm_count(device), default_num_stages()), device, why)) return {q_out, k_out};
  } else {
    why = "the frequency tables of this configuration are built outside a CUDA graph capture only";
  }
  static std::once_flag once_fwd, once_bwd;
  warn_fallback(transpose ? once_bwd : once_fwd, transpose ? "srpe_backward" : "srpe", why);
  static const auto fwd = c10::Dispatcher::singleton().findSchemaOrThrow("wiola::_triton_srpe", "").typed<SrpeSig>();
  static const auto bwd =
      c10::Dispatcher::singleton().findSchemaOrThrow("wiola::_triton_srpe_backward", "").typed<SrpeSig>();
  return (transpose ? bwd : fwd)
      .call(q_in, k_in, position_ids, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq, scale);
}

std::tuple<at::Tensor, at::Tensor> srpe_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& position_ids,
                                            double theta, double spiral_divisor, double radial_amplitude,
                                            double radial_frequency, const std::optional<at::Tensor>& inv_freq,
                                            double scale) {
  return srpe_apply(false, q, k, position_ids, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq,
                    scale);
}

std::tuple<at::Tensor, at::Tensor> srpe_bwd(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                            const at::Tensor& position_ids, double theta, double spiral_divisor,
                                            double radial_amplitude, double radial_frequency,
                                            const std::optional<at::Tensor>& inv_freq, double scale) {
  return srpe_apply(true, grad_q, grad_k, position_ids, theta, spiral_divisor, radial_amplitude, radial_frequency,
                    inv_freq, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CUDA, m) {
  m.impl("srpe", &srpe_fwd);
  m.impl("srpe_backward", &srpe_bwd);
}

}  // namespace wiola::triton
