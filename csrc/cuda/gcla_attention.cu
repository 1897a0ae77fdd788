// GCLA summary-augmented attention on CUDA (SPEC §5.5), FlashAttention-2 style, plain
// CUDA with shared-memory tiles and fp32 FMA (no torch headers; see wiola/gcla_attention.h).
//
// Grids are 1-D ((b, head) major, tile minor), so large B·H never meets gridDim.y's limit.
//
// Forward (one block per (b, h, 32-query tile), 4 warps, 8 rows per warp): key/value
// tiles of 32 keys are staged in shared memory (fp32), only tiles at or left of the
// diagonal and below len_b are visited; lane j scores key j of the tile, the warp keeps
// an online softmax per row and lanes own d_h/32 output columns. The epilogue adds the
// tiny cross softmax over the Λ' summary slots (un-rotated q), applies σ(g_h) and writes
// O once, plus lse = m + log l.
//
// Backward (P recomputed from lse), deterministic, no atomics:
//   1. rows:  one warp per row: cross part (dq, dkc/dvc or per-row partials for S = 1,
//             gate term) and D_i = dO_i · (O_i − σ O^cross_i).
//   2. dq̃:    like the forward, per (b, h, query tile).
//   3. dk̃/dv: per (b, kv group, 32-key tile); each warp owns 8 keys and loops over the
//             group's heads in order and the query tiles below the diagonal.
//   4. fixed-order sums of the per-row partials: dgate (H,), and dkc/dvc when S = 1.
#ifdef WIOLA_CUDA_EMU
#include "emu/cuda_emu.h"  // host C++ build for the SIMT emulator (backend cuda_emu)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <cmath>

#include "wiola/gcla_attention.h"
#include "wiola/cuda_convert.cuh"
#include "wiola/cuda_launch.cuh"

namespace wiola::gcla {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileQ = 32;   // query rows per block (forward, dq)
constexpr int kTileK = 32;   // keys per shared-memory tile (= lanes)
constexpr int kRowsPerWarp = kTileQ / kWarps;
constexpr int kKeysPerWarp = kTileK / kWarps;

using wiola::cuda::from_float;
using wiola::cuda::launch_kernel;
using wiola::cuda::to_float;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ int64_t row_length(const int64_t* lengths, int64_t b, int64_t T) {
  if (lengths == nullptr) return T;
  const int64_t len = lengths[b];
  return len < 0 ? 0 : (len > T ? T : len);
}

// rows [r0, r0 + n) of a (·, DH) matrix into smem (row stride ld), zero past `valid` rows.
template <typename scalar_t, int DH>
__device__ __forceinline__ void stage_rows(const scalar_t* src, int64_t r0, int n, int64_t valid_end, float* dst, int ld) {
  for (int idx = threadIdx.x; idx < n * DH; idx += kThreads) {
    const int r = idx / DH, e = idx % DH;
    dst[r * ld + e] = (r0 + r < valid_end) ? to_float(src[(r0 + r) * DH + e]) : 0.f;
  }
}

// Cross part of one row, lanes own columns e = lane + 32 c. Returns a_λ through the
// callback-free two-pass form: fills oc[c] and writes nothing else.
template <typename scalar_t, int DH>
__device__ __forceinline__ void cross_row(const float (&qv)[DH / 32], const scalar_t* kc, const scalar_t* vc, int64_t L,
                                          float scale, float (&oc)[DH / 32], float& zmax, float& zsum) {
  constexpr int C = DH / 32;
  const int lane = threadIdx.x & 31;
  zmax = -INFINITY;
  for (int64_t l = 0; l < L; ++l) {
    float part = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) part += qv[c] * to_float(kc[l * DH + lane + 32 * c]);
    zmax = fmaxf(zmax, warp_sum(part) * scale);
  }
  zsum = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) oc[c] = 0.f;
  for (int64_t l = 0; l < L; ++l) {
    float part = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) part += qv[c] * to_float(kc[l * DH + lane + 32 * c]);
    const float w = __expf(warp_sum(part) * scale - zmax);
    zsum += w;
