// Switches of the bugs that csrc/tests/planted_bugs.py plants in copies of csrc/cuda/*.cu
// (the wiola_cuda_emu_planted ctest under the emulator, scripts/planted_gpu.sh under
// compute-sanitizer on a GPU): all off, the copies are the shipped kernels. Test-only; the
// shipped kernels never see these. A planted site reads WIOLA_PLANT(kName).
#pragma once

namespace wiola_plant {
enum Flag : int {
  kMissingSync,       // gcla backward: no barrier before the block's partial sums
  kSelectRace,        // atm select: no barrier after the taken flags are written
  kLookAhead,         // atm norms_and_dots: a look-ahead token past the row's end
  kIgnoreAlignment,   // atm rows_vectorizable: 16-byte chunks at any address
  kDivergentBarrier,  // gcla backward S = 1: the barrier between the halves only in the writing half
  kUnwrittenPartial,  // gcla backward: no gate partial from a block whose rows are all padding
  kFlagCount
};
inline bool host_flags[kFlagCount] = {};
#if defined(__CUDACC__) && !defined(WIOLA_CUDA_EMU)
// On the GPU the kernels read a device copy (set_plant writes both).
__constant__ bool device_flags[kFlagCount];
#endif
}  // namespace wiola_plant

#if defined(__CUDA_ARCH__) && !defined(WIOLA_CUDA_EMU)
#define WIOLA_PLANT(flag) (::wiola_plant::device_flags[::wiola_plant::flag])
#else
#define WIOLA_PLANT(flag) (::wiola_plant::host_flags[::wiola_plant::flag])
#endif
