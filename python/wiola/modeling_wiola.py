"""The Wiola decoder (SPEC §2), one readable file, modules in dependency order.

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

Cached decoding steps without gradients run the same maths laid out for batch-1 GEMVs
(``decode.py``: on the CPU in float32/bfloat16/float16 ``wiola_kernels.decode_gemv`` streams
the parameters themselves, no copy; elsewhere transposed copies in the layout MKL streams
fastest; the KV cache appended in place).

The heavy lifting is done by ``wiola_kernels`` ops (``rms_norm``, ``srpe``,
``gcla_attention``, ``atm_merge``/``atm_unmerge``, ``glu`` in DSFF, and ``add_rms_norm`` for
every norm after the first: each residual add and the norm that reads its sum in one pass,
SPEC §10.3); which implementation runs is chosen
by ``config.kernel_backend`` through :func:`wiola_kernels.use_backend` around the
forward (``"auto"``: no override, each op picks the best backend for the device).
Each op's backward runs on the backend its forward used (``wiola_kernels`` pins it),
so ``loss.backward()`` needs no extra scope.

Summaries (SPEC §5.1). ``gcla_summary="causal"`` (default): ``s⁽ˡ⁾_t`` is the mean of
``Xˡ⁺¹_u`` over ``u ≤ t``; the model is causal and the generation cache carries each
layer's running sum, so cached decoding reproduces the full forward.
``gcla_summary="paper"``: ``s⁽ˡ⁾`` is the mean over the whole sequence (paper eq. 20);
every position sees later tokens through it, so the model is *not* causal and a KV
cache cannot reproduce a full forward (the past keys themselves depend on the future).
In that mode ``generate()`` turns the cache off and recomputes the whole sequence at
every step, and ``forward`` refuses a non-empty cache.

ATM (SPEC §6) runs only in training mode and only in the middle third of layers; a
merged pair lets position t see token t+1, a training-time leak the tests show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

import wiola_kernels
from wiola_kernels import SpiralRotaryEmbedding, WiolaRMSNorm
from wiola_kernels.reference import dsff as dsff_reference
from wiola_kernels.reference.gcla_attention import gcla_context_kv, gcla_cross_attention, gcla_summary
from wiola_kernels.dtypes import compute_dtype

from .configuration_wiola import WiolaConfig
from . import decode
from .context_fold import folded_context_attention
from .loading import (check_checkpoint_path, check_load_kwargs, portable_kernel_backend, quiet_load_report,
                      refuse_partial_load, refuse_pickle_only_directory)

# The cache's name in transformers' model outputs and generation kwargs: ``cache`` from
# 5.2x on (``past_key_values`` a deprecated alias), ``past_key_values`` before. The model's
# own API says ``cache`` on every version; on older releases its outputs carry the cache
# under both names, because generate() reads the old one there.
CACHE_KWARG = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"

if CACHE_KWARG == "cache":
    WiolaModelOutput, WiolaCausalLMOutput = BaseModelOutputWithPast, CausalLMOutputWithPast
else:
    @dataclasses.dataclass
    class WiolaModelOutput(BaseModelOutputWithPast):
        """``BaseModelOutputWithPast`` with the cache as ``cache`` too (older transformers)."""

        cache: Cache | None = None

        def __post_init__(self):
            if self.past_key_values is None:
                self.past_key_values = self.cache
            super().__post_init__()

    @dataclasses.dataclass
    class WiolaCausalLMOutput(CausalLMOutputWithPast):
        """``CausalLMOutputWithPast`` with the cache as ``cache`` too (older transformers)."""

        cache: Cache | None = None

        def __post_init__(self):
            if self.past_key_values is None:
                self.past_key_values = self.cache
            super().__post_init__()


# WiolaRMSNorm (SPEC §3) and SpiralRotaryEmbedding (SPEC §4) are the wiola_kernels
# modules: RMSNorm with a learned shift δ before the RMS, and the spiral rotary map.


# ----------------------------------------------------------------------------------------
# Summaries and the cache (SPEC §5.1)
# ----------------------------------------------------------------------------------------

class WiolaCache(DynamicCache):
    """KV cache (rotated keys and values per layer) plus each layer's running summary sum.

    ``summary(layer_idx, x, past, valid)`` turns the new positions' outputs ``x (B, T_new, d)``
    into prefix means over all valid positions so far and advances the running sum, so
    cached decoding with causal summaries equals the full forward.

    Padded batches: the cache keeps its keys in the layout of the ``attention_mask`` it was
    built with (left padding: pads first) and remembers which cached positions are real
    (``key_valid (B, past)``, None when all are) and how many real positions each row's
    summaries have averaged (``summary_counts (B,)``, None when every position is real).
    A later forward must pass the same mask extended by the new positions.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.layer_class_to_replicate is DynamicLayer:  # append in place, not torch.cat of the whole cache
            self.layer_class_to_replicate = decode.GrowingKV
        self.summary_sums: dict[int, Tensor] = {}  # layer -> (B, d) Σ_u Xˡ⁺¹_u, float32 (float64 models: 64)
        self.key_valid: Tensor | None = None       # (B, past) bool: cached position is a real token
        self.summary_counts: Tensor | None = None  # (B,) real positions summarised so far

    def summary(self, layer_idx: int, x: Tensor, past: int, valid: Tensor | None = None) -> Tensor:
        """Prefix means of ``x (B, T_new, d)`` continuing this layer's running sum; ``valid
        (B, T_new)`` bool leaves padded positions out of the sums and counts (their own
        summaries are means of the real positions before them, 0 before the first)."""
        b, t, _ = x.shape
        running = self.summary_sums.get(layer_idx)
        acc = compute_dtype(x.dtype)
        if t == 1 and valid is None and self.summary_counts is None and running is not None:
            # one decoding step, no padding: the sum and the count need no cumsum or arange
            prefix = running + x[:, 0].to(acc)
            self.summary_sums[layer_idx] = prefix
            return (prefix[:, None] / (past + 1)).to(x.dtype)
        xs = x.to(acc)
        if valid is not None:
            xs = xs * valid[..., None]
        prefix = xs.cumsum(1)  # (B, T_new, d)
        if running is not None:
            prefix = prefix + running[:, None, :]
        self.summary_sums[layer_idx] = prefix[:, -1, :]
        if valid is None and self.summary_counts is None:
            count = torch.arange(past + 1, past + t + 1, device=x.device, dtype=acc)[None, :, None]
        else:
            before = self.summary_counts if self.summary_counts is not None \
                else torch.full((b,), past, device=x.device)
            steps = valid.cumsum(1) if valid is not None else torch.arange(1, t + 1, device=x.device)[None, :]
            count = (before[:, None] + steps).to(acc).clamp(min=1)[..., None]
        return (prefix / count).to(x.dtype)

    def advance(self, new_valid: Tensor | None, past: int) -> None:
        """Record the real positions of the ``T_new`` tokens just cached (call once per forward,
        after every layer has updated; ``new_valid`` None: all real)."""
        if new_valid is None and self.key_valid is None:
            return
        b, t = (new_valid.shape if new_valid is not None else (self.key_valid.shape[0], 0))
        device = new_valid.device if new_valid is not None else self.key_valid.device
        old = self.key_valid if self.key_valid is not None else torch.ones(b, past, dtype=torch.bool, device=device)
        new = new_valid if new_valid is not None else torch.ones(b, t, dtype=torch.bool, device=device)
        counts = self.summary_counts if self.summary_counts is not None else torch.full((b,), past, device=device)
        self.key_valid = torch.cat([old, new.bool()], 1)
        self.summary_counts = counts + new.sum(1)

    def reorder_cache(self, beam_idx: torch.LongTensor):  # beam search
        super().reorder_cache(beam_idx)
        for k, s in self.summary_sums.items():
            self.summary_sums[k] = s.index_select(0, beam_idx.to(s.device))
        if self.key_valid is not None:
            self.key_valid = self.key_valid.index_select(0, beam_idx.to(self.key_valid.device))
            self.summary_counts = self.summary_counts.index_select(0, beam_idx.to(self.summary_counts.device))

    def batch_repeat_interleave(self, repeats: int):  # num_return_sequences > 1
        super().batch_repeat_interleave(repeats)
        for k, s in self.summary_sums.items():
            self.summary_sums[k] = s.repeat_interleave(repeats, dim=0)
        if self.key_valid is not None:
            self.key_valid = self.key_valid.repeat_interleave(repeats, dim=0)
            self.summary_counts = self.summary_counts.repeat_interleave(repeats, dim=0)

    def crop(self, max_length: int):
        if self.summary_sums and max_length < self.get_seq_length():
            raise NotImplementedError("WiolaCache cannot be cropped: running summary sums cannot be rewound")
        super().crop(max_length)


