// ATM greedy adjacent merge / unmerge (SPEC §6): torch-free parameters and launchers of
// the CUDA kernels in csrc/cuda/atm.cu (the binding is csrc/cuda/atm_binding.cpp).
//
// All tensors are contiguous, row-major, on the current device. x / merged / y / grads
// are (B, T, d) of `dtype`; positions, index maps are (B, T) int64; lengths (B,) int64.
// Every launcher handles all B rows in one launch per kernel and returns the launch
// status (cudaSuccess or the error); none synchronises.
#pragma once

#ifdef WIOLA_CUDA_EMU
#include "../../cuda/emu/runtime.h"  // the SIMT emulator's runtime (test backend cuda_emu)
#else
#include <cuda_runtime_api.h>
#endif

#include <cstdint>

#include "wiola/dtype.h"

namespace wiola::atm {

using wiola::DType;

struct MergeParams {
  const void* x;               // (B, T, d) input
  const int64_t* positions;    // (B, T) position ids
  const int64_t* lengths;      // (B,) row lengths; clamped to [0, T] on the device
  double threshold;            // τ: pair (t, t+1) is a candidate when s_t > τ (compared in double)
  void* merged;                // out (B, T, d): T'_b merged tokens, then zeros
  int64_t* merged_positions;   // out (B, T): first member's position, 0 after T'_b
  int64_t* merged_lengths;     // out (B,): T'_b
  int64_t* index_map;          // out (B, T): token -> slot
  float* norm_sq;              // workspace (B·T): ‖x_t‖² (x_t rescaled by 2^-e when out of range, atm.cu)
  float* dot;                  // workspace (B·T): ⟨x_t, x_{t+1}⟩ of those tokens (0 at a row's end)
  int64_t* slot_source;        // workspace (B·T): 2·(first member) + paired, −1 after T'_b
  int64_t B, T, d;
  DType dtype;
};

struct MergeBackwardParams {
  const void* grad_merged;       // (B, T, d)
  const int64_t* index_map;      // (B, T)
  const int64_t* merged_lengths; // (B,)
  void* grad_x;                  // out (B, T, d): ½ / 1 / 0 times the slot's gradient
  int64_t B, T, d;
  DType dtype;
};

// Unmerge forward (gather) and backward (segment sum) share one parameter block.
struct UnmergeParams {
  const void* in;             // forward: y (B, T, d); backward: grad_restored (B, T, d)
  const int64_t* index_map;   // (B, T), entries in [0, T)
  void* out;                  // forward: restored; backward: grad_y
  int64_t B, T, d;
  DType dtype;
  int* row_sorted = nullptr;  // backward: workspace (B,) int32 (whether each row's map is sorted)
};

cudaError_t launch_merge(const MergeParams& p, cudaStream_t stream);
cudaError_t launch_merge_backward(const MergeBackwardParams& p, cudaStream_t stream);
cudaError_t launch_unmerge(const UnmergeParams& p, cudaStream_t stream);
cudaError_t launch_unmerge_backward(const UnmergeParams& p, cudaStream_t stream);

}  // namespace wiola::atm
