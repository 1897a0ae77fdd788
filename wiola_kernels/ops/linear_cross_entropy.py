"""Linear cross-entropy, the head's loss without the logits tensor (SPEC §10.1):
:func:`linear_cross_entropy`, the :class:`LinearCrossEntropyFunction` that drives its registered
ops, and their kernels written in Python.

Registered ops (declared in csrc/cpu/linear_cross_entropy.cpp):

* ``wiola::linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing,
  softcap, z_loss, num_items, grad_mask) -> (loss, lse, grad_h, grad_W)``
* ``wiola::linear_cross_entropy_backward(grad_loss, h, W, labels, lse, num_items, grad_h!,
  grad_W!, ignore_index, reduction, label_smoothing, softcap, z_loss, precomputed) -> ()``

With ``reduction`` ``"mean"`` or ``"sum"`` and gradients wanted (``grad_mask``), the forward
also returns the unscaled gradients of ``Σ ℓ_i`` — its chunks hold every row's softmax
anyway, so they cost two GEMMs and no recomputation of the logits — and the backward scales
them in place by ``grad_loss`` (÷ n for a mean). ``"none"`` weights row i by
``grad_loss[i]``, known only in the backward, which then recomputes the logits chunk by chunk
(``precomputed=False``); so does a second backward through the same graph (the first one
used the forward's gradients up: retain_graph, gradcheck), with the same bits.

Kernels: CPU — csrc/cpu/linear_cross_entropy.cpp; CUDA — the Triton kernels
(triton/linear_cross_entropy.py) launched from C++ (csrc/cuda/triton_linear_cross_entropy_binding.cpp),
which runs the Python launchers below (``wiola::_triton_linear_cross_entropy(_backward)``) where
the cubin tables lack a call's variants; Meta — the fakes below. Forced backends
(:mod:`wiola_kernels.dispatch`): ``reference``, ``cpu``, ``triton``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch, reference, shapes
from ..dtypes import compute_dtype
from ..outputs import empty_output
from ..reference.linear_cross_entropy import denominator as _denominator
from ..reference.linear_cross_entropy import linear_cross_entropy_backward as _reference_backward_formula
from ..reference.linear_cross_entropy import linear_cross_entropy_forward as _reference_forward_formula
from ..validation import (INDEX_DTYPES, can_read_values, check_positive, check_rank, check_real,
                          check_same_device, check_same_dtype, check_tensor, dtype_name)
from . import distinct, needs_grad, register_fake, register_triton_cuda, registered, registered_ops


__all__ = ["LinearCrossEntropyFunction", "linear_cross_entropy"]  # exported by wiola_kernels

OP = "linear_cross_entropy"
# The registered ops' overloads, looked up once: a call skips the overload resolution of
# ``torch.ops.wiola.<name>(...)``.
_ops = registered_ops("linear_cross_entropy", "linear_cross_entropy_backward")
_NO_GRAD = (False, False)


# --- argument checks ------------------------------------------------------------------------------
# What the kernels written in Python and the fakes check at entry, in the words of the C++
# kernels' checks::linear_cross_entropy (csrc/include/wiola/checks.h).

#: ``reduction`` values of :func:`wiola_kernels.linear_cross_entropy`.
LCE_REDUCTIONS = ("mean", "sum", "none")


def check_linear_cross_entropy(h: object, W: object, labels: object, ignore_index: object, reduction: object,
                               label_smoothing: object, softcap: object, z_loss: object, num_items: object
                               ) -> tuple[int, float, float | None, float]:
    """Arguments of :func:`wiola_kernels.linear_cross_entropy`; returns ``(N, label_smoothing,
    softcap, z_loss)`` with the numbers as floats. Label values (in ``[0, V)`` or
    ``ignore_index``) and a ``num_items`` tensor's value (> 0) are checked on CPU tensors."""
    check_tensor("h", h)
    check_tensor("W", W)
    check_rank("h", h, range(2, 64), "(..., d)")
    d = h.shape[-1]
    check_rank("W", W, 2, "(V, d)")
    if W.shape[1] != d:
        raise ValueError(f"W must have shape (V, d) = (V, {d}) to match h, got {tuple(W.shape)}")
    if d == 0:
        raise ValueError("h must have a non-empty last dimension d, got d = 0")
    if W.shape[0] == 0:
        raise ValueError(f"W must have at least one row (V >= 1), got shape {tuple(W.shape)}")
    check_same_dtype(h=h, W=W)
    check_tensor("labels", labels, dtypes=INDEX_DTYPES)
    n = h.numel() // d
    if tuple(labels.shape) not in (tuple(h.shape[:-1]), (n,)):
        raise ValueError(f"labels must have shape h.shape[:-1] = {tuple(h.shape[:-1])} or (N,) = ({n},), "
                         f"got {tuple(labels.shape)}")
    check_same_device(h=h, W=W, labels=labels)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in LCE_REDUCTIONS:
        raise ValueError(f"reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")
    label_smoothing = check_real("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing!r}")
    softcap = None if softcap is None else check_positive("softcap", softcap)
    z_loss = check_positive("z_loss", z_loss, allow_zero=True)
    check_num_items(num_items, h.device)
    if can_read_values(labels):
        counted = labels[labels != ignore_index]
        if counted.numel():
            lo, hi = int(counted.min()), int(counted.max())
            if lo < 0 or hi >= W.shape[0]:
                bad = lo if lo < 0 else hi
                raise ValueError(f"labels must lie in [0, V) = [0, {W.shape[0]}) or equal ignore_index = "
                                 f"{ignore_index}, got {bad}")
    return n, label_smoothing, softcap, z_loss


