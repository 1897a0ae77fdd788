// WiolaRMSNorm on the CPU (SPEC §3): z = x + δ, y = γ z / sqrt(mean(z²) + ε).
//
// Forward: rows in parallel; each row is read once (it stays in L1), reduced, and written
// once; while a row is written from L1, the next row is prefetched, so the memory keeps
// reading during the write pass. Large fp32/bf16 outputs (y and ∂x) are written with
// non-temporal stores: no read-for-ownership of their lines. bf16/fp16 rows are converted
// to float on the fly inside the two passes over the row, with no float copy of the row.
// On CPUs with AVX-512 BF16 the bf16 rows run the avx512:: loops below (chosen at run
// time, isa.h). docs/performance.md has what each of these choices measured.
// A finite row whose float Σz² overflows (|z| ≳
// 1.8e19/√d; 1.3e154/√d in double) takes a rare slow path that rescales it by an exact
// power of two (as the reference does); the fast path pays one compare per row.
// Backward: works with ẑ = z·rstd (|ẑ| ≤ √d), so nothing grows with |z|; rows are split
// into a fixed number of chunks (independent of the thread count, so results are bitwise
// reproducible); each chunk accumulates ∂γ and ∂δ partials of shape (d,), then the
// partials are summed in chunk order. The write pass of a row prefetches the next row's
// x and g, one cache line per vector step (a burst of prefetches before the pass did
// not help).
//
// Options for Hugging Face models (wiola_kernels.patch_hf): shift may be absent (δ = 0:
// the forward adds a zero row that stays in L1; the backward skips the ∂δ partials and
// returns an empty grad_shift), and hf_order rounds like LlamaRMSNorm: n = z/r is
// rounded to the input dtype, then y = γ·n (exact in float for bf16/fp16 γ and n, then
// rounded once), so bf16/fp16 outputs match HF's.
//
// add_rms_norm (csrc/cpu/add_rms_norm.cpp, through rms_norm.h) runs the same row loops: its
// forward forms each row of s = x + residual (add_row: rounded once, written out, kept in L1
// as the row the norm reads; ResidualAdd), its backward adds ∂L/∂s to ∂x (kGradS).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "avx512_bf16.h"
#include "common.h"
#include "isa.h"
#include "rms_norm.h"
#include "wiola/checks.h"

namespace wiola::cpu {
namespace {

constexpr int64_t kBackwardChunks = 64;  // partial sums for ∂γ/∂δ; fixed for determinism
constexpr int64_t kMinBackwardElemsPerThread = int64_t(1) << 15;  // parallel grain of the backward

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

template <typename acc_t>
acc_t max_abs_z(const acc_t* x, const acc_t* s, int64_t d) {
  acc_t m = 0;
  for (int64_t i = 0; i < d; ++i) m = std::max(m, std::abs(x[i] + s[i]));
  return m;
}

// The slow path for a finite row whose Σz² overflows: with max|z| = f·2^e (f ∈ [½, 1)),
// sc = 2^(2−e) is a normal power of two, |z|·sc < 4, so z·sc is exact and
// r = sqrt(mean((z·sc)²) + ε·sc²) / sc (ε·sc² may underflow to 0: ε is negligible here).
// Returns rstd = sc/r: subnormal once r > 2^126 (float) / 2^1022 (double), with ≥ 21 / 50
// significant bits left. y uses z·sc and 1/(r·sc), both normal, so y keeps full precision.
template <typename acc_t>
C10_NOINLINE acc_t forward_row_rescaled(const acc_t* x, const acc_t* w, const acc_t* s, acc_t* y, int64_t d,
                                        double eps) {
  int e = 0;
  std::frexp(max_abs_z(x, s, d), &e);
  const acc_t sc = std::ldexp(acc_t(1), 2 - e);
  acc_t sum = 0;
  for (int64_t i = 0; i < d; ++i) sum += ((x[i] + s[i]) * sc) * ((x[i] + s[i]) * sc);
  const acc_t inv_s = acc_t(1) / std::sqrt(sum / acc_t(d) + std::ldexp(acc_t(eps), 2 * (2 - e)));
  for (int64_t i = 0; i < d; ++i) y[i] = w[i] * ((x[i] + s[i]) * sc) * inv_s;
  return inv_s * sc;
}

// Prefetches the `bytes` bytes at `p` (nullptr: nothing) into L1.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  if (p == nullptr) return;
  const char* c = static_cast<const char*>(p);
  for (int64_t j = 0; j < bytes; j += 64) __builtin_prefetch(c + j, 0, 3);
}

// Whether a (rows, d) output of `out_bytes` is written with non-temporal stores (float:
// use_streaming_stores; bf16: the same rule, 16 elements per 32-byte store). Large outputs
// only: they skip the read-for-ownership of each line, and on freshly mapped pages the
// read-back of the zeroes the page fault has just written.
template <typename scalar_t>
inline bool stream_rows(const scalar_t* out, int64_t out_bytes, int64_t d) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    return out_bytes >= kStreamMinBytes && d % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 32 == 0;
  }
#endif
  return use_streaming_stores(out, out_bytes, d);
}

// store_row with non-temporal stores (only where stream_rows said yes).
template <typename scalar_t>
inline void store_row_stream(const acc_type<scalar_t>* src, scalar_t* dst, int64_t n) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    for (int64_t i = 0; i < n; i += 16) {  // the rounding of at::vec::convert (nearest even, NaN kept)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                          at::vec::cvtfp32_bf16(_mm256_loadu_ps(src + i), _mm256_loadu_ps(src + i + 8)));
    }
    return;
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    return;
  }
#endif
  store_row(src, dst, n);
}

