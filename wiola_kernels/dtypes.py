"""The dtype rule every op shares (SPEC §3, §9): statistics and accumulation in float32
whatever the input dtype, except that float64 inputs stay float64 end to end."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for an input dtype: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
