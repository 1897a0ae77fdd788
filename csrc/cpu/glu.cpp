// Gated activations on the CPU (SPEC §10.2): y = act(a) ⊙ b, act ∈ {SiLU, GELU_tanh}.
//
// Both activations are a·σ(h(a)): SiLU with h(a) = a, GELU_tanh with h(a) = 2k(a + c a³)
// (½(1 + tanh z) = σ(2z), k = √(2/π), c = 0.044715), which needs no tanh and has no
// cancellation in 1 + tanh for negative a. With s = σ(h):
//   act(a)  = a·s
//   act'(a) = s + a·s(1 − s)·h'(a)
//   ∂a = g·b·act'(a),  ∂b = g·act(a)         (the backward recomputes s from a)
// Edges: a is clamped to ±T for h and h' (T per activation and dtype: beyond it s is
// exactly 0 or 1 in the accumulation dtype), so nothing overflows and ±inf, huge a give the
// exact limits act = a (a > 0) or 0 (a < 0), act' = 1 or 0; NaN stays NaN (see clamp).
//
// σ uses a vectorised exp (float: Cody-Waite reduction and a degree-5 polynomial, ~2 ulp;
// double: at::vec's exp) and one division. In cache the float loops are compute-bound, so
// the exp is written for a low instruction count (one_plus_exp_neg), and CPUs with AVX-512
// run 16-lane versions of the same steps (avx512::, chosen at run time, isa.h; same bits
// as the 8-lane loops). Rows are read through
// their row stride (the halves of one projection's output are read in place); work is
// split into (row, column chunk) tiles so that few wide rows still use every thread.
// Large outputs are written with non-temporal stores.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>

#include "avx512_bf16.h"
#include "common.h"
#include "glu_math.h"
#include "isa.h"
#include "wiola/checks.h"

namespace wiola::cpu {
namespace {

using checks::GluActivation;
using namespace glu_math;

// (∂a, ∂b) of one vector.
template <GluActivation kAct, typename acc_t>
inline std::pair<Vec<acc_t>, Vec<acc_t>> glu_grad_vec(const Vec<acc_t>& g, const Vec<acc_t>& a,
                                                      const Vec<acc_t>& b) {
  using V = Vec<acc_t>;
  const Clamped<acc_t> c = clamp(a, Gate<kAct, acc_t>::kClamp);
  const V s = V(acc_t(1)) / one_plus_exp_neg<acc_t>(Gate<kAct, acc_t>::h(c.both));
  const V dact = at::vec::fmadd(c.both * s * (V(acc_t(1)) - s), Gate<kAct, acc_t>::dh(c.both), s);
  return {g * b * dact, g * (s * c.low)};
}

// Loads and stores of one step of a row in the accumulation dtype: one vector for float and
// double, two float vectors (converted on the fly) for bf16 and fp16.
template <typename scalar_t>
struct Io {
  using acc_t = acc_type<scalar_t>;
  using V = Vec<acc_t>;
  static constexpr bool kReduced = !std::is_same_v<scalar_t, acc_t>;
  static constexpr int kVecs = kReduced ? 2 : 1;
  static constexpr int64_t kStep = kVecs * V::size();
  using Step = std::array<V, kVecs>;

  static Step load(const scalar_t* p, int64_t count = kStep) {
    if constexpr (kReduced) {
      const auto v = count == kStep ? at::vec::Vectorized<scalar_t>::loadu(p)
                                    : at::vec::Vectorized<scalar_t>::loadu(p, count);
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(v);
      return {lo, hi};
    } else {
      return {count == kStep ? V::loadu(p) : V::loadu(p, count)};
    }
  }

