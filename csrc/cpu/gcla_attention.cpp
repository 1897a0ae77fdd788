// GCLA summary-augmented attention on the CPU (SPEC §5.5), FlashAttention-2 style.
//
//   O_i = Σ_j softmax_j(c q̃_i·k̃_j) v_j  +  σ(g_h) Σ_λ softmax_λ(c q_i·kc_iλ) vc_iλ,   c = 1/√d_h
//
// Head h reads kv group h mod H_kv; keys j ≤ i and j < len_b; rows i ≥ len_b are 0.
//
// The entry points check the tensors and fill a params struct (pointers, strides, shape,
// scale) once; every pass below reads that struct. The tile products and the K/V packs
// they read are in tile_gemm.h.
//
// Row-block passes (the forward, backward pass A) run one task per (b, chunk of heads,
// query block of kBlockQ rows), at::parallel_for over them. A task gathers the rows of its
// heads into a contiguous scratch in address order and writes its outputs the same way (on
// the model's transposed (B, T, H, d_h) views a per-head walk jumps a whole time step per
// row). The Λ' summary slots of a row are found through one SlotMode (shared, gathered
// or in place), chosen once per call.
//
// Forward (forward_task): for each head, stream the key blocks of kBlockK at or left of the
// diagonal and below len_b with an online softmax (self_attention_rows): S = c Q Kᵀ and
// O += P V are tile gemms in float (double for double inputs), the exponentials vectorised.
// The epilogue normalises O, adds the cross softmax over the slots with the un-rotated q,
// applies the gate, and stores lse = m + log l.
//
// Backward (recompute P = exp(S − lse)), two passes, no atomics, deterministic:
//   A. cross_task, per row block: the cross part (dq, dkc, dvc, gate partial) and
//      D_i = dO_i · (O_i − σ O^cross_i).
//   B. self_group_task, per (b, kv group): the self part in one sweep over the group's
//      heads (in head order), their query blocks and the key blocks at or left of the
//      diagonal; each tile pair recomputes S and dP once (5 tile gemms, 1 exp pass) and
//      feeds dq̃ (a query block's accumulator) and dk̃, dv (the task's T-row accumulators).
// S = 1 summaries give dkc/dvc partials per query block and dgate partials per
// (b, h, query block); both are summed afterwards in a fixed order.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "common.h"
#include "tile_gemm.h"
#include "wiola/checks.h"
#include "wiola/cuda_schemas.h"

namespace wiola::cpu {
namespace {

using tile::Diagonal;
using tile::MatRef;
using tile::Vec;

constexpr int64_t kBlockQ = 64;   // query rows per task / tile
constexpr int64_t kBlockK = 128;  // key rows per tile

// ---------------------------------------------------------------------------------
// Row primitives
// ---------------------------------------------------------------------------------
template <typename acc_t>
inline acc_t dot(const acc_t* a, const acc_t* b, int64_t n) {
  using V = Vec<acc_t>;
  V acc(0);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) acc = at::vec::fmadd(V::loadu(a + i), V::loadu(b + i), acc);
  acc_t total = at::vec::vec_reduce_all<acc_t>([](V x, V y) { return x + y; }, acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// y = alpha * x + beta * y
template <typename acc_t>
inline void axpby(acc_t alpha, const acc_t* x, acc_t beta, acc_t* y, int64_t n) {
  using V = Vec<acc_t>;
  const V va(alpha), vb(beta);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) (va * V::loadu(x + i) + vb * V::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] = alpha * x[i] + beta * y[i];
}

// exp on a vector: the 20-ulp variant for float (plenty for softmax weights summed in
// float; ATen's CPU flash attention uses it too), the accurate one for double.
template <typename acc_t>
inline Vec<acc_t> vexp(const Vec<acc_t>& x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

// max(m, s[0..n))
template <typename acc_t>
inline acc_t row_max(const acc_t* s, int64_t n, acc_t m) {
  using V = Vec<acc_t>;
  V vm(m);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) vm = at::vec::maximum(vm, V::loadu(s + j));
  acc_t total = at::vec::vec_reduce_all<acc_t>([](V x, V y) { return at::vec::maximum(x, y); }, vm);
  for (; j < n; ++j) total = std::max(total, s[j]);
  return total;
}

// p[j] = exp(s[j] - m); returns Σ p.
template <typename acc_t>
inline acc_t exp_sub(const acc_t* s, acc_t m, acc_t* p, int64_t n) {
  using V = Vec<acc_t>;
  const V vm(m);
  V vsum(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    const V e = vexp<acc_t>(V::loadu(s + j) - vm);
    e.store(p + j);
    vsum = vsum + e;
  }
  acc_t total = at::vec::vec_reduce_all<acc_t>([](V x, V y) { return x + y; }, vsum);
  for (; j < n; ++j) {
    p[j] = std::exp(s[j] - m);
    total += p[j];
  }
  return total;
}

// ---------------------------------------------------------------------------------
// Tensors and the params struct
// ---------------------------------------------------------------------------------
struct Shape {
  int64_t B, H, Hkv, T, dh, S, L;
};

// Element strides of a (B, H, S, L, d_h) context tensor (d_h contiguous): slot row l of
// (b, h, s) starts at (b, h, s) + l·sl.
struct CtxStrides {
  int64_t sb = 0, sh = 0, ss = 0, sl = 0;
  CtxStrides() = default;
  explicit CtxStrides(const at::Tensor& x) : sb(x.stride(0)), sh(x.stride(1)), ss(x.stride(2)), sl(x.stride(3)) {}
  int64_t operator()(int64_t b, int64_t h, int64_t s) const { return b * sb + h * sh + s * ss; }
};

// The kernels read and write every tensor through its strides (only d_h must be
// contiguous), so the model's transposed (B, T, H, d_h) views need no copy.
template <typename T>
T* data_of(const at::Tensor& x) {
  if constexpr (std::is_const_v<T>) {
    return x.const_data_ptr<std::remove_const_t<T>>();
  } else {
    return x.mutable_data_ptr<T>();
  }
}

// A (B, heads, T, d_h) tensor: row (b, h, t) at data + rs(b, h, t).
template <typename T>
struct Rows {
  T* data = nullptr;
  RowStrides rs;
  Rows() = default;
  explicit Rows(const at::Tensor& x) : data(data_of<T>(x)), rs(x) {}
  T* row(int64_t b, int64_t h, int64_t t) const { return data + rs(b, h, t); }
  // Heads closer together than time steps (the model's views): walk heads inner.
  bool interleaved() const { return std::abs(rs.sh) < std::abs(rs.st); }
};

// A (B, H, S, L, d_h) summary tensor: slot l of (b, h, s) at row(b, h, s, l).
template <typename T>
struct Slots {
  T* data = nullptr;
  CtxStrides cs;
  Slots() = default;
  explicit Slots(const at::Tensor& x) : data(data_of<T>(x)), cs(x) {}
  T* row(int64_t b, int64_t h, int64_t s, int64_t l = 0) const { return data + cs(b, h, s) + l * cs.sl; }
  bool interleaved() const { return std::abs(cs.sh) < std::abs(cs.ss); }
};

// What both directions read.
template <typename scalar_t>
struct Inputs {
  using acc_t = acc_type<scalar_t>;
  Shape d;
  acc_t scale;             // c = 1/√d_h
  const int64_t* lengths;  // (B,), or nullptr: every row valid
  const acc_t* gate;       // (H,)
  Rows<const scalar_t> q_rot, k_rot, v, q;
  Slots<const scalar_t> kc, vc;

