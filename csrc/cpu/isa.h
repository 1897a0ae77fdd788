// Which instruction set the CPU kernels' hot loops use. The extension is compiled for
// x86-64-v3 (AVX2 + FMA) so that it loads on any such CPU; loops that are compute-bound
// there (bf16 conversions) also have AVX-512 versions, compiled with a function target
// attribute and chosen here at run time. The two agree to rounding (each kernel says how;
// tests hold both to the float64 reference), and each is deterministic on its own.
#pragma once

#include <string>

namespace wiola::cpu {

enum class Isa { kAvx2, kAvx512 };

// Whether this CPU runs the AVX-512 loops (F, BW, VL, DQ and BF16: Zen 4, Sapphire Rapids
// and later).
bool cpu_has_avx512();

// The ISA the kernels use now: AVX-512 where the CPU has it, unless the environment
// variable WIOLA_CPU_ISA=avx2 (read once) or set_cpu_isa chose AVX2.
Isa active_isa();

// "avx2", "avx512" or "auto" (the CPU's best); throws c10::ValueError for another name or
// for "avx512" on a CPU without it. Returns the previous ISA's name.
std::string set_cpu_isa(const std::string& name);

std::string isa_name(Isa isa);

}  // namespace wiola::cpu

#if defined(__x86_64__) && defined(__GNUC__) && defined(CPU_CAPABILITY_AVX2)
#define WIOLA_HAVE_AVX512_TARGET 1
// A function compiled for AVX-512 inside this x86-64-v3 build (call it only when
// active_isa() == Isa::kAvx512).
#define WIOLA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif
