"""WiolaRMSNorm in plain PyTorch (SPEC §3): the oracle for every backend.

    z = x + δ,   r = sqrt(mean(z²) + ε),   y = γ ⊙ z / r

Statistics in float32 (float64 for float64 inputs); output in the input dtype.
Backward (per row, g = ∂L/∂y):

    ∂L/∂z_i = (1/r) (γ_i g_i − z_i/(d r²) Σ_k γ_k g_k z_k) = ∂L/∂x_i
    ∂L/∂δ   = Σ_rows ∂L/∂z,        ∂L/∂γ_i = Σ_rows g_i z_i / r

(the paper's eq. 10 wrongly puts γ_i on the second term too).
"""

from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for an input dtype: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: Tensor, weight: Tensor, shift: Tensor, eps: float = 1e-6) -> Tensor:
    """WiolaRMSNorm over the last dimension, differentiable by autograd."""
    acc = compute_dtype(x.dtype)
    z = x.to(acc) + shift.to(acc)
    rstd = torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(acc) * z * rstd).to(x.dtype)


def rms_norm_forward(x: Tensor, weight: Tensor, shift: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Forward that also returns ``rstd = 1/r`` per row (accumulation dtype), for the backward."""
    acc = compute_dtype(x.dtype)
    z = x.to(acc) + shift.to(acc)
    rstd = torch.rsqrt(z.pow(2).mean(-1) + eps)
    y = (weight.to(acc) * z * rstd.unsqueeze(-1)).to(x.dtype)
    return y, rstd


def rms_norm_backward(
    grad_y: Tensor, x: Tensor, weight: Tensor, shift: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Explicit backward of SPEC §3: returns ``(grad_x, grad_weight, grad_shift)``."""
    acc = compute_dtype(x.dtype)
    d = x.shape[-1]
    z = x.to(acc) + shift.to(acc)
    g = grad_y.to(acc)
    r_inv = rstd.to(acc).unsqueeze(-1)
    gw = g * weight.to(acc)
    dot = (gw * z).sum(-1, keepdim=True)
    grad_z = r_inv * (gw - z * (r_inv * r_inv) * dot / d)
    rows = tuple(range(x.dim() - 1))
    grad_weight = (g * z * r_inv).sum(rows) if rows else g * z * r_inv
    grad_shift = grad_z.sum(rows) if rows else grad_z
    return grad_z.to(x.dtype), grad_weight.to(weight.dtype), grad_shift.to(shift.dtype)
