// wiola::gcla_attention and wiola::gcla_attention_backward on CUDA (SPEC §5.5): PyTorch's fused
// causal attention for the self part, our summary kernels (csrc/cuda/gcla_attention.cu) for the
// rest, composed here in C++ — no Python between the dispatcher and the launches.
//
// GCLA's self part is ordinary causal GQA attention and σ(g)·O^cross enters the output linearly,
// so the self part runs on the best attention kernel PyTorch ships and only the summary part
// needs kernels of ours:
//
// * Which fused kernel (self_kernel): float16/bfloat16 on sm80+ use FlashAttention-2
//   (aten::_flash_attention_forward/backward, GQA native). float32 — which flash does not take —
//   uses the memory-efficient kernel (aten::_efficient_attention_forward/backward, O(T) memory;
//   3xTF32 on sm80+ tensor cores, fp32-accurate). It has no GQA: K/V are expanded to H heads in
//   natural order and dK/dV summed back over the group. Half precision without flash (pre-sm80,
//   a build without it) takes that path too, with a one-time warning. Nothing falls back to an
//   O(T²) matrix. Other inputs (float64, d_h ∉ {64, 128}) and WIOLA_GCLA_CUDA_KERNEL=triton run
//   wiola::_triton_gcla_attention(_backward), the Triton kernels registered from Python.
// * Heads: SPEC §5.2 gives head h the kv group h mod H_kv; the fused kernels give query head p
//   the group p / G (G = H/H_kv). Query heads reach a GQA kernel permuted, natural h at
//   p(h) = (h mod H_kv)·G + h / H_kv (perm_kv = H_kv; 1 when H_kv ∈ {1, H}, where the rules
//   agree): one copy of q_rot forward and of dq̃ back; K and V are never copied. The summary
//   kernels read and write the fused kernel's tensors in that order (wiola/gcla_attention.h),
//   so O, dO and lse need no pass of their own.
// * lengths: causal masking already keeps rows t < len_b off keys ≥ len_b, so the fused kernel
//   needs no mask; the summary kernels zero the rows past the length. Padded rows of q_rot,
//   k_rot and v are zeroed before the fused kernel sees them: it multiplies masked-out (zero)
//   weights by whole key blocks, and 0·NaN from garbage in the padding would reach valid rows.
//   With dO and O^self zero there, padded rows add exactly 0 to dK/dV.
// * Layouts: the fused kernels take any strides with a contiguous d_h, so the model's
//   transposed views of q_rot, k_rot and v reach them uncopied. The summary kernels read q, kc,
//   vc, O and dO contiguous and 16-byte aligned (vector loads): those are copied when they are
//   not, and results are copied into the layouts the op's fakes promise (like the inputs).
// * Determinism: our kernels use no atomics. FlashAttention-2's backward accumulates dq with
//   atomics unless torch.use_deterministic_algorithms(True), which PyTorch passes on to it.
//
// Compiled twice: for the CUDA build (registered for wiola's CUDA key), and by
// csrc/cuda/emu/bindings_emu.cpp with WIOLA_CUDA_EMU for the SIMT emulator (registered as
// wiola_cuda_emu's CPU kernels, backend cuda_emu). There the same composite runs on CPU tensors
// with PyTorch's CPU flash attention (aten::_scaled_dot_product_flash_attention_for_cpu, GQA
// native) and the emulated summary kernels; WIOLA_EMU_GCLA_SELF=efficient runs the
// memory-efficient kernel's structure instead (K/V expanded, natural heads, lse rows padded to
// 32 columns), so that every step but the fused kernels' own calls is tested without a GPU.
//
// Also here: the torch side of the summary kernels (wiola::_gcla_summary_fwd / _bwd): checks
// tensors, allocates outputs and workspaces, fills the params structs of
// csrc/include/wiola/gcla_attention.h and launches on the current stream. float32, float16 and
// bfloat16 with d_h ∈ {64, 128}.
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>

#include "binding_device.h"
#include "wiola/checks.h"
#include "wiola/cuda_schemas.h"
#include "wiola/gcla_attention.h"

#ifndef WIOLA_CUDA_EMU
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/transformers/cuda/sdp_utils.h>
#include <ATen/ops/_efficient_attention_backward.h>
#include <ATen/ops/_efficient_attention_forward.h>
#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>

#include <mutex>

