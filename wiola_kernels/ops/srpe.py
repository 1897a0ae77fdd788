"""SRPE as a registered op: ``torch.ops.wiola.srpe`` (+ ``srpe_backward``).

Each backend provides ``apply(q, k, positions, theta, spiral_divisor, radial_amplitude,
radial_frequency, transpose) -> (q_out, k_out)`` on ``q (B, H, T, d_h)``,
``k (B, H_kv, T, d_h)`` with any strides but a contiguous last dimension (the model's
transposed ``(B, T, H, d_h)`` views) and int64 ``positions (B, T)`` with any strides (an
expanded ``(1, T)``); outputs come in the layout of ``torch.empty_like(q)`` /
``empty_like(k)`` — the cpu and triton kernels write them so, the reference's are copied
into it. ``transpose=False`` applies
``R(p)`` (forward); ``transpose=True`` applies ``R(p)ᵀ`` (the backward: rotation by
``−Θ`` scaled by ``r``), so one kernel serves both directions.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch
from ..reference.srpe import srpe as srpe_reference
from ..reference.srpe import srpe_backward as srpe_reference_backward
from ..outputs import in_layout_of, unit_last_stride
from ..srpe_tables import kernel_frequencies
from ..validation import bthd_hint, check_positive, check_rank, check_real, check_same_device, check_same_dtype, check_tensor

OP = "srpe"


def _reference_apply(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, transpose):
    fn = srpe_reference_backward if transpose else srpe_reference
    return fn(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency)


@functools.lru_cache(maxsize=64)
def _cpu_frequencies(head_dim: int, theta: float, spiral_divisor: float,
                     radial_frequency: float) -> tuple[Tensor, Tensor]:
    # Five small tensor ops per call add up for decoding (T = 1); never mutated.
    return kernel_frequencies(head_dim, theta, spiral_divisor, radial_frequency)


def _cpu_apply(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, transpose):
    angle_freq, radial_freq = _cpu_frequencies(q.shape[-1], theta, spiral_divisor, radial_frequency)
    return torch.ops.wiola._srpe(q, k, positions, angle_freq, radial_freq, radial_amplitude, transpose)


def _triton_apply(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, transpose):
    from ..triton import srpe as tk

    return tk.srpe_apply(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, transpose)


dispatch.register(OP, "reference", SimpleNamespace(apply=_reference_apply))
dispatch.register(OP, "cpu", SimpleNamespace(apply=_cpu_apply))
dispatch.register(OP, "triton", SimpleNamespace(apply=_triton_apply))


def max_accurate_position(spiral_divisor: float) -> int:
    """Largest ``|p|`` at which float32 outputs still meet SPEC §9's 1e-5.

    Every backend forms ``p·ω_j·(1 + 1/k_s)`` in float64, whose rounding error is about
    ``p·(1 + 1/k_s)·2^-52`` radians for the worst pair (``ω_0 = 1``); a pair rotated by a
    wrong angle δ has relative error ≈ δ. So ``p ≤ 1e-5·2^52/|1 + 1/k_s|``: about 2^35
    for the default ``k_s = 8``, 2^34 for any ``k_s ≥ 1`` (derivation and mpmath checks
    in tests/test_numerics.py). Capped at 2^53, where int64 → float64 stops being exact.
    """
    factor = abs(1.0 + 1.0 / spiral_divisor)
    return 2**53 if factor == 0.0 else min(2**53, int(1e-5 * 2.0**52 / factor))


def _check_positions(positions: Tensor, spiral_divisor: float) -> None:
    # Inside the op (opaque to torch.compile); CPU only: on a GPU this check would cost a
    # device sync on every call, so CUDA callers get the documented limit without a check.
    if positions.device.type == "cpu" and positions.numel():
        limit = max_accurate_position(spiral_divisor)
        largest = int(positions.abs().max())
        if largest > limit:
            raise ValueError(f"position_ids must lie within ±{limit} (float32 SRPE outputs lose SPEC accuracy "
                             f"beyond it for spiral_divisor={spiral_divisor}), got |p| = {largest}")


@torch.library.custom_op("wiola::srpe", mutates_args=())
def srpe_op(q: Tensor, k: Tensor, positions: Tensor, theta: float, spiral_divisor: float,
            radial_amplitude: float, radial_frequency: float) -> tuple[Tensor, Tensor]:
    """``(R(p) q, R(p) k)`` for ``positions (B, T)`` int64."""
    _check_positions(positions, spiral_divisor)
    impl = dispatch.implementation(OP, q.device)
    q, k = unit_last_stride(q), unit_last_stride(k)
    q_out, k_out = impl.apply(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, False)
    return in_layout_of(q_out, q), in_layout_of(k_out, k)


@srpe_op.register_fake
def _(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency):
    # The inputs' layouts (a transposed (B, T, H, d_h) view stays one): see outputs.py.
    return torch.empty_like(unit_last_stride(q)), torch.empty_like(unit_last_stride(k))


@torch.library.custom_op("wiola::srpe_backward", mutates_args=())
def srpe_backward_op(grad_q: Tensor, grad_k: Tensor, positions: Tensor, theta: float, spiral_divisor: float,
                     radial_amplitude: float, radial_frequency: float,
                     backend: str = "auto") -> tuple[Tensor, Tensor]:
    """``(R(p)ᵀ grad_q, R(p)ᵀ grad_k)`` on the forward's ``backend``."""
    impl = dispatch.backward_implementation(OP, grad_q.device, backend)
    grad_q, grad_k = unit_last_stride(grad_q), unit_last_stride(grad_k)
    dq, dk = impl.apply(grad_q, grad_k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, True)
    return in_layout_of(dq, grad_q), in_layout_of(dk, grad_k)


