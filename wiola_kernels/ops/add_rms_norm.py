"""Residual add + WiolaRMSNorm in one pass (SPEC §10.3): :func:`add_rms_norm`, the
:class:`AddRMSNormFunction` that drives its registered ops, and their kernels written in Python.

Registered ops (declared in csrc/cpu/add_rms_norm.cpp):

* ``wiola::add_rms_norm(x, residual, weight, shift | None, eps, hf_order) -> (y, s, rstd)``
* ``wiola::add_rms_norm_backward(grad_y, grad_s | None, s, weight, shift, rstd) -> (grad_x, grad_weight, grad_shift)``

``s = x + residual`` (rounded once to the input dtype) and ``y = rms_norm(s)``; ``rstd``
is rms_norm's. ``grad_x`` is the gradient of both x and the residual.

Kernels: CPU — csrc/cpu/add_rms_norm.cpp (rms_norm's row kernels with the add folded in);
CUDA — rms_norm's Triton kernels with their residual flags (triton/add_rms_norm.py,
registered below); Meta — the fakes below. Forced backends (:mod:`wiola_kernels.dispatch`):
``reference``, ``cpu``, ``triton``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch, reference, shapes
from ..dtypes import compute_dtype
from ..reference.add_rms_norm import add_rms_norm_backward as _reference_backward
from ..reference.add_rms_norm import add_rms_norm_forward as _reference_forward
from ..validation import check_rank, check_same_device, check_same_dtype, check_tensor
from . import distinct, needs_grad, register_fake, register_triton_cuda, registered, registered_ops
from .rms_norm import check_rms_norm

__all__ = ["AddRMSNormFunction", "add_rms_norm"]  # exported by wiola_kernels

OP = "add_rms_norm"
_ops = registered_ops("add_rms_norm", "add_rms_norm_backward")


# --- argument checks ------------------------------------------------------------------------------
# What the kernels written in Python and the fakes check at entry, in the words of the C++
# kernels' checks::add_rms_norm (csrc/include/wiola/checks.h).

def check_add_rms_norm(x: object, residual: object, weight: object, shift: object, eps: object,
                       hf_order: object) -> float:
    """Arguments of :func:`wiola_kernels.add_rms_norm`; returns ``eps`` as a float."""
    check_tensor("x", x)
    check_tensor("residual", residual)
    check_rank("x", x, range(1, 64), "(..., d)")
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"residual must have the shape of x (..., d) = {tuple(x.shape)}, got {tuple(residual.shape)}")
    check_same_dtype(x=x, residual=residual)
    check_same_device(x=x, residual=residual)
    return check_rms_norm(x, weight, shift, eps, hf_order)


# --- kernels written in Python (the registry's backends; Triton is also the CUDA kernel) ---------

def _no_check(*args):
    """The backward's arguments come from the forward (the Function saves them)."""


def _reference_forward_checked(x, residual, weight, shift, eps=1e-6, hf_order=False):
    eps = check_add_rms_norm(x, residual, weight, shift, eps, hf_order)
    return _reference_forward(x, residual, weight, shift, eps, hf_order)


def _triton_forward(x, residual, weight, shift, eps=1e-6, hf_order=False):
    from ..triton import add_rms_norm as tk

    eps = check_add_rms_norm(x, residual, weight, shift, eps, hf_order)
    d = x.shape[-1]
    y, s, rstd = tk.add_rms_norm_fwd(x.reshape(-1, d).contiguous(), residual.reshape(-1, d).contiguous(),
                                     weight.contiguous(), None if shift is None else shift.contiguous(), eps,
                                     hf_order)
    return y.view(x.shape), s.view(x.shape), rstd.view(x.shape[:-1])


def _triton_backward(grad_y, grad_s, s, weight, shift, rstd):
    from ..triton import add_rms_norm as tk

    # No checks: the arguments come from the forward, which checked them (the Function saves them).
    d = s.shape[-1]
    grad_x, grad_weight, grad_shift = tk.add_rms_norm_bwd(
        grad_y.reshape(-1, d).contiguous(), None if grad_s is None else grad_s.reshape(-1, d).contiguous(),
        s.reshape(-1, d).contiguous(), weight.contiguous(), None if shift is None else shift.contiguous(),
        rstd.reshape(-1).contiguous())
    return grad_x.view(s.shape), grad_weight, grad_shift