// One forward row; `next` / `next_bytes`: the next input row, prefetched before the write pass.
// kHfOrder writes γ·(z·rstd) instead of (γ·z)·rstd (HF's order; see the top of the file).
// kStream: y is written with non-temporal stores (see stream_rows).
template <bool kHfOrder = false, bool kStream = false, typename acc_t>
inline acc_t forward_row(const acc_t* x, const acc_t* w, const acc_t* s, acc_t* y, int64_t d, double eps,
                         const void* next, int64_t next_bytes) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  V acc0(0), acc1(0);
  int64_t i = 0;
  for (; i + 2 * L <= d; i += 2 * L) {  // two accumulators hide the FMA latency
    const V z0 = V::loadu(x + i) + V::loadu(s + i);
    const V z1 = V::loadu(x + i + L) + V::loadu(s + i + L);
    acc0 = at::vec::fmadd(z0, z0, acc0);
    acc1 = at::vec::fmadd(z1, z1, acc1);
  }
  for (; i + L <= d; i += L) {
    const V z0 = V::loadu(x + i) + V::loadu(s + i);
    acc0 = at::vec::fmadd(z0, z0, acc0);
  }
  acc_t sum = at::vec::vec_reduce_all<acc_t>([](V a, V b) { return a + b; }, acc0 + acc1);
  for (; i < d; ++i) sum += (x[i] + s[i]) * (x[i] + s[i]);
  // Σz² = inf with no NaN in z: every |z| is inf, or the finite row's sum overflowed.
  if (C10_UNLIKELY(sum == std::numeric_limits<acc_t>::infinity()) &&
      max_abs_z(x, s, d) <= std::numeric_limits<acc_t>::max()) {
    return forward_row_rescaled(x, w, s, y, d, eps);
  }
  const acc_t inv = acc_t(1) / std::sqrt(sum / acc_t(d) + acc_t(eps));
  const V vinv(inv);
  prefetch_bytes(next, next_bytes);
  i = 0;
  for (; i + L <= d; i += L) {  // x is still in L1
    if constexpr (kHfOrder) {
      store_vec<kStream>(V::loadu(w + i) * ((V::loadu(x + i) + V::loadu(s + i)) * vinv), y + i);
    } else {
      store_vec<kStream>(V::loadu(w + i) * (V::loadu(x + i) + V::loadu(s + i)) * vinv, y + i);
    }
  }
  for (; i < d; ++i) y[i] = kHfOrder ? w[i] * ((x[i] + s[i]) * inv) : w[i] * (x[i] + s[i]) * inv;
  return inv;
}

// Reduced-precision rows (bf16, fp16) are converted to float on the fly, 2·V::size()
// elements per step, inside the two passes over the row (no float copy of the row).
template <typename scalar_t>
using RVec = at::vec::Vectorized<scalar_t>;

template <typename scalar_t>
inline std::tuple<Vec<float>, Vec<float>> load_float2(const scalar_t* p) {
  return at::vec::convert_to_float<scalar_t>(RVec<scalar_t>::loadu(p));
}

// Rounds a, b to scalar_t (nearest even, as store_row does) and stores them at p.
template <bool kStream, typename scalar_t>
inline void store_float2(const Vec<float>& a, const Vec<float>& b, scalar_t* p) {
  const RVec<scalar_t> v = at::vec::convert_from_float<scalar_t>(a, b);
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kStream && std::is_same_v<scalar_t, at::BFloat16>) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
    return;
  }
#endif
  v.store(p);
}

// The forward of one reduced-precision row (y = γ z rstd, not hf_order). Returns false,
// writing nothing, when the row needs the rescaled slow path (its float Σz² overflows).
template <bool kStream, typename scalar_t>
inline bool forward_row_reduced(const scalar_t* x, const float* w, const float* s, scalar_t* y, int64_t d,
                                double eps, const void* next, int64_t next_bytes, float* rstd) {
  using V = Vec<float>;
  constexpr int64_t L = RVec<scalar_t>::size();  // = 2 * V::size()
  V acc0(0), acc1(0);
  int64_t i = 0;
  for (; i + L <= d; i += L) {
    auto [x0, x1] = load_float2(x + i);
    const V z0 = x0 + V::loadu(s + i), z1 = x1 + V::loadu(s + i + V::size());
    acc0 = at::vec::fmadd(z0, z0, acc0);
    acc1 = at::vec::fmadd(z1, z1, acc1);
  }
  float sum = at::vec::vec_reduce_all<float>([](V a, V b) { return a + b; }, acc0 + acc1);
  for (; i < d; ++i) sum += (float(x[i]) + s[i]) * (float(x[i]) + s[i]);
  if (C10_UNLIKELY(sum == std::numeric_limits<float>::infinity())) return false;
  const float inv = 1.0f / std::sqrt(sum / float(d) + float(eps));
  const V vinv(inv);
  prefetch_bytes(next, next_bytes);
  i = 0;
  for (; i + L <= d; i += L) {  // x is still in L1
    auto [x0, x1] = load_float2(x + i);
    const V y0 = V::loadu(w + i) * (x0 + V::loadu(s + i)) * vinv;
    const V y1 = V::loadu(w + i + V::size()) * (x1 + V::loadu(s + i + V::size())) * vinv;
    store_float2<kStream>(y0, y1, y + i);
  }
  for (; i < d; ++i) y[i] = scalar_t(w[i] * (float(x[i]) + s[i]) * inv);
  *rstd = inv;
  return true;
}

// γ and δ in the order the AVX-512 bf16 rows read them (avx512::deinterleave_blocks);
// empty and inactive on AVX2 and for other dtypes.
struct SplitWeights {
  bool active = false;
  std::vector<float> w, s;
};

