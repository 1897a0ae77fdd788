// The schemas of the ops that have CUDA C++ kernels, written once: csrc/cpu/atm.cpp (ATM) and
// csrc/cpu/gcla_attention.cpp (GCLA and its summary kernels) declare them in the wiola
// namespace, the SIMT emulation's bindings (csrc/cuda/emu/bindings_emu.cpp) in wiola_cuda_emu,
// so the two cannot drift apart.
#pragma once

namespace wiola::schema {

// --- GCLA summary-augmented attention (SPEC §5.5): the public op, its CUDA kernel the composite
// of csrc/cuda/gcla_attention_binding.cpp, and the Python kernel that composite runs for the
// calls it does not take (wiola::_triton_gcla_attention*, the same arguments) ---
// q_rot, q (B, H, T, d_h); k_rot, v (B, H_kv, T, d_h); kc, vc (B, H, S, Λ', d_h), S in {1, T};
// gate (H,); lengths (B,) or None. out like q_rot; lse (B, H, T) float32 (float64 for double).
// Gradients in their inputs' layouts (d kc, d vc contiguous for S = 1).
#define WIOLA_GCLA_ATTENTION_SCHEMA                                                                    \
  "(Tensor q_rot, Tensor k_rot, Tensor v, Tensor q, Tensor kc, Tensor vc, Tensor gate,"              \
  " Tensor? lengths=None) -> (Tensor out, Tensor lse)"
#define WIOLA_GCLA_ATTENTION_BACKWARD_SCHEMA                                                           \
  "(Tensor grad_out, Tensor q_rot, Tensor k_rot, Tensor v, Tensor q, Tensor kc, Tensor vc, Tensor gate," \
  " Tensor? lengths, Tensor out, Tensor lse) -> (Tensor grad_q_rot, Tensor grad_k_rot, Tensor grad_v,"   \
  " Tensor grad_q, Tensor grad_kc, Tensor grad_vc, Tensor grad_gate)"
inline constexpr const char* kGclaAttention = "gcla_attention" WIOLA_GCLA_ATTENTION_SCHEMA;
inline constexpr const char* kGclaAttentionBackward = "gcla_attention_backward" WIOLA_GCLA_ATTENTION_BACKWARD_SCHEMA;
inline constexpr const char* kTritonGclaAttention = "_triton_gcla_attention" WIOLA_GCLA_ATTENTION_SCHEMA;
inline constexpr const char* kTritonGclaAttentionBackward =
    "_triton_gcla_attention_backward" WIOLA_GCLA_ATTENTION_BACKWARD_SCHEMA;
#undef WIOLA_GCLA_ATTENTION_SCHEMA
#undef WIOLA_GCLA_ATTENTION_BACKWARD_SCHEMA

// GCLA's summary kernels around a fused self-attention (CUDA; wiola/gcla_attention.h):
// o_self / lse_self are the fused attention's output and log-sum-exp with the query heads
// in the order p(h) = (h mod perm_kv)·(H/perm_kv) + h/perm_kv; out / lse are natural.
inline constexpr const char* kGclaSummaryFwd =
    "_gcla_summary_fwd(Tensor o_self, Tensor lse_self, Tensor q, Tensor kc, Tensor vc, Tensor gate,"
    " Tensor? lengths, int perm_kv) -> (Tensor out, Tensor lse)";
// The cross part's gradients, plus the fused backward's inputs in its head order: dO and
// O^self zeroed past the lengths, q_rot (when write_q_self, zeroed past the lengths; else
// an empty tensor) and lse with lse_columns ≥ T columns.
inline constexpr const char* kGclaSummaryBwd =
    "_gcla_summary_bwd(Tensor grad_out, Tensor out, Tensor lse, Tensor q_rot, Tensor q, Tensor kc, Tensor vc,"
    " Tensor gate, Tensor? lengths, int perm_kv, int lse_columns, bool write_q_self) -> (Tensor grad_q,"
    " Tensor grad_kc, Tensor grad_vc, Tensor grad_gate, Tensor do_self, Tensor o_self, Tensor q_self,"
    " Tensor lse_self)";
// --- ATM greedy adjacent merge (SPEC §6): the public ops, kernels on CPU and CUDA ---
// x (B, T, d); position_ids (B, T) / (1, T) / (T,) and lengths (B,) of an index dtype;
// threshold τ in [-1, 1]. merged (B, T, d): row b's T'_b tokens then zeros; merged_positions
// (B, T) int64 (0 after T'_b); merged_lengths (B,) int64 = T'_b; index_map (B, T) int64.
inline constexpr const char* kAtmMerge =
    "atm_merge(Tensor x, Tensor position_ids, float threshold, Tensor? lengths=None)"
    " -> (Tensor merged, Tensor merged_position_ids, Tensor merged_lengths, Tensor index_map)";
// grad_x[b, t] = w_t grad_merged[b, map[b, t]], w: 1/2 in a pair, 1 alone, 0 padding (map >= T'_b).
inline constexpr const char* kAtmMergeBackward =
    "atm_merge_backward(Tensor grad_merged, Tensor index_map, Tensor merged_lengths) -> Tensor grad_x";
// restored[b, t] = y[b, map[b, t]]; its backward sums the tokens of each slot, in token order.
inline constexpr const char* kAtmUnmerge = "atm_unmerge(Tensor y, Tensor index_map) -> Tensor restored";
inline constexpr const char* kAtmUnmergeBackward =
    "atm_unmerge_backward(Tensor grad_restored, Tensor index_map) -> Tensor grad_y";

}  // namespace wiola::schema
