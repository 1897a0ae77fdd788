// Torch side of the GCLA summary kernels (csrc/cuda/gcla_attention.cu): checks tensors,
// allocates outputs and workspaces, fills the params structs of
// csrc/include/wiola/gcla_attention.h and launches on the current stream. float32, float16
// and bfloat16 with d_h ∈ {64, 128}. The self-attention part and the head permutation
// around it are driven from Python (wiola_kernels/ops/gcla_attention_cuda.py).
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "binding_device.h"
#include "wiola/gcla_attention.h"

namespace wiola::cuda_gcla {
namespace {

using wiola::WIOLA_CUDA_BINDING_NS::check_aligned;
using wiola::WIOLA_CUDA_BINDING_NS::check_launch;
using wiola::WIOLA_CUDA_BINDING_NS::current_stream;
using wiola::WIOLA_CUDA_BINDING_NS::DeviceGuard;
using wiola::WIOLA_CUDA_BINDING_NS::empty_output;
using wiola::WIOLA_CUDA_BINDING_NS::empty_workspace;
using wiola::WIOLA_CUDA_BINDING_NS::kDevice;
using wiola::WIOLA_CUDA_BINDING_NS::kernel_dtype;
using wiola::WIOLA_CUDA_BINDING_NS::kernel_input;
using wiola::WIOLA_CUDA_BINDING_NS::on_kernel_device;

// Bytes of one lane's access to a row of q / kc / vc / O / dO: d_h/32 elements (one 4- to
// 16-byte vector, gcla_attention.cu), to which their base addresses must be aligned.
int64_t vector_bytes(const at::Tensor& q) { return q.size(3) / 32 * static_cast<int64_t>(q.element_size()); }

// A contiguous tensor the kernels read with vectors of d_h/32 elements (like: q).
void check_cuda(const char* name, const at::Tensor& t, const at::Tensor& like, at::IntArrayRef sizes,
                const char* layout) {
  TORCH_CHECK_VALUE(on_kernel_device(t) && t.device() == like.device() && t.is_contiguous() && t.sizes() == sizes, name,
                    " must be a contiguous ", kDevice, " tensor ", layout, " = ", sizes, " on ", like.device(), ", got ",
                    t.sizes(), " on ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type(), ", got ",
                   t.scalar_type());
  check_aligned(name, t, vector_bytes(like));
}

// Shapes shared by both kernels, from q (B, H, T, dh) and kc (B, H, S, L, dh).
struct Shape {
  int64_t B, H, T, dh, S, L;
};

Shape check_common(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& gate_f,
                   const std::optional<at::Tensor>& lengths, int64_t perm_kv) {
  TORCH_CHECK_VALUE(on_kernel_device(q) && q.dim() == 4 && q.is_contiguous(), "q must be a contiguous ", kDevice, " (B, H, T, d_h) tensor, got ",
                    q.sizes(), " on ", q.device());
  Shape s{q.size(0), q.size(1), q.size(2), q.size(3), 0, 0};
  kernel_dtype(q, "q");
  TORCH_CHECK_VALUE(gcla::supported_head_dim(s.dh), "the CUDA gcla_attention kernels support d_h in ",
                    gcla::head_dims_text(), ", got ", s.dh);
  check_aligned("q", q, vector_bytes(q));
  TORCH_CHECK_VALUE(kc.dim() == 5 && (kc.size(2) == 1 || kc.size(2) == s.T),
                    "kc must be (B, H, S, L, d_h) with S in {1, T}, got ", kc.sizes());
  s.S = kc.size(2);
  s.L = kc.size(3);
  check_cuda("kc", kc, q, {s.B, s.H, s.S, s.L, s.dh}, "(B, H, S, L, d_h)");
  check_cuda("vc", vc, q, {s.B, s.H, s.S, s.L, s.dh}, "(B, H, S, L, d_h)");
  TORCH_CHECK_VALUE(on_kernel_device(gate_f) && gate_f.dim() == 1 && gate_f.size(0) == s.H, "gate must have shape (H,) = (",
                    s.H, ",)");
  TORCH_CHECK_VALUE(perm_kv >= 1 && s.H % perm_kv == 0, "perm_kv must divide H = ", s.H, ", got ", perm_kv);
  if (lengths.has_value()) {
    TORCH_CHECK_VALUE(on_kernel_device(*lengths) && lengths->device() == q.device() && lengths->dim() == 1 &&
                          lengths->size(0) == s.B && lengths->scalar_type() == at::kLong && lengths->is_contiguous(),
                      "lengths must be a contiguous int64 ", kDevice, " tensor of shape (B,) = (", s.B, ",)");
  }
  return s;
}

// A (B, H, T, dh) tensor of the fused attention: any strides with a contiguous last dim.
// Checks t; the kernels get `data` (t, or its copy in the emulator's device memory).
gcla::SelfTensor self_tensor(const char* name, const at::Tensor& t, const at::Tensor& q, const at::Tensor& data) {
  TORCH_CHECK_VALUE(on_kernel_device(t) && t.device() == q.device() && t.sizes() == q.sizes() && t.stride(3) == 1, name,
                    " must be a ", kDevice, " tensor (B, H, T, d_h) = ", q.sizes(), " with a contiguous last dimension, got ",
                    t.sizes(), " strides ", t.strides());
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), name, " must have dtype ", q.scalar_type(), ", got ",
                   t.scalar_type());
  // Each lane accesses dh/32 contiguous elements at once.
  const int64_t v = t.size(3) / 32;
  TORCH_CHECK_VALUE(t.stride(0) % v == 0 && t.stride(1) % v == 0 && t.stride(2) % v == 0 &&
                        reinterpret_cast<uintptr_t>(t.const_data_ptr()) % (v * t.element_size()) == 0,
                    name, " must have strides and an address aligned to d_h/32 elements, got strides ", t.strides());
  return {const_cast<void*>(data.const_data_ptr()), data.stride(0), data.stride(1), data.stride(2)};
}
gcla::SelfTensor self_tensor(const char* name, const at::Tensor& t, const at::Tensor& q) {
  return self_tensor(name, t, q, t);
}

