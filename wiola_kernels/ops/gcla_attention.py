"""GCLA summary-augmented attention (SPEC §5.5): the registered ops ``wiola::gcla_attention``
/ ``wiola::gcla_attention_grad``, the :class:`GCLAAttentionFunction` that drives them, and the
public :func:`gcla_attention`.

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
from ..dtypes import compute_dtype
from ..outputs import in_layout_of, unit_last_stride
from ..reference.gcla_attention import gcla_attention_backward, gcla_attention_forward
from ..validation import (CUDA_GCLA_HEAD_DIMS, CUDA_KERNEL_DTYPES, INDEX_DTYPES, TRITON_GCLA_MAX_HEAD_DIM, Limits,
                          bthd_hint, check_lengths, check_query_key, check_rank, check_same_device, check_same_dtype,
                          check_shape, check_tensor)
from . import distinct, gcla_attention_cuda

OP = "gcla_attention"


def _cpu_forward(q_rot, k_rot, v, q, kc, vc, gate, lengths):
    return torch.ops.wiola._gcla_attention_fwd(q_rot, k_rot, v, q, kc, vc, gate, lengths)


def _cpu_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse):
    return torch.ops.wiola._gcla_attention_bwd(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)


def _triton_forward(q_rot, k_rot, v, q, kc, vc, gate, lengths):
    from ..triton import gcla_attention as tk

    return tk.gcla_attention_fwd(q_rot, k_rot, v, q, kc, vc, gate, lengths)


def _triton_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse):
    from ..triton import gcla_attention as tk

    return tk.gcla_attention_bwd(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)


# The C++ CPU kernel is torch.ops.wiola._gcla_attention_fwd/_bwd; the cuda backend (and its
# emulation, cuda_emu: the same orchestration with the summary kernels run by the SIMT emulator
# on CPU tensors, csrc/cuda/emu/) is PyTorch's fused attention plus the summary kernels
# (gcla_attention_cuda.py), which exist for fp32/fp16/bf16 and d_h ∈ {64, 128} only.
# CUDA tensors run `cuda` by default; `triton` (fused FlashAttention-2 style kernels, even
# d_h up to 256) is chosen with use_backend("triton"), on CPU tensors only under TRITON_INTERPRET=1.
_CUDA_LIMITS = Limits(dtypes=CUDA_KERNEL_DTYPES, head_dims=CUDA_GCLA_HEAD_DIMS)
dispatch.register(OP, "reference", SimpleNamespace(forward=gcla_attention_forward, backward=gcla_attention_backward))
dispatch.register(OP, "cpu", SimpleNamespace(forward=_cpu_forward, backward=_cpu_backward))
dispatch.register(OP, "cuda", SimpleNamespace(forward=gcla_attention_cuda.forward,
                                              backward=gcla_attention_cuda.backward), _CUDA_LIMITS)
dispatch.register(OP, "triton", SimpleNamespace(forward=_triton_forward, backward=_triton_backward),
                  Limits(max_head_dim=TRITON_GCLA_MAX_HEAD_DIM))
dispatch.register(OP, "cuda_emu", SimpleNamespace(forward=gcla_attention_cuda.forward,
                                                  backward=gcla_attention_cuda.backward), _CUDA_LIMITS)


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
                      lengths: Optional[Tensor], backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Forward on ``backend``: returns ``(out (B, H, T, d_h), lse (B, H, T))``; ``out`` laid out like ``q_rot``."""
    impl = dispatch.resolve(OP, backend, q_rot.device, q_rot.dtype, q_rot.shape[-1])
    q_rot, k_rot, v, q, kc, vc = map(unit_last_stride, (q_rot, k_rot, v, q, kc, vc))
    out, lse = impl.forward(q_rot, k_rot, v, q, kc, vc, gate.contiguous(), _contig(lengths))
    return in_layout_of(out, q_rot), lse


@gcla_attention_op.register_fake
def _(q_rot, k_rot, v, q, kc, vc, gate, lengths, backend="auto"):
    B, H, T, _ = q_rot.shape
    return (torch.empty_like(unit_last_stride(q_rot)),
            q_rot.new_empty((B, H, T), dtype=compute_dtype(q_rot.dtype)))


