// Every wiola:: op schema, declared once (the Python module is csrc/python_module.cpp).
//
// Each public op is `wiola::<op>` (forward) and `wiola::<op>_backward`, with one kernel per
// dispatch key, so PyTorch's dispatcher picks the kernel from the tensors' device as it does
// for a native op:
//   CPU  — the C++ kernels, csrc/cpu/<op>.cpp (each validates its inputs at entry, wiola/checks.h);
//   CUDA — the CUDA C++ kernels (csrc/cuda/<op>_binding.cpp), the launches of the Triton kernels
//          compiled ahead of time (csrc/cuda/triton_<op>_binding.cpp), or the Triton launchers
//          registered from Python (wiola_kernels/ops/<op>.py);
//   Meta — the fakes, registered from Python (wiola_kernels/ops/<op>.py).
// The torch.autograd.Function of each op (wiola_kernels/ops/<op>.py) drives the pair; the ops
// have no autograd kernel of their own. One block per op: its set_python_module names the
// module that registers the op's Python half (torch imports it when a fake is needed first,
// and requires the fakes to come from there).
#include <torch/library.h>

#include "wiola/cuda_schemas.h"

TORCH_LIBRARY(wiola, m) {
  // --- pieces of one backend, not public ops ---
  // Batch-1 decoding GEMV (csrc/cpu/decode_gemv.cpp; wiola_kernels/decode_gemv.py): x (..., K) with
  // <= 16 rows, float32/bfloat16/float16; weights (n_i, k_i) of one of those dtypes, read in place;
  // every k_i = K, or sum k_i = K with split_input -> (..., sum n_i) in x's dtype.
  m.def("_decode_gemv(Tensor x, Tensor[] weights, bool split_input=False) -> Tensor");
  // A cached decoding step's attention (csrc/cpu/decode_attention.cpp; wiola_kernels/decode_attention.py):
  // SRPE of q and k from qkv (B, (H + 2 H_kv) d_h), the rotated key and the value written into the
  // cache buffers (B, H_kv, capacity, d_h) at index past, GQA softmax over the past + 1 keys, plus
  // the gated context slots (B, slots, H d_h) -> (B, H d_h) in qkv's dtype.
  m.def("_decode_attention(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, int past, Tensor position_ids,"
        " int n_head, float theta, float spiral_divisor, float radial_amplitude, float radial_frequency,"
        " Tensor? context_k=None, Tensor? context_v=None, Tensor? gate=None) -> Tensor");
  // One block of a cached decoding step (csrc/cpu/decode_block.cpp; wiola_kernels/decode_block.py): x, normed
  // (B, 1, d); weights [W_Q, W_K, W_V, W_O, W_Kc, W_Vc, W_n1, W_n3, W_w1, W_w3, W_n2, W_w2]; the block's
  // ffn norm and the next norm (None: none); the cache buffers as for _decode_attention; context (B, 1,
  // slots, d); summary_sum (B, d) float32 or None -> (x_out, next-normed x_out or empty, new summary sum
  // or empty, summary (B, 1, d) or empty).
  m.def("_decode_block(Tensor x, Tensor normed, Tensor[] weights, Tensor ffn_norm_weight, Tensor? ffn_norm_shift,"
        " float ffn_norm_eps, Tensor? next_norm_weight, Tensor? next_norm_shift, float next_norm_eps, Tensor beta,"
        " Tensor gate, Tensor(a!) k_cache, Tensor(b!) v_cache, int past, Tensor position_ids, int n_head,"
        " float theta, float spiral_divisor, float radial_amplitude, float radial_frequency, Tensor? context,"
        " Tensor? summary_sum) -> (Tensor, Tensor, Tensor, Tensor)");
  // A whole cached decoding step (csrc/cpu/decode_step.cpp; wiola_kernels/decode_step.py): input_ids (B, 1),
  // the embedding (V, d); per layer the 12 weights of _decode_block, the gate, β and the cache buffers; the
  // norms [WRMSNorm_0, WRMSNorm'_0, WRMSNorm_1, ..., final]; the running summary sums of every layer but the
  // last (lookback > 0) -> (logits (B, 1, V), the new summary sums).
  m.def("_decode_step(Tensor input_ids, Tensor embed_weight, Tensor[] weights, Tensor[] norm_weights,"
        " Tensor?[] norm_shifts, float[] norm_eps, Tensor[] betas, Tensor[] gates, Tensor(a!)[] k_caches,"
        " Tensor(b!)[] v_caches, int past, Tensor position_ids, int n_head, float theta, float spiral_divisor,"
        " float radial_amplitude, float radial_frequency, int lookback, Tensor[] summary_sums, Tensor head_weight)"
        " -> (Tensor, Tensor[])");
  // The benchmark's copy baseline: a copy allocated like every kernel's output.
  m.def("_copy(Tensor x) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(wiola, m) {
  // --- WiolaRMSNorm (SPEC §3) ---
  m.set_python_module("wiola_kernels.ops.rms_norm");
  // x (..., d), any strides; weight, shift (d,) any float dtype, shift None: δ = 0 (no add,
  // grad_shift None); hf_order: Hugging Face's rounding order (z/r rounded to x's dtype, then
  // times weight). y like x (contiguous); rstd x.shape[:-1], float32 (float64 for double x).
  m.def("rms_norm(Tensor x, Tensor weight, Tensor? shift, float eps=1e-06, bool hf_order=False)"
        " -> (Tensor y, Tensor rstd)");
  m.def("rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor? shift, Tensor rstd)"
        " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");
  // The Python Triton launchers (CUDA only, registered from Python), which the C++ CUDA kernel
  // (csrc/cuda/triton_rms_norm_binding.cpp) runs where the cubin table has no variant for a call.
  m.def("_triton_rms_norm(Tensor x, Tensor weight, Tensor? shift, float eps=1e-06, bool hf_order=False)"
        " -> (Tensor y, Tensor rstd)");
  m.def("_triton_rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor? shift, Tensor rstd)"
        " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");

}

TORCH_LIBRARY_FRAGMENT(wiola, m) {
  // --- Residual add + WiolaRMSNorm (SPEC §10.3) ---
  m.set_python_module("wiola_kernels.ops.add_rms_norm");
  // x, residual (..., d) of one dtype, any strides; weight, shift, eps, hf_order as for rms_norm.
  // s = x + residual rounded to x's dtype, y = rms_norm(s): y, s contiguous like x; rstd as for
  // rms_norm. The backward takes grad_s None when no gradient reached s; grad_x is the gradient
  // of x and of residual alike.
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, Tensor? shift, float eps=1e-06,"
        " bool hf_order=False) -> (Tensor y, Tensor s, Tensor rstd)");
  m.def("add_rms_norm_backward(Tensor grad_y, Tensor? grad_s, Tensor s, Tensor weight, Tensor? shift,"
        " Tensor rstd) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");
  // The Python Triton launchers, as rms_norm's (csrc/cuda/triton_rms_norm_binding.cpp).
  m.def("_triton_add_rms_norm(Tensor x, Tensor residual, Tensor weight, Tensor? shift, float eps=1e-06,"
        " bool hf_order=False) -> (Tensor y, Tensor s, Tensor rstd)");
  m.def("_triton_add_rms_norm_backward(Tensor grad_y, Tensor? grad_s, Tensor s, Tensor weight, Tensor? shift,"
        " Tensor rstd) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");
}

