"""ATM greedy adjacent merge / unmerge as registered ops (SPEC §6):
``torch.ops.wiola.atm_merge`` / ``atm_unmerge`` (+ their ``*_backward`` ops).

Each backend provides, on contiguous tensors (``x, y (B, T, d)``, int64 ``positions
(B, T)``, ``lengths (B,)``, ``index_map (B, T)``):

* ``merge(x, positions, lengths, threshold) -> (merged, merged_positions, merged_lengths, index_map)``
* ``merge_backward(grad_merged, index_map, merged_lengths) -> grad_x``
* ``unmerge(y, index_map) -> restored``
* ``unmerge_backward(grad_restored, index_map) -> grad_y``

Merge decisions are constants for autograd (SPEC §6): gradients flow only through the
averaging (merge) and the copy back (unmerge). Values that would need a device sync
to check (lengths in ``[0, T]``, ``index_map`` entries in ``[0, T)``) are checked by
the CPU kernels and the reference (``ValueError``); the CUDA kernels clamp lengths
and write NaN for an out-of-range index instead of synchronising.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch
from ..reference import atm as ref
from ..validation import check_rank, check_real, check_same_device, check_tensor

OP = "atm"
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _check_lengths_values(lengths: Tensor, t: int) -> None:
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > t):
        raise ValueError(f"lengths must lie in [0, T] = [0, {t}], got values in "
                         f"[{int(lengths.min())}, {int(lengths.max())}]")


def _check_index_values(index_map: Tensor, t: int) -> None:
    if index_map.numel() and (int(index_map.min()) < 0 or int(index_map.max()) >= t):
        raise ValueError(f"index_map values must lie in [0, T) = [0, {t}), got values in "
                         f"[{int(index_map.min())}, {int(index_map.max())}]")


def _reference_merge(x, positions, lengths, threshold):
    _check_lengths_values(lengths, x.shape[1])
    return ref.atm_merge(x, positions, threshold, lengths)


def _reference_unmerge(y, index_map):
    _check_index_values(index_map, y.shape[1])
    return ref.atm_unmerge(y, index_map).contiguous()


def _reference_unmerge_backward(grad, index_map):
    _check_index_values(index_map, grad.shape[1])
    return ref.atm_unmerge_backward(grad, index_map)


def _kernel_merge(x, positions, lengths, threshold):
    return torch.ops.wiola._atm_merge(x, positions, lengths, threshold)


def _kernel_merge_backward(grad_merged, index_map, merged_lengths):
    return torch.ops.wiola._atm_merge_bwd(grad_merged, index_map, merged_lengths)


def _kernel_unmerge(y, index_map):
    return torch.ops.wiola._atm_unmerge(y, index_map)


def _kernel_unmerge_backward(grad, index_map):
    return torch.ops.wiola._atm_unmerge_bwd(grad, index_map)


def _kernel_unless_float64(kernel, fallback):
    """The CUDA kernels cover float32/float16/bfloat16; float64 CUDA tensors use the reference."""
    def run(t: Tensor, *args):
        return (fallback if t.dtype == torch.float64 else kernel)(t, *args)
    return run


_REFERENCE = SimpleNamespace(merge=_reference_merge, merge_backward=ref.atm_merge_backward, unmerge=_reference_unmerge,
                             unmerge_backward=_reference_unmerge_backward)
_KERNELS = SimpleNamespace(merge=_kernel_merge, merge_backward=_kernel_merge_backward, unmerge=_kernel_unmerge,
                           unmerge_backward=_kernel_unmerge_backward)
dispatch.register(OP, "reference", _REFERENCE)
dispatch.register(OP, "cpu", _KERNELS)  # csrc/cpu/atm.cpp (every float dtype)
dispatch.register(OP, "cuda", SimpleNamespace(**{  # csrc/cuda/atm.cu via csrc/cuda/atm_binding.cpp
    name: _kernel_unless_float64(getattr(_KERNELS, name), getattr(_REFERENCE, name))
    for name in ("merge", "merge_backward", "unmerge", "unmerge_backward")}))


def _emu_merge(x, positions, lengths, threshold):
    return torch.ops.wiola_cuda_emu._atm_merge(x, positions, lengths, threshold)


def _emu_merge_backward(grad_merged, index_map, merged_lengths):
    return torch.ops.wiola_cuda_emu._atm_merge_bwd(grad_merged, index_map, merged_lengths)


def _emu_unmerge(y, index_map):
    return torch.ops.wiola_cuda_emu._atm_unmerge(y, index_map)


def _emu_unmerge_backward(grad, index_map):
    return torch.ops.wiola_cuda_emu._atm_unmerge_bwd(grad, index_map)


# Test backend: the same CUDA kernels and binding, on CPU tensors, in the SIMT emulator.
_EMU = SimpleNamespace(merge=_emu_merge, merge_backward=_emu_merge_backward, unmerge=_emu_unmerge,
                       unmerge_backward=_emu_unmerge_backward)
dispatch.register(OP, "cuda_emu", SimpleNamespace(**{
    name: _kernel_unless_float64(getattr(_EMU, name), getattr(_REFERENCE, name))
    for name in ("merge", "merge_backward", "unmerge", "unmerge_backward")}))


# --- merge ---------------------------------------------------------------------------

@torch.library.custom_op("wiola::atm_merge", mutates_args=())
def atm_merge_op(x: Tensor, positions: Tensor, lengths: Tensor,
                 threshold: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x (B, T, d)``, int64 ``positions (B, T)`` and ``lengths (B,)`` →
    ``(merged, merged_positions, merged_lengths, index_map)``."""
    impl = dispatch.implementation(OP, x.device)
    return impl.merge(x.contiguous(), positions.contiguous(), lengths.contiguous(), threshold)


