// Torch side of the GCLA attention CUDA kernels (csrc/cuda/gcla_attention.cu): checks
// tensors, allocates outputs and workspaces, fills the params structs of
// csrc/include/wiola/gcla_attention.h and launches on the current stream. float32, float16
// and bfloat16 with d_h ∈ {64, 128} (wiola_kernels/ops/gcla_attention.py routes other
// CUDA inputs, e.g. float64, to the reference).
#include <torch/library.h>

#include <optional>

#include "../cpu/common.h"
#include "binding_device.h"
#include "wiola/gcla_attention.h"

namespace wiola::cuda_gcla {
namespace {

using wiola::cpu::empty_output;
using wiola::WIOLA_CUDA_BINDING_NS::current_stream;
using wiola::WIOLA_CUDA_BINDING_NS::DeviceGuard;
using wiola::WIOLA_CUDA_BINDING_NS::kDevice;
using wiola::WIOLA_CUDA_BINDING_NS::on_kernel_device;

gcla::DType kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return gcla::DType::kFloat32;
    case at::kHalf:
      return gcla::DType::kFloat16;
    case at::kBFloat16:
      return gcla::DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "q_rot must be float32, float16 or bfloat16 for the CUDA kernels, got ",
                       t.scalar_type());
  }
  return gcla::DType::kFloat32;
}

void check_cuda(const char* name, const at::Tensor& t, const at::Tensor& like, at::IntArrayRef sizes,
                const char* layout) {
  TORCH_CHECK_VALUE(on_kernel_device(t) && t.device() == like.device() && t.is_contiguous() && t.sizes() == sizes, name,
                    " must be a contiguous ", kDevice, " tensor ", layout, " = ", sizes, " on ", like.device(), ", got ",
                    t.sizes(), " on ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type(), ", got ",
                   t.scalar_type());
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "wiola gcla_attention: ", what, " launch failed: ", cudaGetErrorString(err));
}

gcla::ForwardParams make_params(const at::Tensor& q_rot, const at::Tensor& k_rot, const at::Tensor& v,
                                const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                const at::Tensor& gate_f, const std::optional<at::Tensor>& lengths) {
  TORCH_CHECK_VALUE(on_kernel_device(q_rot) && q_rot.dim() == 4 && q_rot.is_contiguous(),
                    "q_rot must be a contiguous ", kDevice, " (B, H, T, d_h) tensor, got ", q_rot.sizes());
  const int64_t B = q_rot.size(0), H = q_rot.size(1), T = q_rot.size(2), dh = q_rot.size(3);
  TORCH_CHECK_VALUE(gcla::supported_head_dim(dh), "the CUDA gcla_attention kernels support d_h in {64, 128}, got ",
                    dh);
  TORCH_CHECK_VALUE(k_rot.dim() == 4 && k_rot.size(1) > 0 && H % k_rot.size(1) == 0,
                    "k_rot must be (B, H_kv, T, d_h) with H a multiple of H_kv, got ", k_rot.sizes());
  const int64_t Hkv = k_rot.size(1);
  check_cuda("k_rot", k_rot, q_rot, {B, Hkv, T, dh}, "(B, H_kv, T, d_h)");
  check_cuda("v", v, q_rot, {B, Hkv, T, dh}, "(B, H_kv, T, d_h)");
  check_cuda("q", q, q_rot, {B, H, T, dh}, "(B, H, T, d_h)");
  TORCH_CHECK_VALUE(kc.dim() == 5 && (kc.size(2) == 1 || kc.size(2) == T),
                    "kc must be (B, H, S, L, d_h) with S in {1, T}, got ", kc.sizes());
  const int64_t S = kc.size(2), L = kc.size(3);
  check_cuda("kc", kc, q_rot, {B, H, S, L, dh}, "(B, H, S, L, d_h)");
  check_cuda("vc", vc, q_rot, {B, H, S, L, dh}, "(B, H, S, L, d_h)");
  TORCH_CHECK_VALUE(on_kernel_device(gate_f) && gate_f.dim() == 1 && gate_f.size(0) == H, "gate must have shape (H,)");
  if (lengths.has_value()) {
    TORCH_CHECK_VALUE(on_kernel_device(*lengths) && lengths->device() == q_rot.device() && lengths->dim() == 1 &&
                          lengths->size(0) == B && lengths->scalar_type() == at::kLong && lengths->is_contiguous(),
                      "lengths must be a contiguous int64 ", kDevice, " tensor of shape (B,) = (", B, ",)");
  }
  gcla::ForwardParams p{};
  p.q_rot = q_rot.const_data_ptr();
  p.k_rot = k_rot.const_data_ptr();
  p.v = v.const_data_ptr();
  p.q = q.const_data_ptr();
  p.kc = kc.const_data_ptr();
  p.vc = vc.const_data_ptr();
  p.gate = gate_f.const_data_ptr<float>();
  p.lengths = lengths.has_value() ? lengths->const_data_ptr<int64_t>() : nullptr;
  p.B = B;
  p.H = H;
  p.Hkv = Hkv;
  p.T = T;
  p.dh = dh;
  p.S = S;
  p.L = L;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dh)));
  p.dtype = kernel_dtype(q_rot);
  return p;
}

