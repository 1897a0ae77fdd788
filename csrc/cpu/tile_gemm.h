// Small dense tile GEMMs on at::vec registers, and the packs they read, for the CPU
// attention kernels. No BLAS: the products are tiny (tens of rows, one head width) and
// the kernels need three things a library call does not give them: a causal mask applied
// inside the product, an accumulation order fixed per element (results independent of
// the tile shape and of the thread count), and operands read in place from the packs.
//
// Conventions of every routine here:
//   * Matrices are row-major MatRefs {data, ld}: element (r, c) at data[r·ld + c].
//   * N, the column count of B and C, is rounded up to a multiple of kNr (two vectors):
//     B must have that many readable columns and C that many writable ones. The columns
//     past N receive values computed from B's extra columns, which the caller never reads
//     back (they stay finite when those columns are, e.g. zero padding).
//   * No alignment: vectors are loaded and stored unaligned.
//   * Each C element's sum runs over k in increasing order, one fused multiply-add per term,
//     then C = alpha·sum (or C + alpha·sum): bitwise the same whatever M, the register
//     block a row falls into, or the thread that computes it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace wiola::cpu::tile {

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

// A row-major matrix view: element (r, c) at data[r·ld + c].
template <typename T>
struct MatRef {
  T* data;
  int64_t ld;
};

// Rows a register block holds: 6 rows × 2 vectors = 12 accumulators, plus the 2 B vectors
// and the broadcast A element, fit AVX2's 16 registers.
constexpr int kMr = 6;

// Tile widths are padded to kPad elements: two vectors of the widest accumulation type,
// the column step of every routine here.
constexpr int64_t kPad = 16;
static_assert(kPad % (2 * Vec<float>::size()) == 0 && kPad % (2 * Vec<double>::size()) == 0,
              "kPad must hold whole column steps (two vectors) of float and double");
inline int64_t padded(int64_t n) { return (n + kPad - 1) / kPad * kPad; }

// Row stride of a transposed pack of T columns: one extra pad, so that a power-of-two T
// does not map the d_h rows a tile product streams through to the same L1 cache set.
inline int64_t transposed_ld(int64_t T) { return padded(T) + kPad; }

// A(r, k) of an M×K operand: row-major, or with kTransA read from its K×M transpose in
// place (A(r, k) = data[k·ld + r]; no transpose copy).
template <bool kTransA, typename acc_t>
inline acc_t a_elem(const acc_t* A, int64_t lda, int64_t r, int64_t k) {
  return kTransA ? A[k * lda + r] : A[r * lda + k];
}

// Offset of row block i of A (row-major) or of its transpose.
template <bool kTransA>
inline int64_t a_rows(int64_t i, int64_t lda) {
  return kTransA ? i : i * lda;
}

