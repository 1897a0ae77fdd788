"""Gated-activation Triton kernels (SPEC §10.2): ``y = act(a) ⊙ b``.

Both activations are ``a·σ(h(a))``: SiLU with ``h(a) = a``, GELU_tanh with
``h(a) = 2k(a + c·a³)`` (``½(1 + tanh z) = σ(2z)``, k = √(2/π), c = 0.044715), so there is
no tanh and no cancellation in ``1 + tanh`` for negative a. With ``s = σ(h)``:

    act(a)  = a·s,       act'(a) = s + a·s(1 − s)·h'(a)
    ∂a = g·b·act'(a),    ∂b = g·act(a)          (the backward recomputes s from a)

``a`` is clamped to ±T for h and h' (T per activation and dtype, where s is exactly 0 or 1
in the accumulation dtype), so ±inf and huge inputs give the exact limits and nothing
overflows; the clamps are ``where`` selects, which keep NaN (``minimum``/``maximum`` would
drop it on a GPU).

Elementwise and memory-bound. Launch (``_launch_config``; ``aot_launches`` compiles the
same): a persistent grid over tiles of ``ROWS_PER_STEP`` rows × ``BLOCK_N`` columns. A thread
owns 16 contiguous bytes of a row (one 128-bit access when the row strides and ``n``
allow; the halves of one projection's output, row stride 2n, do) and a step loads all its
rows before computing, so each thread keeps ``_BYTES_PER_THREAD_STEP`` bytes in flight.
``a`` and ``b`` are read through their row strides: no copy of a strided view.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dtypes import compute_dtype
from ..outputs import empty_output
from . import cdiv, next_power_of_2, sm_count
from .runtime_table import run

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
_TWO_K = 2.0 * math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


@triton.jit
def _gate(a, ACT: tl.constexpr, IS_FP64: tl.constexpr):
    """``(s, a_lo, a_c)``: s = σ(h(a_c)); a_lo = a with values below −T set to −T (−inf
    included: act(−inf) = s·(−T) = 0); a_c = a_lo clamped above at T too."""
    if ACT == 0:
        if IS_FP64:
            T = 710.0
        else:
            T = 89.0
    else:
        if IS_FP64:
            T = 21.5
        else:
            T = 10.125
    a_lo = tl.where(a < -T, -T, a)
    a_c = tl.where(a_lo > T, T, a_lo)
    if ACT == 0:
        h = a_c
    else:
        h = a_c * (1.5957691216057308 + 0.07135481627260025 * a_c * a_c)  # 2k(a + c a³)
    s = 1.0 / (1.0 + tl.exp(-h))
    return s, a_lo, a_c


@triton.jit
def _gate_slope(a_c, ACT: tl.constexpr):
    """h'(a_c)."""
    if ACT == 0:
        return tl.full(a_c.shape, 1.0, a_c.dtype)
    else:
        return 1.5957691216057308 + 0.21406444881780074 * a_c * a_c  # 2k(1 + 3c a²)


