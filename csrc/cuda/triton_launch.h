// Launching the ahead-of-time compiled Triton kernels (the cubin table,
// csrc/include/wiola/triton_table.h) from C++ on the current CUDA stream, at the cost of a
// cuLaunchKernel. The driver is reached through its entry points, obtained from the CUDA
// runtime when first needed (nothing links libcuda at build time, and the extension
// imports where no driver exists). Each cubin is loaded once per device, lazily on its
// first launch and never while the stream is being captured into a CUDA graph.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "wiola/triton_table.h"

namespace wiola::triton {

// The Triton element type name of a tensor's dtype ("bf16", "fp32", ...).
const char* dtype_name(const at::Tensor& t);

// The SM count of `device` (read once per device).
int64_t sm_count(int device);

// The compute capability of `device` as a number (90), read once per device.
int arch(int device);

// The table's variant of `launch` for `device`'s architecture, or nullptr with the reason in
// `why` (no table in this build, no driver, no such variant).
const Variant* lookup(const Launch& launch, int device, std::string& why);

// Launches `variant` (lookup's answer for `launch`) on `device`'s current stream and returns
// true; false (nothing launched, the reason in `why`) where the driver refuses its cubin.
// Errors of the launch itself, and a module that must be loaded while the stream captures, raise.
bool launch(const Variant& variant, const Launch& launch, int device, std::string& why);

// lookup, then launch: true when launched; false (nothing launched, the reason in `why`) when
// the table has no variant or its cubin does not load (the caller then runs the Python Triton
// launcher).
bool launch(const Launch& launch, int device, std::string& why);

}  // namespace wiola::triton
