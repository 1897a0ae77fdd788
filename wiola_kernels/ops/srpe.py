"""SRPE, the spiral rotary position encoding of Q and K (SPEC §4): :func:`srpe`, the
:class:`SRPEFunction` that drives its registered ops, and their kernels written in Python.

Registered ops (declared in csrc/cpu/srpe.cpp):

* ``wiola::srpe(q, k, position_ids, theta, spiral_divisor, radial_amplitude, radial_frequency,
  inv_freq=None, scale=1.0) -> (m R(p) q, m R(p) k)``
* ``wiola::srpe_backward(grad_q, grad_k, position_ids, ...) -> (m R(p)ᵀ grad_q, m R(p)ᵀ grad_k)``

``inv_freq`` (``(d_h/2,)``, any float dtype, taken in float64) replaces ``θ₀^(−2j/d_h)`` when
given; ``scale`` is the output scale ``m`` (SPEC §4, "Given frequencies").

``q (B, H, T, d_h)``, ``k (B, H_kv, T, d_h)`` with any strides (the model's transposed
``(B, T, H, d_h)`` views are read in place; only a last dimension with stride ≠ 1 is copied);
``position_ids`` ``(B, T)``, ``(1, T)`` or ``(T,)`` of any index dtype. Outputs come in the
layout of ``torch.empty_like(q)`` / ``empty_like(k)`` — the C++ and Triton kernels write them
so, the reference's are copied into it. One kernel serves both directions: ``R(p)ᵀ`` is the
rotation by ``−Θ`` scaled by ``r``.

Kernels: CPU — csrc/cpu/srpe.cpp; CUDA — the Triton kernel (triton/srpe.py) compiled ahead of
time and launched from C++ (csrc/cuda/triton_srpe_binding.cpp; its Python launcher below where a
call has no compiled variant); Meta — the fakes below. Forced backends: ``reference``, ``cpu``, ``triton``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch, reference, shapes
from ..outputs import in_layout_of, unit_last_stride
from ..reference.srpe import srpe as _reference_srpe
from ..reference.srpe import srpe_backward as _reference_srpe_backward
from ..validation import (bthd_hint, can_read_values, check_position_ids, check_positive, check_query_key,
                          check_real, check_same_device, check_same_dtype, check_tensor)
from . import distinct, needs_grad, register_fake, register_triton_cuda, registered, registered_ops


__all__ = ["SRPEFunction", "srpe"]  # exported by wiola_kernels

OP = "srpe"
# The registered ops' overloads, looked up once: a call skips the overload resolution of
# ``torch.ops.wiola.<name>(...)``.
_ops = registered_ops("srpe", "srpe_backward")


# --- argument checks ------------------------------------------------------------------------------
# What the kernels written in Python and the fakes check at entry, in the words of the C++
# kernels' checks::srpe (csrc/include/wiola/checks.h).

def check_position_range(positions: torch.Tensor, limit: int, why: str) -> None:
    """``|position_ids| ≤ limit`` (checked on CPU tensors only); ``why`` says what breaks beyond."""
    if can_read_values(positions):
        largest = int(positions.abs().max())
        if largest > limit:
            raise ValueError(f"position_ids must lie within ±{limit} ({why}), got |p| = {largest}")


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
    if not can_read_values(inv_freq):
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


#: The largest ``|p|`` float32 outputs are accurate at (see :func:`srpe_max_position`).
max_accurate_position = srpe_max_position


# --- kernels written in Python ---------------------------------------------------------------------

def _python_kernel(apply, names):
    """``(q, k, position_ids, *params) -> (q_out, k_out)`` from ``apply(q, k, positions int64
    (B, T), *params)``, checked and with outputs in the inputs' layouts."""
    def kernel(q, k, position_ids, theta=10000.0, spiral_divisor=8.0, radial_amplitude=0.1, radial_frequency=0.01,
               inv_freq=None, scale=1.0):
        positions, params, inv_freq, scale = check_srpe(q, k, position_ids, theta, spiral_divisor, radial_amplitude,
                                                        radial_frequency, inv_freq, scale, names)
        q, k = unit_last_stride(q), unit_last_stride(k)
        q_out, k_out = apply(q, k, positions, *params, inv_freq, scale)
        return in_layout_of(q_out, q), in_layout_of(k_out, k)

    return kernel


def _triton(transpose: bool):
    def apply(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq, scale):
        from ..triton import srpe as tk

        return tk.srpe_apply(q, k, positions, theta, spiral_divisor, radial_amplitude, radial_frequency, transpose,
                             inv_freq=inv_freq, scale=scale)

    return apply


_FORWARD_NAMES, _BACKWARD_NAMES = ("q", "k"), ("grad_q", "grad_k")


def _check_backward(*args):
    check_srpe(*args, names=_BACKWARD_NAMES)


