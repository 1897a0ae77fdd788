"""WiolaRMSNorm Triton kernels (SPEC §3).

Forward: each row is loaded once, shifted by δ, its mean square reduced in float32,
and ``γ z / r`` written in the input dtype.
``rstd = 1/r`` is stored per row for the backward. A finite row whose Σz² overflows
is rescaled in registers by an exact power of two ``s = 2^(2−e)`` (``max|z| = f·2^e``,
f ∈ [½, 1)), as in the reference; other rows take the plain path (a runtime branch on
the one overflow flag).

Backward, per row with ``z = x + δ``, ``g = ∂L/∂y`` and ``ẑ = z·rstd`` (|ẑ| ≤ √d,
so nothing grows with |z|):

    c      = Σ_k γ_k g_k ẑ_k / d
    ∂L/∂x  = rstd (γ g − c ẑ)               (= ∂L/∂z)
    ∂L/∂γ += g ẑ,         ∂L/∂δ += ∂L/∂z    (summed over rows)

The column sums are done in two stages: each program accumulates its rows into a
float32 partial of shape (d,), stored in a (programs, d) buffer, and one more kernel
(``_norm_partials_sum_kernel``) sums the partials of ∂L/∂γ and ∂L/∂δ over programs and
writes both in γ's and δ's own dtypes. No atomics, so the result is deterministic (the
number of programs depends only on the shape and the GPU).

γ and δ are read in their stored dtypes and converted in registers, so a launch never
waits on a cast or a copy: the forward is one launch and the backward two, whatever the
dtypes (docs/ops.md, *Launches on CUDA*).

Launch (``_launch_config``, also what ``aot_launches`` compiles ahead of time): a
persistent grid, each program walking tiles of ``ROWS_PER_STEP`` whole rows. A thread
holds 16 contiguous bytes of a row (one 128-bit access when ``d`` allows), and a step
issues the loads of all its rows before the first reduction, so each program keeps
``ROWS_PER_STEP`` rows in flight: at the bench shape (bf16, d = 1024) four rows, 8 KB,
times the 4 resident programs per SM: 32 KB (``python -m wiola_kernels gpu-report``).
Loop bounds are runtime values, so one compiled kernel serves every row count.

Options for Hugging Face models, as ``constexpr`` flags of the same kernels:
``HAS_SHIFT = False`` (δ = 0: no load or add of δ, no ∂L/∂δ partials) and ``HF_ORDER``
(LlamaRMSNorm's rounding: ``n = z·rstd`` rounded to the input dtype, then ``y = γ·n``;
the product of two bf16/fp16 numbers is exact in float32, so bf16/fp16 outputs match
HF's).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..outputs import empty_output
from ..dtypes import compute_dtype
from . import cdiv, next_power_of_2, sm_count
from .runtime_table import run


@triton.jit
def _overflow_scale(ss, m, IS_FP64: tl.constexpr):
    """Per row: ``s = 2^(2−e)`` where ``Σz² = ss`` overflowed but ``max|z| = m = f·2^e`` is
    finite (``m·s ∈ [2, 4)``), else 1. Built from m's biased exponent B as the float with
    exponent field 2·bias+1−B: normal, and exact to multiply by."""
    if IS_FP64:
        biased = (m.to(tl.int64, bitcast=True) >> 52) & 0x7FF
        pow2 = ((2047 - biased) << 52).to(tl.float64, bitcast=True)
    else:
        biased = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
        pow2 = ((255 - biased) << 23).to(tl.float32, bitcast=True)
    return tl.where((ss == float("inf")) & (m < float("inf")), pow2, 1.0)


@triton.jit
def _load_shift(s_ptr, idx, mask, acc_ptr, HAS_SHIFT: tl.constexpr):
    """δ at ``idx`` (read in its stored dtype) in the accumulation dtype (``acc_ptr``'s element
    type), or zeros (folded away) when the norm has no shift."""
    if HAS_SHIFT:
        return tl.load(s_ptr + idx, mask=mask, other=0.0).to(acc_ptr.dtype.element_ty)
    else:
        return (idx * 0).to(acc_ptr.dtype.element_ty)


@triton.jit
def _load_input(x_ptr, r_ptr, sum_ptr, offs, mask, acc_ptr, HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr):
    """The rows the norm reads, in the accumulation dtype (``acc_ptr``'s element type): x;
    or (add_rms_norm) the sum ``x + residual`` rounded once to x's dtype — stored to
    ``sum_ptr`` when ``STORE_SUM``."""
    acc_ty = acc_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(acc_ty) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(acc_ty)).to(x_ptr.dtype.element_ty)
        if STORE_SUM:
            tl.store(sum_ptr + offs, x, mask=mask)
    return x.to(acc_ty)


@triton.jit
def _load_z_chunk(x_ptr, s_ptr, row, row_mask, cols, c0, d, acc_ptr, HAS_SHIFT: tl.constexpr):
    """``z = x + δ`` of the rows ``row`` at columns ``c0 + cols`` (0 where masked), in the
    accumulation dtype (``acc_ptr``'s element type)."""
    mask = row_mask[:, None] & (c0 + cols < d)[None, :]
    offs = row[:, None] * d + (c0 + cols)[None, :]
    sc = _load_shift(s_ptr, c0 + cols, c0 + cols < d, acc_ptr, HAS_SHIFT)[None, :]
    return tl.where(mask, tl.load(x_ptr + offs, mask=mask, other=0.0).to(acc_ptr.dtype.element_ty) + sc, 0.0)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,        # (rows, d) input, contiguous
    r_ptr,        # (rows, d) residual, contiguous (add_rms_norm; else not read)
    sum_ptr,      # (rows, d) output s = x + residual, dtype of x (add_rms_norm; else not written)
    w_ptr,        # (d,) γ in its stored dtype (converted on load: no per-call cast)
    s_ptr,        # (d,) δ in its stored dtype (not read without HAS_SHIFT)
    y_ptr,        # (rows, d) output, dtype of x
    rstd_ptr,     # (rows,) 1/r in the accumulation dtype (float32, float64 for float64 x): sets it
    rows, d, eps,
    ROWS_PER_STEP: tl.constexpr,  # rows per tile, all loaded before the first reduction
    BLOCK_D: tl.constexpr,        # next power of two >= d (a whole row per tile), or the chunk width (WIDE)
    IS_FP64: tl.constexpr,        # accumulation dtype float64 (else float32)
    WIDE: tl.constexpr,           # rows too wide for registers: walk them in BLOCK_D chunks, twice
    HAS_SHIFT: tl.constexpr,      # δ given (else δ = 0 and s_ptr is not read)
    HF_ORDER: tl.constexpr,       # y = γ·round(z·rstd) (Hugging Face) instead of round(γ·z·rstd)
    HAS_RESIDUAL: tl.constexpr,   # add_rms_norm: normalise s = x + residual (rounded to x's dtype), store s
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    acc_ty = rstd_ptr.dtype.element_ty
    if not WIDE:
        col_mask = cols < d
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(acc_ty)[None, :]
        s = _load_shift(s_ptr, cols, col_mask, rstd_ptr, HAS_SHIFT)[None, :]
    for first in range(pid * ROWS_PER_STEP, rows, programs * ROWS_PER_STEP):
        row = tl.arange(0, ROWS_PER_STEP).to(tl.int64) + first  # int64: rows * d can pass 2^31
        row_mask = row < rows
        if WIDE:
            if HAS_RESIDUAL:  # the sum first; the passes below read it back (from L2) as they read x
                for c0 in range(0, d, BLOCK_D):
                    mask = row_mask[:, None] & (c0 + cols < d)[None, :]
                    _load_input(x_ptr, r_ptr, sum_ptr, row[:, None] * d + (c0 + cols)[None, :], mask, rstd_ptr,
                                True, True)
                tl.debug_barrier()  # another thread may read an element this one wrote
                in_ptr = sum_ptr
            else:
                in_ptr = x_ptr
            # Pass 1: Σz², kept per column (per thread) and reduced across the block once
            # after the loop rather than per chunk (one barrier, not one per chunk).
            ss_cols = tl.zeros((ROWS_PER_STEP, BLOCK_D), acc_ty)
            for c0 in range(0, d, BLOCK_D):
                z = _load_z_chunk(in_ptr, s_ptr, row, row_mask, cols, c0, d, rstd_ptr, HAS_SHIFT)
                ss_cols += z * z
            ss = tl.sum(ss_cols, axis=1)
            scale = tl.full((ROWS_PER_STEP,), 1.0, acc_ty)
            if tl.max(ss, axis=0) == float("inf"):  # rare: max|z|, then Σ(s·z)² for the rescaled rows
                m_cols = tl.zeros((ROWS_PER_STEP, BLOCK_D), acc_ty)
                for c0 in range(0, d, BLOCK_D):
                    z = _load_z_chunk(in_ptr, s_ptr, row, row_mask, cols, c0, d, rstd_ptr, HAS_SHIFT)
                    m_cols = tl.maximum(m_cols, tl.abs(z))
                scale = _overflow_scale(ss, tl.max(m_cols, axis=1), IS_FP64)
                ss_cols = tl.zeros((ROWS_PER_STEP, BLOCK_D), acc_ty)
                for c0 in range(0, d, BLOCK_D):
                    z = _load_z_chunk(in_ptr, s_ptr, row, row_mask, cols, c0, d, rstd_ptr, HAS_SHIFT)
                    z = z * scale[:, None]
                    ss_cols += z * z
                ss = tl.where(scale != 1.0, tl.sum(ss_cols, axis=1), ss)
            rstd_s = 1.0 / tl.sqrt(ss / d + eps * scale * scale)
            tl.store(rstd_ptr + row, rstd_s * scale, mask=row_mask)
            for c0 in range(0, d, BLOCK_D):  # pass 2 (the row is in L1/L2 now): y
                mask = row_mask[:, None] & (c0 + cols < d)[None, :]
                offs = row[:, None] * d + (c0 + cols)[None, :]
                wc = tl.load(w_ptr + c0 + cols, mask=c0 + cols < d, other=0.0).to(acc_ty)[None, :]
                sc = _load_shift(s_ptr, c0 + cols, c0 + cols < d, rstd_ptr, HAS_SHIFT)[None, :]
                z = tl.load(in_ptr + offs, mask=mask, other=0.0).to(acc_ty) + sc
                n = (z * scale[:, None]) * rstd_s[:, None]
                if HF_ORDER:
                    n = n.to(y_ptr.dtype.element_ty).to(acc_ty)
                tl.store(y_ptr + offs, (wc * n).to(y_ptr.dtype.element_ty), mask=mask)
        else:
            mask = row_mask[:, None] & col_mask[None, :]
            offs = row[:, None] * d + cols[None, :]
            z = tl.where(mask, _load_input(x_ptr, r_ptr, sum_ptr, offs, mask, rstd_ptr, HAS_RESIDUAL, True) + s,
                         0.0)
            ss = tl.sum(z * z, axis=1)
            scale = tl.full((ROWS_PER_STEP,), 1.0, acc_ty)
            if tl.max(ss, axis=0) == float("inf"):  # no NaN in z; rare, so a branch rather than a select
                scale = _overflow_scale(ss, tl.max(tl.abs(z), axis=1), IS_FP64)
                z = z * scale[:, None]  # exact: a power of two
                ss = tl.where(scale != 1.0, tl.sum(z * z, axis=1), ss)
            # ε·s² may underflow to 0: ε is negligible for rescaled rows.
            rstd_s = 1.0 / tl.sqrt(ss / d + eps * scale * scale)
            if HF_ORDER:
                y = w * (z * rstd_s[:, None]).to(y_ptr.dtype.element_ty).to(acc_ty)
            else:
                y = w * z * rstd_s[:, None]
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(rstd_ptr + row, rstd_s * scale, mask=row_mask)  # subnormal once r > 2^126 (fp32): ≥ 21 bits


@triton.jit
def _add_grad_s(dz, gs_ptr, offs, mask, HAS_GRAD_S: tl.constexpr):
    """``dz + ∂L/∂s`` (add_rms_norm's ∂L/∂x) or dz."""
    if HAS_GRAD_S:
        return dz + tl.load(gs_ptr + offs, mask=mask, other=0.0).to(dz.dtype)
    else:
        return dz


@triton.jit
def _rms_norm_bwd_kernel(
    g_ptr,        # (rows, d) ∂L/∂y, contiguous
    gs_ptr,       # (rows, d) add_rms_norm's ∂L/∂s, added to ∂L/∂x (HAS_GRAD_S; else not read)
    x_ptr,        # (rows, d) input (add_rms_norm: s)
    w_ptr,        # (d,) γ in its stored dtype (converted on load)
    s_ptr,        # (d,) δ in its stored dtype (not read without HAS_SHIFT)
    rstd_ptr,     # (rows,) saved 1/r, accumulation dtype: sets it
    dx_ptr,       # (rows, d) ∂L/∂x, dtype of x
    dw_partial_ptr,  # (programs, d) per-program partial of ∂L/∂γ, accumulation dtype
    ds_partial_ptr,  # (programs, d) per-program partial of ∂L/∂δ, accumulation dtype
    rows, d,
    ROWS_PER_STEP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDE: tl.constexpr,  # rows too wide for registers: two passes over BLOCK_D chunks, and the
                         # partials accumulate in their own (L2-resident) rows
    HAS_SHIFT: tl.constexpr,  # δ given (else δ = 0: s_ptr and ds_partial_ptr are not touched)
    HAS_GRAD_S: tl.constexpr,  # add ∂L/∂s to ∂L/∂x (summed in the accumulation dtype, rounded once)
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    acc_ty = rstd_ptr.dtype.element_ty
    part = pid.to(tl.int64) * d  # this program's row of the (programs, d) partials
    if WIDE:
        for c0 in range(0, d, BLOCK_D):
            tl.store(dw_partial_ptr + part + c0 + cols, tl.zeros((BLOCK_D,), acc_ty), mask=c0 + cols < d)
            if HAS_SHIFT:
                tl.store(ds_partial_ptr + part + c0 + cols, tl.zeros((BLOCK_D,), acc_ty), mask=c0 + cols < d)
    else:
        col_mask = cols < d
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(acc_ty)[None, :]
        s = _load_shift(s_ptr, cols, col_mask, rstd_ptr, HAS_SHIFT)[None, :]
        dw_acc = tl.zeros((BLOCK_D,), acc_ty)
        ds_acc = tl.zeros((BLOCK_D,), acc_ty)
    for first in range(pid * ROWS_PER_STEP, rows, programs * ROWS_PER_STEP):
        row = tl.arange(0, ROWS_PER_STEP).to(tl.int64) + first  # int64: rows * d can pass 2^31
        row_mask = row < rows
        rstd = tl.load(rstd_ptr + row, mask=row_mask, other=0.0)[:, None]
        if WIDE:
            c = tl.zeros((ROWS_PER_STEP,), acc_ty)
            for c0 in range(0, d, BLOCK_D):  # pass 1: c = Σ γ g ẑ / d
                cm = c0 + cols < d
                mask = row_mask[:, None] & cm[None, :]
                offs = row[:, None] * d + (c0 + cols)[None, :]
                wc = tl.load(w_ptr + c0 + cols, mask=cm, other=0.0).to(acc_ty)[None, :]
                sc = _load_shift(s_ptr, c0 + cols, cm, rstd_ptr, HAS_SHIFT)[None, :]
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(acc_ty)
                g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_ty)
                c += tl.sum(g * wc * (tl.where(mask, x + sc, 0.0) * rstd), axis=1)
            c = c[:, None] / d
            for c0 in range(0, d, BLOCK_D):  # pass 2: ∂L/∂x and the partials
                cm = c0 + cols < d
                mask = row_mask[:, None] & cm[None, :]
                offs = row[:, None] * d + (c0 + cols)[None, :]
                wc = tl.load(w_ptr + c0 + cols, mask=cm, other=0.0).to(acc_ty)[None, :]
                sc = _load_shift(s_ptr, c0 + cols, cm, rstd_ptr, HAS_SHIFT)[None, :]
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(acc_ty)
                g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_ty)
                z_hat = tl.where(mask, x + sc, 0.0) * rstd
                dz = (g * wc - c * z_hat) * rstd
                tl.store(dx_ptr + offs, _add_grad_s(dz, gs_ptr, offs, mask, HAS_GRAD_S).to(dx_ptr.dtype.element_ty),
                         mask=mask)
                dw_row = dw_partial_ptr + part + c0 + cols
                # Each thread re-reads only what it wrote itself.
                tl.store(dw_row, tl.load(dw_row, mask=cm) + tl.sum(g * z_hat, axis=0), mask=cm)
                if HAS_SHIFT:
                    ds_row = ds_partial_ptr + part + c0 + cols
                    tl.store(ds_row, tl.load(ds_row, mask=cm) + tl.sum(dz, axis=0), mask=cm)
        else:
            mask = row_mask[:, None] & col_mask[None, :]
            offs = row[:, None] * d + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(acc_ty)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_ty)
            z_hat = tl.where(mask, x + s, 0.0) * rstd
            gw = g * w
            c = tl.sum(gw * z_hat, axis=1)[:, None] / d
            dz = (gw - c * z_hat) * rstd
            tl.store(dx_ptr + offs, _add_grad_s(dz, gs_ptr, offs, mask, HAS_GRAD_S).to(dx_ptr.dtype.element_ty),
                     mask=mask)
            dw_acc += tl.sum(g * z_hat, axis=0)
            ds_acc += tl.sum(dz, axis=0)
    if not WIDE:
        tl.store(dw_partial_ptr + part + cols, dw_acc, mask=col_mask)
        if HAS_SHIFT:
            tl.store(ds_partial_ptr + part + cols, ds_acc, mask=col_mask)