dispatch.register_default(OP, "cpu", "cpu")
dispatch.register_default(OP, "cuda", "triton")
dispatch.register(OP, "reference", SimpleNamespace(forward=_reference_forward_checked, backward=_reference_backward))
dispatch.register(OP, "cpu", SimpleNamespace(forward=registered("wiola", "add_rms_norm", check_add_rms_norm),
                                             backward=registered("wiola", "add_rms_norm_backward", _no_check)))
dispatch.register(OP, "triton", SimpleNamespace(forward=_triton_forward, backward=_triton_backward))
# CUDA: the C++ launch of the compiled kernels (csrc/cuda/triton_rms_norm_binding.cpp), which runs
# these where its table has no variant.
register_triton_cuda("add_rms_norm", _triton_forward)
register_triton_cuda("add_rms_norm_backward", _triton_backward)


@register_fake("wiola::add_rms_norm")
def _add_rms_norm_fake(x, residual, weight, shift, eps=1e-6, hf_order=False):
    check_add_rms_norm(x, residual, weight, shift, eps, hf_order)
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=compute_dtype(x.dtype))


@register_fake("wiola::add_rms_norm_backward")
def _add_rms_norm_backward_fake(grad_y, grad_s, s, weight, shift, rstd):
    return s.new_empty(s.shape), torch.empty_like(weight), None if shift is None else torch.empty_like(shift)


# --- autograd ------------------------------------------------------------------------------------

def _forward(x, residual, weight, shift, eps, hf_order):
    """``(y, s, rstd, backend)``: the dispatcher's kernel (backend None), or the forced one."""
    backend = dispatch.forced_backend()
    if backend is None:
        try:
            return (*_ops.add_rms_norm(x, residual, weight, shift, eps, hf_order), None)
        except RuntimeError:  # the schema's argument parser: name the argument instead
            check_add_rms_norm(x, residual, weight, shift, eps, hf_order)
            raise
    if not isinstance(x, Tensor):
        check_add_rms_norm(x, residual, weight, shift, eps, hf_order)
    backend = dispatch.resolve(OP, backend, x.device, x.dtype)
    return (*dispatch.kernels(OP, backend).forward(x, residual, weight, shift, eps, hf_order), backend)


