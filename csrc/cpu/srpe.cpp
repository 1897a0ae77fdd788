// SRPE, spiral rotary position encoding, on the CPU (SPEC §4).
//
// For position p and pair j ∈ [0, d_h/2) (pairs (j, j + d_h/2), "rotate half"):
//
//   Θ_j(p) = p · angle_freq_j,   angle_freq_j  = ω_j (1 + 1/k_s)
//   r_j(p) = 1 + a_s sin(p · radial_freq_j),    radial_freq_j = f_s ω_j
//
// Plain RoPE (Hugging Face models) is k_s = ∞, a_s = 0: angle_freq_j = ω_j (the caller
// forms 1 + 1/k_s = 1) and r = 1, with the same float64 angle reduction. ω_j is θ₀^(−2j/d_h),
// or given (inv_freq: a rope type's frequencies, read in float64); the output scale m (a
// rope type's attention factor) multiplies r.
//   c = m r cos Θ,  s = m r sin Θ
//   y_j = x_j c − x_{j+h} s,     y_{j+h} = x_j s + x_{j+h} c        (h = d_h/2)
//
// transpose=true applies R(p)ᵀ (s → −s): the backward, ∂L/∂x = R(p)ᵀ ∂L/∂y.
//
// Work split: a task is (block of kTileT consecutive rows t, batch b), ordered t-major.
// It first builds the (c, s) table of its positions once — p·freq in double, reduced
// modulo π/2 in double (Cody–Waite), double sin/cos polynomials four pairs at a time —
// and then streams every head of q (H) and of k (H_kv) over those rows, in memory order:
// head by head for (B, H, T, d_h)-contiguous tensors (a head's block is kTileT·d_h
// contiguous elements), row by row for the model's transposed (B, T, H, d_h) views (a
// row's heads are adjacent); the table (kTileT·d_h/2 (c, s) pairs) stays in L1. q, k and
// positions are read through their strides (d_h contiguous), and each output takes its
// input's layout (empty_output_like), so no copy is made on either side. When consecutive tasks of a thread
// have the same positions (the usual position_ids = arange(T) shared by the batch),
// the table is reused instead of rebuilt. The rotation runs in float (double for double
// inputs); bf16/fp16 rows are converted through a float scratch row. Memory traffic is
// one read and one write of q and k, which is the floor; large float32 outputs are
// written with non-temporal stores (no read-for-ownership of the output lines).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>


#include "common.h"
#include "srpe_rotation.h"
#include "wiola/checks.h"

