// GCLA summary kernels on CUDA (SPEC §5.5): everything of GCLA that is not the causal
// self-attention, which PyTorch's fused attention computes (see wiola/gcla_attention.h for
// the head permutation and the layouts). No torch headers.
//
// One warp per query row; lane l owns the dh/32 contiguous columns [l·V, l·V + V) (one
// 4- to 16-byte access per lane and tensor). Both kernels are memory-bound single passes:
//
// Forward (4 rows per block): cross softmax over the Λ' slots with the un-rotated q
// (online, one read of kc and vc), then out = O^self + σ(g_h)·O^cross read from / written
// to the permuted / natural layouts, rows t ≥ len_b zeroed, lse copied to natural order.
//
// Backward (one block per (b, h, 64 rows), 4 warps): per row, with e_λ = dO·vc_λ,
// r = Σ_λ a_λ e_λ = dO·O^cross and dz_λ = σ a_λ (e_λ − r):
//   dq = c Σ_λ dz_λ kc_λ,  dkc_λ = c dz_λ q,  dvc_λ = σ a_λ dO,  dgate_h += σ(1−σ) r
// and the fused attention backward's inputs: dO (zeroed past the length), O^self = O − σ
// O^cross, q_rot and lse, all in the permuted layout. S = T writes dkc/dvc per row; S = 1
// keeps the rows' coefficients c dz_λ, σ a_λ in shared memory and sums them against q and
// dO per block after the row loop (fixed order) into a partial, and a second kernel adds
// the partials in chunk order — deterministic, no atomics. dgate likewise.
#ifdef WIOLA_CUDA_EMU
#include "emu/cuda_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <atomic>
#include <cmath>
#include <type_traits>

#include "wiola/cuda_convert.cuh"
#include "wiola/gcla_attention.h"
#include "wiola/gcla_launch.h"
#include "wiola/cuda_launch.cuh"
#include "wiola/cuda_vector.cuh"
#include "wiola/warp_reduce.cuh"

namespace wiola::gcla {
namespace {

// kWarps, kThreads, the grids and shared memory of the launches: wiola/gcla_launch.h.
static_assert(kChunkRows == kBackwardChunk, "the partials' layout (wiola/gcla_attention.h)");

using wiola::cuda::dispatch_dtype;
using wiola::cuda::from_float;
using wiola::cuda::launch_kernel;
using wiola::cuda::load_elements;
using wiola::cuda::store_elements;
using wiola::cuda::to_float;
using wiola::cuda::warp_sum;

__device__ __forceinline__ int64_t row_length(const int64_t* lengths, int64_t b, int64_t T) {
  if (lengths == nullptr) return T;
  const int64_t len = lengths[b];
  return len < 0 ? 0 : (len > T ? T : len);
}

// Position of natural head h in the fused attention's head order (wiola/gcla_attention.h).
__device__ __forceinline__ int64_t self_head(int64_t h, int64_t H, int64_t perm_kv) {
  return (h % perm_kv) * (H / perm_kv) + h / perm_kv;
}

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + __expf(-g)); }

