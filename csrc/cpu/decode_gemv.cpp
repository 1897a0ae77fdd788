// Batch-1 decoding GEMV on the CPU (issue 12 §3): y = x · Wᵀ for a few rows x (≤ 16) and a weight
// packed for one sequential read.
//
// At batch 1 a decoding step's matrix products are bound by reading the weights once, so
// the layout is chosen for streaming rather than for reuse. The weight W (n, k) of
// nn.Linear's convention is packed (wiola_kernels/decode_gemv.py) into panels of kPanel = 32
// output columns, k-major inside a panel, the last panel zero-padded:
//
//     packed[g, p, kk, c] = W_g[p·32 + c, kk]            packed: (G, P, k, 32) float32
//
// so the whole weight is one contiguous stream and a panel's step kk is 128 bytes (two
// cache lines) that feed 32 output columns. The G groups (G = 1 for a plain projection)
// each have their own x rows and weight: the folded context attention reads one small
// matrix per head (wiola/decode.py), and a group per head keeps those reads one stream too.
//
// Per panel, each row's 32 outputs live in registers for the whole k loop (AVX-512: two zmm
// per row, up to 8 rows at once; AVX2: four ymm per row, up to 3 rows at once); x[r, kk] is
// broadcast. With one row, two interleaved accumulator sets (even/odd kk) keep the FMA
// latency off the critical path. More rows than a register block holds re-read the panel
// (from L2: ≤ 512 KiB at k = 4096).
//
// Software prefetch runs kPrefetchBytes ahead of the read, so the next lines are in flight
// while the current ones are used. Measured on the 2-core CI VM (AMD EPYC, 1 thread, CPU
// time, one row, wiola-360m's five matrix shapes streamed from DRAM, 1.2 GB per pass, best
// of 7): AVX-512 37.9 GB/s without prefetch, 42.0–42.6 GB/s prefetching 1–16 KiB ahead
// (8 KiB kept); AVX2 36–37 GB/s with or without; MKL on nn.Linear's layout 19–26 GB/s, on
// a (k, n) copy 24–29. The hint is non-temporal: alone the GEMVs run as fast with T0, T1 or
// NTA, but NTA displaces less of what the step's small ops read next (KV cache,
// activations): decoding wiola-360m, the step outside its GEMVs took 3.2–5.6 ms with NTA
// against 7.4–7.7 ms with T0 (alternating runs, medians of 10 rounds of 4 steps).
//
// The AVX-512 path is compiled with a target attribute and chosen at run time
// (__builtin_cpu_supports), so the extension still runs on any x86-64-v3 CPU; `isa` forces
// a path (tests run each). Accumulation is float32 in kk order, one accumulator per output
// (two for a single row: even and odd kk, added at the end).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "common.h"
#include "isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WIOLA_GEMV_X86 1
#include <immintrin.h>
#endif

namespace wiola::cpu {
namespace {

constexpr int64_t kPanel = 32;                 // output columns per panel
constexpr int64_t kMaxRows = 16;               // rows of x per call (a decoding step's B·T_new)
constexpr int64_t kPrefetchBytes = 8192;       // how far ahead of the read the prefetches run

// One panel of one group: out[r, c] (c < cols) = Σ_kk x[r, kk] · w[kk, c] for r < R.
// x rows are ldx apart, out rows ldy apart; w is the panel (k, 32).
template <int R>
void panel_generic(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy, int64_t cols) {
  float acc[R][kPanel] = {};
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* wk = w + kk * kPanel;
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * ldx + kk];
      for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += xr * wk[c];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], cols * sizeof(float));
}

#if defined(WIOLA_GEMV_X86)

inline void prefetch_ahead(const float* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_NTA);
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + 64, _MM_HINT_NTA);
}

