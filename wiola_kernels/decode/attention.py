"""A cached decoding step's attention on the CPU, in one call: SRPE, the cache append, the GQA
softmax over the cache and the gated context slots (SPEC §4, §5).

At batch 1 a decoding step's attention is little arithmetic — one query row per head against
a few hundred cached keys — but done op by op it took ~15 calls per block (SRPE, the cache
update, two ``scaled_dot_product_attention`` calls, the gate), whose dispatch cost more than
the work. :func:`decode_attention` does it in one C++ call (``torch.ops.wiola._decode_attention``,
``csrc/cpu/decode_attention.cpp``) from the step's ``[q | k | v]`` projection (the
:mod:`~wiola_kernels.decode.gemv` output), for a batch of rows each at one new position:

* ``q̃, k̃ = SRPE(q, k)`` at each row's position, with the srpe op's own table and rotation
  (rounded to the input dtype, as that op's outputs are);
* ``k̃`` and ``v`` are written into the caller's cache buffers at index ``past``;
* head ``h`` (group ``h mod H_kv``) attends over the ``past + 1`` cached keys:
  ``softmax(q̃_h K̃ᵀ / √d_h) V``;
* with context slots: ``+ σ(gate_h) · Σ_λ softmax_λ(q_h · kc_λ,h / √d_h) vc_λ,h`` (the
  unrotated ``q``; one slot has weight 1, so it needs no keys).

Accumulates in float32 and rounds each head's output once; every sum is one thread's, in a
fixed order, so results do not depend on ``torch.set_num_threads``. No autograd: decoding only.

    out = decode_attention(qkv, k_buf, v_buf, past, position_ids, n_head=16, theta=1e4,
                           spiral_divisor=8.0, radial_amplitude=0.1, radial_frequency=0.01)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _extension

#: The dtypes the kernel reads (the decoding GEMV's).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel():
    return _extension.cpu_op("_decode_attention", "wiola_kernels.decode.attention")


def available() -> bool:
    """Whether the C++ kernel is loaded (the extension was built and imported)."""
    return _extension.has_cpu_op("_decode_attention")


def applies(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :func:`decode_attention` runs for a model of ``dtype`` on ``device`` (CPU, a
    dtype of :data:`DTYPES`, the extension loaded)."""
    return torch.device(device).type == "cpu" and dtype in DTYPES and available()


def decode_attention(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, past: int, position_ids: Tensor, n_head: int, *,
                     theta: float, spiral_divisor: float, radial_amplitude: float, radial_frequency: float,
                     context_k: Tensor | None = None, context_v: Tensor | None = None,
                     gate: Tensor | None = None) -> Tensor:
    """GCLA of one new position per row against a KV cache, appending to the cache.

    Args:
        qkv: ``(B, (H + 2·H_kv)·d_h)`` — each row ``[q | k | v]``, heads in order, as
            ``[W_Q | W_K | W_V]`` produce it. float32, bfloat16 or float16; the last
            dimension contiguous.
        k_cache, v_cache: ``(B, H_kv, capacity, d_h)`` buffers of ``qkv``'s dtype (the last
            dimension contiguous) holding ``past`` cached positions; the new rotated key and
            value are written at index ``past`` (``past < capacity``).
        past: how many positions the cache holds before this step.
        position_ids: ``(B,)`` or ``(B, 1)`` int64, each row's new position.
        n_head: ``H``, a multiple of ``H_kv``.
        theta, spiral_divisor, radial_amplitude, radial_frequency: SRPE's ``θ₀, k_s, a_s,
            f_s`` (SPEC §4; ``spiral_divisor = inf, radial_amplitude = 0`` is plain RoPE).
        context_k, context_v: ``(B, Λ', H·d_h)`` — the context slots through ``W_Kc`` and
            ``W_Vc`` (SPEC §5.3), or None for no context; ``context_k`` may be None when
            ``Λ' = 1``.
        gate: ``(H,)`` GCLA's gate logits, with the context.

    Returns:
        ``(B, H·d_h)`` in ``qkv``'s dtype.

    Raises:
        TypeError: a tensor of the wrong dtype. ValueError: wrong shapes, devices, or a
            ``past`` outside the buffers.
    """
    if not isinstance(qkv, Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    return _kernel()(qkv, k_cache, v_cache, past, position_ids, n_head, theta, spiral_divisor, radial_amplitude,
                     radial_frequency, context_k, context_v, gate)


__all__ = ["DTYPES", "applies", "available", "decode_attention"]
