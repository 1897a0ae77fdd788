"""ATM greedy adjacent token merging, merge / unmerge (SPEC §6): :func:`atm_merge` /
:func:`atm_unmerge`, the :class:`ATMMergeFunction` / :class:`ATMUnmergeFunction` that drive their
registered ops, and their kernels written in Python.

Registered ops (declared in csrc/cpu/atm.cpp from wiola/cuda_schemas.h):

* ``wiola::atm_merge(x, position_ids, threshold, lengths) -> (merged, merged_position_ids,
  merged_lengths, index_map)`` and ``wiola::atm_merge_backward(grad_merged, index_map,
  merged_lengths) -> grad_x``
* ``wiola::atm_unmerge(y, index_map) -> restored`` and
  ``wiola::atm_unmerge_backward(grad_restored, index_map) -> grad_y``

Merge decisions are constants for autograd (SPEC §6): gradients flow only through the
averaging (merge) and the copy back (unmerge). Values that would need a device sync to check
(lengths in ``[0, T]``, ``index_map`` entries in ``[0, T)``) are checked on CPU tensors
(``ValueError``); the CUDA kernels clamp lengths and write NaN for an out-of-range index
instead of synchronising.

Kernels: CPU — csrc/cpu/atm.cpp; CUDA — csrc/cuda/atm.cu through csrc/cuda/atm_binding.cpp;
Meta — the fakes below. Forced backends: ``reference``, ``cpu``, ``cuda``, ``cuda_emu`` (the
CUDA kernels and their binding, emulated on CPU tensors: ``torch.ops.wiola_cuda_emu``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .. import dispatch, reference, shapes
from ..reference import atm as ref
from ..validation import (CUDA_KERNEL_DTYPES, Limits, can_read_values, check_lengths, check_position_ids,
                          check_rank, check_real, check_same_device, check_tensor)
from . import distinct, needs_grad, register_fake, registered, registered_ops


__all__ = ["ATMMergeFunction", "ATMUnmergeFunction", "atm_merge", "atm_unmerge"]  # exported by wiola_kernels

OP = "atm"
# The registered ops' overloads, looked up once: a call skips the overload resolution of
# ``torch.ops.wiola.<name>(...)``.
_ops = registered_ops("atm_merge", "atm_merge_backward", "atm_unmerge", "atm_unmerge_backward")


# --- argument checks ------------------------------------------------------------------------------
# What the kernels written in Python and the fakes check at entry, in the words of the C++
# kernels' checks::atm (csrc/include/wiola/checks.h).

def check_index_map(index_map: object, b: int, t: int, *, like: str) -> torch.Tensor:
    """An ATM ``index_map``: int64 ``(B, T)`` matching ``like``'s first two dims, values in ``[0, T)``."""
    check_tensor("index_map", index_map, dtypes=(torch.int64,))
    if tuple(index_map.shape) != (b, t):
        raise ValueError(f"index_map must have shape (B, T) = ({b}, {t}) to match {like}, "
                         f"got {tuple(index_map.shape)}")
    check_index_map_values(index_map, t)
    return index_map


def check_index_map_values(index_map: torch.Tensor, t: int) -> None:
    """``index_map`` values lie in ``[0, T)`` (checked on CPU tensors only)."""
    if can_read_values(index_map):
        lo, hi = int(index_map.min()), int(index_map.max())
        if lo < 0 or hi >= t:
            raise ValueError(f"index_map values must lie in [0, T) = [0, {t}), got values in [{lo}, {hi}]")


def check_atm_tokens(name: str, x: object) -> tuple[int, int, int]:
    """ATM's ``(B, T, d)`` tokens (``x``, ``y`` or a gradient: ``name``) with ``d > 0``."""
    check_tensor(name, x)
    check_rank(name, x, 3, "(B, T, d)")
    b, t, d = x.shape
    if d == 0:
        raise ValueError(f"{name} must have a non-empty last dimension d, got shape {tuple(x.shape)}")
    return b, t, d