// AVX2 + FMA (the build's baseline, -march=x86-64-v3): 4 ymm per row, R ≤ 3.
template <int R>
__attribute__((target("avx2,fma"))) void panel_avx2(const float* x, int64_t ldx, const float* w, int64_t k, float* y,
                                                     int64_t ldy, int64_t cols) {
  constexpr int kSets = R == 1 ? 2 : 1;  // one row: even/odd kk accumulators
  __m256 acc[kSets][R][4];
  for (int s = 0; s < kSets; ++s)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[s][r][j] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + kSets <= k; kk += kSets) {
    for (int s = 0; s < kSets; ++s) {
      const float* wk = w + (kk + s) * kPanel;
      prefetch_ahead(wk);
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      const __m256 w2 = _mm256_loadu_ps(wk + 16), w3 = _mm256_loadu_ps(wk + 24);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + kk + s);
        acc[s][r][0] = _mm256_fmadd_ps(xb, w0, acc[s][r][0]);
        acc[s][r][1] = _mm256_fmadd_ps(xb, w1, acc[s][r][1]);
        acc[s][r][2] = _mm256_fmadd_ps(xb, w2, acc[s][r][2]);
        acc[s][r][3] = _mm256_fmadd_ps(xb, w3, acc[s][r][3]);
      }
    }
  }
  for (; kk < k; ++kk) {  // odd k with two sets: the last step into set 0
    const float* wk = w + kk * kPanel;
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + kk);
      for (int j = 0; j < 4; ++j) acc[0][r][j] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 8 * j), acc[0][r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float tmp[kPanel];
    for (int j = 0; j < 4; ++j) {
      __m256 v = acc[0][r][j];
      if constexpr (kSets == 2) v = _mm256_add_ps(v, acc[1][r][j]);
      _mm256_store_ps(tmp + 8 * j, v);
    }
    std::memcpy(y + r * ldy, tmp, cols * sizeof(float));
  }
}

// AVX-512F: 2 zmm per row, R ≤ 8 (16 accumulators; 4 with the even/odd split of one row).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void panel_avx512(const float* x, int64_t ldx, const float* w,
                                                                        int64_t k, float* y, int64_t ldy,
                                                                        int64_t cols) {
  constexpr int kSets = R <= 2 ? 2 : 1;
  __m512 acc[kSets][R][2];
  for (int s = 0; s < kSets; ++s)
    for (int r = 0; r < R; ++r) acc[s][r][0] = acc[s][r][1] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + kSets <= k; kk += kSets) {
    for (int s = 0; s < kSets; ++s) {
      const float* wk = w + (kk + s) * kPanel;
      prefetch_ahead(wk);
      const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * ldx + kk + s]);
        acc[s][r][0] = _mm512_fmadd_ps(xb, w0, acc[s][r][0]);
        acc[s][r][1] = _mm512_fmadd_ps(xb, w1, acc[s][r][1]);
      }
    }
  }
  for (; kk < k; ++kk) {
    const float* wk = w + kk * kPanel;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + kk]);
      acc[0][r][0] = _mm512_fmadd_ps(xb, w0, acc[0][r][0]);
      acc[0][r][1] = _mm512_fmadd_ps(xb, w1, acc[0][r][1]);
    }
  }
  // Masked stores: the padded columns of the last panel are never written.
  const int64_t lo = std::min<int64_t>(cols, 16), hi = cols - lo;
  const __mmask16 m0 = static_cast<__mmask16>((1u << lo) - 1), m1 = static_cast<__mmask16>((1u << hi) - 1);
  for (int r = 0; r < R; ++r) {
    __m512 v0 = acc[0][r][0], v1 = acc[0][r][1];
    if constexpr (kSets == 2) v0 = _mm512_add_ps(v0, acc[1][r][0]), v1 = _mm512_add_ps(v1, acc[1][r][1]);
    _mm512_mask_storeu_ps(y + r * ldy, m0, v0);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, v1);
  }
}

#endif  // WIOLA_GEMV_X86

enum class GemvIsa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

bool cpu_has(GemvIsa isa) {
  switch (isa) {
    case GemvIsa::kGeneric:
      return true;
#if defined(WIOLA_GEMV_X86)
    case GemvIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case GemvIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
#endif
    default:
      return false;
  }
}

const char* isa_name(GemvIsa isa) {
  return isa == GemvIsa::kAvx512 ? "avx512" : isa == GemvIsa::kAvx2 ? "avx2" : "generic";
}

GemvIsa parse_isa(const std::string& name) {
  if (name == "auto") {  // the CPU's best, unless the process chose AVX2 (isa.h: set_cpu_isa, WIOLA_CPU_ISA)
    if (active_isa() == Isa::kAvx2 && cpu_has(GemvIsa::kAvx2)) return GemvIsa::kAvx2;
    for (GemvIsa isa : {GemvIsa::kAvx512, GemvIsa::kAvx2})
      if (cpu_has(isa)) return isa;
    return GemvIsa::kGeneric;
  }
  for (GemvIsa isa : {GemvIsa::kGeneric, GemvIsa::kAvx2, GemvIsa::kAvx512}) {
    if (name == isa_name(isa)) {
      WIOLA_CHECK_ARG(cpu_has(isa), "isa='", name, "' is not supported by this CPU or build");
      return isa;
    }
  }
  WIOLA_CHECK_ARG(false, "isa must be one of 'auto', 'avx512', 'avx2', 'generic'; got '", name, "'");
  return GemvIsa::kGeneric;
}

using PanelFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);

// The register block of `isa` for `rows` rows: the kernel for min(rows, block) rows.
template <template <int> class Kernel>
PanelFn pick(int64_t rows) {
  switch (rows) {
    case 1: return &Kernel<1>::run;
    case 2: return &Kernel<2>::run;
    case 3: return &Kernel<3>::run;
    case 4: return &Kernel<4>::run;
    case 5: return &Kernel<5>::run;
    case 6: return &Kernel<6>::run;
    case 7: return &Kernel<7>::run;
    default: return &Kernel<8>::run;
  }
}

template <int R>
struct Generic {
  static void run(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy, int64_t c) {
    panel_generic<R>(x, ldx, w, k, y, ldy, c);
  }
};
#if defined(WIOLA_GEMV_X86)
template <int R>
struct Avx2 {  // R ≤ 3 rows per block (12 of the 16 ymm registers)
  static void run(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy, int64_t c) {
    panel_avx2<(R < 3 ? R : 3)>(x, ldx, w, k, y, ldy, c);
  }
};
template <int R>
struct Avx512 {
  static void run(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy, int64_t c) {
    panel_avx512<R>(x, ldx, w, k, y, ldy, c);
  }
};
#endif

// Rows per register block of each path.
int64_t block_rows(GemvIsa isa) { return isa == GemvIsa::kAvx2 ? 3 : isa == GemvIsa::kAvx512 ? 8 : 4; }

PanelFn panel_fn(GemvIsa isa, int64_t rows) {
#if defined(WIOLA_GEMV_X86)
  if (isa == GemvIsa::kAvx512) return pick<Avx512>(rows);
  if (isa == GemvIsa::kAvx2) return pick<Avx2>(rows);
#endif
  return pick<Generic>(rows);
}

// x (G, rows ≤ 16, k) float32 with a contiguous last dimension; packed (G, P, k, 32) contiguous
// float32 with P = ceil(n / 32). Returns (G, rows, n).
at::Tensor decode_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t n, c10::string_view isa_arg) {
  WIOLA_CHECK_ARG(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be CPU tensors");
  WIOLA_CHECK_ARG(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
                  "x and packed must be float32, got ", x.scalar_type(), " and ", packed.scalar_type());
  WIOLA_CHECK_ARG(x.dim() == 3, "x must have shape (G, rows, k), got ", x.sizes());
  WIOLA_CHECK_ARG(packed.dim() == 4 && packed.size(3) == kPanel && packed.is_contiguous(),
                  "packed must be a contiguous (G, P, k, ", kPanel, ") tensor, got ", packed.sizes());
  const int64_t groups = x.size(0), rows = x.size(1), k = x.size(2), panels = packed.size(1);
  WIOLA_CHECK_ARG(packed.size(0) == groups && packed.size(2) == k, "packed must have shape (G, P, k, 32) = (",
                  groups, ", P, ", k, ", 32) to match x ", x.sizes(), ", got ", packed.sizes());
  WIOLA_CHECK_ARG(rows >= 1 && rows <= kMaxRows, "x must have 1..", kMaxRows, " rows, got ", rows);
  WIOLA_CHECK_ARG(n >= 1 && (n + kPanel - 1) / kPanel == panels, "n must satisfy ceil(n / 32) = P = ", panels,
                  ", got n = ", n);
  WIOLA_CHECK_ARG(k >= 1, "k must be at least 1");
  WIOLA_CHECK_ARG(x.stride(2) == 1 || k == 1, "x must have a contiguous last dimension");
  const GemvIsa isa = parse_isa(std::string(isa_arg));
  const int64_t block = block_rows(isa);

  at::Tensor out = empty_output({groups, rows, n}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = packed.const_data_ptr<float>();
  float* yp = out.mutable_data_ptr<float>();
  const int64_t sxg = x.stride(0), sxr = x.stride(1);
  const int64_t panel_floats = k * kPanel;
  // Tasks are (group, panel) pairs in memory order, so a thread's share is one stretch of
  // the stream; a grain of ~64 KiB of weights keeps small calls on one thread.
  const int64_t tasks = groups * panels;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / panel_floats);
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / panels, p = t % panels;
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      const float* w = wp + t * panel_floats;
      for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t rb = std::min(block, rows - r0);
        panel_fn(isa, rb)(xp + g * sxg + r0 * sxr, sxr, w, k, yp + (g * rows + r0) * n + p * kPanel, n, cols);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CPU, m) { m.impl("_decode_gemv", &decode_gemv); }

}  // namespace wiola::cpu