#if defined(WIOLA_HAVE_AVX512_TARGET)
// bf16 rows on AVX-512 (isa.h). On AVX2 the bf16 rows are bound by the float <-> bf16
// conversions, not by memory. Here a block of 32 elements is widened by one shift and one
// mask and narrowed by one AVX512-BF16 conversion and one permutation, which brings them
// to the memory's speed (docs/performance.md). The blocks are summed in another order than on
// AVX2, so the two ISAs agree to rounding (Σz² and the ∂γ/∂δ partials in the last bits,
// outputs where a product sits on a bf16 rounding tie), not bitwise; each ISA is
// deterministic and thread-count independent on its own.
namespace avx512 {

using namespace ::wiola::cpu::avx512;  // the bf16 blocks of avx512_bf16.h

// Rows in blocks of 32 bf16, split into the floats of their even and odd elements
// (avx512_bf16.h). γ and δ are read in the same split order: `wp`/`sp` hold, per block,
// the 16 even entries then the 16 odd ones (deinterleave_blocks). The tail (d mod 32)
// takes 16-wide and scalar steps on γ, δ.
inline std::vector<float> deinterleave_blocks(const float* v, int64_t d) {
  std::vector<float> out(v, v + d);
  for (int64_t b = 0; b + 32 <= d; b += 32) {
    for (int64_t j = 0; j < 16; ++j) {
      out[b + j] = v[b + 2 * j];
      out[b + 16 + j] = v[b + 2 * j + 1];
    }
  }
  return out;
}

// add_rms_norm's s = x + residual of one bf16 row (see the AVX2 add_row): 32 elements a step,
// the sum rounded once, stored to `row` (read next by the norm) and to `s_row`.
template <bool kStream>
WIOLA_TARGET_AVX512_BF16 void add_row(const BF16* x, const BF16* r, BF16* row, BF16* s_row, int64_t d) {
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    const Split xv = load_bf16x32(x + i), rv = load_bf16x32(r + i);
    const __m512i v = pack_bf16x32(_mm512_add_ps(xv.even, rv.even), _mm512_add_ps(xv.odd, rv.odd));
    _mm512_storeu_si512(row + i, v);
    store_packed<kStream>(v, s_row + i);
  }
  for (; i < d; ++i) row[i] = s_row[i] = BF16(float(x[i]) + float(r[i]));
}

template <bool kStream>
WIOLA_TARGET_AVX512_BF16 bool forward_row(const BF16* x, const float* w, const float* s, const float* wp,
                                     const float* sp, BF16* y, int64_t d, double eps, const void* next,
                                     int64_t next_bytes, float* rstd) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    const Split xv = load_bf16x32(x + i);
    const __m512 z0 = _mm512_add_ps(xv.even, _mm512_loadu_ps(sp + i));
    const __m512 z1 = _mm512_add_ps(xv.odd, _mm512_loadu_ps(sp + i + 16));
    acc0 = _mm512_fmadd_ps(z0, z0, acc0);
    acc1 = _mm512_fmadd_ps(z1, z1, acc1);
  }
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; i < d; ++i) sum += (float(x[i]) + s[i]) * (float(x[i]) + s[i]);
  if (C10_UNLIKELY(sum == std::numeric_limits<float>::infinity())) return false;
  const float inv = 1.0f / std::sqrt(sum / float(d) + float(eps));
  const __m512 vinv = _mm512_set1_ps(inv);
  prefetch_bytes(next, next_bytes);
  i = 0;
  for (; i + 32 <= d; i += 32) {  // x is still in L1
    const Split xv = load_bf16x32(x + i);
    const __m512 z0 = _mm512_add_ps(xv.even, _mm512_loadu_ps(sp + i));
    const __m512 z1 = _mm512_add_ps(xv.odd, _mm512_loadu_ps(sp + i + 16));
    store_bf16x32<kStream>(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(wp + i), z0), vinv),
                           _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(wp + i + 16), z1), vinv), y + i);
  }
  for (; i < d; ++i) y[i] = BF16(w[i] * (float(x[i]) + s[i]) * inv);
  *rstd = inv;
  return true;
}

// The backward of one row in the block order of forward_row; the ∂γ/∂δ partials `dw`, `ds`
// are kept in that order too for the blocks (interleave_partials restores it). kGradS: ∂x
// also adds `gs` (add_rms_norm's gradient of s).
template <bool kStream, bool kShift, bool kGradS>
WIOLA_TARGET_AVX512_BF16 void backward_row(const BF16* x, const BF16* g, const float* w, const float* s,
                                      const float* wp, const float* sp, float inv, BF16* dx, float* dw, float* ds,
                                      int64_t d, const void* next_x, const void* next_g, int64_t next_bytes,
                                      const BF16* gs) {
  const __m512 vinv = _mm512_set1_ps(inv);
  __m512 dot0 = _mm512_setzero_ps(), dot1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    const Split xv = load_bf16x32(x + i), gv = load_bf16x32(g + i);
    const __m512 zh0 = _mm512_mul_ps(_mm512_add_ps(xv.even, _mm512_loadu_ps(sp + i)), vinv);
    const __m512 zh1 = _mm512_mul_ps(_mm512_add_ps(xv.odd, _mm512_loadu_ps(sp + i + 16)), vinv);
    dot0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(wp + i), gv.even), zh0, dot0);
    dot1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(wp + i + 16), gv.odd), zh1, dot1);
  }
  float dot = _mm512_reduce_add_ps(_mm512_add_ps(dot0, dot1));
  const int64_t blocks_end = i;
  for (; i < d; ++i) dot += w[i] * float(g[i]) * ((float(x[i]) + s[i]) * inv);
  const float coef = dot / float(d);
  const __m512 vcoef = _mm512_set1_ps(coef);
  const char* px = static_cast<const char*>(next_x);
  const char* pg = static_cast<const char*>(next_g);
  const char* pgs = kGradS ? reinterpret_cast<const char*>(gs + d) : nullptr;  // gs's next row (rows contiguous)
  int64_t pf = 0;  // bytes of the next rows prefetched: one line of x and one of g (and gs) per block
  // ∂x of 16 elements (split z, g at offset i of wp/sp); adds to the partials.
  auto dz_of = [&](__m512 xs, __m512 gs, int64_t i) WIOLA_TARGET_AVX512_BF16 {
    const __m512 zh = _mm512_mul_ps(_mm512_add_ps(xs, _mm512_loadu_ps(sp + i)), vinv);
    const __m512 dz = _mm512_mul_ps(_mm512_fnmadd_ps(vcoef, zh, _mm512_mul_ps(_mm512_loadu_ps(wp + i), gs)), vinv);
    if constexpr (kShift) _mm512_storeu_ps(ds + i, _mm512_add_ps(_mm512_loadu_ps(ds + i), dz));
    _mm512_storeu_ps(dw + i, _mm512_fmadd_ps(gs, zh, _mm512_loadu_ps(dw + i)));
    return dz;
  };
  for (i = 0; i < blocks_end; i += 32) {  // x and g are still in L1
    if (pf < next_bytes) {
      __builtin_prefetch(px + pf, 0, 3);
      __builtin_prefetch(pg + pf, 0, 3);
      if constexpr (kGradS) __builtin_prefetch(pgs + pf, 0, 3);
      pf += 64;
    }
    const Split xv = load_bf16x32(x + i), gv = load_bf16x32(g + i);
    __m512 dz0 = dz_of(xv.even, gv.even, i), dz1 = dz_of(xv.odd, gv.odd, i + 16);
    if constexpr (kGradS) {
      const Split gsv = load_bf16x32(gs + i);
      dz0 = _mm512_add_ps(dz0, gsv.even);
      dz1 = _mm512_add_ps(dz1, gsv.odd);
    }
    store_bf16x32<kStream>(dz0, dz1, dx + i);
  }
  for (; i < d; ++i) {
    const float zh = (float(x[i]) + s[i]) * inv, gi = float(g[i]);
    const float dz = (w[i] * gi - coef * zh) * inv;
    dx[i] = BF16(kGradS ? dz + float(gs[i]) : dz);
    if constexpr (kShift) ds[i] += dz;
    dw[i] += gi * zh;
  }
}

