// The torch bindings of the CUDA kernels (csrc/cuda/*_binding.cpp), compiled for the SIMT
// emulator: the same argument checks on CPU tensors, kernels from csrc/cuda/emu/*_emu.cpp,
// registered as torch.ops.wiola_cuda_emu.* (backend cuda_emu, wiola_kernels/dispatch.py):
// GCLA's composite too (PyTorch's CPU flash attention around the emulated summary kernels).
// One translation unit for both bindings: the torch headers are parsed once.
#define WIOLA_CUDA_EMU 1
#include "../atm_binding.cpp"
#include "../gcla_attention_binding.cpp"
#include "wiola/cuda_schemas.h"

// The same schemas as csrc/cpu/atm.cpp and csrc/cpu/gcla_attention.cpp declare in wiola (one
// source: wiola/cuda_schemas.h), with their fakes in the same Python modules (torch.compile of a
// use_backend("cuda_emu") block).
TORCH_LIBRARY(wiola_cuda_emu, m) {
  m.set_python_module("wiola_kernels.ops.gcla_attention");
  m.def(wiola::schema::kGclaAttention);
  m.def(wiola::schema::kGclaAttentionBackward);
  m.def(wiola::schema::kGclaSummaryFwd);
  m.def(wiola::schema::kGclaSummaryBwd);
}

TORCH_LIBRARY_FRAGMENT(wiola_cuda_emu, m) {
  m.set_python_module("wiola_kernels.ops.atm");
  m.def(wiola::schema::kAtmMerge);
  m.def(wiola::schema::kAtmMergeBackward);
  m.def(wiola::schema::kAtmUnmerge);
  m.def(wiola::schema::kAtmUnmergeBackward);
}
