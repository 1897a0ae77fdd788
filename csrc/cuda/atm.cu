// ATM greedy adjacent merge / unmerge on CUDA (SPEC §6; formulas in
// wiola_kernels/reference/atm.py). No torch headers: parameters come from
// csrc/include/wiola/atm.h, filled by csrc/cuda/atm_binding.cpp.
//
// Merge = three launches, each over all B rows:
//   1. norms_and_dots: a block owns kSimTokens consecutive tokens of one row and reads
//      each of their elements once (plus one look-ahead row), kSimBatch columns of all
//      of them loaded before any is summed: ‖x_t‖² and ⟨x_t, x_{t+1}⟩, reduced in a fixed order,
//      and max|x_t|. A block with a token whose max lies outside [2^-30, 2^40) (sums
//      could over/underflow or lose precision) recomputes its sums in double with each
//      such token scaled by 2^-e (max lands in [0.5, 1)): the test is homogeneous in each
//      token, so this changes only the range (SPEC §6; wiola_kernels/reference/atm.py).
//   2. select (one block per row): candidate when s_t > τ and t + 1 < L, decided in
//      double from the sums without a square root, with IEEE-rounded products (so
//      --use_fast_math cannot change a decision) and D, τ scaled together by a power of
//      two (no under/overflow of D², τ²N), as the reference does. The greedy
//      rule in parallel form is a segmented scan: an inclusive max-scan of
//      (candidate ? −1 : t) gives, for every candidate edge, the last non-candidate edge
//      before it, hence the start a of its run, and the edge is taken when t − a is even.
//      An exclusive sum-scan of the taken edges gives slot(t) = t − #taken before t.
//      One block per row walks the row's tiles in order, carrying (last break, taken
//      count, last edge taken) from tile to tile. At the bench shape (B = 8, T = 2048)
//      that is 8 blocks of two tiles each, moving ≈ 80 KB per row (0.1% of the merge's
//      bytes): latency-bound, two tile latencies in series. Splitting a row over blocks
//      needs the carry across blocks: a second launch (per-tile aggregates, then the
//      tiles: the same two latencies in series at T = 2048, plus a launch) or a
//      single-pass look-back (saves about one tile latency there, but blocks spin on
//      their predecessors' flags, which the SIMT emulator cannot run: its blocks run to
//      completion in turn). Long rows (T ≥ 8192: ≥ 8 tiles in series) would gain from the
//      two-launch form; not done (no GPU measurement yet to weigh it).
//   3. gather_average: one block per merged slot copies x_t or writes the pair mean
//      (x_t + x_{t+1})·½, or x_t·½ + x_{t+1}·½ where the sum overflows; zeros after T'_b.
//      (--use_fast_math flushes float32 subnormals here: a merged pair of subnormal
//      float32 tokens comes out as 0; decisions are unaffected, see exact_double.)
// Unmerge is a gather. Backwards: merge is a gather scaled by ½ / 1 / 0; unmerge is a
// segment sum in token order, in parallel over segments of T for the sorted maps merge
// produces, one sequential walk per column otherwise (no atomics: deterministic for any
// index map; see unmerge_backward_kernel).
#ifdef WIOLA_CUDA_EMU
#include "emu/cuda_emu.h"  // host C++ build for the SIMT emulator (backend cuda_emu)
#else
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <cstdint>
#include <cstring>

#include "wiola/atm.h"
#include "wiola/atm_launch.h"
#include "wiola/cuda_convert.cuh"
#include "wiola/cuda_launch.cuh"
#include "wiola/cuda_vector.cuh"
#include "wiola/warp_reduce.cuh"

