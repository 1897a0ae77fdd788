"""WiolaRMSNorm (SPEC §3): :func:`rms_norm`, the :class:`RMSNormFunction` that drives its
registered ops, and their kernels written in Python.

Registered ops (declared in csrc/cpu/rms_norm.cpp):

* ``wiola::rms_norm(x (..., d), weight (d,), shift (d,) | None, eps, hf_order) -> (y, rstd)``
* ``wiola::rms_norm_backward(grad_y, x, weight, shift, rstd) -> (grad_x, grad_weight, grad_shift)``

``rstd`` has shape ``x.shape[:-1]``, float32 (float64 for float64 ``x``); ``grad_shift`` is
None without ``shift`` (δ = 0: no add). ``hf_order`` selects Hugging Face's rounding order
(normalise, round to the input dtype, then multiply by γ).

Kernels: CPU — csrc/cpu/rms_norm.cpp; CUDA — the Triton kernels (triton/rms_norm.py,
registered below); Meta — the fakes below. Forced backends (:mod:`wiola_kernels.dispatch`):
``reference``, ``cpu``, ``triton``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch, reference, shapes
from ..dtypes import compute_dtype
from ..reference.rms_norm import rms_norm_backward as _reference_backward
from ..reference.rms_norm import rms_norm_forward as _reference_forward
from ..validation import check_positive, check_rank, check_same_device, check_shape, check_tensor
from . import distinct, needs_grad, register_fake, register_triton_cuda, registered, registered_ops


__all__ = ["RMSNormFunction", "rms_norm"]  # exported by wiola_kernels

OP = "rms_norm"
# The registered ops' overloads, looked up once: a call skips the overload resolution of
# ``torch.ops.wiola.<name>(...)``.
_ops = registered_ops("rms_norm", "rms_norm_backward")


# --- argument checks ------------------------------------------------------------------------------
# What the kernels written in Python and the fakes check at entry, in the words of the C++
# kernels' checks::rms_norm (csrc/include/wiola/checks.h).

def check_rms_norm(x: object, weight: object, shift: object, eps: object, hf_order: object) -> float:
    """Arguments of :func:`wiola_kernels.rms_norm`; returns ``eps`` as a float."""
    check_tensor("x", x)
    check_tensor("weight", weight)
    if shift is not None:
        check_tensor("shift", shift)
    check_rank("x", x, range(1, 64), "(..., d)")
    d = x.shape[-1]
    check_shape("weight", weight, (d,), "(d,)")
    if shift is not None:
        check_shape("shift", shift, (d,), "(d,)")
    check_same_device(x=x, weight=weight, shift=shift)
    eps = check_positive("eps", eps)
    if not isinstance(hf_order, bool):
        raise TypeError(f"hf_order must be a bool, got {type(hf_order).__name__}")
    if d == 0:
        raise ValueError("x must have a non-empty last dimension d, got d = 0")
    return eps


# --- kernels written in Python (the registry's backends; Triton is also the CUDA kernel) ---------

def _no_check(*args):
    """The backward's arguments come from the forward (the Function saves them)."""

def _reference_forward_checked(x, weight, shift, eps=1e-6, hf_order=False):
    eps = check_rms_norm(x, weight, shift, eps, hf_order)
    return _reference_forward(x, weight, shift, eps, hf_order)


def _triton_forward(x, weight, shift, eps=1e-6, hf_order=False):
    from ..triton import rms_norm as tk

    eps = check_rms_norm(x, weight, shift, eps, hf_order)
    d = x.shape[-1]
    y, rstd = tk.rms_norm_fwd(x.reshape(-1, d).contiguous(), weight.contiguous(),
                              None if shift is None else shift.contiguous(), eps, hf_order)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _triton_backward(grad_y, x, weight, shift, rstd):
    from ..triton import rms_norm as tk

    # No checks: the arguments come from the forward, which checked them (the Function saves them).
    d = x.shape[-1]
    grad_x, grad_weight, grad_shift = tk.rms_norm_bwd(
        grad_y.reshape(-1, d).contiguous(), x.reshape(-1, d).contiguous(), weight.contiguous(),
        None if shift is None else shift.contiguous(), rstd.reshape(-1).contiguous())
    return grad_x.view(x.shape), grad_weight, grad_shift


dispatch.register_default(OP, "cpu", "cpu")
dispatch.register_default(OP, "cuda", "triton")
dispatch.register(OP, "reference", SimpleNamespace(forward=_reference_forward_checked, backward=_reference_backward))
dispatch.register(OP, "cpu", SimpleNamespace(forward=registered("wiola", "rms_norm", check_rms_norm),
                                             backward=registered("wiola", "rms_norm_backward", _no_check)))
dispatch.register(OP, "triton", SimpleNamespace(forward=_triton_forward, backward=_triton_backward))
# CUDA: the C++ launch of the compiled kernels (csrc/cuda/triton_rms_norm_binding.cpp), which runs
# these where its table has no variant.
register_triton_cuda("rms_norm", _triton_forward)
register_triton_cuda("rms_norm_backward", _triton_backward)


