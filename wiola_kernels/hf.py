"""Drop-in fused kernels for Hugging Face Llama-family models: :func:`patch_hf` / :func:`unpatch_hf`.

``patch_hf(model)`` swaps, on that model instance, every RMSNorm module and the
rotary-embedding application of ``LlamaForCausalLM``, ``MistralForCausalLM`` and
``Qwen2ForCausalLM`` (or their bare ``*Model``) for this package's fused ops, on
whatever backend :mod:`wiola_kernels.dispatch` picks (C++ on CPU tensors, Triton/CUDA on
GPUs), for training and inference:

* RMSNorm: each ``<Family>RMSNorm`` becomes a :class:`wiola_kernels.modules.RMSNorm`
  sharing its ``weight`` Parameter (``state_dict`` keys and optimizer state unchanged),
  with δ = 0 (no shift) and Hugging Face's rounding order (normalise in float32, round
  to the input dtype, then multiply by γ), so bf16/fp16 outputs match HF's.
* RoPE: WiolaRMSNorm's sibling SRPE with ``k_s = ∞`` and ``a_s = 0`` is rotate-half
  RoPE. The model's ``rotary_emb`` (which computes float32 cos/sin tables) is replaced by
  a module that hands the positions on to the attention layers, and the modeling
  module's ``apply_rotary_pos_emb`` by a function that applies :func:`wiola_kernels.srpe`
  to Q and K in one launch when it receives those positions (and calls the original
  otherwise, so unpatched models of the same class are unaffected). Angles are
  reduced in float64: the rotation stays float32-accurate at large positions, where
  HF's float32 ``inv_freq · p`` does not (``python -m wiola_kernels bench --hf rope`` prints both errors).

Only the default rope type is swapped; other types (``llama3``, ``yarn``, ``dynamic``,
...) keep HF's rotary embedding, with a warning that names the type (RMSNorm is still
swapped). Models of other architectures are left untouched, with a warning naming them.
``unpatch_hf(model)`` puts the original modules and function back.

Transformers is imported lazily: ``wiola_kernels`` itself does not need it.
"""

from __future__ import annotations

import math
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .modules.rms_norm import RMSNorm
from .ops.srpe import srpe

__all__ = ["patch_hf", "unpatch_hf", "is_patched"]

# model_type -> class-name prefix in transformers.models.<type>.modeling_<type>. The three
# families share LlamaRMSNorm's arithmetic, hence the HF rounding order for all of them.
_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
_HF_ORDER = {"llama": True, "mistral": True, "qwen2": True}
_RECORD = "_wiola_hf_patch"


@dataclass
class _Patch:
    """What patch_hf changed on one model, to undo it."""

    modeling: str                                     # name of the transformers modeling module
    norms: list = field(default_factory=list)         # (parent, attribute name, original module)
    rotary: list = field(default_factory=list)        # (parent, attribute name, original module)