gcla::SelfLse self_lse(const char* name, const at::Tensor& t, const Shape& s, const at::Tensor& q,
                       const at::Tensor& data) {
  TORCH_CHECK_VALUE(on_kernel_device(t) && t.device() == q.device() && t.dim() == 3 && t.size(0) == s.B && t.size(1) == s.H &&
                        t.size(2) >= s.T && (t.stride(2) == 1 || s.T <= 1) && t.scalar_type() == at::kFloat,
                    name, " must be a float32 ", kDevice, " tensor (B, H, >= T) = (", s.B, ", ", s.H, ", >= ", s.T,
                    ") with a contiguous last dimension, got ", t.sizes(), " ", t.scalar_type());
  return {const_cast<float*>(data.const_data_ptr<float>()), data.stride(0), data.stride(1)};
}
gcla::SelfLse self_lse(const char* name, const at::Tensor& t, const Shape& s, const at::Tensor& q) {
  return self_lse(name, t, s, q, t);
}

// (B, H, T, dh) view of fresh (B, T, H, dh) memory: the layout the fused attention keeps its
// tensors in, so that it copies none of ours. The memory-efficient attention's backward
// (wiola_kernels/ops/gcla_attention_cuda.py) relies on it: it takes the output's strides
// to be those of a (B, T, H, dh) tensor.
at::Tensor empty_self(const Shape& s, const at::TensorOptions& options) {
  at::Tensor t = empty_output({s.B, s.T, s.H, s.dh}, options).transpose(1, 2);
  TORCH_INTERNAL_ASSERT(t.transpose(1, 2).is_contiguous());
  return t;
}

