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
//   table                        (every entry: index, arch, key, num_warps, shared)
//
// (pointers as integers). The answer to a launch is one line: the key the C++ chooser builds,
// the index of the static table's entry (-1 for none), the grid, num_warps, `runtime=1` when the
// runtime table (variants registered by the Python launcher) has the key instead, and the byte
// size of each packed parameter of the variant found ("sizes=8,8,8,4,4,8,8"). With drop_last,
// the packing leaves out the last kernel parameter (the planted mismatch the test must catch).
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "wiola/triton_glu.h"
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
  for (const char* d : {"fp64", "fp32", "bf16", "fp16"}) {
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
  out << k << " " << (v ? static_cast<long>(v - t.variants) : -1L) << " grid=" << launch.grid
      << " warps=" << launch.num_warps;
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