#include "triton_launch.h"
#endif

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
// (SelfAttention::backward below) relies on it: it takes the output's strides
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


// ---------------------------------------------------------------------------------
// The composite: wiola::gcla_attention(_backward)
// ---------------------------------------------------------------------------------

// The fused kernel that computes the self part.
enum class SelfKernel {
  kFlash,      // aten::_flash_attention_*: FlashAttention-2, GQA native (CUDA, fp16/bf16, sm80+)
  kEfficient,  // aten::_efficient_attention_*: memory-efficient attention, no GQA (CUDA)
  kCpuFlash,   // aten::_scaled_dot_product_flash_attention_for_cpu*: the emulator's (CPU tensors)
};

#ifndef WIOLA_CUDA_EMU
// Why FlashAttention-2 cannot run on `device` (nullptr when it can): asked once per device (a
// device query per call would be host time).
const char* flash_unusable(int device) {
  static const bool built = sdp::is_flash_attention_available();
  if (!built) return "this PyTorch build has no FlashAttention";
  return triton::arch(device) < 80 ? "FlashAttention needs sm80 or newer" : nullptr;
}
#endif

// The fused self-attention of one call: forward/backward on (B, H, T, d) views whose last
// dimension is contiguous; lse (B, H, >= T) float32 with t contiguous.
struct SelfAttention {
  SelfKernel kernel;
  bool expanded;  // K/V expanded to H heads, heads natural, lse rows padded to 32 columns (no GQA)
  double scale;   // 1/√d_h

  int64_t lse_columns(int64_t T) const { return expanded ? (T + 31) / 32 * 32 : T; }

  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const {
    const int64_t T = q.size(2);
    switch (kernel) {
#ifndef WIOLA_CUDA_EMU
      case SelfKernel::kFlash: {
        auto [o, lse, rng, unused, mask] = at::_flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt, std::nullopt, T, T, 0.0,
            /*is_causal=*/true, /*return_debug_mask=*/false, scale);
        return {o.transpose(1, 2), lse};
      }
      case SelfKernel::kEfficient: {
        // custom_mask_type 1: causal from the top left.
        auto [o, lse, seed, offset, max_q, max_k] = at::_efficient_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt, std::nullopt, std::nullopt,
            std::nullopt, std::nullopt, 0.0, /*custom_mask_type=*/1, /*compute_log_sumexp=*/true, scale);
        return {o.transpose(1, 2), lse};
      }
#endif
      default: {
        auto [o, lse] =
            at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, /*is_causal=*/true, std::nullopt, scale);
        if (!expanded) return {o, lse.contiguous()};
        // The efficient kernel's lse layout, its padding NaN: the summary kernels must not read it.
        at::Tensor padded = at::full({q.size(0), q.size(1), lse_columns(T)}, NAN, lse.options());
        padded.narrow(2, 0, T).copy_(lse);
        return {o, padded};
      }
    }
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& d_o, const at::Tensor& q,
                                                          const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& o, const at::Tensor& lse) const {
    const int64_t T = q.size(2);
    if (expanded) {
      // The efficient backward takes out's strides to be those of a (B, T, H, d) tensor (it
      // ignores out.stride(1)): the summary backward makes O^self so (empty_self); anything else
      // would be read wrong silently.
      TORCH_CHECK(o.transpose(1, 2).is_contiguous(), "gcla_attention: the memory-efficient backward needs O^self laid "
                  "out as (B, T, H, d), got strides ", o.strides(), " for shape ", o.sizes());
    }
    switch (kernel) {
#ifndef WIOLA_CUDA_EMU
      case SelfKernel::kFlash: {
        // Without dropout the RNG state is never read.
        const at::Tensor rng = at::empty({2}, q.options().dtype(at::kUInt64));
        const at::Tensor unused = at::empty({}, q.options().dtype(at::kUInt64));
        auto [dq, dk, dv] = at::_flash_attention_backward(
            d_o.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2), lse,
            at::Tensor(), at::Tensor(), T, T, 0.0, /*is_causal=*/true, rng, unused, scale);
        return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
      }
      case SelfKernel::kEfficient: {
        const at::Tensor seed = at::empty({}, q.options().dtype(at::kLong));
        auto [dq, dk, dv, dbias] = at::_efficient_attention_backward(
            d_o.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt,
            o.transpose(1, 2), std::nullopt, std::nullopt, T, T, lse, 0.0, seed, seed, /*custom_mask_type=*/1,
            /*bias_requires_grad=*/false, scale);
        return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
      }
#endif
      default:
        return at::_scaled_dot_product_flash_attention_for_cpu_backward(
            d_o, q, k, v, o, expanded ? lse.narrow(2, 0, T).contiguous() : lse, 0.0, /*is_causal=*/true,
            std::nullopt, scale);
    }
  }
};