#pragma unroll
    for (int c = 0; c < C; ++c) oc[c] += w * to_float(vc[l * DH + lane + 32 * c]);
  }
  if (L > 0) {
#pragma unroll
    for (int c = 0; c < C; ++c) oc[c] /= zsum;
  }
}

// ---------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------
template <typename scalar_t, int DH>
__global__ void __launch_bounds__(kThreads) forward_kernel(ForwardParams p) {
  constexpr int C = DH / 32;
  constexpr int LDK = DH + 1;  // padded: lane j reads row j
  extern __shared__ float smem[];
  float* Qs = smem;                    // [kTileQ][DH]
  float* Ks = Qs + kTileQ * DH;        // [kTileK][LDK]
  float* Vs = Ks + kTileK * LDK;       // [kTileK][DH]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t ntiles = (p.T + kTileQ - 1) / kTileQ;  // 1-D grid: (b, h) major, query tile minor
  const int64_t bh = int64_t(blockIdx.x) / ntiles, b = bh / p.H, h = bh % p.H, g = h % p.Hkv;
  const int64_t T = p.T, len = row_length(p.lengths, b, T);
  const int64_t i0 = (int64_t(blockIdx.x) % ntiles) * kTileQ;
  const scalar_t* q_rot = static_cast<const scalar_t*>(p.q_rot) + bh * T * DH;
  const scalar_t* k_g = static_cast<const scalar_t*>(p.k_rot) + (b * p.Hkv + g) * T * DH;
  const scalar_t* v_g = static_cast<const scalar_t*>(p.v) + (b * p.Hkv + g) * T * DH;
  scalar_t* out = static_cast<scalar_t*>(p.out) + bh * T * DH;
  float* lse = p.lse + bh * T;
  const int64_t row_end = i0 + kTileQ < len ? i0 + kTileQ : len;  // valid rows [i0, row_end)

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][C];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
  }
  if (i0 < row_end) {
    stage_rows<scalar_t, DH>(q_rot, i0, kTileQ, row_end, Qs, DH);
    for (int64_t j0 = 0; j0 < row_end; j0 += kTileK) {  // causal: keys up to the last valid row
      __syncthreads();
      stage_rows<scalar_t, DH>(k_g, j0, kTileK, row_end, Ks, LDK);
      stage_rows<scalar_t, DH>(v_g, j0, kTileK, row_end, Vs, DH);
      __syncthreads();
      const int64_t j = j0 + lane;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int rr = warp * kRowsPerWarp + r;
        const int64_t i = i0 + rr;
        if (i >= row_end || j0 > i) continue;  // warp-uniform
        float s = -INFINITY;
        if (j <= i) {
          float d = 0.f;
#pragma unroll 8
          for (int e = 0; e < DH; ++e) d += Qs[rr * DH + e] * Ks[lane * LDK + e];
          s = d * p.scale;
        }
        const float m_new = fmaxf(m[r], warp_max(s));
        const float pj = __expf(s - m_new);
        const float corr = __expf(m[r] - m_new);
        l[r] = l[r] * corr + warp_sum(pj);
        m[r] = m_new;
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] *= corr;
        // Only this row's causal keys: 0 · NaN would carry a later key's NaN/Inf into row i.
        const int jn = static_cast<int>(i - j0 + 1 < kTileK ? i - j0 + 1 : kTileK);  // warp-uniform
        for (int jj = 0; jj < jn; ++jj) {
          const float pjj = __shfl_sync(0xffffffffu, pj, jj);
#pragma unroll
          for (int c = 0; c < C; ++c) acc[r][c] += pjj * Vs[jj * DH + lane + 32 * c];
        }
      }
    }
  }
  // Epilogue: normalise, cross part, gate, one write per row.
  const float sig = 1.f / (1.f + __expf(-p.gate[h]));
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = i0 + warp * kRowsPerWarp + r;
    if (i >= T) continue;
    if (i >= row_end) {
#pragma unroll
      for (int c = 0; c < C; ++c) out[i * DH + lane + 32 * c] = from_float<scalar_t>(0.f);
      if (lane == 0) lse[i] = 0.f;
      continue;
    }
    float oc[C];
