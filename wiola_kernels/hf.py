"""Drop-in fused kernels for Hugging Face models: :func:`patch_hf` / :func:`unpatch_hf`.

``patch_hf(model)`` swaps, on that model instance, every RMSNorm module, the
rotary-embedding application, the gated MLP and the causal-LM loss of a model of the
families in :func:`supported` — Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text:
``gemma3_text``), Phi-3, OLMo-2 and SmolLM3: the ``*ForCausalLM``, the bare ``*Model``,
the classification and QA heads — for this package's fused ops, on whatever backend
:mod:`wiola_kernels.dispatch` picks (C++ on CPU tensors, Triton/CUDA on GPUs), for
training and inference. ``supported()`` returns the table of what is swapped per family
(``model_type`` → norms / q-k norms / RoPE / MLP / loss):

* RMSNorm: each ``<Family>RMSNorm`` (the layer norms, and the q/k norms of Qwen3, Gemma 3
  and OLMo-2) becomes a :class:`wiola_kernels.modules.RMSNorm` sharing its ``weight``
  Parameter (``state_dict`` keys and optimizer state unchanged), with δ = 0 (no shift) and
  the family's rounding: Hugging Face's Llama order (normalise in float32, round to the
  input dtype, then multiply by γ), so bf16/fp16 outputs match HF's; OLMo-2's (γ·x̂ in
  float32, rounded once). Gemma's ``x̂ · (1 + γ)`` in float32 becomes a
  :class:`FusedOffsetRMSNorm` (the same op with the weight ``1 + γ``).
* RoPE: WiolaRMSNorm's sibling SRPE with ``k_s = ∞`` and ``a_s = 0`` is rotate-half
  RoPE. The model's ``rotary_emb`` becomes a :class:`FusedRotaryEmbedding`, which still
  returns HF's ``(cos, sin)`` tensors (same shapes and dtype, from float64 angles), so
  code that reads ``position_embeddings`` keeps working; the ``cos`` tensor also carries
  the positions, and the modeling module's ``apply_rotary_pos_emb`` is replaced by a
  function that, when it sees them, applies :func:`wiola_kernels.srpe` to Q and K in one
  launch (and calls the original otherwise, so unpatched models of the same class are
  unaffected, and foreign tables still work). Under ``torch.compile`` the unused tables
  are dead code. Angles are reduced in float64: the rotation stays float32-accurate at
  large positions, where HF's float32 ``inv_freq · p`` does not (``python -m
  wiola_kernels bench --hf rope`` prints both errors).

  Every rope type of Hugging Face's ``ROPE_INIT_FUNCTIONS`` is swapped (:data:`ROPE_TYPES`;
  see "Rope types" below). Gemma 3's rotary module serves each attention layer type
  (sliding, full) with its own θ₀ or rope type; SmolLM3's layers without RoPE stay without
  it (HF's attention decides).

* MLP: each ``<Family>MLP`` (``down(SiLU(gate(x)) ⊙ up(x))``) becomes a
  :class:`FusedGatedMLP` holding the same ``gate_proj``, ``up_proj`` and ``down_proj``
  modules (``state_dict`` keys unchanged) that forms ``SiLU(gate(x)) ⊙ up(x)`` with
  :func:`wiola_kernels.glu` (one pass; the backward recomputes SiLU and saves only the
  two projections, where eager PyTorch also keeps ``SiLU(gate(x))``). Gemma's GeGLU
  (``gelu_pytorch_tanh``) goes through ``glu(..., "gelu_tanh")``; Phi-3's fused
  ``gate_up_proj`` through :class:`FusedPackedGatedMLP` (``glu`` reads the two halves in
  place). Only where the config's activation is the family's (SiLU; Gemma: tanh GELU);
  another keeps HF's MLP, with a warning.

* Loss: ``<Family>ForCausalLM.forward`` becomes, on that instance, a forward that runs the
  backbone and, when ``labels`` are given in training mode, computes Hugging Face's
  causal-LM loss (labels shifted by one, ``ignore_index``, ``num_items_in_batch``,
  ``shift_labels``) with :func:`wiola_kernels.linear_cross_entropy` on the last hidden
  states and ``lm_head.weight`` (Gemma's ``final_logit_softcapping`` as its ``softcap``):
  the ``(B·T, V)`` logits (and HF's float32 copy of them)
  are never materialised, and ``logits`` is None, as in Liger-Kernel. ``return_logits=True``
  in the call keeps them (HF's own forward runs); in eval mode, without labels, with
  ``logits_to_keep``, or with a custom ``loss_function`` HF's forward runs too, so
  evaluation, ``generate`` and custom losses are unchanged. The patched ``forward`` has
  the original's signature (``inspect.signature``), which ``generate`` checks its
  keyword arguments (``logits_to_keep``, ...) against.

What stays HF's: attention (soft-capping, sliding windows, Phi-3's fused ``qkv_proj``,
whose q/k slices srpe reads in place), residual adds and dropouts, embeddings (Gemma's
scale included).

Each swap is switchable (``rms_norm=``, ``rope=``, ``mlp=``, ``loss=``), on by default. The residual
adds of HF's decoder layer stay HF's: fusing them with the norm (``add_rms_norm``) would
need a copy of HF's layer code, which SPEC §10.4 leaves out.

**All or nothing.** ``patch_hf`` first checks everything and builds every replacement,
then swaps; if anything fails (an exception anywhere, even midway through the swaps),
what was swapped is put back and the exception propagates: the model is exactly as
before and not patched.

**Meta-device and ``to_empty`` models.** Whether RoPE can be swapped is decided from the
config and the rotary module's metadata (rope type, scaling, head size), never from
tensor values, so a model built on the meta device (``torch.device("meta")``,
accelerate's ``init_empty_weights``, FSDP's meta init) patches like any other. The HF
rotary module stays inside the fused one (``rotary_emb.hf_rotary``), so ``to_empty``,
``.to()`` and HF's weight initialisation reach its ``inv_freq`` buffer; the first eager
forward that finds that buffer materialised checks it, for the default rope type, against
``θ₀^(−2j/d_h)`` (a hand-edited buffer is not what we compute: that module then keeps
HF's RoPE, with a warning; the other rope types use the buffer as it is). ``unpatch_hf``
hands back the HF modules as they are then.

**Class-level form.** ``patch_hf(LlamaForCausalLM)`` (any model class of a family) or
``patch_hf("llama")`` patches the family: every model of it built afterwards —
``from_pretrained``, ``from_config``, a plain constructor, on any device — is patched
(with the given switches) as its outermost constructor returns, before
``from_pretrained`` loads weights into it (keys are unchanged, so loading is unaffected).
``unpatch_hf(LlamaForCausalLM)`` / ``unpatch_hf("llama")`` stops that; models already
built stay patched until ``unpatch_hf(model)``. ``is_patched`` answers for either form.

**Rope types.** Every rope type of Hugging Face's ``ROPE_INIT_FUNCTIONS`` that only changes
the per-pair frequencies and scales the rotated output (``linear``, ``dynamic``,
``llama3``, ``yarn``, ``longrope``, ``proportional``; :data:`ROPE_TYPES`) is swapped too, in
every family (per layer type in Gemma 3): :func:`rope_srpe_arguments` hands
:func:`wiola_kernels.srpe` the rotary module's own ``inv_freq`` buffer (or
``<layer_type>_inv_freq``; used in float64) and its ``attention_scaling`` as the output
scale (SPEC §4, "Given frequencies"). For ``dynamic`` and ``longrope`` it first runs Hugging
Face's own per-call update (``transformers.modeling_rope_utils.dynamic_rope_update``,
with its condition on the sequence length ``max(position_ids) + 1``), so the frequencies
are recomputed, grown, reset or switched exactly when the unpatched model's would be.
Another rope type, and partial rotary embeddings outside the families whose RoPE
function takes them (Phi-3), keep HF's rotary embedding, with a warning that names the
type (RMSNorm is still swapped). Models of other architectures
(Gemma 3's multimodal ``gemma3`` models included) are left untouched, with a warning
naming them.

Transformers is imported lazily: ``wiola_kernels`` itself does not need it.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
import inspect
import threading
import types
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .modules.rms_norm import RMSNorm
from .ops.rms_norm import rms_norm
from .ops.glu import glu
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.srpe import srpe

__all__ = ["patch_hf", "unpatch_hf", "is_patched", "supported", "FusedGatedMLP", "FusedPackedGatedMLP",
           "FusedOffsetRMSNorm", "FusedRotaryEmbedding", "RotaryPositions", "ROPE_TYPES", "rope_srpe_arguments"]



@dataclass(frozen=True)
class _Family:
    """What :func:`patch_hf` swaps in one Hugging Face family (one row of :func:`supported`).

    ``module``: the family's package, ``transformers.models.<module>.modeling_<module>``;
    ``prefix``: its class names' prefix (``<prefix>RMSNorm``, ``<prefix>MLP``, ...).
    The other fields are the row's values, documented in :func:`supported`."""

    module: str
    prefix: str
    norms: str = "gamma_rounded"
    qk_norms: str | None = None
    rope: str = "all_layers"
    mlp: str = "silu"
    loss: str = "linear_cross_entropy"
    # Whether the family's apply_rotary_pos_emb rotates only the first cos.shape[-1] features
    # of a head and passes the rest (Phi-3: config's partial_rotary_factor, Phi-4-mini's 0.75).
    partial_rotary: bool = False

    def row(self) -> dict:
        return {"classes": f"{self.prefix}*", "norms": self.norms, "qk_norms": self.qk_norms, "rope": self.rope,
                "partial_rotary": self.partial_rotary, "mlp": self.mlp, "loss": self.loss}


