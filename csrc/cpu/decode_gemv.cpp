// Batch-1 decoding GEMV on the CPU: y = x · Wᵀ for a few rows x (≤ 16) and weights read
// where they are, in nn.Linear's (n, k) layout, in float32, bfloat16 or float16.
//
// At batch 1 a decoding step's matrix products are bound by reading each weight once, so the
// kernel is built around one sequential read per thread. A thread owns a contiguous range of
// output rows; weight row j is one contiguous stretch of k elements and the rows of a range
// follow each other in memory, so the thread's reads are a single forward stream, as with a
// packed panel layout — but over the Parameter's own storage: nothing is copied, so the
// decoding step needs no second copy of the weights and sees every in-place change.
//
// Per weight row, each row of x keeps a few vector accumulators over k (the chunks of the row
// go round-robin to S sets, so that the FMA latency is off the critical path), reduced once at
// the end of the row. x is converted once per call into float32 and laid out for the loads:
//
//   float32  chunk = one vector of floats;
//   bfloat16 chunk = one vector of 16-bit words; a bf16 word is the top half of a float, so
//            the even elements are the 32-bit lanes shifted left by 16 and the odd ones the
//            lanes with the low half masked off: two FMAs per chunk, with x stored in the same
//            even/odd order (no widening shuffles);
//   float16  chunk = two halves widened by vcvtph2ps (F16C; AVX-512F for 16 at once).
//
// Accumulation is float32 in a fixed order that depends on the ISA path, the weight dtype and
// the number of x rows, never on the thread count (each output is one thread's sum).
//
// AVX512_BF16's vdpbf16ps is not used. It would do a bf16 chunk's two FMAs in one instruction,
// but it takes x in bf16: x rounded to 8 bits of mantissa (relative error ≤ 2⁻⁹ per term, so
// within SPEC §9's 1e-2 for bf16 weights except under heavy cancellation; exact when x is
// already bf16, as in a bf16 model), and flushes subnormals. The loop is bound by the weight
// stream, not by its arithmetic, and the shift/mask path already reads at that rate, so the
// instruction would change numerics for no speed (docs/performance.md).
//
// Concurrent streams and software prefetch, with one row of x (a decoding step): a single
// sequential stream leaves a core short of reads in flight (each load feeds only 1–4 vector
// ops), so four weight rows are read side by side, each prefetched 1 KiB ahead — on the AVX2
// path (two streams: +5–12 % over one on an AVX2-only Zen 3 core; four: +10–40 % over two on a
// Sapphire Rapids core at the AVX2 level, bf16 and fp32, 1 and 2 threads) and on the AVX-512
// path (+50–70 % over one on Sapphire Rapids, where one stream read 20–30 % below torch.sum
// over the same bytes and four read 15–30 % above it; docs/performance.md).
//
// The ISA paths (generic, AVX2, AVX-512) are chosen at run time by the shared level (isa.h:
// WIOLA_CPU_ISA, wiola_kernels.set_cpu_isa): the AVX-512 path needs only AVX-512 F/BW/VL/DQ.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common.h"
#include "decode_kernels.h"
#include "isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WIOLA_GEMV_X86 1
#include <immintrin.h>
#endif