// Puts a (rows, d) array of partials kept in block order back in element order.
inline void interleave_partials(float* p, int64_t rows, int64_t d) {
  float block[32];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b + 32 <= d; b += 32) {
      float* q = p + r * d + b;
      for (int64_t j = 0; j < 16; ++j) {
        block[2 * j] = q[j];
        block[2 * j + 1] = q[16 + j];
      }
      std::copy(block, block + 32, q);
    }
  }
}

}  // namespace avx512
#endif

// γ and δ in the AVX-512 bf16 rows' order when those rows run (`eligible`: bf16 rows that
// they compute; the AVX-512 ISA active), else inactive.
template <typename acc_t>
SplitWeights split_weights(const acc_t* w, const acc_t* s, int64_t d, bool eligible) {
  SplitWeights split;
#if defined(WIOLA_HAVE_AVX512_TARGET)
  if constexpr (std::is_same_v<acc_t, float>) {
    if (eligible && kernel_isa(kRmsNormIsas) == Isa::kAvx512Bf16) {
      split.active = true;
      split.w = avx512::deinterleave_blocks(w, d);
      split.s = avx512::deinterleave_blocks(s, d);
    }
  }
#endif
  (void)w, (void)s, (void)d, (void)eligible;
  return split;
}

// forward_row_reduced on the active ISA (isa.h); `split` holds γ and δ in the block order of
// avx512::forward_row (only read on AVX-512).
template <bool kStream, typename scalar_t>
inline bool forward_row_reduced_isa(const scalar_t* x, const float* w, const float* s, scalar_t* y, int64_t d,
                                    double eps, const void* next, int64_t next_bytes, float* rstd,
                                    const SplitWeights& split) {
#if defined(WIOLA_HAVE_AVX512_TARGET)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (split.active) {
      return avx512::forward_row<kStream>(x, w, s, split.w.data(), split.s.data(), y, d, eps, next, next_bytes,
                                          rstd);
    }
  }
#endif
  return forward_row_reduced<kStream>(x, w, s, y, d, eps, next, next_bytes, rstd);
}

// f(std::bool_constant<b>{}...) for the runtime flags b: template flags from runtime ones.
template <typename F>
void with_flags(F&& f) {
  f();
}

template <typename F, typename... Flags>
void with_flags(F&& f, bool first, Flags... rest) {
  auto bind = [&](auto flag) {
    with_flags([&](auto... more) { f(flag, more...); }, rest...);
  };
  if (first) {
    bind(std::true_type{});
  } else {
    bind(std::false_type{});
  }
}

// add_rms_norm's input: rows of x and of the residual (any row strides, in elements) whose
// sum s = x + residual, rounded once to scalar_t, is written to `s` ((rows, d) contiguous)
// and normalised in place of x. `s` nullptr: rms_norm (no add).
template <typename scalar_t>
struct ResidualAdd {
  const scalar_t* x = nullptr;
  int64_t x_stride = 0;
  const scalar_t* residual = nullptr;
  int64_t residual_stride = 0;
  scalar_t* s = nullptr;
};

// One row of s = x + residual (float sum, rounded once to scalar_t, as PyTorch's add) into
// `row` (what the norm reads next, from L1) and into the output `s_row` (non-temporal when
// kStream, see stream_rows).
template <bool kStream, typename scalar_t>
inline void add_row(const scalar_t* x, const scalar_t* res, scalar_t* row, scalar_t* s_row, int64_t d) {
  using acc_t = acc_type<scalar_t>;
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    using V = Vec<acc_t>;
    for (; i + V::size() <= d; i += V::size()) {
      const V v = V::loadu(x + i) + V::loadu(res + i);
      v.store(row + i);
      store_vec<kStream>(v, s_row + i);
    }
  } else {
    using R = RVec<scalar_t>;
    for (; i + R::size() <= d; i += R::size()) {
      auto [x0, x1] = load_float2(x + i);
      auto [r0, r1] = load_float2(res + i);
      const R v = at::vec::convert_from_float<scalar_t>(x0 + r0, x1 + r1);
      v.store(row + i);
#if defined(CPU_CAPABILITY_AVX2)
      if constexpr (kStream && std::is_same_v<scalar_t, at::BFloat16>) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(s_row + i), v);
        continue;
      }
#endif
      v.store(s_row + i);
    }
  }
  for (; i < d; ++i) row[i] = s_row[i] = scalar_t(acc_t(x[i]) + acc_t(res[i]));
}

