"""SRPE, spiral rotary position encoding, as one Triton kernel for Q and K (SPEC §4).

For position ``p`` (from ``positions``, not the row index) and pair ``j ∈ [0, d_h/2)``
(rotate-half layout: pairs ``(j, j + d_h/2)``)::

    ω_j    = θ₀^(−2j/d_h)   (or given: a rope type's inv_freq, in float64)
    Θ_j(p) = p · ω_j (1 + 1/k_s)          = p · angle_freq_j
    r_j(p) = 1 + a_s sin(p · f_s ω_j)     = 1 + a_s sin(p · radial_freq_j)
    c = m r cos Θ,   s = m r sin Θ        (m: the output scale, default 1)
    y_j       = x_j c − x_{j+d_h/2} s
    y_{j+d_h/2} = x_j s + x_{j+d_h/2} c

The backward is the transpose, ``∂L/∂x = R(p)ᵀ ∂L/∂y``: the same map with ``s → −s``
(``TRANSPOSE``), so one kernel serves both directions.

Precision: ``p · freq`` is formed and reduced to ``[−π, π)`` in float64 (a float32
product loses ~4e-4 relative at p = 65,536, SPEC §4), then cos/sin and the rotation run
in float32 (float64 throughout for float64 inputs).

Work split: one program per block of ``BLOCK_T`` flattened positions ``(b, t)``. It
computes the ``(BLOCK_T, d_h/2)`` tile of ``(c, s)`` once and applies it to every head
of Q (``H``) and of K (``H_kv``), ``HEADS_PER_STEP`` heads at a time so that several
loads per thread are in flight; the trigonometry is amortised over ``H + H_kv`` heads.
Every tensor is addressed through its strides (``d_h`` contiguous): for contiguous
``(B, H, T, d_h)`` a head's tile rows are consecutive in memory, for the model's
transposed ``(B, T, H, d_h)`` views a step's heads are; either way each ``d_h``-wide row
is one coalesced access. Outputs are allocated with their input's strides
(``empty_output_as``), so the model's layout flows through without a copy. Memory traffic
is one read and one write of Q and K.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..outputs import empty_output_as
from . import cdiv, next_power_of_2, sm_count
from .runtime_table import run

_TWO_PI = 2.0 * math.pi


@triton.jit
def _rotate_heads(x_ptr, out_ptr, c, s, b, t, j, mask, HEADS, HALF, sx_b, sx_h, sx_t, so_b, so_h, so_t,
                  HEADS_PER_STEP: tl.constexpr):
    """Rotate rows (b, head, t) of ``x (B, HEADS, T, 2·HALF)`` (row strides ``sx_*``, ``d_h``
    contiguous) for every head by the ``(BLOCK_T, BLOCK_HALF)`` tile ``(c, s)`` into ``out``
    (row strides ``so_*``), ``HEADS_PER_STEP`` heads per step (their loads are all issued
    before the first use); offsets are int64 (``b``, ``t`` are)."""
    step_heads = tl.arange(0, HEADS_PER_STEP)
    for h0 in range(0, HEADS, HEADS_PER_STEP):
        h = (step_heads + h0).to(tl.int64)
        x_off = (b[None, :] * sx_b + h[:, None] * sx_h + t[None, :] * sx_t)[:, :, None] + j[None, None, :]
        o_off = (b[None, :] * so_b + h[:, None] * so_h + t[None, :] * so_t)[:, :, None] + j[None, None, :]
        m = (h < HEADS)[:, None, None] & mask[None, :, :]
        x1 = tl.load(x_ptr + x_off, mask=m, other=0.0).to(c.dtype)
        x2 = tl.load(x_ptr + x_off + HALF, mask=m, other=0.0).to(c.dtype)
        tl.store(out_ptr + o_off, (x1 * c[None] - x2 * s[None]).to(out_ptr.dtype.element_ty), mask=m)
        tl.store(out_ptr + o_off + HALF, (x1 * s[None] + x2 * c[None]).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _srpe_kernel(
    q_ptr,        # (B, H, T, d_h) queries (or ∂L/∂q_out for the backward), d_h contiguous
    k_ptr,        # (B, H_kv, T, d_h) keys (or ∂L/∂k_out), d_h contiguous
    pos_ptr,      # (B, T) int64 positions (strides pos_sb, pos_st: an expanded (1, T) has pos_sb 0)
    omega_ptr,    # (d_h/2,) float64 frequencies ω_j (θ₀^(−2j/d_h), or given), contiguous
    const_ptr,    # 6 float64 scalars: 1 + 1/k_s, f_s, a_s, 2π, 1/(2π), m (float64 scalars cannot
                  # be arguments: Triton types a Python float as float32)
    q_out_ptr,    # (B, H, T, d_h) output, dtype of q, d_h contiguous
    k_out_ptr,    # (B, H_kv, T, d_h) output, dtype of k, d_h contiguous
    BT,           # B·T: number of positions
    T,            # sequence length
    H,            # query heads
    H_KV,         # key heads
    HALF,         # d_h / 2
    pos_sb, pos_st,              # element strides of positions (b, t)
    q_sb, q_sh, q_st,            # element strides of q (b, head, t); likewise for k and the outputs
    k_sb, k_sh, k_st,
    qo_sb, qo_sh, qo_st,
    ko_sb, ko_sh, ko_st,
    BLOCK_T: tl.constexpr,     # positions per program
    BLOCK_HALF: tl.constexpr,  # next power of two >= d_h/2
    TRANSPOSE: tl.constexpr,   # apply R(p)ᵀ (the backward) instead of R(p)
    F64: tl.constexpr,         # float64 inputs: trigonometry and rotation in float64
    HEADS_PER_STEP: tl.constexpr,  # heads whose loads are in flight together
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # flattened b·T + t, int64
    row_mask = rows < BT
    j = tl.arange(0, BLOCK_HALF)
    col_mask = j < HALF
    mask = row_mask[:, None] & col_mask[None, :]

    # (c, s) for the tile, once. Angles in float64, reduced to [−π, π).
    b = rows // T
    t = rows - b * T
    p = tl.load(pos_ptr + b * pos_sb + t * pos_st, mask=row_mask, other=0).to(tl.float64)
    omega = tl.load(omega_ptr + j, mask=col_mask, other=0.0)
    angle_freq = omega * tl.load(const_ptr)        # ω_j (1 + 1/k_s), rounded once as in the oracle
    radial_freq = omega * tl.load(const_ptr + 1)   # f_s ω_j
    amplitude = tl.load(const_ptr + 2)
    two_pi = tl.load(const_ptr + 3)
    inv_two_pi = tl.load(const_ptr + 4)
    out_scale = tl.load(const_ptr + 5)
    angle = p[:, None] * angle_freq[None, :]
    angle = angle - two_pi * tl.floor(angle * inv_two_pi + 0.5)  # no float64 division
    radial = p[:, None] * radial_freq[None, :]
    radial = radial - two_pi * tl.floor(radial * inv_two_pi + 0.5)
    if F64:
        radius = out_scale * (1.0 + amplitude * tl.sin(radial))
        c = radius * tl.cos(angle)
        s = radius * tl.sin(angle)
    else:
        radius = out_scale.to(tl.float32) * (1.0 + amplitude.to(tl.float32) * tl.sin(radial.to(tl.float32)))
        angle32 = angle.to(tl.float32)
        c = radius * tl.cos(angle32)
        s = radius * tl.sin(angle32)
    if TRANSPOSE:
        s = -s

    # Every head of Q, then of K, at these positions, with the same tile of (c, s).
    _rotate_heads(q_ptr, q_out_ptr, c, s, b, t, j, mask, H, HALF, q_sb, q_sh, q_st, qo_sb, qo_sh, qo_st,
                  HEADS_PER_STEP)
    _rotate_heads(k_ptr, k_out_ptr, c, s, b, t, j, mask, H_KV, HALF, k_sb, k_sh, k_st, ko_sb, ko_sh, ko_st,
                  HEADS_PER_STEP)


def kernel_omega(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """float64 ``ω_j = θ^(−2j/d_h)`` for pairs ``j < d_h/2`` (SPEC §4); the kernel forms
    ``ω_j·(1 + 1/k_s)`` and ``f_s·ω_j`` from it, as it does from given frequencies. Written apart
    from the oracle's (``reference.srpe``) on purpose: a wrong table here cannot pass the tests by
    also being the one the oracle uses (the C++ kernels form theirs in csrc/cpu/srpe_rotation.h)."""
    # Python's float pow is C's pow, the CPU kernel's std::pow: the same ω_j bit for bit on
    # every backend (torch.pow's vectorised pow differs from it by an ulp for some j).
    theta = float(theta)
    return torch.tensor([theta ** (j * (-2.0 / head_dim)) for j in range(head_dim // 2)], dtype=torch.float64,
                        device=device)


def _build_constants(spiral_divisor: float, radial_frequency: float, radial_amplitude: float, scale: float,
                     device: torch.device) -> torch.Tensor:
    """The kernel's 6 float64 scalars (``const_ptr``)."""
    values = (1.0 + 1.0 / spiral_divisor, radial_frequency, radial_amplitude, _TWO_PI, 1.0 / _TWO_PI, scale)
    return torch.tensor(values, dtype=torch.float64, device=device)