@srpe_backward_op.register_fake
def _(grad_q, grad_k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, backend="auto"):
    return torch.empty_like(unit_last_stride(grad_q)), torch.empty_like(unit_last_stride(grad_k))


def _setup_context(ctx, inputs, output):
    _q, _k, positions, *params = inputs
    ctx.save_for_backward(positions)
    ctx.params = params
    ctx.backend = dispatch.select(OP, positions.device)


def _backward(ctx, grad_q, grad_k):
    (positions,) = ctx.saved_tensors
    grad_q_in, grad_k_in = srpe_backward_op(grad_q, grad_k, positions, *ctx.params, ctx.backend)
    return grad_q_in, grad_k_in, None, None, None, None, None


torch.library.register_autograd("wiola::srpe", _backward, setup_context=_setup_context)


def srpe(q: Tensor, k: Tensor, position_ids: Tensor, theta: float = 10000.0, spiral_divisor: float = 8.0,
         radial_amplitude: float = 0.1, radial_frequency: float = 0.01) -> tuple[Tensor, Tensor]:
    """Spiral rotary position encoding of queries and keys (SPEC §4), in one launch.

    Layout: ``q (B, H, T, d_h)``, ``k (B, H_kv, T, d_h)`` — heads before time. Projections
    reshaped with ``.view(B, T, H, d_h)`` need ``.transpose(1, 2)`` first; when
    ``H = H_kv = T`` the shapes cannot tell the two layouts apart, so no error can catch
    that mistake. Any strides are read in place (the cpu and triton kernels take them;
    only a last dimension with stride ≠ 1 is copied first), so pass the transposed views
    as they are: no copy is made.

    For pair ``(j, j + d_h/2)`` at position ``p``: rotation by
    ``Θ_j(p) = p ω_j (1 + 1/k_s)`` scaled by ``r_j(p) = 1 + a_s sin(p f_s ω_j)``, with
    ``ω_j = θ₀^(−2j/d_h)``. Angles are formed and reduced modulo 2π in float64, so
    float32 outputs meet SPEC §9's 1e-5 up to ``|p| = max_accurate_position(k_s)``
    (about 2^35 for ``k_s = 8``; tested up to 2^31). There is no other length limit; on
    CPU tensors a larger position is a ``ValueError`` (not checked on CUDA: it would cost
    a device sync per call).

    Args:
        q: queries ``(B, H, T, d_h)``; float32, float64, bfloat16 or float16.
        k: keys ``(B, H_kv, T, d_h)``, same dtype and device; ``H`` a multiple of ``H_kv``.
        position_ids: integer positions ``(B, T)``, or ``(1, T)`` / ``(T,)`` shared by the batch.
        theta: θ₀ > 0.  spiral_divisor: k_s ≠ 0, or ``math.inf`` (1/k_s = 0).
        radial_amplitude: a_s.  radial_frequency: f_s.
        ``spiral_divisor=math.inf, radial_amplitude=0`` is plain rotary embedding (RoPE,
        rotate-half layout, as in Llama), with the same float64 angle reduction.

    Returns:
        ``(q_out, k_out)``: new tensors with the shapes, dtype and layout (strides, as
        ``torch.empty_like``) of ``q``/``k`` — transposed ``(B, T, H, d_h)`` views give
        outputs in that memory order, which :func:`gcla_attention` reads without a copy;
        contiguous inputs give contiguous outputs. The inputs are never modified.
        Differentiable in ``q`` and ``k``; the gradients take the layout of the incoming
        gradients the same way.
    """
    check_tensor("q", q)
    check_tensor("k", k)
    check_tensor("position_ids", position_ids, dtypes=(torch.int64, torch.int32, torch.int16, torch.uint8))
    check_rank("q", q, 4, "(B, H, T, d_h)")
    check_rank("k", k, 4, "(B, H_kv, T, d_h)")
    check_same_dtype(q=q, k=k)
    check_same_device(q=q, k=k, position_ids=position_ids)
    b, h, t, dh = q.shape
    if dh % 2 != 0 or dh == 0:
        raise ValueError(f"q must have an even, non-zero head dim d_h (rotate-half pairs), got d_h = {dh}")
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != dh:
        raise ValueError(f"k must have shape (B, H_kv, T, d_h) = ({b}, H_kv, {t}, {dh}) to match q, got {tuple(k.shape)}"
                         f"{bthd_hint(q, k)}")
    h_kv = k.shape[1]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"q's heads H = {h} must be a multiple of k's heads H_kv = {h_kv}{bthd_hint(q, k)}")
    hint = bthd_hint(q, k, t=position_ids.shape[-1]) if position_ids.dim() in (1, 2) else ""
    if position_ids.dim() == 1:
        if position_ids.shape[0] != t:
            raise ValueError(f"position_ids must have shape (T,) = ({t},) or (B, T) = ({b}, {t}), "
                             f"got {tuple(position_ids.shape)}{hint}")
        positions = position_ids.to(torch.int64).expand(b, t)
    elif position_ids.dim() == 2:
        if tuple(position_ids.shape) not in ((b, t), (1, t)):
            raise ValueError(f"position_ids must have shape (B, T) = ({b}, {t}), (1, T) or (T,) = ({t},), "
                             f"got {tuple(position_ids.shape)}{hint}")
        positions = position_ids.to(torch.int64).expand(b, t)
    else:
        raise ValueError(f"position_ids must have shape (B, T) or (T,), got {tuple(position_ids.shape)}")
    theta = check_positive("theta", theta)
    if isinstance(spiral_divisor, float) and spiral_divisor in (math.inf, -math.inf):  # (traceable by dynamo)
        spiral_divisor = float(spiral_divisor)  # 1/k_s = 0: the plain RoPE angle p·ω_j
    else:
        spiral_divisor = check_real("spiral_divisor", spiral_divisor)
    if spiral_divisor == 0.0:
        raise ValueError("spiral_divisor must be non-zero (the angle uses 1 + 1/k_s)")
    radial_amplitude = check_real("radial_amplitude", radial_amplitude)
    radial_frequency = check_real("radial_frequency", radial_frequency)
    return srpe_op(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency)