// The launch parameters both summary passes share: shape, the K/V head permutation P
// (perm_kv, gcla_attention.h), scale c = 1/√d_h, dtype.
template <typename Params>
void set_shape(Params& p, const Shape& s, int64_t perm_kv, const at::Tensor& q) {
  p.B = s.B;
  p.H = s.H;
  p.T = s.T;
  p.dh = s.dh;
  p.S = s.S;
  p.L = s.L;
  p.perm_kv = perm_kv;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.dh)));
  p.dtype = kernel_dtype(q, "q");
}

std::tuple<at::Tensor, at::Tensor> gcla_summary_fwd(const at::Tensor& o_self, const at::Tensor& lse_self,
                                                    const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                                    const at::Tensor& gate, const std::optional<at::Tensor>& lengths,
                                                    int64_t perm_kv) {
  const DeviceGuard guard(q.device());
  const at::Tensor gate_f = gate.to(at::kFloat).contiguous();
  const Shape s = check_common(q, kc, vc, gate_f, lengths, perm_kv);
  // The kernels' view of the inputs (in the emulator, copies in its device memory).
  const auto &o_self_d = kernel_input(o_self), &lse_self_d = kernel_input(lse_self), &q_d = kernel_input(q),
             &kc_d = kernel_input(kc), &vc_d = kernel_input(vc), &gate_d = kernel_input(gate_f);
  const std::optional<at::Tensor> lengths_d = lengths.has_value() ? std::optional(kernel_input(*lengths)) : std::nullopt;
  gcla::SummaryForwardParams p{};
  p.o_self = self_tensor("o_self", o_self, q, o_self_d);
  p.lse_self = self_lse("lse_self", lse_self, s, q, lse_self_d);
  p.q = q_d.const_data_ptr();
  p.kc = kc_d.const_data_ptr();
  p.vc = vc_d.const_data_ptr();
  p.gate = gate_d.const_data_ptr<float>();
  p.lengths = lengths_d.has_value() ? lengths_d->const_data_ptr<int64_t>() : nullptr;
  at::Tensor out = empty_output(q.sizes(), q.options());
  at::Tensor lse = empty_output({s.B, s.H, s.T}, q.options().dtype(at::kFloat));
  p.out = out.mutable_data_ptr();
  p.lse = lse.mutable_data_ptr<float>();
  set_shape(p, s, perm_kv, q);
  check_launch(gcla::launch_summary_forward(p, current_stream()), "gcla_attention summary forward");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
gcla_summary_bwd(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q_rot,
                 const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& gate,
                 const std::optional<at::Tensor>& lengths, int64_t perm_kv, int64_t lse_columns, bool write_q_self) {
  const DeviceGuard guard(q.device());
  const at::Tensor gate_f = gate.to(at::kFloat).contiguous();
  const Shape s = check_common(q, kc, vc, gate_f, lengths, perm_kv);
  check_cuda("grad_out", grad_out, q, q.sizes(), "(B, H, T, d_h)");
  check_cuda("out", out, q, q.sizes(), "(B, H, T, d_h)");
  check_cuda("q_rot", q_rot, q, q.sizes(), "(B, H, T, d_h)");
  TORCH_CHECK_VALUE(on_kernel_device(lse) && lse.device() == q.device() && lse.is_contiguous() &&
                        lse.scalar_type() == at::kFloat && lse.sizes() == at::IntArrayRef({s.B, s.H, s.T}),
                    "lse must be a contiguous float32 ", kDevice, " tensor of shape (B, H, T) = (", s.B, ", ", s.H, ", ", s.T,
                    "), got ", lse.sizes(), " ", lse.scalar_type());
  TORCH_CHECK_VALUE(lse_columns >= s.T, "lse_columns must be >= T = ", s.T, ", got ", lse_columns);
  const auto &grad_out_d = kernel_input(grad_out), &out_d = kernel_input(out), &lse_d = kernel_input(lse),
             &q_rot_d = kernel_input(q_rot), &q_d = kernel_input(q), &kc_d = kernel_input(kc),
             &vc_d = kernel_input(vc), &gate_d = kernel_input(gate_f);
  const std::optional<at::Tensor> lengths_d = lengths.has_value() ? std::optional(kernel_input(*lengths)) : std::nullopt;
  const at::TensorOptions f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = empty_output(q.sizes(), q.options());
  at::Tensor dkc = empty_output(kc.sizes(), kc.options());
  at::Tensor dvc = empty_output(vc.sizes(), vc.options());
  at::Tensor dgate = empty_output({s.H}, f32);
  at::Tensor do_self = empty_self(s, q.options());
  at::Tensor o_self = empty_self(s, q.options());
  // Identity order: natural (B, H, T, dh) memory, so that the fused backward's dq needs no copy.
  const bool identity = perm_kv == 1 || perm_kv == s.H;
  at::Tensor q_self = !write_q_self ? at::empty({0}, q.options())
                                    : (identity ? empty_output(q.sizes(), q.options()) : empty_self(s, q.options()));
  // Columns past T exist only for the fused kernels that pad their lse rows; they are never read.
  at::Tensor lse_self = empty_output({s.B, s.H, lse_columns}, f32);
  if (lse_columns > s.T) lse_self.zero_();
  const int64_t nchunks = gcla::backward_chunks(s.T);
  // The kernels' float32 partials in one workspace: gate's, then (S = 1) the context slots'
  // (at a 16-byte boundary for the vector loads).
  const int64_t gate_numel = s.B * s.H * nchunks, ckv_at = (gate_numel + 3) / 4 * 4;
  const int64_t ckv_numel = s.S == 1 ? s.B * s.H * nchunks * 2 * s.L * s.dh : 0;
  at::Tensor workspace = empty_workspace({ckv_numel > 0 ? ckv_at + ckv_numel : gate_numel}, f32);
  at::Tensor gate_part = workspace.narrow(0, 0, gate_numel);
  at::Tensor ckv_part = workspace.narrow(0, ckv_numel > 0 ? ckv_at : 0, ckv_numel);

  gcla::SummaryBackwardParams p{};
  p.grad_out = grad_out_d.const_data_ptr();
  p.out = out_d.const_data_ptr();
  p.lse = lse_d.const_data_ptr<float>();
  p.q_rot = q_rot_d.const_data_ptr();
  p.q = q_d.const_data_ptr();
  p.kc = kc_d.const_data_ptr();
  p.vc = vc_d.const_data_ptr();
  p.gate = gate_d.const_data_ptr<float>();
  p.lengths = lengths_d.has_value() ? lengths_d->const_data_ptr<int64_t>() : nullptr;
  p.dq = dq.mutable_data_ptr();
  p.dkc = dkc.mutable_data_ptr();
  p.dvc = dvc.mutable_data_ptr();
  p.dgate = dgate.mutable_data_ptr<float>();
  p.do_self = self_tensor("do_self", do_self, q);
  p.o_self = self_tensor("o_self", o_self, q);
  p.q_self = write_q_self ? self_tensor("q_self", q_self, q) : gcla::SelfTensor{nullptr, 0, 0, 0};
  p.lse_self = self_lse("lse_self", lse_self, s, q);
  p.gate_part = gate_part.mutable_data_ptr<float>();
  p.ckv_part = s.S == 1 ? ckv_part.mutable_data_ptr<float>() : nullptr;
  set_shape(p, s, perm_kv, q);
  check_launch(gcla::launch_summary_backward(p, current_stream()), "gcla_attention summary backward");
  return {dq, dkc, dvc, dgate, do_self, o_self, q_self, lse_self};
}

}  // namespace

WIOLA_CUDA_KERNELS_IMPL(m) {
  m.impl("_gcla_summary_fwd", &gcla_summary_fwd);
  m.impl("_gcla_summary_bwd", &gcla_summary_bwd);
}

}  // namespace wiola::cuda_gcla