// N contiguous elements as one 4- to 16-byte access (wiola/cuda_vector.cuh): the callers'
// offsets are multiples of N elements and the binding checks the base addresses.
template <typename T, int N>
__device__ __forceinline__ void load(const T* src, float (&x)[N]) {
  T v[N];
  load_elements(src, v);
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = to_float(v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store(T* dst, const float (&x)[N]) {
  T v[N];
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = from_float<T>(x[i]);
  store_elements(dst, v);
}

template <int N>
__device__ __forceinline__ void fill(float (&x)[N], float v) {
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = v;
}

template <int N>
__device__ __forceinline__ float dot(const float (&a)[N], const float (&b)[N]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) s += a[i] * b[i];
  return warp_sum(s);
}

// ---------------------------------------------------------------------------------
// Forward: one warp per row (b, h, t), rows in natural order, t fastest.
// ---------------------------------------------------------------------------------
template <typename scalar_t, int DH>
__global__ void __launch_bounds__(kThreads) summary_forward_kernel(SummaryForwardParams p) {
  constexpr int V = DH / 32;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= p.B * p.H * p.T) return;  // warp-uniform
  const int64_t t = row % p.T, bh = row / p.T, b = bh / p.H, h = bh % p.H;
  const int64_t col = lane * V;
  scalar_t* out = static_cast<scalar_t*>(p.out) + row * DH + col;
  float o[V];
  if (t >= row_length(p.lengths, b, p.T)) {  // padding: exact zeros, O^self never read
    fill(o, 0.f);
    store<scalar_t, V>(out, o);
    if (lane == 0) p.lse[row] = 0.f;
    return;
  }
  float qv[V], k[V], vv[V], oc[V];
  load<scalar_t, V>(static_cast<const scalar_t*>(p.q) + row * DH + col, qv);
  // Cross part: online softmax over the L slots of this row's summary position.
  const int64_t slot0 = (bh * p.S + (p.S == 1 ? 0 : t)) * p.L;
  const scalar_t* kc = static_cast<const scalar_t*>(p.kc) + slot0 * DH + col;
  const scalar_t* vc = static_cast<const scalar_t*>(p.vc) + slot0 * DH + col;
  float m = -INFINITY, l = 0.f;
  fill(oc, 0.f);
  for (int64_t s = 0; s < p.L; ++s) {
    load<scalar_t, V>(kc + s * DH, k);
    load<scalar_t, V>(vc + s * DH, vv);
    const float z = dot(qv, k) * p.scale;
    const float m_new = fmaxf(m, z);
    // While every score so far is −∞ there is nothing to rescale (and −∞ − −∞ is NaN).
    const float alpha = m == -INFINITY ? 0.f : __expf(m - m_new);
    const float w = m_new == -INFINITY ? 0.f : __expf(z - m_new);
    l = l * alpha + w;
#pragma unroll
    for (int i = 0; i < V; ++i) oc[i] = oc[i] * alpha + w * vv[i];
    m = m_new;
  }
  const float sig_l = p.L > 0 ? sigmoid(p.gate[h]) / l : 0.f;
  const int64_t ps = self_head(h, p.H, p.perm_kv);
  load<scalar_t, V>(static_cast<const scalar_t*>(p.o_self.data) + b * p.o_self.sb + ps * p.o_self.sh +
                        t * p.o_self.st + col,
                    o);
#pragma unroll
  for (int i = 0; i < V; ++i) o[i] += sig_l * oc[i];
  store<scalar_t, V>(out, o);
  if (lane == 0) p.lse[row] = p.lse_self.data[b * p.lse_self.sb + ps * p.lse_self.sh + t];
}

