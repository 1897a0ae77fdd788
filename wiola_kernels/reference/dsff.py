"""DSFF, the dual-stream feed-forward block (SPEC §7), in plain PyTorch.

    N(x) = W_n2 (SiLU(W_n1 x) ⊙ W_n3 x)              narrow stream, width n
    W(x) = W_w2 (GELU_tanh(W_w1 x) ⊙ W_w3 x)         wide stream, width w
    DSFF(x) = σ(β) ⊙ N(x) + (1 − σ(β)) ⊙ W(x)

Weights use ``nn.Linear``'s layout ``(out_features, in_features)``; no biases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["dsff"]


def dsff(x: Tensor, w_n1: Tensor, w_n3: Tensor, w_n2: Tensor, w_w1: Tensor, w_w3: Tensor, w_w2: Tensor,
         beta: Tensor) -> Tensor:
    """DSFF of ``x (..., d)``; ``w_n1, w_n3 (n, d)``, ``w_n2 (d, n)``, ``w_w1, w_w3 (w, d)``,
    ``w_w2 (d, w)``, ``beta (d,)``."""
    narrow = F.linear(F.silu(F.linear(x, w_n1)) * F.linear(x, w_n3), w_n2)
    wide = F.linear(F.gelu(F.linear(x, w_w1), approximate="tanh") * F.linear(x, w_w3), w_w2)
    lam = torch.sigmoid(beta)
    return lam * narrow + (1.0 - lam) * wide
