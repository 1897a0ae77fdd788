"""Independent float64 oracles of the ops, written from SPEC.md alone (loops over heads,
pairs and tokens), and the one greedy-merge loop of SPEC §6.2 that every ATM test uses.

Nothing here imports ``wiola_kernels``: a bug in the package (its reference included)
cannot reach these oracles. Tests compare kernels with them, never with the code under
test. ``rel`` is the relative error the black-box tests use: it also asserts equal shapes
and finite outputs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

F64 = torch.float64


def rel(out, ref):
    """``‖out − ref‖ / ‖ref‖`` in float64, asserting equal shapes and a finite ``out``."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all()
    den = ref.norm()
    num = (out - ref).norm()
    if den == 0:
        return num.item()
    return (num / den).item()


def raises_naming(exc_types, names, fn):
    """``fn()`` raises one of ``exc_types`` whose message names one of ``names``."""
    with pytest.raises(exc_types) as info:
        fn()
    msg = str(info.value)
    assert any(n in msg for n in names), f"message {msg!r} names none of {names}"


def rms_oracle(x, w, s, eps, hf_order=False):
    """SPEC §3 in float64: ``γ z / sqrt(mean z² + ε)``, ``z = x + δ`` (``s`` None: δ = 0).

    ``hf_order``: Hugging Face's LlamaRMSNorm order instead, in x's dtype, not float64 (its
    roundings are the point): ``z = x + δ`` and its normalisation in float32, rounded to x's
    dtype, then multiplied by γ in PyTorch's type promotion."""
    if hf_order:
        z = x.to(torch.float32) if s is None else x.to(torch.float32) + s.to(torch.float32)
        return w * (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    x, w = x.double(), w.double()
    z = x if s is None else x + s.double()
    r = torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    return w * z / r


def add_rms_norm_oracle(x, residual, w, s, eps):
    """SPEC §10.3 in float64: ``(WRMSNorm(x + residual), x + residual)``."""
    total = x.double() + residual.double()
    return rms_oracle(total, w, s, eps), total


def glu_oracle(a, b, activation):
    """SPEC §10.2 in float64: ``act(a) ⊙ b``; ``b`` None: ``a`` is the packed ``[a | b]``."""
    a = a.double()
    if b is None:
        a, b = a.chunk(2, dim=-1)
    if activation == "silu":
        act = a / (1 + torch.exp(-a))
    else:
        act = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))
    return act * b.double()


def lce_oracle(h, W, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0,
               num_items=None):
    """SPEC §10.1 row by row in float64, differentiable by autograd: h (..., d), W (V, d)."""
    h2, W = h.double().reshape(-1, h.shape[-1]), W.double()
    y = labels.reshape(-1).tolist()
    eps = label_smoothing
    rows = []
    for i, yi in enumerate(y):
        if yi == ignore_index:
            rows.append(torch.zeros((), dtype=F64))
            continue
        z = W @ h2[i]
        s = softcap * torch.tanh(z / softcap) if softcap is not None else z
        lse = torch.logsumexp(s, 0)
        rows.append((1 - eps) * (lse - s[yi]) + eps * (lse - s.mean()) + z_loss * lse * lse)
    loss = torch.stack(rows) if rows else torch.zeros(0, dtype=F64)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    n = float(num_items) if num_items is not None else max(1, sum(v != ignore_index for v in y))
    return loss.sum() / n


