// Switches of the bugs that CMakeLists.txt plants in copies of csrc/cuda/*.cu for the
// wiola_cuda_emu_planted test (csrc/tests/cuda_emu_test.cpp, planted_main): all off, the
// copies are the shipped kernels. Test-only; the shipped kernels never see these.
#pragma once

namespace wiola_plant {
inline bool missing_sync = false;           // gcla backward: no barrier before the block's partial sums
inline bool select_race = false;            // atm select: no barrier after the taken flags are written
inline bool look_ahead_off_by_one = false;  // atm norms_and_dots: a look-ahead token past the row's end
inline bool ignore_alignment = false;       // atm rows_vectorizable: 16-byte chunks at any address
}  // namespace wiola_plant
