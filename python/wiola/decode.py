"""Cached decoding: the KV cache layer and the one-call decoding step.

The model's own decoding path is :mod:`wiola.model` (its products on the GEMV kernel,
``wiola_kernels.decode.gemv``, which streams the parameters in place, and a one-position
step's attention on ``wiola_kernels.decode.attention``). Here:

* :class:`GrowingKV`, the cache layer: keys and values are written into a buffer with spare
  capacity (doubling), instead of ``torch.cat`` copying the whole cache on every token;
* :func:`fused_step`, a whole cached decoding step of one new token per row, unpadded, as one
  C++ call (:func:`wiola_kernels.decode.step.decode_step`: the same kernels as the model's
  path, in the same order, with the norms' rows those of the ``add_rms_norm`` op), which
  ``WiolaForCausalLM.forward`` takes where it applies: at batch 1 the interpreter and
  dispatch time between the kernels was a fifth of a bf16 step.

This module imports the model, never the reverse.
"""

from __future__ import annotations


import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from wiola_kernels import SpiralRotaryEmbedding, dispatch
from wiola_kernels.decode import block as decode_block, gemv as decode_gemv, step as decode_step
from wiola_kernels.ops.srpe import srpe_max_position

from .model import cached_attention, holds_its_weights  # noqa: F401  (cached_attention: the old name's home)

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
        value itself (:func:`wiola_kernels.decode.attention.decode_attention`); call
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


def gemv_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decoding steps of a ``dtype`` model on ``device`` run on the GEMV kernel
    (CPU float32/bfloat16/float16 with the C++ extension); elsewhere they run ``F.linear``."""
    return decode_gemv.applies(dtype, device)


def _weight(linear) -> Tensor:
    """``linear.weight`` without ``nn.Module.__getattr__``; a weight that is not a registered
    Parameter (a parametrization) is read the ordinary way."""
    w = linear._parameters.get("weight")
    return w if w is not None else linear.weight


def fused_step(model, head: Tensor, input_ids: Tensor, position_ids: Tensor | None, cache) -> Tensor | None:
    """The logits ``(B, 1, V)`` of a cached decoding step of ``model`` (a :class:`WiolaModel`)
    with the output head ``head (V, d)``, by one :func:`wiola_kernels.decode.step.decode_step`
    call; the cache advances by one position. None (nothing done) where that call does not
    apply and the step must take the model's own forward: any padding (the caller checks the
    mask; here the cache's), a layer the block op does not take (a sharded norm, SRPE not the
    model's module, a cache it cannot append to), mixed dtypes, a
    forced backend, non-causal summaries, more context rows than one GEMV takes.

    ``input_ids (B, 1)`` int64 on the CPU; ``position_ids`` None (each row at ``past``) or
    ``(B, 1)`` / ``(1, 1)`` int64."""
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
        if type(layer) is not GrowingKV or type(rotary) is not SpiralRotaryEmbedding:
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


__all__ = ["GrowingKV", "MAX_STEP_POSITIONS", "applies", "cached_attention", "fused_step", "gemv_applies",
           "positions_ok"]
