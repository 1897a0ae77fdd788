// The Python module `wiola_kernels._C`. Importing it loads this library, whose static
// initialisers register every wiola:: kernel with the dispatcher (csrc/wiola_ops.cpp
// declares the schemas; csrc/cpu and csrc/cuda implement them).
#include <torch/extension.h>

#include "cpu/isa.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "wiola_kernels compiled kernels (C++ CPU, and CUDA when built with it)";
#ifdef WIOLA_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  // The run-time ISA of the CPU kernels' hot loops (csrc/cpu/isa.h); Python checks the name.
  m.def("cpu_isa", [] { return wiola::cpu::isa_name(wiola::cpu::active_isa()); });
  m.def("cpu_has_avx512", &wiola::cpu::cpu_has_avx512);
  m.def("set_cpu_isa", &wiola::cpu::set_cpu_isa);
}
