"""WiolaRMSNorm Triton kernels (SPEC §3).

Forward: one program per block of rows; each row is loaded once, shifted by δ,
its mean square reduced in float32, and ``γ z / r`` written in the input dtype.
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
float32 partial of shape (d,), stored in a (programs, d) buffer, and one ``.sum(0)``
reduces the partials. No atomics, so the result is deterministic.

Options for Hugging Face models, as ``constexpr`` flags of the same kernels:
``HAS_SHIFT = False`` (δ = 0: no load or add of δ, no ∂L/∂δ partials) and ``HF_ORDER``
(LlamaRMSNorm's rounding: ``n = z·rstd`` rounded to the input dtype, then ``y = γ·n``;
the product of two bf16/fp16 numbers is exact in float32, so bf16/fp16 outputs match
HF's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops._common import empty_output
from ..reference.rms_norm import compute_dtype


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,        # (rows, d) input, contiguous
    w_ptr,        # (d,) γ in the accumulation dtype
    s_ptr,        # (d,) δ in the accumulation dtype (not read without HAS_SHIFT)
    y_ptr,        # (rows, d) output, dtype of x
    rstd_ptr,     # (rows,) 1/r in the accumulation dtype
    rows, d, eps,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_D: tl.constexpr,       # next power of two >= d: a whole row per tile
    IS_FP64: tl.constexpr,       # accumulation dtype float64 (else float32)
    HAS_SHIFT: tl.constexpr = True,  # δ given (else δ = 0)
    HF_ORDER: tl.constexpr = False,  # y = γ·round(z·rstd) (HF) instead of round(γ·z·rstd)
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < d
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
    for i in range(ROWS_PER_PROGRAM):
        row = pid.to(tl.int64) * ROWS_PER_PROGRAM + i  # int64: rows * d can pass 2^31
        if row < rows:
            x = tl.load(x_ptr + row * d + cols, mask=col_mask, other=0.0).to(w.dtype)
            if HAS_SHIFT:
                z = tl.where(col_mask, x + tl.load(s_ptr + cols, mask=col_mask, other=0.0), 0.0)
            else:
                z = x  # masked columns loaded as 0
            ss = tl.sum(z * z, axis=0)
            scale = tl.full((), 1.0, w.dtype)
            if ss == float("inf"):  # no NaN in z; rare, so a branch rather than a select
                m = tl.max(tl.abs(z), axis=0)
                # A finite row (m normal here) gets s = 2^(2−e), built from m's biased
                # exponent B as the float with exponent field 2·bias+1−B: normal, m·s in [2, 4).
                if IS_FP64:
                    biased = (m.to(tl.int64, bitcast=True) >> 52) & 0x7FF
                    pow2 = ((2047 - biased) << 52).to(tl.float64, bitcast=True)
                else:
                    biased = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
                    pow2 = ((255 - biased) << 23).to(tl.float32, bitcast=True)
                if m < float("inf"):
                    scale = pow2
                    z = z * scale  # exact: a power of two
                    ss = tl.sum(z * z, axis=0)
            # ε·s² may underflow to 0: ε is negligible for rescaled rows.
            rstd_s = 1.0 / tl.sqrt(ss / d + eps * scale * scale)
            if HF_ORDER:
                y = w * (z * rstd_s).to(y_ptr.dtype.element_ty).to(w.dtype)
            else:
                y = w * z * rstd_s
            tl.store(y_ptr + row * d + cols, y.to(y_ptr.dtype.element_ty), mask=col_mask)
            tl.store(rstd_ptr + row, rstd_s * scale)  # subnormal once r > 2^126 (fp32): ≥ 21 bits


@triton.jit
def _rms_norm_bwd_kernel(
    g_ptr,        # (rows, d) ∂L/∂y, contiguous
    x_ptr,        # (rows, d) input
    w_ptr,        # (d,) γ, accumulation dtype
    s_ptr,        # (d,) δ, accumulation dtype (not read without HAS_SHIFT)
    rstd_ptr,     # (rows,) saved 1/r
    dx_ptr,       # (rows, d) ∂L/∂x, dtype of x
    dw_partial_ptr,  # (programs, d) per-program partial of ∂L/∂γ
    ds_partial_ptr,  # (programs, d) per-program partial of ∂L/∂δ (not written without HAS_SHIFT)
    rows, d,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SHIFT: tl.constexpr = True,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < d
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
    if HAS_SHIFT:
        s = tl.load(s_ptr + cols, mask=col_mask, other=0.0)
    else:
        s = tl.zeros((BLOCK_D,), dtype=w.dtype)
    dw_acc = tl.zeros((BLOCK_D,), dtype=w.dtype)
    ds_acc = tl.zeros((BLOCK_D,), dtype=w.dtype)
    for i in range(ROWS_PER_PROGRAM):
        row = pid.to(tl.int64) * ROWS_PER_PROGRAM + i  # int64: rows * d can pass 2^31
        if row < rows:
            x = tl.load(x_ptr + row * d + cols, mask=col_mask, other=0.0).to(w.dtype)
            g = tl.load(g_ptr + row * d + cols, mask=col_mask, other=0.0).to(w.dtype)
            rstd = tl.load(rstd_ptr + row)
            z_hat = tl.where(col_mask, x + s, 0.0) * rstd
            gw = g * w
            c = tl.sum(gw * z_hat, axis=0) / d
            dz = (gw - c * z_hat) * rstd
            tl.store(dx_ptr + row * d + cols, dz.to(dx_ptr.dtype.element_ty), mask=col_mask)
            dw_acc += g * z_hat
            ds_acc += dz
    tl.store(dw_partial_ptr + pid * d + cols, dw_acc, mask=col_mask)
    if HAS_SHIFT:
        tl.store(ds_partial_ptr + pid * d + cols, ds_acc, mask=col_mask)


def _launch_config(rows: int, d: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS_PER_PROGRAM, programs): a whole row per tile; on the GPU about
    4 programs per SM, in the interpreter few programs (each launch is slow there)."""
    block_d = triton.next_power_of_2(d)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        target = 4 * sms
    else:
        target = 4
    rows_per_program = max(1, triton.cdiv(rows, target))
    return block_d, rows_per_program, max(1, triton.cdiv(rows, rows_per_program))


