// ATM greedy adjacent merge / unmerge on the CPU (SPEC §6; the formulas are in
// wiola_kernels/reference/atm.py).
//
// Merge, with at least as many rows as threads: rows in parallel, each streamed once —
// per token, ‖x_{t+1}‖² and ⟨x_t, x_{t+1}⟩, the candidate test s_t > τ (decided in double
// from the sums, without a square root; similarity 0 for a zero norm; a token whose norm is
// out of the safe range is first rescaled by a power of two), the greedy step, and
// the slot write (x_t, or the pair mean) while both rows are in L1: x is read from
// memory once and merged written once. With fewer rows than threads, three parallel
// steps instead (sums over all tokens, greedy scan per row, gather per slot); both paths
// compute every sum with the same functions, so they decide identically.
// Unmerge is a row gather. Backwards: merge is a gather scaled by ½ / 1 / 0; unmerge is
// a segment sum per (row, column block) in token order, so it is deterministic for any
// index map (each slot is rounded once for maps from merge).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "wiola/checks.h"
#include "wiola/cuda_schemas.h"

namespace wiola::cpu {
namespace {

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

constexpr int64_t kColumnBlock = 512;  // unmerge backward: columns per task

// ‖a‖² and ⟨a, b⟩. Every backend path computes each sum with these two functions, so a
// token's norm is the same number whichever path (streaming or phased) computed it.
template <typename acc_t>
inline acc_t row_norm_sq(const acc_t* a, int64_t d) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  V v0(0), v1(0);
  int64_t i = 0;
  for (; i + 2 * L <= d; i += 2 * L) {
    const V a0 = V::loadu(a + i), a1 = V::loadu(a + i + L);
    v0 = at::vec::fmadd(a0, a0, v0);
    v1 = at::vec::fmadd(a1, a1, v1);
  }
  acc_t total = at::vec::vec_reduce_all<acc_t>([](V p, V q) { return p + q; }, v0 + v1);
  for (; i < d; ++i) total += a[i] * a[i];
  return total;
}

template <typename acc_t>
inline acc_t row_dot(const acc_t* a, const acc_t* b, int64_t d) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  V v0(0), v1(0);
  int64_t i = 0;
  for (; i + 2 * L <= d; i += 2 * L) {
    v0 = at::vec::fmadd(V::loadu(a + i), V::loadu(b + i), v0);
    v1 = at::vec::fmadd(V::loadu(a + i + L), V::loadu(b + i + L), v1);
  }
  acc_t total = at::vec::vec_reduce_all<acc_t>([](V p, V q) { return p + q; }, v0 + v1);
  for (; i < d; ++i) total += a[i] * b[i];
  return total;
}

// Squared norms at which the unscaled sums are exact up to ordinary rounding: no partial
// sum overflows (|D| ≤ √(n_t n_{t+1})), N = n_t·n_{t+1} is a normal double, and subnormal
// roundings (≤ d·2^-150 absolute in float) stay far below one ulp of the sums.
template <typename acc_t>
struct SafeNorm;
template <>
struct SafeNorm<float> {
  static constexpr float lo = 0x1p-60f, hi = 0x1p100f;
};
template <>
struct SafeNorm<double> {
  static constexpr double lo = 0x1p-500, hi = 0x1p500;
};