TORCH_LIBRARY_FRAGMENT(wiola, m) {
  // --- Gated activations (SPEC §10.2) ---
  m.set_python_module("wiola_kernels.ops.glu");
  // y = act(a) ⊙ b, activation "silu" or "gelu_tanh". a, b (..., n), one dtype, any strides with
  // a unit last stride (the halves of one projection's output are read in place); or b None and
  // a (..., 2n) holding [a | b]. y (..., n) contiguous. Gradients contiguous: grad_a, grad_b of
  // a's shape, or for b None grad_a (..., 2n) = [∂a | ∂b] and grad_b None.
  m.def("glu(Tensor a, Tensor? b, str activation=\"silu\") -> Tensor");
  m.def("glu_backward(Tensor grad_y, Tensor a, Tensor? b, str activation) -> (Tensor grad_a, Tensor grad_b)");
  // The Python Triton launchers of glu (CUDA only, registered from Python): where the cubin table
  // has no variant for a call, the C++ CUDA kernel (csrc/cuda/triton_glu_binding.cpp) runs these.
  m.def("_triton_glu(Tensor a, Tensor? b, str activation) -> Tensor");
  m.def("_triton_glu_backward(Tensor grad_y, Tensor a, Tensor? b, str activation) -> (Tensor grad_a, Tensor grad_b)");
}

