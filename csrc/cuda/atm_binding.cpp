// Torch side of the ATM CUDA kernels (csrc/cuda/atm.cu): checks tensors, allocates
// outputs and workspaces, fills the params structs of csrc/include/wiola/atm.h and
// launches on the current stream. float32, float16 and bfloat16 (float64 CUDA inputs are
// routed to the reference by wiola_kernels/ops/atm.py). The argument checks are the
// op's (wiola/checks.h), the same as the CPU kernels'.
#include <torch/library.h>

#include "binding_device.h"
#include "wiola/checks.h"
#include "wiola/atm.h"

namespace wiola::cuda_atm {
namespace {

using wiola::WIOLA_CUDA_BINDING_NS::check_launch;
using wiola::WIOLA_CUDA_BINDING_NS::current_stream;
using wiola::WIOLA_CUDA_BINDING_NS::DeviceGuard;
using wiola::WIOLA_CUDA_BINDING_NS::empty_output;
using wiola::WIOLA_CUDA_BINDING_NS::empty_workspace;
using wiola::WIOLA_CUDA_BINDING_NS::kDevice;
using wiola::WIOLA_CUDA_BINDING_NS::kernel_dtype;
using wiola::WIOLA_CUDA_BINDING_NS::kernel_input;
using wiola::WIOLA_CUDA_BINDING_NS::on_kernel_device;

// What the kernels need beyond the op's checks (wiola/checks.h): the kernels' device and dtype
// (kernel_dtype) and T < 2^30 (32-bit slot arithmetic in atm.cu).
void check_kernel_input(const char* name, const at::Tensor& x) {
  TORCH_CHECK_VALUE(on_kernel_device(x), name, " must be a ", kDevice, " tensor for these kernels, got ", x.device());
  TORCH_CHECK_VALUE(x.size(1) < (int64_t{1} << 30), name, ": T must be below 2^30, got ", x.size(1));
  kernel_dtype(x, name);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> atm_merge(const at::Tensor& x_in,
                                                                     const at::Tensor& position_ids, double threshold,
                                                                     const std::optional<at::Tensor>& lengths_in) {
  const checks::AtmMergeArgs args = checks::atm_merge(x_in, position_ids, threshold, lengths_in);
  check_kernel_input("x", x_in);
  // The kernels' view of the inputs (in the emulator, copies in its device memory).
  const at::Tensor x = kernel_input(x_in.contiguous()), positions = kernel_input(args.positions.contiguous()),
                   lengths = kernel_input(args.lengths);
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2);
  const DeviceGuard guard(x.device());
  at::Tensor merged = empty_output(x.sizes(), x.options());
  at::Tensor merged_positions = empty_output({B, T}, positions.options());
  at::Tensor merged_lengths = empty_output({B}, lengths.options());
  at::Tensor index_map = empty_output({B, T}, positions.options());
  if (B * T == 0) return {merged, merged_positions, merged_lengths.copy_(lengths.clamp(0, T)), index_map};
  at::Tensor work = empty_workspace({2 * B * T}, x.options().dtype(at::kFloat));
  at::Tensor slot_source = empty_workspace({B * T}, positions.options());
  atm::MergeParams p{};
  p.x = x.const_data_ptr();
  p.positions = positions.const_data_ptr<int64_t>();
  p.lengths = lengths.const_data_ptr<int64_t>();
  p.threshold = threshold;
  p.merged = merged.mutable_data_ptr();
  p.merged_positions = merged_positions.mutable_data_ptr<int64_t>();
  p.merged_lengths = merged_lengths.mutable_data_ptr<int64_t>();
  p.index_map = index_map.mutable_data_ptr<int64_t>();
  p.norm_sq = work.mutable_data_ptr<float>();
  p.dot = p.norm_sq + B * T;
  p.slot_source = slot_source.mutable_data_ptr<int64_t>();
  p.B = B;
  p.T = T;
  p.d = d;
  p.dtype = kernel_dtype(x, "x");
  check_launch(atm::launch_merge(p, current_stream()), "atm merge");
  return {merged, merged_positions, merged_lengths, index_map};
}

at::Tensor atm_merge_bwd(const at::Tensor& grad_in, const at::Tensor& map_in, const at::Tensor& merged_lengths_in) {
  checks::atm_unmerge("grad_merged", grad_in, map_in);
  check_kernel_input("grad_merged", grad_in);
  const at::Tensor grad_merged = kernel_input(grad_in.contiguous()), index_map = kernel_input(map_in.contiguous());
  const int64_t B = grad_merged.size(0), T = grad_merged.size(1), d = grad_merged.size(2);
  TORCH_CHECK_TYPE(merged_lengths_in.scalar_type() == at::kLong, "merged_lengths must have dtype in (int64), got ",
                   checks::dtype_name(merged_lengths_in.scalar_type()));
  checks::shape("merged_lengths", merged_lengths_in, {B}, "(B,)");
  checks::same_device("merged_lengths", merged_lengths_in, "grad_merged", grad_in);
  const at::Tensor merged_lengths = kernel_input(merged_lengths_in.contiguous());
  const DeviceGuard guard(grad_merged.device());
  at::Tensor grad_x = empty_output(grad_merged.sizes(), grad_merged.options());
  atm::MergeBackwardParams p{grad_merged.const_data_ptr(), index_map.const_data_ptr<int64_t>(),
                             merged_lengths.const_data_ptr<int64_t>(), grad_x.mutable_data_ptr(), B, T, d,
                             kernel_dtype(grad_merged, "grad_merged")};
  check_launch(atm::launch_merge_backward(p, current_stream()), "atm merge backward");
  return grad_x;
}

at::Tensor unmerge_common(const at::Tensor& in_arg, const at::Tensor& map_arg, bool backward) {
  const char* name = backward ? "grad_restored" : "y";
  checks::atm_unmerge(name, in_arg, map_arg);
  check_kernel_input(name, in_arg);
  const at::Tensor in = kernel_input(in_arg.contiguous()), index_map = kernel_input(map_arg.contiguous());
  const int64_t B = in.size(0), T = in.size(1), d = in.size(2);
  const DeviceGuard guard(in.device());
  at::Tensor out = empty_output(in.sizes(), in.options());
  // Backward: whether each row's map is sorted (its segments then run in parallel, atm.cu).
  at::Tensor row_sorted = empty_workspace({backward ? B : 0}, in.options().dtype(at::kInt));
  atm::UnmergeParams p{in.const_data_ptr(), index_map.const_data_ptr<int64_t>(), out.mutable_data_ptr(), B, T, d,
                       kernel_dtype(in, backward ? "grad_restored" : "y"),
                       backward ? row_sorted.mutable_data_ptr<int>() : nullptr};
  const auto stream = current_stream();
  check_launch(backward ? atm::launch_unmerge_backward(p, stream) : atm::launch_unmerge(p, stream),
               backward ? "atm unmerge backward" : "atm unmerge");
  return out;
}

at::Tensor atm_unmerge(const at::Tensor& y, const at::Tensor& index_map) {
  return unmerge_common(y, index_map, false);
}

at::Tensor atm_unmerge_bwd(const at::Tensor& grad_restored, const at::Tensor& index_map) {
  return unmerge_common(grad_restored, index_map, true);
}

}  // namespace

WIOLA_CUDA_KERNELS_IMPL(m) {
  m.impl("atm_merge", &atm_merge);
  m.impl("atm_merge_backward", &atm_merge_bwd);
  m.impl("atm_unmerge", &atm_unmerge);
  m.impl("atm_unmerge_backward", &atm_unmerge_bwd);
}

}  // namespace wiola::cuda_atm