# model_type (config.model_type) -> what is swapped. Llama, Mistral, Qwen2, Qwen3, Phi-3 and
# SmolLM3 share LlamaRMSNorm's arithmetic (γ times x̂ rounded to the input dtype); OLMo-2
# multiplies by γ in float32 and rounds once; Gemma multiplies by 1 + γ in float32.
_FAMILIES: dict[str, _Family] = {
    "llama": _Family("llama", "Llama"),
    "mistral": _Family("mistral", "Mistral"),
    "qwen2": _Family("qwen2", "Qwen2"),
    "qwen3": _Family("qwen3", "Qwen3", qk_norms="per_head"),
    "gemma2": _Family("gemma2", "Gemma2", norms="one_plus_gamma_fp32", mlp="gelu_tanh",
                      loss="linear_cross_entropy_softcap"),
    "gemma3_text": _Family("gemma3", "Gemma3", norms="one_plus_gamma_fp32", qk_norms="per_head",
                           rope="per_layer_type", mlp="gelu_tanh", loss="linear_cross_entropy_softcap"),
    "phi3": _Family("phi3", "Phi3", mlp="packed_silu", partial_rotary=True),
    "olmo2": _Family("olmo2", "Olmo2", norms="gamma_fp32", qk_norms="whole_projection"),
    "smollm3": _Family("smollm3", "SmolLM3", rope="no_rope_layers"),
}


def supported() -> dict[str, dict]:
    """The families :func:`patch_hf` patches and what it swaps in each: a new dict
    ``{model_type: row}`` (``model_type`` as in ``config.model_type``; each is also a
    name ``patch_hf`` takes for the class-level form). Each row:

    * ``classes``: the ``transformers`` classes of the family (``<Prefix>*`` in
      ``transformers.models.<family>``): every ``<Prefix>RMSNorm``, ``<Prefix>MLP`` and
      ``<Prefix>RotaryEmbedding`` inside any of its models is swapped, the loss only in
      ``<Prefix>ForCausalLM``.
    * ``norms`` — every RMSNorm, onto :func:`wiola_kernels.rms_norm`, statistics in float32:
      ``"gamma_rounded"``: ``γ · round(x̂)`` (LlamaRMSNorm's rounding order);
      ``"gamma_fp32"``: ``round(γ · x̂)`` (OLMo-2); ``"one_plus_gamma_fp32"``:
      ``round((1 + γ) · x̂)`` (Gemma; the weight ``1 + γ`` is formed per call, a ``(d,)``
      add, next to the norm's ``(N, d)`` pass).
    * ``qk_norms`` — RMSNorms on the queries and keys before RoPE (swapped as the norms
      are): ``None`` (none), ``"per_head"`` (over each head's ``d_h``: Qwen3, Gemma 3) or
      ``"whole_projection"`` (over all heads at once: OLMo-2).
    * ``rope`` — RoPE through :func:`wiola_kernels.srpe` (every rope type of
      :data:`ROPE_TYPES`, see :func:`rope_srpe_arguments`; another type keeps Hugging
      Face's, with a warning): ``"all_layers"``; ``"per_layer_type"`` (Gemma 3: one θ₀ or
      rope type per attention layer type, sliding and full); ``"no_rope_layers"``
      (SmolLM3: the layers ``config.no_rope_layers`` marks 0 apply none, as in HF).
    * ``partial_rotary`` — whether a rotary embedding over the first
      ``partial_rotary_factor · d_h`` features of each head is swapped too (Phi-3 and
      Phi-4-mini: ``srpe`` rotates those features, the rest pass through, as in HF).
    * ``mlp`` — the gated MLP's product through :func:`wiola_kernels.glu`: ``"silu"``
      (``down(SiLU(gate(x)) ⊙ up(x))``), ``"gelu_tanh"`` (GeGLU, Gemma's
      ``gelu_pytorch_tanh``), ``"packed_silu"`` (Phi-3's fused ``gate_up_proj``, whose two
      halves ``glu`` reads in place). Another ``hidden_act`` keeps HF's MLP, with a warning.
    * ``loss`` — the causal-LM training loss through
      :func:`wiola_kernels.linear_cross_entropy`: ``"linear_cross_entropy"``, or
      ``"linear_cross_entropy_softcap"`` (Gemma: ``config.final_logit_softcapping``
      passed as its ``softcap``).

    What stays Hugging Face's everywhere: attention (its soft-capping, sliding windows and
    the q/k/v projections, Phi-3's fused ``qkv_proj`` included), the residual adds and
    dropouts, and Gemma's embedding scale.

    Returns:
        ``{model_type: {"classes", "norms", "qk_norms", "rope", "partial_rotary", "mlp", "loss"}}``.
    """
    return {model_type: family.row() for model_type, family in _FAMILIES.items()}


def _modeling_name(model_type: str) -> str:
    module = _FAMILIES[model_type].module
    return f"transformers.models.{module}.modeling_{module}"

_RECORD = "_wiola_hf_patch"
_ROPE_ATTR = "_wiola_rope"  # attribute of the cos table the fused rotary embedding returns


@dataclass
class _Patch:
    """What patch_hf changed on one model, to undo it."""

    modeling: str                                     # name of the transformers modeling module
    switches: dict = field(default_factory=dict)      # the patch_hf keyword arguments used
    norms: list = field(default_factory=list)         # (parent, attribute name, original module)
    rotary: list = field(default_factory=list)        # (parent, attribute name, original module)
    mlps: list = field(default_factory=list)          # (parent, attribute name, original module)
    loss_args: tuple | None = None    # the forward's positional parameter names, when the loss is swapped
    cache_field: str = "cache"        # the output's cache field ("past_key_values" before transformers 5.2x)


_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
# transformers' ACT2FN names of the activations glu computes, by the name glu takes
# (gelu_new is the same tanh formula as gelu_pytorch_tanh).
_ACTIVATIONS = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_new")}


