// ATM greedy adjacent merge / unmerge on the CPU (SPEC §6; the formulas are in
// wiola_kernels/reference/atm.py).
//
// Merge runs in three parallel phases over the flattened (B·T) tokens / rows:
//   1. per token t: ‖x_t‖² and ⟨x_t, x_{t+1}⟩ in one sweep over both rows (the next
//      row stays in cache for the following token, so x is read from memory once);
//   2. per row: the candidate test s_t > τ (decided in double from the sums, without a
//      square root; 0 similarity for a zero norm), then the greedy left-to-right scan
//      (sequential within a row), which also yields the index map, merged positions, T'_b;
//   3. per merged slot: copy the singleton or write x_t/2 + x_{t+1}/2, zeros after T'_b.
// Unmerge is a row gather. Backwards: merge is a gather scaled by ½ / 1 / 0; unmerge
// is a segment sum done per (row, column block) in token order, so it is
// deterministic for any index map (each slot is rounded once for maps from merge).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace wiola::cpu {
namespace {

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

constexpr int64_t kColumnBlock = 512;  // unmerge backward: columns per task

// ‖a‖² and ⟨a, b⟩ in one sweep (b may be null: norm only).
template <typename acc_t>
inline void norm_and_dot(const acc_t* a, const acc_t* b, int64_t d, acc_t& nsq, acc_t& dot) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  V vn0(0), vn1(0), vd0(0), vd1(0);
  int64_t i = 0;
  if (b != nullptr) {
    for (; i + 2 * L <= d; i += 2 * L) {
      const V a0 = V::loadu(a + i), a1 = V::loadu(a + i + L);
      vn0 = at::vec::fmadd(a0, a0, vn0);
      vn1 = at::vec::fmadd(a1, a1, vn1);
      vd0 = at::vec::fmadd(a0, V::loadu(b + i), vd0);
      vd1 = at::vec::fmadd(a1, V::loadu(b + i + L), vd1);
    }
  } else {
    for (; i + 2 * L <= d; i += 2 * L) {
      const V a0 = V::loadu(a + i), a1 = V::loadu(a + i + L);
      vn0 = at::vec::fmadd(a0, a0, vn0);
      vn1 = at::vec::fmadd(a1, a1, vn1);
    }
  }
  const auto add = [](V p, V q) { return p + q; };
  nsq = at::vec::vec_reduce_all<acc_t>(add, vn0 + vn1);
  dot = b != nullptr ? at::vec::vec_reduce_all<acc_t>(add, vd0 + vd1) : acc_t(0);
  for (; i < d; ++i) {
    nsq += a[i] * a[i];
    if (b != nullptr) dot += a[i] * b[i];
  }
}

// Phase 1 over flattened tokens: nsq[i] = ‖x_i‖², dot[i] = ⟨x_i, x_{i+1}⟩ (0 at a row's end).
template <typename scalar_t>
void norms_and_dots(const scalar_t* x, acc_type<scalar_t>* nsq, acc_type<scalar_t>* dot, int64_t n_tokens,
                    int64_t T, int64_t d) {
  using acc_t = acc_type<scalar_t>;
  at::parallel_for(0, n_tokens, std::max<int64_t>(1, 32768 / d), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf_a, buf_b;
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      buf_a.resize(d);
      buf_b.resize(d);
    }
    acc_t* cur = buf_a.data();
    acc_t* nxt = buf_b.data();
    bool have_cur = false;
    for (int64_t i = begin; i < end; ++i) {
      const bool has_next = (i % T) + 1 < T;
      const acc_t* a;
      const acc_t* b = nullptr;
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        a = x + i * d;
        if (has_next) b = x + (i + 1) * d;
      } else {
        if (!have_cur) load_row(x + i * d, cur, d);
        if (has_next) load_row(x + (i + 1) * d, nxt, d);
        a = cur;
        if (has_next) b = nxt;
      }
      norm_and_dot<acc_t>(a, b, d, nsq[i], dot[i]);
      if constexpr (!std::is_same_v<scalar_t, acc_t>) {
        std::swap(cur, nxt);
        have_cur = has_next;
      }
    }
  });
}

// s_t > τ decided in double without a square root (wiola_kernels/reference/atm.py):
// n = ‖x_t‖²·‖x_{t+1}‖², D = ⟨x_t, x_{t+1}⟩. NaN sums are never candidates.
inline bool is_candidate(double D, double n, double tau) {
  if (!(tau < 1.0)) return false;
  if (n == 0.0) return tau < 0.0;
  const double d2 = D * D, t2n = (tau * tau) * n;
  return D > 0.0 ? (tau < 0.0 || d2 > t2n) : (tau < 0.0 && d2 < t2n);
}

