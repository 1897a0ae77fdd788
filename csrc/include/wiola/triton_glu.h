// The launches of glu's Triton kernels (wiola_kernels/triton/glu.py), torch-free: the same
// launch configuration (_launch_config) and arguments as the Python launchers glu_fwd /
// glu_bwd, for the C++ CUDA kernel (csrc/cuda/triton_ops_binding.cpp) and the test binary.
#pragma once

#include <algorithm>
#include <cstdint>

#include "wiola/triton_table.h"

namespace wiola::triton::glu {

// Mirrors triton/glu.py's constants.
constexpr int64_t kBytesPerThreadRow = 16;
constexpr int64_t kBytesPerThreadStep = 64;
constexpr int64_t kProgramsPerSm = 8;
constexpr int64_t kMaxWarps = 4;

struct Config {
  int64_t block_n, rows_per_step, num_warps, programs;
};

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t next_power_of_2(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// _launch_config(rows, n, element_size, loads, sms) on a GPU (sms > 0).
inline Config launch_config(int64_t rows, int64_t n, int64_t element_size, int64_t loads, int64_t sms) {
  const int64_t per_thread = std::max<int64_t>(1, kBytesPerThreadRow / element_size);
  const int64_t block_n = std::min(next_power_of_2(std::max<int64_t>(n, 1)), per_thread * 32 * kMaxWarps);
  const int64_t num_warps = std::max<int64_t>(1, std::min(kMaxWarps, block_n / (32 * per_thread)));
  const int64_t rows_per_step = std::max<int64_t>(1, kBytesPerThreadStep / (kBytesPerThreadRow * loads));
  const int64_t tiles = cdiv(rows, rows_per_step) * cdiv(n, block_n);
  const int64_t programs = std::max<int64_t>(1, std::min(tiles, sms * kProgramsPerSm));
  return {block_n, rows_per_step, num_warps, programs};
}

// The operands of one call: pointers (a and b already the row views the kernel reads),
// Triton's element type name, the element size, the row count, width and row strides.
struct Forward {
  const char* dtype;
  int64_t element_size;
  bool fp64;
  int act;  // 0 SiLU, 1 GELU_tanh
  const void *a, *b, *y;
  int64_t rows, n, stride_a, stride_b;
};

struct Backward {
  const char* dtype;
  int64_t element_size;
  bool fp64;
  int act;
  const void *g, *a, *b, *da, *db;
  int64_t rows, n, stride_g, stride_a, stride_b, stride_d;
};

// glu_fwd's launch of _glu_fwd_kernel.
inline Launch forward(const Forward& f, int64_t sms, int num_stages) {
  const Config c = launch_config(f.rows, f.n, f.element_size, 2, sms);
  return Launch{"_glu_fwd_kernel",
                {Arg::pointer("a_ptr", f.dtype, f.a), Arg::pointer("b_ptr", f.dtype, f.b),
                 Arg::pointer("y_ptr", f.dtype, f.y), Arg::integer("rows", f.rows), Arg::integer("n", f.n),
                 Arg::integer("stride_a", f.stride_a), Arg::integer("stride_b", f.stride_b),
                 Arg::constexpr_int("ROWS_PER_STEP", c.rows_per_step), Arg::constexpr_int("BLOCK_N", c.block_n),
                 Arg::constexpr_int("ACT", f.act), Arg::constexpr_bool("IS_FP64", f.fp64)},
                static_cast<int>(c.num_warps), num_stages, c.programs};
}

// glu_bwd's launch of _glu_bwd_kernel.
inline Launch backward(const Backward& b, int64_t sms, int num_stages) {
  const Config c = launch_config(b.rows, b.n, b.element_size, 3, sms);
  return Launch{"_glu_bwd_kernel",
                {Arg::pointer("g_ptr", b.dtype, b.g), Arg::pointer("a_ptr", b.dtype, b.a),
                 Arg::pointer("b_ptr", b.dtype, b.b), Arg::pointer("da_ptr", b.dtype, b.da),
                 Arg::pointer("db_ptr", b.dtype, b.db), Arg::integer("rows", b.rows), Arg::integer("n", b.n),
                 Arg::integer("stride_g", b.stride_g), Arg::integer("stride_a", b.stride_a),
                 Arg::integer("stride_b", b.stride_b), Arg::integer("stride_d", b.stride_d),
                 Arg::constexpr_int("ROWS_PER_STEP", c.rows_per_step), Arg::constexpr_int("BLOCK_N", c.block_n),
                 Arg::constexpr_int("ACT", b.act), Arg::constexpr_bool("IS_FP64", b.fp64)},
                static_cast<int>(c.num_warps), num_stages, c.programs};
}

}  // namespace wiola::triton::glu
