"""GCLA summary-augmented attention as fused Triton kernels, FlashAttention-2 style (SPEC §5.5).

For batch row ``b``, head ``h`` (key/value group ``g = h mod H_kv``, SPEC §5.2 — not
``h // (H/H_kv)``) and query row ``i < len_b`` (scale ``c = 1/√d_h``)::

    s_ij   = c q̃_i·k̃_gj  (j ≤ i, j < len_b)      lse_i = log Σ_j exp(s_ij)
    O_i    = Σ_j exp(s_ij − lse_i) v_gj  +  σ(g_h) Σ_λ softmax_λ(c q_i·kc_iλ) vc_iλ
    O_i    = 0, lse_i = 0                         for i ≥ len_b

Forward, one program per (query block of ``BLOCK_M`` rows, b, h), heaviest (last) query
blocks first: the block's rotated queries stay in registers while key/value blocks of
``BLOCK_N`` rows stream through ``tl.dot`` with an online softmax. Key blocks wholly left
of the diagonal need no mask at all (every key there is < the block's first row < len_b);
the diagonal blocks get the causal and length mask; blocks above the diagonal and past
``len_b`` are never visited, and a block of rows that lies wholly past ``len_b`` does no
attention work. The Λ' summary slots — a softmax over λ with the un-rotated ``q`` (slot row 0
for ``S = 1``, row ``i`` for ``S = T``), scaled by ``σ(g_h)`` — are computed by the same
program before its key loop, while no softmax state is live, and parked (in float32 scratch
for 16-bit outputs, else in the block's own output rows); the epilogue normalises, adds them back, zeroes the rows
past ``len_b`` and writes ``O`` and ``lse``. (Computed in the epilogue, next to the O tile,
the slots spill registers at d_h = 128; the park costs one extra write and read of a
B·H·T·d_h tile set, in float32 for bf16/fp16.)

Backward (``dO`` treated as 0 on rows ≥ len_b; ``P = exp(S − lse)`` recomputed)::

    D_i   = dO_i·(O_i − σ O^cross_i)                       (FlashAttention-2's identity)
    dS    = P ∘ (dO Vᵀ − D),   dq̃ = c dS K̃,   dk̃ = c dSᵀ Q̃,   dV = Pᵀ dO
    cross: dOc = σ dO, dvc = a dOc, dz = a (dOc·vc − dOc·O^cross),
           dq = c Σ_λ dz kc,  dkc = c dz q,  dg_h = σ(1−σ) Σ dO·O^cross

* dq pass, one program per (query block, b, h): the cross part (``dq``, ``dkc``, ``dvc``,
  the gate partial) and ``D`` in its prologue — three short passes over λ (statistics;
  ``t = dO·O^cross = Σ_λ a_λ dO·vc_λ`` and ``dvc``; ``dz_λ = σ a_λ (dO·vc_λ − t)``, ``dq``,
  ``dkc``), so no O^cross tile is held — then ``dq̃`` over the key blocks at or left of the
  diagonal. ``D`` goes to a (B, H, T) buffer for the next pass.
* dk/dv pass, one program per (key block, b, kv group ``g``, split ``s``): it loops over its
  share of the group's query heads ``h = g + s·H_kv, g + (s + SPLIT)·H_kv, …`` in order and,
  per head, over the query blocks at or below the diagonal and below ``len_b``, accumulating
  ``dk̃, dV`` in registers. With ``SPLIT = 1`` (grids that fill the GPU) a program owns its
  key block and writes ``dk̃, dV``; a grid of fewer programs than SMs (e.g. B = 1, H_kv = 1,
  T = 2,048: 16 key blocks on 132 SMs) splits each group's heads over ``SPLIT`` programs
  (:func:`dkv_split`), which write float partials that are summed afterwards in split order.
  No atomics either way: bitwise reproducible.
* ``S = 1``: ``dkc, dvc`` are per-(query block) float partials summed afterwards; the gate
  gradient likewise (per (b, h, query block)), so every reduction has a fixed order.

Precision: scores, softmax statistics and accumulators in float32 (float64 for float64
inputs); ``P`` and ``dS`` are rounded to the input dtype before their ``tl.dot`` (the
FlashAttention convention for bf16/fp16). float32 inputs use ``input_precision="ieee"``
(on a GPU up to d_h 64; :func:`launch_config`):
exact float32 products on the FMA units (TF32, ~2⁻¹¹ per product, would miss SPEC §9's 1e-4
for attention; "tf32x3" keeps the tensor cores but triples the operand registers and spilled
in every configuration tried at d_h 128, and on sm_80 at d_h 64). float32 is not the
training dtype; bf16/fp16 are the tensor-core paths.

Addressing: the row offsets ``row × row stride`` reach past 2³¹ elements (T ≥ 1,048,576 rows
at H·d_h = 2,048), so every base pointer is advanced in 64 bits to the first row of its block,
and only the offsets inside a block (``tl.arange`` × stride, bounded by the block) stay in 32
bits (``gpu-report`` lints the TTIR for 32-bit products of a row index and a stride).

Head widths: any even ``d_h`` up to 256; the tile width is the next power of two ≥ 16
(``tl.dot`` needs a reduction dimension of at least 16), padded columns are masked. Powers
of two (16, 32, 64, 128, 256) waste nothing.

Not handled like the CPU kernel: a NaN/Inf inside the valid region of ``k_rot``/``v``
reaches the earlier rows of its own diagonal tile (``0·NaN`` inside ``tl.dot``), as in
FlashAttention; garbage past ``len_b`` is never read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..dtypes import compute_dtype
from ..outputs import empty_output, empty_output_as
from ..validation import TRITON_GCLA_FP32_MAX_HEAD_DIM as FP32_MAX_HEAD_DIM
from ..validation import TRITON_GCLA_MAX_HEAD_DIM as MAX_HEAD_DIM
from . import cdiv, next_power_of_2


# ---------------------------------------------------------------------------------------------
# Kernels
#
# Calls between @triton.jit functions are inlined on the GPU but cost ~2 ms each in the CPU
# interpreter (it re-patches triton.language per call), so the inner loops are one call per
# step with everything inside written out. Column masks ``cols < HEAD_DIM`` are folded away
# by the compiler when BLOCK_D == HEAD_DIM (checked in the PTX), so loads always carry them.
# Pointers: a 64-bit base at the block's first row (``row0.to(tl.int64) * stride``) plus a
# 32-bit tile ``tl.arange(0, BLOCK)[:, None] * stride + cols`` (bounded by the block).
# ---------------------------------------------------------------------------------------------

@triton.jit
def _cross_stats(qq, kc_base, ctx_offs, ctx_ok, L, kc_sl, c, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Softmax statistics ``(m, l)`` over the Λ' ≥ 1 summary slots for a block of rows, with the
    un-rotated ``qq`` (natural exp; Λ' is a handful, so CUDA cores). Slot λ of the rows sits at
    ``kc_base + λ·kc_sl + ctx_offs`` (a tile for S = T, one shared row for S = 1). The callers
    re-read the slots for their second pass rather than keep an O^cross tile alive: fewer
    registers, and the re-reads hit L1/L2."""
    m = tl.full([BLOCK_M], float("-inf"), c.dtype)
    l = tl.full([BLOCK_M], 0.0, c.dtype)
    for lam in tl.range(0, L, num_stages=1):
        kc = tl.load(kc_base + tl.cast(lam, tl.int64) * kc_sl + ctx_offs, mask=ctx_ok, other=0.0)
        z = tl.sum(qq.to(c.dtype) * kc.to(c.dtype), 1) * c
        m_new = tl.maximum(m, z)
        l = l * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    return m, l


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, k_st, v_st, rows, n0, length, c_exp,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK: tl.constexpr, F64: tl.constexpr, UPCAST: tl.constexpr):
    """One key block [n0, n0 + BLOCK_N) of the online softmax (scores in exp units). MASK: the
    block crosses the diagonal or len_b; keys j > i or j ≥ len_b get weight 0 and keys past
    len_b are not read. Without MASK every key of the block is valid for every row."""
    offs_n = tl.arange(0, BLOCK_N)
    keys = n0 + offs_n
    cols = tl.arange(0, BLOCK_D)
    key_ok = keys < length
    if MASK:
        ld_ok = key_ok[:, None] & (cols < HEAD_DIM)[None, :]
    else:
        ld_ok = (cols < HEAD_DIM)[None, :]
    n64 = tl.cast(n0, tl.int64)  # a loop variable: a Python int in the interpreter
    k = tl.load(k_base + n64 * k_st + (offs_n[:, None] * k_st + cols[None, :]), mask=ld_ok, other=0.0)
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = s * c_exp  # (BLOCK_M, BLOCK_N)
    if MASK:
        s = tl.where((keys[None, :] <= rows[:, None]) & key_ok[None, :], s, float("-inf"))
    # Every row meets a valid key (key 0, or key m0 in the first diagonal block) before any
    # block that masks it whole, so m_new is finite and -inf - -inf never arises.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if F64:
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + n64 * v_st + (offs_n[:, None] * v_st + cols[None, :]), mask=ld_ok, other=0.0)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee", out_dtype=acc.dtype)
    return acc, m_new, l_i


