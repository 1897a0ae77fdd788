"""SRPE (SPEC §4): the registered ops ``wiola::srpe`` / ``wiola::srpe_grad``, the
:class:`SRPEFunction` that drives them, and the public :func:`srpe`.

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
from . import distinct
from ..reference.srpe import srpe as srpe_reference
from ..reference.srpe import srpe_backward as srpe_reference_backward
from ..outputs import in_layout_of, unit_last_stride
from ..srpe_tables import kernel_frequencies
from ..validation import (bthd_hint, check_position_ids, check_position_range, check_positive, check_query_key,
                          check_real, check_same_device, check_same_dtype, check_tensor)

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
    in tests/test_srpe.py). Capped at 2^53, where int64 → float64 stops being exact.
    """
    factor = abs(1.0 + 1.0 / spiral_divisor)
    return 2**53 if factor == 0.0 else min(2**53, int(1e-5 * 2.0**52 / factor))


_POSITION_LIMIT_REASON = "float32 SRPE outputs lose SPEC accuracy beyond it for spiral_divisor={}"


@torch.library.custom_op("wiola::srpe", mutates_args=())
def srpe_op(q: Tensor, k: Tensor, positions: Tensor, theta: float, spiral_divisor: float,
            radial_amplitude: float, radial_frequency: float, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """``(R(p) q, R(p) k)`` for ``positions (B, T)`` int64, on ``backend``; outputs in the
    inputs' layouts (a transposed ``(B, T, H, d_h)`` view stays one: see outputs.py)."""
    # Inside the op (opaque to torch.compile), and on CPU only: on a GPU the check would cost
    # a device sync on every call, so CUDA callers get the documented limit without a check.
    check_position_range(positions, max_accurate_position(spiral_divisor),
                         _POSITION_LIMIT_REASON.format(spiral_divisor))
    impl = dispatch.resolve(OP, backend, q.device, q.dtype)
    q, k = unit_last_stride(q), unit_last_stride(k)
    q_out, k_out = impl.apply(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, False)
    return in_layout_of(q_out, q), in_layout_of(k_out, k)


@srpe_op.register_fake
def _(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, backend="auto"):
    return torch.empty_like(unit_last_stride(q)), torch.empty_like(unit_last_stride(k))


@torch.library.custom_op("wiola::srpe_grad", mutates_args=())
def srpe_grad_op(grad_q: Tensor, grad_k: Tensor, positions: Tensor, theta: float, spiral_divisor: float,
                 radial_amplitude: float, radial_frequency: float, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """``(R(p)ᵀ grad_q, R(p)ᵀ grad_k)`` on ``backend``, in the gradients' layouts."""
    impl = dispatch.resolve(OP, backend, grad_q.device, grad_q.dtype)
    grad_q, grad_k = unit_last_stride(grad_q), unit_last_stride(grad_k)
    dq, dk = impl.apply(grad_q, grad_k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, True)
    return in_layout_of(dq, grad_q), in_layout_of(dk, grad_k)


@srpe_grad_op.register_fake
def _(grad_q, grad_k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, backend="auto"):
    return torch.empty_like(unit_last_stride(grad_q)), torch.empty_like(unit_last_stride(grad_k))


class SRPEFunction(torch.autograd.Function):
    """Autograd for :func:`srpe`: ``SRPEFunction.apply(q, k, position_ids, theta, spiral_divisor,
    radial_amplitude, radial_frequency)`` (every argument positional; see :func:`srpe`).
    Validates, picks the backend once (kept on ``ctx``: the backward runs where the forward
    ran) and calls ``wiola::srpe`` / ``wiola::srpe_grad``."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, position_ids: Tensor, theta: float, spiral_divisor: float,
                radial_amplitude: float, radial_frequency: float) -> tuple[Tensor, Tensor]:
        check_tensor("q", q)
        check_tensor("k", k)
        check_same_dtype(q=q, k=k)
        b, _h, _h_kv, t, _dh = check_query_key("q", q, "k", k)
        check_same_device(q=q, k=k, position_ids=position_ids)
        hint = bthd_hint(q, k, t=position_ids.shape[-1]) if position_ids.dim() in (1, 2) else ""
        positions = check_position_ids(position_ids, b, t, hint=hint)
        theta = check_positive("theta", theta)
        if isinstance(spiral_divisor, float) and spiral_divisor in (math.inf, -math.inf):  # (traceable by dynamo)
            spiral_divisor = float(spiral_divisor)  # 1/k_s = 0: the plain RoPE angle p·ω_j
        else:
            spiral_divisor = check_real("spiral_divisor", spiral_divisor)
        if spiral_divisor == 0.0:
            raise ValueError("spiral_divisor must be non-zero (the angle uses 1 + 1/k_s)")
        params = (theta, spiral_divisor, check_real("radial_amplitude", radial_amplitude),
                  check_real("radial_frequency", radial_frequency))
        ctx.backend = dispatch.select(OP, q.device, q.dtype)
        q_out, k_out = srpe_op(q, k, positions, *params, ctx.backend)
        ctx.save_for_backward(positions)
        ctx.params = params
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor):
        (positions,) = ctx.saved_tensors
        grad_q_in, grad_k_in = srpe_grad_op(grad_q, grad_k, positions, *ctx.params, ctx.backend)
        return grad_q_in, grad_k_in, None, None, None, None, None


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
        Differentiable in ``q`` and ``k`` (through :class:`SRPEFunction`); the gradients
        take the layout of the incoming gradients the same way.
    """
    return SRPEFunction.apply(*distinct(q, k, position_ids), theta, spiral_divisor, radial_amplitude, radial_frequency)
