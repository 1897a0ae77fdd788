"""Cached decoding steps: the same maths as the model's forward, laid out for
batch-1 GEMVs on the CPU.

At batch 1 a decoding step is a chain of matrix-vector products; its cost is reading every
weight once. On the CPU in float32, bfloat16 or float16 (with the C++ extension) every
product of a step runs on :func:`wiola_kernels.decode_gemv.gemv`, which streams the
parameters themselves — ``nn.Linear``'s ``(n, d)`` rows, one contiguous stretch per thread
— so decoding holds no copy of the weights: memory stays at the parameters plus the KV
cache, training and ``state_dict`` see ordinary Parameters, and an in-place change of a
weight (an optimizer step, ``load_state_dict``) is read by the next step as it is. A block
is five kernel calls, each one parallel region over its weights: ``W_Q|W_K|W_V``, the
context projections ``W_Kc|W_Vc`` of the context slots, ``W_O``, ``W_n1|W_n3|W_w1|W_w3``, and
``W_n2|W_w2`` each on its own stream's activations; the tied head is one more. bfloat16 and
float16 weights are widened in registers (the kernel reads half the bytes of float32), the
activations keep the model's dtype between the products, as the model's forward does.

A step runs each block's own sequence, :meth:`WiolaBlock.sequence
<wiola.modeling_wiola.WiolaBlock.sequence>` (the norms, the residual adds and their fusion
with the next norm, as in training), with :class:`DecodeStep`'s attention over the cache and
its DSFF products as the two sublayers: only the products are laid out differently here.
Where each row adds one unpadded position to a :class:`GrowingKV` cache on the GEMV kernel,
the block's attention is one call (:func:`wiola_kernels.decode_attention.decode_attention`:
SRPE, the cache append, the softmax over the cache and the context slots), and with the
add-and-norm fusion on the whole block is one call
(:func:`wiola_kernels.decode_block.decode_block`: the GEMVs and the attention from C++, the
work between them as loops with the Python sequence's roundings, and the layer's running
causal summary): at batch 1 the interpreter and dispatch time of ~30 small ops per block was a
fifth of a bf16 step.

The context sub-attention (SPEC §5.3) is taken unfolded here: the ``Λ'`` context slots go
through ``W_Kc`` and ``W_Vc`` as rows of one product (``Λ' ≤ 2`` by default, so one read of
each matrix, as the folded form of :mod:`wiola.context_fold` costs), which needs no
per-head transposed or pre-scaled matrix; the gate and ``1/√d_h`` are applied to the small
results.

Elsewhere (CUDA, float64, no extension) :class:`_Packed` keeps the layouts MKL streams
fastest: ``W_Q | W_K | W_V`` and ``W_n1 | W_n3 | W_w1 | W_w3`` as transposed ``(d, Σ n_i)``
copies and the tied head as ``(d, V)``; ``W_O``, ``W_n2``, ``W_w2`` and the context matrices
are read in place. :class:`DecodeWeights` holds those copies: built on the first cached
decoding step without gradients, checked against the parameters' identity and version
counters on every step (an optimizer step, ``load_state_dict`` or ``.to()`` rebuilds them),
and dropped by ``model.train()`` or :meth:`WiolaForCausalLM.release_decode_weights`. Set
``WiolaModel.decode_packing = False`` to decode through the model's own modules.

:class:`GrowingKV` is the cache layer: keys and values are written into a buffer with spare
capacity (doubling), instead of ``torch.cat`` copying the whole cache on every token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from wiola_kernels import decode_attention, decode_block, decode_gemv, decode_step, dispatch, glu
from wiola_kernels import SpiralRotaryEmbedding
from wiola_kernels.dtypes import compute_dtype
from wiola_kernels.validation import srpe_max_position

from .context_fold import folded_context_attention

#: Decoding steps with at most this many new positions (× batch) use the packed weights;
#: a longer chunk after a cache is a prefill and takes the fused attention path.
MAX_STEP_POSITIONS = 16


class GrowingKV(DynamicLayer):
    """A :class:`~transformers.cache_utils.DynamicLayer` whose ``keys`` / ``values`` are views
    of buffers with spare capacity along the sequence, so appending ``T_new`` positions
    copies ``T_new`` positions (``DynamicLayer`` concatenates, copying the whole cache).

    Hugging Face's cache methods that replace ``keys`` (beam reordering, repeats) leave
    views of other storage; the next update notices and re-seeds the buffer from them.
    ``crop`` slices the view, which the next update simply overwrites past."""

    _min_capacity = 256
    # (keys, values, end) as appended() last set them: while keys and values are still those
    # views, the buffers back them and append_buffers needs no other check (a decoding step
    # asks once per layer, and the full checks cost more than a small op).
    _views: tuple[Tensor, Tensor, int] | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf = self._vbuf = None
        self._views = None

    @staticmethod
    def _fits(buf: Tensor | None, cur: Tensor, new: Tensor | None) -> bool:
        """Whether ``buf`` still backs ``cur`` and has room after it for ``new`` (None: one
        more position of ``cur``'s shape)."""
        if buf is None or cur.dim() != 4 or cur.data_ptr() != buf.data_ptr() or cur.stride() != buf.stride():
            return False
        new = cur if new is None else new
        n_new = 1 if new is cur else new.shape[2]
        return (buf.dtype == new.dtype and buf.shape[0] == new.shape[0] and buf.shape[1] == new.shape[1]
                and buf.shape[3] == new.shape[3] and cur.shape[2] + n_new <= buf.shape[2])

    @staticmethod
    def _grow(cur: Tensor, new: Tensor, capacity: int) -> Tensor:
        b, h, _, dh = new.shape
        buf = new.new_empty(b, h, capacity, dh)
        if cur.dim() == 4 and cur.shape[2]:
            buf[:, :, :cur.shape[2]].copy_(cur)
        return buf

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append ``(B, H_kv, T_new, d_h)`` keys and values; returns every cached key and value."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past = self.keys.shape[2] if self.keys.dim() == 4 else 0
        end = past + key_states.shape[2]
        if not (self._fits(self._kbuf, self.keys, key_states) and self._fits(self._vbuf, self.values, value_states)):
            capacity = max(2 * end, self._min_capacity)
            self._kbuf = self._grow(self.keys, key_states, capacity)
            self._vbuf = self._grow(self.values, value_states, capacity)
        self._kbuf.narrow(2, past, end - past).copy_(key_states)
        self._vbuf.narrow(2, past, end - past).copy_(value_states)
        self.appended(end)
        return self.keys, self.values

    def append_buffers(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype
                       ) -> tuple[Tensor, Tensor, int] | None:
        """``(key buffer, value buffer, past)``: the ``(B, H_kv, capacity, d_h)`` buffers, with
        room for one more position at index ``past``, for a kernel that writes the new key and
        value itself (:func:`wiola_kernels.decode_attention.decode_attention`); call
        :meth:`appended` ``(past + 1)`` after it. None where this layer holds no cache yet or
        one of another shape or dtype (the caller then uses :meth:`update`)."""
        views = self._views
        if views is not None and views[0] is self.keys and views[1] is self.values:
            kb, vb, past = self._kbuf, self._vbuf, views[2]
            if past < kb.shape[2] and kb.dtype == dtype and vb.dtype == dtype and kb.shape == vb.shape \
                    and kb.shape[0] == batch and kb.shape[1] == heads and kb.shape[3] == head_dim:
                return kb, vb, past
        if not self.is_initialized or self.keys.dim() != 4:
            return None
        k = self.keys
        if k.dtype != dtype or k.shape[0] != batch or k.shape[1] != heads or k.shape[3] != head_dim \
                or self.values.shape != k.shape or self.values.dtype != dtype:
            return None
        past = k.shape[2]
        if not (self._fits(self._kbuf, k, None) and self._fits(self._vbuf, self.values, None)):
            capacity = max(2 * (past + 1), self._min_capacity)
            self._kbuf = self._grow(k, k, capacity)
            self._vbuf = self._grow(self.values, self.values, capacity)
        return self._kbuf, self._vbuf, past

    def appended(self, end: int) -> None:
        """The cache now holds the buffers' first ``end`` positions."""
        self.keys, self.values = self._kbuf.narrow(2, 0, end), self._vbuf.narrow(2, 0, end)
        self._views = (self.keys, self.values, end)


def cached_attention(q_rot: Tensor, k_rot: Tensor, v: Tensor, key_valid: Tensor | None = None) -> Tensor:
    """Causal self-attention of ``T_new`` queries against ``T_k ≥ T_new`` cached keys (SPEC
    §5.2; the last ``T_new`` keys are the queries' own positions), in the accumulation dtype.

    ``q_rot (B, H, T_new, d_h)``, ``k_rot, v (B, H_kv, T_k, d_h)``; ``key_valid (B, T_k)``
    bool masks padded keys (a query with no real key at or before it gets 0). Head ``h``
    reads group ``h mod H_kv``: the heads of one group are gathered into one batched product
    (queries viewed ``(B, H_kv, H/H_kv · T_new, d_h)``), so the cache is never repeated.
    Returns ``(B, H, T_new, d_h)``.
    """
    b, h, t_new, dh = q_rot.shape
    h_kv, t_k = k_rot.shape[1], k_rot.shape[2]
    r = h // h_kv
    acc = compute_dtype(q_rot.dtype)
    # h = r·H_kv + g  →  (B, H_kv, R·T_new, d_h), rows ordered (r, t)
    q = q_rot.to(acc).reshape(b, r, h_kv, t_new, dh).transpose(1, 2).reshape(b, h_kv, r * t_new, dh)
    if t_new == 1 and key_valid is None:
        # One query per row at the last position sees every key: no mask, and SDPA does the
        # three steps in one call (measured, 16 heads × 130 keys, 1 thread: 30 → 16 µs).
        out = F.scaled_dot_product_attention(q, k_rot.to(acc), v.to(acc))                  # (B, H_kv, R, d_h)
        return out.view(b, h_kv, r, 1, dh).transpose(1, 2).reshape(b, h, 1, dh)
    scores = (q @ k_rot.to(acc).transpose(-1, -2)) * (1.0 / math.sqrt(dh))  # (B, H_kv, R·T_new, T_k)
    allowed = None
    if t_new > 1:
        q_pos = torch.arange(t_k - t_new, t_k, device=q.device).repeat(r)                    # (R·T_new,)
        allowed = torch.arange(t_k, device=q.device)[None, :] <= q_pos[:, None]            # (R·T_new, T_k)
    if key_valid is not None:
        kv = key_valid[:, None, None, :]                                                   # (B, 1, 1, T_k)
        allowed = kv if allowed is None else allowed[None, None] & kv
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if key_valid is not None:  # a padded query before any real key: no key at all, output 0 (no NaN)
        any_key = allowed.any(-1, keepdim=True)
        p = torch.softmax(scores.masked_fill(~any_key, 0.0), -1) * any_key
    else:
        p = torch.softmax(scores, -1)
    out = p @ v.to(acc)                                                                    # (B, H_kv, R·T_new, d_h)
    return out.view(b, h_kv, r, t_new, dh).transpose(1, 2).reshape(b, h, t_new, dh)


def _source_key(params: tuple[Tensor, ...]) -> tuple:
    return tuple((id(p), p.data_ptr(), p._version, p.dtype, p.device) for p in params)


class _Packed:
    """One packed, transposed copy of some ``(n_i, d)`` weights: ``(d, Σ n_i)`` contiguous."""

    def __init__(self, *weights: Tensor):
        self.sources = weights
        self.key = _source_key(weights)
        self.t = torch.cat([w.detach() for w in weights], 0).t().contiguous()
        self.splits = [w.shape[0] for w in weights]

    def fresh(self) -> bool:
        return self.key == _source_key(self.sources)


def gemv_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decoding steps of a ``dtype`` model on ``device`` run on the GEMV kernel
    (CPU float32/bfloat16/float16 with the C++ extension); otherwise they use the MKL
    layouts of :class:`_Packed`."""
    return decode_gemv.applies(dtype, device)


class DecodeWeights:
    """The transposed copies (:class:`_Packed`) decoding steps read where the GEMV kernel does
    not apply (see the module docstring), built lazily. On the GEMV path it stays empty."""

    def __init__(self):
        self.blocks: dict[int, tuple[_Packed, _Packed]] = {}
        self.head: _Packed | None = None

    def block(self, block) -> tuple[_Packed, _Packed]:
        """``(W_Q|W_K|W_V, W_n1|W_n3|W_w1|W_w3)`` of ``block``, rebuilt when a source changed."""
        got = self.blocks.get(block.layer_idx)
        if got is None or not (got[0].fresh() and got[1].fresh()):
            a, f = block.attn, block.ffn
            got = (_Packed(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                   _Packed(f.w_n1.weight, f.w_n3.weight, f.w_w1.weight, f.w_w3.weight))
            self.blocks[block.layer_idx] = got
        return got

    def lm_head(self, weight: Tensor) -> _Packed:
        if self.head is None or self.head.sources[0] is not weight or not self.head.fresh():
            self.head = _Packed(weight)
        return self.head

    def logits(self, hidden: Tensor, weight: Tensor) -> Tensor:
        """``hidden (B, T, d) @ weightᵀ`` (the tied head ``weight (V, d)``): on the GEMV kernel
        from ``weight`` itself where it applies, else from the packed copy."""
        if gemv_applies(weight.dtype, weight.device) and hidden.dtype == weight.dtype \
                and hidden.shape[:-1].numel() <= decode_gemv.MAX_ROWS:
            return decode_gemv.gemv(hidden, weight)
        return hidden @ self.lm_head(weight).t


def _gemv_rows(x: Tensor, weights: list[Tensor]) -> Tensor:
    """:func:`~wiola_kernels.decode_gemv.gemv` of ``x (N, k)`` for any N, in chunks of at most
    ``MAX_ROWS`` rows (each chunk reads the weights once more)."""
    step = decode_gemv.MAX_ROWS
    if x.shape[0] <= step:
        return decode_gemv.gemv(x, weights)
    return torch.cat([decode_gemv.gemv(x[i:i + step], weights) for i in range(0, x.shape[0], step)])


class DecodeStep:
    """One cached decoding forward's shared state (the position ids, the cache, the padding
    mask of the keys and the packed weights) and its two sublayers for
    :meth:`WiolaBlock.sequence <wiola.modeling_wiola.WiolaBlock.sequence>`: the attention over
    the cache and the DSFF, each a few products on the GEMV kernel (or on the packed copies /
    the modules where it does not apply). The norms, residual adds and their fusion are the
    block's own. RMSNorm and SRPE are the model's modules (the public ops, which run their
    registered kernels directly when no gradient is needed)."""

    def __init__(self, model, position_ids: Tensor, cache, key_valid: Tensor | None, weights: DecodeWeights | None,
                 summaries: bool = False):
        device = position_ids.device
        self.position_ids = position_ids.contiguous()
        self.cache, self.key_valid, self.weights = cache, key_valid, weights
        dtype = model.embed_tokens.weight.dtype
        self.gemv = weights is not None and gemv_applies(dtype, device)
        # One kernel call for a block's attention (SRPE, the cache append, the softmax over the
        # cache and the context slots) where each row adds one unpadded position to a GrowingKV.
        self.fused_attention = self.gemv and key_valid is None and position_ids.shape[-1] == 1 \
            and decode_attention.applies(dtype, device) and not getattr(cache, "offloading", False)
        # And the whole block in one call (wiola_kernels.decode_block: no interpreter or ATen
        # dispatch between the GEMVs) where no backend is forced.
        self.fused_block = self.fused_attention and decode_block.available() and dispatch.forced_backend() is None
        # summaries: the caller lets the block op keep the running causal summaries (one step
        # of WiolaCache.summary: no padding); summary_of() hands each layer's to the caller.
        self.summaries = summaries
        self._summary: dict[int, Tensor] = {}

    def summary_of(self, layer_idx: int) -> Tensor | None:
        """The causal summary the fused block computed for ``layer_idx`` (None: it did not)."""
        return self._summary.pop(layer_idx, None)

    def block(self, block, x: Tensor, context: Tensor, normed: Tensor | None = None, next_norm=None
              ) -> Tensor | tuple[Tensor, Tensor]:
        """``Xˡ⁺¹`` of one block for ``x (B, T_new, d)`` (and ``next_norm(Xˡ⁺¹)`` with a
        ``next_norm``, as the block's forward returns them); ``context (B, S, Λ', d)``."""
        mods = block._modules
        attn, ffn = mods["attn"], mods["ffn"]
        if self.gemv:
            if self.fused_block:
                out = self._fused_block(block, mods, attn, ffn, x, context, normed, next_norm)
                if out is not None:
                    return out
            return block.sequence(x, lambda h: self._gemv_attend(attn, h, context), lambda h: self._gemv_dsff(ffn, h),
                                  normed, next_norm)
        packed = self.weights.block(block) if self.weights is not None else None
        return block.sequence(x, lambda h: self._attend(attn, h, context, packed),
                              lambda h: self._dsff(ffn, h, packed), normed, next_norm)

    # ---- the packed copies / the modules (CUDA, float64, no extension, packing off) ----

    def _attend(self, attn, hx: Tensor, context: Tensor, packed) -> Tensor:
        """``A (B, T, d)`` of the normed ``hx (B, T, d)``: projections, SRPE, the cache, the
        cached self-attention, the folded context part and ``W_O``."""
        b, t, d = hx.shape
        h, h_kv, dh = attn.n_head, attn.n_kv_head, attn.head_dim
        if packed is not None:
            q, k, v = (hx @ packed[0].t).split(packed[0].splits, -1)
        else:
            q, k, v = attn.q_proj(hx), attn.k_proj(hx), attn.v_proj(hx)
        q = q.view(b, t, h, dh)
        k = k.view(b, t, h_kv, dh).transpose(1, 2)                              # (B, H_kv, T, d_h)
        v = v.view(b, t, h_kv, dh).transpose(1, 2)
        q_rot, k_rot = attn.srpe(q.transpose(1, 2), k, self.position_ids)
        k_all, v_all = self.cache.update(k_rot, v, attn.layer_idx)               # (B, H_kv, T_past + T, d_h)
        out = cached_attention(q_rot, k_all, v_all, self.key_valid).transpose(1, 2)  # (B, T, H, d_h)
        n_ctx = context.shape[2]
        if n_ctx:
            cross = folded_context_attention(q.reshape(b * t, h, dh),
                                             context.expand(b, t, n_ctx, d).reshape(b * t, n_ctx, d),
                                             attn.kc_proj.weight, attn.vc_proj.weight, attn.gate)
            out = out + cross.view(b, t, h, dh)
        return attn.o_proj(out.to(hx.dtype).reshape(b, t, h * dh))

    def _dsff(self, ffn, hf: Tensor, packed) -> Tensor:
        """``F = λ·narrow + (1 − λ)·wide`` (SPEC §7) of the normed ``hf (B, T, d)``."""
        if packed is not None:
            gn, un, gw, uw = (hf @ packed[1].t).split(packed[1].splits, -1)
        else:
            gn, un, gw, uw = ffn.w_n1(hf), ffn.w_n3(hf), ffn.w_w1(hf), ffn.w_w3(hf)
        narrow = ffn.w_n2(F.silu(gn) * un)
        wide = ffn.w_w2(F.gelu(gw, approximate="tanh") * uw)
        lam = torch.sigmoid(ffn.beta)
        return lam * narrow + (1.0 - lam) * wide

    # ---- the GEMV kernel, reading the parameters in place ----
    # At ~30 small ops per block the step's Python and dispatch overhead is a real part of a
    # token's time, so these are the fewest ops that do the maths (``split_with_sizes``, not
    # the Python ``split``; SDPA for the attention and for the context mixture; the fused GLU).

    def _attention(self, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """SRPE, the cache update and the cached self-attention: ``(B, T, H, d_h)`` from the
        projections ``q (B, T, H, d_h)``, ``k, v (B, T, H_kv, d_h)``."""
        q_rot, k_rot = attn.srpe(q.transpose(1, 2), k.transpose(1, 2), self.position_ids)
        k_all, v_all = self.cache.update(k_rot, v.transpose(1, 2), attn.layer_idx)  # (B, H_kv, T_past + T, d_h)
        b, h, t, dh = q_rot.shape
        if t == 1 and self.key_valid is None:
            # One query per row, no mask: one SDPA call over the cache as it is (a 16-bit cache
            # is read as is, accumulating in float32), the heads of a group as its rows.
            h_kv = k_all.shape[1]
            out = F.scaled_dot_product_attention(q_rot.reshape(b, h // h_kv, h_kv, dh).transpose(1, 2), k_all, v_all)
            return out.view(b, h_kv, h // h_kv, 1, dh).transpose(1, 2).reshape(b, 1, h, dh)
        return cached_attention(q_rot, k_all, v_all, self.key_valid).transpose(1, 2)

    def _gemv_attend(self, attn, hx: Tensor, context: Tensor) -> Tensor:
        """:meth:`_attend` with every product on the GEMV kernel and the context part unfolded."""
        gemv = decode_gemv.gemv
        mods = attn._modules
        b, t, d = hx.shape
        h, h_kv, dh = attn.n_head, attn.n_kv_head, attn.head_dim
        qkv = gemv(hx, [_weight(mods["q_proj"]), _weight(mods["k_proj"]), _weight(mods["v_proj"])])
        if self.fused_attention:
            out = self._fused_attention(attn, mods, qkv, context)
            if out is not None:
                return gemv(out.view(b, t, h * dh), _weight(mods["o_proj"]))
        q, k, v = qkv.split_with_sizes([h * dh, h_kv * dh, h_kv * dh], -1)
        q = q.view(b, t, h, dh)
        out = self._attention(attn, q, k.view(b, t, h_kv, dh), v.view(b, t, h_kv, dh))  # (B, T, H, d_h)
        n_ctx = context.shape[2]
        if n_ctx:  # SPEC §5.3 unfolded: the context slots through W_Kc and W_Vc as rows of one product
            n = b * t
            ctx = context.expand(b, t, n_ctx, d).reshape(n * n_ctx, d)            # (N·Λ', d)
            if n_ctx == 1:  # one slot: softmax weight 1, the key side drops out
                mixed = _gemv_rows(ctx, [_weight(mods["vc_proj"])])
            else:  # softmax_λ(q_h · W_Kc,h s_λ / √d_h) over the slots, then Σ_λ a_λ W_Vc,h s_λ: attention
                kv = _gemv_rows(ctx, [_weight(mods["kc_proj"]), _weight(mods["vc_proj"])]).view(n, n_ctx, 2, h, dh)
                kv = kv.permute(2, 0, 3, 1, 4)                                  # (2, N, H, Λ', d_h)
                mixed = F.scaled_dot_product_attention(q.reshape(n, h, 1, dh), kv[0], kv[1])
            # out + σ(g_h) · mixed, σ(g) (H, 1) broadcast over d_h
            out = torch.addcmul(out, mixed.view(b, t, h, dh), torch.sigmoid(attn.gate.to(out.dtype)).view(h, 1))
        return gemv(out.to(hx.dtype).reshape(b, t, h * dh), _weight(mods["o_proj"]))

    def _cache_slot(self, attn, b: int, dtype: torch.dtype):
        """``(layer, key buffer, value buffer, past)`` for a kernel that appends this step's key
        and value itself; None where the layer's cache is not a :class:`GrowingKV` it can append
        to, or SRPE is not the model's own module."""
        layers, idx = self.cache.layers, attn.layer_idx
        layer = layers[idx] if idx < len(layers) else None
        if type(layer) is not GrowingKV or type(attn._modules["srpe"]) is not SpiralRotaryEmbedding:
            return None
        buffers = layer.append_buffers(b, attn.n_kv_head, attn.head_dim, dtype)
        return None if buffers is None else (layer, *buffers)

    def _fused_block(self, block, mods, attn, ffn, x: Tensor, context: Tensor, normed: Tensor | None, next_norm
                     ) -> Tensor | tuple[Tensor, Tensor] | None:
        """:meth:`block` as one :func:`~wiola_kernels.decode_block.decode_block` call; None
        (nothing done) where it does not apply: the block's add-and-norm fusion off, more
        context rows than one GEMV takes, a cache it cannot append to, mixed dtypes."""
        b, d = x.shape[0], x.shape[-1]
        n_ctx = context.shape[2]
        ffn_norm = mods["ffn_norm"]
        if not block.fuse_add_norm or b * n_ctx > decode_gemv.MAX_ROWS or x.dtype != ffn_norm.weight.dtype:
            return None
        slot = self._cache_slot(attn, b, x.dtype)
        if slot is None:
            return None
        layer, k_buf, v_buf, past = slot
        if normed is None:
            normed = mods["attn_norm"](x)
        a, f = attn._modules, ffn._modules
        weights = [_weight(a["q_proj"]), _weight(a["k_proj"]), _weight(a["v_proj"]), _weight(a["o_proj"]),
                   _weight(a["kc_proj"]), _weight(a["vc_proj"]), _weight(f["w_n1"]), _weight(f["w_n3"]),
                   _weight(f["w_w1"]), _weight(f["w_w3"]), _weight(f["w_n2"]), _weight(f["w_w2"])]
        idx = attn.layer_idx
        summary_sum = self.cache.summary_sums.get(idx) if self.summaries else None
        srpe = a["srpe"]
        out, y, new_sum, summary = decode_block.decode_block(
            x, normed, weights, (ffn_norm.weight, ffn_norm.shift, ffn_norm.eps),
            None if next_norm is None else (next_norm.weight, next_norm.shift, next_norm.eps),
            ffn._parameters["beta"], attn._parameters["gate"], k_buf, v_buf, past, self.position_ids, attn.n_head,
            theta=srpe.theta, spiral_divisor=srpe.spiral_divisor, radial_amplitude=srpe.radial_amplitude,
            radial_frequency=srpe.radial_frequency, context=context if n_ctx else None, summary_sum=summary_sum)
        layer.appended(past + 1)
        if summary_sum is not None:
            self.cache.summary_sums[idx] = new_sum
            self._summary[idx] = summary
        return out if next_norm is None else (out, y)

    def _fused_attention(self, attn, mods, qkv: Tensor, context: Tensor) -> Tensor | None:
        """``(B, H·d_h)``: :meth:`_attention` and the context part of :meth:`_gemv_attend` in one
        :func:`~wiola_kernels.decode_attention.decode_attention` call, which also appends the
        new key and value to this layer's cache; None (nothing done) where the layer's cache
        is not a :class:`GrowingKV` it can append to, or SRPE is not the model's own module."""
        b, h, dh = qkv.shape[0], attn.n_head, attn.head_dim
        slot = self._cache_slot(attn, b, qkv.dtype)
        if slot is None:
            return None
        layer, k_buf, v_buf, past = slot
        srpe = attn._modules["srpe"]
        context_k = context_v = gate = None
        n_ctx = context.shape[2]
        if n_ctx:  # the context slots through W_Kc and W_Vc as rows of one product (as in _gemv_attend)
            rows = context.expand(b, 1, n_ctx, context.shape[-1]).reshape(b * n_ctx, -1)
            if n_ctx == 1:  # one slot: softmax weight 1, no keys needed
                context_v = _gemv_rows(rows, [_weight(mods["vc_proj"])]).view(b, 1, h * dh)
            else:
                kv = _gemv_rows(rows, [_weight(mods["kc_proj"]), _weight(mods["vc_proj"])]).view(b, n_ctx, 2 * h * dh)
                context_k, context_v = kv[..., :h * dh], kv[..., h * dh:]
            gate = attn._parameters["gate"]
        out = decode_attention.decode_attention(
            qkv.view(b, -1), k_buf, v_buf, past, self.position_ids, h, theta=srpe.theta,
            spiral_divisor=srpe.spiral_divisor, radial_amplitude=srpe.radial_amplitude,
            radial_frequency=srpe.radial_frequency, context_k=context_k, context_v=context_v, gate=gate)
        layer.appended(past + 1)
        return out

    def _gemv_dsff(self, ffn, hf: Tensor) -> Tensor:
        """:meth:`_dsff` on the GEMV kernel: one up product ``[u_n1 | u_n3 | u_w1 | u_w3]``, the
        fused GLU on each stream's half (the model's op), one down product over both streams."""
        gemv = decode_gemv.gemv
        mods = ffn._modules
        w_n1 = _weight(mods["w_n1"])
        n, d = w_n1.shape[0], hf.shape[-1]
        u = gemv(hf, [w_n1, _weight(mods["w_n3"]), _weight(mods["w_w1"]), _weight(mods["w_w3"])])
        act = torch.cat([glu(u[..., :2 * n], activation="silu"), glu(u[..., 2 * n:], activation="gelu_tanh")], -1)
        narrow, wide = gemv(act, [_weight(mods["w_n2"]), _weight(mods["w_w2"])], split_input=True) \
            .split_with_sizes([d, d], -1)
        return torch.lerp(wide, narrow, torch.sigmoid(ffn.beta))                # λ·narrow + (1−λ)·wide


