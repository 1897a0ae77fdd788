"""GCLA summary-augmented attention in plain PyTorch (SPEC §5.5): the oracle.

For every batch row ``b``, head ``h`` (key/value group ``g = h mod H_kv``) and query
position ``i`` (scale ``c = 1/√d_h``)::

    s_ij      = c · q̃_i · k̃_gj                for keys j ≤ i and j < len_b (else −∞)
    lse_i     = log Σ_j exp(s_ij),     P_ij = exp(s_ij − lse_i)
    O^self_i  = Σ_j P_ij v_gj
    z_iλ      = c · q_i · kc_{s(i),λ}          s(i) = 0 when S = 1, i when S = T
    a_iλ      = softmax_λ(z_iλ),       O^cross_i = Σ_λ a_iλ vc_{s(i),λ}
    O_i       = O^self_i + σ(g_h) · O^cross_i  (rows i ≥ len_b are exactly 0)

Λ' = 0 makes ``O^cross = 0`` (plain causal attention). ``lse`` is returned for the
backward in the accumulation dtype (float32, float64 for float64 inputs); rows
``i ≥ len_b`` get ``lse = 0`` by convention.

Backward (``dO`` zeroed on rows ``i ≥ len_b``, ``σ = σ(g_h)``)::

    self:   dV_j  = Σ_i P_ij dO_i        dP_ij = dO_i · v_j
            D_i   = dO_i · O^self_i      dS_ij = P_ij (dP_ij − D_i)
            dq̃_i  = c Σ_j dS_ij k̃_j      dk̃_j  = c Σ_i dS_ij q̃_i
            (dk̃, dV of a kv group sum over the heads h ≡ g mod H_kv)
    cross:  dOc_i = σ dO_i               dvc_iλ = a_iλ dOc_i
            dz_iλ = a_iλ (dOc_i · vc_iλ − dOc_i · O^cross_i)
            dq_i  = c Σ_λ dz_iλ kc_iλ    dkc_iλ = c dz_iλ q_i   (summed over i when S = 1)
    gate:   dg_h  = σ (1 − σ) Σ_{b,i} dO_i · O^cross_i

Kernels compute ``D_i`` as ``dO_i · (O_i − σ O^cross_i)`` from the saved output (the
FlashAttention-2 trick); this oracle recomputes ``O^self`` exactly.

Also here: the summaries of SPEC §5.1 (``paper``: mean over all positions, ``S = 1``;
``causal``: prefix mean, ``S = T``) and the context projections that turn them into
``kc, vc`` (§5.3).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..dtypes import compute_dtype

__all__ = ["gcla_attention", "gcla_attention_backward", "gcla_attention_forward", "gcla_context_kv",
           "gcla_cross_attention", "gcla_summary"]


def _group_index(num_heads: int, num_kv_heads: int, device: torch.device) -> Tensor:
    """kv group of every query head: ``h mod H_kv`` (SPEC §5.2)."""
    return torch.arange(num_heads, device=device) % num_kv_heads


def _masks(B: int, T: int, lengths: Tensor | None, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(allowed (B, 1, T, T), row_ok (B, 1, T))``: causal + length mask, valid query rows."""
    t = torch.arange(T, device=device)
    if lengths is None:
        row_ok = torch.ones(B, T, dtype=torch.bool, device=device)
    else:
        row_ok = t[None, :] < lengths.to(device=device, dtype=torch.int64)[:, None]
    causal = t[None, :] <= t[:, None]  # (i, j): j <= i
    allowed = causal[None] & row_ok[:, None, :] & row_ok[:, :, None]  # key j valid, row i valid
    return allowed[:, None], row_ok[:, None]