namespace wiola::atm {
namespace {

// Launch geometry (threads per block, grids): wiola/atm_launch.h. Per-thread work:
constexpr int kSimBlocks = 4;        // resident blocks per SM the register budget is sized for
constexpr int kSimScalarBatch = 2;   // element-wise path (d or x not 16-byte aligned): columns per step
constexpr int kScanItems = 4;        // select: tiles of kScanThreads·kScanItems tokens
constexpr int kTile = kScanThreads * kScanItems;
// Row kernels: each thread loads kRowChunks 16-byte chunks before storing any: a bf16 row of
// d = 1024 is one block's 64 × 2 chunks, and with 32 such blocks resident an SM has ≈ 64 KB
// of loads in flight (≥ 32 KB for HBM bandwidth; one 2-byte load per thread had 4 KB).
constexpr int kRowChunks = 2;
constexpr int kUnmergeBatch = 4;     // unmerge backward: tokens whose chunks are loaded before any is summed
constexpr int kCheckItems = 4;       // consecutive entries per thread

using wiola::cuda::dispatch_dtype;
using wiola::cuda::from_float;
using wiola::cuda::launch_kernel;
using wiola::cuda::to_float;
using wiola::cuda::vector_cast;
using wiola::cuda::warp_max;
using wiola::cuda::warp_sum;

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// Sum over the block in a fixed order, returned to every thread; `scratch` has one slot per warp.
__device__ __forceinline__ double block_sum(double v, double* scratch) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += scratch[w];
  __syncthreads();  // scratch is reused by the next call
  return total;
}

// Tokens are classed by the bits of max|x_t|: integer compares, exact under -ftz and
// independent of summation order, so a token read as look-ahead is classed as by its owner.
constexpr unsigned kFastLo = (127u - 30u) << 23;  // 2^-30: ‖x‖² ≥ 2^-60
constexpr unsigned kFastHi = (127u + 40u) << 23;  // 2^40: ‖x‖² < d·2^80, far from FLT_MAX
constexpr unsigned kInfBits = 0x7f800000u;

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// Finite, nonzero and outside the fast range (zero and NaN/Inf tokens stay as they are).
__device__ __forceinline__ bool needs_rescale(unsigned max_bits) {
  return max_bits != 0u && max_bits < kInfBits && (max_bits < kFastLo || max_bits >= kFastHi);
}

// 2^-e with max·2^-e ∈ [0.5, 1) for a token that needs rescaling, else 1.
__device__ __forceinline__ double rescale_factor(unsigned max_bits) {
  if (!needs_rescale(max_bits)) return 1.0;
  const int biased = static_cast<int>(max_bits >> 23);
  const int e = biased != 0 ? biased - 126 : (31 - __clz(static_cast<int>(max_bits))) - 148;  // subnormal max
  return __longlong_as_double(static_cast<long long>(1023 - e) << 52);
}

// v as a double, exactly also for a subnormal v (a float conversion under -ftz flushes it).
__device__ __forceinline__ double exact_double(float v) {
  const unsigned u = __float_as_uint(v);
  if ((u & kInfBits) != 0u) return static_cast<double>(v);
  const double m = static_cast<double>(u & 0x7fffffu) * 0x1p-149;
  return (u >> 31) ? -m : m;
}

// A 16-byte global access (ld/st.global.v4.u32; uint4 without the CUDA vector types, so
// the same body runs in the emulator). Pointers become Chunk pointers by vector_cast
// (wiola/cuda_vector.cuh), which the emulator checks for alignment.
struct alignas(16) Chunk {
  unsigned w[4];
};

template <typename scalar_t>
constexpr int64_t kPerChunk = static_cast<int64_t>(sizeof(Chunk) / sizeof(scalar_t));

template <typename scalar_t>
struct Elems {
  scalar_t v[sizeof(Chunk) / sizeof(scalar_t)];
};

template <typename scalar_t>
__device__ __forceinline__ Elems<scalar_t> unpack(const Chunk& c) {
  Elems<scalar_t> e;
  memcpy(&e, &c, sizeof(Chunk));
  return e;
}

template <typename scalar_t>
__device__ __forceinline__ Chunk pack(const Elems<scalar_t>& e) {
  Chunk c;
  memcpy(&c, &e, sizeof(Chunk));
  return c;
}

// Host: whether a row kernel may use 16-byte chunks (every row starts 16-byte aligned).
template <typename scalar_t>
bool rows_vectorizable(int64_t d, const void* a, const void* b) {
  return d % kPerChunk<scalar_t> == 0 && reinterpret_cast<uintptr_t>(a) % sizeof(Chunk) == 0 &&
         reinterpret_cast<uintptr_t>(b) % sizeof(Chunk) == 0;
}

// out[j] = src[j] over one row (bit copy).
template <typename scalar_t>
__device__ __forceinline__ void copy_row(const scalar_t* __restrict__ src, scalar_t* __restrict__ out, int64_t d,
                                         bool vec) {
  if (vec) {
    const Chunk* s = vector_cast<const Chunk>(src);
    Chunk* o = vector_cast<Chunk>(out);
    const int64_t n = d / kPerChunk<scalar_t>;
#pragma unroll 1  // kRowChunks chunks in flight per step is the design (gpu-report counts the body)
    for (int64_t c = threadIdx.x; c < n; c += kRowThreads * kRowChunks) {
      Chunk v[kRowChunks];
#pragma unroll
      for (int k = 0; k < kRowChunks; ++k)
        if (c + k * kRowThreads < n) v[k] = s[c + k * kRowThreads];
#pragma unroll
      for (int k = 0; k < kRowChunks; ++k)
        if (c + k * kRowThreads < n) o[c + k * kRowThreads] = v[k];
    }
    return;
  }
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[j] = src[j];
}

// out[j] = value over one row.
template <typename scalar_t>
__device__ __forceinline__ void fill_row(scalar_t* __restrict__ out, float value, int64_t d, bool vec) {
  const scalar_t v = from_float<scalar_t>(value);
  if (vec) {
    Elems<scalar_t> e;
#pragma unroll
    for (int k = 0; k < kPerChunk<scalar_t>; ++k) e.v[k] = v;
    const Chunk c = pack(e);
    Chunk* o = vector_cast<Chunk>(out);
    const int64_t n = d / kPerChunk<scalar_t>;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = c;
    return;
  }
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[j] = v;
}

// out[j] = f(a[j], b[j]) over one row, computed in float (b is read only when kInputs == 2).
template <int kInputs, typename scalar_t, typename Fn>
__device__ __forceinline__ void map_row(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                        scalar_t* __restrict__ out, int64_t d, bool vec, Fn f) {
  if (vec) {
    const Chunk* sa = vector_cast<const Chunk>(a);
    const Chunk* sb = vector_cast<const Chunk>(b);
    Chunk* o = vector_cast<Chunk>(out);
    const int64_t n = d / kPerChunk<scalar_t>;
#pragma unroll 1  // kRowChunks chunks in flight per step is the design (gpu-report counts the body)
    for (int64_t c = threadIdx.x; c < n; c += kRowThreads * kRowChunks) {
      Chunk va[kRowChunks], vb[kRowChunks];
#pragma unroll
      for (int k = 0; k < kRowChunks; ++k) {
        if (c + k * kRowThreads < n) {
          va[k] = sa[c + k * kRowThreads];
          if (kInputs == 2) vb[k] = sb[c + k * kRowThreads];
        }
      }
#pragma unroll
      for (int k = 0; k < kRowChunks; ++k) {
        if (c + k * kRowThreads < n) {
          const Elems<scalar_t> ea = unpack<scalar_t>(va[k]);
          Elems<scalar_t> eb;
          if (kInputs == 2) eb = unpack<scalar_t>(vb[k]);
          Elems<scalar_t> r;
#pragma unroll
          for (int e = 0; e < kPerChunk<scalar_t>; ++e)
            r.v[e] = from_float<scalar_t>(f(to_float(ea.v[e]), kInputs == 2 ? to_float(eb.v[e]) : 0.f));
          o[c + k * kRowThreads] = pack(r);
        }
      }
    }
    return;
  }
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    out[j] = from_float<scalar_t>(f(to_float(a[j]), kInputs == 2 ? to_float(b[j]) : 0.f));
}

struct MaxOp {
  __device__ __forceinline__ int operator()(int a, int b) const { return a > b ? a : b; }
};

// Adds kCols columns of a step to one thread's sums, columns in ascending order:
// elem(k, c) is column c of token k (0 for a column past d or a token not read, which
// leaves ‖·‖² and max|·| unchanged).
template <int kCols, typename Elem>
__device__ __forceinline__ void accumulate_step(Elem elem, int n, float (&ns)[kSimTokens], float (&dt)[kSimTokens],
                                                unsigned (&mx)[kSimTokens + 1]) {
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    float prev = elem(0, c);
    mx[0] = max(mx[0], abs_bits(prev));
#pragma unroll
    for (int k = 0; k < kSimTokens; ++k) {
      if (k < n) {
        const float next = elem(k + 1, c);
        mx[k + 1] = max(mx[k + 1], abs_bits(next));
        ns[k] = fmaf(prev, prev, ns[k]);
        dt[k] = fmaf(prev, next, dt[k]);
        prev = next;
      }
    }
  }
}