@triton.jit
def _gcla_fwd_kernel(
    q_rot_ptr,    # (B, H, T, d_h) rotated queries; every tensor: any strides, d_h contiguous
    k_rot_ptr,    # (B, H_kv, T, d_h) rotated keys
    v_ptr,        # (B, H_kv, T, d_h) values
    q_ptr,        # (B, H, T, d_h) un-rotated queries (cross part)
    kc_ptr,       # (B, H, S, Λ', d_h) context keys
    vc_ptr,       # (B, H, S, Λ', d_h) context values
    gate_ptr,     # (H,) gate logits in the accumulation dtype (float32 / float64)
    len_ptr,      # (B,) int64 lengths (read only when HAS_LEN)
    out_ptr,      # (B, H, T, d_h) out: O, input dtype
    lse_ptr,      # (B, H, T) out: log-sum-exp, accumulation dtype; 0 past the length
    park_ptr,     # (B, H, T, d_h) scratch for σ·O^cross, strided like out: float32 for 16-bit outputs,
                  # else out_ptr itself
    B, H, H_KV, T, L,                # sizes; L = Λ'
    sqr_b, sqr_h, sqr_t,             # element strides (b, head, t) of q_rot
    sk_b, sk_h, sk_t,                # of k_rot
    sv_b, sv_h, sv_t,                # of v
    sq_b, sq_h, sq_t,                # of q
    skc_b, skc_h, skc_s, skc_l,      # (b, head, s, λ) of kc
    svc_b, svc_h, svc_s, svc_l,      # of vc
    so_b, so_h, so_t,                # (b, head, t) of out and park
    HEAD_DIM: tl.constexpr,          # d_h
    BLOCK_M: tl.constexpr,           # query rows per program
    BLOCK_N: tl.constexpr,           # keys per step (BLOCK_M % BLOCK_N == 0)
    BLOCK_D: tl.constexpr,           # next power of two ≥ max(d_h, 16)
    PER_ROW: tl.constexpr,           # S = T (causal summaries), else S = 1
    HAS_CROSS: tl.constexpr,         # Λ' > 0
    HAS_LEN: tl.constexpr,           # lengths given
    F64: tl.constexpr,               # float64 inputs: float64 statistics, natural exp
    UPCAST: tl.constexpr,            # widen dot operands to float32 (interpreter, bfloat16 only)
    SAME_T_STRIDE: tl.constexpr,     # q_rot, q and out have equal strides, k_rot and v, kc and vc too
                                     # (the model's views, contiguous inputs): shared offset tiles, fewer
                                     # registers (separate ones spill in the float32 kernel on sm_80)
):
    pid = tl.program_id(0)
    n_bh = B * H
    bh = pid % n_bh
    m0 = ((T + BLOCK_M - 1) // BLOCK_M - 1 - pid // n_bh) * BLOCK_M  # the longest rows start first
    b = bh // H
    h = bh % H
    g = h % H_KV  # SPEC §5.2: the paper's rule
    if HAS_LEN:
        length = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), T).to(tl.int32)  # clamped under torch.compile
    else:
        length = T
    offs_m = tl.arange(0, BLOCK_M)
    rows = m0 + offs_m
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < length
    tile_ok = row_ok[:, None] & (cols < HEAD_DIM)[None, :]
    b64, h64, g64, m64 = b.to(tl.int64), h.to(tl.int64), g.to(tl.int64), m0.to(tl.int64)
    qr_base = q_rot_ptr + b64 * sqr_b + h64 * sqr_h + m64 * sqr_t
    qr_offs = offs_m[:, None] * sqr_t + cols[None, :]
    k_base = k_rot_ptr + b64 * sk_b + g64 * sk_h
    q_base = q_ptr + b64 * sq_b + h64 * sq_h + m64 * sq_t
    o_row0 = b64 * so_b + h64 * so_h + m64 * so_t
    if SAME_T_STRIDE:
        q_offs = qr_offs
        o_offs = qr_offs
        v_base = v_ptr + b64 * sk_b + g64 * sk_h
    else:
        q_offs = offs_m[:, None] * sq_t + cols[None, :]
        o_offs = offs_m[:, None] * so_t + cols[None, :]
        v_base = v_ptr + b64 * sv_b + g64 * sv_h

    sig = 1.0 / (1.0 + tl.exp(-tl.load(gate_ptr + h)))  # σ(g_h); its dtype is the accumulation dtype
    # c = 1/√d_h formed here: a Python float argument would be typed float32 (too coarse for float64).
    c = 1.0 / tl.sqrt(tl.full((), HEAD_DIM, sig.dtype))
    st_ok = (rows < T)[:, None] & (cols < HEAD_DIM)[None, :]

    # The cross part first, while no softmax state is live: σ(g_h)·O^cross is parked (park_ptr)
    # and picked up by the epilogue (done in the epilogue itself it would hold an O tile, q,
    # kc and vc at once and spill at d_h = 128).
    if HAS_CROSS:
        qq = tl.load(q_base + q_offs, mask=tile_ok, other=0.0)
        if PER_ROW:  # row i reads its own slot row i (rows past the length read 0)
            kc_base = kc_ptr + b64 * skc_b + h64 * skc_h + m64 * skc_s
            kc_offs = offs_m[:, None] * skc_s + cols[None, :]
            if SAME_T_STRIDE:
                vc_base = vc_ptr + b64 * skc_b + h64 * skc_h + m64 * skc_s
                vc_offs = kc_offs
            else:
                vc_base = vc_ptr + b64 * svc_b + h64 * svc_h + m64 * svc_s
                vc_offs = offs_m[:, None] * svc_s + cols[None, :]
            ctx_ok = tile_ok
        else:  # one slot row shared by every position
            kc_base = kc_ptr + b64 * skc_b + h64 * skc_h
            vc_base = vc_ptr + b64 * svc_b + h64 * svc_h
            kc_offs = cols[None, :]
            vc_offs = cols[None, :]
            ctx_ok = (cols < HEAD_DIM)[None, :]
        m_c, l_c = _cross_stats(qq, kc_base, kc_offs, ctx_ok, L, skc_l, c, HEAD_DIM, BLOCK_M)
        w = sig / l_c
        o_cross = tl.full([BLOCK_M, BLOCK_D], 0.0, sig.dtype)
        vc_sl = skc_l if SAME_T_STRIDE else svc_l
        for lam in tl.range(0, L, num_stages=1):  # σ Σ_λ a_λ vc_λ
            lam64 = tl.cast(lam, tl.int64)
            kc = tl.load(kc_base + lam64 * skc_l + kc_offs, mask=ctx_ok, other=0.0)
            vc = tl.load(vc_base + lam64 * vc_sl + vc_offs, mask=ctx_ok, other=0.0)
            z = tl.sum(qq.to(sig.dtype) * kc.to(sig.dtype), 1) * c
            o_cross += (w * tl.exp(z - m_c))[:, None] * vc.to(sig.dtype)
        tl.store(park_ptr + o_row0 + o_offs, o_cross.to(park_ptr.dtype.element_ty), mask=st_ok)

    if F64:
        c_exp = c
    else:
        c_exp = c * 1.4426950408889634  # scores in log2 units for exp2
    q = tl.load(qr_base + qr_offs, mask=tile_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), sig.dtype)
    l_i = tl.full([BLOCK_M], 0.0, sig.dtype)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, sig.dtype)
    # Key blocks left of the diagonal: keys < m0 < len_b, no mask. None for rows past len_b.
    v_st = sk_t if SAME_T_STRIDE else sv_t  # one key offset tile for k and v
    for n0 in range(0, tl.where(m0 < length, m0, 0), BLOCK_N):
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, sk_t, v_st, rows, n0, length, c_exp,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, False, F64, UPCAST)
    # The diagonal blocks, up to the last valid key; blocks above the diagonal are never visited.
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, length), BLOCK_N):
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, sk_t, v_st, rows, n0, length, c_exp,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, True, F64, UPCAST)

    # Epilogue: normalise, add the parked cross part, zero the rows past the length, write.
    l_safe = tl.where(row_ok, l_i, 1.0)
    o = acc / l_safe[:, None]
    if F64:
        lse = m_i + tl.log(l_safe)
    else:
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    if HAS_CROSS:
        tl.debug_barrier()  # the parked values were stored by other threads of this program
        o += tl.load(park_ptr + o_row0 + o_offs, mask=st_ok, other=0.0).to(sig.dtype)
    o = tl.where(row_ok[:, None], o, 0.0)
    tl.store(out_ptr + o_row0 + o_offs, o.to(out_ptr.dtype.element_ty), mask=st_ok)
    tl.store(lse_ptr + bh.to(tl.int64) * T + rows, tl.where(row_ok, lse, 0.0), mask=rows < T)


