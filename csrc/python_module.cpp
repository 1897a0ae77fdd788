// The Python module `wiola_kernels._C`. Importing it loads this library, whose static
// initialisers register every wiola:: kernel with the dispatcher (csrc/wiola_ops.cpp
// declares the schemas; csrc/cpu and csrc/cuda implement them).
// pybind11 and c10's checks, not <torch/extension.h> (all of torch's C++ API: ~30 s of a
// compile for nothing this file uses). torch._C registers the translation of c10 errors to
// Python's (c10::ValueError → ValueError) with the pybind11 both modules share.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "cpu/isa.h"
#ifdef WIOLA_WITH_CUDA
#include "wiola/triton_table.h"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "wiola_kernels compiled kernels (C++ CPU, and CUDA when built with it)";
#ifdef WIOLA_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  // The ops whose CUDA kernel is C++ launching the cubin table (csrc/cuda/triton_*_binding.cpp).
  m.attr("TRITON_CUDA_OPS") = std::vector<std::string>{"glu", "glu_backward", "rms_norm", "rms_norm_backward",
                                                            "add_rms_norm", "add_rms_norm_backward"};
  // The cubin table of this build: (Triton version or None, why there is none or None, entries).
  m.def("cubin_table", [] {
    const auto& t = wiola::triton::table();
    pybind11::object version = pybind11::none(), reason = pybind11::none();
    if (t.triton_version != nullptr) version = pybind11::str(t.triton_version);
    if (t.missing_reason != nullptr) reason = pybind11::str(t.missing_reason);
    return pybind11::make_tuple(version, reason, t.size);
  });
#else
  m.attr("WITH_CUDA") = false;
  m.attr("TRITON_CUDA_OPS") = std::vector<std::string>{};
#endif
  // The run-time ISA level of the CPU kernels' hot loops (csrc/cpu/isa.h).
  using wiola::cpu::Isa;
  m.def("cpu_isa", [] { return wiola::cpu::isa_name(wiola::cpu::active_isa()); });
  m.def("cpu_best_isa", [] { return wiola::cpu::isa_name(wiola::cpu::cpu_best_isa()); });
  // Whether RMSNorm's AVX-512 loops (they need AVX512_BF16) can run: the name's old meaning.
  m.def("cpu_has_avx512", [] { return wiola::cpu::cpu_best_isa() == Isa::kAvx512Bf16; });
  m.def("set_cpu_isa", &wiola::cpu::set_cpu_isa);
  m.def("_set_cpu_probe_cap", &wiola::cpu::set_cpu_probe_cap);
  // The level each CPU kernel with several paths runs now, by kernel name.
  m.def("kernel_isa", [](const std::string& kernel) {
    if (kernel == "decode_gemv") return wiola::cpu::isa_name(wiola::cpu::kernel_isa(wiola::cpu::kDecodeGemvIsas));
    if (kernel == "rms_norm" || kernel == "add_rms_norm")
      return wiola::cpu::isa_name(wiola::cpu::kernel_isa(wiola::cpu::kRmsNormIsas));
    if (kernel == "glu") return wiola::cpu::isa_name(wiola::cpu::kernel_isa(wiola::cpu::kGluIsas));
    if (kernel == "linear_cross_entropy")
      return wiola::cpu::isa_name(wiola::cpu::kernel_isa(wiola::cpu::kLinearCrossEntropyIsas));
    TORCH_CHECK_VALUE(false, "kernel must be 'decode_gemv', 'rms_norm', 'add_rms_norm', 'glu' or 'linear_cross_entropy', got '",
                      kernel, "'");
    return std::string();
  });
  // The pure decision (isa.h choose_isa) on level names, for tests.
  m.def("_choose_isa", [](const std::vector<std::string>& implemented, const std::string& chosen) {
    std::vector<Isa> levels;
    for (const auto& name : implemented) levels.push_back(wiola::cpu::parse_isa(name, "implemented"));
    TORCH_CHECK_VALUE(!levels.empty(), "implemented must name at least one level");
    const Isa want = wiola::cpu::parse_isa(chosen, "chosen");
    return wiola::cpu::isa_name(wiola::cpu::choose_isa(levels.data(), levels.size(), want));
  });
}
