"""ATM — adaptive token merging (SPEC §6) in plain PyTorch: the oracle for every backend.

Per row ``b`` of ``x (B, T, d)`` with length ``L_b`` (tokens ``t ≥ L_b`` are padding):

    s_t   = ⟨x_t, x_{t+1}⟩ / (‖x_t‖·‖x_{t+1}‖)                      t ∈ [0, T−1)
            (s_t = 0 when a norm is 0: a zero vector is never "similar"; s_t ≤ 1)
    c_t   = s_t > τ  and  t + 1 < L_b                               candidate edges
    take  = greedy left to right, non-overlapping; in parallel form: in every maximal
            run of consecutive candidate edges starting at edge a, take a, a+2, a+4, …
    slot(t) = t − #{taken edges e < t}                              the index map
    T'_b  = L_b − #{taken edges}

The test is homogeneous in each token, so every backend evaluates it on tokens rescaled
by a power of two: ``x̂_t = x_t·2^−e_t`` with ``e_t`` the exponent of ``max|x_t|`` (so
``max|x̂_t| ∈ [0.5, 1)``; exact, except that elements below ~2^−126·max|x_t| (float32) are
rounded, a negligible contribution). Zero and non-finite tokens are left as they are.
This reference always rescales; the kernels keep the unscaled sums when they are already
safely in range (float32 accumulation: ``2^−60 ≤ ‖x_t‖² ≤ 2^100``; float64: ``2^±500``),
where rescaling would change nothing but rounding far below one ulp of the sums. The
sums ``D = ⟨x̂_t, x̂_{t+1}⟩``, ``n_t = ‖x̂_t‖²`` are accumulated in float32 (float64 for
float64 input). The test ``s_t > τ`` is then decided without a square root, in IEEE
float64 (``N = n_t·n_{t+1}``, ``τ²N`` computed as ``(τ·τ)·N``)::

    τ = 1           → never a candidate (s_t ≤ 1; rounding cannot make a pair pass)
    D or N non-finite (a NaN/Inf token) → never a candidate
    N = 0           → candidate iff τ < 0        (s_t = 0: a zero token)
    D > 0           → candidate iff τ < 0 or D² > τ²N
    D ≤ 0           → candidate iff τ < 0 and D² < τ²N

where the squares are evaluated as if float64 had an unbounded exponent range: ``D`` and
``τ`` are first scaled together by the power of two that brings ``max(|D|, |τ|)`` into
``[0.5, 1)`` (this changes no rounding where nothing over/underflows, and keeps a tiny
``τ`` or ``D`` from flushing to 0). So the decision for ``(2^a x_t, 2^b x_{t+1})`` is that
for ``(x_t, x_{t+1})`` for every finite input and every power-of-two scaling that keeps
the tokens representable (bit for bit, except that elements ~2^−126 (float32
accumulation) below their token's max are rounded differently, which can only matter at
an exact rounding tie), and every backend that accumulates the same ``D, n`` (e.g.
small-integer inputs) makes the same decision bit for bit, whatever its ``sqrt`` (torch's
CPU ``sqrt`` is not always correctly rounded).

Outputs (static shapes): ``merged (B, T, d)`` — slot ``s < T'_b`` holds the singleton
``x_t`` or the pair mean ``(x_t + x_{t+1})/2``, computed in the accumulation dtype as
``(x_t + x_{t+1})·½`` — the correctly rounded mean, subnormals included — or, where that
sum overflows, as ``x_t·½ + x_{t+1}·½`` (exact halves: no overflow up to the dtype's
maximum); then rounded to the input dtype. Slots ``s ≥ T'_b`` hold zeros; ``merged_position_ids
(B, T)`` int64 — the first member's position, **0** in the zero region; ``merged_lengths
(B,)`` int64 = ``T'_b``; ``index_map (B, T)`` int64 = ``slot(t)`` (padding token ``t``
maps to ``T'_b + (t − L_b)``, inside the zero region).

Unmerge: ``restored[b, t] = y[b, index_map[b, t]]``.

Backward (decisions are constants):

    merge:    ∂L/∂x_t = w_t · ∂L/∂merged_{slot(t)},  w_t = 1/2 in a pair, 1 alone, 0 padding
    unmerge:  ∂L/∂y_s = Σ_{t : map(t) = s} ∂L/∂restored_t
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dtypes import compute_dtype

__all__ = ["atm_merge", "atm_merge_backward", "atm_unmerge", "atm_unmerge_backward"]


def _pow2(k: Tensor) -> Tensor:
    """``2^k`` exactly as float64, for int64 ``k ∈ [−1022, 1023]`` (built from its bits)."""
    return ((k + 1023) << 52).view(torch.float64)


def _times_pow2(x: Tensor, k: Tensor) -> Tensor:
    """``x·2^k`` (float64, int64 ``k ∈ [−1024, 2046]`` broadcastable), rounded once like ``ldexp``
    unless the result is subnormal."""
    first = torch.where(k > 0, k // 2, k.clamp(min=-1022))   # scaling up: two exact steps
    return x * _pow2(first) * _pow2(k - first)


def _exponent(m: Tensor) -> Tensor:
    """``e`` with ``m·2^−e ∈ [0.5, 1)`` for finite ``m > 0``; 0 elsewhere (int64).

    Read from the float64 bits (``frexp``'s exponent, exactly), not with ``torch.frexp``,
    whose float64 vectorisation Inductor's CPU code generation fails to compile (torch 2.13,
    AVX2): with it the bench had no ``torch.compile`` baseline for ATM. A subnormal is first
    scaled by 2^54 (exact) into the normal range."""
    m = m.to(torch.float64)
    subnormal = m < 2.0 ** -1022
    scaled = torch.where(subnormal, m * 2.0 ** 54, m)
    biased = torch.bitwise_and(torch.bitwise_right_shift(scaled.view(torch.int64), 52), 0x7FF)
    e = biased - 1022 - torch.where(subnormal, 54, 0)
    return torch.where(torch.isfinite(m) & (m > 0), e, torch.zeros_like(e))


def atm_normalize(x: Tensor) -> Tensor:
    """Each token ``x_t·2^−e_t`` (``e_t``: exponent of ``max|x_t|``) in the accumulation dtype.

    The factor must be representable, so a token whose max is subnormal is scaled by the
    largest power of two instead (its max lands in ``[2^−22, 1)``; every element stays exact).
    """
    xa = x.to(compute_dtype(x.dtype))
    top = 127 if xa.dtype == torch.float32 else 1023               # 2^top: the largest power of two
    k = (-_exponent(xa.abs().amax(dim=-1, keepdim=True))).clamp(max=top)
    return xa * _times_pow2(torch.ones_like(k, dtype=torch.float64), k).to(xa.dtype)


def atm_sums(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(dot (B, T−1), norm_sq (B, T))`` of the normalised tokens, in the accumulation dtype."""
    xa = atm_normalize(x)
    return (xa[:, :-1] * xa[:, 1:]).sum(-1), xa.pow(2).sum(-1)


