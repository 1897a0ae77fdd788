// Linear cross-entropy on the CPU (SPEC §10.1): ℓ_i from h_i Wᵀ without an (N, V) tensor.
//
// Rows are processed in chunks of R rows (chunk_rows); a chunk's logits L (R, V) live in one
// buffer of the input dtype, the only large thing the op allocates. Per chunk, each phase a
// parallel loop over a fixed partition into tasks (so the results do not depend on the thread
// count: every GEMM below runs on one thread, on a block the partition fixes), which the
// threads take one by one (a thread slowed by another process takes fewer):
//   1. per span of vocabulary blocks (C columns each): L[:, span] = h_c W_spanᵀ (one ATen
//      GEMM: MKL for float, oneDNN for bf16; on the widened path one block at a time), then
//      per block of the span softcap in place and each row's block max, Σexp, Σs and target
//      logit;
//   2. per row: lse and ℓ from the block statistics, combined in block order;
//   3. gradients wanted: dz in place in L block by block, and the blocks' share of ∂W,
//      dzᵀ h_c — per span of blocks in float/double (one GEMM into ∂W itself), per block
//      while it is in L2 in bf16 (through a block-sized partial);
//   4. ∂h_c = dz W: per column slab of ∂h (one GEMM over all of V); on the widened path
//      (below) per fixed group of blocks inside phase 3's tasks instead (each block's
//      dz_b W_b into the group's float partial while W_b is widened, the partials summed in
//      group order).
// Everything after the logits GEMM is ours (vectorised, float accumulation; double for
// double). bf16/fp16 (see widened_bf16_gemms): where the CPU multiplies bf16 natively the GEMMs
// run in bf16 (fp32 accumulation inside) and round their outputs, as a model's lm_head does;
// elsewhere they run in float32 on widened operands, with float32 logits. ∂h is rounded once;
// ∂W sums the chunks' partials to 24 bits (bf16: the output holds the top 16 bits of the
// float32 sum, a (V, d) byte buffer the next 8; see add_partial_split) or in float32 (fp16, a
// (V, d) float accumulator), rounded once at the end.
//
// Where the gradients come from (Liger-Kernel's choice, not Cut Cross-Entropy's): with
// reduction "mean" or "sum" every row's gradient is grad_loss (÷ n) times a row gradient the
// forward already has in L, so the forward computes the unscaled ∂h and ∂W in passing (3
// GEMMs per step), and the backward only scales them in place. Recomputing the logits in the
// backward (Cut Cross-Entropy) costs a 4th GEMM of the same size, and the GEMMs are nearly
// all of the time, so the torch.compile'd reference (3 GEMMs + elementwise passes over (N, V))
// would win (docs/ops.md, linear_cross_entropy). "none"
// weights rows by grad_loss[i], which only the backward knows: there the backward recomputes
// (phases 1, 3, 4 with the saved lse). The backward recomputes too when the forward's
// gradients were already used (autograd called twice on the graph, e.g. gradcheck): the same
// code on the same chunks, so both give the same bits.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include <unistd.h>

#include "common.h"
#include "isa.h"
#include "wiola/checks.h"

namespace wiola::cpu {
namespace {

// Bytes of one (R, C) logits block: it stays in L2 from its GEMM to its epilogue, and from its
// dz to its ∂W GEMM: half the core's L2 (block_bytes; 256 KiB where the L2 is unknown).
constexpr int64_t kDefaultBlockBytes = int64_t(256) << 10;
// Bytes of the chunk's logits (R, V), the op's working memory: R = this / (V · element size),
// at least kMinChunkRows (GEMMs with fewer rows lose efficiency), at most kMaxChunkRows.
// Every chunk streams all of W twice (logits, ∂h) and reads and writes all of ∂W (V, d) once,
// so fewer, larger chunks move less (docs/ops.md, linear_cross_entropy): at the bench shape
// (V 32000, d 1024) 64 MiB is 512 rows, a few percent of the eager loss's logits.
// Independent of the thread count, so that the results are too.
constexpr int64_t kChunkBytes = int64_t(64) << 20;
constexpr int64_t kMinChunkRows = 32;
constexpr int64_t kMaxChunkRows = 512;
// Vocabulary columns per GEMM (whole blocks) for the logits and, in float/double, for ∂W:
// fewer, wider calls than the L2-sized blocks the epilogues walk, because every call packs
// h_c again (with a call per 512-column block, packing was a tenth of a float32 fwd+bwd;
// 4096-column calls run as fast as one GEMM over all of V). 8 tasks at V = 32000. The
// block epilogues then read the span from L3/memory rather than L2: one more read of it.
constexpr int64_t kSpanCols = 4096;
// Columns of ∂h per phase-4 task, at most kGradHCols: each task reads all of the chunk's dz, so
// fewer, wider slabs read it fewer times; but an even number of slabs, at least 2, of equal
// width (a multiple of 16), so that two threads share the GEMM evenly — one 512-column slab at
// d = 512 left a core idle for a third of a fwd+bwd. A function of d alone (not of the thread
// count), so that the bits are too.
constexpr int64_t kGradHCols = 512;
int64_t grad_h_slab_cols(int64_t d) {
  int64_t slabs = std::max<int64_t>(2, (d + kGradHCols - 1) / kGradHCols);
  slabs += slabs % 2;
  return std::max<int64_t>(16, ((d + slabs - 1) / slabs + 15) / 16 * 16);
}
// The widened path's phase 3-4 tasks: ∂h_c = Σ_g dz[:, group g] W[group g] over this many
// fixed groups of vocabulary blocks, each into its own (R, d) float partial, summed in group
// order (so the bits do not depend on which thread ran a group); each W block is widened
// once for its ∂h product and its share of ∂W. (Float32 inputs keep the column slabs above:
// one long-K GEMM per slab instead of short-K ones.)
constexpr int64_t kGradHGroups = 8;

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

struct Options {
  int64_t ignore_index;
  double eps;        // label smoothing ε
  double z_loss;     // ζ
  bool has_cap;
  double cap;        // softcap c
};

// MKL's thread count for the calling thread set to 1 for the guard's lifetime. MKL plans a GEMM
// for the threads it may use, and on some CPUs (Sapphire Rapids) splits a long reduction (∂h's
// K = V) between them: the bits would then depend on the thread count, even inside a parallel
// region where the split halves run one after the other. Weak, so that a PyTorch built
// without MKL still loads the extension (and its BLAS runs as it will). MKL_Set_Num_Threads_Local
// is the C entry point (mkl_service.h maps mkl_set_num_threads_local to it); the lower-case
// symbol of the same name is the Fortran one, which takes a pointer.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
struct SequentialBlas {
  int previous = 0;
  SequentialBlas() { if (MKL_Set_Num_Threads_Local != nullptr) previous = MKL_Set_Num_Threads_Local(1); }
  ~SequentialBlas() { if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(previous); }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;
};

// tasks(0) … tasks(count − 1) on the intra-op threads, each task on one thread, taken in order
// from a shared counter (dynamic: a thread that another process slows takes fewer); `body(next)`
// runs once per worker and calls next() for its next task (−1: none left), so that a worker can
// keep its scratch across its tasks. Which thread runs a task does not change its result: its
// BLAS calls run on that one thread (SequentialBlas).
template <typename Body>
void parallel_tasks(int64_t count, const Body& body) {
  if (count <= 0) return;
  std::atomic<int64_t> counter{0};
  const int64_t workers = std::min<int64_t>(std::max(at::get_num_threads(), 1), count);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const at::AutoDispatchBelowADInplaceOrView no_autograd;  // worker threads: grad mode is per thread
    const SequentialBlas one_blas_thread;
    body([&]() -> int64_t {
      const int64_t t = counter.fetch_add(1, std::memory_order_relaxed);
      return t < count ? t : -1;
    });
  });
}