def check_num_items(num_items: object, device: torch.device) -> None:
    """``num_items`` of a mean: None, a number > 0, or a tensor of one element on ``device``
    or the CPU (its value, > 0, checked on the CPU)."""
    if num_items is None:
        return
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.dtype == torch.bool or num_items.is_complex():
            raise ValueError(f"num_items must be a number > 0 or a real tensor of one element, got a tensor of "
                             f"shape {tuple(num_items.shape)} and dtype {dtype_name(num_items.dtype)}")
        if num_items.device != device and num_items.device.type != "cpu":
            raise ValueError(f"num_items must be on {device} like h (or on the CPU), got {num_items.device}")
        if can_read_values(num_items):
            value = float(num_items)
            if not value > 0.0 or value == float("inf"):
                raise ValueError(f"num_items must be a finite number > 0, got {value!r}")
        return
    check_positive("num_items", num_items)


def _check_grad_mask(grad_mask, reduction) -> tuple[bool, bool]:
    want = (bool(grad_mask[0]), bool(grad_mask[1]))
    if any(want) and reduction == "none":
        raise ValueError("grad_mask: the forward computes gradients for reduction 'mean' or 'sum' only, got 'none'")
    return want


def _check(h, W, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0,
           num_items=None, *rest):
    """check_linear_cross_entropy on a forward's arguments (``rest``: grad_mask)."""
    return check_linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss,
                                      num_items)


def _check_backward(grad_loss, h, W, labels, lse, num_items, grad_h, grad_W, ignore_index, reduction,
                    label_smoothing, softcap, z_loss, precomputed):
    return check_linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss,
                                      num_items)


def _scale(grad_loss: Tensor, labels: Tensor, ignore_index: int, reduction: str, num_items) -> Tensor:
    """The factor of the unscaled gradients of a "mean"/"sum": grad_loss (÷ n), a 0-d tensor
    on the device (no sync)."""
    g = grad_loss.to(torch.float64) if grad_loss.device.type == "cpu" else grad_loss
    if reduction == "mean":
        g = g / _denominator(labels.reshape(-1) != ignore_index, num_items)
    return g