#pragma unroll
    for (int c = 0; c < C; ++c) oc[c] = 0.f;
    if (p.L > 0) {
      const int64_t s_idx = p.S == 1 ? 0 : i;
      const int64_t off = ((bh * p.S + s_idx) * p.L) * DH;
      float qv[C];
      const scalar_t* q = static_cast<const scalar_t*>(p.q) + (bh * T + i) * DH;
#pragma unroll
      for (int c = 0; c < C; ++c) qv[c] = to_float(q[lane + 32 * c]);
      float zmax, zsum;
      cross_row<scalar_t, DH>(qv, static_cast<const scalar_t*>(p.kc) + off, static_cast<const scalar_t*>(p.vc) + off, p.L, p.scale, oc,
                       zmax, zsum);
    }
    const float inv_l = 1.f / l[r];
#pragma unroll
    for (int c = 0; c < C; ++c) out[i * DH + lane + 32 * c] = from_float<scalar_t>(acc[r][c] * inv_l + sig * oc[c]);
    if (lane == 0) lse[i] = m[r] + logf(l[r]);
  }
}

// ---------------------------------------------------------------------------------
// Backward 1: per row (one warp each): cross part, D, gate term
// ---------------------------------------------------------------------------------
template <typename scalar_t, int DH>
__global__ void __launch_bounds__(kThreads) rows_kernel(BackwardParams bp) {
  constexpr int C = DH / 32;
  const ForwardParams& p = bp.fwd;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nblk = (p.T + kWarps - 1) / kWarps;
  const int64_t bh = int64_t(blockIdx.x) / nblk, b = bh / p.H, h = bh % p.H;
  const int64_t T = p.T, len = row_length(p.lengths, b, T);
  const int64_t i = (int64_t(blockIdx.x) % nblk) * kWarps + warp;
  if (i >= T) return;
  const int64_t row = bh * T + i;
  const int64_t L = p.L;
  const bool shared = p.S == 1;
  scalar_t* dq = static_cast<scalar_t*>(bp.dq) + row * DH;
  if (i >= len) {  // padding: zero gradients and partials
#pragma unroll
    for (int c = 0; c < C; ++c) dq[lane + 32 * c] = from_float<scalar_t>(0.f);
    for (int64_t idx = lane; idx < L * DH; idx += 32) {
      if (shared) {
        bp.dkc_rows[row * L * DH + idx] = 0.f;
        bp.dvc_rows[row * L * DH + idx] = 0.f;
      } else {
        static_cast<scalar_t*>(bp.dkc)[row * L * DH + idx] = from_float<scalar_t>(0.f);
        static_cast<scalar_t*>(bp.dvc)[row * L * DH + idx] = from_float<scalar_t>(0.f);
      }
    }
    if (lane == 0) {
      bp.delta[row] = 0.f;
      bp.dgate_rows[row] = 0.f;
    }
    return;
  }
  const float sig = 1.f / (1.f + __expf(-p.gate[h]));
  float d_o[C], o[C], qv[C], oc[C], dqc[C];
  const scalar_t* go = static_cast<const scalar_t*>(bp.grad_out) + row * DH;
  const scalar_t* out = static_cast<const scalar_t*>(p.out) + row * DH;
  const scalar_t* q = static_cast<const scalar_t*>(p.q) + row * DH;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    d_o[c] = to_float(go[lane + 32 * c]);
    o[c] = to_float(out[lane + 32 * c]);
    qv[c] = to_float(q[lane + 32 * c]);
    oc[c] = 0.f;
    dqc[c] = 0.f;
  }
  float gate_term = 0.f;
  if (L > 0) {
    const int64_t s_idx = shared ? 0 : i;
    const int64_t off = ((bh * p.S + s_idx) * L) * DH;
    const scalar_t* kc = static_cast<const scalar_t*>(p.kc) + off;
    const scalar_t* vc = static_cast<const scalar_t*>(p.vc) + off;
    float zmax, zsum;
    cross_row<scalar_t, DH>(qv, kc, vc, L, p.scale, oc, zmax, zsum);
    float part = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) part += d_o[c] * oc[c];
    const float do_oc = warp_sum(part);
    gate_term = sig * (1.f - sig) * do_oc;
    for (int64_t l = 0; l < L; ++l) {
      float zp = 0.f, vp = 0.f;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        zp += qv[c] * to_float(kc[l * DH + lane + 32 * c]);
        vp += d_o[c] * to_float(vc[l * DH + lane + 32 * c]);
      }
      const float a = __expf(warp_sum(zp) * p.scale - zmax) / zsum;
      const float dz = a * sig * (warp_sum(vp) - do_oc);  // dOc = σ dO
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int e = lane + 32 * c;
        dqc[c] += p.scale * dz * to_float(kc[l * DH + e]);
        const float gk = p.scale * dz * qv[c], gv = a * sig * d_o[c];
        if (shared) {
          bp.dkc_rows[(row * L + l) * DH + e] = gk;
          bp.dvc_rows[(row * L + l) * DH + e] = gv;
        } else {
          static_cast<scalar_t*>(bp.dkc)[off + l * DH + e] = from_float<scalar_t>(gk);
          static_cast<scalar_t*>(bp.dvc)[off + l * DH + e] = from_float<scalar_t>(gv);
        }
      }
    }
  }
  float dpart = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    dq[lane + 32 * c] = from_float<scalar_t>(dqc[c]);
    dpart += d_o[c] * (o[c] - sig * oc[c]);
  }
  const float delta = warp_sum(dpart);
  if (lane == 0) {
    bp.delta[row] = delta;
    bp.dgate_rows[row] = gate_term;
  }
}

