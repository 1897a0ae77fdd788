"""WiolaConfig: the hyper-parameters of a Wiola decoder (SPEC §1).

Field names are the ones of the published ``wiola-360m`` ``config.json`` (SPEC §1), so
``WiolaConfig.from_pretrained(dir)`` / ``WiolaConfig.from_json_file(path)`` read that
file as is. Two fields go beyond the paper: ``gcla_summary`` (how GCLA summarises a
layer, SPEC §5.1) and ``kernel_backend`` (which ``wiola_kernels`` backend runs the ops).

Gradient checkpointing: ``WiolaConfig(..., gradient_checkpointing=True)`` (Hugging Face
turns it on when the model is built) or ``model.gradient_checkpointing_enable()``.

Presets by name::

    WiolaConfig.from_name("wiola-360m")                    # the published model
    WiolaConfig.from_name("wiola-tiny", num_hidden_layers=3)  # overrides win
"""

from __future__ import annotations

from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig

SUMMARY_MODES = ("causal", "paper")
KERNEL_BACKENDS = ("auto", "reference", "cpu", "cuda", "triton")

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
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["cache"]

    vocab_size: int = 32000                       # V
    hidden_size: int = 1024                       # d (= H·d_h)
    num_hidden_layers: int = 16                   # L
    num_attention_heads: int = 16                 # H query heads
    num_key_value_heads: int = 4                  # H_kv key/value heads; head h uses group h mod H_kv
    head_dim: int | None = None                   # d_h; None → d / H
    max_position_embeddings: int = 2048           # longest sequence trained on (SRPE itself has no limit)
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
        if self.head_dim is None and isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int) \
                and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.check()  # plain ValueError naming the field (strict's own errors wrap it otherwise)
        super().__post_init__(**kwargs)

    def check(self) -> None:
        """Check every Wiola field; errors name the field and what it must be."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "max_position_embeddings", "dsff_narrow_size", "dsff_wide_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"WiolaConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"WiolaConfig.num_key_value_heads ({self.num_key_value_heads}) must divide "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise ValueError(f"WiolaConfig.head_dim must be even (SRPE rotates pairs), got {self.head_dim}")
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"WiolaConfig.head_dim × num_attention_heads ({self.head_dim} × "
                             f"{self.num_attention_heads}) must equal hidden_size ({self.hidden_size})")
        if not isinstance(self.gcla_lookback, int) or self.gcla_lookback < 0:
            raise ValueError(f"WiolaConfig.gcla_lookback must be an int ≥ 0, got {self.gcla_lookback!r}")
        if self.gcla_summary not in SUMMARY_MODES:
            raise ValueError(f"WiolaConfig.gcla_summary must be one of {SUMMARY_MODES}, got {self.gcla_summary!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"WiolaConfig.kernel_backend must be one of {KERNEL_BACKENDS}, "
                             f"got {self.kernel_backend!r}")
        for name in ("rms_norm_eps", "srpe_theta", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WiolaConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.srpe_spiral_divisor == 0:
            raise ValueError("WiolaConfig.srpe_spiral_divisor must be non-zero (angles use 1 + 1/k_s)")
        if not -1.0 <= self.atm_threshold <= 1.0:
            raise ValueError(f"WiolaConfig.atm_threshold must be a cosine similarity in [-1, 1], "
                             f"got {self.atm_threshold!r}")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "WiolaConfig":
        """A preset by name (``wiola-120m``, ``wiola-360m``, ``wiola-700m``, ``wiola-1.5b``, ``wiola-tiny``)."""
        if name not in PRESETS:
            raise ValueError(f"WiolaConfig.from_name: name must be one of {sorted(PRESETS)}, got {name!r}")
        return cls(**{**PRESETS[name], **overrides})

    preset = from_name

    # SPEC §2: ATM runs in layers L/3 ≤ ℓ < 2L/3 (integer division).
    def is_merge_layer(self, layer_idx: int) -> bool:
        return self.num_hidden_layers // 3 <= layer_idx < 2 * self.num_hidden_layers // 3


__all__ = ["KERNEL_BACKENDS", "NOMINAL_PARAMETERS", "PRESETS", "SUMMARY_MODES", "WiolaConfig"]
