"""The Wiola decoder (SPEC §2) in one file, modules in the paper's order.

    X⁰ = Embed(ids)
    for ℓ in 0..L-1:
        X̃  = WRMSNorm_ℓ(Xˡ)
        [ATM merge of X̃ — training only, layers L/3 ≤ ℓ < 2L/3]
        A  = GCLA_ℓ(X̃, Cˡ)                 Cˡ: summaries of the Λ layers before ℓ
        [ATM unmerge of A]
        X' = Xˡ + A
        Xˡ⁺¹ = X' + DSFF_ℓ(WRMSNorm'_ℓ(X'))
        record the summary s⁽ˡ⁾ of Xˡ⁺¹
    logits = WRMSNorm_final(Xᴸ) · Eᵀ       (tied head)

One path serves training, a full forward and cached decoding; speed comes from the
``wiola_kernels`` ops underneath: ``rms_norm`` / ``add_rms_norm`` (every norm after the first
reads the residual add it follows in one pass, SPEC §10.3), ``srpe``, ``gcla_attention``,
``atm_merge`` / ``atm_unmerge``, ``glu`` and ``linear_cross_entropy``. A few rows without
gradients on the CPU (a decoding step) run their products on ``decode_gemv``, which reads the
parameters in place, and a one-position step's attention on ``decode_attention`` (SRPE, the
cache append and the softmax over the cache and the context slots in one call).
``wiola.decode.fused_step`` runs a whole such step in one C++ call, equal bit for bit to this
path (tests/test_model_decode_step.py).

The cache (``cache``) is any object with the methods :class:`wiola.WiolaCache` gives: Hugging
Face's ``update(k, v, layer) -> (K, V)`` and ``get_seq_length(layer)``; ``key_mask`` (which
keys of this forward are real, ``(B, past + T)`` bool, None without padding);
``summary(layer, x)`` (the causal summaries of the new positions, continuing that layer's
running sum, SPEC §5.1); ``append_buffers(layer, B, H_kv, d_h, dtype)`` / ``appended(layer,
end)`` (room for one position, for ``decode_attention``; None where it has none).

    model = Wiola(WiolaConfig.from_name("wiola-tiny"))
    hidden = model(ids)                                                  # (B, T, d)
    logits, _ = logits_and_loss(hidden, model.embed_tokens.weight)       # (B, T, V)
    _, loss = logits_and_loss(hidden, model.embed_tokens.weight, ids)     # no (B, T, V) tensor formed
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import wiola_kernels as wk
from wiola_kernels import SpiralRotaryEmbedding, WiolaRMSNorm
from wiola_kernels.decode import attention as decode_attention, gemv as decode_gemv
from wiola_kernels.dtypes import compute_dtype
from wiola_kernels.reference.gcla_attention import gcla_context_kv, gcla_cross_attention, gcla_summary
from wiola_kernels.ops.srpe import srpe_max_position

from .configuration_wiola import WiolaConfig


def no_grad_wanted(x: Tensor, weight: Tensor) -> bool:
    """Whether autograd records nothing for a product of ``x`` with a parameter like ``weight``."""
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def linear(x: Tensor | list[Tensor], weights: list[Tensor]) -> Tensor:
    """``[x W_1ᵀ | x W_2ᵀ | …]`` ``(…, Σ n_i)``; ``x`` a list: ``[x_1 W_1ᵀ | x_2 W_2ᵀ | …]``. At
    most ``decode_gemv.MAX_ROWS`` rows without gradients on the CPU (decoding) run on the GEMV
    kernel (one parallel read of every weight, in place); everything else on ``F.linear``."""
    w, x0 = weights[0], x[0] if isinstance(x, list) else x
    if not torch.compiler.is_compiling() and x0.dtype == w.dtype and x0.shape[:-1].numel() <= decode_gemv.MAX_ROWS \
            and no_grad_wanted(x0, w) and decode_gemv.applies(w.dtype, x0.device) and not torch.is_autocast_enabled("cpu"):
        split = isinstance(x, list)
        return decode_gemv.gemv(torch.cat(x, -1) if split else x, weights, split)
    out = [F.linear(xi, wi) for xi, wi in zip(x if isinstance(x, list) else [x] * len(weights), weights)]
    return out[0] if len(out) == 1 else torch.cat(out, -1)


def add_norm(update: Tensor, residual: Tensor, norm: WiolaRMSNorm) -> tuple[Tensor, Tensor]:
    """``(norm(residual + update), residual + update)`` in one :func:`wiola_kernels.add_rms_norm`.
    Under autocast the update (a GEMM's output) is 16-bit while the residual stream stays
    float32: both go in at the dtype their sum would promote to."""
    dtype = torch.promote_types(update.dtype, residual.dtype)
    return wk.add_rms_norm(update.to(dtype), residual.to(dtype), norm.weight, norm.shift, norm.eps)


def holds_its_weights(norm: WiolaRMSNorm, d: int) -> bool:
    """Whether another module's forward may read ``norm``'s parameters: not under FSDP, which
    keeps them sharded (FSDP2: DTensors; FSDP1: flat views) until the norm's own forward."""
    for name in ("weight", "shift"):
        p = norm._parameters.get(name)
        if p is None:
            p = getattr(norm, name, None)  # not a registered Parameter (a parametrization, FSDP's views)
        if p is None:
            continue
        if p.shape != (d,):  # FSDP1's flat views
            return False
        if type(p) is not nn.Parameter and "DTensor" in (type(p).__name__, type(getattr(p, "data", p)).__name__):
            return False
    return True


# ----------------------------------------------------------------------------------------
# GCLA: gated cross-layer attention (SPEC §5)
# ----------------------------------------------------------------------------------------

def cached_attention(q_rot: Tensor, k_rot: Tensor, v: Tensor, key_valid: Tensor | None = None) -> Tensor:
    """Causal self-attention (SPEC §5.2) of ``T_new`` queries ``q_rot (B, H, T_new, d_h)`` against
    ``T_k ≥ T_new`` keys ``k_rot, v (B, H_kv, T_k, d_h)`` (the last ``T_new`` are the queries'
    own positions), in the accumulation dtype. ``key_valid (B, T_k)`` bool masks padded keys
    (a query with none real gets 0). Head ``h`` reads group ``h mod H_kv``: a group's heads are
    the rows of one product, so the cache is never repeated. Returns ``(B, H, T_new, d_h)``."""
    b, h, t_new, dh = q_rot.shape
    h_kv, t_k = k_rot.shape[1], k_rot.shape[2]
    r, acc = h // h_kv, compute_dtype(q_rot.dtype)
    # h = r·H_kv + g  →  (B, H_kv, R·T_new, d_h), rows ordered (r, t)
    q = q_rot.to(acc).reshape(b, r, h_kv, t_new, dh).transpose(1, 2).reshape(b, h_kv, r * t_new, dh)
    k, v = k_rot.to(acc), v.to(acc)
    if t_new == 1 and key_valid is None:  # the last position sees every key: no mask
        out = F.scaled_dot_product_attention(q, k, v)                                   # (B, H_kv, R, d_h)
        return out.view(b, h_kv, r, 1, dh).transpose(1, 2).reshape(b, h, 1, dh)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(dh))                         # (B, H_kv, R·T_new, T_k)
    q_pos = torch.arange(t_k - t_new, t_k, device=q.device).repeat(r)                   # (R·T_new,)
    allowed = torch.arange(t_k, device=q.device)[None, :] <= q_pos[:, None]             # (R·T_new, T_k) causal
    if key_valid is not None:
        allowed = allowed[None, None] & key_valid[:, None, None, :]                     # (B, 1, R·T_new, T_k)
    any_key = allowed.any(-1, keepdim=True)  # a padded query before any real key: output 0, no NaN
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")).masked_fill(~any_key, 0.0), -1) * any_key
    out = p @ v                                                                          # (B, H_kv, R·T_new, d_h)
    return out.view(b, h_kv, r, t_new, dh).transpose(1, 2).reshape(b, h, t_new, dh)