// ‖x_t‖² and ⟨x_t, x_{t+1}⟩ for kSimTokens tokens of one row per block.
template <typename scalar_t>
// kSimBlocks blocks per SM: room for the kSimTokens + 1 chunks loaded per step.
__global__ void __launch_bounds__(kSimThreads, kSimBlocks)
    norms_and_dots_kernel(const scalar_t* __restrict__ x, float* __restrict__ norm_sq, float* __restrict__ dot,
                          int64_t T, int64_t d, int64_t chunks_per_row, bool vec) {
  const int64_t b = blockIdx.x / chunks_per_row;
  const int64_t t0 = (blockIdx.x % chunks_per_row) * kSimTokens;
  const int n = static_cast<int>(T - t0 < kSimTokens ? T - t0 : kSimTokens);  // tokens owned
  const bool look_ahead = t0 + n < T;
  const int reads = n + (look_ahead ? 1 : 0);  // tokens read: owned + look-ahead
  const scalar_t* row = x + (b * T + t0) * d;
  float ns[kSimTokens], dt[kSimTokens];
  unsigned mx[kSimTokens + 1];  // bits of max|x| of each token and of the look-ahead
#pragma unroll
  for (int k = 0; k < kSimTokens; ++k) ns[k] = dt[k] = 0.f;
#pragma unroll
  for (int k = 0; k <= kSimTokens; ++k) mx[k] = 0u;
  // A step loads its columns of all tokens before any is summed (memory-level
  // parallelism); each thread sums its columns in ascending order, the
  // block its threads in a fixed order below: deterministic.
  if (vec) {  // one 16-byte chunk per token: columns [c·E, c·E + E) of chunk c
    constexpr int E = static_cast<int>(kPerChunk<scalar_t>);
    const int64_t chunks = d / E;
#pragma unroll 1
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      Chunk v[kSimTokens + 1];
#pragma unroll
      for (int k = 0; k <= kSimTokens; ++k) {
        if (k < reads) {
          v[k] = vector_cast<const Chunk>(row + k * d)[c];
        } else {
          v[k] = Chunk{};
        }
      }
      accumulate_step<E>([&](int k, int e) { return to_float(unpack<scalar_t>(v[k]).v[e]); }, n, ns, dt, mx);
    }
  } else {  // element-wise: kSimScalarBatch columns blockDim apart
#pragma unroll 1
    for (int64_t j0 = threadIdx.x; j0 < d; j0 += static_cast<int64_t>(blockDim.x) * kSimScalarBatch) {
      float v[kSimTokens + 1][kSimScalarBatch];
#pragma unroll
      for (int u = 0; u < kSimScalarBatch; ++u) {
        const int64_t j = j0 + static_cast<int64_t>(u) * blockDim.x;
#pragma unroll
        for (int k = 0; k <= kSimTokens; ++k) v[k][u] = j < d && k < reads ? to_float(row[k * d + j]) : 0.f;
      }
      accumulate_step<kSimScalarBatch>([&](int k, int u) { return v[k][u]; }, n, ns, dt, mx);
    }
  }
  __shared__ float partial[kSimThreads / 32][2 * kSimTokens];
  __shared__ unsigned partial_max[kSimThreads / 32][kSimTokens + 1];
  __shared__ double scratch[kSimThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = static_cast<int>(blockDim.x / 32);
#pragma unroll
  for (int k = 0; k < kSimTokens; ++k) {
    const float a = warp_sum(ns[k]), c = warp_sum(dt[k]);
    if (lane == 0) {
      partial[warp][k] = a;
      partial[warp][kSimTokens + k] = c;
    }
  }
#pragma unroll
  for (int k = 0; k <= kSimTokens; ++k) {
    const unsigned m = warp_max(mx[k]);
    if (lane == 0) partial_max[warp][k] = m;
  }
  __syncthreads();
  const auto token_max = [&](int k) {
    unsigned m = 0u;
    for (int w = 0; w < warps; ++w) m = max(m, partial_max[w][k]);
    return m;
  };
  bool rescale = false;  // block-uniform
  for (int k = 0; k <= n; ++k) rescale = rescale || needs_rescale(token_max(k));
  if (!rescale) {
    if (threadIdx.x < 2 * kSimTokens) {
      const int k = threadIdx.x % kSimTokens;
      float total = 0.f;
      for (int w = 0; w < warps; ++w) total += partial[w][threadIdx.x];  // fixed order
      if (k < n) (threadIdx.x < kSimTokens ? norm_sq : dot)[b * T + t0 + k] = total;
    }
    return;
  }
  // Rare: recompute in double, one token at a time, with the out-of-range tokens rescaled.
  for (int k = 0; k < n; ++k) {
    const double s0 = rescale_factor(token_max(k)), s1 = rescale_factor(token_max(k + 1));
    const bool has_next = k + 1 < n || look_ahead;
    double a = 0.0, c = 0.0;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      const double u = exact_double(to_float(row[k * d + j])) * s0;
      a = fma(u, u, a);
      if (has_next) c = fma(u, exact_double(to_float(row[(k + 1) * d + j])) * s1, c);
    }
    a = block_sum(a, scratch);
    c = block_sum(c, scratch);
    if (threadIdx.x == 0) {
      norm_sq[b * T + t0 + k] = static_cast<float>(a);
      dot[b * T + t0 + k] = static_cast<float>(c);
    }
  }
}

