"""Residual add + WiolaRMSNorm in plain PyTorch (SPEC §10.3): the oracle for every backend.

    s = x + residual             the new residual stream, in the input dtype (rounded once)
    y = WiolaRMSNorm(s)          SPEC §3 (reference/rms_norm.py), of the *rounded* s

In bf16/fp16, y is the norm of s as stored, which is what the unfused code
``s = x + residual; y = rms_norm(s)`` computes. Both outputs are differentiable.

Backward, with g_y = ∂L/∂y and g_s = ∂L/∂s (the gradient the rest of the model sends
into the residual stream):

    ∂L/∂x = ∂L/∂residual = g_s + ∂L/∂s|norm         (∂L/∂s|norm: SPEC §3's ∂L/∂x)
    ∂L/∂γ, ∂L/∂δ                                     as for rms_norm, on s

summed in the accumulation dtype and rounded once.
"""

from __future__ import annotations

from torch import Tensor

from ..dtypes import compute_dtype
from .rms_norm import rms_norm as _rms_norm
from .rms_norm import rms_norm_backward as _rms_norm_backward
from .rms_norm import rms_norm_forward as _rms_norm_forward

__all__ = ["add_rms_norm", "add_rms_norm_backward", "add_rms_norm_forward"]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, shift: Tensor | None, eps: float = 1e-6,
                 hf_order: bool = False) -> tuple[Tensor, Tensor]:
    """``(y, s)``, differentiable by autograd (``shift=None``: δ = 0)."""
    s = x + residual
    return _rms_norm(s, weight, shift, eps, hf_order), s


def add_rms_norm_forward(x: Tensor, residual: Tensor, weight: Tensor, shift: Tensor | None, eps: float,
                         hf_order: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The forward of the registered op: ``(y, s, rstd)``, ``rstd = 1/r`` per row of s
    (accumulation dtype), for the backward."""
    s = x + residual
    y, rstd = _rms_norm_forward(s, weight, shift, eps, hf_order)
    return y, s, rstd


def add_rms_norm_backward(grad_y: Tensor, grad_s: Tensor | None, s: Tensor, weight: Tensor, shift: Tensor | None,
                          rstd: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """Explicit backward: ``(grad_x, grad_weight, grad_shift)``; ``grad_x`` is also the
    residual's gradient. ``grad_s`` None: no gradient reached s."""
    acc = compute_dtype(s.dtype)
    grad_x, grad_weight, grad_shift = _rms_norm_backward(grad_y.to(acc), s.to(acc), weight, shift, rstd)
    if grad_s is not None:
        grad_x = grad_x + grad_s.to(acc)
    return grad_x.to(s.dtype), grad_weight, grad_shift