class WiolaAttention(nn.Module):
    """GCLA (SPEC §5.2–5.4): ``O_h = softmax(Q̃_h K̃_gᵀ/√d_h + M) V_g + σ(g_h) softmax_λ(Q_h Kᶜ_hᵀ/√d_h) Vᶜ_h``
    with ``g = h mod H_kv``, ``Q̃, K̃`` SRPE-rotated, ``Kᶜ, Vᶜ`` the context slots projected;
    ``A = [O_1 … O_H] W_O``."""

    def __init__(self, config: WiolaConfig, layer_idx: int):
        super().__init__()
        d, h, h_kv, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.layer_idx, self.n_head, self.n_kv_head, self.head_dim = layer_idx, h, h_kv, dh
        self.q_proj = nn.Linear(d, h * dh, bias=False)       # W_Q
        self.k_proj = nn.Linear(d, h_kv * dh, bias=False)    # W_K
        self.v_proj = nn.Linear(d, h_kv * dh, bias=False)    # W_V
        self.o_proj = nn.Linear(h * dh, d, bias=False)       # W_O
        self.kc_proj = nn.Linear(d, h * dh, bias=False)      # W_Kc: context keys, all H heads, no SRPE
        self.vc_proj = nn.Linear(d, h * dh, bias=False)      # W_Vc: context values
        self.gate = nn.Parameter(torch.full((h,), float(config.gcla_gate_init)))  # g: σ(g) blends the context
        self.srpe = SpiralRotaryEmbedding(dh, config.srpe_theta, config.srpe_spiral_divisor,
                                          config.srpe_radial_amplitude, config.srpe_radial_frequency)

    def context_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """``Kᶜ = C W_Kc``, ``Vᶜ = C W_Vc`` (SPEC §5.3) of ``context (B, S, Λ', d)``: ``(B, H, S, Λ', d_h)`` each."""
        return gcla_context_kv(context, self.kc_proj.weight.t(), self.vc_proj.weight.t(), self.n_head)

    def forward(self, x: Tensor, position_ids: Tensor, context: Tensor, lengths: Tensor | None = None,
                cache=None) -> Tensor:
        """``x (B, T, d)``, ``position_ids (B, T)``, ``context (B, S, Λ', d)`` with ``S ∈ {1, T}``;
        ``lengths (B,)`` real positions per row (padding, ATM) → ``A (B, T, d)``."""
        b, t, _ = x.shape
        h, h_kv, dh = self.n_head, self.n_kv_head, self.head_dim
        qkv = linear(x, [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])  # (B, T, (H + 2H_kv)·d_h)
        if cache is not None and t == 1:
            out = self.decode_step(qkv, position_ids, context, cache)  # one position per row: one kernel
            if out is not None:
                return linear(out.view(b, 1, h * dh), [self.o_proj.weight])
        q, k, v = qkv.split([h * dh, h_kv * dh, h_kv * dh], -1)
        q = q.view(b, t, h, dh).transpose(1, 2)                      # (B, H, T, d_h)
        k = k.view(b, t, h_kv, dh).transpose(1, 2)                   # (B, H_kv, T, d_h)
        v = v.view(b, t, h_kv, dh).transpose(1, 2)                   # (B, H_kv, T, d_h)
        q_rot, k_rot = self.srpe(q, k, position_ids)                 # SRPE on Q and K, one launch
        kc, vc = self.context_kv(context)                            # (B, H, S, Λ', d_h) each
        if cache is None or cache.get_seq_length(self.layer_idx) == 0:
            if cache is not None:
                cache.update(k_rot, v, self.layer_idx)
            out = wk.gcla_attention(q_rot, k_rot, v, q, kc, vc, self.gate, lengths)  # (B, H, T, d_h)
        else:  # T new queries against every cached key (the op takes one T)
            k_all, v_all = cache.update(k_rot, v, self.layer_idx)   # (B, H_kv, past + T, d_h)
            acc = compute_dtype(q.dtype)
            out = cached_attention(q_rot, k_all, v_all, cache.key_mask)
            if kc.shape[3] > 0:  # SPEC §5.3-5.4: the slot softmax and the gated mixture
                _, cross = gcla_cross_attention(q.to(acc), kc.to(acc), vc.to(acc), 1.0 / math.sqrt(dh))
                out = out + torch.sigmoid(self.gate.to(acc))[None, :, None, None] * cross
            out = out.to(q.dtype)
        return linear(out.transpose(1, 2).reshape(b, t, h * dh), [self.o_proj.weight])  # (B, T, d)

    def decode_step(self, qkv: Tensor, position_ids: Tensor, context: Tensor, cache) -> Tensor | None:
        """``(B, H·d_h)`` for one new unpadded position per row by one
        :func:`~wiola_kernels.decode.attention.decode_attention` call (SRPE, the cache append,
        the softmax over the cache and the context slots); None where it does not apply."""
        b, dh = qkv.shape[0], self.head_dim
        if torch.compiler.is_compiling() or cache.key_mask is not None or not no_grad_wanted(qkv, self.q_proj.weight) \
                or not decode_attention.applies(qkv.dtype, qkv.device) \
                or type(self.srpe) is not SpiralRotaryEmbedding or position_ids.dtype != torch.int64 \
                or int(position_ids.abs().max()) > srpe_max_position(self.srpe.spiral_divisor):
            return None
        slot = cache.append_buffers(self.layer_idx, b, self.n_kv_head, dh, qkv.dtype)
        if slot is None:
            return None
        k_buf, v_buf, past = slot
        n_ctx, hd = context.shape[2], self.n_head * dh
        context_k = context_v = gate = None
        if n_ctx:  # the context slots through W_Kc and W_Vc as rows of one product
            rows = context.expand(b, 1, n_ctx, context.shape[-1]).reshape(b * n_ctx, -1)
            if n_ctx == 1:  # one slot: softmax weight 1, no keys needed
                context_v = linear(rows, [self.vc_proj.weight]).view(b, 1, hd)
            else:
                kv = linear(rows, [self.kc_proj.weight, self.vc_proj.weight]).view(b, n_ctx, 2 * hd)
                context_k, context_v = kv[..., :hd], kv[..., hd:]
            gate = self.gate
        s = self.srpe
        out = decode_attention.decode_attention(
            qkv.view(b, -1), k_buf, v_buf, past, position_ids.contiguous(), self.n_head, theta=s.theta,
            spiral_divisor=s.spiral_divisor, radial_amplitude=s.radial_amplitude, radial_frequency=s.radial_frequency,
            context_k=context_k, context_v=context_v, gate=gate)
        cache.appended(self.layer_idx, past + 1)
        return out