@triton.jit
def _dq_inner(dq, qr, do, lse_e, delta, k_base, v_base, k_st, v_st, rows, n0, length, c_exp,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              MASK: tl.constexpr, F64: tl.constexpr, UPCAST: tl.constexpr):
    """dq̃ += dS K̃ over one key block (c is applied once, by the caller)."""
    offs_n = tl.arange(0, BLOCK_N)
    keys = n0 + offs_n
    cols = tl.arange(0, BLOCK_D)
    key_ok = keys < length
    if MASK:
        ld_ok = key_ok[:, None] & (cols < HEAD_DIM)[None, :]
    else:
        ld_ok = (cols < HEAD_DIM)[None, :]
    n64 = tl.cast(n0, tl.int64)  # a loop variable: a Python int in the interpreter
    k = tl.load(k_base + n64 * k_st + (offs_n[:, None] * k_st + cols[None, :]), mask=ld_ok, other=0.0)
    v = tl.load(v_base + n64 * v_st + (offs_n[:, None] * v_st + cols[None, :]), mask=ld_ok, other=0.0)
    if UPCAST:
        s = tl.dot(qr.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
        dp = tl.dot(do.to(tl.float32), tl.trans(v).to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(qr, tl.trans(k), input_precision="ieee")
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    s = s * c_exp
    if MASK:
        s = tl.where((keys[None, :] <= rows[:, None]) & key_ok[None, :], s, float("-inf"))
    if F64:
        p = tl.exp(s - lse_e[:, None])
    else:
        p = tl.exp2(s - lse_e[:, None])
    ds = p * (dp - delta[:, None])
    if UPCAST:
        dq = tl.dot(ds.to(k.dtype).to(tl.float32), k.to(tl.float32), dq, input_precision="ieee")
    else:
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee", out_dtype=dq.dtype)
    return dq


@triton.jit
def _gcla_bwd_dq_kernel(
    q_rot_ptr, k_rot_ptr, v_ptr, q_ptr, kc_ptr, vc_ptr,  # the forward's inputs (see the forward)
    gate_ptr,     # (H,) gate logits, accumulation dtype
    len_ptr,      # (B,) int64 lengths (HAS_LEN)
    out_ptr,      # (B, H, T, d_h) the forward's output O
    lse_ptr,      # (B, H, T) the forward's log-sum-exp
    do_ptr,       # (B, H, T, d_h) ∂L/∂O
    dq_rot_ptr,   # (B, H, T, d_h) out: ∂L/∂q̃
    dq_ptr,       # (B, H, T, d_h) out: ∂L/∂q (the cross part's)
    dkc_ptr,      # out: S = T: (B, H, T, Λ', d_h) ∂L/∂kc; S = 1: (B, H, M_BLOCKS, Λ', d_h) partials
    dvc_ptr,      # out: as dkc_ptr, for vc
    delta_ptr,    # (B, H, T) out: D_i = dO_i·(O_i − σ O^cross_i), accumulation dtype
    dgate_ptr,    # (B, H, M_BLOCKS) out: σ(1−σ) Σ dO·O^cross per query block
    B, H, H_KV, T, L,
    sqr_b, sqr_h, sqr_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sq_b, sq_h, sq_t,  # element strides, as the forward's
    skc_b, skc_h, skc_s, skc_l, svc_b, svc_h, svc_s, svc_l,
    so_b, so_h, so_t,                # out
    sdo_b, sdo_h, sdo_t,             # ∂L/∂O
    sdqr_b, sdqr_h, sdqr_t,          # ∂L/∂q̃
    sdq_b, sdq_h, sdq_t,             # ∂L/∂q
    sdkc_b, sdkc_h, sdkc_s, sdkc_l,  # ∂L/∂kc (S = T; the S = 1 partials are contiguous)
    sdvc_b, sdvc_h, sdvc_s, sdvc_l,  # ∂L/∂vc
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,           # query rows per program
    BLOCK_N: tl.constexpr,           # keys per step (BLOCK_M % BLOCK_N == 0)
    BLOCK_D: tl.constexpr,
    PER_ROW: tl.constexpr, HAS_CROSS: tl.constexpr, HAS_LEN: tl.constexpr, F64: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    n_bh = B * H
    bh = pid % n_bh
    n_mb = (T + BLOCK_M - 1) // BLOCK_M
    mb = n_mb - 1 - pid // n_bh
    m0 = mb * BLOCK_M
    b = bh // H
    h = bh % H
    g = h % H_KV
    if HAS_LEN:
        length = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), T).to(tl.int32)
    else:
        length = T
    offs_m = tl.arange(0, BLOCK_M)
    rows = m0 + offs_m
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    row_ok = rows < length
    tile_ok = row_ok[:, None] & col_ok[None, :]
    st_ok = (rows < T)[:, None] & col_ok[None, :]
    b64, h64, g64, m64 = b.to(tl.int64), h.to(tl.int64), g.to(tl.int64), m0.to(tl.int64)
    k_base = k_rot_ptr + b64 * sk_b + g64 * sk_h
    v_base = v_ptr + b64 * sv_b + g64 * sv_h
    r2 = offs_m[:, None]
    c2 = cols[None, :]

    sig = 1.0 / (1.0 + tl.exp(-tl.load(gate_ptr + h)))
    c = 1.0 / tl.sqrt(tl.full((), HEAD_DIM, sig.dtype))
    # dO past the length reads as 0, so it reaches no gradient.
    do = tl.load(do_ptr + (b64 * sdo_b + h64 * sdo_h + m64 * sdo_t) + (r2 * sdo_t + c2), mask=tile_ok, other=0.0)
    o = tl.load(out_ptr + (b64 * so_b + h64 * so_h + m64 * so_t) + (r2 * so_t + c2), mask=tile_ok, other=0.0)
    delta = tl.sum(do.to(sig.dtype) * o.to(sig.dtype), 1)  # dO·O; minus σ dO·O^cross below

    # ---- the cross part: dq, dkc, dvc, the gate partial; with t = dO·O^cross = Σ_λ a_λ dO·vc_λ,
    # dz_λ = σ a_λ (dO·vc_λ − t), so three short passes over λ need no O^cross tile ----
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, sig.dtype)
    if HAS_CROSS:
        qq = tl.load(q_ptr + (b64 * sq_b + h64 * sq_h + m64 * sq_t) + (r2 * sq_t + c2), mask=tile_ok, other=0.0)
        if PER_ROW:
            kc_base = kc_ptr + b64 * skc_b + h64 * skc_h + m64 * skc_s
            vc_base = vc_ptr + b64 * svc_b + h64 * svc_h + m64 * svc_s
            kc_offs = r2 * skc_s + c2
            vc_offs = r2 * svc_s + c2
            dkc_ptrs = dkc_ptr + (b64 * sdkc_b + h64 * sdkc_h + m64 * sdkc_s) + (r2 * sdkc_s + c2)
            dvc_ptrs = dvc_ptr + (b64 * sdvc_b + h64 * sdvc_h + m64 * sdvc_s) + (r2 * sdvc_s + c2)
            ctx_ok = tile_ok
        else:
            kc_base = kc_ptr + b64 * skc_b + h64 * skc_h
            vc_base = vc_ptr + b64 * svc_b + h64 * svc_h
            kc_offs = c2
            vc_offs = c2
            ctx_ok = col_ok[None, :]
        part_base = (bh.to(tl.int64) * n_mb + mb) * L * HEAD_DIM  # S = 1: this block's partials
        m_c, l_c = _cross_stats(qq, kc_base, kc_offs, ctx_ok, L, skc_l, c, HEAD_DIM, BLOCK_M)
        t = tl.full([BLOCK_M], 0.0, sig.dtype)
        for lam in tl.range(0, L, num_stages=1):  # t, and dvc_λ = σ a_λ dO
            lam64 = tl.cast(lam, tl.int64)
            kc = tl.load(kc_base + lam64 * skc_l + kc_offs, mask=ctx_ok, other=0.0)
            vc = tl.load(vc_base + lam64 * svc_l + vc_offs, mask=ctx_ok, other=0.0)
            # rows past the length: a = 0, and no 0 · NaN from S = 1's summaries of an empty row
            a = tl.where(row_ok, tl.exp(tl.sum(qq.to(sig.dtype) * kc.to(sig.dtype), 1) * c - m_c) / l_c, 0.0)
            t += tl.where(row_ok, a * tl.sum(do.to(sig.dtype) * vc.to(sig.dtype), 1), 0.0)
            dvc = (sig * a)[:, None] * do.to(sig.dtype)
            if PER_ROW:  # rows past the length hold exact zeros (dO reads 0 there)
                tl.store(dvc_ptrs + lam64 * sdvc_l, dvc.to(dvc_ptr.dtype.element_ty), mask=st_ok)
            else:
                tl.store(dvc_ptr + part_base + lam64 * HEAD_DIM + cols, tl.sum(dvc, 0), mask=col_ok)
        for lam in tl.range(0, L, num_stages=1):  # dq += c dz_λ kc_λ, dkc_λ = c dz_λ q
            lam64 = tl.cast(lam, tl.int64)
            kc = tl.load(kc_base + lam64 * skc_l + kc_offs, mask=ctx_ok, other=0.0)
            vc = tl.load(vc_base + lam64 * svc_l + vc_offs, mask=ctx_ok, other=0.0)
            a = tl.exp(tl.sum(qq.to(sig.dtype) * kc.to(sig.dtype), 1) * c - m_c) / l_c
            dz = tl.where(row_ok, (sig * c) * a * (tl.sum(do.to(sig.dtype) * vc.to(sig.dtype), 1) - t), 0.0)
            dq += dz[:, None] * kc.to(sig.dtype)
            dkc = dz[:, None] * qq.to(sig.dtype)
            if PER_ROW:
                tl.store(dkc_ptrs + lam64 * sdkc_l, dkc.to(dkc_ptr.dtype.element_ty), mask=st_ok)
            else:
                tl.store(dkc_ptr + part_base + lam64 * HEAD_DIM + cols, tl.sum(dkc, 0), mask=col_ok)
        tl.store(dgate_ptr + bh.to(tl.int64) * n_mb + mb, sig * (1.0 - sig) * tl.sum(t, 0))
        delta -= sig * t
    else:
        tl.store(dgate_ptr + bh.to(tl.int64) * n_mb + mb, sig * 0.0)
    tl.store(dq_ptr + (b64 * sdq_b + h64 * sdq_h + m64 * sdq_t) + (r2 * sdq_t + c2),
             tl.where(row_ok[:, None], dq, 0.0).to(dq_ptr.dtype.element_ty), mask=st_ok)
    tl.store(delta_ptr + bh.to(tl.int64) * T + rows, delta, mask=rows < T)

    # ---- the self part: dq̃ over the key blocks at or left of the diagonal ----
    qr = tl.load(q_rot_ptr + (b64 * sqr_b + h64 * sqr_h + m64 * sqr_t) + (r2 * sqr_t + c2), mask=tile_ok,
                 other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * T + rows, mask=row_ok, other=0.0)
    if F64:
        c_exp = c
        lse_e = lse
    else:
        c_exp = c * 1.4426950408889634
        lse_e = lse * 1.4426950408889634
    dq_rot = tl.full([BLOCK_M, BLOCK_D], 0.0, sig.dtype)
    for n0 in range(0, tl.where(m0 < length, m0, 0), BLOCK_N):
        dq_rot = _dq_inner(dq_rot, qr, do, lse_e, delta, k_base, v_base, sk_t, sv_t, rows, n0, length,
                           c_exp, HEAD_DIM, BLOCK_N, BLOCK_D, False, F64, UPCAST)
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, length), BLOCK_N):
        dq_rot = _dq_inner(dq_rot, qr, do, lse_e, delta, k_base, v_base, sk_t, sv_t, rows, n0, length,
                           c_exp, HEAD_DIM, BLOCK_N, BLOCK_D, True, F64, UPCAST)
    dq_rot = tl.where(row_ok[:, None], dq_rot * c, 0.0)
    tl.store(dq_rot_ptr + (b64 * sdqr_b + h64 * sdqr_h + m64 * sdqr_t) + (r2 * sdqr_t + c2),
             dq_rot.to(dq_rot_ptr.dtype.element_ty), mask=st_ok)