namespace wiola::cpu {
namespace {

using namespace srpe_rotation;

constexpr int64_t kTileT = 32;  // rows (positions) per task; table = kTileT·d_h/2 (c, s) pairs
constexpr int64_t kMinElemsPerThread = int64_t(1) << 18;  // parallel grain, in q/k elements

// The strides of one (B, heads, T, d_h) input and of its output.
struct IoStrides {
  RowStrides in, out;
};

template <typename scalar_t>
void srpe_kernel(const scalar_t* q, const scalar_t* k, const int64_t* positions, int64_t pos_sb, int64_t pos_st,
                 const double* angle_freq, const double* radial_freq, double amplitude, double scale, bool transpose,
                 scalar_t* q_out, scalar_t* k_out, const IoStrides& qs, const IoStrides& ks, int64_t B, int64_t H,
                 int64_t H_kv, int64_t T, int64_t dh) {
  using acc_t = acc_type<scalar_t>;
  constexpr bool kSameType = std::is_same_v<scalar_t, acc_t>;
  const int64_t half = dh / 2;
  const int64_t half_padded = (half + VD::size() - 1) / VD::size() * VD::size();
  std::vector<double> af(half_padded, 0.0), rf(half_padded, 0.0);
  std::copy(angle_freq, angle_freq + half, af.begin());
  std::copy(radial_freq, radial_freq + half, rf.begin());
  const int64_t tiles = (T + kTileT - 1) / kTileT;
  // Non-temporal stores for large float outputs (see common.h); q and k rows both aligned.
  const int64_t out_bytes = (H + H_kv) * B * T * dh * static_cast<int64_t>(sizeof(scalar_t));
  // Streaming also needs every output row 32-byte aligned: row offsets multiples of 8 floats.
  const bool rows_aligned = (qs.out.sb | qs.out.sh | qs.out.st | ks.out.sb | ks.out.sh | ks.out.st) % 8 == 0;
  const bool stream = half % 8 == 0 && rows_aligned && use_streaming_stores(q_out, out_bytes, dh) &&
                      use_streaming_stores(k_out, kStreamMinBytes, dh);
  // Each task moves (H + H_kv)·kTileT·d_h elements. A thread gets at least
  // kMinElemsPerThread of them (~1 MB read + written in fp32, ~0.1 ms): below that, waking
  // another thread costs more than it saves, and on a busy machine far more (docs/performance.md).
  const int64_t task_elems = std::max<int64_t>(1, (H + H_kv) * std::min(kTileT, T) * dh);
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerThread / task_elems);
  at::parallel_for(0, tiles * B, grain, [&](int64_t task_begin, int64_t task_end) {
    std::vector<acc_t> ctab(kTileT * half), stab(kTileT * half);
    std::vector<double> scratch(2 * half_padded);
    std::vector<acc_t> xrow(kSameType ? 0 : dh), orow(kSameType ? 0 : dh);
    std::vector<int64_t> table_pos(kTileT), pos(kTileT);  // positions the table holds; this task's
    int64_t table_nt = 0;
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t b = task % B;
      const int64_t t0 = (task / B) * kTileT;
      const int64_t nt = std::min(kTileT, T - t0);
      for (int64_t i = 0; i < nt; ++i) pos[i] = positions[b * pos_sb + (t0 + i) * pos_st];
      if (nt != table_nt || !std::equal(pos.begin(), pos.begin() + nt, table_pos.begin())) {
        for (int64_t i = 0; i < nt; ++i) {
          position_table<acc_t>(static_cast<double>(pos[i]), af.data(), rf.data(), half, half_padded, amplitude,
                                transpose, ctab.data() + i * half, stab.data() + i * half, scratch.data(), scale);
        }
        std::copy(pos.begin(), pos.begin() + nt, table_pos.begin());
        table_nt = nt;
      }
      auto rotate = [&](const scalar_t* x, scalar_t* y, int64_t i) {
        if constexpr (kSameType) {
          if (stream) {
            rotate_row<acc_t, true>(x, ctab.data() + i * half, stab.data() + i * half, y, half);
          } else {
            rotate_row<acc_t>(x, ctab.data() + i * half, stab.data() + i * half, y, half);
          }
        } else {
          load_row(x, xrow.data(), dh);
          rotate_row<acc_t>(xrow.data(), ctab.data() + i * half, stab.data() + i * half, orow.data(), half);
          store_row(orow.data(), y, dh);
        }
      };
      auto sweep = [&](const scalar_t* src, scalar_t* dst, int64_t heads, const IoStrides& st) {
        if (st.in.sh < st.in.st) {  // heads adjacent in memory: (B, T, H, d_h) order
          for (int64_t i = 0; i < nt; ++i) {
            for (int64_t h = 0; h < heads; ++h) rotate(src + st.in(b, h, t0 + i), dst + st.out(b, h, t0 + i), i);
          }
        } else {
          for (int64_t h = 0; h < heads; ++h) {
            for (int64_t i = 0; i < nt; ++i) rotate(src + st.in(b, h, t0 + i), dst + st.out(b, h, t0 + i), i);
          }
        }
      };
      sweep(q, q_out, H, qs);
      sweep(k, k_out, H_kv, ks);
    }
#if defined(CPU_CAPABILITY_AVX2)
    if (stream) stream_fence();
#endif
  });
}