// ---------------------------------------------------------------------------------
// Backward 1: per row, one block per (b, h, kChunkRows rows); warp w takes rows
// t0 + w, t0 + w + 4, ... Dynamic shared memory (floats):
//   [kWarps][2][L]                a_λ and e_λ of the warp's current row
//   S = 1: [kChunkRows][L][2]     c·dz_λ and σ a_λ of each row of the block
//   S = 1: [2][kSlotTile][DH]     the second half's dkc / dvc sums of a slot tile
//   [kWarps]                      each warp's Σ r
// S = 1 sums dkc_λ = Σ_t c dz_tλ q_t and dvc_λ = Σ_t σ a_tλ dO_t over the block's rows after
// the row loop, in registers: warp w takes kc (w even) or vc over half of the rows, the
// halves meet once per kSlotTile slots in shared memory. (Accumulating each row into
// per-warp [L][DH] shared sums instead took 4 KB × Λ' per block, capping the resident
// blocks, and its lane-strided updates were V-way bank conflicts.) That pass reads q and dO
// of the block's rows again, from L2: ⌈Λ'/kSlotTile⌉ more reads of two row tensors.
// ---------------------------------------------------------------------------------
template <typename scalar_t, int DH>
__global__ void __launch_bounds__(kThreads) summary_backward_kernel(SummaryBackwardParams p) {
  constexpr int V = DH / 32;
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t L = p.L, nchunks = backward_chunks(p.T);
  const int64_t bh = int64_t(blockIdx.x) / nchunks, chunk = int64_t(blockIdx.x) % nchunks;
  const int64_t b = bh / p.H, h = bh % p.H, ps = self_head(h, p.H, p.perm_kv);
  const int64_t len = row_length(p.lengths, b, p.T), col = lane * V;
  const bool shared_ctx = p.S == 1;
  float* a_s = smem + warp * 2 * L;  // a_λ
  float* e_s = a_s + L;              // e_λ = dO·vc_λ
  float* coef = smem + kWarps * 2 * L;       // S = 1: [row][λ][c·dz, σ a]
  float* half_sum = coef + kChunkRows * 2 * L;  // S = 1: [kc / vc][slot of the tile][DH]
  const float sig = sigmoid(p.gate[h]);
  float gate_acc = 0.f;  // Σ_t r over the warp's rows (warp-uniform)
  const int64_t t0 = chunk * kChunkRows;
  const int64_t t_end = t0 + kChunkRows < p.T ? t0 + kChunkRows : p.T;
  for (int64_t t = t0 + warp; t < t_end; t += kWarps) {
    const int64_t row = bh * p.T + t;
    const int64_t self_off_do = b * p.do_self.sb + ps * p.do_self.sh + t * p.do_self.st + col;
    const int64_t self_off_o = b * p.o_self.sb + ps * p.o_self.sh + t * p.o_self.st + col;
    float* lse_self = p.lse_self.data + b * p.lse_self.sb + ps * p.lse_self.sh + t;
    float dO[V], qv[V], k[V], vv[V], oc[V], dq[V], tmp[V];
    if (t >= len) {  // padding: zero gradients and zero self tensors, inputs never read
      fill(tmp, 0.f);
      store<scalar_t, V>(static_cast<scalar_t*>(p.do_self.data) + self_off_do, tmp);
      store<scalar_t, V>(static_cast<scalar_t*>(p.o_self.data) + self_off_o, tmp);
      if (p.q_self.data != nullptr) {
        store<scalar_t, V>(static_cast<scalar_t*>(p.q_self.data) + b * p.q_self.sb + ps * p.q_self.sh +
                               t * p.q_self.st + col,
                           tmp);
      }
      store<scalar_t, V>(static_cast<scalar_t*>(p.dq) + row * DH + col, tmp);
      if (!shared_ctx) {
        #pragma unroll 1  // L ≤ Λ is small: unrolled, these slot loops made ptxas spill on sm_80
        for (int64_t s = 0; s < L; ++s) {
          store<scalar_t, V>(static_cast<scalar_t*>(p.dkc) + (row * L + s) * DH + col, tmp);
          store<scalar_t, V>(static_cast<scalar_t*>(p.dvc) + (row * L + s) * DH + col, tmp);
        }
      }
      if (lane == 0) *lse_self = 0.f;
      continue;
    }
    load<scalar_t, V>(static_cast<const scalar_t*>(p.grad_out) + row * DH + col, dO);
    store<scalar_t, V>(static_cast<scalar_t*>(p.do_self.data) + self_off_do, dO);
    load<scalar_t, V>(static_cast<const scalar_t*>(p.q) + row * DH + col, qv);
    const int64_t slot0 = shared_ctx ? bh * L : row * L;
    const scalar_t* kc = static_cast<const scalar_t*>(p.kc) + slot0 * DH + col;
    const scalar_t* vc = static_cast<const scalar_t*>(p.vc) + slot0 * DH + col;
    // Pass 1: scores z_λ (kept in a_s) and their maximum.
    float m = -INFINITY;
    #pragma unroll 1
    for (int64_t s = 0; s < L; ++s) {
      load<scalar_t, V>(kc + s * DH, k);
      const float z = dot(qv, k) * p.scale;
      if (lane == 0) a_s[s] = z;
      m = fmaxf(m, z);
    }
    __syncwarp();
    float l = 0.f;
    #pragma unroll 1
    for (int64_t s = 0; s < L; ++s) l += __expf(a_s[s] - m);
    // Pass 2: a_λ, e_λ = dO·vc_λ, O^cross, r = dO·O^cross.
    fill(oc, 0.f);
    float r = 0.f;
    #pragma unroll 1
    for (int64_t s = 0; s < L; ++s) {
      load<scalar_t, V>(vc + s * DH, vv);
      const float a = __expf(a_s[s] - m) / l;
      const float e = dot(dO, vv);
      __syncwarp();  // every lane has read a_s[s] before lane 0 overwrites it
      if (lane == 0) {
        a_s[s] = a;
        e_s[s] = e;
      }
#pragma unroll
      for (int i = 0; i < V; ++i) oc[i] += a * vv[i];
      r += a * e;
    }
    __syncwarp();
    // Pass 3: dz_λ, dq, and dkc / dvc (S = T) or their coefficients (S = 1).
    fill(dq, 0.f);
    #pragma unroll 1
    for (int64_t s = 0; s < L; ++s) {
      load<scalar_t, V>(kc + s * DH, k);
      const float a = a_s[s];
      const float dz = sig * a * (e_s[s] - r);
      const float cdz = p.scale * dz, sa = sig * a;
#pragma unroll
      for (int i = 0; i < V; ++i) dq[i] += dz * k[i];
      if (shared_ctx) {
        if (lane == 0) {
          coef[((t - t0) * L + s) * 2] = cdz;
          coef[((t - t0) * L + s) * 2 + 1] = sa;
        }
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          k[i] = cdz * qv[i];
          tmp[i] = sa * dO[i];
        }
        store<scalar_t, V>(static_cast<scalar_t*>(p.dkc) + (row * L + s) * DH + col, k);
        store<scalar_t, V>(static_cast<scalar_t*>(p.dvc) + (row * L + s) * DH + col, tmp);
      }
    }
    __syncwarp();  // a_s / e_s are rewritten by the next row
#pragma unroll
    for (int i = 0; i < V; ++i) dq[i] *= p.scale;
    store<scalar_t, V>(static_cast<scalar_t*>(p.dq) + row * DH + col, dq);
    gate_acc += r;
    // The fused backward's inputs: O^self = O − σ O^cross, q_rot, lse.
    load<scalar_t, V>(static_cast<const scalar_t*>(p.out) + row * DH + col, tmp);
#pragma unroll
    for (int i = 0; i < V; ++i) tmp[i] -= sig * oc[i];
    store<scalar_t, V>(static_cast<scalar_t*>(p.o_self.data) + self_off_o, tmp);
    if (p.q_self.data != nullptr) {
      load<scalar_t, V>(static_cast<const scalar_t*>(p.q_rot) + row * DH + col, tmp);
      store<scalar_t, V>(static_cast<scalar_t*>(p.q_self.data) + b * p.q_self.sb + ps * p.q_self.sh +
                             t * p.q_self.st + col,
                         tmp);
    }
    if (lane == 0) *lse_self = p.lse[row];
  }
  // Block partials, warps added in order 0..3 (the barrier also publishes coef).
  float* gate_s = smem + kWarps * 2 * L + (shared_ctx ? kChunkRows * 2 * L + 2 * kSlotTile * DH : 0);
  if (lane == 0) gate_s[warp] = gate_acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float g = 0.f;
    for (int w = 0; w < kWarps; ++w) g += gate_s[w];
    p.gate_part[blockIdx.x] = g;
  }
  if (!shared_ctx) return;
  // S = 1: warp w sums tensor w & 1 (0: c dz_λ q → dkc, 1: σ a_λ dO → dvc) over the valid
  // rows of half w >> 1 of the block, in row order; the second half's sums go through
  // half_sum (element i of lane l at i·32 + l: no bank conflicts) to the first, which
  // writes the block's partial [kc / vc][λ][DH].
  const int tensor = warp & 1, half = warp >> 1;
  const scalar_t* src = static_cast<const scalar_t*>(tensor == 0 ? p.q : p.grad_out) + bh * p.T * DH + col;
  const int64_t valid_end = t_end < len ? t_end : len;
  const int64_t r0 = t0 + half * (kChunkRows / 2);
  const int64_t r1 = r0 + kChunkRows / 2 < valid_end ? r0 + kChunkRows / 2 : valid_end;
  float* part = p.ckv_part + (int64_t(blockIdx.x) * 2 + tensor) * L * DH + col;
  #pragma unroll 1
  for (int64_t s0 = 0; s0 < L; s0 += kSlotTile) {  // block-uniform
    float acc[kSlotTile][V];
#pragma unroll
    for (int j = 0; j < kSlotTile; ++j) fill(acc[j], 0.f);
    #pragma unroll 1
    for (int64_t tb = r0; tb < r1; tb += kSumBatch) {
      float x[kSumBatch][V];
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u)
        if (tb + u < r1) load<scalar_t, V>(src + (tb + u) * DH, x[u]);
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u) {
        if (tb + u >= r1) break;
        const float* c = coef + ((tb + u - t0) * L + s0) * 2 + tensor;
#pragma unroll
        for (int j = 0; j < kSlotTile; ++j) {
          if (s0 + j >= L) break;
          const float w = c[2 * j];
#pragma unroll
          for (int i = 0; i < V; ++i) acc[j][i] += w * x[u][i];
        }
      }
    }
    float* hs = half_sum + tensor * kSlotTile * DH + lane;
    if (half == 1) {
#pragma unroll
      for (int j = 0; j < kSlotTile; ++j)
#pragma unroll
        for (int i = 0; i < V; ++i) hs[j * DH + i * 32] = acc[j][i];
    }
    __syncthreads();
    if (half == 0) {
#pragma unroll
      for (int j = 0; j < kSlotTile; ++j) {
        if (s0 + j >= L) break;
#pragma unroll
        for (int i = 0; i < V; ++i) acc[j][i] += hs[j * DH + i * 32];
        store_elements(part + (s0 + j) * DH, acc[j]);
      }
    }
    __syncthreads();  // half_sum is rewritten by the next tile
  }
}

