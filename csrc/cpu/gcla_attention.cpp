// GCLA summary-augmented attention on the CPU (SPEC §5.5), FlashAttention-2 style.
//
//   O_i = Σ_j softmax_j(c q̃_i·k̃_j) v_j  +  σ(g_h) Σ_λ softmax_λ(c q_i·kc_iλ) vc_iλ,   c = 1/√d_h
//
// Head h reads kv group h mod H_kv; keys j ≤ i and j < len_b; rows i ≥ len_b are 0.
//
// Forward: one task per (b, chunk of heads, query block of kBlockQ rows), at::parallel_for
// over them. A task gathers the q̃/q/kc/vc rows of its heads into a contiguous scratch in
// address order and writes O the same way (on the model's transposed (B, T, H, d_h) views
// a per-head walk jumps a whole time step per row). For each head it streams key blocks
// of kBlockK (only those at or left of the diagonal, and only below len_b) with an online
// softmax: S = c Q Kᵀ and O += P V are gemms on small float (double for double inputs)
// tiles; the exponentials are vectorised. The epilogue normalises O, adds the tiny cross
// softmax over the Λ' summary slots with the un-rotated q, applies the gate; it stores
// lse = m + log l.
//
// Backward (recompute P = exp(S − lse)), two passes, no atomics, deterministic:
//   A. per (b, chunk of heads, query block; rows gathered as in the forward): the cross
//      part (dq, dkc, dvc, gate partial) and D_i = dO_i · (O_i − σ O^cross_i).
//   B. per (b, kv group): the self part in one sweep over the group's heads (in head
//      order), their query blocks and the key blocks at or left of the diagonal; each tile
//      pair recomputes S and dP once (5 tile gemms, 1 exp pass) and feeds dq̃ (a query
//      block's accumulator) and dk̃, dv (the task's T-row accumulators).
// S = 1 summaries give dkc/dvc partials per query block and dgate partials per
// (b, h, query block); both are summed afterwards in a fixed order.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "common.h"
#include "wiola/checks.h"

