// The benchmark's copy baseline on the CPU: a parallel memcpy into an output allocated
// exactly like every kernel's (wiola::cpu::empty_output, huge-page hint included), so
// "% of copy" compares an op with a copy that pays the same first-touch cost.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

namespace wiola::cpu {
namespace {

at::Tensor copy(const at::Tensor& x) {
  WIOLA_CHECK_ARG(x.is_contiguous(), "x must be contiguous");
  at::Tensor out = empty_output(x.sizes(), x.options());
  const auto* src = static_cast<const char*>(x.const_data_ptr());
  auto* dst = static_cast<char*>(out.mutable_data_ptr());
  constexpr int64_t kChunk = int64_t(1) << 20;  // bytes per task
  const int64_t nbytes = static_cast<int64_t>(x.nbytes());
  at::parallel_for(0, (nbytes + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * kChunk, hi = std::min(nbytes, end * kChunk);
    std::memcpy(dst + lo, src + lo, hi - lo);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(wiola, CPU, m) { m.impl("_copy", &copy); }

}  // namespace wiola::cpu