_cached_omega = functools.lru_cache(maxsize=64)(kernel_omega)
_cached_constants = functools.lru_cache(maxsize=64)(_build_constants)


def _kernel_tables(head_dim, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq, scale, device):
    """``(ω, constants)`` for the kernel. The default ``ω`` and the constants are built once per
    configuration and device (each costs a tiny launch) and never written afterwards; not
    cached while a CUDA graph is being captured (captured kernels do not run, so a cached
    tensor would stay unwritten). A given ``inv_freq`` is never cached: it is read at every
    call (cast to contiguous float64, a no-op when it already is), so a frequency tensor
    recomputed or updated in place (``dynamic`` rope) is always the one used."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if inv_freq is not None:
        omega = inv_freq.to(device=device, dtype=torch.float64).contiguous()
    else:
        omega = (kernel_omega if capturing else _cached_omega)(head_dim, theta, device)
    constants = (_build_constants if capturing else _cached_constants)(spiral_divisor, radial_frequency,
                                                                      radial_amplitude, scale, device)
    return omega, constants


# Heads per step: a thread's loads in flight per step are HEADS_PER_STEP · 2 halves · 16 B
# (128 B): with the ~4 programs per SM of the launch below, 32 KB per SM at the bench shape.
_HEADS_PER_STEP = 4
_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class LaunchConfig:
    """How ``srpe_apply`` runs the kernel."""

    block_t: int
    block_half: int
    heads_per_step: int
    num_warps: int
    programs: int


def _launch_config(bt: int, half: int, element_size: int, sms: int | None) -> LaunchConfig:
    """The launch for ``bt`` positions and ``half`` pairs per head (``element_size``-byte
    elements). A thread owns 16 contiguous bytes of each half-row (one 128-bit access when
    ``d_h`` allows); tiles of ``BLOCK_T`` positions so that the GPU (``sms`` SMs) gets
    ``_PROGRAMS_PER_SM`` programs per SM, at most 8 warps each. ``sms=None``: the
    interpreter (same head steps, large tiles, few programs: each program is slow there)."""
    block_half = next_power_of_2(half)
    if sms is None:
        block_t = max(1, min(next_power_of_2(bt), 64))
        return LaunchConfig(block_t, block_half, _HEADS_PER_STEP, 1, cdiv(bt, block_t))
    per_thread = max(1, 16 // element_size)
    max_t = max(1, 8 * 32 * per_thread // block_half)  # 8 warps
    block_t = max(1, min(next_power_of_2(cdiv(bt, _PROGRAMS_PER_SM * sms)), max_t))
    num_warps = max(1, min(8, block_t * block_half // (32 * per_thread)))
    return LaunchConfig(block_t, block_half, _HEADS_PER_STEP, num_warps, cdiv(bt, block_t))


def srpe_apply(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float, spiral_divisor: float,
               radial_amplitude: float, radial_frequency: float, transpose: bool, *,
               inv_freq: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m R q, m R k)`` (``Rᵀ`` when ``transpose``) on ``q (B, H, T, d_h)``, ``k (B, H_kv, T, d_h)``
    (any strides, ``d_h`` contiguous) and int64 ``positions (B, T)`` (any strides), with the
    frequencies ``inv_freq (d_h/2,)`` when given (else ``θ₀^(−2j/d_h)``) and the output scale
    ``m = scale``; new outputs laid out like ``q`` and ``k`` (``torch.empty_like``)."""
    b, h, t, dh = q.shape
    h_kv = k.shape[1]
    half = dh // 2
    q_out = empty_output_as(q)
    k_out = empty_output_as(k)
    if b * t == 0 or half == 0:
        return q_out, k_out
    omega, constants = _kernel_tables(dh, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq,
                                      scale, q.device)
    cfg = _launch_config(b * t, half, q.element_size(), sm_count(q.device))
    run(_srpe_kernel, cfg.programs,
        q, k, positions, omega, constants, q_out, k_out, b * t, t, h, h_kv, half, *positions.stride(), *q.stride()[:3],
        *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3],
        BLOCK_T=cfg.block_t, BLOCK_HALF=cfg.block_half, TRANSPOSE=bool(transpose), F64=q.dtype == torch.float64,
        HEADS_PER_STEP=cfg.heads_per_step, num_warps=cfg.num_warps)
    return q_out, k_out


