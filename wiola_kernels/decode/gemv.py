"""Batch-1 decoding GEMV on the CPU: ``x · Wᵀ`` for a few rows of ``x``, reading the weights
in place.

At batch 1 a decoding step's projections are matrix-vector products whose cost is reading
each weight once. :func:`gemv` computes ``y = x · Wᵀ`` (``nn.Linear``'s convention, no bias)
for up to :data:`MAX_ROWS` rows of ``x`` with the C++ kernel ``torch.ops.wiola._decode_gemv``
(``csrc/cpu/decode_gemv.cpp``) straight from ``nn.Linear.weight``'s ``(n, k)`` layout: each
thread streams one contiguous range of weight rows, the way a packed copy would be streamed,
so there is no packed copy — no second copy of the weights in memory, nothing to rebuild
when a weight changes in place.

* Weights: float32, bfloat16 or float16 (widened in registers); activations ``x`` float32,
  bfloat16 or float16, converted to float32 once per call; float32 accumulation. The result
  has ``x``'s dtype (rounded once, like ``nn.Linear``).
* Several weights in one call (one parallel region, one output): ``gemv(x, [W_q, W_k, W_v])``
  is ``[x W_qᵀ | x W_kᵀ | x W_vᵀ]``; with ``split_input=True`` weight ``i`` reads its own
  consecutive ``k_i`` columns of ``x`` instead (``Σ k_i`` = x's width).
* Instruction set: the CPU kernels' shared level (:func:`wiola_kernels.cpu_isa`,
  :func:`wiola_kernels.set_cpu_isa`, ``WIOLA_CPU_ISA``); this kernel has generic, AVX2 and
  AVX-512 (F/BW/VL/DQ) paths and runs the highest at or below that level
  (:func:`wiola_kernels.kernel_isa` ``("decode_gemv")`` says which).
* Threads: ``torch.set_num_threads``; each thread takes an equal contiguous stretch of the
  weight bytes. Each output is one thread's sum in a fixed order, so results do not depend
  on the thread count.

    w = torch.randn(1536, 1024, dtype=torch.bfloat16)
    y = gemv(torch.randn(1, 1024), w)        # ≈ x @ w.float().t(), (1, 1536) float32
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _extension

#: Most rows of ``x`` per call (the C++ kernel's ``kMaxRows``; a decoding step's ``B·T_new``).
MAX_ROWS = 16
#: The weight (and activation) dtypes the kernel reads.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel():
    return _extension.cpu_op("_decode_gemv", "wiola_kernels.decode.gemv")


def available() -> bool:
    """Whether the C++ kernel is loaded (the extension was built and imported)."""
    return _extension.has_cpu_op("_decode_gemv")


def applies(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :func:`gemv` reads weights of ``dtype`` on ``device`` (CPU, a dtype of
    :data:`DTYPES`, the extension loaded)."""
    return torch.device(device).type == "cpu" and dtype in DTYPES and available()


def gemv(x: Tensor, weight: Tensor | Sequence[Tensor], split_input: bool = False) -> Tensor:
    """``x · Wᵀ`` for one weight or ``[x W_0ᵀ | x W_1ᵀ | …]`` for several, on the CPU.

    Args:
        x: ``(..., k)`` float32, bfloat16 or float16 with at most :data:`MAX_ROWS` rows in
            all (the leading dimensions' product). Strided rows are read in place; a
            strided last dimension is copied.
        weight: an ``(n, k)`` tensor (``nn.Linear.weight``), or a list or tuple of
            ``(n_i, k_i)`` tensors of one dtype (float32, bfloat16 or float16). Rows must be
            contiguous; the row stride may be larger than ``k`` (a view). Read in place,
            never copied.
        split_input: with several weights, weight ``i`` reads columns
            ``Σ_{j<i} k_j … + k_i`` of ``x`` (``Σ k_i`` = ``k``) instead of all of it.

    Returns:
        ``(..., Σ n_i)`` in ``x``'s dtype, accumulated in float32.

    Raises:
        TypeError: ``x`` or a weight is not a tensor of a supported dtype, or the weights'
            dtypes differ. ValueError: wrong shapes or devices, more than :data:`MAX_ROWS`
            rows, or widths that do not fit ``x``.
    """
    # A decoding step calls this ~80 times per token: the kernel checks shapes and dtypes
    # (ValueError / TypeError naming the argument); here only what it cannot see.
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(weight, Tensor):
        weights = (weight,)
    elif isinstance(weight, (list, tuple)) and weight and all(isinstance(w, Tensor) for w in weight):
        weights = weight
    else:
        raise TypeError(f"weight must be a torch.Tensor or a non-empty list of them, got {type(weight).__name__}")
    if not x.is_cpu or not all(w.is_cpu for w in weights):
        raise ValueError(f"x and the weights must be on the CPU, got x on {x.device} and weights on "
                         f"{sorted({str(w.device) for w in weights})}")
    return _kernel()(x, weights, split_input)


__all__ = ["DTYPES", "MAX_ROWS", "applies", "available", "gemv"]
