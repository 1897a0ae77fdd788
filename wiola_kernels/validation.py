"""Argument checks shared by every op: each raises ``TypeError``/``ValueError`` that
names the argument and what was expected (SPEC §9), before any kernel runs.

Everything an op checks lives here, so that the ops agree: tensor types and float dtypes,
ranks and shapes, devices, ``position_ids`` (``(B, T)``, ``(1, T)`` or ``(T,)``, any of
:data:`INDEX_DTYPES`), ``lengths``, ATM index maps, head widths, and the limits of each
backend (:class:`Limits`: which dtypes and head widths its kernels take)."""

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


# --- integer inputs: position ids, lengths, index maps ------------------------------------

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


def _checks_values(t: torch.Tensor) -> bool:
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
    if _checks_values(lengths):
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > t:
            raise ValueError(f"lengths must lie in [0, T] = [0, {t}], got values in [{lo}, {hi}]")


def check_index_map(index_map: object, b: int, t: int, *, like: str) -> torch.Tensor:
    """An ATM ``index_map``: int64 ``(B, T)`` matching ``like``'s first two dims, values in ``[0, T)``."""
    check_tensor("index_map", index_map, dtypes=(torch.int64,))
    if tuple(index_map.shape) != (b, t):
        raise ValueError(f"index_map must have shape (B, T) = ({b}, {t}) to match {like}, "
                         f"got {tuple(index_map.shape)}")
    check_index_map_values(index_map, t)
    return index_map


def check_index_map_values(index_map: torch.Tensor, t: int) -> None:
    """``index_map`` values lie in ``[0, T)`` (checked on CPU tensors only)."""
    if _checks_values(index_map):
        lo, hi = int(index_map.min()), int(index_map.max())
        if lo < 0 or hi >= t:
            raise ValueError(f"index_map values must lie in [0, T) = [0, {t}), got values in [{lo}, {hi}]")


def check_position_range(positions: torch.Tensor, limit: int, why: str) -> None:
    """``|position_ids| ≤ limit`` (checked on CPU tensors only); ``why`` says what breaks beyond."""
    if _checks_values(positions):
        largest = int(positions.abs().max())
        if largest > limit:
            raise ValueError(f"position_ids must lie within ±{limit} ({why}), got |p| = {largest}")


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

def _dtype_name(dtype: torch.dtype) -> str:
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
            return f"dtype {_dtype_name(dtype)} (it takes {', '.join(map(_dtype_name, self.dtypes))})"
        if head_dim is not None and self.head_dims is not None and head_dim not in self.head_dims:
            return f"d_h = {head_dim} (it has kernels for d_h in {{{', '.join(map(str, self.head_dims))}}})"
        if head_dim is not None and self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"d_h = {head_dim} (it takes even head widths d_h in [2, {self.max_head_dim}])"
        for limited, widest in self.dtype_max_head_dims or ():
            if dtype == limited and head_dim is not None and head_dim > widest:
                name = _dtype_name(dtype)
                return f"{name} with d_h = {head_dim} (it takes {name} only up to d_h {widest})"
        return None

    def describe(self) -> str:
        """One line, e.g. ``"dtypes float32, float16, bfloat16; d_h in {64, 128}"``; ``"any input"``."""
        parts = []
        if self.dtypes is not None:
            parts.append("dtypes " + ", ".join(map(_dtype_name, self.dtypes)))
        if self.head_dims is not None:
            parts.append("d_h in {" + ", ".join(map(str, self.head_dims)) + "}")
        if self.max_head_dim is not None:
            parts.append(f"even d_h in [2, {self.max_head_dim}]")
        parts += [f"{_dtype_name(dt)} up to d_h {widest}" for dt, widest in self.dtype_max_head_dims or ()]
        return "; ".join(parts) or "any input"


