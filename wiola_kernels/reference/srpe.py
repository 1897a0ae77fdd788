"""SRPE, spiral rotary position encoding, in plain PyTorch (SPEC §4): the oracle.

For position p and pair j ∈ [0, d_h/2) (rotate-half layout, pairs (j, j + d_h/2)):

    ω_j = θ₀^(−2j/d_h),   Θ_j(p) = p ω_j (1 + 1/k_s),   r_j(p) = 1 + a_s sin(p f_s ω_j)
    y_j = m (q_j r cosΘ − q_{j+d_h/2} r sinΘ),   y_{j+d_h/2} = m (q_j r sinΘ + q_{j+d_h/2} r cosΘ)

``ω_j`` may be given instead (``inv_freq``: a Hugging Face rope type's frequencies, taken in
float64), and ``m`` (``scale``, default 1) is the output scale (a rope type's attention factor).

Angles are computed in float64 and reduced modulo 2π before the sine/cosine (the
rotation then runs in the compute dtype), so float32 keeps SPEC accuracy up to
``wiola_kernels.ops.srpe.max_accurate_position(k_s)`` (about 2^35 for k_s = 8).
The backward is the transpose: rotation by −Θ, scaled by r.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..dtypes import compute_dtype

__all__ = ["srpe", "srpe_backward", "srpe_cos_sin", "srpe_frequencies"]


def srpe_frequencies(head_dim: int, theta: float, spiral_divisor: float, radial_frequency: float,
                     device: torch.device | str = "cpu", inv_freq: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-pair float64 frequencies ``(ω_j (1 + 1/k_s), f_s ω_j)``, each of shape ``(d_h/2,)``;
    ``ω_j`` is ``inv_freq`` (taken in float64) when given, else ``θ₀^(−2j/d_h)``."""
    if inv_freq is not None:
        omega = inv_freq.to(device=device, dtype=torch.float64)
    else:  # C's pow, element by element: the kernels' ω_j, so that given θ₀^(−2j/d_h) is the default
        omega = torch.tensor([theta ** (j * (-2.0 / head_dim)) for j in range(head_dim // 2)], dtype=torch.float64,
                             device=device)
    return omega * (1.0 + 1.0 / spiral_divisor), omega * radial_frequency


def srpe_cos_sin(position_ids: Tensor, head_dim: int, theta: float = 10000.0, spiral_divisor: float = 8.0,
                 radial_amplitude: float = 0.1, radial_frequency: float = 0.01,
                 dtype: torch.dtype = torch.float32, inv_freq: Tensor | None = None,
                 scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """``(m r cos Θ, m r sin Θ)`` of shape ``position_ids.shape + (d_h/2,)``, angles in float64."""
    angle_freq, radial_freq = srpe_frequencies(head_dim, theta, spiral_divisor, radial_frequency,
                                               position_ids.device, inv_freq)
    p = position_ids.to(torch.float64).unsqueeze(-1)
    two_pi = 2.0 * math.pi
    angle = torch.remainder(p * angle_freq, two_pi)
    radius = scale * (1.0 + radial_amplitude * torch.sin(torch.remainder(p * radial_freq, two_pi)))
    return (radius * torch.cos(angle)).to(dtype), (radius * torch.sin(angle)).to(dtype)


def _broadcast_positions(position_ids: Tensor, x: Tensor) -> Tensor:
    # (T,) or (B, T) -> (B|1, 1, T) so it broadcasts over heads.
    pos = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
    return pos.unsqueeze(1)


def apply_srpe(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotation of ``x (..., d_h)`` by ``cos/sin (..., d_h/2)`` (already scaled by r)."""
    half = x.shape[-1] // 2
    acc = compute_dtype(x.dtype)
    x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
    c, s = cos.to(acc), sin.to(acc)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


def srpe(q: Tensor, k: Tensor, position_ids: Tensor, theta: float = 10000.0, spiral_divisor: float = 8.0,
         radial_amplitude: float = 0.1, radial_frequency: float = 0.01, inv_freq: Tensor | None = None,
         scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """SRPE of ``q (B, H, T, d_h)`` and ``k (B, H_kv, T, d_h)`` at ``position_ids (B, T) | (T,)``;
    ``inv_freq (d_h/2,)`` replaces ``θ₀^(−2j/d_h)`` when given, ``scale`` multiplies the output."""
    cos, sin = srpe_cos_sin(_broadcast_positions(position_ids, q), q.shape[-1], theta, spiral_divisor,
                            radial_amplitude, radial_frequency, dtype=compute_dtype(q.dtype), inv_freq=inv_freq,
                            scale=scale)
    return apply_srpe(q, cos, sin), apply_srpe(k, cos, sin)


def srpe_backward(grad_q: Tensor, grad_k: Tensor, position_ids: Tensor, theta: float = 10000.0,
                  spiral_divisor: float = 8.0, radial_amplitude: float = 0.1,
                  radial_frequency: float = 0.01, inv_freq: Tensor | None = None,
                  scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Explicit backward: ``m R(p)ᵀ g`` — the same map with the sine negated."""
    cos, sin = srpe_cos_sin(_broadcast_positions(position_ids, grad_q), grad_q.shape[-1], theta,
                            spiral_divisor, radial_amplitude, radial_frequency,
                            dtype=compute_dtype(grad_q.dtype), inv_freq=inv_freq, scale=scale)
    return apply_srpe(grad_q, cos, -sin), apply_srpe(grad_k, cos, -sin)
