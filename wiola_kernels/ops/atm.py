"""ATM greedy adjacent merge / unmerge (SPEC §6): the registered ops ``wiola::atm_merge`` /
``wiola::atm_merge_grad`` and ``wiola::atm_unmerge`` / ``wiola::atm_unmerge_grad``, the
:class:`ATMMergeFunction` / :class:`ATMUnmergeFunction` that drive them, and the public
:func:`atm_merge` / :func:`atm_unmerge`.

Each backend provides, on contiguous tensors (``x, y (B, T, d)``, int64 ``positions
(B, T)``, ``lengths (B,)``, ``index_map (B, T)``):

* ``merge(x, positions, lengths, threshold) -> (merged, merged_positions, merged_lengths, index_map)``
* ``merge_backward(grad_merged, index_map, merged_lengths) -> grad_x``
* ``unmerge(y, index_map) -> restored``
* ``unmerge_backward(grad_restored, index_map) -> grad_y``

Merge decisions are constants for autograd (SPEC §6): gradients flow only through the
averaging (merge) and the copy back (unmerge). Values that would need a device sync
to check (lengths in ``[0, T]``, ``index_map`` entries in ``[0, T)``) are checked on CPU
tensors (``ValueError``, :mod:`wiola_kernels.validation`); the CUDA kernels clamp lengths
and write NaN for an out-of-range index instead of synchronising.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch
from . import distinct
from ..reference import atm as ref
from ..validation import (CUDA_KERNEL_DTYPES, Limits, check_index_map, check_index_map_values, check_lengths,
                          check_lengths_values, check_position_ids, check_rank, check_real, check_same_device,
                          check_tensor)

OP = "atm"


def _reference_merge(x, positions, lengths, threshold):
    check_lengths_values(lengths, x.shape[1])
    return ref.atm_merge(x, positions, threshold, lengths)


def _reference_unmerge(y, index_map):
    check_index_map_values(index_map, y.shape[1])
    return ref.atm_unmerge(y, index_map).contiguous()


def _reference_unmerge_backward(grad, index_map):
    check_index_map_values(index_map, grad.shape[1])
    return ref.atm_unmerge_backward(grad, index_map)


def _kernel_merge(x, positions, lengths, threshold):
    return torch.ops.wiola._atm_merge(x, positions, lengths, threshold)


def _kernel_merge_backward(grad_merged, index_map, merged_lengths):
    return torch.ops.wiola._atm_merge_bwd(grad_merged, index_map, merged_lengths)


def _kernel_unmerge(y, index_map):
    return torch.ops.wiola._atm_unmerge(y, index_map)


def _kernel_unmerge_backward(grad, index_map):
    return torch.ops.wiola._atm_unmerge_bwd(grad, index_map)


def _emu_merge(x, positions, lengths, threshold):
    return torch.ops.wiola_cuda_emu._atm_merge(x, positions, lengths, threshold)


def _emu_merge_backward(grad_merged, index_map, merged_lengths):
    return torch.ops.wiola_cuda_emu._atm_merge_bwd(grad_merged, index_map, merged_lengths)


def _emu_unmerge(y, index_map):
    return torch.ops.wiola_cuda_emu._atm_unmerge(y, index_map)


def _emu_unmerge_backward(grad, index_map):
    return torch.ops.wiola_cuda_emu._atm_unmerge_bwd(grad, index_map)


_REFERENCE = SimpleNamespace(merge=_reference_merge, merge_backward=ref.atm_merge_backward, unmerge=_reference_unmerge,
                             unmerge_backward=_reference_unmerge_backward)
_KERNELS = SimpleNamespace(merge=_kernel_merge, merge_backward=_kernel_merge_backward, unmerge=_kernel_unmerge,
                           unmerge_backward=_kernel_unmerge_backward)
# The CUDA kernels (csrc/cuda/atm.cu via csrc/cuda/atm_binding.cpp) exist for fp32/fp16/bf16;
# cuda_emu runs the same kernels and binding on CPU tensors, in the SIMT emulator.
_CUDA_LIMITS = Limits(dtypes=CUDA_KERNEL_DTYPES)
dispatch.register(OP, "reference", _REFERENCE)
dispatch.register(OP, "cpu", _KERNELS)  # csrc/cpu/atm.cpp (every float dtype)
dispatch.register(OP, "cuda", SimpleNamespace(**vars(_KERNELS)), _CUDA_LIMITS)
dispatch.register(OP, "cuda_emu", SimpleNamespace(merge=_emu_merge, merge_backward=_emu_merge_backward,
                                                  unmerge=_emu_unmerge, unmerge_backward=_emu_unmerge_backward),
                  _CUDA_LIMITS)


# --- merge ---------------------------------------------------------------------------

@torch.library.custom_op("wiola::atm_merge", mutates_args=())
def atm_merge_op(x: Tensor, positions: Tensor, lengths: Tensor, threshold: float,
                 backend: str = "auto") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x (B, T, d)``, int64 ``positions (B, T)`` and ``lengths (B,)`` →
    ``(merged, merged_positions, merged_lengths, index_map)``, on ``backend``."""
    impl = dispatch.resolve(OP, backend, x.device, x.dtype)
    return impl.merge(x.contiguous(), positions.contiguous(), lengths.contiguous(), threshold)