TORCH_LIBRARY_FRAGMENT(wiola, m) {
  // --- SRPE (SPEC §4) ---
  m.set_python_module("wiola_kernels.ops.srpe");
  // q (B, H, T, d_h), k (B, H_kv, T, d_h), any strides; position_ids (B, T) / (1, T) / (T,) of
  // an index dtype. Outputs laid out like torch.empty_like(q) / (k). The backward applies
  // R(p)ᵀ to the incoming gradients (rotation by −Θ scaled by r).
  // inv_freq: given per-pair frequencies ω_j (d_h/2,), used in float64 in place of
  // θ₀^(−2j/d_h) (a Hugging Face rope type's); scale: the output scale m (y = m R(p) q).
  m.def("srpe(Tensor q, Tensor k, Tensor position_ids, float theta=10000.0, float spiral_divisor=8.0,"
        " float radial_amplitude=0.1, float radial_frequency=0.01, Tensor? inv_freq=None, float scale=1.0)"
        " -> (Tensor q_out, Tensor k_out)");
  m.def("srpe_backward(Tensor grad_q, Tensor grad_k, Tensor position_ids, float theta, float spiral_divisor,"
        " float radial_amplitude, float radial_frequency, Tensor? inv_freq=None, float scale=1.0)"
        " -> (Tensor grad_q_in, Tensor grad_k_in)");
  // The Python Triton launchers of srpe (CUDA only, registered from Python): where the cubin tables
  // have no variant for a call, the C++ CUDA kernel (csrc/cuda/triton_srpe_binding.cpp) runs these.
  m.def("_triton_srpe(Tensor q, Tensor k, Tensor position_ids, float theta=10000.0, float spiral_divisor=8.0,"
        " float radial_amplitude=0.1, float radial_frequency=0.01, Tensor? inv_freq=None, float scale=1.0)"
        " -> (Tensor q_out, Tensor k_out)");
  m.def("_triton_srpe_backward(Tensor grad_q, Tensor grad_k, Tensor position_ids, float theta, float spiral_divisor,"
        " float radial_amplitude, float radial_frequency, Tensor? inv_freq=None, float scale=1.0)"
        " -> (Tensor grad_q_in, Tensor grad_k_in)");

}

TORCH_LIBRARY_FRAGMENT(wiola, m) {
  // --- GCLA summary-augmented attention (SPEC §5.5) ---
  m.set_python_module("wiola_kernels.ops.gcla_attention");
  // q_rot, q (B, H, T, d_h); k_rot, v (B, H_kv, T, d_h); kc, vc (B, H, S, Λ', d_h), S in {1, T};
  // gate (H,); lengths (B,) or None. out like q_rot; lse (B, H, T) float32 (float64 for double).
  // Gradients in their inputs' layouts (d kc, d vc contiguous for S = 1).
  m.def("gcla_attention(Tensor q_rot, Tensor k_rot, Tensor v, Tensor q, Tensor kc, Tensor vc, Tensor gate,"
        " Tensor? lengths=None) -> (Tensor out, Tensor lse)");
  m.def("gcla_attention_backward(Tensor grad_out, Tensor q_rot, Tensor k_rot, Tensor v, Tensor q, Tensor kc,"
        " Tensor vc, Tensor gate, Tensor? lengths, Tensor out, Tensor lse) -> (Tensor grad_q_rot,"
        " Tensor grad_k_rot, Tensor grad_v, Tensor grad_q, Tensor grad_kc, Tensor grad_vc, Tensor grad_gate)");

}

TORCH_LIBRARY_FRAGMENT(wiola, m) {
  // The cuda backend of GCLA: summary kernels around PyTorch's fused self-attention
  // (CUDA, and emulated as wiola_cuda_emu); not a public op.
  m.set_python_module("wiola_kernels.ops.gcla_attention_cuda");
  m.def(wiola::schema::kGclaSummaryFwd);
  m.def(wiola::schema::kGclaSummaryBwd);
}

TORCH_LIBRARY_FRAGMENT(wiola, m) {
  // --- Linear cross-entropy (SPEC §10.1) ---
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
}

// --- ATM greedy adjacent merge / unmerge (SPEC §6): wiola/cuda_schemas.h, shared with the
// SIMT emulation's bindings (csrc/cuda/emu/bindings_emu.cpp) ---
TORCH_LIBRARY_FRAGMENT(wiola, m) {
  m.set_python_module("wiola_kernels.ops.atm");
  m.def(wiola::schema::kAtmMerge);
  m.def(wiola::schema::kAtmMergeBackward);
  m.def(wiola::schema::kAtmUnmerge);
  m.def(wiola::schema::kAtmUnmergeBackward);
}