namespace wiola::cpu {
namespace {

constexpr int64_t kMaxRows = 16;            // rows of x per call (a decoding step's B·T_new)
constexpr int64_t kRowBlock = 4;            // x rows per register block
constexpr int64_t kXPad = 32;               // prepared x rows are padded (zeros) to a multiple of this
constexpr int64_t kMinThreadBytes = 1 << 16;  // weight bytes below which a call stays on one thread

constexpr int64_t kAlignFloats = 16;       // 64 bytes: prepared x starts on a cache line
// AVX2, one row of x: weight rows read at once, accumulator vectors per row (sets × parts:
// four streams of two fill 8 of the 16 registers), and how far ahead of its reads each stream
// is prefetched (the sweeps behind these: docs/history.md, "Decoding GEMV").
constexpr int kStreamsAvx2 = 4;
constexpr int kStreamSets = 2;
constexpr int64_t kPrefetchBytes = 1024;
// AVX-512, one row of x: weight rows read at once, and accumulator vectors per row (sets ×
// parts), from a sweep of 1–4 streams and 0–4 KiB prefetch (docs/history.md).
constexpr int kStreams512 = 4;
constexpr int kStreamSets512 = 2;

inline float* align_up(float* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<float*>((a + 63) & ~uintptr_t(63));
}

enum class WType { kF32, kBF16, kF16 };

template <WType T>
using Elem = std::conditional_t<T == WType::kF32, float, std::conditional_t<T == WType::kBF16, at::BFloat16, at::Half>>;

// Elements per chunk of a path: one vector of weights (the same count fixes x's layout).
constexpr int64_t chunk_elems(Isa isa, WType t) {
  const int64_t bytes = isa == Isa::kAvx512 ? 64 : 32;
  return t == WType::kF32 ? bytes / 4 : bytes / 2;
}

// Float vectors one chunk of weights widens to: bf16 even/odd lanes, fp16 low/high halves.
constexpr int parts(WType t) { return t == WType::kF32 ? 1 : 2; }

// Accumulator sets for B rows of x: the chunks of a row go round-robin to S sets, so that
// 8 accumulators (B·S·parts) take the FMAs; 4 left one core short of the weight stream's
// rate (docs/performance.md).
constexpr int sets_for(int b, int parts) { return std::max(1, 8 / (b * parts)); }

template <typename O>
inline void store(O* y, float v) {
  *y = static_cast<O>(v);
}

// ---- generic: plain C++, k in order --------------------------------------------------------

template <WType T, typename O>
void rows_generic(const Elem<T>* w, int64_t ldw, int64_t k, int64_t nrows, const float* x, int64_t ldx,
                  int64_t xrows, O* y, int64_t ldy) {
  for (int64_t j = 0; j < nrows; ++j) {
    const Elem<T>* wj = w + j * ldw;
    for (int64_t b = 0; b < xrows; ++b) {
      const float* xb = x + b * ldx;
      float acc = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) acc += xb[kk] * static_cast<float>(wj[kk]);
      store(y + b * ldy + j, acc);
    }
  }
}

#if defined(WIOLA_GEMV_X86)

// ---- AVX2 + FMA + F16C (the build's baseline) ----------------------------------------------

// A chunk of weights as P float vectors (P = 1 for float32, 2 otherwise).
template <WType T>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void load_avx2(const Elem<T>* p, __m256* v) {
  if constexpr (T == WType::kF32) {
    v[0] = _mm256_loadu_ps(p);
  } else if constexpr (T == WType::kBF16) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));                                  // even elements
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xffff0000u))));  // odd elements
  } else {
    v[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + 1));
  }
}

__attribute__((target("avx2,fma"), always_inline)) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Accumulate one chunk of weights (at wp; x's chunk at offset `at`) into set s of B rows.
template <WType T, int B, int S>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void step_avx2(__m256 (&acc)[B][S][parts(T)],
                                                                             const Elem<T>* wp, const float* x,
                                                                             int64_t ldx, int64_t at, int s) {
  __m256 v[parts(T)];
  load_avx2<T>(wp, v);
  for (int b = 0; b < B; ++b)
    for (int p = 0; p < parts(T); ++p)
      acc[b][s][p] = _mm256_fmadd_ps(v[p], _mm256_loadu_ps(x + b * ldx + at + 8 * p), acc[b][s][p]);
}

// One weight row against B rows of x (prepared, ldx apart): y[b·ldy] = Σ_k x[b, k] w[k],
// prefetched kPrefetchBytes ahead (faster than without for several rows of x: docs/history.md).
template <WType T, int B, typename O>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void row_avx2(const Elem<T>* w, int64_t k,
                                                                            const float* x, int64_t ldx, O* y,
                                                                            int64_t ldy) {
  constexpr int64_t C = chunk_elems(Isa::kAvx2, T);
  constexpr int P = parts(T), S = sets_for(B, P);
  __m256 acc[B][S][P];
  for (int b = 0; b < B; ++b)
    for (int s = 0; s < S; ++s)
      for (int p = 0; p < P; ++p) acc[b][s][p] = _mm256_setzero_ps();
  constexpr int64_t kGroupBytes = S * C * int64_t(sizeof(Elem<T>));
  const int64_t full = k / C;
  int64_t c = 0;
  for (; c + S <= full; c += S) {
    for (int64_t b = 0; b < kGroupBytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + c * C) + kPrefetchBytes + b, _MM_HINT_T0);
    for (int s = 0; s < S; ++s) step_avx2<T, B, S>(acc, w + (c + s) * C, x, ldx, (c + s) * C, s);
  }
  for (; c < full; ++c) step_avx2<T, B, S>(acc, w + c * C, x, ldx, c * C, 0);
  if (const int64_t tail = k - full * C) {  // x is zero past k: pad the weights' tail with zeros too
    Elem<T> buf[C] = {};
    std::memcpy(buf, w + full * C, tail * sizeof(Elem<T>));
    step_avx2<T, B, S>(acc, buf, x, ldx, full * C, 0);
  }
  for (int b = 0; b < B; ++b) {
    __m256 v = acc[b][0][0];
    for (int s = 0; s < S; ++s)
      for (int p = 0; p < P; ++p)
        if (s || p) v = _mm256_add_ps(v, acc[b][s][p]);
    store(y + b * ldy, hsum_avx2(v));
  }
}