// `ones`: a row of 1s (only read for hf_order with a reduced-precision x). `add`: see ResidualAdd.
template <typename scalar_t>
void forward_rows(const scalar_t* x, const acc_type<scalar_t>* w, const acc_type<scalar_t>* s,
                  const acc_type<scalar_t>* ones, scalar_t* y, acc_type<scalar_t>* rstd, int64_t rows, int64_t d,
                  double eps, bool hf_order, const ResidualAdd<scalar_t>& add = {}) {
  using acc_t = acc_type<scalar_t>;
  using V = Vec<acc_t>;
  const int64_t row_bytes = d * int64_t(sizeof(scalar_t));
  const bool stream = stream_rows(y, rows * row_bytes, d);
  const bool stream_s = add.s != nullptr && stream_rows(add.s, rows * row_bytes, d);
  [[maybe_unused]] const bool avx512_rows = kernel_isa(kRmsNormIsas) == Isa::kAvx512Bf16;  // bf16 sums on AVX-512 (isa.h)
  const SplitWeights split = split_weights(w, s, d, std::is_same_v<scalar_t, at::BFloat16> && !hf_order);
  with_flags([&](auto kAdd, auto kStreamS) {
    constexpr bool add_ = decltype(kAdd)::value;
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> sum(add_ ? d : 0);
      // The row the norm reads: x's, or s = x + residual (also written out), in `sum`.
      auto row = [&](int64_t r) -> const scalar_t* {
        if constexpr (add_) {
          constexpr bool stream_s_ = decltype(kStreamS)::value;
          const scalar_t *xr = add.x + r * add.x_stride, *rr = add.residual + r * add.residual_stride;
#if defined(WIOLA_HAVE_AVX512_TARGET)
          if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
            if (avx512_rows) {
              avx512::add_row<stream_s_>(xr, rr, sum.data(), add.s + r * d, d);
              return sum.data();
            }
          }
#endif
          add_row<stream_s_>(xr, rr, sum.data(), add.s + r * d, d);
        }
        return add_ ? sum.data() : x + r * d;
      };
      auto next_of = [&](int64_t r) -> const scalar_t* {  // the next input row, prefetched
        if (r + 1 >= end) return nullptr;
        return add_ ? add.x + (r + 1) * add.x_stride : x + (r + 1) * d;
      };
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        for (int64_t r = begin; r < end; ++r) {
          const scalar_t* next = next_of(r);
          const scalar_t* xr = row(r);
          scalar_t* yr = y + r * d;
          if (stream) {
            rstd[r] = hf_order ? forward_row<true, true>(xr, w, s, yr, d, eps, next, row_bytes)
                               : forward_row<false, true>(xr, w, s, yr, d, eps, next, row_bytes);
          } else {
            rstd[r] = hf_order ? forward_row<true>(xr, w, s, yr, d, eps, next, row_bytes)
                               : forward_row<false>(xr, w, s, yr, d, eps, next, row_bytes);
          }
        }
      } else {
        std::vector<acc_t> xs(d), ys(d);
        for (int64_t r = begin; r < end; ++r) {
          const scalar_t* next = next_of(r);
          const scalar_t* xr = row(r);
          if (hf_order) {
            load_row(xr, xs.data(), d);
            // n = z·rstd rounded to scalar_t (through y, in L1), then γ·n rounded once.
            rstd[r] = forward_row<true>(xs.data(), ones, s, ys.data(), d, eps, next, row_bytes);
            store_row(ys.data(), y + r * d, d);
            load_row(y + r * d, ys.data(), d);
            int64_t i = 0;
            for (; i + V::size() <= d; i += V::size()) (V::loadu(w + i) * V::loadu(ys.data() + i)).store(ys.data() + i);
            for (; i < d; ++i) ys[i] = w[i] * ys[i];
          } else {
            const bool done = stream ? forward_row_reduced_isa<true>(xr, w, s, y + r * d, d, eps, next, row_bytes,
                                                                     rstd + r, split)
                                     : forward_row_reduced_isa<false>(xr, w, s, y + r * d, d, eps, next, row_bytes,
                                                                      rstd + r, split);
            if (done) continue;
            load_row(xr, xs.data(), d);  // Σz² overflowed: the float path rescales
            rstd[r] = forward_row<false>(xs.data(), w, s, ys.data(), d, eps, next, row_bytes);
          }
          if (stream) {
            store_row_stream(ys.data(), y + r * d, d);
          } else {
            store_row(ys.data(), y + r * d, d);
          }
        }
      }
      if (stream || decltype(kStreamS)::value) stream_fence();
    });
  }, add.s != nullptr, stream_s);
}

