"""GCLA's cross-layer sub-attention with the context projections folded.

SPEC §5.3 projects every context slot through both context matrices,
``Kᶜ_λ = s_λ W_Kc``, ``Vᶜ_λ = s_λ W_Vc``: with causal summaries that is ``2Λ'`` products
of ``d × d`` per token and layer. The same numbers cost two products per token:

    score_λ = q_h · (W_Kc,h s_λ) = (W_Kc,hᵀ q_h) · s_λ      key matrix moved to the query
    O^cross_h = Σ_λ a_λ (W_Vc,h s_λ) = W_Vc,h (Σ_λ a_λ s_λ)  value matrix after the mixture

(``W_Kc,h`` is head ``h``'s ``(d_h, d)`` block of ``kc_proj.weight``.) With one slot
(layer 1) the softmax is 1 and the key side drops out entirely.

:func:`folded_context_attention` returns ``σ(g_h) · O^cross_h`` for per-position contexts
(``S = T``, causal summaries). Its backward recomputes ``W_Kc,hᵀ q_h`` and the mixture
rather than saving them (they are ``H·d`` per token, ``H`` times a hidden state), so the
memory it keeps is ``q``, the context (already kept by the caller) and the slot weights.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from wiola_kernels.dtypes import compute_dtype


#: Rows per chunk of the inference path: 32 positions' ``(32, H, d)`` intermediates are
#: 2 MiB in float32 at wiola-360m's width (16 heads × 1,024).
INFERENCE_ROWS = 32


def _heads(weight: Tensor, num_heads: int) -> Tensor:
    """``(H·d_h, d)`` Linear weight → ``(H, d_h, d)`` per-head blocks (a view)."""
    return weight.view(num_heads, weight.shape[0] // num_heads, weight.shape[1])


def _forward(q: Tensor, context: Tensor, w_kc: Tensor, w_vc: Tensor, gate: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(σ(g)·O^cross, slot weights a (N, H, Λ'), O^cross)``."""
    n, h, dh = q.shape
    slots = context.shape[1]
    acc = compute_dtype(q.dtype)
    wk, wv = _heads(w_kc.to(q.dtype), h), _heads(w_vc.to(q.dtype), h)
    ctx_q = context.to(q.dtype)
    if slots == 1:
        a = torch.ones(n, h, 1, dtype=acc, device=q.device)
        mix = ctx_q[:, 0, None, :].expand(n, h, -1)  # (N, H, d): the only slot
    else:
        q_hat = torch.einsum("nhe,hed->nhd", q, wk)                       # (N, H, d)
        z = torch.einsum("nhd,nld->nhl", q_hat, ctx_q).to(acc) / math.sqrt(dh)
        a = torch.softmax(z, -1)                                          # (N, H, Λ')
        mix = torch.einsum("nhl,nld->nhd", a.to(q.dtype), ctx_q)          # Σ_λ a_λ s_λ
    o = torch.einsum("nhd,hed->nhe", mix, wv)                             # (N, H, d_h)
    sig = torch.sigmoid(gate.to(acc))
    return (o.to(acc) * sig[None, :, None]).to(q.dtype), a, o


