"""WiolaConfig: the hyper-parameters of a Wiola decoder (SPEC §1).

Field names are the ones of the published ``wiola-360m`` ``config.json`` (SPEC §1), so
``WiolaConfig.from_pretrained(dir)`` / ``WiolaConfig.from_json_file(path)`` read that
file as is. Two fields go beyond the paper: ``gcla_summary`` (how GCLA summarises a
layer, SPEC §5.1) and ``kernel_backend`` (which ``wiola_kernels`` backend runs the ops).

Validation (SPEC §1; ``check()``, run on construction and again when a model is built):
every field's type and range is checked, and a bad value raises a ``ValueError`` naming
the field — sizes are positive ints (not floats, not bools), ``hidden_size`` equals
``num_attention_heads × head_dim``, ``num_key_value_heads`` divides ``num_attention_heads``,
``head_dim`` is even, real-valued fields are finite numbers, ``gcla_summary`` and
``kernel_backend`` are one of their choices, ``atm_threshold`` lies in [−1, 1], token ids
lie in the vocabulary.

Required and defaulted fields. ``WiolaConfig(**kwargs)`` defaults every field to
wiola-360m (Hugging Face builds ``WiolaConfig()`` itself). A ``config.json`` (read by
``from_pretrained``, ``from_json_file``, ``from_dict``, ``AutoConfig``) must give the
fields that fix the tensor shapes, :data:`REQUIRED_FIELDS`; a missing one is a
``ValueError`` naming it, never a silent 360m default. The other fields default to the
SPEC §1 values (``head_dim`` to ``hidden_size / num_attention_heads``), so the published
``wiola-360m`` ``config.json`` loads as is. A ``model_type`` other than ``"wiola"`` is
refused. Unknown extra keys are kept as attributes, as Hugging Face does (a newer
version's fields, ``architectures``, ``transformers_version``…), but one that looks like a
misspelt Wiola field (``hiden_size``) gives a ``UserWarning`` naming the likely field.

Gradient checkpointing: ``WiolaConfig(..., gradient_checkpointing=True)`` (Hugging Face
turns it on when the model is built) or ``model.gradient_checkpointing_enable()``.

Presets by name::

    WiolaConfig.from_name("wiola-360m")                    # the published model
    WiolaConfig.from_name("wiola-tiny", num_hidden_layers=3)  # overrides win
"""

from __future__ import annotations

import difflib
import math
import warnings
from numbers import Real
from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig

SUMMARY_MODES = ("causal", "paper")
KERNEL_BACKENDS = ("auto", "reference", "cpu", "cuda", "triton")
#: Fields a config.json must give: they fix the shapes of the weights (and the longest sequence).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "dsff_narrow_size", "dsff_wide_size", "max_position_embeddings")
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "max_position_embeddings", "dsff_narrow_size", "dsff_wide_size")
_REALS = ("rms_norm_eps", "srpe_theta", "srpe_spiral_divisor", "srpe_radial_amplitude", "srpe_radial_frequency",
          "gcla_gate_init", "atm_threshold", "initializer_range")
_BOOLS = ("atm_enabled", "use_cache", "tie_word_embeddings")

# Nominal sizes of the paper (SPEC §1). Presets keep d_h = 64, H_kv = H/4, n = d, w = 4d.
PRESETS: dict[str, dict[str, Any]] = {
    "wiola-120m": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=3,
                       dsff_narrow_size=768, dsff_wide_size=3072),
    "wiola-360m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                       dsff_narrow_size=1024, dsff_wide_size=4096),
    "wiola-700m": dict(hidden_size=1536, num_hidden_layers=14, num_attention_heads=24, num_key_value_heads=6,
                       dsff_narrow_size=1536, dsff_wide_size=6144),
    "wiola-1.5b": dict(hidden_size=2048, num_hidden_layers=18, num_attention_heads=32, num_key_value_heads=8,
                       dsff_narrow_size=2048, dsff_wide_size=8192),
    # For tests and the training demo: a byte-level vocabulary (3 special ids + 256 bytes),
    # 6 layers so that the middle third (layers 2 and 3) merges tokens under ATM.
    "wiola-tiny": dict(vocab_size=259, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, dsff_narrow_size=128, dsff_wide_size=512,
                       max_position_embeddings=1024),
}
#: Nominal parameter counts the presets are checked against (±5%, SPEC §1).
NOMINAL_PARAMETERS = {"wiola-120m": 120e6, "wiola-360m": 360e6, "wiola-700m": 700e6, "wiola-1.5b": 1.5e9}


