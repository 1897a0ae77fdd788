"""GCLA summary-augmented causal attention (SPEC §5.5): :func:`gcla_attention`, the
:class:`GCLAAttentionFunction` that drives its registered ops, and their kernels written in
Python.

``O = softmax_causal(q̃ k̃ᵀ/√d_h) v + σ(g) · softmax_λ(q kcᵀ/√d_h) vc`` per head, with kv
group ``h mod H_kv``; see :mod:`wiola_kernels.reference.gcla_attention` for the maths.

Registered ops (declared in csrc/cpu/gcla_attention.cpp):

* ``wiola::gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths) -> (out, lse)``
* ``wiola::gcla_attention_backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)
  -> (d q_rot, d k_rot, d v, d q, d kc, d vc, d gate)``

``lse (B, H, T)`` is the self-attention log-sum-exp in float32 (float64 for float64 inputs),
0 on rows past the length. Layouts (no hidden copies): inputs are read through their strides
(only a last dimension with stride ≠ 1 is copied); ``out`` and each gradient take the layout
of ``torch.empty_like`` of the matching input (``d kc``/``d vc`` contiguous for ``S = 1``,
where they are sums over positions). The C++ and Triton kernels write these layouts directly;
the reference's and the cuda composite's results are copied into them.

Kernels: CPU — csrc/cpu/gcla_attention.cpp; Meta — the fakes below; CUDA — C++, one of two,
chosen once, when the extension loads, by ``WIOLA_GCLA_CUDA_KERNEL`` (checked here at import):

* ``cuda`` (default): PyTorch's fused attention for the self part and our summary kernels,
  composed in C++ (csrc/cuda/gcla_attention_binding.cpp), for float32/float16/bfloat16 and
  ``d_h ∈ {64, 128}``; any other input runs the Triton kernels, with a one-time warning;
* ``triton``: the fused FlashAttention-2-style Triton kernels (triton/gcla_attention.py),
  even ``d_h`` up to 256.

Either way the C++ kernel hands what it does not run itself to ``wiola::_triton_gcla_attention``
(``_backward``), whose CUDA kernel is the Python one below.

Forced backends: ``reference``, ``cpu``, ``cuda``, ``triton``, ``cuda_emu`` (the CUDA composite
itself on CPU tensors: PyTorch's CPU flash attention and the summary kernels run by the SIMT
emulator, ``torch.ops.wiola_cuda_emu``).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch, reference, shapes
from ..dtypes import compute_dtype
from ..outputs import in_layout_of, unit_last_stride
from ..reference.gcla_attention import gcla_attention_backward as _reference_backward
from ..reference.gcla_attention import gcla_attention_forward as _reference_forward
from ..validation import (CUDA_KERNEL_DTYPES, INDEX_DTYPES, TRITON_GCLA_FP32_MAX_HEAD_DIM,
                          TRITON_GCLA_MAX_HEAD_DIM, Limits, bthd_hint, check_lengths, check_query_key,
                          check_rank, check_same_device, check_same_dtype, check_shape, check_tensor)
from . import distinct, needs_grad, register_fake, register_triton_cuda, registered, registered_ops


__all__ = ["GCLAAttentionFunction", "gcla_attention"]  # exported by wiola_kernels

OP = "gcla_attention"
# The registered ops' overloads, looked up once: a call skips the overload resolution of
# ``torch.ops.wiola.<name>(...)``.
_ops = registered_ops("gcla_attention", "gcla_attention_backward")
CUDA_KERNELS = ("cuda", "triton")


# --- argument checks ------------------------------------------------------------------------------
# What the kernels written in Python and the fakes check at entry, in the words of the C++
# kernels' checks::gcla_attention (csrc/include/wiola/checks.h).

#: Head widths the CUDA GCLA summary kernels are instantiated for (csrc/cuda/gcla_attention.cu).
CUDA_GCLA_HEAD_DIMS = (64, 128)


def check_gcla_attention(q_rot: object, k_rot: object, v: object, q: object, kc: object, vc: object, gate: object,
                         lengths: object) -> torch.Tensor | None:
    """Arguments of :func:`wiola_kernels.gcla_attention`; returns ``lengths`` as int64 (or None)."""
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


def _grad_layouts(q_rot, k_rot, v, q, kc, vc, gate) -> tuple[Tensor, ...]:
    """Tensors whose ``torch.empty_like`` has the layout of each backward output (meta
    tensors stand for contiguous ones: no allocation)."""
    def contiguous(t):
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    if kc.shape[2] == 1:  # S = 1: sums over positions, contiguous
        kc, vc = contiguous(kc), contiguous(vc)
    return q_rot, k_rot, v, q, kc, vc, contiguous(gate)


# --- kernels written in Python ---------------------------------------------------------------------

def _python_kernels(forward, backward) -> SimpleNamespace:
    """The op's two signatures around ``forward(q_rot, k_rot, v, q, kc, vc, gate, lengths int64 |
    None)`` and ``backward(...)`` of one backend: inputs checked (forward) and with a unit last
    stride, results in the layouts the op promises."""
    def fwd(q_rot, k_rot, v, q, kc, vc, gate, lengths=None):
        lengths = check_gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths)
        q_rot, k_rot, v, q, kc, vc = map(unit_last_stride, (q_rot, k_rot, v, q, kc, vc))
        out, lse = forward(q_rot, k_rot, v, q, kc, vc, gate.contiguous(), lengths)
        return in_layout_of(out, q_rot), lse

    def bwd(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse):
        lengths = None if lengths is None else lengths.to(torch.int64).contiguous()
        grad_out, q_rot, k_rot, v, q, kc, vc, out = map(unit_last_stride, (grad_out, q_rot, k_rot, v, q, kc, vc, out))
        grads = backward(grad_out, q_rot, k_rot, v, q, kc, vc, gate.contiguous(), lengths, out, lse.contiguous())
        return tuple(in_layout_of(g, like) for g, like in zip(grads, _grad_layouts(q_rot, k_rot, v, q, kc, vc, gate)))

    return SimpleNamespace(forward=fwd, backward=bwd)


def _triton_forward(*args):
    from ..triton import gcla_attention as tk

    return tk.gcla_attention_fwd(*args)


def _triton_backward(*args):
    from ..triton import gcla_attention as tk

    return tk.gcla_attention_bwd(*args)


def _registered_kernels(namespace: str) -> SimpleNamespace:
    """The registered ops of ``namespace`` (``wiola``: the dispatcher's kernels; ``wiola_cuda_emu``:
    the CUDA composite on CPU tensors, its summary kernels emulated), looked up when called."""
    return SimpleNamespace(forward=registered(namespace, "gcla_attention", check_gcla_attention),
                           backward=registered(namespace, "gcla_attention_backward",
                                               lambda grad_out, *a: check_gcla_attention(*a[:8])))


# The CUDA C++ summary kernels exist for fp32/fp16/bf16 and d_h ∈ {64, 128} only; cuda_emu runs
# the same composite and kernels (the SIMT emulator) on CPU tensors.
_CUDA_LIMITS = Limits(dtypes=CUDA_KERNEL_DTYPES, head_dims=CUDA_GCLA_HEAD_DIMS)
dispatch.register(OP, "reference", _python_kernels(_reference_forward, _reference_backward))
dispatch.register(OP, "cpu", _registered_kernels("wiola"))
dispatch.register(OP, "cuda", _registered_kernels("wiola"), _CUDA_LIMITS)
dispatch.register(OP, "triton", _python_kernels(_triton_forward, _triton_backward),
                  Limits(max_head_dim=TRITON_GCLA_MAX_HEAD_DIM,
                         dtype_max_head_dims=((torch.float32, TRITON_GCLA_FP32_MAX_HEAD_DIM),)))
dispatch.register(OP, "cuda_emu", _registered_kernels("wiola_cuda_emu"), _CUDA_LIMITS)


def cuda_kernel() -> str:
    """Which kernel runs GCLA on CUDA tensors by default: ``WIOLA_GCLA_CUDA_KERNEL`` (``"cuda"``,
    the default, or ``"triton"``), read once, when the package is imported."""
    name = os.environ.get("WIOLA_GCLA_CUDA_KERNEL", "cuda").strip() or "cuda"
    if name not in CUDA_KERNELS:
        raise ValueError(f"WIOLA_GCLA_CUDA_KERNEL must be one of {CUDA_KERNELS}, got {name!r}")
    return name


_CUDA_KERNEL = cuda_kernel()
dispatch.register_default(OP, "cpu", "cpu")
dispatch.register_default(OP, "cuda", _CUDA_KERNEL)


def _fallback_backend(q_rot: Tensor) -> str:
    """The Python backend that runs a CUDA call the C++ kernel hands over: the configured one
    when it is Triton, else the next in line for an input outside the composite's limits
    (with a one-time warning naming why)."""
    head_dim = q_rot.shape[-1] if q_rot.dim() else None
    backend = dispatch.resolve(OP, _CUDA_KERNEL, q_rot.device, q_rot.dtype, head_dim)
    return "triton" if backend == "cuda" else backend  # (the C++ kernel runs what "cuda" takes)


def _forward_on_cuda(q_rot, *args):
    return dispatch.kernels(OP, _fallback_backend(q_rot)).forward(q_rot, *args)


def _backward_on_cuda(grad_out, q_rot, *args):
    return dispatch.kernels(OP, _fallback_backend(q_rot)).backward(grad_out, q_rot, *args)


# wiola::_triton_gcla_attention(_backward), which the C++ CUDA kernel runs for what it does not
# take; wiola::gcla_attention's own CUDA kernel only in a build without the CUDA kernels.
register_triton_cuda("gcla_attention", _forward_on_cuda)
register_triton_cuda("gcla_attention_backward", _backward_on_cuda)


def _gcla_attention_fake(q_rot, k_rot, v, q, kc, vc, gate, lengths=None):
    check_gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths)
    B, H, T, _ = q_rot.shape
    return (torch.empty_like(unit_last_stride(q_rot)),
            q_rot.new_empty((B, H, T), dtype=compute_dtype(q_rot.dtype)))


def _gcla_attention_backward_fake(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse):
    likes = _grad_layouts(*map(unit_last_stride, (q_rot, k_rot, v, q, kc, vc)), gate)
    return tuple(torch.empty_like(t, device=q_rot.device) for t in likes)


# The CUDA composite's summary kernels (csrc/cuda/gcla_attention.cu): o_self / lse_self and the
# self tensors of the backward are in the fused kernel's head order and (B, T, H, d_h) memory
# (the binding's empty_self), everything else natural and contiguous.
def _summary_fwd_fake(o_self, lse_self, q, kc, vc, gate, lengths, perm_kv):
    B, H, T, _ = q.shape
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty((B, H, T), dtype=torch.float32)


def _summary_bwd_fake(grad_out, out, lse, q_rot, q, kc, vc, gate, lengths, perm_kv, lse_columns, write_q_self):
    B, H, T, dh = q.shape

    def self_order():  # (B, H, T, d_h) view of (B, T, H, d_h) memory, as the binding's empty_self
        return q.new_empty((B, T, H, dh)).transpose(1, 2)

    identity = perm_kv == 1 or perm_kv == H
    q_self = q.new_empty((0,)) if not write_q_self else (q.new_empty(q.shape) if identity else self_order())
    return (q.new_empty(q.shape), kc.new_empty(kc.shape), vc.new_empty(vc.shape),
            q.new_empty((H,), dtype=torch.float32), self_order(), self_order(), q_self,
            q.new_empty((B, H, lse_columns), dtype=torch.float32))


for _ns in ("wiola", "wiola_cuda_emu"):
    register_fake(f"{_ns}::gcla_attention")(_gcla_attention_fake)
    register_fake(f"{_ns}::gcla_attention_backward")(_gcla_attention_backward_fake)
    register_fake(f"{_ns}::_gcla_summary_fwd")(_summary_fwd_fake)
    register_fake(f"{_ns}::_gcla_summary_bwd")(_summary_bwd_fake)
register_fake("wiola::_triton_gcla_attention")(_gcla_attention_fake)
register_fake("wiola::_triton_gcla_attention_backward")(_gcla_attention_backward_fake)


# --- autograd --------------------------------------------------------------------------------------

def _forward(q_rot, k_rot, v, q, kc, vc, gate, lengths):
    """``(out, lse, backend)``: the dispatcher's kernel (backend None), or the forced one."""
    backend = dispatch.forced_backend()
    if backend is None:
        try:
            return (*_ops.gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths), None)
        except RuntimeError:  # the schema's argument parser: name the argument instead
            check_gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths)
            raise
    if not isinstance(q_rot, Tensor) or q_rot.dim() != 4:
        check_gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths)
    backend = dispatch.resolve(OP, backend, q_rot.device, q_rot.dtype, q_rot.shape[-1])
    return (*dispatch.kernels(OP, backend).forward(q_rot, k_rot, v, q, kc, vc, gate, lengths), backend)