# --- kernels written in Python (the forced backends; Triton is also the CUDA kernel) ------------

def _reference_forward(h, W, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
                       z_loss=0.0, num_items=None, grad_mask=_NO_GRAD):
    n, eps, cap, zl = check_linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap,
                                                 z_loss, num_items)
    want = _check_grad_mask(grad_mask, reduction)
    loss, lse = _reference_forward_formula(h, W, labels, ignore_index, reduction, eps, cap, zl, num_items)
    grad_h, grad_W = h.new_empty((0,)), W.new_empty((0,))
    if any(want):
        one = torch.ones((), dtype=lse.dtype, device=h.device)
        gh, gw = _reference_backward_formula(one, h, W, labels, lse, ignore_index, "sum", eps, cap, zl)
        grad_h = gh.reshape(n, h.shape[-1]).contiguous() if want[0] else grad_h
        grad_W = gw.contiguous() if want[1] else grad_W
    return loss, lse, grad_h, grad_W


def _reference_backward(grad_loss, h, W, labels, lse, num_items, grad_h, grad_W, ignore_index, reduction,
                        label_smoothing, softcap, z_loss, precomputed):
    _, eps, cap, zl = check_linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap,
                                                 z_loss, num_items)
    none = reduction == "none"
    if not precomputed:
        g = grad_loss if none else torch.ones((), dtype=lse.dtype, device=h.device)
        gh, gw = _reference_backward_formula(g, h, W, labels, lse, ignore_index, reduction if none else "sum",
                                                   eps, cap, zl)
        if grad_h is not None:
            grad_h.copy_(gh.reshape(grad_h.shape))
        if grad_W is not None:
            grad_W.copy_(gw)
    if not none:
        s = _scale(grad_loss, labels, ignore_index, reduction, num_items)
        for t in (grad_h, grad_W):
            if t is not None:
                t.mul_(s)


def _triton_forward(h, W, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
                    z_loss=0.0, num_items=None, grad_mask=_NO_GRAD):
    from ..triton import linear_cross_entropy as tk

    n, eps, cap, zl = check_linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap,
                                                 z_loss, num_items)
    want = _check_grad_mask(grad_mask, reduction)
    h2, y = h.reshape(n, h.shape[-1]), labels.reshape(n).to(torch.int64).contiguous()
    rows, lse, gh, gw = tk.lce_forward(h2, W, y, ignore_index, eps, cap, zl, want)
    # "mean"/"sum": one launch, the divisor read on the device (no host sync, graph-safe).
    loss = rows if reduction == "none" else tk.lce_reduce(rows, y, ignore_index, num_items, reduction == "mean")
    tk.sweep()
    return loss, lse, gh if want[0] else h.new_empty((0,)), gw if want[1] else W.new_empty((0,))


def _triton_backward(grad_loss, h, W, labels, lse, num_items, grad_h, grad_W, ignore_index, reduction,
                     label_smoothing, softcap, z_loss, precomputed):
    from ..triton import linear_cross_entropy as tk

    # The arguments come from the forward, which checked them (the Function saves them).
    n = lse.shape[0]
    eps, cap, zl = float(label_smoothing), None if softcap is None else float(softcap), float(z_loss)
    none = reduction == "none"
    y = labels.reshape(n).to(torch.int64).contiguous()
    if not precomputed and (grad_h is not None or grad_W is not None):
        tk.lce_forward(h.reshape(n, h.shape[-1]), W, y, ignore_index, eps, cap, zl, lse_in=lse,
                       row_grad=grad_loss.reshape(n).to(lse.dtype).contiguous() if none else None,
                       grad_h=grad_h, grad_W=grad_W)
    grads = [t for t in (grad_h, grad_W) if t is not None]
    if not none and grads:
        # grad_loss (÷ n) in one launch, applied to both gradients in one more (no host sync).
        s = tk.lce_reduce(None, y, ignore_index, num_items, reduction == "mean", grad=grad_loss, dtype=lse.dtype)
        torch._foreach_mul_(grads, s)
    tk.sweep()


