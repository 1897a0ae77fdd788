"""Black-box tests of the reference model (`wiola`) written from SPEC.md alone.

Everything here is checked against an independent float64 oracle written in this file
straight from SPEC §2-§7 (embedding, WRMSNorm, SRPE, GQA with group `h mod H_kv`,
cross-layer sub-attention over the summaries of the up-to-Λ previous layers, the gate,
DSFF, both summary modes, ATM in the middle third in training, tied head). Only public
names are used: `WiolaConfig`, `WiolaForCausalLM`, `PRESETS`, `named_parameters`,
`forward(input_ids, position_ids, cache, use_cache)`, `generate`. Parameter names are
mapped from `named_parameters()` (nn.Linear stores `W^T`, so `X W_Q = X @ q_proj.weight.T`;
head `h` occupies columns `h·d_h … (h+1)·d_h` of every projection).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import wiola
from wiola import WiolaConfig, WiolaForCausalLM

from oracles import ModelOracle

F64 = torch.float64
SEED_CONFIG = os.path.join(os.path.dirname(__file__), "data", "wiola-360m-config.json")  # copy of shared/seed


# ----------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------

def tiny_config(**overrides) -> WiolaConfig:
    kw = dict(
        vocab_size=61, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, dsff_narrow_size=24, dsff_wide_size=40,
        max_position_embeddings=64, gcla_lookback=2,
    )
    kw.update(overrides)
    return WiolaConfig(**kw)


def per_layer_count(d, H, H_kv, d_h, n, w):
    attn = d * H * d_h + 2 * d * H_kv * d_h + H * d_h * d
    ctx = 2 * d * H * d_h
    gate = H
    dsff = 2 * d * n + n * d + 2 * d * w + w * d + d
    norms = 4 * d
    return attn, ctx, gate, dsff, norms


def analytic_count(V, d, L, H, H_kv, d_h, n, w):
    return V * d + L * sum(per_layer_count(d, H, H_kv, d_h, n, w)) + 2 * d


def meta_model(cfg) -> WiolaForCausalLM:
    with torch.device("meta"):
        return WiolaForCausalLM(cfg)


def unique_count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates tied ones


# ----------------------------------------------------------------------------------------
# §1 parameter counts and defaults
# ----------------------------------------------------------------------------------------

def test_360m_exact_count_and_breakdown():
    cfg = WiolaConfig.from_name("wiola-360m")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (1024, 16, 16, 4, 64, 32000)
    assert (cfg.dsff_narrow_size, cfg.dsff_wide_size, cfg.max_position_embeddings) == (1024, 4096, 2048)
    # the SPEC's breakdown, from the SPEC's formulas
    attn, ctx, gate, dsff, norms = per_layer_count(1024, 16, 4, 64, 1024, 4096)
    assert (attn, ctx, gate, dsff, norms) == (2_621_440, 2_097_152, 16, 15_729_664, 4_096)
    assert attn + ctx + gate + dsff + norms == 20_452_368
    assert analytic_count(32000, 1024, 16, 16, 4, 64, 1024, 4096) == 360_007_936

    model = meta_model(cfg)
    assert unique_count(model) == 360_007_936
    # breakdown by what the parameters are, classified by shape and name
    params = dict(model.named_parameters())
    emb = [p for k, p in params.items() if p.dim() == 2 and p.shape == (32000, 1024)]
    assert len(emb) == 1 and emb[0].numel() == 32_768_000
    for layer in range(16):
        lp = {k: p for k, p in params.items() if re.search(rf"\blayers\.{layer}\.", k)}
        assert sum(p.numel() for p in lp.values()) == 20_452_368, layer
        one_d = {k: p for k, p in lp.items() if p.dim() == 1}
        # 16 gate values, one β of size d, two norms of (γ, δ)
        assert sorted(p.numel() for p in one_d.values()) == [16] + [1024] * 5
    top_1d = [p for k, p in params.items() if "layers." not in k and p.dim() == 1]
    assert sum(p.numel() for p in top_1d) == 2_048


@pytest.mark.parametrize("name,d,L,H,H_kv,nominal", [
    ("wiola-120m", 768, 8, 12, 3, 116.6e6),
    ("wiola-360m", 1024, 16, 16, 4, 360.0e6),
    ("wiola-700m", 1536, 14, 24, 6, 693.4e6),
    ("wiola-1.5b", 2048, 18, 32, 8, 1537.9e6),
])
def test_presets(name, d, L, H, H_kv, nominal):
    assert name in wiola.PRESETS
    cfg = WiolaConfig.from_name(name)
    assert cfg.hidden_size == d and cfg.num_hidden_layers == L
    assert cfg.num_attention_heads == H and cfg.num_key_value_heads == H_kv
    assert cfg.head_dim == 64 and cfg.dsff_narrow_size == d and cfg.dsff_wide_size == 4 * d
    assert cfg.vocab_size == 32000
    count = unique_count(meta_model(cfg))
    assert count == analytic_count(32000, d, L, H, H_kv, 64, d, 4 * d)
    assert abs(count - nominal) < 0.05e6 + 1  # "116.6M" etc. within rounding
    paper_size = {"wiola-120m": 120e6, "wiola-360m": 360e6, "wiola-700m": 700e6, "wiola-1.5b": 1.5e9}[name]
    assert abs(count / paper_size - 1) <= 0.05


SPEC_DEFAULTS = dict(
    hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
    head_dim=64, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-6,
    srpe_theta=10000, srpe_spiral_divisor=8, srpe_radial_amplitude=0.1,
    srpe_radial_frequency=0.01, gcla_lookback=2, gcla_gate_init=-3.0,
    dsff_narrow_size=1024, dsff_wide_size=4096, atm_threshold=0.92, atm_enabled=True,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


@pytest.mark.parametrize("make", [lambda: WiolaConfig(), lambda: WiolaConfig.from_name("wiola-360m")],
                         ids=["default", "preset"])
def test_section1_defaults(make):
    cfg = make()
    for key, value in SPEC_DEFAULTS.items():
        got = getattr(cfg, key)
        assert got == value and type(got) is not str, (key, got, value)
    assert cfg.gcla_summary == "causal"  # SPEC §5.1: the model default


def test_seed_config_loads():
    cfg = WiolaConfig.from_json_file(SEED_CONFIG)
    for key, value in SPEC_DEFAULTS.items():
        assert getattr(cfg, key) == value, key
    assert unique_count(meta_model(cfg)) == 360_007_936


def test_seed_config_loads_with_auto(tmp_path):
    from transformers import AutoConfig
    shutil.copy(SEED_CONFIG, tmp_path / "config.json")
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    assert isinstance(cfg, WiolaConfig)
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 64 and cfg.gcla_lookback == 2


def randomise(model, seed=0):
    """Non-init values everywhere, so that init shortcuts (γ=1, δ=0, β=0, g=-3) show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=F64)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.3 * r
            elif name.endswith("norm.shift"):
                v = 0.5 * r
            elif name.endswith("gate") or name.endswith("beta"):
                v = 1.5 * r
            elif "embed" in name:
                v = r
            else:
                v = r / math.sqrt(p.shape[1])
            p.copy_(v.to(p.dtype))
    return model