def _weight(linear) -> Tensor:
    """``linear.weight`` without ``nn.Module.__getattr__`` (a step reads ~30 weights per block,
    and that lookup costs more than a small op); a weight that is not a registered Parameter
    (a parametrization) is read the ordinary way."""
    w = linear._parameters.get("weight")
    return w if w is not None else linear.weight


def fused_step(model, head: Tensor, input_ids: Tensor, position_ids: Tensor | None, cache) -> Tensor | None:
    """The logits ``(B, 1, V)`` of a cached decoding step of ``model`` (a :class:`WiolaModel`)
    with the output head ``head (V, d)``, by one :func:`wiola_kernels.decode_step.decode_step`
    call; the cache advances by one position. None (nothing done) where that call does not
    apply and the step must take the model's own forward: any padding (the caller checks the
    mask; here the cache's), a layer the block op does not take (add-and-norm fusion off, a
    sharded norm, SRPE not the model's module, a cache it cannot append to), mixed dtypes, a
    forced backend, non-causal summaries, more context rows than one GEMV takes.

    ``input_ids (B, 1)`` int64 on the CPU; ``position_ids`` None (each row at ``past``) or
    ``(B, 1)`` / ``(1, 1)`` int64."""
    from .modeling_wiola import holds_its_weights  # the model module imports this one

    cfg = model.config
    emb = model.embed_tokens._parameters.get("weight")
    b = input_ids.shape[0]
    past = cache.get_seq_length()
    if emb is None or head.dtype != emb.dtype or not (decode_step.available() and decode_block.available()) \
            or cache.key_valid is not None or cache.summary_counts is not None \
            or getattr(cache, "offloading", False) or not applies(model, b, 1, past, cache, False) \
            or not gemv_applies(emb.dtype, emb.device) or cfg.kernel_backend != "auto" \
            or dispatch.forced_backend() is not None:
        return None
    lookback = cfg.gcla_lookback
    if lookback and (cfg.gcla_summary != "causal" or b * lookback > decode_gemv.MAX_ROWS):
        return None
    if position_ids is None:
        position_ids = torch.full((b, 1), past, dtype=torch.int64)
    elif position_ids.dtype != torch.int64 or position_ids.dim() != 2 or position_ids.shape[1] != 1 \
            or position_ids.shape[0] not in (1, b) or not positions_ok(position_ids, cfg.srpe_spiral_divisor):
        return None
    else:
        position_ids = position_ids.expand(b, 1).contiguous()
    dtype, d = emb.dtype, emb.shape[1]
    layers, cache_layers = model.layers, cache.layers
    if not len(layers) or len(cache_layers) != len(layers):
        return None
    weights: list[Tensor] = []
    norms: list[tuple] = []
    betas, gates, k_bufs, v_bufs, grown = [], [], [], [], []
    srpe = None
    for block, layer in zip(layers, cache_layers):
        mods = block._modules
        attn, ffn = mods["attn"], mods["ffn"]
        a, f = attn._modules, ffn._modules
        rotary = a["srpe"]
        if not block.fuse_add_norm or type(layer) is not GrowingKV or type(rotary) is not SpiralRotaryEmbedding:
            return None
        if srpe is None:
            srpe = rotary
        elif (rotary.theta, rotary.spiral_divisor, rotary.radial_amplitude, rotary.radial_frequency) != \
                (srpe.theta, srpe.spiral_divisor, srpe.radial_amplitude, srpe.radial_frequency):
            return None
        for norm in (mods["attn_norm"], mods["ffn_norm"]):
            w = norm.weight
            if w.dtype != dtype or not holds_its_weights(norm, d):
                return None
            norms.append((w, norm.shift, norm.eps))
        buffers = layer.append_buffers(b, attn.n_kv_head, attn.head_dim, dtype)
        if buffers is None or buffers[2] != past:
            return None
        k_bufs.append(buffers[0])
        v_bufs.append(buffers[1])
        grown.append(layer)
        weights += [_weight(a["q_proj"]), _weight(a["k_proj"]), _weight(a["v_proj"]), _weight(a["o_proj"]),
                    _weight(a["kc_proj"]), _weight(a["vc_proj"]), _weight(f["w_n1"]), _weight(f["w_n3"]),
                    _weight(f["w_w1"]), _weight(f["w_w3"]), _weight(f["w_n2"]), _weight(f["w_w2"])]
        betas.append(ffn._parameters["beta"])
        gates.append(attn._parameters["gate"])
    final = model.norm
    if final.weight.dtype != dtype or not holds_its_weights(final, d):
        return None
    norms.append((final.weight, final.shift, final.eps))
    sums = []
    if lookback:
        sums = [cache.summary_sums.get(i) for i in range(len(layers) - 1)]
        if any(s is None or s.dtype != torch.float32 for s in sums):
            return None
    model.decode_weights()  # empty on the GEMV path; made here as on every decoding step
    logits, new_sums = decode_step.decode_step(
        input_ids, emb, weights, norms, betas, gates, k_bufs, v_bufs, past, position_ids, attn.n_head,
        theta=srpe.theta, spiral_divisor=srpe.spiral_divisor, radial_amplitude=srpe.radial_amplitude,
        radial_frequency=srpe.radial_frequency, lookback=lookback, summary_sums=sums, head_weight=head)
    for layer in grown:
        layer.appended(past + 1)
    for i, s in enumerate(new_sums):
        cache.summary_sums[i] = s
    return logits


