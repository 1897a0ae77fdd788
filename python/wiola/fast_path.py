"""Inference shortcuts: the same ``wiola_kernels`` implementations, without the op wrapper.

A registered op (``torch.library.custom_op`` plus argument validation) costs about 80 µs of
Python per call, more than its kernel on a decoding step's single row: RMSNorm of one
1024-wide row took 87 µs through ``wiola_kernels.rms_norm`` and 6.5 µs through the
implementation the op dispatches to (1 thread, best of 5; ``/tmp``-style micro benchmark
in the issue 12 notes). Decoding wiola-360m calls RMSNorm 33 times and SRPE 16 times per
token. When no gradient is needed (and outside ``torch.compile``), the model therefore
calls the dispatched implementation directly, on tensors it built itself; with gradients
it goes through the op, whose autograd is the one the tests check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from wiola_kernels import dispatch
from wiola_kernels.ops.srpe import max_accurate_position
from wiola_kernels.outputs import unit_last_stride


def _direct(*tensors: Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def rms_norm(module, x: Tensor) -> Tensor:
    """``module(x)`` for a :class:`wiola_kernels.WiolaRMSNorm`, direct when no gradient is needed."""
    if not _direct(x, module.weight, module.shift):
        return module(x)
    d = x.shape[-1]
    y, _ = dispatch.implementation("rms_norm", x.device).forward(
        x.reshape(-1, d).contiguous(), module.weight.contiguous(), module.shift.contiguous(), module.eps)
    return y.view(x.shape)


def srpe(module, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``module(q, k, position_ids)`` for a :class:`wiola_kernels.SpiralRotaryEmbedding`
    with ``position_ids (B, T)`` int64, direct when no gradient is needed (the op's
    position-range guard is kept)."""
    if not _direct(q, k) or position_ids.dtype != torch.int64 or position_ids.dim() != 2:
        return module(q, k, position_ids)
    if position_ids.device.type == "cpu" and position_ids.numel():
        limit = max_accurate_position(module.spiral_divisor)
        if int(position_ids.abs().max()) > limit:
            return module(q, k, position_ids)  # the op raises its own error
    # The kernels read the model's transposed (B, T, H, d_h) views through their strides.
    return dispatch.implementation("srpe", q.device).apply(
        unit_last_stride(q), unit_last_stride(k), position_ids, module.theta, module.spiral_divisor,
        module.radial_amplitude, module.radial_frequency, False)


__all__ = ["rms_norm", "srpe"]
