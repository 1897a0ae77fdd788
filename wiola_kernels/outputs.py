"""Kernel output allocation shared by every launcher (ops/ and triton/): poisoned in tests."""

from __future__ import annotations

import os

import torch


def poison_enabled() -> bool:
    """True when ``WIOLA_POISON_OUTPUTS=1``: outputs are filled with NaN (floats) or -1
    (integers) before a kernel writes them, so a skipped element cannot pass a test.
    The C++ extension reads the same variable."""
    return os.environ.get("WIOLA_POISON_OUTPUTS", "0") not in ("", "0")


def empty_output(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs, poisoned when :func:`poison_enabled`."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if poison_enabled():
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out