@atm_merge_op.register_fake
def _(x, positions, lengths, threshold):
    b, t, _ = x.shape
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((b, t), dtype=torch.int64), x.new_empty((b,), dtype=torch.int64),
            x.new_empty((b, t), dtype=torch.int64))


@torch.library.custom_op("wiola::atm_merge_backward", mutates_args=())
def atm_merge_backward_op(grad_merged: Tensor, index_map: Tensor, merged_lengths: Tensor,
                          backend: str = "auto") -> Tensor:
    """``grad_x[b, t] = w_t · grad_merged[b, index_map[b, t]]`` (w: ½ pair, 1 single, 0 padding)."""
    impl = dispatch.backward_implementation(OP, grad_merged.device, backend)
    return impl.merge_backward(grad_merged.contiguous(), index_map.contiguous(), merged_lengths.contiguous())


@atm_merge_backward_op.register_fake
def _(grad_merged, index_map, merged_lengths, backend="auto"):
    return torch.empty_like(grad_merged, memory_format=torch.contiguous_format)


def _merge_setup_context(ctx, inputs, output):
    _merged, _positions, merged_lengths, index_map = output
    ctx.save_for_backward(index_map, merged_lengths)
    ctx.backend = dispatch.select(OP, index_map.device)


def _merge_backward(ctx, grad_merged, _g_pos, _g_len, _g_map):
    index_map, merged_lengths = ctx.saved_tensors
    return atm_merge_backward_op(grad_merged, index_map, merged_lengths, ctx.backend), None, None, None


torch.library.register_autograd("wiola::atm_merge", _merge_backward, setup_context=_merge_setup_context)


# --- unmerge -------------------------------------------------------------------------

@torch.library.custom_op("wiola::atm_unmerge", mutates_args=())
def atm_unmerge_op(y: Tensor, index_map: Tensor) -> Tensor:
    """``restored[b, t] = y[b, index_map[b, t]]`` for ``y (B, T, d)``."""
    return dispatch.implementation(OP, y.device).unmerge(y.contiguous(), index_map.contiguous())


@atm_unmerge_op.register_fake
def _(y, index_map):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


@torch.library.custom_op("wiola::atm_unmerge_backward", mutates_args=())
def atm_unmerge_backward_op(grad_restored: Tensor, index_map: Tensor, backend: str = "auto") -> Tensor:
    """``grad_y[b, s] = Σ_{t : index_map[b, t] = s} grad_restored[b, t]`` (deterministic)."""
    impl = dispatch.backward_implementation(OP, grad_restored.device, backend)
    return impl.unmerge_backward(grad_restored.contiguous(), index_map.contiguous())


@atm_unmerge_backward_op.register_fake
def _(grad_restored, index_map, backend="auto"):
    return torch.empty_like(grad_restored, memory_format=torch.contiguous_format)


def _unmerge_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.backend = dispatch.select(OP, inputs[1].device)


