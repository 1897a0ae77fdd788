// SIMT emulation of CUDA's device side for the wiola kernels, test-only.
// A .cu includes this instead of the CUDA headers when compiled as host C++ with
// -DWIOLA_CUDA_EMU; the kernel bodies stay unchanged. The runtime (fibers, scheduler,
// checks) is csrc/cuda/emu/runtime.cpp.
//
// Semantics, and where the device may differ:
// * __syncthreads is a real block barrier. Every thread of the block must reach it: a
//   thread that exited while others wait is reported (undefined on the device), and so
//   are threads that wait at different __syncthreads calls (a barrier in divergent code).
// * Warp collectives (__shfl*_sync, __ballot_sync, __any_sync, __all_sync, __syncwarp)
//   pair up the k-th call of each lane named in the mask; a named lane that exited,
//   waits at a barrier, or calls another collective/mask is reported, as is a lane that
//   reads a lane outside the mask. Only __syncwarp / __syncthreads order memory.
// * __nv_bfloat16 / __half convert with round-to-nearest-even, NaN -> canonical NaN
//   (0x7fff), exactly as cuda_bf16.hpp / cuda_fp16.hpp.
// * Fast-math: __expf/expf/logf are libm (the device's ex2.approx/lg2.approx path is
//   ~2 ulp plus ~2^-21·|x| for __expf) and '/' is IEEE division (fast-math: ≤ 2 ulp).
//   Tests therefore use the SPEC §9 tolerances, orders of magnitude above these ulp-level
//   differences. Subnormal float32 results are flushed as under the device's -ftz=true:
//   the fibers run with MXCSR FTZ (runtime.h: flush_to_zero, WIOLA_EMU_FTZ=0 keeps them).
//   bf16/fp16 conversions are bit manipulations, exact for subnormals either way.
// * Thread order: the threads of a block run one at a time between meeting points, in the
//   order of the launch's schedule (runtime.h: forward, reverse or a seeded shuffle per
//   meeting point; WIOLA_EMU_SCHEDULE). A kernel whose result depends on it has a race.
// * Memory is the host's: there is no global/shared address-space check (TSan and the
//   poisoned outputs of the tests catch stale or missing writes); dynamic shared memory
//   is poisoned with 0xFF (NaN) at the start of every block. Buffers from device_alloc
//   (runtime.h: what the cuda_emu bindings and the C++ tests hand to kernels) end at a
//   guard page; a memory fault in a kernel is a device fault of the launch, as
//   cudaErrorIllegalAddress. A vector access (wiola/cuda_vector.cuh: vector_cast) must
//   be aligned to its size, as on the device (cudaErrorMisalignedAddress).
#pragma once

#include <math.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "runtime.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
// `thread_local` at block scope implies static: one copy per OS worker thread, and a
// worker runs one block at a time, so this is per-block memory. `extern __shared__ T a[];`
// becomes a block-scope extern thread_local declaration of a variable that the including
// TU defines, before the kernels, with WIOLA_EMU_EXTERN_SHARED.
#define __shared__ thread_local

namespace wiola_emu {

struct ThreadInfo {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
extern __thread ThreadInfo* tls_thread;  // the fiber running on this OS thread

enum class Collective : int { kShfl, kShflXor, kShflUp, kShflDown, kBallot, kAny, kAll, kSyncWarp };

// `site`: the __syncthreads call (file:line); every thread of a block must wait at the same one.
void syncthreads(const char* site);
// A device fault of the running thread's block (the launch throws with `what`); outside a
// kernel, std::runtime_error.
[[noreturn]] void device_fault(const std::string& what);
[[noreturn]] void misaligned_access(const void* p, size_t bytes);
int tls_init_anchor();  // returns 0, opaque to the compiler (WIOLA_EMU_EXTERN_SHARED)
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width);

template <typename T>
__forceinline__ uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffled types are at most 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T>
__forceinline__ T from_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

constexpr size_t kMaxDynamicSharedBytes = kMaxSmemPerBlock;

// --- launch ------------------------------------------------------------------------
template <typename... KArgs, typename... Args>
void launch_typed(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  static_assert(sizeof...(KArgs) == sizeof...(Args), "wrong number of kernel arguments");
  const std::tuple<std::decay_t<KArgs>...> params(static_cast<std::decay_t<KArgs>>(std::forward<Args>(args))...);
  launch(reinterpret_cast<const void*>(kernel), grid, block, smem, stream,
         [&params, kernel] { std::apply(kernel, params); });  // each thread gets its own copies
}

// --- bfloat16 / half: storage types with the device's conversions -------------------
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t(0x7fffu)};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                   // round to nearest, ties to even
  return {uint16_t(u >> 16)};
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }

// CUDA's vector types that the kernels use (wiola/cuda_vector.cuh), with their alignment.
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

inline float __half2float(__half h) {
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu, man = h.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: value = man · 2^-24, exact in float
    const float v = float(man) * 0x1p-24f;
    std::memcpy(&u, &v, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __half __float2half_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return {uint16_t(0x7fffu)};  // NaN
  if (a >= 0x477ff000u) return {uint16_t(sign | 0x7c00u)};  // ≥ 65520 rounds to Inf
  if (a >= 0x38800000u) {  // normal half (≥ 2^-14)
    const uint32_t r = a - 0x38000000u;  // rebias 127 -> 15, still with 23 mantissa bits
    const uint32_t h = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
    return {uint16_t(sign | h)};
  }
  if (a <= 0x33000000u) return {sign};  // ≤ 2^-25: rounds to ±0 (a tie at 2^-25 goes to even 0)
  // subnormal half: value / 2^-24 rounded to nearest even integer
  const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // value = m · 2^(e-150); half units 2^-24 -> m >> (126 - e)
  const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half_ulp = 1u << (shift - 1u);
  const uint32_t h = q + ((rem > half_ulp || (rem == half_ulp && (q & 1u))) ? 1u : 0u);
  return {uint16_t(sign | h)};
}

// A vector access of `bytes` (a power of two) at p: the device faults unless p is a
// multiple of it (csrc/include/wiola/cuda_vector.cuh calls this for every vector cast).
__forceinline__ void check_vector_alignment(const void* p, size_t bytes) {
  if ((reinterpret_cast<uintptr_t>(p) & (bytes - 1)) != 0) misaligned_access(p, bytes);
}

// --- bit casts and fast-math intrinsics (IEEE on the host, see the header comment) ---
inline float __int_as_float(int v) { return from_bits<float>(uint32_t(v)); }
inline int __float_as_int(float v) { return int(uint32_t(to_bits(v))); }
inline float __uint_as_float(unsigned v) { return from_bits<float>(v); }
inline unsigned __float_as_uint(float v) { return unsigned(to_bits(v)); }
inline double __longlong_as_double(long long v) { return from_bits<double>(uint64_t(v)); }
inline long long __double_as_longlong(double v) { return (long long)to_bits(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(unsigned(v)); }
inline int __clzll(long long v) { return v == 0 ? 64 : __builtin_clzll((unsigned long long)v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
// glibc declares (but does not export) its own __expf / __logf: macros take precedence.
inline float fast_expf(float x) { return ::expf(x); }
inline float fast_logf(float x) { return ::logf(x); }
#define __expf(x) ::wiola_emu::fast_expf(x)
#define __logf(x) ::wiola_emu::fast_logf(x)
inline float __fdividef(float a, float b) { return a / b; }
// The _rn intrinsics are never contracted into an FMA on the device: the barrier keeps
// the host compiler (which contracts under -march=x86-64-v3) from fusing them either.
template <typename T>
__forceinline__ T rounded(T r) {
#if defined(__x86_64__)
  asm("" : "+x"(r));
#else
  asm volatile("" : "+m"(r));
#endif
  return r;
}
inline float __fmul_rn(float a, float b) { return rounded(a * b); }
inline float __fadd_rn(float a, float b) { return rounded(a + b); }
inline double __dmul_rn(double a, double b) { return rounded(a * b); }
inline double __dadd_rn(double a, double b) { return rounded(a + b); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
// CUDA's global integer min/max overloads.
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }

// --- barriers and warp collectives --------------------------------------------------
// A macro, so that each call names its own site: threads of a block that wait at different
// __syncthreads calls (a barrier in divergent code: undefined on the device, reported by
// compute-sanitizer synccheck) are a device fault.
#define WIOLA_EMU_STR2(x) #x
#define WIOLA_EMU_STR(x) WIOLA_EMU_STR2(x)
#define __syncthreads() ::wiola_emu::syncthreads(__FILE__ ":" WIOLA_EMU_STR(__LINE__))
inline void __syncwarp(unsigned mask = 0xffffffffu) { warp_collective(Collective::kSyncWarp, mask, 0, 0, 32); }
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return from_bits<T>(warp_collective(Collective::kShfl, mask, to_bits(var), src_lane, width));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return from_bits<T>(warp_collective(Collective::kShflXor, mask, to_bits(var), lane_mask, width));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return from_bits<T>(warp_collective(Collective::kShflUp, mask, to_bits(var), int(delta), width));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return from_bits<T>(warp_collective(Collective::kShflDown, mask, to_bits(var), int(delta), width));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return unsigned(warp_collective(Collective::kBallot, mask, pred != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int pred) {
  return int(warp_collective(Collective::kAny, mask, pred != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int pred) {
  return int(warp_collective(Collective::kAll, mask, pred != 0, 0, 32));
}

}  // namespace wiola_emu

#define threadIdx (::wiola_emu::tls_thread->thread_idx)
#define blockIdx (::wiola_emu::tls_thread->block_idx)
#define blockDim (::wiola_emu::tls_thread->block_dim)
#define gridDim (::wiola_emu::tls_thread->grid_dim)

// Defines the storage of `extern __shared__ type name[];` for the kernels of the enclosing
// namespace: write it in the kernels' namespace before including the .cu (a definition
// seen first has no dynamic initialisation to guard).
// (GCC 12 calls the TU's __tls_init for a block-scope extern thread_local but emits it only
// when some thread_local of the TU has a dynamic initialiser: the anchor provides one.)
#define WIOLA_EMU_EXTERN_SHARED(type, name)                                                           \
  alignas(16) thread_local type name[::wiola_emu::kMaxDynamicSharedBytes / sizeof(type)];             \
  [[maybe_unused]] thread_local int name##_wiola_emu_tls_anchor = ::wiola_emu::tls_init_anchor();       \
  [[maybe_unused]] const bool name##_wiola_emu_registered = (::wiola_emu::register_dynamic_shared([] {  \
    (void)name##_wiola_emu_tls_anchor; /* runs __tls_init on the worker, before any fiber */           \
    return static_cast<void*>(name);                                                                    \
  }),                                                                                                   \
                                                             true)

#include "cub_block_scan.h"
