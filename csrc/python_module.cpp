// The Python module `wiola_kernels._C`. Importing it loads this library, whose static
// initialisers register every wiola:: kernel with the dispatcher (csrc/cpu/<op>.cpp declares
// each op's schemas, csrc/wiola_ops.cpp the library's others; csrc/cpu and csrc/cuda implement them).
// pybind11 and c10's checks, not <torch/extension.h> (all of torch's C++ API: ~30 s of a
// compile for nothing this file uses). torch._C registers the translation of c10 errors to
// Python's (c10::ValueError → ValueError) with the pybind11 both modules share.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/isa.h"
#include "wiola/triton_plan.h"
#include "wiola/triton_table.h"
#ifdef WIOLA_WITH_CUDA
#include "cuda/triton_launch.h"
#else
namespace wiola::triton {
// A build without the CUDA kernels has no cubin table; its runtime table and launch plans still
// serve the tests (_triton_plan, _triton_register).
const Table& table() {
  static const Table t{nullptr, 0, nullptr, "a build without the CUDA kernels", 0};
  return t;
}
}  // namespace wiola::triton
#endif

namespace {

namespace py = pybind11;
using wiola::triton::ParamKind;

ParamKind param_kind(const std::string& name) {
  if (name == "PTR") return ParamKind::kPtr;
  if (name == "I32") return ParamKind::kI32;
  if (name == "I64") return ParamKind::kI64;
  if (name == "F32") return ParamKind::kF32;
  if (name == "F64") return ParamKind::kF64;
  TORCH_CHECK_VALUE(false, "parameter kind must be one of PTR, I32, I64, F32, F64, got '", name, "'");
  return ParamKind::kPtr;
}

const char* param_kind_name(ParamKind k) {
  switch (k) {
    case ParamKind::kPtr: return "PTR";
    case ParamKind::kI32: return "I32";
    case ParamKind::kI64: return "I64";
    case ParamKind::kF32: return "F32";
    case ParamKind::kF64: return "F64";
  }
  return "?";
}

// The runtime table's hooks (wiola/triton_table.h), for wiola_kernels/triton/runtime_table.py
// and the tests.
void def_runtime_table(py::module_& m) {
  // This thread's launches the tables missed during the current op call: (kernel, key, arch, device).
  m.def("_triton_pending", [] {
    std::vector<std::tuple<std::string, std::string, int, int>> out;
    for (const auto& p : wiola::triton::pending()) out.emplace_back(p.kernel, p.key, p.arch, p.device);
    return out;
  });
  // For tests without a GPU: sets this thread's pending misses as a C++ kernel's lookups would.
  m.def("_triton_set_pending", [](const std::vector<std::tuple<std::string, std::string, int, int>>& misses) {
    auto& list = wiola::triton::pending();
    list.clear();
    for (const auto& [kernel, key, arch, device] : misses) list.push_back({kernel, key, arch, device});
  });
  // Registers a kernel the Python launcher's JIT compiled (an entry as cubin_table.describe makes
  // it) under `key` for `arch`, and loads it on `device` (>= 0) unless its stream captures. Returns
  // None, or why the variant cannot be registered.
  m.def(
      "_triton_register",
      [](const std::string& key, const std::string& kernel, const std::string& function, int arch, py::bytes cubin,
         int num_warps, int num_ctas, int shared, const std::vector<std::pair<std::string, int>>& params,
         int scratch_pointers, size_t global_scratch_size, size_t profile_scratch_size, bool cooperative,
         int device) -> std::optional<std::string> {
        const std::string image = cubin;
        std::vector<wiola::triton::Param> ps;
        for (const auto& [kind, arg] : params) ps.push_back({param_kind(kind), arg});
        const wiola::triton::Variant v{key.c_str(), kernel.c_str(), function.c_str(), arch, image.data(),
                                       image.size(), num_warps, num_ctas, shared, ps.data(),
                                       static_cast<int>(ps.size()), scratch_pointers, global_scratch_size,
                                       profile_scratch_size, cooperative ? 1 : 0};
        std::string why;
        const wiola::triton::RuntimeVariant* r = wiola::triton::runtime_table().add(v, why);
        if (r == nullptr) return why;
#ifdef WIOLA_WITH_CUDA
        if (device >= 0) wiola::triton::preload(*r, device);
#else
        (void)device;
#endif
        return std::nullopt;
      },
      py::arg("key"), py::arg("kernel"), py::arg("function"), py::arg("arch"), py::arg("cubin"), py::arg("num_warps"),
      py::arg("num_ctas"), py::arg("shared"), py::arg("params"), py::arg("scratch_pointers"),
      py::arg("global_scratch_size"), py::arg("profile_scratch_size"), py::arg("cooperative"), py::arg("device"));
  // The registered variants, as stored: dicts of key, arch, kernel, function, num_warps, num_ctas,
  // shared, params [(kind, arg)], scratch_pointers, cubin_size.
  m.def("_triton_registered", [] {
    py::list out;
    for (const auto* r : wiola::triton::runtime_table().entries()) {
      const auto& v = r->variant;
      py::list params;
      for (int i = 0; i < v.num_params; ++i) params.append(py::make_tuple(param_kind_name(v.params[i].kind), v.params[i].arg));
      py::dict d;
      d["key"] = v.key;
      d["arch"] = v.arch;
      d["kernel"] = v.kernel;
      d["function"] = v.function;
      d["num_warps"] = v.num_warps;
      d["num_ctas"] = v.num_ctas;
      d["shared"] = v.shared;
      d["params"] = params;
      d["scratch_pointers"] = v.scratch_pointers;
      d["cubin_size"] = v.cubin_size;
      out.append(d);
    }
    return out;
  });
  // The num_stages the C++ keys name (the table's, else the one reported by the Python launcher).
  m.def("_triton_num_stages", [] { return wiola::triton::default_num_stages(); });
  m.def("_triton_report_num_stages", [](int stages) { wiola::triton::reported_num_stages().store(stages); });
  // A launch described as text (wiola/triton_plan.h): the key C++ builds, the entry it finds in
  // either table and the packed parameters' sizes.
  m.def(
      "_triton_plan",
      [](const std::string& line, bool drop_last) {
        bool ok = true;
        std::string out = wiola::triton::plan::answer(line, drop_last, ok);
        TORCH_CHECK_VALUE(ok, "unknown launch: ", line);
        return out;
      },
      py::arg("line"), py::arg("drop_last") = false);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "wiola_kernels compiled kernels (C++ CPU, and CUDA when built with it)";
#ifdef WIOLA_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  // The ops whose CUDA kernel is C++ launching the cubin table (csrc/cuda/triton_*_binding.cpp).
  m.attr("TRITON_CUDA_OPS") = std::vector<std::string>{"glu",          "glu_backward",          "rms_norm",
                                                            "rms_norm_backward", "add_rms_norm", "add_rms_norm_backward",
                                                            "srpe",         "srpe_backward",
                                                            "linear_cross_entropy", "linear_cross_entropy_backward"};
  // The ops whose CUDA kernel is a C++ composite of PyTorch's kernels and ours, which runs the
  // Python kernel wiola::_triton_<op> for the inputs it does not take (csrc/cuda/gcla_attention_binding.cpp).
  m.attr("COMPOSITE_CUDA_OPS") = std::vector<std::string>{"gcla_attention", "gcla_attention_backward"};
  // The cubin table of this build: (Triton version or None, why there is none or None, entries).
  m.def("cubin_table", [] {
    const auto& t = wiola::triton::table();
    pybind11::object version = pybind11::none(), reason = pybind11::none();
    if (t.triton_version != nullptr) version = pybind11::str(t.triton_version);
    if (t.missing_reason != nullptr) reason = pybind11::str(t.missing_reason);
    return pybind11::make_tuple(version, reason, t.size, wiola::triton::runtime_table().entries().size());
  });
#else
  m.attr("WITH_CUDA") = false;
  m.attr("TRITON_CUDA_OPS") = std::vector<std::string>{};
  m.attr("COMPOSITE_CUDA_OPS") = std::vector<std::string>{};
#endif
  def_runtime_table(m);
  // The run-time ISA level of the CPU kernels' hot loops (csrc/cpu/isa.h).
  using wiola::cpu::Isa;
  m.def("cpu_isa", [] { return wiola::cpu::isa_name(wiola::cpu::active_isa()); });
  m.def("cpu_best_isa", [] { return wiola::cpu::isa_name(wiola::cpu::cpu_best_isa()); });
  m.def("set_cpu_isa", &wiola::cpu::set_cpu_isa);
  m.def("_set_cpu_probe_cap", &wiola::cpu::set_cpu_probe_cap);
  // The levels, lowest first, and the table of which levels each CPU kernel implements (isa.h).
  m.def("isa_levels", [] {
    std::vector<std::string> names;
    for (Isa level : wiola::cpu::kIsaLevels) names.push_back(wiola::cpu::isa_name(level));
    return names;
  });
  m.def("kernel_isas", [] {
    std::vector<std::pair<std::string, std::vector<std::string>>> table;
    for (const auto& entry : wiola::cpu::kKernelIsas) {
      std::vector<std::string> names;
      for (size_t i = 0; i < entry.count; ++i) names.push_back(wiola::cpu::isa_name(entry.levels[i]));
      table.emplace_back(entry.kernel, std::move(names));
    }
    return table;
  });
  // The level a CPU kernel with several paths runs now, by kernel name.
  m.def("kernel_isa", [](const std::string& kernel) {
    for (const auto& entry : wiola::cpu::kKernelIsas)
      if (kernel == entry.kernel)
        return wiola::cpu::isa_name(wiola::cpu::choose_isa(entry.levels, entry.count, wiola::cpu::active_isa()));
    std::string names;
    for (const auto& entry : wiola::cpu::kKernelIsas) names += std::string(names.empty() ? "'" : ", '") + entry.kernel + "'";
    TORCH_CHECK_VALUE(false, "kernel must be one of ", names, ", got '", kernel, "'");
    return std::string();
  });
  // The pure decision (isa.h choose_isa) on level names, for tests.
  m.def("_choose_isa", [](const std::vector<std::string>& implemented, const std::string& chosen) {
    std::vector<Isa> levels;
    for (const auto& name : implemented) levels.push_back(wiola::cpu::parse_isa(name, "implemented"));
    TORCH_CHECK_VALUE(!levels.empty(), "implemented must name at least one level");
    const Isa want = wiola::cpu::parse_isa(chosen, "chosen");
    return wiola::cpu::isa_name(wiola::cpu::choose_isa(levels.data(), levels.size(), want));
  });
}