dispatch.register_default(OP, "cpu", "cpu")
dispatch.register_default(OP, "cuda", "triton")
dispatch.register(OP, "reference", SimpleNamespace(forward=_reference_forward, backward=_reference_backward))
dispatch.register(OP, "cpu", SimpleNamespace(forward=registered("wiola", "linear_cross_entropy", _check),
                                             backward=registered("wiola", "linear_cross_entropy_backward",
                                                                 _check_backward)))
dispatch.register(OP, "triton", SimpleNamespace(forward=_triton_forward, backward=_triton_backward))
# The C++ CUDA kernels (csrc/cuda/triton_linear_cross_entropy_binding.cpp) run these where the
# cubin tables lack a call's variants.
register_triton_cuda("linear_cross_entropy", _triton_forward)
register_triton_cuda("linear_cross_entropy_backward", _triton_backward)


@register_fake("wiola::linear_cross_entropy")
def _linear_cross_entropy_fake(h, W, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
                               z_loss=0.0, num_items=None, grad_mask=_NO_GRAD):
    n, *_ = check_linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss,
                                       num_items)
    want = _check_grad_mask(grad_mask, reduction)
    acc = compute_dtype(h.dtype)
    d, V = h.shape[-1], W.shape[0]
    return (h.new_empty((n,) if reduction == "none" else (), dtype=acc), h.new_empty((n,), dtype=acc),
            h.new_empty((n, d) if want[0] else (0,)), W.new_empty((V, d) if want[1] else (0,)))


@register_fake("wiola::linear_cross_entropy_backward")
def _linear_cross_entropy_backward_fake(grad_loss, h, W, labels, lse, num_items, grad_h, grad_W, ignore_index,
                                        reduction, label_smoothing, softcap, z_loss, precomputed):
    return None


# --- autograd ------------------------------------------------------------------------------------

def _num_items(num_items, device: torch.device):
    """``num_items`` as the ops take it: None or a tensor. A number becomes a 0-d float64 tensor
    on ``device`` (h's) written by a fill kernel whose launch carries the value: no host-to-device
    copy, which would wait on the GPU and cannot be captured in a CUDA graph."""
    if num_items is None or isinstance(num_items, Tensor):
        return num_items
    check_num_items(num_items, torch.device("cpu"))
    return torch.full((), float(num_items), dtype=torch.float64, device=device)