#ifdef WIOLA_CUDA_EMU
// WIOLA_EMU_GCLA_SELF, read at every call as the emulator's other settings: "flash" (default; the
// GQA-native path) or "efficient" (the memory-efficient kernel's structure).
bool emulate_efficient() {
  const char* v = std::getenv("WIOLA_EMU_GCLA_SELF");
  if (v == nullptr || v[0] == '\0' || std::strcmp(v, "flash") == 0) return false;
  TORCH_CHECK_VALUE(std::strcmp(v, "efficient") == 0, "WIOLA_EMU_GCLA_SELF must be flash or efficient, got '", v,
                    "'");
  return true;
}
#endif

// The fused kernel for q_rot's device and dtype.
SelfAttention self_attention(const at::Tensor& q_rot) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q_rot.size(3)));
#ifdef WIOLA_CUDA_EMU
  return {SelfKernel::kCpuFlash, emulate_efficient(), scale};
#else
  if (q_rot.scalar_type() == at::kHalf || q_rot.scalar_type() == at::kBFloat16) {
    const char* why = flash_unusable(q_rot.get_device());
    if (why == nullptr) return {SelfKernel::kFlash, false, scale};
    TORCH_WARN_ONCE("wiola gcla_attention: ", why, "; the self part runs on the memory-efficient attention kernel "
                    "with K/V expanded to H heads (slower, same O(T) memory)");
  }
  return {SelfKernel::kEfficient, true, scale};
#endif
}

// perm_kv of the summary kernels for these heads: H_kv when the fused kernel is GQA-native and
// the two grouping rules differ, else 1 (heads natural).
int64_t perm_kv_of(const SelfAttention& attn, int64_t H, int64_t H_kv) {
  return !attn.expanded && 1 < H_kv && H_kv < H ? H_kv : 1;
}

// x (B, H, T, d), natural heads h = j·P + g, in the fused kernel's order p = g·(H/P) + j: a
// (B, H, T, d) view of fresh (B, T, H, d) memory (the layout flash keeps), one copy.
at::Tensor to_self_order(const at::Tensor& x, int64_t P) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), d = x.size(3), G = H / P;
  at::Tensor y = at::empty({B, T, P, G, d}, x.options());
  y.copy_(x.reshape({B, G, P, T, d}).permute({0, 3, 2, 1, 4}));
  return y.view({B, T, H, d}).transpose(1, 2);
}

// The inverse of to_self_order, written straight into `like`'s layout (torch.empty_like), one copy.
at::Tensor from_self_order(const at::Tensor& x, int64_t P, const at::Tensor& like) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), d = x.size(3), G = H / P;
  at::Tensor y = at::empty_like(like, x.options());
  y.view({B, G, P, T, d}).copy_(x.transpose(1, 2).reshape({B, T, P, G, d}).permute({0, 3, 2, 1, 4}));
  return y;
}

// (B, 1, T, 1): true on rows t >= len_b.
at::Tensor pad_mask(const at::Tensor& lengths, int64_t T) {
  const at::Tensor t = at::arange(T, lengths.options());
  return t.unsqueeze(0).ge(lengths.unsqueeze(1)).view({lengths.size(0), 1, T, 1});
}

// K and V as the fused kernel reads them: zero past the lengths, expanded to H heads for a
// kernel without GQA (head j·H_kv + g reads group g: repeat, not repeat_interleave).
std::pair<at::Tensor, at::Tensor> self_kv(const SelfAttention& attn, at::Tensor k, at::Tensor v,
                                          const std::optional<at::Tensor>& pad, int64_t G) {
  if (pad.has_value()) k = k.masked_fill(*pad, 0.0), v = v.masked_fill(*pad, 0.0);
  if (attn.expanded && G > 1) k = k.repeat({1, G, 1, 1}), v = v.repeat({1, G, 1, 1});
  return {k, v};
}