@triton.jit
def _dkv_inner(dk, dv, k, v, qr_base, qr_st, do_base, do_st, stat_base, lse_ptr, delta_ptr, keys, m0, length, c_exp,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK: tl.constexpr, F64: tl.constexpr, UPCAST: tl.constexpr, SAME_T_STRIDE: tl.constexpr):
    """dV += Pᵀ dO and dk̃ += dSᵀ Q̃ (c applied by the caller) over the query rows
    [m0, m0 + BLOCK_M) of one head. Rows past the length read as 0 (q̃, dO, lse, D) and add
    exactly 0; MASK adds the causal mask for row blocks that cross the diagonal."""
    offs_m = tl.arange(0, BLOCK_M)
    rows = m0 + offs_m
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < length
    tile_ok = row_ok[:, None] & (cols < HEAD_DIM)[None, :]
    m64 = tl.cast(m0, tl.int64)
    qr_offs = offs_m[:, None] * qr_st + cols[None, :]
    if SAME_T_STRIDE:  # one offset tile for both loads (a second one spills at d_h 128 on sm_90)
        do_offs = qr_offs
    else:
        do_offs = offs_m[:, None] * do_st + cols[None, :]
    qr = tl.load(qr_base + m64 * qr_st + qr_offs, mask=tile_ok, other=0.0)
    do = tl.load(do_base + m64 * do_st + do_offs, mask=tile_ok, other=0.0)
    lse = tl.load(lse_ptr + stat_base + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + stat_base + rows, mask=row_ok, other=0.0)
    if UPCAST:
        s_t = tl.dot(k.to(tl.float32), tl.trans(qr).to(tl.float32), input_precision="ieee")
        dp_t = tl.dot(v.to(tl.float32), tl.trans(do).to(tl.float32), input_precision="ieee")
    else:
        s_t = tl.dot(k, tl.trans(qr), input_precision="ieee")  # (BLOCK_N, BLOCK_M): Sᵀ
        dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
    s_t = s_t * c_exp
    if MASK:
        s_t = tl.where((rows[None, :] >= keys[:, None]) & row_ok[None, :], s_t, float("-inf"))
    if F64:
        p_t = tl.exp(s_t - lse[None, :])
    else:
        p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)
    ds_t = p_t * (dp_t - delta[None, :])
    if UPCAST:
        dv = tl.dot(p_t.to(do.dtype).to(tl.float32), do.to(tl.float32), dv, input_precision="ieee")
        dk = tl.dot(ds_t.to(qr.dtype).to(tl.float32), qr.to(tl.float32), dk, input_precision="ieee")
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee", out_dtype=dv.dtype)
        dk = tl.dot(ds_t.to(qr.dtype), qr, dk, input_precision="ieee", out_dtype=dk.dtype)
    return dk, dv