// ---------------------------------------------------------------------------------
// Backward 2: fixed-order sums of the block partials.
// ---------------------------------------------------------------------------------
// dgate[h] = σ(1−σ) Σ_b Σ_chunk gate_part[b, h, chunk]: one warp per head, lanes stride the
// (b, chunk) pairs, then a fixed xor tree.
__global__ void dgate_kernel(const float* gate_part, const float* gate, float* dgate, int64_t B, int64_t H,
                             int64_t nchunks) {
  const int64_t h = blockIdx.x;
  const int lane = threadIdx.x;
  float acc = 0.f;
  for (int64_t i = lane; i < B * nchunks; i += 32) {
    const int64_t b = i / nchunks, c = i % nchunks;
    acc += gate_part[(b * H + h) * nchunks + c];
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    const float sig = sigmoid(gate[h]);
    dgate[h] = sig * (1.f - sig) * acc;
  }
}

// dkc / dvc (B, H, 1, L, dh) = Σ_chunk ckv_part[b, h, chunk, 0 / 1, ...], one thread per output.
template <typename scalar_t>
__global__ void context_sum_kernel(const float* ckv_part, scalar_t* dkc, scalar_t* dvc, int64_t BH, int64_t nchunks,
                                   int64_t LD) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= BH * 2 * LD) return;
  const int64_t bh = idx / (2 * LD), k = idx % (2 * LD);
  float acc = 0.f;
  for (int64_t c = 0; c < nchunks; ++c) acc += ckv_part[(bh * nchunks + c) * 2 * LD + k];
  scalar_t* dst = k < LD ? dkc + bh * LD + k : dvc + bh * LD + (k - LD);
  *dst = from_float<scalar_t>(acc);
}