@triton.jit
def _tile(tile, col_tiles, rows, n, ROWS_PER_STEP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows (int64), columns and mask of one tile."""
    row = (tile // col_tiles) * ROWS_PER_STEP + tl.arange(0, ROWS_PER_STEP).to(tl.int64)
    col = (tile % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (row < rows)[:, None] & (col < n)[None, :]
    return row[:, None], col[None, :], mask


@triton.jit
def _glu_fwd_kernel(
    a_ptr,            # (rows, n) a, row stride stride_a, columns contiguous
    b_ptr,            # (rows, n) b, row stride stride_b
    y_ptr,            # (rows, n) output, contiguous, dtype of a
    rows, n, stride_a, stride_b,
    ROWS_PER_STEP: tl.constexpr,  # rows per tile, all loaded before the first use
    BLOCK_N: tl.constexpr,        # columns per tile (a power of two)
    ACT: tl.constexpr,            # 0 SiLU, 1 GELU_tanh
    IS_FP64: tl.constexpr,        # accumulation dtype float64 (else float32)
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    col_tiles = tl.cdiv(n, BLOCK_N)
    acc_ty = tl.float64 if IS_FP64 else tl.float32
    for tile in range(pid, tl.cdiv(rows, ROWS_PER_STEP) * col_tiles, programs):
        row, col, mask = _tile(tile, col_tiles, rows, n, ROWS_PER_STEP, BLOCK_N)
        a = tl.load(a_ptr + row * stride_a + col, mask=mask, other=0.0).to(acc_ty)
        b = tl.load(b_ptr + row * stride_b + col, mask=mask, other=0.0).to(acc_ty)
        s, a_lo, _ = _gate(a, ACT, IS_FP64)
        tl.store(y_ptr + row * n + col, (s * a_lo * b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    g_ptr,            # (rows, n) ∂L/∂y, row stride stride_g
    a_ptr,            # (rows, n) a, row stride stride_a
    b_ptr,            # (rows, n) b, row stride stride_b
    da_ptr,           # (rows, n) ∂L/∂a, row stride stride_d
    db_ptr,           # (rows, n) ∂L/∂b, row stride stride_d (the packed form: da_ptr + n)
    rows, n, stride_g, stride_a, stride_b, stride_d,
    ROWS_PER_STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT: tl.constexpr,
    IS_FP64: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    col_tiles = tl.cdiv(n, BLOCK_N)
    acc_ty = tl.float64 if IS_FP64 else tl.float32
    for tile in range(pid, tl.cdiv(rows, ROWS_PER_STEP) * col_tiles, programs):
        row, col, mask = _tile(tile, col_tiles, rows, n, ROWS_PER_STEP, BLOCK_N)
        g = tl.load(g_ptr + row * stride_g + col, mask=mask, other=0.0).to(acc_ty)
        a = tl.load(a_ptr + row * stride_a + col, mask=mask, other=0.0).to(acc_ty)
        b = tl.load(b_ptr + row * stride_b + col, mask=mask, other=0.0).to(acc_ty)
        s, a_lo, a_c = _gate(a, ACT, IS_FP64)
        dact = s + a_c * s * (1.0 - s) * _gate_slope(a_c, ACT)
        tl.store(da_ptr + row * stride_d + col, (g * b * dact).to(da_ptr.dtype.element_ty), mask=mask)
        tl.store(db_ptr + row * stride_d + col, (g * (s * a_lo)).to(db_ptr.dtype.element_ty), mask=mask)


# Bytes a thread loads from each row of each operand per step: one 128-bit access.
_BYTES_PER_THREAD_ROW = 16
# Bytes a thread keeps in flight per step (all operands, all rows of the tile).
_BYTES_PER_THREAD_STEP = 64
# Persistent programs per SM: elementwise, few registers; 8 programs of 4 warps keep the
# forward's 64 B per thread × 1024 threads in flight per SM.
_PROGRAMS_PER_SM = 8
_MAX_WARPS = 4


@dataclass(frozen=True)
class LaunchConfig:
    """How a launcher runs one kernel: constexprs, warps and the persistent grid."""

    block_n: int
    rows_per_step: int
    num_warps: int
    programs: int


@functools.lru_cache(maxsize=4096)  # a launch plan per shape, dtype size and GPU: computed once
def _launch_config(rows: int, n: int, element_size: int, loads: int, sms: int | None) -> LaunchConfig:
    """The launch for ``rows`` rows of ``n`` elements (``element_size`` bytes) reading
    ``loads`` operands per element (2 forward, 3 backward). ``sms``: the GPU's SM count;
    None for the interpreter (same tiles, at most four programs)."""
    per_thread = max(1, _BYTES_PER_THREAD_ROW // element_size)
    block_n = min(next_power_of_2(max(n, 1)), per_thread * 32 * _MAX_WARPS)
    num_warps = max(1, min(_MAX_WARPS, block_n // (32 * per_thread)))
    rows_per_step = max(1, _BYTES_PER_THREAD_STEP // (_BYTES_PER_THREAD_ROW * loads))
    tiles = cdiv(rows, rows_per_step) * cdiv(n, block_n)
    programs = max(1, min(4, tiles) if sms is None else min(tiles, sms * _PROGRAMS_PER_SM))
    return LaunchConfig(block_n, rows_per_step, num_warps, programs)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``(rows, n)`` with unit column stride: a view when its leading dimensions
    fold into one row stride (the halves of a projection's output do), else a copy."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, n)


def _operands(a: torch.Tensor, b: torch.Tensor | None):
    """``(a rows, b rows, n)``; for the packed form (b None) the halves of a's rows."""
    width = a.shape[-1]
    if b is not None:
        return _rows(a, width), _rows(b, width), width
    n = width // 2
    u = _rows(a, width)
    return u[:, :n], u[:, n:], n


def glu_fwd(a: torch.Tensor, b: torch.Tensor | None, activation: str) -> torch.Tensor:
    """Launch the forward; returns ``y`` (contiguous, ``(..., n)``)."""
    shape = a.shape if b is not None else (*a.shape[:-1], a.shape[-1] // 2)
    y = empty_output(shape, dtype=a.dtype, device=a.device)
    if y.numel() == 0:
        return y
    a_rows, b_rows, n = _operands(a, b)
    rows = a_rows.shape[0]
    cfg = _launch_config(rows, n, a.element_size(), 2, sm_count(a.device))
    run(_glu_fwd_kernel, cfg.programs,
        a_rows, b_rows, y, rows, n, a_rows.stride(0), b_rows.stride(0),
        ROWS_PER_STEP=cfg.rows_per_step, BLOCK_N=cfg.block_n, ACT=ACTIVATIONS[activation],
        IS_FP64=compute_dtype(a.dtype) == torch.float64, num_warps=cfg.num_warps)
    return y


def glu_bwd(grad_y: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, activation: str
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward; returns ``(grad_a, grad_b)``, contiguous; for the packed form
    ``(one (..., 2n) gradient [∂a | ∂b], None)``."""
    grad_a = empty_output(a.shape, dtype=a.dtype, device=a.device)
    grad_b = None if b is None else empty_output(a.shape, dtype=a.dtype, device=a.device)
    if grad_y.numel() == 0:
        return grad_a, grad_b
    a_rows, b_rows, n = _operands(a, b)
    rows = a_rows.shape[0]
    g = _rows(grad_y, n)
    da = grad_a.view(rows, a.shape[-1])
    da, db = (da, grad_b.view(rows, n)) if b is not None else (da[:, :n], da[:, n:])
    cfg = _launch_config(rows, n, a.element_size(), 3, sm_count(a.device))
    run(_glu_bwd_kernel, cfg.programs,
        g, a_rows, b_rows, da, db, rows, n, g.stride(0), a_rows.stride(0), b_rows.stride(0), da.stride(0),
        ROWS_PER_STEP=cfg.rows_per_step, BLOCK_N=cfg.block_n, ACT=ACTIVATIONS[activation],
        IS_FP64=compute_dtype(a.dtype) == torch.float64, num_warps=cfg.num_warps)
    return grad_a, grad_b


def aot_launches(sms: int):
    """Every launch of the two kernels at the GPU test and bench shapes, on a GPU with ``sms``
    SMs (see ``wiola_kernels/triton/aot.py``). Row strides are those the launchers pass:
    ``n`` for separate tensors, ``2n`` for the halves of one (the bench: one projection's
    output)."""
    from ..shapes import GLU_BENCH, GLU_GPU_TESTS, GPU_BENCH_DTYPE
    from .aot import DEFAULT_NUM_STAGES, DevicePointer as P, Launch

    cases = [(f"test glu ({rows}, {n}) packed={packed} {dtype}", rows, n, packed, dtype, act)
             for rows, n, packed, dtype in GLU_GPU_TESTS for act in ACTIVATIONS]
    cases += [(f"bench {size} glu ({tokens}, {n}) {act} {GPU_BENCH_DTYPE}", tokens, n, True, GPU_BENCH_DTYPE, act)
              for size, streams in GLU_BENCH.items() for tokens, n, act in streams]
    for case, rows, n, packed, dtype, act in cases:
        acc64 = compute_dtype(dtype) == torch.float64
        element_size = torch.empty((), dtype=dtype).element_size()
        stride = 2 * n if packed else n
        # The packed form's b (and db) is the second half of a row: n elements in.
        half = P(dtype, n * element_size) if packed else P(dtype)
        fwd = _launch_config(rows, n, element_size, 2, sms)
        yield Launch(_glu_fwd_kernel, (P(dtype), half, P(dtype), rows, n, stride, stride),
                     dict(ROWS_PER_STEP=fwd.rows_per_step, BLOCK_N=fwd.block_n, ACT=ACTIVATIONS[act], IS_FP64=acc64),
                     fwd.num_warps, DEFAULT_NUM_STAGES, fwd.programs, case)
        bwd = _launch_config(rows, n, element_size, 3, sms)
        yield Launch(_glu_bwd_kernel, (P(dtype), P(dtype), half, P(dtype), half, rows, n, n, stride, stride, stride),
                     dict(ROWS_PER_STEP=bwd.rows_per_step, BLOCK_N=bwd.block_n, ACT=ACTIVATIONS[act], IS_FP64=acc64),
                     bwd.num_warps, DEFAULT_NUM_STAGES, bwd.programs, case)