// Candidate test s_t > τ of SPEC §6.1, decided in double without a square root exactly as
// the reference does (wiola_kernels/reference/atm.py): D and τ scaled together by a power
// of two so that D² and τ²N neither underflow nor overflow; NaN/Inf tokens never merge.
__device__ __forceinline__ bool is_candidate(float nsq0, float nsq1, float dot, double tau) {
  if (!(tau < 1.0)) return false;
  const double n = __dmul_rn(static_cast<double>(nsq0), static_cast<double>(nsq1));
  const double D = static_cast<double>(dot);
  if (!isfinite(n) || !isfinite(D)) return false;
  if (n == 0.0) return tau < 0.0;
  if (D > 0.0 && tau < 0.0) return true;
  if (!(D > 0.0) && !(tau < 0.0)) return false;
  int e = 0;
  frexp(fmax(fabs(D), fabs(tau)), &e);  // > 0 here
  const double ds = ldexp(D, -e), ts = ldexp(tau, -e);
  const double d2 = __dmul_rn(ds, ds), t2n = __dmul_rn(__dmul_rn(ts, ts), n);
  return D > 0.0 ? d2 > t2n : d2 < t2n;
}

// One block per row: decisions, index map, merged positions / lengths, slot sources.
__global__ void __launch_bounds__(kScanThreads)
    select_kernel(const float* __restrict__ norm_sq, const float* __restrict__ dot,
                  const int64_t* __restrict__ positions, const int64_t* __restrict__ lengths, double tau, int64_t T,
                  int64_t* __restrict__ index_map, int64_t* __restrict__ merged_positions,
                  int64_t* __restrict__ merged_lengths, int64_t* __restrict__ slot_source) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ unsigned char taken_shared[kTile + 1];  // [0]: last edge of the previous tile
  const int64_t b = blockIdx.x;
  int64_t len = lengths[b];
  len = len < 0 ? 0 : (len > T ? T : len);
  const float* ns = norm_sq + b * T;
  const float* dt = dot + b * T;
  int last_break = -1;      // last non-candidate edge before this tile
  int taken_before = 0;     // taken edges before this tile
  unsigned char last_taken = 0;
  for (int64_t base = 0; base < T; base += kTile) {
    int key[kScanItems], taken[kScanItems], before[kScanItems];
    bool cand[kScanItems];
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      const int t = static_cast<int>(base) + threadIdx.x * kScanItems + i;
      cand[i] = t + 1 < len && is_candidate(ns[t], ns[t + 1], dt[t], tau);
      key[i] = cand[i] ? -1 : t;
    }
    int tile_break;
    Scan(scan_storage).InclusiveScan(key, key, MaxOp(), tile_break);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      const int t = static_cast<int>(base) + threadIdx.x * kScanItems + i;
      const int run_start = (key[i] > last_break ? key[i] : last_break) + 1;
      taken[i] = cand[i] && ((t - run_start) & 1) == 0 ? 1 : 0;
    }
    last_break = tile_break > last_break ? tile_break : last_break;
    int tile_taken;
    Scan(scan_storage).ExclusiveSum(taken, before, tile_taken);
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) taken_shared[1 + threadIdx.x * kScanItems + i] = taken[i];
    if (threadIdx.x == 0) taken_shared[0] = last_taken;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      const int local = threadIdx.x * kScanItems + i;
      const int64_t t = base + local;
      if (t >= T) continue;
      const int64_t slot = t - (taken_before + before[i]);  // padding lands at T' + (t − len)
      index_map[b * T + t] = slot;
      if (t < len && !taken_shared[local]) {  // first member or singleton
        merged_positions[b * T + slot] = positions[b * T + t];
        slot_source[b * T + slot] = 2 * t + taken[i];
      }
    }
    taken_before += tile_taken;
    last_taken = taken_shared[kTile];
    __syncthreads();  // taken_shared and scan_storage are reused by the next tile
  }
  const int64_t merged_len = len - taken_before;
  if (threadIdx.x == 0) merged_lengths[b] = merged_len;
  for (int64_t s = merged_len + threadIdx.x; s < T; s += blockDim.x) {
    merged_positions[b * T + s] = 0;
    slot_source[b * T + s] = -1;
  }
}

