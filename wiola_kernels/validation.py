"""The argument checks several ops share: each raises ``TypeError``/``ValueError`` that names
the argument and what was expected (SPEC §9), before any kernel runs.

Each op's own check, ``check_<op>`` (the words of ``checks::<op>`` in
csrc/include/wiola/checks.h), lives in its module ``wiola_kernels/ops/<op>.py``, beside the
kernels written in Python and the fakes that call it. It is built from the pieces here, so
that the ops agree: tensor types and float dtypes, ranks and shapes, devices,
``position_ids`` (``(B, T)``, ``(1, T)`` or ``(T,)``, any of :data:`INDEX_DTYPES`),
``lengths``, attention tensors' heads and head widths; and the limits of each backend
(:class:`Limits`: which dtypes and head widths its kernels take)."""

from __future__ import annotations

from dataclasses import dataclass
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


# --- integer inputs: position ids, lengths ------------------------------------------------

#: Integer dtypes every op accepts for ``position_ids`` and ``lengths`` (converted to int64).
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def check_position_ids(position_ids: object, b: int, t: int, *, hint: str = "") -> torch.Tensor:
    """``position_ids`` of an op over ``(B, T)`` tokens: an integer tensor ``(B, T)``, ``(1, T)``
    or ``(T,)`` (the last two shared by the batch), the same for every op that takes positions.
    Returns an int64 ``(B, T)`` view (expanded, not copied, when shared). ``hint`` is appended
    to a shape error (see :func:`bthd_hint`)."""
    check_tensor("position_ids", position_ids, dtypes=INDEX_DTYPES)
    shape = tuple(position_ids.shape)
    if shape not in ((b, t), (1, t), (t,)):
        raise ValueError(f"position_ids must have shape (B, T) = ({b}, {t}), (1, T) = (1, {t}) or (T,) = ({t},), "
                         f"got {shape}{hint}")
    return position_ids.to(torch.int64).expand(b, t)


def can_read_values(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values: a CPU tensor with data, outside ``torch.compile``."""
    # Reading values needs the data: on a GPU that is a device sync per call, and under
    # torch.compile a graph break. There the kernels clamp instead (docs/ops.md, bad input).
    if t.device.type != "cpu" or t.numel() == 0 or torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t)  # a fake (tracing) has no data


def check_lengths(lengths: object, b: int, t: int) -> torch.Tensor | None:
    """Optional per-row lengths: None, or an integer tensor ``(B,)`` with values in ``[0, T]``
    (values checked on CPU tensors). Returns int64 ``(B,)`` or None."""
    if lengths is None:
        return None
    check_tensor("lengths", lengths, dtypes=INDEX_DTYPES)
    check_shape("lengths", lengths, (b,), "(B,)")
    check_lengths_values(lengths, t)
    return lengths.to(torch.int64)


def check_lengths_values(lengths: torch.Tensor, t: int) -> None:
    """``lengths`` values lie in ``[0, T]`` (checked on CPU tensors only, see :func:`check_lengths`)."""
    if can_read_values(lengths):
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > t:
            raise ValueError(f"lengths must lie in [0, T] = [0, {t}], got values in [{lo}, {hi}]")


# --- attention tensors: heads and head dims ------------------------------------------------

def check_head_dim(name: str, head_dim: int) -> None:
    """The head width every op takes: even (rotate-half pairs) and > 0. Backend-specific limits
    are :class:`Limits`, checked when a backend is chosen."""
    if head_dim == 0 or head_dim % 2 != 0:
        raise ValueError(f"{name} must have an even, non-zero head dim d_h (last dim), got d_h = {head_dim}")


def check_query_key(q_name: str, q: torch.Tensor, k_name: str, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    """``q (B, H, T, d_h)`` and ``k (B, H_kv, T, d_h)`` with ``H`` a multiple of ``H_kv`` and an
    even ``d_h``; returns ``(B, H, H_kv, T, d_h)``."""
    check_rank(q_name, q, 4, "(B, H, T, d_h)")
    check_rank(k_name, k, 4, "(B, H_kv, T, d_h)")
    b, h, t, dh = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != dh:
        raise ValueError(f"{k_name} must have shape (B, H_kv, T, d_h) = ({b}, H_kv, {t}, {dh}) to match {q_name}, "
                         f"got {tuple(k.shape)}{bthd_hint(q, k)}")
    h_kv = k.shape[1]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"{q_name}'s heads H = {h} (dim 1) must be a multiple of {k_name}'s heads H_kv = {h_kv} "
                         f"(dim 1){bthd_hint(q, k)}")
    check_head_dim(q_name, dh)
    return b, h, h_kv, t, dh


# --- what a backend takes -------------------------------------------------------------------

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Limits:
    """The inputs one backend of one op takes (``None``: no limit). A backend chosen for an
    input outside its limits is skipped, with a one-time warning that names the reason
    (:func:`wiola_kernels.dispatch.select`); :func:`wiola_kernels.backends` lists them."""

    dtypes: tuple[torch.dtype, ...] | None = None      # floating dtypes of the op's main input
    head_dims: tuple[int, ...] | None = None           # d_h values with kernels
    max_head_dim: int | None = None                    # even d_h up to this
    dtype_max_head_dims: tuple[tuple[torch.dtype, int], ...] | None = None  # (dtype, widest d_h) narrower limits

    def reason(self, dtype: torch.dtype | None, head_dim: int | None) -> str | None:
        """None when the backend takes ``dtype`` / ``head_dim``, else why not."""
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype {dtype_name(dtype)} (it takes {', '.join(map(dtype_name, self.dtypes))})"
        if head_dim is not None and self.head_dims is not None and head_dim not in self.head_dims:
            return f"d_h = {head_dim} (it has kernels for d_h in {{{', '.join(map(str, self.head_dims))}}})"
        if head_dim is not None and self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"d_h = {head_dim} (it takes even head widths d_h in [2, {self.max_head_dim}])"
        for limited, widest in self.dtype_max_head_dims or ():
            if dtype == limited and head_dim is not None and head_dim > widest:
                name = dtype_name(dtype)
                return f"{name} with d_h = {head_dim} (it takes {name} only up to d_h {widest})"
        return None

    def describe(self) -> str:
        """One line, e.g. ``"dtypes float32, float16, bfloat16; d_h in {64, 128}"``; ``"any input"``."""
        parts = []
        if self.dtypes is not None:
            parts.append("dtypes " + ", ".join(map(dtype_name, self.dtypes)))
        if self.head_dims is not None:
            parts.append("d_h in {" + ", ".join(map(str, self.head_dims)) + "}")
        if self.max_head_dim is not None:
            parts.append(f"even d_h in [2, {self.max_head_dim}]")
        parts += [f"{dtype_name(dt)} up to d_h {widest}" for dt, widest in self.dtype_max_head_dims or ()]
        return "; ".join(parts) or "any input"


NO_LIMITS = Limits()
#: The CUDA C++ kernels (GCLA summary kernels, ATM) are instantiated for these dtypes only.
CUDA_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# GCLA's Triton limits, here because two layers read them: the kernels (triton/gcla_attention.py,
# which import nothing of the op layer) and the op's Limits (ops/gcla_attention.py).
#: Widest head the Triton GCLA kernels tile (16 … 256 columns; triton/gcla_attention.py).
TRITON_GCLA_MAX_HEAD_DIM = 256
#: Widest float32 head they take on a GPU: float32's exact (FMA) products hold d_h-long operand
#: rows in registers, and spill beyond (the cuda backend takes float32 at d_h 128).
TRITON_GCLA_FP32_MAX_HEAD_DIM = 64