class AddRMSNormFunction(torch.autograd.Function):
    """Autograd for :func:`add_rms_norm`: ``AddRMSNormFunction.apply(x, residual, weight, shift,
    eps, hf_order) -> (y, s)`` (every argument positional; see :func:`add_rms_norm`). Calls
    ``wiola::add_rms_norm``, saves s (not x or the residual), and in the backward calls
    ``wiola::add_rms_norm_backward`` with both incoming gradients — or the forced backend's
    kernels, kept on ``ctx`` so that the backward runs where the forward ran."""

    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, weight: Tensor, shift: Tensor | None, eps: float,
                hf_order: bool) -> tuple[Tensor, Tensor]:
        y, s, rstd, ctx.backend = _forward(x, residual, weight, shift, eps, hf_order)
        ctx.save_for_backward(s, weight, shift, rstd)
        ctx.set_materialize_grads(False)  # an unused s (the last layer's) costs no zero tensor
        return y, s

    @staticmethod
    def backward(ctx, grad_y: Tensor | None, grad_s: Tensor | None):
        s, weight, shift, rstd = ctx.saved_tensors
        if grad_y is None:  # only s reached the loss
            grad_y = torch.zeros_like(s)
        if ctx.backend is None:
            grad_x, grad_w, grad_shift = _ops.add_rms_norm_backward(grad_y, grad_s, s, weight, shift, rstd)
        else:
            grad_x, grad_w, grad_shift = dispatch.kernels(OP, ctx.backend).backward(grad_y, grad_s, s, weight, shift,
                                                                                    rstd)
        return grad_x, grad_x, grad_w, grad_shift, None, None


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, shift: Tensor | None = None, eps: float = 1e-6, *,
                 hf_order: bool = False) -> tuple[Tensor, Tensor]:
    """Residual add + WiolaRMSNorm in one pass (SPEC §10.3): ``s = x + residual`` and
    ``y = γ ⊙ (s + δ) / sqrt(mean((s + δ)²) + ε)``.

    Args:
        x: the update ``(..., d)`` (an attention or feed-forward output); float32, float64,
            bfloat16 or float16. Any strides with a contiguous last dimension.
        residual: the residual stream, ``x``'s shape, dtype and device, any strides.
        weight: γ, shape ``(d,)``, any float dtype.
        shift: δ, shape ``(d,)``, any float dtype; or None for δ = 0.
        eps: ε > 0 added to the mean square.
        hf_order: Hugging Face's rounding order for the norm (see :func:`rms_norm`).

    Returns:
        ``(y, s)``, both of ``x``'s shape and dtype, contiguous: ``s = x + residual`` rounded
        once to the input dtype (the new residual stream, equal to ``x + residual`` in
        PyTorch), and ``y`` the norm of that rounded ``s`` (statistics in float32, float64
        for float64). Both are differentiable (through :class:`AddRMSNormFunction`): the
        backward gets ∂L/∂y and ∂L/∂s and returns ``∂L/∂x = ∂L/∂residual = ∂L/∂s + the
        norm's ∂L/∂s`` in one pass, plus ∂L/∂γ and ∂L/∂δ.

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype or shape.
    """
    if torch.compiler.is_compiling():
        return AddRMSNormFunction.apply(*distinct(x, residual, weight, shift), eps, hf_order)
    if needs_grad(x, residual, weight, shift):
        return AddRMSNormFunction.apply(x, residual, weight, shift, eps, hf_order)
    y, s, _, _ = _forward(x, residual, weight, shift, eps, hf_order)
    return y, s


# --- benchmark cases (wiola_kernels.bench: python -m wiola_kernels bench [--overhead]) -------------

def bench_cases(device: torch.device, size: str) -> list[dict]:
    """This op's benchmark cases at ``size`` (:data:`~wiola_kernels.shapes.BENCH_SIZES`; shapes
    in :mod:`wiola_kernels.shapes`), as keyword arguments of ``wiola_kernels.bench.BenchCase``:
    the residual add before each norm of a layer (x: the attention or DSFF output), as
    rms_norm's; ``"tiny"`` (one decoding step's rows) is what ``bench --overhead`` times."""
    rows, d = shapes.bench_shape(OP, shapes.ADD_RMS_NORM_BENCH, device, size)

    def min_bytes(pass_, inputs, outputs, diff):
        # Read x, residual, γ, δ; write y, s. The backward reads ∂L/∂y, ∂L/∂s and s again and
        # writes one tensor, ∂L/∂x = ∂L/∂residual, plus ∂γ, ∂δ.
        x, residual, weight, shift = inputs
        row_tensor, params = x.numel() * x.element_size(), 2 * weight.numel() * weight.element_size()
        fwd = 4 * row_tensor + params
        return fwd if pass_ == "fwd" else fwd + 4 * row_tensor + params

    def case(dtype: torch.dtype) -> dict:
        def make_inputs():
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(rows, d, generator=g).to(device=device, dtype=dtype)
            residual = torch.randn(rows, d, generator=g).to(device=device, dtype=dtype)
            weight = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype)
            shift = (0.1 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
            return x, residual, weight, shift

        return dict(op=OP, shape=f"x, residual ({rows}, {d})", dtype=dtype, make_inputs=make_inputs,
                    fused=lambda x, r, w, s: add_rms_norm(x, r, w, s, 1e-6),
                    eager=lambda x, r, w, s: reference.add_rms_norm(x, r, w, s, 1e-6), min_bytes=min_bytes)

    return [case(dtype) for dtype in shapes.bench_dtypes(device, size)]
