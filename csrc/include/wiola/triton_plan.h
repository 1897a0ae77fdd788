// Launches of the C++-launched Triton kernels described as lines of text, torch-free: the input
// of the test driver (csrc/tests/triton_table_test.cpp) and of the extension's test hook
// `wiola_kernels._C._triton_plan`, which tests/test_cubin_table.py feeds with the Python
// launchers' launches. One launch per line:
//
//   glu_fwd DTYPE ACT ROWS N STRIDE_A STRIDE_B A B Y SMS ARCH
//   glu_bwd DTYPE ACT ROWS N STRIDE_G STRIDE_A STRIDE_B STRIDE_D G A B DA DB SMS ARCH
//   rms_fwd ROWS D EPS FP64 HAS_SHIFT HF_ORDER HAS_RESIDUAL SMS ARCH DT:PTR x7 (x r sum w s y rstd)
//   rms_bwd ROWS D HAS_SHIFT HAS_GRAD_S SMS ARCH DT:PTR x9 (g gs x w s rstd dx dw_partial ds_partial)
//   rms_sum PROGRAMS D HAS_SHIFT ARCH DT:PTR x4  (dw_partial ds_partial dw ds)
//   rms_layout PROGRAMS D HAS_SHIFT  (prints the partials' size, ds_offset and total)
//   srpe DTYPE TRANSPOSE B T H H_KV HALF POS_SB POS_ST Q_S x3 K_S x3 QO_S x3 KO_S x3 SMS ARCH
//        Q K POSITIONS OMEGA CONSTANTS Q_OUT K_OUT
//   lce_logits ROW0 ROWS V D S_HN S_HD S_WV S_WD HAS_CAP STORE WANT_SUM SMS ARCH DT:PTR x5 (h W y logits stats)
//   lce_rows ROW0 ROWS SPLITS V IGNORE ARCH DT:PTR x4  (stats y lse loss)
//   lce_dlogits ROW0 ROWS V IGNORE HAS_CAP HAS_ROW_GRAD ARCH DT:PTR x5  (logits dz y lse g)
//   lce_dw ROW0 ROWS V D S_HN S_HD FIRST ARCH DT:PTR x3  (dz h acc)
//   lce_reduce N IGNORE MEAN HAS_ITEMS BACKWARD ARCH DT:PTR x5  (rows y items g out)
//   lce_plan N V D DTYPE SMS CHUNKED DW_ACC CHUNK_OVERRIDE  (prints the chunking and workspace:
//        chunk rows_max last_rows chunks splits per last_splits last_per dz_offset stats_offset
//        dw_acc_offset total)
//   table                        (every entry: index, arch, key, num_warps, shared)
//
// (pointers as integers). The answer to a launch is one line: the key the C++ chooser builds,
// the index of the static table's entry (-1 for none), the grid (and `grid_y=` for a 2-D grid),
// num_warps, `runtime=1` when the
// runtime table (variants registered by the Python launcher) has the key instead, and the byte
// size of each packed parameter of the variant found ("sizes=8,8,8,4,4,8,8"). With drop_last,
// the packing leaves out the last kernel parameter (the planted mismatch the test must catch).
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "wiola/triton_glu.h"
#include "wiola/triton_linear_cross_entropy.h"
#include "wiola/triton_rms_norm.h"
#include "wiola/triton_srpe.h"
#include "wiola/triton_table.h"