// Rows per chunk: kChunkBytes of logits, within [kMinChunkRows, kMaxChunkRows] and ≤ n.
// WIOLA_LCE_CHUNK_ROWS overrides it (for measuring other sizes; docs/ops.md).
int64_t chunk_rows(int64_t n, int64_t V, int64_t element_size) {
  int64_t rows = kChunkBytes / std::max<int64_t>(1, V * element_size);
  if (const char* env = std::getenv("WIOLA_LCE_CHUNK_ROWS")) {
    rows = std::atoll(env);
  }
  rows = std::clamp<int64_t>(rows, kMinChunkRows, kMaxChunkRows);
  return std::max<int64_t>(1, std::min(rows, n));
}

// Bytes of a logits block: half the core's L2 (the OS's figure), within [256 KiB, 1 MiB];
// 256 KiB where the OS does not say.
int64_t block_bytes() {
  static const int64_t bytes = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
    const long l2 = 0;
#endif
    return l2 > 0 ? std::clamp<int64_t>(l2 / 2, kDefaultBlockBytes, int64_t(1) << 20) : kDefaultBlockBytes;
  }();
  return bytes;
}

// Vocabulary columns per block: block_bytes() of an (R, C) block, a multiple of 64.
int64_t block_cols(int64_t rows, int64_t V, int64_t element_size) {
  int64_t cols = block_bytes() / std::max<int64_t>(1, rows * element_size);
  cols = std::max<int64_t>(64, cols / 64 * 64);
  return std::min(cols, V);
}

template <typename acc_t>
inline Vec<acc_t> fast_exp(const Vec<acc_t>& x) {
  return x.exp_u20();  // ≤ 20 ulp in float; the loss needs 1e-4
}