# ----------------------------------------------------------------------------------------
# DSFF: dual-stream feed-forward (SPEC §7)
# ----------------------------------------------------------------------------------------

class WiolaDSFF(nn.Module):
    """``σ(β) ⊙ W_n2(SiLU(W_n1 x) ⊙ W_n3 x) + (1 − σ(β)) ⊙ W_w2(GELU_tanh(W_w1 x) ⊙ W_w3 x)``: the
    up products ``[W_n1 | W_n3 | W_w1 | W_w3] x`` side by side, :func:`wiola_kernels.glu` on each
    stream's half read in place (it saves only its input), the two down products and the blend
    as ``lerp(W, N, σ(β))`` (SPEC §10.2's folded down product is the same in exact arithmetic;
    the decoding kernels round as this does)."""

    def __init__(self, config: WiolaConfig):
        super().__init__()
        d, n, w = config.hidden_size, config.dsff_narrow_size, config.dsff_wide_size
        self.w_n1 = nn.Linear(d, n, bias=False)   # narrow gate (SiLU)
        self.w_n3 = nn.Linear(d, n, bias=False)   # narrow up
        self.w_n2 = nn.Linear(n, d, bias=False)   # narrow down
        self.w_w1 = nn.Linear(d, w, bias=False)   # wide gate (tanh-GELU)
        self.w_w3 = nn.Linear(d, w, bias=False)   # wide up
        self.w_w2 = nn.Linear(w, d, bias=False)   # wide down
        self.beta = nn.Parameter(torch.zeros(d))  # β: per-channel blend σ(β), starts at 1/2

    def forward(self, x: Tensor) -> Tensor:
        n, d = self.w_n1.out_features, x.shape[-1]
        u = linear(x, [self.w_n1.weight, self.w_n3.weight, self.w_w1.weight, self.w_w3.weight])  # (B, T, 2n + 2w)
        h_n = wk.glu(u[..., :2 * n], activation="silu")                 # (B, T, n)  SiLU(W_n1 x) ⊙ W_n3 x
        h_w = wk.glu(u[..., 2 * n:], activation="gelu_tanh")            # (B, T, w)  GELU(W_w1 x) ⊙ W_w3 x
        narrow, wide = linear([h_n, h_w], [self.w_n2.weight, self.w_w2.weight]).split([d, d], -1)  # (B, T, d) each
        return torch.lerp(wide, narrow, torch.sigmoid(self.beta).to(wide.dtype))  # λ N + (1 − λ) W