def srpe_oracle(x, pos, theta=10000.0, ks=8.0, a_s=0.1, f_s=0.01):
    """SPEC §4 in float64, one pair at a time (rotate-half): x (B, Hx, T, d_h); pos (B, T),
    (1, T) or (T,) integer positions. ``ks = ±inf`` and ``a_s = 0`` is plain RoPE."""
    x = x.double()
    B, Hx, T, dh = x.shape
    half = dh // 2
    p = pos.to(torch.int64).expand(B, T).double()
    cols_lo, cols_hi = [], []
    for j in range(half):
        w_j = theta ** (-2.0 * j / dh)
        ang = p * w_j * (1.0 + 1.0 / ks)
        r = 1.0 + a_s * torch.sin(p * f_s * w_j)
        c = (r * torch.cos(ang))[:, None, :]
        sn = (r * torch.sin(ang))[:, None, :]
        a, b = x[..., j], x[..., j + half]
        cols_lo.append(a * c - b * sn)
        cols_hi.append(a * sn + b * c)
    return torch.stack(cols_lo + cols_hi, dim=-1)


def gcla_oracle(q_rot, k_rot, v, q, kc, vc, gate, lengths=None, return_lse=False):
    """SPEC §5.2-5.5 in float64, one batch row at a time, differentiable by autograd: head ``h``
    attends causally to key/value group ``h mod H_kv`` with scores ``q̃·k̃ / √d_h``, plus
    ``σ(g_h)`` times a softmax over the Λ' slots of ``kc``/``vc`` with the un-rotated ``q``
    (slot row 0 when ``S = 1``, row ``t`` when ``S = T``). Rows ``t ≥ lengths[b]`` are 0 (their
    keys are never attended: a row ``t < len`` sees keys ``≤ t`` only). The ``T×T`` scores are
    materialised: an oracle may. ``return_lse``: also the self part's log-sum-exp (B, H, T),
    NaN on rows past the length (SPEC leaves it undefined there)."""
    q_rot, k_rot, v, q, kc, vc, gate = (t.double() for t in (q_rot, k_rot, v, q, kc, vc, gate))
    B, H, T, dh = q_rot.shape
    group = torch.arange(H) % k_rot.shape[1]                   # SPEC §5.2: h mod H_kv
    scale = 1.0 / math.sqrt(dh)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)        # key j > query t
    outs, lses = [], []
    for b in range(B):
        valid = torch.arange(T) < (T if lengths is None else int(lengths[b]))
        s = (q_rot[b] @ k_rot[b, group].transpose(-1, -2) * scale).masked_fill(future, float("-inf"))  # (H, T, T)
        o = torch.softmax(s, -1) @ v[b, group]
        ctx_k, ctx_v = kc[b].expand(H, T, *kc.shape[3:]), vc[b].expand(H, T, *vc.shape[3:])  # S = 1: one row for all t
        a = torch.softmax(torch.einsum("htd,htld->htl", q[b], ctx_k) * scale, -1)  # Λ' = 0: empty, O^cross = 0
        o = o + torch.sigmoid(gate)[:, None, None] * torch.einsum("htl,htld->htd", a, ctx_v)
        outs.append(torch.where(valid[:, None], o, 0.0))
        lses.append(torch.where(valid, torch.logsumexp(s, -1), float("nan")))
    out = torch.stack(outs) if B else q_rot * 0.0  # B = 0: empty, differentiable
    if return_lse:
        return out, torch.stack(lses) if B else q_rot.new_zeros(q_rot.shape[:3])
    return out


def greedy_groups(length, candidate):
    """SPEC §6.2, the greedy left-to-right scan over one row's first ``length`` tokens:
    token t is paired with t + 1 when edge t is a candidate (``candidate(t)``: s_t > τ) and
    t is not already taken; every other token stays alone. Returns the groups in order,
    tuples ``(t, t + 1)`` or ``(t,)``; padding tokens (t ≥ length) are never grouped."""
    groups, t = [], 0
    while t < length:
        if t + 1 < length and candidate(t):
            groups.append((t, t + 1))
            t += 2
        else:
            groups.append((t,))
            t += 1
    return groups


def _unit_scaled(v):
    """The token ``v`` (floats) times the power of two that brings ``max|v|`` into [0.5, 1):
    the cosine is homogeneous in each token, so this changes no similarity, only keeps the
    sums below in range at every magnitude."""
    m = max(abs(u) for u in v)
    if m == 0:
        return v
    e = math.frexp(m)[1]
    return [math.ldexp(u, -e) for u in v]