class _FoldedContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, context: Tensor, w_kc: Tensor, w_vc: Tensor, gate: Tensor) -> Tensor:
        out, a, o = _forward(q, context, w_kc, w_vc, gate)
        ctx.save_for_backward(q, context, w_kc, w_vc, gate, a, o)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, context, w_kc, w_vc, gate, a, o = ctx.saved_tensors
        n, h, dh = q.shape
        slots = context.shape[1]
        acc = compute_dtype(q.dtype)
        dt = q.dtype
        wk, wv = _heads(w_kc.to(dt), h), _heads(w_vc.to(dt), h)
        ctx_q = context.to(dt)
        sig = torch.sigmoid(gate.to(acc))
        g = grad_out.to(acc)
        d_gate = sig * (1 - sig) * (g * o.to(acc)).sum((0, 2))
        d_o = (g * sig[None, :, None]).to(dt)                                 # (N, H, d_h)
        mix = ctx_q[:, 0, None, :].expand(n, h, -1) if slots == 1 \
            else torch.einsum("nhl,nld->nhd", a.to(dt), ctx_q)                # recomputed
        d_wv = torch.einsum("nhe,nhd->hed", d_o, mix).reshape(w_vc.shape)
        d_mix = torch.einsum("nhe,hed->nhd", d_o, wv)                         # (N, H, d)
        d_ctx = torch.einsum("nhl,nhd->nld", a.to(dt), d_mix)
        if slots == 1:  # softmax over one slot is constant: no gradient reaches q or W_Kc
            d_q, d_wk = torch.zeros_like(q), torch.zeros_like(w_kc)
        else:
            da = torch.einsum("nhd,nld->nhl", d_mix, ctx_q).to(acc)
            dz = (a * (da - (a * da).sum(-1, keepdim=True)) / math.sqrt(dh)).to(dt)
            q_hat = torch.einsum("nhe,hed->nhd", q, wk)                       # recomputed
            d_ctx = d_ctx + torch.einsum("nhl,nhd->nld", dz, q_hat)
            d_q_hat = torch.einsum("nhl,nld->nhd", dz, ctx_q)
            d_q = torch.einsum("nhd,hed->nhe", d_q_hat, wk)
            d_wk = torch.einsum("nhe,nhd->hed", q, d_q_hat).reshape(w_kc.shape)
        return (d_q, d_ctx.to(context.dtype), d_wk.to(w_kc.dtype), d_wv.to(w_vc.dtype), d_gate.to(gate.dtype))


def folded_context_attention(q: Tensor, context: Tensor, w_kc: Tensor, w_vc: Tensor, gate: Tensor) -> Tensor:
    """``σ(g_h) · softmax_λ(q_h · Kᶜ_{h,λ} / √d_h) · Vᶜ_h`` (SPEC §5.3–5.4) with the folds above.

    Args:
        q: un-rotated queries ``(N, H, d_h)``, one row per position (``N = B·T``).
        context: the summaries each position sees, ``(N, Λ', d)`` with ``Λ' ≥ 1``.
        w_kc, w_vc: ``kc_proj.weight``, ``vc_proj.weight``, ``(H·d_h, d)``.
        gate: ``(H,)`` gate logits.

    Returns ``(N, H, d_h)`` in the dtype of ``q``; differentiable in every argument.
    """
    n, h, dh = q.shape
    if context.dim() != 3 or context.shape[0] != n or context.shape[1] < 1:
        raise ValueError(f"context must have shape (N, Λ' ≥ 1, d) with N = {n}, got {tuple(context.shape)}")
    d = context.shape[2]
    for name, w in (("w_kc", w_kc), ("w_vc", w_vc)):
        if tuple(w.shape) != (h * dh, d):
            raise ValueError(f"{name} must have shape (H·d_h, d) = ({h * dh}, {d}), got {tuple(w.shape)}")
    if tuple(gate.shape) != (h,):
        raise ValueError(f"gate must have shape (H,) = ({h},), got {tuple(gate.shape)}")
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, context, w_kc, w_vc, gate)):
        # inference: no autograd node to build; in row chunks, so that a prompt's (N, H, d)
        # intermediates (H hidden states per position) stay small beside the weights
        return torch.cat([_forward(q[i:i + INFERENCE_ROWS], context[i:i + INFERENCE_ROWS], w_kc, w_vc, gate)[0]
                          for i in range(0, n, INFERENCE_ROWS)]) if n > INFERENCE_ROWS \
            else _forward(q, context, w_kc, w_vc, gate)[0]
    return _FoldedContext.apply(q, context, w_kc, w_vc, gate)


__all__ = ["folded_context_attention"]