// The dynamic shared memory limit is an attribute of a function on a device: a driver call
// that need not run per launch. Each kernel keeps, per device, the most bytes it has been
// allowed there and calls the driver only when a launch needs more (once per device in
// practice; thread-safe: a race sets the same attribute twice). cudaGetDevice reads the
// thread's current device without a driver round trip.
constexpr int kMaxDevices = 64;

template <auto Kernel>
cudaError_t set_smem_once(size_t bytes) {
  static std::atomic<size_t> allowed[kMaxDevices] = {};
  int device = 0;
#ifndef WIOLA_CUDA_EMU
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
#endif
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && allowed[device].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  const cudaError_t err =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess && cached) {
    size_t seen = allowed[device].load(std::memory_order_relaxed);
    while (seen < bytes && !allowed[device].compare_exchange_weak(seen, bytes, std::memory_order_release)) {
    }
  }
  return err;
}

template <typename scalar_t, int DH>
cudaError_t forward_typed(const SummaryForwardParams& p, cudaStream_t stream) {
  const int64_t rows = p.B * p.H * p.T;
  if (rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(summary_forward_blocks(rows)));
  launch_kernel(summary_forward_kernel<scalar_t, DH>, grid, kThreads, 0, stream, p);
  return cudaGetLastError();
}