  int64_t length(int64_t b) const { return lengths == nullptr ? d.T : std::clamp<int64_t>(lengths[b], 0, d.T); }
  acc_t sigma(int64_t h) const { return acc_t(1) / (acc_t(1) + std::exp(-gate[h])); }
};

template <typename scalar_t>
struct ForwardParams : Inputs<scalar_t> {
  Rows<scalar_t> out;
  acc_type<scalar_t>* lse;  // (B, H, T)
};

template <typename scalar_t>
struct BackwardParams : Inputs<scalar_t> {
  using acc_t = acc_type<scalar_t>;
  Rows<const scalar_t> out, grad_out;
  const acc_t* lse;  // (B, H, T), the forward's
  Rows<scalar_t> dq_rot, dk_rot, dv, dq;
  Slots<scalar_t> dkc, dvc;  // S ≠ 1 only (S = 1: summed from dkc_part, dvc_part)
  acc_t* D;                  // (B, H, T) workspace: D_i = dO_i · O^self_i, pass A to pass B
  acc_t *dkc_part, *dvc_part;  // S = 1: (B, H, query block, L, d_h) partials
  acc_t* dgate_part;           // (B, H, query block) partials
};

// ---------------------------------------------------------------------------------
// Row blocks: the tasks of the forward and of backward pass A
// ---------------------------------------------------------------------------------
inline int64_t query_blocks(int64_t T) { return (T + kBlockQ - 1) / kBlockQ; }

// Heads per task: with interleaved rows all of them, so that whole strided rows are
// gathered at once, unless that leaves fewer than two tasks per thread; otherwise one
// (each head's rows are already contiguous; tasks then run in (b, h, query block) order,
// keeping a kv group's K/V hot). Only the partition depends on the thread count: every
// (b, h, query block) is computed the same way whatever the task holding it.
inline int64_t heads_per_task(int64_t H, int64_t outer, bool interleaved) {
  if (!interleaved) return 1;
  const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
  const int64_t chunks = std::clamp<int64_t>((want + std::max<int64_t>(outer, 1) - 1) / std::max<int64_t>(outer, 1), 1,
                                             std::max<int64_t>(H, 1));
  return (H + chunks - 1) / chunks;
}

struct TaskGrid {
  int64_t nqb;  // query blocks
  int64_t hpt;  // heads per task
  int64_t nhc;  // head chunks
  int64_t tasks(const Shape& d) const { return d.B * nqb * nhc; }
};

inline TaskGrid task_grid(const Shape& d, bool interleaved) {
  const int64_t nqb = query_blocks(d.T), hpt = heads_per_task(d.H, d.B * nqb, interleaved);
  return {nqb, hpt, (d.H + hpt - 1) / hpt};
}

// A task's rows: batch b, heads [h0, h0 + nh), query block qb = rows [i0, i1), the first
// nq of them below the length.
struct RowBlock {
  int64_t b, qb, h0, nh, i0, i1, nq;
  // Head hh's row r in the task's head-major scratches.
  int64_t slot(int64_t hh, int64_t r) const { return hh * kBlockQ + r; }
};

template <typename scalar_t>
RowBlock row_block(const Inputs<scalar_t>& in, const TaskGrid& g, int64_t task) {
  const int64_t qb = task % g.nqb, hc = (task / g.nqb) % g.nhc, b = task / (g.nqb * g.nhc);
  const int64_t h0 = hc * g.hpt, nh = std::min(g.hpt, in.d.H - h0);
  const int64_t i0 = qb * kBlockQ, i1 = std::min(in.d.T, i0 + kBlockQ);
  const int64_t nq = std::max<int64_t>(0, std::min(i1, in.length(b)) - i0);
  return {b, qb, h0, nh, i0, i1, nq};
}

// Calls f(hh, r) for heads [0, nh) and rows [0, n) in address order: heads inner when
// they lie closer together than time steps, so that every access continues a stream the
// hardware prefetchers follow instead of jumping a whole time step (and page) per row.
template <typename F>
inline void in_address_order(bool heads_inner, int64_t nh, int64_t n, F&& f) {
  if (heads_inner) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t hh = 0; hh < nh; ++hh) f(hh, r);
  } else {
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t r = 0; r < n; ++r) f(hh, r);
  }
}

// The block's valid rows of a (B, heads, T, d_h) tensor into a head-major scratch.
template <typename scalar_t, typename acc_t>
inline void gather_rows(const Rows<const scalar_t>& src, const RowBlock& blk, int64_t dh, MatRef<acc_t> dst) {
  in_address_order(src.interleaved(), blk.nh, blk.nq, [&](int64_t hh, int64_t r) {
    load_row(src.row(blk.b, blk.h0 + hh, blk.i0 + r), dst.data + blk.slot(hh, r) * dst.ld, dh);
  });
}

// The reverse: the block's valid rows from the scratch, its rows past the length as zeros.
template <typename acc_t, typename scalar_t>
inline void scatter_rows(MatRef<const acc_t> src, const RowBlock& blk, int64_t dh, const Rows<scalar_t>& dst) {
  in_address_order(dst.interleaved(), blk.nh, blk.i1 - blk.i0, [&](int64_t hh, int64_t r) {
    scalar_t* d = dst.row(blk.b, blk.h0 + hh, blk.i0 + r);
    if (r < blk.nq) {
      store_row(src.data + blk.slot(hh, r) * src.ld, d, dh);
    } else {
      std::fill_n(d, dh, scalar_t(0));
    }
  });
}

// The heads [h0, h0 + nh) of a task grouped by kv group (each group's K/V stays in cache).
inline void group_order(int64_t h0, int64_t nh, int64_t Hkv, std::vector<int64_t>& order) {
  order.clear();
  for (int64_t g = 0; g < Hkv; ++g)
    for (int64_t hh = 0; hh < nh; ++hh)
      if ((h0 + hh) % Hkv == g) order.push_back(hh);
}

// ---------------------------------------------------------------------------------
// Summary slots: where a row's Λ' slots and their gradients are
// ---------------------------------------------------------------------------------
enum class SlotMode {
  kShared,    // S = 1: the one (b, h) set, read in place; gradients summed into
              // per-(b, h, query block) partials (tasks never share a slot row)
  kGathered,  // S = T, heads interleaved: moved to and from the task's scratch once per task
  kInPlace,   // S = T otherwise (or Λ' = 0): each row's own slots, read and written in place
};

inline SlotMode slot_mode(const Shape& d, bool interleaved) {
  if (d.S == 1) return SlotMode::kShared;
  return d.L > 0 && interleaved ? SlotMode::kGathered : SlotMode::kInPlace;
}

// A task's slot rows in the accumulation type, (hh, r, l) at ((hh·kBlockQ + r)·L + l)·d_h;
// allocated for kGathered only (dkc, dvc: backward only).
template <typename acc_t>
struct SlotScratch {
  std::vector<acc_t> kc, vc, dkc, dvc;
  int64_t L, dh;
  SlotScratch(SlotMode mode, int64_t hpt, int64_t L_, int64_t dh_, bool grads) : L(L_), dh(dh_) {
    const int64_t n = mode == SlotMode::kGathered ? hpt * kBlockQ * L * dh : 0;
    kc.resize(n), vc.resize(n), dkc.resize(grads ? n : 0), dvc.resize(grads ? n : 0);
  }
  int64_t offset(int64_t slot) const { return slot * L * dh; }
};

