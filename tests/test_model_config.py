"""The model's configuration (SPEC §1): the defaults, the presets and their parameter counts
from SPEC's formulas (not from the code), config.json loaded every way, and every bad field
refused naming it — in keyword arguments and in config.json, through every loader."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from wiola import WiolaConfig, WiolaForCausalLM
from wiola.configuration_wiola import PRESETS, REQUIRED_FIELDS

SEED_CONFIG = Path(__file__).parent / "data" / "wiola-360m-config.json"  # copy of shared/seed
SEED = json.loads(SEED_CONFIG.read_text())

# A tiny, valid config (2 layers, d 64): the bad-field table starts from it.
TINY = dict(vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, dsff_narrow_size=64, dsff_wide_size=128, max_position_embeddings=16)

SPEC_DEFAULTS = dict(
    hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
    head_dim=64, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-6,
    srpe_theta=10000, srpe_spiral_divisor=8, srpe_radial_amplitude=0.1,
    srpe_radial_frequency=0.01, gcla_lookback=2, gcla_gate_init=-3.0,
    dsff_narrow_size=1024, dsff_wide_size=4096, atm_threshold=0.92, atm_enabled=True,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---- parameter counts: SPEC §1's formula ---------------------------------------------------

def per_layer_count(d, H, H_kv, d_h, n, w):
    """SPEC §1's per-layer breakdown: attention, GCLA context projections, gate, DSFF, norms."""
    attn = d * H * d_h + 2 * d * H_kv * d_h + H * d_h * d
    ctx = 2 * d * H * d_h
    gate = H
    dsff = 2 * d * n + n * d + 2 * d * w + w * d + d
    norms = 4 * d
    return attn, ctx, gate, dsff, norms


def analytic_count(V, d, L, H, H_kv, d_h, n, w):
    return V * d + L * sum(per_layer_count(d, H, H_kv, d_h, n, w)) + 2 * d  # tied head, final norm


def count(config: WiolaConfig) -> int:
    with torch.device("meta"):
        model = WiolaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates the tied head


def test_360m_breakdown_is_the_specs():
    """SPEC §1: 360,007,936 = embedding 32,768,000 + 16 × 20,452,368 (2,621,440 + 2,097,152
    + 16 + 15,729,664 + 4,096) + final norm 2,048 — the formula's, then the model's, by layer."""
    attn, ctx, gate, dsff, norms = per_layer_count(1024, 16, 4, 64, 1024, 4096)
    assert (attn, ctx, gate, dsff, norms) == (2_621_440, 2_097_152, 16, 15_729_664, 4_096)
    assert attn + ctx + gate + dsff + norms == 20_452_368
    assert analytic_count(32000, 1024, 16, 16, 4, 64, 1024, 4096) == 360_007_936
    with torch.device("meta"):
        model = WiolaForCausalLM(WiolaConfig.from_name("wiola-360m"))
    params = dict(model.named_parameters())
    emb = [p for p in params.values() if p.shape == (32000, 1024)]
    assert len(emb) == 1 and emb[0].numel() == 32_768_000
    for layer in range(16):
        lp = {k: p for k, p in params.items() if re.search(rf"\blayers\.{layer}\.", k)}
        assert sum(p.numel() for p in lp.values()) == 20_452_368, layer
        # 16 gate values, one β of size d, two norms of (γ, δ)
        assert sorted(p.numel() for p in lp.values() if p.dim() == 1) == [16] + [1024] * 5
    assert sum(p.numel() for k, p in params.items() if "layers." not in k and p.dim() == 1) == 2_048


@pytest.mark.parametrize("name, d, L, H, H_kv, nominal", [
    ("wiola-120m", 768, 8, 12, 3, 116.6e6),
    ("wiola-360m", 1024, 16, 16, 4, 360.0e6),
    ("wiola-700m", 1536, 14, 24, 6, 693.4e6),
    ("wiola-1.5b", 2048, 18, 32, 8, 1537.9e6),
])
def test_presets_are_the_specs(name, d, L, H, H_kv, nominal):
    """SPEC §1: d_h 64, n = d, w = 4d, V 32000; the count is the formula's, SPEC's rounded
    figure, and within ±5% of the paper's nominal size."""
    cfg = WiolaConfig.from_name(name)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (d, L, H, H_kv)
    assert (cfg.head_dim, cfg.dsff_narrow_size, cfg.dsff_wide_size, cfg.vocab_size) == (64, d, 4 * d, 32000)
    n = count(cfg)
    assert n == analytic_count(32000, d, L, H, H_kv, 64, d, 4 * d)
    assert abs(n - nominal) < 0.05e6 + 1  # "116.6M" etc. within rounding
    paper_size = {"wiola-120m": 120e6, "wiola-360m": 360e6, "wiola-700m": 700e6, "wiola-1.5b": 1.5e9}[name]
    assert abs(n / paper_size - 1) <= 0.05