@torch.library.custom_op("wiola::gcla_attention_grad", mutates_args=())
def gcla_attention_grad_op(grad_out: Tensor, q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor,
                           vc: Tensor, gate: Tensor, lengths: Optional[Tensor], out: Tensor, lse: Tensor,
                           backend: str = "auto") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward on ``backend``: ``(d q_rot, d k_rot, d v, d q, d kc, d vc, d gate)``, each in its input's layout."""
    impl = dispatch.resolve(OP, backend, q_rot.device, q_rot.dtype, q_rot.shape[-1])
    grad_out, q_rot, k_rot, v, q, kc, vc, out = map(unit_last_stride, (grad_out, q_rot, k_rot, v, q, kc, vc, out))
    grads = impl.backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate.contiguous(), _contig(lengths), out,
                          lse.contiguous())
    return tuple(in_layout_of(g, like) for g, like in zip(grads, _grad_layouts(q_rot, k_rot, v, q, kc, vc, gate)))


@gcla_attention_grad_op.register_fake
def _(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse, backend="auto"):
    likes = _grad_layouts(*map(unit_last_stride, (q_rot, k_rot, v, q, kc, vc)), gate)
    return tuple(torch.empty_like(t, device=q_rot.device) for t in likes)


def _check_inputs(q_rot, k_rot, v, q, kc, vc, gate, lengths) -> Optional[Tensor]:
    """Every check of :func:`gcla_attention`; returns ``lengths`` as int64 (or None)."""
    for name, t in (("q_rot", q_rot), ("k_rot", k_rot), ("v", v), ("q", q), ("kc", kc), ("vc", vc),
                    ("gate", gate)):
        check_tensor(name, t)
    B, H, H_kv, T, dh = check_query_key("q_rot", q_rot, "k_rot", k_rot)
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
        check_tensor("lengths", lengths, dtypes=INDEX_DTYPES)
    check_same_device(q_rot=q_rot, k_rot=k_rot, v=v, q=q, kc=kc, vc=vc, gate=gate, lengths=lengths)
    return check_lengths(lengths, B, T)


class GCLAAttentionFunction(torch.autograd.Function):
    """Autograd for :func:`gcla_attention`: ``GCLAAttentionFunction.apply(q_rot, k_rot, v, q, kc,
    vc, gate, lengths)`` (every argument positional, ``lengths`` may be None; see
    :func:`gcla_attention`). Validates, picks the backend once for the input's dtype and head
    width (kept on ``ctx``: the backward runs where the forward ran) and calls
    ``wiola::gcla_attention`` / ``wiola::gcla_attention_grad``."""

    @staticmethod
    def forward(ctx, q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor, gate: Tensor,
                lengths: Optional[Tensor]) -> Tensor:
        lengths = _check_inputs(q_rot, k_rot, v, q, kc, vc, gate, lengths)
        ctx.backend = dispatch.select(OP, q_rot.device, q_rot.dtype, q_rot.shape[-1])
        out, lse = gcla_attention_op(q_rot, k_rot, v, q, kc, vc, gate, lengths, ctx.backend)
        ctx.save_for_backward(q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse = ctx.saved_tensors
        grads = gcla_attention_grad_op(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse, ctx.backend)
        return (*grads, None)


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
        lengths: optional integer ``(B,)`` in ``[0, T]``: keys at ``t ≥ len_b`` are
            masked, outputs there are exactly zero, and no work is done past ``len_b``.
            Values are checked on CPU tensors (on a GPU the kernels clamp: no device sync).

    Returns:
        ``O (B, H, T, d_h)`` in the dtype and layout (``torch.empty_like``) of ``q_rot``:
        for the model's transposed views it is in ``(B, T, H, d_h)`` memory order, so
        ``O.transpose(1, 2).reshape(B, T, H·d_h)`` is a view. Softmax statistics in float32
        (float64 for float64 inputs). Causal, scale ``1/√d_h``. Differentiable in every
        tensor argument except ``lengths`` (through :class:`GCLAAttentionFunction`); each
        gradient takes its input's layout (``kc``/``vc``'s for ``S = T``, contiguous for ``S = 1``).
    """
    return GCLAAttentionFunction.apply(*distinct(q_rot, k_rot, v, q, kc, vc, gate, lengths))
