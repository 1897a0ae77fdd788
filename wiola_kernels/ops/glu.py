"""Gated activations SiLU / GELU_tanh, DSFF's streams (SPEC §10.2): :func:`glu`, the
:class:`GLUFunction` that drives its registered ops, and their kernels written in Python.

Registered ops (declared in csrc/cpu/glu.cpp):

* ``wiola::glu(a (..., n), b (..., n) | None, activation) -> y (..., n)``
* ``wiola::glu_backward(grad_y, a, b, activation) -> (grad_a, grad_b)``

``b`` None is the packed form: ``a`` is ``(..., 2n)`` holding ``[a | b]`` (one projection's
output, the activated half first), and ``grad_a`` is its one ``(..., 2n)`` gradient
(``grad_b`` None). Outputs and gradients are contiguous; inputs are read through their row
strides (the two halves of a projection's output are read in place).

Kernels: CPU — csrc/cpu/glu.cpp; CUDA — the Triton kernels (triton/glu.py) compiled ahead
of time and launched from C++ (csrc/cuda/triton_glu_binding.cpp; their Python launchers
below where a call has no compiled variant); Meta — the fakes below. Forced backends (:mod:`wiola_kernels.dispatch`):
``reference``, ``cpu``, ``triton``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch, reference, shapes
from ..reference.glu import glu_backward as _reference_backward
from ..reference.glu import glu_forward as _reference_forward
from ..validation import check_rank, check_same_device, check_same_dtype, check_tensor
from . import distinct, needs_grad, register_fake, register_triton_cuda, registered, registered_ops

__all__ = ["GLUFunction", "glu"]  # exported by wiola_kernels

OP = "glu"
_ops = registered_ops("glu", "glu_backward")


# --- argument checks ------------------------------------------------------------------------------
# What the kernels written in Python and the fakes check at entry, in the words of the C++
# kernels' checks::glu (csrc/include/wiola/checks.h).

#: The activations of :func:`wiola_kernels.glu`.
GLU_ACTIVATIONS = ("silu", "gelu_tanh")


def check_glu(a: object, b: object, activation: object) -> str:
    """Arguments of :func:`wiola_kernels.glu` (``b`` None: ``a`` holds ``[a | b]``); returns
    the activation."""
    check_tensor("a", a)
    if b is not None:
        check_tensor("b", b)
    check_rank("a", a, range(1, 64), "(..., n)" if b is not None else "(..., 2n)")
    if b is not None:
        if tuple(b.shape) != tuple(a.shape):
            raise ValueError(f"b must have the shape of a (..., n) = {tuple(a.shape)}, got {tuple(b.shape)}")
        check_same_dtype(a=a, b=b)
        check_same_device(a=a, b=b)
    elif a.shape[-1] % 2:
        raise ValueError(f"a must have an even last dimension 2n when b is None (a holds [a | b]), got {a.shape[-1]}")
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str, got {type(activation).__name__}")
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")
    return activation


# --- kernels written in Python (the registry's backends; Triton is also the CUDA kernel) ---------

def _no_check(*args):
    """The backward's arguments come from the forward (the Function saves them)."""


def _reference_forward_checked(a, b, activation="silu"):
    return _reference_forward(a, b, check_glu(a, b, activation))


def _triton_forward(a, b, activation="silu"):
    from ..triton import glu as tk

    return tk.glu_fwd(a, b, check_glu(a, b, activation))


def _triton_backward(grad_y, a, b, activation):
    from ..triton import glu as tk

    # No checks: the arguments come from the forward, which checked them (the Function saves them).
    return tk.glu_bwd(grad_y, a, b, activation)


dispatch.register_default(OP, "cpu", "cpu")
dispatch.register_default(OP, "cuda", "triton")
dispatch.register(OP, "reference", SimpleNamespace(forward=_reference_forward_checked, backward=_reference_backward))
dispatch.register(OP, "cpu", SimpleNamespace(forward=registered("wiola", "glu", check_glu),
                                             backward=registered("wiola", "glu_backward", _no_check)))
dispatch.register(OP, "triton", SimpleNamespace(forward=_triton_forward, backward=_triton_backward))
# CUDA: the C++ launch of the compiled kernels (csrc/cuda/triton_glu_binding.cpp), which runs these
# where its table has no variant.
register_triton_cuda("glu", _triton_forward)
register_triton_cuda("glu_backward", _triton_backward)


