// The torch bindings of the CUDA kernels (csrc/cuda/*_binding.cpp), compiled for the SIMT
// emulator: the same argument checks on CPU tensors, kernels from csrc/cuda/emu/*_emu.cpp,
// registered as torch.ops.wiola_cuda_emu.* (backend cuda_emu, wiola_kernels/dispatch.py).
// One translation unit for both bindings: the torch headers are parsed once.
#define WIOLA_CUDA_EMU 1
#include "../atm_binding.cpp"
#include "../gcla_attention_binding.cpp"

// The schemas of csrc/wiola_ops.cpp (tests/test_cuda_emu.py checks that they agree).
TORCH_LIBRARY(wiola_cuda_emu, m) {
  m.def("_gcla_summary_fwd(Tensor o_self, Tensor lse_self, Tensor q, Tensor kc, Tensor vc, Tensor gate,"
        " Tensor? lengths, int perm_kv) -> (Tensor out, Tensor lse)");
  m.def("_gcla_summary_bwd(Tensor grad_out, Tensor out, Tensor lse, Tensor q_rot, Tensor q, Tensor kc, Tensor vc,"
        " Tensor gate, Tensor? lengths, int perm_kv, int lse_columns, bool write_q_self) -> (Tensor grad_q,"
        " Tensor grad_kc, Tensor grad_vc, Tensor grad_gate, Tensor do_self, Tensor o_self, Tensor q_self,"
        " Tensor lse_self)");
  m.def("_atm_merge(Tensor x, Tensor positions, Tensor lengths, float threshold)"
        " -> (Tensor merged, Tensor merged_positions, Tensor merged_lengths, Tensor index_map)");
  m.def("_atm_merge_bwd(Tensor grad_merged, Tensor index_map, Tensor merged_lengths) -> Tensor grad_x");
  m.def("_atm_unmerge(Tensor y, Tensor index_map) -> Tensor restored");
  m.def("_atm_unmerge_bwd(Tensor grad_restored, Tensor index_map) -> Tensor grad_y");
}