// Tokens of x as acc_t rows with their squared norms, cached for the two most recent
// tokens. s_t > τ is homogeneous in each token, so a token whose norm is outside SafeNorm
// (overflowed, underflowed, or too small for full precision) is replaced by x_t·2^-e,
// e = exponent of max|x_t| (max lands in [0.5, 1); exact but for elements ~2^-126 below
// the max): the decision is then the same at every magnitude. Zero and non-finite tokens
// stay as they are. Every path takes its norms and rows from here, so they all agree.
template <typename scalar_t>
class Tokens {
 public:
  using acc_t = acc_type<scalar_t>;
  struct Token {
    const acc_t* row;
    acc_t norm_sq;
  };
  Tokens(const scalar_t* x, int64_t d) : x_(x), d_(d) {
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      buf_[0].resize(d);
      buf_[1].resize(d);
    }
  }
  // The returned row stays valid until the token after next is requested.
  Token get(int64_t t) {
    for (int k = 0; k < 2; ++k) {
      if (tag_[k] == t) return tok_[k];
    }
    const int k = tag_[0] < tag_[1] ? 0 : 1;  // replace the older token
    const acc_t* p;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      p = x_ + t * d_;
    } else {
      load_row(x_ + t * d_, buf_[k].data(), d_);
      p = buf_[k].data();
    }
    acc_t n = row_norm_sq(p, d_);
    if (!(n >= SafeNorm<acc_t>::lo && n <= SafeNorm<acc_t>::hi) && !std::isnan(n)) {  // NaN: a NaN element
      acc_t mx = 0;
      for (int64_t i = 0; i < d_; ++i) mx = std::max(mx, std::abs(p[i]));
      if (mx > 0 && std::isfinite(mx)) {
        int e = 0;
        std::frexp(mx, &e);
        buf_[k].resize(d_);  // no reallocation when p already points into it
        acc_t* q = buf_[k].data();
        for (int64_t i = 0; i < d_; ++i) q[i] = std::ldexp(p[i], -e);
        p = q;
        n = row_norm_sq(p, d_);
      }
    }
    tag_[k] = t;
    tok_[k] = Token{p, n};
    return tok_[k];
  }

 private:
  const scalar_t* x_;
  int64_t d_;
  std::vector<acc_t> buf_[2];
  int64_t tag_[2] = {-2, -1};
  Token tok_[2] = {};
};

// s_t > τ decided in double without a square root (wiola_kernels/reference/atm.py), with
// D = ⟨x_t, x_{t+1}⟩, n_t = ‖x_t‖². D and τ are scaled together by a power of two so that
// D² and τ²N neither underflow nor overflow: the comparison is that of an unbounded
// exponent range. NaN/Inf tokens are never candidates.
inline bool is_candidate(double D, double n0, double n1, double tau) {
  if (!(tau < 1.0)) return false;
  const double n = n0 * n1;
  if (!std::isfinite(n) || !std::isfinite(D)) return false;
  if (n == 0.0) return tau < 0.0;
  if (D > 0.0 && tau < 0.0) return true;
  if (!(D > 0.0) && !(tau < 0.0)) return false;
  int e = 0;
  std::frexp(std::max(std::abs(D), std::abs(tau)), &e);  // > 0 here
  const double ds = std::ldexp(D, -e), ts = std::ldexp(tau, -e);
  const double d2 = ds * ds, t2n = (ts * ts) * n;
  return D > 0.0 ? d2 > t2n : d2 < t2n;
}

// One merged slot: a copy of x0, or the mean of x0 and x1 (x1 == nullptr: singleton).
template <typename scalar_t>
inline void write_slot(const scalar_t* x0, const scalar_t* x1, scalar_t* out, int64_t d,
                       std::vector<acc_type<scalar_t>>& scratch) {
  using acc_t = acc_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  if (x1 == nullptr) {
    std::memcpy(out, x0, d * sizeof(scalar_t));
    return;
  }
  const acc_t* p0;
  const acc_t* p1;
  acc_t* o;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    p0 = x0;
    p1 = x1;
    o = out;
  } else {
    scratch.resize(2 * d);
    load_row(x0, scratch.data(), d);
    load_row(x1, scratch.data() + d, d);
    p0 = o = scratch.data();
    p1 = scratch.data() + d;
  }
  // (a + b)·½ is the correctly rounded mean (a sum below 2^-125 is exact; above, halving
  // is), except where a + b overflows: there a·½ + b·½ is (both halves are exact).
  const V half(acc_t(0.5)), inf(std::numeric_limits<acc_t>::infinity());
  int64_t j = 0;
  for (; j + L <= d; j += L) {
    const V a = V::loadu(p0 + j), b = V::loadu(p1 + j);
    const V m = (a + b) * half;
    V::blendv(m, a * half + b * half, m.abs() == inf).store(o + j);
  }
  for (; j < d; ++j) {
    const acc_t m = (p0[j] + p1[j]) * acc_t(0.5);
    o[j] = std::isinf(m) ? p0[j] * acc_t(0.5) + p1[j] * acc_t(0.5) : m;
  }
  if constexpr (!std::is_same_v<scalar_t, acc_t>) store_row(o, out, d);
}