def atm_candidate(a, b, tau):
    """SPEC §6.1: is ``s = cos(a, b) > τ`` for two tokens (lists of floats)? The cosine of a
    zero token is 0; a NaN/Inf token is never a candidate (docs/ops.md). Decided without a
    square root — for ``D = ⟨a, b⟩ > 0``, ``s > τ ⟺ D² > τ²·‖a‖²‖b‖²`` — in float64 with
    ``τ²N`` rounded as ``(τ·τ)·N``, the rounding the project fixes for exact ties
    (wiola_kernels/reference/atm.py): a threshold one ulp from a similarity is decided
    the same way by every backend. D and τ are scaled together by a power of two so that
    neither square under- or overflows."""
    if not tau < 1 or not all(math.isfinite(u) for u in a + b):
        return False
    a, b = _unit_scaled(a), _unit_scaled(b)
    dot = math.fsum(p * q for p, q in zip(a, b))
    n = math.fsum(p * p for p in a) * math.fsum(q * q for q in b)
    if n == 0:
        return tau < 0
    if (dot > 0) != (tau >= 0):
        return dot > 0                                  # the signs decide
    e = math.frexp(max(abs(dot), abs(tau)))[1]
    ds, ts = math.ldexp(dot, -e), math.ldexp(tau, -e)
    return ds * ds > (ts * ts) * n if dot > 0 else ds * ds < (ts * ts) * n


def atm_oracle(x, position_ids, threshold, lengths=None):
    """SPEC §6.1-6.3 in float64, a row and a token at a time: ``(merged, merged_position_ids,
    merged_lengths, index_map)`` of ``x (B, T, d)``, ``merged`` differentiable in ``x`` (so its
    autograd is SPEC §6.4's backward: halves to a pair's members, padding zero).

    Candidates by :func:`atm_candidate` inside each row's length, the greedy scan of
    :func:`greedy_groups`; a pair's mean as ``x_t/2 + x_{t+1}/2`` (no overflow at a dtype's
    maximum) with its first member's position; row b holds its T'_b slots first, then zeros
    with position 0; a padding token t ≥ L_b maps to slot ``T'_b + (t − L_b)``."""
    x = x.double()
    B, T, d = x.shape
    pos = position_ids.to(torch.int64).expand(B, T)
    rows = x.detach().tolist()
    merged, mpos = [], torch.zeros(B, T, dtype=torch.int64)
    mlen, imap = torch.zeros(B, dtype=torch.int64), torch.zeros(B, T, dtype=torch.int64)
    for b in range(B):
        L = T if lengths is None else int(lengths[b])
        groups = greedy_groups(L, lambda t, r=rows[b]: atm_candidate(r[t], r[t + 1], threshold))
        first, last = (x[b, torch.tensor([g[k] for g in groups], dtype=torch.int64)] for k in (0, -1))
        pair = torch.tensor([len(g) == 2 for g in groups], dtype=torch.bool)[:, None]
        slots = torch.where(pair, first / 2 + last / 2, first)
        merged.append(torch.cat([slots, torch.zeros(T - len(groups), d, dtype=F64)]))
        for s, g in enumerate(groups):
            mpos[b, s] = pos[b, g[0]]
            imap[b, list(g)] = s
        imap[b, L:] = torch.arange(len(groups), len(groups) + T - L)
        mlen[b] = len(groups)
    return (torch.stack(merged) if B else x * 0), mpos, mlen, imap


def atm_unmerge_oracle(y, index_map):
    """SPEC §6.3 in float64: ``restored[b, t] = y[b, index_map[b, t]]``; differentiable, a
    slot's gradient the sum of its tokens' (§6.4)."""
    y = y.double()
    return torch.stack([y[b, index_map[b]] for b in range(y.shape[0])]) if y.shape[0] else y * 0