dispatch.register_default(OP, "cpu", "cpu")
dispatch.register_default(OP, "cuda", "triton")
dispatch.register(OP, "reference", SimpleNamespace(forward=_python_kernel(_reference_srpe, _FORWARD_NAMES),
                                                   backward=_python_kernel(_reference_srpe_backward, _BACKWARD_NAMES)))
dispatch.register(OP, "cpu", SimpleNamespace(forward=registered("wiola", "srpe", check_srpe),
                                             backward=registered("wiola", "srpe_backward", _check_backward)))
dispatch.register(OP, "triton", SimpleNamespace(forward=_python_kernel(_triton(False), _FORWARD_NAMES),
                                                backward=_python_kernel(_triton(True), _BACKWARD_NAMES)))
# CUDA: the C++ launch of the compiled kernel (csrc/cuda/triton_srpe_binding.cpp), which runs these
# where its tables have no variant.
register_triton_cuda("srpe", dispatch.kernels(OP, "triton").forward)
register_triton_cuda("srpe_backward", dispatch.kernels(OP, "triton").backward)


def _fake(names):
    def fake(q, k, position_ids, theta=10000.0, spiral_divisor=8.0, radial_amplitude=0.1, radial_frequency=0.01,
             inv_freq=None, scale=1.0):
        check_srpe(q, k, position_ids, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq, scale,
                   names)
        return torch.empty_like(unit_last_stride(q)), torch.empty_like(unit_last_stride(k))

    return fake


register_fake("wiola::srpe")(_fake(_FORWARD_NAMES))
register_fake("wiola::srpe_backward")(_fake(_BACKWARD_NAMES))


# --- autograd --------------------------------------------------------------------------------------

def _forward(q, k, position_ids, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq, scale):
    """``(q_out, k_out, backend)``: the dispatcher's kernel (backend None), or the forced one."""
    backend = dispatch.forced_backend()
    params = (theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq, scale)
    if backend is None:
        try:
            return (*_ops.srpe(q, k, position_ids, *params), None)
        except RuntimeError:  # the schema's argument parser: name the argument instead
            check_srpe(q, k, position_ids, *params)
            raise
    if not isinstance(q, Tensor):
        check_srpe(q, k, position_ids, *params)
    backend = dispatch.resolve(OP, backend, q.device, q.dtype)
    return (*dispatch.kernels(OP, backend).forward(q, k, position_ids, *params), backend)


