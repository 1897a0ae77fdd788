"""One Wiola block of a cached decoding step on the CPU, in one call (SPEC §2, §5, §7).

At batch 1 a decoding step is a chain of GEMVs (:mod:`~wiola_kernels.decode.gemv`) with a
dozen small operations between them per block — the attention over the cache, two residual
adds with their norms, the DSFF activations and blend, the running causal summary. Each is a
few microseconds of arithmetic; called from Python each cost ~10–30 µs of interpreter and
dispatch time, about a millisecond per block of wiola-360m. :func:`decode_block` runs the
block's whole sequence in one C++ call (``torch.ops.wiola._decode_block``,
``csrc/cpu/decode_block.cpp``): the GEMVs and the attention through the dispatcher, and the
work between them as loops over the rows with the roundings of the model's Python decoding
step (``wiola.model``: each op's output rounded to the model's dtype, statistics
in float32), so the two agree to rounding; only the interpreter and dispatch time goes.

For ``x (B, 1, d)`` (one new position per row) and ``normed = WRMSNorm_ℓ(x)``:

* ``A = W_O · decode_attention([W_Q | W_K | W_V] normed, cache, [W_Kc | W_Vc] context, gate)``
  (:func:`wiola_kernels.decode.attention.decode_attention`, which appends the new key and value);
* ``H', X' = add_rms_norm(A, x, ffn_norm)``;
* ``F = lerp(W_w2 GELU-GLU(u_w), W_n2 SiLU-GLU(u_n), σ(β))`` with
  ``u = [W_n1 | W_n3 | W_w1 | W_w3] H'``;
* ``Y, X'' = add_rms_norm(F, X', next_norm)`` (``X'' = X' + F`` without a next norm);
* with a running summary sum ``S (B, d)`` (float32): ``S + X''`` and the causal summary
  ``(S + X'') / (past + 1)`` in x's dtype (SPEC §5.1).

No autograd: decoding only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _extension

#: The order of :func:`decode_block`'s ``weights``.
WEIGHTS = ("W_Q", "W_K", "W_V", "W_O", "W_Kc", "W_Vc", "W_n1", "W_n3", "W_w1", "W_w3", "W_n2", "W_w2")


def _kernel():
    return _extension.cpu_op("_decode_block", "wiola_kernels.decode.block")


def available() -> bool:
    """Whether the C++ kernel is loaded (the extension was built and imported)."""
    return _extension.has_cpu_op("_decode_block")


def decode_block(x: Tensor, normed: Tensor, weights: Sequence[Tensor], ffn_norm: tuple[Tensor, Tensor | None, float],
                 next_norm: tuple[Tensor, Tensor | None, float] | None, beta: Tensor, gate: Tensor,
                 k_cache: Tensor, v_cache: Tensor, past: int, position_ids: Tensor, n_head: int, *, theta: float,
                 spiral_divisor: float, radial_amplitude: float, radial_frequency: float,
                 context: Tensor | None = None, summary_sum: Tensor | None = None
                 ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """One block of a decoding step (see the module docstring).

    Args:
        x, normed: ``(B, 1, d)``, the block's input and ``WRMSNorm_ℓ(x)``; CPU, float32,
            bfloat16 or float16 (the weights' dtype).
        weights: the 12 matrices of :data:`WEIGHTS`, ``nn.Linear`` layout, read in place.
        ffn_norm, next_norm: ``(weight, shift or None, eps)`` of ``WRMSNorm'_ℓ`` and of the
            norm that reads the block's output next (None: return ``X''`` without it).
        beta: DSFF's blend logits ``(d,)``.  gate: GCLA's gate logits ``(H,)``.
        k_cache, v_cache, past, position_ids, n_head, theta, spiral_divisor,
            radial_amplitude, radial_frequency: as for
            :func:`~wiola_kernels.decode.attention.decode_attention`.
        context: ``(B, 1, Λ', d)`` context slots (at most 16 rows ``B·Λ'``), or None.
        summary_sum: ``(B, d)`` float32 running sum of this layer's outputs, or None.

    Returns:
        ``(X'', next_norm(X'') or None, S + X'' or None, summary (B, 1, d) or None)``.

    Raises:
        TypeError / ValueError: from the kernels it runs, naming the argument.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if len(weights) != len(WEIGHTS):
        raise ValueError(f"weights must be the {len(WEIGHTS)} matrices {', '.join(WEIGHTS)}, got {len(weights)}")
    nw, ns, ne = next_norm if next_norm is not None else (None, None, 0.0)
    out, y, s, summary = _kernel()(x, normed, list(weights), ffn_norm[0], ffn_norm[1], ffn_norm[2], nw, ns, ne, beta,
                                   gate, k_cache, v_cache, past, position_ids, n_head, theta, spiral_divisor,
                                   radial_amplitude, radial_frequency, context, summary_sum)
    return out, (y if nw is not None else None), (s if summary_sum is not None else None), \
        (summary if summary_sum is not None else None)


__all__ = ["WEIGHTS", "available", "decode_block"]
