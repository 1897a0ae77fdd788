"""Linear cross-entropy as Triton kernels (SPEC §10.1), the CUDA kernels of the op.

Notation as in ``reference/linear_cross_entropy.py``: ``s = h Wᵀ`` (softcapped), ``lse``,
``ℓ``, and the row gradient ``dz = g·[(1 + 2ζ·lse)·softmax(s) − (1−ε)·onehot(y) − ε/V]``,
times ``1 − (s/c)²`` under a softcap.

* ``_lce_logits_kernel`` — a tensor-core GEMM tile ``h_rows W_colsᵀ`` (``tl.dot`` over d in
  ``BLOCK_K`` steps, float32 accumulator; float64 for float64) with the online log-sum-exp:
  each program walks ``BLOCK_N``-column tiles of its share of the vocabulary (the grid is row
  blocks × vocabulary splits, so that small row counts still fill the GPU) and writes, per
  row, its split's running max, Σexp, Σs and the target logit. ``STORE_LOGITS``: it also
  stores the (softcapped) float32 logits tile into a chunk buffer, for the gradients.
* ``_lce_rows_kernel`` — per row, the splits combined in order: ``lse`` and ``ℓ`` (0 on an
  ignored row; NaN for a label outside ``[0, V)`` that is not ``ignore_index``: values are not
  read on the host, which would cost a device sync per call).
* ``_lce_dlogits_kernel`` — ``dz`` from the chunk's logits and ``lse``, rounded to the input
  dtype (bf16/fp16: the operand of the gradient GEMMs, as in every bf16 backward).
* ``_lce_dw_kernel`` — bf16/fp16 only: ``∂W += dzᵀ h_chunk`` into a float32 accumulator
  (``tl.dot``; cuBLAS has no bf16 GEMM with a float32 output that accumulates in place).

* ``_lce_reduce_kernel`` — one program: the ``"mean"``/``"sum"`` loss from the row losses,
  and the backward's factor ``grad ÷ n``, the divisor (counted rows, or ``num_items``) read on
  the device: nothing goes through the host, so a call never waits on the GPU and can be
  captured in a CUDA graph.

No ``(N, V)`` tensor exists: the loss alone (no gradients, or ``"none"``'s forward) is one
``_lce_logits_kernel`` launch over all rows with nothing stored. With gradients, rows go in
chunks (``LaunchConfig.chunk``: a float32 logits buffer of at most ``_CHUNK_BYTES`` plus its
``dz`` in the input dtype, one workspace allocated once per call with the per-chunk
statistics): logits tile kernel → rows kernel → dlogits kernel → ``∂h_chunk = dz W`` and
(float32/float64) ``∂W += dzᵀ h_chunk`` by cuBLAS through ``torch.mm`` on the chunk buffers,
or ``_lce_dw_kernel`` for bf16/fp16: five launches a chunk. As on the CPU, ``"mean"``/``"sum"`` compute the
unscaled gradients in the forward (three GEMMs per step; the backward scales them), and
``"none"`` recomputes in the backward with ``g_i = grad_loss[i]`` (docs/ops.md).

Precision: ``tl.dot`` runs bf16/fp16 operands on the tensor cores with a float32 accumulator;
float32 inputs use ``input_precision="ieee"`` (exact float32 products: TF32's ~2⁻¹¹ per product
would miss the 1e-4 of SPEC §10.1), float64 likewise. All offsets are int64 (``N·V`` and
``V·d`` exceed 2³¹ at real sizes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dtypes import compute_dtype
from ..outputs import empty_output
from . import cdiv, sm_count
from .runtime_table import run, several_variants
from .runtime_table import sweep as runtime_sweep


@triton.jit
def _softcap(x, cap):
    """``c·tanh(x/c)`` from ``exp`` (no tanh in every Triton's core language), exact in sign."""
    e = tl.exp(-2.0 * tl.abs(x) / cap)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _lce_logits_kernel(
    h_ptr,        # (rows total, d) tokens, strides (stride_hn, stride_hd)
    w_ptr,        # (V, d) head, strides (stride_wv, stride_wd)
    y_ptr,        # (rows total,) int64 labels
    logits_ptr,   # (R, V) float32 chunk buffer, row stride stride_l (STORE_LOGITS)
    stats_ptr,    # (4, splits, R) accumulation dtype: running max, Σexp, Σs, target logit
    row0,         # first row of this launch (the chunk's)
    rows,         # rows in this launch
    V, d,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_l,
    cap,          # softcap c (HAS_CAP)
    v_per_split,  # vocabulary columns per program along axis 1 (a multiple of BLOCK_N)
    BLOCK_M: tl.constexpr,       # rows per program
    BLOCK_N: tl.constexpr,       # vocabulary columns per tile
    BLOCK_K: tl.constexpr,       # d per tl.dot step
    HAS_CAP: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    WANT_SUM: tl.constexpr,      # Σs (label smoothing)
    F64: tl.constexpr,
    PRECISION: tl.constexpr,     # tl.dot input_precision
    UPCAST: tl.constexpr,        # dot operands widened to float32 (the interpreter's bf16 dot)
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    acc_ty = tl.float64 if F64 else tl.float32
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < rows
    grow = (row0 + rm).to(tl.int64)
    y = tl.load(y_ptr + grow, mask=row_ok, other=-1)
    m_i = tl.full((BLOCK_M,), float("-inf"), acc_ty)
    s_i = tl.zeros((BLOCK_M,), acc_ty)
    sum_i = tl.zeros((BLOCK_M,), acc_ty)
    t_i = tl.zeros((BLOCK_M,), acc_ty)
    v_begin = split * v_per_split
    v_end = tl.minimum(V, v_begin + v_per_split)
    rk = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + grow[:, None] * stride_hn
    for v0 in range(v_begin, v_end, BLOCK_N):
        rn = v0 + tl.arange(0, BLOCK_N)
        col_ok = rn < v_end
        w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wv
        acc = tl.zeros((BLOCK_M, BLOCK_N), acc_ty)
        for k0 in range(0, d, BLOCK_K):
            k = k0 + rk
            a = tl.load(h_rows + k.to(tl.int64)[None, :] * stride_hd, mask=row_ok[:, None] & (k < d)[None, :],
                        other=0.0)
            b = tl.load(w_cols + k.to(tl.int64)[:, None] * stride_wd, mask=(k < d)[:, None] & col_ok[None, :],
                        other=0.0)
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc_ty)
        if HAS_CAP:
            acc = _softcap(acc, cap)
        if STORE_LOGITS:
            tl.store(logits_ptr + rm.to(tl.int64)[:, None] * stride_l + rn[None, :],
                     acc.to(logits_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        z = tl.where(col_ok[None, :], acc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m_i = m_new
        if WANT_SUM:
            sum_i += tl.sum(tl.where(col_ok[None, :], acc, 0.0), 1)
        t_i += tl.sum(tl.where(rn[None, :] == y[:, None], acc, 0.0), 1)
    plane = splits * rows
    at = stats_ptr + split.to(tl.int64) * rows + rm
    tl.store(at, m_i, mask=row_ok)
    tl.store(at + plane, s_i, mask=row_ok)
    tl.store(at + 2 * plane, sum_i, mask=row_ok)
    tl.store(at + 3 * plane, t_i, mask=row_ok)


@triton.jit
def _lce_rows_kernel(
    stats_ptr,    # (4, splits, R) from _lce_logits_kernel
    y_ptr,        # (rows total,) int64 labels
    lse_ptr,      # (rows total,) out: log-sum-exp, accumulation dtype
    loss_ptr,     # (rows total,) out: ℓ_i (0 on ignored rows)
    row0, rows, splits, V,
    ignore_index, eps, z_loss,
    BLOCK_R: tl.constexpr,
    F64: tl.constexpr,
):
    acc_ty = tl.float64 if F64 else tl.float32
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < rows
    plane = splits * rows
    m = tl.full((BLOCK_R,), float("-inf"), acc_ty)
    at = stats_ptr + r  # split j's row block: a pointer stepped by rows (no j·rows product)
    for j in range(0, splits):
        m = tl.maximum(m, tl.load(at, mask=ok, other=0.0))
        at += rows
    total = tl.zeros((BLOCK_R,), acc_ty)
    sum_s = tl.zeros((BLOCK_R,), acc_ty)
    target = tl.zeros((BLOCK_R,), acc_ty)
    at = stats_ptr + r
    for j in range(0, splits):
        total += tl.load(at + plane, mask=ok, other=0.0) * tl.exp(tl.load(at, mask=ok, other=0.0) - m)
        sum_s += tl.load(at + 2 * plane, mask=ok, other=0.0)
        target += tl.load(at + 3 * plane, mask=ok, other=0.0)
        at += rows
    lse = m + tl.log(tl.where(ok, total, 1.0))  # rows past the end: no log(0)
    grow = (row0 + r).to(tl.int64)
    y = tl.load(y_ptr + grow, mask=ok, other=0)
    loss = (1.0 - eps) * (lse - target) + eps * (lse - sum_s / V) + z_loss * lse * lse
    loss = tl.where((y < 0) | (y >= V), float("nan"), loss)
    loss = tl.where(y == ignore_index, 0.0, loss)
    tl.store(lse_ptr + grow, lse, mask=ok)
    tl.store(loss_ptr + grow, loss, mask=ok)


@triton.jit
def _lce_dlogits_kernel(
    logits_ptr,   # (R, V) float32 (softcapped) logits, row stride stride_l
    dz_ptr,       # (R, V) out: dz in the input dtype, row stride stride_l (may be logits_ptr)
    y_ptr, lse_ptr,   # (rows total,) labels, lse
    g_ptr,        # (rows total,) per-row gradient (HAS_ROW_GRAD), else 1
    row0, rows, V, stride_l,
    cap, ignore_index, eps, z_loss,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_ROW_GRAD: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm < rows
    mask = row_ok[:, None] & (rn < V)[None, :]
    grow = (row0 + rm).to(tl.int64)
    y = tl.load(y_ptr + grow, mask=row_ok, other=ignore_index)
    lse = tl.load(lse_ptr + grow, mask=row_ok, other=0.0)
    if HAS_ROW_GRAD:
        g = tl.load(g_ptr + grow, mask=row_ok, other=0.0).to(lse.dtype)
    else:
        g = tl.full((BLOCK_M,), 1.0, lse.dtype)
    g = tl.where(y == ignore_index, 0.0, g)
    offs = rm.to(tl.int64)[:, None] * stride_l + rn[None, :]
    s = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(lse.dtype)
    a = g * (1.0 + 2.0 * z_loss * lse)
    t = a[:, None] * tl.exp(s - lse[:, None]) - (g * eps / V)[:, None]
    t -= tl.where(rn[None, :] == y[:, None], (g * (1.0 - eps))[:, None], 0.0)
    if HAS_CAP:
        q = s / cap
        t = t * (1.0 - q * q)
    t = tl.where(g[:, None] == 0.0, 0.0, t)  # ignored rows: exactly 0
    tl.store(dz_ptr + offs, t.to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lce_dw_kernel(
    dz_ptr,       # (R, V) dz in the input dtype, row stride stride_l
    h_ptr,        # (rows total, d) tokens, strides (stride_hn, stride_hd)
    acc_ptr,      # (V, d) float32 accumulator of ∂W, contiguous
    row0, rows, V, d, stride_l, stride_hn, stride_hd,
    FIRST: tl.constexpr,         # the first chunk: store instead of adding
    BLOCK_M: tl.constexpr,       # vocabulary rows of ∂W per program
    BLOCK_N: tl.constexpr,       # d columns per program
    BLOCK_K: tl.constexpr,       # chunk rows per tl.dot step
    UPCAST: tl.constexpr,
):
    rv = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    v_ok = rv < V
    d_ok = rd < d
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, rows, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < rows
        a = tl.load(dz_ptr + k.to(tl.int64)[None, :] * stride_l + rv[:, None], mask=v_ok[:, None] & k_ok[None, :],
                    other=0.0)   # (BLOCK_M, BLOCK_K) = dzᵀ
        b = tl.load(h_ptr + (row0 + k).to(tl.int64)[:, None] * stride_hn + rd.to(tl.int64)[None, :] * stride_hd,
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    offs = rv.to(tl.int64)[:, None] * d + rd[None, :]
    mask = v_ok[:, None] & d_ok[None, :]
    if not FIRST:
        acc += tl.load(acc_ptr + offs, mask=mask, other=0.0)
    tl.store(acc_ptr + offs, acc, mask=mask)


@triton.jit
def _lce_reduce_kernel(
    rows_ptr,     # (n,) row losses (not BACKWARD)
    y_ptr,        # (n,) int64 labels (MEAN without HAS_ITEMS: the rows counted)
    items_ptr,    # (1,) num_items, any real dtype (HAS_ITEMS)
    g_ptr,        # (1,) the loss's incoming gradient (BACKWARD)
    out_ptr,      # (1,) out, accumulation dtype: Σ rows ÷ den (forward), g ÷ den (BACKWARD)
    n, ignore_index,
    BLOCK: tl.constexpr,
    MEAN: tl.constexpr,       # den = num_items or max(1, counted rows); else den = 1
    HAS_ITEMS: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """``"mean"``/``"sum"`` on the device, in one program (a fixed order: deterministic)."""
    acc_ty = out_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), acc_ty)
    count = tl.zeros((BLOCK,), tl.int32)
    if (not BACKWARD) or (MEAN and not HAS_ITEMS):
        for r0 in range(0, n, BLOCK):
            r = r0 + i
            ok = r < n
            if not BACKWARD:
                total += tl.load(rows_ptr + r, mask=ok, other=0.0).to(acc_ty)
            if MEAN and not HAS_ITEMS:
                count += (ok & (tl.load(y_ptr + r, mask=ok, other=ignore_index) != ignore_index)).to(tl.int32)
    if BACKWARD:
        value = tl.load(g_ptr).to(acc_ty)
    else:
        value = tl.sum(total, axis=0)
    if MEAN:
        if HAS_ITEMS:
            den = tl.load(items_ptr).to(acc_ty)
        else:
            den = tl.maximum(tl.sum(count, axis=0), 1).to(acc_ty)
        value = value / den
    tl.store(out_ptr, value)


# ---------------------------------------------------------------------------------------------
# Launch configuration

#: Bytes of a chunk's float32 logits buffer on a GPU (its dz in the input dtype comes on top):
#: large enough that each chunk's three GEMMs dwarf its five launches (1,024 rows at V = 32000:
#: 4 chunks at N = 4096; 256 rows at V = 128256, each GEMM ~130 GFLOP), small beside a GPU's
#: memory and bounded whatever N is (SPEC §10.1: never an (N, V) tensor).
_CHUNK_BYTES = 128 << 20
_MIN_CHUNK_ROWS = 128
_MAX_CHUNK_ROWS = 4096
#: Rows per chunk in the interpreter: small, so that small test shapes span several chunks.
_INTERPRETER_CHUNK_ROWS = 16
#: Programs per SM the logits kernel's grid aims at (row blocks × vocabulary splits).
_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class LaunchConfig:
    """Every choice of one call's launches (a pure function of shape, dtype and GPU, and of
    ``WIOLA_LCE_CHUNK_ROWS`` when set)."""

    logits: Tiles
    dw: Tiles
    ew_m: int          # rows × columns of a dlogits program
    ew_n: int
    ew_warps: int
    rows_block: int    # rows per rows-kernel program
    chunk: int         # rows per chunk (gradients)
    precision: str
    upcast: bool


def _launch_config(n: int, V: int, d: int, dtype: torch.dtype, sms: int | None) -> LaunchConfig:
    """The launches for ``n`` rows, vocabulary ``V``, width ``d`` of ``dtype`` on a GPU with
    ``sms`` SMs; ``None``: Triton's CPU interpreter (small tiles and chunks, so that small
    test shapes cross tile and chunk edges)."""
    precision = "ieee" if dtype in (torch.float32, torch.float64) else "tf32"
    if sms is None:
        t = Tiles(16, 32, 16, 1, 1)
        return LaunchConfig(t, Tiles(32, 16, 16, 1, 1), 16, 32, 1, 16, _INTERPRETER_CHUNK_ROWS, precision,
                            upcast=dtype == torch.bfloat16)
    ew_m, ew_n, ew_warps = 16, 256, 8
    if dtype == torch.float64:  # 8 warps: with 4, the logits tile without Σs spills on sm_90 (Triton 3.6)
        logits, dw = Tiles(32, 32, 16, 8, 1), Tiles(32, 32, 16, 4, 1)
        ew_m, ew_n, ew_warps = 8, 128, 4
    elif dtype == torch.float32:  # FMA products ("ieee"): register tiles, no tensor cores
        logits, dw = Tiles(64, 64, 16, 8, 2), Tiles(64, 64, 16, 8, 2)
    else:
        logits, dw = Tiles(64, 128, 64, 8, 3), Tiles(128, 128, 64, 8, 3)
    chunk = _CHUNK_BYTES // (4 * V)
    chunk = max(_MIN_CHUNK_ROWS, min(_MAX_CHUNK_ROWS, chunk // logits.block_m * logits.block_m))
    override = os.environ.get("WIOLA_LCE_CHUNK_ROWS", "")
    if override.isdigit() and int(override) > 0:  # for measuring other sizes, as on the CPU (docs/ops.md)
        chunk = max(logits.block_m, int(override) // logits.block_m * logits.block_m)
    return LaunchConfig(logits, dw, ew_m, ew_n, ew_warps, 256, chunk, precision, upcast=False)


def _splits(rows: int, V: int, tiles: Tiles, sms: int | None) -> tuple[int, int]:
    """``(splits, columns per split)`` of the vocabulary for a launch over ``rows`` rows: enough
    programs to fill ``sms`` SMs ``_PROGRAMS_PER_SM`` times, each at least one tile wide."""
    row_blocks = cdiv(rows, tiles.block_m)
    tiles_v = cdiv(V, tiles.block_n)
    want = 2 if sms is None else max(1, cdiv(_PROGRAMS_PER_SM * sms, row_blocks))
    per = cdiv(tiles_v, min(tiles_v, want)) * tiles.block_n
    return cdiv(V, per), per


# ---------------------------------------------------------------------------------------------
# Launchers. h2 (n, d) and W (V, d) may have any strides; labels int64 (n,) contiguous.

def _logits_launch(h2, W, y, logits, stats, row0, rows, cfg: LaunchConfig, splits, per, cap, want_sum):
    t = cfg.logits
    V, d = W.shape
    run(_lce_logits_kernel, (cdiv(rows, t.block_m), splits),
        h2, W, y, stats if logits is None else logits, stats, row0, rows, V, d,
        h2.stride(0), h2.stride(1), W.stride(0), W.stride(1), 0 if logits is None else logits.stride(0),
        1.0 if cap is None else cap, per,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, HAS_CAP=cap is not None,
        STORE_LOGITS=logits is not None, WANT_SUM=want_sum, F64=h2.dtype == torch.float64,
        PRECISION=cfg.precision, UPCAST=cfg.upcast, num_warps=t.num_warps, num_stages=t.num_stages)


def _rows_launch(stats, y, lse, loss, row0, rows, splits, V, cfg, ignore_index, eps, z_loss):
    run(_lce_rows_kernel, cdiv(rows, cfg.rows_block),
        stats, y, lse, loss, row0, rows, splits, V, ignore_index, eps, z_loss,
        BLOCK_R=cfg.rows_block, F64=lse.dtype == torch.float64, num_warps=_DEFAULT_WARPS)


def _chunk_grads(h2, W, y, lse, g, row0, rows, cfg, buf, dz, grad_h, grad_W, dW_acc, first, ignore_index, eps, cap,
                 z_loss):
    """∂h rows and the chunk's share of ∂W from the chunk's logits in ``buf``."""
    V = W.shape[0]
    run(_lce_dlogits_kernel, (cdiv(rows, cfg.ew_m), cdiv(V, cfg.ew_n)),
        buf, dz, y, lse, lse if g is None else g, row0, rows, V, buf.stride(0), 1.0 if cap is None else cap,
        ignore_index, eps, z_loss, BLOCK_M=cfg.ew_m, BLOCK_N=cfg.ew_n, HAS_CAP=cap is not None,
        HAS_ROW_GRAD=g is not None, num_warps=cfg.ew_warps)
    dzc = dz[:rows]
    if grad_h is not None:
        torch.mm(dzc, W, out=grad_h[row0:row0 + rows])
    if grad_W is None:
        return
    hc = h2[row0:row0 + rows]
    if dW_acc is None:  # float32 / float64: cuBLAS accumulates in the output
        if first:
            torch.mm(dzc.t(), hc, out=grad_W)
        else:
            grad_W.addmm_(dzc.t(), hc)
        return
    t = cfg.dw
    d = h2.shape[1]
    run(_lce_dw_kernel, (cdiv(V, t.block_m), cdiv(d, t.block_n)),
        dz, h2, dW_acc, row0, rows, V, d, dz.stride(0), h2.stride(0), h2.stride(1), FIRST=first,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, UPCAST=cfg.upcast, num_warps=t.num_warps,
        num_stages=t.num_stages)


def _workspace(rows: int, V: int, dtype: torch.dtype, acc: torch.dtype, stats_numel: int, device,
               dw_numel: int = 0):
    """One allocation per call for the chunks' temporaries: the logits buffer ``(rows, V)`` in
    the accumulation dtype, its ``dz`` in ``dtype`` (the same tensor when the dtypes agree), the
    statistics and (``dw_numel``: bf16/fp16 ``∂W``) the float32 ``∂W`` accumulator, each 256-byte
    aligned (as a fresh tensor would be); the C++ kernel lays it out alike
    (csrc/include/wiola/triton_linear_cross_entropy.h ``plan``)."""
    def nbytes(numel, dt):
        return (numel * dt.itemsize + 255) // 256 * 256

    sizes = [nbytes(rows * V, acc), 0 if dtype == acc else nbytes(rows * V, dtype), nbytes(stats_numel, acc),
             nbytes(dw_numel, torch.float32)]
    ws = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    buf = ws[:rows * V * acc.itemsize].view(acc).view(rows, V)
    at = sizes[0]
    dz = buf if dtype == acc else ws[at:at + rows * V * dtype.itemsize].view(dtype).view(rows, V)
    at += sizes[1]
    stats = ws[at:at + stats_numel * acc.itemsize].view(acc)
    at += sizes[2]
    dw_acc = ws[at:at + dw_numel * 4].view(torch.float32) if dw_numel else None
    return buf, dz, stats, dw_acc


_REDUCE_BLOCK = 1024
_DEFAULT_WARPS = 4  # Triton's default num_warps, named so that the C++ launches name the same


def device_num_items(num_items: torch.Tensor | None, device) -> torch.Tensor | None:
    """``num_items`` where the reduction kernel reads it: a tensor on ``device`` as it is; a CPU
    tensor's value (read on the host: no device sync) written into a float64 device scalar by a fill
    kernel whose launch carries it, as a number's is (no copy from host memory, which a CUDA graph
    cannot capture). The C++ kernel does the same."""
    if num_items is None or num_items.device == device:
        return num_items
    return torch.full((), float(num_items), dtype=torch.float64, device=device)


def lce_reduce(rows: torch.Tensor | None, y: torch.Tensor, ignore_index: int, num_items: torch.Tensor | None,
               mean: bool, grad: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One launch: the forward's ``Σ rows`` (÷ the mean's divisor when ``mean``), or with
    ``grad`` (the backward's incoming 0-d gradient) ``grad ÷`` that divisor; a 0-d tensor in
    ``rows``' dtype (the backward: ``dtype``). The divisor is ``num_items`` (one element, any
    real dtype; a CPU tensor's value goes to the device through a fill, device_num_items) or the
    number of labels ``y (n,)`` that are not ``ignore_index`` (at least 1), read on the device,
    never on the host. ``num_items`` is not read for a sum."""
    backward = grad is not None
    out = torch.empty((), dtype=dtype if backward else rows.dtype, device=y.device)
    num_items = device_num_items(num_items, y.device) if mean else None
    run(_lce_reduce_kernel, 1,
        y if backward else rows, y, out if num_items is None else num_items, grad if backward else out, out,
        y.shape[0], ignore_index, BLOCK=_REDUCE_BLOCK, MEAN=bool(mean), HAS_ITEMS=num_items is not None,
        BACKWARD=backward, num_warps=_DEFAULT_WARPS)
    return out


def lce_forward(h2: torch.Tensor, W: torch.Tensor, y: torch.Tensor, ignore_index: int, eps: float,
                cap: float | None, z_loss: float, grad_mask=(False, False), lse_in: torch.Tensor | None = None,
                row_grad: torch.Tensor | None = None, grad_h: torch.Tensor | None = None,
                grad_W: torch.Tensor | None = None):
    """Row losses, lse and (optionally) gradients of ``h2 (n, d)``, ``W (V, d)``, ``y (n,)``.

    Returns ``(loss_rows (n,), lse (n,), grad_h, grad_W)`` in the accumulation dtype (the
    gradients in the inputs' dtypes, None when not wanted). Gradients are of Σ_i g_i ℓ_i with
    ``g = row_grad`` (None: 1), written into ``grad_h`` / ``grad_W`` when given (the backward's
    buffers), else into new tensors per ``grad_mask``. ``lse_in``: the forward's lse (the
    backward: no losses are computed)."""
    n, d = h2.shape
    V = W.shape[0]
    acc = compute_dtype(h2.dtype)
    device = h2.device
    sms = sm_count(device)
    cfg = _launch_config(n, V, d, h2.dtype, sms)
    want_h = grad_h is not None or bool(grad_mask[0])
    want_W = grad_W is not None or bool(grad_mask[1])
    if want_h and grad_h is None:
        grad_h = empty_output((n, d), dtype=h2.dtype, device=device)
    if want_W and grad_W is None:
        grad_W = empty_output((V, d), dtype=W.dtype, device=device)
    backward = lse_in is not None
    lse = lse_in if backward else empty_output((n,), dtype=acc, device=device)
    loss = None if backward else empty_output((n,), dtype=acc, device=device)
    if n == 0:
        if want_W:
            grad_W.zero_()
        return loss, lse, grad_h, grad_W
    want_sum = eps != 0.0
    if not (want_h or want_W):  # the loss alone: one launch over every row, nothing stored
        splits, per = _splits(n, V, cfg.logits, sms)
        stats = torch.empty((4, splits, n), dtype=acc, device=device)
        _logits_launch(h2, W, y, None, stats, 0, n, cfg, splits, per, cap, want_sum)
        _rows_launch(stats, y, lse, loss, 0, n, splits, V, cfg, ignore_index, eps, z_loss)
        return loss, lse, grad_h, grad_W
    rows_max = min(n, cfg.chunk)
    # Every chunk's split (the last, shorter chunk may split the vocabulary more ways).
    split_of = {rows: _splits(rows, V, cfg.logits, sms) for rows in {rows_max, n - (n - 1) // rows_max * rows_max}}
    dw_numel = V * d if want_W and W.dtype != acc else 0  # bf16 / fp16: a float32 accumulator
    buf, dz, stats_all, dW_acc = _workspace(rows_max, V, h2.dtype, acc,
                                            max(4 * sp * r for r, (sp, _) in split_of.items()), device, dw_numel)
    for row0 in range(0, n, rows_max):
        rows = min(rows_max, n - row0)
        splits, per = split_of[rows]
        stats = stats_all[:4 * splits * rows]
        _logits_launch(h2, W, y, buf, stats, row0, rows, cfg, splits, per, cap, want_sum and not backward)
        if not backward:
            _rows_launch(stats, y, lse, loss, row0, rows, splits, V, cfg, ignore_index, eps, z_loss)
        _chunk_grads(h2, W, y, lse, row_grad, row0, rows, cfg, buf, dz, grad_h if want_h else None,
                     grad_W if want_W else None, dW_acc, row0 == 0, ignore_index, eps, cap, z_loss)
    if dW_acc is not None:
        grad_W.copy_(dW_acc.view(V, d))
    return loss, lse, grad_h, grad_W


_KERNELS = (_lce_logits_kernel, _lce_rows_kernel, _lce_dlogits_kernel, _lce_dw_kernel, _lce_reduce_kernel)
several_variants(*_KERNELS)  # a call launches each in several variants (chunks, first and later)


def sweep() -> None:
    """After the op's Python launcher ran for a C++ miss: warns once about a missed key no launch
    had (runtime_table.sweep)."""
    runtime_sweep(*_KERNELS)


def aot_launches(sms: int):
    """Every launch of the five kernels at the GPU test and bench shapes on a GPU with ``sms``
    SMs (see ``wiola_kernels/triton/aot.py``): the loss alone and with gradients (each chunk's
    rows), with and without softcap and label smoothing, the backward's recomputation (per-row
    gradients, no Σs), and the reductions (counted rows, a ``num_items`` as the op layer passes
    it: float64 on the device, the backward's factor)."""
    from ..shapes import LCE_BENCH, LCE_GPU_TESTS
    from .aot import DEFAULT_NUM_STAGES, DevicePointer as P, Launch

    cases = [(f"test (n, d, V) ({n}, {d}, {V}) {dtype}", n, d, V, dtype) for n, d, V, dtype in LCE_GPU_TESTS]
    cases += [(f"bench {size} (n, d, V) {shape} {dtype}", *shape, dtype)
              for size, shape in LCE_BENCH.items() for dtype in (torch.bfloat16, torch.float32)]
    flags = ((False, False), (False, True), (True, False), (True, True))
    for case, n, d, V, dtype in cases:
        cfg = _launch_config(n, V, d, dtype, sms)
        acc = compute_dtype(dtype)
        t = cfg.logits
        f64 = dtype == torch.float64
        rows_max = min(n, cfg.chunk)
        chunk_rows = sorted({rows_max, n - (n - 1) // rows_max * rows_max}, reverse=True)
        for store, rows in [(False, n)] + [(True, r) for r in chunk_rows]:
            splits, per = _splits(rows, V, t, sms)
            what = f"{case}{' chunk of ' + str(rows) if store else ''}"
            for cap, want_sum in flags:
                yield Launch(_lce_logits_kernel,
                             (P(dtype), P(dtype), P(torch.int64), P(acc), P(acc), 0, rows, V, d, d, 1, d, 1,
                              V if store else 0, 30.0, per),
                             dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, HAS_CAP=cap,
                                  STORE_LOGITS=store, WANT_SUM=want_sum, F64=f64, PRECISION=cfg.precision,
                                  UPCAST=False),
                             t.num_warps, t.num_stages, cdiv(rows, t.block_m) * splits,
                             f"{what}{' softcap' if cap else ''}{' smoothing' if want_sum else ''}",
                             memory_bound=False)
            yield Launch(_lce_rows_kernel, (P(acc), P(torch.int64), P(acc), P(acc), 0, rows, splits, V, -100, 0.1,
                                            1e-4),
                         dict(BLOCK_R=cfg.rows_block, F64=f64), _DEFAULT_WARPS, DEFAULT_NUM_STAGES,
                         cdiv(rows, cfg.rows_block), what, memory_bound=False)
            if not store:
                continue
            for cap, row_grad in flags:
                yield Launch(_lce_dlogits_kernel,
                             (P(acc), P(dtype), P(torch.int64), P(acc), P(acc), 0, rows, V, V, 30.0, -100, 0.1, 1e-4),
                             dict(BLOCK_M=cfg.ew_m, BLOCK_N=cfg.ew_n, HAS_CAP=cap, HAS_ROW_GRAD=row_grad),
                             cfg.ew_warps, DEFAULT_NUM_STAGES, cdiv(rows, cfg.ew_m) * cdiv(V, cfg.ew_n), what,
                             memory_bound=False)
            if dtype in (torch.bfloat16, torch.float16):
                w = cfg.dw
                for first in (True, False):
                    yield Launch(_lce_dw_kernel, (P(dtype), P(dtype), P(torch.float32), 0, rows, V, d, V, d, 1),
                                 dict(FIRST=first, BLOCK_M=w.block_m, BLOCK_N=w.block_n, BLOCK_K=w.block_k,
                                      UPCAST=False),
                                 w.num_warps, w.num_stages, cdiv(V, w.block_m) * cdiv(d, w.block_n), what,
                                 memory_bound=False)
        for mean, items, backward in ((True, False, False), (True, True, False), (False, False, False),
                                      (True, False, True), (True, True, True), (False, False, True)):
            yield Launch(_lce_reduce_kernel,
                         (P(torch.int64 if backward else acc), P(torch.int64), P(torch.float64 if items else acc), P(acc),
                          P(acc), n, -100),
                         dict(BLOCK=_REDUCE_BLOCK, MEAN=mean, HAS_ITEMS=items, BACKWARD=backward), _DEFAULT_WARPS,
                         DEFAULT_NUM_STAGES, 1, case, memory_bound=False)
