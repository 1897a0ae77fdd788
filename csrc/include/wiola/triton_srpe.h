// The launch of srpe's Triton kernel (wiola_kernels/triton/srpe.py), torch-free: the same launch
// configuration (_launch_config) and arguments as the Python launcher srpe_apply, for the C++
// CUDA kernel (csrc/cuda/triton_srpe_binding.cpp) and the test driver. One launch serves both
// directions (TRANSPOSE: the backward's R(p)ᵀ) and both Q and K.
#pragma once

#include <algorithm>
#include <cstdint>

#include "wiola/triton_glu.h"  // cdiv, next_power_of_2
#include "wiola/triton_table.h"

namespace wiola::triton::srpe {

using glu::cdiv;
using glu::next_power_of_2;

// Mirrors triton/srpe.py's constants.
constexpr int64_t kHeadsPerStep = 4;
constexpr int64_t kProgramsPerSm = 4;
constexpr int64_t kMaxWarps = 8;

struct Config {
  int64_t block_t, block_half, heads_per_step, num_warps, programs;
};

// _launch_config(bt, half, element_size, sms) on a GPU (sms > 0).
inline Config launch_config(int64_t bt, int64_t half, int64_t element_size, int64_t sms) {
  const int64_t block_half = next_power_of_2(half);
  const int64_t per_thread = std::max<int64_t>(1, 16 / element_size);
  const int64_t max_t = std::max<int64_t>(1, kMaxWarps * 32 * per_thread / block_half);
  const int64_t block_t = std::max<int64_t>(1, std::min(next_power_of_2(cdiv(bt, kProgramsPerSm * sms)), max_t));
  const int64_t num_warps = std::max<int64_t>(1, std::min(kMaxWarps, block_t * block_half / (32 * per_thread)));
  return {block_t, block_half, kHeadsPerStep, num_warps, cdiv(bt, block_t)};
}

// The operands of one call: q (B, H, T, d_h) and k (B, H_kv, T, d_h) with unit last stride (the
// incoming gradients for the backward), int64 positions (B, T), the float64 tables ω (d_h/2,)
// and the 6 constants, the outputs; element strides of positions (b, t) and of q, k and the
// outputs (b, head, t).
struct Call {
  const char* dtype;   // Triton's name of q's element type
  int64_t element_size;
  bool fp64, transpose;
  const void *q, *k, *positions, *omega, *constants, *q_out, *k_out;
  int64_t B, T, H, H_kv, half;
  int64_t pos_sb, pos_st;
  int64_t q_s[3], k_s[3], qo_s[3], ko_s[3];
};

// srpe_apply's launch of _srpe_kernel.
inline Launch launch(const Call& c, int64_t sms, int num_stages) {
  const Config cfg = launch_config(c.B * c.T, c.half, c.element_size, sms);
  return Launch{"_srpe_kernel",
                {Arg::pointer("q_ptr", c.dtype, c.q), Arg::pointer("k_ptr", c.dtype, c.k),
                 Arg::pointer("pos_ptr", "i64", c.positions), Arg::pointer("omega_ptr", "fp64", c.omega),
                 Arg::pointer("const_ptr", "fp64", c.constants), Arg::pointer("q_out_ptr", c.dtype, c.q_out),
                 Arg::pointer("k_out_ptr", c.dtype, c.k_out), Arg::integer("BT", c.B * c.T), Arg::integer("T", c.T),
                 Arg::integer("H", c.H), Arg::integer("H_KV", c.H_kv), Arg::integer("HALF", c.half),
                 Arg::integer("pos_sb", c.pos_sb), Arg::integer("pos_st", c.pos_st), Arg::integer("q_sb", c.q_s[0]),
                 Arg::integer("q_sh", c.q_s[1]), Arg::integer("q_st", c.q_s[2]), Arg::integer("k_sb", c.k_s[0]),
                 Arg::integer("k_sh", c.k_s[1]), Arg::integer("k_st", c.k_s[2]), Arg::integer("qo_sb", c.qo_s[0]),
                 Arg::integer("qo_sh", c.qo_s[1]), Arg::integer("qo_st", c.qo_s[2]), Arg::integer("ko_sb", c.ko_s[0]),
                 Arg::integer("ko_sh", c.ko_s[1]), Arg::integer("ko_st", c.ko_s[2]),
                 Arg::constexpr_int("BLOCK_T", cfg.block_t), Arg::constexpr_int("BLOCK_HALF", cfg.block_half),
                 Arg::constexpr_bool("TRANSPOSE", c.transpose), Arg::constexpr_bool("F64", c.fp64),
                 Arg::constexpr_int("HEADS_PER_STEP", cfg.heads_per_step)},
                static_cast<int>(cfg.num_warps), num_stages, cfg.programs};
}

}  // namespace wiola::triton::srpe