// One row of the backward on acc_t rows: writes ∂L/∂x = rstd (γg − ẑ mean(γgẑ)) to `dx`
// and adds this row's terms (g ẑ, ∂L/∂x) to the ∂γ/∂δ partials `dw`, `ds`. `next_x`,
// `next_g`: the next row's inputs (next_bytes each; 0 when there is none), prefetched.
// kShift = false: δ is absent (s is a zero row) and the ∂δ partial `ds` is not written.
// kGradS: ∂x also adds `gs`, add_rms_norm's gradient of s (the partials do not).
template <bool kStream, bool kShift, bool kGradS, typename acc_t>
inline void backward_row(const acc_t* x, const acc_t* g, const acc_t* w, const acc_t* s, acc_t inv, acc_t* dx,
                         acc_t* dw, acc_t* ds, int64_t d, const void* next_x, const void* next_g,
                         int64_t next_bytes, const acc_t* gs) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size();
  const V vinv(inv);
  V vdot(0);  // Σ γ g ẑ, ẑ = z·rstd
  int64_t i = 0;
  for (; i + L <= d; i += L) {
    vdot = at::vec::fmadd(V::loadu(w + i) * V::loadu(g + i), (V::loadu(x + i) + V::loadu(s + i)) * vinv, vdot);
  }
  acc_t dot = at::vec::vec_reduce_all<acc_t>([](V a, V b) { return a + b; }, vdot);
  for (; i < d; ++i) dot += w[i] * g[i] * ((x[i] + s[i]) * inv);
  const acc_t coef = dot / acc_t(d);
  const V vcoef(coef);
  const char* px = static_cast<const char*>(next_x);
  const char* pg = static_cast<const char*>(next_g);
  const char* pgs = kGradS ? reinterpret_cast<const char*>(gs + d) : nullptr;  // gs's next row (rows contiguous)
  int64_t pf = 0;  // bytes of the next rows prefetched so far
  bool pf_g = false;
  i = 0;
  for (; i + L <= d; i += L) {  // x and g are still in L1
    if (pf < next_bytes) {  // one line per step, alternately of x and of g (then gs)
      __builtin_prefetch((pf_g ? pg : px) + pf, 0, 3);
      if constexpr (kGradS) {
        if (pf_g) __builtin_prefetch(pgs + pf, 0, 3);
      }
      pf += pf_g ? 64 : 0;
      pf_g = !pf_g;
    }
    const V zh = (V::loadu(x + i) + V::loadu(s + i)) * vinv, vg = V::loadu(g + i);
    const V dz = at::vec::fnmadd(vcoef, zh, V::loadu(w + i) * vg) * vinv;
    store_vec<kStream>(kGradS ? dz + V::loadu(gs + i) : dz, dx + i);
    if constexpr (kShift) (V::loadu(ds + i) + dz).store(ds + i);
    at::vec::fmadd(vg, zh, V::loadu(dw + i)).store(dw + i);
  }
  for (; i < d; ++i) {
    const acc_t zh = (x[i] + s[i]) * inv;
    const acc_t dz = (w[i] * g[i] - coef * zh) * inv;
    dx[i] = kGradS ? dz + gs[i] : dz;
    if constexpr (kShift) ds[i] += dz;
    dw[i] += g[i] * zh;
  }
}

// backward_row for a reduced-precision row: x, g and ∂x stay in scalar_t in memory and are
// converted 2·V::size() elements at a time; the float terms are those of backward_row.
template <bool kStream, bool kShift, bool kGradS, typename scalar_t>
inline void backward_row_reduced(const scalar_t* x, const scalar_t* g, const float* w, const float* s, float inv,
                                 scalar_t* dx, float* dw, float* ds, int64_t d, const void* next_x,
                                 const void* next_g, int64_t next_bytes, const scalar_t* gs) {
  using V = Vec<float>;
  constexpr int64_t L = RVec<scalar_t>::size(), H = V::size();
  const V vinv(inv);
  V vdot0(0), vdot1(0);
  int64_t i = 0;
  for (; i + L <= d; i += L) {
    auto [x0, x1] = load_float2(x + i);
    auto [g0, g1] = load_float2(g + i);
    vdot0 = at::vec::fmadd(V::loadu(w + i) * g0, (x0 + V::loadu(s + i)) * vinv, vdot0);
    vdot1 = at::vec::fmadd(V::loadu(w + i + H) * g1, (x1 + V::loadu(s + i + H)) * vinv, vdot1);
  }
  float dot = at::vec::vec_reduce_all<float>([](V a, V b) { return a + b; }, vdot0 + vdot1);
  for (; i < d; ++i) dot += w[i] * float(g[i]) * ((float(x[i]) + s[i]) * inv);
  const float coef = dot / float(d);
  const V vcoef(coef);
  const char* px = static_cast<const char*>(next_x);
  const char* pg = static_cast<const char*>(next_g);
  const char* pgs = kGradS ? reinterpret_cast<const char*>(gs + d) : nullptr;  // gs's next row (rows contiguous)
  int64_t pf = 0;  // bytes of the next rows prefetched so far: one line of x and one of g (and gs) per step
  i = 0;
  for (; i + L <= d; i += L) {  // x and g are still in L1
    if (pf < next_bytes) {
      __builtin_prefetch(px + pf, 0, 3);
      __builtin_prefetch(pg + pf, 0, 3);
      if constexpr (kGradS) __builtin_prefetch(pgs + pf, 0, 3);
      pf += 64;
    }
    auto [x0, x1] = load_float2(x + i);
    auto [g0, g1] = load_float2(g + i);
    const V zh0 = (x0 + V::loadu(s + i)) * vinv, zh1 = (x1 + V::loadu(s + i + H)) * vinv;
    const V dz0 = at::vec::fnmadd(vcoef, zh0, V::loadu(w + i) * g0) * vinv;
    const V dz1 = at::vec::fnmadd(vcoef, zh1, V::loadu(w + i + H) * g1) * vinv;
    if constexpr (kGradS) {
      auto [gs0, gs1] = load_float2(gs + i);
      store_float2<kStream>(dz0 + gs0, dz1 + gs1, dx + i);
    } else {
      store_float2<kStream>(dz0, dz1, dx + i);
    }
    if constexpr (kShift) {
      (V::loadu(ds + i) + dz0).store(ds + i);
      (V::loadu(ds + i + H) + dz1).store(ds + i + H);
    }
    at::vec::fmadd(g0, zh0, V::loadu(dw + i)).store(dw + i);
    at::vec::fmadd(g1, zh1, V::loadu(dw + i + H)).store(dw + i + H);
  }
  for (; i < d; ++i) {
    const float zh = (float(x[i]) + s[i]) * inv, gi = float(g[i]);
    const float dz = (w[i] * gi - coef * zh) * inv;
    dx[i] = scalar_t(kGradS ? dz + float(gs[i]) : dz);
    if constexpr (kShift) ds[i] += dz;
    dw[i] += gi * zh;
  }
}