// x ← c·tanh(x / c).
template <typename acc_t>
void softcap_row(acc_t* x, int64_t n, acc_t cap) {
  using V = Vec<acc_t>;
  const V vc(cap), vinv(acc_t(1) / cap);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) (vc * (V::loadu(x + i) * vinv).tanh()).store(x + i);
  for (; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

template <typename acc_t>
acc_t max_row(const acc_t* x, int64_t n) {
  using V = Vec<acc_t>;
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  int64_t i = 0;
  if (n >= V::size()) {
    V vm = V::loadu(x);
    for (i = V::size(); i + V::size() <= n; i += V::size()) vm = at::vec::maximum(vm, V::loadu(x + i));
    m = at::vec::vec_reduce_all<acc_t>([](V a, V b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);  // NaN in a row: the comparisons above keep it (maximum)
  return m;
}

// (Σ exp(x − m), Σ x).
template <typename acc_t>
std::pair<acc_t, acc_t> exp_sum_row(const acc_t* x, int64_t n, acc_t m, bool want_sum) {
  using V = Vec<acc_t>;
  const V vm(m);
  V se(0), sx(0);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    const V v = V::loadu(x + i);
    se = se + fast_exp(v - vm);
    if (want_sum) sx = sx + v;
  }
  acc_t e = at::vec::vec_reduce_all<acc_t>([](V a, V b) { return a + b; }, se);
  acc_t s = want_sum ? at::vec::vec_reduce_all<acc_t>([](V a, V b) { return a + b; }, sx) : acc_t(0);
  for (; i < n; ++i) {
    e += std::exp(x[i] - m);
    if (want_sum) s += x[i];
  }
  return {e, s};
}

// dz over one block row: t_v = a·exp(s_v − lse) − b, minus k at the label column `yc`
// (−1: not in this block), times 1 − (s_v/c)² under a softcap.
template <typename acc_t>
void dz_row(acc_t* x, int64_t n, acc_t lse, acc_t a, acc_t b, acc_t k, int64_t yc, const Options& o) {
  using V = Vec<acc_t>;
  const V vlse(lse), va(a), vb(b), one(acc_t(1)), vinv(acc_t(o.has_cap ? 1.0 / o.cap : 1.0));
  acc_t xy = yc >= 0 ? x[yc] : acc_t(0);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    const V s = V::loadu(x + i);
    V t = at::vec::fmsub(va, fast_exp(s - vlse), vb);
    if (o.has_cap) {
      const V r = s * vinv;
      t = t * at::vec::fnmadd(r, r, one);
    }
    t.store(x + i);
  }
  const acc_t inv = acc_t(o.has_cap ? 1.0 / o.cap : 1.0);
  for (; i < n; ++i) {
    acc_t t = a * std::exp(x[i] - lse) - b;
    if (o.has_cap) t *= acc_t(1) - (x[i] * inv) * (x[i] * inv);
    x[i] = t;
  }
  if (yc >= 0) {
    acc_t t = a * std::exp(xy - lse) - b - k;
    if (o.has_cap) t *= acc_t(1) - (xy * inv) * (xy * inv);
    x[yc] = t;
  }
}

// The chunk's block statistics, (rows, blocks) each: max, Σexp(s − max), Σs; and s_y per row.
template <typename acc_t>
struct Stats {
  std::vector<acc_t> max, expsum, sum, target;
  int64_t blocks;
  Stats(int64_t rows, int64_t blocks_)
      : max(rows * blocks_), expsum(rows * blocks_), sum(rows * blocks_), target(rows), blocks(blocks_) {}
};

// bf16 ∂W summed over the chunks to 24 bits without a float32 (V, d) buffer: the float32 sum
// s is kept as its top 16 bits in the output `hi` itself (a bf16 bit pattern) and its next 8
// in `lo`; each chunk adds its partial p in float32 to (hi, lo) and rounds the sum to 24 bits
// (half a unit of the 24th bit: ≤ 2^-16 relative, against 2^-9 for a bf16 running sum, which
// at N = 4096 in 16-row chunks misses 1e-2); `last`: the final sum is rounded to bf16
// (nearest even) instead. Inf and NaN pass through (no rounding increment on them).
// The partial p is the GEMM's bf16 output, or its float32 output on the widened path.
template <typename part_t>
inline void add_partial_split(const part_t* p, c10::BFloat16* hi, uint8_t* lo, int64_t count, bool first, bool last) {
  uint16_t* hb = reinterpret_cast<uint16_t*>(hi);
  for (int64_t i = 0; i < count; ++i) {
    float s = static_cast<float>(p[i]);
    if (!first) s += std::bit_cast<float>((uint32_t(hb[i]) << 16) | (uint32_t(lo[i]) << 8));
    uint32_t u = std::bit_cast<uint32_t>(s);
    if (last) {
      hb[i] = c10::BFloat16(s).x;  // round to nearest even
      continue;
    }
    u += (u & 0x7F800000u) != 0x7F800000u ? 0x80u : 0u;
    hb[i] = uint16_t(u >> 16);
    lo[i] = uint8_t(u >> 8);
  }
}

// One call's tensors and sizes.
template <typename scalar_t>
struct Problem {
  using acc_t = acc_type<scalar_t>;
  at::Tensor h, W;          // (n, d), (V, d): any strides the GEMMs take
  const int64_t* y;         // (n,) labels
  int64_t n, V, d;
  Options o;
};

// bf16/fp16 GEMMs run as float32 GEMMs on widened operands ("the widened path": h a chunk at
// a time, W a block at a time, float32 logits) unless the CPU multiplies bf16 natively
// (AVX512_BF16 and up, where oneDNN's bf16 GEMM is the fast one): without native bf16,
// ATen's bf16 GEMM is several times slower than MKL's float32 one, and a widened bf16
// fwd+bwd takes the float32 time (docs/ops.md, linear_cross_entropy).
// fp16 always widens: ATen's fp16 GEMM is fast only with AVX512-FP16 or AMX-FP16, which the
// ISA levels here (isa.h) do not name.
inline bool widened_bf16_gemms() { return kernel_isa(kLinearCrossEntropyIsas) < Isa::kAvx512Bf16; }

// A worker's (cols, d) float32 buffer for widened W blocks (undefined when logit_t is the input type).
template <typename scalar_t, typename logit_t>
at::Tensor widen_buffer(const Problem<scalar_t>& P, int64_t cols) {
  if constexpr (std::is_same_v<scalar_t, logit_t>) return at::Tensor();
  else return at::empty({std::min(cols, P.V), P.d}, P.W.options().dtype(at::kFloat));
}

// W[v0 : v0 + nv] as a GEMM operand: a view of W, or its float32 copy in `buf` (widened path).
template <typename scalar_t, typename logit_t>
at::Tensor vocab_rows(const Problem<scalar_t>& P, int64_t v0, int64_t nv, at::Tensor& buf) {
  const at::Tensor w = P.W.narrow(0, v0, nv);
  if constexpr (std::is_same_v<scalar_t, logit_t>) {
    (void)buf;
    return w;
  } else {
    at::Tensor wide = buf.narrow(0, 0, nv);
    wide.copy_(w);
    return wide;
  }
}

// A worker's row of acc_t for reduced-precision rows (empty for float/double storage).
template <typename logit_t>
std::vector<acc_type<logit_t>> scratch_row(int64_t cols) {
  return std::vector<acc_type<logit_t>>(std::is_same_v<logit_t, acc_type<logit_t>> ? 0 : cols);
}

// acc_t view of a block row: the row itself (float/double storage) or its copy in `scratch`.
template <typename logit_t, typename acc_t = acc_type<logit_t>>
inline acc_t* as_acc(logit_t* p, int64_t n, std::vector<acc_t>& scratch) {
  if constexpr (std::is_same_v<logit_t, acc_t>) {
    (void)n, (void)scratch;
    return p;
  } else {
    load_row(p, scratch.data(), n);
    return scratch.data();
  }
}

template <typename logit_t, typename acc_t>
inline void write_back(const acc_t* x, logit_t* p, int64_t n) {
  if constexpr (!std::is_same_v<logit_t, acc_t>) store_row(x, p, n);
  else (void)x, (void)p, (void)n;
}

// Phase 1: logits of the chunk's rows (GEMM operand hc) into L, softcapped in place; block
// statistics. L holds logit_t: the input dtype, or float32 on the widened path.
template <typename scalar_t, typename logit_t>
void logits_and_stats(const Problem<scalar_t>& P, const at::Tensor& hc, at::Tensor& L, int64_t rows, int64_t cols,
                      int64_t r0, Stats<acc_type<scalar_t>>* stats) {
  using acc_t = acc_type<scalar_t>;
  const int64_t blocks = (P.V + cols - 1) / cols;
  // Blocks per GEMM: a span of at least kSpanCols columns where W is read in place
  // (the widened path widens one block at a time into a block-sized buffer).
  constexpr bool widened = !std::is_same_v<scalar_t, logit_t>;
  const int64_t span = widened ? 1 : std::max<int64_t>(1, (kSpanCols + cols - 1) / cols);
  const int64_t spans = (blocks + span - 1) / span;
  parallel_tasks(spans, [&](const auto& next) {
    auto scratch = scratch_row<logit_t>(cols);
    at::Tensor wbuf = widen_buffer<scalar_t, logit_t>(P, cols);
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t b0 = t * span, b1 = std::min(blocks, b0 + span);
      const int64_t s0 = b0 * cols, sn = std::min(P.V, b1 * cols) - s0;
      at::Tensor Ls = L.narrow(0, 0, rows).narrow(1, s0, sn);
      at::mm_out(Ls, hc, vocab_rows<scalar_t, logit_t>(P, s0, sn, wbuf).t());
      if (!P.o.has_cap && stats == nullptr) continue;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t v0 = b * cols, nv = std::min(cols, P.V - v0);
        logit_t* base = L.mutable_data_ptr<logit_t>() + v0;
        for (int64_t r = 0; r < rows; ++r) {
          logit_t* row = base + r * P.V;
          acc_t* x = as_acc(row, nv, scratch);
          if (P.o.has_cap) {
            softcap_row(x, nv, acc_t(P.o.cap));
            write_back(x, row, nv);
            if constexpr (!std::is_same_v<logit_t, acc_t>) load_row(row, x, nv);  // the stored (rounded) s
          }
          if (stats == nullptr) continue;
          const acc_t m = max_row(x, nv);
          const auto [e, s] = exp_sum_row(x, nv, m, P.o.eps != 0.0);
          stats->max[r * blocks + b] = m;
          stats->expsum[r * blocks + b] = e;
          stats->sum[r * blocks + b] = s;
          const int64_t yv = P.y[r0 + r] - v0;
          if (P.y[r0 + r] != P.o.ignore_index && yv >= 0 && yv < nv) stats->target[r] = x[yv];
        }
      }
    }
  });
}