namespace wiola::cpu {
namespace {

constexpr int64_t kBlockQ = 64;   // query rows per task / tile
constexpr int64_t kBlockK = 128;  // key rows per tile

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

// ---- Small dense tiles: a register-blocked gemm on at::vec (no BLAS dependency) ----
//
// C (M×N) (+)= alpha · A (M×K) · B (K×N), all row-major. N is rounded up to a multiple of
// two vectors: B and C must have that many readable/writable columns (the tiles below are
// padded; the extra columns hold finite junk that is never read back). With TA, A is read
// transposed from a (K×M) row-major matrix: A(r, k) = A[k · lda + r] (no transpose copy).
template <typename acc_t, int MR, bool TA = false>
inline void gemm_rows(int64_t K, int64_t N, acc_t alpha, const acc_t* A, int64_t lda, const acc_t* B, int64_t ldb,
                      acc_t* C, int64_t ldc, bool accumulate) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const V valpha(alpha);
  for (int64_t j = 0; j < N; j += 2 * W) {
    V acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = V(acc_t(0));
    for (int64_t k = 0; k < K; ++k) {
      const V b0 = V::loadu(B + k * ldb + j), b1 = V::loadu(B + k * ldb + j + W);
      for (int r = 0; r < MR; ++r) {
        const V a(TA ? A[k * lda + r] : A[r * lda + k]);
        acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      acc_t* c = C + r * ldc + j;
      if (accumulate) {
        at::vec::fmadd(valpha, acc[r][0], V::loadu(c)).store(c);
        at::vec::fmadd(valpha, acc[r][1], V::loadu(c + W)).store(c + W);
      } else {
        (valpha * acc[r][0]).store(c);
        (valpha * acc[r][1]).store(c + W);
      }
    }
  }
}

template <typename acc_t, bool TA = false>
inline void gemm(int64_t M, int64_t N, int64_t K, acc_t alpha, const acc_t* A, int64_t lda, const acc_t* B,
                 int64_t ldb, acc_t* C, int64_t ldc, bool accumulate) {
  constexpr int MR = 6;
  int64_t i = 0;
  for (; i + MR <= M; i += MR)
    gemm_rows<acc_t, MR, TA>(K, N, alpha, TA ? A + i : A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
  const acc_t* a = TA ? A + i : A + i * lda;
  acc_t* c = C + i * ldc;
  switch (M - i) {
    case 5: gemm_rows<acc_t, 5, TA>(K, N, alpha, a, lda, B, ldb, c, ldc, accumulate); break;
    case 4: gemm_rows<acc_t, 4, TA>(K, N, alpha, a, lda, B, ldb, c, ldc, accumulate); break;
    case 3: gemm_rows<acc_t, 3, TA>(K, N, alpha, a, lda, B, ldb, c, ldc, accumulate); break;
    case 2: gemm_rows<acc_t, 2, TA>(K, N, alpha, a, lda, B, ldb, c, ldc, accumulate); break;
    case 1: gemm_rows<acc_t, 1, TA>(K, N, alpha, a, lda, B, ldb, c, ldc, accumulate); break;
    default: break;
  }
}

// C (MR×N) += alpha · A · B where row r sums only k ∈ [kb[r], ke[r]): a register block of
// MR rows streams the union of the ranges once, each row's accumulator taking exactly its
// own terms in increasing k (so the result equals MR one-row products); rows with an empty
// range are left untouched. Used on tiles that cross the causal diagonal.
template <typename acc_t, int MR, bool TA = false>
inline void gemm_rows_ranged(const int64_t* kb, const int64_t* ke, int64_t N, acc_t alpha, const acc_t* A,
                             int64_t lda, const acc_t* B, int64_t ldb, acc_t* C, int64_t ldc) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const V valpha(alpha);
  int64_t lo = kb[0], hi = ke[0], lo_all = kb[0], hi_all = ke[0];  // union; intersection
  for (int r = 1; r < MR; ++r) {
    lo = std::min(lo, kb[r]);
    hi = std::max(hi, ke[r]);
    lo_all = std::max(lo_all, kb[r]);
    hi_all = std::min(hi_all, ke[r]);
  }
  if (hi_all < lo_all) lo_all = hi_all = hi;  // no common range: every k takes the masked path
  for (int64_t j = 0; j < N; j += 2 * W) {
    V acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = V(acc_t(0));
    auto masked = [&](int64_t k) {
      const V b0 = V::loadu(B + k * ldb + j), b1 = V::loadu(B + k * ldb + j + W);
      for (int r = 0; r < MR; ++r) {
        if (k < kb[r] || k >= ke[r]) continue;
        const V a(TA ? A[k * lda + r] : A[r * lda + k]);
        acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
      }
    };
    for (int64_t k = lo; k < lo_all; ++k) masked(k);
    for (int64_t k = lo_all; k < hi_all; ++k) {
      const V b0 = V::loadu(B + k * ldb + j), b1 = V::loadu(B + k * ldb + j + W);
      for (int r = 0; r < MR; ++r) {
        const V a(TA ? A[k * lda + r] : A[r * lda + k]);
        acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
      }
    }
    for (int64_t k = std::max(hi_all, lo_all); k < hi; ++k) masked(k);
    for (int r = 0; r < MR; ++r) {
      if (kb[r] >= ke[r]) continue;
      acc_t* c = C + r * ldc + j;
      at::vec::fmadd(valpha, acc[r][0], V::loadu(c)).store(c);
      at::vec::fmadd(valpha, acc[r][1], V::loadu(c + W)).store(c + W);
    }
  }
}

// Drives gemm_rows_ranged over M rows; range(r, kb, ke) gives row r's k range.
template <typename acc_t, bool TA = false, typename Range>
inline void gemm_ranged(int64_t M, int64_t N, acc_t alpha, const acc_t* A, int64_t lda, const acc_t* B, int64_t ldb,
                        acc_t* C, int64_t ldc, const Range& range) {
  constexpr int MR = 6;
  int64_t kb[MR], ke[MR];
  int64_t i = 0;
  for (; i + MR <= M; i += MR) {
    for (int r = 0; r < MR; ++r) range(i + r, kb[r], ke[r]);
    gemm_rows_ranged<acc_t, MR, TA>(kb, ke, N, alpha, TA ? A + i : A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  }
  for (; i < M; ++i) {
    range(i, kb[0], ke[0]);
    gemm_rows_ranged<acc_t, 1, TA>(kb, ke, N, alpha, TA ? A + i : A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  }
}

// C += alpha · A · B on a tile that crosses the causal diagonal: row r of A (query
// i0 + r) multiplies only its own causal keys j ≤ i0 + r, i.e. the first
// clamp(i0 + r − j0 + 1, 0, K) rows of B (keys from j0). A's masked entries are exactly 0,
// but 0 · NaN is NaN: a non-finite value at a later key must not reach earlier rows.
template <typename acc_t>
inline void gemm_causal_rows(int64_t M, int64_t N, int64_t K, int64_t i0, int64_t j0, acc_t alpha, const acc_t* A,
                             int64_t lda, const acc_t* B, int64_t ldb, acc_t* C, int64_t ldc) {
  gemm_ranged<acc_t>(M, N, alpha, A, lda, B, ldb, C, ldc, [&](int64_t r, int64_t& kb, int64_t& ke) {
    kb = 0;
    ke = std::clamp<int64_t>(i0 + r - j0 + 1, 0, K);
  });
}

// The transpose of the above for the key-side gradients: C (K×N) += alpha · Aᵀ · B (M×N), A
// the (M×K) query-by-key tile itself, where row c of Aᵀ (key j0 + c) multiplies only the
// query rows that see it, i ≥ j0 + c, i.e. rows clamp(j0 + c − i0, 0, M) .. M of B.
template <typename acc_t>
inline void gemm_anticausal_rows(int64_t K, int64_t N, int64_t M, int64_t i0, int64_t j0, acc_t alpha, const acc_t* A,
                                 int64_t lda, const acc_t* B, int64_t ldb, acc_t* C, int64_t ldc) {
  gemm_ranged<acc_t, true>(K, N, alpha, A, lda, B, ldb, C, ldc, [&](int64_t c, int64_t& kb, int64_t& ke) {
    kb = std::clamp<int64_t>(j0 + c - i0, 0, M);
    ke = M;
  });
}

// Rows [0, n) of a (·, dh) scalar_t matrix with row stride lds into an acc_t tile with row
// stride ldd.
template <typename scalar_t, typename acc_t>
inline void load_tile(const scalar_t* src, int64_t n, int64_t lds, int64_t dh, acc_t* dst, int64_t ldd) {
  for (int64_t r = 0; r < n; ++r) load_row(src + r * lds, dst + r * ldd, dh);
}

// Tile widths rounded up to two vectors of the widest accumulation type (16 floats).
constexpr int64_t kPad = 16;
inline int64_t padded(int64_t n) { return (n + kPad - 1) / kPad * kPad; }
// Row stride of the transposed K/V packs: one extra pad so that a power-of-two T does not
// put the d_h rows a tile gemm streams through into the same L1 cache set.
inline int64_t transposed_ld(int64_t T) { return padded(T) + kPad; }

// K/V of every (b, kv group) converted once to the accumulation type, in the layouts the
// tile gemms read: transposed (n, dh, ldt) with ldt = transposed_ld(T) (zero columns past T), or
// row-padded (n, T, padded(dh)). Linear in T, and saves a conversion per tile pair.
template <typename scalar_t, typename acc_t>
std::vector<acc_t> pack_transposed(const scalar_t* src, const RowStrides& rs, int64_t B, int64_t Hkv, int64_t T,
                                   int64_t dh) {
  const int64_t n = B * Hkv, ldt = transposed_ld(T);
  std::vector<acc_t> out(n * dh * ldt, acc_t(0));
  at::parallel_for(0, n * ((T + kBlockK - 1) / kBlockK), 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> row(dh);
    const int64_t nb = (T + kBlockK - 1) / kBlockK;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t k = task / nb, t0 = (task % nb) * kBlockK, t1 = std::min(T, t0 + kBlockK);
      for (int64_t t = t0; t < t1; ++t) {
        load_row(src + rs(k / Hkv, k % Hkv, t), row.data(), dh);
        for (int64_t e = 0; e < dh; ++e) out[(k * dh + e) * ldt + t] = row[e];
      }
    }
  });
  return out;
}

template <typename scalar_t, typename acc_t>
std::vector<acc_t> pack_rows(const scalar_t* src, const RowStrides& rs, int64_t B, int64_t Hkv, int64_t T, int64_t dh) {
  const int64_t rows = B * Hkv * T, dp = padded(dh);
  std::vector<acc_t> out(rows * dp, acc_t(0));
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) load_row(src + rs(r / (Hkv * T), (r / T) % Hkv, r % T), out.data() + r * dp, dh);
  });
  return out;
}

template <typename acc_t>
inline acc_t dot(const acc_t* a, const acc_t* b, int64_t n) {
  using V = Vec<acc_t>;
  V acc(0);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) acc = at::vec::fmadd(V::loadu(a + i), V::loadu(b + i), acc);
  acc_t total = at::vec::vec_reduce_all<acc_t>([](V x, V y) { return x + y; }, acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// y = alpha * x + beta * y
template <typename acc_t>
inline void axpby(acc_t alpha, const acc_t* x, acc_t beta, acc_t* y, int64_t n) {
  using V = Vec<acc_t>;
  const V va(alpha), vb(beta);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) (va * V::loadu(x + i) + vb * V::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] = alpha * x[i] + beta * y[i];
}

// exp on a vector: the 20-ulp variant for float (plenty for softmax weights summed in
// float; ATen's CPU flash attention uses it too), the accurate one for double.
template <typename acc_t>
inline Vec<acc_t> vexp(const Vec<acc_t>& x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

// max(m, s[0..n))
template <typename acc_t>
inline acc_t row_max(const acc_t* s, int64_t n, acc_t m) {
  using V = Vec<acc_t>;
  V vm(m);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) vm = at::vec::maximum(vm, V::loadu(s + j));
  acc_t total = at::vec::vec_reduce_all<acc_t>([](V x, V y) { return at::vec::maximum(x, y); }, vm);
  for (; j < n; ++j) total = std::max(total, s[j]);
  return total;
}

