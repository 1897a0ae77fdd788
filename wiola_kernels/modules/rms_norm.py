"""``WiolaRMSNorm``: drop-in module for SPEC §3."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.rms_norm import rms_norm


class WiolaRMSNorm(nn.Module):
    """RMSNorm with a learned shift δ applied before the RMS (SPEC §3).

    ``y = γ ⊙ (x + δ) / sqrt(mean((x + δ)²) + ε)`` over the last dimension, with γ
    (``weight``) initialised to ones and δ (``shift``) to zeros.

    Args:
        hidden_size: d, the normalised (last) dimension.
        eps: ε (default 1e-6, SPEC §1 ``rms_norm_eps``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.shift = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.shift, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class RMSNorm(nn.Module):
    """Plain RMSNorm (δ = 0) on the fused op: ``y = γ ⊙ x / sqrt(mean(x²) + ε)``.

    The module :func:`wiola_kernels.patch_hf` puts in place of a Hugging Face
    ``LlamaRMSNorm`` (and Mistral's, Qwen2's). It keeps that module's attribute names
    (``weight``, ``variance_epsilon``), so ``state_dict`` keys do not change, and can
    share its ``weight`` Parameter.

    Args:
        hidden_size: d, the normalised (last) dimension (ignored when ``weight`` is given).
        eps: ε.
        hf_order: round like HF (``γ · round(x/r)``; see :func:`wiola_kernels.rms_norm`).
            With ``hf_order`` and γ in another dtype than ``x`` (e.g. float32 γ, bf16
            activations), the output has the promoted dtype, as HF's does.
        weight: an existing γ Parameter to use (shared, not copied).
    """

    def __init__(self, hidden_size: int | None = None, eps: float = 1e-6, *, hf_order: bool = False,
                 weight: nn.Parameter | None = None, device=None, dtype=None) -> None:
        super().__init__()
        if weight is None:
            if not isinstance(hidden_size, int) or hidden_size <= 0:
                raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
            weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        elif not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise TypeError(f"weight must be a 1-D nn.Parameter, got {type(weight).__name__}")
        self.weight = weight
        self.variance_epsilon = float(eps)
        self.hf_order = bool(hf_order)

    def forward(self, x: Tensor) -> Tensor:
        if self.hf_order and self.weight.dtype != x.dtype:
            # HF multiplies γ (its own dtype) by x/r rounded to x's dtype: the result is
            # promoted. The op computes round(x/r) (γ = 1 is exact), the product follows.
            ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
            return self.weight * rms_norm(x, ones, None, self.variance_epsilon, hf_order=True)
        return rms_norm(x, self.weight, None, self.variance_epsilon, hf_order=self.hf_order)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, hf_order={self.hf_order}"