// backward_row_reduced on the active ISA (isa.h); `split` as for forward_row_reduced_isa.
template <bool kStream, bool kShift, bool kGradS, typename scalar_t>
inline void backward_row_reduced_isa(const scalar_t* x, const scalar_t* g, const float* w, const float* s,
                                     float inv, scalar_t* dx, float* dw, float* ds, int64_t d, const void* next_x,
                                     const void* next_g, int64_t next_bytes, const SplitWeights& split,
                                     const scalar_t* gs) {
#if defined(WIOLA_HAVE_AVX512_TARGET)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (split.active) {
      avx512::backward_row<kStream, kShift, kGradS>(x, g, w, s, split.w.data(), split.s.data(), inv, dx, dw, ds, d,
                                                    next_x, next_g, next_bytes, gs);
      return;
    }
  }
#endif
  backward_row_reduced<kStream, kShift, kGradS>(x, g, w, s, inv, dx, dw, ds, d, next_x, next_g, next_bytes, gs);
}

// `gs`: add_rms_norm's gradient of s, added to ∂x (nullptr: none).
template <typename scalar_t>
void backward_rows(const scalar_t* g_in, const scalar_t* x, const acc_type<scalar_t>* w,
                   const acc_type<scalar_t>* s, const acc_type<scalar_t>* rstd, scalar_t* dx,
                   acc_type<scalar_t>* dw_partial, acc_type<scalar_t>* ds_partial, int64_t rows, int64_t d,
                   int64_t chunks, bool has_shift, const scalar_t* gs) {
  using acc_t = acc_type<scalar_t>;
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  const bool stream = stream_rows(dx, rows * d * int64_t(sizeof(scalar_t)), d);
  const int64_t row_bytes = d * int64_t(sizeof(scalar_t));
  const SplitWeights split = split_weights(w, s, d, /*eligible=*/std::is_same_v<scalar_t, at::BFloat16>);
  // At least kMinBackwardElemsPerThread elements per thread: waking a second thread for a
  // small input costs more than it saves, and far more on a loaded machine (docs/performance.md).
  // The chunks, hence the bits of the result, do not depend on this.
  const int64_t chunk_elems = std::max<int64_t>(1, rows_per_chunk * d);
  const int64_t grain = std::max<int64_t>(1, (kMinBackwardElemsPerThread + chunk_elems - 1) / chunk_elems);
  with_flags([&](auto kStream, auto kShift, auto kGradS) {
    constexpr bool stream_ = decltype(kStream)::value, shift_ = decltype(kShift)::value;
    constexpr bool grad_s_ = decltype(kGradS)::value;
    at::parallel_for(0, chunks, grain, [&](int64_t chunk_begin, int64_t chunk_end) {
      for (int64_t c = chunk_begin; c < chunk_end; ++c) {
        acc_t* dw = dw_partial + c * d;
        acc_t* ds = ds_partial + c * d;
        std::fill(dw, dw + d, acc_t(0));
        std::fill(ds, ds + d, acc_t(0));
        const int64_t r_end = std::min(rows, (c + 1) * rows_per_chunk);
        for (int64_t r = c * rows_per_chunk; r < r_end; ++r) {
          const int64_t next_bytes = r + 1 < r_end ? row_bytes : 0;
          const scalar_t* next_x = x + (r + 1) * d;  // only read (prefetched) when next_bytes > 0
          const scalar_t* next_g = g_in + (r + 1) * d;
          const scalar_t *xr = x + r * d, *gr = g_in + r * d, *gsr = grad_s_ ? gs + r * d : nullptr;
          scalar_t* dxr = dx + r * d;
          if constexpr (std::is_same_v<scalar_t, acc_t>) {
            backward_row<stream_, shift_, grad_s_>(xr, gr, w, s, rstd[r], dxr, dw, ds, d, next_x, next_g, next_bytes,
                                                   gsr);
          } else {
            backward_row_reduced_isa<stream_, shift_, grad_s_>(xr, gr, w, s, rstd[r], dxr, dw, ds, d, next_x,
                                                               next_g, next_bytes, split, gsr);
          }
        }
      }
      if (stream_) stream_fence();
    });
  }, stream, has_shift, gs != nullptr);
#if defined(WIOLA_HAVE_AVX512_TARGET)
  if constexpr (std::is_same_v<acc_t, float>) {
    if (split.active) {
      avx512::interleave_partials(dw_partial, chunks, d);
      if (has_shift) avx512::interleave_partials(ds_partial, chunks, d);
    }
  }
#endif
}