// p[j] = exp(s[j] - m); returns Σ p.
template <typename acc_t>
inline acc_t exp_sub(const acc_t* s, acc_t m, acc_t* p, int64_t n) {
  using V = Vec<acc_t>;
  const V vm(m);
  V vsum(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    const V e = vexp<acc_t>(V::loadu(s + j) - vm);
    e.store(p + j);
    vsum = vsum + e;
  }
  acc_t total = at::vec::vec_reduce_all<acc_t>([](V x, V y) { return x + y; }, vsum);
  for (; j < n; ++j) {
    p[j] = std::exp(s[j] - m);
    total += p[j];
  }
  return total;
}

struct Dims {
  int64_t B, H, Hkv, T, dh, S, L;
  double scale;
};

// Element strides of a (B, H, S, L, d_h) context tensor (d_h contiguous): slot row l of
// (b, h, s) starts at (b, h, s) + l·sl.
struct CtxStrides {
  int64_t sb = 0, sh = 0, ss = 0, sl = 0;
  CtxStrides() = default;
  explicit CtxStrides(const at::Tensor& x) : sb(x.stride(0)), sh(x.stride(1)), ss(x.stride(2)), sl(x.stride(3)) {}
  int64_t operator()(int64_t b, int64_t h, int64_t s) const { return b * sb + h * sh + s * ss; }
};

// Where every tensor's rows are: the kernels read and write through strides (only d_h
// must be contiguous), so the model's transposed (B, T, H, d_h) views need no copy.
struct Layout {
  RowStrides q_rot, k_rot, v, q, out, grad_out, dq_rot, dk_rot, dv, dq;
  CtxStrides kc, vc, dkc, dvc;
};

// Cross part for one row: a (L), o_cross (dh) from q (dh), kc/vc rows (L×dh, scalar_t).
template <typename scalar_t, typename acc_t>
inline void cross_row(const acc_t* q, const scalar_t* kc, int64_t ldk, const scalar_t* vc, int64_t ldv, int64_t L,
                      int64_t dh, acc_t scale, acc_t* a, acc_t* o_cross, acc_t* row) {
  std::fill(o_cross, o_cross + dh, acc_t(0));
  if (L == 0) return;
  acc_t zmax = -std::numeric_limits<acc_t>::infinity();
  // Rows already in the accumulation type are read in place.
  auto as_acc = [&](const scalar_t* src) -> const acc_t* {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      return src;
    } else {
      load_row(src, row, dh);
      return row;
    }
  };
  for (int64_t l = 0; l < L; ++l) {
    a[l] = scale * dot(q, as_acc(kc + l * ldk), dh);
    zmax = std::max(zmax, a[l]);
  }
  acc_t sum = 0;
  for (int64_t l = 0; l < L; ++l) {
    a[l] = std::exp(a[l] - zmax);
    sum += a[l];
  }
  for (int64_t l = 0; l < L; ++l) {
    a[l] /= sum;
    axpby(a[l], as_acc(vc + l * ldv), acc_t(1), o_cross, dh);
  }
}

inline int64_t row_length(const int64_t* lengths, int64_t b, int64_t T) {
  return lengths == nullptr ? T : std::clamp<int64_t>(lengths[b], 0, T);
}

// Rows [t0, t0 + n) of heads [h0, h0 + nh) of a (B, heads, T, d_h) tensor to or from a
// head-major scratch (head hh's row r at dst + (hh·kBlockQ + r)·ld), visiting the tensor
// in address order: heads inner when they lie closer together than time steps (the
// model's transposed (B, T, H, d_h) views), so every access continues a stream the
// hardware prefetchers follow instead of jumping a whole time step (and page) per row.
template <typename scalar_t, typename acc_t>
inline void gather_rows(const scalar_t* src, const RowStrides& rs, int64_t b, int64_t h0, int64_t nh, int64_t t0,
                        int64_t n, int64_t dh, acc_t* dst, int64_t ld) {
  if (std::abs(rs.sh) < std::abs(rs.st)) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t hh = 0; hh < nh; ++hh) load_row(src + rs(b, h0 + hh, t0 + r), dst + (hh * kBlockQ + r) * ld, dh);
  } else {
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t r = 0; r < n; ++r) load_row(src + rs(b, h0 + hh, t0 + r), dst + (hh * kBlockQ + r) * ld, dh);
  }
}

// The reverse of gather_rows: rows [0, nrow) of each head's slab to the tensor, then rows
// [nrow, n) written as zeros (rows past the sequence length).
template <typename acc_t, typename scalar_t>
inline void scatter_rows(const acc_t* src, int64_t ld, int64_t nrow, scalar_t* dst, const RowStrides& rs, int64_t b,
                         int64_t h0, int64_t nh, int64_t t0, int64_t n, int64_t dh) {
  auto put = [&](int64_t hh, int64_t r) {
    scalar_t* d = dst + rs(b, h0 + hh, t0 + r);
    if (r < nrow) {
      store_row(src + (hh * kBlockQ + r) * ld, d, dh);
    } else {
      std::fill_n(d, dh, scalar_t(0));
    }
  };
  if (std::abs(rs.sh) < std::abs(rs.st)) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t hh = 0; hh < nh; ++hh) put(hh, r);
  } else {
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t r = 0; r < n; ++r) put(hh, r);
  }
}

// Per-time-step summary slots (S = T) of rows [t0, t0 + n), heads [h0, h0 + nh), of two
// tensors (kc and vc, or their gradients) to or from head-major scratches: (hh, r, l) at
// buf + ((hh·kBlockQ + r)·L + l)·dh, in address order. With interleaved heads the two
// tensors alternate per (time step, slot): in the model both are halves of one projection
// row, so the walk is sequential.
template <typename acc_t, typename scalar_t, bool kStore>
inline void move_ctx(std::conditional_t<kStore, scalar_t*, const scalar_t*> ctx0, const CtxStrides& cs0,
                     std::conditional_t<kStore, const acc_t*, acc_t*> buf0,
                     std::conditional_t<kStore, scalar_t*, const scalar_t*> ctx1, const CtxStrides& cs1,
                     std::conditional_t<kStore, const acc_t*, acc_t*> buf1, int64_t b, int64_t h0, int64_t nh,
                     int64_t t0, int64_t n, int64_t L, int64_t dh) {
  auto one = [&](auto ctx, const CtxStrides& cs, auto buf, int64_t hh, int64_t r, int64_t l) {
    const int64_t off = cs(b, h0 + hh, t0 + r) + l * cs.sl, boff = ((hh * kBlockQ + r) * L + l) * dh;
    if constexpr (kStore) {
      store_row(buf + boff, ctx + off, dh);
    } else {
      load_row(ctx + off, buf + boff, dh);
    }
  };
  auto walk = [&](auto ctx, const CtxStrides& cs, auto buf) {
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t l = 0; l < L; ++l) one(ctx, cs, buf, hh, r, l);
  };
  if (std::abs(cs0.sh) < std::abs(cs0.ss) && std::abs(cs1.sh) < std::abs(cs1.ss)) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t hh = 0; hh < nh; ++hh) one(ctx0, cs0, buf0, hh, r, l);
        for (int64_t hh = 0; hh < nh; ++hh) one(ctx1, cs1, buf1, hh, r, l);
      }
  } else if (std::abs(cs0.sh) < std::abs(cs0.ss)) {  // one interleaved: each in its own order
    for (int64_t r = 0; r < n; ++r)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t hh = 0; hh < nh; ++hh) one(ctx0, cs0, buf0, hh, r, l);
    walk(ctx1, cs1, buf1);
  } else if (std::abs(cs1.sh) < std::abs(cs1.ss)) {
    walk(ctx0, cs0, buf0);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t hh = 0; hh < nh; ++hh) one(ctx1, cs1, buf1, hh, r, l);
  } else {
    walk(ctx0, cs0, buf0);
    walk(ctx1, cs1, buf1);
  }
}