// One row of x against R weight rows read as R concurrent streams (R = 1 or 4), each row
// with kStreamSets accumulator vectors (sets × parts): the same sums, chunk for chunk, whether a row
// is read alone or beside another (so the bits do not depend on how the rows were paired,
// which follows the thread split). Each stream is prefetched kPrefetchBytes ahead.
template <WType T, int R, typename O>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void streams_avx2(const Elem<T>* const (&w)[R],
                                                                                int64_t k, const float* x,
                                                                                O* const (&y)[R]) {
  constexpr int64_t C = chunk_elems(Isa::kAvx2, T);
  constexpr int P = parts(T), S = kStreamSets / P;
  static_assert(S >= 1, "kStreamSets: at least one set per part");
  constexpr int64_t kGroupBytes = S * C * int64_t(sizeof(Elem<T>));
  __m256 acc[R][S][P];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s)
      for (int p = 0; p < P; ++p) acc[r][s][p] = _mm256_setzero_ps();
  auto chunk = [&](int r, const Elem<T>* wp, int64_t at, int s) {
    __m256 v[P];
    load_avx2<T>(wp, v);
    for (int p = 0; p < P; ++p) acc[r][s][p] = _mm256_fmadd_ps(v[p], _mm256_loadu_ps(x + at + 8 * p), acc[r][s][p]);
  };
  const int64_t full = k / C;
  int64_t c = 0;
  for (; c + S <= full; c += S) {
    for (int r = 0; r < R; ++r)
      for (int64_t b = 0; b < kGroupBytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + c * C) + kPrefetchBytes + b, _MM_HINT_T0);
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) chunk(r, w[r] + (c + s) * C, (c + s) * C, s);
  }
  for (; c < full; ++c)
    for (int r = 0; r < R; ++r) chunk(r, w[r] + c * C, c * C, 0);
  if (const int64_t tail = k - full * C) {  // x is zero past k: pad the weights' tail with zeros too
    for (int r = 0; r < R; ++r) {
      Elem<T> buf[C] = {};
      std::memcpy(buf, w[r] + full * C, tail * sizeof(Elem<T>));
      chunk(r, buf, full * C, 0);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 v = acc[r][0][0];
    for (int s = 0; s < S; ++s)
      for (int p = 0; p < P; ++p)
        if (s || p) v = _mm256_add_ps(v, acc[r][s][p]);
    store(y[r], hsum_avx2(v));
  }
}

