"""Residual add + WiolaRMSNorm Triton launchers (SPEC §10.3).

The kernels are rms_norm's (``triton/rms_norm.py``) with two ``constexpr`` flags:
``HAS_RESIDUAL`` in the forward (each tile loads x and the residual, forms
``s = x + residual`` in float, rounds it once to x's dtype, stores it, and normalises the
rounded s — what unfused code computes) and ``HAS_GRAD_S`` in the backward (on s, with
``∂L/∂s`` added to ``∂L/∂x`` in the accumulation dtype before the one rounding). Rows are
read once; the launch is rms_norm's ``_launch_config`` with two row tensors loaded per
row in the forward and three in the backward.
"""

from __future__ import annotations

import torch

from .rms_norm import norm_bwd, norm_fwd, norm_launches


def add_rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor | None,
                     eps: float, hf_order: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward on ``x, residual (rows, d)``, contiguous; returns ``(y, s, rstd)``."""
    return norm_fwd(x, residual, weight, shift, eps, hf_order)


def add_rms_norm_bwd(grad_y, grad_s, s, weight, shift, rstd):
    """Launch the backward on contiguous rows; returns ``(grad_x, grad_weight, grad_shift)``,
    ``grad_x`` being the gradient of x and of the residual (``grad_s`` None: no ∂L/∂s)."""
    return norm_bwd(grad_y, grad_s, s, weight, shift, rstd)


def aot_launches(sms: int):
    """Every launch of the forward and backward kernels with the residual flags, at the GPU
    test and bench shapes, on a GPU with ``sms`` SMs (see ``wiola_kernels/triton/aot.py``)."""
    from ..shapes import ADD_RMS_NORM_BENCH, ADD_RMS_NORM_GPU_TESTS, GPU_BENCH_DTYPE

    cases = [(f"test add x {shape} {dtype}", shape, dtype) for shape, dtype in ADD_RMS_NORM_GPU_TESTS]
    cases += [(f"bench {size} add x {shape} {GPU_BENCH_DTYPE}", shape, GPU_BENCH_DTYPE)
              for size, shape in ADD_RMS_NORM_BENCH.items()]
    for case, shape, dtype in cases:
        yield from norm_launches(case, shape, dtype, sms, residual=True)
