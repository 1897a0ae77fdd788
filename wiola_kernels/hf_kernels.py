"""This package's layers for Hugging Face's ``kernels`` switch: :func:`kernel_mapping` / :func:`kernel_config`.

transformers marks the layers a kernel may replace (``@use_kernel_forward_from_hub(name)``
on a class, ``@use_kernelized_func`` for a function) and the ``kernels`` package swaps
their ``forward`` for a *layer* registered under that name, for a device type and a mode
(``kernels.kernelize(model, mode=..., device=...)``, or ``from_pretrained(...,
use_kernels=True)``). This module registers ours, offline: each repository object in the
mapping hands ``kernels`` a layer class from this package (no Hub download, no kernel
build directory; ``kernels`` accepts any object with a ``load()`` that returns the layer).

Layers (stateless ``nn.Module`` classes: their ``forward`` reads the attributes of the
module whose ``forward`` they replace, as ``kernels`` requires):

* ``"RMSNorm"`` → :class:`layers.RMSNorm`: ``γ ⊙ x/r`` through :func:`wiola_kernels.rms_norm`
  with Hugging Face's rounding order (``hf_order=True``) on the module's ``weight`` and
  ``variance_epsilon``. transformers decorates this name on every RMSNorm of that form
  (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3 and ~130 others). Gemma's ``x̂ · (1 + γ)``
  norm and OLMo-2's carry no decorator in transformers 5.25: nothing to register for them.
* ``"rotary_pos_emb"`` (the ``apply_rotary_pos_emb`` function) → :class:`layers.ApplyRotaryPosEmb`:
  Q and K rotated by :func:`wiola_kernels.srpe` (``k_s = ∞, a_s = 0``: rotate-half RoPE with
  the angles reduced in float64) when the ``cos`` table comes from our rotary embedding
  below, which attaches the positions to it; HF's own rotation of the tables otherwise.
* ``"WiolaRotaryEmbedding"`` → :class:`layers.RotaryEmbedding`: the ``<Family>RotaryEmbedding``
  module is not decorated by transformers, and the rotary function only sees the ``(cos,
  sin)`` tables, not the positions ``srpe`` needs. :func:`kernel_mapping` therefore marks
  the rotary-embedding classes of the families listed in :data:`ROTARY_FAMILIES` with
  ``kernels.replace_kernel_forward_from_hub`` (the ``kernels`` way of extending a
  third-party layer: it adds the class attributes ``kernel_layer_name`` and
  ``kernel_condition``, nothing else), for instances whose rope type is ``default`` and
  whose ``inv_freq`` is the default one. Without our mapping, ``kernelize`` keeps their
  own ``forward``. Our forward returns HF's ``(cos, sin)`` (same shapes and dtype, angles
  in float64) with the positions attached. Other rope types keep HF's tables and HF's
  rotation (``srpe`` with given frequencies would serve them: see ``_rope_of``).

Not reachable through this switch in transformers 5.25: the gated MLP (only the
activation is decorated, which cannot fuse the product) and the causal-LM loss.
:func:`wiola_kernels.patch_hf` swaps those (and RoPE for every family it knows).

Registered for the devices ``cpu`` and ``cuda`` and the modes ``TRAINING``,
``INFERENCE`` and both with ``TORCH_COMPILE`` (every layer has a backward and compiles
without graph breaks). Tested with ``kernels`` 0.19.1 + transformers 5.25 and ``kernels``
0.16.2 + transformers 5.17 (each transformers release pins the ``kernels`` range it accepts).

Example::

    import kernels, wiola_kernels as wk
    from transformers import AutoModelForCausalLM

    # 1. kernels' own call, on any model built already:
    with kernels.use_kernel_mapping(wk.kernel_mapping()):
        model = kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")

    # 2. transformers' switch, when loading (stays on across model.train() / .eval()):
    model = AutoModelForCausalLM.from_pretrained(path, use_kernels=True, kernel_config=wk.kernel_config())

``kernels`` and transformers are imported lazily: ``wiola_kernels`` imports without them.
"""

from __future__ import annotations

import importlib
import inspect
import math

import torch
from torch import Tensor, nn

from .ops.rms_norm import rms_norm
from .ops.srpe import srpe

__all__ = ["kernel_mapping", "kernel_config", "layers", "LAYER_NAMES", "ROTARY_FAMILIES", "register_rotary_layers"]

# transformers' model types whose <Prefix>RotaryEmbedding.forward(x, position_ids) feeds a
# decorated apply_rotary_pos_emb: model_type -> class-name prefix.
ROTARY_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
                   "smollm3": "SmolLM3", "gemma": "Gemma", "gemma2": "Gemma2"}
