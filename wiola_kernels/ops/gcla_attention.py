"""GCLA summary-augmented attention as a registered op (SPEC §5.5):
``torch.ops.wiola.gcla_attention`` (+ ``gcla_attention_backward``).

``O = softmax_causal(q̃ k̃ᵀ/√d_h) v + σ(g) · softmax_λ(q kcᵀ/√d_h) vc`` per head, with kv
group ``h mod H_kv``; see :mod:`wiola_kernels.reference.gcla_attention` for the maths.

Each backend provides, on tensors with any strides but a contiguous last dimension
(``lengths`` int64 or ``None``; the model's q/k/v are transposed ``(B, T, H, d_h)`` views):

* ``forward(q_rot, k_rot, v, q, kc, vc, gate, lengths) -> (out, lse)``
* ``backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)
  -> (d q_rot, d k_rot, d v, d q, d kc, d vc, d gate)``

``lse (B, H, T)`` is the self-attention log-sum-exp in float32 (float64 for float64
inputs), 0 on rows past the length.

Layouts (no hidden copies): ``out`` and each gradient take the layout of
``torch.empty_like`` of the matching input (``out``, ``d q_rot`` like ``q_rot``; ``d k_rot``,
``d v``, ``d q`` like theirs; ``d kc``/``d vc`` like ``kc``/``vc`` for ``S = T``, contiguous for
``S = 1``, where they are sums over positions). The cpu and triton kernels read strided
inputs and write these layouts directly; the reference and the cuda composite (its summary
kernels take contiguous tensors) have their results copied into them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from .. import dispatch
from . import gcla_attention_cuda
from ..reference.gcla_attention import gcla_attention_backward, gcla_attention_forward
from ..dtypes import compute_dtype
from ..outputs import in_layout_of, unit_last_stride
from ..validation import bthd_hint, check_rank, check_same_device, check_same_dtype, check_shape, check_tensor

OP = "gcla_attention"


def _cpu_forward(q_rot, k_rot, v, q, kc, vc, gate, lengths):
    return torch.ops.wiola._gcla_attention_fwd(q_rot, k_rot, v, q, kc, vc, gate, lengths)


def _cpu_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse):
    return torch.ops.wiola._gcla_attention_bwd(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)


CUDA_HEAD_DIMS = (64, 128)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cuda_supports(q_rot: Tensor) -> bool:
    """The summary kernels are instantiated for d_h ∈ {64, 128} and fp32/fp16/bf16; other CUDA
    inputs (float64 for gradcheck, odd head widths) run the reference, with a warning."""
    return q_rot.shape[-1] in CUDA_HEAD_DIMS and q_rot.dtype in CUDA_DTYPES


def _warn_reference(q_rot: Tensor) -> None:
    gcla_attention_cuda._warn_once(
        f"wiola gcla_attention: the cuda backend has kernels for d_h in {CUDA_HEAD_DIMS} and "
        f"float32/float16/bfloat16, got d_h = {q_rot.shape[-1]}, {q_rot.dtype}: running the O(T²) reference")


def _cuda_forward(q_rot, k_rot, v, q, kc, vc, gate, lengths):
    if not _cuda_supports(q_rot):
        _warn_reference(q_rot)
        return gcla_attention_forward(q_rot, k_rot, v, q, kc, vc, gate, lengths)
    return gcla_attention_cuda.forward(q_rot, k_rot, v, q, kc, vc, gate, lengths)


def _cuda_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse):
    if not _cuda_supports(q_rot):
        return gcla_attention_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)
    return gcla_attention_cuda.backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)


def _triton_forward(q_rot, k_rot, v, q, kc, vc, gate, lengths):
    from ..triton import gcla_attention as tk

    return tk.gcla_attention_fwd(q_rot, k_rot, v, q, kc, vc, gate, lengths)


def _triton_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse):
    from ..triton import gcla_attention as tk

    return tk.gcla_attention_bwd(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)


def _emu_forward(q_rot, k_rot, v, q, kc, vc, gate, lengths):
    if not _cuda_supports(q_rot):
        return gcla_attention_forward(q_rot, k_rot, v, q, kc, vc, gate, lengths)
    # CPU tensors: the CPU flash kernel for the self part, the summary kernels emulated.
    return gcla_attention_cuda.forward(q_rot, k_rot, v, q, kc, vc, gate, lengths)


def _emu_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse):
    if not _cuda_supports(q_rot):
        return gcla_attention_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)
    return gcla_attention_cuda.backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)


# The C++ CPU kernel is torch.ops.wiola._gcla_attention_fwd/_bwd; the cuda backend (and its
# emulation, cuda_emu) is PyTorch's fused attention plus the summary kernels (gcla_attention_cuda.py).
# CUDA tensors run `cuda` by default; `triton` (fused FlashAttention-2 style kernels) is chosen
# with use_backend("triton"), or on CPU tensors only when forced under TRITON_INTERPRET=1.
dispatch.register(OP, "reference", SimpleNamespace(forward=gcla_attention_forward, backward=gcla_attention_backward))
dispatch.register(OP, "cpu", SimpleNamespace(forward=_cpu_forward, backward=_cpu_backward))
dispatch.register(OP, "cuda", SimpleNamespace(forward=_cuda_forward, backward=_cuda_backward))
dispatch.register(OP, "triton", SimpleNamespace(forward=_triton_forward, backward=_triton_backward))
# Test backend: the CUDA kernels and binding on CPU tensors, in the SIMT emulator (csrc/cuda/emu/).
dispatch.register(OP, "cuda_emu", SimpleNamespace(forward=_emu_forward, backward=_emu_backward))


def _contig(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _grad_layouts(q_rot, k_rot, v, q, kc, vc, gate) -> tuple[Tensor, ...]:
    """Tensors whose ``torch.empty_like`` has the layout of each backward output (meta
    tensors stand for contiguous ones: no allocation)."""
    def contiguous(t):
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    if kc.shape[2] == 1:  # S = 1: sums over positions, contiguous
        kc, vc = contiguous(kc), contiguous(vc)
    return q_rot, k_rot, v, q, kc, vc, contiguous(gate)


@torch.library.custom_op("wiola::gcla_attention", mutates_args=())
def gcla_attention_op(q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor, gate: Tensor,
                      lengths: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Forward: returns ``(out (B, H, T, d_h), lse (B, H, T))``; ``out`` laid out like ``q_rot``."""
    impl = dispatch.implementation(OP, q_rot.device)
    q_rot, k_rot, v, q, kc, vc = map(unit_last_stride, (q_rot, k_rot, v, q, kc, vc))
    out, lse = impl.forward(q_rot, k_rot, v, q, kc, vc, gate.contiguous(), _contig(lengths))
    return in_layout_of(out, q_rot), lse