// R(p) (or R(p)ᵀ when transpose) of q and k; the checks of wiola::srpe (wiola/checks.h)
// with the inputs named q_name / k_name.
std::tuple<at::Tensor, at::Tensor> srpe_apply(const char* q_name, const at::Tensor& q_in, const char* k_name,
                                              const at::Tensor& k_in, const at::Tensor& position_ids, double theta,
                                              double spiral_divisor, double radial_amplitude,
                                              double radial_frequency, const std::optional<at::Tensor>& inv_freq,
                                              double scale, bool transpose) {
  const at::Tensor positions = checks::srpe(q_name, q_in, k_name, k_in, position_ids, theta, spiral_divisor,
                                            radial_amplitude, radial_frequency, inv_freq, scale);
  const at::Tensor q = checks::unit_last_stride(q_in), k = checks::unit_last_stride(k_in);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), dh = q.size(3), H_kv = k.size(1);
  at::Tensor q_out = empty_output_like(q);
  at::Tensor k_out = empty_output_like(k);
  if (B * T == 0) return {q_out, k_out};
  // Per-pair frequencies in float64 (SPEC §4): angle ω_j (1 + 1/k_s), radial f_s ω_j.
  std::vector<double> angle_freq, radial_freq;
  at::Tensor omega;  // given frequencies as contiguous float64 (a view when they already are)
  if (inv_freq.has_value()) omega = inv_freq->to(at::kDouble).contiguous();
  pair_frequencies(dh, theta, spiral_divisor, radial_frequency, dh / 2, angle_freq, radial_freq,
                   omega.defined() ? omega.const_data_ptr<double>() : nullptr);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "wiola_srpe", [&] {
    srpe_kernel<scalar_t>(q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
                          positions.const_data_ptr<int64_t>(), positions.stride(0), positions.stride(1),
                          angle_freq.data(), radial_freq.data(), radial_amplitude, scale, transpose,
                          q_out.mutable_data_ptr<scalar_t>(), k_out.mutable_data_ptr<scalar_t>(),
                          IoStrides{RowStrides(q), RowStrides(q_out)}, IoStrides{RowStrides(k), RowStrides(k_out)}, B,
                          H, H_kv, T, dh);
  });
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> srpe_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& position_ids,
                                            double theta, double spiral_divisor, double radial_amplitude,
                                            double radial_frequency, const std::optional<at::Tensor>& inv_freq,
                                            double scale) {
  return srpe_apply("q", q, "k", k, position_ids, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq,
                    scale, false);
}

std::tuple<at::Tensor, at::Tensor> srpe_bwd(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                            const at::Tensor& position_ids, double theta, double spiral_divisor,
                                            double radial_amplitude, double radial_frequency,
                                            const std::optional<at::Tensor>& inv_freq, double scale) {
  return srpe_apply("grad_q", grad_q, "grad_k", grad_k, position_ids, theta, spiral_divisor, radial_amplitude,
                    radial_frequency, inv_freq, scale, true);
}

}  // namespace

// The op's schemas, declared once, here beside its CPU kernels: every build of the op compiles this file.
// set_python_module names the module that registers the op's fakes and Python kernels.
TORCH_LIBRARY_FRAGMENT(wiola, m) {
  m.set_python_module("wiola_kernels.ops.srpe");
  // q (B, H, T, d_h), k (B, H_kv, T, d_h), any strides; position_ids (B, T) / (1, T) / (T,) of
  // an index dtype. Outputs laid out like torch.empty_like(q) / (k). The backward applies
  // R(p)ᵀ to the incoming gradients (rotation by −Θ scaled by r).
  // inv_freq: given per-pair frequencies ω_j (d_h/2,), used in float64 in place of
  // θ₀^(−2j/d_h) (a Hugging Face rope type's); scale: the output scale m (y = m R(p) q).
  m.def("srpe(Tensor q, Tensor k, Tensor position_ids, float theta=10000.0, float spiral_divisor=8.0,"
        " float radial_amplitude=0.1, float radial_frequency=0.01, Tensor? inv_freq=None, float scale=1.0)"
        " -> (Tensor q_out, Tensor k_out)");
  m.def("srpe_backward(Tensor grad_q, Tensor grad_k, Tensor position_ids, float theta, float spiral_divisor,"
        " float radial_amplitude, float radial_frequency, Tensor? inv_freq=None, float scale=1.0)"
        " -> (Tensor grad_q_in, Tensor grad_k_in)");
  // The Python Triton launchers of srpe (CUDA only, registered from Python): where the cubin tables
  // have no variant for a call, the C++ CUDA kernel (csrc/cuda/triton_srpe_binding.cpp) runs these.
  m.def("_triton_srpe(Tensor q, Tensor k, Tensor position_ids, float theta=10000.0, float spiral_divisor=8.0,"
        " float radial_amplitude=0.1, float radial_frequency=0.01, Tensor? inv_freq=None, float scale=1.0)"
        " -> (Tensor q_out, Tensor k_out)");
  m.def("_triton_srpe_backward(Tensor grad_q, Tensor grad_k, Tensor position_ids, float theta, float spiral_divisor,"
        " float radial_amplitude, float radial_frequency, Tensor? inv_freq=None, float scale=1.0)"
        " -> (Tensor grad_q_in, Tensor grad_k_in)");
}

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("srpe", &srpe_fwd);
  m.impl("srpe_backward", &srpe_bwd);
}

}  // namespace wiola::cpu