// The rows of one thread's range, all inlined into one function: no call (and no
// vzeroupper) between rows of the stream. One row of x (a decoding step): the range's four
// quarters are read side by side, rows j, j + q, j + 2q, j + 3q together (q = nrows / 4) —
// more streams in flight raise a core's read rate (one stream's loads each feed 1–4 vector
// ops, which fill the scheduler before enough reads are in flight; docs/performance.md). More
// rows of x: each weight row once, against blocks of kRowBlock rows of x.
template <WType T, typename O>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Elem<T>* w, int64_t ldw, int64_t k, int64_t nrows,
                                                          const float* x, int64_t ldx, int64_t xrows, O* y,
                                                          int64_t ldy) {
  if (xrows == 1) {
    constexpr int R = kStreamsAvx2;
    const int64_t q = nrows / R;
    for (int64_t j = 0; j < q; ++j) {
      const Elem<T>* rows[R];
      O* out[R];
      for (int r = 0; r < R; ++r) {
        rows[r] = w + (j + r * q) * ldw;
        out[r] = y + j + r * q;
      }
      streams_avx2<T, R, O>(rows, k, x, out);
    }
    for (int64_t j = R * q; j < nrows; ++j) {  // the last nrows mod R rows, alone
      const Elem<T>* const last[1] = {w + j * ldw};
      O* const out[1] = {y + j};
      streams_avx2<T, 1, O>(last, k, x, out);
    }
    return;
  }
  for (int64_t j = 0; j < nrows; ++j) {
    const Elem<T>* wj = w + j * ldw;  // re-read from L1 by the later blocks of x rows
    for (int64_t b0 = 0; b0 < xrows; b0 += kRowBlock) {
      const float* xb = x + b0 * ldx;
      O* yb = y + b0 * ldy + j;
      switch (std::min(kRowBlock, xrows - b0)) {
        case 1: row_avx2<T, 1>(wj, k, xb, ldx, yb, ldy); break;
        case 2: row_avx2<T, 2>(wj, k, xb, ldx, yb, ldy); break;
        case 3: row_avx2<T, 3>(wj, k, xb, ldx, yb, ldy); break;
        default: row_avx2<T, 4>(wj, k, xb, ldx, yb, ldy); break;
      }
    }
  }
}

#if defined(WIOLA_HAVE_AVX512_TARGET)

// ---- AVX-512 F/BW/VL/DQ -------------------------------------------------------------------

template <WType T>
WIOLA_TARGET_AVX512 __attribute__((always_inline)) inline void load_avx512(const Elem<T>* p, __m512* v) {
  if constexpr (T == WType::kF32) {
    v[0] = _mm512_loadu_ps(p);
  } else if constexpr (T == WType::kBF16) {
    const __m512i u = _mm512_loadu_si512(p);
    v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    v[1] = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
  } else {
    v[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    v[1] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + 1));
  }
}

template <WType T, int B, int S>
WIOLA_TARGET_AVX512 __attribute__((always_inline)) inline void step_avx512(__m512 (&acc)[B][S][parts(T)],
                                                                                 const Elem<T>* wp, const float* x,
                                                                          int64_t ldx, int64_t at, int s) {
  __m512 v[parts(T)];
  load_avx512<T>(wp, v);
  for (int b = 0; b < B; ++b)
    for (int p = 0; p < parts(T); ++p)
      acc[b][s][p] = _mm512_fmadd_ps(v[p], _mm512_loadu_ps(x + b * ldx + at + 16 * p), acc[b][s][p]);
}

// R weight rows (R = 1, 2 or 4, read as concurrent streams, each prefetched) against B rows of
// x (prepared, ldx apart): y[r][b·ldy] = Σ_k x[b, k] w[r][k], one accumulator per (weight row,
// x row, part) — the streams, not extra sets, keep the FMAs independent — so a row's sums do
// not depend on the rows read beside it (which follow the thread split). Several prefetched
// streams read a step's context slots (2 rows of x against W_Kc and W_Vc) as fast as one row
// of x reads, where one stream without prefetch was ~40 % slower (docs/history.md).
template <WType T, int R, int B, typename O>
WIOLA_TARGET_AVX512 __attribute__((always_inline)) inline void row_avx512(const Elem<T>* const (&w)[R], int64_t k,
                                                                         const float* x, int64_t ldx,
                                                                         O* const (&y)[R], int64_t ldy) {
  constexpr int64_t C = chunk_elems(Isa::kAvx512, T);
  constexpr int P = parts(T), S = 1;
  constexpr int64_t kGroupBytes = S * C * int64_t(sizeof(Elem<T>));
  __m512 acc[R][B][S][P];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b)
      for (int s = 0; s < S; ++s)
        for (int p = 0; p < P; ++p) acc[r][b][s][p] = _mm512_setzero_ps();
  const int64_t full = k / C;
  int64_t c = 0;
  for (; c + S <= full; c += S) {
    for (int r = 0; r < R; ++r)
      for (int64_t b = 0; b < kGroupBytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + c * C) + kPrefetchBytes + b, _MM_HINT_T0);
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) step_avx512<T, B, S>(acc[r], w[r] + (c + s) * C, x, ldx, (c + s) * C, s);
  }
  for (; c < full; ++c)
    for (int r = 0; r < R; ++r) step_avx512<T, B, S>(acc[r], w[r] + c * C, x, ldx, c * C, 0);
  if (const int64_t tail = k - full * C) {
    for (int r = 0; r < R; ++r) {
      Elem<T> buf[C] = {};
      std::memcpy(buf, w[r] + full * C, tail * sizeof(Elem<T>));
      step_avx512<T, B, S>(acc[r], buf, x, ldx, full * C, 0);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      __m512 v = acc[r][b][0][0];
      for (int s = 0; s < S; ++s)
        for (int p = 0; p < P; ++p)
          if (s || p) v = _mm512_add_ps(v, acc[r][b][s][p]);
      store(y[r] + b * ldy, _mm512_reduce_add_ps(v));
    }
}

