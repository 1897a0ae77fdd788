"""``WiolaRMSNorm``: drop-in module for SPEC §3."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.rms_norm import rms_norm


class WiolaRMSNorm(nn.Module):
    """RMSNorm with a learned shift δ applied before the RMS (SPEC §3).

    ``y = γ ⊙ (x + δ) / sqrt(mean((x + δ)²) + ε)`` over the last dimension, with γ
    (``weight``) initialised to ones and δ (``shift``) to zeros.

    Args:
        hidden_size: d, the normalised (last) dimension.
        eps: ε (default 1e-6, SPEC §1 ``rms_norm_eps``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.shift = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.shift, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