@gcla_attention_op.register_fake
def _(q_rot, k_rot, v, q, kc, vc, gate, lengths):
    B, H, T, _ = q_rot.shape
    return (torch.empty_like(unit_last_stride(q_rot)),
            q_rot.new_empty((B, H, T), dtype=compute_dtype(q_rot.dtype)))


@torch.library.custom_op("wiola::gcla_attention_backward", mutates_args=())
def gcla_attention_backward_op(grad_out: Tensor, q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor,
                               vc: Tensor, gate: Tensor, lengths: Optional[Tensor], out: Tensor, lse: Tensor,
                               backend: str = "auto") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward: ``(d q_rot, d k_rot, d v, d q, d kc, d vc, d gate)`` on the forward's ``backend``."""
    impl = dispatch.backward_implementation(OP, q_rot.device, backend)
    grad_out, q_rot, k_rot, v, q, kc, vc, out = map(unit_last_stride, (grad_out, q_rot, k_rot, v, q, kc, vc, out))
    grads = impl.backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate.contiguous(), _contig(lengths), out,
                          lse.contiguous())
    return tuple(in_layout_of(g, like) for g, like in zip(grads, _grad_layouts(q_rot, k_rot, v, q, kc, vc, gate)))


@gcla_attention_backward_op.register_fake
def _(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse, backend="auto"):
    likes = _grad_layouts(*map(unit_last_stride, (q_rot, k_rot, v, q, kc, vc)), gate)
    return tuple(torch.empty_like(t, device=q_rot.device) for t in likes)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7], inputs[7], output[0], output[1])
    ctx.backend = dispatch.select(OP, inputs[0].device)


def _backward(ctx, grad_out, _grad_lse):
    q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse = ctx.saved_tensors
    grads = gcla_attention_backward_op(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse,
                                       ctx.backend)
    return (*grads, None)


torch.library.register_autograd("wiola::gcla_attention", _backward, setup_context=_setup_context)


_INT_DTYPES = (torch.int32, torch.int64)