// The widest vector access of the summary kernels (16 bytes): their inputs start at a multiple of it.
constexpr uintptr_t kVectorBytes = 16;

// x contiguous and 16-byte aligned, as the summary kernels read it (a contiguous view at an
// element offset, x[1:], is copied).
at::Tensor for_kernel(const at::Tensor& x) {
  at::Tensor c = x.contiguous();
  if (reinterpret_cast<uintptr_t>(c.const_data_ptr()) % kVectorBytes == 0) return c;
  return c.clone(at::MemoryFormat::Contiguous);
}

// result in the layout torch.empty_like(like) has (the op's fakes promise it): itself when it
// already is, else copied into it. Strides of dimensions of size 1 address nothing.
at::Tensor in_layout_of(const at::Tensor& result, const at::Tensor& like) {
  if (like.is_non_overlapping_and_dense()) {
    bool same = true;
    for (int64_t i = 0; i < like.dim(); ++i) same = same && (like.size(i) <= 1 || like.stride(i) == result.stride(i));
    if (same) return result;
  }
  return at::empty_like(like, result.options()).copy_(result);
}

// kc / vc's gradient layout: theirs for S = T, contiguous for S = 1 (sums over positions).
at::Tensor context_grad(const at::Tensor& g, const at::Tensor& like) {
  return like.size(2) == 1 ? g.contiguous() : in_layout_of(g, like);
}

using Outputs = std::tuple<at::Tensor, at::Tensor>;
using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

#ifndef WIOLA_CUDA_EMU
using ForwardSig = Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using BackwardSig = Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&);

// WIOLA_GCLA_CUDA_KERNEL=triton (read once; the Python package checks its value at import,
// wiola_kernels/ops/gcla_attention.py cuda_kernel): every call runs the Triton kernels.
bool triton_chosen() {
  static const bool chosen = [] {
    const char* v = std::getenv("WIOLA_GCLA_CUDA_KERNEL");
    std::string name = v == nullptr ? "" : v;
    name.erase(0, name.find_first_not_of(" \t\n"));
    name.erase(name.find_last_not_of(" \t\n") + 1);
    return name == "triton";
  }();
  return chosen;
}
#endif

// Whether the composite runs this call: the summary kernels' dtypes and head widths (in the
// emulator, anything else is the kernels' TypeError / ValueError: the cuda_emu backend's limits
// keep such inputs away).
bool composite_takes(const at::Tensor& q_rot) {
#ifdef WIOLA_CUDA_EMU
  kernel_dtype(q_rot, "q_rot");
  TORCH_CHECK_VALUE(gcla::supported_head_dim(q_rot.size(3)), "the CUDA gcla_attention kernels support d_h in ",
                    gcla::head_dims_text(), ", got ", q_rot.size(3));
  return true;
#else
  const auto s = q_rot.scalar_type();
  return !triton_chosen() && (s == at::kFloat || s == at::kHalf || s == at::kBFloat16) &&
         gcla::supported_head_dim(q_rot.size(3));
#endif
}

Outputs gcla_attention_fwd(const at::Tensor& q_rot_in, const at::Tensor& k_rot_in, const at::Tensor& v_in,
                           const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& gate,
                           const std::optional<at::Tensor>& lengths_in) {
  const std::optional<at::Tensor> lengths =
      checks::gcla_attention(q_rot_in, k_rot_in, v_in, q, kc, vc, gate, lengths_in);
  if (!composite_takes(q_rot_in)) {
#ifndef WIOLA_CUDA_EMU
    static const auto triton = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("wiola::_triton_gcla_attention", "")
                                   .typed<ForwardSig>();
    return triton.call(q_rot_in, k_rot_in, v_in, q, kc, vc, gate, lengths_in);
#endif
  }
  const DeviceGuard guard(q_rot_in.device());
  const at::Tensor q_rot = checks::unit_last_stride(q_rot_in), k_rot = checks::unit_last_stride(k_rot_in),
                   v = checks::unit_last_stride(v_in);
  const int64_t H = q_rot.size(1), H_kv = k_rot.size(1), T = q_rot.size(2);
  const SelfAttention attn = self_attention(q_rot);
  const int64_t P = perm_kv_of(attn, H, H_kv);
  const std::optional<at::Tensor> pad = lengths.has_value() ? std::optional(pad_mask(*lengths, T)) : std::nullopt;
  at::Tensor q_self = q_rot;
  if (P != 1) {
    q_self = to_self_order(q_rot, P);
    if (pad.has_value()) q_self.masked_fill_(*pad, 0.0);  // fresh memory
  } else if (pad.has_value()) {
    q_self = q_rot.masked_fill(*pad, 0.0);
  }
  const auto [k_self, v_self] = self_kv(attn, k_rot, v, pad, H / H_kv);
  const auto [o_self, lse_self] = attn.forward(q_self, k_self, v_self);
  auto [out, lse] = gcla_summary_fwd(o_self, lse_self, for_kernel(q), for_kernel(kc), for_kernel(vc), gate, lengths, P);
  return {in_layout_of(out, q_rot), lse};
}

