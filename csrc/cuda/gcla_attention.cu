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
// sums them per block in shared memory (fixed order) into a partial, and a second kernel
// adds the partials in chunk order — deterministic, no atomics. dgate likewise.
#ifdef WIOLA_CUDA_EMU
#include "emu/cuda_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <cmath>
#include <type_traits>

#include "wiola/cuda_convert.cuh"
#include "wiola/gcla_attention.h"
#include "wiola/gcla_launch.h"
#include "wiola/cuda_launch.cuh"
#include "wiola/warp_reduce.cuh"

namespace wiola::gcla {
namespace {

// kWarps, kThreads, the grids and shared memory of the launches: wiola/gcla_launch.h.

using wiola::cuda::dispatch_dtype;
using wiola::cuda::from_float;
using wiola::cuda::launch_kernel;
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

// N contiguous elements as one access (the callers' offsets are multiples of N elements).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load(const T* src, float (&x)[N]) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(src);
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = to_float(pk.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store(T* dst, const float (&x)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_float<T>(x[i]);
  *reinterpret_cast<Pack<T, N>*>(dst) = pk;
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
// Backward 1: per row, one block per (b, h, kBackwardChunk rows); warp w takes rows
// t0 + w, t0 + w + 4, ... Dynamic shared memory (floats):
//   [kWarps][2][L]      a_λ and e_λ of the warp's current row
//   [kWarps][2][L][DH]  the warp's running dkc / dvc sums (S = 1 only)
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
  float* acc_kc = smem + kWarps * 2 * L + warp * 2 * L * DH;
  float* acc_vc = acc_kc + L * DH;
  if (shared_ctx) {
    for (int64_t i = lane; i < 2 * L * DH; i += 32) acc_kc[i] = 0.f;
  }
  __syncwarp();
  const float sig = sigmoid(p.gate[h]);
  float gate_acc = 0.f;  // Σ_t r over the warp's rows (warp-uniform)
  const int64_t t_end = (chunk + 1) * kBackwardChunk < p.T ? (chunk + 1) * kBackwardChunk : p.T;
  for (int64_t t = chunk * kBackwardChunk + warp; t < t_end; t += kWarps) {
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
    // Pass 3: dz_λ, dq, dkc, dvc.
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
#pragma unroll
        for (int i = 0; i < V; ++i) {
          acc_kc[s * DH + col + i] += cdz * qv[i];
          acc_vc[s * DH + col + i] += sa * dO[i];
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
  // Block partials, warps added in order 0..3.
  float* gate_s = smem + kWarps * 2 * L + (shared_ctx ? kWarps * 2 * L * DH : 0);
  if (lane == 0) gate_s[warp] = gate_acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float g = 0.f;
    for (int w = 0; w < kWarps; ++w) g += gate_s[w];
    p.gate_part[blockIdx.x] = g;
  }
  if (shared_ctx) {
    const int64_t n = 2 * L * DH;
    float* part = p.ckv_part + int64_t(blockIdx.x) * n;
    const float* acc0 = smem + kWarps * 2 * L;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      float s = 0.f;
      for (int w = 0; w < kWarps; ++w) s += acc0[w * n + i];
      part[i] = s;
    }
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

template <typename K>
cudaError_t set_smem(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
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
    if ((err = set_smem(summary_backward_kernel<scalar_t, DH>, smem)) != cudaSuccess) return err;
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