std::tuple<at::Tensor, at::Tensor> gcla_attention_fwd(const at::Tensor& q_rot, const at::Tensor& k_rot,
                                                      const at::Tensor& v, const at::Tensor& q, const at::Tensor& kc,
                                                      const at::Tensor& vc, const at::Tensor& gate,
                                                      const std::optional<at::Tensor>& lengths) {
  const DeviceGuard guard(q_rot.device());
  const at::Tensor gate_f = gate.to(at::kFloat).contiguous();
  gcla::ForwardParams p = make_params(q_rot, k_rot, v, q, kc, vc, gate_f, lengths);
  at::Tensor out = empty_output(q_rot.sizes(), q_rot.options());
  at::Tensor lse = empty_output({p.B, p.H, p.T}, q_rot.options().dtype(at::kFloat));
  p.out = out.mutable_data_ptr();
  p.lse = lse.mutable_data_ptr<float>();
  check_launch(gcla::launch_forward(p, current_stream()), "forward");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gcla_attention_bwd(
    const at::Tensor& grad_out, const at::Tensor& q_rot, const at::Tensor& k_rot, const at::Tensor& v,
    const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& gate,
    const std::optional<at::Tensor>& lengths, const at::Tensor& out, const at::Tensor& lse) {
  const DeviceGuard guard(q_rot.device());
  const at::Tensor gate_f = gate.to(at::kFloat).contiguous();
  gcla::BackwardParams bp{};
  bp.fwd = make_params(q_rot, k_rot, v, q, kc, vc, gate_f, lengths);
  const gcla::ForwardParams& p = bp.fwd;
  check_cuda("grad_out", grad_out, q_rot, q_rot.sizes(), "(B, H, T, d_h)");
  check_cuda("out", out, q_rot, q_rot.sizes(), "(B, H, T, d_h)");
  TORCH_CHECK_VALUE(on_kernel_device(lse) && lse.is_contiguous() && lse.scalar_type() == at::kFloat &&
                        lse.sizes() == at::IntArrayRef({p.B, p.H, p.T}),
                    "lse must be a contiguous float32 ", kDevice, " tensor of shape (B, H, T)");
  bp.fwd.out = const_cast<void*>(out.const_data_ptr());
  bp.fwd.lse = const_cast<float*>(lse.const_data_ptr<float>());
  bp.grad_out = grad_out.const_data_ptr();
  at::Tensor dq_rot = empty_output(q_rot.sizes(), q_rot.options());
  at::Tensor dk_rot = empty_output(k_rot.sizes(), k_rot.options());
  at::Tensor dv = empty_output(v.sizes(), v.options());
  at::Tensor dq = empty_output(q.sizes(), q.options());
  at::Tensor dkc = empty_output(kc.sizes(), kc.options());
  at::Tensor dvc = empty_output(vc.sizes(), vc.options());
  const at::TensorOptions f32 = q_rot.options().dtype(at::kFloat);
  at::Tensor dgate = at::empty({p.H}, f32);
  at::Tensor work = at::empty({2 * p.B * p.H * p.T}, f32);
  const bool shared = p.S == 1;
  at::Tensor rows = at::empty({shared ? 2 * p.B * p.H * p.T * p.L * p.dh : 0}, f32);
  bp.dq_rot = dq_rot.mutable_data_ptr();
  bp.dk_rot = dk_rot.mutable_data_ptr();
  bp.dv = dv.mutable_data_ptr();
  bp.dq = dq.mutable_data_ptr();
  bp.dkc = dkc.mutable_data_ptr();
  bp.dvc = dvc.mutable_data_ptr();
  bp.dgate = dgate.mutable_data_ptr<float>();
  bp.delta = work.mutable_data_ptr<float>();
  bp.dgate_rows = bp.delta + p.B * p.H * p.T;
  bp.dkc_rows = shared ? rows.mutable_data_ptr<float>() : nullptr;
  bp.dvc_rows = shared ? bp.dkc_rows + p.B * p.H * p.T * p.L * p.dh : nullptr;
  check_launch(gcla::launch_backward(bp, current_stream()), "backward");
  return {dq_rot, dk_rot, dv, dq, dkc, dvc, dgate.to(gate.scalar_type())};
}

}  // namespace

WIOLA_CUDA_KERNELS_IMPL(m) {
  m.impl("_gcla_attention_fwd", &gcla_attention_fwd);
  m.impl("_gcla_attention_bwd", &gcla_attention_bwd);
}

}  // namespace wiola::cuda_gcla