// Accumulate one chunk of weight row r (at wp; x's chunk at offset `at`) into its set s.
template <WType T, int R, int S>
WIOLA_TARGET_AVX512 __attribute__((always_inline)) inline void stream_step_avx512(__m512 (&acc)[R][S][parts(T)], int r,
                                                                                 const Elem<T>* wp, const float* x,
                                                                          int64_t at, int s) {
  __m512 v[parts(T)];
  load_avx512<T>(wp, v);
  for (int p = 0; p < parts(T); ++p)
    acc[r][s][p] = _mm512_fmadd_ps(v[p], _mm512_loadu_ps(x + at + 16 * p), acc[r][s][p]);
}

// One row of x against R weight rows read as R concurrent streams (R = 1, 2 or 4), each row
// with kStreamSets512 / P accumulator sets per part, every stream prefetched kPrefetchBytes
// ahead: as streams_avx2, the same sums whether a row is read alone or beside others.
template <WType T, int R, typename O>
WIOLA_TARGET_AVX512 __attribute__((always_inline)) inline void streams_avx512(const Elem<T>* const (&w)[R],
                                                                             int64_t k, const float* x,
                                                                             O* const (&y)[R]) {
  constexpr int64_t C = chunk_elems(Isa::kAvx512, T);
  constexpr int P = parts(T), S = std::max(1, kStreamSets512 / P);
  constexpr int64_t kGroupBytes = S * C * int64_t(sizeof(Elem<T>));
  __m512 acc[R][S][P];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s)
      for (int p = 0; p < P; ++p) acc[r][s][p] = _mm512_setzero_ps();
  const int64_t full = k / C;
  int64_t c = 0;
  for (; c + S <= full; c += S) {
    for (int r = 0; r < R; ++r)
      for (int64_t b = 0; b < kGroupBytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + c * C) + kPrefetchBytes + b, _MM_HINT_T0);
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) stream_step_avx512<T, R, S>(acc, r, w[r] + (c + s) * C, x, (c + s) * C, s);
  }
  for (; c < full; ++c)
    for (int r = 0; r < R; ++r) stream_step_avx512<T, R, S>(acc, r, w[r] + c * C, x, c * C, 0);
  if (const int64_t tail = k - full * C) {  // x is zero past k: pad the weights' tail with zeros too
    for (int r = 0; r < R; ++r) {
      Elem<T> buf[C] = {};
      std::memcpy(buf, w[r] + full * C, tail * sizeof(Elem<T>));
      stream_step_avx512<T, R, S>(acc, r, buf, x, full * C, 0);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 v = acc[r][0][0];
    for (int s = 0; s < S; ++s)
      for (int p = 0; p < P; ++p)
        if (s || p) v = _mm512_add_ps(v, acc[r][s][p]);
    store(y[r], _mm512_reduce_add_ps(v));
  }
}

// Several rows of x: the group of R weight rows j, j + q, … (R = 1 with q = 0: row j alone)
// against every block of ≤ kRowBlock rows of x in turn; the later blocks re-read the group
// from L1/L2.
template <WType T, int R, typename O>
WIOLA_TARGET_AVX512 __attribute__((always_inline)) inline void group_avx512(const Elem<T>* w, int64_t ldw,
                                                                           int64_t j, int64_t q, int64_t k,
                                                                           const float* x, int64_t ldx,
                                                                           int64_t xrows, O* y, int64_t ldy) {
  const Elem<T>* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w + (j + r * q) * ldw;
  for (int64_t b0 = 0; b0 < xrows; b0 += kRowBlock) {
    O* out[R];
    for (int r = 0; r < R; ++r) out[r] = y + b0 * ldy + j + r * q;
    const float* xb = x + b0 * ldx;
    switch (std::min(kRowBlock, xrows - b0)) {
      case 1: row_avx512<T, R, 1, O>(rows, k, xb, ldx, out, ldy); break;
      case 2: row_avx512<T, R, 2, O>(rows, k, xb, ldx, out, ldy); break;
      case 3: row_avx512<T, R, 3, O>(rows, k, xb, ldx, out, ldy); break;
      default: row_avx512<T, R, 4, O>(rows, k, xb, ldx, out, ldy); break;
    }
  }
}