// Heads per task: with interleaved rows (heads closer together than time steps, the
// model's views) all of them, so that whole strided rows are gathered at once, unless that
// leaves fewer than two tasks per thread; otherwise one (each head's rows are already
// contiguous; tasks then run in (b, h, query block) order, keeping a kv group's K/V hot).
// Only the partition depends on the thread count: every (b, h, query block) is computed
// the same way whatever the task holding it.
inline int64_t heads_per_task(int64_t H, int64_t outer, bool interleaved) {
  if (!interleaved) return 1;
  const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
  const int64_t chunks = std::clamp<int64_t>((want + std::max<int64_t>(outer, 1) - 1) / std::max<int64_t>(outer, 1), 1,
                                             std::max<int64_t>(H, 1));
  return (H + chunks - 1) / chunks;
}
inline bool interleaved(const RowStrides& rs) { return std::abs(rs.sh) < std::abs(rs.st); }
inline bool interleaved(const CtxStrides& cs) { return std::abs(cs.sh) < std::abs(cs.ss); }

// The heads [h0, h0 + nh) of a task grouped by kv group (each group's K/V stays in cache).
inline void group_order(int64_t h0, int64_t nh, int64_t Hkv, std::vector<int64_t>& order) {
  order.clear();
  for (int64_t g = 0; g < Hkv; ++g)
    for (int64_t hh = 0; hh < nh; ++hh)
      if ((h0 + hh) % Hkv == g) order.push_back(hh);
}

// ---------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------
template <typename scalar_t>
void forward_impl(const Dims& d, const Layout& lay, const scalar_t* q_rot, const scalar_t* k_rot, const scalar_t* v, const scalar_t* q,
                  const scalar_t* kc, const scalar_t* vc, const acc_type<scalar_t>* gate, const int64_t* lengths,
                  scalar_t* out, acc_type<scalar_t>* lse) {
  using acc_t = acc_type<scalar_t>;
  const int64_t B = d.B, H = d.H, Hkv = d.Hkv, T = d.T, dh = d.dh, S = d.S, L = d.L;
  const acc_t scale = acc_t(d.scale);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const int64_t nqb = (T + kBlockQ - 1) / kBlockQ;
  const int64_t dp = padded(dh), ldt = transposed_ld(T);
  const std::vector<acc_t> kt_all = pack_transposed<scalar_t, acc_t>(k_rot, lay.k_rot, B, Hkv, T, dh);
  const std::vector<acc_t> v_all = pack_rows<scalar_t, acc_t>(v, lay.v, B, Hkv, T, dh);
  // One task per (b, chunk of heads, query block): its strided rows are gathered and
  // written once for the whole chunk (see gather_rows).
  // Per-step summaries are gathered only when interleaved; otherwise read in place.
  const bool gather_ctx = S != 1 && L > 0 && (interleaved(lay.kc) || interleaved(lay.vc));
  const int64_t hpt = heads_per_task(H, B * nqb, interleaved(lay.q_rot) || interleaved(lay.q) || interleaved(lay.out) ||
                                                     gather_ctx);
  const int64_t nhc = (H + hpt - 1) / hpt;
  at::parallel_for(0, B * nqb * nhc, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order;
    std::vector<acc_t> qbuf(hpt * kBlockQ * dp), qplain(L > 0 ? hpt * kBlockQ * dh : 0),
        kcbuf(gather_ctx ? hpt * kBlockQ * L * dh : 0), vcbuf(gather_ctx ? hpt * kBlockQ * L * dh : 0),
        sbuf(kBlockQ * kBlockK), obuf(hpt * kBlockQ * dp), m(kBlockQ), l(kBlockQ), a(std::max<int64_t>(L, 1)), oc(dh),
        row(dh);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qb = task % nqb, hc = (task / nqb) % nhc, b = task / (nqb * nhc);
      const int64_t h0 = hc * hpt, nh = std::min(hpt, H - h0);
      const int64_t len = row_length(lengths, b, T);
      const int64_t i0 = qb * kBlockQ, i1 = std::min(T, i0 + kBlockQ);
      const int64_t nq = std::max<int64_t>(0, std::min(i1, len) - i0);  // valid rows
      // Rows past the length: exactly zero (scatter_rows below), lse 0.
      for (int64_t hh = 0; hh < nh; ++hh)
        for (int64_t i = i0 + nq; i < i1; ++i) lse[(b * H + h0 + hh) * T + i] = 0;
      if (nq > 0) {
        gather_rows(q_rot, lay.q_rot, b, h0, nh, i0, nq, dh, qbuf.data(), dp);
        if (L > 0) gather_rows(q, lay.q, b, h0, nh, i0, nq, dh, qplain.data(), dh);
        if (gather_ctx) {
          move_ctx<acc_t, scalar_t, false>(kc, lay.kc, kcbuf.data(), vc, lay.vc, vcbuf.data(), b, h0, nh, i0, nq, L, dh);
        }
      }
      group_order(h0, nq > 0 ? nh : 0, Hkv, order);
      for (const int64_t hh : order) {
        const int64_t h = h0 + hh, g = h % Hkv;
        acc_t* lse_bh = lse + (b * H + h) * T;
        const acc_t* Q = qbuf.data() + hh * kBlockQ * dp;
        acc_t* O = obuf.data() + hh * kBlockQ * dp;
        const acc_t* KT_g = kt_all.data() + (b * Hkv + g) * dh * ldt;
        const acc_t* V_g = v_all.data() + (b * Hkv + g) * T * dp;
        std::fill(m.begin(), m.begin() + nq, neg_inf);
        std::fill(l.begin(), l.begin() + nq, acc_t(0));
        std::fill(O, O + nq * dp, acc_t(0));
        const int64_t kv_end = i0 + nq;  // keys j ≤ last valid row (< len)
        for (int64_t j0 = 0; j0 < kv_end; j0 += kBlockK) {
          const int64_t nk = std::min(kBlockK, kv_end - j0);
          acc_t* Sb = sbuf.data();
          gemm<acc_t>(nq, nk, dh, scale, Q, dp, KT_g + j0, ldt, Sb, kBlockK, false);
          const bool diagonal = j0 + nk - 1 > i0;  // some key lies right of some row
          for (int64_t r = 0; r < nq; ++r) {
            acc_t* s = Sb + r * kBlockK;
            const int64_t i = i0 + r;
            const int64_t ncol = diagonal ? std::clamp<int64_t>(i - j0 + 1, 0, nk) : nk;
            for (int64_t c = ncol; c < nk; ++c) s[c] = neg_inf;
            const acc_t mx = row_max(s, ncol, m[r]);
            // ncol ≥ 1 always holds for the first key block (key 0 ≤ i), so mx is finite.
            const acc_t corr = std::exp(m[r] - mx);
            const acc_t sum = exp_sub(s, mx, s, nk);
            l[r] = l[r] * corr + sum;
            m[r] = mx;
            if (corr != acc_t(1)) {
              acc_t* o = O + r * dp;
              for (int64_t e = 0; e < dp; e += Vec<acc_t>::size()) (Vec<acc_t>::loadu(o + e) * Vec<acc_t>(corr)).store(o + e);
            }
          }
          if (diagonal) {
            gemm_causal_rows<acc_t>(nq, dh, nk, i0, j0, acc_t(1), Sb, kBlockK, V_g + j0 * dp, dp, O, dp);
          } else {
            gemm<acc_t>(nq, dh, nk, acc_t(1), Sb, kBlockK, V_g + j0 * dp, dp, O, dp, true);
          }
        }
        // Epilogue: normalise, cross part, gate.
        const acc_t sig = acc_t(1) / (acc_t(1) + std::exp(-gate[h]));
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t i = i0 + r;
          acc_t* o = O + r * dp;
          const acc_t inv_l = acc_t(1) / l[r];
          lse_bh[i] = m[r] + std::log(l[r]);
          if (L > 0) {
            const acc_t* qrow = qplain.data() + (hh * kBlockQ + r) * dh;
            if (gather_ctx) {
              const int64_t off = (hh * kBlockQ + r) * L * dh;
              cross_row(qrow, kcbuf.data() + off, dh, vcbuf.data() + off, dh, L, dh, scale, a.data(), oc.data(),
                        row.data());
            } else {
              const int64_t s_idx = S == 1 ? 0 : i;
              cross_row(qrow, kc + lay.kc(b, h, s_idx), lay.kc.sl, vc + lay.vc(b, h, s_idx), lay.vc.sl, L, dh, scale,
                        a.data(), oc.data(), row.data());
            }
            for (int64_t e = 0; e < dh; ++e) o[e] = o[e] * inv_l + sig * oc[e];
          } else {
            for (int64_t e = 0; e < dh; ++e) o[e] *= inv_l;
          }
        }
      }
      scatter_rows(obuf.data(), dp, nq, out, lay.out, b, h0, nh, i0, i1 - i0, dh);  // the one write of O
    }
  });
}