@atm_merge_op.register_fake
def _(x, positions, lengths, threshold, backend="auto"):
    b, t, _ = x.shape
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((b, t), dtype=torch.int64), x.new_empty((b,), dtype=torch.int64),
            x.new_empty((b, t), dtype=torch.int64))


@torch.library.custom_op("wiola::atm_merge_grad", mutates_args=())
def atm_merge_grad_op(grad_merged: Tensor, index_map: Tensor, merged_lengths: Tensor,
                      backend: str = "auto") -> Tensor:
    """``grad_x[b, t] = w_t · grad_merged[b, index_map[b, t]]`` (w: ½ pair, 1 single, 0 padding)."""
    impl = dispatch.resolve(OP, backend, grad_merged.device, grad_merged.dtype)
    return impl.merge_backward(grad_merged.contiguous(), index_map.contiguous(), merged_lengths.contiguous())


@atm_merge_grad_op.register_fake
def _(grad_merged, index_map, merged_lengths, backend="auto"):
    return torch.empty_like(grad_merged, memory_format=torch.contiguous_format)


def _check_x(name: str, x: object) -> tuple[int, int, int]:
    check_tensor(name, x)
    check_rank(name, x, 3, "(B, T, d)")
    b, t, d = x.shape
    if d == 0:
        raise ValueError(f"{name} must have a non-empty last dimension d, got shape {tuple(x.shape)}")
    return b, t, d