@register_fake("wiola::rms_norm")
def _rms_norm_fake(x, weight, shift, eps=1e-6, hf_order=False):
    check_rms_norm(x, weight, shift, eps, hf_order)
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            x.new_empty(x.shape[:-1], dtype=compute_dtype(x.dtype)))


@register_fake("wiola::rms_norm_backward")
def _rms_norm_backward_fake(grad_y, x, weight, shift, rstd):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight),
            None if shift is None else torch.empty_like(shift))


# --- autograd ------------------------------------------------------------------------------------

def _forward(x, weight, shift, eps, hf_order):
    """``(y, rstd, backend)``: the dispatcher's kernel (backend None), or the forced one."""
    backend = dispatch.forced_backend()
    if backend is None:
        try:
            return (*_ops.rms_norm(x, weight, shift, eps, hf_order), None)
        except RuntimeError:  # the schema's argument parser: name the argument instead
            check_rms_norm(x, weight, shift, eps, hf_order)
            raise
    if not isinstance(x, Tensor):
        check_rms_norm(x, weight, shift, eps, hf_order)
    backend = dispatch.resolve(OP, backend, x.device, x.dtype)
    return (*dispatch.kernels(OP, backend).forward(x, weight, shift, eps, hf_order), backend)


class RMSNormFunction(torch.autograd.Function):
    """Autograd for :func:`rms_norm`: ``RMSNormFunction.apply(x, weight, shift, eps, hf_order)``
    (every argument positional; see :func:`rms_norm`). Calls ``wiola::rms_norm`` and, in the
    backward, ``wiola::rms_norm_backward`` — or the forced backend's kernels, kept on ``ctx``
    so that the backward runs where the forward ran."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, shift: Tensor | None, eps: float, hf_order: bool) -> Tensor:
        y, rstd, ctx.backend = _forward(x, weight, shift, eps, hf_order)
        ctx.save_for_backward(x, weight, shift, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, weight, shift, rstd = ctx.saved_tensors
        if ctx.backend is None:
            grads = _ops.rms_norm_backward(grad_y, x, weight, shift, rstd)
        else:
            grads = dispatch.kernels(OP, ctx.backend).backward(grad_y, x, weight, shift, rstd)
        return *grads, None, None


def rms_norm(x: Tensor, weight: Tensor, shift: Tensor | None = None, eps: float = 1e-6, *,
             hf_order: bool = False) -> Tensor:
    """WiolaRMSNorm over the last dimension (SPEC §3): ``γ ⊙ (x + δ) / sqrt(mean((x + δ)²) + ε)``.

    Args:
        x: input of shape ``(..., d)``; float32, float64, bfloat16 or float16. Any
            strides (non-contiguous inputs are copied once).
        weight: γ, shape ``(d,)``, any float dtype.
        shift: δ, shape ``(d,)``, any float dtype; or None for δ = 0 (plain RMSNorm,
            no add and no ``∂L/∂δ``).
        eps: ε > 0 added to the mean square.
        hf_order: round like Hugging Face's ``LlamaRMSNorm``: ``n = (x + δ)/r`` is
            rounded to the input dtype, then multiplied by γ (and rounded again). With
            γ in the input dtype, bf16/fp16 outputs then match HF's to within one ulp
            (bit for bit unless the float32 statistics round differently). Default
            False: ``γ (x + δ)/r`` rounded once, the more accurate order.

    Returns:
        ``y`` with the shape and dtype of ``x``. Statistics are computed in float32
        (float64 for float64 input). Differentiable in ``x``, ``weight`` and ``shift``
        (through :class:`RMSNormFunction`; without gradients the registered op is called
        directly).

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype or shape.
    """
    if torch.compiler.is_compiling():
        return RMSNormFunction.apply(*distinct(x, weight, shift), eps, hf_order)
    if needs_grad(x, weight, shift):
        return RMSNormFunction.apply(x, weight, shift, eps, hf_order)
    return _forward(x, weight, shift, eps, hf_order)[0]


# --- benchmark cases (wiola_kernels.bench: python -m wiola_kernels bench [--overhead]) -------------

def bench_cases(device: torch.device, size: str) -> list[dict]:
    """This op's benchmark cases at ``size`` (:data:`~wiola_kernels.shapes.BENCH_SIZES`; shapes
    in :mod:`wiola_kernels.shapes`), as keyword arguments of ``wiola_kernels.bench.BenchCase``;
    ``"tiny"`` (one decoding step's rows) is what ``bench --overhead`` times call by call."""
    rows, d = shapes.bench_shape(OP, shapes.RMS_NORM_BENCH, device, size)

    def case(dtype: torch.dtype) -> dict:
        def make_inputs():
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(rows, d, generator=g).to(device=device, dtype=dtype)
            weight = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype)
            shift = (0.1 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
            return x, weight, shift

        return dict(op=OP, shape=f"x ({rows}, {d})", dtype=dtype, make_inputs=make_inputs,
                    fused=lambda x, w, s: rms_norm(x, w, s, 1e-6),
                    eager=lambda x, w, s: reference.rms_norm(x, w, s, 1e-6),
                    backward_rereads=(0, 1, 2))  # ∂x needs z = x + δ and γ

    return [case(dtype) for dtype in shapes.bench_dtypes(device, size)]