@triton.jit
def _norm_partials_sum_kernel(
    dw_partial_ptr,  # (programs, d) partials of ∂L/∂γ, accumulation dtype
    ds_partial_ptr,  # (programs, d) partials of ∂L/∂δ (HAS_SHIFT; else not read)
    dw_ptr,          # (d,) ∂L/∂γ, γ's dtype
    ds_ptr,          # (d,) ∂L/∂δ, δ's dtype (HAS_SHIFT; else not written)
    programs, d,
    BLOCK_P: tl.constexpr,  # partial rows summed per step
    BLOCK_D: tl.constexpr,  # columns per program
    HAS_SHIFT: tl.constexpr,
):
    """The backward's second stage: column sums of the (programs, d) partials, in a fixed
    order (deterministic), rounded once to the gradients' dtypes."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < d
    p = tl.arange(0, BLOCK_P)
    # The tile's offsets stay 32-bit (BLOCK_P · d < 2^31) and loop-invariant; the row
    # pointers move in 64 bits. Int64 offsets per element spilled on sm_90 (Triton 3.6).
    tile = p[:, None] * d + cols[None, :]
    acc_ty = dw_partial_ptr.dtype.element_ty
    dw = tl.zeros((BLOCK_P, BLOCK_D), acc_ty)
    ds = tl.zeros((BLOCK_P, BLOCK_D), acc_ty)
    dw_rows = dw_partial_ptr
    ds_rows = ds_partial_ptr
    for p0 in range(0, programs, BLOCK_P):
        mask = (p + p0 < programs)[:, None] & col_mask[None, :]
        dw += tl.load(dw_rows + tile, mask=mask, other=0.0)
        if HAS_SHIFT:
            ds += tl.load(ds_rows + tile, mask=mask, other=0.0)
        dw_rows += BLOCK_P * d
        ds_rows += BLOCK_P * d
    tl.store(dw_ptr + cols, tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    if HAS_SHIFT:
        tl.store(ds_ptr + cols, tl.sum(ds, axis=0).to(ds_ptr.dtype.element_ty), mask=col_mask)


# The partials' column sums: 32 columns (128 B of float32 per partial row) per program,
# 64 partial rows per step (16 loads in flight per thread with 4 warps).
_SUM_BLOCK_D = 32
_SUM_BLOCK_P = 64
_SUM_WARPS = 4


# Bytes a thread loads from each row per step: one 128-bit access.
_BYTES_PER_THREAD_ROW = 16
# Input bytes a thread keeps in flight per step (forward; the backward loads x and g,
# so half as many rows). Four 128-bit loads: with 4 programs of 4 warps per SM at
# d = 1024, 32 KB in flight per SM (Little's law for HBM3e: ~4.8 TB/s · 1 µs / 132).
_BYTES_PER_THREAD_STEP = 64
# Persistent programs per SM: what the registers allow at the bench shape (gpu-report's
# blocks_per_sm), and few enough that the backward's (programs, d) partials stay small.
_PROGRAMS_PER_SM = 4
_MAX_WARPS = 16
# Row bytes per thread beyond which a row does not fit in registers (ptxas spills at
# 64: d = 8193 in fp32 or bf16): such rows are walked in chunks (WIDE).
_MAX_ROW_BYTES_PER_THREAD = 32
# Warps walking a wide row: at 16, ptxas (Triton 3.6) held the forward to 64 registers for two
# 512-thread blocks per SM and spilled; at 8 it needs 48, and all four programs per SM fit.
_MAX_WIDE_WARPS = 8


@dataclass(frozen=True)
class LaunchConfig:
    """How a launcher runs one kernel: constexprs, warps and the persistent grid."""

    block_d: int
    rows_per_step: int
    num_warps: int
    programs: int
    wide: bool  # rows walked in block_d chunks


@functools.lru_cache(maxsize=4096)  # a launch plan per shape, dtype size and GPU: computed once
def _launch_config(rows: int, d: int, element_size: int, loads_per_row: int, sms: int | None) -> LaunchConfig:
    """The launch of either kernel for ``rows`` rows of width ``d`` (``element_size``
    bytes each; ``loads_per_row`` row tensors read per row: 1 forward, 2 backward; with
    add_rms_norm's residual 2 and 3).

    Threads own 16 contiguous bytes of a row; rows per step so that each thread has
    ``_BYTES_PER_THREAD_STEP`` bytes loading. ``sms``: the GPU's SM count (the grid is
    ``_PROGRAMS_PER_SM`` × ``sms``); ``None`` for the interpreter (same tiles, at most
    four programs: each program is slow there)."""
    block_d = next_power_of_2(d)
    per_thread = max(1, _BYTES_PER_THREAD_ROW // element_size)
    num_warps = min(_MAX_WARPS, max(1, block_d // (32 * per_thread)))
    row_bytes_per_thread = max(_BYTES_PER_THREAD_ROW, block_d * element_size // (32 * num_warps))
    wide = row_bytes_per_thread > _MAX_ROW_BYTES_PER_THREAD
    if wide:  # chunks of 16 B per thread per row
        num_warps = min(num_warps, _MAX_WIDE_WARPS)
        block_d = 32 * num_warps * per_thread
        row_bytes_per_thread = _BYTES_PER_THREAD_ROW
    # At least _BYTES_PER_THREAD_STEP: add_rms_norm's backward loads three row tensors, two rows (96 B).
    rows_per_step = max(1, min(16, cdiv(_BYTES_PER_THREAD_STEP, row_bytes_per_thread * loads_per_row)))
    if wide:
        rows_per_step = 1
    steps = cdiv(rows, rows_per_step)
    programs = min(4, steps) if sms is None else min(steps, sms * _PROGRAMS_PER_SM)
    return LaunchConfig(block_d, rows_per_step, num_warps, programs, wide)


def norm_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, shift: torch.Tensor | None,
             eps: float, hf_order: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch the forward on contiguous ``x (rows, d)``; returns ``(y, s, rstd)``. ``weight``
    and ``shift`` are contiguous ``(d,)`` tensors of any float dtype (read as they are).
    ``residual`` (contiguous, x's shape; add_rms_norm): the rows normalised are
    ``s = x + residual`` rounded to x's dtype, also returned (else s is None).
    ``shift=None``: δ = 0; ``hf_order``: Hugging Face's rounding order."""
    rows, d = x.shape
    acc = compute_dtype(x.dtype)
    y = empty_output((rows, d), dtype=x.dtype, device=x.device)
    s = None if residual is None else empty_output((rows, d), dtype=x.dtype, device=x.device)
    rstd = empty_output((rows,), dtype=acc, device=x.device)
    if rows == 0:
        return y, s, rstd
    cfg = _launch_config(rows, d, x.element_size(), 1 if residual is None else 2, sm_count(x.device))
    run(_rms_norm_fwd_kernel, cfg.programs,
        x, x if residual is None else residual, y if s is None else s, weight,
        weight if shift is None else shift, y, rstd, rows, d, eps,
        ROWS_PER_STEP=cfg.rows_per_step, BLOCK_D=cfg.block_d, IS_FP64=acc == torch.float64, WIDE=cfg.wide,
        HAS_SHIFT=shift is not None, HF_ORDER=bool(hf_order), HAS_RESIDUAL=residual is not None,
        num_warps=cfg.num_warps)
    return y, s, rstd