template <typename scalar_t, int DH>
cudaError_t backward_typed(const SummaryBackwardParams& p, cudaStream_t stream) {
  const int64_t BH = p.B * p.H, nchunks = backward_chunks(p.T);
  const bool shared_ctx = p.S == 1;
  cudaError_t err = cudaSuccess;
  if (BH * nchunks > 0) {
    const size_t smem = summary_backward_smem(p.L, DH, shared_ctx);
    if (smem > kMaxSmem) return cudaErrorInvalidValue;
    if ((err = set_smem_once<summary_backward_kernel<scalar_t, DH>>(smem)) != cudaSuccess) return err;
    launch_kernel(summary_backward_kernel<scalar_t, DH>, static_cast<unsigned>(BH * nchunks), kThreads, smem, stream, p);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (shared_ctx && BH * p.L > 0) {
    const int64_t n = BH * 2 * p.L * DH;
    launch_kernel(context_sum_kernel<scalar_t>, static_cast<unsigned>(context_sum_blocks(n)), kContextSumThreads, 0,
        stream, p.ckv_part, static_cast<scalar_t*>(p.dkc), static_cast<scalar_t*>(p.dvc), BH, nchunks, p.L * DH);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.H > 0) {
    launch_kernel(dgate_kernel, static_cast<unsigned>(p.H), kDgateThreads, 0, stream, p.gate_part, p.gate, p.dgate, p.B,
        p.H, nchunks);
    err = cudaGetLastError();
  }
  return err;
}

// Calls fn(std::integral_constant<int, DH>{}) for dh in HeadDims (wiola/gcla_attention.h).
template <typename Fn, int... Ds>
cudaError_t dispatch_head_dim(int64_t dh, HeadDimList<Ds...>, Fn&& fn) {
  cudaError_t err = cudaErrorInvalidValue;
  (void)((dh == Ds && ((err = fn(std::integral_constant<int, Ds>{})), true)) || ...);
  return err;
}

}  // namespace

cudaError_t launch_summary_forward(const SummaryForwardParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    return dispatch_head_dim(p.dh, HeadDims{},
                             [&](auto dh) { return forward_typed<decltype(tag), decltype(dh)::value>(p, stream); });
  });
}

cudaError_t launch_summary_backward(const SummaryBackwardParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    return dispatch_head_dim(p.dh, HeadDims{},
                             [&](auto dh) { return backward_typed<decltype(tag), decltype(dh)::value>(p, stream); });
  });
}

}  // namespace wiola::gcla