Grads gcla_attention_bwd(const at::Tensor& grad_out, const at::Tensor& q_rot_in, const at::Tensor& k_rot_in,
                         const at::Tensor& v_in, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                         const at::Tensor& gate, const std::optional<at::Tensor>& lengths_in, const at::Tensor& out,
                         const at::Tensor& lse) {
  const std::optional<at::Tensor> lengths =
      checks::gcla_attention_backward(grad_out, q_rot_in, k_rot_in, v_in, q, kc, vc, gate, lengths_in, out, lse);
  if (!composite_takes(q_rot_in)) {
#ifndef WIOLA_CUDA_EMU
    static const auto triton = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("wiola::_triton_gcla_attention_backward", "")
                                   .typed<BackwardSig>();
    return triton.call(grad_out, q_rot_in, k_rot_in, v_in, q, kc, vc, gate, lengths_in, out, lse);
#endif
  }
  const DeviceGuard guard(q_rot_in.device());
  const at::Tensor q_rot = checks::unit_last_stride(q_rot_in), k_rot = checks::unit_last_stride(k_rot_in),
                   v = checks::unit_last_stride(v_in);
  const int64_t B = q_rot.size(0), H = q_rot.size(1), H_kv = k_rot.size(1), T = q_rot.size(2), dh = q_rot.size(3);
  const int64_t G = H / H_kv;
  const SelfAttention attn = self_attention(q_rot);
  const int64_t P = perm_kv_of(attn, H, H_kv);
  // q_rot in the fused kernel's order and zero past the lengths: written by the summary
  // backward when it differs from q_rot itself.
  const bool write_q_self = P != 1 || lengths.has_value();
  auto [dq, dkc, dvc, dgate, do_self, o_self, q_self, lse_self] =
      gcla_summary_bwd(for_kernel(grad_out), for_kernel(out), lse.contiguous(), for_kernel(q_rot), for_kernel(q),
                       for_kernel(kc), for_kernel(vc), gate, lengths, P, attn.lse_columns(T), write_q_self);
  if (!write_q_self) q_self = q_rot;
  const std::optional<at::Tensor> pad = lengths.has_value() ? std::optional(pad_mask(*lengths, T)) : std::nullopt;
  const auto [k_self, v_self] = self_kv(attn, k_rot, v, pad, G);
  auto [dq_self, dk, dv] = attn.backward(do_self, q_self, k_self, v_self, o_self, lse_self);
  const at::Tensor dq_rot = P != 1 ? from_self_order(dq_self, P, q_rot) : in_layout_of(dq_self, q_rot);
  if (attn.expanded && G > 1) {  // the group's heads summed back, in a fixed order
    dk = dk.reshape({B, G, H_kv, T, dh}).sum(1);
    dv = dv.reshape({B, G, H_kv, T, dh}).sum(1);
  }
  return {dq_rot,
          in_layout_of(dk, k_rot),
          in_layout_of(dv, v),
          in_layout_of(dq, checks::unit_last_stride(q)),
          context_grad(dkc, checks::unit_last_stride(kc)),
          context_grad(dvc, checks::unit_last_stride(vc)),
          dgate.to(gate.scalar_type())};
}

}  // namespace

WIOLA_CUDA_KERNELS_IMPL(m) {
  m.impl("gcla_attention", &gcla_attention_fwd);
  m.impl("gcla_attention_backward", &gcla_attention_bwd);
  m.impl("_gcla_summary_fwd", &gcla_summary_fwd);
  m.impl("_gcla_summary_bwd", &gcla_summary_bwd);
}

}  // namespace wiola::cuda_gcla