// Padding tokens map into the zero region; slots from T' on hold zeros and position 0.
template <typename scalar_t>
void finish_row(int64_t merged_len, int64_t len, int64_t T, int64_t d, int64_t* map, int64_t* mpos,
                scalar_t* merged) {
  for (int64_t p = len; p < T; ++p) map[p] = merged_len + (p - len);
  for (int64_t s = merged_len; s < T; ++s) mpos[s] = 0;
  if (merged != nullptr) std::fill(merged + merged_len * d, merged + T * d, scalar_t(0));
}

// Streaming merge of one row (used when there are at least as many rows as threads): the
// greedy scan runs token by token, each decision needs only x_t and x_{t+1}, and the slot
// is written while both rows are still in L1, so x is read from memory once.
template <typename scalar_t>
void merge_row_streaming(const scalar_t* x, const int64_t* pos, int64_t len, double tau, int64_t T, int64_t d,
                         scalar_t* merged, int64_t* map, int64_t* mpos, int64_t* mlen,
                         std::vector<acc_type<scalar_t>>& scratch) {
  Tokens<scalar_t> tokens(x, d);
  int64_t slot = 0, t = 0;
  while (t < len) {
    bool take = false;
    if (t + 1 < len) {
      const auto a = tokens.get(t), b = tokens.get(t + 1);
      take = is_candidate(row_dot(a.row, b.row, d), a.norm_sq, b.norm_sq, tau);
    }
    map[t] = slot;
    mpos[slot] = pos[t];
    write_slot<scalar_t>(x + t * d, take ? x + (t + 1) * d : nullptr, merged + slot * d, d, scratch);
    if (take) map[t + 1] = slot;
    t += take ? 2 : 1;
    ++slot;
  }
  *mlen = slot;
  finish_row(slot, len, T, d, map, mpos, merged);
}

// Phased merge (fewer rows than threads), step 1 over flattened tokens (rescaled as Tokens
// does): nsq[i] = ‖x_i‖², dot[i] = ⟨x_i, x_{i+1}⟩ (0 at a row's end).
template <typename scalar_t>
void norms_and_dots(const scalar_t* x, acc_type<scalar_t>* nsq, acc_type<scalar_t>* dot, int64_t n_tokens,
                    int64_t T, int64_t d) {
  at::parallel_for(0, n_tokens, std::max<int64_t>(1, 32768 / d), [&](int64_t begin, int64_t end) {
    Tokens<scalar_t> tokens(x, d);
    for (int64_t i = begin; i < end; ++i) {
      const auto a = tokens.get(i);
      nsq[i] = a.norm_sq;
      dot[i] = (i % T) + 1 < T ? row_dot(a.row, tokens.get(i + 1).row, d) : 0;
    }
  });
}

// Step 2, one row: the greedy scan; src[s] = 2·first + paired for s < T', −1 after.
template <typename acc_t>
void scan_row(const acc_t* nsq, const acc_t* dot, const int64_t* pos, int64_t len, double tau, int64_t T,
              int64_t* index_map, int64_t* merged_pos, int64_t* merged_len, int64_t* src) {
  int64_t slot = 0, t = 0;
  while (t < len) {
    bool take = false;
    if (t + 1 < len) {
      take = is_candidate(dot[t], nsq[t], nsq[t + 1], tau);
    }
    index_map[t] = slot;
    merged_pos[slot] = pos[t];
    src[slot] = 2 * t + (take ? 1 : 0);
    if (take) index_map[t + 1] = slot;
    t += take ? 2 : 1;
    ++slot;
  }
  *merged_len = slot;
  finish_row<float>(slot, len, T, 0, index_map, merged_pos, nullptr);
  for (int64_t s = slot; s < T; ++s) src[s] = -1;
}