def _out_shape(a: Tensor, b: Tensor | None) -> tuple[int, ...]:
    return tuple(a.shape) if b is not None else (*a.shape[:-1], a.shape[-1] // 2)


@register_fake("wiola::glu")
def _glu_fake(a, b, activation="silu"):
    check_glu(a, b, activation)
    return a.new_empty(_out_shape(a, b))


@register_fake("wiola::glu_backward")
def _glu_backward_fake(grad_y, a, b, activation):
    return a.new_empty(a.shape), None if b is None else a.new_empty(a.shape)


# --- autograd ------------------------------------------------------------------------------------

def _forward(a, b, activation):
    """``(y, backend)``: the dispatcher's kernel (backend None), or the forced one."""
    backend = dispatch.forced_backend()
    if backend is None:
        try:
            return _ops.glu(a, b, activation), None
        except RuntimeError:  # the schema's argument parser: name the argument instead
            check_glu(a, b, activation)
            raise
    if not isinstance(a, Tensor):
        check_glu(a, b, activation)
    backend = dispatch.resolve(OP, backend, a.device, a.dtype)
    return dispatch.kernels(OP, backend).forward(a, b, activation), backend


class GLUFunction(torch.autograd.Function):
    """Autograd for :func:`glu`: ``GLUFunction.apply(a, b, activation)`` (every argument
    positional; see :func:`glu`). Saves ``a`` and ``b`` only (the backward recomputes
    ``act(a)``); calls ``wiola::glu`` and, in the backward, ``wiola::glu_backward`` — or the
    forced backend's kernels, kept on ``ctx`` so that the backward runs where the forward ran."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor | None, activation: str) -> Tensor:
        y, ctx.backend = _forward(a, b, activation)
        ctx.activation = activation
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        a, b = ctx.saved_tensors
        if ctx.backend is None:
            grad_a, grad_b = _ops.glu_backward(grad_y, a, b, ctx.activation)
        else:
            grad_a, grad_b = dispatch.kernels(OP, ctx.backend).backward(grad_y, a, b, ctx.activation)
        return grad_a, grad_b, None


def glu(a: Tensor, b: Tensor | None = None, activation: str = "silu") -> Tensor:
    """Gated activation (SPEC §10.2): ``act(a) ⊙ b``, the core of SwiGLU / GeGLU feed-forwards.

    ``SiLU(a) = a·σ(a)``; ``GELU_tanh(a) = ½a(1 + tanh(√(2/π)(a + 0.044715a³)))``.

    Args:
        a: the activated input ``(..., n)``; float32, float64, bfloat16 or float16. Any
            strides with a contiguous last dimension are read in place — in particular
            ``a, b = u[..., :n], u[..., n:]``, the halves of one projection's output.
        b: the gate's other input, ``a``'s shape, dtype and device. None for the packed
            form: ``a`` is then ``(..., 2n)`` holding ``[a | b]`` (one projection with the
            activated rows first, e.g. ``x @ cat([W1, W3]).T``), and its gradient comes back
            as one ``(..., 2n)`` tensor — no ``cat`` of ``∂a`` and ``∂b`` in the backward.
        activation: ``"silu"`` (SwiGLU; DSFF's narrow stream) or ``"gelu_tanh"`` (GeGLU;
            DSFF's wide stream).

    Returns:
        ``y (..., n)``, contiguous, in the input dtype (computed in float32, float64 for
        float64). Differentiable in ``a`` and ``b`` (through :class:`GLUFunction`, which
        saves only the inputs and recomputes ``act(a)``); the gradients are contiguous
        tensors of the inputs' shapes.

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype, shape or
        activation.
    """
    if torch.compiler.is_compiling():
        return GLUFunction.apply(*distinct(a, b), activation)
    if needs_grad(a, b):
        return GLUFunction.apply(a, b, activation)
    return _forward(a, b, activation)[0]


# --- benchmark cases (wiola_kernels.bench: python -m wiola_kernels bench [--overhead]) -------------

def bench_cases(device: torch.device, size: str) -> list[dict]:
    """This op's benchmark cases at ``size`` (:data:`~wiola_kernels.shapes.BENCH_SIZES`; shapes
    in :mod:`wiola_kernels.shapes`), as keyword arguments of ``wiola_kernels.bench.BenchCase``:
    DSFF's narrow (SiLU, n) and wide (GELU_tanh, w) streams, u = x·[W1; W3]ᵀ of width 2n, one
    projection's output, given to glu whole (the packed form: its gradient is one tensor);
    ``"tiny"`` (one decoding token's) is what ``bench --overhead`` times call by call."""
    dtype = shapes.bench_dtype(device, size)

    def case(tokens: int, n: int, activation: str) -> dict:
        def make_inputs():
            g = torch.Generator(device="cpu").manual_seed(0)
            return (torch.randn(tokens, 2 * n, generator=g).to(device=device, dtype=dtype),)

        return dict(op=OP, shape=f"u ({tokens}, 2·{n}), {activation}", dtype=dtype, make_inputs=make_inputs,
                    fused=lambda u: glu(u, None, activation), eager=lambda u: reference.glu(u, None, activation),
                    backward_rereads=(0,))  # ∂a, ∂b recompute act(a) from u

    if size in ("default", "tiny"):  # one stream: the narrow one
        streams = [shapes.bench_shape(OP, {"full": shapes.GLU_BENCH["full"][0]}, device, size)]
    else:
        streams = shapes.GLU_BENCH[size]
    return [case(*stream) for stream in streams]