// Per-time-step slots (S = T) of a block's rows [0, n) to (Slots<const scalar_t>: load) or
// from (Slots<scalar_t>: store) two head-major scratches, in address order. With
// interleaved heads the two tensors alternate per (time step, slot): in the model both are
// halves of one projection row, so the walk is sequential.
template <typename Ctx, typename Buf>
inline void move_slots(const Slots<Ctx>& c0, Buf* b0, const Slots<Ctx>& c1, Buf* b1, const RowBlock& blk, int64_t n,
                       const Shape& d) {
  constexpr bool kStore = !std::is_const_v<Ctx>;
  const int64_t L = d.L, dh = d.dh;
  auto one = [&](const Slots<Ctx>& c, Buf* buf, int64_t hh, int64_t r, int64_t l) {
    Ctx* row = c.row(blk.b, blk.h0 + hh, blk.i0 + r, l);
    Buf* brow = buf + (blk.slot(hh, r) * L + l) * dh;
    if constexpr (kStore) {
      store_row(brow, row, dh);
    } else {
      load_row(row, brow, dh);
    }
  };
  auto walk = [&](const Slots<Ctx>& c, Buf* buf) {
    if (c.interleaved()) {
      for (int64_t r = 0; r < n; ++r)
        for (int64_t l = 0; l < L; ++l)
          for (int64_t hh = 0; hh < blk.nh; ++hh) one(c, buf, hh, r, l);
    } else {
      for (int64_t hh = 0; hh < blk.nh; ++hh)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t l = 0; l < L; ++l) one(c, buf, hh, r, l);
    }
  };
  if (!(c0.interleaved() && c1.interleaved())) {
    walk(c0, b0);
    walk(c1, b1);
    return;
  }
  for (int64_t r = 0; r < n; ++r)
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t hh = 0; hh < blk.nh; ++hh) one(c0, b0, hh, r, l);
      for (int64_t hh = 0; hh < blk.nh; ++hh) one(c1, b1, hh, r, l);
    }
}

// One row's Λ' slots: key l at k + l·ldk, value l at v + l·ldv.
template <typename src_t>
struct SlotRef {
  const src_t* k;
  int64_t ldk;
  const src_t* v;
  int64_t ldv;
};

// Calls f(SlotRef) with the slots of the block's row (hh, r): the task's scratch (acc_t)
// when gathered, else the tensors themselves (scalar_t).
template <typename scalar_t, typename F>
inline void with_slots(const Inputs<scalar_t>& in, SlotMode mode, const SlotScratch<acc_type<scalar_t>>& sc,
                       const RowBlock& blk, int64_t hh, int64_t r, F&& f) {
  if (mode == SlotMode::kGathered) {
    const int64_t off = sc.offset(blk.slot(hh, r));
    f(SlotRef<acc_type<scalar_t>>{sc.kc.data() + off, in.d.dh, sc.vc.data() + off, in.d.dh});
  } else {
    const int64_t b = blk.b, h = blk.h0 + hh, s = mode == SlotMode::kShared ? 0 : blk.i0 + r;
    f(SlotRef<scalar_t>{in.kc.row(b, h, s), in.kc.cs.sl, in.vc.row(b, h, s), in.vc.cs.sl});
  }
}

// Where one head of a block puts its rows' slot gradients dkc_l = ck·q, dvc_l = cv·dO.
template <typename scalar_t>
struct SlotGrads {
  using acc_t = acc_type<scalar_t>;
  SlotMode mode;
  int64_t L, dh;
  acc_t *dk_part, *dv_part;  // kShared: the (b, h, query block)'s (L, d_h) partials
  acc_t *dk_buf, *dv_buf;    // kGathered: the head's scratch, row r at r·L·d_h
  Slots<scalar_t> dkc, dvc;  // kInPlace: the tensors, row r at time step i0 + r
  int64_t b, h, i0;

  // Slot l of row r; tmp: a d_h row of scratch.
  void put(int64_t r, int64_t l, acc_t ck, const acc_t* q, acc_t cv, const acc_t* dO, acc_t* tmp) const {
    if (mode == SlotMode::kShared) {
      axpby(ck, q, acc_t(1), dk_part + l * dh, dh);
      axpby(cv, dO, acc_t(1), dv_part + l * dh, dh);
    } else if (mode == SlotMode::kGathered) {
      acc_t* dk_l = dk_buf + (r * L + l) * dh;
      acc_t* dv_l = dv_buf + (r * L + l) * dh;
      for (int64_t e = 0; e < dh; ++e) dk_l[e] = ck * q[e];
      for (int64_t e = 0; e < dh; ++e) dv_l[e] = cv * dO[e];
    } else {
      for (int64_t e = 0; e < dh; ++e) tmp[e] = ck * q[e];
      store_row(tmp, dkc.row(b, h, i0 + r, l), dh);
      for (int64_t e = 0; e < dh; ++e) tmp[e] = cv * dO[e];
      store_row(tmp, dvc.row(b, h, i0 + r, l), dh);
    }
  }

  // Before the head's rows: kShared partials start at zero, and rows [nq, n) past the
  // length get zero gradients (kShared rows add nothing there).
  void begin(int64_t nq, int64_t n) const {
    if (mode == SlotMode::kShared) {
      std::fill(dk_part, dk_part + L * dh, acc_t(0));
      std::fill(dv_part, dv_part + L * dh, acc_t(0));
    } else if (mode == SlotMode::kGathered) {
      std::fill(dk_buf + nq * L * dh, dk_buf + n * L * dh, acc_t(0));
      std::fill(dv_buf + nq * L * dh, dv_buf + n * L * dh, acc_t(0));
    } else {
      for (int64_t r = nq; r < n; ++r)
        for (int64_t l = 0; l < L; ++l) {
          std::fill_n(dkc.row(b, h, i0 + r, l), dh, scalar_t(0));
          std::fill_n(dvc.row(b, h, i0 + r, l), dh, scalar_t(0));
        }
    }
  }
};

// Scratch of the cross softmax of one row.
template <typename acc_t>
struct CrossScratch {
  std::vector<acc_t> a, oc, row;  // softmax weights (L), O^cross (d_h), a converted slot row (d_h)
  CrossScratch(int64_t L, int64_t dh) : a(std::max<int64_t>(L, 1)), oc(dh), row(dh) {}
};

// The cross part of one row: w.a = softmax_l(c q·kc_l), w.oc = Σ_l a_l vc_l.
template <typename src_t, typename acc_t>
inline void cross_row(const acc_t* q, const SlotRef<src_t>& s, int64_t L, int64_t dh, acc_t scale,
                      CrossScratch<acc_t>& w) {
  acc_t *a = w.a.data(), *o_cross = w.oc.data();
  std::fill(o_cross, o_cross + dh, acc_t(0));
  if (L == 0) return;
  acc_t zmax = -std::numeric_limits<acc_t>::infinity();
  // Rows already in the accumulation type are read in place.
  auto as_acc = [&](const src_t* src) -> const acc_t* {
    if constexpr (std::is_same_v<src_t, acc_t>) {
      return src;
    } else {
      load_row(src, w.row.data(), dh);
      return w.row.data();
    }
  };
  for (int64_t l = 0; l < L; ++l) {
    a[l] = scale * dot(q, as_acc(s.k + l * s.ldk), dh);
    zmax = std::max(zmax, a[l]);
  }
  acc_t sum = 0;
  for (int64_t l = 0; l < L; ++l) {
    a[l] = std::exp(a[l] - zmax);
    sum += a[l];
  }
  for (int64_t l = 0; l < L; ++l) {
    a[l] /= sum;
    axpby(a[l], as_acc(s.v + l * s.ldv), acc_t(1), o_cross, dh);
  }
}

