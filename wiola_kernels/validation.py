"""Argument checks shared by every op: each raises ``TypeError``/``ValueError`` that
names the argument and what was expected (SPEC §9), before any kernel runs."""

from __future__ import annotations

from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_tensor(name: str, t: object, *, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> torch.Tensor:
    """``t`` must be a tensor of one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    return t


def check_rank(name: str, t: torch.Tensor, rank: int | Sequence[int], layout: str) -> None:
    """``t.dim()`` must be ``rank`` (or one of them); ``layout`` spells the expected shape."""
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if t.dim() not in ranks:
        if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
            wanted = f"at least {ranks[0]} dimension{'s' if ranks[0] > 1 else ''}"  # an open range, e.g. (..., d)
        else:
            wanted = f"{' or '.join(map(str, ranks))}-D"
        got = "a 0-d tensor (a scalar)" if t.dim() == 0 else str(tuple(t.shape))
        raise ValueError(f"{name} must have shape {layout} ({wanted}), got {got}")


def bthd_hint(queries: torch.Tensor, *others: torch.Tensor, t: int | None = None) -> str:
    """A hint to append to a shape error when 4-D attention tensors look like they were
    passed as ``(B, T, H, d_h)`` — the layout of ``Linear(x).view(B, T, H, d_h)`` — instead
    of the ops' ``(B, H, T, d_h)``: read that way they agree (same B, T and d_h, query
    heads a multiple of each other tensor's heads, and T equal to ``t`` when given).
    Returns "" when they do not, so the hint never points the wrong way."""
    tensors = (queries, *others)
    if any(x.dim() != 4 for x in tensors):
        return ""
    b, seq, h, dh = queries.shape
    for x in others:
        if x.shape[0] != b or x.shape[1] != seq or x.shape[3] != dh or x.shape[2] == 0 or h % x.shape[2]:
            return ""
    if t is not None and t != seq:
        return ""
    return (f"; these look like (B, T, H, d_h) = {tuple(queries.shape)}, but the layout is (B, H, T, d_h) "
            f"(heads before time): pass .transpose(1, 2) of each")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    """``t.shape`` must equal ``expected``; ``layout`` spells it with symbols."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors live on one device; returns it."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    for n, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    device = items[0][1].device
    for n, t in items[1:]:
        if t.device != device:
            raise ValueError(f"{n} must be on {device} like {items[0][0]}, got {t.device}")
    return device


def check_same_dtype(**tensors: torch.Tensor | None) -> torch.dtype:
    """All given tensors share one dtype; returns it."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    dtype = items[0][1].dtype
    for n, t in items[1:]:
        if t.dtype != dtype:
            raise TypeError(f"{n} must have dtype {dtype} like {items[0][0]}, got {t.dtype}")
    return dtype


def check_positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    """``value`` is a finite real number > 0 (or >= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not (v >= 0.0 if allow_zero else v > 0.0) or v != v or v == float("inf"):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


def check_real(name: str, value: object) -> float:
    """``value`` is a finite real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v