def gcla_attention(q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor, gate: Tensor,
                   lengths: Optional[Tensor] = None) -> Tensor:
    """GCLA summary-augmented attention (SPEC §5.5): ``O = O^self + σ(gate) · O^cross``.

    Layout: every attention tensor is ``(B, heads, T, d_h)`` — heads before time.
    Projections reshaped with ``.view(B, T, H, d_h)`` need ``.transpose(1, 2)`` first; when
    ``H = H_kv = T`` the shapes cannot tell the two layouts apart, so no error can catch
    that mistake. Any strides are read in place (only a last dimension with stride ≠ 1 is
    copied first): pass the transposed views — and :func:`srpe`'s outputs, which keep
    their layout — as they are; the cpu and triton backends make no copy.

    Args:
        q_rot: SRPE-rotated queries ``(B, H, T, d_h)``; float32, float64, bfloat16 or float16.
        k_rot: SRPE-rotated keys ``(B, H_kv, T, d_h)``; head ``h`` reads group ``h mod H_kv``.
        v: values ``(B, H_kv, T, d_h)``.
        q: un-rotated queries ``(B, H, T, d_h)`` for the cross part.
        kc, vc: context keys/values ``(B, H, S, Λ', d_h)``, ``S = 1`` (paper summaries,
            shared by all positions) or ``S = T`` (causal summaries); ``Λ' = 0`` gives
            plain causal attention. Same dtype as ``q_rot`` (all six tensors share one).
        gate: ``(H,)`` gate logits ``g`` (any float dtype); the cross part is scaled by ``σ(g_h)``.
        lengths: optional ``(B,)`` int32/int64 in ``[0, T]``: keys at ``t ≥ len_b`` are
            masked, outputs there are exactly zero, and no work is done past ``len_b``.

    Returns:
        ``O (B, H, T, d_h)`` in the dtype and layout (``torch.empty_like``) of ``q_rot``:
        for the model's transposed views it is in ``(B, T, H, d_h)`` memory order, so
        ``O.transpose(1, 2).reshape(B, T, H·d_h)`` is a view. Softmax statistics in float32
        (float64 for float64 inputs). Causal, scale ``1/√d_h``. Differentiable in every
        tensor argument except ``lengths``; each gradient takes its input's layout
        (``kc``/``vc``'s for ``S = T``, contiguous for ``S = 1``).
    """
    for name, t in (("q_rot", q_rot), ("k_rot", k_rot), ("v", v), ("q", q), ("kc", kc), ("vc", vc),
                    ("gate", gate)):
        check_tensor(name, t)
    check_rank("q_rot", q_rot, 4, "(B, H, T, d_h)")
    B, H, T, dh = q_rot.shape
    check_rank("k_rot", k_rot, 4, "(B, H_kv, T, d_h)")
    H_kv = k_rot.shape[1]
    if k_rot.shape[0] != B or k_rot.shape[2] != T or k_rot.shape[3] != dh:
        raise ValueError(f"k_rot must have shape (B, H_kv, T, d_h) = ({B}, H_kv, {T}, {dh}), got {tuple(k_rot.shape)}"
                         f"{bthd_hint(q_rot, k_rot)}")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"the number of query heads H = {H} (q_rot dim 1) must be a multiple of "
                         f"H_kv = {H_kv} (k_rot dim 1){bthd_hint(q_rot, k_rot)}")
    if dh == 0 or dh % 2 != 0:
        raise ValueError(f"head width d_h (last dim of q_rot) must be even and > 0, got {dh}")
    # With H = H_kv the four tensors agree in either layout; kc/gate give a transposed call away.
    transposed = bthd_hint(q_rot, k_rot, v, q)
    check_shape("v", v, (B, H_kv, T, dh), "(B, H_kv, T, d_h)")
    check_shape("q", q, (B, H, T, dh), "(B, H, T, d_h)")
    check_rank("kc", kc, 5, "(B, H, S, Λ', d_h)")
    if kc.shape[0] != B or kc.shape[1] != H or kc.shape[4] != dh or kc.shape[2] not in (1, T):
        hint = transposed if kc.shape[1] == T and kc.shape[2] in (1, H) else ""
        raise ValueError(f"kc must have shape (B, H, S, Λ', d_h) = ({B}, {H}, S, Λ', {dh}) with S in "
                         f"{{1, T = {T}}}, got {tuple(kc.shape)}{hint}")
    check_rank("vc", vc, 5, "(B, H, S, Λ', d_h)")
    if tuple(vc.shape) != tuple(kc.shape):
        raise ValueError(f"vc must have the shape of kc (B, H, S, Λ', d_h) = {tuple(kc.shape)} (same S and Λ'), "
                         f"got {tuple(vc.shape)}")
    if tuple(gate.shape) != (H,):
        hint = transposed if tuple(gate.shape) == (T,) else ""
        raise ValueError(f"gate must have shape (H,) = ({H},), got {tuple(gate.shape)}{hint}")
    check_same_dtype(q_rot=q_rot, k_rot=k_rot, v=v, q=q, kc=kc, vc=vc)
    if lengths is not None:
        check_tensor("lengths", lengths, dtypes=_INT_DTYPES)
    check_same_device(q_rot=q_rot, k_rot=k_rot, v=v, q=q, kc=kc, vc=vc, gate=gate, lengths=lengths)
    if lengths is not None:
        check_shape("lengths", lengths, (B,), "(B,)")
        # A value check needs the data; under torch.compile the kernels clamp instead.
        if not torch.compiler.is_compiling() and B > 0:
            lo, hi = int(lengths.min()), int(lengths.max())
            if lo < 0 or hi > T:
                raise ValueError(f"lengths must lie in [0, T] = [0, {T}], got values in [{lo}, {hi}]")
        lengths = lengths.to(torch.int64)
    out, _ = gcla_attention_op(q_rot, k_rot, v, q, kc, vc, gate, lengths)
    return out