// ---------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------
template <typename scalar_t>
void backward_impl(const Dims& d, const Layout& lay, const scalar_t* grad_out, const scalar_t* q_rot, const scalar_t* k_rot,
                   const scalar_t* v, const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                   const acc_type<scalar_t>* gate, const int64_t* lengths, const scalar_t* out,
                   const acc_type<scalar_t>* lse, scalar_t* dq_rot, scalar_t* dk_rot, scalar_t* dv, scalar_t* dq,
                   scalar_t* dkc, scalar_t* dvc, acc_type<scalar_t>* dbuf, acc_type<scalar_t>* dkc_part,
                   acc_type<scalar_t>* dvc_part, acc_type<scalar_t>* dgate_part) {
  using acc_t = acc_type<scalar_t>;
  const int64_t B = d.B, H = d.H, Hkv = d.Hkv, T = d.T, dh = d.dh, S = d.S, L = d.L;
  const acc_t scale = acc_t(d.scale);
  const int64_t nqb = (T + kBlockQ - 1) / kBlockQ;
  const int64_t group = H / Hkv;

  const int64_t dp = padded(dh), ldt = transposed_ld(T);
  const std::vector<acc_t> kt_all = pack_transposed<scalar_t, acc_t>(k_rot, lay.k_rot, B, Hkv, T, dh);
  const std::vector<acc_t> vt_all = pack_transposed<scalar_t, acc_t>(v, lay.v, B, Hkv, T, dh);
  const std::vector<acc_t> k_all = pack_rows<scalar_t, acc_t>(k_rot, lay.k_rot, B, Hkv, T, dh);

  // ---- Pass A: per (b, chunk of heads, query block): cross part, D. Strided rows are
  // gathered and written once per chunk (gather_rows); partials stay indexed by
  // (b, h, query block). ----
  // Per-step summaries (and their gradients) go through the scratch only when interleaved.
  const bool gather_ctx = S != 1 && L > 0 &&
                            (interleaved(lay.kc) || interleaved(lay.vc) || interleaved(lay.dkc) || interleaved(lay.dvc));
  const int64_t hpt = heads_per_task(H, B * nqb, interleaved(lay.grad_out) || interleaved(lay.out) ||
                                                     interleaved(lay.q) || interleaved(lay.dq) || gather_ctx);
  const int64_t nhc = (H + hpt - 1) / hpt;
  at::parallel_for(0, B * nqb * nhc, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> dobuf(hpt * kBlockQ * dp), obufs(hpt * kBlockQ * dh), qplain(L > 0 ? hpt * kBlockQ * dh : 0),
        dqbuf(hpt * kBlockQ * dh), kcbuf(gather_ctx ? hpt * kBlockQ * L * dh : 0),
        vcbuf(gather_ctx ? hpt * kBlockQ * L * dh : 0), dkcbuf(gather_ctx ? hpt * kBlockQ * L * dh : 0),
        dvcbuf(gather_ctx ? hpt * kBlockQ * L * dh : 0), a(std::max<int64_t>(L, 1)), oc(dh), row(dh);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qb = task % nqb, hc = (task / nqb) % nhc, b = task / (nqb * nhc);
      const int64_t h0 = hc * hpt, nh = std::min(hpt, H - h0);
      const int64_t len = row_length(lengths, b, T);
      const int64_t i0 = qb * kBlockQ, i1 = std::min(T, i0 + kBlockQ);
      const int64_t nq = std::max<int64_t>(0, std::min(i1, len) - i0);
      if (nq > 0) {
        gather_rows(grad_out, lay.grad_out, b, h0, nh, i0, nq, dh, dobuf.data(), dp);
        gather_rows(out, lay.out, b, h0, nh, i0, nq, dh, obufs.data(), dh);
        if (L > 0) gather_rows(q, lay.q, b, h0, nh, i0, nq, dh, qplain.data(), dh);
        if (gather_ctx) {
          move_ctx<acc_t, scalar_t, false>(kc, lay.kc, kcbuf.data(), vc, lay.vc, vcbuf.data(), b, h0, nh, i0, nq, L, dh);
        }
      }
      for (int64_t hh = 0; hh < nh; ++hh) {
        const int64_t h = h0 + hh;
        const int64_t bh = b * H + h;
        const int64_t part = bh * nqb + qb;  // (b, h, query block)
        acc_t* dkc_p = S == 1 ? dkc_part + part * L * dh : nullptr;
        acc_t* dvc_p = S == 1 ? dvc_part + part * L * dh : nullptr;
        if (S == 1) {
          std::fill(dkc_p, dkc_p + L * dh, acc_t(0));
          std::fill(dvc_p, dvc_p + L * dh, acc_t(0));
        }
        // Rows past the length: zero gradients (dq, and dkc, dvc when gathered, through the
        // scratch below).
        for (int64_t i = i0 + nq; i < i1; ++i) {
          std::fill_n(dq_rot + lay.dq_rot(b, h, i), dh, scalar_t(0));
          if (S != 1 && !gather_ctx) {
            for (int64_t l = 0; l < L; ++l) {
              std::fill_n(dkc + lay.dkc(b, h, i) + l * lay.dkc.sl, dh, scalar_t(0));
              std::fill_n(dvc + lay.dvc(b, h, i) + l * lay.dvc.sl, dh, scalar_t(0));
            }
          }
          dbuf[bh * T + i] = 0;
        }
        if (gather_ctx) {
          std::fill(dkcbuf.begin() + (hh * kBlockQ + nq) * L * dh, dkcbuf.begin() + (hh + 1) * kBlockQ * L * dh, acc_t(0));
          std::fill(dvcbuf.begin() + (hh * kBlockQ + nq) * L * dh, dvcbuf.begin() + (hh + 1) * kBlockQ * L * dh, acc_t(0));
        }
        acc_t gate_acc = 0;
        const acc_t sig = acc_t(1) / (acc_t(1) + std::exp(-gate[h]));
        // Cross part and D, row by row.
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t slot = hh * kBlockQ + r;
          const acc_t* dO = dobuf.data() + slot * dp;
          acc_t* orow = obufs.data() + slot * dh;
          acc_t* dqc = dqbuf.data() + slot * dh;
          std::fill(dqc, dqc + dh, acc_t(0));
          if (L > 0) {
            const acc_t* qrow = qplain.data() + slot * dh;
            const int64_t i = i0 + r, s_idx = S == 1 ? 0 : i;
            const acc_t* kc_i = gather_ctx ? kcbuf.data() + slot * L * dh : nullptr;
            const acc_t* vc_i = gather_ctx ? vcbuf.data() + slot * L * dh : nullptr;
            const scalar_t* kc_s = kc + lay.kc(b, h, s_idx);
            const scalar_t* vc_s = vc + lay.vc(b, h, s_idx);
            if (gather_ctx) {
              cross_row(qrow, kc_i, dh, vc_i, dh, L, dh, scale, a.data(), oc.data(), row.data());
            } else {
              cross_row(qrow, kc_s, lay.kc.sl, vc_s, lay.vc.sl, L, dh, scale, a.data(), oc.data(), row.data());
            }
            const acc_t do_oc = dot(dO, oc.data(), dh);
            gate_acc += do_oc;
            for (int64_t l = 0; l < L; ++l) {
              if (gather_ctx) {
                std::copy_n(vc_i + l * dh, dh, row.data());
              } else {
                load_row(vc_s + l * lay.vc.sl, row.data(), dh);
              }
              const acc_t dz = a[l] * sig * (dot(dO, row.data(), dh) - do_oc);  // dOc = σ dO
              if (gather_ctx) {
                std::copy_n(kc_i + l * dh, dh, row.data());
              } else {
                load_row(kc_s + l * lay.kc.sl, row.data(), dh);
              }
              axpby(scale * dz, row.data(), acc_t(1), dqc, dh);
              if (S == 1) {
                axpby(scale * dz, qrow, acc_t(1), dkc_p + l * dh, dh);
                axpby(a[l] * sig, dO, acc_t(1), dvc_p + l * dh, dh);
              } else if (gather_ctx) {
                acc_t* dk_l = dkcbuf.data() + (slot * L + l) * dh;
                acc_t* dv_l = dvcbuf.data() + (slot * L + l) * dh;
                for (int64_t e = 0; e < dh; ++e) dk_l[e] = scale * dz * qrow[e];
                for (int64_t e = 0; e < dh; ++e) dv_l[e] = a[l] * sig * dO[e];
              } else {
                for (int64_t e = 0; e < dh; ++e) row[e] = scale * dz * qrow[e];
                store_row(row.data(), dkc + lay.dkc(b, h, i) + l * lay.dkc.sl, dh);
                for (int64_t e = 0; e < dh; ++e) row[e] = a[l] * sig * dO[e];
                store_row(row.data(), dvc + lay.dvc(b, h, i) + l * lay.dvc.sl, dh);
              }
            }
            // O^self = O − σ O^cross
            axpby(-sig, oc.data(), acc_t(1), orow, dh);
          }
          dbuf[bh * T + i0 + r] = dot(dO, orow, dh);
        }
        dgate_part[part] = sig * (acc_t(1) - sig) * gate_acc;
      }
      scatter_rows(dqbuf.data(), dh, nq, dq, lay.dq, b, h0, nh, i0, i1 - i0, dh);
      if (gather_ctx) {
        move_ctx<acc_t, scalar_t, true>(dkc, lay.dkc, dkcbuf.data(), dvc, lay.dvc, dvcbuf.data(), b, h0, nh, i0, i1 - i0,
                                        L, dh);
      }
    }
  });

  // ---- Pass B: per (b, kv group): the self part. For each of the group's heads (in
  // order), its query blocks below len_b and their key blocks at or left of the diagonal:
  // S = c Q̃ K̃ᵀ, P = exp(S − lse), dP = dO Vᵀ, dS = P (dP − D), then dq̃ += c dS K̃
  // (complete once the query block's key loop ends), dv += Pᵀ dO and dk̃ += c dSᵀ Q̃ into the
  // task's own T-row accumulators: 5 tile gemms and 1 exp pass per tile pair. Every sum runs
  // in a fixed order (dq̃ over key blocks; dk̃, dv over heads, then query blocks), whatever
  // the thread count.
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> qbuf(kBlockQ * dp), dobuf(kBlockQ * dp), sbuf(kBlockQ * kBlockK), dpbuf(kBlockQ * kBlockK),
        dqacc(kBlockQ * dp), dkacc(T * dp), dvacc(T * dp);
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      const int64_t len = row_length(lengths, b, T);
      // Keys past the length: zero gradients.
      for (int64_t j = len; j < T; ++j) {
        std::fill_n(dk_rot + lay.dk_rot(b, g, j), dh, scalar_t(0));
        std::fill_n(dv + lay.dv(b, g, j), dh, scalar_t(0));
      }
      if (len == 0) continue;
      const acc_t* KT_g = kt_all.data() + bg * dh * ldt;
      const acc_t* VT_g = vt_all.data() + bg * dh * ldt;
      const acc_t* K_g = k_all.data() + bg * T * dp;
      std::fill(dkacc.begin(), dkacc.begin() + len * dp, acc_t(0));
      std::fill(dvacc.begin(), dvacc.begin() + len * dp, acc_t(0));
      for (int64_t hi = 0; hi < group; ++hi) {
        const int64_t h = g + hi * Hkv;
        const int64_t bh = b * H + h;
        const acc_t* lse_bh = lse + bh * T;
        const acc_t* D_bh = dbuf + bh * T;
        for (int64_t i0 = 0; i0 < len; i0 += kBlockQ) {
          const int64_t nq = std::min(kBlockQ, len - i0);
          load_tile(q_rot + lay.q_rot(b, h, i0), nq, lay.q_rot.st, dh, qbuf.data(), dp);
          load_tile(grad_out + lay.grad_out(b, h, i0), nq, lay.grad_out.st, dh, dobuf.data(), dp);
          std::fill(dqacc.begin(), dqacc.begin() + nq * dp, acc_t(0));
          const int64_t kv_end = i0 + nq;  // keys j ≤ last valid row (< len)
          for (int64_t j0 = 0; j0 < kv_end; j0 += kBlockK) {
            const int64_t nk = std::min(kBlockK, kv_end - j0);
            acc_t* Sb = sbuf.data();
            acc_t* dP = dpbuf.data();
            gemm<acc_t>(nq, nk, dh, scale, qbuf.data(), dp, KT_g + j0, ldt, Sb, kBlockK, false);
            gemm<acc_t>(nq, nk, dh, acc_t(1), dobuf.data(), dp, VT_g + j0, ldt, dP, kBlockK, false);
            for (int64_t r = 0; r < nq; ++r) {
              const int64_t i = i0 + r;
              const int64_t ncol = std::clamp<int64_t>(i - j0 + 1, 0, nk);
              acc_t* s = Sb + r * kBlockK;
              acc_t* dpr = dP + r * kBlockK;
              exp_sub(s, lse_bh[i], s, ncol);  // P
              const acc_t Di = D_bh[i];
              for (int64_t c = 0; c < ncol; ++c) dpr[c] = s[c] * (dpr[c] - Di);  // dS
              for (int64_t c = ncol; c < nk; ++c) s[c] = dpr[c] = 0;
            }
            if (j0 + nk - 1 > i0) {
              // Crosses the diagonal: each row multiplies only its causal keys, each key only
              // the rows that see it (a non-finite value must not leak across the diagonal).
              gemm_causal_rows<acc_t>(nq, dh, nk, i0, j0, scale, dP, kBlockK, K_g + j0 * dp, dp, dqacc.data(), dp);
              gemm_anticausal_rows<acc_t>(nk, dh, nq, i0, j0, acc_t(1), Sb, kBlockK, dobuf.data(), dp,
                                          dvacc.data() + j0 * dp, dp);
              gemm_anticausal_rows<acc_t>(nk, dh, nq, i0, j0, scale, dP, kBlockK, qbuf.data(), dp,
                                          dkacc.data() + j0 * dp, dp);
            } else {
              gemm<acc_t>(nq, dh, nk, scale, dP, kBlockK, K_g + j0 * dp, dp, dqacc.data(), dp, true);
              gemm<acc_t, true>(nk, dh, nq, acc_t(1), Sb, kBlockK, dobuf.data(), dp, dvacc.data() + j0 * dp, dp,
                                true);  // dv += Pᵀ dO
              gemm<acc_t, true>(nk, dh, nq, scale, dP, kBlockK, qbuf.data(), dp, dkacc.data() + j0 * dp, dp,
                                true);  // dk̃ += c dSᵀ Q̃
            }
          }
          for (int64_t r = 0; r < nq; ++r) store_row(dqacc.data() + r * dp, dq_rot + lay.dq_rot(b, h, i0 + r), dh);
        }
      }
      for (int64_t j = 0; j < len; ++j) {
        store_row(dkacc.data() + j * dp, dk_rot + lay.dk_rot(b, g, j), dh);
        store_row(dvacc.data() + j * dp, dv + lay.dv(b, g, j), dh);
      }
    }
  });
}