class RotaryPositions:
    """What the patched rotary embedding returns in place of ``(cos, sin)``: the
    positions and RoPE's θ₀, applied to Q and K by the patched ``apply_rotary_pos_emb``."""

    __slots__ = ("position_ids", "theta")

    def __init__(self, position_ids: Tensor, theta: float) -> None:
        self.position_ids = position_ids
        self.theta = theta

    def apply(self, q: Tensor, k: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
        """RoPE of ``q``, ``k`` laid out ``(B, H, T, d_h)`` (``unsqueeze_dim=1``) or
        ``(B, T, H, d_h)`` (``unsqueeze_dim=2``)."""
        if unsqueeze_dim == 2:
            q_rot, k_rot = self.apply(q.transpose(1, 2), k.transpose(1, 2))
            return q_rot.transpose(1, 2), k_rot.transpose(1, 2)
        if unsqueeze_dim != 1:
            raise ValueError(f"unsqueeze_dim must be 1 (B, H, T, d_h) or 2 (B, T, H, d_h), got {unsqueeze_dim}")
        b, h, t, dh = q.shape
        h_kv = k.shape[1]
        if q.dim() == 4 and k.dim() == 4 and q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous():
            # HF's q/k are (B, T, H, d_h) projections viewed as (B, H, T, d_h). As
            # (B·T, H, 1, d_h) they are already in the kernel's layout: no copy in, and the
            # outputs come back as the same kind of view (what HF's own RoPE returns too).
            pos = self.position_ids.to(q.device).expand(b, t).reshape(b * t, 1)
            q_flat = q.transpose(1, 2).reshape(b * t, h, 1, dh)
            k_flat = k.transpose(1, 2).reshape(b * t, h_kv, 1, dh)
            q_out, k_out = srpe(q_flat, k_flat, pos, self.theta, spiral_divisor=math.inf, radial_amplitude=0.0,
                                radial_frequency=0.0)
            return q_out.view(b, t, h, dh).transpose(1, 2), k_out.view(b, t, h_kv, dh).transpose(1, 2)
        return srpe(q, k, self.position_ids, self.theta, spiral_divisor=math.inf, radial_amplitude=0.0,
                    radial_frequency=0.0)

    def __iter__(self):  # unpacks like HF's (cos, sin)
        return iter((self, self))


class FusedRotaryEmbedding(nn.Module):
    """Stands in for a model's ``<Family>RotaryEmbedding``: instead of float32 cos/sin
    tables, returns :class:`RotaryPositions` for the patched ``apply_rotary_pos_emb``."""

    def __init__(self, theta: float, head_dim: int, modeling: str) -> None:
        super().__init__()
        self.theta = float(theta)
        self.head_dim = int(head_dim)
        self.modeling = modeling  # name of the transformers modeling module whose RoPE we serve

    def forward(self, x: Tensor, position_ids: Tensor) -> RotaryPositions:
        # A deep copy of a patched model is not registered yet: register it on first use,
        # so the patched apply_rotary_pos_emb stays in place while it lives.
        entry = _installed.get(self.modeling)
        if entry is None or id(self) not in entry[1]:
            _install_apply(sys.modules[self.modeling], self)
        return RotaryPositions(position_ids, self.theta)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, head_dim={self.head_dim}"


# Modeling modules whose apply_rotary_pos_emb we replaced: name -> (original function,
# {id(rotary): finalizer} of the FusedRotaryEmbedding modules using it). The original
# comes back when the last of them is unpatched or garbage-collected.
_installed: dict[str, tuple[object, dict[int, weakref.finalize]]] = {}


def _make_apply(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if isinstance(cos, RotaryPositions):
            return cos.apply(q, k, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__doc__ = ("RoPE through wiola_kernels.srpe for models patched by wiola_kernels.patch_hf; "
                                    "the original function otherwise.")
    return apply_rotary_pos_emb


def _install_apply(modeling, user: nn.Module) -> None:
    name = modeling.__name__
    if name not in _installed:
        original = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = _make_apply(original)
        _installed[name] = (original, {})
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
    if entry is not None and id(user) in entry[1]:
        entry[1][id(user)].detach()
        _release_apply(modeling, id(user))


def _family(model: nn.Module):
    """``(model_type, modeling module)`` for a supported model, else ``(None, reason)``."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    modeling = sys.modules.get(type(model).__module__)
    if model_type not in _FAMILIES or modeling is None or not type(model).__module__.endswith(f"modeling_{model_type}"):
        return None, f"{type(model).__name__} (model_type={model_type!r})"
    return model_type, modeling


def _swap(parent: nn.Module, name: str, new: nn.Module) -> None:
    setattr(parent, name, new)


def _rope_supported(rotary: nn.Module, config, head_dim: int) -> str | None:
    """None when ``rotary`` is default RoPE we can reproduce, else why not."""
    rope_type = getattr(rotary, "rope_type", None)
    if rope_type != "default":
        return f"rope type {rope_type!r}"
    if getattr(rotary, "attention_scaling", 1.0) != 1.0:
        return f"attention scaling {rotary.attention_scaling}"
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    inv_freq = getattr(rotary, "inv_freq", None)
    if theta is None or inv_freq is None or inv_freq.numel() * 2 != head_dim:
        return "a partial or non-standard rotary embedding"
    # The buffer must be the default θ₀^(−2j/d_h) rounded to its dtype (float32, or bf16
    # after model.to(bf16)): anything else (a hand-edited buffer) is not what we compute.
    # We use the float64 ω_j, not the rounded buffer.
    j = torch.arange(head_dim // 2, dtype=torch.float64)
    omega = (float(theta) ** (-2.0 * j / head_dim))
    rtol = max(2e-7, torch.finfo(inv_freq.dtype).eps) if inv_freq.is_floating_point() else 0.0
    if not torch.allclose(inv_freq.detach().double().cpu(), omega, rtol=rtol, atol=0.0):
        return "inverse frequencies that differ from the default θ₀^(−2j/d_h)"
    return None


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch_hf` has patched ``model`` (and :func:`unpatch_hf` has not undone it)."""
    return getattr(model, _RECORD, None) is not None


def patch_hf(model: nn.Module, *, rms_norm: bool = True, rope: bool = True) -> nn.Module:
    """Swap ``model``'s RMSNorm modules and RoPE for this package's fused ops, in place.

    Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
    the other heads/bare models of those three families (``config.model_type`` in
    ``llama``, ``mistral``, ``qwen2``), with the default rope type. Patching an already
    patched model does nothing.

    Args:
        model: a ``transformers`` model instance.
        rms_norm: swap every ``<Family>RMSNorm`` for :class:`wiola_kernels.modules.RMSNorm`
            (shares the ``weight`` Parameter; HF's rounding order).
        rope: apply rotary embeddings with :func:`wiola_kernels.srpe`
            (``k_s = ∞``, ``a_s = 0``: plain rotate-half RoPE, angles reduced in float64).

    Returns:
        ``model`` itself. Unknown architectures are returned untouched with a
        ``UserWarning`` naming them; unsupported rope types keep HF's RoPE, with a
        warning naming the type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if is_patched(model):
        return model
    model_type, modeling = _family(model)
    if model_type is None:
        warnings.warn(f"wiola_kernels.patch_hf: unsupported architecture {modeling}; model left untouched "
                      f"(supported: {', '.join(_FAMILIES)})", UserWarning, stacklevel=2)
        return model
    prefix = _FAMILIES[model_type]
    norm_cls = getattr(modeling, f"{prefix}RMSNorm", None)
    rotary_cls = getattr(modeling, f"{prefix}RotaryEmbedding", None)
    record = _Patch(modeling.__name__)
    # Collect first, then swap: swapping while iterating named_modules would revisit.
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    if rms_norm and norm_cls is not None:
        for parent, name, child in targets:
            if type(child) is norm_cls:
                fused = RMSNorm(eps=child.variance_epsilon, hf_order=_HF_ORDER[model_type], weight=child.weight)
                _swap(parent, name, fused)
                record.norms.append((parent, name, child))
    if rope and rotary_cls is not None and hasattr(modeling, "apply_rotary_pos_emb"):
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        for parent, name, child in targets:
            if type(child) is not rotary_cls:
                continue
            why = _rope_supported(child, config, head_dim)
            if why is not None:
                warnings.warn(f"wiola_kernels.patch_hf: {type(model).__name__} uses {why}, which the fused RoPE "
                              f"does not implement; its rotary embedding is left untouched (RMSNorm is still "
                              f"swapped)", UserWarning, stacklevel=2)
                continue
            params = getattr(config, "rope_parameters", None) or {}
            theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
            fused = FusedRotaryEmbedding(theta, head_dim, modeling.__name__)
            _swap(parent, name, fused)
            _install_apply(modeling, fused)
            record.rotary.append((parent, name, child))
    object.__setattr__(model, _RECORD, record)
    return model


def unpatch_hf(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_hf` on ``model``: the original RMSNorm and rotary-embedding
    modules go back in place (holding the current ``weight`` Parameters), and the
    modeling module's ``apply_rotary_pos_emb`` is restored once no patched model of
    that family remains. A model that is not patched is returned as is."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    record = getattr(model, _RECORD, None)
    if record is None:
        return model
    for parent, name, original in record.norms:
        fused = getattr(parent, name)
        # model.to()/load_state_dict may have replaced the Parameter: hand back the current one.
        if isinstance(fused, RMSNorm) and fused.weight is not original.weight:
            original.weight = fused.weight
        _swap(parent, name, original)
    for parent, name, original in record.rotary:
        fused = getattr(parent, name)
        if isinstance(fused, FusedRotaryEmbedding):
            _uninstall_apply(sys.modules[record.modeling], fused)
        _swap(parent, name, original)
    object.__delattr__(model, _RECORD)
    return model


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