@triton.jit
def _gcla_bwd_dkv_kernel(
    q_rot_ptr,    # (B, H, T, d_h)
    k_rot_ptr,    # (B, H_kv, T, d_h)
    v_ptr,        # (B, H_kv, T, d_h)
    gate_ptr,     # (H,) accumulation dtype (only its dtype is used)
    len_ptr,      # (B,) int64 lengths (HAS_LEN)
    lse_ptr,      # (B, H, T) the forward's log-sum-exp
    do_ptr,       # (B, H, T, d_h) ∂L/∂O
    delta_ptr,    # (B, H, T) D, from the dq pass
    dk_ptr,       # out, (SPLIT·B, H_kv, T, d_h): ∂L/∂k̃ (SPLIT = 1, input dtype), else float partials,
    dv_ptr,       # out, as dk_ptr: ∂L/∂v             split s of batch row b at row s·B + b
    B, H, H_KV, T,
    SPLIT,        # programs sharing one (key block, b, g): each takes every SPLIT-th head of the group
    sqr_b, sqr_h, sqr_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,  # element strides (b, head, t): q_rot, k_rot, v,
    sdo_b, sdo_h, sdo_t, sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t,  # ∂L/∂O, ∂L/∂k̃, ∂L/∂v
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,           # query rows per step
    BLOCK_N: tl.constexpr,           # keys per program (BLOCK_N % BLOCK_M == 0)
    BLOCK_D: tl.constexpr,
    HAS_LEN: tl.constexpr, F64: tl.constexpr, UPCAST: tl.constexpr,
    SAME_T_STRIDE: tl.constexpr,     # q_rot and ∂L/∂O have one t stride (the model's views, contiguous inputs)
):
    pid = tl.program_id(0)
    n_bg = B * H_KV
    n_work = n_bg * SPLIT
    n0 = (pid // n_work) * BLOCK_N  # the first key blocks have the most rows: they start first
    work = pid % n_work
    bg = work % n_bg
    split = work // n_bg
    b = bg // H_KV
    g = bg % H_KV
    if HAS_LEN:
        length = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), T).to(tl.int32)
    else:
        length = T
    offs_n = tl.arange(0, BLOCK_N)
    keys = n0 + offs_n
    cols = tl.arange(0, BLOCK_D)
    key_ok = keys < length
    b64, g64, n64 = b.to(tl.int64), g.to(tl.int64), n0.to(tl.int64)
    k2 = offs_n[:, None]
    c2 = cols[None, :]
    tile_ok = key_ok[:, None] & (cols < HEAD_DIM)[None, :]
    k = tl.load(k_rot_ptr + (b64 * sk_b + g64 * sk_h + n64 * sk_t) + (k2 * sk_t + c2), mask=tile_ok, other=0.0)
    v = tl.load(v_ptr + (b64 * sv_b + g64 * sv_h + n64 * sv_t) + (k2 * sv_t + c2), mask=tile_ok, other=0.0)
    acc_like = tl.load(gate_ptr)
    c = 1.0 / tl.sqrt(tl.full((), HEAD_DIM, acc_like.dtype))
    if F64:
        c_exp = c
    else:
        c_exp = c * 1.4426950408889634
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, acc_like.dtype)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, acc_like.dtype)
    # Rows crossing this key block's diagonal: [n0, min(n0 + BLOCK_N, len)); the rows below,
    # up to the length, see every key of the block. This program's heads h ≡ g (mod H_kv) of
    # the group in order: a fixed summation order, no atomics.
    diag_end = tl.maximum(tl.minimum(n0 + BLOCK_N, length), n0)
    for h in range(g + split * H_KV, H, SPLIT * H_KV):
        h64 = tl.cast(h, tl.int64)
        qr_base = q_rot_ptr + b64 * sqr_b + h64 * sqr_h
        do_base = do_ptr + b64 * sdo_b + h64 * sdo_h
        stat_base = (b64 * H + h64) * T
        for m0 in range(n0, diag_end, BLOCK_M):
            dk, dv = _dkv_inner(dk, dv, k, v, qr_base, sqr_t, do_base, sdo_t, stat_base, lse_ptr, delta_ptr, keys, m0,
                                length, c_exp, HEAD_DIM, BLOCK_M, BLOCK_D, True, F64, UPCAST, SAME_T_STRIDE)
        for m0 in range(n0 + BLOCK_N, length, BLOCK_M):
            dk, dv = _dkv_inner(dk, dv, k, v, qr_base, sqr_t, do_base, sdo_t, stat_base, lse_ptr, delta_ptr, keys, m0,
                                length, c_exp, HEAD_DIM, BLOCK_M, BLOCK_D, False, F64, UPCAST, SAME_T_STRIDE)
    st_ok = (keys < T)[:, None] & (cols < HEAD_DIM)[None, :]
    out_b = b64 + split.to(tl.int64) * B
    tl.store(dk_ptr + (out_b * sdk_b + g64 * sdk_h + n64 * sdk_t) + (k2 * sdk_t + c2),
             tl.where(key_ok[:, None], dk * c, 0.0).to(dk_ptr.dtype.element_ty), mask=st_ok)
    tl.store(dv_ptr + (out_b * sdv_b + g64 * sdv_h + n64 * sdv_t) + (k2 * sdv_t + c2),
             tl.where(key_ok[:, None], dv, 0.0).to(dv_ptr.dtype.element_ty), mask=st_ok)