// All nrows weight rows in groups of R streams (q = nrows / R; the last nrows mod R alone).
template <WType T, int R, typename O>
WIOLA_TARGET_AVX512 void groups_avx512(const Elem<T>* w, int64_t ldw, int64_t k, int64_t nrows, const float* x,
                                       int64_t ldx, int64_t xrows, O* y, int64_t ldy) {
  const int64_t q = nrows / R;
  for (int64_t j = 0; j < q; ++j) group_avx512<T, R, O>(w, ldw, j, q, k, x, ldx, xrows, y, ldy);
  for (int64_t j = R * q; j < nrows; ++j) group_avx512<T, 1, O>(w, ldw, j, 0, k, x, ldx, xrows, y, ldy);
}

// The rows of one thread's range. One row of x (a decoding step): the range's four quarters
// are read side by side, rows j, j + q, j + 2q and j + 3q together (q = nrows / 4; the last
// nrows mod 4 rows alone), each stream prefetched: more reads in flight than one stream keeps,
// and faster than torch.sum over the same bytes (docs/performance.md, docs/history.md).
// More rows of x: groups_avx512, each weight row read once.
template <WType T, typename O>
WIOLA_TARGET_AVX512 void rows_avx512(const Elem<T>* w, int64_t ldw, int64_t k, int64_t nrows, const float* x,
                                     int64_t ldx, int64_t xrows, O* y, int64_t ldy) {
  if (xrows == 1) {
    constexpr int R = kStreams512;
    const int64_t q = nrows / R;
    for (int64_t j = 0; j < q; ++j) {
      const Elem<T>* rows[R];
      O* out[R];
      for (int r = 0; r < R; ++r) {
        rows[r] = w + (j + r * q) * ldw;
        out[r] = y + j + r * q;
      }
      streams_avx512<T, R, O>(rows, k, x, out);
    }
    for (int64_t j = R * q; j < nrows; ++j) {
      const Elem<T>* const last[1] = {w + j * ldw};
      O* const out[1] = {y + j};
      streams_avx512<T, 1, O>(last, k, x, out);
    }
    return;
  }
  if (4 * std::min(kRowBlock, xrows) * parts(T) <= 24) {
    groups_avx512<T, 4, O>(w, ldw, k, nrows, x, ldx, xrows, y, ldy);
  } else {
    groups_avx512<T, 2, O>(w, ldw, k, nrows, x, ldx, xrows, y, ldy);
  }
}

#endif  // WIOLA_HAVE_AVX512_TARGET
#endif  // WIOLA_GEMV_X86

// nrows weight rows (ldw apart) against every row of x on the chosen path.
template <WType T, typename O>
void run_rows(Isa isa, const Elem<T>* w, int64_t ldw, int64_t k, int64_t nrows, const float* x, int64_t ldx,
              int64_t xrows, O* y, int64_t ldy) {
#if defined(WIOLA_GEMV_X86)
#if defined(WIOLA_HAVE_AVX512_TARGET)
  if (isa == Isa::kAvx512) return rows_avx512<T, O>(w, ldw, k, nrows, x, ldx, xrows, y, ldy);
#endif
  if (isa == Isa::kAvx2) return rows_avx2<T, O>(w, ldw, k, nrows, x, ldx, xrows, y, ldy);
#endif
  rows_generic<T, O>(w, ldw, k, nrows, x, ldx, xrows, y, ldy);
}

// x[:, offset : offset + k] as float32 in the path's layout, rows ld apart, zeros past k: in
// chunk order, and within each chunk of a bf16 weight's vector path the even elements
// before the odd ones (the order load_avx2 / load_avx512 produce).
template <typename X>
void prepare_x(const X* x, int64_t ldx_in, int64_t rows, int64_t offset, int64_t k, bool even_odd, int64_t chunk,
               float* out, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const X* src = x + r * ldx_in + offset;
    float* dst = out + r * ld;
    std::fill(dst, dst + ld, 0.0f);
    if (!even_odd) {
      for (int64_t i = 0; i < k; ++i) dst[i] = static_cast<float>(src[i]);
      continue;
    }
    const int64_t half = chunk / 2;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t c = i / chunk, e = i % chunk;
      dst[c * chunk + (e % 2) * half + e / 2] = static_cast<float>(src[i]);
    }
  }
}

