"""The Hugging Face glue of the Wiola decoder: the maths is :mod:`wiola.model`.

Here: :class:`WiolaPreTrainedModel` (strict safetensors loading, weight init),
:class:`WiolaModel` (``model.Wiola`` with Hugging Face's base class, input checks and padded
batches), :class:`WiolaForCausalLM` (the tied head, the loss, ``generate``), :class:`WiolaCache`
(Hugging Face's cache with the causal summaries' running sums and the padding bookkeeping) and
:class:`PaddingLayout`. Which ``wiola_kernels`` backend runs the ops is chosen by
``config.kernel_backend`` through :func:`wiola_kernels.use_backend` around the forward
(``"auto"``: no override); each op's backward runs on the backend its forward used.

Summaries (SPEC §5.1). ``gcla_summary="causal"`` (default): the model is causal and the cache
carries each layer's running sum, so cached decoding reproduces the full forward.
``gcla_summary="paper"``: every position sees later tokens through the summary, so a KV cache
cannot reproduce a full forward: ``generate()`` turns the cache off and recomputes the whole
sequence at every step, and ``forward`` refuses a non-empty cache.

ATM (SPEC §6) runs only in training mode and only in the middle third of layers; a merged
pair lets position t see token t+1, a training-time leak the tests show.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

import wiola_kernels
from wiola_kernels import WiolaRMSNorm
from wiola_kernels.dtypes import compute_dtype

from . import decode
from .configuration_wiola import WiolaConfig
from .model import Wiola, WiolaAttention, WiolaDSFF, logits_and_loss
# Names that lived here before model.py (kept for callers that import them from this module).
from .model import WiolaBlock, add_norm, cached_attention, first_member, holds_its_weights  # noqa: F401
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


# ----------------------------------------------------------------------------------------
# Summaries and the cache (SPEC §5.1)
# ----------------------------------------------------------------------------------------

class WiolaCache(DynamicCache):
    """KV cache (rotated keys and values per layer) plus each layer's running summary sum: the
    cache :mod:`wiola.model` takes (its docstring lists the methods).

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
        self.begin(None, 0)

    def begin(self, layout: "PaddingLayout | None", past: int) -> None:
        """Set the padding of the forward that starts now over ``past`` cached positions."""
        self._layout, self._past = layout, past
        self.key_mask = layout.key_valid if layout is not None and past > 0 else None  # (B, past + T) or None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Hugging Face's update; a left-padded prompt's keys, computed right-padded, are cached
        back in the mask's layout."""
        layout = self._layout
        if layout is not None and layout.shift is not None and self._past == 0:
            key_states, value_states = layout.to_mask_layout(key_states, 2), layout.to_mask_layout(value_states, 2)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def append_buffers(self, layer_idx: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype):
        """``(key buffer, value buffer, past)`` with room for one position of ``layer_idx``
        (:meth:`decode.GrowingKV.append_buffers`); None where the layer cannot take one."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if type(layer) is not decode.GrowingKV or getattr(self, "offloading", False):
            return None
        return layer.append_buffers(batch, heads, head_dim, dtype)

    def appended(self, layer_idx: int, end: int) -> None:
        """Layer ``layer_idx`` now holds its buffers' first ``end`` positions."""
        self.layers[layer_idx].appended(end)

    def summary(self, layer_idx: int, x: Tensor) -> Tensor:
        """Prefix means of ``x (B, T_new, d)`` continuing this layer's running sum (SPEC §5.1);
        padded positions stay out of the sums and counts (their own summaries are means of
        the real positions before them, 0 before the first)."""
        b, t, _ = x.shape
        past, valid = self._past, self._layout.summary_valid if self._layout is not None else None
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
        self.begin(None, 0)
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
    """:class:`wiola.model.Wiola` (embedding, L blocks with the summary context, final norm:
    hidden states ``(B, T, d)``) with Hugging Face's base class, input checks and padded batches."""

    #: Kept for callers of the name: cached decoding always reads the parameters in place
    #: (the GEMV kernel where it applies, ``F.linear`` elsewhere); there is no copy to switch off.
    decode_packing = True

    def __init__(self, config: WiolaConfig):
        super().__init__(config)
        core = Wiola(config, init=False)  # the same modules, under the same state_dict keys; post_init inits
        self.embed_tokens, self.layers, self.norm = core.embed_tokens, core.layers, core.norm
        self.gradient_checkpointing = False
        self.post_init()

    #: The decoder's forward and summaries (model.py), run on this module's own layers.
    run, summary = Wiola.forward, Wiola.summary

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
        ids = input_ids if input_ids is not None else inputs_embeds
        b, t = ids.shape[:2]
        device = ids.device if input_ids is None else self.embed_tokens.weight.device
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
        layout = padding_layout(attention_mask, past, t, b, device, cache)
        if position_ids is None:
            position_ids = layout.default_positions(past, t) if layout is not None \
                else torch.arange(past, past + t, device=device)
        position_ids = position_ids.expand(b, t) if position_ids.dim() == 1 or position_ids.shape[0] == 1 \
            else position_ids  # (B, T)
        if layout is not None and layout.shift is not None:  # left padding: compute on right-padded rows
            ids, position_ids = layout.to_compute_layout(ids, 1), layout.to_compute_layout(position_ids, 1)
        if cache is not None:
            cache.begin(layout, past)
        hidden_states: list[Tensor] | None = [] if output_hidden_states else None
        x = self.run(ids if input_ids is not None else None, position_ids, cache,
                     layout.lengths if layout is not None else None, ids if input_ids is None else None,
                     hidden_states)                                          # (B, T, d)
        if cache is not None:
            cache.advance(layout.new_valid if layout is not None else None, past)
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
        with self.kernel_backend():
            out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_hidden_states=output_hidden_states, output_attentions=output_attentions)
            hidden = out.last_hidden_state                                   # (B, T, d)
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            if labels is not None:
                check_labels(labels, (input_ids if input_ids is not None else inputs_embeds).shape[:2])
                labels = labels.to(hidden.device)
            logits, loss = logits_and_loss(hidden, self.lm_head.weight, labels, return_logits)
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
                or output_attentions or output_hidden_states \
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
