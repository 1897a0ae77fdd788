"""Gated activations in plain PyTorch (SPEC §10.2): the oracle for every backend.

    y = act(a) ⊙ b,   SiLU(a) = a·σ(a),   GELU_tanh(a) = ½a(1 + tanh(√(2/π)(a + 0.044715a³)))

Computed in float32 (float64 for float64 inputs); output in the input dtype. ``b=None``
is the packed form: ``a`` is ``(..., 2n)`` holding ``[a | b]`` (the two halves of one
projection's output, the activated half first) and the gradient is one ``(..., 2n)``
tensor.

Backward (g = ∂L/∂y), recomputing act(a) from a:

    ∂L/∂a = g ⊙ b ⊙ act'(a),      ∂L/∂b = g ⊙ act(a)
    SiLU'(a)      = σ(a)·(1 + a·(1 − σ(a)))
    GELU_tanh'(a) = ½(1 + t) + ½a·(1 − t²)·√(2/π)(1 + 3·0.044715a²),   t = tanh(√(2/π)(a + 0.044715a³))

These are the SPEC's formulas, written as they are printed; the kernels evaluate the
same functions in another form (``½(1 + tanh z) = σ(2z)``, so both activations are
``a·σ(h(a))``), which the tests compare against this one.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..dtypes import compute_dtype

__all__ = ["glu", "glu_backward", "glu_forward"]

ACTIVATIONS = ("silu", "gelu_tanh")
GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


def split_packed(a: Tensor, b: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(a, b)``; for the packed form (``b`` None) the two halves of ``a``'s last dimension."""
    if b is not None:
        return a, b
    n = a.shape[-1] // 2
    return a[..., :n], a[..., n:]


def act(a: Tensor, kind: str) -> Tensor:
    """``act(a)`` in ``a``'s dtype, differentiable by autograd."""
    if kind == "silu":
        return a * torch.sigmoid(a)
    if kind == "gelu_tanh":
        return 0.5 * a * (1.0 + torch.tanh(GELU_K * (a + GELU_C * a * a * a)))
    raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {kind!r}")


def act_grad(a: Tensor, kind: str) -> Tensor:
    """``act'(a)`` (SPEC §10.2's derivative, written out)."""
    if kind == "silu":
        s = torch.sigmoid(a)
        return s * (1.0 + a * (1.0 - s))
    if kind == "gelu_tanh":
        t = torch.tanh(GELU_K * (a + GELU_C * a * a * a))
        return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * GELU_C * a * a)
    raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {kind!r}")


def glu(a: Tensor, b: Tensor | None, activation: str = "silu") -> Tensor:
    """``act(a) ⊙ b`` in the accumulation dtype, rounded once to the input dtype;
    differentiable by autograd."""
    a_, b_ = split_packed(a, b)
    acc = compute_dtype(a.dtype)
    return (act(a_.to(acc), activation) * b_.to(acc)).to(a.dtype)


def glu_forward(a: Tensor, b: Tensor | None, activation: str = "silu") -> Tensor:
    """The forward the registered op computes (the same as :func:`glu`)."""
    return glu(a, b, activation)


def glu_backward(grad_y: Tensor, a: Tensor, b: Tensor | None, activation: str
                 ) -> tuple[Tensor, Tensor | None]:
    """Explicit backward: ``(grad_a, grad_b)``; for the packed form ``(grad of [a | b], None)``."""
    a_, b_ = split_packed(a, b)
    acc = compute_dtype(a.dtype)
    g, av, bv = grad_y.to(acc), a_.to(acc), b_.to(acc)
    grad_a = (g * bv * act_grad(av, activation)).to(a.dtype)
    grad_b = (g * act(av, activation)).to(a.dtype)
    if b is None:
        return torch.cat([grad_a, grad_b], dim=-1), None
    return grad_a, grad_b