// ---------------------------------------------------------------------------------
// Backward 2: dq̃ per (b, h, query tile)
// ---------------------------------------------------------------------------------
template <typename scalar_t, int DH>
__global__ void __launch_bounds__(kThreads) dq_kernel(BackwardParams bp) {
  constexpr int C = DH / 32;
  constexpr int LDK = DH + 1;
  const ForwardParams& p = bp.fwd;
  extern __shared__ float smem[];
  float* Qs = smem;                 // [kTileQ][DH]
  float* dOs = Qs + kTileQ * DH;    // [kTileQ][DH]
  float* Ks = dOs + kTileQ * DH;    // [kTileK][LDK]
  float* Vs = Ks + kTileK * LDK;    // [kTileK][LDK]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t ntiles = (p.T + kTileQ - 1) / kTileQ;
  const int64_t bh = int64_t(blockIdx.x) / ntiles, b = bh / p.H, h = bh % p.H, g = h % p.Hkv;
  const int64_t T = p.T, len = row_length(p.lengths, b, T);
  const int64_t i0 = (int64_t(blockIdx.x) % ntiles) * kTileQ;
  const int64_t row_end = i0 + kTileQ < len ? i0 + kTileQ : len;
  const scalar_t* k_g = static_cast<const scalar_t*>(p.k_rot) + (b * p.Hkv + g) * T * DH;
  const scalar_t* v_g = static_cast<const scalar_t*>(p.v) + (b * p.Hkv + g) * T * DH;
  const float* lse = p.lse + bh * T;
  const float* delta = bp.delta + bh * T;
  scalar_t* dq_rot = static_cast<scalar_t*>(bp.dq_rot) + bh * T * DH;
  float acc[kRowsPerWarp][C];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
  if (i0 < row_end) {
    stage_rows<scalar_t, DH>(static_cast<const scalar_t*>(p.q_rot) + bh * T * DH, i0, kTileQ, row_end, Qs, DH);
    stage_rows<scalar_t, DH>(static_cast<const scalar_t*>(bp.grad_out) + bh * T * DH, i0, kTileQ, row_end, dOs, DH);
    for (int64_t j0 = 0; j0 < row_end; j0 += kTileK) {
      __syncthreads();
      stage_rows<scalar_t, DH>(k_g, j0, kTileK, row_end, Ks, LDK);
      stage_rows<scalar_t, DH>(v_g, j0, kTileK, row_end, Vs, LDK);
      __syncthreads();
      const int64_t j = j0 + lane;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int rr = warp * kRowsPerWarp + r;
        const int64_t i = i0 + rr;
        if (i >= row_end || j0 > i) continue;  // warp-uniform
        float ds = 0.f;
        if (j <= i) {
          float s = 0.f, dp = 0.f;
#pragma unroll 8
          for (int e = 0; e < DH; ++e) {
            s += Qs[rr * DH + e] * Ks[lane * LDK + e];
            dp += dOs[rr * DH + e] * Vs[lane * LDK + e];
          }
          const float pj = __expf(s * p.scale - lse[i]);
          ds = pj * (dp - delta[i]);
        }
        const int jn = static_cast<int>(i - j0 + 1 < kTileK ? i - j0 + 1 : kTileK);  // causal keys only
        for (int jj = 0; jj < jn; ++jj) {
          const float dsj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
          for (int c = 0; c < C; ++c) acc[r][c] += dsj * Ks[jj * LDK + lane + 32 * c];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = i0 + warp * kRowsPerWarp + r;
    if (i >= T) continue;
#pragma unroll
    for (int c = 0; c < C; ++c) dq_rot[i * DH + lane + 32 * c] = from_float<scalar_t>(i < row_end ? acc[r][c] * p.scale : 0.f);
  }
}

// ---------------------------------------------------------------------------------
// Backward 3: dk̃, dv per (b, kv group, key tile); heads of the group in order
// ---------------------------------------------------------------------------------
template <typename scalar_t, int DH>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(BackwardParams bp) {
  constexpr int C = DH / 32;
  constexpr int LD = DH + 1;
  const ForwardParams& p = bp.fwd;
  extern __shared__ float smem[];
  float* Ks = smem;                  // [kTileK][LD]
  float* Vs = Ks + kTileK * LD;      // [kTileK][LD]
  float* Qs = Vs + kTileK * LD;      // [kTileQ][LD]
  float* dOs = Qs + kTileQ * LD;     // [kTileQ][LD]
  float* lse_s = dOs + kTileQ * LD;  // [kTileQ]
  float* del_s = lse_s + kTileQ;     // [kTileQ]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t ntiles = (p.T + kTileK - 1) / kTileK;
  const int64_t bg = int64_t(blockIdx.x) / ntiles, b = bg / p.Hkv, g = bg % p.Hkv;
  const int64_t T = p.T, len = row_length(p.lengths, b, T);
  const int64_t j0 = (int64_t(blockIdx.x) % ntiles) * kTileK;
  const int64_t key_end = j0 + kTileK < len ? j0 + kTileK : len;
  float dk[kKeysPerWarp][C], dv[kKeysPerWarp][C];
#pragma unroll
  for (int k = 0; k < kKeysPerWarp; ++k)
#pragma unroll
    for (int c = 0; c < C; ++c) dk[k][c] = dv[k][c] = 0.f;
  if (j0 < key_end) {
    stage_rows<scalar_t, DH>(static_cast<const scalar_t*>(p.k_rot) + bg * T * DH, j0, kTileK, key_end, Ks, LD);
    stage_rows<scalar_t, DH>(static_cast<const scalar_t*>(p.v) + bg * T * DH, j0, kTileK, key_end, Vs, LD);
    for (int64_t h = g; h < p.H; h += p.Hkv) {
      const int64_t bh = b * p.H + h;
      const scalar_t* q_rot = static_cast<const scalar_t*>(p.q_rot) + bh * T * DH;
      const scalar_t* go = static_cast<const scalar_t*>(bp.grad_out) + bh * T * DH;
      for (int64_t i0 = j0; i0 < len; i0 += kTileQ) {  // queries i ≥ j0 see these keys
        __syncthreads();
        stage_rows<scalar_t, DH>(q_rot, i0, kTileQ, len, Qs, LD);
        stage_rows<scalar_t, DH>(go, i0, kTileQ, len, dOs, LD);
        if (threadIdx.x < kTileQ) {
          const int64_t i = i0 + threadIdx.x;
          lse_s[threadIdx.x] = i < len ? p.lse[bh * T + i] : 0.f;
          del_s[threadIdx.x] = i < len ? bp.delta[bh * T + i] : 0.f;
        }
        __syncthreads();
        const int64_t i = i0 + lane;  // lane = query of the tile
#pragma unroll
        for (int k = 0; k < kKeysPerWarp; ++k) {
          const int kk = warp * kKeysPerWarp + k;
          const int64_t j = j0 + kk;
          if (j >= key_end) continue;  // warp-uniform
          float pj = 0.f, ds = 0.f;
          if (i < len && i >= j) {
            float s = 0.f, dp = 0.f;
#pragma unroll 8
            for (int e = 0; e < DH; ++e) {
              s += Qs[lane * LD + e] * Ks[kk * LD + e];
              dp += dOs[lane * LD + e] * Vs[kk * LD + e];
            }
            pj = __expf(s * p.scale - lse_s[lane]);
            ds = pj * (dp - del_s[lane]);
          }
          // Only the queries that see key j (j ≤ i < len): an earlier row's NaN must not reach it.
          const int ii0 = static_cast<int>(j > i0 ? j - i0 : 0);  // warp-uniform
          const int ii1 = static_cast<int>(len - i0 < kTileQ ? len - i0 : kTileQ);
          for (int ii = ii0; ii < ii1; ++ii) {
            const float pi = __shfl_sync(0xffffffffu, pj, ii);
            const float dsi = __shfl_sync(0xffffffffu, ds, ii);
#pragma unroll
            for (int c = 0; c < C; ++c) {
              dv[k][c] += pi * dOs[ii * LD + lane + 32 * c];
              dk[k][c] += dsi * Qs[ii * LD + lane + 32 * c];
            }
          }
        }
      }
    }
  }
  scalar_t* dk_out = static_cast<scalar_t*>(bp.dk_rot) + bg * T * DH;
  scalar_t* dv_out = static_cast<scalar_t*>(bp.dv) + bg * T * DH;
#pragma unroll
  for (int k = 0; k < kKeysPerWarp; ++k) {
    const int64_t j = j0 + warp * kKeysPerWarp + k;
    if (j >= T) continue;
    const bool valid = j < key_end;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      dk_out[j * DH + lane + 32 * c] = from_float<scalar_t>(valid ? dk[k][c] * p.scale : 0.f);
      dv_out[j * DH + lane + 32 * c] = from_float<scalar_t>(valid ? dv[k][c] : 0.f);
    }
  }
}

// ---------------------------------------------------------------------------------
// Backward 4: fixed-order reductions
// ---------------------------------------------------------------------------------
// dgate[h] = Σ_b Σ_t rows[b, h, t], one warp per head, lanes stride t, then a fixed tree.
__global__ void dgate_kernel(const float* rows, float* dgate, int64_t B, int64_t H, int64_t T) {
  const int64_t h = blockIdx.x;
  const int lane = threadIdx.x;
  float acc = 0.f;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = lane; t < T; t += 32) acc += rows[(b * H + h) * T + t];
  acc = warp_sum(acc);
  if (lane == 0) dgate[h] = acc;
}

