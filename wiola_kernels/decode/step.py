"""A whole cached decoding step of a Wiola model on the CPU, in one call (SPEC §2, §5.1).

:func:`~wiola_kernels.decode.block.decode_block` made each block one C++ call; what remained
between the blocks was the model's Python — the loop over the layers, the context slots'
stack, the cache bookkeeping, each block's dozen-weight argument list — and it ran cold, after
every block had streamed tens of MB of weights through the caches: ~5 ms of a 45 ms
wiola-360m bf16 step on a 2-core Sapphire Rapids VM, 11 %. :func:`decode_step` runs the whole
step in one call (``torch.ops.wiola._decode_step``, ``csrc/cpu/decode_step.cpp``), with the
kernels the model's Python step calls, in the same order, so the two agree bit for bit:

* ``x = E[input_ids]``, ``normed = WRMSNorm_0(x)`` (the rms_norm op);
* per layer ℓ, :func:`~wiola_kernels.decode.block.decode_block` with the context slots
  ``stack(the last Λ' layers' causal summaries)``, the next norm (``WRMSNorm_ℓ₊₁``, or the
  final norm after the last layer) and the layer's running summary sum;
* ``logits = normed · W_headᵀ`` (the decoding GEMV).

Every row of ``input_ids`` adds one unpadded position to caches that hold ``past`` positions;
the blocks write the new keys and values into the cache buffers at index ``past``. No
autograd: decoding only.

Example (what ``wiola.decode.fused_step`` passes for a :class:`wiola.WiolaForCausalLM`)::

    logits, sums = decode_step(ids, E, weights, norms, betas, gates, k_bufs, v_bufs, past,
                               positions, n_head=16, theta=1e4, spiral_divisor=8.0,
                               radial_amplitude=0.1, radial_frequency=0.01, lookback=2,
                               summary_sums=sums)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _extension
from .block import WEIGHTS


def _kernel():
    return _extension.cpu_op("_decode_step", "wiola_kernels.decode.step")


def available() -> bool:
    """Whether the C++ kernel is loaded (the extension was built and imported)."""
    return _extension.has_cpu_op("_decode_step")


def decode_step(input_ids: Tensor, embed_weight: Tensor, weights: Sequence[Tensor],
                norms: Sequence[tuple[Tensor, Tensor | None, float]], betas: Sequence[Tensor],
                gates: Sequence[Tensor], k_caches: Sequence[Tensor], v_caches: Sequence[Tensor], past: int,
                position_ids: Tensor, n_head: int, *, theta: float, spiral_divisor: float, radial_amplitude: float,
                radial_frequency: float, lookback: int = 0, summary_sums: Sequence[Tensor] = (),
                head_weight: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
    """One decoding step of an ``L``-layer Wiola model (see the module docstring).

    Args:
        input_ids: ``(B, 1)`` int64, ids in ``[0, V)``; CPU.
        embed_weight: the token embedding ``E (V, d)``: float32, bfloat16 or float16.
        weights: ``12·L`` matrices, layer by layer in the order of
            :data:`wiola_kernels.decode.block.WEIGHTS`, ``nn.Linear`` layout, read in place.
        norms: ``2·L + 1`` triples ``(weight, shift or None, eps)``: ``WRMSNorm_ℓ`` and
            ``WRMSNorm'_ℓ`` of each layer, then the final norm.
        betas: DSFF's blend logits, ``(d,)`` per layer.  gates: GCLA's gate logits ``(H,)``.
        k_caches, v_caches: per layer the ``(B, H_kv, capacity, d_h)`` buffers, with room at
            index ``past``; written there.
        past: the positions each cache holds (≥ 0).
        position_ids: ``(B, 1)`` int64, the new positions (SRPE).
        n_head, theta, spiral_divisor, radial_amplitude, radial_frequency: the attention's
            heads and SRPE's parameters (SPEC §4), as for
            :func:`~wiola_kernels.decode.attention.decode_attention`.
        lookback: ``Λ'``, how many earlier layers' summaries each layer attends to (0: none).
        summary_sums: with ``lookback > 0``, the ``L − 1`` running sums ``(B, d)`` float32 of
            every layer's outputs but the last's; empty otherwise.
        head_weight: the output head ``(V, d)``; None: the embedding (tied).

    Returns:
        ``(logits (B, 1, V) in the weights' dtype, the L − 1 new summary sums)`` (the inputs are
        not modified; an empty list without ``lookback``).

    Raises:
        TypeError / ValueError naming the argument (from this wrapper or the kernels it runs),
        e.g. an id outside ``[0, V)`` or lists of the wrong lengths.
    """
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    layers = len(betas)
    if len(weights) != len(WEIGHTS) * layers:
        raise ValueError(f"weights must hold the {len(WEIGHTS)} matrices {', '.join(WEIGHTS)} per layer "
                         f"({len(WEIGHTS) * layers} for {layers} layers), got {len(weights)}")
    if any(not (isinstance(n, (tuple, list)) and len(n) == 3) for n in norms):
        raise TypeError("norms must be (weight, shift or None, eps) triples")
    if isinstance(lookback, bool) or not isinstance(lookback, int):
        raise TypeError(f"lookback must be an int, got {type(lookback).__name__}")
    logits, sums = _kernel()(input_ids, embed_weight, list(weights), [n[0] for n in norms], [n[1] for n in norms],
                             [float(n[2]) for n in norms], list(betas), list(gates), list(k_caches), list(v_caches),
                             past, position_ids, n_head, theta, spiral_divisor, radial_amplitude, radial_frequency,
                             lookback, list(summary_sums), embed_weight if head_weight is None else head_weight)
    return logits, list(sums)


__all__ = ["available", "decode_step"]