ROTARY_LAYER = "WiolaRotaryEmbedding"  # the name we give the rotary-embedding classes
_TAG = "_wiola_kernels_rope"  # attribute of the cos table that carries the positions


class _Rope:
    """What our rotary embedding attaches to its ``cos`` table: the positions, θ₀ and the
    rotated width, for :func:`_apply_rope`."""

    __slots__ = ("position_ids", "theta", "head_dim")

    def __init__(self, position_ids: Tensor, theta: float, head_dim: int) -> None:
        self.position_ids = position_ids
        self.theta = theta
        self.head_dim = head_dim


def _apply_rope(rope: _Rope, q: Tensor, k: Tensor, unsqueeze_dim: int) -> tuple[Tensor, Tensor]:
    """RoPE of ``q``, ``k`` through :func:`wiola_kernels.srpe`, laid out ``(B, H, T, d_h)``
    (``unsqueeze_dim=1``) or ``(B, T, H, d_h)`` (``unsqueeze_dim=2``), as HF's function."""
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    b, h, t, dh = q.shape
    h_kv = k.shape[1]
    # srpe's default frequencies θ₀^(−2j/d_h). Given frequencies (yarn, llama3, ...) would
    # pass inv_freq= (float64) and scale= (the attention factor) here.
    rope_kw = dict(spiral_divisor=math.inf, radial_amplitude=0.0, radial_frequency=0.0)
    if q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous():
        # HF's q/k are (B, T, H, d_h) projections viewed as (B, H, T, d_h); as (B·T, H, 1,
        # d_h) they are already the kernel's layout: no copy in, and the outputs come back
        # as the same kind of view.
        pos = rope.position_ids.to(q.device).expand(b, t).reshape(b * t, 1)
        q_out, k_out = srpe(q.transpose(1, 2).reshape(b * t, h, 1, dh), k.transpose(1, 2).reshape(b * t, h_kv, 1, dh),
                            pos, rope.theta, **rope_kw)
        q_out, k_out = q_out.view(b, t, h, dh).transpose(1, 2), k_out.view(b, t, h_kv, dh).transpose(1, 2)
    else:
        q_out, k_out = srpe(q, k, rope.position_ids.to(q.device), rope.theta, **rope_kw)
    if unsqueeze_dim == 2:
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta) if theta is not None else getattr(config, "rope_theta", None)


def _rope_of(module: nn.Module, check_values: bool = True) -> tuple[float, int] | None:
    """``(θ₀, rotated width)`` when ``module`` (a ``<Family>RotaryEmbedding``) computes
    default RoPE, which ``srpe`` reproduces; None for anything else (other rope types,
    an attention scale, a hand-edited ``inv_freq``): that module keeps HF's forward.
    ``check_values``: also compare ``inv_freq``'s values (not while compiling: a
    data-dependent branch). With ``srpe``'s given frequencies, ``module.inv_freq``
    (recomputed in float64) and ``module.attention_scaling`` would cover the other rope
    types here."""
    inv_freq = getattr(module, "inv_freq", None)
    theta = _rope_theta(getattr(module, "config", None))
    if getattr(module, "rope_type", None) != "default" or getattr(module, "attention_scaling", 1.0) != 1.0 \
            or not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or theta is None or theta <= 0:
        return None
    dim = 2 * inv_freq.numel()
    if check_values and not inv_freq.is_meta:  # a meta buffer is computed by HF's init later
        # HF's own float32 formula: it is up to ~5 ulp from the float64 θ₀^(−2j/d) (j/d
        # rounded, then amplified by ln θ₀), so compare with it, not with float64, allowing
        # another device's pow or a cast of the buffer (model.to(bf16)).
        want = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        got = inv_freq.detach().to("cpu", torch.float32)
        if not torch.allclose(got, want, rtol=2 * torch.finfo(inv_freq.dtype).eps, atol=0.0):
            return None
    return theta, dim


def _serves_rope(module: nn.Module) -> bool:
    """The registration's condition (``kernels`` >= 0.17 asks it per instance at kernelize time)."""
    return _rope_of(module) is not None


