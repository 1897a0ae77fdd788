"""The per-pair frequency table the SRPE kernels (C++ CPU, Triton) read. Written apart from
the oracle's (``reference.srpe``) on purpose: a wrong table here cannot pass the tests by
also being the one the oracle uses."""

from __future__ import annotations

import torch
from torch import Tensor


def kernel_frequencies(head_dim: int, theta: float, spiral_divisor: float, radial_frequency: float,
                       device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """float64 ``(ω_j·(1 + 1/k_s), f_s·ω_j)`` for pairs ``j < d_h/2``, ``ω_j = θ^(−2j/d_h)``
    (SPEC §4); ``k_s = ±inf`` gives the plain RoPE angle ``ω_j``."""
    exponent = torch.arange(0, head_dim // 2, dtype=torch.float64, device=device) * (-2.0 / head_dim)
    omega = torch.pow(torch.tensor(float(theta), dtype=torch.float64, device=device), exponent)
    stretch = 1.0 + 1.0 / spiral_divisor  # 1/±inf = 0
    return omega * stretch, omega * radial_frequency