def test_tiny_preset_and_overrides():
    config = WiolaConfig.from_name("wiola-tiny", num_hidden_layers=3)
    assert config.num_hidden_layers == 3 and config.vocab_size == 259
    assert set(PRESETS) == {"wiola-120m", "wiola-360m", "wiola-700m", "wiola-1.5b", "wiola-tiny"}
    # SPEC §2: the middle third L/3 ≤ ℓ < 2L/3, integer division: layers 5..9 of 16
    assert [i for i in range(16) if WiolaConfig().is_merge_layer(i)] == [5, 6, 7, 8, 9]
    small = WiolaConfig(vocab_size=61, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, dsff_narrow_size=24, dsff_wide_size=40)
    assert count(small) == analytic_count(61, 32, 6, 4, 2, 8, 24, 40)


@pytest.mark.parametrize("make", [lambda: WiolaConfig(), lambda: WiolaConfig.from_name("wiola-360m")],
                         ids=["default", "preset"])
def test_section1_defaults(make):
    cfg = make()
    for key, value in SPEC_DEFAULTS.items():
        got = getattr(cfg, key)
        assert got == value and type(got) is not str, (key, got, value)
    assert cfg.gcla_summary == "causal"  # SPEC §5.1: the model default


# ---- config.json: loaded every way, required fields, defaults, unknown keys ---------------------

