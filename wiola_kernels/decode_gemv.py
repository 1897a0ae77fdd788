"""Batch-1 decoding GEMV on the CPU (private: the Wiola model's decoding steps use it).

At batch 1 a decoding step's projections are matrix-vector products whose cost is reading
each weight once. :func:`pack` lays a weight out for one sequential read — panels of
:data:`PANEL` output columns, k-major inside a panel, the last panel zero-padded — and
:func:`gemv` computes ``y = x · Wᵀ`` (``nn.Linear``'s convention, no bias) for up to
:data:`MAX_ROWS` rows of ``x`` with the C++ kernel ``torch.ops.wiola._decode_gemv``
(``csrc/cpu/decode_gemv.cpp``: AVX-512 when the CPU has it, else AVX2, else plain C++;
float32 accumulation; ``torch.set_num_threads`` threads over the panels).

Grouped weights ``(G, n, k)`` hold G independent matrices, each with its own rows of ``x``
(``x (G, rows, k) → (G, rows, n)``); the model's folded context attention reads one small
matrix per head that way.

The instruction set is chosen at run time; ``isa=`` (or the environment variable
``WIOLA_GEMV_ISA``) forces ``"avx512"``, ``"avx2"`` or ``"generic"``, so that tests and
benchmarks can run each path on one machine; ``"auto"`` follows the CPU kernels' choice
(:func:`wiola_kernels.cpu_isa`: AVX-512 where the CPU has it, unless set to AVX2).

    w = torch.randn(1536, 1024)
    packed = pack(w)
    y = gemv(torch.randn(1, 1024), packed)      # == x @ w.t(), (1, 1536)
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

#: Output columns per panel of the packed layout (the C++ kernel's ``kPanel``).
PANEL = 32
#: Most rows of ``x`` per call (the C++ kernel's ``kMaxRows``; a decoding step's ``B·T_new``).
MAX_ROWS = 16
ISAS = ("auto", "avx512", "avx2", "generic")


@dataclass(frozen=True)
class PackedWeight:
    """A weight packed by :func:`pack`: ``data (G, ceil(n / PANEL), k, PANEL)`` float32,
    ``data[g, p, kk, c] = W_g[p·PANEL + c, kk]`` (zeros past ``n``)."""

    data: Tensor
    n: int
    k: int
    groups: int

    @property
    def nbytes(self) -> int:
        """Bytes one :func:`gemv` reads from the weight (padding included)."""
        return self.data.numel() * self.data.element_size()


_op = None


def _kernel():
    # The op's overload, looked up once: a decoding step calls it ~100 times, and the
    # torch.ops lookup costs more than the checks around it.
    global _op
    if _op is None:
        if not available():
            raise RuntimeError("wiola_kernels.decode_gemv needs the C++ extension (wiola_kernels._C), "
                               "which is not loaded")
        _op = torch.ops.wiola._decode_gemv.default
    return _op


def available() -> bool:
    """Whether the C++ kernel is loaded (the extension was built and imported)."""
    from . import _extension

    return _extension.load_error() is None and hasattr(torch.ops, "wiola") and hasattr(torch.ops.wiola, "_decode_gemv")


def pack(weight: Tensor) -> PackedWeight:
    """Pack ``weight`` — ``(n, k)`` as ``nn.Linear.weight``, or ``(G, n, k)`` for G matrices —
    for :func:`gemv`. The result is a copy (gradients do not flow to ``weight``).

    Raises:
        TypeError: ``weight`` is not a float32 tensor.
        ValueError: ``weight`` is not on the CPU, not 2-D/3-D, or has an empty dimension.
    """
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype != torch.float32:
        raise TypeError(f"weight must be float32, got {weight.dtype}")
    if weight.device.type != "cpu":
        raise ValueError(f"weight must be on the CPU, got {weight.device}")
    if weight.dim() not in (2, 3) or 0 in weight.shape:
        raise ValueError(f"weight must have shape (n, k) or (G, n, k) with no empty dimension, "
                         f"got {tuple(weight.shape)}")
    w = weight.detach()
    w3 = w[None] if w.dim() == 2 else w
    g, n, k = w3.shape
    panels = -(-n // PANEL)
    padded = w3.new_zeros(g, panels * PANEL, k)
    padded[:, :n] = w3
    data = padded.view(g, panels, PANEL, k).transpose(2, 3).contiguous()  # (G, P, k, PANEL)
    return PackedWeight(data, n, k, g)


@functools.lru_cache(maxsize=None)
def _isa_runs(isa: str) -> bool:
    try:
        _kernel()(torch.ones(1, 1, 1), torch.ones(1, 1, 1, PANEL), 1, isa)
    except ValueError:
        return False
    return True


def available_isas() -> list[str]:
    """The instruction sets :func:`gemv` can use here, best first (``"generic"`` always,
    when the extension is loaded)."""
    return [isa for isa in ISAS[1:] if _isa_runs(isa)]


def gemv(x: Tensor, packed: PackedWeight, isa: str | None = None) -> Tensor:
    """``x · Wᵀ`` for the ``W`` that ``packed`` holds (float32, CPU).

    Args:
        x: ``(..., k)`` with at most :data:`MAX_ROWS` rows in all (the leading dimensions'
            product) for a plain weight; ``(G, rows ≤ MAX_ROWS, k)`` for G grouped weights.
            The last dimension must be contiguous (other strides are read as they are).
        packed: the result of :func:`pack`.
        isa: ``"auto"`` (default: ``WIOLA_GEMV_ISA`` or else the best the CPU has),
            ``"avx512"``, ``"avx2"`` or ``"generic"``.

    Returns:
        ``(..., n)`` (plain) or ``(G, rows, n)`` (grouped), float32.

    Raises:
        TypeError: wrong types or dtypes. ValueError: wrong shapes, devices, too many rows,
        or an instruction set this CPU or build lacks.
    """
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"packed must be a PackedWeight from decode_gemv.pack, got {type(packed).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if not x.is_cpu:
        raise ValueError(f"x must be on the CPU, got {x.device}")
    if isa is None:
        isa = os.environ.get("WIOLA_GEMV_ISA") or "auto"
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    if x.dim() == 0 or x.shape[-1] != packed.k:
        raise ValueError(f"x must have shape (..., k = {packed.k}), got {tuple(x.shape)}")
    if packed.groups == 1:
        rows = x.reshape(1, -1, packed.k)  # a view for the model's (B, T, k) activations
        if not 1 <= rows.shape[1] <= MAX_ROWS:
            raise ValueError(f"x must have 1..{MAX_ROWS} rows (product of its leading dimensions), "
                             f"got shape {tuple(x.shape)}")
        if rows.stride(2) != 1:
            rows = rows.contiguous()
        return _kernel()(rows, packed.data, packed.n, isa).view(x.shape[:-1] + (packed.n,))
    if x.dim() != 3 or x.shape[0] != packed.groups or not 1 <= x.shape[1] <= MAX_ROWS:
        raise ValueError(f"x must have shape (G = {packed.groups}, rows ≤ {MAX_ROWS}, k = {packed.k}) for a grouped "
                         f"weight, got {tuple(x.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    return _kernel()(x, packed.data, packed.n, isa)


__all__ = ["MAX_ROWS", "PANEL", "PackedWeight", "available", "available_isas", "gemv", "pack"]
