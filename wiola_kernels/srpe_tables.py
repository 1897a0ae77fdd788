"""The per-pair frequencies the SRPE Triton kernel reads. Written apart from the oracle's
(``reference.srpe``) on purpose: a wrong table here cannot pass the tests by also being the
one the oracle uses. (The C++ kernels form theirs in csrc/cpu/srpe_rotation.h.)"""

from __future__ import annotations

import torch
from torch import Tensor


def kernel_omega(head_dim: int, theta: float, device: torch.device | str = "cpu") -> Tensor:
    """float64 ``ω_j = θ^(−2j/d_h)`` for pairs ``j < d_h/2`` (SPEC §4); the kernel forms
    ``ω_j·(1 + 1/k_s)`` and ``f_s·ω_j`` from it, as it does from given frequencies."""
    # Python's float pow is C's pow, the CPU kernel's std::pow: the same ω_j bit for bit on
    # every backend (torch.pow's vectorised pow differs from it by an ulp for some j).
    theta = float(theta)
    return torch.tensor([theta ** (j * (-2.0 / head_dim)) for j in range(head_dim // 2)], dtype=torch.float64,
                        device=device)
