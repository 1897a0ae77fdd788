// Test driver of the cubin table's C++ side, torch-free and without a GPU
// (tests/test_cubin_table.py compiles it with a generated table and feeds it every test and
// bench launch). Reads one launch per line from stdin:
//
//   glu_fwd DTYPE ACT ROWS N STRIDE_A STRIDE_B A B Y SMS ARCH
//   glu_bwd DTYPE ACT ROWS N STRIDE_G STRIDE_A STRIDE_B STRIDE_D G A B DA DB SMS ARCH
//   rms_fwd ROWS D EPS FP64 HAS_SHIFT HF_ORDER HAS_RESIDUAL SMS ARCH DT:PTR x7 (x r sum w s y rstd)
//   rms_bwd ROWS D HAS_SHIFT HAS_GRAD_S SMS ARCH DT:PTR x9 (g gs x w s rstd dx dw_partial ds_partial)
//   rms_sum PROGRAMS D HAS_SHIFT ARCH DT:PTR x4  (dw_partial ds_partial dw ds)
//   rms_layout PROGRAMS D HAS_SHIFT  (prints the partials' size, ds_offset and total)
//   table                        (every entry: index, arch, key, num_warps, shared)
//
// (pointers as integers) and prints, per launch, one line: the key the C++ chooser builds,
// the index of the table entry it finds (-1 for none), the grid, num_warps, and the byte
// size of each packed parameter ("sizes=8,8,8,4,4,8,8"). With --drop-last, the packing
// leaves out the last kernel parameter (the planted mismatch the test must catch).
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>

#include "wiola/triton_glu.h"
#include "wiola/triton_rms_norm.h"
#include "wiola/triton_table.h"

namespace {

using wiola::triton::Launch;

int element_size(const std::string& dtype) {
  if (dtype == "fp64") return 8;
  if (dtype == "fp32") return 4;
  return 2;  // bf16, fp16
}

const char* interned(const std::string& dtype) {
  for (const char* d : {"fp64", "fp32", "bf16", "fp16"}) {
    if (dtype == d) return d;
  }
  return "unknown";
}

const void* ptr(uint64_t v) { return reinterpret_cast<const void*>(v); }

// "bf16:256" -> a typed pointer.
wiola::triton::rms_norm::Ptr typed(const std::string& word) {
  const size_t colon = word.find(':');
  return {ptr(std::stoull(word.substr(colon + 1))), interned(word.substr(0, colon))};
}

template <size_t N>
void read_typed(std::istringstream& in, wiola::triton::rms_norm::Ptr (&out)[N]) {
  for (auto& p : out) {
    std::string w;
    in >> w;
    p = typed(w);
  }
}

void report(const Launch& launch, int arch, bool drop_last) {
  const auto& t = wiola::triton::table();
  const std::string k = wiola::triton::key(launch);
  const wiola::triton::Variant* v = wiola::triton::find(t, arch, k);
  std::cout << k << " " << (v ? static_cast<long>(v - t.variants) : -1L) << " grid=" << launch.grid
            << " warps=" << launch.num_warps;
  if (v != nullptr) {
    wiola::triton::Packed packed;
    wiola::triton::pack(*v, launch.args, packed);
    if (packed.error != nullptr) {
      std::cout << " error=" << '"' << packed.error << '"' << "\n";
      return;
    }
    std::cout << " sizes=";
    for (int i = 0; i < packed.count; ++i) {
      if (drop_last && i == v->num_params - 1) continue;
      std::cout << (i ? "," : "") << static_cast<int>(packed.sizes[i]);
    }
  }
  std::cout << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  const bool drop_last = argc > 1 && std::strcmp(argv[1], "--drop-last") == 0;
  const auto& t = wiola::triton::table();
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd, dtype;
    in >> cmd;
    if (cmd == "table") {
      std::cout << "triton " << (t.triton_version ? t.triton_version : "none") << " stages "
                << t.default_num_stages << " entries " << t.size << "\n";
      for (size_t i = 0; i < t.size; ++i) {
        const auto& v = t.variants[i];
        std::cout << i << " " << v.arch << " " << v.key << " " << v.num_warps << " " << v.shared << " "
                  << v.cubin_size << "\n";
      }
      continue;
    }
    if (cmd == "glu_fwd") {
      int act, arch;
      int64_t rows, n, sa, sb, sms;
      uint64_t a, b, y;
      in >> dtype >> act >> rows >> n >> sa >> sb >> a >> b >> y >> sms >> arch;
      wiola::triton::glu::Forward f{interned(dtype), element_size(dtype), dtype == "fp64", act, ptr(a), ptr(b),
                                    ptr(y), rows, n, sa, sb};
      report(wiola::triton::glu::forward(f, sms, t.default_num_stages), arch, drop_last);
    } else if (cmd == "glu_bwd") {
      int act, arch;
      int64_t rows, n, sg, sa, sb, sd, sms;
      uint64_t g, a, b, da, db;
      in >> dtype >> act >> rows >> n >> sg >> sa >> sb >> sd >> g >> a >> b >> da >> db >> sms >> arch;
      wiola::triton::glu::Backward bw{interned(dtype), element_size(dtype), dtype == "fp64", act, ptr(g), ptr(a),
                                      ptr(b), ptr(da), ptr(db), rows, n, sg, sa, sb, sd};
      report(wiola::triton::glu::backward(bw, sms, t.default_num_stages), arch, drop_last);
    } else if (cmd == "rms_fwd") {
      int64_t rows, d, sms;
      double eps;
      int fp64, has_shift, hf, has_res, arch;
      in >> rows >> d >> eps >> fp64 >> has_shift >> hf >> has_res >> sms >> arch;
      wiola::triton::rms_norm::Ptr p[7];
      read_typed(in, p);
      wiola::triton::rms_norm::Forward f{p[0], p[1], p[2], p[3], p[4], p[5], p[6],
                                         element_size(p[0].dtype), rows, d, eps, fp64 != 0, has_shift != 0,
                                         hf != 0, has_res != 0};
      report(wiola::triton::rms_norm::forward(f, sms, t.default_num_stages), arch, drop_last);
    } else if (cmd == "rms_bwd") {
      int64_t rows, d, sms;
      int has_shift, has_gs, arch;
      in >> rows >> d >> has_shift >> has_gs >> sms >> arch;
      wiola::triton::rms_norm::Ptr p[9];
      read_typed(in, p);
      wiola::triton::rms_norm::Backward b{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8],
                                          element_size(p[0].dtype), rows, d, has_shift != 0, has_gs != 0};
      report(wiola::triton::rms_norm::backward(b, sms, t.default_num_stages), arch, drop_last);
    } else if (cmd == "rms_sum") {
      int64_t programs, d;
      int has_shift, arch;
      in >> programs >> d >> has_shift >> arch;
      wiola::triton::rms_norm::Ptr p[4];
      read_typed(in, p);
      wiola::triton::rms_norm::PartialsSum ps{p[0], p[1], p[2], p[3], programs, d, has_shift != 0};
      report(wiola::triton::rms_norm::partials_sum(ps, t.default_num_stages), arch, drop_last);
    } else if (cmd == "rms_layout") {
      int64_t programs, d;
      int has_shift;
      in >> programs >> d >> has_shift;
      const auto l = wiola::triton::rms_norm::partials_layout(programs, d, has_shift != 0);
      std::cout << l.size << " " << l.ds_offset << " " << l.total << "\n";
    } else if (!cmd.empty()) {
      std::cerr << "unknown command: " << cmd << "\n";
      return 2;
    }
  }
  return 0;
}
