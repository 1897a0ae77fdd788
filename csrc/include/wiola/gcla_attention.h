// GCLA summary-augmented attention (SPEC §5.5): torch-free parameters and launchers of
// the CUDA kernels in csrc/cuda/gcla_attention.cu (binding: csrc/cuda/gcla_attention_binding.cpp).
//
//   O_i = Σ_j softmax_j(c q̃_i·k̃_j) v_j + σ(g_h) Σ_λ softmax_λ(c q_i·kc_{s(i)λ}) vc_{s(i)λ},  c = 1/√d_h
//
// Head h reads kv group h mod H_kv; keys j ≤ i and j < len_b; rows i ≥ len_b are zero.
// All tensors are contiguous, row-major, on the current device, of `dtype` unless a
// comment says float. Launchers return cudaSuccess, cudaErrorInvalidValue for an
// unsupported head width (d_h ∈ {64, 128}), or the launch error; none synchronises.
#pragma once

#ifdef WIOLA_CUDA_EMU
#include "../../cuda/emu/runtime.h"  // the SIMT emulator's runtime (test backend cuda_emu)
#else
#include <cuda_runtime_api.h>
#endif

#include <cstdint>

namespace wiola::gcla {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Head widths the kernels are instantiated for.
inline bool supported_head_dim(int64_t dh) { return dh == 64 || dh == 128; }

struct ForwardParams {
  const void* q_rot;        // (B, H, T, dh)
  const void* k_rot;        // (B, Hkv, T, dh)
  const void* v;            // (B, Hkv, T, dh)
  const void* q;            // (B, H, T, dh), un-rotated
  const void* kc;           // (B, H, S, L, dh)
  const void* vc;           // (B, H, S, L, dh)
  const float* gate;        // (H,) float
  const int64_t* lengths;   // (B,) or nullptr (all rows full); clamped to [0, T]
  void* out;                // out (B, H, T, dh)
  float* lse;               // out (B, H, T) float; 0 on rows past the length
  int64_t B, H, Hkv, T, dh, S, L;
  float scale;              // 1/√dh
  DType dtype;
};

struct BackwardParams {
  ForwardParams fwd;        // inputs as in the forward; fwd.out / fwd.lse are the forward's outputs (read)
  const void* grad_out;     // (B, H, T, dh)
  void* dq_rot;             // out (B, H, T, dh)
  void* dk_rot;             // out (B, Hkv, T, dh)
  void* dv;                 // out (B, Hkv, T, dh)
  void* dq;                 // out (B, H, T, dh)
  void* dkc;                // out (B, H, S, L, dh)
  void* dvc;                // out (B, H, S, L, dh)
  float* dgate;             // out (H,) float
  float* delta;             // workspace (B, H, T) float: D_i = dO_i · O^self_i
  float* dgate_rows;        // workspace (B, H, T) float: per-row gate terms
  float* dkc_rows;          // workspace (B, H, T, L, dh) float when S = 1, else unused (may be null)
  float* dvc_rows;          // workspace (B, H, T, L, dh) float when S = 1, else unused (may be null)
};

cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream);
cudaError_t launch_backward(const BackwardParams& p, cudaStream_t stream);

}  // namespace wiola::gcla