def _num_warps(block_d: int) -> int:
    return min(16, max(1, block_d // 256))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor | None,
                     eps: float, hf_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on contiguous ``x (rows, d)``; returns ``(y, rstd)``.
    ``shift=None``: δ = 0; ``hf_order``: Hugging Face's rounding order."""
    rows, d = x.shape
    acc = compute_dtype(x.dtype)
    y = empty_output((rows, d), dtype=x.dtype, device=x.device)
    rstd = empty_output((rows,), dtype=acc, device=x.device)
    if rows == 0:
        return y, rstd
    block_d, per_program, programs = _launch_config(rows, d, x.device)
    w = weight.to(acc).contiguous()
    _rms_norm_fwd_kernel[(programs,)](
        x, w, w if shift is None else shift.to(acc).contiguous(), y, rstd, rows, d, eps,
        ROWS_PER_PROGRAM=per_program, BLOCK_D=block_d, IS_FP64=acc == torch.float64,
        HAS_SHIFT=shift is not None, HF_ORDER=bool(hf_order),
        num_warps=_num_warps(block_d))
    return y, rstd


def rms_norm_backward(grad_y, x, weight, shift, rstd):
    """Launch the backward; returns ``(grad_x, grad_weight, grad_shift)`` (``grad_shift``
    None when ``shift`` is)."""
    rows, d = x.shape
    acc = compute_dtype(x.dtype)
    grad_x = empty_output((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0:
        return grad_x, torch.zeros_like(weight), None if shift is None else torch.zeros_like(shift)
    block_d, per_program, programs = _launch_config(rows, d, x.device)
    dw_partial = empty_output((programs, d), dtype=acc, device=x.device)
    ds_partial = dw_partial if shift is None else empty_output((programs, d), dtype=acc, device=x.device)
    w = weight.to(acc).contiguous()
    _rms_norm_bwd_kernel[(programs,)](
        grad_y, x, w, w if shift is None else shift.to(acc).contiguous(), rstd, grad_x, dw_partial, ds_partial,
        rows, d, ROWS_PER_PROGRAM=per_program, BLOCK_D=block_d, HAS_SHIFT=shift is not None,
        num_warps=_num_warps(block_d))
    grad_shift = None if shift is None else ds_partial.sum(0).to(shift.dtype)
    return grad_x, dw_partial.sum(0).to(weight.dtype), grad_shift