// Step 3 over flattened slots.
template <typename scalar_t>
void gather_average(const scalar_t* x, const int64_t* src, scalar_t* merged, int64_t n_slots, int64_t T,
                    int64_t d) {
  at::parallel_for(0, n_slots, std::max<int64_t>(1, 32768 / d), [&](int64_t begin, int64_t end) {
    std::vector<acc_type<scalar_t>> scratch;
    for (int64_t i = begin; i < end; ++i) {
      scalar_t* out = merged + i * d;
      const int64_t code = src[i];
      if (code < 0) {
        std::fill(out, out + d, scalar_t(0));
        continue;
      }
      const scalar_t* x0 = x + ((i / T) * T + (code >> 1)) * d;
      write_slot<scalar_t>(x0, (code & 1) ? x0 + d : nullptr, out, d, scratch);
    }
  });
}

// Merge backward over flattened tokens: grad_x_t = w_t · g_{slot(t)}.
template <typename scalar_t>
void scatter_halves(const scalar_t* g, const int64_t* map, const int64_t* mlen, scalar_t* out, int64_t B, int64_t T,
                    int64_t d) {
  using acc_t = acc_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  at::parallel_for(0, B * T, std::max<int64_t>(1, 32768 / d), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(std::is_same_v<scalar_t, acc_t> ? 0 : d);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / T, t = i % T, slot = map[i];
      scalar_t* o = out + i * d;
      if (slot >= mlen[row]) {  // padding: zero gradient
        std::fill(o, o + d, scalar_t(0));
        continue;
      }
      const bool paired = (t > 0 && map[i - 1] == slot) || (t + 1 < T && map[i + 1] == slot);
      const scalar_t* gs = g + (row * T + slot) * d;
      if (!paired) {
        std::memcpy(o, gs, d * sizeof(scalar_t));
        continue;
      }
      const acc_t* p;
      acc_t* q;
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        p = gs;
        q = o;
      } else {
        load_row(gs, buf.data(), d);
        p = q = buf.data();
      }
      const V half(acc_t(0.5));
      int64_t j = 0;
      for (; j + L <= d; j += L) (V::loadu(p + j) * half).store(q + j);
      for (; j < d; ++j) q[j] = p[j] * acc_t(0.5);
      if constexpr (!std::is_same_v<scalar_t, acc_t>) store_row(q, o, d);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> atm_merge(const at::Tensor& x_in,
                                                                     const at::Tensor& position_ids, double threshold,
                                                                     const std::optional<at::Tensor>& lengths_in) {
  const checks::AtmMergeArgs args = checks::atm_merge(x_in, position_ids, threshold, lengths_in);
  const at::Tensor x = x_in.contiguous(), positions = args.positions.contiguous(), lengths = args.lengths;
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2);
  const int64_t* len = lengths.const_data_ptr<int64_t>();
  const auto acc = acc_scalar_type(x);
  at::Tensor merged = empty_output(x.sizes(), x.options());
  at::Tensor merged_pos = empty_output({B, T}, positions.options());
  at::Tensor merged_len = empty_output({B}, lengths.options());
  at::Tensor index_map = empty_output({B, T}, positions.options());
  if (B * T == 0) return {merged, merged_pos, merged_len.copy_(lengths), index_map};
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  int64_t* map = index_map.mutable_data_ptr<int64_t>();
  int64_t* mpos = merged_pos.mutable_data_ptr<int64_t>();
  int64_t* mlen = merged_len.mutable_data_ptr<int64_t>();
  if (B >= at::get_num_threads()) {  // rows in parallel, each streamed once
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "wiola_atm_merge", [&] {
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      scalar_t* out = merged.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, B, std::max<int64_t>(1, 32768 / (T * d)), [&](int64_t b0, int64_t b1) {
        std::vector<acc_type<scalar_t>> scratch;
        for (int64_t b = b0; b < b1; ++b) {
          merge_row_streaming<scalar_t>(xp + b * T * d, pos + b * T, len[b], threshold, T, d, out + b * T * d,
                                        map + b * T, mpos + b * T, mlen + b, scratch);
        }
      });
    });
    return {merged, merged_pos, merged_len, index_map};
  }
  at::Tensor nsq = at::empty({B * T}, x.options().dtype(acc));
  at::Tensor dot = at::empty({B * T}, x.options().dtype(acc));
  at::Tensor src = at::empty({B * T}, positions.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "wiola_atm_merge", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    acc_t* nsq_p = nsq.mutable_data_ptr<acc_t>();
    acc_t* dot_p = dot.mutable_data_ptr<acc_t>();
    norms_and_dots<scalar_t>(xp, nsq_p, dot_p, B * T, T, d);
    int64_t* srcp = src.mutable_data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {  // fewer rows than threads: cheap next to steps 1 and 3
      scan_row<acc_t>(nsq_p + b * T, dot_p + b * T, pos + b * T, len[b], threshold, T, map + b * T, mpos + b * T,
                      mlen + b, srcp + b * T);
    }
    gather_average<scalar_t>(xp, srcp, merged.mutable_data_ptr<scalar_t>(), B * T, T, d);
  });
  return {merged, merged_pos, merged_len, index_map};
}