# ----------------------------------------------------------------------------------------
# GCLA: gated cross-layer attention (SPEC §5)
# ----------------------------------------------------------------------------------------

def gcla_attention_cached(q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor,
                          gate: Tensor, key_valid: Tensor | None = None) -> Tensor:
    """GCLA for ``T_new`` queries against ``T_k ≥ T_new`` cached keys, in plain PyTorch.

    ``q_rot, q (B, H, T_new, d_h)``, ``k_rot, v (B, H_kv, T_k, d_h)`` (the last ``T_new``
    keys are the queries' own positions), ``kc, vc (B, H, S, Λ', d_h)``; ``key_valid
    (B, T_k)`` bool masks padded keys (a query with no real key at or before it gets 0).
    Used for decoding steps, where queries and keys have different lengths (the fused op
    takes one T).
    """
    b, h, t_new, dh = q_rot.shape
    acc = compute_dtype(q.dtype)
    out = decode.cached_attention(q_rot, k_rot, v, key_valid)  # (B, H, T_new, d_h), accumulation dtype
    if kc.shape[3] > 0:  # SPEC §5.3: the reference's slot softmax and mixture; kc, vc broadcast S = 1 over T_new
        _, cross = gcla_cross_attention(q.to(acc), kc.to(acc), vc.to(acc), 1.0 / math.sqrt(dh))
        out = out + torch.sigmoid(gate.to(acc))[None, :, None, None] * cross
    return out.to(q.dtype)


#: ``WiolaAttention.fold_context = "auto"`` folds only where it measured faster on the CPU:
#: without gradients and at most this many positions per forward (decoding, short prompts).
FOLD_MAX_POSITIONS = 256


class WiolaAttention(nn.Module):
    """GCLA: SRPE self-attention with GQA plus a gated sub-attention over the summaries of
    earlier layers (SPEC §5.2–5.4).

    ``O_h = softmax(Q̃_h K̃_gᵀ/√d_h + M) V_g + σ(g_h) softmax_λ(Q_h Kᶜ_h/√d_h) Vᶜ_h``,
    ``A = [O_1 … O_H] W_O``, with ``g = h mod H_kv``.
    """

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
        self.gate = nn.Parameter(torch.full((h,), float(config.gcla_gate_init)))  # g, σ(g) blends the context
        self.srpe = SpiralRotaryEmbedding(dh, config.srpe_theta, config.srpe_spiral_divisor,
                                          config.srpe_radial_amplitude, config.srpe_radial_frequency)

    #: Per-position contexts (causal summaries) can use the folded cross part (context_fold.py:
    #: two d×d products per token instead of 2Λ', but H·d-wide intermediates per token).
    #: "auto": where it measured faster on the CPU (no gradients, ≤ FOLD_MAX_POSITIONS
    #: positions: decoding +15% tok/s on wiola-360m); training steps measured no faster
    #: (wiola-360m layer shape) or 3% slower (d 256), so they keep the fused op's own cross
    #: part. "always" / "never" force it (tests, benchmarks).
    fold_context = "auto"

    def context_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """``Kᶜ = C W_Kc``, ``Vᶜ = C W_Vc`` (SPEC §5.3) of ``context (B, S, Λ', d)``: ``(B, H, S, Λ', d_h)`` each."""
        return gcla_context_kv(context, self.kc_proj.weight.t(), self.vc_proj.weight.t(), self.n_head)

    def folds(self, context: Tensor, t: int, x: Tensor) -> bool:
        """Whether this forward uses the folded cross part (see :attr:`fold_context`)."""
        if context.shape[2] == 0 or context.shape[1] != t or self.fold_context == "never":
            return False
        if self.fold_context == "always":
            return True
        grad = torch.is_grad_enabled() and (x.requires_grad or self.kc_proj.weight.requires_grad)
        return not grad and context.shape[0] * t <= FOLD_MAX_POSITIONS

    def forward(self, x: Tensor, position_ids: Tensor, context: Tensor, lengths: Tensor | None = None,
                cache: WiolaCache | None = None, layout: "PaddingLayout | None" = None) -> Tensor:
        """``x (B, T, d)``, ``position_ids (B, T)``, ``context (B, S, Λ', d)`` with S ∈ {1, T}.

        ``layout`` (padded batches, see :class:`PaddingLayout`): which cached keys are real,
        and how to put this forward's keys back into the mask's layout before caching them."""
        b, t, _ = x.shape
        h, h_kv, dh = self.n_head, self.n_kv_head, self.head_dim
        q_bthd = self.q_proj(x).view(b, t, h, dh)
        q = q_bthd.transpose(1, 2)                                 # (B, H, T, d_h)
        k = self.k_proj(x).view(b, t, h_kv, dh).transpose(1, 2)    # (B, H_kv, T, d_h)
        v = self.v_proj(x).view(b, t, h_kv, dh).transpose(1, 2)    # (B, H_kv, T, d_h)
        q_rot, k_rot = self.srpe(q, k, position_ids)  # SRPE on Q and K, one launch
        n_ctx = context.shape[2]
        fold = self.folds(context, t, x)
        if fold:
            kc, vc = q.new_zeros(b, h, 1, 0, dh), q.new_zeros(b, h, 1, 0, dh)  # two: see wiola_kernels.ops.distinct
        else:
            kc, vc = self.context_kv(context)  # (B, H, S, Λ', d_h) each
        if cache is not None and cache.get_seq_length(self.layer_idx) > 0:
            k_all, v_all = cache.update(k_rot, v, self.layer_idx)  # (B, H_kv, T_past + T, d_h)
            key_valid = layout.key_valid if layout is not None else None
            out = gcla_attention_cached(q_rot, k_all, v_all, q, kc, vc, self.gate, key_valid)
        else:
            if cache is not None:  # cached in the mask's layout (left-padded rows were shifted to compute)
                cache.update(*((layout.to_mask_layout(k_rot, 2), layout.to_mask_layout(v, 2))
                               if layout is not None else (k_rot, v)), self.layer_idx)
            out = wiola_kernels.gcla_attention(q_rot, k_rot, v, q, kc, vc, self.gate, lengths)  # (B, H, T, d_h)
        out = out.transpose(1, 2)  # (B, T, H, d_h)
        if fold:
            cross = folded_context_attention(q_bthd.reshape(b * t, h, dh), context.reshape(b * t, n_ctx, -1),
                                             self.kc_proj.weight, self.vc_proj.weight, self.gate).view(b, t, h, dh)
            if lengths is not None:  # rows past a length are exactly zero, as the attention op leaves them
                cross = cross * (torch.arange(t, device=x.device)[None, :] < lengths[:, None])[..., None, None]
            out = out + cross
        return self.o_proj(out.reshape(b, t, h * dh))  # (B, T, d)

    def forward_packed(self, rows: "PackedRows", x: Tensor, position_ids: Tensor, context: Tensor) -> Tensor:
        """GCLA of ATM-merged rows with the projections on the valid rows only (SPEC §6.2).

        ``x (N, d)``, ``position_ids (N,)`` and, with per-position summaries, ``context
        (N, Λ', d)`` hold the ``N = Σ_b T'_b`` merged tokens of all rows, packed (see
        :class:`PackedRows`); ``context (B, 1, Λ', d)`` for paper summaries. Returns the
        merged outputs ``A' (N, d)``. Q/K/V, SRPE, the context projections and ``W_O`` run
        on N rows instead of B·T; only the fused attention op sees the padded (B, ·, T, ·)
        layout, which it needs, and skips past each row's length. The same arithmetic per
        row as :meth:`forward` with ``lengths = T'``: packing only re-lays rows out."""
        n = x.shape[0]
        h, h_kv, dh = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_proj(x).view(1, n, h, dh).transpose(1, 2)        # (1, H, N, d_h)
        k = self.k_proj(x).view(1, n, h_kv, dh).transpose(1, 2)     # (1, H_kv, N, d_h)
        v = self.v_proj(x).view(n, h_kv, dh)
        q_rot, k_rot = self.srpe(q, k, position_ids[None])  # SRPE is per position
        if context.dim() == 3:  # per-position summaries, packed like x
            kc, vc = (rows.unpack(c[:, :, 0]).transpose(1, 2) for c in self.context_kv(context[:, None]))
        else:  # (B, 1, Λ', d): one context per row, nothing to pack
            kc, vc = self.context_kv(context)
        out = wiola_kernels.gcla_attention(
            rows.unpack_heads(q_rot[0]), rows.unpack_heads(k_rot[0]), rows.unpack_heads(v.transpose(0, 1)),
            rows.unpack_heads(q[0]), kc, vc, self.gate, rows.lengths)  # (B, H, T, d_h), zero past T'_b
        return self.o_proj(rows.pack_heads(out).reshape(n, h * dh))  # (N, d)


