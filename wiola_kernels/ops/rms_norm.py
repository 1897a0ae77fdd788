"""WiolaRMSNorm (SPEC §3): the registered ops ``wiola::rms_norm`` / ``wiola::rms_norm_grad``,
the :class:`RMSNormFunction` that drives them, and the public :func:`rms_norm`.

The ops work on a 2-D view ``(rows, d)``. Each backend provides
``forward(x, weight, shift, eps, hf_order) -> (y, rstd)`` and
``backward(grad_y, x, weight, shift, rstd) -> (grad_x, grad_weight, grad_shift)`` on
contiguous 2-D ``x``; ``rstd`` is float32 (float64 for float64 inputs). ``shift`` may be
None (δ = 0: no add, and ``grad_shift`` is None); ``hf_order`` selects Hugging Face's
rounding order (normalise, round to the input dtype, then multiply by γ).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch
from . import distinct
from ..dtypes import compute_dtype
from ..reference.rms_norm import rms_norm_backward, rms_norm_forward
from ..validation import check_positive, check_rank, check_same_device, check_shape, check_tensor

OP = "rms_norm"


def _cpu_forward(x: Tensor, weight: Tensor, shift: Tensor | None, eps: float,
                 hf_order: bool = False) -> tuple[Tensor, Tensor]:
    return torch.ops.wiola._rms_norm_fwd(x, weight, shift, eps, hf_order)


def _cpu_backward(grad_y, x, weight, shift, rstd):
    grad_x, grad_weight, grad_shift = torch.ops.wiola._rms_norm_bwd(grad_y, x, weight, shift, rstd)
    return grad_x, grad_weight, None if shift is None else grad_shift


def _triton_forward(x, weight, shift, eps, hf_order=False):
    from ..triton import rms_norm as tk

    return tk.rms_norm_fwd(x, weight, shift, eps, hf_order)


def _triton_backward(grad_y, x, weight, shift, rstd):
    from ..triton import rms_norm as tk

    return tk.rms_norm_bwd(grad_y, x, weight, shift, rstd)


# Every backend takes every float dtype and any d (Triton walks wide rows in chunks).
dispatch.register(OP, "reference", SimpleNamespace(forward=rms_norm_forward, backward=rms_norm_backward))
dispatch.register(OP, "cpu", SimpleNamespace(forward=_cpu_forward, backward=_cpu_backward))
dispatch.register(OP, "triton", SimpleNamespace(forward=_triton_forward, backward=_triton_backward))


@torch.library.custom_op("wiola::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, shift: Tensor | None, eps: float, hf_order: bool = False,
                backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Forward on ``x (rows, d)`` on ``backend`` (see :func:`wiola_kernels.dispatch.resolve`):
    returns ``(y, rstd)``."""
    impl = dispatch.resolve(OP, backend, x.device, x.dtype)
    return impl.forward(x.contiguous(), weight.contiguous(), None if shift is None else shift.contiguous(), eps,
                        hf_order)


@rms_norm_op.register_fake
def _(x, weight, shift, eps, hf_order=False, backend="auto"):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        x.shape[:-1], dtype=compute_dtype(x.dtype))


@torch.library.custom_op("wiola::rms_norm_grad", mutates_args=())
def rms_norm_grad_op(grad_y: Tensor, x: Tensor, weight: Tensor, shift: Tensor | None, rstd: Tensor,
                     backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Backward on 2-D tensors on ``backend``: returns ``(grad_x, grad_weight, grad_shift)``.
    Without ``shift``, ``grad_shift`` is an empty ``(0,)`` tensor (a custom op cannot return None)."""
    impl = dispatch.resolve(OP, backend, x.device, x.dtype)
    grad_x, grad_weight, grad_shift = impl.backward(
        grad_y.contiguous(), x.contiguous(), weight.contiguous(), None if shift is None else shift.contiguous(), rstd)
    return grad_x, grad_weight, weight.new_empty(0) if grad_shift is None else grad_shift


@rms_norm_grad_op.register_fake
def _(grad_y, x, weight, shift, rstd, backend="auto"):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            weight.new_empty(0) if shift is None else torch.empty_like(shift))


class RMSNormFunction(torch.autograd.Function):
    """Autograd for :func:`rms_norm`: ``RMSNormFunction.apply(x, weight, shift, eps, hf_order)``
    (every argument positional; see :func:`rms_norm` for their meaning). Validates, picks the
    backend once (kept on ``ctx``: the backward runs where the forward ran) and calls
    ``wiola::rms_norm`` / ``wiola::rms_norm_grad``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, shift: Tensor | None, eps: float, hf_order: bool) -> Tensor:
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
        x2d = x.reshape(-1, d)
        ctx.backend = dispatch.select(OP, x.device, x.dtype)
        y, rstd = rms_norm_op(x2d, weight, shift, eps, hf_order, ctx.backend)
        ctx.save_for_backward(x2d, weight, shift, rstd)
        ctx.has_shift = shift is not None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x2d, weight, shift, rstd = ctx.saved_tensors
        grad_x, grad_weight, grad_shift = rms_norm_grad_op(grad_y.reshape(x2d.shape), x2d, weight, shift, rstd,
                                                           ctx.backend)
        return grad_x.view(grad_y.shape), grad_weight, grad_shift if ctx.has_shift else None, None, None


def rms_norm(x: Tensor, weight: Tensor, shift: Tensor | None, eps: float = 1e-6, *, hf_order: bool = False) -> Tensor:
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
        (through :class:`RMSNormFunction`).
    """
    return RMSNormFunction.apply(*distinct(x, weight, shift), eps, hf_order)