// out[b, h, 0, l, e] = Σ_t rows[b, h, t, l, e] (S = 1 summaries), one thread per output.
template <typename scalar_t>
__global__ void sum_rows_kernel(const float* rows, scalar_t* out, int64_t BH, int64_t T_len, int64_t LD) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= BH * LD) return;
  const int64_t bh = idx / LD, k = idx % LD;
  float acc = 0.f;
  for (int64_t t = 0; t < T_len; ++t) acc += rows[(bh * T_len + t) * LD + k];
  out[idx] = from_float<scalar_t>(acc);
}

template <typename K>
cudaError_t set_smem(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <typename scalar_t, int DH>
cudaError_t forward_typed(const ForwardParams& p, cudaStream_t stream) {
  if (p.B * p.H * p.T == 0) return cudaSuccess;
  const size_t smem = sizeof(float) * (kTileQ * DH + kTileK * (DH + 1) + kTileK * DH);
  cudaError_t err = set_smem(forward_kernel<scalar_t, DH>, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((p.T + kTileQ - 1) / kTileQ * p.B * p.H));
  launch_kernel(forward_kernel<scalar_t, DH>, grid, kThreads, smem, stream, p);
  return cudaGetLastError();
}

template <typename scalar_t, int DH>
cudaError_t backward_typed(const BackwardParams& bp, cudaStream_t stream) {
  const ForwardParams& p = bp.fwd;
  const int64_t BH = p.B * p.H;
  const bool shared = p.S == 1;
  cudaError_t err = cudaSuccess;
  if (BH * p.T > 0) {
    const dim3 rows_grid(static_cast<unsigned>((p.T + kWarps - 1) / kWarps * BH));
    launch_kernel(rows_kernel<scalar_t, DH>, rows_grid, kThreads, 0, stream, bp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;

    const size_t dq_smem = sizeof(float) * (2 * kTileQ * DH + 2 * kTileK * (DH + 1));
    if ((err = set_smem(dq_kernel<scalar_t, DH>, dq_smem)) != cudaSuccess) return err;
    const dim3 q_grid(static_cast<unsigned>((p.T + kTileQ - 1) / kTileQ * BH));
    launch_kernel(dq_kernel<scalar_t, DH>, q_grid, kThreads, dq_smem, stream, bp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;

    const size_t kv_smem = sizeof(float) * ((2 * kTileK + 2 * kTileQ) * (DH + 1) + 2 * kTileQ);
    if ((err = set_smem(dkdv_kernel<scalar_t, DH>, kv_smem)) != cudaSuccess) return err;
    const dim3 k_grid(static_cast<unsigned>((p.T + kTileK - 1) / kTileK * p.B * p.Hkv));
    launch_kernel(dkdv_kernel<scalar_t, DH>, k_grid, kThreads, kv_smem, stream, bp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (shared && BH * p.L > 0) {
    const int64_t n = BH * p.L * DH;
    const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
    launch_kernel(sum_rows_kernel<scalar_t>, blocks, 256, 0, stream, bp.dkc_rows, static_cast<scalar_t*>(bp.dkc), BH, p.T, p.L * DH);
    launch_kernel(sum_rows_kernel<scalar_t>, blocks, 256, 0, stream, bp.dvc_rows, static_cast<scalar_t*>(bp.dvc), BH, p.T, p.L * DH);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.H > 0) {
    launch_kernel(dgate_kernel, static_cast<unsigned>(p.H), 32, 0, stream, bp.dgate_rows, bp.dgate, p.B, p.H, p.T);
    err = cudaGetLastError();
  }
  return err;
}

template <typename scalar_t>
cudaError_t forward_dh(const ForwardParams& p, cudaStream_t stream) {
  if (p.dh == 64) return forward_typed<scalar_t, 64>(p, stream);
  if (p.dh == 128) return forward_typed<scalar_t, 128>(p, stream);
  return cudaErrorInvalidValue;
}

template <typename scalar_t>
cudaError_t backward_dh(const BackwardParams& p, cudaStream_t stream) {
  if (p.fwd.dh == 64) return backward_typed<scalar_t, 64>(p, stream);
  if (p.fwd.dh == 128) return backward_typed<scalar_t, 128>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: return forward_dh<float>(p, stream);
    case DType::kFloat16: return forward_dh<__half>(p, stream);
    case DType::kBFloat16: return forward_dh<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_backward(const BackwardParams& p, cudaStream_t stream) {
  switch (p.fwd.dtype) {
    case DType::kFloat32: return backward_dh<float>(p, stream);
    case DType::kFloat16: return backward_dh<__half>(p, stream);
    case DType::kBFloat16: return backward_dh<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace wiola::gcla