def _zero_padding(row_ok: Tensor, *ts: Tensor) -> list[Tensor]:
    """Zero every position ``t ≥ len_b`` of the T-indexed tensors (``(B, ·, T, ...)``; context
    tensors with ``S = 1`` are passed through). Padded keys/rows only ever meet a zero weight,
    but ``0 · NaN = NaN``: garbage in the padding must not reach the valid rows."""
    T = row_ok.shape[-1]
    out = []
    for t in ts:
        if t.shape[2] == T:  # kc, vc with S = 1 < T are shared by the whole row: kept
            mask = ~row_ok.reshape(row_ok.shape[0], 1, T, *([1] * (t.dim() - 3)))
            t = t.masked_fill(mask, 0.0)
        out.append(t)
    return out


def _nonfinite_terms(a: Tensor, allowed: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` over allowed pairs only, for ``b`` holding NaN/Inf: the finite part by one product
    with NaN/Inf zeroed, then every output that an allowed non-finite term reaches set to what
    IEEE arithmetic gives (NaN for NaN or 0·Inf or Inf − Inf, else ±Inf)."""
    finite = torch.isfinite(b)
    out = a @ b.masked_fill(~finite, 0.0)
    allowed = allowed.expand(a.shape)
    pos, neg, zero = (allowed & (a > 0)), (allowed & (a < 0)), (allowed & (a == 0))
    b_nan, b_pinf, b_ninf = b.isnan().to(a.dtype), (b == math.inf).to(a.dtype), (b == -math.inf).to(a.dtype)
    pos, neg, zero, allowed = pos.to(a.dtype), neg.to(a.dtype), zero.to(a.dtype), allowed.to(a.dtype)
    nan_hits = allowed @ b_nan + zero @ (b_pinf + b_ninf)
    pinf_hits = pos @ b_pinf + neg @ b_ninf
    ninf_hits = pos @ b_ninf + neg @ b_pinf
    out = torch.where(pinf_hits > 0, out + math.inf, out)
    out = torch.where(ninf_hits > 0, out - math.inf, out)
    return torch.where(nan_hits > 0, math.nan, out)


def _masked_matmul(a: Tensor, allowed: Tensor, b: Tensor) -> Tensor:
    """``Σ_j a_ij b_j`` over the allowed ``(i, j)`` only (``allowed`` broadcasts against ``a``).

    A dense ``a @ b`` multiplies a masked (zero) weight by every ``b_j``, and ``0 · NaN = NaN``
    would carry a later key's NaN/Inf into earlier rows; the kernels never touch masked pairs,
    and neither does this. The exact path runs only when ``b`` is not all finite (``torch.cond``
    keeps it one graph under ``torch.compile``).
    """
    a = a.masked_fill(~allowed, 0.0)
    return torch.cond(torch.isfinite(b).all(), lambda a, m, b: a @ b, _nonfinite_terms, (a, allowed, b))


def gcla_cross_attention(q: Tensor, kc: Tensor, vc: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """GCLA's cross sub-attention (SPEC §5.3) before the gate: the slot softmax
    ``a = softmax_λ(q · kc_λ · scale)`` and ``O^cross = Σ_λ a_λ vc_λ``.

    ``q (B, H, T, d_h)``, ``kc, vc (B, H, S, Λ', d_h)`` with ``S ∈ {1, T}`` (``S = 1``
    broadcasts over T). Returns ``(a (B, H, T, Λ'), O^cross (B, H, T, d_h))`` in the
    arguments' dtype (zeros for ``Λ' = 0``)."""
    z = (q.unsqueeze(-2) * kc).sum(-1) * scale  # (B, H, T, Λ'); kc broadcasts S = 1 over T
    a = torch.softmax(z, dim=-1)
    o_cross = (a.unsqueeze(-1) * vc).sum(-2)
    if o_cross.shape != q.shape:  # Λ' = 0 with S = 1: the empty sum did not broadcast over T
        o_cross = o_cross.expand(q.shape)
    return a, o_cross


def gcla_attention_forward(q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor,
                           gate: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Returns ``(out (B, H, T, d_h) in the input dtype, lse (B, H, T) in the accumulation dtype)``.

    Differentiable by autograd (in every tensor argument); builds the full ``T×T`` scores.
    """
    acc = compute_dtype(q_rot.dtype)
    B, H, T, dh = q_rot.shape
    scale = 1.0 / math.sqrt(dh)
    idx = _group_index(H, k_rot.shape[1], q_rot.device)
    allowed, row_ok = _masks(B, T, lengths, q_rot.device)
    if lengths is not None:
        q_rot, k_rot, v, q, kc, vc = _zero_padding(row_ok, q_rot, k_rot, v, q, kc, vc)
    s = (q_rot.to(acc) @ k_rot.to(acc)[:, idx].transpose(-1, -2)) * scale  # (B, H, T, T)
    s_masked = s.masked_fill(~allowed, float("-inf"))
    # Rows past the length have no key: take the lse of zeros there (finite, no NaN in
    # autograd) and report 0.
    lse = torch.logsumexp(s_masked.masked_fill(~row_ok[..., None], 0.0), dim=-1)
    p = torch.exp(s_masked - lse[..., None])
    o_self = _masked_matmul(p, allowed, v.to(acc)[:, idx])
    _, o_cross = gcla_cross_attention(q.to(acc), kc.to(acc), vc.to(acc), scale)
    sig = torch.sigmoid(gate.to(acc))[None, :, None, None]
    out = (o_self + sig * o_cross).masked_fill(~row_ok[..., None], 0.0)
    return out.to(q_rot.dtype), lse.masked_fill(~row_ok, 0.0)


def gcla_attention(q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor, gate: Tensor,
                   lengths: Tensor | None = None) -> Tensor:
    """``O = O^self + σ(gate) · O^cross`` (SPEC §5.5), differentiable by autograd."""
    return gcla_attention_forward(q_rot, k_rot, v, q, kc, vc, gate, lengths)[0]


def gcla_attention_backward(grad_out: Tensor, q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor,
                            vc: Tensor, gate: Tensor, lengths: Tensor | None, out: Tensor, lse: Tensor
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Explicit backward: ``(d q_rot, d k_rot, d v, d q, d kc, d vc, d gate)``, each in its input's dtype.

    ``out`` is unused here (kernels use it for ``D``); ``lse`` is the forward's.
    """
    del out
    acc = compute_dtype(q_rot.dtype)
    B, H, T, dh = q_rot.shape
    H_kv = k_rot.shape[1]
    scale = 1.0 / math.sqrt(dh)
    idx = _group_index(H, H_kv, q_rot.device)
    allowed, row_ok = _masks(B, T, lengths, q_rot.device)
    if lengths is not None:
        q_rot, k_rot, v, q, kc, vc = _zero_padding(row_ok, q_rot, k_rot, v, q, kc, vc)
    qr, qq = q_rot.to(acc), q.to(acc)
    kk, vv = k_rot.to(acc)[:, idx], v.to(acc)[:, idx]  # (B, H, T, dh)
    kcc, vcc = kc.to(acc), vc.to(acc)
    d_o = grad_out.to(acc).masked_fill(~row_ok[..., None], 0.0)

    # Self part: recompute P from lse.
    s = (qr @ kk.transpose(-1, -2)) * scale
    p = torch.exp(s.masked_fill(~allowed, float("-inf")) - lse.to(acc)[..., None])
    allowed_t = allowed.transpose(-1, -2)
    o_self = _masked_matmul(p, allowed, vv)
    dv_h = _masked_matmul(p.transpose(-1, -2), allowed_t, d_o)
    dp = d_o @ vv.transpose(-1, -2)
    big_d = (d_o * o_self).sum(-1, keepdim=True)
    ds = (p * (dp - big_d)).masked_fill(~allowed, 0.0)  # dp of a masked pair may be 0 · NaN
    dq_rot = _masked_matmul(ds, allowed, kk) * scale
    dk_h = _masked_matmul(ds.transpose(-1, -2), allowed_t, qr) * scale
    dk = torch.zeros(B, H_kv, T, dh, dtype=acc, device=q_rot.device).index_add_(1, idx, dk_h)
    dv = torch.zeros(B, H_kv, T, dh, dtype=acc, device=q_rot.device).index_add_(1, idx, dv_h)

    # Cross part.
    a, o_cross = gcla_cross_attention(qq, kcc, vcc, scale)
    sig = torch.sigmoid(gate.to(acc))
    d_oc = sig[None, :, None, None] * d_o
    # Rows past a length read S = 1's shared summaries too, which may be NaN/Inf where the row
    # is empty (a mean over no tokens): their terms are dropped, not multiplied by a zero dO.
    pad = ~row_ok[..., None]
    a, o_cross = a.masked_fill(pad, 0.0), o_cross.masked_fill(pad, 0.0)
    dvc = a.unsqueeze(-1) * d_oc.unsqueeze(-2)  # (B, H, T, Λ', dh)
    da = (d_oc.unsqueeze(-2) * vcc).sum(-1)  # (B, H, T, Λ')
    dz = (a * (da - (d_oc * o_cross).sum(-1, keepdim=True))).masked_fill(pad, 0.0)
    dq = (dz.unsqueeze(-1) * kcc).sum(-2) * scale
    if dq.shape != qq.shape:  # Λ' = 0, S = 1
        dq = dq.expand(qq.shape)
    dq = dq.masked_fill(pad, 0.0)
    dkc = dz.unsqueeze(-1) * qq.unsqueeze(-2) * scale
    if kc.shape[2] == 1:
        dkc = dkc.sum(2, keepdim=True)
        dvc = dvc.sum(2, keepdim=True)
    dkc, dvc = dkc.expand(kc.shape), dvc.expand(vc.shape)
    dgate = sig * (1 - sig) * (d_o * o_cross).sum((0, 2, 3))
    return (dq_rot.to(q_rot.dtype), dk.to(k_rot.dtype), dv.to(v.dtype), dq.to(q.dtype),
            dkc.to(kc.dtype).contiguous(), dvc.to(vc.dtype).contiguous(), dgate.to(gate.dtype))


# ---- summaries and context (SPEC §5.1, §5.3) -------------------------------------------------

def gcla_summary(x: Tensor, mode: str = "causal", lengths: Tensor | None = None) -> Tensor:
    """Summary of one layer's output ``x (B, T, d)``.

    ``mode="paper"``: mean over all (valid) positions → ``(B, 1, d)``.
    ``mode="causal"``: prefix mean ``mean_{u ≤ t} x_u`` → ``(B, T, d)``.
    With ``lengths``, padded positions do not enter the paper-mode mean (causal prefix
    means at ``t < len_b`` never see them anyway).
    """
    B, T, _ = x.shape
    if mode == "paper":
        if lengths is None:
            return x.mean(1, keepdim=True)
        keep = (torch.arange(T, device=x.device)[None, :] < lengths.to(x.device)[:, None]).to(x.dtype)
        count = keep.sum(1, keepdim=True).clamp_min(1)[..., None]
        return (x * keep[..., None]).sum(1, keepdim=True) / count
    if mode == "causal":
        count = torch.arange(1, T + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return x.cumsum(1) / count
    raise ValueError(f"mode must be 'paper' or 'causal', got {mode!r}")


def gcla_context_kv(summaries: Tensor, w_kc: Tensor, w_vc: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """Project stacked summaries ``(B, S, Λ', d)`` (oldest layer first) to ``kc, vc (B, H, S, Λ', d_h)``.

    ``w_kc, w_vc`` are ``(d, H·d_h)`` as in SPEC §5.3 (``Kᶜ = C W_Kc``; an ``nn.Linear``'s
    weight is the transpose). ``Λ' = 0`` gives empty ``kc, vc`` (plain attention).
    """
    B, S, L, _ = summaries.shape
    dh = w_kc.shape[1] // num_heads
    kc = (summaries @ w_kc).view(B, S, L, num_heads, dh).permute(0, 3, 1, 2, 4)
    vc = (summaries @ w_vc).view(B, S, L, num_heads, dh).permute(0, 3, 1, 2, 4)
    return kc, vc