def applies(model, batch: int, t: int, past: int, cache, requires_grad: bool) -> bool:
    """Whether a forward of ``model`` (a :class:`WiolaModel`) over ``batch × t`` new positions
    is a cached decoding step the fast path takes: a non-empty cache, at most
    :data:`MAX_STEP_POSITIONS` new positions, no gradient wanted (``requires_grad``: the
    input embeddings need one), not training, not being compiled."""
    if cache is None or past == 0 or model.training or torch.compiler.is_compiling():
        return False
    if batch * t > MAX_STEP_POSITIONS:
        return False
    return not (torch.is_grad_enabled() and (requires_grad or model.embed_tokens.weight.requires_grad))


def positions_ok(position_ids: Tensor, spiral_divisor: float) -> bool:
    """Every position within the range SRPE's kernels compute accurately (else the op path
    runs and raises its own error)."""
    if position_ids.device.type != "cpu" or position_ids.dtype != torch.int64 or not position_ids.numel():
        return position_ids.dtype == torch.int64
    return int(position_ids.abs().max()) <= srpe_max_position(spiral_divisor)


__all__ = ["DecodeStep", "DecodeWeights", "GrowingKV", "MAX_STEP_POSITIONS", "applies", "cached_attention",
           "fused_step", "gemv_applies", "positions_ok"]