class layers:  # noqa: N801  (the namespace ``kernels`` reads layers from: ``<kernel>.layers.<name>``)
    """The layer classes, by the names :func:`kernel_mapping` gives ``kernels``."""

    class RMSNorm(nn.Module):
        """``forward`` of a Llama-style RMSNorm (``weight``, ``variance_epsilon``):
        ``γ · round(x/r)`` through :func:`wiola_kernels.rms_norm` (``hf_order=True``)."""

        has_backward = True
        can_torch_compile = True

        def forward(self, hidden_states: Tensor) -> Tensor:
            weight = self.weight
            if weight.dtype != hidden_states.dtype:
                # HF multiplies γ (its own dtype) by x/r rounded to x's dtype, so the
                # output dtype is promoted: normalise with γ = 1 (exact), then multiply.
                ones = torch.ones(hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
                return weight * rms_norm(hidden_states, ones, None, self.variance_epsilon, hf_order=True)
            return rms_norm(hidden_states, weight, None, self.variance_epsilon, hf_order=True)

    class RotaryEmbedding(nn.Module):
        """``forward`` of a ``<Family>RotaryEmbedding``: HF's ``(cos, sin)`` tables
        (``(B, T, d)``, the halves repeated, in ``x``'s dtype) from float64 angles, the
        ``cos`` table carrying the positions for :class:`ApplyRotaryPosEmb`. Put only on
        modules whose rope is the default one (the registration's condition); where
        ``kernels`` has no condition (< 0.17), any other rope runs the class's own forward."""

        has_backward = True
        can_torch_compile = True

        def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
            rope = _rope_of(self, check_values=not torch.compiler.is_compiling())
            if rope is None:  # kernels < 0.17 has no per-instance condition: decide here
                return type(self).forward(self, x, position_ids)
            theta, dim = rope
            j = torch.arange(0, dim, 2, dtype=torch.float64, device=position_ids.device)
            angle = position_ids[..., None].to(torch.float64) * torch.pow(theta, -j / dim)
            emb = torch.cat((angle, angle), dim=-1)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            setattr(cos, _TAG, _Rope(position_ids, theta, dim))
            return cos, sin

    class ApplyRotaryPosEmb(nn.Module):
        """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``: :func:`wiola_kernels.srpe`
        when ``cos`` comes from :class:`RotaryEmbedding`, HF's rotation of the tables
        otherwise (a rotary embedding we do not serve)."""

        has_backward = True
        can_torch_compile = True

        def forward(self, q, k, cos, sin, unsqueeze_dim=1):
            rope = getattr(cos, _TAG, None)
            if rope is not None and q.dim() == 4 and k.dim() == 4 and q.shape[-1] == rope.head_dim \
                    and unsqueeze_dim in (1, 2):
                return _apply_rope(rope, q, k, unsqueeze_dim)
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


# kernel layer name (transformers' decorator name) -> our layer's name in ``layers``
LAYER_NAMES = {"RMSNorm": "RMSNorm", "rotary_pos_emb": "ApplyRotaryPosEmb", ROTARY_LAYER: "RotaryEmbedding"}


class Repository:
    """A ``kernels`` repository (its ``RepositoryProtocol``: ``load()`` returns the layer
    class) that serves a layer of :class:`layers` from this installed package: nothing is
    downloaded or built. ``layer_name``: the class's name in :class:`layers`."""

    def __init__(self, layer_name: str) -> None:
        if not isinstance(getattr(layers, layer_name, None), type):
            raise ValueError(f"layer_name must be one of {', '.join(sorted(set(LAYER_NAMES.values())))}, "
                             f"got {layer_name!r}")
        self.layer_name = layer_name

    def load(self) -> type[nn.Module]:
        """The layer class (``kernels`` validates it against the module it replaces)."""
        return getattr(layers, self.layer_name)

    def __eq__(self, other) -> bool:
        return isinstance(other, Repository) and other.layer_name == self.layer_name

    def __hash__(self) -> int:
        return hash((Repository, self.layer_name))

    def __repr__(self) -> str:
        return f"wiola_kernels.hf_kernels.Repository({self.layer_name!r})"

    __str__ = __repr__


def register_rotary_layers(families=None) -> list[type]:
    """Mark the ``<Prefix>RotaryEmbedding`` classes of ``families`` (model types, default:
    every one of :data:`ROTARY_FAMILIES`) as the ``kernels`` layer ``"WiolaRotaryEmbedding"``
    (``kernels.replace_kernel_forward_from_hub``), for instances that compute default RoPE.
    Idempotent; :func:`kernel_mapping` calls it. A family whose modeling module or class
    is missing in the installed transformers is skipped. The name is also registered with
    ``kernels`` for no device, so ``kernelize`` without our mapping keeps those classes'
    own ``forward`` silently (with ``use_fallback=False`` it raises, as for any layer with
    no kernel for the device).

    Args:
        families: iterable of model types (keys of :data:`ROTARY_FAMILIES`), or None.

    Returns:
        The classes marked.

    Raises:
        ValueError: a family not in :data:`ROTARY_FAMILIES`.
        ImportError: ``kernels`` is not installed.
    """
    from kernels import register_kernel_mapping, replace_kernel_forward_from_hub

    families = list(ROTARY_FAMILIES) if families is None else list(families)
    unknown = [f for f in families if f not in ROTARY_FAMILIES]
    if unknown:
        raise ValueError(f"families must be among {', '.join(ROTARY_FAMILIES)}, got {unknown}")
    marked = []
    for family in families:
        try:
            modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        cls = getattr(modeling, f"{ROTARY_FAMILIES[family]}RotaryEmbedding", None)
        apply = getattr(modeling, "apply_rotary_pos_emb", None)
        # Only where the rotary function is decorated: otherwise nothing would use the positions.
        if cls is None or getattr(apply, "kernel_layer_name", None) != "rotary_pos_emb":
            continue
        if cls.__dict__.get("kernel_layer_name") != ROTARY_LAYER:
            if "condition" in inspect.signature(replace_kernel_forward_from_hub).parameters:  # kernels >= 0.17
                replace_kernel_forward_from_hub(cls, ROTARY_LAYER, condition=_serves_rope)
            else:  # our forward hands other rope types back to the class's own
                replace_kernel_forward_from_hub(cls, ROTARY_LAYER)
        marked.append(cls)
    if marked:
        # The name with no device: a kernelize outside our mapping (transformers' from_pretrained
        # runs one by default) keeps the class's own forward without a "no kernel mapping" warning.
        register_kernel_mapping({ROTARY_LAYER: {}})
    return marked


def kernel_mapping(devices=("cpu", "cuda")) -> dict:
    """The mapping to give ``kernels.use_kernel_mapping`` (or ``register_kernel_mapping``):
    each layer name → device type → mode → a :class:`Repository` of this package, for the
    modes ``TRAINING``, ``INFERENCE`` and each with ``TORCH_COMPILE``. Also marks the
    rotary-embedding classes (:func:`register_rotary_layers`).

    Args:
        devices: device types to register (``"cpu"``, ``"cuda"``).

    Returns:
        ``{"RMSNorm": {"cpu": {Mode.TRAINING: Repository("RMSNorm"), ...}, "cuda": ...}, ...}``

    Raises:
        ValueError: a device type other than ``"cpu"`` / ``"cuda"``.
        ImportError: ``kernels`` is not installed.
    """
    from kernels import Mode

    devices = (devices,) if isinstance(devices, str) else tuple(devices)
    bad = [d for d in devices if d not in ("cpu", "cuda")]
    if bad or not devices:
        raise ValueError(f"devices must be 'cpu' and/or 'cuda', got {devices!r}")
    register_rotary_layers()
    modes = (Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE, Mode.INFERENCE | Mode.TORCH_COMPILE)
    return {name: {device: dict.fromkeys(modes, Repository(ours)) for device in devices}
            for name, ours in LAYER_NAMES.items()}


_config_class = None


def kernel_config(inherit_mapping: bool = True):
    """A ``transformers.KernelConfig`` that serves :func:`kernel_mapping` to
    ``from_pretrained(..., use_kernels=True, kernel_config=wk.kernel_config())``.

    transformers' own ``KernelConfig`` takes Hub strings (``"org/repo:Layer"``) or a local
    kernel build directory, for one mode (the model's at loading time: inference) and not
    the ``cpu`` device. This subclass hands transformers the whole mapping instead (cpu and
    cuda, every mode), so ``model.train()`` after loading re-kernelizes onto our layers too.

    Args:
        inherit_mapping: keep transformers' default mapping for the layers we do not
            serve (ours replace its entries for the names above).

    Returns:
        A ``KernelConfig`` instance.

    Raises:
        ImportError: transformers or ``kernels`` is not installed.
    """
    global _config_class
    if _config_class is None:
        from transformers import KernelConfig

        class WiolaKernelConfig(KernelConfig):
            """``KernelConfig`` whose mapping is :func:`wiola_kernels.hf_kernels.kernel_mapping`."""

            def __init__(self, inherit_mapping: bool = True) -> None:
                # Empty until create_compatible_mapping: from_pretrained first reads the
                # mapping as Hub strings (register_kernel_replacements_and_fusions).
                super().__init__(kernel_mapping={}, use_local_kernel=False, inherit_mapping=inherit_mapping)

            def sanitize_kernel_mapping(self, model) -> None:
                self.store_registered_layer_names(model)  # our mapping is well-formed by construction

            def create_compatible_mapping(self, model, compile: bool = False) -> None:
                self.kernel_mapping = kernel_mapping()

        _config_class = WiolaKernelConfig
    kernel_mapping()  # fail here, not inside from_pretrained, if kernels is missing
    return _config_class(inherit_mapping=inherit_mapping)