def make_model(seed=0, **overrides):
    cfg = tiny_config(**overrides)
    torch.manual_seed(seed)
    model = WiolaForCausalLM(cfg)
    randomise(model, seed)
    model = model.to(F64).eval()
    return model, cfg


# Every comparison below runs the model in float64, far below what any SPEC choice moves
# (each "discriminates" assert shows > 1e-3). transformers' generate() casts the scores
# it returns to float32: GENERATE_TOL is the float32 rounding of those.
TOL = 1e-12
TIGHT = 1e-12
GENERATE_TOL = 1e-6


def rel(a, b):
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------------------
# §2 macro structure vs the oracle
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["causal", "paper"])
def test_forward_matches_oracle(mode):
    model, cfg = make_model(gcla_summary=mode)
    oracle = ModelOracle(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 11))
    with torch.no_grad():
        got = model(ids).logits
    assert got.dtype == F64
    want = oracle.forward(ids, mode=mode)
    assert rel(got, want) < TOL
    # the comparison discriminates: each SPEC choice moves the logits visibly
    other = "paper" if mode == "causal" else "causal"
    assert rel(oracle.forward(ids, mode=other), want) > 1e-3
    assert rel(oracle.forward(ids, mode=mode, group_rule="div"), want) > 1e-3
    assert rel(oracle.forward(ids, mode=mode, lookback=1), want) > 1e-3
    assert rel(oracle.forward(ids, mode=mode, lookback=3), want) > 1e-3