WType wtype_of(at::ScalarType t) {
  return t == at::kFloat ? WType::kF32 : t == at::kBFloat16 ? WType::kBF16 : WType::kF16;
}

bool gemv_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

}  // namespace


// x (..., K): at most 16 rows in its leading dimensions; weights (n_i, k_i) with contiguous
// rows, all of one dtype. Without split_input every k_i = K (all read x); with it Σ k_i = K and
// weight i reads its own consecutive k_i columns of x. Returns (..., Σ n_i) in x's dtype:
// [x W_0ᵀ | x W_1ᵀ | …]. A decoding step calls this ~80 times per token, so the checks and
// the bookkeeping stay allocation-light (the output is the only tensor made).
at::Tensor decode_gemv(const at::Tensor& x_in, at::TensorList weights, bool split_input) {
  WIOLA_CHECK_ARG(x_in.device().is_cpu(), "x must be a CPU tensor, got ", x_in.device());
  TORCH_CHECK_TYPE(gemv_dtype(x_in.scalar_type()), "x must be float32, bfloat16 or float16, got ", x_in.scalar_type());
  WIOLA_CHECK_ARG(x_in.dim() >= 1 && x_in.size(-1) >= 1, "x must have shape (..., k) with k >= 1, got ", x_in.sizes());
  const int64_t kx = x_in.size(-1), rows = kx ? x_in.numel() / kx : 0;
  WIOLA_CHECK_ARG(rows >= 1 && rows <= kMaxRows, "x must have 1..", kMaxRows,
                  " rows (the product of its leading dimensions), got shape ", x_in.sizes());
  const size_t count = weights.size();
  WIOLA_CHECK_ARG(count >= 1, "weights must hold at least one tensor");
  const char* name = count == 1 ? "weight" : "weights[";
  const char* close = count == 1 ? "" : "]";
  const at::ScalarType wt = weights[0].scalar_type();
  int64_t n_total = 0, k_sum = 0;
  bool shared = true;
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& w = weights[i];
    const auto idx = count == 1 ? std::string() : std::to_string(i);
    WIOLA_CHECK_ARG(w.device().is_cpu(), name, idx, close, " must be a CPU tensor, got ", w.device());
    TORCH_CHECK_TYPE(gemv_dtype(w.scalar_type()), name, idx, close, " must be float32, bfloat16 or float16, got ",
                     w.scalar_type());
    TORCH_CHECK_TYPE(w.scalar_type() == wt, "weights must share one dtype (float32, bfloat16 or float16): weights[",
                     i, "] is ", w.scalar_type(), ", weights[0] ", wt);
    WIOLA_CHECK_ARG(w.dim() == 2 && w.size(0) >= 1 && w.size(1) >= 1, name, idx, close,
                    " must have shape (n, k) with no empty dimension, got ", w.sizes());
    WIOLA_CHECK_ARG(w.stride(1) == 1 || w.size(1) == 1, name, idx, close, " must have contiguous rows, got strides ",
                    w.strides());
    n_total += w.size(0);
    k_sum += w.size(1);
    shared = shared && w.size(1) == kx;
  }
  if (split_input) {
    WIOLA_CHECK_ARG(k_sum == kx, "x must have shape (..., k = Σ k_i = ", k_sum, ") with split_input, got ",
                    x_in.sizes());
  } else {
    WIOLA_CHECK_ARG(shared, "x must have shape (..., k = ", weights[0].size(1), ") to match every weight's k, got ",
                    x_in.sizes());
  }
  // (rows, K) with unit column stride: a view of x when its rows have one stride.
  const at::Tensor x = x_in.stride(-1) == 1 || kx == 1 ? x_in.reshape({rows, kx}) : x_in.contiguous().view({rows, kx});

  const Isa isa = kernel_isa(kDecodeGemvIsas);
  const WType type = wtype_of(wt);
  const bool even_odd = type == WType::kBF16 && isa != Isa::kGeneric;
  const int64_t chunk = chunk_elems(isa, type);

  // x as float32 in the path's layout, one block per distinct slice of x (a reused buffer).
  const size_t segments = split_input ? count : 1;
  c10::SmallVector<int64_t, 8> seg_off(segments), seg_ld(segments), seg_at(segments);
  int64_t floats = 0;
  for (size_t s = 0, off = 0; s < segments; ++s) {
    const int64_t len = split_input ? weights[s].size(1) : kx;
    seg_off[s] = off;
    off += len;
    seg_ld[s] = (len + kXPad - 1) / kXPad * kXPad;
    seg_at[s] = floats;
    floats += rows * seg_ld[s];
  }
  // 64-byte aligned (kXPad keeps every row and segment so): an x chunk never straddles two
  // cache lines, which would make each AVX-512 load of x two loads.
  thread_local std::vector<float> xbuf;
  if (static_cast<int64_t>(xbuf.size()) < floats + kAlignFloats) xbuf.resize(floats + kAlignFloats);
  float* const xa = align_up(xbuf.data());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "decode_gemv_x", [&] {
    for (size_t s = 0; s < segments; ++s)
      prepare_x(x.const_data_ptr<scalar_t>(), x.stride(0), rows, seg_off[s],
                split_input ? weights[s].size(1) : kx, even_odd, chunk, xa + seg_at[s], seg_ld[s]);
  });

  std::vector<int64_t> out_sizes(x_in.sizes().begin(), x_in.sizes().end());
  out_sizes.back() = n_total;
  at::Tensor out = empty_output(out_sizes, x_in.options().memory_format(at::MemoryFormat::Contiguous));
  // Weight i's rows start at byte start[i] of the call's stream; threads take equal stretches.
  const int64_t esize = weights[0].element_size();
  c10::SmallVector<int64_t, 8> start(count + 1, 0), col(count + 1, 0);
  for (size_t i = 0; i < count; ++i) {
    start[i + 1] = start[i] + weights[i].size(0) * weights[i].size(1) * esize;
    col[i + 1] = col[i] + weights[i].size(0);
  }
  const int64_t total = start[count];
  const int64_t chunks = std::clamp<int64_t>(total / kMinThreadBytes, 1, at::get_num_threads());
  const float* xb = xa;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "decode_gemv_out", [&] {
    using O = scalar_t;
    if constexpr (std::is_same_v<O, double>) {
      TORCH_INTERNAL_ASSERT(false, "decode_gemv: float64 x was refused above");
    } else {
      O* yp = out.mutable_data_ptr<O>();
      auto run = [&](auto tag) {
        constexpr WType T = decltype(tag)::value;
        auto work = [&](int64_t c0, int64_t c1) {
          for (int64_t c = c0; c < c1; ++c) {
            const int64_t lo = total * c / chunks, hi = total * (c + 1) / chunks;
            for (size_t i = 0; i < count; ++i) {
              if (start[i + 1] <= lo || start[i] >= hi) continue;
              const at::Tensor& w = weights[i];
              const int64_t k = w.size(1), row_bytes = k * esize, n = w.size(0);
              // the rows whose first byte lies in [lo, hi)
              const int64_t r0 = std::clamp<int64_t>((lo - start[i] + row_bytes - 1) / row_bytes, 0, n);
              const int64_t r1 = std::clamp<int64_t>((hi - start[i] + row_bytes - 1) / row_bytes, 0, n);
              if (r0 >= r1) continue;
              const size_t s = split_input ? i : 0;
              const Elem<T>* wp = reinterpret_cast<const Elem<T>*>(w.const_data_ptr()) + r0 * w.stride(0);
              run_rows<T, O>(isa, wp, w.stride(0), k, r1 - r0, xb + seg_at[s], seg_ld[s], rows, yp + col[i] + r0,
                             n_total);
            }
          }
        };
        if (chunks == 1) {
          work(0, 1);
        } else {
          at::parallel_for(0, chunks, 1, work);
        }
      };
      if (type == WType::kF32) run(std::integral_constant<WType, WType::kF32>{});
      else if (type == WType::kBF16) run(std::integral_constant<WType, WType::kBF16>{});
      else run(std::integral_constant<WType, WType::kF16>{});
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(wiola, CPU, m) { m.impl("_decode_gemv", &decode_gemv); }

}  // namespace wiola::cpu