// K/V of every (b, kv group) bg = b·H_kv + g in the accumulation type, packed once per
// call in the layouts the tile gemms read (tile_gemm.h): linear in T, and it saves a
// conversion per tile pair. Each pass packs only what it reads.
template <typename acc_t>
struct KvPacks {
  std::vector<acc_t> kt, vt;  // transposed: (bg, d_h, ldt)
  std::vector<acc_t> k, v;    // row-padded: (bg, T, dp)
  int64_t T, dh, dp, ldt;
  KvPacks(int64_t T_, int64_t dh_) : T(T_), dh(dh_), dp(tile::padded(dh_)), ldt(tile::transposed_ld(T_)) {}
  const acc_t* kt_of(int64_t bg) const { return kt.data() + bg * dh * ldt; }
  const acc_t* vt_of(int64_t bg) const { return vt.data() + bg * dh * ldt; }
  const acc_t* k_of(int64_t bg) const { return k.data() + bg * T * dp; }
  const acc_t* v_of(int64_t bg) const { return v.data() + bg * T * dp; }
};

template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
std::vector<acc_t> pack_transposed(const Inputs<scalar_t>& in, const Rows<const scalar_t>& x) {
  return tile::pack_transposed<scalar_t, acc_t>(x.data, x.rs, in.d.B, in.d.Hkv, in.d.T, in.d.dh);
}

template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
std::vector<acc_t> pack_rows(const Inputs<scalar_t>& in, const Rows<const scalar_t>& x) {
  return tile::pack_rows<scalar_t, acc_t>(x.data, x.rs, in.d.B, in.d.Hkv, in.d.T, in.d.dh);
}

// ---------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------
// One task's scratch, reused across the tasks of a thread.
template <typename acc_t>
struct ForwardScratch {
  std::vector<int64_t> order;
  std::vector<acc_t> q;       // (hpt, kBlockQ, dp): q̃ rows
  std::vector<acc_t> qplain;  // (hpt, kBlockQ, d_h): q rows, for the cross part
  std::vector<acc_t> o;       // (hpt, kBlockQ, dp): O rows
  std::vector<acc_t> s;       // (kBlockQ, kBlockK): S, then P
  std::vector<acc_t> m, l;    // (kBlockQ): running row max and row sum
  SlotScratch<acc_t> slots;
  CrossScratch<acc_t> cross;
  ForwardScratch(const Shape& d, const TaskGrid& g, SlotMode mode)
      : q(g.hpt * kBlockQ * tile::padded(d.dh)),
        qplain(d.L > 0 ? g.hpt * kBlockQ * d.dh : 0),
        o(g.hpt * kBlockQ * tile::padded(d.dh)),
        s(kBlockQ * kBlockK),
        m(kBlockQ),
        l(kBlockQ),
        slots(mode, g.hpt, d.L, d.dh, /*grads=*/false),
        cross(d.L, d.dh) {}
};

// Online softmax over one key block of S (nq × nk, row stride kBlockK): masks the keys
// right of the diagonal, turns S into P = exp(S − m_new), updates m and l, and rescales
// the O rows (row stride dp) by exp(m_old − m_new).
template <typename acc_t>
inline void online_softmax_block(acc_t* S, int64_t nq, int64_t nk, Diagonal dg, ForwardScratch<acc_t>& w, acc_t* O,
                                 int64_t dp) {
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const bool diagonal = dg.j0 + nk - 1 > dg.i0;  // some key lies right of some row
  for (int64_t r = 0; r < nq; ++r) {
    acc_t* s = S + r * kBlockK;
    const int64_t ncol = diagonal ? std::clamp<int64_t>(dg.i0 + r - dg.j0 + 1, 0, nk) : nk;
    for (int64_t c = ncol; c < nk; ++c) s[c] = neg_inf;
    const acc_t mx = row_max(s, ncol, w.m[r]);
    // ncol ≥ 1 always holds for the first key block (key 0 ≤ i), so mx is finite.
    const acc_t corr = std::exp(w.m[r] - mx);
    const acc_t sum = exp_sub(s, mx, s, nk);
    w.l[r] = w.l[r] * corr + sum;
    w.m[r] = mx;
    if (corr != acc_t(1)) {
      acc_t* o = O + r * dp;
      for (int64_t e = 0; e < dp; e += Vec<acc_t>::size()) (Vec<acc_t>::loadu(o + e) * Vec<acc_t>(corr)).store(o + e);
    }
  }
}

// The self part of head hh's valid rows: leaves Σ_j exp(S_ij − m_i) v_j in its O rows and
// m, l for the epilogue.
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
void self_attention_rows(const ForwardParams<scalar_t>& p, const KvPacks<acc_t>& kv, const RowBlock& blk, int64_t hh,
                         ForwardScratch<acc_t>& w) {
  const int64_t nq = blk.nq, i0 = blk.i0, dh = p.d.dh, dp = kv.dp;
  const int64_t bg = blk.b * p.d.Hkv + (blk.h0 + hh) % p.d.Hkv;
  const acc_t* Q = w.q.data() + hh * kBlockQ * dp;
  acc_t* O = w.o.data() + hh * kBlockQ * dp;
  std::fill(w.m.begin(), w.m.begin() + nq, -std::numeric_limits<acc_t>::infinity());
  std::fill(w.l.begin(), w.l.begin() + nq, acc_t(0));
  std::fill(O, O + nq * dp, acc_t(0));
  const int64_t kv_end = i0 + nq;  // keys j ≤ last valid row (< len)
  for (int64_t j0 = 0; j0 < kv_end; j0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, kv_end - j0);
    const Diagonal dg{i0, j0};
    acc_t* S = w.s.data();
    tile::gemm<acc_t>(nq, nk, dh, p.scale, {Q, dp}, {kv.kt_of(bg) + j0, kv.ldt}, {S, kBlockK}, false);
    online_softmax_block(S, nq, nk, dg, w, O, dp);
    const MatRef<const acc_t> V{kv.v_of(bg) + j0 * dp, dp};
    if (j0 + nk - 1 > i0) {
      tile::gemm_causal_rows<acc_t>(nq, dh, nk, dg, acc_t(1), {S, kBlockK}, V, {O, dp});
    } else {
      tile::gemm<acc_t>(nq, dh, nk, acc_t(1), {S, kBlockK}, V, {O, dp}, true);
    }
  }
}