@pytest.mark.parametrize("lookback,L", [(1, 3), (3, 5)])
def test_forward_matches_oracle_other_lookback(lookback, L):
    model, cfg = make_model(gcla_lookback=lookback, num_hidden_layers=L, seed=1)
    oracle = ModelOracle(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        got = model(ids).logits
    assert rel(got, oracle.forward(ids)) < TOL


def test_forward_matches_oracle_mha_and_T1():
    # H_kv = H (plain MHA) and H_kv = 1 (MQA), and a single token
    for hkv in (4, 1):
        model, cfg = make_model(num_key_value_heads=hkv, seed=2)
        oracle = ModelOracle(model, cfg)
        for T in (1, 5):
            ids = torch.randint(0, cfg.vocab_size, (2, T))
            with torch.no_grad():
                got = model(ids).logits
            assert rel(got, oracle.forward(ids)) < TOL, (hkv, T)


def test_position_ids_respected():
    model, cfg = make_model(seed=3)
    oracle = ModelOracle(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    pos = torch.stack([torch.arange(7) + 5, torch.arange(7) + 17])
    with torch.no_grad():
        got = model(ids, position_ids=pos).logits
        default = model(ids).logits
    want = oracle.forward(ids, pos=pos)
    assert rel(got, want) < TOL
    assert rel(default, want) > 1e-4


# ----------------------------------------------------------------------------------------
# ATM: training only, middle third only, slot context from its first member
# ----------------------------------------------------------------------------------------

def middle_third(L):
    return tuple(range(L // 3, (2 * L) // 3))


def test_middle_third_examples():
    assert middle_third(16) == (5, 6, 7, 8, 9)
    assert middle_third(6) == (2, 3)


def _train_logits(model, ids):
    model.train()
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        model.eval()


@pytest.mark.parametrize("L", [6, 16, 3, 5])
@pytest.mark.parametrize("mode", ["causal", "paper"])
def test_atm_in_training_middle_third(L, mode):
    # τ low enough that the middle layers really merge; decisions checked for margin
    model, cfg = make_model(num_hidden_layers=L, atm_threshold=0.1, gcla_summary=mode,
                            hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, seed=4)
    oracle = ModelOracle(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    info = {}
    want = oracle.forward(ids, mode=mode, atm_layers=middle_third(L), info=info)
    assert min(info["margin"]) > 1e-8, "a merge decision sits on the threshold; change seed"
    assert all(info["merges"][l] > 0 for l in middle_third(L)), info["merges"]
    got = _train_logits(model, ids)
    no_atm = oracle.forward(ids, mode=mode)
    assert rel(want, no_atm) > 1e-3  # merging matters, so the test discriminates
    assert rel(oracle.forward(ids, mode=mode, atm_layers=middle_third(L), atm_member=-1), want) > 10 * TOL
    assert rel(got, want) < TOL


@pytest.mark.parametrize("L", [7, 8])
def test_atm_middle_third_integer_division(L):
    # SPEC §2: L/3 ≤ ℓ < 2L/3 with integer division, i.e. [L//3, (2L)//3)
    # (L = 8, the 120M preset's depth: layers 2..4; 2*(L//3) would give 2..3)
    model, cfg = make_model(num_hidden_layers=L, atm_threshold=0.1, hidden_size=16,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, seed=5)
    oracle = ModelOracle(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 10))
    info = {}
    want = oracle.forward(ids, atm_layers=middle_third(L), info=info)
    assert min(info["margin"]) > 1e-8
    assert all(info["merges"][l] > 0 for l in middle_third(L))
    got = _train_logits(model, ids)
    assert rel(got, want) < TOL


def test_atm_short_sequences_in_training():
    model, cfg = make_model(atm_threshold=0.1, seed=18)
    oracle = ModelOracle(model, cfg)
    for T in (1, 2, 3):
        ids = torch.randint(0, cfg.vocab_size, (3, T))
        info = {}
        want = oracle.forward(ids, atm_layers=middle_third(6), info=info)
        assert min(info["margin"]) > 1e-8
        assert rel(_train_logits(model, ids), want) < TOL, T


def test_atm_off_in_eval_and_when_disabled():
    model, cfg = make_model(atm_threshold=0.1, seed=6)
    oracle = ModelOracle(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    no_atm = oracle.forward(ids)
    with_atm = oracle.forward(ids, atm_layers=middle_third(6))
    assert rel(with_atm, no_atm) > 1e-3
    with torch.no_grad():
        assert rel(model(ids).logits, no_atm) < TOL        # eval: off
    model2, _ = make_model(atm_threshold=0.1, atm_enabled=False, seed=6)
    assert rel(_train_logits(model2, ids), no_atm) < TOL  # disabled: off in training too


def test_atm_off_in_generate_even_in_train_mode():
    model, cfg = make_model(atm_threshold=0.1, seed=7)
    oracle = ModelOracle(model, cfg)
    prompt = torch.randint(3, cfg.vocab_size, (1, 9))
    model.train()
    try:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=3, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    finally:
        model.eval()
    want = oracle.forward(prompt)[:, -1]
    with_atm = oracle.forward(prompt, atm_layers=middle_third(6))[:, -1]
    assert rel(with_atm, want) > 1e-3
    assert rel(out.scores[0].to(F64), want) < GENERATE_TOL


# ----------------------------------------------------------------------------------------
# Causality, caching, generation
# ----------------------------------------------------------------------------------------

def test_causal_mode_is_causal_paper_mode_is_not():
    for mode, causal in (("causal", True), ("paper", False)):
        model, cfg = make_model(gcla_summary=mode, seed=8)
        ids = torch.randint(0, cfg.vocab_size, (1, 8))
        ids2 = ids.clone()
        ids2[0, -1] = (ids[0, -1] + 1) % cfg.vocab_size
        with torch.no_grad():
            a, b = model(ids).logits, model(ids2).logits
        d = (a[:, :-1] - b[:, :-1]).abs().max().item()
        if causal:
            assert d == 0.0
        else:
            assert d > 1e-6


def _decode_step_by_step(model, ids, prompt_len):
    """Logits of a cached forward of ``ids[:, :prompt_len]``, then one token per step."""
    with torch.no_grad():
        out = model(ids[:, :prompt_len], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(prompt_len, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
    return torch.cat(steps, 1)


def test_cached_step_by_step_equals_full_forward():
    model, cfg = make_model(seed=9)
    oracle = ModelOracle(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    want = oracle.forward(ids)
    with torch.no_grad():
        full = model(ids).logits
    stepped = _decode_step_by_step(model, ids, 4)
    assert rel(full, want) < TOL
    assert rel(stepped, want) < TOL


def test_cached_steps_with_explicit_position_ids():
    model, cfg = make_model(seed=10)
    oracle = ModelOracle(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    pos = torch.arange(8)[None] + 11
    want = oracle.forward(ids, pos=pos)
    with torch.no_grad():
        out = model(ids[:, :3], position_ids=pos[:, :3], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(3, 8):
            out = model(ids[:, t:t + 1], position_ids=pos[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
    assert rel(torch.cat(steps, 1), want) < TOL


def _greedy(oracle, prompt, n, mode):
    seq = prompt.clone()
    scores = []
    for _ in range(n):
        logits = oracle.forward(seq, mode=mode)[:, -1]
        scores.append(logits)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    return seq, scores


@pytest.mark.parametrize("mode,batch", [("causal", 1), ("causal", 2), ("paper", 1)])
def test_generate_matches_oracle_greedy(mode, batch):
    model, cfg = make_model(gcla_summary=mode, seed=11)
    oracle = ModelOracle(model, cfg)
    prompt = torch.randint(3, cfg.vocab_size, (batch, 5))
    want_seq, want_scores = _greedy(oracle, prompt, 6, mode)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out.sequences, want_seq)
    for s, w in zip(out.scores, want_scores):
        assert rel(s.to(F64), w) < GENERATE_TOL


# ----------------------------------------------------------------------------------------
# Parameters: no biases, tied head, init values
# ----------------------------------------------------------------------------------------

def test_no_biases_and_tied_head():
    cfg = tiny_config()
    model = WiolaForCausalLM(cfg)
    for name, mod in model.named_modules():
        assert getattr(mod, "bias", None) is None, name
    assert not any("bias" in n for n, _ in model.named_parameters())
    inp, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert inp.data_ptr() == out.data_ptr() and inp.shape == out.shape
    n_all = sum(p.numel() for p in model.parameters())
    assert n_all == analytic_count(61, 32, 6, 4, 2, 8, 24, 40)
    # tied after a training step too
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        inp.add_(1.0)
    assert torch.equal(model.get_output_embeddings().weight, inp)


@pytest.mark.parametrize("g0", [-3.0, -1.25])
def test_init_values(g0):
    model = WiolaForCausalLM(tiny_config(gcla_gate_init=g0))
    P = dict(model.named_parameters())
    for i in range(6):
        pre = f"model.layers.{i}."
        assert torch.all(P[pre + "attn.gate"] == g0)
        assert torch.all(P[pre + "ffn.beta"] == 0)
        for nm in ("attn_norm", "ffn_norm"):
            assert torch.all(P[pre + nm + ".weight"] == 1)
            assert torch.all(P[pre + nm + ".shift"] == 0)
    assert torch.all(P["model.norm.weight"] == 1) and torch.all(P["model.norm.shift"] == 0)


# ----------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,field", [
    (dict(hidden_size=100, num_attention_heads=16), r"hidden_size|head_dim|num_attention_heads"),
    (dict(hidden_size=1024, num_attention_heads=16, head_dim=32), r"hidden_size|head_dim"),
    (dict(num_attention_heads=16, num_key_value_heads=5), r"num_key_value_heads"),
    (dict(hidden_size=36, num_attention_heads=4, num_key_value_heads=2, head_dim=9), r"head_dim"),
    (dict(vocab_size="32000"), r"vocab_size"),
    (dict(vocab_size=0), r"vocab_size"),
    (dict(rms_norm_eps=-1.0), r"rms_norm_eps"),
    (dict(gcla_summary="global"), r"gcla_summary"),
    (dict(gcla_lookback=-1), r"gcla_lookback"),
    (dict(num_hidden_layers=0), r"num_hidden_layers"),
    (dict(dsff_wide_size=0), r"dsff_wide_size"),
])
def test_bad_config_names_field(overrides, field):
    with pytest.raises((ValueError, TypeError), match=field):
        WiolaConfig(**overrides)


@pytest.mark.parametrize("missing", ["hidden_size", "num_key_value_heads", "vocab_size"])
def test_config_json_missing_field(tmp_path, missing):
    with open(SEED_CONFIG) as f:
        data = json.load(f)
    del data[missing]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=missing):
        WiolaConfig.from_pretrained(str(tmp_path))


def test_config_json_wrong_field(tmp_path):
    with open(SEED_CONFIG) as f:
        data = json.load(f)
    data["num_key_value_heads"] = 3  # 16 % 3 != 0
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        WiolaConfig.from_pretrained(str(tmp_path))


def test_generate_errors():
    model, cfg = make_model(seed=12)
    with pytest.raises(ValueError, match=r"(?i)empty|prompt|length|token"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2, do_sample=False)
    long_prompt = torch.randint(3, cfg.vocab_size, (1, cfg.max_position_embeddings + 1))
    with pytest.raises(ValueError, match=r"max_position_embeddings"):
        model.generate(long_prompt, max_new_tokens=1, do_sample=False)
    ok = torch.randint(3, cfg.vocab_size, (1, cfg.max_position_embeddings - 2))
    with pytest.raises(ValueError, match=r"max_position_embeddings"):
        model.generate(ok, max_new_tokens=5, do_sample=False)


def test_forward_too_long_errors():
    model, cfg = make_model(seed=13)
    ids = torch.randint(3, cfg.vocab_size, (1, cfg.max_position_embeddings + 1))
    with pytest.raises(ValueError, match=r"max_position_embeddings"):
        model(ids)


# ----------------------------------------------------------------------------------------
# float64 accuracy, gradients, loss, padding
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["causal", "paper"])
def test_float64_forward_is_float64_accurate(mode):
    model, cfg = make_model(gcla_summary=mode, seed=14)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        got = model(ids).logits
    assert rel(got, ModelOracle(model, cfg).forward(ids, mode=mode)) < TIGHT


def test_float64_cached_decoding_is_float64_accurate():
    model, cfg = make_model(seed=15, gcla_lookback=0)  # no summaries: isolates the attention path
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    assert rel(_decode_step_by_step(model, ids, 3), ModelOracle(model, cfg).forward(ids)) < TIGHT


def _oracle_grads(model, cfg, ids, **kw):
    oracle = ModelOracle(model, cfg, requires_grad=True)
    leaves = oracle.P
    logits = oracle.forward(ids, **kw)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss.backward()
    # layer 0 has no context, so its kc/vc projections and gate get no gradient
    return loss.detach(), {k: torch.zeros_like(v) if v.grad is None else v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("train", [False, True])
def test_loss_and_gradients_match_oracle(train):
    # §8: next-token cross-entropy; gradients of every parameter (ATM on in training)
    model, cfg = make_model(atm_threshold=0.1, hidden_size=16, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, seed=16)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    info = {}
    atm = middle_third(6) if train else ()
    want_loss, want = _oracle_grads(model, cfg, ids, atm_layers=atm, info=info)
    if train:
        assert min(info["margin"]) > 1e-8 and all(info["merges"][l] > 0 for l in atm)
    model.train(train)
    out = model(ids, labels=ids)
    out.loss.backward()
    model.eval()
    assert abs(out.loss.item() - want_loss.item()) < TOL * abs(want_loss.item())
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad
        if want[name].abs().max() == 0:
            assert g.abs().max() == 0, name
        else:
            assert rel(g, want[name]) < TOL, name


@pytest.mark.parametrize("mode", ["causal", "paper"])
@pytest.mark.parametrize("train", [False, True])
def test_right_padding_matches_unpadded_rows(mode, train):
    model, cfg = make_model(gcla_summary=mode, atm_threshold=0.1, hidden_size=16,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, seed=17)
    oracle = ModelOracle(model, cfg)
    lengths = [10, 6, 1]
    ids = torch.randint(3, cfg.vocab_size, (3, 10))
    mask = torch.zeros(3, 10, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = 0
    model.train(train)
    try:
        with torch.no_grad():
            got = model(ids, attention_mask=mask).logits
    finally:
        model.eval()
    atm = middle_third(6) if train else ()
    for b, n in enumerate(lengths):
        info = {}
        want = oracle.forward(ids[b:b + 1, :n], mode=mode, atm_layers=atm, info=info)
        if info.get("margin"):
            assert min(info["margin"]) > 1e-8
        assert rel(got[b:b + 1, :n], want) < TOL, (b, n)


@pytest.mark.parametrize("mode", ["causal", "paper"])
def test_float32_model_close_to_float64_oracle(mode):
    # SPEC §9 attention tolerance (1e-4) for the whole float32 model, default kernels
    model, cfg = make_model(gcla_summary=mode, seed=19)
    oracle = ModelOracle(model, cfg)
    model = model.float()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        got = model(ids).logits
    assert got.dtype == torch.float32
    assert rel(got.to(F64), oracle.forward(ids, mode=mode)) < 1e-4


def test_save_load_round_trip(tmp_path):
    model, cfg = make_model(gcla_summary="paper", gcla_gate_init=-2.0, atm_threshold=0.5, seed=20)
    model.save_pretrained(str(tmp_path))
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=F64).eval()
    for key in ("gcla_summary", "gcla_gate_init", "atm_threshold", "head_dim", "gcla_lookback",
                "num_key_value_heads", "srpe_spiral_divisor"):
        assert getattr(loaded.config, key) == getattr(cfg, key), key
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    with torch.no_grad():
        assert rel(loaded(ids).logits, ModelOracle(model, cfg).forward(ids, mode="paper")) < TOL


@pytest.mark.parametrize("case", ["out_of_vocab", "negative", "float", "one_dim"])
def test_bad_input_ids_named(case):
    model, cfg = make_model(seed=21)
    ids = {
        "out_of_vocab": torch.tensor([[3, cfg.vocab_size]]),
        "negative": torch.tensor([[3, -1]]),
        "float": torch.tensor([[3.0, 4.0]]),
        "one_dim": torch.tensor([3, 4]),
    }[case]
    with pytest.raises((ValueError, TypeError), match="input_ids"):
        model(ids)