// Phase 2: lse and ℓ per row from the block statistics (block order: deterministic).
template <typename acc_t>
void row_losses(const Stats<acc_t>& st, const int64_t* y, int64_t rows, int64_t V, const Options& o, acc_t* lse,
                acc_t* loss) {
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t* m = &st.max[r * st.blocks];
    const acc_t* e = &st.expsum[r * st.blocks];
    const acc_t* s = &st.sum[r * st.blocks];
    acc_t mx = m[0];
    for (int64_t b = 1; b < st.blocks; ++b) mx = std::max(mx, m[b]);
    acc_t total = 0, sum = 0;
    for (int64_t b = 0; b < st.blocks; ++b) {
      total += std::isinf(mx) ? e[b] : e[b] * std::exp(m[b] - mx);
      sum += s[b];
    }
    const acc_t l = mx + std::log(total);
    lse[r] = l;
    if (y[r] == o.ignore_index) {
      loss[r] = 0;
      continue;
    }
    acc_t v = acc_t(1.0 - o.eps) * (l - st.target[r]);
    if (o.eps != 0.0) v += acc_t(o.eps) * (l - sum / acc_t(V));
    if (o.z_loss != 0.0) v += acc_t(o.z_loss) * l * l;
    loss[r] = v;
  }
}

// Where one chunk's gradients go. ∂W: float/double accumulate in grad_W; bf16 in (grad_W,
// dW_lo) (add_partial_split); fp16 in the float accumulator dW_acc. dh_parts: the (groups, R, d)
// partials of ∂h (widened path only). `first`: the chunk overwrites instead of adding; `last`:
// the final chunk (bf16 rounds).
struct Grads {
  at::Tensor* grad_h;
  at::Tensor* grad_W;
  at::Tensor* dW_acc;
  at::Tensor* dW_lo;
  at::Tensor* dh_parts;
  bool first, last;
};