# ----------------------------------------------------------------------------------------
# One decoder layer (SPEC §2, one iteration of the loop)
# ----------------------------------------------------------------------------------------

def first_member(index_map: Tensor) -> Tensor:
    """``(B, T)`` merged slot → the first original position mapped to it (0 for empty slots)."""
    b, t = index_map.shape
    pos = torch.arange(t, device=index_map.device).expand(b, t)
    return torch.zeros_like(index_map).scatter_reduce(1, index_map, pos, reduce="amin", include_self=False)


class WiolaBlock(nn.Module):
    """``X' = Xˡ + GCLA(WRMSNorm(Xˡ))``, ``Xˡ⁺¹ = X' + DSFF(WRMSNorm'(X'))``, with ATM around
    GCLA in the middle third of layers while training."""

    def __init__(self, config: WiolaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.atm_threshold = float(config.atm_threshold)
        self.merges = bool(config.atm_enabled) and config.is_merge_layer(layer_idx)  # ATM here (training)
        self.attn_norm = WiolaRMSNorm(config.hidden_size, config.rms_norm_eps)  # WRMSNorm_ℓ
        self.attn = WiolaAttention(config, layer_idx)                            # GCLA_ℓ
        self.ffn_norm = WiolaRMSNorm(config.hidden_size, config.rms_norm_eps)   # WRMSNorm'_ℓ
        self.ffn = WiolaDSFF(config)                                            # DSFF_ℓ

    def forward(self, x: Tensor, position_ids: Tensor, context: Tensor, normed: Tensor | None = None,
                lengths: Tensor | None = None, cache=None, next_norm: WiolaRMSNorm | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """``x (B, T, d)`` → ``(Xˡ⁺¹, next_norm(Xˡ⁺¹) or None)``. ``normed``: ``WRMSNorm_ℓ(x)``
        when the block before computed it with its residual add; ``next_norm``: the norm that
        reads ``Xˡ⁺¹`` next (the next layer's or the final one), fused with the add."""
        h = self.attn_norm(x) if normed is None else normed          # X̃ (B, T, d)
        if self.merges and self.training and cache is None:          # ATM (SPEC §6)
            merged, pos, merged_len, index_map = wk.atm_merge(h, position_ids, self.atm_threshold, lengths)
            if context.shape[1] > 1:  # causal summaries: a slot reads the context at its first member
                context = context.gather(1, first_member(index_map)[:, :, None, None].expand_as(context))
            a = self.attn(merged, pos, context, merged_len)          # (B, T, d), zero past merged_len
            a = wk.atm_unmerge(a, index_map)                         # A_t = A'_{map(t)}
        else:
            a = self.attn(h, position_ids, context, lengths, cache)  # A (B, T, d)
        hf, x = add_norm(a, x, self.ffn_norm)                        # WRMSNorm'_ℓ(X'), X' = Xˡ + A
        f = self.ffn(hf)                                             # F (B, T, d)
        if next_norm is None:
            return x + f, None                                       # Xˡ⁺¹
        y, x = add_norm(f, x, next_norm)                             # next_norm(Xˡ⁺¹), Xˡ⁺¹ = X' + F
        return x, y


# ----------------------------------------------------------------------------------------
# The decoder and the tied head
# ----------------------------------------------------------------------------------------

class Wiola(nn.Module):
    """Embedding, L blocks with the summary context, final norm (``wiola.WiolaModel`` is this
    module with Hugging Face's base class and input checks)."""

    def __init__(self, config: WiolaConfig, init: bool = True):
        super().__init__()
        config.check()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # E
        self.layers = nn.ModuleList(WiolaBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = WiolaRMSNorm(config.hidden_size, config.rms_norm_eps)         # WRMSNorm_final
        self.gradient_checkpointing = False
        if init:  # (Hugging Face's post_init does it for wiola.WiolaModel)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """The initial values: every matrix N(0, initializer_range²), γ = 1, δ = 0, g = g₀, β = 0."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, self.config.initializer_range)
            elif isinstance(m, WiolaRMSNorm):
                m.weight.fill_(1.0)
                m.shift.zero_()
            elif isinstance(m, WiolaAttention):
                m.gate.fill_(float(self.config.gcla_gate_init))
            elif isinstance(m, WiolaDSFF):
                m.beta.zero_()

    def forward(self, input_ids: Tensor | None = None, position_ids: Tensor | None = None, cache=None,
                lengths: Tensor | None = None, inputs_embeds: Tensor | None = None,
                hidden_states: list[Tensor] | None = None) -> Tensor:
        """``input_ids (B, T)`` (or ``inputs_embeds (B, T, d)``) → ``WRMSNorm_final(Xᴸ) (B, T, d)``.

        ``position_ids (B, T)`` or ``(T,)`` (default: after the cached positions); ``lengths (B,)``
        real tokens per right-padded row; ``hidden_states``: a list that receives ``X⁰ … Xᴸ⁻¹``
        and the final output."""
        cfg, layers = self.config, self.layers
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # X⁰ (B, T, d)
        b, t, d = x.shape
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + t, device=x.device)
        position_ids = position_ids.expand(b, t) if position_ids.dim() == 1 or position_ids.shape[0] == 1 \
            else position_ids                                                        # (B, T)
        if hidden_states is not None:
            hidden_states.append(x)
        run = list(layers)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():  # recomputed in backward
            func = getattr(self, "_gradient_checkpointing_func", partial(checkpoint, use_reentrant=False))
            run = [partial(func, layer.__call__) for layer in layers]
        summaries: list[Tensor] = []  # s⁽ˡ⁾ (B, S, d) of the last Λ layers, oldest first
        normed = None                 # WRMSNorm_ℓ(Xˡ) when block ℓ − 1 computed it with its residual add
        for i, layer in enumerate(run):
            if summaries:
                context = torch.stack(summaries, dim=2)               # Cˡ (B, S, Λ', d)
            else:
                context = x.new_zeros(b, 1, 0, d)                     # no earlier layer: plain attention
            next_norm = layers[i + 1].attn_norm if i + 1 < len(layers) else self.norm
            x, normed = layer(x, position_ids, context, normed, lengths, cache,
                              next_norm if holds_its_weights(next_norm, d) else None)  # Xˡ⁺¹ (B, T, d)
            if i == len(layers) - 1:
                break  # the last layer's summary is never read
            if hidden_states is not None:
                hidden_states.append(x)
            if cfg.gcla_lookback > 0:
                summaries = (summaries + [self.summary(i, x, lengths, cache)])[-cfg.gcla_lookback:]
        x = self.norm(x) if normed is None else normed                # WRMSNorm_final(Xᴸ) (B, T, d)
        if hidden_states is not None:
            hidden_states.append(x)
        return x

    def summary(self, layer_idx: int, x: Tensor, lengths: Tensor | None, cache) -> Tensor:
        """``s⁽ˡ⁾`` of ``Xˡ⁺¹ = x (B, T, d)`` (SPEC §5.1), summed in float32 (float64 models: 64):
        causal prefix means ``(B, T, d)`` (with a cache: continuing its running sums) or the
        paper's sequence mean ``(B, 1, d)``."""
        if cache is not None and self.config.gcla_summary == "causal":
            return cache.summary(layer_idx, x)
        return gcla_summary(x.to(compute_dtype(x.dtype)), self.config.gcla_summary, lengths).to(x.dtype)


def logits_and_loss(hidden: Tensor, head: Tensor, labels: Tensor | None = None,
                    return_logits: bool = False) -> tuple[Tensor | None, Tensor | None]:
    """The tied head ``Z = H Eᵀ`` and the next-token loss (``labels (B, T)``, −100 ignored,
    position t predicting token t + 1). With ``labels`` and not ``return_logits`` the loss is
    :func:`wiola_kernels.linear_cross_entropy` and no ``(B, T, V)`` logits are formed."""
    if labels is not None and not return_logits:
        h, e = hidden[:, :-1], head
        if torch.is_autocast_enabled(h.device.type):  # as autocast runs the head's F.linear
            dt = torch.get_autocast_dtype(h.device.type)
            h, e = h.to(dt), e.to(dt)
        return None, wk.linear_cross_entropy(h, e.to(h.dtype), labels[:, 1:], ignore_index=-100)
    logits = linear(hidden, [head])                                   # (B, T, V)
    if labels is None:
        return logits, None
    flat = logits[:, :-1].to(compute_dtype(logits.dtype)).reshape(-1, logits.shape[-1])
    return logits, F.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=-100)


__all__ = ["Wiola", "WiolaAttention", "WiolaBlock", "WiolaDSFF", "add_norm", "cached_attention", "first_member",
           "holds_its_weights", "linear", "logits_and_loss"]