  // kStream: non-temporal (p 32-byte aligned, a whole step).
  template <bool kStream>
  static void store(const Step& v, scalar_t* p, int64_t count = kStep) {
    if constexpr (kReduced) {
      const at::vec::Vectorized<scalar_t> r = at::vec::convert_from_float<scalar_t>(v[0], v[1]);
#if defined(CPU_CAPABILITY_AVX2)
      if constexpr (kStream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(p), r);
        return;
      }
#endif
      count == kStep ? r.store(p) : r.store(p, count);
    } else {
#if defined(CPU_CAPABILITY_AVX2)
      if constexpr (kStream && std::is_same_v<acc_t, float>) {
        _mm256_stream_ps(p, v[0]);
        return;
      } else if constexpr (kStream) {
        _mm256_stream_pd(p, v[0]);
        return;
      }
#endif
      count == kStep ? v[0].store(p) : v[0].store(p, count);
    }
  }
};

// Rows of a (rows, n) operand: element (r, c) at ptr[r·stride + c].
template <typename T>
struct Rows {
  T* ptr;
  int64_t stride;
  T* row(int64_t r) const { return ptr + r * stride; }
};

// Columns per tile: whole steps, so that streamed stores stay 32-byte aligned.
constexpr int64_t kTileCols = 2048;
constexpr int64_t kMinTileElemsPerTask = int64_t(1) << 15;  // the parallel grain, in elements

// f(row, first column, end column) over the (rows, n) tiles, in parallel.
template <typename F>
void for_each_tile(int64_t rows, int64_t n, F&& f) {
  const int64_t tiles_per_row = (n + kTileCols - 1) / kTileCols;
  const int64_t tile_cols = std::min(n, kTileCols);
  const int64_t grain = std::max<int64_t>(1, kMinTileElemsPerTask / std::max<int64_t>(1, tile_cols));
  at::parallel_for(0, rows * tiles_per_row, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / tiles_per_row, c0 = (t % tiles_per_row) * kTileCols;
      f(r, c0, std::min(n, c0 + kTileCols));
    }
  });
}

// Whether outputs `outs` of `bytes` bytes in all, rows of `row_strides` elements, are
// written with non-temporal stores: large outputs only (see use_streaming_stores), every
// row start 32-byte aligned.
template <typename scalar_t>
bool stream_outputs(std::initializer_list<Rows<scalar_t>> outs, int64_t bytes) {
#if defined(CPU_CAPABILITY_AVX2)
  if (bytes < kStreamMinBytes) return false;
  for (const auto& o : outs) {
    if (reinterpret_cast<uintptr_t>(o.ptr) % 32 != 0 || (o.stride * int64_t(sizeof(scalar_t))) % 32 != 0) return false;
  }
  return true;
#else
  (void)outs, (void)bytes;
  return false;
#endif
}

