// The attention of one cached decoding step on the CPU (SPEC §5 over a KV cache), in one call.
//
// For each row b of a batch of single new positions p_b, from the step's projections
// qkv = [q | k | v] (the decoding GEMV's output, (B, (H + 2·H_kv)·d_h)):
//   1. SRPE of q and k at p_b — the SRPE kernel's own table and rotation (srpe_rotation.h) —
//      rounded to the model's dtype, as the srpe op's outputs are;
//   2. the rotated key and the value written into the caller's cache buffers at index `past`;
//   3. per head h (group g = h mod H_kv): softmax(q̃_h K̃_gᵀ / √d_h) V_g over the past + 1 keys;
//   4. with context slots (SPEC §5.3): + σ(gate_h) · Σ_λ softmax_λ(q_h · kc_λ,h / √d_h) vc_λ,h,
//      with q not rotated (one slot: weight 1, so no keys are needed);
// accumulating in float32 and rounding the head's output once.
//
// Why one op: a decoding step did this in ~15 small calls per block (SRPE, the cache update,
// two SDPA calls, the sigmoid and the gated add, views and copies between them), whose
// dispatch and Python cost more than their arithmetic: one SDPA call took longer than this
// whole op (docs/history.md, "Decoding: a block's attention as one C++ call").
//
// Work split: one task per (b, g); its R = H / H_kv query heads share every key and value row
// it reads (converted to float once per row). Every sum is one task's, in a fixed order, so the
// results do not depend on the thread count. Tasks run on one thread unless each holds enough
// work to pay for waking another (kMinTaskFlops).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "common.h"
#include "srpe_rotation.h"