def _unmerge_backward(ctx, grad_restored):
    (index_map,) = ctx.saved_tensors
    return atm_unmerge_backward_op(grad_restored, index_map, ctx.backend), None


torch.library.register_autograd("wiola::atm_unmerge", _unmerge_backward, setup_context=_unmerge_setup_context)


# --- public functions ----------------------------------------------------------------

def _check_x(name: str, x: object) -> tuple[int, int, int]:
    check_tensor(name, x)
    check_rank(name, x, 3, "(B, T, d)")
    b, t, d = x.shape
    if d == 0:
        raise ValueError(f"{name} must have a non-empty last dimension d, got shape {tuple(x.shape)}")
    return b, t, d


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
        position_ids: integer ``(B, T)`` or ``(T,)`` (shared by the batch).
        threshold: τ, a real number in ``[−1, 1]``.
        lengths: integer ``(B,)`` with values in ``[0, T]``, or None (every row has length T).
            Tokens at ``t ≥ lengths[b]`` are padding: never merged.

    Returns:
        ``(merged, merged_position_ids, merged_lengths, index_map)``:

        * ``merged (B, T, d)``, dtype of x: row b's ``T'_b`` merged tokens first, zeros after;
        * ``merged_position_ids (B, T)`` int64: the first member's position; **0** in the
          zero region (slots ``≥ T'_b``);
        * ``merged_lengths (B,)`` int64: ``T'_b``;
        * ``index_map (B, T)`` int64: the merged slot of each original token; padding token
          ``t`` maps to ``T'_b + (t − lengths[b])``.

        Differentiable in ``x`` (decisions are constants): each member of a pair gets half
        of its slot's gradient, a singleton its own, padding zero.
    """
    b, t, _ = _check_x("x", x)
    check_tensor("position_ids", position_ids, dtypes=_INT_DTYPES)
    if position_ids.dim() == 1:
        if position_ids.shape[0] != t:
            raise ValueError(f"position_ids must have shape (T,) = ({t},) or (B, T) = ({b}, {t}), "
                             f"got {tuple(position_ids.shape)}")
        positions = position_ids.to(torch.int64).expand(b, t)
    elif position_ids.dim() == 2:
        if tuple(position_ids.shape) != (b, t):
            raise ValueError(f"position_ids must have shape (B, T) = ({b}, {t}) or (T,) = ({t},), "
                             f"got {tuple(position_ids.shape)}")
        positions = position_ids.to(torch.int64)
    else:
        raise ValueError(f"position_ids must have shape (B, T) = ({b}, {t}) or (T,) = ({t},), "
                         f"got {tuple(position_ids.shape)}")
    threshold = check_real("threshold", threshold)
    if not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must lie in [-1, 1] (a cosine similarity), got {threshold!r}")
    if lengths is None:
        lengths = torch.full((b,), t, dtype=torch.int64, device=x.device)
    else:
        check_tensor("lengths", lengths, dtypes=_INT_DTYPES)
        if tuple(lengths.shape) != (b,):
            raise ValueError(f"lengths must have shape (B,) = ({b},), got {tuple(lengths.shape)}")
        lengths = lengths.to(torch.int64)
    check_same_device(x=x, position_ids=position_ids, lengths=lengths)
    return atm_merge_op(x, positions, lengths, threshold)


def atm_unmerge(y: Tensor, index_map: Tensor) -> Tensor:
    """Unmerge restoration (SPEC §6.3): ``restored[b, t] = y[b, index_map[b, t]]``.

    Both members of a merged pair receive their slot's value; padding tokens receive
    their zero-region slot.

    Args:
        y: merged-layer output ``(B, T, d)``; float32, float64, bfloat16 or float16.
        index_map: int64 ``(B, T)`` from :func:`atm_merge`, values in ``[0, T)``.

    Returns:
        ``restored (B, T, d)``, dtype of y. Differentiable in ``y``: a slot receives the
        sum of the gradients of the tokens mapped to it (deterministic).
    """
    b, t, _ = _check_x("y", y)
    check_tensor("index_map", index_map, dtypes=(torch.int64,))
    if tuple(index_map.shape) != (b, t):
        raise ValueError(f"index_map must have shape (B, T) = ({b}, {t}) to match y, got {tuple(index_map.shape)}")
    check_same_device(y=y, index_map=index_map)
    return atm_unmerge_op(y, index_map)
