// Which instruction set the CPU kernels' hot loops use: one process-wide level, one
// environment variable, one setter, for every CPU kernel.
//
// The extension is compiled for x86-64-v3 (AVX2 + FMA + F16C) so that it loads on any such
// CPU; loops that gain from wider vectors or from AVX-512 BF16 also exist as functions
// compiled with a target attribute and are chosen here at run time. The levels are ordered:
//
//   generic      plain C++ loops (a kernel's reference path; for tests and comparisons)
//   avx2         AVX2 + FMA + F16C, the build's baseline
//   avx512       AVX-512 F, BW, VL, DQ (Skylake-SP, Cascade Lake, Ice Lake, Zen 4, ...)
//   avx512_bf16  avx512 + AVX512_BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later)
//
// The process chooses one level — the CPU's best unless WIOLA_CPU_ISA (read once) or
// set_cpu_isa lowered it — and each kernel runs the highest level it implements at or below
// that choice (choose_isa): the decoding GEMV has generic/avx2/avx512 paths, so a CPU with
// AVX-512 but no BF16 runs its AVX-512 path; RMSNorm's and GLU's wide paths need BF16
// (avx512_bf16.h), so there they run their AVX2 paths. The paths of one kernel agree to rounding (each kernel says how; tests hold
// each to the float64 reference), and each is deterministic on its own.
#pragma once

#include <cstddef>
#include <string>

namespace wiola::cpu {

enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// The best level this CPU runs (probed once; lowered by the test hook set_cpu_probe_cap).
Isa cpu_best_isa();

// The level the process chose: cpu_best_isa(), unless WIOLA_CPU_ISA or set_cpu_isa chose a
// lower one.
Isa active_isa();

// The level a kernel implementing `implemented` runs when the process chose `chosen`: the
// highest of them at or below `chosen`, else the lowest (every kernel's lowest path runs on
// the build's baseline). Pure: tests call it with any pair.
Isa choose_isa(const Isa* implemented, size_t count, Isa chosen);

// choose_isa(implemented, active_isa()): what a kernel calls before its loops.
template <size_t N>
Isa kernel_isa(const Isa (&implemented)[N]) {
  return choose_isa(implemented, N, active_isa());
}

// "auto" (the CPU's best) or a level name; throws c10::ValueError for another name or for a
// level above the CPU's. Returns the previous level's name.
std::string set_cpu_isa(const std::string& name);

// Test hook: pretend the CPU's best level is at most `name` ("none" removes the cap), as on
// a CPU that lacks the higher extensions, and reset the process's choice to that best.
// Only lowers what the CPU runs, so every kernel stays safe to call. Returns the previous cap.
std::string set_cpu_probe_cap(const std::string& name);

std::string isa_name(Isa isa);

// The level of a name ("generic", "avx2", "avx512", "avx512_bf16"); throws c10::ValueError
// naming `what` for another string.
Isa parse_isa(const std::string& name, const char* what = "isa");

// The levels each kernel implements. kKernelIsas below is the one table of them: the kernels
// choose from it, and Python reads it (wiola_kernels._extension.cpu_kernel_isas).
inline constexpr Isa kDecodeGemvIsas[] = {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512};
inline constexpr Isa kRmsNormIsas[] = {Isa::kAvx2, Isa::kAvx512Bf16};  // rms_norm and add_rms_norm
inline constexpr Isa kGluIsas[] = {Isa::kAvx2, Isa::kAvx512Bf16};
// bf16 GEMMs natively (ATen/oneDNN) at avx512_bf16, as widened float32 GEMMs below it.
inline constexpr Isa kLinearCrossEntropyIsas[] = {Isa::kAvx2, Isa::kAvx512Bf16};

// Every level, lowest first, and every CPU kernel with more than one path, by name.
inline constexpr Isa kIsaLevels[] = {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};
struct KernelIsas {
  const char* kernel;
  const Isa* levels;
  size_t count;
};
template <size_t N>
constexpr KernelIsas kernel_isas(const char* kernel, const Isa (&levels)[N]) {
  return {kernel, levels, N};
}
inline constexpr KernelIsas kKernelIsas[] = {
    kernel_isas("decode_gemv", kDecodeGemvIsas),
    kernel_isas("rms_norm", kRmsNormIsas),
    kernel_isas("add_rms_norm", kRmsNormIsas),
    kernel_isas("glu", kGluIsas),
    kernel_isas("linear_cross_entropy", kLinearCrossEntropyIsas),
};

}  // namespace wiola::cpu

#if defined(__x86_64__) && defined(__GNUC__) && defined(CPU_CAPABILITY_AVX2)
#define WIOLA_HAVE_AVX512_TARGET 1
// A function compiled for AVX-512 inside this x86-64-v3 build: call it only when the kernel's
// kernel_isa() is Isa::kAvx512 or higher (WIOLA_TARGET_AVX512_BF16: Isa::kAvx512Bf16).
#define WIOLA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define WIOLA_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif
