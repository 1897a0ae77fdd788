// The Python module `wiola_kernels._C`. Importing it loads this library, whose static
// initialisers register every wiola:: kernel with the dispatcher (csrc/cpu/<op>.cpp declares
// each op's schemas, csrc/wiola_ops.cpp the library's others; csrc/cpu and csrc/cuda implement them).
// pybind11 and c10's checks, not <torch/extension.h> (all of torch's C++ API: ~30 s of a
// compile for nothing this file uses). torch._C registers the translation of c10 errors to
// Python's (c10::ValueError → ValueError) with the pybind11 both modules share.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
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
  m.def("set_cpu_isa", &wiola::cpu::set_cpu_isa);
  m.def("_set_cpu_probe_cap", &wiola::cpu::set_cpu_probe_cap);
  // The levels, lowest first, and the table of which levels each CPU kernel implements (isa.h).
  m.def("isa_levels", [] {
    std::vector<std::string> names;
    for (Isa level : wiola::cpu::kIsaLevels) names.push_back(wiola::cpu::isa_name(level));
    return names;
  });
  m.def("kernel_isas", [] {
    std::vector<std::pair<std::string, std::vector<std::string>>> table;
    for (const auto& entry : wiola::cpu::kKernelIsas) {
      std::vector<std::string> names;
      for (size_t i = 0; i < entry.count; ++i) names.push_back(wiola::cpu::isa_name(entry.levels[i]));
      table.emplace_back(entry.kernel, std::move(names));
    }
    return table;
  });
  // The level a CPU kernel with several paths runs now, by kernel name.
  m.def("kernel_isa", [](const std::string& kernel) {
    for (const auto& entry : wiola::cpu::kKernelIsas)
      if (kernel == entry.kernel)
        return wiola::cpu::isa_name(wiola::cpu::choose_isa(entry.levels, entry.count, wiola::cpu::active_isa()));
    std::string names;
    for (const auto& entry : wiola::cpu::kKernelIsas) names += std::string(names.empty() ? "'" : ", '") + entry.kernel + "'";
    TORCH_CHECK_VALUE(false, "kernel must be one of ", names, ", got '", kernel, "'");
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
