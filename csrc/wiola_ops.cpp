// Every wiola:: kernel schema, declared once, and the Python module `wiola_kernels._C`.
//
// These `_`-prefixed ops are the raw kernels (one implementation per backend, in
// csrc/cpu/<op>.cpp and csrc/cuda/<op>_binding.cpp). The public ops
// (torch.ops.wiola.rms_norm, ...) are defined in Python (wiola_kernels/ops/) so the
// package also works without this extension; they call these kernels when the
// dispatcher (wiola_kernels/dispatch.py) picks the `cpu` or `cuda` backend.
#include <torch/extension.h>

TORCH_LIBRARY_FRAGMENT(wiola, m) {
  // WiolaRMSNorm (SPEC §3) on contiguous x (rows, d); rstd is float32 (float64 for double x).
  m.def("_rms_norm_fwd(Tensor x, Tensor weight, Tensor shift, float eps) -> (Tensor y, Tensor rstd)");
  m.def("_rms_norm_bwd(Tensor grad_y, Tensor x, Tensor weight, Tensor shift, Tensor rstd)"
        " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_shift)");
  // SRPE (SPEC §4): q (B, H, T, dh), k (B, Hkv, T, dh), positions (B, T) int64;
  // angle_freq / radial_freq (dh/2,) float64. `transpose` applies R(p)^T (the backward).
  m.def("_srpe(Tensor q, Tensor k, Tensor positions, Tensor angle_freq, Tensor radial_freq,"
        " float radial_amplitude, bool transpose) -> (Tensor q_out, Tensor k_out)");
  // --- GCLA summary-augmented attention (SPEC §5.5) ---
  // --- ATM greedy adjacent merge (SPEC §6) ---
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "wiola_kernels compiled kernels (C++ CPU, and CUDA when built with it)";
#ifdef WIOLA_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}