// One block per merged slot (flattened b·T + s).
template <typename scalar_t>
__global__ void __launch_bounds__(kRowThreads)
    gather_average_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ slot_source,
                          scalar_t* __restrict__ merged, int64_t T, int64_t d, bool vec) {
  const int64_t slot = blockIdx.x;
  const int64_t code = slot_source[slot];
  scalar_t* out = merged + slot * d;
  if (code < 0) {
    fill_row(out, 0.f, d, vec);
    return;
  }
  const scalar_t* x0 = x + ((slot / T) * T + (code >> 1)) * d;
  if (code & 1) {  // as csrc/cpu/atm.cpp write_slot
    map_row<2>(x0, x0 + d, out, d, vec, [](float a, float c) {
      const float m = __fmul_rn(0.5f, __fadd_rn(a, c));
      return isinf(m) ? __fadd_rn(__fmul_rn(0.5f, a), __fmul_rn(0.5f, c)) : m;
    });
  } else {
    copy_row(x0, out, d, vec);
  }
}

// One block per token: grad_x_t = w_t · g_{slot(t)}.
template <typename scalar_t>
__global__ void __launch_bounds__(kRowThreads)
    merge_backward_kernel(const scalar_t* __restrict__ grad, const int64_t* __restrict__ index_map,
                          const int64_t* __restrict__ merged_lengths, scalar_t* __restrict__ grad_x, int64_t T,
                          int64_t d, bool vec) {
  const int64_t i = blockIdx.x;
  const int64_t b = i / T, t = i % T, slot = index_map[i];
  scalar_t* out = grad_x + i * d;
  float w;
  if (slot < 0 || slot >= T) {
    w = quiet_nan();  // invalid map: visible, never silent
  } else if (slot >= merged_lengths[b]) {
    w = 0.f;  // padding
  } else {
    const bool paired = (t > 0 && index_map[i - 1] == slot) || (t + 1 < T && index_map[i + 1] == slot);
    w = paired ? 0.5f : 1.f;
  }
  if (!(w == w) || w == 0.f) {
    fill_row(out, w, d, vec);
    return;
  }
  const scalar_t* g = grad + (b * T + slot) * d;
  map_row<1>(g, g, out, d, vec, [w](float a, float) { return w * a; });
}