// Phase 2, one row: decisions, index map, merged positions, T'; src[s] = 2·first + paired
// for s < T', −1 after.
template <typename acc_t>
void scan_row(const acc_t* nsq, const acc_t* dot, const int64_t* pos, int64_t len, double tau, int64_t T,
              int64_t* index_map, int64_t* merged_pos, int64_t* merged_len, int64_t* src) {
  int64_t slot = 0, t = 0;
  while (t < len) {
    bool take = false;
    if (t + 1 < len) {
      take = is_candidate(dot[t], static_cast<double>(nsq[t]) * static_cast<double>(nsq[t + 1]), tau);
    }
    index_map[t] = slot;
    merged_pos[slot] = pos[t];
    src[slot] = 2 * t + (take ? 1 : 0);
    if (take) index_map[t + 1] = slot;
    t += take ? 2 : 1;
    ++slot;
  }
  *merged_len = slot;
  for (int64_t p = len; p < T; ++p) index_map[p] = slot + (p - len);
  for (int64_t s = slot; s < T; ++s) {
    merged_pos[s] = 0;
    src[s] = -1;
  }
}

// Phase 3 over flattened slots.
template <typename scalar_t>
void gather_average(const scalar_t* x, const int64_t* src, scalar_t* merged, int64_t n_slots, int64_t T,
                    int64_t d) {
  using acc_t = acc_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  at::parallel_for(0, n_slots, std::max<int64_t>(1, 32768 / d), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> a, b;
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      a.resize(d);
      b.resize(d);
    }
    for (int64_t i = begin; i < end; ++i) {
      scalar_t* out = merged + i * d;
      const int64_t code = src[i];
      if (code < 0) {
        std::fill(out, out + d, scalar_t(0));
        continue;
      }
      const int64_t row = i / T, t = code >> 1;
      const scalar_t* x0 = x + (row * T + t) * d;
      if ((code & 1) == 0) {
        std::memcpy(out, x0, d * sizeof(scalar_t));
        continue;
      }
      const scalar_t* x1 = x0 + d;
      const acc_t* p0;
      const acc_t* p1;
      acc_t* o;
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        p0 = x0;
        p1 = x1;
        o = out;
      } else {
        load_row(x0, a.data(), d);
        load_row(x1, b.data(), d);
        p0 = a.data();
        p1 = b.data();
        o = a.data();
      }
      const V half(acc_t(0.5));
      int64_t j = 0;
      for (; j + L <= d; j += L) (V::loadu(p0 + j) * half + V::loadu(p1 + j) * half).store(o + j);
      for (; j < d; ++j) o[j] = p0[j] * acc_t(0.5) + p1[j] * acc_t(0.5);
      if constexpr (!std::is_same_v<scalar_t, acc_t>) store_row(o, out, d);
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

void check_index_map(const at::Tensor& index_map, int64_t B, int64_t T) {
  WIOLA_CHECK_ARG(index_map.dim() == 2 && index_map.size(0) == B && index_map.size(1) == T &&
                      index_map.scalar_type() == at::kLong && index_map.is_contiguous(),
                  "index_map must be a contiguous int64 (B, T) = (", B, ", ", T, ") tensor, got ",
                  index_map.sizes(), " ", index_map.scalar_type());
  const int64_t* m = index_map.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) {
    WIOLA_CHECK_ARG(m[i] >= 0 && m[i] < T, "index_map values must lie in [0, T) = [0, ", T, "), got ", m[i]);
  }
}

void check_x(const char* name, const at::Tensor& x) {
  WIOLA_CHECK_ARG(x.dim() == 3 && x.is_contiguous(), name, " must be a contiguous (B, T, d) tensor, got ",
                  x.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> atm_merge(const at::Tensor& x, const at::Tensor& positions,
                                                                     const at::Tensor& lengths, double threshold) {
  check_x("x", x);
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2);
  WIOLA_CHECK_ARG(positions.dim() == 2 && positions.size(0) == B && positions.size(1) == T &&
                      positions.scalar_type() == at::kLong && positions.is_contiguous(),
                  "positions must be a contiguous int64 (B, T) = (", B, ", ", T, ") tensor, got ", positions.sizes());
  WIOLA_CHECK_ARG(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == at::kLong &&
                      lengths.is_contiguous(),
                  "lengths must be a contiguous int64 (B,) = (", B, ",) tensor, got ", lengths.sizes());
  WIOLA_CHECK_ARG(threshold >= -1.0 && threshold <= 1.0, "threshold must lie in [-1, 1], got ", threshold);
  const int64_t* len = lengths.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    WIOLA_CHECK_ARG(len[b] >= 0 && len[b] <= T, "lengths must lie in [0, T] = [0, ", T, "], got ", len[b]);
  }
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor merged = empty_output(x.sizes(), x.options());
  at::Tensor merged_pos = empty_output({B, T}, positions.options());
  at::Tensor merged_len = empty_output({B}, lengths.options());
  at::Tensor index_map = empty_output({B, T}, positions.options());
  if (B * T == 0) return {merged, merged_pos, merged_len.copy_(lengths), index_map};
  at::Tensor nsq = at::empty({B * T}, x.options().dtype(acc));
  at::Tensor dot = at::empty({B * T}, x.options().dtype(acc));
  at::Tensor src = at::empty({B * T}, positions.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "wiola_atm_merge", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    acc_t* nsq_p = nsq.mutable_data_ptr<acc_t>();
    acc_t* dot_p = dot.mutable_data_ptr<acc_t>();
    norms_and_dots<scalar_t>(xp, nsq_p, dot_p, B * T, T, d);
    const int64_t* pos = positions.const_data_ptr<int64_t>();
    int64_t* map = index_map.mutable_data_ptr<int64_t>();
    int64_t* mpos = merged_pos.mutable_data_ptr<int64_t>();
    int64_t* mlen = merged_len.mutable_data_ptr<int64_t>();
    int64_t* srcp = src.mutable_data_ptr<int64_t>();
    at::parallel_for(0, B, std::max<int64_t>(1, 16384 / T), [&](int64_t b0, int64_t b1) {  // tiny rows: inline
      for (int64_t b = b0; b < b1; ++b) {
        scan_row<acc_t>(nsq_p + b * T, dot_p + b * T, pos + b * T, len[b], threshold, T, map + b * T,
                        mpos + b * T, mlen + b, srcp + b * T);
      }
    });
    gather_average<scalar_t>(xp, srcp, merged.mutable_data_ptr<scalar_t>(), B * T, T, d);
  });
  return {merged, merged_pos, merged_len, index_map};
}