// dz in place over block [v0, v0 + nv) of the chunk's rows (row r weighted by g[r]; 0: an
// ignored row).
template <typename scalar_t, typename logit_t>
void block_dz(const Problem<scalar_t>& P, at::Tensor& L, int64_t r0, int64_t rows, int64_t v0, int64_t nv,
              const acc_type<scalar_t>* lse, const acc_type<scalar_t>* g, std::vector<acc_type<logit_t>>& scratch) {
  using acc_t = acc_type<scalar_t>;
  const Options& o = P.o;
  logit_t* base = L.mutable_data_ptr<logit_t>() + v0;
  for (int64_t r = 0; r < rows; ++r) {
    logit_t* row = base + r * P.V;
    if (g[r] == acc_t(0)) {
      std::fill(row, row + nv, logit_t(0));
      continue;
    }
    acc_t* x = as_acc(row, nv, scratch);
    const int64_t yv = P.y[r0 + r] - v0;
    dz_row(x, nv, lse[r], acc_t(g[r] * (1.0 + 2.0 * o.z_loss * lse[r])), acc_t(g[r] * o.eps / double(P.V)),
           acc_t(g[r] * (1.0 - o.eps)), yv >= 0 && yv < nv ? yv : -1, o);
    write_back(x, row, nv);
  }
}

// The block's share of ∂W, dz_blockᵀ h_c, added into the chunk sum (`partial`: the worker's
// (cols, d) GEMM output where the sum is not the GEMM's own output).
template <typename scalar_t, typename logit_t>
void block_dW(const Problem<scalar_t>& P, const at::Tensor& dzb, const at::Tensor& hc, int64_t v0, int64_t nv,
              const Grads& G, at::Tensor& partial) {
  using acc_t = acc_type<scalar_t>;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {  // float / double: accumulate in the output
    at::Tensor out = G.grad_W->narrow(0, v0, nv);
    if (G.first) at::mm_out(out, dzb, hc);
    else out.addmm_(dzb, hc);
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {  // fp16 (always widened): in the float accumulator
    at::Tensor out = G.dW_acc->narrow(0, v0, nv);
    if (G.first) at::mm_out(out, dzb, hc);
    else out.addmm_(dzb, hc);
  } else {  // bf16: the GEMM's partial (bf16, or float widened) summed to 24 bits
    at::Tensor part = partial.narrow(0, 0, nv);
    at::mm_out(part, dzb, hc);
    add_partial_split(part.const_data_ptr<logit_t>(), G.grad_W->mutable_data_ptr<scalar_t>() + v0 * P.d,
                      G.dW_lo->mutable_data_ptr<uint8_t>() + v0 * P.d, nv * P.d, G.first, G.last);
  }
}

// Phases 3 and 4 for one chunk whose float32 logits are in L, on the widened path: tasks are
// kGradHGroups fixed groups of vocabulary blocks; per block, dz in place, its share of ∂W and
// its product dz_b W_b (W_b widened once for both) into the group's ∂h partial, while the
// block is in L2; then ∂h_c = Σ_g partial_g in group order.
template <typename scalar_t, typename logit_t>
void chunk_gradients_widened(const Problem<scalar_t>& P, const at::Tensor& hc, at::Tensor& L, int64_t r0,
                             int64_t rows, int64_t cols, const acc_type<scalar_t>* lse, const acc_type<scalar_t>* g,
                             const Grads& G) {
  const int64_t blocks = (P.V + cols - 1) / cols;
  const int64_t groups = std::min(kGradHGroups, blocks);
  parallel_tasks(groups, [&](const auto& next) {
    auto scratch = scratch_row<logit_t>(cols);
    at::Tensor wbuf = widen_buffer<scalar_t, logit_t>(P, cols);
    at::Tensor partial = G.grad_W != nullptr && std::is_same_v<scalar_t, c10::BFloat16>
                             ? at::empty({std::min(cols, P.V), P.d}, L.options())
                             : at::Tensor();
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t b0 = blocks * t / groups, b1 = blocks * (t + 1) / groups;
      at::Tensor dh = G.grad_h != nullptr ? G.dh_parts->select(0, t).narrow(0, 0, rows) : at::Tensor();
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t v0 = b * cols, nv = std::min(cols, P.V - v0);
        block_dz<scalar_t, logit_t>(P, L, r0, rows, v0, nv, lse, g, scratch);
        const at::Tensor dzb = L.narrow(0, 0, rows).narrow(1, v0, nv);  // (rows, nv)
        if (G.grad_W != nullptr) block_dW<scalar_t, logit_t>(P, dzb.t(), hc, v0, nv, G, partial);
        if (G.grad_h == nullptr) continue;
        const at::Tensor wb = vocab_rows<scalar_t, logit_t>(P, v0, nv, wbuf);
        if (b == b0) at::mm_out(dh, dzb, wb);
        else dh.addmm_(dzb, wb);
      }
    }
  });
  if (G.grad_h == nullptr) return;
  // ∂h_c = Σ_g partial_g, in group order, rounded once to the input dtype.
  using acc_t = acc_type<logit_t>;
  const acc_t* parts = G.dh_parts->const_data_ptr<acc_t>();
  const int64_t stride = G.dh_parts->stride(0);
  scalar_t* out = G.grad_h->mutable_data_ptr<scalar_t>() + r0 * P.d;
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    std::vector<acc_t> row(P.d);
    for (int64_t r = lo; r < hi; ++r) {
      const acc_t* p = parts + r * P.d;
      std::copy(p, p + P.d, row.begin());
      for (int64_t t = 1; t < groups; ++t) {
        const acc_t* q = p + t * stride;
        for (int64_t c = 0; c < P.d; ++c) row[c] += q[c];
      }
      store_row(row.data(), out + r * P.d, P.d);
    }
  });
}