// ---------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------
// The checks of wiola::gcla_attention (wiola/checks.h); inputs whose d_h is not contiguous
// are copied (the kernels take every other stride). Returns the dims and int64 lengths.
struct Inputs {
  Dims d;
  at::Tensor q_rot, k_rot, v, q, kc, vc;
  std::optional<at::Tensor> lengths;
};

Inputs check_inputs(const at::Tensor& q_rot, const at::Tensor& k_rot, const at::Tensor& v, const at::Tensor& q,
                    const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& gate,
                    const std::optional<at::Tensor>& lengths) {
  std::optional<at::Tensor> len = checks::gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths);
  using checks::unit_last_stride;
  const int64_t dh = q_rot.size(3);
  const Dims d{q_rot.size(0), q_rot.size(1), k_rot.size(1), q_rot.size(2), dh, kc.size(2), kc.size(3),
               1.0 / std::sqrt(static_cast<double>(dh))};
  return {d, unit_last_stride(q_rot), unit_last_stride(k_rot), unit_last_stride(v), unit_last_stride(q),
          unit_last_stride(kc), unit_last_stride(vc), std::move(len)};
}

std::tuple<at::Tensor, at::Tensor> gcla_attention_fwd(const at::Tensor& q_rot_in, const at::Tensor& k_rot_in,
                                                      const at::Tensor& v_in, const at::Tensor& q_in,
                                                      const at::Tensor& kc_in, const at::Tensor& vc_in,
                                                      const at::Tensor& gate,
                                                      const std::optional<at::Tensor>& lengths_in) {
  const Inputs in = check_inputs(q_rot_in, k_rot_in, v_in, q_in, kc_in, vc_in, gate, lengths_in);
  const Dims& d = in.d;
  const at::Tensor &q_rot = in.q_rot, &k_rot = in.k_rot, &v = in.v, &q = in.q, &kc = in.kc, &vc = in.vc;
  const std::optional<at::Tensor>& lengths = in.lengths;
  const auto acc = acc_scalar_type(q_rot);
  const at::Tensor gate_acc = gate.to(acc).contiguous();
  at::Tensor out = empty_output_like(q_rot);  // q_rot's layout: (B, T, H, d_h) order for the model's views
  Layout lay;
  lay.q_rot = RowStrides(q_rot), lay.k_rot = RowStrides(k_rot), lay.v = RowStrides(v), lay.q = RowStrides(q);
  lay.out = RowStrides(out), lay.kc = CtxStrides(kc), lay.vc = CtxStrides(vc);
  at::Tensor lse = empty_output({d.B, d.H, d.T}, q_rot.options().dtype(acc));
  const int64_t* len_ptr = lengths.has_value() ? lengths->const_data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q_rot.scalar_type(), "wiola_gcla_attention_fwd", [&] {
    using acc_t = acc_type<scalar_t>;
    forward_impl<scalar_t>(d, lay, q_rot.const_data_ptr<scalar_t>(), k_rot.const_data_ptr<scalar_t>(),
                           v.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(), kc.const_data_ptr<scalar_t>(),
                           vc.const_data_ptr<scalar_t>(), gate_acc.const_data_ptr<acc_t>(), len_ptr,
                           out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<acc_t>());
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gcla_attention_bwd(
    const at::Tensor& grad_out_in, const at::Tensor& q_rot_in, const at::Tensor& k_rot_in, const at::Tensor& v_in,
    const at::Tensor& q_in, const at::Tensor& kc_in, const at::Tensor& vc_in, const at::Tensor& gate,
    const std::optional<at::Tensor>& lengths_in, const at::Tensor& out_in, const at::Tensor& lse_in) {
  const Inputs in = check_inputs(q_rot_in, k_rot_in, v_in, q_in, kc_in, vc_in, gate, lengths_in);
  const Dims& d = in.d;
  const at::Tensor &q_rot = in.q_rot, &k_rot = in.k_rot, &v = in.v, &q = in.q, &kc = in.kc, &vc = in.vc;
  const std::optional<at::Tensor>& lengths = in.lengths;
  const auto acc = acc_scalar_type(q_rot);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_out", &grad_out_in}, {"out", &out_in}}) {
    TORCH_CHECK_VALUE(t->sizes() == q_rot.sizes() && t->scalar_type() == q_rot.scalar_type() &&
                          t->device() == q_rot.device(),
                      name, " must have the shape and dtype of q_rot ", checks::shape_str(q_rot.sizes()), " ",
                      checks::dtype_name(q_rot.scalar_type()), ", got ", checks::shape_str(t->sizes()), " ",
                      checks::dtype_name(t->scalar_type()));
  }
  TORCH_CHECK_VALUE(lse_in.dim() == 3 && lse_in.size(0) == d.B && lse_in.size(1) == d.H && lse_in.size(2) == d.T &&
                        lse_in.scalar_type() == acc && lse_in.device() == q_rot.device(),
                    "lse must be the forward's (B, H, T) = ", checks::shape_str({d.B, d.H, d.T}), " ",
                    checks::dtype_name(acc), " tensor, got ", checks::shape_str(lse_in.sizes()), " ",
                    checks::dtype_name(lse_in.scalar_type()));
  const at::Tensor grad_out = checks::unit_last_stride(grad_out_in), out = checks::unit_last_stride(out_in);
  const at::Tensor lse = lse_in.contiguous();
  const at::Tensor gate_acc = gate.to(acc).contiguous();
  // Each gradient in its input's layout: autograd hands it back through the input's view
  // chain (transpose, view of the projection) without a copy.
  at::Tensor dq_rot = empty_output_like(q_rot);
  at::Tensor dk_rot = empty_output_like(k_rot);
  at::Tensor dv = empty_output_like(v);
  at::Tensor dq = empty_output_like(q);
  const int64_t nqb = (d.T + kBlockQ - 1) / kBlockQ;
  const int64_t ntasks = d.B * d.H * nqb;
  const at::TensorOptions acc_opts = q_rot.options().dtype(acc);
  at::Tensor dbuf = at::empty({d.B, d.H, d.T}, acc_opts);
  at::Tensor dgate_part = at::zeros({d.B, d.H, nqb}, acc_opts);
  const bool shared = d.S == 1;
  at::Tensor dkc_part = at::empty({shared ? ntasks : 0, d.L, d.dh}, acc_opts);
  at::Tensor dvc_part = at::empty({shared ? ntasks : 0, d.L, d.dh}, acc_opts);
  at::Tensor dkc = shared ? at::Tensor() : empty_output_like(kc);
  at::Tensor dvc = shared ? at::Tensor() : empty_output_like(vc);
  Layout lay;
  lay.q_rot = RowStrides(q_rot), lay.k_rot = RowStrides(k_rot), lay.v = RowStrides(v), lay.q = RowStrides(q);
  lay.out = RowStrides(out), lay.grad_out = RowStrides(grad_out), lay.kc = CtxStrides(kc), lay.vc = CtxStrides(vc);
  lay.dq_rot = RowStrides(dq_rot), lay.dk_rot = RowStrides(dk_rot), lay.dv = RowStrides(dv), lay.dq = RowStrides(dq);
  if (!shared) lay.dkc = CtxStrides(dkc), lay.dvc = CtxStrides(dvc);
  const int64_t* len_ptr = lengths.has_value() ? lengths->const_data_ptr<int64_t>() : nullptr;
  if (d.B * d.H * d.T * d.dh > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q_rot.scalar_type(), "wiola_gcla_attention_bwd", [&] {
      using acc_t = acc_type<scalar_t>;
      backward_impl<scalar_t>(
          d, lay, grad_out.const_data_ptr<scalar_t>(), q_rot.const_data_ptr<scalar_t>(), k_rot.const_data_ptr<scalar_t>(),
          v.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(), kc.const_data_ptr<scalar_t>(),
          vc.const_data_ptr<scalar_t>(), gate_acc.const_data_ptr<acc_t>(), len_ptr, out.const_data_ptr<scalar_t>(),
          lse.const_data_ptr<acc_t>(), dq_rot.mutable_data_ptr<scalar_t>(), dk_rot.mutable_data_ptr<scalar_t>(),
          dv.mutable_data_ptr<scalar_t>(), dq.mutable_data_ptr<scalar_t>(),
          shared ? nullptr : dkc.mutable_data_ptr<scalar_t>(), shared ? nullptr : dvc.mutable_data_ptr<scalar_t>(),
          dbuf.mutable_data_ptr<acc_t>(), shared ? dkc_part.mutable_data_ptr<acc_t>() : nullptr,
          shared ? dvc_part.mutable_data_ptr<acc_t>() : nullptr, dgate_part.mutable_data_ptr<acc_t>());
    });
  } else {
    dq_rot.zero_();
    dk_rot.zero_();
    dv.zero_();
    dq.zero_();
    dkc_part.zero_();
    dvc_part.zero_();
  }
  if (shared) {
    // (B, H, nqb, L, dh) partials summed over the query blocks: a fixed-shape reduction.
    const int64_t nb = d.B * d.H * d.T > 0 ? nqb : 0;
    if (nb > 0) {
      dkc = dkc_part.view({d.B, d.H, nb, d.L, d.dh}).sum(2, /*keepdim=*/true).to(kc.scalar_type());
      dvc = dvc_part.view({d.B, d.H, nb, d.L, d.dh}).sum(2, /*keepdim=*/true).to(vc.scalar_type());
    } else {
      dkc = at::zeros(kc.sizes(), kc.options());
      dvc = at::zeros(vc.sizes(), vc.options());
    }
  }
  at::Tensor dgate = dgate_part.sum(at::IntArrayRef{0, 2}).to(gate.scalar_type());  // (IntArrayRef: torch 2.11 finds {0, 2} ambiguous)
  return {dq_rot, dk_rot, dv, dq, dkc, dvc, dgate};
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("gcla_attention", &gcla_attention_fwd);
  m.impl("gcla_attention_backward", &gcla_attention_bwd);
}

}  // namespace wiola::cpu