def atm_similarity(x: Tensor) -> Tensor:
    """Adjacent cosine similarities ``s (B, T−1)`` (for inspection; decisions use :func:`atm_candidates`)."""
    dot, nsq = atm_sums(x)
    den = (nsq[:, :-1] * nsq[:, 1:]).sqrt()
    return torch.where(den == 0, torch.zeros_like(dot), dot / torch.where(den == 0, torch.ones_like(den), den))


def atm_candidates(dot: Tensor, norm_sq: Tensor, threshold: float) -> Tensor:
    """``s_t > τ`` for every edge, decided in float64 without a square root (module docstring)."""
    d = dot.to(torch.float64)
    n = norm_sq[:, :-1].to(torch.float64) * norm_sq[:, 1:].to(torch.float64)
    tau = torch.full_like(d, threshold)
    k = -_exponent(torch.maximum(d.abs(), tau.abs()))      # D, τ scaled together: no under/overflow
    ds, ts = _times_pow2(d, k), _times_pow2(tau, k)
    d2, t2n = ds * ds, (ts * ts) * n
    negative_tau = threshold < 0
    cand = torch.where(d > 0, (d2 > t2n) | negative_tau, (d2 < t2n) & negative_tau)
    cand = torch.where(n == 0, torch.full_like(cand, 0.0 > threshold), cand)
    return cand & torch.isfinite(n) & torch.isfinite(d) & (threshold < 1)


def atm_decisions(x: Tensor, lengths: Tensor, threshold: float) -> Tensor:
    """Taken edges ``(B, T−1)`` bool: the parallel form of the greedy rule."""
    b, t = x.shape[0], x.shape[1]
    dot, nsq = atm_sums(x)
    edge = torch.arange(max(t - 1, 0), device=x.device)
    cand = atm_candidates(dot, nsq, threshold) & (edge + 1 < lengths.unsqueeze(-1))   # (B, T-1)
    prev = torch.cat([torch.zeros_like(cand[:, :1]), cand[:, :-1]], dim=1)
    is_start = cand & ~prev
    # Start of the run containing edge e: the last run start at or before e.
    run_start = torch.where(is_start, edge, torch.zeros_like(edge)).cummax(dim=1).values if t > 1 else \
        edge.expand(b, 0)
    return cand & ((edge - run_start) % 2 == 0)