#if defined(WIOLA_HAVE_AVX512_TARGET)
// float, bf16 and fp16 rows on AVX-512 (isa.h): the float math of glu_vec / glu_grad_vec on
// 16 lanes. In cache it runs ~1.5x the 8-lane loops' throughput even where 512-bit operations
// are split in two (fewer instructions for the same work), which keeps these loops
// memory-bound. Rows in steps of 32 elements (two vectors: a bf16 block's even and odd
// elements, avx512_bf16.h; else two halves), the tail with masked loads and stores. The
// lanes compute what the AVX2 lanes compute, in the same order: both ISAs give the same bits.
namespace avx512 {

using namespace ::wiola::cpu::avx512;  // Split, load_bf16x32, pack_bf16x32, store_packed

WIOLA_TARGET_AVX512_BF16 inline __m512 one_plus_exp_neg(__m512 h) {  // as the AVX2 one_plus_exp_neg
  const __m512 hc = _mm512_max_ps(_mm512_min_ps(h, _mm512_set1_ps(87.0f)), _mm512_set1_ps(-89.0f));
  const __m512 shifter = _mm512_set1_ps(12582912.0f + 127.0f);
  const __m512 t = _mm512_fnmadd_ps(hc, _mm512_set1_ps(1.44269504088896341f), shifter);
  const __m512 n = _mm512_sub_ps(t, shifter);
  __m512 r = _mm512_fnmsub_ps(n, _mm512_set1_ps(0.693359375f), hc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(8.3125262e-3f), r, _mm512_set1_ps(4.1890115e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6667114e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.9999231e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23));
  return _mm512_fmadd_ps(p, scale, _mm512_set1_ps(1.0f));
}

// (a clamped below at −T, a clamped to ±T, 1 + e^{−h(a clamped)}): as clamp and Gate.
template <GluActivation kAct>
WIOLA_TARGET_AVX512_BF16 inline void gate(__m512 a, __m512& low, __m512& both, __m512& denominator) {
  constexpr float t = Gate<kAct, float>::kClamp;
  low = _mm512_max_ps(_mm512_set1_ps(-t), a);  // NaN stays NaN (second operand)
  both = _mm512_min_ps(_mm512_set1_ps(t), low);
  __m512 h = both;
  if constexpr (kAct == GluActivation::kGeluTanh) {
    h = _mm512_mul_ps(both, _mm512_fmadd_ps(_mm512_mul_ps(both, both), _mm512_set1_ps(float(2 * kGeluK * kGeluC)),
                                            _mm512_set1_ps(float(2 * kGeluK))));
  }
  denominator = one_plus_exp_neg(h);
}

template <GluActivation kAct>
WIOLA_TARGET_AVX512_BF16 inline __m512 glu_vec(__m512 a, __m512 b) {
  __m512 low, both, den;
  gate<kAct>(a, low, both, den);
  return _mm512_div_ps(_mm512_mul_ps(low, b), den);
}

template <GluActivation kAct>
WIOLA_TARGET_AVX512_BF16 inline void glu_grad_vec(__m512 g, __m512 a, __m512 b, __m512& da, __m512& db) {
  __m512 low, both, den;
  gate<kAct>(a, low, both, den);
  const __m512 s = _mm512_div_ps(_mm512_set1_ps(1.0f), den);
  __m512 slope = _mm512_set1_ps(1.0f);
  if constexpr (kAct == GluActivation::kGeluTanh) {
    slope = _mm512_fmadd_ps(_mm512_mul_ps(both, both), _mm512_set1_ps(float(6 * kGeluK * kGeluC)),
                            _mm512_set1_ps(float(2 * kGeluK)));
  }
  const __m512 spread = _mm512_mul_ps(_mm512_mul_ps(both, s), _mm512_sub_ps(_mm512_set1_ps(1.0f), s));
  const __m512 dact = _mm512_fmadd_ps(spread, slope, s);
  da = _mm512_mul_ps(_mm512_mul_ps(g, b), dact);
  db = _mm512_mul_ps(g, _mm512_mul_ps(s, low));
}

// 32 elements of a row as two float vectors, and back; `count` < 32: the masked tail.
template <typename scalar_t>
struct Io;

template <>
struct Io<float> {
  WIOLA_TARGET_AVX512_BF16 static Split load(const float* p, int64_t count = 32) {
    if (count == 32) return {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)};
    return {_mm512_maskz_loadu_ps(mask16(count), p), _mm512_maskz_loadu_ps(mask16(count - 16), p + 16)};
  }
  template <bool kStream>
  WIOLA_TARGET_AVX512_BF16 static void store(Split v, float* p, int64_t count = 32) {
    if (count == 32) {
      store_packed<kStream>(_mm512_castps_si512(v.even), p);
      store_packed<kStream>(_mm512_castps_si512(v.odd), p + 16);
      return;
    }
    _mm512_mask_storeu_ps(p, mask16(count), v.even);
    _mm512_mask_storeu_ps(p + 16, mask16(count - 16), v.odd);
  }
  static __mmask16 mask16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : n <= 0 ? 0 : __mmask16((1u << n) - 1); }
};

template <>
struct Io<at::BFloat16> {
  WIOLA_TARGET_AVX512_BF16 static Split load(const BF16* p, int64_t count = 32) {
    if (count == 32) return load_bf16x32(p);
    const __m512i v = _mm512_maskz_loadu_epi16(__mmask32((1u << count) - 1), p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xffff0000u))))};
  }
  template <bool kStream>
  WIOLA_TARGET_AVX512_BF16 static void store(Split v, BF16* p, int64_t count = 32) {
    if (count == 32) {
      store_packed<kStream>(pack_bf16x32(v.even, v.odd), p);
    } else {
      _mm512_mask_storeu_epi16(p, __mmask32((1u << count) - 1), pack_bf16x32(v.even, v.odd));
    }
  }
};

template <>
struct Io<at::Half> {
  WIOLA_TARGET_AVX512_BF16 static Split load(const at::Half* p, int64_t count = 32) {
    if (count == 32) {
      return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
              _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + 1))};
    }
    return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(Io<float>::mask16(count), p)),
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(Io<float>::mask16(count - 16), p + 16))};
  }
  template <bool kStream>
  WIOLA_TARGET_AVX512_BF16 static void store(Split v, at::Half* p, int64_t count = 32) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // as c10::Half(float)
    const __m256i lo = _mm512_cvtps_ph(v.even, kRound), hi = _mm512_cvtps_ph(v.odd, kRound);
    if (count == 32) {
      store_packed<kStream>(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), p);
    } else {
      _mm256_mask_storeu_epi16(p, Io<float>::mask16(count), lo);
      _mm256_mask_storeu_epi16(p + 16, Io<float>::mask16(count - 16), hi);
    }
  }
};