# ---------------------------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Blocks:
    """Tile sizes and launch options of one kernel: query rows (``block_m``) × keys (``block_n``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class LaunchConfig:
    """The three kernels' blocks: forward, dq pass (block_m % block_n == 0 for both) and dk/dv
    pass (block_n % block_m == 0)."""

    fwd: Blocks
    dq: Blocks
    dkv: Blocks


def block_d(head_dim: int) -> int:
    """Tile width for ``head_dim``: the next power of two, at least 16 (``tl.dot``'s minimum K)."""
    return max(16, next_power_of_2(head_dim))


def check_head_dim(head_dim: int) -> None:
    """Raise ``ValueError`` unless the kernels support ``head_dim`` (even, 2 … 256)."""
    if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the triton gcla_attention kernels support even head widths d_h in [2, {MAX_HEAD_DIM}] "
                         f"(tiles of 16, 32, 64, 128 or 256 columns; powers of two waste none), got d_h = {head_dim}")


def launch_config(head_dim: int, dtype: torch.dtype, arch: Optional[int]) -> LaunchConfig:
    """Blocks for ``head_dim`` and ``dtype`` on compute capability ``arch`` (e.g. 90, 80), or
    for the CPU interpreter (``arch=None``: small tiles, so that small test shapes still span
    several blocks; warps mean nothing there).

    Every choice is compiled ahead of time for sm_90 and sm_80 under the supported Tritons
    (``gpu-report``, tests/test_triton_aot.py): no spills, shared memory within the per-block
    limit. bf16/fp16: the forward keeps 128-row query blocks where registers allow (64 at
    d_h 128 on sm_80); the dq pass streams narrow key blocks under a tall query block, the
    dk/dv pass the reverse, as in FlashAttention-2's Triton kernels (16 query rows per step
    at d_h 128: 32 spill on sm_90). float32 ("ieee", FMA dot products) holds whole d_h-long
    operand rows in registers: it is taken up to d_h 64 only (``ValueError`` beyond, where
    the forward and dq pass spill in every configuration; the ``cuda`` backend takes it).
    d_h 256 is untuned.
    """
    if arch is None:
        return LaunchConfig(Blocks(32, 16, 1, 1), Blocks(32, 16, 1, 1), Blocks(16, 32, 1, 1))
    bd = block_d(head_dim)
    if dtype == torch.float64:
        return LaunchConfig(Blocks(32, 16, 4, 1), Blocks(32, 16, 4, 1), Blocks(16, 32, 4, 1))
    if dtype == torch.float32:  # exact float32 FMA products ("ieee"): no tensor cores
        if head_dim > FP32_MAX_HEAD_DIM:
            raise ValueError(f"the triton gcla_attention kernels take float32 on a GPU only up to d_h = "
                             f"{FP32_MAX_HEAD_DIM}, got d_h = {head_dim}: float32's exact (FMA) products hold "
                             f"d_h-long operand rows in registers, which spill beyond; use bfloat16/float16, or "
                             f"the cuda backend (wiola_kernels.use_backend('cuda'))")
        if arch >= 90:
            return LaunchConfig(Blocks(64, 32, 8, 2), Blocks(32, 16, 8, 2), Blocks(16, 64, 4, 2))
        # sm_80: a 4-warp forward (8 warps spill under Triton 3.6)
        return LaunchConfig(Blocks(32, 32, 4, 2), Blocks(64, 32, 8, 2), Blocks(16, 64, 4, 2))
    if bd <= 64:
        # The dk/dv pass: 64 keys per program (128 spill on sm_90 under Triton 3.6), and on sm_80
        # 16 query rows per step (32 spill under Triton 3.6).
        return LaunchConfig(Blocks(128, 64, 8, 3), Blocks(128, 32, 8, 3), Blocks(32 if arch >= 90 else 16, 64, 8, 3))
    if bd == 128:
        if arch >= 90:
            return LaunchConfig(Blocks(128, 64, 8, 3), Blocks(64, 64, 8, 2), Blocks(16, 64, 8, 2))
        return LaunchConfig(Blocks(64, 64, 8, 2), Blocks(64, 64, 8, 2), Blocks(16, 64, 8, 2))
    return LaunchConfig(Blocks(64, 32, 8, 2), Blocks(32, 32, 8, 2), Blocks(16, 32, 8, 2))