def test_seed_config_loads_every_way_without_warnings(tmp_path):
    folder = write_config(tmp_path, SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        configs = [WiolaConfig.from_json_file(SEED_CONFIG), WiolaConfig.from_pretrained(folder),
                   AutoConfig.from_pretrained(folder)]
    for config in configs:
        assert isinstance(config, WiolaConfig)
        assert all(getattr(config, key) == value for key, value in SPEC_DEFAULTS.items())
        assert (config.gcla_summary, config.kernel_backend) == ("causal", "auto")
    assert count(configs[0]) == count(configs[2]) == 360_007_936


@pytest.mark.parametrize("field", REQUIRED_FIELDS)
def test_missing_required_field_is_named(tmp_path, field):
    assert field in SEED
    folder = write_config(tmp_path, {k: v for k, v in SEED.items() if k != field})
    for load in (WiolaConfig.from_pretrained, AutoConfig.from_pretrained, WiolaForCausalLM.from_pretrained,
                 AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=f"missing the required field.*{field}"):
            load(folder)
    with pytest.raises(ValueError, match=field):
        WiolaConfig.from_json_file(folder / "config.json")


def test_defaulted_fields_may_be_left_out(tmp_path):
    """Every other field of the seed config has the SPEC §1 default."""
    defaults = WiolaConfig()
    optional = [k for k in SEED if k not in REQUIRED_FIELDS and k not in ("model_type", "architectures",
                                                                           "transformers_version", "dtype")]
    assert "srpe_theta" in optional and "atm_threshold" in optional
    minimal = {k: v for k, v in SEED.items() if k not in optional}
    config = WiolaConfig.from_pretrained(write_config(tmp_path, minimal))
    for name in optional:
        assert getattr(config, name) == getattr(defaults, name) == SEED[name], name
    assert config.head_dim == 64  # derived: hidden_size / num_attention_heads


def test_unknown_keys_are_kept_and_typos_warned(tmp_path):
    folder = write_config(tmp_path / "a", {**SEED, "future_field": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert WiolaConfig.from_pretrained(folder).future_field == 3
    folder = write_config(tmp_path / "b", {**SEED, "atm_treshold": 0.5})  # misspelt: the default stays
    with pytest.warns(UserWarning, match="atm_treshold.*atm_threshold"):
        config = WiolaConfig.from_pretrained(folder)
    assert config.atm_threshold == 0.92
    with pytest.warns(UserWarning, match="did you mean 'gcla_summary'"):
        WiolaConfig(**TINY, gcla_sumary="paper")


# ---- bad fields --------------------------------------------------------------------------------

BAD_VALUES = [
    ("hidden_size", "64"), ("hidden_size", 64.0), ("hidden_size", 0), ("hidden_size", -64), ("hidden_size", True),
    ("hidden_size", 96),                  # ≠ num_attention_heads · head_dim
    ("vocab_size", "many"), ("vocab_size", None), ("vocab_size", 0),
    ("num_hidden_layers", 2.5), ("num_hidden_layers", 0), ("num_hidden_layers", -1),
    ("num_attention_heads", 3),           # 3 · 16 ≠ 64
    ("num_key_value_heads", 3),           # does not divide 4
    ("num_key_value_heads", 0), ("head_dim", 15), ("head_dim", 8), ("head_dim", "16"),
    ("max_position_embeddings", 0), ("max_position_embeddings", 1e3), ("dsff_narrow_size", -1),
    ("dsff_wide_size", [128]), ("dsff_wide_size", 0),
    ("gcla_summary", "future"), ("gcla_summary", None), ("gcla_summary", ["causal"]), ("kernel_backend", "gpu"),
    ("gcla_lookback", -1), ("gcla_lookback", 1.5),
    ("atm_threshold", 1.5), ("atm_threshold", -1.01), ("atm_threshold", "high"), ("atm_threshold", float("nan")),
    ("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-6), ("rms_norm_eps", "1e-6"), ("rms_norm_eps", float("inf")),
    ("srpe_theta", 0), ("srpe_spiral_divisor", 0), ("srpe_radial_amplitude", None), ("gcla_gate_init", "x"),
    ("initializer_range", 0), ("atm_enabled", "yes"), ("use_cache", 1), ("tie_word_embeddings", "false"),
    ("bos_token_id", 259), ("pad_token_id", -1), ("eos_token_id", [2, 999]), ("eos_token_id", 2.0),
    # SPEC §9: d_h odd, with H·d_h = d otherwise consistent
    ("head_dim", dict(hidden_size=36, num_attention_heads=4, num_key_value_heads=2, head_dim=9)),
]


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_bad_field_is_named_in_kwargs_and_config_json(tmp_path, field, value):
    changes = value if isinstance(value, dict) else {field: value}
    with pytest.raises(ValueError, match=field):
        WiolaConfig(**{**TINY, **changes})
    folder = write_config(tmp_path, {**TINY, "model_type": "wiola", **changes})
    for load in (WiolaConfig.from_pretrained, AutoConfig.from_pretrained, WiolaForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=field):
            load(folder)


def test_presets_name_the_choices_and_check_overrides():
    with pytest.raises(ValueError, match="wiola-360m"):
        WiolaConfig.from_name("wiola-9b")
    with pytest.raises(ValueError, match="hidden_size"):
        WiolaConfig.from_name("wiola-tiny", hidden_size=0)


def test_exact_atm_threshold_bounds_and_int_reals_are_accepted():
    for tau in (-1, -1.0, 1, 1.0):
        assert WiolaConfig(**TINY, atm_threshold=tau).atm_threshold == tau
    assert WiolaConfig(**TINY, srpe_theta=500000, rms_norm_eps=1).srpe_theta == 500000


def test_wrong_model_type_is_refused(tmp_path):
    folder = write_config(tmp_path, {**SEED, "model_type": "llama"})
    for load in (WiolaConfig.from_pretrained, WiolaForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match="model_type"):
            load(folder)
    with pytest.raises(ValueError, match="model_type"):
        WiolaConfig(**TINY, model_type="llama")
    with pytest.raises(ValueError, match="model_type"):
        WiolaConfig.from_pretrained(write_config(tmp_path / "ok", SEED), model_type="llama")


def test_from_pretrained_overrides_are_checked(tmp_path):
    folder = write_config(tmp_path, SEED)
    with pytest.raises(ValueError, match="hidden_size"):
        WiolaConfig.from_pretrained(folder, hidden_size="1024")
    with pytest.raises(ValueError, match="atm_threshold"):
        AutoConfig.from_pretrained(folder, atm_threshold=2.0)


def test_a_config_broken_after_construction_is_refused_by_the_model():
    config = WiolaConfig(**TINY)
    config.num_key_value_heads = 3
    with pytest.raises(ValueError, match="num_key_value_heads"):
        WiolaForCausalLM(config)
