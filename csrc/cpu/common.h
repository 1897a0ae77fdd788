// Helpers shared by the C++ CPU kernels.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "wiola/empty_output.h"
#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace wiola::cpu {

using wiola::advise_huge_pages;
using wiola::empty_output;  // wiola/empty_output.h, shared with the CUDA bindings
using wiola::empty_output_like;

// Element strides of the (B, heads, T) dimensions of a (B, heads, T, d_h) tensor whose last
// dimension is contiguous: row (b, h, t) starts at b·sb + h·sh + t·st.
struct RowStrides {
  int64_t sb = 0, sh = 0, st = 0;
  RowStrides() = default;
  explicit RowStrides(const at::Tensor& x) : sb(x.stride(0)), sh(x.stride(1)), st(x.stride(2)) {}
  int64_t operator()(int64_t b, int64_t h, int64_t t) const { return b * sb + h * sh + t * st; }
};

// A (B, heads, T, d_h) tensor the kernels can read row by row: d_h contiguous.
inline bool rows_contiguous(const at::Tensor& x) { return x.dim() == 4 && (x.size(3) <= 1 || x.stride(3) == 1); }

// Accumulation type: double stays double, every other float type computes in float.
template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// The same rule for a tensor's dtype: float64 stays float64, every other float computes in float32.
inline at::ScalarType acc_scalar_type(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// dst[i] = (acc_t) src[i], vectorised for the reduced-precision types.
template <typename scalar_t, typename acc_t>
inline void load_row(const scalar_t* src, acc_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    std::memcpy(dst, src, n * sizeof(acc_t));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// dst[i] = (scalar_t) src[i].
template <typename acc_t, typename scalar_t>
inline void store_row(const acc_t* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    std::memcpy(dst, src, n * sizeof(acc_t));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// Float outputs too large to stay in cache are written with non-temporal stores: they
// skip the read-for-ownership of every output line, which brings a streaming op to copy
// speed (docs/performance.md). Small outputs keep ordinary stores so their consumer finds them in
// cache. Streaming needs 32-byte-aligned rows; kernels that stream call stream_fence()
// before returning.
constexpr int64_t kStreamMinBytes = int64_t(16) << 20;

template <typename scalar_t>
inline bool use_streaming_stores(const scalar_t* out, int64_t out_bytes, int64_t row_elems) {
#if defined(CPU_CAPABILITY_AVX2)
  return std::is_same_v<scalar_t, float> && out_bytes >= kStreamMinBytes && row_elems % 8 == 0 &&
         reinterpret_cast<uintptr_t>(out) % 32 == 0;
#else
  (void)out, (void)out_bytes, (void)row_elems;
  return false;
#endif
}

// v.store(p), non-temporal when kStream (float only; p 32-byte aligned).
template <bool kStream, typename acc_t>
inline void store_vec(const at::vec::Vectorized<acc_t>& v, acc_t* p) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kStream && std::is_same_v<acc_t, float>) {
    _mm256_stream_ps(p, v);
    return;
  }
#endif
  v.store(p);
}

inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

#define WIOLA_CHECK_ARG(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

}  // namespace wiola::cpu
