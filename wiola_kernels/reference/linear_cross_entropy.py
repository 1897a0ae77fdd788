"""Linear cross-entropy in plain PyTorch (SPEC §10.1): the oracle for every backend.

For token rows ``h_i`` (``h (N, d)``, any leading shape flattened), the head ``W (V, d)``
and labels ``y_i``::

    z_i   = h_i Wᵀ                          (V,)  in float32 (float64 for float64 inputs)
    s_i   = c·tanh(z_i / c)                  when softcap = c is given, else s_i = z_i
    lse_i = log Σ_v exp s_iv
    ℓ_i   = (1−ε)(lse_i − s_{i,y_i}) + ε(lse_i − mean_v s_iv) + ζ·lse_i²

with ε = ``label_smoothing`` and ζ = ``z_loss``. Rows with ``y_i = ignore_index`` give
``ℓ_i = 0`` and are not counted. ``reduction``: ``"none"`` → ``ℓ (N,)``; ``"sum"`` → ``Σ ℓ_i``;
``"mean"`` → ``Σ ℓ_i / n`` with ``n = num_items`` when given (Hugging Face's
``num_items_in_batch``: gradient accumulation then equals one large batch), else the
number of counted rows. **No counted row and no num_items gives 0** (loss and gradients),
where ``F.cross_entropy`` gives NaN (0/0): a fully masked micro-batch must not poison a
gradient-accumulation step.

Backward. With ``p_i = softmax(s_i)`` and ``g_i`` the gradient reaching row i (``grad_loss[i]``
for ``"none"``, ``grad_loss`` for ``"sum"``, ``grad_loss / n`` for ``"mean"``; 0 on ignored rows)::

    ∂ℓ_i/∂s_iv = (1 + 2ζ·lse_i)·p_iv − (1−ε)·[v = y_i] − ε/V
    ∂s_iv/∂z_iv = 1 − (s_iv / c)²           (1 without softcap)
    dz_iv      = g_i · ∂ℓ_i/∂s_iv · ∂s_iv/∂z_iv
    ∂L/∂h_i    = Σ_v dz_iv W_v,      ∂L/∂W_v = Σ_i dz_iv h_i

This oracle holds the ``(N, V)`` logits; the kernels never do (they work on chunks of
rows). In bfloat16/float16 the logits are the input-dtype matmul (accumulated in float32
by PyTorch) widened to float32, as a model computes them (``lm_head(h).float()``), so
``torch.compile`` of this function is a fair baseline; everything after is float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dtypes import compute_dtype

__all__ = ["linear_cross_entropy", "linear_cross_entropy_backward", "linear_cross_entropy_forward"]

REDUCTIONS = ("mean", "sum", "none")


def _rows2d(h: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``h`` as ``(N, d)`` and ``labels`` as int64 ``(N,)``."""
    return h.reshape(-1, h.shape[-1]), labels.reshape(-1).to(torch.int64)


def _logits(h2: Tensor, W: Tensor, softcap: float | None) -> tuple[Tensor, Tensor]:
    """``(s, z)``: the (softcapped) logits and the raw ones, ``(N, V)`` in the accumulation dtype."""
    acc = compute_dtype(h2.dtype)
    z = (h2 @ W.mT).to(acc)
    return (z if softcap is None else softcap * torch.tanh(z / softcap)), z


def denominator(valid: Tensor, num_items) -> Tensor | float:
    """``n`` of the mean: ``num_items``, else the counted rows (at least 1: no row gives a 0 loss)."""
    if num_items is not None:
        return num_items.to(torch.float64) if isinstance(num_items, Tensor) else float(num_items)
    return valid.sum().clamp(min=1)


