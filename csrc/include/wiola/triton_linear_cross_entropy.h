// The launches of linear_cross_entropy's Triton kernels (wiola_kernels/triton/linear_cross_entropy.py),
// torch-free: the same launch configuration (_launch_config, _splits), chunking, workspace layout
// (_workspace) and arguments as the Python launchers lce_forward / lce_reduce, for the C++ CUDA
// kernel (csrc/cuda/triton_linear_cross_entropy_binding.cpp) and the test driver. What a call
// launches: the loss alone is _lce_logits_kernel over every row then _lce_rows_kernel; with
// gradients, per chunk of rows, logits (stored) → rows (the forward only) → _lce_dlogits_kernel
// → the ∂h GEMM → the ∂W GEMM (float32/float64) or _lce_dw_kernel (bf16/fp16, into a float32
// accumulator); "mean"/"sum" add _lce_reduce_kernel. The GEMMs are ATen's, not described here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "wiola/triton_glu.h"  // cdiv
#include "wiola/triton_table.h"

namespace wiola::triton::lce {

using glu::cdiv;

// Mirrors triton/linear_cross_entropy.py's constants.
constexpr int64_t kChunkBytes = int64_t{128} << 20;  // _CHUNK_BYTES
constexpr int64_t kMinChunkRows = 128;
constexpr int64_t kMaxChunkRows = 4096;
constexpr int64_t kProgramsPerSm = 4;  // _PROGRAMS_PER_SM
constexpr int64_t kRowsBlock = 256;    // rows per _lce_rows_kernel program
constexpr int64_t kReduceBlock = 1024;  // _REDUCE_BLOCK
constexpr int kDefaultWarps = 4;        // Triton's num_warps where the launcher sets none

struct Tiles {
  int64_t block_m, block_n, block_k;
  int num_warps, num_stages;
};

struct Config {
  Tiles logits, dw;
  int64_t ew_m, ew_n;  // rows × columns of a dlogits program
  int ew_warps;
  int64_t rows_block;  // rows per rows-kernel program
  int64_t chunk;       // rows per chunk (gradients)
  const char* precision;
};

// WIOLA_LCE_CHUNK_ROWS as _launch_config reads it: a positive decimal integer, else 0 (unset).
inline int64_t parse_chunk_override(const char* text) {
  if (text == nullptr || *text == '\0') return 0;
  int64_t v = 0;
  for (const char* p = text; *p != '\0'; ++p) {
    if (*p < '0' || *p > '9') return 0;
    v = std::min<int64_t>(v * 10 + (*p - '0'), int64_t{1} << 40);  // saturates: rows past any n
  }
  return v;
}

// _launch_config(n, V, d, dtype, sms) on a GPU; `dtype` is Triton's name of h's element type,
// `chunk_override` parse_chunk_override's answer.
inline Config launch_config(int64_t V, const std::string& dtype, int64_t chunk_override) {
  const bool f64 = dtype == "fp64", f32 = dtype == "fp32";
  Config c{};
  c.ew_m = 16, c.ew_n = 256, c.ew_warps = 8;
  if (f64) {
    c.logits = Tiles{32, 32, 16, 8, 1};
    c.dw = Tiles{32, 32, 16, 4, 1};
    c.ew_m = 8, c.ew_n = 128, c.ew_warps = 4;
  } else if (f32) {  // FMA products ("ieee"): register tiles, no tensor cores
    c.logits = c.dw = Tiles{64, 64, 16, 8, 2};
  } else {
    c.logits = Tiles{64, 128, 64, 8, 3};
    c.dw = Tiles{128, 128, 64, 8, 3};
  }
  const int64_t bm = c.logits.block_m;
  c.chunk = std::max(kMinChunkRows, std::min(kMaxChunkRows, kChunkBytes / (4 * V) / bm * bm));
  if (chunk_override > 0) c.chunk = std::max(bm, chunk_override / bm * bm);
  c.rows_block = kRowsBlock;
  c.precision = (f64 || f32) ? "ieee" : "tf32";
  return c;
}

// _splits: the vocabulary split of a logits launch over `rows` rows.
struct Split {
  int64_t splits, per;  // programs along axis 1, vocabulary columns per program
};

inline Split splits(int64_t rows, int64_t V, const Tiles& t, int64_t sms) {
  const int64_t row_blocks = cdiv(rows, t.block_m);
  const int64_t tiles_v = cdiv(V, t.block_n);
  const int64_t want = std::max<int64_t>(1, cdiv(kProgramsPerSm * sms, row_blocks));
  const int64_t per = cdiv(tiles_v, std::min(tiles_v, want)) * t.block_n;
  return {cdiv(V, per), per};
}

// One call's chunking and its workspace (_workspace, one allocation, in bytes, every part 256-byte
// aligned as a fresh tensor is): the float32/float64 logits buffer (rows_max, V) at 0, its dz in
// h's dtype at dz_offset (the buffer itself when the dtypes agree), the statistics (4, splits,
// rows) at stats_offset, and (bf16/fp16 with ∂W) the float32 ∂W accumulator (V, d) at
// dw_acc_offset. The loss alone (no gradients) needs only the statistics of one launch over
// every row.
struct Plan {
  Config cfg;
  bool chunked;        // gradients: rows in chunks, logits stored
  int64_t rows_max;    // rows of a full chunk (n without gradients)
  int64_t last_rows;   // rows of the last chunk
  int64_t chunks;
  Split full, last;    // splits of a full chunk and of the last
  int64_t dz_offset, stats_offset, dw_acc_offset, total;  // bytes; dw_acc_offset -1: none
};

inline int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// lce_forward's plan for n > 0 rows of width d, vocabulary V, h of `dtype` (element_size bytes),
// on a GPU of `sms` SMs; `chunked`: gradients wanted (or the backward's recomputation);
// `dw_acc`: ∂W wanted in bf16/fp16.
inline Plan plan(int64_t n, int64_t V, int64_t d, const std::string& dtype, int64_t element_size, int64_t sms,
                 bool chunked, bool dw_acc, int64_t chunk_override) {
  Plan p{};
  p.cfg = launch_config(V, dtype, chunk_override);
  p.chunked = chunked;
  const int64_t acc_size = dtype == "fp64" ? 8 : 4;
  p.dw_acc_offset = -1;
  if (!chunked) {
    p.rows_max = p.last_rows = n;
    p.chunks = 1;
    p.full = p.last = splits(n, V, p.cfg.logits, sms);
    p.dz_offset = p.stats_offset = 0;
    p.total = aligned(4 * p.full.splits * n * acc_size);
    return p;
  }
  p.rows_max = std::min(n, p.cfg.chunk);
  p.chunks = cdiv(n, p.rows_max);
  p.last_rows = n - (p.chunks - 1) * p.rows_max;
  p.full = splits(p.rows_max, V, p.cfg.logits, sms);
  p.last = splits(p.last_rows, V, p.cfg.logits, sms);
  const int64_t stats_numel = std::max(4 * p.full.splits * p.rows_max, 4 * p.last.splits * p.last_rows);
  const int64_t buf = aligned(p.rows_max * V * acc_size);
  const int64_t dz = element_size == acc_size ? 0 : aligned(p.rows_max * V * element_size);
  p.dz_offset = dz == 0 ? 0 : buf;
  p.stats_offset = buf + dz;
  p.total = p.stats_offset + aligned(stats_numel * acc_size);
  if (dw_acc) {
    p.dw_acc_offset = p.total;
    p.total += aligned(V * d * 4);
  }
  return p;
}

// A pointer and the Triton name of its element type.
struct Ptr {
  const void* p;
  const char* dtype;
};

inline Arg ptr_arg(const char* name, const Ptr& p) { return Arg::pointer(name, p.dtype, p.p); }

inline Arg constexpr_text(const char* name, const char* text) {
  return {Arg::Kind::kConstexpr, name, nullptr, 0, 0, 0.0, text};
}

// The operands every launch of one call shares: h (rows total, d) and W (V, d) with element
// strides, int64 labels (n,), the options.
struct Problem {
  Ptr h, W, y;
  const char* acc;  // "fp32" or "fp64"
  int64_t V, d, stride_hn, stride_hd, stride_wv, stride_wd;
  bool has_cap;
  double cap, eps, z_loss;
  int64_t ignore_index;
};

// _logits_launch: rows [row0, row0 + rows); `store` false: the loss alone (the statistics stand in
// for the logits).
inline Launch logits(const Problem& p, const Config& c, const Split& s, bool store, Ptr logits, Ptr stats,
                     int64_t row0, int64_t rows, bool want_sum) {
  const Tiles& t = c.logits;
  Launch l{"_lce_logits_kernel",
           {ptr_arg("h_ptr", p.h), ptr_arg("w_ptr", p.W), ptr_arg("y_ptr", p.y),
            ptr_arg("logits_ptr", store ? logits : stats), ptr_arg("stats_ptr", stats), Arg::integer("row0", row0),
            Arg::integer("rows", rows), Arg::integer("V", p.V), Arg::integer("d", p.d),
            Arg::integer("stride_hn", p.stride_hn), Arg::integer("stride_hd", p.stride_hd),
            Arg::integer("stride_wv", p.stride_wv), Arg::integer("stride_wd", p.stride_wd),
            Arg::integer("stride_l", store ? p.V : 0), Arg::real("cap", p.has_cap ? p.cap : 1.0),
            Arg::integer("v_per_split", s.per), Arg::constexpr_int("BLOCK_M", t.block_m),
            Arg::constexpr_int("BLOCK_N", t.block_n), Arg::constexpr_int("BLOCK_K", t.block_k),
            Arg::constexpr_bool("HAS_CAP", p.has_cap), Arg::constexpr_bool("STORE_LOGITS", store),
            Arg::constexpr_bool("WANT_SUM", want_sum), Arg::constexpr_bool("F64", std::strcmp(p.acc, "fp64") == 0),
            constexpr_text("PRECISION", c.precision), Arg::constexpr_bool("UPCAST", false)},
           t.num_warps, t.num_stages, cdiv(rows, t.block_m)};
  l.grid_y = s.splits;
  return l;
}

// _rows_launch: lse and the row losses of rows [row0, row0 + rows) from their statistics.
inline Launch rows(const Problem& p, const Config& c, int64_t splits, Ptr stats, Ptr lse, Ptr loss, int64_t row0,
                   int64_t rows, int num_stages) {
  return Launch{"_lce_rows_kernel",
                {ptr_arg("stats_ptr", stats), ptr_arg("y_ptr", p.y), ptr_arg("lse_ptr", lse), ptr_arg("loss_ptr", loss),
                 Arg::integer("row0", row0), Arg::integer("rows", rows), Arg::integer("splits", splits),
                 Arg::integer("V", p.V), Arg::integer("ignore_index", p.ignore_index), Arg::real("eps", p.eps),
                 Arg::real("z_loss", p.z_loss), Arg::constexpr_int("BLOCK_R", c.rows_block),
                 Arg::constexpr_bool("F64", std::strcmp(p.acc, "fp64") == 0)},
                kDefaultWarps, num_stages, cdiv(rows, c.rows_block)};
}

// _chunk_grads' first launch: dz (in h's dtype) of rows [row0, row0 + rows) from the chunk's
// logits; `has_row_grad` false: every row weighted 1 (lse stands in for g).
inline Launch dlogits(const Problem& p, const Config& c, Ptr logits, Ptr dz, Ptr lse, bool has_row_grad, Ptr g,
                      int64_t row0, int64_t rows, int num_stages) {
  Launch l{"_lce_dlogits_kernel",
           {ptr_arg("logits_ptr", logits), ptr_arg("dz_ptr", dz), ptr_arg("y_ptr", p.y), ptr_arg("lse_ptr", lse),
            ptr_arg("g_ptr", has_row_grad ? g : lse), Arg::integer("row0", row0), Arg::integer("rows", rows),
            Arg::integer("V", p.V), Arg::integer("stride_l", p.V), Arg::real("cap", p.has_cap ? p.cap : 1.0),
            Arg::integer("ignore_index", p.ignore_index), Arg::real("eps", p.eps), Arg::real("z_loss", p.z_loss),
            Arg::constexpr_int("BLOCK_M", c.ew_m), Arg::constexpr_int("BLOCK_N", c.ew_n),
            Arg::constexpr_bool("HAS_CAP", p.has_cap), Arg::constexpr_bool("HAS_ROW_GRAD", has_row_grad)},
           c.ew_warps, num_stages, cdiv(rows, c.ew_m)};
  l.grid_y = cdiv(p.V, c.ew_n);
  return l;
}

// _chunk_grads' ∂W for bf16/fp16: ∂W += dzᵀ h_chunk into the float32 accumulator (V, d).
inline Launch dw(const Problem& p, const Config& c, Ptr dz, Ptr acc, int64_t row0, int64_t rows, bool first) {
  const Tiles& t = c.dw;
  Launch l{"_lce_dw_kernel",
           {ptr_arg("dz_ptr", dz), ptr_arg("h_ptr", p.h), ptr_arg("acc_ptr", acc), Arg::integer("row0", row0),
            Arg::integer("rows", rows), Arg::integer("V", p.V), Arg::integer("d", p.d), Arg::integer("stride_l", p.V),
            Arg::integer("stride_hn", p.stride_hn), Arg::integer("stride_hd", p.stride_hd),
            Arg::constexpr_bool("FIRST", first), Arg::constexpr_int("BLOCK_M", t.block_m),
            Arg::constexpr_int("BLOCK_N", t.block_n), Arg::constexpr_int("BLOCK_K", t.block_k),
            Arg::constexpr_bool("UPCAST", false)},
           t.num_warps, t.num_stages, cdiv(p.V, t.block_m)};
  l.grid_y = cdiv(p.d, t.block_n);
  return l;
}

// lce_reduce: the forward's Σ rows (÷ the mean's divisor), or (`backward`) grad ÷ that divisor,
// into `out`; without `has_items` the divisor is the counted labels (the output stands in for
// items; a sum has none), the backward's `rows` is y, the forward's `grad` is out.
inline Launch reduce(Ptr rows, Ptr y, bool has_items, Ptr items, bool backward, Ptr grad, Ptr out, int64_t n,
                     int64_t ignore_index, bool mean, int num_stages) {
  has_items = has_items && mean;
  return Launch{"_lce_reduce_kernel",
                {ptr_arg("rows_ptr", backward ? y : rows), ptr_arg("y_ptr", y),
                 ptr_arg("items_ptr", has_items ? items : out), ptr_arg("g_ptr", backward ? grad : out),
                 ptr_arg("out_ptr", out), Arg::integer("n", n), Arg::integer("ignore_index", ignore_index),
                 Arg::constexpr_int("BLOCK", kReduceBlock), Arg::constexpr_bool("MEAN", mean),
                 Arg::constexpr_bool("HAS_ITEMS", has_items), Arg::constexpr_bool("BACKWARD", backward)},
                kDefaultWarps, num_stages, 1};
}

}  // namespace wiola::triton::lce