# ----------------------------------------------------------------------------------------
# The float64 oracle (SPEC §2-§7)
# ----------------------------------------------------------------------------------------

class ModelOracle:
    """One Wiola forward in float64 from the SPEC formulas, weights copied from a model."""

    def __init__(self, model, cfg, requires_grad=False):
        self.cfg = cfg
        P = {k: v.detach().to(F64).clone().requires_grad_(requires_grad) for k, v in model.named_parameters()}
        self.P = P
        emb = [k for k in P if "embed" in k]
        assert len(emb) == 1, emb
        self.E = P[emb[0]]
        self.final_w = P["model.norm.weight"]
        self.final_s = P["model.norm.shift"]
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            g = lambda name: P[pre + name]  # noqa: E731
            self.layers.append(dict(
                n1w=g("attn_norm.weight"), n1s=g("attn_norm.shift"),
                n2w=g("ffn_norm.weight"), n2s=g("ffn_norm.shift"),
                Wq=g("attn.q_proj.weight").T, Wk=g("attn.k_proj.weight").T,
                Wv=g("attn.v_proj.weight").T, Wo=g("attn.o_proj.weight").T,
                Wkc=g("attn.kc_proj.weight").T, Wvc=g("attn.vc_proj.weight").T,
                gate=g("attn.gate"), beta=g("ffn.beta"),
                Wn1=g("ffn.w_n1.weight").T, Wn2=g("ffn.w_n2.weight").T, Wn3=g("ffn.w_n3.weight").T,
                Ww1=g("ffn.w_w1.weight").T, Ww2=g("ffn.w_w2.weight").T, Ww3=g("ffn.w_w3.weight").T,
            ))
        # everything the model has is used by the oracle
        used = {k for k in P if k.startswith("model.layers.")}
        n_used = 18 * cfg.num_hidden_layers
        assert len(used) == n_used, sorted(used)
        assert set(P) - used == {emb[0], "model.norm.weight", "model.norm.shift"}

    # §3
    def norm(self, x, w, s):
        z = x + s
        r = torch.sqrt((z * z).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return w * z / r

    # §4; x (H, T, d_h), pos (T,)
    def srpe(self, x, pos):
        c = self.cfg
        dh = x.shape[-1]
        half = dh // 2
        j = torch.arange(half, dtype=F64)
        omega = float(c.srpe_theta) ** (-2.0 * j / dh)
        p = pos.to(F64)[:, None]
        theta = p * omega * (1.0 + 1.0 / c.srpe_spiral_divisor)
        r = 1.0 + c.srpe_radial_amplitude * torch.sin(p * c.srpe_radial_frequency * omega)
        cs, sn = r * torch.cos(theta), r * torch.sin(theta)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cs - x2 * sn, x1 * sn + x2 * cs], dim=-1)

    # §5.2-5.4 for one sequence; xt (T, d), pos (T,), ctx (S, Λ', d) with S ∈ {1, T} or None
    def gcla(self, lp, xt, pos, ctx, group_rule="mod"):
        c = self.cfg
        T = xt.shape[0]
        H, Hkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        Q = (xt @ lp["Wq"]).view(T, H, dh).transpose(0, 1)
        K = (xt @ lp["Wk"]).view(T, Hkv, dh).transpose(0, 1)
        V = (xt @ lp["Wv"]).view(T, Hkv, dh).transpose(0, 1)
        Qr, Kr = self.srpe(Q, pos), self.srpe(K, pos)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        if ctx is not None:
            S, Lc = ctx.shape[0], ctx.shape[1]
            Kc = (ctx @ lp["Wkc"]).view(S, Lc, H, dh)
            Vc = (ctx @ lp["Wvc"]).view(S, Lc, H, dh)
        outs = []
        for h in range(H):
            g = h % Hkv if group_rule == "mod" else h // (H // Hkv)
            s = (Qr[h] @ Kr[g].T) / math.sqrt(dh)
            s = s.masked_fill(mask, float("-inf"))
            o = torch.softmax(s, -1) @ V[g]
            if ctx is not None:
                kc = Kc[:, :, h].expand(T, Lc, dh)
                vc = Vc[:, :, h].expand(T, Lc, dh)
                a = torch.softmax(torch.einsum("td,tld->tl", Q[h], kc) / math.sqrt(dh), -1)
                o = o + torch.sigmoid(lp["gate"][h]) * torch.einsum("tl,tld->td", a, vc)
            outs.append(o)
        O = torch.stack(outs, 1).reshape(T, H * dh)
        return O @ lp["Wo"]

    # §7
    def dsff(self, lp, x):
        nar = (F.silu(x @ lp["Wn1"]) * (x @ lp["Wn3"])) @ lp["Wn2"]
        wid = (F.gelu(x @ lp["Ww1"], approximate="tanh") * (x @ lp["Ww3"])) @ lp["Ww2"]
        lam = torch.sigmoid(lp["beta"])
        return lam * nar + (1 - lam) * wid

    # §6; returns (slots: list of member lists, min |s_t - τ|)
    @staticmethod
    def merge_plan(xt, tau):
        xt = xt.detach()
        T = xt.shape[0]
        margin = float("inf")
        cos = [float(torch.dot(xt[i], xt[i + 1]) / (xt[i].norm() * xt[i + 1].norm())) for i in range(T - 1)]
        if cos:
            margin = min(abs(s - tau) for s in cos)
        return [list(grp) for grp in greedy_groups(T, lambda t: cos[t] > tau)], margin

    def forward(self, ids, pos=None, mode="causal", atm_layers=(), group_rule="mod",
                lookback=None, info=None, atm_member=0):
        """ids (B, T); pos (B, T) or None; returns logits (B, T, V)."""
        c = self.cfg
        B, T = ids.shape
        if pos is None:
            pos = torch.arange(T).expand(B, T)
        lookback = c.gcla_lookback if lookback is None else lookback
        X = self.E[ids]
        summaries = []
        for l, lp in enumerate(self.layers):
            Xn = self.norm(X, lp["n1w"], lp["n1s"])
            ctx_layers = summaries[max(0, l - lookback):l]
            A = torch.empty_like(X)
            for b in range(B):
                ctx = torch.stack([s[b] for s in ctx_layers], dim=1) if ctx_layers else None
                if l in atm_layers:
                    slots, margin = self.merge_plan(Xn[b], c.atm_threshold)
                    if info is not None:
                        info.setdefault("margin", []).append(margin)
                        info.setdefault("merges", {}).setdefault(l, 0)
                        info["merges"][l] += sum(len(s) == 2 for s in slots)
                    # SPEC: position and causal context of a slot are its first member's
                    # (atm_member=-1 is a wrong variant, used to show the tests discriminate)
                    first = torch.tensor([s[atm_member] for s in slots])
                    xm = torch.stack([Xn[b, s].mean(0) for s in slots])
                    cm = None if ctx is None else (ctx[first] if ctx.shape[0] == T else ctx)
                    Am = self.gcla(lp, xm, pos[b, first], cm, group_rule)
                    for k, s in enumerate(slots):
                        for t in s:
                            A[b, t] = Am[k]
                else:
                    A[b] = self.gcla(lp, Xn[b], pos[b], ctx, group_rule)
            X = X + A
            X = X + self.dsff(lp, self.norm(X, lp["n2w"], lp["n2s"]))
            if mode == "paper":
                summaries.append(X.mean(1, keepdim=True))
            else:
                summaries.append(X.cumsum(1) / torch.arange(1, T + 1, dtype=F64)[None, :, None])
        return self.norm(X, self.final_w, self.final_s) @ self.E.T