class FusedGatedMLP(nn.Module):
    """Stands in for a model's ``<Family>MLP``: ``down_proj(glu(gate_proj(x), up_proj(x), activation))``.

    ``gate_proj``, ``up_proj`` and ``down_proj`` are the HF module's own ``nn.Linear``
    modules (shared, not copied: same ``state_dict`` keys, parameters and optimizer state,
    and whatever later wraps them, e.g. a LoRA adapter, is used here too).

    Args:
        hf_mlp: the HF MLP module.
        activation: ``"silu"`` (SwiGLU: Llama, Qwen, ...) or ``"gelu_tanh"`` (GeGLU: Gemma).
    """

    parts = _MLP_PARTS

    def __init__(self, hf_mlp: nn.Module, activation: str = "silu") -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (getattr(hf_mlp, name) for name in _MLP_PARTS)
        self.hidden_size = getattr(hf_mlp, "hidden_size", None)
        self.intermediate_size = getattr(hf_mlp, "intermediate_size", None)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class FusedPackedGatedMLP(nn.Module):
    """Stands in for Phi-3's MLP, whose one ``gate_up_proj`` computes ``[gate | up]``:
    ``down_proj(glu(gate_up_proj(x), None, activation))`` — :func:`wiola_kernels.glu`'s
    packed form reads the two halves in place (no ``chunk`` copies; its gradient comes back
    as one tensor, no ``cat``). The projections are the HF module's own (shared).

    Args:
        hf_mlp: the HF MLP module (``gate_up_proj``, ``down_proj``).
        activation: ``"silu"``.
    """

    parts = ("gate_up_proj", "down_proj")

    def __init__(self, hf_mlp: nn.Module, activation: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = hf_mlp.gate_up_proj, hf_mlp.down_proj
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(glu(self.gate_up_proj(x), None, self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, packed"


class FusedOffsetRMSNorm(nn.Module):
    """Stands in for Gemma's RMSNorm, ``round((1 + γ) · x / sqrt(mean(x²) + ε))`` computed in
    float32: :func:`wiola_kernels.rms_norm` (statistics in float32, rounded once) with the
    weight ``1 + γ`` in float32 (float64 for float64 inputs).

    Shares the HF module's ``weight`` Parameter (γ, initialised to 0: ``state_dict`` keys and
    optimizer state unchanged) and its ``eps`` attribute. Each call forms ``1 + γ``: one
    ``(d,)`` add (and its ``(d,)`` gradient), next to the norm's own pass over ``(N, d)``.
    """

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise TypeError(f"weight must be a 1-D nn.Parameter, got {type(weight).__name__}")
        self.weight = weight
        self.eps = float(eps)

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        return rms_norm(x, self.weight.to(dtype) + 1.0, None, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, weight 1 + γ"


#: Hugging Face rope types the fused RoPE serves: each changes only the per-pair frequencies
#: ``inv_freq`` and scales the rotated output by ``attention_scaling`` (SPEC §4).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")
# Plain rotate-half RoPE in srpe's terms: no spiral stretch (1/k_s = 0), no radial term.
_ROPE = {"spiral_divisor": math.inf, "radial_amplitude": 0.0, "radial_frequency": 0.0}


def _rope_type(rotary: nn.Module, layer_type: str | None = None):
    """``rotary``'s rope type (for ``layer_type``, in a module serving several: Gemma 3's
    ``rope_type`` is a dict), or None."""
    rope_type = getattr(rotary, "rope_type", None)
    if isinstance(rope_type, dict):
        return rope_type.get(layer_type)
    return rope_type if layer_type is None else None


_frequency_update = None


def _hf_frequency_update():
    """Hugging Face's own per-call frequency update (``dynamic_rope_update``: ``dynamic`` grows
    or resets ``inv_freq`` with ``max(position_ids) + 1``, ``longrope`` switches between its
    short and long factors) around a forward that computes nothing; built once (a plain
    global, not functools.cache, which Dynamo warns about when tracing)."""
    global _frequency_update
    if _frequency_update is None:
        from transformers.modeling_rope_utils import dynamic_rope_update

        _frequency_update = dynamic_rope_update(lambda self, x, position_ids, **kwargs: None)
    return _frequency_update


def rope_srpe_arguments(rotary: nn.Module, x: Tensor, position_ids: Tensor, layer_type: str | None = None) -> dict:
    """The keyword arguments of :func:`wiola_kernels.srpe` that apply a Hugging Face rotary
    embedding module's RoPE, of any rope type in :data:`ROPE_TYPES`, at these positions:
    ``srpe(q, k, position_ids, **rope_srpe_arguments(rotary, x, position_ids))``.

    For the ``default`` type: ``theta = θ₀`` from ``rotary.config`` and no ``inv_freq`` (the
    kernels form ``θ₀^(−2j/d_h)`` in float64). For the others: the module's own frequencies
    (its ``inv_freq`` buffer, or ``<layer_type>_inv_freq``, as it is: float32, or whatever
    dtype ``model.to`` gave it) and its ``attention_scaling`` (``<layer_type>_attention_scaling``)
    as ``scale``, after running Hugging Face's per-call update on the module (``dynamic``:
    recomputed for ``max(position_ids) + 1`` beyond the cached length, reset below the
    original one; ``longrope``: the long factors beyond ``original_max_position_embeddings``)
    — the same state change the unpatched module's forward makes.

    Args:
        rotary: a ``<Family>RotaryEmbedding`` (its ``rope_type``, ``config``, buffers).
        x: the tensor HF's rotary forward receives (only its device is used).
        position_ids: ``(B, T)`` positions, as HF's rotary forward receives them.
        layer_type: for modules with per-layer-type RoPE (``rope_type`` a dict, e.g. Gemma 3's
            ``"sliding_attention"`` / ``"full_attention"``); None for the others.

    Returns:
        ``{"theta", "spiral_divisor": inf, "radial_amplitude": 0.0, "radial_frequency": 0.0,
        "inv_freq", "scale"}`` (``theta`` only for the ``default`` type).

    Raises:
        ValueError: for a rope type outside :data:`ROPE_TYPES`.
    """
    rope_type = _rope_type(rotary, layer_type)
    if rope_type not in ROPE_TYPES:
        where = "" if layer_type is None else f" for layer type {layer_type!r}"
        raise ValueError(f"rotary has rope type {rope_type!r}{where}; the fused RoPE serves {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return dict(_ROPE, theta=float(_rope_theta(rotary.config, layer_type)), inv_freq=None, scale=1.0)
    _hf_frequency_update()(rotary, x, position_ids, **({} if layer_type is None else {"layer_type": layer_type}))
    return dict(_ROPE, inv_freq=getattr(rotary, _rotary_attr_name("inv_freq", layer_type)),
                scale=float(getattr(rotary, _rotary_attr_name("attention_scaling", layer_type), 1.0)))


class RotaryPositions:
    """The positions and RoPE's frequencies (θ₀, or a rope type's ``inv_freq`` and output
    scale) that the fused rotary embedding attaches to its ``cos`` table; :meth:`apply`
    rotates Q and K with :func:`wiola_kernels.srpe`."""

    __slots__ = ("position_ids", "theta", "inv_freq", "scale", "rotary_dim")

    def __init__(self, position_ids: Tensor, theta: float = 10000.0, inv_freq: Tensor | None = None,
                 scale: float = 1.0, rotary_dim: int | None = None) -> None:
        self.position_ids = position_ids
        self.theta = theta
        self.inv_freq = inv_freq
        self.scale = scale
        self.rotary_dim = rotary_dim  # None: all of d_h; else the first rotary_dim features

    def apply(self, q: Tensor, k: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
        """RoPE of ``q``, ``k`` laid out ``(B, H, T, d_h)`` (``unsqueeze_dim=1``) or
        ``(B, T, H, d_h)`` (``unsqueeze_dim=2``); with ``rotary_dim < d_h``, of their first
        ``rotary_dim`` features, the rest passed through (HF's partial rotary)."""
        if self.rotary_dim is not None and self.rotary_dim < q.shape[-1]:
            # srpe reads the strided slices in place; the concatenation is HF's own.
            r = self.rotary_dim
            q_rot, k_rot = self.apply(q[..., :r], k[..., :r], unsqueeze_dim)
            return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        if unsqueeze_dim == 2:
            q_rot, k_rot = self.apply(q.transpose(1, 2), k.transpose(1, 2))
            return q_rot.transpose(1, 2), k_rot.transpose(1, 2)
        if unsqueeze_dim != 1:
            raise ValueError(f"unsqueeze_dim must be 1 (B, H, T, d_h) or 2 (B, T, H, d_h), got {unsqueeze_dim}")
        b, h, t, dh = q.shape
        h_kv = k.shape[1]
        inv_freq = None if self.inv_freq is None else self.inv_freq.to(q.device)
        if q.dim() == 4 and k.dim() == 4 and q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous():
            # HF's q/k are (B, T, H, d_h) projections viewed as (B, H, T, d_h). As
            # (B·T, H, 1, d_h) they are already in the kernel's layout: no copy in, and the
            # outputs come back as the same kind of view (what HF's own RoPE returns too).
            pos = self.position_ids.to(q.device).expand(b, t).reshape(b * t, 1)
            q_flat = q.transpose(1, 2).reshape(b * t, h, 1, dh)
            k_flat = k.transpose(1, 2).reshape(b * t, h_kv, 1, dh)
            q_out, k_out = srpe(q_flat, k_flat, pos, self.theta, **_ROPE, inv_freq=inv_freq, scale=self.scale)
            return q_out.view(b, t, h, dh).transpose(1, 2), k_out.view(b, t, h_kv, dh).transpose(1, 2)
        return srpe(q, k, self.position_ids, self.theta, **_ROPE, inv_freq=inv_freq, scale=self.scale)


def rope_tables(position_ids: Tensor, theta: float, head_dim: int, dtype: torch.dtype, inv_freq: Tensor | None = None,
                scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """HF's ``(cos, sin)`` — ``(B, T, d_h)``, the halves repeated, times ``scale`` (a rope type's
    ``attention_scaling``) — with the angles ``p·ω_j`` formed in float64 (accurate at large
    positions), in ``dtype``; ``ω_j = θ₀^(−2j/d_h)``, or ``inv_freq`` (taken in float64) when given."""
    if inv_freq is None:
        j = torch.arange(head_dim // 2, dtype=torch.float64, device=position_ids.device)
        omega = torch.pow(float(theta), -2.0 * j / head_dim)
    else:
        omega = inv_freq.to(position_ids.device, torch.float64)
    angle = position_ids[..., None].to(torch.float64) * omega
    emb = torch.cat((angle, angle), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


class FusedRotaryEmbedding(nn.Module):
    """Stands in for a model's ``<Family>RotaryEmbedding`` (kept as ``hf_rotary``).

    ``forward(x, position_ids)`` returns ``(cos, sin)`` like HF's (shapes ``(B, T, d_h)``,
    dtype of ``x``); ``cos`` carries a :class:`RotaryPositions`, which the patched
    ``apply_rotary_pos_emb`` uses to rotate Q and K with :func:`wiola_kernels.srpe`.
    The frequencies come from :func:`rope_srpe_arguments` (every rope type of
    :data:`ROPE_TYPES`; ``dynamic`` and ``longrope`` update ``hf_rotary`` per call as HF does).
    For the ``default`` type, the first eager forward that finds ``hf_rotary.inv_freq``
    materialised checks it is ``θ₀^(−2j/d_h)``; if not, this module returns HF's own tables
    from then on (a warning says so), which the patched function hands to HF's original
    code. The other types use the buffer as it is, so there is nothing to check
    (``buffer_check`` is ``"given"`` when no layer type is ``default``).

    A rotary module serving several attention layer types (Gemma 3's, called as
    ``forward(x, position_ids, layer_type)``, with one ``<layer_type>_inv_freq`` buffer,
    θ₀ and rope type per type) is served alike: ``theta`` is then ``{layer_type: θ₀}``
    (θ₀ is used only by the layer types whose rope type is ``default``).

    ``head_dim`` is the number of features RoPE rotates: the head size, or with a partial
    rotary embedding (Phi-3's ``partial_rotary_factor``) its first part, which is also the
    width of ``(cos, sin)`` (as HF's) and the ``d_h`` of its ``θ₀^(−2j/d_h)``.
    """

    def __init__(self, hf_rotary: nn.Module | None = None, theta: float | dict | None = None,
                 head_dim: int | None = None, modeling: str | None = None, *, config=None, device=None) -> None:
        super().__init__()
        if hf_rotary is None:
            # HF's own constructor form, RotaryEmbedding(config=..., device=...): code that builds a
            # fresh rotary module as type(model.rotary_emb)(config=...) gets a fused one of the
            # config's family (transformers' RoPE tests do; see scripts/hf_suite.py).
            if config is None:
                raise TypeError("FusedRotaryEmbedding takes hf_rotary, theta, head_dim and modeling, or config=")
            built = _fused_rotary_for_config(config, device)
            hf_rotary, head_dim, modeling = built.hf_rotary, built.head_dim, built.modeling
            theta = built.theta if list(built.thetas) == [None] else built.thetas
        elif theta is None or head_dim is None or modeling is None:
            raise TypeError("FusedRotaryEmbedding(hf_rotary, ...) needs theta, head_dim and modeling")
        self.hf_rotary = hf_rotary
        # layer type -> θ₀; the key None: a rotary module with one type (forward(x, position_ids))
        self.thetas = {k: float(v) for k, v in theta.items()} if isinstance(theta, dict) else {None: float(theta)}
        self.theta = self.thetas.get(None)
        self.head_dim = int(head_dim)
        self.modeling = modeling  # name of the transformers modeling module whose RoPE we serve
        self.rope_types = {layer_type: _rope_type(hf_rotary, layer_type) for layer_type in self.thetas}
        self.rope_type = self.rope_types.get(None)
        # "pending" -> "fused" (default RoPE, verified) or "hf" (differs: HF's RoPE); "given":
        # only rope types whose own inv_freq buffer srpe reads, nothing to verify.
        self.buffer_check = "pending" if "default" in self.rope_types.values() else "given"

    def forward(self, x: Tensor, position_ids: Tensor, layer_type: str | None = None) -> tuple[Tensor, Tensor]:
        if not torch.compiler.is_compiling():
            self._eager_checks()
        if self.buffer_check == "hf":
            return self.hf_rotary(x, position_ids) if layer_type is None else self.hf_rotary(x, position_ids,
                                                                                              layer_type)
        if layer_type not in self.thetas:  # as HF's: a module serving several layer types needs one of them
            raise TypeError(f"{type(self).__name__}.forward: layer_type must be one of "
                            f"{', '.join(sorted(map(repr, self.thetas)))}, got {layer_type!r}")
        theta = self.thetas[layer_type]
        if self.rope_types[layer_type] == "default":
            cos, sin = rope_tables(position_ids, theta, self.head_dim, x.dtype)
            setattr(cos, _ROPE_ATTR, RotaryPositions(position_ids, theta, rotary_dim=self.head_dim))
            return cos, sin
        args = rope_srpe_arguments(self.hf_rotary, x, position_ids, layer_type)
        cos, sin = rope_tables(position_ids, theta, self.head_dim, x.dtype, args["inv_freq"], args["scale"])
        setattr(cos, _ROPE_ATTR, RotaryPositions(position_ids, theta, args["inv_freq"], args["scale"], self.head_dim))
        return cos, sin

    def _eager_checks(self) -> None:
        # A deep copy of a patched model is not registered yet: register it on first use,
        # so the patched apply_rotary_pos_emb stays in place while it lives.
        entry = _installed.get(self.modeling)
        if entry is None or id(self) not in entry[1]:
            _install_apply(sys.modules[self.modeling], self)
        if self.buffer_check == "pending":
            buffers = {_rotary_attr_name("inv_freq", layer_type): (getattr(self.hf_rotary,
                       _rotary_attr_name("inv_freq", layer_type), None), theta)
                       for layer_type, theta in self.thetas.items() if self.rope_types[layer_type] == "default"}
            if any(not isinstance(inv_freq, Tensor) or inv_freq.is_meta for inv_freq, _ in buffers.values()):
                return  # not materialised yet (a meta model): decide later
            for name, (inv_freq, theta) in buffers.items():
                why = _inv_freq_mismatch(inv_freq, theta, self.head_dim)
                if why is not None:
                    warnings.warn(f"wiola_kernels.patch_hf: {type(self.hf_rotary).__name__}.{name} holds {why}, "
                                  f"which the fused RoPE does not compute; this model keeps Hugging Face's RoPE",
                                  UserWarning, stacklevel=3)
                    self.buffer_check = "hf"
                    return
            self.buffer_check = "fused"

    def __getattr__(self, name: str):
        # What HF's rotary module holds and this one does not (inv_freq, original_inv_freq,
        # attention_scaling, config, ...) is read from it: code reading model.rotary_emb.inv_freq
        # keeps working on a patched model.
        try:
            return super().__getattr__(name)
        except AttributeError:
            hf_rotary = self.__dict__.get("_modules", {}).get("hf_rotary")
            if hf_rotary is None or not hasattr(hf_rotary, name):
                raise
            return getattr(hf_rotary, name)

    def extra_repr(self) -> str:
        if list(self.thetas) == [None]:
            return f"rope_type={self.rope_type!r}, theta={self.theta}, head_dim={self.head_dim}"
        return f"rope_type={self.rope_types}, theta={self.thetas}, head_dim={self.head_dim}"


def _rotary_attr_name(name: str, layer_type: str | None) -> str:
    """HF's rotary attribute ``name`` (``inv_freq``, ``attention_scaling``, ...) for a layer
    type: ``<layer_type>_<name>`` in a rotary module serving several (Gemma 3)."""
    return name if layer_type is None else f"{layer_type}_{name}"


# Modeling modules whose apply_rotary_pos_emb we replaced: name -> (original function,
# {id(rotary): finalizer} of the FusedRotaryEmbedding modules using it). The original
# comes back when the last of them is unpatched or garbage-collected.
_installed: dict[str, tuple[object, dict[int, weakref.finalize]]] = {}


def _make_apply(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        rope = getattr(cos, _ROPE_ATTR, None)
        if rope is not None:
            return rope.apply(q, k, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__doc__ = ("RoPE through wiola_kernels.srpe for models patched by wiola_kernels.patch_hf; "
                                    "the original function otherwise.")
    return apply_rotary_pos_emb


def _install_apply(modeling, user: nn.Module) -> None:
    name = modeling.__name__
    if name not in _installed:
        original = modeling.apply_rotary_pos_emb
        _installed[name] = (original, {})
        modeling.apply_rotary_pos_emb = _make_apply(original)
    _installed[name][1][id(user)] = weakref.finalize(user, _release_apply, modeling, id(user))


def _release_apply(modeling, key: int) -> None:
    entry = _installed.get(modeling.__name__)
    if entry is None:
        return
    original, users = entry
    users.pop(key, None)
    if not users:
        if getattr(modeling.apply_rotary_pos_emb, "__wrapped__", None) is original:
            modeling.apply_rotary_pos_emb = original
        del _installed[modeling.__name__]


def _uninstall_apply(modeling, user: nn.Module) -> None:
    entry = _installed.get(modeling.__name__)
    if entry is not None:
        finalizer = entry[1].get(id(user))
        if finalizer is not None:
            finalizer.detach()
        _release_apply(modeling, id(user))  # also puts the original back if nobody uses the wrapper


def _family_of_class(cls) -> tuple[str, object] | None:
    """``(model_type, modeling module)`` of the first class in ``cls``'s MRO that is defined in
    the modeling module of a supported type, else None. A class whose config is of another
    type is not of the family (Gemma 3's module also holds the multimodal ``gemma3`` models)."""
    config_type = getattr(getattr(cls, "config_class", None), "model_type", None)
    for base in getattr(cls, "__mro__", ()):
        for model_type in _FAMILIES:
            if base.__module__ == _modeling_name(model_type) and config_type in (None, "", model_type):
                modeling = sys.modules.get(base.__module__)
                if modeling is not None:
                    return model_type, modeling
    return None


def _family(model: nn.Module):
    """``(model_type, modeling module)`` for a supported model, else ``(None, reason)``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    found = _family_of_class(type(model))
    if found is None or found[0] != model_type:
        return None, f"{type(model).__name__} (model_type={model_type!r})"
    return found


def _swap(parent: nn.Module, name: str, new: nn.Module) -> None:
    setattr(parent, name, new)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_theta(config, layer_type: str | None = None):
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))


def _rope_supported(rotary: nn.Module, config, head_dim: int, layer_type: str | None = None,
                    partial: bool = False) -> str | None:
    """None when ``rotary`` is RoPE of a type in :data:`ROPE_TYPES` we can reproduce (for
    ``layer_type``, in a rotary module serving several), else why not. With ``partial`` its
    frequencies may cover fewer than ``head_dim`` features (an even number: the rotated part).
    Reads only the config and metadata (never tensor values), so meta-device modules are
    judged alike."""
    rope_type = _rope_type(rotary, layer_type)
    if rope_type not in ROPE_TYPES:
        return f"rope type {rope_type!r}" + ("" if layer_type is None else f" ({layer_type} layers)")
    inv_freq = getattr(rotary, _rotary_attr_name("inv_freq", layer_type), None)
    if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or inv_freq.shape[0] == 0:
        return "a non-standard rotary embedding"
    rotated = inv_freq.shape[0] * 2
    if rotated > head_dim:
        return "a non-standard rotary embedding"
    if rotated < head_dim and not partial:
        return f"a partial rotary embedding ({rotated} of {head_dim} features)"
    if rope_type != "default":
        return None  # srpe reads the module's own inv_freq and attention_scaling
    scaling = getattr(rotary, _rotary_attr_name("attention_scaling", layer_type), 1.0)
    if scaling != 1.0:
        return f"attention scaling {scaling}"
    theta = _rope_theta(config, layer_type)
    if not isinstance(theta, (int, float)) or not theta > 0:
        return "a non-standard rotary embedding"
    return None


def _fused_rotary(rotary: nn.Module, config, head_dim: int, modeling, family: _Family):
    """The :class:`FusedRotaryEmbedding` for HF's ``rotary`` module, or why there is none
    (a string). The one place where a family's rotary module is turned into srpe's
    arguments (θ₀ and rope type per layer type; a type other than ``default`` reads its
    frequencies per call through :func:`rope_srpe_arguments`)."""
    layer_types = sorted(getattr(rotary, "layer_types", ())) if family.rope == "per_layer_type" else [None]
    if not layer_types:
        return "a rotary embedding without layer types"
    for layer_type in layer_types:
        why = _rope_supported(rotary, config, head_dim, layer_type, partial=family.partial_rotary)
        if why is not None:
            return why
    # The features RoPE rotates: head_dim, or its first part (partial rotary: Phi-3's factor).
    rotated = getattr(rotary, _rotary_attr_name("inv_freq", layer_types[0])).shape[0] * 2
    thetas = {layer_type: _rope_theta(config, layer_type) for layer_type in layer_types}
    # θ₀ of the default type (checked above); the other types read their inv_freq instead.
    thetas = {layer_type: float(theta) if isinstance(theta, (int, float)) and theta > 0 else 10000.0
              for layer_type, theta in thetas.items()}
    return FusedRotaryEmbedding(rotary, thetas if layer_types != [None] else thetas[None], rotated,
                                modeling.__name__)


def _fused_rotary_for_config(config, device=None) -> FusedRotaryEmbedding:
    """A :class:`FusedRotaryEmbedding` around a new HF rotary module of ``config``'s family."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ValueError(f"config has model_type {model_type!r}; the fused RoPE serves {', '.join(_FAMILIES)}")
    family = _FAMILIES[model_type]
    modeling = importlib.import_module(_modeling_name(model_type))
    rotary = getattr(modeling, f"{family.prefix}RotaryEmbedding")(config=config)  # some take no device=
    if device is not None:
        rotary = rotary.to(device)
    fused = _fused_rotary(rotary, config, _head_dim(config), modeling, family)
    if isinstance(fused, str):
        raise ValueError(f"{type(rotary).__name__} uses {fused}, which the fused RoPE does not implement")
    return fused


def _inv_freq_mismatch(inv_freq: Tensor, theta: float, head_dim: int) -> str | None:
    """None when the materialised buffer is the default θ₀^(−2j/d_h) as Hugging Face computes
    it (in float32, then possibly cast: bf16 after ``model.to(bf16)``), else what it holds.
    The fused RoPE uses the float64 ω_j, not the rounded buffer."""
    if not inv_freq.is_floating_point():
        return f"a {inv_freq.dtype} tensor"
    values = inv_freq.detach().to("cpu", torch.float64)
    # HF's own float32 formula is up to ~5 ulp from the float64 θ₀^(−2j/d_h) when d_h is not
    # a power of two (2j/d_h rounded, then amplified by ln θ₀): compare with that formula,
    # within 2 ulp of the buffer's dtype (another device's pow, or a cast of the buffer);
    # a buffer formed in float64 and rounded is accepted too.
    hf = 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    eps = max(torch.finfo(inv_freq.dtype).eps, torch.finfo(torch.float32).eps)
    if torch.allclose(values, hf.to(torch.float64), rtol=2 * eps, atol=0.0):
        return None
    j = torch.arange(head_dim // 2, dtype=torch.float64)
    omega = float(theta) ** (-2.0 * j / head_dim)
    if torch.allclose(values, omega, rtol=max(2e-7, torch.finfo(inv_freq.dtype).eps), atol=0.0):
        return None
    return "inverse frequencies that differ from the default θ₀^(−2j/d_h)"


def is_patched(target) -> bool:
    """Whether :func:`patch_hf` has patched ``target`` and :func:`unpatch_hf` has not undone it:
    a model instance, or (the class-level form) a model class or family name."""
    if isinstance(target, (str, type)):
        found = _class_target(target, strict=False)
        return found is not None and found[0] in _class_patches
    return getattr(_unwrap_peft(target), _RECORD, None) is not None


def _unwrap_peft(model):
    """The ``transformers`` model inside a PEFT wrapper (``PeftModel`` → its tuner, e.g.
    ``LoraModel`` → the model), as the HF Trainer unwraps it; anything else as is. Patching
    the inner model is what patching the wrapper means: the wrapper calls the inner
    model's (patched) ``forward``, and the adapters PEFT put in place of the projections
    (``lora.Linear``) stay where they are — the fused MLPs call them."""
    for _ in range(4):  # PeftModel -> tuner -> model; never loop on a strange object
        if not type(model).__module__.startswith("peft."):
            break
        get_base = getattr(model, "get_base_model", None)
        inner = get_base() if callable(get_base) else getattr(model, "model", None)
        if not isinstance(inner, nn.Module) or inner is model:
            break
        model = inner
    return model


def _check_switches(switches: dict) -> dict:
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool (whether to swap that part), got {type(value).__name__}")
    return switches


def patch_hf(target, *, rms_norm: bool = True, rope: bool = True, mlp: bool = True, loss: bool = True):
    """Swap a Hugging Face model's RMSNorm modules, RoPE, MLP activations and causal-LM loss for this package's fused ops.

    Supported: the models of the families :func:`supported` lists (``config.model_type``
    in ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3_text``, ``phi3``,
    ``olmo2``, ``smollm3``), with any rope type of :data:`ROPE_TYPES`; ``supported()`` says what is
    swapped in each. All or nothing: on any error the model is left exactly as it was
    (see the module docstring). Patching an already patched model does nothing.

    Args:
        target: a ``transformers`` model instance (patched in place); or a model class
            of a supported family, or the family's ``model_type`` (``"llama"``,
            ``"gemma3_text"``, ...; another string is a ``ValueError``): the class-level
            form, which patches every model of that family built from then on (e.g. by
            ``from_pretrained``) until ``unpatch_hf(target)``.
        rms_norm: swap every ``<Family>RMSNorm`` (q/k norms included) for
            :class:`wiola_kernels.modules.RMSNorm`, or Gemma's for
            :class:`FusedOffsetRMSNorm` (sharing the ``weight`` Parameter; the family's
            rounding order).
        rope: apply rotary embeddings with :func:`wiola_kernels.srpe`
            (``k_s = ∞``, ``a_s = 0``: plain rotate-half RoPE, angles reduced in float64;
            a rope type's own ``inv_freq`` and attention factor, see :func:`rope_srpe_arguments`).
        mlp: form each gated MLP's ``act(gate(x)) ⊙ up(x)`` with :func:`wiola_kernels.glu`
            (:class:`FusedGatedMLP` / :class:`FusedPackedGatedMLP`, sharing the projections).
        loss: compute a ``<Family>ForCausalLM``'s training loss with
            :func:`wiola_kernels.linear_cross_entropy`, without the logits (see the module
            docstring; a call's ``return_logits=True`` keeps them).

    Returns:
        ``target`` itself. Unknown architectures are returned untouched with a
        ``UserWarning`` naming them; unsupported rope types keep HF's RoPE, and MLPs with
        another activation than the family's keep HF's MLP, each with a warning naming why.
    """
    switches = _check_switches({"rms_norm": rms_norm, "rope": rope, "mlp": mlp, "loss": loss})
    if isinstance(target, (str, type)):
        return _patch_classes(target, switches)
    if not isinstance(target, nn.Module):
        raise TypeError(f"target must be a transformers model (a torch.nn.Module), a model class or a family name "
                        f"({', '.join(map(repr, _FAMILIES))}), got {type(target).__name__}")
    model = _unwrap_peft(target)
    if is_patched(model):
        return target
    model_type, modeling = _family(model)
    if model_type is None:
        warnings.warn(f"wiola_kernels.patch_hf: unsupported architecture {modeling}; model left untouched "
                      f"(supported: {', '.join(_FAMILIES)})", UserWarning, stacklevel=2)
        return target
    norms, rotary, mlps = _plan(model, model_type, modeling, switches)
    loss_args = _loss_plan(model, model_type, modeling) if switches.get("loss", True) else None
    record = _Patch(modeling.__name__, dict(switches))
    try:
        for parent, name, child, fused in norms:
            _swap(parent, name, fused)
            record.norms.append((parent, name, child))
        for parent, name, child, fused in mlps:
            _swap(parent, name, fused)
            record.mlps.append((parent, name, child))
        for parent, name, child, fused in rotary:
            record.rotary.append((parent, name, child))
            _install_apply(modeling, fused)
            _swap(parent, name, fused)
        if loss_args is not None:
            record.loss_args, record.cache_field = loss_args
            object.__setattr__(model, "forward", types.MethodType(_loss_forward_for(type(model).forward), model))
        object.__setattr__(model, _RECORD, record)
    except BaseException:
        _rollback(record, {id(child): fused for *_, child, fused in norms + rotary + mlps}, modeling)
        _unset_loss_forward(model)
        raise
    return target


# ---- the causal-LM loss ----------------------------------------------------------------

def _loss_plan(model: nn.Module, model_type: str, modeling) -> tuple[tuple, str] | None:
    """``(positional parameter names of the forward, the output's cache field)`` when
    ``model`` is the family's ``ForCausalLM`` with a bias-free linear head, else None."""
    cls = getattr(modeling, f"{_FAMILIES[model_type].prefix}ForCausalLM", None)
    head = getattr(model, "lm_head", None)
    if cls is None or not isinstance(model, cls) or type(model).forward is not cls.forward \
            or not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    if "labels" not in names:
        return None
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = getattr(CausalLMOutputWithPast, "__dataclass_fields__", {})
    return names, "cache" if "cache" in fields else "past_key_values"


def _fused_loss_forward(self, *args, return_logits: bool | None = None, **kwargs):
    """The patched ``<Family>ForCausalLM.forward`` (bound to the instance): HF's forward,
    except that a training-mode call with ``labels`` computes HF's causal-LM loss with
    :func:`wiola_kernels.linear_cross_entropy` and returns ``logits=None``.

    ``return_logits``: True keeps the logits (HF's forward and loss); None (default): keep
    them only in eval mode, as Liger-Kernel does (evaluation loops read them)."""
    record = getattr(self, _RECORD)
    names = record.loss_args
    if len(args) > len(names):
        raise TypeError(f"forward takes at most {len(names)} positional arguments, got {len(args)}")
    kwargs.update(zip(names, args))
    labels = kwargs.pop("labels", None)
    keep = not self.training if return_logits is None else bool(return_logits)
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    if labels is None or keep or not (isinstance(logits_to_keep, int) and logits_to_keep == 0) \
            or getattr(self, "_loss_function", None) is not None:
        return type(self).forward(self, labels=labels, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    kwargs.pop("logits_to_keep", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = self.model(**kwargs)
    hidden = outputs.last_hidden_state
    if shift_labels is None:
        # HF's shift: position t predicts token t + 1; the last position has no target.
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    # Gemma's final-logit soft-capping c·tanh(z/c), read from the config at each call as HF does.
    softcap = getattr(self.config, "final_logit_softcapping", None)
    head_loss = _fsdp_head_loss(self.lm_head) or functools.partial(_head_loss, self.lm_head)
    loss = head_loss(hidden, shift_labels, ignore_index, softcap, num_items)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                 attentions=outputs.attentions,
                                 **{record.cache_field: getattr(outputs, record.cache_field, None)})
    return out.to_tuple() if return_dict is False else out


def _head_loss(head: nn.Linear, hidden, shift_labels, ignore_index, softcap, num_items):
    """HF's causal-LM loss over ``head``'s logits, without them: a sum ÷ ``num_items`` when
    given, else a mean (HF's fixed_cross_entropy)."""
    weight = head.weight
    if torch.is_autocast_enabled(hidden.device.type):  # as autocast runs lm_head's F.linear
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return linear_cross_entropy(hidden, weight.to(hidden.dtype), shift_labels, ignore_index=ignore_index,
                                softcap=softcap, num_items=num_items)


_FSDP_HEAD_METHOD = "wiola_causal_lm_loss"


def _fsdp_head_loss(head: nn.Module):
    """For a head sharded by FSDP2 as its own unit: :func:`_head_loss` as a method of the head
    registered with ``register_fsdp_forward_method``, so FSDP gathers the weight before the
    fused loss reads it and reduces its gradient after, as around ``head(...)`` (the fused
    loss never calls the head). None for any other head (the root unit gathers it)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(head, getattr(fsdp, "FSDPModule", ())):
        return None
    if _FSDP_HEAD_METHOD not in head.__dict__:
        object.__setattr__(head, _FSDP_HEAD_METHOD, types.MethodType(_head_loss, head))
        fsdp.register_fsdp_forward_method(head, _FSDP_HEAD_METHOD)
    return getattr(head, _FSDP_HEAD_METHOD)


_loss_forwards: dict = {}  # a ForCausalLM class's forward -> the fused-loss forward wearing its signature


def _loss_forward_for(cls_forward):
    """:func:`_fused_loss_forward` under ``cls_forward``'s name, docstring and signature
    (``functools.wraps``: ``inspect.signature`` follows ``__wrapped__``), so the patched
    ``model.forward`` has the original's signature: HF's ``generate`` checks its keyword
    arguments (``logits_to_keep``, ...) against it. ``return_logits`` goes through the
    original's ``**kwargs``. Bound to the instance with ``types.MethodType``, so a deep
    copy of the model is bound to the copy."""
    fn = _loss_forwards.get(cls_forward)
    if fn is None:
        @functools.wraps(cls_forward)
        def fn(self, *args, **kwargs):
            return _fused_loss_forward(self, *args, **kwargs)

        fn._wiola_fused_loss = True
        _loss_forwards[cls_forward] = fn
    return fn


def _unset_loss_forward(model: nn.Module) -> None:
    bound = model.__dict__.get("forward")
    if getattr(getattr(bound, "__func__", None), "_wiola_fused_loss", False):
        object.__delattr__(model, "forward")


def _fused_norm(child: nn.Module, family: _Family) -> nn.Module:
    """The stand-in for one of the family's RMSNorm modules (sharing its ``weight``)."""
    if family.norms == "one_plus_gamma_fp32":
        return FusedOffsetRMSNorm(child.weight, child.eps)
    return RMSNorm(eps=child.variance_epsilon, hf_order=family.norms == "gamma_rounded", weight=child.weight)


def _plan(model: nn.Module, model_type: str, modeling, switches: dict) -> tuple[list, list, list]:
    """Every swap to make, as ``(parent, name, original, replacement)``, built before any is
    made (so a failure here changes nothing)."""
    family = _FAMILIES[model_type]
    prefix = family.prefix
    norm_cls = getattr(modeling, f"{prefix}RMSNorm", None)
    rotary_cls = getattr(modeling, f"{prefix}RotaryEmbedding", None)
    # Collect first, then swap: swapping while iterating named_modules would revisit.
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    norms, rotary = [], []
    if switches["rms_norm"] and norm_cls is not None:
        for parent, name, child in targets:
            if type(child) is norm_cls:  # the layer norms and the q/k norms alike
                fused = _fused_norm(child, family)
                fused.train(child.training)
                norms.append((parent, name, child, fused))
    if switches["rope"] and rotary_cls is not None and callable(getattr(modeling, "apply_rotary_pos_emb", None)):
        config = model.config
        head_dim = _head_dim(config)
        for parent, name, child in targets:
            if type(child) is not rotary_cls:
                continue
            fused = _fused_rotary(child, config, head_dim, modeling, family)
            if isinstance(fused, str):
                warnings.warn(f"wiola_kernels.patch_hf: {type(model).__name__} uses {fused}, which the fused RoPE "
                              f"does not implement; its rotary embedding is left untouched (RMSNorm is still "
                              f"swapped)", UserWarning, stacklevel=3)
                continue
            fused.train(child.training)
            rotary.append((parent, name, child, fused))
    mlps = []
    mlp_cls = getattr(modeling, f"{prefix}MLP", None)
    if switches["mlp"] and mlp_cls is not None:
        found = [(parent, name, child) for parent, name, child in targets if type(child) is mlp_cls]
        packed = family.mlp.startswith("packed_")
        activation = family.mlp.removeprefix("packed_")
        act_attr = "hidden_activation" if hasattr(model.config, "hidden_activation") else "hidden_act"
        act = getattr(model.config, act_attr, None)
        if found and act not in _ACTIVATIONS[activation]:
            warnings.warn(f"wiola_kernels.patch_hf: {type(model).__name__} uses {act_attr}={act!r}, not "
                          f"{' or '.join(_ACTIVATIONS[activation])}; its MLPs are left untouched", UserWarning,
                          stacklevel=3)
            found = []
        fused_cls = FusedPackedGatedMLP if packed else FusedGatedMLP
        for parent, name, child in found:
            if not all(isinstance(getattr(child, part, None), nn.Module) for part in fused_cls.parts):
                raise TypeError(f"wiola_kernels.patch_hf: {type(child).__name__} at {name!r} lacks one of "
                                f"{', '.join(fused_cls.parts)}; nothing was patched (call patch_hf(model, "
                                f"mlp=False) to patch the rest)")
            fused = fused_cls(child, activation)
            fused.train(child.training)
            mlps.append((parent, name, child, fused))
    return norms, rotary, mlps


def _rollback(record: _Patch, replacement: dict, modeling) -> None:
    """Undo a partly applied patch (the swaps recorded so far), newest first."""
    for parent, name, child in reversed(record.rotary):
        fused = replacement[id(child)]
        nn.Module.__setattr__(parent, name, child)
        _uninstall_apply(modeling, fused)
    for parent, name, child in reversed(record.mlps):
        nn.Module.__setattr__(parent, name, child)
    for parent, name, child in reversed(record.norms):
        nn.Module.__setattr__(parent, name, child)


def unpatch_hf(target):
    """Undo :func:`patch_hf`.

    On a model: the original RMSNorm, rotary-embedding and MLP modules go back in place
    (holding the current ``weight`` Parameters, buffers and projection modules, so weights
    loaded or moved after patching are kept), the instance's fused-loss ``forward`` is removed,
    and the modeling module's ``apply_rotary_pos_emb`` is restored
    once no patched model of that family remains. On a model class or family name: models
    of the family built from now on are no longer patched (those already built stay
    patched until unpatched themselves). Anything not patched is returned as is."""
    if isinstance(target, (str, type)):
        return _unpatch_classes(target)
    if not isinstance(target, nn.Module):
        raise TypeError(f"target must be a transformers model (a torch.nn.Module), a model class or a family name "
                        f"({', '.join(map(repr, _FAMILIES))}), got {type(target).__name__}")
    model = _unwrap_peft(target)
    record = getattr(model, _RECORD, None)
    if record is None:
        return target
    for parent, name, original in record.norms:
        fused = getattr(parent, name)
        if isinstance(fused, (RMSNorm, FusedOffsetRMSNorm)):
            # model.to()/to_empty()/load_state_dict may have replaced the Parameter: hand back the current one.
            if fused.weight is not original.weight:
                original.weight = fused.weight
            original.train(fused.training)
        _swap(parent, name, original)
    for parent, name, original in record.mlps:
        fused = getattr(parent, name)
        if isinstance(fused, (FusedGatedMLP, FusedPackedGatedMLP)):
            # hand back the projections as they are now (an adapter may have wrapped them)
            for part in fused.parts:
                if getattr(fused, part) is not getattr(original, part):
                    setattr(original, part, getattr(fused, part))
            original.train(fused.training)
        _swap(parent, name, original)
    for parent, name, original in record.rotary:
        fused = getattr(parent, name)
        if isinstance(fused, FusedRotaryEmbedding):
            _uninstall_apply(sys.modules[record.modeling], fused)
            original = fused.hf_rotary  # the same module, moved and initialised with the model
        _swap(parent, name, original)
    _unset_loss_forward(model)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module) and _FSDP_HEAD_METHOD in head.__dict__:
        object.__delattr__(head, _FSDP_HEAD_METHOD)
    object.__delattr__(model, _RECORD)
    return target


# ---- the class-level form ----------------------------------------------------------

@dataclass
class _ClassPatch:
    switches: dict
    inits: dict  # class -> its own __init__ before we wrapped it (None: it had none, inherited)


_class_patches: dict[str, _ClassPatch] = {}  # model_type -> what patch_hf(<class>) changed
_constructing = threading.local()  # depth of nested family-model constructors in this thread


def _class_target(target, strict: bool = True) -> tuple[str, object] | None:
    """``(model_type, modeling module)`` of a family name or model class."""
    if isinstance(target, str):
        if target not in _FAMILIES:
            if not strict:
                return None
            raise ValueError(f"family must be one of {', '.join(map(repr, _FAMILIES))}, got {target!r}")
        return target, importlib.import_module(_modeling_name(target))
    if not isinstance(target, type) or not issubclass(target, nn.Module):
        if not strict:
            return None
        raise TypeError(f"target must be a transformers model class, got {target!r}")
    return _family_of_class(target)


def _family_classes(model_type: str, modeling) -> list[type]:
    """The family's model classes (``<Family>PreTrainedModel`` subclasses of its modeling module
    whose config is the family's: Gemma 3's module also holds the multimodal ``gemma3`` models)."""
    base = getattr(modeling, f"{_FAMILIES[model_type].prefix}PreTrainedModel")
    return [c for c in vars(modeling).values()
            if isinstance(c, type) and issubclass(c, base) and c is not base and c.__module__ == modeling.__name__
            and getattr(getattr(c, "config_class", None), "model_type", model_type) == model_type]


def _wrap_init(model_type: str, init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_constructing, "depth", 0)
        _constructing.depth = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _constructing.depth = depth
        patch = _class_patches.get(model_type)
        if depth == 0 and patch is not None and not is_patched(self):
            patch_hf(self, **patch.switches)  # the outermost model of the family, fully built

    __init__._wiola_wrapped = init
    return __init__


def _patch_classes(target, switches: dict):
    found = _class_target(target)
    if found is None:
        warnings.warn(f"wiola_kernels.patch_hf: unsupported architecture {target.__name__}; class left untouched "
                      f"(supported: {', '.join(_FAMILIES)})", UserWarning, stacklevel=3)
        return target
    model_type, modeling = found
    if model_type in _class_patches:  # patched already: the new switches apply from now on
        _class_patches[model_type].switches = dict(switches)
        return target
    patch = _ClassPatch(dict(switches), {})
    try:
        for cls in _family_classes(model_type, modeling):
            own = cls.__dict__.get("__init__")
            patch.inits[cls] = own
            cls.__init__ = _wrap_init(model_type, cls.__init__)
        _class_patches[model_type] = patch
    except BaseException:
        _restore_inits(patch)
        raise
    return target


def _restore_inits(patch: _ClassPatch) -> None:
    for cls, own in reversed(list(patch.inits.items())):
        if own is None:
            if "__init__" in cls.__dict__:
                del cls.__init__
        else:
            cls.__init__ = own


def _unpatch_classes(target):
    found = _class_target(target)
    if found is None:
        return target
    patch = _class_patches.pop(found[0], None)
    if patch is not None:
        _restore_inits(patch)
    return target


def format_rope_accuracy(rows: list[dict]) -> str:
    """:func:`rope_accuracy`'s rows as a table."""
    lines = [f"{'position':>10} {'patched (srpe) vs f64':>22} {'HF float32 vs f64':>18}   "
             f"(relative error of rotated float32 q/k, d_h 64, θ₀ 10000)"]
    lines += [f"{r['position']:>10} {r['ours']:>22.2e} {r['hf']:>18.2e}" for r in rows]
    return "\n".join(lines)


ROPE_POSITIONS = (1024, 4096, 16384, 65536, 2**18, 2**20 - 1)


def rope_accuracy(positions=ROPE_POSITIONS, head_dim: int = 64, theta: float = 10000.0, heads: int = 4,
                  seed: int = 0) -> list[dict]:
    """RoPE accuracy at large positions: for each ``p`` in ``positions`` (a window of 64
    positions ending at ``p``), the relative error against float64 RoPE of the patched
    path (:func:`wiola_kernels.srpe`, ``k_s = ∞``, ``a_s = 0``) and of Hugging Face's
    float32 RoPE (``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``), on float32 q/k.

    Returns one dict per position: ``{"position", "ours", "hf"}``. Needs transformers.
    """
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ml

    config = LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max(int(p) for p in positions) + 1,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    hf_rotary = ml.LlamaRotaryEmbedding(config)
    apply = getattr(ml.apply_rotary_pos_emb, "__wrapped__", ml.apply_rotary_pos_emb)  # HF's own, even if patched
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p in positions:
        pos = torch.arange(int(p) - 63, int(p) + 1).clamp(min=0).unsqueeze(0)  # (1, 64)
        q = torch.randn(1, heads, pos.shape[1], head_dim, generator=g)
        k = torch.randn(1, heads, pos.shape[1], head_dim, generator=g)
        # float64 truth: ω_j = θ₀^(−2j/d_h) and p·ω_j in float64 (error ~p·2^-52 rad).
        j = torch.arange(head_dim // 2, dtype=torch.float64)
        angle = pos.to(torch.float64)[:, None, :, None] * theta ** (-2.0 * j / head_dim)
        cos, sin = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
        truth = [apply(x.double(), x.double(), cos, sin, 1)[0] for x in (q, k)]
        ours = RotaryPositions(pos, theta).apply(q, k)
        hf = apply(q, k, *hf_rotary(q, pos))
        err = lambda outs: max(float(torch.linalg.vector_norm(o.double() - t) / torch.linalg.vector_norm(t))
                               for o, t in zip(outs, truth))
        rows.append({"position": int(p), "ours": err(ours), "hf": err(hf)})
    return rows