// One block per token: restored_t = y_{slot(t)} (NaN for an out-of-range slot).
template <typename scalar_t>
__global__ void __launch_bounds__(kRowThreads)
    unmerge_kernel(const scalar_t* __restrict__ y, const int64_t* __restrict__ index_map, scalar_t* __restrict__ out,
                   int64_t T, int64_t d, bool vec) {
  const int64_t i = blockIdx.x;
  const int64_t slot = index_map[i];
  scalar_t* o = out + i * d;
  if (slot < 0 || slot >= T) {
    fill_row(o, quiet_nan(), d, vec);
    return;
  }
  copy_row(y + ((i / T) * T + slot) * d, o, d, vec);
}

// --- Unmerge backward: grad_y[s] = Σ_{t: map(t) = s} grad[t], summed in token order ---
//
// Runs of consecutive tokens with the same slot are summed in float in token order and
// stored once; a slot met again in a later run (not in a map from merge) gets the run
// added to what is there (as csrc/cpu/atm.cpp). Two paths, chosen per row on the device:
//   * sorted rows (every entry in [0, T), never decreasing: all maps merge produces): each
//     slot is one run, so the row splits into segments of kUnmergeSegment tokens that run
//     in parallel. A segment sums the runs that start in it — skipping tokens that continue
//     a run from before it and reading past its end to finish its last run — and zeroes
//     the slots no token maps to (the gap before each run it starts; slots before the
//     first / after the last token's slot that fall in its own range). Every output row
//     has one writer and each sum its token order: deterministic without atomics.
//   * other rows: one sequential walk over T per column (segment 0's blocks).
// A thread owns one 16-byte chunk of the columns (vec) or one element.

// One block per row: row_sorted[b] = 1 when the row's map is sorted (above), else 0. A
// thread checks kCheckItems consecutive entries, loaded together: one or two memory round
// trips at the bench shapes, so the check costs little next to the segment sums.
__global__ void __launch_bounds__(kCheckThreads)
    map_sorted_kernel(const int64_t* __restrict__ index_map, int* __restrict__ row_sorted, int64_t T) {
  const int64_t* map = index_map + static_cast<int64_t>(blockIdx.x) * T;
  bool ok = true;
#pragma unroll 1
  for (int64_t t0 = static_cast<int64_t>(threadIdx.x) * kCheckItems; t0 < T;
       t0 += static_cast<int64_t>(blockDim.x) * kCheckItems) {
    int64_t v[kCheckItems + 1];  // entries t0 − 1 … t0 + kCheckItems − 1
    v[0] = t0 > 0 ? map[t0 - 1] : 0;
#pragma unroll
    for (int i = 0; i < kCheckItems; ++i) v[i + 1] = t0 + i < T ? map[t0 + i] : T - 1;
#pragma unroll
    for (int i = 0; i < kCheckItems; ++i) ok = ok & (v[i + 1] >= 0) & (v[i + 1] < T) & (v[i] <= v[i + 1]);
  }
  __shared__ int warp_ok[kCheckThreads / 32];
  const int all = __all_sync(0xffffffffu, ok);
  if (threadIdx.x % 32 == 0) warp_ok[threadIdx.x / 32] = all;
  __syncthreads();
  if (threadIdx.x == 0) {
    int r = 1;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) r = r & (warp_ok[w] != 0);
    row_sorted[blockIdx.x] = r;
  }
}

// The columns of a row one thread owns: a 16-byte chunk (kVec), or one element (the
// chunk's first; the others are zero). A template parameter, so that each path's loop
// holds only its own loads.
template <typename scalar_t, bool kVec>
struct ColumnLane {
  static constexpr int E = static_cast<int>(kPerChunk<scalar_t>);

  static __device__ __forceinline__ Chunk load(const scalar_t* p) {
    if (kVec) return *vector_cast<const Chunk>(p);
    Chunk c{};
    const scalar_t v = *p;
    memcpy(&c, &v, sizeof(scalar_t));
    return c;
  }
  static __device__ __forceinline__ void store(scalar_t* p, const float (&acc)[E]) {
    if (kVec) {
      Elems<scalar_t> e;
#pragma unroll
      for (int i = 0; i < E; ++i) e.v[i] = from_float<scalar_t>(acc[i]);
      *vector_cast<Chunk>(p) = pack(e);
    } else {
      *p = from_float<scalar_t>(acc[0]);
    }
  }
  static __device__ __forceinline__ void zero(scalar_t* p) {
    float z[E];
#pragma unroll
    for (int i = 0; i < E; ++i) z[i] = 0.f;
    store(p, z);
  }
  static __device__ __forceinline__ void set(float (&acc)[E], const Chunk& c) {
    const Elems<scalar_t> e = unpack<scalar_t>(c);
#pragma unroll
    for (int i = 0; i < E; ++i) acc[i] = to_float(e.v[i]);
  }
  static __device__ __forceinline__ void add(float (&acc)[E], const Chunk& c) {
    const Elems<scalar_t> e = unpack<scalar_t>(c);
#pragma unroll
    for (int i = 0; i < E; ++i) acc[i] += to_float(e.v[i]);
  }
};

