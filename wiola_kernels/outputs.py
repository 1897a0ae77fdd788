"""Kernel output allocation shared by every launcher (ops/ and triton/): poisoned in tests."""

from __future__ import annotations

import os

import torch


def _poison_from_environment() -> bool:
    return os.environ.get("WIOLA_POISON_OUTPUTS", "0") not in ("", "0")


# Read once, at import (tests/conftest.py sets it before importing the package): an environment
# lookup per allocation is host time on every kernel call.
_POISON = _poison_from_environment()


def poison_enabled() -> bool:
    """True when ``WIOLA_POISON_OUTPUTS=1`` was set when the package was imported: outputs are
    filled with NaN (floats) or -1 (integers) before a kernel writes them, so a skipped element
    cannot pass a test. The C++ extension reads the same variable."""
    return _POISON


def empty_output(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs, poisoned when :func:`poison_enabled`."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _POISON:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out



# ---- Layouts: kernels take strided inputs and return outputs in their inputs' layout ----
#
# The model's q/k/v are transposed views ``Linear(x).view(B, T, H, d_h).transpose(1, 2)``.
# SRPE and GCLA attention read them through their strides and write each output with the
# strides of the input it corresponds to (``torch.empty_like``: a dense input keeps its
# memory order, any other comes out contiguous), so the next op — and autograd handing a
# gradient back through the views — needs no copy. Only a non-unit last-dim stride (never
# produced by a projection) is copied.


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension is contiguous (stride 1), else a contiguous copy:
    the one input layout the strided kernels cannot read."""
    if x.numel() == 0:  # no data; .contiguous() would keep the odd strides (an empty tensor counts as contiguous)
        return x if x.dim() == 0 or x.stride(-1) == 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return x if x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def empty_output_as(x: torch.Tensor) -> torch.Tensor:
    """:func:`empty_output` shaped and laid out like ``x`` (``torch.empty_like``'s strides;
    the C++ kernels' ``empty_output_like`` and the ops' fakes make the same choice)."""
    out = torch.empty_like(x)
    if _POISON:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and equal strides in every dimension longer than 1 (the strides that
    address memory)."""
    return a.shape == b.shape and all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


def in_layout_of(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``result`` in the layout ``torch.empty_like(like)`` has (``like`` may be a meta tensor):
    itself when it already is (the strided kernels), else copied into it (the reference and
    CUDA-composite backends)."""
    if same_layout(result, torch.empty_like(like, dtype=result.dtype, device="meta")):
        return result
    return torch.empty_like(like, dtype=result.dtype, device=result.device).copy_(result)