// Normalises head hh's O rows, adds the gated cross part and stores lse = m + log l.
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
void forward_epilogue(const ForwardParams<scalar_t>& p, SlotMode mode, const RowBlock& blk, int64_t hh,
                      ForwardScratch<acc_t>& w) {
  const int64_t h = blk.h0 + hh, dh = p.d.dh, L = p.d.L, dp = tile::padded(dh);
  acc_t* lse_bh = p.lse + (blk.b * p.d.H + h) * p.d.T;
  const acc_t sig = p.sigma(h);
  for (int64_t r = 0; r < blk.nq; ++r) {
    acc_t* o = w.o.data() + blk.slot(hh, r) * dp;
    const acc_t inv_l = acc_t(1) / w.l[r];
    lse_bh[blk.i0 + r] = w.m[r] + std::log(w.l[r]);
    if (L == 0) {
      for (int64_t e = 0; e < dh; ++e) o[e] *= inv_l;
      continue;
    }
    const acc_t* qrow = w.qplain.data() + blk.slot(hh, r) * dh;
    with_slots(p, mode, w.slots, blk, hh, r, [&](const auto& s) { cross_row(qrow, s, L, dh, p.scale, w.cross); });
    const acc_t* oc = w.cross.oc.data();
    for (int64_t e = 0; e < dh; ++e) o[e] = o[e] * inv_l + sig * oc[e];
  }
}

template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
void forward_task(const ForwardParams<scalar_t>& p, const KvPacks<acc_t>& kv, const TaskGrid& g, SlotMode mode,
                  ForwardScratch<acc_t>& w, int64_t task) {
  const Shape& d = p.d;
  const RowBlock blk = row_block(p, g, task);
  const int64_t dp = kv.dp;
  // Rows past the length: exactly zero (scatter_rows below), lse 0.
  for (int64_t hh = 0; hh < blk.nh; ++hh)
    for (int64_t i = blk.i0 + blk.nq; i < blk.i1; ++i) p.lse[(blk.b * d.H + blk.h0 + hh) * d.T + i] = 0;
  if (blk.nq > 0) {
    gather_rows(p.q_rot, blk, d.dh, MatRef<acc_t>{w.q.data(), dp});
    if (d.L > 0) gather_rows(p.q, blk, d.dh, MatRef<acc_t>{w.qplain.data(), d.dh});
    if (mode == SlotMode::kGathered) move_slots(p.kc, w.slots.kc.data(), p.vc, w.slots.vc.data(), blk, blk.nq, d);
  }
  group_order(blk.h0, blk.nq > 0 ? blk.nh : 0, d.Hkv, w.order);
  for (const int64_t hh : w.order) {
    self_attention_rows(p, kv, blk, hh, w);
    forward_epilogue(p, mode, blk, hh, w);
  }
  scatter_rows(MatRef<const acc_t>{w.o.data(), dp}, blk, d.dh, p.out);  // the one write of O
}

template <typename scalar_t>
void forward_impl(const ForwardParams<scalar_t>& p) {
  using acc_t = acc_type<scalar_t>;
  KvPacks<acc_t> kv(p.d.T, p.d.dh);
  kv.kt = pack_transposed(p, p.k_rot);
  kv.v = pack_rows(p, p.v);
  const SlotMode mode = slot_mode(p.d, p.kc.interleaved() || p.vc.interleaved());
  const TaskGrid g = task_grid(
      p.d, p.q_rot.interleaved() || p.q.interleaved() || p.out.interleaved() || mode == SlotMode::kGathered);
  at::parallel_for(0, g.tasks(p.d), 1, [&](int64_t begin, int64_t end) {
    ForwardScratch<acc_t> w(p.d, g, mode);
    for (int64_t task = begin; task < end; ++task) forward_task(p, kv, g, mode, w, task);
  });
}

// ---------------------------------------------------------------------------------
// Backward pass A: the cross part and D, per row block
// ---------------------------------------------------------------------------------
template <typename acc_t>
struct CrossPassScratch {
  std::vector<acc_t> dO;      // (hpt, kBlockQ, dp)
  std::vector<acc_t> o;       // (hpt, kBlockQ, d_h): O, turned into O^self
  std::vector<acc_t> qplain;  // (hpt, kBlockQ, d_h)
  std::vector<acc_t> dq;      // (hpt, kBlockQ, d_h)
  SlotScratch<acc_t> slots;
  CrossScratch<acc_t> cross;
  CrossPassScratch(const Shape& d, const TaskGrid& g, SlotMode mode)
      : dO(g.hpt * kBlockQ * tile::padded(d.dh)),
        o(g.hpt * kBlockQ * d.dh),
        qplain(d.L > 0 ? g.hpt * kBlockQ * d.dh : 0),
        dq(g.hpt * kBlockQ * d.dh),
        slots(mode, g.hpt, d.L, d.dh, /*grads=*/true),
        cross(d.L, d.dh) {}
};

// One row's inputs and outputs in pass A.
template <typename acc_t>
struct CrossRow {
  int64_t r;        // row in the block
  const acc_t* q;   // (d_h) un-rotated query
  const acc_t* dO;  // (d_h)
  acc_t* o;         // (d_h) O in, O^self = O − σ O^cross out
  acc_t* dq;        // (d_h) out
  acc_t sig;        // σ(g_h)
};

// The cross part's backward on one row. With a and O^cross recomputed and
// dz_l = σ a_l (dO·vc_l − dO·O^cross) (the cross output's gradient is σ dO):
// dq = c Σ_l dz_l kc_l, dkc_l = c dz_l q, dvc_l = σ a_l dO. Returns dO·O^cross, the
// row's term of the gate gradient.
template <typename scalar_t, typename src_t, typename acc_t = acc_type<scalar_t>>
acc_t cross_row_backward(const Inputs<scalar_t>& in, const CrossRow<acc_t>& x, const SlotRef<src_t>& s,
                         const SlotGrads<scalar_t>& grads, CrossScratch<acc_t>& w) {
  const int64_t L = in.d.L, dh = in.d.dh;
  const acc_t scale = in.scale;
  acc_t* row = w.row.data();
  cross_row(x.q, s, L, dh, scale, w);
  const acc_t* a = w.a.data();
  const acc_t do_oc = dot(x.dO, w.oc.data(), dh);
  for (int64_t l = 0; l < L; ++l) {
    load_row(s.v + l * s.ldv, row, dh);
    const acc_t dz = a[l] * x.sig * (dot(x.dO, row, dh) - do_oc);
    load_row(s.k + l * s.ldk, row, dh);
    axpby(scale * dz, row, acc_t(1), x.dq, dh);
    grads.put(x.r, l, scale * dz, x.q, a[l] * x.sig, x.dO, row);
  }
  axpby(-x.sig, w.oc.data(), acc_t(1), x.o, dh);
  return do_oc;
}

// Where head hh of a block puts its slot gradients (see SlotGrads).
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
SlotGrads<scalar_t> slot_grads(const BackwardParams<scalar_t>& p, SlotMode mode, const TaskGrid& g,
                               const RowBlock& blk, int64_t hh, SlotScratch<acc_t>& sc) {
  const int64_t h = blk.h0 + hh, L = p.d.L, dh = p.d.dh;
  const int64_t part = (blk.b * p.d.H + h) * g.nqb + blk.qb;  // (b, h, query block)
  const bool shared = mode == SlotMode::kShared, gathered = mode == SlotMode::kGathered;
  const int64_t off = sc.offset(blk.slot(hh, 0));
  return {.mode = mode,
          .L = L,
          .dh = dh,
          .dk_part = shared ? p.dkc_part + part * L * dh : nullptr,
          .dv_part = shared ? p.dvc_part + part * L * dh : nullptr,
          .dk_buf = gathered ? sc.dkc.data() + off : nullptr,
          .dv_buf = gathered ? sc.dvc.data() + off : nullptr,
          .dkc = p.dkc,
          .dvc = p.dvc,
          .b = blk.b,
          .h = h,
          .i0 = blk.i0};
}