def dkv_split(batch: int, heads: int, kv_heads: int, seq_len: int, block_n: int, sms: Optional[int]) -> int:
    """Programs that share one (key block, b, kv group) of the dk/dv pass: 1 when the grid of
    cdiv(T, BLOCK_N)·B·H_kv programs covers the ``sms`` SMs, else enough to cover them, at most
    the group's H/H_kv heads (each split takes every SPLIT-th head; its float partials are
    summed afterwards). ``sms=None`` (the interpreter): 1."""
    programs = cdiv(seq_len, block_n) * batch * kv_heads
    if sms is None or programs == 0 or programs >= sms:
        return 1
    return max(1, min(heads // kv_heads, cdiv(sms, programs)))


@functools.lru_cache(maxsize=None)
def _device_arch(device: torch.device) -> tuple[Optional[int], Optional[int]]:
    """(compute capability, SM count) of a CUDA device; (None, None) for the interpreter.
    Asked once per device (a device-property query per launch is host time)."""
    if device.type != "cuda":
        return None, None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor, torch.cuda.get_device_properties(device).multi_processor_count


def _needs_park(dims: tuple, dtype: torch.dtype) -> bool:
    return dims[-1] > 0 and torch.finfo(dtype).bits == 16


def _upcast(dtype: torch.dtype, device_type: str) -> bool:
    return dtype == torch.bfloat16 and device_type != "cuda"  # the interpreter's bf16 dot is wrong


@dataclass
class KernelLaunch:
    """One launch: ``kernel[(grid,)](*args, **constexprs, num_warps=…, num_stages=…)``. ``args``
    are tensors (or ``aot.DevicePointer`` stand-ins, for compiling ahead of time) and ints,
    in the kernel's order."""

    kernel: object
    grid: int
    args: tuple
    constexprs: dict
    num_warps: int
    num_stages: int

    def launch(self) -> None:
        self.kernel[(self.grid,)](*self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def _strides(*tensors) -> tuple:
    """The kernels' stride arguments: every dimension but the last (d_h, contiguous) of each
    tensor, in order; ``None`` (the S = 1 context gradients, written as contiguous partials)
    gives zeros for a 5-D tensor. ``tensors`` may be meta tensors (ahead-of-time launches)."""
    return tuple(x for t in tensors for x in ((0, 0, 0, 0) if t is None else t.stride()[:-1]))


def _fwd_launch(q_rot, k_rot, v, q, kc, vc, gate_acc, lengths, out, lse, dims, cfg: LaunchConfig, dtype,
                device_type, park=None, layout=None) -> KernelLaunch:
    """``layout``: tensors with the strides of (q_rot, k_rot, v, q, kc, vc, out) when the
    launch arguments carry none (ahead-of-time stand-ins); default the arguments themselves."""
    B, H, H_kv, T, D, S, L = dims
    blk = cfg.fwd
    l_qr, l_k, l_v, l_q, l_kc, l_vc, l_o = layout or (q_rot, k_rot, v, q, kc, vc, out)
    same = l_qr.stride() == l_q.stride() == l_o.stride() and l_k.stride() == l_v.stride() and \
        l_kc.stride() == l_vc.stride()
    return KernelLaunch(
        _gcla_fwd_kernel, cdiv(T, blk.block_m) * B * H,
        (q_rot, k_rot, v, q, kc, vc, gate_acc, gate_acc if lengths is None else lengths, out, lse,
         out if park is None else park, B, H, H_kv, T, L, *_strides(l_qr, l_k, l_v, l_q, l_kc, l_vc, l_o)),
        dict(HEAD_DIM=D, BLOCK_M=blk.block_m, BLOCK_N=blk.block_n, BLOCK_D=block_d(D), PER_ROW=S != 1,
             HAS_CROSS=L > 0, HAS_LEN=lengths is not None, F64=dtype == torch.float64,
             UPCAST=_upcast(dtype, device_type), SAME_T_STRIDE=same),
        blk.num_warps, blk.num_stages)


def _bwd_launches(grad_out, q_rot, k_rot, v, q, kc, vc, gate_acc, lengths, out, lse, dq_rot, dq, dkc, dvc, delta,
                  dgate_part, dk, dv, dims, cfg: LaunchConfig, split: int, dtype, device_type,
                  layout=None) -> tuple[KernelLaunch, KernelLaunch]:
    """The dq pass and the dk/dv pass. ``dk``/``dv``: the gradients (``split == 1``) or the
    (split·B, H_kv, T, d_h) float partials. ``layout``: tensors with the strides of (grad_out,
    q_rot, k_rot, v, q, kc, vc, out, dq_rot, dq, dkc, dvc, dk, dv) for ahead-of-time stand-ins;
    default the arguments themselves."""
    B, H, H_kv, T, D, S, L = dims
    (l_do, l_qr, l_k, l_v, l_q, l_kc, l_vc, l_o, l_dqr, l_dq, l_dkc, l_dvc, l_dk, l_dv) = layout or (
        grad_out, q_rot, k_rot, v, q, kc, vc, out, dq_rot, dq, dkc, dvc, dk, dv)
    if S == 1:  # the context gradients are contiguous per-block partials, addressed by the kernel
        l_dkc = l_dvc = None
    lens = gate_acc if lengths is None else lengths
    common = dict(HEAD_DIM=D, BLOCK_D=block_d(D), HAS_LEN=lengths is not None, F64=dtype == torch.float64,
                  UPCAST=_upcast(dtype, device_type))
    dq_blk, kv_blk = cfg.dq, cfg.dkv
    dq_pass = KernelLaunch(
        _gcla_bwd_dq_kernel, cdiv(T, dq_blk.block_m) * B * H,
        (q_rot, k_rot, v, q, kc, vc, gate_acc, lens, out, lse, grad_out, dq_rot, dq, dkc, dvc, delta, dgate_part,
         B, H, H_kv, T, L, *_strides(l_qr, l_k, l_v, l_q, l_kc, l_vc, l_o, l_do, l_dqr, l_dq, l_dkc, l_dvc)),
        dict(common, BLOCK_M=dq_blk.block_m, BLOCK_N=dq_blk.block_n, PER_ROW=S != 1, HAS_CROSS=L > 0),
        dq_blk.num_warps, dq_blk.num_stages)
    dkv_pass = KernelLaunch(
        _gcla_bwd_dkv_kernel, cdiv(T, kv_blk.block_n) * B * H_kv * split,
        (q_rot, k_rot, v, gate_acc, lens, lse, grad_out, delta, dk, dv, B, H, H_kv, T, split,
         *_strides(l_qr, l_k, l_v, l_do, l_dk, l_dv)),
        dict(common, BLOCK_M=kv_blk.block_m, BLOCK_N=kv_blk.block_n, SAME_T_STRIDE=l_qr.stride(2) == l_do.stride(2)),
        kv_blk.num_warps, kv_blk.num_stages)
    return dq_pass, dkv_pass


# ---------------------------------------------------------------------------------------------
# Launchers (strided inputs with d_h contiguous, shapes validated by the op)
# ---------------------------------------------------------------------------------------------

def _dims(q_rot: torch.Tensor, k_rot: torch.Tensor, kc: torch.Tensor) -> tuple:
    B, H, T, D = q_rot.shape
    return B, H, k_rot.shape[1], T, D, kc.shape[2], kc.shape[3]


def gcla_attention_fwd(q_rot, k_rot, v, q, kc, vc, gate, lengths, config: Optional[LaunchConfig] = None):
    """``(out (B, H, T, d_h), lse (B, H, T))`` on inputs with any strides but a contiguous
    ``d_h``; ``out`` laid out like ``q_rot`` (``torch.empty_like``); ``lengths`` int64 or None.

    ``config`` overrides :func:`launch_config` (tests use it to force several blocks)."""
    dims = _dims(q_rot, k_rot, kc)
    B, H, H_kv, T, D, S, L = dims
    check_head_dim(D)
    acc = compute_dtype(q_rot.dtype)
    out = empty_output_as(q_rot)
    lse = empty_output((B, H, T), dtype=acc, device=q_rot.device)
    if B * H * T == 0:
        return out, lse
    cfg = config or launch_config(D, q_rot.dtype, _device_arch(q_rot.device)[0])
    # σ·O^cross is parked between the kernel's prologue and epilogue: in float32 scratch for
    # 16-bit outputs (a bf16 park adds a rounding that D = dO·(O − σ O^cross) then sees).
    park = torch.empty_like(out, dtype=acc) if _needs_park(dims, q_rot.dtype) else None  # strided like out
    _fwd_launch(q_rot, k_rot, v, q, kc, vc, gate.to(acc).contiguous(), lengths, out, lse, dims, cfg,
                q_rot.dtype, q_rot.device.type, park).launch()
    return out, lse


def gcla_attention_bwd(grad_out, q_rot, k_rot, v, q, kc, vc, gate, lengths, out, lse,
                       config: Optional[LaunchConfig] = None, split: Optional[int] = None):
    """``(d q_rot, d k_rot, d v, d q, d kc, d vc, d gate)`` on strided inputs (the forward's
    ``out`` and ``lse``), each laid out like its input (``d kc``/``d vc`` contiguous for S = 1);
    two launches, then the fixed-order sums of the S = 1, gate and (small grids) dk/dv
    partials. ``config`` and ``split`` override :func:`launch_config` and :func:`dkv_split`."""
    dims = _dims(q_rot, k_rot, kc)
    B, H, H_kv, T, D, S, L = dims
    check_head_dim(D)
    dev, dt = q_rot.device, q_rot.dtype
    acc = compute_dtype(dt)
    dq_rot, dq, dk, dv = empty_output_as(q_rot), empty_output_as(q), empty_output_as(k_rot), empty_output_as(v)
    if B * H * T == 0:
        return (dq_rot, dk, dv, dq, torch.zeros(kc.shape, dtype=dt, device=dev),
                torch.zeros(vc.shape, dtype=dt, device=dev), torch.zeros_like(gate))
    arch, sms = _device_arch(dev)
    cfg = config or launch_config(D, dt, arch)
    if split is None:
        split = dkv_split(B, H, H_kv, T, cfg.dkv.block_n, sms)
    n_mb = cdiv(T, cfg.dq.block_m)
    if S != 1:
        dkc, dvc = empty_output_as(kc), empty_output_as(vc)
    else:  # per-(query block) partials, summed below in a fixed order
        dkc = empty_output((B, H, n_mb, L, D), dtype=acc, device=dev)
        dvc = empty_output((B, H, n_mb, L, D), dtype=acc, device=dev)
    delta = empty_output((B, H, T), dtype=acc, device=dev)
    dgate_part = empty_output((B, H, n_mb), dtype=acc, device=dev)
    if split > 1:  # per-split float partials of dk̃ and dV, summed below in split order
        dk_part = empty_output((split * B, H_kv, T, D), dtype=acc, device=dev)
        dv_part = empty_output((split * B, H_kv, T, D), dtype=acc, device=dev)
    else:
        dk_part, dv_part = dk, dv
    for launch in _bwd_launches(grad_out, q_rot, k_rot, v, q, kc, vc, gate.to(acc).contiguous(), lengths, out, lse,
                                dq_rot, dq, dkc, dvc, delta, dgate_part, dk_part, dv_part, dims, cfg, split, dt,
                                dev.type):
        launch.launch()
    if split > 1:
        dk.copy_(dk_part.view(split, B, H_kv, T, D).sum(0))
        dv.copy_(dv_part.view(split, B, H_kv, T, D).sum(0))
    if S == 1:
        dkc = dkc.sum(2, keepdim=True).to(dt)
        dvc = dvc.sum(2, keepdim=True).to(dt)
    dgate = dgate_part.sum((0, 2)).to(gate.dtype)
    return dq_rot, dk, dv, dq, dkc, dvc, dgate


# ---------------------------------------------------------------------------------------------
# Ahead-of-time launches (wiola_kernels/triton/aot.py, gpu-report)
# ---------------------------------------------------------------------------------------------

def _meta_layouts(dims: tuple, model_layout: bool, split: int) -> tuple[tuple, tuple]:
    """Meta tensors with the strides of the forward's and the backward's tensors (the
    ``layout`` arguments of the launch builders): contiguous ``(B, ·, T, d_h)`` (the tests),
    or the model's transposed ``(B, T, ·, d_h)`` views and ``(B, S, Λ', H, d_h)`` permuted
    contexts (every output then takes its input's layout); dk/dv partials are contiguous."""
    B, H, H_kv, T, D, S, L = dims

    def heads(n):
        if model_layout:
            return torch.empty((B, T, n, D), device="meta").transpose(1, 2)
        return torch.empty((B, n, T, D), device="meta")

    def ctx():
        if model_layout:
            return torch.empty((B, S, L, H, D), device="meta").permute(0, 3, 1, 2, 4)
        return torch.empty((B, H, S, L, D), device="meta")

    q, kv, c = heads(H), heads(H_kv), ctx()
    dkv = kv if split == 1 else torch.empty((split * B, H_kv, T, D), device="meta")
    return (q, kv, kv, q, c, c, q), (q, q, kv, kv, q, c, c, q, q, q, c, c, dkv, dkv)


def aot_launches(sms: int, arch: int = 90):
    """Every launch of the three kernels at the GPU test shapes and the bench shapes (both
    summary modes, contiguous and the model's views) on a GPU of compute capability ``arch``
    with ``sms`` SMs, for ``wiola_kernels/triton/aot.py`` (``gpu-report``). GCLA is compute
    bound (tensor cores), so no bytes-in-flight target applies."""
    from .. import shapes
    from .aot import DevicePointer, Launch

    cases = [(f"test {c[:5]} {c[5]}{' lengths' if c[6] else ''} {dtype}", c[:6] + (c[6] is not None,), dtype, False)
             for c, dtypes in shapes.GCLA_GPU_TESTS for dtype in dtypes]
    s = shapes.GCLA_BENCH
    for dh in shapes.GCLA_BENCH_HEAD_DIMS:
        for summary, lengths in (("causal", False), ("paper", True)):
            c = (s["B"], s["H"], s["H_kv"], s["T"], dh, summary, lengths)
            for model in (False, True):  # contiguous, and the model's (B, T, H, d_h) views
                cases.append((f"bench {c[:5]} {summary}{' lengths' if lengths else ''} {shapes.GPU_BENCH_DTYPE}"
                              f"{' (B, T, H, d_h) views' if model else ''}", c, shapes.GPU_BENCH_DTYPE, model))
    for case, (b, h, h_kv, t, dh, summary, lengths), dtype, model in cases:
        acc = compute_dtype(dtype)
        S = t if summary == "causal" else 1
        dims = (b, h, h_kv, t, dh, S, s["L"])
        x, a, i64 = DevicePointer(dtype), DevicePointer(acc), DevicePointer(torch.int64)
        lens = i64 if lengths else None
        cfg = launch_config(dh, dtype, arch)
        split = dkv_split(b, h, h_kv, t, cfg.dkv.block_n, sms)
        ctx = x if S != 1 else a
        dkv = x if split == 1 else a
        fwd_layout, bwd_layout = _meta_layouts(dims, model, split)
        plans = [_fwd_launch(x, x, x, x, x, x, a, lens, x, a, dims, cfg, dtype, "cuda",
                             a if _needs_park(dims, dtype) else None, fwd_layout),
                 *_bwd_launches(x, x, x, x, x, x, x, a, lens, x, a, x, x, ctx, ctx, a, a, dkv, dkv, dims, cfg, split,
                                dtype, "cuda", bwd_layout)]
        for p in plans:
            yield Launch(p.kernel, p.args, p.constexprs, p.num_warps, p.num_stages, p.grid, case, memory_bound=False)