// δ in the accumulation dtype; a zero row when absent.
at::Tensor shift_or_zeros(const std::optional<at::Tensor>& shift, const at::Tensor& x, at::ScalarType acc) {
  return shift.has_value() ? shift->to(acc).contiguous() : at::zeros({x.size(-1)}, x.options().dtype(acc));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_rows_forward(const at::Tensor& x_in,
                                                                     const std::optional<at::Tensor>& residual,
                                                                     const at::Tensor& weight,
                                                                     const std::optional<at::Tensor>& shift,
                                                                     double eps, bool hf_order) {
  const int64_t d = x_in.size(-1);
  // rms_norm reads contiguous rows; add_rms_norm reads x and the residual through their row
  // strides (a view when the leading dimensions fold into one stride, else a copy).
  const at::Tensor x = residual.has_value() ? checks::unit_last_stride(x_in).reshape({-1, d}) : x_in.contiguous();
  const at::Tensor res = residual.has_value() ? checks::unit_last_stride(*residual).reshape({-1, d}) : at::Tensor();
  const int64_t rows = x.numel() / d;
  const auto acc = acc_scalar_type(x);
  const at::Tensor w = weight.to(acc).contiguous(), s = shift_or_zeros(shift, x, acc);
  const bool reduced = x.scalar_type() != acc;
  const at::Tensor ones = hf_order && reduced ? at::ones({d}, x.options().dtype(acc)) : w;
  at::Tensor y = empty_output(x_in.sizes(), x.options());
  at::Tensor sum = residual.has_value() ? empty_output(x_in.sizes(), x.options()) : at::Tensor();
  at::Tensor rstd = empty_output(x_in.sizes().slice(0, x_in.dim() - 1), x.options().dtype(acc));
  if (rows == 0) return {y, sum, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "wiola_rms_norm_fwd", [&] {
    using acc_t = acc_type<scalar_t>;
    ResidualAdd<scalar_t> add;
    if (residual.has_value()) {
      add = {x.const_data_ptr<scalar_t>(), x.stride(0), res.const_data_ptr<scalar_t>(), res.stride(0),
             sum.mutable_data_ptr<scalar_t>()};
    }
    forward_rows<scalar_t>(x.const_data_ptr<scalar_t>(), w.const_data_ptr<acc_t>(), s.const_data_ptr<acc_t>(),
                           ones.const_data_ptr<acc_t>(), y.mutable_data_ptr<scalar_t>(),
                           rstd.mutable_data_ptr<acc_t>(), rows, d, eps, hf_order, add);
  });
  return {y, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_rows_backward(const char* x_name, const at::Tensor& grad_y_in,
                                                                      const std::optional<at::Tensor>& grad_s_in,
                                                                      const at::Tensor& x_in, const at::Tensor& weight,
                                                                      const std::optional<at::Tensor>& shift,
                                                                      const at::Tensor& rstd_in) {
  const auto acc = acc_scalar_type(x_in);
  const auto same_as_x = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK_VALUE(t.sizes() == x_in.sizes() && t.scalar_type() == x_in.scalar_type() && t.device() == x_in.device(),
                      name, " must have the shape and dtype of ", x_name, " ", checks::shape_str(x_in.sizes()), ", got ",
                      checks::shape_str(t.sizes()), " ", checks::dtype_name(t.scalar_type()));
  };
  same_as_x("grad_y", grad_y_in);
  if (grad_s_in.has_value()) same_as_x("grad_s", *grad_s_in);
  TORCH_CHECK_VALUE(rstd_in.sizes() == x_in.sizes().slice(0, x_in.dim() - 1) && rstd_in.scalar_type() == acc &&
                        rstd_in.device() == x_in.device(),
                    "rstd must have shape ", x_name, ".shape[:-1] = ",
                    checks::shape_str(x_in.sizes().slice(0, x_in.dim() - 1)), " and dtype ", checks::dtype_name(acc),
                    " (the forward's), got ", checks::shape_str(rstd_in.sizes()), " ",
                    checks::dtype_name(rstd_in.scalar_type()));
  const at::Tensor x = x_in.contiguous(), grad_y = grad_y_in.contiguous(), rstd = rstd_in.contiguous();
  const at::Tensor grad_s = grad_s_in.has_value() ? grad_s_in->contiguous() : at::Tensor();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const at::Tensor w = weight.to(acc).contiguous(), s = shift_or_zeros(shift, x, acc);
  at::Tensor grad_x = empty_output(x.sizes(), x.options());
  const int64_t chunks = std::max<int64_t>(1, std::min(rows, kBackwardChunks));
  at::Tensor dw_partial = at::empty({chunks, d}, x.options().dtype(acc));
  at::Tensor ds_partial = at::empty({chunks, d}, x.options().dtype(acc));
  if (rows == 0) {
    dw_partial.zero_();
    ds_partial.zero_();
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "wiola_rms_norm_bwd", [&] {
      using acc_t = acc_type<scalar_t>;
      backward_rows<scalar_t>(grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                              w.const_data_ptr<acc_t>(), s.const_data_ptr<acc_t>(), rstd.const_data_ptr<acc_t>(),
                              grad_x.mutable_data_ptr<scalar_t>(), dw_partial.mutable_data_ptr<acc_t>(),
                              ds_partial.mutable_data_ptr<acc_t>(), rows, d, chunks, shift.has_value(),
                              grad_s.defined() ? grad_s.const_data_ptr<scalar_t>() : nullptr);
    });
  }
  // Column sums of the partials: a fixed-shape reduction, so the result does not
  // depend on the thread count.
  at::Tensor grad_shift = shift.has_value() ? ds_partial.sum(0).to(shift->scalar_type()) : at::Tensor();
  return {grad_x, dw_partial.sum(0).to(weight.scalar_type()), grad_shift};
}

namespace {

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& shift, double eps, bool hf_order) {
  checks::rms_norm(x, weight, shift);
  checks::positive("eps", eps);
  auto [y, unused, rstd] = rms_norm_rows_forward(x, std::nullopt, weight, shift, eps, hf_order);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_y, const at::Tensor& x,
                                                            const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& shift,
                                                            const at::Tensor& rstd) {
  checks::rms_norm(x, weight, shift);
  return rms_norm_rows_backward("x", grad_y, std::nullopt, x, weight, shift, rstd);
}

}  // namespace

// The op's schemas, declared once, here beside its CPU kernels: every build of the op compiles this file.
// set_python_module names the module that registers the op's fakes and Python kernels.
TORCH_LIBRARY_FRAGMENT(wiola, m) {
  m.set_python_module("wiola_kernels.ops.rms_norm");
  // x (..., d), any strides; weight, shift (d,) any float dtype, shift None: δ = 0 (no add,
  // grad_shift None); hf_order: Hugging Face's rounding order (z/r rounded to x's dtype, then
  // times weight). y like x (contiguous); rstd x.shape[:-1], float32 (float64 for double x).
  m.def("rms_norm(Tensor x, Tensor weight, Tensor? shift, float eps=1e-06, bool hf_order=False)"
        " -> (Tensor y, Tensor rstd)");
  m.def("rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor? shift, Tensor rstd)"
        " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");
  // The Python Triton launchers (CUDA only, registered from Python), which the C++ CUDA kernel
  // (csrc/cuda/triton_rms_norm_binding.cpp) runs where the cubin table has no variant for a call.
  m.def("_triton_rms_norm(Tensor x, Tensor weight, Tensor? shift, float eps=1e-06, bool hf_order=False)"
        " -> (Tensor y, Tensor rstd)");
  m.def("_triton_rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor? shift, Tensor rstd)"
        " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");
}

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("rms_norm", &rms_norm_fwd);
  m.impl("rms_norm_backward", &rms_norm_bwd);
}

}  // namespace wiola::cpu