NO_LIMITS = Limits()
#: The CUDA C++ kernels (GCLA summary kernels, ATM) are instantiated for these dtypes only.
CUDA_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Head widths the CUDA GCLA summary kernels are instantiated for (csrc/cuda/gcla_attention.cu).
CUDA_GCLA_HEAD_DIMS = (64, 128)
#: Widest head the Triton GCLA kernels tile (16 … 256 columns; triton/gcla_attention.py).
TRITON_GCLA_MAX_HEAD_DIM = 256
#: Widest float32 head they take on a GPU: float32's exact (FMA) products hold d_h-long operand
#: rows in registers, and spill beyond (the cuda backend takes float32 at d_h 128).
TRITON_GCLA_FP32_MAX_HEAD_DIM = 64


# --- one function per public op: what its kernels written in Python check at entry ---------
#
# The C++ kernels make the same checks with the same words (csrc/include/wiola/checks.h); the
# ops' Functions call these only when a backend is forced (the dispatcher's kernels check
# their own inputs), and the fakes call them while tracing.

def check_rms_norm(x: object, weight: object, shift: object, eps: object, hf_order: object) -> float:
    """Arguments of :func:`wiola_kernels.rms_norm`; returns ``eps`` as a float."""
    check_tensor("x", x)
    check_tensor("weight", weight)
    if shift is not None:
        check_tensor("shift", shift)
    check_rank("x", x, range(1, 64), "(..., d)")
    d = x.shape[-1]
    check_shape("weight", weight, (d,), "(d,)")
    if shift is not None:
        check_shape("shift", shift, (d,), "(d,)")
    check_same_device(x=x, weight=weight, shift=shift)
    eps = check_positive("eps", eps)
    if not isinstance(hf_order, bool):
        raise TypeError(f"hf_order must be a bool, got {type(hf_order).__name__}")
    if d == 0:
        raise ValueError("x must have a non-empty last dimension d, got d = 0")
    return eps


def srpe_max_position(spiral_divisor: float, max_frequency: float = 1.0) -> int:
    """Largest ``|p|`` at which float32 SRPE outputs still meet SPEC §9's 1e-5.

    Every backend forms ``p·ω_j·(1 + 1/k_s)`` in float64, whose rounding error is about
    ``p·ω_j·(1 + 1/k_s)·2^-52`` radians; a pair rotated by a wrong angle δ has relative
    error ≈ δ. With ``max_frequency = max_j |ω_j|`` (1 for ``θ₀^(−2j/d_h)``, ``ω_0 = 1``; a
    given ``inv_freq``'s largest value otherwise) that is ``p ≤ 1e-5·2^52/(|1 + 1/k_s|·max_j|ω_j|)``:
    about 2^35 for the default ``k_s = 8``, 2^34 for any ``k_s ≥ 1`` (derivation and mpmath
    checks in tests/test_srpe.py). Capped at 2^53, where int64 → float64 stops being exact.
    """
    factor = abs(1.0 + 1.0 / spiral_divisor) * max_frequency
    return 2**53 if factor == 0.0 else min(2**53, int(1e-5 * 2.0**52 / factor))