// Pass A on head hh of a block: zero gradients past the length, then the cross part and D
// row by row, and the head's gate partial.
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
void cross_head(const BackwardParams<scalar_t>& p, SlotMode mode, const TaskGrid& g, const RowBlock& blk, int64_t hh,
                CrossPassScratch<acc_t>& w) {
  const int64_t h = blk.h0 + hh, bh = blk.b * p.d.H + h, dh = p.d.dh, dp = tile::padded(dh);
  const SlotGrads<scalar_t> grads = slot_grads(p, mode, g, blk, hh, w.slots);
  grads.begin(blk.nq, blk.i1 - blk.i0);
  for (int64_t i = blk.i0 + blk.nq; i < blk.i1; ++i) {
    std::fill_n(p.dq_rot.row(blk.b, h, i), dh, scalar_t(0));
    p.D[bh * p.d.T + i] = 0;
  }
  acc_t gate_acc = 0;
  const acc_t sig = p.sigma(h);
  for (int64_t r = 0; r < blk.nq; ++r) {
    const int64_t slot = blk.slot(hh, r);
    const CrossRow<acc_t> x{r, w.qplain.data() + slot * dh, w.dO.data() + slot * dp, w.o.data() + slot * dh,
                            w.dq.data() + slot * dh, sig};
    std::fill(x.dq, x.dq + dh, acc_t(0));
    if (p.d.L > 0) {
      with_slots(p, mode, w.slots, blk, hh, r,
                 [&](const auto& s) { gate_acc += cross_row_backward(p, x, s, grads, w.cross); });
    }
    p.D[bh * p.d.T + blk.i0 + r] = dot(x.dO, x.o, dh);
  }
  p.dgate_part[bh * g.nqb + blk.qb] = sig * (acc_t(1) - sig) * gate_acc;
}

template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
void cross_task(const BackwardParams<scalar_t>& p, SlotMode mode, const TaskGrid& g, CrossPassScratch<acc_t>& w,
                int64_t task) {
  const Shape& d = p.d;
  const RowBlock blk = row_block(p, g, task);
  SlotScratch<acc_t>& sc = w.slots;
  if (blk.nq > 0) {
    gather_rows(p.grad_out, blk, d.dh, MatRef<acc_t>{w.dO.data(), tile::padded(d.dh)});
    gather_rows(p.out, blk, d.dh, MatRef<acc_t>{w.o.data(), d.dh});
    if (d.L > 0) gather_rows(p.q, blk, d.dh, MatRef<acc_t>{w.qplain.data(), d.dh});
    if (mode == SlotMode::kGathered) move_slots(p.kc, sc.kc.data(), p.vc, sc.vc.data(), blk, blk.nq, d);
  }
  for (int64_t hh = 0; hh < blk.nh; ++hh) cross_head(p, mode, g, blk, hh, w);
  scatter_rows(MatRef<const acc_t>{w.dq.data(), d.dh}, blk, d.dh, p.dq);
  if (mode == SlotMode::kGathered) {
    const acc_t *dk = sc.dkc.data(), *dv = sc.dvc.data();
    move_slots(p.dkc, dk, p.dvc, dv, blk, blk.i1 - blk.i0, d);
  }
}

template <typename scalar_t>
void cross_pass(const BackwardParams<scalar_t>& p) {
  using acc_t = acc_type<scalar_t>;
  const SlotMode mode = slot_mode(
      p.d, p.kc.interleaved() || p.vc.interleaved() || p.dkc.interleaved() || p.dvc.interleaved());
  const TaskGrid g = task_grid(p.d, p.grad_out.interleaved() || p.out.interleaved() || p.q.interleaved() ||
                                        p.dq.interleaved() || mode == SlotMode::kGathered);
  at::parallel_for(0, g.tasks(p.d), 1, [&](int64_t begin, int64_t end) {
    CrossPassScratch<acc_t> w(p.d, g, mode);
    for (int64_t task = begin; task < end; ++task) cross_task(p, mode, g, w, task);
  });
}

// ---------------------------------------------------------------------------------
// Backward pass B: the self part, per (b, kv group)
// ---------------------------------------------------------------------------------
template <typename acc_t>
struct SelfPassScratch {
  std::vector<acc_t> q, dO, dq;  // (kBlockQ, dp): the query block's q̃, dO, dq̃ accumulator
  std::vector<acc_t> s, dp;      // (kBlockQ, kBlockK): S then P; dP then dS
  std::vector<acc_t> dk, dv;     // (T, dp): the kv group's dk̃, dv accumulators
  SelfPassScratch(const Shape& d, int64_t dpad)
      : q(kBlockQ * dpad),
        dO(kBlockQ * dpad),
        dq(kBlockQ * dpad),
        s(kBlockQ * kBlockK),
        dp(kBlockQ * kBlockK),
        dk(d.T * dpad),
        dv(d.T * dpad) {}
};

// A query block of one head: batch b, head h (kv group bg = b·H_kv + g), rows [i0, i0 + nq).
struct QueryBlock {
  int64_t b, h, bg, i0, nq;
};

// From S (into P) and dP (into dS) on one tile pair: P = exp(S − lse), dS = P (dP − D),
// both zero right of the diagonal.
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
void softmax_grad_tile(const BackwardParams<scalar_t>& p, const QueryBlock& qb, int64_t j0, int64_t nk,
                       SelfPassScratch<acc_t>& w) {
  const acc_t* lse_bh = p.lse + (qb.b * p.d.H + qb.h) * p.d.T;
  const acc_t* D_bh = p.D + (qb.b * p.d.H + qb.h) * p.d.T;
  for (int64_t r = 0; r < qb.nq; ++r) {
    const int64_t i = qb.i0 + r;
    const int64_t ncol = std::clamp<int64_t>(i - j0 + 1, 0, nk);
    acc_t* s = w.s.data() + r * kBlockK;
    acc_t* dpr = w.dp.data() + r * kBlockK;
    exp_sub(s, lse_bh[i], s, ncol);  // P
    const acc_t Di = D_bh[i];
    for (int64_t c = 0; c < ncol; ++c) dpr[c] = s[c] * (dpr[c] - Di);  // dS
    for (int64_t c = ncol; c < nk; ++c) s[c] = dpr[c] = 0;
  }
}