namespace wiola::triton::plan {

inline int element_size(const std::string& dtype) {
  if (dtype == "fp64") return 8;
  if (dtype == "fp32") return 4;
  return 2;  // bf16, fp16
}

inline const char* interned(const std::string& dtype) {
  for (const char* d : {"fp64", "fp32", "bf16", "fp16", "i64", "i32", "i16", "i8", "u8"}) {
    if (dtype == d) return d;
  }
  return "unknown";
}

inline const void* ptr(uint64_t v) { return reinterpret_cast<const void*>(v); }

// "bf16:256" -> a typed pointer.
inline rms_norm::Ptr typed(const std::string& word) {
  const size_t colon = word.find(':');
  return {ptr(std::stoull(word.substr(colon + 1))), interned(word.substr(0, colon))};
}

template <size_t N>
void read_typed(std::istringstream& in, rms_norm::Ptr (&out)[N]) {
  for (auto& p : out) {
    std::string w;
    in >> w;
    p = typed(w);
  }
}

// The answer line (without its newline) for a launch on `arch`.
inline std::string report(const Launch& launch, int arch, bool drop_last) {
  const Table& t = table();
  const std::string k = key(launch);
  const Variant* v = find(t, arch, k);
  const RuntimeVariant* r = v == nullptr ? runtime_table().find(arch, k) : nullptr;
  std::ostringstream out;
  out << k << " " << (v ? static_cast<long>(v - t.variants) : -1L) << " grid=" << launch.grid;
  if (launch.grid_y != 1) out << " grid_y=" << launch.grid_y;
  out << " warps=" << launch.num_warps;
  if (r != nullptr) {
    out << " runtime=1";
    v = &r->variant;
  }
  if (v != nullptr) {
    Packed packed;
    pack(*v, launch.args, packed);
    if (packed.error != nullptr) {
      out << " error=" << '"' << packed.error << '"';
      return out.str();
    }
    out << " sizes=";
    for (int i = 0; i < packed.count; ++i) {
      if (drop_last && i == v->num_params - 1) continue;
      out << (i ? "," : "") << static_cast<int>(packed.sizes[i]);
    }
  }
  return out.str();
}

// A linear_cross_entropy problem for the launch builders: the dtypes of h (and W) and of the
// accumulation, the shape and strides; the float options do not enter a launch's variant.
inline lce::Problem lce_problem(rms_norm::Ptr h, rms_norm::Ptr W, rms_norm::Ptr y, const char* acc, int64_t V,
                                int64_t d, int64_t s_hn, int64_t s_hd, int64_t s_wv, int64_t s_wd, bool has_cap,
                                int64_t ignore_index) {
  return {{h.p, h.dtype}, {W.p, W.dtype}, {y.p, y.dtype}, acc, V, d, s_hn, s_hd, s_wv, s_wd, has_cap, 30.0, 0.1,
          1e-4, ignore_index};
}

inline lce::Ptr lce_ptr(const rms_norm::Ptr& p) { return {p.p, p.dtype}; }

// The lce_* lines (see the top of this file).
inline std::string lce_answer(const std::string& cmd, std::istringstream& in, bool drop_last, bool& ok) {
  const int stages = default_num_stages();
  int arch = 0;
  if (cmd == "lce_plan") {
    int64_t n, V, d, sms, override_rows;
    int chunked, dw_acc;
    std::string dtype;
    in >> n >> V >> d >> dtype >> sms >> chunked >> dw_acc >> override_rows;
    const lce::Plan p = lce::plan(n, V, d, dtype, element_size(dtype), sms, chunked != 0, dw_acc != 0, override_rows);
    std::ostringstream out;
    out << p.cfg.chunk << " " << p.rows_max << " " << p.last_rows << " " << p.chunks << " " << p.full.splits << " "
        << p.full.per << " " << p.last.splits << " " << p.last.per << " " << p.dz_offset << " " << p.stats_offset
        << " " << p.dw_acc_offset << " " << p.total;
    return out.str();
  }
  if (cmd == "lce_logits") {
    int64_t row0, rows, V, d, s_hn, s_hd, s_wv, s_wd, sms;
    int has_cap, store, want_sum;
    in >> row0 >> rows >> V >> d >> s_hn >> s_hd >> s_wv >> s_wd >> has_cap >> store >> want_sum >> sms >> arch;
    rms_norm::Ptr p[5];
    read_typed(in, p);
    const lce::Problem pr = lce_problem(p[0], p[1], p[2], p[4].dtype, V, d, s_hn, s_hd, s_wv, s_wd, has_cap != 0, -100);
    const lce::Config c = lce::launch_config(V, p[0].dtype, 0);
    const lce::Split s = lce::splits(rows, V, c.logits, sms);
    return report(lce::logits(pr, c, s, store != 0, lce_ptr(p[3]), lce_ptr(p[4]), row0, rows, want_sum != 0),
                  arch, drop_last);
  }
  if (cmd == "lce_rows") {
    int64_t row0, rows, splits, V, ignore;
    in >> row0 >> rows >> splits >> V >> ignore >> arch;
    rms_norm::Ptr p[4];
    read_typed(in, p);
    const lce::Problem pr = lce_problem(p[1], p[1], p[1], p[0].dtype, V, 1, 1, 1, 1, 1, false, ignore);
    const lce::Config c = lce::launch_config(V, p[0].dtype, 0);
    return report(lce::rows(pr, c, splits, lce_ptr(p[0]), lce_ptr(p[2]), lce_ptr(p[3]), row0, rows, stages), arch,
                  drop_last);
  }
  if (cmd == "lce_dlogits") {
    int64_t row0, rows, V, ignore;
    int has_cap, has_row_grad;
    in >> row0 >> rows >> V >> ignore >> has_cap >> has_row_grad >> arch;
    rms_norm::Ptr p[5];
    read_typed(in, p);
    const lce::Problem pr = lce_problem(p[1], p[1], p[2], p[3].dtype, V, 1, 1, 1, 1, 1, has_cap != 0, ignore);
    const lce::Config c = lce::launch_config(V, p[1].dtype, 0);
    return report(lce::dlogits(pr, c, lce_ptr(p[0]), lce_ptr(p[1]), lce_ptr(p[3]), has_row_grad != 0, lce_ptr(p[4]),
                               row0, rows, stages),
                  arch, drop_last);
  }
  if (cmd == "lce_dw") {
    int64_t row0, rows, V, d, s_hn, s_hd;
    int first;
    in >> row0 >> rows >> V >> d >> s_hn >> s_hd >> first >> arch;
    rms_norm::Ptr p[3];
    read_typed(in, p);
    const lce::Problem pr = lce_problem(p[1], p[1], p[1], "fp32", V, d, s_hn, s_hd, d, 1, false, -100);
    const lce::Config c = lce::launch_config(V, p[1].dtype, 0);
    return report(lce::dw(pr, c, lce_ptr(p[0]), lce_ptr(p[2]), row0, rows, first != 0), arch, drop_last);
  }
  if (cmd == "lce_reduce") {
    int64_t n, ignore;
    int mean, has_items, backward;
    in >> n >> ignore >> mean >> has_items >> backward >> arch;
    rms_norm::Ptr p[5];
    read_typed(in, p);
    return report(lce::reduce(lce_ptr(p[0]), lce_ptr(p[1]), has_items != 0, lce_ptr(p[2]), backward != 0,
                              lce_ptr(p[3]), lce_ptr(p[4]), n, ignore, mean != 0, stages),
                  arch, drop_last);
  }
  ok = false;
  return "";
}

// The answer to one line (several lines for "table"; empty for an empty line); false in `ok`
// for an unknown command.
inline std::string answer(const std::string& line, bool drop_last, bool& ok) {
  const Table& t = table();
  std::istringstream in(line);
  std::string cmd, dtype;
  in >> cmd;
  ok = true;
  std::ostringstream out;
  if (cmd == "table") {
    out << "triton " << (t.triton_version ? t.triton_version : "none") << " stages " << t.default_num_stages
        << " entries " << t.size;
    for (size_t i = 0; i < t.size; ++i) {
      const auto& v = t.variants[i];
      out << "\n" << i << " " << v.arch << " " << v.key << " " << v.num_warps << " " << v.shared << " " << v.cubin_size;
    }
    return out.str();
  }
  if (cmd == "glu_fwd") {
    int act, arch;
    int64_t rows, n, sa, sb, sms;
    uint64_t a, b, y;
    in >> dtype >> act >> rows >> n >> sa >> sb >> a >> b >> y >> sms >> arch;
    glu::Forward f{interned(dtype), element_size(dtype), dtype == "fp64", act, ptr(a), ptr(b), ptr(y), rows, n, sa, sb};
    return report(glu::forward(f, sms, default_num_stages()), arch, drop_last);
  }
  if (cmd == "glu_bwd") {
    int act, arch;
    int64_t rows, n, sg, sa, sb, sd, sms;
    uint64_t g, a, b, da, db;
    in >> dtype >> act >> rows >> n >> sg >> sa >> sb >> sd >> g >> a >> b >> da >> db >> sms >> arch;
    glu::Backward bw{interned(dtype), element_size(dtype), dtype == "fp64", act, ptr(g), ptr(a), ptr(b), ptr(da),
                     ptr(db), rows, n, sg, sa, sb, sd};
    return report(glu::backward(bw, sms, default_num_stages()), arch, drop_last);
  }
  if (cmd == "rms_fwd") {
    int64_t rows, d, sms;
    double eps;
    int fp64, has_shift, hf, has_res, arch;
    in >> rows >> d >> eps >> fp64 >> has_shift >> hf >> has_res >> sms >> arch;
    rms_norm::Ptr p[7];
    read_typed(in, p);
    rms_norm::Forward f{p[0], p[1], p[2], p[3], p[4], p[5], p[6], element_size(p[0].dtype), rows, d, eps,
                        fp64 != 0, has_shift != 0, hf != 0, has_res != 0};
    return report(rms_norm::forward(f, sms, default_num_stages()), arch, drop_last);
  }
  if (cmd == "rms_bwd") {
    int64_t rows, d, sms;
    int has_shift, has_gs, arch;
    in >> rows >> d >> has_shift >> has_gs >> sms >> arch;
    rms_norm::Ptr p[9];
    read_typed(in, p);
    rms_norm::Backward b{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8],
                         element_size(p[0].dtype), rows, d, has_shift != 0, has_gs != 0};
    return report(rms_norm::backward(b, sms, default_num_stages()), arch, drop_last);
  }
  if (cmd == "rms_sum") {
    int64_t programs, d;
    int has_shift, arch;
    in >> programs >> d >> has_shift >> arch;
    rms_norm::Ptr p[4];
    read_typed(in, p);
    rms_norm::PartialsSum ps{p[0], p[1], p[2], p[3], programs, d, has_shift != 0};
    return report(rms_norm::partials_sum(ps, default_num_stages()), arch, drop_last);
  }
  if (cmd == "srpe") {
    int transpose, arch;
    int64_t sms;
    srpe::Call c{};
    in >> dtype >> transpose >> c.B >> c.T >> c.H >> c.H_kv >> c.half >> c.pos_sb >> c.pos_st;
    for (int64_t* s : {c.q_s, c.k_s, c.qo_s, c.ko_s}) in >> s[0] >> s[1] >> s[2];
    in >> sms >> arch;
    uint64_t p[7];
    for (auto& v : p) in >> v;
    c.dtype = interned(dtype);
    c.element_size = element_size(dtype);
    c.fp64 = dtype == "fp64";
    c.transpose = transpose != 0;
    c.q = ptr(p[0]), c.k = ptr(p[1]), c.positions = ptr(p[2]), c.omega = ptr(p[3]), c.constants = ptr(p[4]);
    c.q_out = ptr(p[5]), c.k_out = ptr(p[6]);
    return report(srpe::launch(c, sms, default_num_stages()), arch, drop_last);
  }
  if (cmd.rfind("lce_", 0) == 0) return lce_answer(cmd, in, drop_last, ok);
  if (cmd == "rms_layout") {
    int64_t programs, d;
    int has_shift;
    in >> programs >> d >> has_shift;
    const auto l = rms_norm::partials_layout(programs, d, has_shift != 0);
    out << l.size << " " << l.ds_offset << " " << l.total;
    return out.str();
  }
  ok = cmd.empty();
  return "";
}

}  // namespace wiola::triton::plan