// One register block: C (MR×N) (+)= alpha · A (MR×K) · B (K×N).
template <typename acc_t, int MR, bool kTransA = false>
inline void gemm_rows(int64_t K, int64_t N, acc_t alpha, MatRef<const acc_t> A, MatRef<const acc_t> B,
                      MatRef<acc_t> C, bool accumulate) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const V valpha(alpha);
  for (int64_t j = 0; j < N; j += 2 * W) {
    V acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = V(acc_t(0));
    for (int64_t k = 0; k < K; ++k) {
      const V b0 = V::loadu(B.data + k * B.ld + j), b1 = V::loadu(B.data + k * B.ld + j + W);
      for (int r = 0; r < MR; ++r) {
        const V a(a_elem<kTransA>(A.data, A.ld, r, k));
        acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      acc_t* c = C.data + r * C.ld + j;
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

// C (M×N) = alpha · A · B, or C += alpha · A · B with accumulate; A is M×K (kTransA: read
// from its K×M transpose), B is K×N.
template <typename acc_t, bool kTransA = false>
inline void gemm(int64_t M, int64_t N, int64_t K, acc_t alpha, MatRef<const acc_t> A, MatRef<const acc_t> B,
                 MatRef<acc_t> C, bool accumulate) {
  int64_t i = 0;
  for (; i + kMr <= M; i += kMr) {
    gemm_rows<acc_t, kMr, kTransA>(K, N, alpha, {A.data + a_rows<kTransA>(i, A.ld), A.ld}, B,
                                   {C.data + i * C.ld, C.ld}, accumulate);
  }
  const MatRef<const acc_t> a{A.data + a_rows<kTransA>(i, A.ld), A.ld};
  const MatRef<acc_t> c{C.data + i * C.ld, C.ld};
  switch (M - i) {
    case 5: gemm_rows<acc_t, 5, kTransA>(K, N, alpha, a, B, c, accumulate); break;
    case 4: gemm_rows<acc_t, 4, kTransA>(K, N, alpha, a, B, c, accumulate); break;
    case 3: gemm_rows<acc_t, 3, kTransA>(K, N, alpha, a, B, c, accumulate); break;
    case 2: gemm_rows<acc_t, 2, kTransA>(K, N, alpha, a, B, c, accumulate); break;
    case 1: gemm_rows<acc_t, 1, kTransA>(K, N, alpha, a, B, c, accumulate); break;
    default: break;
  }
}

// Per-row k ranges of a register block: row r sums k ∈ [kb[r], ke[r]).
template <int MR>
struct KRanges {
  int64_t kb[MR], ke[MR];
};

// One register block of C (MR×N) += alpha · A · B where row r sums only its own k range.
// The block streams the union of the ranges once; k in every range (their intersection)
// takes the unmasked loop. Each row's accumulator takes exactly its own terms in increasing
// k, so the result equals MR one-row products; rows with an empty range are left untouched.
template <typename acc_t, int MR, bool kTransA = false>
inline void gemm_rows_ranged(const KRanges<MR>& kr, int64_t N, acc_t alpha, MatRef<const acc_t> A,
                             MatRef<const acc_t> B, MatRef<acc_t> C) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const int64_t *kb = kr.kb, *ke = kr.ke;
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
    auto step = [&](int64_t k, bool masked) {
      const V b0 = V::loadu(B.data + k * B.ld + j), b1 = V::loadu(B.data + k * B.ld + j + W);
      for (int r = 0; r < MR; ++r) {
        if (masked && (k < kb[r] || k >= ke[r])) continue;
        const V a(a_elem<kTransA>(A.data, A.ld, r, k));
        acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
      }
    };
    for (int64_t k = lo; k < lo_all; ++k) step(k, true);
    for (int64_t k = lo_all; k < hi_all; ++k) step(k, false);
    for (int64_t k = std::max(hi_all, lo_all); k < hi; ++k) step(k, true);
    for (int r = 0; r < MR; ++r) {
      if (kb[r] >= ke[r]) continue;
      acc_t* c = C.data + r * C.ld + j;
      at::vec::fmadd(valpha, acc[r][0], V::loadu(c)).store(c);
      at::vec::fmadd(valpha, acc[r][1], V::loadu(c + W)).store(c + W);
    }
  }
}

// C (M×N) += alpha · A · B where row r sums only k ∈ [kb, ke) given by range(r, kb, ke).
template <typename acc_t, bool kTransA = false, typename Range>
inline void gemm_ranged(int64_t M, int64_t N, acc_t alpha, MatRef<const acc_t> A, MatRef<const acc_t> B,
                        MatRef<acc_t> C, const Range& range) {
  int64_t i = 0;
  for (; i + kMr <= M; i += kMr) {
    KRanges<kMr> kr;
    for (int r = 0; r < kMr; ++r) range(i + r, kr.kb[r], kr.ke[r]);
    gemm_rows_ranged<acc_t, kMr, kTransA>(kr, N, alpha, {A.data + a_rows<kTransA>(i, A.ld), A.ld}, B,
                                          {C.data + i * C.ld, C.ld});
  }
  for (; i < M; ++i) {
    KRanges<1> kr;
    range(i, kr.kb[0], kr.ke[0]);
    gemm_rows_ranged<acc_t, 1, kTransA>(kr, N, alpha, {A.data + a_rows<kTransA>(i, A.ld), A.ld}, B,
                                        {C.data + i * C.ld, C.ld});
  }
}

// Where a query-by-key tile sits: its first query row i0 and first key j0. Query i sees
// key j when j ≤ i.
struct Diagonal {
  int64_t i0, j0;
};

// C (M×N) += alpha · A · B for A an M×K query-by-key tile crossing the causal diagonal:
// row r (query i0 + r) takes only its causal keys j ≤ i0 + r, i.e. the first
// clamp(i0 + r − j0 + 1, 0, K) rows of B. A's masked entries are 0, but 0 · NaN is NaN: a
// non-finite value in B at a later key must not reach earlier rows.
template <typename acc_t>
inline void gemm_causal_rows(int64_t M, int64_t N, int64_t K, Diagonal dg, acc_t alpha, MatRef<const acc_t> A,
                             MatRef<const acc_t> B, MatRef<acc_t> C) {
  gemm_ranged<acc_t>(M, N, alpha, A, B, C, [&](int64_t r, int64_t& kb, int64_t& ke) {
    kb = 0;
    ke = std::clamp<int64_t>(dg.i0 + r - dg.j0 + 1, 0, K);
  });
}

// Its transpose, for the key-side gradients: C (K×N) += alpha · Aᵀ · B, A the M×K tile
// itself and B M×N, where row c of Aᵀ (key j0 + c) takes only the query rows that see it,
// i ≥ j0 + c, i.e. rows clamp(j0 + c − i0, 0, M) .. M of B.
template <typename acc_t>
inline void gemm_anticausal_rows(int64_t K, int64_t N, int64_t M, Diagonal dg, acc_t alpha, MatRef<const acc_t> A,
                                 MatRef<const acc_t> B, MatRef<acc_t> C) {
  gemm_ranged<acc_t, true>(K, N, alpha, A, B, C, [&](int64_t c, int64_t& kb, int64_t& ke) {
    kb = std::clamp<int64_t>(dg.j0 + c - dg.i0, 0, M);
    ke = M;
  });
}

// Rows [0, n) of a (·, dh) scalar_t matrix with row stride lds, converted into an acc_t
// tile with row stride ldd.
template <typename scalar_t, typename acc_t>
inline void load_tile(const scalar_t* src, int64_t n, int64_t lds, int64_t dh, acc_t* dst, int64_t ldd) {
  for (int64_t r = 0; r < n; ++r) load_row(src + r * lds, dst + r * ldd, dh);
}

// Time steps per parallel task of the packs (any value gives the same pack).
constexpr int64_t kPackChunk = 128;

// The (B, Hkv, T, dh) tensor src (rows at RowStrides rs, dh contiguous) converted once to
// acc_t and transposed per (b, kv group) n = b·Hkv + g: element (n, e, t) at
// out[(n·dh + e)·ldt + t], ldt = transposed_ld(T), zero in columns t ≥ T. A B operand for
// S = Q·Kᵀ-shaped products, read in place at column offset j0.
template <typename scalar_t, typename acc_t>
std::vector<acc_t> pack_transposed(const scalar_t* src, const RowStrides& rs, int64_t B, int64_t Hkv, int64_t T,
                                   int64_t dh) {
  const int64_t n = B * Hkv, ldt = transposed_ld(T), nb = (T + kPackChunk - 1) / kPackChunk;
  std::vector<acc_t> out(n * dh * ldt, acc_t(0));
  at::parallel_for(0, n * nb, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> row(dh);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t k = task / nb, t0 = (task % nb) * kPackChunk, t1 = std::min(T, t0 + kPackChunk);
      for (int64_t t = t0; t < t1; ++t) {
        load_row(src + rs(k / Hkv, k % Hkv, t), row.data(), dh);
        for (int64_t e = 0; e < dh; ++e) out[(k * dh + e) * ldt + t] = row[e];
      }
    }
  });
  return out;
}

// The same tensor converted row by row: element (n, t, e) at out[(n·T + t)·dp + e],
// dp = padded(dh), zero in columns e ≥ dh. A B operand for P·V-shaped products, read in
// place at row offset j0.
template <typename scalar_t, typename acc_t>
std::vector<acc_t> pack_rows(const scalar_t* src, const RowStrides& rs, int64_t B, int64_t Hkv, int64_t T, int64_t dh) {
  const int64_t rows = B * Hkv * T, dp = padded(dh);
  std::vector<acc_t> out(rows * dp, acc_t(0));
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) load_row(src + rs(r / (Hkv * T), (r / T) % Hkv, r % T), out.data() + r * dp, dh);
  });
  return out;
}

}  // namespace wiola::cpu::tile