// Any map, one thread's columns of one row: zero every slot, then walk the tokens in
// order, adding each run to its slot (invalid entries contribute nothing).
template <typename Lane, typename scalar_t>
__device__ __forceinline__ void unmerge_backward_any_map(const scalar_t* g, const int64_t* map, scalar_t* out,
                                                         int64_t T, int64_t d) {
#pragma unroll 1
  for (int64_t s = 0; s < T; ++s) Lane::zero(out + s * d);
  int64_t cur = -1;
  float acc[Lane::E] = {};
  const auto flush = [&]() {
    float sum[Lane::E];
    Lane::set(sum, Lane::load(out + cur * d));
#pragma unroll
    for (int i = 0; i < Lane::E; ++i) sum[i] += acc[i];
    Lane::store(out + cur * d, sum);
  };
#pragma unroll 1
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = map[t];
    if (slot < 0 || slot >= T) continue;
    const Chunk v = Lane::load(g + t * d);
    if (slot == cur) {
      Lane::add(acc, v);
      continue;
    }
    if (cur >= 0) flush();
    cur = slot;
    Lane::set(acc, v);
  }
  if (cur >= 0) flush();
}

// A sorted row, one thread's columns of tokens [t0, t1): the runs that start there, and
// the zero slots this segment owns. seg_map[0] is the slot of token t0 − 1 (−1 for none),
// seg_map[1 + i] that of token t0 + i.
template <typename Lane, typename scalar_t>
__device__ __forceinline__ void unmerge_backward_segment(const scalar_t* g, const int64_t* map, scalar_t* out,
                                                         const int64_t* seg_map, int64_t T, int64_t d, int64_t t0,
                                                         int64_t t1) {
  // Slots before the first token's / after the last token's slot, in this segment's range.
  const int64_t first = map[0], last = map[T - 1];
#pragma unroll 1
  for (int64_t s = t0; s < t1; ++s)
    if (s < first || s > last) Lane::zero(out + s * d);
  int64_t prev = seg_map[0];  // slot of the previous token
  int64_t cur = -1;           // slot of the run being summed (one this segment started)
  float acc[Lane::E] = {};
  const auto visit = [&](int64_t slot, const Chunk& v) {
    if (slot == prev) {  // the run goes on (one from before the segment when cur < 0: skipped)
      if (cur >= 0) Lane::add(acc, v);
      return;
    }
    if (cur >= 0) Lane::store(out + cur * d, acc);
#pragma unroll 1
    for (int64_t s = prev + 1; prev >= 0 && s < slot; ++s) Lane::zero(out + s * d);  // no token maps there
    cur = prev = slot;
    Lane::set(acc, v);
  };
  // kUnmergeBatch tokens' chunks are loaded before any is summed.
#pragma unroll 1
  for (int64_t t = t0; t < t1; t += kUnmergeBatch) {
    Chunk v[kUnmergeBatch];
#pragma unroll
    for (int k = 0; k < kUnmergeBatch; ++k)
      if (t + k < t1) v[k] = Lane::load(g + (t + k) * d);
#pragma unroll
    for (int k = 0; k < kUnmergeBatch; ++k)
      if (t + k < t1) visit(seg_map[t + k - t0 + 1], v[k]);
  }
  if (cur >= 0) {  // the last run may go on past the segment
#pragma unroll 1
    for (int64_t t = t1; t < T && map[t] == cur; ++t) Lane::add(acc, Lane::load(g + t * d));
    Lane::store(out + cur * d, acc);
  }
}

// grid (segments × column blocks, rows b0 …); row_sorted from map_sorted_kernel.
template <typename scalar_t>
__global__ void __launch_bounds__(kColumnThreads)
    unmerge_backward_kernel(const scalar_t* __restrict__ grad, const int64_t* __restrict__ index_map,
                            const int* __restrict__ row_sorted, scalar_t* __restrict__ grad_y, int64_t b0, int64_t T,
                            int64_t d, int64_t lanes, bool vec) {
  static_assert(kColumnThreads > kUnmergeSegment, "one thread stages each map entry of a segment");
  __shared__ int64_t seg_map[kUnmergeSegment + 1];
  const int64_t column_blocks = (lanes + kColumnThreads - 1) / kColumnThreads;
  const int64_t seg = blockIdx.x / column_blocks;
  const int64_t lane = (blockIdx.x % column_blocks) * kColumnThreads + threadIdx.x;
  const bool active = lane < lanes;
  const int64_t t0 = seg * kUnmergeSegment;
  const int64_t t1 = t0 + kUnmergeSegment < T ? t0 + kUnmergeSegment : T;
  const int64_t b = b0 + blockIdx.y;
  const int64_t* map = index_map + b * T;
  const int64_t col = vec ? lane * kPerChunk<scalar_t> : lane;
  const scalar_t* g = grad + b * T * d + col;
  scalar_t* out = grad_y + b * T * d + col;
  if (!row_sorted[b]) {  // block-uniform
    if (seg == 0 && active) {
      if (vec) {
        unmerge_backward_any_map<ColumnLane<scalar_t, true>>(g, map, out, T, d);
      } else {
        unmerge_backward_any_map<ColumnLane<scalar_t, false>>(g, map, out, T, d);
      }
    }
    return;
  }
  if (threadIdx.x <= t1 - t0)
    seg_map[threadIdx.x] = threadIdx.x > 0 ? map[t0 + threadIdx.x - 1] : (t0 > 0 ? map[t0 - 1] : -1);
  __syncthreads();
  if (!active) return;
  if (vec) {
    unmerge_backward_segment<ColumnLane<scalar_t, true>>(g, map, out, seg_map, T, d, t0, t1);
  } else {
    unmerge_backward_segment<ColumnLane<scalar_t, false>>(g, map, out, seg_map, T, d, t0, t1);
  }
}