def check_srpe_inv_freq(inv_freq: object, dh: int, q_name: str, q: torch.Tensor) -> float:
    """SRPE's given frequencies (SPEC §4): a floating ``(d_h/2,)`` tensor on ``q``'s device,
    finite (values read on CPU tensors only). Returns ``max_j |ω_j|`` (1.0 when the values are
    not read)."""
    check_tensor("inv_freq", inv_freq)
    if tuple(inv_freq.shape) != (dh // 2,):
        got = "a 0-d tensor (a scalar)" if inv_freq.dim() == 0 else str(tuple(inv_freq.shape))
        raise ValueError(f"inv_freq must have shape (d_h/2,) = ({dh // 2},), got {got}")
    check_same_device(**{q_name: q, "inv_freq": inv_freq})
    if not _checks_values(inv_freq):
        return 1.0
    w = inv_freq.double()
    bad = (~torch.isfinite(w)).nonzero()
    if len(bad):
        j = int(bad[0, 0])
        raise ValueError(f"inv_freq must hold finite frequencies, got {float(w[j])!r} at pair {j}")
    return float(w.abs().max())


def check_srpe(q: object, k: object, position_ids: object, theta: object, spiral_divisor: object,
               radial_amplitude: object, radial_frequency: object, inv_freq: object = None, scale: object = 1.0,
               names: tuple[str, str] = ("q", "k")
               ) -> tuple[torch.Tensor, tuple[float, float, float, float], torch.Tensor | None, float]:
    """Arguments of :func:`wiola_kernels.srpe` (``names``: what to call q and k); returns the
    int64 ``(B, T)`` positions, the four parameters as floats, ``inv_freq`` (or None) and
    ``scale`` as a float."""
    q_name, k_name = names
    check_tensor(q_name, q)
    check_tensor(k_name, k)
    check_same_dtype(**{q_name: q, k_name: k})
    b, _h, _h_kv, t, dh = check_query_key(q_name, q, k_name, k)
    check_same_device(**{q_name: q, k_name: k}, position_ids=position_ids)
    hint = bthd_hint(q, k, t=position_ids.shape[-1]) if position_ids.dim() in (1, 2) else ""
    positions = check_position_ids(position_ids, b, t, hint=hint)
    theta = check_positive("theta", theta)
    if isinstance(spiral_divisor, float) and spiral_divisor in (float("inf"), float("-inf")):
        spiral_divisor = float(spiral_divisor)  # 1/k_s = 0: the plain RoPE angle p·ω_j
    else:
        spiral_divisor = check_real("spiral_divisor", spiral_divisor)
    if spiral_divisor == 0.0:
        raise ValueError("spiral_divisor must be non-zero (the angle uses 1 + 1/k_s)")
    params = (theta, spiral_divisor, check_real("radial_amplitude", radial_amplitude),
              check_real("radial_frequency", radial_frequency))
    max_frequency = 1.0 if inv_freq is None else check_srpe_inv_freq(inv_freq, dh, q_name, q)
    scale = check_real("scale", scale)
    given = "" if inv_freq is None else f" and max |inv_freq| = {max_frequency!r}"
    why = f"float32 SRPE outputs lose SPEC accuracy beyond it for spiral_divisor={spiral_divisor}{given}"
    check_position_range(positions, srpe_max_position(spiral_divisor, max_frequency), why)
    return positions, params, inv_freq, scale


def check_gcla_attention(q_rot: object, k_rot: object, v: object, q: object, kc: object, vc: object, gate: object,
                         lengths: object) -> torch.Tensor | None:
    """Arguments of :func:`wiola_kernels.gcla_attention`; returns ``lengths`` as int64 (or None)."""
    for name, t in (("q_rot", q_rot), ("k_rot", k_rot), ("v", v), ("q", q), ("kc", kc), ("vc", vc),
                    ("gate", gate)):
        check_tensor(name, t)
    B, H, H_kv, T, dh = check_query_key("q_rot", q_rot, "k_rot", k_rot)
    # With H = H_kv the four tensors agree in either layout; kc/gate give a transposed call away.
    transposed = bthd_hint(q_rot, k_rot, v, q)
    check_shape("v", v, (B, H_kv, T, dh), "(B, H_kv, T, d_h)")
    check_shape("q", q, (B, H, T, dh), "(B, H, T, d_h)")
    check_rank("kc", kc, 5, "(B, H, S, Λ', d_h)")
    if kc.shape[0] != B or kc.shape[1] != H or kc.shape[4] != dh or kc.shape[2] not in (1, T):
        hint = transposed if kc.shape[1] == T and kc.shape[2] in (1, H) else ""
        raise ValueError(f"kc must have shape (B, H, S, Λ', d_h) = ({B}, {H}, S, Λ', {dh}) with S in "
                         f"{{1, T = {T}}}, got {tuple(kc.shape)}{hint}")
    check_rank("vc", vc, 5, "(B, H, S, Λ', d_h)")
    if tuple(vc.shape) != tuple(kc.shape):
        raise ValueError(f"vc must have the shape of kc (B, H, S, Λ', d_h) = {tuple(kc.shape)} (same S and Λ'), "
                         f"got {tuple(vc.shape)}")
    if tuple(gate.shape) != (H,):
        hint = transposed if tuple(gate.shape) == (T,) else ""
        raise ValueError(f"gate must have shape (H,) = ({H},), got {tuple(gate.shape)}{hint}")
    check_same_dtype(q_rot=q_rot, k_rot=k_rot, v=v, q=q, kc=kc, vc=vc)
    if lengths is not None:
        check_tensor("lengths", lengths, dtypes=INDEX_DTYPES)
    check_same_device(q_rot=q_rot, k_rot=k_rot, v=v, q=q, kc=kc, vc=vc, gate=gate, lengths=lengths)
    return check_lengths(lengths, B, T)


def check_atm_tokens(name: str, x: object) -> tuple[int, int, int]:
    """ATM's ``(B, T, d)`` tokens (``x``, ``y`` or a gradient: ``name``) with ``d > 0``."""
    check_tensor(name, x)
    check_rank(name, x, 3, "(B, T, d)")
    b, t, d = x.shape
    if d == 0:
        raise ValueError(f"{name} must have a non-empty last dimension d, got shape {tuple(x.shape)}")
    return b, t, d


def check_atm_merge(x: object, position_ids: object, threshold: object, lengths: object
                    ) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Arguments of :func:`wiola_kernels.atm_merge`; returns int64 ``(B, T)`` positions, the
    threshold as a float and int64 ``(B,)`` lengths (``T`` for every row when None)."""
    b, t, _ = check_atm_tokens("x", x)
    check_same_device(x=x, position_ids=position_ids, lengths=lengths)
    positions = check_position_ids(position_ids, b, t)
    threshold = check_real("threshold", threshold)
    if not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must lie in [-1, 1] (a cosine similarity), got {threshold!r}")
    lengths = check_lengths(lengths, b, t)
    if lengths is None:
        lengths = torch.full((b,), t, dtype=torch.int64, device=x.device)
    return positions, threshold, lengths


def check_atm_unmerge(y: object, index_map: object, name: str = "y") -> None:
    """Arguments of :func:`wiola_kernels.atm_unmerge` (``name``: what to call ``y``)."""
    b, t, _ = check_atm_tokens(name, y)
    check_index_map(index_map, b, t, like=name)
    check_same_device(**{name: y}, index_map=index_map)


def check_add_rms_norm(x: object, residual: object, weight: object, shift: object, eps: object,
                       hf_order: object) -> float:
    """Arguments of :func:`wiola_kernels.add_rms_norm`; returns ``eps`` as a float."""
    check_tensor("x", x)
    check_tensor("residual", residual)
    check_rank("x", x, range(1, 64), "(..., d)")
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"residual must have the shape of x (..., d) = {tuple(x.shape)}, got {tuple(residual.shape)}")
    check_same_dtype(x=x, residual=residual)
    check_same_device(x=x, residual=residual)
    return check_rms_norm(x, weight, shift, eps, hf_order)


#: The activations of :func:`wiola_kernels.glu`.
GLU_ACTIVATIONS = ("silu", "gelu_tanh")


def check_glu(a: object, b: object, activation: object) -> str:
    """Arguments of :func:`wiola_kernels.glu` (``b`` None: ``a`` holds ``[a | b]``); returns
    the activation."""
    check_tensor("a", a)
    if b is not None:
        check_tensor("b", b)
    check_rank("a", a, range(1, 64), "(..., n)" if b is not None else "(..., 2n)")
    if b is not None:
        if tuple(b.shape) != tuple(a.shape):
            raise ValueError(f"b must have the shape of a (..., n) = {tuple(a.shape)}, got {tuple(b.shape)}")
        check_same_dtype(a=a, b=b)
        check_same_device(a=a, b=b)
    elif a.shape[-1] % 2:
        raise ValueError(f"a must have an even last dimension 2n when b is None (a holds [a | b]), got {a.shape[-1]}")
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str, got {type(activation).__name__}")
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")
    return activation


#: ``reduction`` values of :func:`wiola_kernels.linear_cross_entropy`.
LCE_REDUCTIONS = ("mean", "sum", "none")


def check_linear_cross_entropy(h: object, W: object, labels: object, ignore_index: object, reduction: object,
                               label_smoothing: object, softcap: object, z_loss: object, num_items: object
                               ) -> tuple[int, float, float | None, float]:
    """Arguments of :func:`wiola_kernels.linear_cross_entropy`; returns ``(N, label_smoothing,
    softcap, z_loss)`` with the numbers as floats. Label values (in ``[0, V)`` or
    ``ignore_index``) and a ``num_items`` tensor's value (> 0) are checked on CPU tensors."""
    check_tensor("h", h)
    check_tensor("W", W)
    check_rank("h", h, range(2, 64), "(..., d)")
    d = h.shape[-1]
    check_rank("W", W, 2, "(V, d)")
    if W.shape[1] != d:
        raise ValueError(f"W must have shape (V, d) = (V, {d}) to match h, got {tuple(W.shape)}")
    if d == 0:
        raise ValueError("h must have a non-empty last dimension d, got d = 0")
    if W.shape[0] == 0:
        raise ValueError(f"W must have at least one row (V >= 1), got shape {tuple(W.shape)}")
    check_same_dtype(h=h, W=W)
    check_tensor("labels", labels, dtypes=INDEX_DTYPES)
    n = h.numel() // d
    if tuple(labels.shape) not in (tuple(h.shape[:-1]), (n,)):
        raise ValueError(f"labels must have shape h.shape[:-1] = {tuple(h.shape[:-1])} or (N,) = ({n},), "
                         f"got {tuple(labels.shape)}")
    check_same_device(h=h, W=W, labels=labels)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in LCE_REDUCTIONS:
        raise ValueError(f"reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")
    label_smoothing = check_real("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing!r}")
    softcap = None if softcap is None else check_positive("softcap", softcap)
    z_loss = check_positive("z_loss", z_loss, allow_zero=True)
    check_num_items(num_items, h.device)
    if _checks_values(labels):
        counted = labels[labels != ignore_index]
        if counted.numel():
            lo, hi = int(counted.min()), int(counted.max())
            if lo < 0 or hi >= W.shape[0]:
                bad = lo if lo < 0 else hi
                raise ValueError(f"labels must lie in [0, V) = [0, {W.shape[0]}) or equal ignore_index = "
                                 f"{ignore_index}, got {bad}")
    return n, label_smoothing, softcap, z_loss


def check_num_items(num_items: object, device: torch.device) -> None:
    """``num_items`` of a mean: None, a number > 0, or a tensor of one element on ``device``
    or the CPU (its value, > 0, checked on the CPU)."""
    if num_items is None:
        return
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.dtype == torch.bool or num_items.is_complex():
            raise ValueError(f"num_items must be a number > 0 or a real tensor of one element, got a tensor of "
                             f"shape {tuple(num_items.shape)} and dtype {_dtype_name(num_items.dtype)}")
        if num_items.device != device and num_items.device.type != "cpu":
            raise ValueError(f"num_items must be on {device} like h (or on the CPU), got {num_items.device}")
        if _checks_values(num_items):
            value = float(num_items)
            if not value > 0.0 or value == float("inf"):
                raise ValueError(f"num_items must be a finite number > 0, got {value!r}")
        return
    check_positive("num_items", num_items)
