// The launches of rms_norm's and add_rms_norm's Triton kernels (wiola_kernels/triton/rms_norm.py),
// torch-free: the same launch configuration (_launch_config) and arguments as the Python
// launchers norm_fwd / norm_bwd, for the C++ CUDA kernels (csrc/cuda/triton_rms_norm_binding.cpp)
// and the test binary. Every pointer carries its own dtype: the kernels read γ and δ in their
// stored dtypes (the variant is looked up by them) and take the accumulation dtype from
// rstd_ptr's. The forward is one launch; the backward two: _rms_norm_bwd_kernel into per-program
// partials, then _norm_partials_sum_kernel writing ∂γ and ∂δ in γ's and δ's dtypes.
#pragma once

#include <algorithm>
#include <cstdint>

#include "wiola/triton_glu.h"  // cdiv, next_power_of_2
#include "wiola/triton_table.h"

namespace wiola::triton::rms_norm {

using glu::cdiv;
using glu::next_power_of_2;

// Mirrors triton/rms_norm.py's constants.
constexpr int64_t kBytesPerThreadRow = 16;
constexpr int64_t kBytesPerThreadStep = 64;
constexpr int64_t kProgramsPerSm = 4;
constexpr int64_t kMaxWarps = 16;
constexpr int64_t kMaxRowBytesPerThread = 32;
constexpr int64_t kMaxWideWarps = 8;  // warps walking a wide row (_MAX_WIDE_WARPS)
// _norm_partials_sum_kernel's launch: _SUM_BLOCK_D columns per program, _SUM_BLOCK_P partial
// rows per step, _SUM_WARPS warps.
constexpr int64_t kSumBlockD = 32;
constexpr int64_t kSumBlockP = 64;
constexpr int kSumWarps = 4;

struct Config {
  int64_t block_d, rows_per_step, num_warps, programs;
  bool wide;
};

// _launch_config(rows, d, element_size, loads_per_row, sms) on a GPU (sms > 0).
inline Config launch_config(int64_t rows, int64_t d, int64_t element_size, int64_t loads_per_row, int64_t sms) {
  int64_t block_d = next_power_of_2(d);
  const int64_t per_thread = std::max<int64_t>(1, kBytesPerThreadRow / element_size);
  int64_t num_warps = std::min(kMaxWarps, std::max<int64_t>(1, block_d / (32 * per_thread)));
  int64_t row_bytes_per_thread = std::max(kBytesPerThreadRow, block_d * element_size / (32 * num_warps));
  const bool wide = row_bytes_per_thread > kMaxRowBytesPerThread;
  if (wide) {
    num_warps = std::min(num_warps, kMaxWideWarps);
    block_d = 32 * num_warps * per_thread;
    row_bytes_per_thread = kBytesPerThreadRow;
  }
  int64_t rows_per_step =
      std::max<int64_t>(1, std::min<int64_t>(16, cdiv(kBytesPerThreadStep, row_bytes_per_thread * loads_per_row)));
  if (wide) rows_per_step = 1;
  const int64_t steps = cdiv(rows, rows_per_step);
  return {block_d, rows_per_step, num_warps, std::min(steps, sms * kProgramsPerSm), wide};
}

// A pointer and the Triton name of its element type.
struct Ptr {
  const void* p;
  const char* dtype;
};

// norm_fwd's launch: x (rows, d) contiguous; residual / sum present for add_rms_norm (else x
// and y stand in, as in Python); shift absent: w stands in.
struct Forward {
  Ptr x, residual, sum, w, shift, y, rstd;
  int64_t element_size, rows, d;
  double eps;
  bool fp64, has_shift, hf_order, has_residual;
};

inline Launch forward(const Forward& f, int64_t sms, int num_stages) {
  const Config c = launch_config(f.rows, f.d, f.element_size, f.has_residual ? 2 : 1, sms);
  return Launch{"_rms_norm_fwd_kernel",
                {Arg::pointer("x_ptr", f.x.dtype, f.x.p), Arg::pointer("r_ptr", f.residual.dtype, f.residual.p),
                 Arg::pointer("sum_ptr", f.sum.dtype, f.sum.p), Arg::pointer("w_ptr", f.w.dtype, f.w.p),
                 Arg::pointer("s_ptr", f.shift.dtype, f.shift.p), Arg::pointer("y_ptr", f.y.dtype, f.y.p),
                 Arg::pointer("rstd_ptr", f.rstd.dtype, f.rstd.p), Arg::integer("rows", f.rows),
                 Arg::integer("d", f.d), Arg::real("eps", f.eps), Arg::constexpr_int("ROWS_PER_STEP", c.rows_per_step),
                 Arg::constexpr_int("BLOCK_D", c.block_d), Arg::constexpr_bool("IS_FP64", f.fp64),
                 Arg::constexpr_bool("WIDE", c.wide), Arg::constexpr_bool("HAS_SHIFT", f.has_shift),
                 Arg::constexpr_bool("HF_ORDER", f.hf_order), Arg::constexpr_bool("HAS_RESIDUAL", f.has_residual)},
                static_cast<int>(c.num_warps), num_stages, c.programs};
}

// norm_bwd's first launch: the partials are slices of one buffer laid out by partials_layout;
// grad_s absent: g stands in; shift absent: w and dw_partial stand in.
struct Backward {
  Ptr g, grad_s, x, w, shift, rstd, dx, dw_partial, ds_partial;
  int64_t element_size, rows, d;
  bool has_shift, has_grad_s;
};

inline Config backward_config(int64_t rows, int64_t d, int64_t element_size, bool has_grad_s, int64_t sms) {
  return launch_config(rows, d, element_size, has_grad_s ? 3 : 2, sms);
}

// norm_bwd's one accumulation-dtype buffer for both partials, in elements: ∂γ's (programs, d) at
// 0, δ's at ds_offset = cdiv(programs·d, 4)·4 (a 16-byte boundary, as the compiled variants
// assume of every pointer); without δ only ∂γ's (ds_offset 0: ds_partial = dw_partial).
struct Partials {
  int64_t size, ds_offset, total;
};

inline Partials partials_layout(int64_t programs, int64_t d, bool has_shift) {
  const int64_t size = programs * d;
  const int64_t stride = cdiv(size, 4) * 4;
  return has_shift ? Partials{size, stride, stride + size} : Partials{size, 0, size};
}

inline Launch backward(const Backward& b, int64_t sms, int num_stages) {
  const Config c = backward_config(b.rows, b.d, b.element_size, b.has_grad_s, sms);
  return Launch{"_rms_norm_bwd_kernel",
                {Arg::pointer("g_ptr", b.g.dtype, b.g.p), Arg::pointer("gs_ptr", b.grad_s.dtype, b.grad_s.p),
                 Arg::pointer("x_ptr", b.x.dtype, b.x.p), Arg::pointer("w_ptr", b.w.dtype, b.w.p),
                 Arg::pointer("s_ptr", b.shift.dtype, b.shift.p), Arg::pointer("rstd_ptr", b.rstd.dtype, b.rstd.p),
                 Arg::pointer("dx_ptr", b.dx.dtype, b.dx.p),
                 Arg::pointer("dw_partial_ptr", b.dw_partial.dtype, b.dw_partial.p),
                 Arg::pointer("ds_partial_ptr", b.ds_partial.dtype, b.ds_partial.p), Arg::integer("rows", b.rows),
                 Arg::integer("d", b.d), Arg::constexpr_int("ROWS_PER_STEP", c.rows_per_step),
                 Arg::constexpr_int("BLOCK_D", c.block_d), Arg::constexpr_bool("WIDE", c.wide),
                 Arg::constexpr_bool("HAS_SHIFT", b.has_shift), Arg::constexpr_bool("HAS_GRAD_S", b.has_grad_s)},
                static_cast<int>(c.num_warps), num_stages, c.programs};
}

// norm_bwd's second launch: the column sums of the partials of `programs` (the first launch's
// grid) rows into dw (γ's dtype) and ds (δ's dtype); shift absent: dw stands in for ds.
struct PartialsSum {
  Ptr dw_partial, ds_partial, dw, ds;
  int64_t programs, d;
  bool has_shift;
};

inline Launch partials_sum(const PartialsSum& p, int num_stages) {
  return Launch{"_norm_partials_sum_kernel",
                {Arg::pointer("dw_partial_ptr", p.dw_partial.dtype, p.dw_partial.p),
                 Arg::pointer("ds_partial_ptr", p.ds_partial.dtype, p.ds_partial.p),
                 Arg::pointer("dw_ptr", p.dw.dtype, p.dw.p), Arg::pointer("ds_ptr", p.ds.dtype, p.ds.p),
                 Arg::integer("programs", p.programs), Arg::integer("d", p.d),
                 Arg::constexpr_int("BLOCK_P", kSumBlockP), Arg::constexpr_int("BLOCK_D", kSumBlockD),
                 Arg::constexpr_bool("HAS_SHIFT", p.has_shift)},
                kSumWarps, num_stages, cdiv(p.d, kSumBlockD)};
}

}  // namespace wiola::triton::rms_norm