at::Tensor atm_merge_bwd(const at::Tensor& grad_merged, const at::Tensor& index_map,
                         const at::Tensor& merged_lengths) {
  check_x("grad_merged", grad_merged);
  const int64_t B = grad_merged.size(0), T = grad_merged.size(1), d = grad_merged.size(2);
  check_index_map(index_map, B, T);
  WIOLA_CHECK_ARG(merged_lengths.dim() == 1 && merged_lengths.size(0) == B &&
                      merged_lengths.scalar_type() == at::kLong && merged_lengths.is_contiguous(),
                  "merged_lengths must be a contiguous int64 (B,) tensor");
  at::Tensor grad_x = empty_output(grad_merged.sizes(), grad_merged.options());
  const int64_t* map = index_map.const_data_ptr<int64_t>();
  const int64_t* mlen = merged_lengths.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_merged.scalar_type(), "wiola_atm_merge_bwd", [&] {
    scatter_halves<scalar_t>(grad_merged.const_data_ptr<scalar_t>(), map, mlen, grad_x.mutable_data_ptr<scalar_t>(),
                             B, T, d);
  });
  return grad_x;
}

at::Tensor atm_unmerge(const at::Tensor& y, const at::Tensor& index_map) {
  check_x("y", y);
  const int64_t B = y.size(0), T = y.size(1), d = y.size(2);
  check_index_map(index_map, B, T);
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

// Segment sum in token order for columns [c0, c1) of row b. A run of consecutive tokens
// with the same slot is summed in acc_t and flushed once; a slot seen again later (only
// for maps not produced by merge) is added to what was flushed before.
template <typename scalar_t>
void segment_sum_block(const scalar_t* g, const int64_t* map, scalar_t* out, int64_t T, int64_t d, int64_t c0,
                       int64_t c1, std::vector<acc_type<scalar_t>>& acc, std::vector<acc_type<scalar_t>>& tmp,
                       std::vector<char>& written) {
  using acc_t = acc_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  const int64_t w = c1 - c0;
  std::fill(written.begin(), written.end(), 0);
  const auto flush = [&](int64_t slot) {
    scalar_t* o = out + slot * d + c0;
    if (!written[slot]) {
      store_row(acc.data(), o, w);
      written[slot] = 1;
    } else {
      load_row(o, tmp.data(), w);
      int64_t j = 0;
      for (; j + L <= w; j += L) (V::loadu(tmp.data() + j) + V::loadu(acc.data() + j)).store(tmp.data() + j);
      for (; j < w; ++j) tmp[j] += acc[j];
      store_row(tmp.data(), o, w);
    }
  };
  int64_t cur = -1;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = map[t];
    const scalar_t* gt = g + t * d + c0;
    if (slot != cur) {
      if (cur >= 0) flush(cur);
      cur = slot;
      load_row(gt, acc.data(), w);
    } else {
      load_row(gt, tmp.data(), w);
      int64_t j = 0;
      for (; j + L <= w; j += L) (V::loadu(acc.data() + j) + V::loadu(tmp.data() + j)).store(acc.data() + j);
      for (; j < w; ++j) acc[j] += tmp[j];
    }
  }
  if (cur >= 0) flush(cur);
  for (int64_t s = 0; s < T; ++s) {
    if (!written[s]) std::fill(out + s * d + c0, out + s * d + c1, scalar_t(0));
  }
}

at::Tensor atm_unmerge_bwd(const at::Tensor& grad_restored, const at::Tensor& index_map) {
  check_x("grad_restored", grad_restored);
  const int64_t B = grad_restored.size(0), T = grad_restored.size(1), d = grad_restored.size(2);
  check_index_map(index_map, B, T);
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

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("_atm_merge", &atm_merge);
  m.impl("_atm_merge_bwd", &atm_merge_bwd);
  m.impl("_atm_unmerge", &atm_unmerge);
  m.impl("_atm_unmerge_bwd", &atm_unmerge_bwd);
}

}  // namespace wiola::cpu