class SRPEFunction(torch.autograd.Function):
    """Autograd for :func:`srpe`: ``SRPEFunction.apply(q, k, position_ids, theta, spiral_divisor,
    radial_amplitude, radial_frequency, inv_freq, scale)`` (every argument positional; see
    :func:`srpe`). Calls ``wiola::srpe`` and, in the backward, ``wiola::srpe_backward`` — or the
    forced backend's kernels, kept on ``ctx`` so that the backward runs where the forward ran.
    Gradients flow to ``q`` and ``k`` only (none to ``inv_freq``)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, position_ids: Tensor, theta: float, spiral_divisor: float,
                radial_amplitude: float, radial_frequency: float, inv_freq: Tensor | None = None,
                scale: float = 1.0) -> tuple[Tensor, Tensor]:
        q_out, k_out, ctx.backend = _forward(q, k, position_ids, theta, spiral_divisor, radial_amplitude,
                                             radial_frequency, inv_freq, scale)
        ctx.save_for_backward(position_ids, inv_freq)
        ctx.params = (theta, spiral_divisor, radial_amplitude, radial_frequency)
        ctx.scale = scale
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor):
        position_ids, inv_freq = ctx.saved_tensors
        if ctx.backend is None:
            grad_q_in, grad_k_in = _ops.srpe_backward(grad_q, grad_k, position_ids, *ctx.params, inv_freq, ctx.scale)
        else:
            grad_q_in, grad_k_in = dispatch.kernels(OP, ctx.backend).backward(grad_q, grad_k, position_ids,
                                                                               *ctx.params, inv_freq, ctx.scale)
        return grad_q_in, grad_k_in, None, None, None, None, None, None, None


def srpe(q: Tensor, k: Tensor, position_ids: Tensor, theta: float = 10000.0, spiral_divisor: float = 8.0,
         radial_amplitude: float = 0.1, radial_frequency: float = 0.01, *, inv_freq: Tensor | None = None,
         scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Spiral rotary position encoding of queries and keys (SPEC §4), in one launch.

    Layout: ``q (B, H, T, d_h)``, ``k (B, H_kv, T, d_h)`` — heads before time. Projections
    reshaped with ``.view(B, T, H, d_h)`` need ``.transpose(1, 2)`` first; when
    ``H = H_kv = T`` the shapes cannot tell the two layouts apart, so no error can catch
    that mistake. Any strides are read in place (the cpu and triton kernels take them;
    only a last dimension with stride ≠ 1 is copied first), so pass the transposed views
    as they are: no copy is made.

    For pair ``(j, j + d_h/2)`` at position ``p``: rotation by
    ``Θ_j(p) = p ω_j (1 + 1/k_s)`` scaled by ``r_j(p) = 1 + a_s sin(p f_s ω_j)``, with
    ``ω_j = θ₀^(−2j/d_h)`` (or ``inv_freq[j]``), times the output scale ``m``. Angles are
    formed and reduced modulo 2π in float64, so float32 outputs meet SPEC §9's 1e-5 up to
    ``|p| = max_accurate_position(k_s)`` (about 2^35 for ``k_s = 8``; tested up to 2^31).
    There is no other length limit; on CPU tensors a larger position is a ``ValueError``
    (not checked on CUDA: it would cost a device sync per call).

    Args:
        q: queries ``(B, H, T, d_h)``; float32, float64, bfloat16 or float16.
        k: keys ``(B, H_kv, T, d_h)``, same dtype and device; ``H`` a multiple of ``H_kv``.
        position_ids: integer positions ``(B, T)``, or ``(1, T)`` / ``(T,)`` shared by the batch.
        theta: θ₀ > 0.  spiral_divisor: k_s ≠ 0, or ``math.inf`` (1/k_s = 0).
        radial_amplitude: a_s.  radial_frequency: f_s.
        ``spiral_divisor=math.inf, radial_amplitude=0`` is plain rotary embedding (RoPE,
        rotate-half layout, as in Llama), with the same float64 angle reduction.
        inv_freq: given per-pair frequencies ``ω_j``, a ``(d_h/2,)`` floating tensor on the
            inputs' device (any float dtype; taken in float64), used in place of
            ``θ₀^(−2j/d_h)`` in the angle and the radial term — a Hugging Face rope type's
            ``inv_freq`` (``linear``, ``dynamic``, ``llama3``, ``yarn``, ``longrope``). The
            accurate range scales with it: ``max_accurate_position(k_s, max_j |ω_j|)``. On CPU
            its values must be finite. No gradient flows to it.
        scale: output scale ``m`` (default 1): ``y = m R(p) q``, backward ``m R(p)ᵀ g`` (the
            attention factor of ``yarn`` / ``longrope``).

    Returns:
        ``(q_out, k_out)``: new tensors with the shapes, dtype and layout (strides, as
        ``torch.empty_like``) of ``q``/``k`` — transposed ``(B, T, H, d_h)`` views give
        outputs in that memory order, which :func:`gcla_attention` reads without a copy;
        contiguous inputs give contiguous outputs. The inputs are never modified.
        Differentiable in ``q`` and ``k`` (through :class:`SRPEFunction`; without gradients
        the registered op is called directly); the gradients take the layout of the
        incoming gradients the same way.

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype or shape.
    """
    if torch.compiler.is_compiling():
        return SRPEFunction.apply(*distinct(q, k, position_ids), theta, spiral_divisor, radial_amplitude,
                                  radial_frequency, inv_freq, scale)
    if needs_grad(q, k):
        return SRPEFunction.apply(q, k, position_ids, theta, spiral_divisor, radial_amplitude, radial_frequency,
                                  inv_freq, scale)
    return _forward(q, k, position_ids, theta, spiral_divisor, radial_amplitude, radial_frequency, inv_freq,
                    scale)[:2]


# --- benchmark cases (wiola_kernels.bench: python -m wiola_kernels bench [--overhead]) -------------

def bench_cases(device: torch.device, size: str) -> list[dict]:
    """This op's benchmark cases at ``size`` (:data:`~wiola_kernels.shapes.BENCH_SIZES`; shapes
    in :mod:`wiola_kernels.shapes`), as keyword arguments of ``wiola_kernels.bench.BenchCase``:
    wiola-360m attention shapes (H = 16, H_kv = 4, d_h = 64); ``"tiny"`` (one decoding token)
    is what ``bench --overhead`` times call by call."""
    b, h, h_kv, t, dh = shapes.bench_shape(OP, shapes.SRPE_BENCH, device, size)
    dtype = shapes.bench_dtype(device, size)

    def make_inputs():
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(b, h, t, dh, generator=g).to(device=device, dtype=dtype)
        k = torch.randn(b, h_kv, t, dh, generator=g).to(device=device, dtype=dtype)
        positions = torch.arange(t, device=device).expand(b, t).contiguous()
        return q, k, positions

    return [dict(op=OP, shape=f"q ({b}, {h}, {t}, {dh}), k ({b}, {h_kv}, {t}, {dh})", dtype=dtype,
                 make_inputs=make_inputs, fused=lambda q, k, p: srpe(q, k, p),
                 eager=lambda q, k, p: reference.srpe(q, k, p),
                 backward_rereads=(2,))]  # the rotation is linear: its backward needs the positions, not q or k
