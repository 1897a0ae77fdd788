// Output allocation of every kernel binding, written once: the C++ CPU kernels
// (csrc/cpu/*.cpp, through csrc/cpu/common.h) and the CUDA bindings (csrc/cuda/*_binding.cpp,
// which must not pull in the CPU kernels' SIMD headers). ATen only.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace wiola {

// Large CPU outputs are freshly mapped memory whose first-touch page faults can cost more
// than the writes themselves (docs/performance.md). Ask for transparent huge pages before the
// kernel's first write. Only a hint: ignored where THP is off; 2 MiB-aligned interior only.
inline void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  if (!t.is_cpu() || t.nbytes() < 4 * kHuge) return;  // device memory is not the process's pages
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + static_cast<uintptr_t>(t.nbytes())) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

// Fills a fresh output with NaN (floats) or -1 (integers) when the environment set
// WIOLA_POISON_OUTPUTS=1 at the first allocation (read once, as wiola_kernels/outputs.py reads
// it at import: no environment lookup per call), so a test sees any element a kernel skips.
inline void poison_if_requested(at::Tensor& out) {
  static const bool poison = [] {
    const char* flag = std::getenv("WIOLA_POISON_OUTPUTS");
    return flag != nullptr && flag[0] != '\0' && std::strcmp(flag, "0") != 0;
  }();
  if (poison) {
    if (at::isFloatingType(out.scalar_type())) {
      out.fill_(std::numeric_limits<double>::quiet_NaN());
    } else {
      out.fill_(-1);
    }
  }
}

// torch.empty for kernel outputs (with the huge-page hint above), poisoned on request.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
  advise_huge_pages(out);
  poison_if_requested(out);
  return out;
}

// empty_output with the strides of x (torch.empty_like's preserve_format: a dense x such as
// a transposed (B, T, H, d_h) view keeps its memory order, anything else comes out
// contiguous), so a kernel's output takes the layout of its input and the op that
// consumes it needs no copy. The Python fakes use torch.empty_like too: same strides.
inline at::Tensor empty_output_like(const at::Tensor& x) {
  at::Tensor out = at::empty_like(x);
  advise_huge_pages(out);  // dense: nbytes() is its whole extent
  poison_if_requested(out);
  return out;
}

}  // namespace wiola