// One tile pair (the query block × keys [j0, j0 + nk)): S = c Q̃ K̃ᵀ, dP = dO Vᵀ, then
// dq̃ += c dS K̃, dv += Pᵀ dO, dk̃ += c dSᵀ Q̃.
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
void self_tile_pair(const BackwardParams<scalar_t>& p, const KvPacks<acc_t>& kv, const QueryBlock& qb, int64_t j0,
                    SelfPassScratch<acc_t>& w) {
  const int64_t nq = qb.nq, nk = std::min(kBlockK, qb.i0 + nq - j0), dh = p.d.dh, dp = kv.dp;
  const acc_t scale = p.scale;
  const MatRef<const acc_t> Q{w.q.data(), dp}, dO{w.dO.data(), dp}, K{kv.k_of(qb.bg) + j0 * dp, dp};
  const MatRef<const acc_t> P{w.s.data(), kBlockK}, dS{w.dp.data(), kBlockK};
  const MatRef<acc_t> dq{w.dq.data(), dp}, dk{w.dk.data() + j0 * dp, dp}, dv{w.dv.data() + j0 * dp, dp};
  tile::gemm<acc_t>(nq, nk, dh, scale, Q, {kv.kt_of(qb.bg) + j0, kv.ldt}, {w.s.data(), kBlockK}, false);
  tile::gemm<acc_t>(nq, nk, dh, acc_t(1), dO, {kv.vt_of(qb.bg) + j0, kv.ldt}, {w.dp.data(), kBlockK}, false);
  softmax_grad_tile(p, qb, j0, nk, w);
  if (j0 + nk - 1 > qb.i0) {
    // Crosses the diagonal: each row multiplies only its causal keys, each key only the
    // rows that see it (a non-finite value must not leak across the diagonal).
    const Diagonal dg{qb.i0, j0};
    tile::gemm_causal_rows<acc_t>(nq, dh, nk, dg, scale, dS, K, dq);
    tile::gemm_anticausal_rows<acc_t>(nk, dh, nq, dg, acc_t(1), P, dO, dv);
    tile::gemm_anticausal_rows<acc_t>(nk, dh, nq, dg, scale, dS, Q, dk);
  } else {
    tile::gemm<acc_t>(nq, dh, nk, scale, dS, K, dq, true);
    tile::gemm<acc_t, true>(nk, dh, nq, acc_t(1), P, dO, dv, true);
    tile::gemm<acc_t, true>(nk, dh, nq, scale, dS, Q, dk, true);
  }
}

// One query block against its keys j ≤ its last valid row: dq̃ is complete at the end.
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
void self_query_block(const BackwardParams<scalar_t>& p, const KvPacks<acc_t>& kv, const QueryBlock& qb,
                      SelfPassScratch<acc_t>& w) {
  const int64_t dh = p.d.dh, dp = kv.dp;
  tile::load_tile(p.q_rot.row(qb.b, qb.h, qb.i0), qb.nq, p.q_rot.rs.st, dh, w.q.data(), dp);
  tile::load_tile(p.grad_out.row(qb.b, qb.h, qb.i0), qb.nq, p.grad_out.rs.st, dh, w.dO.data(), dp);
  std::fill(w.dq.begin(), w.dq.begin() + qb.nq * dp, acc_t(0));
  for (int64_t j0 = 0; j0 < qb.i0 + qb.nq; j0 += kBlockK) self_tile_pair(p, kv, qb, j0, w);
  for (int64_t r = 0; r < qb.nq; ++r) store_row(w.dq.data() + r * dp, p.dq_rot.row(qb.b, qb.h, qb.i0 + r), dh);
}

// Pass B on one (b, kv group): its heads in order, each head's query blocks in order, so
// dk̃ and dv sum over heads, then query blocks, whatever the thread count.
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
void self_group_task(const BackwardParams<scalar_t>& p, const KvPacks<acc_t>& kv, SelfPassScratch<acc_t>& w,
                     int64_t bg) {
  const int64_t Hkv = p.d.Hkv, b = bg / Hkv, g = bg % Hkv, dh = p.d.dh, dp = kv.dp;
  const int64_t len = p.length(b);
  // Keys past the length: zero gradients.
  for (int64_t j = len; j < p.d.T; ++j) {
    std::fill_n(p.dk_rot.row(b, g, j), dh, scalar_t(0));
    std::fill_n(p.dv.row(b, g, j), dh, scalar_t(0));
  }
  if (len == 0) return;
  std::fill(w.dk.begin(), w.dk.begin() + len * dp, acc_t(0));
  std::fill(w.dv.begin(), w.dv.begin() + len * dp, acc_t(0));
  for (int64_t h = g; h < p.d.H; h += Hkv)
    for (int64_t i0 = 0; i0 < len; i0 += kBlockQ) self_query_block(p, kv, {b, h, bg, i0, std::min(kBlockQ, len - i0)}, w);
  for (int64_t j = 0; j < len; ++j) {
    store_row(w.dk.data() + j * dp, p.dk_rot.row(b, g, j), dh);
    store_row(w.dv.data() + j * dp, p.dv.row(b, g, j), dh);
  }
}

template <typename scalar_t>
void self_pass(const BackwardParams<scalar_t>& p) {
  using acc_t = acc_type<scalar_t>;
  KvPacks<acc_t> kv(p.d.T, p.d.dh);
  kv.kt = pack_transposed(p, p.k_rot);
  kv.vt = pack_transposed(p, p.v);
  kv.k = pack_rows(p, p.k_rot);
  at::parallel_for(0, p.d.B * p.d.Hkv, 1, [&](int64_t begin, int64_t end) {
    SelfPassScratch<acc_t> w(p.d, kv.dp);
    for (int64_t bg = begin; bg < end; ++bg) self_group_task(p, kv, w, bg);
  });
}

// ---------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------
// The checks of wiola::gcla_attention (wiola/checks.h); inputs whose d_h is not contiguous
// are copied (the kernels take every other stride). Holds the shape and int64 lengths.
struct CheckedInputs {
  Shape d;
  at::Tensor q_rot, k_rot, v, q, kc, vc;
  at::Tensor gate_acc;  // gate in the accumulation type
  std::optional<at::Tensor> lengths;
};

// The inputs of a call that passed checks::gcla_attention(_backward), which returned `len`.
CheckedInputs checked_inputs(const at::Tensor& q_rot, const at::Tensor& k_rot, const at::Tensor& v, const at::Tensor& q,
                             const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& gate,
                             std::optional<at::Tensor> len) {
  using checks::unit_last_stride;
  const Shape d{q_rot.size(0), q_rot.size(1), k_rot.size(1), q_rot.size(2), q_rot.size(3), kc.size(2), kc.size(3)};
  return {d,
          unit_last_stride(q_rot),
          unit_last_stride(k_rot),
          unit_last_stride(v),
          unit_last_stride(q),
          unit_last_stride(kc),
          unit_last_stride(vc),
          gate.to(acc_scalar_type(q_rot)).contiguous(),
          std::move(len)};
}

template <typename scalar_t>
Inputs<scalar_t> kernel_inputs(const CheckedInputs& in) {
  using acc_t = acc_type<scalar_t>;
  const acc_t scale = acc_t(1.0 / std::sqrt(static_cast<double>(in.d.dh)));
  return {in.d,
          scale,
          in.lengths.has_value() ? in.lengths->const_data_ptr<int64_t>() : nullptr,
          in.gate_acc.const_data_ptr<acc_t>(),
          Rows<const scalar_t>(in.q_rot),
          Rows<const scalar_t>(in.k_rot),
          Rows<const scalar_t>(in.v),
          Rows<const scalar_t>(in.q),
          Slots<const scalar_t>(in.kc),
          Slots<const scalar_t>(in.vc)};
}