def aot_launches(sms: int):
    """Every launch of the kernel (forward and transpose) at the GPU test and bench
    shapes (:mod:`wiola_kernels.shapes`), on a GPU with ``sms`` SMs (see
    ``wiola_kernels/triton/aot.py``)."""
    from .. import shapes
    from .aot import DEFAULT_NUM_STAGES, DevicePointer as P, Launch

    # (B, H, T, d_h)-contiguous q/k (the tests and the bench), and the bench shapes in the
    # model's layout, transposed (B, T, H, d_h) views (outputs alike).
    cases = [(f"test q/k {shape} {dtype}", shape, dtype, False) for shape, dtype in shapes.SRPE_GPU_TESTS]
    cases += [(f"bench {size} q/k {shape} {shapes.GPU_BENCH_DTYPE}{' (B, T, H, d_h) views' if model else ''}", shape,
               shapes.GPU_BENCH_DTYPE, model) for size, shape in shapes.SRPE_BENCH.items() for model in (False, True)]
    for case, (b, h, h_kv, t, dh), dtype, model in cases:
        cfg = _launch_config(b * t, dh // 2, torch.empty((), dtype=dtype).element_size(), sms)
        q_st, k_st = ((t * h * dh, dh, h * dh), (t * h_kv * dh, dh, h_kv * dh)) if model else \
            ((h * t * dh, t * dh, dh), (h_kv * t * dh, t * dh, dh))
        for transpose in (False, True):
            yield Launch(_srpe_kernel, (P(dtype), P(dtype), P(torch.int64), P(torch.float64), P(torch.float64),
                                        P(dtype), P(dtype),
                                        b * t, t, h, h_kv, dh // 2, t, 1, *q_st, *k_st, *q_st, *k_st),
                         dict(BLOCK_T=cfg.block_t, BLOCK_HALF=cfg.block_half, TRANSPOSE=transpose,
                              F64=dtype == torch.float64, HEADS_PER_STEP=cfg.heads_per_step),
                         cfg.num_warps, DEFAULT_NUM_STAGES, cfg.programs, case)