def norm_bwd(grad_y, grad_s, x, weight, shift, rstd):
    """Launch the backward on contiguous rows (two launches: the rows, then the column sums of
    the partials); returns ``(grad_x, grad_weight, grad_shift)`` in the dtypes of ``x``,
    ``weight`` and ``shift`` (``grad_shift`` None when ``shift`` is). ``grad_s`` (add_rms_norm; ``x`` is then s) is
    added to ``grad_x``; None: nothing added."""
    rows, d = x.shape
    grad_x = empty_output((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0:
        return grad_x, torch.zeros_like(weight), None if shift is None else torch.zeros_like(shift)
    cfg = _launch_config(rows, d, x.element_size(), 2 if grad_s is None else 3, sm_count(x.device))
    # One allocation for both partials (rstd's dtype is the accumulation dtype); δ's starts at a
    # 16-byte boundary, as the compiled variants assume of every pointer.
    size = cfg.programs * d
    stride = cdiv(size, 4) * 4
    partials = empty_output((stride + size if shift is not None else size,), dtype=rstd.dtype, device=x.device)
    dw_partial, ds_partial = partials[:size], partials[stride:] if shift is not None else partials
    run(_rms_norm_bwd_kernel, cfg.programs,
        grad_y, grad_y if grad_s is None else grad_s, x, weight, weight if shift is None else shift, rstd,
        grad_x, dw_partial, ds_partial, rows, d, ROWS_PER_STEP=cfg.rows_per_step, BLOCK_D=cfg.block_d, WIDE=cfg.wide,
        HAS_SHIFT=shift is not None, HAS_GRAD_S=grad_s is not None, num_warps=cfg.num_warps)
    grad_weight = empty_output((d,), dtype=weight.dtype, device=x.device)
    grad_shift = None if shift is None else empty_output((d,), dtype=shift.dtype, device=x.device)
    run(_norm_partials_sum_kernel, cdiv(d, _SUM_BLOCK_D),
        dw_partial, ds_partial, grad_weight, grad_weight if grad_shift is None else grad_shift, cfg.programs, d,
        BLOCK_P=_SUM_BLOCK_P, BLOCK_D=_SUM_BLOCK_D, HAS_SHIFT=shift is not None, num_warps=_SUM_WARPS)
    return grad_x, grad_weight, grad_shift


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor | None,
                 eps: float, hf_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on contiguous ``x (rows, d)``; returns ``(y, rstd)``."""
    y, _, rstd = norm_fwd(x, None, weight, shift, eps, hf_order)
    return y, rstd


def rms_norm_bwd(grad_y, x, weight, shift, rstd):
    """Launch the backward; returns ``(grad_x, grad_weight, grad_shift)``."""
    return norm_bwd(grad_y, None, x, weight, shift, rstd)


def aot_launches(sms: int):
    """Every launch of the forward and backward kernels at the GPU test and bench shapes
    (:mod:`wiola_kernels.shapes`), on a GPU with ``sms`` SMs (see ``wiola_kernels/triton/aot.py``)."""
    from .. import shapes

    cases = [(f"test x {shape} {dtype}", shape, dtype) for shape, dtype in shapes.RMS_NORM_GPU_TESTS]
    cases += [(f"bench {size} x {shape} {shapes.GPU_BENCH_DTYPE}", shape, shapes.GPU_BENCH_DTYPE)
              for size, shape in shapes.RMS_NORM_BENCH.items()]
    for case, shape, dtype in cases:
        yield from norm_launches(case, shape, dtype, sms)
        if case.startswith("bench"):  # the Hugging Face variant (patch_hf): no δ, HF's rounding order
            yield from norm_launches(case + " hf", shape, dtype, sms, shift=False, hf_order=True)


def norm_launches(case: str, shape: tuple, dtype: torch.dtype, sms: int, *, residual: bool = False,
                  shift: bool = True, hf_order: bool = False):
    """The forward and backward launches of one input ``shape`` (rms_norm's, or add_rms_norm's
    with ``residual``: one more row tensor each way) for :mod:`wiola_kernels.triton.aot`."""
    from .aot import DEFAULT_NUM_STAGES, DevicePointer as P, Launch

    rows, d = math.prod(shape[:-1]), shape[-1]
    acc = compute_dtype(dtype)
    element_size = torch.empty((), dtype=dtype).element_size()
    fwd = _launch_config(rows, d, element_size, 1 + residual, sms)
    # γ and δ in x's dtype, as the GPU tests, the bench and the models pass them.
    yield Launch(_rms_norm_fwd_kernel, (P(dtype),) * 6 + (P(acc), rows, d, 1e-6),
                 dict(ROWS_PER_STEP=fwd.rows_per_step, BLOCK_D=fwd.block_d, IS_FP64=acc == torch.float64,
                      WIDE=fwd.wide, HAS_SHIFT=shift, HF_ORDER=hf_order, HAS_RESIDUAL=residual),
                 fwd.num_warps, DEFAULT_NUM_STAGES, fwd.programs, case)
    bwd = _launch_config(rows, d, element_size, 2 + residual, sms)
    yield Launch(_rms_norm_bwd_kernel, (P(dtype),) * 5 + (P(acc), P(dtype), P(acc), P(acc), rows, d),
                 dict(ROWS_PER_STEP=bwd.rows_per_step, BLOCK_D=bwd.block_d, WIDE=bwd.wide, HAS_SHIFT=shift,
                      HAS_GRAD_S=residual),
                 bwd.num_warps, DEFAULT_NUM_STAGES, bwd.programs, case)
    yield Launch(_norm_partials_sum_kernel, (P(acc), P(acc), P(dtype), P(dtype), bwd.programs, d),
                 dict(BLOCK_P=_SUM_BLOCK_P, BLOCK_D=_SUM_BLOCK_D, HAS_SHIFT=shift),
                 _SUM_WARPS, DEFAULT_NUM_STAGES, cdiv(d, _SUM_BLOCK_D), case, memory_bound=False)