def _index_map(taken: Tensor, t: int) -> Tensor:
    b = taken.shape[0]
    before = torch.cat([taken.new_zeros(b, 1, dtype=torch.int64), taken.to(torch.int64).cumsum(dim=1)], dim=1)
    return torch.arange(t, device=taken.device) - before                 # (B, T)


def _merge_weights(index_map: Tensor, merged_lengths: Tensor, dtype: torch.dtype) -> Tensor:
    """``w_t``: 1/2 for a member of a pair, 1 for a singleton, 0 for padding."""
    same_prev = torch.zeros_like(index_map, dtype=torch.bool)
    same_next = torch.zeros_like(index_map, dtype=torch.bool)
    same_prev[:, 1:] = index_map[:, 1:] == index_map[:, :-1]
    same_next[:, :-1] = index_map[:, :-1] == index_map[:, 1:]
    w = torch.where(same_prev | same_next, 0.5, 1.0).to(dtype)
    return torch.where(index_map < merged_lengths.unsqueeze(-1), w, torch.zeros_like(w))


def atm_merge(x: Tensor, position_ids: Tensor, threshold: float, lengths: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Merge of SPEC §6.2, differentiable in ``x`` by autograd (through the averaging).

    ``x (B, T, d)``, ``position_ids (B, T)`` integer, ``lengths (B,)`` integer or None (all T).
    Returns ``(merged, merged_position_ids, merged_lengths, index_map)``.
    """
    b, t, d = x.shape
    if lengths is None:
        lengths = torch.full((b,), t, dtype=torch.int64, device=x.device)
    lengths = lengths.to(torch.int64)
    position_ids = position_ids.to(torch.int64).expand(b, t)
    acc = compute_dtype(x.dtype)
    taken = atm_decisions(x.detach(), lengths, threshold)
    index_map = _index_map(taken, t)
    merged_lengths = lengths - taken.sum(dim=1)
    w = _merge_weights(index_map, merged_lengths, acc).unsqueeze(-1)    # (B, T, 1)
    slots = index_map.unsqueeze(-1).expand(b, t, d)
    xa = x.to(acc)
    # (x_t + x_{t+1})·½ (the correctly rounded mean), or x_t·½ + x_{t+1}·½ where the sum overflows.
    total = torch.zeros(b, t, d, dtype=acc, device=x.device).scatter_add(1, slots, xa * (w > 0))
    halves = torch.zeros(b, t, d, dtype=acc, device=x.device).scatter_add(1, slots, xa * w)
    is_pair = torch.zeros(b, t, 1, dtype=torch.bool, device=x.device).scatter_add(
        1, index_map.unsqueeze(-1), w == 0.5)
    mean = torch.where(is_pair, total * 0.5, total)
    merged = torch.where(mean.isinf(), halves, mean).to(x.dtype)
    second = torch.zeros_like(index_map, dtype=torch.bool)
    second[:, 1:] = taken
    first_real = ~second & (torch.arange(t, device=x.device) < lengths.unsqueeze(-1))
    merged_pos = torch.zeros(b, t, dtype=torch.int64, device=x.device).scatter_add(
        1, index_map, torch.where(first_real, position_ids, torch.zeros_like(position_ids)))
    return merged, merged_pos, merged_lengths, index_map


def atm_unmerge(y: Tensor, index_map: Tensor) -> Tensor:
    """Unmerge of SPEC §6.3: ``restored[b, t] = y[b, index_map[b, t]]`` (differentiable in ``y``)."""
    return y.gather(1, index_map.unsqueeze(-1).expand(*index_map.shape, y.shape[-1]))


def atm_merge_backward(grad_merged: Tensor, index_map: Tensor, merged_lengths: Tensor) -> Tensor:
    """Explicit merge backward: ``w_t · grad_merged[slot(t)]`` (SPEC §6.4)."""
    acc = compute_dtype(grad_merged.dtype)
    w = _merge_weights(index_map, merged_lengths, acc)
    return (atm_unmerge(grad_merged.to(acc), index_map) * w.unsqueeze(-1)).to(grad_merged.dtype)


def atm_unmerge_backward(grad_restored: Tensor, index_map: Tensor) -> Tensor:
    """Explicit unmerge backward: each slot sums the gradients of the tokens mapped to it."""
    acc = compute_dtype(grad_restored.dtype)
    b, t, d = grad_restored.shape
    out = torch.zeros(b, t, d, dtype=acc, device=grad_restored.device)
    out.scatter_add_(1, index_map.unsqueeze(-1).expand(b, t, d), grad_restored.to(acc))
    return out.to(grad_restored.dtype)