def check_atm_merge(x: object, position_ids: object, threshold: object, lengths: object
                    ) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Arguments of :func:`wiola_kernels.atm_merge`; returns int64 ``(B, T)`` positions, the
    threshold as a float and int64 ``(B,)`` lengths (``T`` for every row when None)."""
    b, t, _ = check_atm_tokens("x", x)
    check_same_device(x=x, position_ids=position_ids, lengths=lengths)
    positions = check_position_ids(position_ids, b, t)
    threshold = check_real("threshold", threshold)
    if not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must lie in [-1, 1] (a cosine similarity), got {threshold!r}")
    lengths = check_lengths(lengths, b, t)
    if lengths is None:
        lengths = torch.full((b,), t, dtype=torch.int64, device=x.device)
    return positions, threshold, lengths


def check_atm_unmerge(y: object, index_map: object, name: str = "y") -> None:
    """Arguments of :func:`wiola_kernels.atm_unmerge` (``name``: what to call ``y``)."""
    b, t, _ = check_atm_tokens(name, y)
    check_index_map(index_map, b, t, like=name)
    check_same_device(**{name: y}, index_map=index_map)


# --- kernels ---------------------------------------------------------------------------------------

def _reference_merge(x, position_ids, threshold, lengths=None):
    positions, threshold, lengths = check_atm_merge(x, position_ids, threshold, lengths)
    return ref.atm_merge(x, positions, threshold, lengths)


def _reference_unmerge(y, index_map):
    check_atm_unmerge(y, index_map)
    return ref.atm_unmerge(y, index_map).contiguous()


def _reference_unmerge_backward(grad_restored, index_map):
    check_atm_unmerge(grad_restored, index_map, "grad_restored")
    return ref.atm_unmerge_backward(grad_restored, index_map)


def _kernels(namespace: str) -> SimpleNamespace:
    """The four registered ops of ``namespace`` (``wiola``: the dispatcher's kernels;
    ``wiola_cuda_emu``: the CUDA kernels emulated on CPU tensors), looked up when called."""
    return SimpleNamespace(
        merge=registered(namespace, "atm_merge", check_atm_merge),
        merge_backward=registered(namespace, "atm_merge_backward", lambda g, m, n: check_atm_unmerge(g, m, "grad_merged")),
        unmerge=registered(namespace, "atm_unmerge", check_atm_unmerge),
        unmerge_backward=registered(namespace, "atm_unmerge_backward",
                                    lambda g, m: check_atm_unmerge(g, m, "grad_restored")))


_CUDA_LIMITS = Limits(dtypes=CUDA_KERNEL_DTYPES)  # the CUDA kernels: fp32, fp16, bf16
dispatch.register_default(OP, "cpu", "cpu")
dispatch.register_default(OP, "cuda", "cuda")
dispatch.register(OP, "reference", SimpleNamespace(merge=_reference_merge, merge_backward=ref.atm_merge_backward,
                                                   unmerge=_reference_unmerge,
                                                   unmerge_backward=_reference_unmerge_backward))
dispatch.register(OP, "cpu", _kernels("wiola"))  # csrc/cpu/atm.cpp (every float dtype)
dispatch.register(OP, "cuda", _kernels("wiola"), _CUDA_LIMITS)
dispatch.register(OP, "cuda_emu", _kernels("wiola_cuda_emu"), _CUDA_LIMITS)


def _merge_fake(x, position_ids, threshold, lengths=None):
    check_atm_merge(x, position_ids, threshold, lengths)
    b, t, _ = x.shape
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device), x.new_empty((b, t), dtype=torch.int64),
            x.new_empty((b,), dtype=torch.int64), x.new_empty((b, t), dtype=torch.int64))


def _merge_backward_fake(grad_merged, index_map, merged_lengths):
    return torch.empty(grad_merged.shape, dtype=grad_merged.dtype, device=grad_merged.device)


def _unmerge_fake(y, index_map):
    check_atm_unmerge(y, index_map)
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


def _unmerge_backward_fake(grad_restored, index_map):
    return torch.empty(grad_restored.shape, dtype=grad_restored.dtype, device=grad_restored.device)


for _ns in ("wiola", "wiola_cuda_emu"):
    register_fake(f"{_ns}::atm_merge")(_merge_fake)
    register_fake(f"{_ns}::atm_merge_backward")(_merge_backward_fake)
    register_fake(f"{_ns}::atm_unmerge")(_unmerge_fake)
    register_fake(f"{_ns}::atm_unmerge_backward")(_unmerge_backward_fake)


# --- merge -----------------------------------------------------------------------------------------

def _merge(x, position_ids, threshold, lengths):
    """The four outputs and the backend (None: the dispatcher's kernel)."""
    backend = dispatch.forced_backend()
    if backend is None:
        try:
            return (*_ops.atm_merge(x, position_ids, threshold, lengths), None)
        except RuntimeError:  # the schema's argument parser: name the argument instead
            check_atm_merge(x, position_ids, threshold, lengths)
            raise
    if not isinstance(x, Tensor):
        check_atm_tokens("x", x)
    backend = dispatch.resolve(OP, backend, x.device, x.dtype)
    return (*dispatch.kernels(OP, backend).merge(x, position_ids, threshold, lengths), backend)


class ATMMergeFunction(torch.autograd.Function):
    """Autograd for :func:`atm_merge`: ``ATMMergeFunction.apply(x, position_ids, threshold,
    lengths)`` (every argument positional, ``lengths`` may be None; see :func:`atm_merge`).
    Calls ``wiola::atm_merge`` and, in the backward, ``wiola::atm_merge_backward`` — or the
    forced backend's kernels, kept on ``ctx``. Only ``merged`` is differentiable; the merge
    decisions are constants."""

    @staticmethod
    def forward(ctx, x: Tensor, position_ids: Tensor, threshold: float, lengths: Tensor | None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        merged, merged_positions, merged_lengths, index_map, ctx.backend = _merge(x, position_ids, threshold, lengths)
        ctx.save_for_backward(index_map, merged_lengths)
        ctx.mark_non_differentiable(merged_positions, merged_lengths, index_map)
        return merged, merged_positions, merged_lengths, index_map

    @staticmethod
    def backward(ctx, grad_merged: Tensor, _grad_positions, _grad_lengths, _grad_index_map):
        index_map, merged_lengths = ctx.saved_tensors
        if ctx.backend is None:
            grad_x = _ops.atm_merge_backward(grad_merged, index_map, merged_lengths)
        else:
            grad_x = dispatch.kernels(OP, ctx.backend).merge_backward(grad_merged, index_map, merged_lengths)
        return grad_x, None, None, None


# --- unmerge ---------------------------------------------------------------------------------------

def _unmerge(y, index_map):
    """The restored tensor and the backend (None: the dispatcher's kernel)."""
    backend = dispatch.forced_backend()
    if backend is None:
        try:
            return _ops.atm_unmerge(y, index_map), None
        except RuntimeError:  # the schema's argument parser: name the argument instead
            check_atm_unmerge(y, index_map)
            raise
    if not isinstance(y, Tensor):
        check_atm_tokens("y", y)
    backend = dispatch.resolve(OP, backend, y.device, y.dtype)
    return dispatch.kernels(OP, backend).unmerge(y, index_map), backend


class ATMUnmergeFunction(torch.autograd.Function):
    """Autograd for :func:`atm_unmerge`: ``ATMUnmergeFunction.apply(y, index_map)``. Calls
    ``wiola::atm_unmerge`` and, in the backward, ``wiola::atm_unmerge_backward`` — or the
    forced backend's kernels, kept on ``ctx``."""

    @staticmethod
    def forward(ctx, y: Tensor, index_map: Tensor) -> Tensor:
        restored, ctx.backend = _unmerge(y, index_map)
        ctx.save_for_backward(index_map)
        return restored

    @staticmethod
    def backward(ctx, grad_restored: Tensor):
        (index_map,) = ctx.saved_tensors
        if ctx.backend is None:
            grad_y = _ops.atm_unmerge_backward(grad_restored, index_map)
        else:
            grad_y = dispatch.kernels(OP, ctx.backend).unmerge_backward(grad_restored, index_map)
        return grad_y, None


# --- public functions ------------------------------------------------------------------------------

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

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype, shape or value.
    """
    if torch.compiler.is_compiling():
        return ATMMergeFunction.apply(*distinct(x, position_ids, threshold, lengths))
    if needs_grad(x):
        return ATMMergeFunction.apply(x, position_ids, threshold, lengths)
    return _merge(x, position_ids, threshold, lengths)[:4]


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

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype, shape or value.
    """
    if torch.compiler.is_compiling():
        return ATMUnmergeFunction.apply(*distinct(y, index_map))
    if needs_grad(y):
        return ATMUnmergeFunction.apply(y, index_map)
    return _unmerge(y, index_map)[0]


# --- benchmark cases (wiola_kernels.bench: python -m wiola_kernels bench [--overhead]) -------------

def bench_cases(device: torch.device, size: str) -> list[dict]:
    """This op's benchmark cases at ``size`` (:data:`~wiola_kernels.shapes.BENCH_SIZES`; shapes
    in :mod:`wiola_kernels.shapes`), as keyword arguments of ``wiola_kernels.bench.BenchCase``:
    merge + unmerge at τ = 0.92 on random tokens with ~10% of adjacent pairs planted as
    near-duplicates (cos ≈ 0.998; unplanted pairs have |cos| ≈ 0.03 at d = 1024). ``"tiny"``
    (8 tokens) is what ``bench --overhead`` times call by call: one case per public function,
    named after it."""
    b, t, d = shapes.bench_shape(OP, shapes.ATM_BENCH, device, size)
    dtype = torch.float32 if device.type == "cpu" else shapes.bench_dtype(device, size)
    tau, planted = 0.92, 0.10
    notes: dict = {"tau": tau, "planted_pair_rate": planted}

    def tokens():
        g = torch.Generator(device="cpu").manual_seed(0)
        copy_prev = torch.rand(b, t, generator=g) < planted           # token t repeats token t-1
        copy_prev[:, 0] = False
        group = torch.cumsum(~copy_prev, dim=1) - 1                    # (B, T) source token
        base = torch.randn(b, t, d, generator=g)
        x = base.gather(1, group.unsqueeze(-1).expand(b, t, d)) + 0.05 * torch.randn(b, t, d, generator=g)
        return x.to(device=device, dtype=dtype), torch.arange(t, device=device).expand(b, t).contiguous()

    def make_inputs():
        x, positions = tokens()
        with torch.no_grad():
            merged_len = reference.atm_merge(x, positions, tau)[2].double()
        # Attention FLOPs scale with T² per row (a causal mask halves both sides alike).
        notes["merged_token_pct"] = round(100.0 * float(1 - merged_len.sum() / (b * t)), 2)
        notes["attention_flops_saved_pct"] = round(100.0 * float(1 - (merged_len ** 2).sum() / (b * t * t)), 2)
        return x, positions

    def fused(x, positions):
        merged, _, _, index_map = atm_merge(x, positions, tau)
        return atm_unmerge(merged, index_map)

    def eager(x, positions):
        merged, _, _, index_map = reference.atm_merge(x, positions, tau)
        return reference.atm_unmerge(merged, index_map)

    if size == "tiny":
        def unmerge_inputs():
            x, positions = tokens()
            return x, reference.atm_merge(x, positions, tau)[3]

        return [dict(op="atm_merge", shape=f"x ({b}, {t}, {d})", dtype=dtype, make_inputs=tokens,
                     fused=lambda x, p: atm_merge(x, p, tau), eager=lambda x, p: reference.atm_merge(x, p, tau)),
                dict(op="atm_unmerge", shape=f"y ({b}, {t}, {d})", dtype=dtype, make_inputs=unmerge_inputs,
                     fused=atm_unmerge, eager=reference.atm_unmerge)]
    return [dict(op=OP, shape=f"x ({b}, {t}, {d}), merge+unmerge", dtype=dtype, make_inputs=make_inputs,
                 fused=fused, eager=eager, differentiable=(0,), notes=notes)]