// One tile of a row (n elements from the given pointers).
template <GluActivation kAct, bool kStream, typename scalar_t>
WIOLA_TARGET_AVX512_BF16 void forward_span(const scalar_t* a, const scalar_t* b, scalar_t* y, int64_t n) {
  using io = Io<scalar_t>;
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    const Split av = io::load(a + c), bv = io::load(b + c);
    io::template store<kStream>({glu_vec<kAct>(av.even, bv.even), glu_vec<kAct>(av.odd, bv.odd)}, y + c);
  }
  if (c < n) {
    const Split av = io::load(a + c, n - c), bv = io::load(b + c, n - c);
    io::template store<false>({glu_vec<kAct>(av.even, bv.even), glu_vec<kAct>(av.odd, bv.odd)}, y + c, n - c);
  }
}

template <GluActivation kAct, bool kStream, typename scalar_t>
WIOLA_TARGET_AVX512_BF16 void backward_span(const scalar_t* g, const scalar_t* a, const scalar_t* b, scalar_t* da,
                                       scalar_t* db, int64_t n) {
  using io = Io<scalar_t>;
  for (int64_t c = 0; c < n; c += 32) {
    const int64_t count = std::min<int64_t>(32, n - c);
    const Split gv = io::load(g + c, count), av = io::load(a + c, count), bv = io::load(b + c, count);
    Split ga, gb;
    glu_grad_vec<kAct>(gv.even, av.even, bv.even, ga.even, gb.even);
    glu_grad_vec<kAct>(gv.odd, av.odd, bv.odd, ga.odd, gb.odd);
    if (count == 32) {
      io::template store<kStream>(ga, da + c);
      io::template store<kStream>(gb, db + c);
    } else {
      io::template store<false>(ga, da + c, count);
      io::template store<false>(gb, db + c, count);
    }
  }
}

}  // namespace avx512
#endif

// Whether scalar_t rows take the AVX-512 loops now (float, bf16, fp16 at the avx512_bf16
// level: the bf16 stores need AVX512_BF16, and one path for all dtypes keeps one choice).
template <typename scalar_t>
bool avx512_rows() {
#if defined(WIOLA_HAVE_AVX512_TARGET)
  return !std::is_same_v<scalar_t, double> && kernel_isa(kGluIsas) == Isa::kAvx512Bf16;
#else
  return false;
#endif
}

template <GluActivation kAct, bool kStream, typename scalar_t>
void forward_tiles(Rows<const scalar_t> a, Rows<const scalar_t> b, Rows<scalar_t> y, int64_t rows, int64_t n) {
  using io = Io<scalar_t>;
  using acc_t = typename io::acc_t;
  constexpr int64_t L = io::kStep;
  [[maybe_unused]] const bool wide = avx512_rows<scalar_t>();
  for_each_tile(rows, n, [&](int64_t r, int64_t c0, int64_t c1) {
    const scalar_t *ar = a.row(r), *br = b.row(r);
    scalar_t* yr = y.row(r);
#if defined(WIOLA_HAVE_AVX512_TARGET)
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (wide) return avx512::forward_span<kAct, kStream>(ar + c0, br + c0, yr + c0, c1 - c0);
    }
#endif
    int64_t c = c0;
    for (; c + L <= c1; c += L) {
      const auto av = io::load(ar + c), bv = io::load(br + c);
      typename io::Step out;
      for (int k = 0; k < io::kVecs; ++k) out[k] = glu_vec<kAct, acc_t>(av[k], bv[k]);
      io::template store<kStream>(out, yr + c);
    }
    if (c < c1) {
      const auto av = io::load(ar + c, c1 - c), bv = io::load(br + c, c1 - c);
      typename io::Step out;
      for (int k = 0; k < io::kVecs; ++k) out[k] = glu_vec<kAct, acc_t>(av[k], bv[k]);
      io::template store<false>(out, yr + c, c1 - c);
    }
  });
  if (kStream) stream_fence();
}

