// GCLA summary-augmented attention (SPEC §5.5) on CUDA: torch-free parameters and launchers
// of the summary kernels in csrc/cuda/gcla_attention.cu (binding:
// csrc/cuda/gcla_attention_binding.cpp, which also composes them with the fused self-attention).
//
//   O_i = O^self_i + σ(g_h) Σ_λ softmax_λ(c q_i·kc_{s(i)λ}) vc_{s(i)λ},  c = 1/√d_h
//
// The self part O^self (causal GQA attention) comes from PyTorch's fused attention, which
// maps query head p to kv group p / (H/H_kv); SPEC §5.2 maps head h to h mod H_kv. The
// fused kernel therefore sees the query heads permuted: natural head h sits at
//
//   p(h) = (h mod P) · (H/P) + h / P            P = perm_kv
//
// (P = H_kv makes p(h) / (H/H_kv) = h mod H_kv; P = 1 or P = H is the identity). Every
// tensor of the fused attention (its output, log-sum-exp, query and output gradient) is
// in that order, at any strides whose last dimension is contiguous; every tensor of ours
// is natural and contiguous. The summary kernels read and write both, so the permutation
// costs no extra pass over O or dO.
//
// Rows t ≥ len_b: out = 0 and lse = 0 (forward); in the backward their dO is 0, and the
// self tensors handed to the fused backward are zero there (finite, so masked-out pairs of
// padded rows contribute exactly 0 to dK/dV).
//
// Launchers return cudaSuccess, cudaErrorInvalidValue for an unsupported head width
// (d_h ∈ {64, 128}) or too many context slots for shared memory, or the launch error;
// none synchronises. Deterministic: no atomics; S = 1 sums and dgate are two-stage
// (per-block partials, then a fixed-order sum).
#pragma once

#ifdef WIOLA_CUDA_EMU
#include "../../cuda/emu/runtime.h"  // the SIMT emulator's runtime (test backend cuda_emu)
#else
#include <cuda_runtime_api.h>
#endif

#include <cstdint>
#include <string>

#include "wiola/dtype.h"

namespace wiola::gcla {

using wiola::DType;

// Head widths the kernels are instantiated for, written once: gcla_attention.cu
// instantiates and dispatches over this list, the binding checks and names it.
template <int... Ds>
struct HeadDimList {};
using HeadDims = HeadDimList<64, 128>;

template <int... Ds>
constexpr bool in_list(int64_t dh, HeadDimList<Ds...>) {
  return ((dh == Ds) || ...);
}
inline bool supported_head_dim(int64_t dh) { return in_list(dh, HeadDims{}); }

// "{64, 128}", for error messages.
template <int... Ds>
std::string list_text(HeadDimList<Ds...>) {
  std::string s;
  ((s += (s.empty() ? "{" : ", ") + std::to_string(Ds)), ...);
  return s + "}";
}
inline std::string head_dims_text() { return list_text(HeadDims{}); }

// Query rows per block of the backward kernel: the S = 1 and gate partial sums have one
// entry per (b, h, chunk of this many rows).
constexpr int64_t kBackwardChunk = 64;
constexpr int64_t backward_chunks(int64_t T) { return (T + kBackwardChunk - 1) / kBackwardChunk; }

// A (B, H, T, dh) tensor of the fused attention: element (b, p, t, e) at
// data[b·sb + p·sh + t·st + e], heads in the permuted order p(h).
struct SelfTensor {
  void* data;
  int64_t sb, sh, st;
};

// A (B, H, ≥T) float log-sum-exp of the fused attention, permuted heads, t contiguous.
struct SelfLse {
  float* data;
  int64_t sb, sh;
};

struct SummaryForwardParams {
  SelfTensor o_self;       // (B, H, T, dh) read: O^self
  SelfLse lse_self;        // read
  const void* q;           // (B, H, T, dh), un-rotated
  const void* kc;          // (B, H, S, L, dh)
  const void* vc;          // (B, H, S, L, dh)
  const float* gate;       // (H,) float
  const int64_t* lengths;  // (B,) or nullptr (all rows full); clamped to [0, T]
  void* out;               // out (B, H, T, dh)
  float* lse;              // out (B, H, T) float; 0 on rows past the length
  int64_t B, H, T, dh, S, L, perm_kv;
  float scale;             // 1/√dh
  DType dtype;
};

struct SummaryBackwardParams {
  const void* grad_out;    // (B, H, T, dh)
  const void* out;         // (B, H, T, dh), the forward's output
  const float* lse;        // (B, H, T) float, the forward's
  const void* q_rot;       // (B, H, T, dh), read only when q_self.data is set
  const void* q;           // (B, H, T, dh), un-rotated
  const void* kc;          // (B, H, S, L, dh)
  const void* vc;          // (B, H, S, L, dh)
  const float* gate;       // (H,) float
  const int64_t* lengths;  // (B,) or nullptr
  void* dq;                // out (B, H, T, dh): the cross part's d q
  void* dkc;               // out (B, H, S, L, dh)
  void* dvc;               // out (B, H, S, L, dh)
  float* dgate;            // out (H,) float
  SelfTensor do_self;      // out: dO, zero past the length
  SelfTensor o_self;       // out: O^self = O − σ O^cross (zero past the length), for D = dO·O^self
  SelfTensor q_self;       // out when data is set: q_rot, zero past the length
  SelfLse lse_self;        // out: lse (0 past the length); columns ≥ T are left alone
  float* gate_part;        // workspace (B, H, backward_chunks(T)) float
  float* ckv_part;         // workspace (B, H, backward_chunks(T), 2, L, dh) float when S = 1, else unused
  int64_t B, H, T, dh, S, L, perm_kv;
  float scale;
  DType dtype;
};

cudaError_t launch_summary_forward(const SummaryForwardParams& p, cudaStream_t stream);
cudaError_t launch_summary_backward(const SummaryBackwardParams& p, cudaStream_t stream);

}  // namespace wiola::gcla
