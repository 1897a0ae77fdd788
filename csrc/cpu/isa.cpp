// The run-time ISA choice of the CPU kernels (see isa.h).
#include "isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

namespace wiola::cpu {
namespace {

Isa best_isa() { return cpu_has_avx512() ? Isa::kAvx512 : Isa::kAvx2; }

Isa initial_isa() {
  const char* env = std::getenv("WIOLA_CPU_ISA");
  return env != nullptr && std::string(env) == "avx2" ? Isa::kAvx2 : best_isa();
}

std::atomic<Isa>& current() {
  static std::atomic<Isa> isa{initial_isa()};
  return isa;
}

}  // namespace

bool cpu_has_avx512() {
#if defined(WIOLA_HAVE_AVX512_TARGET)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

Isa active_isa() { return current().load(std::memory_order_relaxed); }

std::string isa_name(Isa isa) { return isa == Isa::kAvx512 ? "avx512" : "avx2"; }

std::string set_cpu_isa(const std::string& name) {
  Isa isa;
  if (name == "auto") {
    isa = best_isa();
  } else if (name == "avx2") {
    isa = Isa::kAvx2;
  } else if (name == "avx512") {
    TORCH_CHECK_VALUE(cpu_has_avx512(), "isa: this CPU has no AVX-512 (F/BW/VL/DQ/BF16); use 'avx2' or 'auto'");
    isa = Isa::kAvx512;
  } else {
    TORCH_CHECK_VALUE(false, "isa must be 'auto', 'avx2' or 'avx512', got '", name, "'");
  }
  return isa_name(current().exchange(isa));
}

}  // namespace wiola::cpu
