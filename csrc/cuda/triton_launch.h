// Launching the ahead-of-time compiled Triton kernels (the cubin table,
// csrc/include/wiola/triton_table.h) from C++ on the current CUDA stream, at the cost of a
// cuLaunchKernel. The driver is reached through its entry points, obtained from the CUDA
// runtime when first needed (nothing links libcuda at build time, and the extension
// imports where no driver exists). Each cubin is loaded once per device, lazily on its
// first launch and never while the stream is being captured into a CUDA graph.
#pragma once

#include <ATen/core/Tensor.h>

#include <mutex>
#include <string>

#include "wiola/triton_table.h"

namespace wiola::triton {

// The Triton element type name of a tensor's dtype ("bf16", "fp32", ...).
const char* dtype_name(const at::Tensor& t);

// The SM count of `device` (read once per device).
int64_t sm_count(int device);

// The compute capability of `device` as a number (90), read once per device.
int arch(int device);

// A variant of the static table or of the runtime table (registered by the Python launcher),
// with its per-device functions.
struct Kernel;

// The variant of `launch` for `device`'s architecture, static table first, or nullptr with the
// reason in `why` (no driver, no such variant). A missing variant's key is added to this thread's
// pending() list, for the Python launcher that runs instead to register what it compiles.
const Kernel* lookup(const Launch& launch, int device, std::string& why);

// Launches `kernel` (lookup's answer for `launch`) on `device`'s current stream and returns
// true; false (nothing launched, the reason in `why`) where the driver refuses its cubin, or a
// runtime variant's module is not yet loaded while the stream captures. Errors of the launch
// itself, and a static variant's module that must be loaded while the stream captures, raise.
bool launch(const Kernel& kernel, const Launch& launch, int device, std::string& why);

// lookup, then launch: true when launched; false (nothing launched, the reason in `why`) when
// neither table has the variant or its cubin does not load (the caller then runs the Python
// Triton launcher).
bool launch(const Launch& launch, int device, std::string& why);

// Loads a just-registered runtime variant's module on `device` unless its current stream is
// being captured (then its first launch outside a capture loads it); a refusal is kept.
void preload(const RuntimeVariant& variant, int device);

// The one-time warning of an op that runs its Python Triton launcher instead: nothing when the
// miss is pending (the launcher compiles the variant and registers it, or warns why it cannot).
void warn_fallback(std::once_flag& once, const char* op, const std::string& why);

}  // namespace wiola::triton