def _forward(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss, num_items, grad_mask):
    """``(loss, lse, grad_h, grad_W, backend)``: the dispatcher's kernel (backend None), or the forced one."""
    backend = dispatch.forced_backend()
    if backend is None:
        try:
            return (*_ops.linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss,
                                               num_items, grad_mask), None)
        except RuntimeError:  # the schema's argument parser: name the argument instead
            check_linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss,
                                       num_items)
            raise
    if not isinstance(h, Tensor):
        check_linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss, num_items)
    backend = dispatch.resolve(OP, backend, h.device, h.dtype)
    return (*dispatch.kernels(OP, backend).forward(h, W, labels, ignore_index, reduction, label_smoothing, softcap,
                                                   z_loss, num_items, grad_mask), backend)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd for :func:`linear_cross_entropy`: ``LinearCrossEntropyFunction.apply(h, W, labels,
    ignore_index, reduction, label_smoothing, softcap, z_loss, num_items)`` (every argument
    positional; see :func:`linear_cross_entropy`). Calls ``wiola::linear_cross_entropy`` —
    asking it for the gradients of a "mean"/"sum" loss, for the inputs that need them — and,
    in the backward, ``wiola::linear_cross_entropy_backward``, which scales those in place (or
    recomputes: "none", or a second backward through the graph); or the forced backend's
    kernels, kept on ``ctx``. Differentiable in ``h`` and ``W``."""

    @staticmethod
    def forward(ctx, h: Tensor, W: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                label_smoothing: float, softcap: float | None, z_loss: float, num_items) -> Tensor:
        items = _num_items(num_items, h.device if isinstance(h, Tensor) else torch.device("cpu"))
        want = (False, False) if reduction == "none" else (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        loss, lse, grad_h, grad_W, ctx.backend = _forward(h, W, labels, ignore_index, reduction, label_smoothing,
                                                          softcap, z_loss, items, want)
        ctx.args = (ignore_index, reduction, label_smoothing, softcap, z_loss)
        ctx.want = want
        if any(want) and torch.compiler.is_compiling():
            # A compiled graph passes them as values (its backward may run more than once).
            ctx.save_for_backward(h, W, labels, lse, items, grad_h, grad_W)
            ctx.grads = None
        else:
            ctx.save_for_backward(h, W, labels, lse, items)
            # Eager: kept off the saved tensors, so that the backward can scale them in place
            # and the first backward uses them up (a second one recomputes).
            ctx.grads = [grad_h, grad_W] if any(want) else None
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        saved = ctx.saved_tensors
        h, W, labels, lse, items = saved[:5]
        ignore_index, reduction, label_smoothing, softcap, z_loss = ctx.args
        need_h, need_W = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if len(saved) > 5:
            grad_h, grad_W = saved[5:]
            precomputed = True
        elif ctx.grads is not None:
            (grad_h, grad_W), ctx.grads = ctx.grads, None
            precomputed = True
        else:
            n, d = lse.shape[0], h.shape[-1]
            grad_h = empty_output((n, d), dtype=h.dtype, device=h.device) if need_h else None
            grad_W = empty_output(W.shape, dtype=W.dtype, device=W.device) if need_W else None
            precomputed = False
        if precomputed:
            grad_h = grad_h if ctx.want[0] and need_h else None
            grad_W = grad_W if ctx.want[1] and need_W else None
        args = (grad_loss, h, W, labels, lse, items, grad_h, grad_W, ignore_index, reduction, label_smoothing,
                softcap, z_loss, precomputed)
        if ctx.backend is None:
            _ops.linear_cross_entropy_backward(*args)
        else:
            dispatch.kernels(OP, ctx.backend).backward(*args)
        return (None if grad_h is None else grad_h.view(h.shape), grad_W, None, None, None, None, None, None, None)


def linear_cross_entropy(h: Tensor, W: Tensor, labels: Tensor, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, softcap: float | None = None, z_loss: float = 0.0,
                         num_items: int | float | Tensor | None = None) -> Tensor:
    """Cross-entropy of the logits ``h Wᵀ`` without ever holding them (SPEC §10.1):
    ``ℓ_i = (1−ε)(lse_i − s_{i,y_i}) + ε(lse_i − mean_v s_iv) + ζ·lse_i²`` with
    ``s_i = c·tanh(h_i Wᵀ / c)`` under a softcap (else ``h_i Wᵀ``), rows processed in chunks.

    How the gradients are produced: for ``"mean"`` and ``"sum"`` the forward, while a chunk's
    softmax is at hand, turns it into ``∂ℓ/∂s`` in place and folds it into ``∂h`` and ``∂W``
    (Liger-Kernel's choice); the backward only scales them by the incoming gradient. That
    is three GEMMs per training step, as eager PyTorch does — recomputing the logits in the
    backward (Cut Cross-Entropy's choice) would be a fourth, and on a CPU, where the GEMMs
    are the whole cost, that is a third more time; its saving, skipping negligible softmax
    entries, pays on GPUs with huge vocabularies, not here. The price is memory for ``∂h``
    and ``∂W`` during the forward, which the backward would allocate anyway. ``"none"``
    (row weights known only in the backward) and a second backward recompute.

    Args:
        h: hidden states ``(..., d)`` (leading dimensions flattened to N rows); float32,
            float64, bfloat16 or float16. Any strides.
        W: the output head ``(V, d)``, h's dtype (in Wiola the tied embedding; a transposed
            view or a slice of a larger matrix is read in place).
        labels: target ids, shape ``h.shape[:-1]`` or ``(N,)``; int64, int32, int16 or uint8,
            each in ``[0, V)`` or equal to ``ignore_index`` (checked on CPU tensors; on CUDA an
            out-of-range label gives that row a NaN loss).
        ignore_index: label of rows that contribute 0 and are not counted (default −100).
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (``(N,)`` row losses).
        label_smoothing: ε in ``[0, 1]``.
        softcap: c > 0 (Gemma-style logit soft-capping), or None.
        z_loss: ζ ≥ 0, the weight of ``lse²`` (PaLM's z-loss).
        num_items: divisor of ``"mean"`` instead of the number of counted rows — Hugging
            Face's ``num_items_in_batch``, so that gradient accumulation over micro-batches
            equals one large batch. A number > 0, or a one-element tensor (on h's device or
            the CPU; its value is not read on a GPU).

    Returns:
        The loss in float32 (float64 for float64 inputs) — a scalar, or ``(N,)`` for
        ``"none"``. ``"mean"`` with no counted row and no ``num_items`` is 0 (with zero
        gradients), where ``F.cross_entropy`` gives NaN. Differentiable in ``h`` and ``W``
        (through :class:`LinearCrossEntropyFunction`).

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype, shape or value.
    """
    if torch.compiler.is_compiling():
        return LinearCrossEntropyFunction.apply(*distinct(h, W, labels), ignore_index, reduction, label_smoothing,
                                                softcap, z_loss, num_items)
    if needs_grad(h, W):
        return LinearCrossEntropyFunction.apply(h, W, labels, ignore_index, reduction, label_smoothing, softcap,
                                                z_loss, num_items)
    return _forward(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss,
                    _num_items(num_items, h.device if isinstance(h, Tensor) else torch.device("cpu")), _NO_GRAD)[0]


# --- benchmark cases (wiola_kernels.bench: python -m wiola_kernels bench [--overhead]) -------------

def bench_cases(device: torch.device, size: str) -> list[dict]:
    """This op's benchmark cases at ``size`` (:data:`~wiola_kernels.shapes.BENCH_SIZES`; shapes
    in :mod:`wiola_kernels.shapes`), as keyword arguments of ``wiola_kernels.bench.BenchCase``:
    the wiola-360m head (tied embedding, V = 32000, d = 1024) on N = 4096 tokens, 5% of them
    padding (ignore_index), float32 and bfloat16 on the CPU; ``"tiny"`` (one decoding step's
    loss: 4 tokens, a 128-word head) is what ``bench --overhead`` times call by call."""
    n, d, V = shapes.bench_shape(OP, shapes.LCE_BENCH, device, size)

    def case(dtype: torch.dtype) -> dict:
        def make_inputs():
            g = torch.Generator(device="cpu").manual_seed(0)
            h = torch.randn(n, d, generator=g).to(device=device, dtype=dtype)
            W = (torch.randn(V, d, generator=g) * d ** -0.5).to(device=device, dtype=dtype)
            labels = torch.randint(0, V, (n,), generator=g)
            labels[torch.rand(n, generator=g) < 0.05] = -100
            return h, W, labels.to(device)

        return dict(op=OP, shape=f"h ({n}, {d}), W ({V}, {d})", dtype=dtype, make_inputs=make_inputs,
                    fused=lambda h, W, y: linear_cross_entropy(h, W, y),
                    eager=lambda h, W, y: reference.linear_cross_entropy(h, W, y),
                    differentiable=(0, 1), backward_rereads=(0, 1, 2), tolerance_kind="attention",
                    peak_memory=True, compute_bound=True)

    return [case(dtype) for dtype in shapes.bench_dtypes(device, size)]