template <typename scalar_t>
cudaError_t merge_typed(const MergeParams& p, cudaStream_t stream) {
  const int64_t chunks = (p.T + kSimTokens - 1) / kSimTokens;
  const Geometry sim = norms_and_dots_geometry(p.B, p.T), scan = select_geometry(p.B), row = row_geometry(p.B, p.T);
  launch_kernel(norms_and_dots_kernel<scalar_t>, static_cast<unsigned>(sim.blocks), sim.threads, sim.smem, stream,
      static_cast<const scalar_t*>(p.x), p.norm_sq, p.dot, p.T, p.d, chunks, rows_vectorizable<scalar_t>(p.d, p.x, p.x));
  launch_kernel(select_kernel, static_cast<unsigned>(scan.blocks), scan.threads, scan.smem, stream,
      p.norm_sq, p.dot, p.positions, p.lengths, p.threshold, p.T, p.index_map, p.merged_positions,
      p.merged_lengths, p.slot_source);
  launch_kernel(gather_average_kernel<scalar_t>, static_cast<unsigned>(row.blocks), row.threads, row.smem, stream,
      static_cast<const scalar_t*>(p.x), p.slot_source, static_cast<scalar_t*>(p.merged), p.T, p.d,
      rows_vectorizable<scalar_t>(p.d, p.x, p.merged));
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t merge_backward_typed(const MergeBackwardParams& p, cudaStream_t stream) {
  const Geometry row = row_geometry(p.B, p.T);
  launch_kernel(merge_backward_kernel<scalar_t>, static_cast<unsigned>(row.blocks), row.threads, row.smem, stream,
      static_cast<const scalar_t*>(p.grad_merged), p.index_map, p.merged_lengths, static_cast<scalar_t*>(p.grad_x),
      p.T, p.d, rows_vectorizable<scalar_t>(p.d, p.grad_merged, p.grad_x));
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t unmerge_typed(const UnmergeParams& p, cudaStream_t stream) {
  const Geometry row = row_geometry(p.B, p.T);
  launch_kernel(unmerge_kernel<scalar_t>, static_cast<unsigned>(row.blocks), row.threads, row.smem, stream,
      static_cast<const scalar_t*>(p.in), p.index_map, static_cast<scalar_t*>(p.out), p.T, p.d,
      rows_vectorizable<scalar_t>(p.d, p.in, p.out));
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t unmerge_backward_typed(const UnmergeParams& p, cudaStream_t stream) {
  const bool vec = rows_vectorizable<scalar_t>(p.d, p.in, p.out);
  const int64_t lanes = unmerge_backward_lanes(p.d, kPerChunk<scalar_t>, vec);
  const Geometry check = map_sorted_geometry(p.B), seg = unmerge_backward_geometry(p.T, lanes);
  if (seg.blocks > INT32_MAX || p.B > INT32_MAX) return cudaErrorInvalidValue;
  launch_kernel(map_sorted_kernel, static_cast<unsigned>(check.blocks), check.threads, check.smem, stream,
      p.index_map, p.row_sorted, p.T);
  for (int64_t b0 = 0; b0 < p.B; b0 += kMaxGridY) {  // gridDim.y ≤ 65535
    const unsigned rows = static_cast<unsigned>(p.B - b0 < kMaxGridY ? p.B - b0 : kMaxGridY);
    launch_kernel(unmerge_backward_kernel<scalar_t>, dim3(static_cast<unsigned>(seg.blocks), rows), seg.threads,
        seg.smem, stream, static_cast<const scalar_t*>(p.in), p.index_map, p.row_sorted,
        static_cast<scalar_t*>(p.out), b0, p.T, p.d, lanes, vec);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_merge(const MergeParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.T == 0) return cudaSuccess;
  if (p.d <= 0 || p.T >= (int64_t{1} << 30)) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) { return merge_typed<decltype(tag)>(p, stream); });
}

cudaError_t launch_merge_backward(const MergeBackwardParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.T == 0 || p.d == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto tag) { return merge_backward_typed<decltype(tag)>(p, stream); });
}

cudaError_t launch_unmerge(const UnmergeParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.T == 0 || p.d == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto tag) { return unmerge_typed<decltype(tag)>(p, stream); });
}

cudaError_t launch_unmerge_backward(const UnmergeParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.T == 0 || p.d == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto tag) { return unmerge_backward_typed<decltype(tag)>(p, stream); });
}

}  // namespace wiola::atm