// Phases 3 and 4 for one chunk whose logits are in L in the input dtype: per block, dz in
// place and its share of ∂W, while the block is in L2; then per column slab of ∂h,
// ∂h_c = dz W (one GEMM over all of V).
template <typename scalar_t>
void chunk_gradients(const Problem<scalar_t>& P, const at::Tensor& hc, at::Tensor& L, int64_t r0,
                              int64_t rows, int64_t cols, const acc_type<scalar_t>* lse,
                              const acc_type<scalar_t>* g, const Grads& G) {
  const int64_t blocks = (P.V + cols - 1) / cols;
  // float/double accumulate ∂W in the output, so their ∂W GEMM spans several blocks (one pack
  // of h_c per span instead of per block); bf16's goes through a block-sized partial.
  constexpr bool in_output = std::is_same_v<scalar_t, acc_type<scalar_t>>;
  const int64_t span = in_output ? std::max<int64_t>(1, (kSpanCols + cols - 1) / cols) : 1;
  const int64_t spans = (blocks + span - 1) / span;
  parallel_tasks(spans, [&](const auto& next) {
    auto scratch = scratch_row<scalar_t>(cols);
    at::Tensor partial = G.grad_W != nullptr && !in_output ? at::empty({std::min(cols, P.V), P.d}, P.h.options())
                                                           : at::Tensor();
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t b0 = t * span, b1 = std::min(blocks, b0 + span);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t v0 = b * cols, nv = std::min(cols, P.V - v0);
        block_dz<scalar_t, scalar_t>(P, L, r0, rows, v0, nv, lse, g, scratch);
      }
      if (G.grad_W == nullptr) continue;
      const int64_t s0 = b0 * cols, sn = std::min(P.V, b1 * cols) - s0;
      const at::Tensor dzs = L.narrow(0, 0, rows).narrow(1, s0, sn).t();  // (sn, rows)
      block_dW<scalar_t, scalar_t>(P, dzs, hc, s0, sn, G, partial);
    }
  });
  if (G.grad_h == nullptr) return;
  const at::Tensor dz = L.narrow(0, 0, rows);
  const int64_t slab = grad_h_slab_cols(P.d);
  const int64_t tasks = (P.d + slab - 1) / slab;
  parallel_tasks(tasks, [&](const auto& next) {
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t c0 = t * slab, nc = std::min(slab, P.d - c0);
      at::Tensor out = G.grad_h->narrow(0, r0, rows).narrow(1, c0, nc);
      at::mm_out(out, dz, P.W.narrow(1, c0, nc));
    }
  });
}

// Every chunk: logits (phase 1), then with `lse_in` (backward) the given lse, else phase 2's
// into lse/loss; with gradients wanted, phases 3-4 with row weights g(r) (0 on ignored rows).
// logit_t: the logits' (and GEMMs') dtype, the input's or float32 (widened path).
template <typename scalar_t, typename logit_t, typename RowWeight>
void run_chunks_as(const Problem<scalar_t>& P, acc_type<scalar_t>* lse, acc_type<scalar_t>* loss,
                   const acc_type<scalar_t>* lse_in, at::Tensor* grad_h, at::Tensor* grad_W, RowWeight weight) {
  using acc_t = acc_type<scalar_t>;
  constexpr bool widened = !std::is_same_v<scalar_t, logit_t>;
  const int64_t esize = int64_t(sizeof(logit_t));
  const int64_t R = chunk_rows(P.n, P.V, esize);
  const int64_t cols = block_cols(R, P.V, esize);
  const int64_t blocks = (P.V + cols - 1) / cols;
  const bool grads = grad_h != nullptr || grad_W != nullptr;
  const auto logit_dtype = c10::CppTypeToScalarType<logit_t>::value;
  at::Tensor L = at::empty({R, P.V}, P.h.options().dtype(logit_dtype));
  // ∂W of reduced precision: bf16 summed to 24 bits in (grad_W, dW_lo), fp16 in float (V, d);
  // rounded once at the end.
  constexpr bool bf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr bool fp16 = std::is_same_v<scalar_t, c10::Half>;
  at::Tensor dW_acc = grad_W != nullptr && fp16 ? at::empty({P.V, P.d}, P.h.options().dtype(at::kFloat)) : at::Tensor();
  at::Tensor dW_lo = grad_W != nullptr && bf16 ? at::empty({P.V, P.d}, P.h.options().dtype(at::kByte)) : at::Tensor();
  at::Tensor dh_parts = grad_h != nullptr && widened
                            ? at::empty({std::min(kGradHGroups, blocks), R, P.d}, L.options())
                            : at::Tensor();
  std::vector<acc_t> g(R);
  for (int64_t r0 = 0; r0 < P.n; r0 += R) {
    const int64_t rows = std::min(R, P.n - r0);
    // The chunk's rows of h as the GEMMs' operand: a view, or float32 on the widened path.
    at::Tensor hc = P.h.narrow(0, r0, rows);
    if constexpr (!std::is_same_v<scalar_t, logit_t>) hc = hc.to(at::kFloat);
    if (lse_in == nullptr) {
      Stats<acc_t> stats(rows, blocks);
      logits_and_stats<scalar_t, logit_t>(P, hc, L, rows, cols, r0, &stats);
      row_losses(stats, P.y + r0, rows, P.V, P.o, lse + r0, loss + r0);
    } else {
      logits_and_stats<scalar_t, logit_t>(P, hc, L, rows, cols, r0, nullptr);
    }
    if (!grads) continue;
    const acc_t* l = lse_in != nullptr ? lse_in + r0 : lse + r0;
    for (int64_t r = 0; r < rows; ++r) g[r] = P.y[r0 + r] == P.o.ignore_index ? acc_t(0) : weight(r0 + r);
    const Grads G{grad_h, grad_W, dW_acc.defined() ? &dW_acc : nullptr, dW_lo.defined() ? &dW_lo : nullptr,
                  dh_parts.defined() ? &dh_parts : nullptr, r0 == 0, r0 + rows >= P.n};
    if constexpr (widened) chunk_gradients_widened<scalar_t, logit_t>(P, hc, L, r0, rows, cols, l, g.data(), G);
    else chunk_gradients<scalar_t>(P, hc, L, r0, rows, cols, l, g.data(), G);
  }
  if (grad_W != nullptr) {
    if (P.n == 0) grad_W->zero_();
    else if (dW_acc.defined()) grad_W->copy_(dW_acc);
  }
}