def _row_losses(h, W, labels, ignore_index, label_smoothing, softcap, z_loss):
    """``(ℓ (N,), lse (N,), valid (N,))`` in the accumulation dtype, ℓ = 0 on ignored rows."""
    h2, y = _rows2d(h, labels)
    s, _ = _logits(h2, W, softcap)
    lse = torch.logsumexp(s, dim=-1)
    valid = y != ignore_index
    s_y = s.gather(1, torch.where(valid, y, 0)[:, None]).squeeze(1)
    loss = (1.0 - label_smoothing) * (lse - s_y)
    if label_smoothing != 0.0:
        loss = loss + label_smoothing * (lse - s.mean(-1))
    if z_loss != 0.0:
        loss = loss + z_loss * lse * lse
    return torch.where(valid, loss, 0.0), lse, valid


def _reduce(rows: Tensor, valid: Tensor, reduction: str, num_items) -> Tensor:
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    return (total / denominator(valid, num_items)).to(rows.dtype)


def linear_cross_entropy(h: Tensor, W: Tensor, labels: Tensor, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, softcap: float | None = None, z_loss: float = 0.0,
                         num_items=None) -> Tensor:
    """SPEC §10.1, differentiable by autograd; the loss in the accumulation dtype
    (``(N,)`` for ``"none"``, else a scalar)."""
    rows, _, valid = _row_losses(h, W, labels, ignore_index, label_smoothing, softcap, z_loss)
    return _reduce(rows, valid, reduction, num_items)


def linear_cross_entropy_forward(h: Tensor, W: Tensor, labels: Tensor, ignore_index: int = -100,
                                 reduction: str = "mean", label_smoothing: float = 0.0, softcap: float | None = None,
                                 z_loss: float = 0.0, num_items=None) -> tuple[Tensor, Tensor]:
    """``(loss, lse)``: the loss and the per-row log-sum-exp ``(N,)`` the backward needs."""
    with torch.no_grad():
        rows, lse, valid = _row_losses(h, W, labels, ignore_index, label_smoothing, softcap, z_loss)
        return _reduce(rows, valid, reduction, num_items), lse


def row_gradients(grad_loss: Tensor, labels: Tensor, ignore_index: int, reduction: str, num_items) -> Tensor:
    """``g_i`` (N,): the gradient reaching each row's ℓ_i (0 on ignored rows)."""
    y = labels.reshape(-1)
    valid = y != ignore_index
    if reduction == "none":
        g = grad_loss.reshape(-1)
    elif reduction == "sum":
        g = grad_loss.expand(y.shape)
    else:
        g = (grad_loss / denominator(valid, num_items)).to(grad_loss.dtype).expand(y.shape)
    return torch.where(valid, g, 0.0)


def linear_cross_entropy_backward(grad_loss: Tensor, h: Tensor, W: Tensor, labels: Tensor, lse: Tensor,
                                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                                  softcap: float | None = None, z_loss: float = 0.0, num_items=None
                                  ) -> tuple[Tensor, Tensor]:
    """The explicit backward of the module docstring: ``(grad_h, grad_W)`` in the dtypes of
    ``h`` and ``W`` (``grad_h`` shaped like ``h``)."""
    h2, y = _rows2d(h, labels)
    acc = compute_dtype(h.dtype)
    s, _ = _logits(h2, W, softcap)
    V = s.shape[-1]
    lse = lse.to(acc).reshape(-1, 1)
    g = row_gradients(grad_loss.to(acc), labels, ignore_index, reduction, num_items)
    ds = (1.0 + 2.0 * z_loss * lse) * torch.exp(s - lse) - label_smoothing / V
    valid = y != ignore_index
    ds = ds - (1.0 - label_smoothing) * torch.nn.functional.one_hot(torch.where(valid, y, 0), V).to(acc)
    if softcap is not None:
        ds = ds * (1.0 - (s / softcap) ** 2)
    dz = ds * g[:, None]
    if h.dtype == acc:
        grad_h, grad_W = dz @ W.to(acc), dz.mT @ h2
    else:  # the input-dtype matmuls a model's backward runs, accumulated in float32
        dz = dz.to(h.dtype)
        grad_h, grad_W = dz @ W, dz.mT @ h2
    return grad_h.to(h.dtype).reshape(h.shape), grad_W.to(W.dtype)
