// The Python module `wiola_kernels._C`. Importing it loads this library, whose static
// initialisers register every wiola:: kernel with the dispatcher (csrc/wiola_ops.cpp
// declares the schemas; csrc/cpu and csrc/cuda implement them).
#include <torch/extension.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "wiola_kernels compiled kernels (C++ CPU, and CUDA when built with it)";
#ifdef WIOLA_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}