template <typename scalar_t, typename RowWeight>
void run_chunks(const Problem<scalar_t>& P, acc_type<scalar_t>* lse, acc_type<scalar_t>* loss,
                const acc_type<scalar_t>* lse_in, at::Tensor* grad_h, at::Tensor* grad_W, RowWeight weight) {
  if constexpr (std::is_same_v<scalar_t, acc_type<scalar_t>>) {
    run_chunks_as<scalar_t, scalar_t>(P, lse, loss, lse_in, grad_h, grad_W, weight);
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    run_chunks_as<scalar_t, float>(P, lse, loss, lse_in, grad_h, grad_W, weight);
  } else if (widened_bf16_gemms()) {
    run_chunks_as<scalar_t, float>(P, lse, loss, lse_in, grad_h, grad_W, weight);
  } else {
    run_chunks_as<scalar_t, scalar_t>(P, lse, loss, lse_in, grad_h, grad_W, weight);
  }
}

// A 2-D GEMM operand as BLAS reads it, one dimension of stride 1 (a transposed view, a
// slice of an embedding: no copy); anything else is copied once here rather than by every
// GEMM of every chunk.
at::Tensor gemm_operand(const at::Tensor& t) {
  if (t.numel() == 0 || t.stride(1) == 1 || t.stride(0) == 1) return t;
  return t.contiguous();
}

Options options(int64_t ignore_index, double eps, std::optional<double> softcap, double z_loss) {
  return {ignore_index, eps, z_loss, softcap.has_value(), softcap.value_or(1.0)};
}

// n of a mean: num_items, else the counted rows (at least 1).
double denominator(const checks::LinearCrossEntropyArgs& a, int64_t ignore_index) {
  if (a.num_items.has_value()) return *a.num_items;
  const int64_t* y = a.labels.const_data_ptr<int64_t>();
  int64_t count = 0;
  for (int64_t i = 0; i < a.n; ++i) count += y[i] != ignore_index;
  return double(std::max<int64_t>(count, 1));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lce_fwd(
    const at::Tensor& h, const at::Tensor& W, const at::Tensor& labels, int64_t ignore_index,
    c10::string_view reduction, double label_smoothing, std::optional<double> softcap, double z_loss,
    const std::optional<at::Tensor>& num_items, std::array<bool, 2> grad_mask) {
  const checks::LinearCrossEntropyArgs a =
      checks::linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss, num_items);
  TORCH_CHECK_VALUE(!(grad_mask[0] || grad_mask[1]) || reduction != "none",
                    "grad_mask: the forward computes gradients for reduction 'mean' or 'sum' only, got 'none'");
  const int64_t d = h.size(-1), V = W.size(0), n = a.n;
  const auto acc = acc_scalar_type(h);
  const auto opts = h.options();
  at::Tensor lse = empty_output({n}, opts.dtype(acc));
  at::Tensor rows_loss = reduction == "none" ? empty_output({n}, opts.dtype(acc)) : at::empty({n}, opts.dtype(acc));
  at::Tensor grad_h = grad_mask[0] ? empty_output({n, d}, opts) : at::empty({0}, opts);
  at::Tensor grad_W = grad_mask[1] ? empty_output({V, d}, W.options()) : at::empty({0}, W.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "wiola_linear_cross_entropy_fwd", [&] {
    using acc_t = acc_type<scalar_t>;
    Problem<scalar_t> P{gemm_operand(h.reshape({n, d})).detach(), gemm_operand(W).detach(), a.labels.const_data_ptr<int64_t>(), n, V, d,
                        options(ignore_index, label_smoothing, softcap, z_loss)};
    run_chunks<scalar_t>(P, lse.mutable_data_ptr<acc_t>(), rows_loss.mutable_data_ptr<acc_t>(), nullptr,
                         grad_mask[0] ? &grad_h : nullptr, grad_mask[1] ? &grad_W : nullptr,
                         [](int64_t) { return acc_t(1); });
  });
  if (reduction == "none") return {rows_loss, lse, grad_h, grad_W};
  // The sum in double, in row order: the same bits for any thread count.
  double total = 0;
  AT_DISPATCH_FLOATING_TYPES(acc, "wiola_linear_cross_entropy_sum", [&] {
    const scalar_t* p = rows_loss.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) total += double(p[i]);
  });
  if (reduction == "mean") total /= denominator(a, ignore_index);
  at::Tensor loss = empty_output({}, opts.dtype(acc));
  loss.fill_(total);
  return {loss, lse, grad_h, grad_W};
}

