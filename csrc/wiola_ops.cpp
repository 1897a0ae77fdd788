// Every wiola:: kernel schema, declared once (the Python module is csrc/python_module.cpp).
//
// These `_`-prefixed ops are the raw kernels (one implementation per backend, in
// csrc/cpu/<op>.cpp and csrc/cuda/<op>_binding.cpp). The public ops
// (torch.ops.wiola.rms_norm, ...) are defined in Python (wiola_kernels/ops/) so the
// package also works without this extension; they call these kernels when the
// dispatcher (wiola_kernels/dispatch.py) picks the `cpu` or `cuda` backend.
#include <torch/library.h>

#include "wiola/cuda_schemas.h"

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
  // Batch-1 decoding GEMV (csrc/cpu/decode_gemv.cpp; wiola_kernels/decode_gemv.py packs):
  // x (G, rows ≤ 16, k) float32, packed (G, ceil(n/32), k, 32) float32 -> (G, rows, n);
  // isa: "auto", "avx512", "avx2" or "generic".
  m.def("_decode_gemv(Tensor x, Tensor packed, int n, str isa=\"auto\") -> Tensor");
  // --- GCLA summary-augmented attention (SPEC §5.5) ---
  // q_rot, q (B, H, T, dh); k_rot, v (B, H_kv, T, dh); kc, vc (B, H, S, L, dh), S in {1, T};
  // gate (H,); lengths (B,) int64 or None. lse (B, H, T) float32 (float64 for double inputs).
  m.def("_gcla_attention_fwd(Tensor q_rot, Tensor k_rot, Tensor v, Tensor q, Tensor kc, Tensor vc,"
        " Tensor gate, Tensor? lengths) -> (Tensor out, Tensor lse)");
  m.def("_gcla_attention_bwd(Tensor grad_out, Tensor q_rot, Tensor k_rot, Tensor v, Tensor q, Tensor kc,"
        " Tensor vc, Tensor gate, Tensor? lengths, Tensor out, Tensor lse) -> (Tensor grad_q_rot,"
        " Tensor grad_k_rot, Tensor grad_v, Tensor grad_q, Tensor grad_kc, Tensor grad_vc, Tensor grad_gate)");
  // GCLA's summary kernels and ATM: their schemas live in wiola/cuda_schemas.h (shared with
  // the SIMT emulation's bindings, csrc/cuda/emu/bindings_emu.cpp).
  m.def(wiola::schema::kGclaSummaryFwd);
  m.def(wiola::schema::kGclaSummaryBwd);
  m.def(wiola::schema::kAtmMerge);
  m.def(wiola::schema::kAtmMergeBwd);
  m.def(wiola::schema::kAtmUnmerge);
  m.def(wiola::schema::kAtmUnmergeBwd);
}