at::Tensor atm_merge_bwd(const at::Tensor& grad_in, const at::Tensor& map_in, const at::Tensor& merged_lengths_in) {
  checks::atm_unmerge("grad_merged", grad_in, map_in);
  const at::Tensor grad_merged = grad_in.contiguous(), index_map = map_in.contiguous();
  const int64_t B = grad_merged.size(0), T = grad_merged.size(1), d = grad_merged.size(2);
  TORCH_CHECK_TYPE(merged_lengths_in.scalar_type() == at::kLong, "merged_lengths must have dtype in (int64), got ",
                   checks::dtype_name(merged_lengths_in.scalar_type()));
  checks::shape("merged_lengths", merged_lengths_in, {B}, "(B,)");
  const at::Tensor merged_lengths = merged_lengths_in.contiguous();
  at::Tensor grad_x = empty_output(grad_merged.sizes(), grad_merged.options());
  const int64_t* map = index_map.const_data_ptr<int64_t>();
  const int64_t* mlen = merged_lengths.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_merged.scalar_type(), "wiola_atm_merge_bwd", [&] {
    scatter_halves<scalar_t>(grad_merged.const_data_ptr<scalar_t>(), map, mlen, grad_x.mutable_data_ptr<scalar_t>(),
                             B, T, d);
  });
  return grad_x;
}

at::Tensor atm_unmerge(const at::Tensor& y_in, const at::Tensor& map_in) {
  checks::atm_unmerge("y", y_in, map_in);
  const at::Tensor y = y_in.contiguous(), index_map = map_in.contiguous();
  const int64_t B = y.size(0), T = y.size(1), d = y.size(2);
  at::Tensor out = empty_output(y.sizes(), y.options());
  const int64_t* map = index_map.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "wiola_atm_unmerge", [&] {
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, B * T, std::max<int64_t>(1, 32768 / d), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(op + i * d, yp + ((i / T) * T + map[i]) * d, d * sizeof(scalar_t));
      }
    });
  });
  return out;
}