void lce_bwd(const at::Tensor& grad_loss, const at::Tensor& h, const at::Tensor& W, const at::Tensor& labels,
             const at::Tensor& lse_in, const std::optional<at::Tensor>& num_items,
             const std::optional<at::Tensor>& grad_h_opt, const std::optional<at::Tensor>& grad_W_opt,
             int64_t ignore_index, c10::string_view reduction, double label_smoothing, std::optional<double> softcap,
             double z_loss, bool precomputed) {
  const checks::LinearCrossEntropyArgs a = checks::linear_cross_entropy_backward(
      grad_loss, h, W, labels, lse_in, num_items, grad_h_opt, grad_W_opt, ignore_index, reduction, label_smoothing,
      softcap, z_loss, precomputed);
  const int64_t d = h.size(-1), V = W.size(0), n = a.n;
  const auto acc = acc_scalar_type(h);
  const bool none = reduction == "none";
  const bool want_h = grad_h_opt.has_value() && grad_h_opt->defined();
  const bool want_W = grad_W_opt.has_value() && grad_W_opt->defined();
  // The scale of the whole loss ("mean" / "sum"): grad_loss, ÷ n for a mean.
  const double scale = none ? 1.0 : grad_loss.item<double>() / (reduction == "mean" ? denominator(a, ignore_index) : 1.0);
  at::Tensor grad_h = want_h ? *grad_h_opt : at::Tensor();
  at::Tensor grad_W = want_W ? *grad_W_opt : at::Tensor();
  if (!precomputed && (want_h || want_W)) {
    TORCH_CHECK_VALUE(!want_h || grad_h.is_contiguous(), "grad_h must be contiguous");
    TORCH_CHECK_VALUE(!want_W || grad_W.is_contiguous(), "grad_W must be contiguous");
    const at::Tensor g = none ? grad_loss.reshape({n}).to(acc).contiguous() : at::Tensor();
    const at::Tensor lse = lse_in.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "wiola_linear_cross_entropy_bwd", [&] {
      using acc_t = acc_type<scalar_t>;
      Problem<scalar_t> P{gemm_operand(h.reshape({n, d})).detach(), gemm_operand(W).detach(), a.labels.const_data_ptr<int64_t>(), n, V, d,
                          options(ignore_index, label_smoothing, softcap, z_loss)};
      const acc_t* gp = none ? g.const_data_ptr<acc_t>() : nullptr;
      run_chunks<scalar_t>(P, nullptr, nullptr, lse.const_data_ptr<acc_t>(), want_h ? &grad_h : nullptr,
                           want_W ? &grad_W : nullptr, [gp](int64_t i) { return gp != nullptr ? gp[i] : acc_t(1); });
    });
  }
  // "mean"/"sum": the unscaled gradients (computed now or by the forward) times the scale.
  if (!none) {
    if (want_h) grad_h.mul_(scale);
    if (want_W) grad_W.mul_(scale);
  }
}

}  // namespace

// The op's schemas, declared once, here beside its CPU kernels: every build of the op compiles this file.
// set_python_module names the module that registers the op's fakes and Python kernels.
TORCH_LIBRARY_FRAGMENT(wiola, m) {
  m.set_python_module("wiola_kernels.ops.linear_cross_entropy");
  // h (..., d), W (V, d) any strides, labels h.shape[:-1] or (N,) of an index dtype; num_items
  // None or a one-element tensor. loss: (N,) ("none") or () in float32 (float64 for double
  // inputs); lse (N,), same dtype. grad_mask = (∂h, ∂W) wanted, only with "mean"/"sum": the
  // gradients of the row sum Σ ℓ_i (not yet scaled by grad_loss or 1/n) come back in h's
  // layout (N, d) / (V, d) in the dtypes of h / W, else (0,) tensors. No (N, V) tensor is
  // ever held: rows are processed in chunks.
  m.def("linear_cross_entropy(Tensor h, Tensor W, Tensor labels, int ignore_index=-100, str reduction=\"mean\","
        " float label_smoothing=0.0, float? softcap=None, float z_loss=0.0, Tensor? num_items=None,"
        " bool[2] grad_mask=[False, False]) -> (Tensor loss, Tensor lse, Tensor grad_h, Tensor grad_W)");
  // Writes ∂L/∂h into grad_h (N, d) and ∂L/∂W into grad_W (V, d) (either may be None: not
  // wanted). precomputed: they hold the forward's unscaled gradients ("mean"/"sum"), scaled
  // here in place by grad_loss (÷ n for "mean"); else they are overwritten with the gradients
  // recomputed from h, W and lse (every reduction).
  m.def("linear_cross_entropy_backward(Tensor grad_loss, Tensor h, Tensor W, Tensor labels, Tensor lse,"
        " Tensor? num_items, Tensor(a!)? grad_h, Tensor(b!)? grad_W, int ignore_index, str reduction,"
        " float label_smoothing, float? softcap, float z_loss, bool precomputed) -> ()");
  // The Python Triton launchers of the op (CUDA only, registered from Python): where the cubin
  // tables have no variant for a call, the C++ CUDA kernel
  // (csrc/cuda/triton_linear_cross_entropy_binding.cpp) runs these.
  m.def("_triton_linear_cross_entropy(Tensor h, Tensor W, Tensor labels, int ignore_index=-100,"
        " str reduction=\"mean\", float label_smoothing=0.0, float? softcap=None, float z_loss=0.0,"
        " Tensor? num_items=None, bool[2] grad_mask=[False, False])"
        " -> (Tensor loss, Tensor lse, Tensor grad_h, Tensor grad_W)");
  m.def("_triton_linear_cross_entropy_backward(Tensor grad_loss, Tensor h, Tensor W, Tensor labels, Tensor lse,"
        " Tensor? num_items, Tensor(a!)? grad_h, Tensor(b!)? grad_W, int ignore_index, str reduction,"
        " float label_smoothing, float? softcap, float z_loss, bool precomputed) -> ()");
}

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("linear_cross_entropy", &lce_fwd);
  m.impl("linear_cross_entropy_backward", &lce_bwd);
}

}  // namespace wiola::cpu