# ----------------------------------------------------------------------------------------
# DSFF: dual-stream feed-forward (SPEC §7)
# ----------------------------------------------------------------------------------------

class StackedLinear(torch.autograd.Function):
    """``x · [W_1; …; W_k]ᵀ`` as one GEMM while the weights stay separate Parameters (their
    own ``state_dict`` keys, optimizer state and decoding packs), returned in column groups.

    ``StackedLinear.apply(x, groups, *weights)``: ``groups`` says how many consecutive
    weights each output covers (DSFF: ``(2, 2)``, the narrow ``[W_n1; W_n3]`` and the wide
    ``[W_w1; W_w3]``); the outputs are column blocks of the one GEMM's result (views, no
    copy). Why a Function: ``F.linear(x, torch.cat(weights))`` would keep the stacked
    weight copy alive from the forward to the backward, and slicing its output would make
    autograd build a full-width zero-filled gradient per slice; here the stacked copy
    exists only while a GEMM runs and each group's gradient goes straight into its GEMMs.

    Under autocast the forward's GEMM runs in the autocast dtype; the backward's GEMMs run
    in the incoming gradients' dtype (what autocast's own ``linear`` backward does), and
    autograd casts each gradient to its input's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, groups: tuple[int, ...], *weights: Tensor):
        ctx.groups = groups
        ctx.save_for_backward(x, *weights)
        out = F.linear(x, torch.cat(weights))
        bounds, start = [], 0
        for size in groups:
            bounds.append(sum(w.shape[0] for w in weights[start:start + size]))
            start += size
        return tuple(out.split(bounds, dim=-1))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x, *weights = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        grad_x, grad_w, start = None, [], 0
        for size, grad in zip(ctx.groups, grads):
            group = weights[start:start + size]
            start += size
            if grad is None:
                grad_w += [None] * size
                continue
            g2 = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[0]:
                w = torch.cat(group).to(g2.dtype)
                grad_x = g2.matmul(w) if grad_x is None else grad_x.addmm_(g2, w)
            if any(ctx.needs_input_grad[2:]):
                grad_w += list(g2.t().matmul(x2.to(g2.dtype)).split([w.shape[0] for w in group]))
            else:
                grad_w += [None] * size
        if grad_x is not None:
            grad_x = grad_x.view(x.shape)
        return grad_x, None, *grad_w


class WiolaDSFF(nn.Module):
    """``σ(β) ⊙ W_n2(SiLU(W_n1 x) ⊙ W_n3 x) + (1 − σ(β)) ⊙ W_w2(GELU_tanh(W_w1 x) ⊙ W_w3 x)``.

    Computed as SPEC §10.2 folds it: one up projection ``u = x·[W_n1; W_n3; W_w1; W_w3]ᵀ``
    (:class:`StackedLinear`), :func:`wiola_kernels.glu` on each stream's half of ``u``
    read in place (``h_n = SiLU(u_n1) ⊙ u_n3``, ``h_w = GELU_tanh(u_w1) ⊙ u_w3``; the op
    saves only ``u`` and recomputes the activation in the backward), and the down
    projection with the blend folded into its weight,
    ``[diag(λ)W_n2 | diag(1−λ)W_w2]·[h_n; h_w]``, ``λ = σ(β)``. The down GEMM is split
    along its inner dimension (``h_w``'s product accumulated onto ``h_n``'s by ``addmm``)
    so that ``[h_n; h_w]`` is never concatenated. Equal to §7 in exact arithmetic; β's
    gradient flows through the fold (``∂β_i = λ_i(1−λ_i)·Σ_t g_ti (N_ti − W_ti)``, exact).
    The six weights and β stay separate Parameters under §7's names, so checkpoints,
    optimizer state and the decoding packs (decode.py) are unchanged.
    """

    #: False runs §7 term by term (reference DSFF: four up projections, two down and
    #: the blend, eager elementwise ops): the path the tests compare the fused one with.
    fused = True

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

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d) -> (B, T, d)
        if not self.fused:
            return dsff_reference(x, self.w_n1.weight, self.w_n3.weight, self.w_n2.weight, self.w_w1.weight,
                                  self.w_w3.weight, self.w_w2.weight, self.beta)
        if self._inference_applies(x):
            return self._inference(x)
        n = self.w_n1.out_features
        u_n, u_w = StackedLinear.apply(x, (2, 2), self.w_n1.weight, self.w_n3.weight, self.w_w1.weight,
                                       self.w_w3.weight)             # column blocks of one GEMM
        h_n = wiola_kernels.glu(u_n, activation="silu")              # (…, n)  packed [W_n1 x | W_n3 x]
        h_w = wiola_kernels.glu(u_w, activation="gelu_tanh")         # (…, w)  packed [W_w1 x | W_w3 x]
        lam = torch.sigmoid(self.beta)[:, None]                      # (d, 1)
        down_n = lam * self.w_n2.weight                              # diag(λ) W_n2      (d, n)
        down_w = (1.0 - lam) * self.w_w2.weight                      # diag(1 − λ) W_w2  (d, w)
        lead = h_n.shape[:-1]
        y = torch.addmm(F.linear(h_n.reshape(-1, n), down_n), h_w.reshape(-1, h_w.shape[-1]), down_w.t())
        return y.view(*lead, y.shape[-1])

    def _inference_applies(self, x: Tensor) -> bool:
        """No gradient wanted, one dtype throughout, no autocast: :meth:`_inference`."""
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return False
        return all(p.dtype == x.dtype for p in self.parameters()) and not torch.is_autocast_enabled(x.device.type)

    def _inference(self, x: Tensor) -> Tensor:
        """The same products with no gradient wanted (a prompt's forward, evaluation): each up
        projection writes its column block of ``u`` and the blend scales the two down
        projections' outputs, so no stacked (``(2n + 2w) × d``) or scaled (``d × (n + w)``)
        weight copy is made: 31 MiB per block of bf16 wiola-360m, made and freed block after
        block, which a prompt's forward left in a decoding process's resident set (glibc keeps
        freed memory). The blend rounds as the decoding step's (``torch.lerp``)."""
        weights = (self.w_n1.weight, self.w_n3.weight, self.w_w1.weight, self.w_w3.weight)
        x2 = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling():  # Dynamo traces no out= into a view; Inductor places the cat itself
            u = torch.cat([F.linear(x2, w) for w in weights], -1)
        else:
            u = x2.new_empty(x2.shape[0], sum(w.shape[0] for w in weights))
            start = 0
            for w in weights:
                torch.mm(x2, w.t(), out=u[:, start:start + w.shape[0]])
                start += w.shape[0]
        n = self.w_n1.out_features
        h_n = wiola_kernels.glu(u[:, :2 * n], activation="silu")
        h_w = wiola_kernels.glu(u[:, 2 * n:], activation="gelu_tanh")
        narrow = F.linear(h_n, self.w_n2.weight)
        y = torch.lerp(F.linear(h_w, self.w_w2.weight), narrow, torch.sigmoid(self.beta))  # W + λ(N − W)
        return y.view(*x.shape[:-1], y.shape[-1])


# ----------------------------------------------------------------------------------------
# One decoder layer (SPEC §2, one iteration of the loop)
# ----------------------------------------------------------------------------------------

class WiolaBlock(GradientCheckpointingLayer):
    #: Merged layers run the attention block's projections (Q/K/V/O, SRPE, the context
    #: projections) on the ``Σ_b T'_b`` merged tokens only (:class:`PackedRows`); False keeps
    #: the static ``(B, T, d)`` shapes of the ATM op throughout (the attention op alone skips
    #: the zero rows past ``T'_b``), which ``torch.compile`` / CUDA graphs prefer. Packing is
    #: a re-layout: results agree to rounding (tests/test_model_atm_packing.py).
    pack_merged = True

    def __init__(self, config: WiolaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.atm_threshold = float(config.atm_threshold)
        self.merges = bool(config.atm_enabled) and config.is_merge_layer(layer_idx)  # ATM here (training)
        self.attn_norm = WiolaRMSNorm(config.hidden_size, config.rms_norm_eps)  # WRMSNorm_ℓ
        self.attn = WiolaAttention(config, layer_idx)                            # GCLA_ℓ
        self.ffn_norm = WiolaRMSNorm(config.hidden_size, config.rms_norm_eps)   # WRMSNorm'_ℓ
        self.ffn = WiolaDSFF(config)                                            # DSFF_ℓ

    #: Every norm after a residual add runs with it as one :func:`wiola_kernels.add_rms_norm`
    #: (SPEC §10.3): ``WRMSNorm'_ℓ`` with ``X' = Xˡ + A``, and, when the caller passes
    #: ``next_norm``, the next layer's ``WRMSNorm_ℓ₊₁`` (or the final norm) with
    #: ``Xˡ⁺¹ = X' + F``. False adds and normalises separately (the path the tests compare with).
    fuse_add_norm = True

    def forward(self, x: Tensor, position_ids: Tensor, context: Tensor, normed: Tensor | None = None,
                lengths: Tensor | None = None, cache: WiolaCache | None = None, layout: "PaddingLayout | None" = None,
                next_norm: WiolaRMSNorm | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """``x (B, T, d)`` → ``Xˡ⁺¹ (B, T, d)``; ``context (B, S, Λ', d)``.

        ``normed``: ``WRMSNorm_ℓ(x)`` when the caller has it already (the previous block's
        ``next_norm`` output); computed here when None. ``next_norm``: the norm that reads
        ``Xˡ⁺¹`` next (the next layer's ``attn_norm`` or the final norm); the block then
        returns ``(Xˡ⁺¹, next_norm(Xˡ⁺¹))``, the residual add and that norm in one pass."""
        return self.sequence(x, lambda h: self.attend(h, position_ids, context, lengths, cache, layout), self.ffn,
                             normed, next_norm)

    def sequence(self, x: Tensor, attend: Callable[[Tensor], Tensor], ffn: Callable[[Tensor], Tensor],
                 normed: Tensor | None = None, next_norm: WiolaRMSNorm | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
        """The block (SPEC §2): ``X' = Xˡ + GCLA(WRMSNorm(Xˡ))``, ``Xˡ⁺¹ = X' + DSFF(WRMSNorm'(X'))``,
        with the two sublayers passed in: ``attend(X̃) → A`` and ``ffn(H) → F``, ``(B, T, d)``
        each. :meth:`forward` passes :meth:`attend` and the DSFF module; a cached decoding step
        (decode.py) passes its own products over the KV cache, so the norms, the residuals and
        their fusion are written here only. ``normed`` and ``next_norm`` as in :meth:`forward`."""
        h = self.attn_norm(x) if normed is None else normed  # X̃ (B, T, d)
        a = attend(h)                                  # A
        if not self.fuse_add_norm:
            x = x + a                                  # X'
            x = x + ffn(self.ffn_norm(x))              # Xˡ⁺¹
            return x if next_norm is None else (x, next_norm(x))
        hf, x = add_norm(a, x, self.ffn_norm)          # WRMSNorm'_ℓ(X'), X'
        f = ffn(hf)                                    # F
        if next_norm is None:
            return x + f                               # Xˡ⁺¹
        y, x = add_norm(f, x, next_norm)               # next_norm(Xˡ⁺¹), Xˡ⁺¹
        return x, y

    def attend(self, h: Tensor, position_ids: Tensor, context: Tensor, lengths: Tensor | None = None,
               cache: WiolaCache | None = None, layout: "PaddingLayout | None" = None) -> Tensor:
        """``A = GCLA_ℓ(X̃)`` of the normed input ``h (B, T, d)``: with ATM's merge around it
        when the block merges (training, no cache)."""
        if not (self.merges and self.training and cache is None):
            return self.attn(h, position_ids, context, lengths, cache, layout)
        # ATM (SPEC §6): merge similar neighbours, attend over the shorter rows, restore length T.
        merged, merged_pos, merged_len, index_map = wiola_kernels.atm_merge(h, position_ids, self.atm_threshold, lengths)
        if self.pack_merged:  # the attention block's projections skip the merged-away rows
            rows = PackedRows(merged_len, h.shape[1])
            if context.shape[1] > 1:  # causal summaries: each slot reads the context at its first member
                context = rows.pack(context, first_member(index_map))
            a = self.attn.forward_packed(rows, rows.pack(merged), rows.pack(merged_pos), context)  # (N, d)
            return rows.unmerge(a, index_map, lengths is not None)  # A_t = A'_{map(t)}, (B, T, d)
        # static shapes: only the attention op skips work past merged_len
        if context.shape[1] > 1:
            context = context.gather(1, first_member(index_map)[:, :, None, None].expand_as(context))
        a = self.attn(merged, merged_pos, context, merged_len)  # (B, T, d), zero past merged_len
        return wiola_kernels.atm_unmerge(a, index_map)  # A_t = A'_{map(t)}


def holds_its_weights(norm: WiolaRMSNorm, d: int) -> bool:
    """Whether another module's forward may read ``norm``'s parameters: not under FSDP, which
    keeps a module's parameters sharded (FSDP2: DTensors; FSDP1: flat, empty views) until
    that module's own forward gathers them. The block then leaves the next norm to its owner."""
    params = norm._parameters
    for name in ("weight", "shift"):
        p = params.get(name)
        if p is None:
            p = getattr(norm, name, None)  # not a registered Parameter (a parametrization, FSDP's views)
        if p is None:
            continue
        if p.shape != (d,):  # FSDP1's flat views
            return False
        # a plain Parameter holds a plain tensor (no .data: it makes a new tensor object,
        # and a decoding step asks for every norm)
        if type(p) is not nn.Parameter and (type(p).__name__ == "DTensor"
                                            or type(getattr(p, "data", p)).__name__ == "DTensor"):
            return False
    return True


def add_norm(update: Tensor, residual: Tensor, norm: WiolaRMSNorm) -> tuple[Tensor, Tensor]:
    """``(norm(residual + update), residual + update)`` in one pass (:func:`wiola_kernels.add_rms_norm`).

    Under autocast the update (a GEMM's output) is in the autocast dtype while the residual
    stream stays float32: both go in at the dtype ``residual + update`` would promote to, as
    in the unfused sum."""
    dtype = torch.promote_types(update.dtype, residual.dtype)
    return wiola_kernels.add_rms_norm(update.to(dtype), residual.to(dtype), norm.weight, norm.shift, norm.eps)


class PackedRows:
    """The valid merged rows of an ATM-merged batch, packed (SPEC §6.2: row ``b`` holds its
    ``T'_b`` merged tokens first and zeros after).

    ``pack`` gathers slots ``(b, s < T'_b)`` of a ``(B, T, …)`` tensor into ``(N, …)``,
    ``N = Σ_b T'_b``, row-major; ``unpack`` is its inverse, zeros past ``T'_b``;
    ``unpack_heads`` / ``pack_heads`` do the same between ``(H, N, d_h)`` / ``(N, H, d_h)``
    and the attention op's ``(B, H, T, d_h)``; ``unmerge`` restores length T from packed
    merged outputs. Finding the rows reads ``merged_len``
    (one device sync), which is why packing is the eager-mode choice."""

    def __init__(self, merged_len: Tensor, t: int):
        b = merged_len.shape[0]
        self.batch, self.t, self.lengths = b, t, merged_len
        valid = torch.arange(t, device=merged_len.device)[None, :] < merged_len[:, None]  # (B, T)
        self.index = valid.reshape(-1).nonzero().squeeze(1)           # (N,) flat b·T + s
        self.n = self.index.numel()
        self.offsets = merged_len.cumsum(0) - merged_len              # (B,) first packed row of b
        self.row_of, self.slot_of = self.index // t, self.index % t   # (N,) each packed row's (b, s)

    def pack(self, x: Tensor, slots: Tensor | None = None) -> Tensor:
        """``x (B, T, …)`` → ``(N, …)``; ``slots (B, T)`` reads slot ``(b, s)`` from
        ``x[b, slots[b, s]]`` instead (the gather is folded into the packing)."""
        flat = x.reshape(self.batch * self.t, *x.shape[2:])
        if slots is None:
            return flat.index_select(0, self.index)
        rows = torch.arange(self.batch, device=x.device)[:, None] * self.t
        return flat.index_select(0, (rows + slots).reshape(-1).index_select(0, self.index))

    def unpack(self, y: Tensor) -> Tensor:
        """``y (N, …)`` → ``(B, T, …)`` with zeros past each row's ``T'_b``."""
        full = y.new_zeros(self.batch * self.t, *y.shape[1:])
        return full.index_copy(0, self.index, y).view(self.batch, self.t, *y.shape[1:])

    def unpack_heads(self, y: Tensor) -> Tensor:
        """``y (H, N, d_h)`` → ``(B, H, T, d_h)``, contiguous (the attention op's layout),
        zeros past each row's ``T'_b``."""
        full = y.new_zeros(self.batch, y.shape[0], self.t, y.shape[2])
        full[self.row_of, :, self.slot_of] = y.transpose(0, 1)
        return full

    def pack_heads(self, x: Tensor) -> Tensor:
        """``x (B, H, T, d_h)`` → ``(N, H, d_h)``."""
        return x[self.row_of, :, self.slot_of]

    def unmerge(self, y: Tensor, index_map: Tensor, padded: bool = True) -> Tensor:
        """``A_t = A'_{map(t)}`` (SPEC §6.3) from packed ``y (N, d)``: ``(B, T, d)``; a token
        mapped past ``T'_b`` (padding, only when the merge had ``lengths``: say ``padded``)
        gets 0, as the attention op leaves that slot. Its backward sums the gradients of the
        tokens sharing a slot (SPEC §6.4)."""
        src = self.offsets[:, None] + index_map
        if padded:
            src = torch.where(index_map < self.lengths[:, None], src, self.n)  # row N: zeros
            y = torch.cat([y, y.new_zeros(1, y.shape[1])])
        return y.index_select(0, src.reshape(-1)).view(self.batch, self.t, y.shape[1])


def first_member(index_map: Tensor) -> Tensor:
    """``(B, T)`` slot → the first original position mapped to it (0 for empty slots)."""
    b, t = index_map.shape
    pos = torch.arange(t, device=index_map.device).expand(b, t)
    first = torch.zeros_like(index_map)
    return first.scatter_reduce(1, index_map, pos, reduce="amin", include_self=False)


# ----------------------------------------------------------------------------------------
# The model and the Hugging Face glue
# ----------------------------------------------------------------------------------------

class WiolaPreTrainedModel(PreTrainedModel):
    config_class = WiolaConfig
    config: WiolaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["WiolaBlock"]
    _supports_sdpa = False

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Hugging Face ``from_pretrained``, strict and safetensors only (SECURITY.md).

        * Weights are read from ``model.safetensors`` (or a sharded safetensors index),
          never from a pickle (``pytorch_model.bin``…): a directory holding only pickled
          weights is an ``OSError``, and ``use_safetensors=False`` a ``ValueError``.
        * Every parameter must be in the checkpoint with the model's shape, and every
          checkpoint tensor must be a parameter: a missing, unexpected or wrongly shaped
          tensor is a ``ValueError`` naming it (Hugging Face would warn and initialise it
          at random). ``ignore_mismatched_sizes=True`` is refused for the same reason.
        """
        check_load_kwargs(cls.__name__, kwargs)
        check_checkpoint_path(cls.__name__, pretrained_model_name_or_path, kwargs.get("subfolder") or "",
                              local_files_only=bool(kwargs.get("local_files_only")))
        refuse_pickle_only_directory(cls.__name__, pretrained_model_name_or_path, kwargs.get("subfolder") or "")
        want_info = kwargs.pop("output_loading_info", False)
        kwargs["use_safetensors"] = True
        kwargs["ignore_mismatched_sizes"] = True  # report mismatches in the loading info, refused just below
        with quiet_load_report():
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                  **kwargs)
        refuse_partial_load(cls.__name__, pretrained_model_name_or_path, info)
        portable_kernel_backend(cls.__name__, model.config, next(model.parameters()).device,
                                explicit="kernel_backend" in kwargs)
        return (model, info) if want_info else model

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, WiolaRMSNorm):
            init.ones_(module.weight)   # γ
            init.zeros_(module.shift)   # δ
        elif isinstance(module, WiolaAttention):
            init.constant_(module.gate, float(self.config.gcla_gate_init))
        elif isinstance(module, WiolaDSFF):
            init.zeros_(module.beta)


class WiolaModel(WiolaPreTrainedModel):
    """Embedding, L blocks with the summary context, final norm: hidden states ``(B, T, d)``."""

    def __init__(self, config: WiolaConfig):
        super().__init__(config)
        config.check()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # E
        self.layers = nn.ModuleList(WiolaBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = WiolaRMSNorm(config.hidden_size, config.rms_norm_eps)         # WRMSNorm_final
        self.gradient_checkpointing = False
        self._decode_weights: decode.DecodeWeights | None = None
        self.post_init()

    #: Cached decoding steps take decode.py's path: on the CPU in float32/bfloat16/float16 the
    #: GEMV kernel reading the parameters in place (no copy); elsewhere transposed copies of
    #: the widest matrices, built on the first step and freed by ``train()``. False decodes
    #: through the model's own modules.
    decode_packing = True

    def decode_weights(self) -> "decode.DecodeWeights | None":
        """The copies decoding steps read where the GEMV kernel does not apply (empty where it
        does; None when :attr:`decode_packing` is off)."""
        if not self.decode_packing:
            self._decode_weights = None
        elif self._decode_weights is None:
            self._decode_weights = decode.DecodeWeights()
        return self._decode_weights

    def release_decode_weights(self) -> None:
        """Free the copies decoding built (rebuilt by the next decoding step where needed)."""
        self._decode_weights = None

    def train(self, mode: bool = True):
        if mode:
            self.release_decode_weights()
        return super().train(mode)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Cache | None = None, inputs_embeds: Tensor | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, **kwargs) -> WiolaModelOutput:
        """Hidden states ``(B, T, d)`` after the final norm.

        ``attention_mask (B, past + T)``: 1 for real tokens, 0 for padding; rows may be
        left-padded (what generation uses) or right-padded, and each row's result equals the
        row run alone (positions count from its first real token unless ``position_ids``
        are given). ``output_hidden_states=True`` also returns the L + 1 hidden states
        (embeddings, each block's output, the last one after the final norm);
        ``output_attentions=True`` is refused: the fused attention never forms the matrix."""
        cfg = self.config
        check_output_flags(cfg, output_attentions)
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(cfg, "output_hidden_states", False))
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("WiolaModel: pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            check_input_ids(input_ids, cfg.vocab_size)
        elif not isinstance(inputs_embeds, Tensor) or inputs_embeds.dim() != 3 \
                or inputs_embeds.shape[-1] != cfg.hidden_size:
            raise ValueError(f"inputs_embeds must be a (B, T, hidden_size = {cfg.hidden_size}) tensor, got "
                             f"{tuple(inputs_embeds.shape) if isinstance(inputs_embeds, Tensor) else type(inputs_embeds).__name__}")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # X⁰ (B, T, d)
        b, t, _ = x.shape
        if use_cache is None:  # no cache while training by default (and ATM needs none)
            use_cache = cfg.use_cache and not self.training
        if use_cache and cache is None:
            cache = WiolaCache()
        if not use_cache:
            cache = None
        if cache is not None and not isinstance(cache, WiolaCache):
            raise TypeError(f"cache must be a WiolaCache (it carries the summary sums), got {type(cache).__name__}")
        past = cache.get_seq_length() if cache is not None else 0
        check_length(t, past, cfg.max_position_embeddings)
        if past > 0 and cfg.gcla_summary == "paper":
            raise ValueError("gcla_summary='paper': summaries are means over the whole sequence, so a KV cache "
                             "cannot reproduce the full forward; call with use_cache=False (generate() does)")
        check_attention_mask(attention_mask, b, past, t)
        layout = padding_layout(attention_mask, past, t, b, x.device, cache)
        lengths = layout.lengths if layout is not None else None
        if position_ids is None:
            position_ids = layout.default_positions(past, t) if layout is not None \
                else torch.arange(past, past + t, device=x.device)
        position_ids = position_ids.expand(b, t) if position_ids.dim() == 1 or position_ids.shape[0] == 1 \
            else position_ids  # (B, T)
        if layout is not None and layout.shift is not None:  # left padding: compute on right-padded rows
            x, position_ids = layout.to_compute_layout(x, 1), layout.to_compute_layout(position_ids, 1)
        hidden_states: list[Tensor] | None = [x] if output_hidden_states else None
        step = None  # a cached decoding step: blocks run on the packed weights (decode.py)
        if decode.applies(self, b, t, past, cache, x.requires_grad) \
                and decode.positions_ok(position_ids, cfg.srpe_spiral_divisor):
            # the fused block may keep the causal summaries where WiolaCache.summary would take its
            # one-step form (no padding now or before)
            summaries = cfg.gcla_lookback > 0 and cfg.gcla_summary == "causal" and layout is None \
                and cache.summary_counts is None
            step = decode.DecodeStep(self, position_ids, cache, layout.key_valid if layout is not None else None,
                                     self.decode_weights(), summaries)

        lookback = cfg.gcla_lookback
        summaries: list[Tensor] = []  # s⁽ˡ⁾, (B, S, d) each, oldest first
        normed = None  # WRMSNorm_ℓ(Xˡ) when the block before computed it with its residual add
        for i, layer in enumerate(self.layers):
            if summaries and lookback > 0:
                context = torch.stack(summaries[-lookback:], dim=2)  # Cˡ (B, S, Λ', d)
            else:
                context = x.new_zeros(b, 1, 0, x.shape[-1])           # no earlier layers: plain attention
            # the block also returns the next norm of its output (the add and norm fused)
            next_norm = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            if not holds_its_weights(next_norm, x.shape[-1]):
                next_norm = None
            if step is not None:  # the block's sequence with the step's products
                out = step.block(layer, x, context, normed, next_norm)
            else:
                out = layer(x, position_ids, context, normed, lengths=lengths, cache=cache, layout=layout,
                            next_norm=next_norm)
            x, normed = out if isinstance(out, tuple) else (out, None)
            if hidden_states is not None and i < len(self.layers) - 1:
                hidden_states.append(x)
            if lookback > 0 and i < len(self.layers) - 1:  # the last layer's summary is never read
                if cache is not None and cfg.gcla_summary == "causal":
                    summary = step.summary_of(i) if step is not None else None
                    summaries.append(summary if summary is not None else
                                     cache.summary(i, x, past, layout.summary_valid if layout is not None else None))
                else:
                    acc = compute_dtype(x.dtype)  # summed in float32 (float64 models: 64)
                    summaries.append(gcla_summary(x.to(acc), cfg.gcla_summary, lengths).to(x.dtype))
                summaries = summaries[-lookback:]
        if cache is not None:
            cache.advance(layout.new_valid if layout is not None else None, past)
        x = self.norm(x) if normed is None else normed  # WRMSNorm_final(Xᴸ)
        if hidden_states is not None:
            hidden_states.append(x)  # Hugging Face convention: the last entry is after the final norm
        if layout is not None and layout.shift is not None:
            x = layout.to_mask_layout(x, 1)
            hidden_states = None if hidden_states is None else [layout.to_mask_layout(h, 1) for h in hidden_states]
        return WiolaModelOutput(last_hidden_state=x, cache=cache,
                                hidden_states=None if hidden_states is None else tuple(hidden_states))


def check_input_ids(input_ids: object, vocab_size: int) -> None:
    """``input_ids`` must be an integer ``(B, T)`` tensor of ids in ``[0, vocab_size)``: an
    out-of-range id would otherwise be an IndexError on the CPU and a device assert on CUDA."""
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (B, T), got {tuple(input_ids.shape)}")
    if input_ids.numel() and not torch.compiler.is_compiling():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"input_ids must lie in [0, vocab_size) = [0, {vocab_size}), got values in [{lo}, {hi}]")


def check_attention_mask(attention_mask: object, b: int, past: int, t: int) -> None:
    """``attention_mask`` is None or a ``(B, past + T)`` tensor (Hugging Face passes the
    whole sequence's mask while decoding; ``(B, T)`` is accepted too). A mask of another
    length is refused here, naming the mask, rather than later as bad ``lengths``."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    allowed = sorted({t, past + t})
    if attention_mask.dim() != 2 or attention_mask.shape[0] != b or attention_mask.shape[1] not in allowed:
        want = " or ".join(f"({b}, {n})" for n in allowed)
        raise ValueError(f"attention_mask must have shape (B, cached + T) = {want}, one entry per position of "
                         f"input_ids, got {tuple(attention_mask.shape)}")


def check_labels(labels: object, shape: tuple[int, int]) -> None:
    """``labels`` must be an integer ``(B, T)`` tensor like ``input_ids`` (−100 ignored)."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (token ids, -100 to ignore), got {labels.dtype}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"labels must have the shape of input_ids (B, T) = {tuple(shape)}, got {tuple(labels.shape)}")


def check_length(t: int, past: int, max_positions: int) -> None:
    """A forward needs ``T ≥ 1`` new positions and ``past + T ≤ max_position_embeddings``.

    Why a hard cap rather than a warning: SRPE has no position table, so nothing breaks past
    the limit (it stays accurate up to ``wiola_kernels.ops.srpe.max_accurate_position``,
    about 2^35), but the SPEC black-box contract refuses such inputs and a model's quality
    beyond its training length is unknown. The cap is a config field and no weight depends
    on it: ``model.config.max_position_embeddings = N`` runs longer sequences knowingly."""
    if t == 0:
        raise ValueError("input_ids is empty (T = 0): a forward needs at least one position")
    if past + t > max_positions:
        raise ValueError(f"sequence too long: {past} cached + {t} new positions exceed "
                         f"max_position_embeddings = {max_positions} (no weight depends on it: raise "
                         "config.max_position_embeddings to run longer sequences knowingly)")


def check_prompt_rank(prompt: object, inputs_embeds: bool = False) -> None:
    """A ``generate`` prompt is a batch: ``(B, T)`` ids (``(B, T, d)`` embeddings). A 1-D
    prompt would die deep inside Hugging Face with an IndexError."""
    if not isinstance(prompt, Tensor):
        return
    want = 3 if inputs_embeds else 2
    if prompt.dim() != want:
        name, layout = ("inputs_embeds", "(B, T, d)") if inputs_embeds else ("input_ids", "(B, T)")
        fix = "; for one sequence pass ids[None] (or ids.unsqueeze(0))" if prompt.dim() == want - 1 else ""
        raise ValueError(f"generate: the prompt ({name}) must have shape {layout}, got {tuple(prompt.shape)}{fix}")


class PaddingLayout:
    """How a padded batch is laid out for one forward (built by :func:`padding_layout`).

    Prefill (empty cache): every row's real tokens form one run ``[start_b, start_b + len_b)``
    of the mask. Left-padded rows are rotated so that the run starts at 0
    (``to_compute_layout``), the layers run on right-padded rows with per-row ``lengths``
    (the fused attention skips the padding), and outputs and cached keys are rotated back
    (``to_mask_layout``). Decoding (non-empty cache): no rotation; ``key_valid`` masks
    the padded cached keys.

    Attributes: ``lengths (B,)`` real tokens per row for the fused op (prefill only);
    ``shift (B,)`` the rotation (None when no row is left-padded); ``key_valid (B, past + T)``
    bool in the mask's layout; ``new_valid (B, T)`` the new positions' mask (mask layout,
    what the cache records); ``summary_valid (B, T)`` the same in the compute layout.
    """

    def __init__(self, key_valid: Tensor, past: int, lengths: Tensor | None = None, shift: Tensor | None = None):
        self.key_valid, self.lengths, self.shift = key_valid, lengths, shift
        self.new_valid = key_valid[:, past:]
        t = self.new_valid.shape[1]
        self.summary_valid = self.new_valid if lengths is None \
            else torch.arange(t, device=key_valid.device)[None, :] < lengths[:, None]

    def _rotate(self, x: Tensor, dim: int, sign: int) -> Tensor:
        t = x.shape[dim]
        idx = (torch.arange(t, device=x.device)[None, :] + sign * self.shift[:, None]) % t  # (B, T)
        shape = [x.shape[0]] + [1] * (x.dim() - 1)
        shape[dim] = t
        return x.gather(dim, idx.view(shape).expand(x.shape))

    def to_compute_layout(self, x: Tensor, dim: int) -> Tensor:
        """Row ``b`` of ``x`` (sequence along ``dim``) rotated left by ``shift_b``: real tokens first."""
        return x if self.shift is None else self._rotate(x, dim, +1)

    def to_mask_layout(self, x: Tensor, dim: int) -> Tensor:
        """Inverse of :meth:`to_compute_layout`."""
        return x if self.shift is None else self._rotate(x, dim, -1)

    def default_positions(self, past: int, t: int) -> Tensor:
        """Position ids when none are given, as Hugging Face derives them from the mask: each
        real token's index among its row's real tokens (pads: 0), in the mask's layout."""
        return (self.key_valid.long().cumsum(1) - 1).clamp(min=0)[:, past:]


def padding_layout(attention_mask: Tensor | None, past: int, t: int, batch: int, device: torch.device,
                   cache: "WiolaCache | None") -> PaddingLayout | None:
    """The :class:`PaddingLayout` of a forward over ``t`` new positions after ``past`` cached
    ones; None when nothing (mask or cache) is padded.

    ``attention_mask`` is ``(B, past + T)`` of 0/1 (Hugging Face's convention; an all-ones
    mask of another width is accepted as "no padding"). A cache built from a padded batch
    needs the mask on every later call (``ValueError`` otherwise: without it the pads would
    silently become keys), and the mask's first ``past`` columns must be the cache's own.
    """
    cached_valid = cache.key_valid if cache is not None and past > 0 else None
    if attention_mask is None:
        if cached_valid is not None:
            raise ValueError("attention_mask is required: this cache was built from a padded batch, so every later "
                             f"call must pass the same mask extended by the new positions, shape ({batch}, "
                             f"{past + t}); without it the padded positions would be attended to")
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be a (B, past + T) tensor of 0/1, got "
                         f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__}")
    mask = attention_mask.to(device=device).bool()
    if cached_valid is None and bool(mask.all()):
        return None
    if tuple(mask.shape) != (batch, past + t):
        raise ValueError(f"attention_mask must have shape (B, past + T) = ({batch}, {past} + {t}), got "
                         f"{tuple(mask.shape)}")
    if past > 0:
        before = cached_valid if cached_valid is not None else torch.ones_like(mask[:, :past])
        if not torch.equal(mask[:, :past], before):
            raise ValueError(f"attention_mask: its first {past} columns differ from the padding the cache was "
                             "built with; pass the mask of the whole sequence so far")
        return PaddingLayout(mask, past)
    lengths = mask.sum(1)
    start = mask.int().argmax(1)  # first real token (0 for an empty row)
    cols = torch.arange(t, device=device)[None, :]
    if not torch.equal(mask, (cols >= start[:, None]) & (cols < (start + lengths)[:, None])):
        raise ValueError("attention_mask: each row's real tokens (ones) must be contiguous: left padding, right "
                         "padding or both, not a hole in the middle")
    return PaddingLayout(mask, 0, lengths, start if bool(start.any()) else None)


def check_generation_padding(attention_mask: object) -> None:
    """``generate`` continues every row after its last column, so a right-padded row would
    continue from a pad: refused with a ``ValueError`` (pad on the left for generation)."""
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 and attention_mask.numel():
        mask = attention_mask.bool()
        if bool((~mask[:, -1] & mask.any(1)).any()):
            raise ValueError("generate: attention_mask is right-padded (a row ends in padding), so generation would "
                             "continue from a pad token; pad prompts on the left (tokenizer.padding_side = 'left')")


def check_output_flags(config: WiolaConfig, output_attentions: bool | None) -> None:
    """``output_attentions=True`` (argument or config) is a ``ValueError``: the fused GCLA op
    never forms the attention matrix."""
    if output_attentions is None:
        output_attentions = bool(getattr(config, "output_attentions", False))
    if output_attentions:
        raise ValueError("output_attentions=True is not supported: Wiola's fused attention never forms the T×T "
                         "attention matrix (use output_hidden_states=True for per-layer activations)")


def backend_scope(name: str) -> contextlib.AbstractContextManager:
    """``wiola_kernels.use_backend(name)``; ``"auto"`` adds no override, so the ops choose
    per device and a process-wide ``WIOLA_BACKEND`` still applies."""
    return contextlib.nullcontext() if name == "auto" else wiola_kernels.use_backend(name)


class WiolaForCausalLM(WiolaPreTrainedModel, GenerationMixin):
    """Wiola decoder with the tied language-model head; next-token loss when ``labels`` are given."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: WiolaConfig):
        super().__init__(config)
        self.model = WiolaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # Eᵀ, tied
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def kernel_backend(self) -> contextlib.AbstractContextManager:
        """:func:`backend_scope` of ``config.kernel_backend`` (the forward enters it itself;
        backward kernels follow the forward's choice without it)."""
        return backend_scope(self.config.kernel_backend)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Cache | None = None,
                inputs_embeds: Tensor | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_logits: bool = False,
                **kwargs) -> WiolaCausalLMOutput:
        """``input_ids (B, T)`` → ``logits (B, T, V)``; ``labels (B, T)`` (−100 ignored) are
        shifted inside, like Hugging Face causal LMs.

        With ``labels``, the loss goes through :func:`wiola_kernels.linear_cross_entropy` on
        the last hidden states and the tied head: the ``(B, T, V)`` logits are never
        materialised (at a 32k vocabulary they, their log-softmax and their gradient are most
        of a training step's memory), and ``logits`` is None. ``return_logits=True`` keeps
        them: the head runs as without labels and the loss is ``F.cross_entropy`` of those
        logits (the unfused path, equal within SPEC §9 tolerances). Without ``labels`` the
        flag changes nothing."""
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if self._one_call_step(input_ids, attention_mask, cache, labels, inputs_embeds, use_cache,
                               output_hidden_states, output_attentions):
            # a cached decoding step without padding: the whole model in one C++ call (decode.py)
            logits = decode.fused_step(self.model, self.lm_head.weight, input_ids, position_ids, cache)
            if logits is not None:
                return WiolaCausalLMOutput(logits=logits, cache=cache)
        ids = input_ids if input_ids is not None else inputs_embeds
        past = cache.get_seq_length() if isinstance(cache, WiolaCache) else 0
        packed_head = isinstance(ids, Tensor) and ids.dim() >= 2 and self.model.decode_packing \
            and use_cache is not False and decode.applies(self.model, ids.shape[0], ids.shape[1], past, cache,
                               inputs_embeds is not None and inputs_embeds.requires_grad)
        with self.kernel_backend():
            out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_hidden_states=output_hidden_states, output_attentions=output_attentions)
            hidden = out.last_hidden_state                                   # (B, T, d)
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            logits = loss = None
            if labels is not None:
                check_labels(labels, (input_ids if input_ids is not None else inputs_embeds).shape[:2])
                targets = labels[:, 1:].to(hidden.device)
            if labels is not None and not return_logits:
                # Position t predicts token t + 1: the last position has no target.
                h, E = hidden[:, :-1], self.lm_head.weight
                if torch.is_autocast_enabled(h.device.type):  # as autocast runs the head's F.linear
                    dt = torch.get_autocast_dtype(h.device.type)
                    h, E = h.to(dt), E.to(dt)
                loss = wiola_kernels.linear_cross_entropy(h, E.to(h.dtype), targets, ignore_index=-100)
            elif packed_head:  # E on the GEMV kernel, or from a transposed copy (decode.py)
                logits = self.model.decode_weights().logits(hidden, self.lm_head.weight)
            else:
                logits = self.lm_head(hidden)                                # (B, T, V)
        if logits is not None and labels is not None:
            loss = F.cross_entropy(logits[:, :-1].to(compute_dtype(logits.dtype)).reshape(-1, logits.shape[-1]),
                                   targets.reshape(-1), ignore_index=-100)
        return WiolaCausalLMOutput(loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states)

    def _one_call_step(self, input_ids, attention_mask, cache, labels, inputs_embeds, use_cache,
                       output_hidden_states, output_attentions) -> bool:
        """Whether a forward's arguments ask for nothing but the next logits of one new token per
        row after a cache with no padding: what :func:`decode.fused_step` may compute (it
        checks the model and the cache). Anything else — and any argument the forward would
        refuse — takes the forward's own path."""
        cfg = self.config
        if torch.compiler.is_compiling():  # a graph traces the model's own path (decode.applies)
            return False
        if labels is not None or inputs_embeds is not None or use_cache is False or not isinstance(cache, WiolaCache) \
                or not self.model.decode_packing or output_attentions or output_hidden_states \
                or getattr(cfg, "output_hidden_states", False) or getattr(cfg, "output_attentions", False):
            return False
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] != 1 \
                or input_ids.dtype != torch.int64 or not input_ids.is_cpu:
            return False
        if attention_mask is None:
            return True
        # Hugging Face passes the whole sequence's mask; all ones is no padding
        return isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 \
            and attention_mask.shape[0] == input_ids.shape[0] \
            and attention_mask.shape[1] in (1, cache.get_seq_length() + 1) and bool(attention_mask.all())

    # -- generation --------------------------------------------------------------------

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_KWARG)
        if cache is not None and not isinstance(cache, WiolaCache) and cache.get_seq_length() == 0:
            model_kwargs[CACHE_KWARG] = WiolaCache()  # carries the summary sums as well as K and V

    def generate(self, inputs: Tensor | None = None, *args, **kwargs):
        """Hugging Face ``generate``. With ``gcla_summary="paper"`` the cache is turned off
        (cached decoding cannot match a full forward there) and every step recomputes the
        whole sequence.

        Lengths: the prompt must have at least one token, and the whole sequence — prompt
        plus ``max_new_tokens`` (or ``max_length``) — must fit in
        ``config.max_position_embeddings``. Otherwise a ``ValueError`` is raised before
        anything is computed (an empty prompt, ``(B, 0)``, has no position to continue
        from; an empty prompt is not replaced by ``bos_token_id``)."""
        prompt = next((x for x in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if x is not None),
                      None)
        check_prompt_rank(prompt, inputs_embeds=prompt is kwargs.get("inputs_embeds"))
        if isinstance(prompt, Tensor) and prompt.dim() >= 2:
            if prompt.shape[1] == 0:
                raise ValueError(f"generate: the prompt is empty (shape {tuple(prompt.shape)}); pass at least one "
                                 f"token, e.g. bos_token_id = {self.config.bos_token_id}")
            if prompt.shape[1] > self.config.max_position_embeddings:
                raise ValueError(f"generate: the prompt has {prompt.shape[1]} tokens, more than "
                                 f"max_position_embeddings = {self.config.max_position_embeddings}")
        check_generation_padding(kwargs.get("attention_mask"))
        if self.config.gcla_summary == "paper":
            kwargs["use_cache"] = False
        return super().generate(inputs, *args, **kwargs)

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length):
        # Hugging Face hook, called once max_length = prompt + max_new_tokens is known.
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        limit = self.config.max_position_embeddings
        if generation_config.max_length > limit:
            raise ValueError(f"generate: prompt ({input_ids_length} tokens) + new tokens = "
                             f"{generation_config.max_length} positions exceed max_position_embeddings = {limit}; "
                             f"lower max_new_tokens to at most {max(limit - input_ids_length, 0)}")


__all__ = ["WiolaCache", "backend_scope", "check_length", "WiolaForCausalLM", "WiolaModel", "WiolaPreTrainedModel"]