// Segment sum in token order for columns [c0, c1) of one row. A run of consecutive tokens
// with the same slot is summed in acc_t and stored once (a run of one is a plain copy);
// a slot met again later (only for maps not produced by merge) is added to what is there.
template <typename scalar_t>
void segment_sum_block(const scalar_t* g, const int64_t* map, scalar_t* out, int64_t T, int64_t d, int64_t c0,
                       int64_t c1, std::vector<acc_type<scalar_t>>& acc, std::vector<acc_type<scalar_t>>& tmp,
                       std::vector<char>& written) {
  using acc_t = acc_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  const int64_t w = c1 - c0;
  const auto add_into_acc = [&](const scalar_t* src) {
    load_row(src, tmp.data(), w);
    int64_t j = 0;
    for (; j + L <= w; j += L) (V::loadu(acc.data() + j) + V::loadu(tmp.data() + j)).store(acc.data() + j);
    for (; j < w; ++j) acc[j] += tmp[j];
  };
  std::fill(written.begin(), written.end(), 0);
  for (int64_t t = 0; t < T;) {
    const int64_t slot = map[t];
    int64_t t1 = t + 1;
    while (t1 < T && map[t1] == slot) ++t1;
    scalar_t* o = out + slot * d + c0;
    if (!written[slot] && t1 == t + 1) {
      std::memcpy(o, g + t * d + c0, w * sizeof(scalar_t));
    } else {
      load_row(g + t * d + c0, acc.data(), w);
      for (int64_t k = t + 1; k < t1; ++k) add_into_acc(g + k * d + c0);
      if (written[slot]) add_into_acc(o);
      store_row(acc.data(), o, w);
    }
    written[slot] = 1;
    t = t1;
  }
  for (int64_t s = 0; s < T; ++s) {
    if (!written[s]) std::fill(out + s * d + c0, out + s * d + c1, scalar_t(0));
  }
}

at::Tensor atm_unmerge_bwd(const at::Tensor& grad_in, const at::Tensor& map_in) {
  checks::atm_unmerge("grad_restored", grad_in, map_in);
  const at::Tensor grad_restored = grad_in.contiguous(), index_map = map_in.contiguous();
  const int64_t B = grad_restored.size(0), T = grad_restored.size(1), d = grad_restored.size(2);
  at::Tensor grad_y = empty_output(grad_restored.sizes(), grad_restored.options());
  const int64_t blocks = (d + kColumnBlock - 1) / kColumnBlock;
  const int64_t* map = index_map.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_restored.scalar_type(), "wiola_atm_unmerge_bwd",
                                  [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* g = grad_restored.const_data_ptr<scalar_t>();
    scalar_t* out = grad_y.mutable_data_ptr<scalar_t>();
    const int64_t task_work = T * std::min(d, kColumnBlock);
    at::parallel_for(0, B * blocks, std::max<int64_t>(1, 32768 / task_work), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(kColumnBlock), tmp(kColumnBlock);
      std::vector<char> written(T);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / blocks, c0 = (task % blocks) * kColumnBlock;
        segment_sum_block<scalar_t>(g + b * T * d, map + b * T, out + b * T * d, T, d, c0,
                                    std::min(d, c0 + kColumnBlock), acc, tmp, written);
      }
    });
  });
  return grad_y;
}

}  // namespace

// The op's schemas, declared once, here beside its CPU kernels: every build of the op compiles this file.
// set_python_module names the module that registers the op's fakes and Python kernels.
// The schemas' text is wiola/cuda_schemas.h's, shared with the SIMT emulation's bindings
// (csrc/cuda/emu/bindings_emu.cpp), so the two cannot drift apart.
TORCH_LIBRARY_FRAGMENT(wiola, m) {
  m.set_python_module("wiola_kernels.ops.atm");
  m.def(wiola::schema::kAtmMerge);
  m.def(wiola::schema::kAtmMergeBackward);
  m.def(wiola::schema::kAtmUnmerge);
  m.def(wiola::schema::kAtmUnmergeBackward);
}

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("atm_merge", &atm_merge);
  m.impl("atm_merge_backward", &atm_merge_bwd);
  m.impl("atm_unmerge", &atm_unmerge);
  m.impl("atm_unmerge_backward", &atm_unmerge_bwd);
}

}  // namespace wiola::cpu
