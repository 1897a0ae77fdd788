"""WiolaRMSNorm in plain PyTorch (SPEC §3): the oracle for every backend.

    z = x + δ,   r = sqrt(mean(z²) + ε),   y = γ ⊙ z / r

Statistics in float32 (float64 for float64 inputs); output in the input dtype.

Two orders of the last step (``hf_order``): ours, ``y = (γ ⊙ z) / r`` rounded once to
the input dtype; and Hugging Face's ``LlamaRMSNorm`` order, ``n = z / r`` rounded to
the input dtype first, then ``y = γ ⊙ n`` (rounded again). In bf16/fp16 the two differ
by up to an ulp; the second reproduces HF models bit for bit (the product of two bf16
or fp16 numbers is exact in float32, so rounding it once matches PyTorch's ``γ * n``).
The backward is the same for both (rounding passes the gradient through, as in HF).
``shift=None`` means δ = 0 (no add, no ``∂L/∂δ``).
Backward (per row, g = ∂L/∂y), written with the normalised row ẑ = z / r so that no
intermediate grows with |z|:

    ∂L/∂z = (1/r) (γ ⊙ g − ẑ · mean(γ ⊙ g ⊙ ẑ)) = ∂L/∂x
    ∂L/∂δ = Σ_rows ∂L/∂z,        ∂L/∂γ = Σ_rows g ⊙ ẑ

(the same as SPEC §3's (1/r)(γ_i g_i − z_i/(d r²) Σ_k γ_k g_k z_k); the paper's eq. 10
wrongly puts γ_i on the second term too).

Huge rows. Σz² overflows (float32: |z| ≳ 1.8e19/√d; float64: ≳ 1.3e154/√d) long
before z does. A finite row whose Σz² is infinite is rescaled by an exact power of two
s = 2^(2−e), with max|z| = f·2^e, f ∈ [½, 1) (so |z|·s < 4 and s stays a normal
number), and

    r = sqrt(mean((s z)²) + ε s²) / s,   y = γ ⊙ (s z) · s/r

(ε s² may underflow to 0: ε is negligible there). Other rows have s = 1, the plain
formula. Rows holding NaN/Inf are not rescaled and stay NaN/Inf. rstd = 1/r is saved
for the backward; it is subnormal once r > 2^126 (float32) / 2^1022 (float64), i.e.
keeps ≥ 21 (float32) / 50 (float64) significant bits even at the dtype's maximum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dtypes import compute_dtype

__all__ = ["rms_norm", "rms_norm_backward", "rms_norm_forward"]


def overflow_scale(z: Tensor, mean_sq: Tensor) -> Tensor:
    """Per-row power of two ``s`` (shape ``(..., 1)``, a constant for autograd): 2^(2−e)
    for a finite row whose ``mean_sq`` overflowed (``max|z| = f·2^e``, f ∈ [½, 1)), else 1."""
    m = torch.linalg.vector_norm(z.detach(), float("inf"), dim=-1, keepdim=True)  # max|z|
    _, e = torch.frexp(m)
    overflow = torch.isinf(mean_sq.detach()) & torch.isfinite(m)
    return torch.ldexp(torch.ones_like(m), torch.where(overflow, 2 - e, 0))


def _scale(x: Tensor, weight: Tensor, z: Tensor, rstd: Tensor, hf_order: bool) -> Tensor:
    """``γ z rstd`` in the accumulation dtype, in our order or HF's (see the module docstring)."""
    acc = z.dtype
    if hf_order:
        return weight.to(acc) * (z * rstd).to(x.dtype).to(acc)
    return weight.to(acc) * z * rstd


def _normalise(x: Tensor, weight: Tensor, shift: Tensor | None, eps: float,
               hf_order: bool = False) -> tuple[Tensor, Tensor]:
    """(y in the accumulation dtype, rstd of shape (..., 1)), rescaling overflowing rows."""
    acc = compute_dtype(x.dtype)
    z = x.to(acc) if shift is None else x.to(acc) + shift.to(acc)
    mean_sq = z.pow(2).mean(-1, keepdim=True)
    # The rare path, for rows whose Σz² overflowed. Under torch.compile it is always
    # taken (no data-dependent branch): s = 1 leaves the other rows bit-identical.
    if torch.compiler.is_compiling() or bool(torch.isinf(mean_sq).any()):
        s = overflow_scale(z, mean_sq)
        z = z * s  # exact: s is a power of two
        rstd_s = torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps * s * s)
        return _scale(x, weight, z, rstd_s, hf_order), rstd_s * s
    rstd = torch.rsqrt(mean_sq + eps)
    return _scale(x, weight, z, rstd, hf_order), rstd


def rms_norm(x: Tensor, weight: Tensor, shift: Tensor | None, eps: float = 1e-6, hf_order: bool = False) -> Tensor:
    """WiolaRMSNorm over the last dimension, differentiable by autograd (``shift=None``: δ = 0)."""
    y, _ = _normalise(x, weight, shift, eps, hf_order)
    return y.to(x.dtype)


def rms_norm_forward(x: Tensor, weight: Tensor, shift: Tensor | None, eps: float,
                     hf_order: bool = False) -> tuple[Tensor, Tensor]:
    """Forward that also returns ``rstd = 1/r`` per row (accumulation dtype), for the backward."""
    y, rstd = _normalise(x, weight, shift, eps, hf_order)
    return y.to(x.dtype), rstd.squeeze(-1)


def rms_norm_backward(
    grad_y: Tensor, x: Tensor, weight: Tensor, shift: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Explicit backward of SPEC §3: returns ``(grad_x, grad_weight, grad_shift)``
    (``grad_shift`` is None when ``shift`` is)."""
    acc = compute_dtype(x.dtype)
    g = grad_y.to(acc)
    r_inv = rstd.to(acc).unsqueeze(-1)
    z = x.to(acc) if shift is None else x.to(acc) + shift.to(acc)
    z_hat = z * r_inv  # |ẑ| ≤ √d whatever |z|
    gw = g * weight.to(acc)
    grad_z = r_inv * (gw - z_hat * (gw * z_hat).mean(-1, keepdim=True))
    rows = tuple(range(x.dim() - 1))
    grad_weight = (g * z_hat).sum(rows) if rows else g * z_hat
    if shift is None:
        return grad_z.to(x.dtype), grad_weight.to(weight.dtype), None
    grad_shift = grad_z.sum(rows) if rows else grad_z
    return grad_z.to(x.dtype), grad_weight.to(weight.dtype), grad_shift.to(shift.dtype)
