// Launch geometry of the ATM CUDA kernels (csrc/cuda/atm.cu): threads per block and grid
// sizes, as functions of the shape. The one definition: the launchers in atm.cu call these,
// and gpu-report reads them through csrc/tools/launch_geometry.cpp (compiled and run by
// wiola_kernels/devtools/cuda_report.py), so no tool re-derives a grid. Plain C++17: no CUDA,
// no torch.
#pragma once

#include <cstdint>

namespace wiola::atm {

constexpr int kSimTokens = 8;     // tokens per block in norms_and_dots
// norms_and_dots: a step of a thread is one 16-byte chunk of each of the kSimTokens + 1
// tokens (9 × 16 B in flight per thread; a bf16 row of d = 1024 is one step of 128 threads).
constexpr int kSimThreads = 128;
constexpr int kScanThreads = 256;  // select: one block per row, tiles of kScanThreads·kScanItems tokens
// Row kernels (gather_average, merge_backward, unmerge): one block per token / slot, each
// thread moving 16-byte chunks when d and the base pointers allow.
constexpr int kRowThreads = 64;
// Unmerge backward: a block owns kUnmergeSegment tokens of one row and kColumnThreads
// 16-byte chunks (or elements) of their columns; the segments of a row run in parallel.
constexpr int kColumnThreads = 128;
constexpr int kUnmergeSegment = 16;
constexpr int kCheckThreads = 1024;  // map_sorted_kernel: one block per row
constexpr int64_t kMaxGridY = 65535;  // gridDim.y limit: unmerge_backward launches rows in groups of this

// One launch: blocks in the grid (x; unmerge_backward's is per row group, see below),
// threads per block, dynamic shared memory in bytes.
struct Geometry {
  int64_t blocks;
  int threads;
  int64_t smem;
};

constexpr Geometry norms_and_dots_geometry(int64_t B, int64_t T) {
  return {B * ((T + kSimTokens - 1) / kSimTokens), kSimThreads, 0};
}
constexpr Geometry select_geometry(int64_t B) { return {B, kScanThreads, 0}; }
// gather_average, merge_backward, unmerge: one block per (row, token).
constexpr Geometry row_geometry(int64_t B, int64_t T) { return {B * T, kRowThreads, 0}; }
constexpr Geometry map_sorted_geometry(int64_t B) { return {B, kCheckThreads, 0}; }
// Column lanes of unmerge_backward: 16-byte chunks of `per_chunk` elements when vectorised.
constexpr int64_t unmerge_backward_lanes(int64_t d, int64_t per_chunk, bool vec) { return vec ? d / per_chunk : d; }
// Blocks along x (segments × column blocks); the launcher adds min(B, kMaxGridY) rows along y.
constexpr Geometry unmerge_backward_geometry(int64_t T, int64_t lanes) {
  return {((T + kUnmergeSegment - 1) / kUnmergeSegment) * ((lanes + kColumnThreads - 1) / kColumnThreads),
          kColumnThreads, 0};
}

}  // namespace wiola::atm