template <GluActivation kAct, bool kStream, typename scalar_t>
void backward_tiles(Rows<const scalar_t> g, Rows<const scalar_t> a, Rows<const scalar_t> b, Rows<scalar_t> da,
                    Rows<scalar_t> db, int64_t rows, int64_t n) {
  using io = Io<scalar_t>;
  using acc_t = typename io::acc_t;
  constexpr int64_t L = io::kStep;
  [[maybe_unused]] const bool wide = avx512_rows<scalar_t>();
  for_each_tile(rows, n, [&](int64_t r, int64_t c0, int64_t c1) {
    const scalar_t *gr = g.row(r), *ar = a.row(r), *br = b.row(r);
    scalar_t *dar = da.row(r), *dbr = db.row(r);
#if defined(WIOLA_HAVE_AVX512_TARGET)
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (wide) return avx512::backward_span<kAct, kStream>(gr + c0, ar + c0, br + c0, dar + c0, dbr + c0, c1 - c0);
    }
#endif
    auto step = [&](int64_t c, int64_t count, auto stream) {
      const auto gv = io::load(gr + c, count), av = io::load(ar + c, count), bv = io::load(br + c, count);
      typename io::Step ga, gb;
      for (int k = 0; k < io::kVecs; ++k) std::tie(ga[k], gb[k]) = glu_grad_vec<kAct, acc_t>(gv[k], av[k], bv[k]);
      io::template store<decltype(stream)::value>(ga, dar + c, count);
      io::template store<decltype(stream)::value>(gb, dbr + c, count);
    };
    int64_t c = c0;
    for (; c + L <= c1; c += L) step(c, L, std::bool_constant<kStream>{});
    if (c < c1) step(c, c1 - c, std::false_type{});
  });
  if (kStream) stream_fence();
}

template <typename F>
void dispatch_activation(GluActivation act, bool stream, F&& f) {
  auto with_stream = [&](auto kAct) {
    if (stream) {
      f(kAct, std::true_type{});
    } else {
      f(kAct, std::false_type{});
    }
  };
  if (act == GluActivation::kSilu) {
    with_stream(std::integral_constant<GluActivation, GluActivation::kSilu>{});
  } else {
    with_stream(std::integral_constant<GluActivation, GluActivation::kGeluTanh>{});
  }
}

// t as (rows, n) with unit column stride: a view when its leading dimensions fold into one
// row stride (the halves of a projection's output do), else a contiguous copy.
at::Tensor as_rows(const at::Tensor& t, int64_t n) {
  return checks::unit_last_stride(t).reshape({-1, n});
}

// The operands of either form: a's and b's rows (for the packed form, the two halves of a).
struct Operands {
  at::Tensor a_rows, b_rows;  // (rows, width of a)
  int64_t n, b_offset;        // b's elements start b_offset after a's in b_rows
};

Operands operands(const at::Tensor& a, const std::optional<at::Tensor>& b) {
  const int64_t width = a.size(-1);
  const int64_t n = b.has_value() ? width : width / 2;
  at::Tensor a_rows = as_rows(a, width);
  return {a_rows, b.has_value() ? as_rows(*b, width) : a_rows, n, b.has_value() ? 0 : n};
}

at::Tensor glu_fwd(const at::Tensor& a, const std::optional<at::Tensor>& b, c10::string_view activation) {
  const GluActivation act = checks::glu(a, b, activation);
  std::vector<int64_t> out_shape(a.sizes().begin(), a.sizes().end());
  if (!b.has_value()) out_shape.back() /= 2;
  at::Tensor y = empty_output(out_shape, a.options());
  if (y.numel() == 0) return y;
  const Operands op = operands(a, b);
  const int64_t rows = y.numel() / op.n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "wiola_glu_fwd", [&] {
    const Rows<const scalar_t> ar{op.a_rows.const_data_ptr<scalar_t>(), op.a_rows.stride(0)};
    const Rows<const scalar_t> br{op.b_rows.const_data_ptr<scalar_t>() + op.b_offset, op.b_rows.stride(0)};
    const Rows<scalar_t> yr{y.mutable_data_ptr<scalar_t>(), op.n};
    const bool stream = stream_outputs<scalar_t>({yr}, int64_t(y.nbytes()));
    dispatch_activation(act, stream, [&](auto kAct, auto kStream) {
      forward_tiles<decltype(kAct)::value, decltype(kStream)::value>(ar, br, yr, rows, op.n);
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> glu_bwd(const at::Tensor& grad_y, const at::Tensor& a,
                                           const std::optional<at::Tensor>& b, c10::string_view activation) {
  const GluActivation act = checks::glu(a, b, activation);
  std::vector<int64_t> y_shape(a.sizes().begin(), a.sizes().end());
  if (!b.has_value()) y_shape.back() /= 2;
  TORCH_CHECK_VALUE(grad_y.sizes() == at::IntArrayRef(y_shape) && grad_y.scalar_type() == a.scalar_type() &&
                        grad_y.device() == a.device(),
                    "grad_y must have the shape and dtype of y ", checks::shape_str(y_shape), " ",
                    checks::dtype_name(a.scalar_type()), ", got ", checks::shape_str(grad_y.sizes()), " ",
                    checks::dtype_name(grad_y.scalar_type()));
  // Gradients are contiguous: (..., n) each, or for the packed form one (..., 2n) tensor
  // holding [∂a | ∂b], the gradient of the projection's output with no cat.
  at::Tensor grad_a = empty_output(a.sizes(), a.options());
  at::Tensor grad_b = b.has_value() ? empty_output(a.sizes(), a.options()) : at::Tensor();
  const int64_t numel = int64_t(grad_y.numel());
  if (numel == 0) return {grad_a, grad_b};
  const Operands op = operands(a, b);
  const at::Tensor g = as_rows(grad_y, op.n);
  const int64_t rows = numel / op.n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "wiola_glu_bwd", [&] {
    const Rows<const scalar_t> gr{g.const_data_ptr<scalar_t>(), g.stride(0)};
    const Rows<const scalar_t> ar{op.a_rows.const_data_ptr<scalar_t>(), op.a_rows.stride(0)};
    const Rows<const scalar_t> br{op.b_rows.const_data_ptr<scalar_t>() + op.b_offset, op.b_rows.stride(0)};
    const int64_t width = a.size(-1);
    const Rows<scalar_t> dar{grad_a.mutable_data_ptr<scalar_t>(), width};
    const Rows<scalar_t> dbr = b.has_value() ? Rows<scalar_t>{grad_b.mutable_data_ptr<scalar_t>(), width}
                                             : Rows<scalar_t>{dar.ptr + op.n, width};
    const int64_t bytes = 2 * numel * int64_t(sizeof(scalar_t));
    const bool stream = stream_outputs<scalar_t>({dar, dbr}, bytes);
    dispatch_activation(act, stream, [&](auto kAct, auto kStream) {
      backward_tiles<decltype(kAct)::value, decltype(kStream)::value>(gr, ar, br, dar, dbr, rows, op.n);
    });
  });
  return {grad_a, grad_b};
}

}  // namespace

// The op's schemas, declared once, here beside its CPU kernels: every build of the op compiles this file.
// set_python_module names the module that registers the op's fakes and Python kernels.
TORCH_LIBRARY_FRAGMENT(wiola, m) {
  m.set_python_module("wiola_kernels.ops.glu");
  // y = act(a) ⊙ b, activation "silu" or "gelu_tanh". a, b (..., n), one dtype, any strides with
  // a unit last stride (the halves of one projection's output are read in place); or b None and
  // a (..., 2n) holding [a | b]. y (..., n) contiguous. Gradients contiguous: grad_a, grad_b of
  // a's shape, or for b None grad_a (..., 2n) = [∂a | ∂b] and grad_b None.
  m.def("glu(Tensor a, Tensor? b, str activation=\"silu\") -> Tensor");
  m.def("glu_backward(Tensor grad_y, Tensor a, Tensor? b, str activation) -> (Tensor grad_a, Tensor grad_b)");
  // The Python Triton launchers of glu (CUDA only, registered from Python): where the cubin table
  // has no variant for a call, the C++ CUDA kernel (csrc/cuda/triton_glu_binding.cpp) runs these.
  m.def("_triton_glu(Tensor a, Tensor? b, str activation) -> Tensor");
  m.def("_triton_glu_backward(Tensor grad_y, Tensor a, Tensor? b, str activation) -> (Tensor grad_a, Tensor grad_b)");
}

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("glu", &glu_fwd);
  m.impl("glu_backward", &glu_bwd);
}

}  // namespace wiola::cpu