namespace wiola::cpu {
namespace {

using namespace srpe_rotation;
using Vf = at::vec::Vectorized<float>;

// Floating-point work below which a parallel region costs more than it saves (~10 µs of
// arithmetic on one core; waking a second thread costs a few µs, far more on a busy machine).
constexpr int64_t kMinTaskFlops = int64_t(1) << 17;

inline float reduce_sum(const Vf& v) {
  return at::vec::vec_reduce_all<float>([](Vf& a, Vf& b) { return a + b; }, v);
}

// Σ a_i b_i.
inline float dot(const float* a, const float* b, int64_t n) {
  Vf acc(0.f);
  int64_t i = 0;
  for (; i + Vf::size() <= n; i += Vf::size()) acc = at::vec::fmadd(Vf::loadu(a + i), Vf::loadu(b + i), acc);
  float s = reduce_sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a · x.
inline void axpy(float a, const float* x, float* y, int64_t n) {
  const Vf va(a);
  int64_t i = 0;
  for (; i + Vf::size() <= n; i += Vf::size()) at::vec::fmadd(va, Vf::loadu(x + i), Vf::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

// s_i ← exp(s_i − max s) in place; returns Σ s_i (the softmax's denominator).
inline float exp_shifted(float* s, int64_t n) {
  int64_t i = 0;
  Vf vmax(-std::numeric_limits<float>::infinity());
  for (; i + Vf::size() <= n; i += Vf::size()) vmax = at::vec::maximum(vmax, Vf::loadu(s + i));
  float m = at::vec::vec_reduce_all<float>([](Vf& a, Vf& b) { return at::vec::maximum(a, b); }, vmax);
  for (; i < n; ++i) m = std::max(m, s[i]);
  const Vf vm(m);
  Vf acc(0.f);
  i = 0;
  for (; i + Vf::size() <= n; i += Vf::size()) {
    const Vf e = (Vf::loadu(s + i) - vm).exp();
    e.store(s + i);
    acc = acc + e;
  }
  float sum = reduce_sum(acc);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// x ← x rounded to scalar_t (what the srpe op's output holds).
template <typename scalar_t>
inline void round_to(float* x, scalar_t* tmp, int64_t n) {
  if constexpr (!std::is_same_v<scalar_t, float>) {
    store_row(x, tmp, n);
    load_row(tmp, x, n);
  }
}

struct Dims {
  int64_t B, H, H_kv, dh, past, n_ctx;
};

// A (B, heads, T, d_h) cache buffer's row (b, g, t).
struct CacheRows {
  int64_t sb, sh, st;
  explicit CacheRows(const at::Tensor& c) : sb(c.stride(0)), sh(c.stride(1)), st(c.stride(2)) {}
};

#if defined(CPU_CAPABILITY_AVX2)
// The eight horizontal sums of a[0..7], in order, in one vector (three rounds of hadd).
inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// scores[r·ld + j] = scale · q_r · k_j for RB heads (q rows r·dh) and keys j < n (k row stride
// dh), dh a multiple of 8: 8/RB keys at a time, one accumulator per (head, key), so each key
// row is loaded once for all RB heads and no score pays a full horizontal reduction.
template <int RB>
void key_scores_avx2(const float* q, const float* k, int64_t n, int64_t dh, float scale, float* scores, int64_t ld) {
  constexpr int KB = 8 / RB;
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + KB <= n; j += KB) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dh; i += 8) {
      __m256 kv[KB];
      for (int kk = 0; kk < KB; ++kk) kv[kk] = _mm256_loadu_ps(k + (j + kk) * dh + i);
      for (int r = 0; r < RB; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * dh + i);
        for (int kk = 0; kk < KB; ++kk) a[r * KB + kk] = _mm256_fmadd_ps(qv, kv[kk], a[r * KB + kk]);
      }
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, _mm256_mul_ps(hsum8(a), vs));
    for (int r = 0; r < RB; ++r) {
      for (int kk = 0; kk < KB; ++kk) scores[r * ld + j + kk] = out[r * KB + kk];
    }
  }
  for (; j < n; ++j) {
    for (int r = 0; r < RB; ++r) scores[r * ld + j] = dot(q + r * dh, k + j * dh, dh) * scale;
  }
}

// out[r·dh + c] = Σ_j p[r·ld + j] v_{j,c} for RB ≤ 4 heads and rows j < n of v (row stride dh),
// dh a multiple of 16: strips of 16 columns, 2·RB accumulators, each value row loaded once for
// all RB heads.
template <int RB>
void weighted_rows_avx2(const float* p, int64_t ld, const float* v, int64_t n, int64_t dh, float* out) {
  for (int64_t c = 0; c < dh; c += 16) {
    __m256 a[2 * RB];
    for (int u = 0; u < 2 * RB; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * dh + c), v1 = _mm256_loadu_ps(v + j * dh + c + 8);
      for (int r = 0; r < RB; ++r) {
        const __m256 pj = _mm256_broadcast_ss(p + r * ld + j);
        a[2 * r] = _mm256_fmadd_ps(pj, v0, a[2 * r]);
        a[2 * r + 1] = _mm256_fmadd_ps(pj, v1, a[2 * r + 1]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      _mm256_storeu_ps(out + r * dh + c, a[2 * r]);
      _mm256_storeu_ps(out + r * dh + c + 8, a[2 * r + 1]);
    }
  }
}
#endif

// scores[r·T + j] = scale · q_r · k_j for the R query rows q_r (stride dh) and the T key rows
// k_j (stride dh).
inline void key_scores(const float* q, int64_t R, const float* k, int64_t T, int64_t dh, float scale, float* scores) {
  int64_t r = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if (dh % 8 == 0) {
    for (; r + 4 <= R; r += 4) key_scores_avx2<4>(q + r * dh, k, T, dh, scale, scores + r * T, T);
    for (; r + 2 <= R; r += 2) key_scores_avx2<2>(q + r * dh, k, T, dh, scale, scores + r * T, T);
    for (; r < R; ++r) key_scores_avx2<1>(q + r * dh, k, T, dh, scale, scores + r * T, T);
  }
#endif
  for (; r < R; ++r) {
    for (int64_t j = 0; j < T; ++j) scores[r * T + j] = dot(q + r * dh, k + j * dh, dh) * scale;
  }
}

// out_r = Σ_j p[r·T + j] v_j for the R heads (out rows stride dh) over the T value rows v_j.
inline void weighted_rows(const float* p, int64_t R, const float* v, int64_t T, int64_t dh, float* out) {
  int64_t r = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if (dh % 16 == 0) {
    for (; r + 4 <= R; r += 4) weighted_rows_avx2<4>(p + r * T, T, v, T, dh, out + r * dh);
    for (; r + 2 <= R; r += 2) weighted_rows_avx2<2>(p + r * T, T, v, T, dh, out + r * dh);
    for (; r < R; ++r) weighted_rows_avx2<1>(p + r * T, T, v, T, dh, out + r * dh);
  }
#endif
  for (; r < R; ++r) {
    std::fill(out + r * dh, out + (r + 1) * dh, 0.f);
    for (int64_t j = 0; j < T; ++j) axpy(p[r * T + j], v + j * dh, out + r * dh, dh);
  }
}

// The (T, d_h) rows of one cache group as float32: the buffer itself where it already is
// (float32 rows one after the other), else converted into `buf` once for all R heads.
template <typename scalar_t>
const float* group_rows(const scalar_t* base, int64_t st, int64_t T, int64_t dh, std::vector<float>& buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (st == dh) return base;
  }
  buf.resize(T * dh);
  if (st == dh) {
    load_row(base, buf.data(), T * dh);
  } else {
    for (int64_t j = 0; j < T; ++j) load_row(base + j * st, buf.data() + j * dh, dh);
  }
  return buf.data();
}

template <typename scalar_t>
void decode_attention_kernel(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& pos,
                             const std::vector<double>& angle_freq, const std::vector<double>& radial_freq,
                             double amplitude, const at::Tensor* ctx_k, const at::Tensor* ctx_v,
                             const std::vector<float>& gate_sigmoid, at::Tensor& out, const Dims& D) {
  const int64_t B = D.B, H = D.H, H_kv = D.H_kv, dh = D.dh, R = H / H_kv, T = D.past + 1, n_ctx = D.n_ctx;
  const int64_t half = dh / 2, half_padded = static_cast<int64_t>(angle_freq.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const scalar_t* qkv_p = qkv.const_data_ptr<scalar_t>();
  const int64_t qkv_sb = qkv.stride(0);
  scalar_t* kc = k_cache.mutable_data_ptr<scalar_t>();
  scalar_t* vc = v_cache.mutable_data_ptr<scalar_t>();
  const CacheRows ks(k_cache), vs(v_cache);
  const int64_t* positions = pos.const_data_ptr<int64_t>();
  const int64_t pos_sb = pos.stride(0);
  scalar_t* out_p = out.mutable_data_ptr<scalar_t>();

  const int64_t task_flops = 4 * R * T * dh + 4 * R * n_ctx * dh;
  const int64_t grain = std::max<int64_t>(1, kMinTaskFlops / std::max<int64_t>(1, task_flops));
  at::parallel_for(0, B * H_kv, grain, [&](int64_t task_begin, int64_t task_end) {
    std::vector<float> c(half), s(half), x(dh), q(R * dh), q_rot(R * dh), row(dh), acc(R * dh);
    std::vector<float> scores(R * T), inv_sum(R), slot(std::max<int64_t>(n_ctx, 1)), k_rows, v_rows;
    std::vector<double> scratch(2 * half_padded);
    std::vector<scalar_t> tmp(dh);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t b = task / H_kv, g = task % H_kv;
      position_table<float>(static_cast<double>(positions[b * pos_sb]), angle_freq.data(), radial_freq.data(), half,
                            half_padded, amplitude, false, c.data(), s.data(), scratch.data());
      const scalar_t* in = qkv_p + b * qkv_sb;
      // The new key (rotated, rounded) and value, written at index `past`.
      scalar_t* k_base = kc + b * ks.sb + g * ks.sh;
      scalar_t* v_base = vc + b * vs.sb + g * vs.sh;
      load_row(in + (H + g) * dh, x.data(), dh);
      rotate_row<float>(x.data(), c.data(), s.data(), row.data(), half);
      store_row(row.data(), k_base + D.past * ks.st, dh);
      std::copy(in + (H + H_kv + g) * dh, in + (H + H_kv + g + 1) * dh, v_base + D.past * vs.st);
      const float* kf = group_rows(k_base, ks.st, T, dh, k_rows);
      const float* vf = group_rows(v_base, vs.st, T, dh, v_rows);
      // The group's queries as projected (for the context slots) and rotated, rounded (for the
      // cache); head h = r·H_kv + g reads group g = h mod H_kv.
      for (int64_t r = 0; r < R; ++r) {
        float* qr = q.data() + r * dh;
        float* qt = q_rot.data() + r * dh;
        load_row(in + (r * H_kv + g) * dh, qr, dh);
        rotate_row<float>(qr, c.data(), s.data(), qt, half);
        round_to(qt, tmp.data(), dh);
      }
      key_scores(q_rot.data(), R, kf, T, dh, scale, scores.data());
      for (int64_t r = 0; r < R; ++r) inv_sum[r] = 1.0f / exp_shifted(scores.data() + r * T, T);
      weighted_rows(scores.data(), R, vf, T, dh, acc.data());
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = r * H_kv + g;
        const float* qr = q.data() + r * dh;
        float* a = acc.data() + r * dh;
        for (int64_t i = 0; i < dh; ++i) a[i] *= inv_sum[r];
        if (n_ctx > 0) {  // σ(gate_h) · Σ_λ softmax_λ(q_h · kc_λ,h / √d_h) vc_λ,h
          const int64_t off = h * dh;
          if (ctx_k != nullptr) {
            const scalar_t* kp = ctx_k->const_data_ptr<scalar_t>() + b * ctx_k->stride(0) + off;
            for (int64_t l = 0; l < n_ctx; ++l) {
              load_row(kp + l * ctx_k->stride(1), row.data(), dh);
              slot[l] = dot(qr, row.data(), dh) * scale;
            }
            const float inv = 1.0f / exp_shifted(slot.data(), n_ctx);
            for (int64_t l = 0; l < n_ctx; ++l) slot[l] *= inv;
          } else {
            slot[0] = 1.0f;  // one slot
          }
          const scalar_t* vp = ctx_v->const_data_ptr<scalar_t>() + b * ctx_v->stride(0) + off;
          for (int64_t l = 0; l < n_ctx; ++l) {
            load_row(vp + l * ctx_v->stride(1), row.data(), dh);
            axpy(gate_sigmoid[h] * slot[l], row.data(), a, dh);
          }
        }
        store_row(a, out_p + b * out.stride(0) + h * dh, dh);
      }
    }
  });
}

bool decode_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void check_cache(const char* name, const at::Tensor& c, const at::Tensor& qkv, int64_t B, int64_t past) {
  WIOLA_CHECK_ARG(c.device().is_cpu(), name, " must be a CPU tensor, got ", c.device());
  TORCH_CHECK_TYPE(c.scalar_type() == qkv.scalar_type(), name, " must have qkv's dtype ", qkv.scalar_type(), ", got ",
                   c.scalar_type());
  WIOLA_CHECK_ARG(c.dim() == 4 && c.size(0) == B && c.size(1) >= 1 && c.size(3) >= 2 && c.size(3) % 2 == 0,
                  name, " must have shape (B = ", B, ", H_kv, capacity, d_h) with an even d_h, got ", c.sizes());
  WIOLA_CHECK_ARG(c.stride(3) == 1, name, " must have a contiguous last dimension, got strides ", c.strides());
  WIOLA_CHECK_ARG(past >= 0 && past < c.size(2), "past must be in [0, ", name, ".size(2) = ", c.size(2),
                  ") (the buffer needs room for the new position), got ", past);
}

void check_context(const char* name, const at::Tensor& t, const at::Tensor& qkv, int64_t B, int64_t width) {
  WIOLA_CHECK_ARG(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == qkv.scalar_type(), name, " must have qkv's dtype ", qkv.scalar_type(), ", got ",
                   t.scalar_type());
  WIOLA_CHECK_ARG(t.dim() == 3 && t.size(0) == B && t.size(1) >= 1 && t.size(2) == width, name,
                  " must have shape (B = ", B, ", slots >= 1, H·d_h = ", width, "), got ", t.sizes());
  WIOLA_CHECK_ARG(t.stride(2) == 1, name, " must have a contiguous last dimension, got strides ", t.strides());
}

// qkv (B, (H + 2·H_kv)·d_h), rows with a unit last stride; k_cache, v_cache (B, H_kv, capacity,
// d_h) buffers of qkv's dtype (written at index past); position_ids (B,) or (B, 1) int64;
// context_k, context_v (B, Λ', H·d_h) or None (context_k None: Λ' must be 1); gate (H,) with
// the context. Returns (B, H·d_h) in qkv's dtype.
at::Tensor decode_attention(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, int64_t past,
                            const at::Tensor& position_ids, int64_t n_head, double theta, double spiral_divisor,
                            double radial_amplitude, double radial_frequency,
                            const std::optional<at::Tensor>& context_k, const std::optional<at::Tensor>& context_v,
                            const std::optional<at::Tensor>& gate) {
  WIOLA_CHECK_ARG(qkv.device().is_cpu(), "qkv must be a CPU tensor, got ", qkv.device());
  TORCH_CHECK_TYPE(decode_dtype(qkv.scalar_type()), "qkv must be float32, bfloat16 or float16, got ",
                   qkv.scalar_type());
  WIOLA_CHECK_ARG(qkv.dim() == 2 && qkv.size(0) >= 1 && qkv.stride(1) == 1,
                  "qkv must have shape (B, (H + 2·H_kv)·d_h) with B >= 1 and a contiguous last dimension, got shape ",
                  qkv.sizes(), " and strides ", qkv.strides());
  const int64_t B = qkv.size(0);
  check_cache("k_cache", k_cache, qkv, B, past);
  check_cache("v_cache", v_cache, qkv, B, past);
  WIOLA_CHECK_ARG(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ", k_cache.sizes(), ", got ",
                  v_cache.sizes());
  const int64_t H_kv = k_cache.size(1), dh = k_cache.size(3);
  WIOLA_CHECK_ARG(n_head >= 1 && n_head % H_kv == 0, "n_head must be a positive multiple of H_kv = ", H_kv, ", got ",
                  n_head);
  WIOLA_CHECK_ARG(qkv.size(1) == (n_head + 2 * H_kv) * dh, "qkv must have (n_head + 2·H_kv)·d_h = ",
                  (n_head + 2 * H_kv) * dh, " columns, got ", qkv.size(1));
  WIOLA_CHECK_ARG(position_ids.device().is_cpu(), "position_ids must be a CPU tensor, got ", position_ids.device());
  TORCH_CHECK_TYPE(position_ids.scalar_type() == at::kLong, "position_ids must be int64, got ",
                   position_ids.scalar_type());
  WIOLA_CHECK_ARG((position_ids.dim() == 1 || (position_ids.dim() == 2 && position_ids.size(1) == 1)) &&
                      position_ids.size(0) == B,
                  "position_ids must have shape (B,) or (B, 1) with B = ", B, ", got ", position_ids.sizes());
  WIOLA_CHECK_ARG(std::isfinite(theta) && theta > 0, "theta must be a positive finite number, got ", theta);
  WIOLA_CHECK_ARG(spiral_divisor != 0 && !std::isnan(spiral_divisor),
                  "spiral_divisor must be non-zero (±inf: plain RoPE), got ", spiral_divisor);
  WIOLA_CHECK_ARG(std::isfinite(radial_amplitude) && std::isfinite(radial_frequency),
                  "radial_amplitude and radial_frequency must be finite, got ", radial_amplitude, " and ",
                  radial_frequency);
  const int64_t width = n_head * dh;
  int64_t n_ctx = 0;
  std::vector<float> gate_sigmoid;
  if (context_v.has_value()) {
    check_context("context_v", *context_v, qkv, B, width);
    n_ctx = context_v->size(1);
    if (context_k.has_value()) {
      check_context("context_k", *context_k, qkv, B, width);
      WIOLA_CHECK_ARG(context_k->size(1) == n_ctx, "context_k must have context_v's ", n_ctx, " slots, got ",
                      context_k->size(1));
    } else {
      WIOLA_CHECK_ARG(n_ctx == 1, "context_k may be None only with one context slot; context_v has ", n_ctx);
    }
    WIOLA_CHECK_ARG(gate.has_value(), "gate (H,) is required with context_v");
    WIOLA_CHECK_ARG(gate->device().is_cpu() && gate->dim() == 1 && gate->size(0) == n_head,
                    "gate must be a CPU tensor of shape (n_head = ", n_head, ",), got ", gate->sizes(), " on ",
                    gate->device());
    TORCH_CHECK_TYPE(at::isFloatingType(gate->scalar_type()), "gate must be a floating tensor, got ",
                     gate->scalar_type());
    gate_sigmoid.resize(n_head);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate->scalar_type(), "decode_attention_gate", [&] {
      const scalar_t* gp = gate->const_data_ptr<scalar_t>();
      for (int64_t h = 0; h < n_head; ++h) {
        gate_sigmoid[h] = 1.0f / (1.0f + std::exp(-static_cast<float>(gp[h * gate->stride(0)])));
      }
    });
  } else {
    WIOLA_CHECK_ARG(!context_k.has_value(), "context_k needs context_v");
  }
  const at::Tensor pos = position_ids.dim() == 2 ? position_ids.select(1, 0) : position_ids;

  const int64_t half_padded = (dh / 2 + VD::size() - 1) / VD::size() * VD::size();
  std::vector<double> angle_freq, radial_freq;
  pair_frequencies(dh, theta, spiral_divisor, radial_frequency, half_padded, angle_freq, radial_freq);
  at::Tensor out = empty_output({B, width}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  const Dims D{B, n_head, H_kv, dh, past, n_ctx};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "decode_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_INTERNAL_ASSERT(false, "decode_attention: float64 qkv was refused above");
    } else {
      decode_attention_kernel<scalar_t>(qkv, k_cache, v_cache, pos, angle_freq, radial_freq, radial_amplitude,
                                        context_k.has_value() ? &*context_k : nullptr,
                                        context_v.has_value() ? &*context_v : nullptr, gate_sigmoid, out, D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CPU, m) { m.impl("_decode_attention", &decode_attention); }

}  // namespace wiola::cpu
