// Launch geometry of the GCLA summary CUDA kernels (csrc/cuda/gcla_attention.cu): threads
// per block, grids and dynamic shared memory. The one definition: the launchers call these,
// and gpu-report reads them through csrc/tools/launch_geometry.cpp. Plain C++17: no CUDA,
// no torch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wiola::gcla {

constexpr int kWarps = 4;                 // summary kernels: one warp per query row
constexpr int kThreads = kWarps * 32;
constexpr int kContextSumThreads = 256;   // context_sum_kernel: one thread per output element
constexpr int kDgateThreads = 32;         // dgate_kernel: one warp per head
constexpr size_t kMaxSmem = 227 * 1024;   // opt-in shared memory per block on sm_90

// Blocks of the forward: kWarps rows per block.
constexpr int64_t summary_forward_blocks(int64_t rows) { return (rows + kWarps - 1) / kWarps; }

// Dynamic shared memory of summary_backward_kernel<_, DH> (floats): a_λ and e_λ of each warp's
// current row ([kWarps][2][L]), the warps' running dkc / dvc sums for S = 1 ([kWarps][2][L][DH]),
// and one gate partial per warp.
constexpr size_t summary_backward_smem(int64_t L, int DH, bool shared_ctx) {
  return sizeof(float) * static_cast<size_t>(kWarps * 2 * L * (1 + (shared_ctx ? DH : 0)) + kWarps);
}

constexpr int64_t context_sum_blocks(int64_t n) { return (n + kContextSumThreads - 1) / kContextSumThreads; }

}  // namespace wiola::gcla