class ATMMergeFunction(torch.autograd.Function):
    """Autograd for :func:`atm_merge`: ``ATMMergeFunction.apply(x, position_ids, threshold,
    lengths)`` (every argument positional, ``lengths`` may be None; see :func:`atm_merge`).
    Validates, picks the backend once (kept on ``ctx``: the backward runs where the forward
    ran) and calls ``wiola::atm_merge`` / ``wiola::atm_merge_grad``. Only ``merged`` is
    differentiable; the merge decisions are constants."""

    @staticmethod
    def forward(ctx, x: Tensor, position_ids: Tensor, threshold: float, lengths: Tensor | None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        b, t, _ = _check_x("x", x)
        check_same_device(x=x, position_ids=position_ids, lengths=lengths)
        positions = check_position_ids(position_ids, b, t)
        threshold = check_real("threshold", threshold)
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must lie in [-1, 1] (a cosine similarity), got {threshold!r}")
        lengths = check_lengths(lengths, b, t)
        if lengths is None:
            lengths = torch.full((b,), t, dtype=torch.int64, device=x.device)
        ctx.backend = dispatch.select(OP, x.device, x.dtype)
        merged, merged_positions, merged_lengths, index_map = atm_merge_op(x, positions, lengths, threshold,
                                                                           ctx.backend)
        ctx.save_for_backward(index_map, merged_lengths)
        ctx.mark_non_differentiable(merged_positions, merged_lengths, index_map)
        return merged, merged_positions, merged_lengths, index_map

    @staticmethod
    def backward(ctx, grad_merged: Tensor, _grad_positions, _grad_lengths, _grad_index_map):
        index_map, merged_lengths = ctx.saved_tensors
        return atm_merge_grad_op(grad_merged, index_map, merged_lengths, ctx.backend), None, None, None


# --- unmerge -------------------------------------------------------------------------

@torch.library.custom_op("wiola::atm_unmerge", mutates_args=())
def atm_unmerge_op(y: Tensor, index_map: Tensor, backend: str = "auto") -> Tensor:
    """``restored[b, t] = y[b, index_map[b, t]]`` for ``y (B, T, d)``, on ``backend``."""
    return dispatch.resolve(OP, backend, y.device, y.dtype).unmerge(y.contiguous(), index_map.contiguous())


@atm_unmerge_op.register_fake
def _(y, index_map, backend="auto"):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


@torch.library.custom_op("wiola::atm_unmerge_grad", mutates_args=())
def atm_unmerge_grad_op(grad_restored: Tensor, index_map: Tensor, backend: str = "auto") -> Tensor:
    """``grad_y[b, s] = Σ_{t : index_map[b, t] = s} grad_restored[b, t]`` (deterministic)."""
    impl = dispatch.resolve(OP, backend, grad_restored.device, grad_restored.dtype)
    return impl.unmerge_backward(grad_restored.contiguous(), index_map.contiguous())


@atm_unmerge_grad_op.register_fake
def _(grad_restored, index_map, backend="auto"):
    return torch.empty_like(grad_restored, memory_format=torch.contiguous_format)


class ATMUnmergeFunction(torch.autograd.Function):
    """Autograd for :func:`atm_unmerge`: ``ATMUnmergeFunction.apply(y, index_map)``. Validates,
    picks the backend once (kept on ``ctx``: the backward runs where the forward ran) and calls
    ``wiola::atm_unmerge`` / ``wiola::atm_unmerge_grad``."""

    @staticmethod
    def forward(ctx, y: Tensor, index_map: Tensor) -> Tensor:
        b, t, _ = _check_x("y", y)
        check_index_map(index_map, b, t, like="y")
        check_same_device(y=y, index_map=index_map)
        ctx.backend = dispatch.select(OP, y.device, y.dtype)
        ctx.save_for_backward(index_map)
        return atm_unmerge_op(y, index_map, ctx.backend)

    @staticmethod
    def backward(ctx, grad_restored: Tensor):
        (index_map,) = ctx.saved_tensors
        return atm_unmerge_grad_op(grad_restored, index_map, ctx.backend), None


# --- public functions ----------------------------------------------------------------

def atm_merge(x: Tensor, position_ids: Tensor, threshold: float, lengths: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Greedy adjacent token merge (SPEC §6.1–6.2), static shapes.

    Pair ``(t, t+1)`` is a candidate when ``s_t = cos(x_t, x_{t+1}) > threshold``
    (strict) and both tokens are inside the row's length; candidates are taken greedily
    left to right without overlap. A taken pair becomes ``(x_t + x_{t+1})/2`` with
    position ``p_t``. The cosine is computed in float32 (float64 for float64 input) as
    ``dot / (‖x_t‖·‖x_{t+1}‖)`` clamped to ``[−1, 1]``, and is **0** when either vector
    is zero; it is compared with ``threshold`` in float64. ``threshold = 1`` never merges.

    Args:
        x: ``(B, T, d)``; float32, float64, bfloat16 or float16. Any strides.
        position_ids: integer ``(B, T)``, or ``(1, T)`` / ``(T,)`` shared by the batch.
        threshold: τ, a real number in ``[−1, 1]``.
        lengths: integer ``(B,)`` with values in ``[0, T]`` (checked on CPU tensors), or None
            (every row has length T). Tokens at ``t ≥ lengths[b]`` are padding: never merged.

    Returns:
        ``(merged, merged_position_ids, merged_lengths, index_map)``:

        * ``merged (B, T, d)``, dtype of x: row b's ``T'_b`` merged tokens first, zeros after;
        * ``merged_position_ids (B, T)`` int64: the first member's position; **0** in the
          zero region (slots ``≥ T'_b``);
        * ``merged_lengths (B,)`` int64: ``T'_b``;
        * ``index_map (B, T)`` int64: the merged slot of each original token; padding token
          ``t`` maps to ``T'_b + (t − lengths[b])``.

        Differentiable in ``x`` (decisions are constants; through :class:`ATMMergeFunction`):
        each member of a pair gets half of its slot's gradient, a singleton its own, padding zero.
    """
    return ATMMergeFunction.apply(*distinct(x, position_ids, threshold, lengths))


def atm_unmerge(y: Tensor, index_map: Tensor) -> Tensor:
    """Unmerge restoration (SPEC §6.3): ``restored[b, t] = y[b, index_map[b, t]]``.

    Both members of a merged pair receive their slot's value; padding tokens receive
    their zero-region slot.

    Args:
        y: merged-layer output ``(B, T, d)``; float32, float64, bfloat16 or float16.
        index_map: int64 ``(B, T)`` from :func:`atm_merge`, values in ``[0, T)``.

    Returns:
        ``restored (B, T, d)``, dtype of y. Differentiable in ``y`` (through
        :class:`ATMUnmergeFunction`): a slot receives the sum of the gradients of the tokens
        mapped to it (deterministic).
    """
    return ATMUnmergeFunction.apply(y, index_map)