@strict(accept_kwargs=True)
class WiolaConfig(PretrainedConfig):
    """Configuration of a Wiola decoder. Defaults are wiola-360m (SPEC §1)."""

    model_type = "wiola"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["cache", "past_key_values"]  # the name before transformers 5.2x

    vocab_size: int = 32000                       # V
    hidden_size: int = 1024                       # d (= H·d_h)
    num_hidden_layers: int = 16                   # L
    num_attention_heads: int = 16                 # H query heads
    num_key_value_heads: int = 4                  # H_kv key/value heads; head h uses group h mod H_kv
    head_dim: int | None = None                   # d_h; None → d / H
    max_position_embeddings: int = 2048           # longest sequence a forward accepts (SRPE is accurate far beyond)
    rms_norm_eps: float = 1e-6                    # ε of every WiolaRMSNorm
    srpe_theta: int | float = 10000.0             # θ₀, SRPE base frequency
    srpe_spiral_divisor: int | float = 8          # k_s: angles grow by (1 + 1/k_s)
    srpe_radial_amplitude: int | float = 0.1      # a_s: radius 1 + a_s sin(p f_s ω_j)
    srpe_radial_frequency: int | float = 0.01     # f_s
    gcla_lookback: int = 2                        # Λ: summaries of this many earlier layers form the context
    gcla_gate_init: int | float = -3.0            # g₀: σ(−3) ≈ 0.047, GCLA starts near plain attention
    gcla_summary: str = "causal"                  # "causal" prefix means (default) | "paper" sequence means
    dsff_narrow_size: int = 1024                  # n, SiLU-gated narrow stream
    dsff_wide_size: int = 4096                    # w, tanh-GELU-gated wide stream
    atm_threshold: int | float = 0.92             # τ: merge neighbours with cosine similarity > τ
    atm_enabled: bool = True                      # ATM in the middle third of layers, training only
    kernel_backend: str = "auto"                  # "auto" | "reference" | "cpu" | "cuda" | "triton"
    initializer_range: int | float = 0.02         # std of the normal init of every matrix
    use_cache: bool = True                        # generate() keeps a KV + summary cache (causal mode)
    tie_word_embeddings: bool = True              # output head = embedding matrix
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = 0

    def __post_init__(self, **kwargs):
        model_type = kwargs.get("model_type", self.model_type)
        if model_type != self.model_type:
            raise ValueError(f"WiolaConfig.model_type must be {self.model_type!r}, got {model_type!r}")
        if self.head_dim is None and _is_int(self.hidden_size) and _is_int(self.num_attention_heads) \
                and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.check()  # plain ValueError naming the field (strict's own errors wrap it otherwise)
        _warn_misspelt(kwargs)
        super().__post_init__(**kwargs)

    def check(self) -> None:
        """Check every Wiola field; errors are ``ValueError`` naming the field and what it must be."""
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"WiolaConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"WiolaConfig.num_key_value_heads ({self.num_key_value_heads}) must divide "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise ValueError(f"WiolaConfig.head_dim must be even (SRPE rotates pairs), got {self.head_dim}")
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"WiolaConfig.head_dim × num_attention_heads ({self.head_dim} × "
                             f"{self.num_attention_heads}) must equal hidden_size ({self.hidden_size})")
        if not _is_int(self.gcla_lookback) or self.gcla_lookback < 0:
            raise ValueError(f"WiolaConfig.gcla_lookback must be an int ≥ 0, got {self.gcla_lookback!r}")
        for name in ("gcla_summary", "kernel_backend"):
            value, choices = getattr(self, name), SUMMARY_MODES if name == "gcla_summary" else KERNEL_BACKENDS
            if not isinstance(value, str) or value not in choices:
                raise ValueError(f"WiolaConfig.{name} must be one of {choices}, got {value!r}")
        for name in _REALS:
            value = getattr(self, name)
            if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"WiolaConfig.{name} must be a finite number, got {value!r}")
        for name in ("rms_norm_eps", "srpe_theta", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WiolaConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.srpe_spiral_divisor == 0:
            raise ValueError("WiolaConfig.srpe_spiral_divisor must be non-zero (angles use 1 + 1/k_s)")
        if not -1.0 <= self.atm_threshold <= 1.0:
            raise ValueError(f"WiolaConfig.atm_threshold must be a cosine similarity in [-1, 1], "
                             f"got {self.atm_threshold!r}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"WiolaConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
            if value is not None and not all(_is_int(i) and 0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"WiolaConfig.{name} must be None or an int in [0, vocab_size = {self.vocab_size})"
                                 f"{' (or a list of them)' if name == 'eos_token_id' else ''}, got {value!r}")

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        """Hugging Face ``from_dict`` (used by ``from_pretrained`` and ``AutoConfig``), with the
        :data:`REQUIRED_FIELDS` required and the result checked after ``kwargs`` overrides."""
        if not isinstance(config_dict, dict):
            raise ValueError(f"WiolaConfig: a config must be a JSON object, got {type(config_dict).__name__}")
        missing = [name for name in REQUIRED_FIELDS if name not in config_dict and name not in kwargs]
        if missing:
            raise ValueError(f"WiolaConfig: config.json is missing the required field(s) {', '.join(missing)} "
                             f"(required: {', '.join(REQUIRED_FIELDS)})")
        if "model_type" in kwargs:  # get_config_dict lets kwargs override the file's model_type
            raise ValueError(f"WiolaConfig.model_type cannot be overridden (got {kwargs['model_type']!r})")
        out = super().from_dict(dict(config_dict), **kwargs)
        (out[0] if isinstance(out, tuple) else out).check()  # kwargs were set after construction
        return out

    @classmethod
    def from_json_file(cls, json_file):
        """A ``config.json`` read like ``from_pretrained`` reads it (required fields, checks)."""
        return cls.from_dict(cls._dict_from_json_file(json_file))

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "WiolaConfig":
        """A preset by name (``wiola-120m``, ``wiola-360m``, ``wiola-700m``, ``wiola-1.5b``, ``wiola-tiny``)."""
        if name not in PRESETS:
            raise ValueError(f"WiolaConfig.from_name: name must be one of {sorted(PRESETS)}, got {name!r}")
        return cls(**{**PRESETS[name], **overrides})

    # SPEC §2: ATM runs in layers L/3 ≤ ℓ < 2L/3 (integer division).
    def is_merge_layer(self, layer_idx: int) -> bool:
        return self.num_hidden_layers // 3 <= layer_idx < 2 * self.num_hidden_layers // 3


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _warn_misspelt(extra: dict[str, Any]) -> None:
    """Unknown keys are kept (Hugging Face style); warn about one that looks like a typo of a Wiola field."""
    known = set(WiolaConfig.__dataclass_fields__)
    for key in extra:
        if key in known:
            continue
        close = difflib.get_close_matches(key, [f for f in WiolaConfig.__annotations__ if f not in extra], 1, 0.85)
        if close:
            warnings.warn(f"WiolaConfig: unknown field {key!r} is kept but unused; did you mean {close[0]!r}?",
                          UserWarning, stacklevel=3)


__all__ = ["KERNEL_BACKENDS", "NOMINAL_PARAMETERS", "PRESETS", "REQUIRED_FIELDS", "SUMMARY_MODES", "WiolaConfig"]