std::tuple<at::Tensor, at::Tensor> gcla_attention_fwd(const at::Tensor& q_rot, const at::Tensor& k_rot,
                                                      const at::Tensor& v, const at::Tensor& q, const at::Tensor& kc,
                                                      const at::Tensor& vc, const at::Tensor& gate,
                                                      const std::optional<at::Tensor>& lengths) {
  const CheckedInputs in =
      checked_inputs(q_rot, k_rot, v, q, kc, vc, gate, checks::gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths));
  at::Tensor out = empty_output_like(in.q_rot);  // q_rot's layout: (B, T, H, d_h) order for the model's views
  at::Tensor lse = empty_output({in.d.B, in.d.H, in.d.T}, in.q_rot.options().dtype(acc_scalar_type(in.q_rot)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.q_rot.scalar_type(), "wiola_gcla_attention_fwd", [&] {
    ForwardParams<scalar_t> p{kernel_inputs<scalar_t>(in)};
    p.out = Rows<scalar_t>(out);
    p.lse = lse.mutable_data_ptr<acc_type<scalar_t>>();
    forward_impl(p);
  });
  return {out, lse};
}

// The backward's outputs, each in its input's layout (autograd hands it back through the
// input's view chain, transpose or view of the projection, without a copy), and its
// workspaces.
struct BackwardTensors {
  at::Tensor grad_out, out, lse;  // the inputs, d_h contiguous
  at::Tensor dq_rot, dk_rot, dv, dq;
  at::Tensor dkc, dvc;                        // S ≠ 1 only
  at::Tensor D, dgate_part, dkc_part, dvc_part;  // see BackwardParams
};

BackwardTensors backward_tensors(const CheckedInputs& in, const at::Tensor& grad_out, const at::Tensor& out,
                                 const at::Tensor& lse) {
  const Shape& d = in.d;
  const bool shared = d.S == 1;
  const int64_t nqb = query_blocks(d.T), ntasks = d.B * d.H * nqb;
  const at::TensorOptions acc_opts = in.q_rot.options().dtype(acc_scalar_type(in.q_rot));
  BackwardTensors t;
  t.grad_out = checks::unit_last_stride(grad_out), t.out = checks::unit_last_stride(out), t.lse = lse.contiguous();
  t.dq_rot = empty_output_like(in.q_rot), t.dk_rot = empty_output_like(in.k_rot);
  t.dv = empty_output_like(in.v), t.dq = empty_output_like(in.q);
  t.D = at::empty({d.B, d.H, d.T}, acc_opts);
  t.dgate_part = at::zeros({d.B, d.H, nqb}, acc_opts);
  t.dkc_part = at::empty({shared ? ntasks : 0, d.L, d.dh}, acc_opts);
  t.dvc_part = at::empty({shared ? ntasks : 0, d.L, d.dh}, acc_opts);
  if (!shared) t.dkc = empty_output_like(in.kc), t.dvc = empty_output_like(in.vc);
  return t;
}

template <typename scalar_t>
BackwardParams<scalar_t> backward_params(const CheckedInputs& in, BackwardTensors& t) {
  using acc_t = acc_type<scalar_t>;
  const bool shared = in.d.S == 1;
  BackwardParams<scalar_t> p{kernel_inputs<scalar_t>(in)};
  p.out = Rows<const scalar_t>(t.out), p.grad_out = Rows<const scalar_t>(t.grad_out);
  p.lse = t.lse.const_data_ptr<acc_t>();
  p.dq_rot = Rows<scalar_t>(t.dq_rot), p.dk_rot = Rows<scalar_t>(t.dk_rot);
  p.dv = Rows<scalar_t>(t.dv), p.dq = Rows<scalar_t>(t.dq);
  if (!shared) p.dkc = Slots<scalar_t>(t.dkc), p.dvc = Slots<scalar_t>(t.dvc);
  p.D = t.D.mutable_data_ptr<acc_t>();
  p.dkc_part = shared ? t.dkc_part.mutable_data_ptr<acc_t>() : nullptr;
  p.dvc_part = shared ? t.dvc_part.mutable_data_ptr<acc_t>() : nullptr;
  p.dgate_part = t.dgate_part.mutable_data_ptr<acc_t>();
  return p;
}

// S = 1: the (B, H, nqb, L, d_h) partials summed over the query blocks, a fixed-shape
// reduction.
at::Tensor sum_slot_partials(const at::Tensor& part, const Shape& d, const at::Tensor& like) {
  const int64_t nb = d.B * d.H * d.T > 0 ? query_blocks(d.T) : 0;
  if (nb == 0) return at::zeros(like.sizes(), like.options());
  return part.view({d.B, d.H, nb, d.L, d.dh}).sum(2, /*keepdim=*/true).to(like.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gcla_attention_bwd(
    const at::Tensor& grad_out, const at::Tensor& q_rot, const at::Tensor& k_rot, const at::Tensor& v,
    const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& gate,
    const std::optional<at::Tensor>& lengths, const at::Tensor& out, const at::Tensor& lse) {
  const CheckedInputs in = checked_inputs(q_rot, k_rot, v, q, kc, vc, gate,
                                          checks::gcla_attention_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate,
                                                                        lengths, out, lse));
  const Shape& d = in.d;
  BackwardTensors t = backward_tensors(in, grad_out, out, lse);
  if (d.B * d.H * d.T * d.dh > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.q_rot.scalar_type(), "wiola_gcla_attention_bwd", [&] {
      const BackwardParams<scalar_t> p = backward_params<scalar_t>(in, t);
      cross_pass(p);
      self_pass(p);
    });
  } else {
    for (at::Tensor* x : {&t.dq_rot, &t.dk_rot, &t.dv, &t.dq, &t.dkc_part, &t.dvc_part}) x->zero_();
  }
  if (d.S == 1) t.dkc = sum_slot_partials(t.dkc_part, d, in.kc), t.dvc = sum_slot_partials(t.dvc_part, d, in.vc);
  // (IntArrayRef: torch 2.11 finds {0, 2} ambiguous)
  at::Tensor dgate = t.dgate_part.sum(at::IntArrayRef{0, 2}).to(gate.scalar_type());
  return {t.dq_rot, t.dk_rot, t.dv, t.dq, t.dkc, t.dvc, dgate};
}

}  // namespace

// The op's schemas, declared once, here beside its CPU kernels: every build of the op compiles this file
// (the strings are in wiola/cuda_schemas.h, which the CUDA kernels' emulation declares again in
// wiola_cuda_emu). set_python_module names the module that registers the op's fakes and Python kernels.
TORCH_LIBRARY_FRAGMENT(wiola, m) {
  m.set_python_module("wiola_kernels.ops.gcla_attention");
  m.def(wiola::schema::kGclaAttention);
  m.def(wiola::schema::kGclaAttentionBackward);
  // The Triton kernels (or, for an input they do not take, the next backend in line), registered
  // from Python for CUDA: what the CUDA kernel (csrc/cuda/gcla_attention_binding.cpp) runs for a
  // call outside its limits or under WIOLA_GCLA_CUDA_KERNEL=triton.
  m.def(wiola::schema::kTritonGclaAttention);
  m.def(wiola::schema::kTritonGclaAttentionBackward);
  // The CUDA composite's summary kernels (csrc/cuda/gcla_attention.cu), not public ops.
  m.def(wiola::schema::kGclaSummaryFwd);
  m.def(wiola::schema::kGclaSummaryBwd);
}

TORCH_LIBRARY_IMPL(wiola, CPU, m) {
  m.impl("gcla_attention", &gcla_attention_fwd);
  m.impl("gcla_attention_backward", &gcla_attention_bwd);
}

}  // namespace wiola::cpu
