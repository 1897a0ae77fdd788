// The run-time ISA choice of the CPU kernels (see isa.h).
#include "isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

namespace wiola::cpu {
namespace {


Isa probed_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const Isa best = [] {
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return Isa::kGeneric;
#if defined(WIOLA_HAVE_AVX512_TARGET)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
#endif
    return Isa::kAvx2;
  }();
  return best;
#else
  return Isa::kGeneric;
#endif
}

// The test hook's cap on the probed level (set_cpu_probe_cap); kAvx512Bf16: none.
std::atomic<Isa>& probe_cap() {
  static std::atomic<Isa> cap{Isa::kAvx512Bf16};
  return cap;
}

Isa initial_isa() {
  const char* env = std::getenv("WIOLA_CPU_ISA");
  if (env == nullptr || std::string(env).empty() || std::string(env) == "auto") return cpu_best_isa();
  for (Isa isa : kIsaLevels)
    if (isa_name(isa) == env) {
      if (static_cast<int>(isa) <= static_cast<int>(cpu_best_isa())) return isa;
      TORCH_WARN("WIOLA_CPU_ISA=", env, " is above what this CPU runs (", isa_name(cpu_best_isa()),
                 "); using ", isa_name(cpu_best_isa()));
      return cpu_best_isa();
    }
  TORCH_WARN("WIOLA_CPU_ISA=", env, " is not one of auto, generic, avx2, avx512, avx512_bf16; using ",
             isa_name(cpu_best_isa()));
  return cpu_best_isa();
}

std::atomic<Isa>& current() {
  static std::atomic<Isa> isa{initial_isa()};
  return isa;
}

}  // namespace

Isa cpu_best_isa() {
  const Isa probed = probed_isa(), cap = probe_cap().load(std::memory_order_relaxed);
  return static_cast<int>(cap) < static_cast<int>(probed) ? cap : probed;
}

Isa active_isa() { return current().load(std::memory_order_relaxed); }

Isa choose_isa(const Isa* implemented, size_t count, Isa chosen) {
  Isa lowest = Isa::kAvx512Bf16, best = Isa::kGeneric;
  bool found = false;
  for (size_t i = 0; i < count; ++i) {
    const Isa isa = implemented[i];
    if (static_cast<int>(isa) < static_cast<int>(lowest)) lowest = isa;
    if (static_cast<int>(isa) <= static_cast<int>(chosen) && (!found || static_cast<int>(isa) > static_cast<int>(best)))
      best = isa, found = true;
  }
  return found ? best : lowest;
}

std::string isa_name(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return "generic";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
  }
  return "generic";
}

Isa parse_isa(const std::string& name, const char* what) {
  for (Isa isa : kIsaLevels)
    if (isa_name(isa) == name) return isa;
  TORCH_CHECK_VALUE(false, what, " must be one of 'generic', 'avx2', 'avx512', 'avx512_bf16' (or 'auto'), got '",
                    name, "'");
  return Isa::kGeneric;
}

std::string set_cpu_isa(const std::string& name) {
  Isa isa = cpu_best_isa();
  if (name != "auto") {
    isa = parse_isa(name, "isa");
    TORCH_CHECK_VALUE(static_cast<int>(isa) <= static_cast<int>(cpu_best_isa()), "isa: this CPU has no ", name,
                      " (it runs up to ", isa_name(cpu_best_isa()), "); use a lower level or 'auto'");
  }
  return isa_name(current().exchange(isa));
}

std::string set_cpu_probe_cap(const std::string& name) {
  const Isa cap = name == "none" ? Isa::kAvx512Bf16 : parse_isa(name, "cap");
  const Isa before = probe_cap().exchange(cap);
  current().store(cpu_best_isa());
  return before == Isa::kAvx512Bf16 ? "none" : isa_name(before);
}

}  // namespace wiola::cpu
