// The wiola:: library and the schemas that belong to no public op (the Python module is
// csrc/python_module.cpp). Each public op declares its own schemas beside its CPU kernels, in a
// TORCH_LIBRARY_FRAGMENT(wiola, m) of csrc/cpu/<op>.cpp, so a new op edits no shared C++ file.
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
// have no autograd kernel of their own. Each op's block names, with set_python_module, the
// module that registers the op's Python half (torch imports it when a fake is needed first,
// and requires the fakes to come from there).
#include <torch/library.h>

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