class GCLAAttentionFunction(torch.autograd.Function):
    """Autograd for :func:`gcla_attention`: ``GCLAAttentionFunction.apply(q_rot, k_rot, v, q, kc,
    vc, gate, lengths)`` (every argument positional, ``lengths`` may be None; see
    :func:`gcla_attention`). Calls ``wiola::gcla_attention`` and, in the backward,
    ``wiola::gcla_attention_backward`` — or the forced backend's kernels (chosen for the
    input's dtype and head width), kept on ``ctx`` so that the backward runs where the forward ran."""

    @staticmethod
    def forward(ctx, q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor, gate: Tensor,
                lengths: Tensor | None) -> Tensor:
        out, lse, ctx.backend = _forward(q_rot, k_rot, v, q, kc, vc, gate, lengths)
        ctx.save_for_backward(q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        saved = ctx.saved_tensors
        if ctx.backend is None:
            grads = _ops.gcla_attention_backward(grad_out, *saved)
        else:
            grads = dispatch.kernels(OP, ctx.backend).backward(grad_out, *saved)
        return (*grads, None)


def gcla_attention(q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor, gate: Tensor,
                   lengths: Tensor | None = None) -> Tensor:
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
        tensor argument except ``lengths`` (through :class:`GCLAAttentionFunction`; without
        gradients the registered op is called directly); each gradient takes its input's
        layout (``kc``/``vc``'s for ``S = T``, contiguous for ``S = 1``).

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype or shape.
    """
    if torch.compiler.is_compiling():
        return GCLAAttentionFunction.apply(*distinct(q_rot, k_rot, v, q, kc, vc, gate, lengths))
    if needs_grad(q_rot, k_rot, v, q, kc, vc, gate):
        return GCLAAttentionFunction.apply(q_rot, k_rot, v, q, kc, vc, gate, lengths)
    return _forward(q_rot, k_rot, v, q, kc, vc, gate, lengths)[0]


# --- benchmark cases (wiola_kernels.bench: python -m wiola_kernels bench [--overhead]) -------------

def bench_cases(device: torch.device, size: str) -> list[dict]:
    """This op's benchmark cases at ``size`` (:data:`~wiola_kernels.shapes.BENCH_SIZES`; shapes
    in :mod:`wiola_kernels.shapes`), as keyword arguments of ``wiola_kernels.bench.BenchCase``:
    wiola-360m attention (H 16, H_kv 4, d_h 64) with Λ' = 2 causal (prefix-mean) summaries;
    ``"tiny"`` (one decoding token, one slot) is what ``bench --overhead`` times call by call."""
    full = shapes.GCLA_BENCH if device.type == "cuda" else shapes.GCLA_BENCH_CPU
    shape = shapes.bench_shape(OP, {"small": shapes.GCLA_BENCH_SMALL, "full": full}, device, size)
    b, h, h_kv, t, lam = (shape[k] for k in ("B", "H", "H_kv", "T", "L"))
    dh = shapes.GCLA_BENCH_HEAD_DIMS[0]
    dtype = shapes.bench_dtype(device, size)

    def make_inputs():
        g = torch.Generator(device="cpu").manual_seed(0)

        def r(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        gate = (-3.0 + 0.5 * torch.randn(h, generator=g)).to(device)
        return r(b, h, t, dh), r(b, h_kv, t, dh), r(b, h_kv, t, dh), r(b, h, t, dh), r(b, h, t, lam, dh), \
            r(b, h, t, lam, dh), gate

    return [dict(op=OP, shape=f"q ({b}, {h}, {t}, {dh}), kv heads {h_kv}, Λ' {lam} causal", dtype=dtype,
                 make_inputs=make_inputs, fused=gcla_attention, eager=reference.gcla_attention,
                 tolerance_kind="attention",
                 backward_rereads=tuple(range(7)))]  # attention's backward recomputes from every input
