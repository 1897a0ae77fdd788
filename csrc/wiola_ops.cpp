// Every wiola:: kernel schema, declared once (the Python module is csrc/python_module.cpp).
//
// These `_`-prefixed ops are the raw kernels (one implementation per backend, in
// csrc/cpu/<op>.cpp and csrc/cuda/<op>_binding.cpp). The public ops
// (torch.ops.wiola.rms_norm, ...) are defined in Python (wiola_kernels/ops/) so the
// package also works without this extension; they call these kernels when the
// dispatcher (wiola_kernels/dispatch.py) picks the `cpu` or `cuda` backend.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(wiola, m) {
  // WiolaRMSNorm (SPEC §3) on contiguous x (rows, d); rstd is float32 (float64 for double x).
  // shift = None: δ = 0 (grad_shift is then an empty (0,) tensor); hf_order: Hugging Face's
  // rounding order (z/r rounded to x's dtype, then times weight).
  m.def("_rms_norm_fwd(Tensor x, Tensor weight, Tensor? shift, float eps, bool hf_order=False)"
        " -> (Tensor y, Tensor rstd)");
  m.def("_rms_norm_bwd(Tensor grad_y, Tensor x, Tensor weight, Tensor? shift, Tensor rstd)"
        " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");
  // SRPE (SPEC §4): q (B, H, T, dh), k (B, Hkv, T, dh), positions (B, T) int64;
  // angle_freq / radial_freq (dh/2,) float64. `transpose` applies R(p)^T (the backward).
  m.def("_srpe(Tensor q, Tensor k, Tensor positions, Tensor angle_freq, Tensor radial_freq,"
        " float radial_amplitude, bool transpose) -> (Tensor q_out, Tensor k_out)");
  // The benchmark's copy baseline: a copy allocated like every kernel's output.
  m.def("_copy(Tensor x) -> Tensor");
  // --- GCLA summary-augmented attention (SPEC §5.5) ---
  // q_rot, q (B, H, T, dh); k_rot, v (B, H_kv, T, dh); kc, vc (B, H, S, L, dh), S in {1, T};
  // gate (H,); lengths (B,) int64 or None. lse (B, H, T) float32 (float64 for double inputs).
  m.def("_gcla_attention_fwd(Tensor q_rot, Tensor k_rot, Tensor v, Tensor q, Tensor kc, Tensor vc,"
        " Tensor gate, Tensor? lengths) -> (Tensor out, Tensor lse)");
  m.def("_gcla_attention_bwd(Tensor grad_out, Tensor q_rot, Tensor k_rot, Tensor v, Tensor q, Tensor kc,"
        " Tensor vc, Tensor gate, Tensor? lengths, Tensor out, Tensor lse) -> (Tensor grad_q_rot,"
        " Tensor grad_k_rot, Tensor grad_v, Tensor grad_q, Tensor grad_kc, Tensor grad_vc, Tensor grad_gate)");
  // GCLA's summary kernels around a fused self-attention (CUDA; wiola/gcla_attention.h):
  // o_self / lse_self are the fused attention's output and log-sum-exp with the query heads
  // in the order p(h) = (h mod perm_kv)·(H/perm_kv) + h/perm_kv; out / lse are natural.
  m.def("_gcla_summary_fwd(Tensor o_self, Tensor lse_self, Tensor q, Tensor kc, Tensor vc, Tensor gate,"
        " Tensor? lengths, int perm_kv) -> (Tensor out, Tensor lse)");
  // The cross part's gradients, plus the fused backward's inputs in its head order: dO and
  // O^self zeroed past the lengths, q_rot (when write_q_self, zeroed past the lengths; else
  // an empty tensor) and lse with lse_columns ≥ T columns.
  m.def("_gcla_summary_bwd(Tensor grad_out, Tensor out, Tensor lse, Tensor q_rot, Tensor q, Tensor kc, Tensor vc,"
        " Tensor gate, Tensor? lengths, int perm_kv, int lse_columns, bool write_q_self) -> (Tensor grad_q,"
        " Tensor grad_kc, Tensor grad_vc, Tensor grad_gate, Tensor do_self, Tensor o_self, Tensor q_self,"
        " Tensor lse_self)");
  // --- ATM greedy adjacent merge (SPEC §6) ---
  // x (B, T, d) contiguous; positions (B, T), lengths (B,) int64; threshold τ in [-1, 1].
  // merged (B, T, d): row b's T'_b tokens then zeros; merged_positions (B, T) int64 (0 after
  // T'_b); merged_lengths (B,) int64 = T'_b; index_map (B, T) int64 (token -> merged slot).
  m.def("_atm_merge(Tensor x, Tensor positions, Tensor lengths, float threshold)"
        " -> (Tensor merged, Tensor merged_positions, Tensor merged_lengths, Tensor index_map)");
  // grad_x[b, t] = w_t grad_merged[b, map[b, t]], w: 1/2 in a pair, 1 alone, 0 padding (map >= T'_b).
  m.def("_atm_merge_bwd(Tensor grad_merged, Tensor index_map, Tensor merged_lengths) -> Tensor grad_x");
  // restored[b, t] = y[b, map[b, t]]; its backward sums the tokens of each slot, in token order.
  m.def("_atm_unmerge(Tensor y, Tensor index_map) -> Tensor restored");
  m.def("_atm_unmerge_bwd(Tensor grad_restored, Tensor index_map) -> Tensor grad_y");
}
