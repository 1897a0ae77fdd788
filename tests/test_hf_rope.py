"""Every Hugging Face rope type through ``patch_hf`` (SPEC §4 "Given frequencies", §10.4):
the patched rotary path hands :func:`wiola_kernels.srpe` the rotary module's own ``inv_freq``
and its ``attention_scaling`` as the output scale, after Hugging Face's own per-call update
for ``dynamic`` and ``longrope``. Each type's tiny random Llama, patched in float32, gives
the loss and every parameter gradient of the unpatched model run in float64 within SPEC
§9's float32 tolerance (attention class), on batches with padding and ``-100`` labels whose
positions run past ``original_max_position_embeddings`` (or, for ``dynamic``,
``max_position_embeddings``), so the scaling is exercised; then a short batch (``dynamic``
resets, ``longrope`` switches back to its short factors) and a long one again.
"""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import hf
from wiola_kernels.hf import ROPE_TYPES, FusedRotaryEmbedding, rope_srpe_arguments
from wiola_kernels.testing import rel_err, tolerance

from hf_helpers import (  # noqa: F401  (transformers: skips without it)
    VOCAB, assert_compiled_step_matches_eager, loss_and_grads, model, transformers)

TOL = tolerance(torch.float32, "attention")
ORIGINAL = 16  # original_max_position_embeddings of the small configs; batches run to 24 positions
HALF = 8       # pairs per head (d_h 16)

ROPES = {
    "default": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    # dynamic grows beyond max_position_embeddings, resets below it: 16 here.
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                    max_position_embeddings=ORIGINAL),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": ORIGINAL}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": ORIGINAL}),
    "yarn_attention_factor": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                                   "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0,
                                                   "original_max_position_embeddings": ORIGINAL}),
    # longrope: factor = max_position_embeddings / original = 4 sets its attention factor.
    "longrope": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                      "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5],
                                      "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                                      "original_max_position_embeddings": ORIGINAL},
                     max_position_embeddings=4 * ORIGINAL),
    "proportional": dict(rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0}),
}


def rope_model(name: str, seed: int, attn: str = "eager"):
    overrides = dict(ROPES[name])
    overrides.setdefault("max_position_embeddings", 64)
    return model("llama", seed=seed, attn=attn, **overrides)


def batch(length: int, padding: str, seed: int) -> dict:
    """B 3 × ``length`` tokens: rows of lengths ``length``, ``2/3·length``, ``1/3·length`` padded
    on the right or on the left (then with per-row ``position_ids``, as ``generate`` makes
    them), padding labelled -100 and a third of the other labels too."""
    g = torch.Generator().manual_seed(seed)
    b = 3
    input_ids = torch.randint(1, VOCAB, (b, length), generator=g)
    lengths = torch.tensor([length, max(1, 2 * length // 3), max(1, length // 3)])
    cols = torch.arange(length)
    mask = (cols[None] < lengths[:, None]) if padding == "right" else (cols[None] >= (length - lengths)[:, None])
    mask = mask.long()
    input_ids = input_ids.masked_fill(mask == 0, 0)
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[torch.rand(b, length, generator=g) < 1 / 3] = -100
    out = dict(input_ids=input_ids, labels=labels, attention_mask=mask)
    if padding == "left":
        out["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return out


def _assert_matches(got, want, what):
    loss, _, grads = got
    want_loss, _, want_grads = want
    assert rel_err(loss, want_loss) <= TOL, f"{what}: loss {float(loss)} vs {float(want_loss)}"
    assert grads.keys() == want_grads.keys(), what
    for name, grad in grads.items():
        assert rel_err(grad, want_grads[name]) <= TOL, f"{what}: grad {name} rel err {rel_err(grad, want_grads[name])}"


@pytest.fixture(autouse=True)
def _nothing_patched_after_the_test():
    yield
    for family in list(hf._class_patches):
        wk.unpatch_hf(family)


@pytest.fixture
def srpe_calls(monkeypatch):
    """The ``inv_freq`` (None or a tensor) and ``scale`` of every srpe call the patched RoPE makes."""
    calls = []
    real = hf.srpe

    def spy(*args, **kwargs):
        calls.append((kwargs.get("inv_freq"), kwargs.get("scale", 1.0)))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "srpe", spy)
    return calls


def test_rope_types_are_hugging_faces():
    """ROPE_TYPES is what this transformers has (a new type fails here until it is reviewed)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_TYPES) == set(ROPE_INIT_FUNCTIONS) | {"default"}
    assert {name.split("_")[0] for name in ROPES} == set(ROPE_TYPES)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("name", list(ROPES))
def test_each_rope_type_matches_hf_float64(name, padding, srpe_calls, recwarn):
    """Patched float32 vs unpatched float64: long (beyond the original length), short, long."""
    attn = "sdpa" if padding == "left" else "eager"  # see hf_helpers.training_batch: left padding
    m = rope_model(name, seed=60, attn=attn).train()
    reference = copy.deepcopy(m).double()
    wk.patch_hf(m)
    assert isinstance(m.model.rotary_emb, FusedRotaryEmbedding)
    assert not [w for w in recwarn if "wiola_kernels" in str(w.message)], [str(w.message) for w in recwarn]
    hf_rotary, ref_rotary = m.model.rotary_emb.hf_rotary, reference.model.rotary_emb
    for step, length in enumerate((24, 8, 24)):
        srpe_calls.clear()
        data = batch(length, padding, seed=61 + step)
        _assert_matches(loss_and_grads(m, **data), loss_and_grads(reference, **data), f"{name} T={length}")
        assert len(srpe_calls) == m.config.num_hidden_layers  # every layer's RoPE is ours
        inv_freq, scale = srpe_calls[0]
        if name == "default":
            assert inv_freq is None and scale == 1.0
            continue
        # The module's own frequencies and attention factor, after HF's update (the reference's).
        assert scale == ref_rotary.attention_scaling == hf_rotary.attention_scaling
        assert torch.equal(inv_freq.double(), ref_rotary.inv_freq.double()), f"{name} T={length}"
    if name in ("dynamic", "longrope"):
        want_long, want_short = _expected_frequencies(name, m.config)
        assert torch.equal(hf_rotary.inv_freq, want_long)  # the last batch was long
    if name == "dynamic":
        assert hf_rotary.max_seq_len_cached == ref_rotary.max_seq_len_cached == 24
    wk.unpatch_hf(m)


def _expected_frequencies(name, config):
    """``(long, short)`` frequencies of HF's init function for ``dynamic`` (at 24 positions) and
    ``longrope`` (beyond the original length), given the length as HF's update does (a tensor
    for ``dynamic``: its arithmetic then differs from a Python int's by an ulp)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS[name]
    seq = torch.tensor(24) if name == "dynamic" else ORIGINAL + 1
    return fn(config, "cpu", seq_len=seq)[0], fn(config, "cpu")[0]


def test_dynamic_recomputes_only_where_hf_does(srpe_calls):
    """``dynamic``: the frequencies srpe gets are the default ones up to max_position_embeddings
    positions, grown for 24 positions (HF's condition is max(position_ids) + 1 > cached), kept
    for 20 (below the cached 24, above the original 16), reset for 10."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    m = wk.patch_hf(rope_model("dynamic", seed=62))
    fn = ROPE_INIT_FUNCTIONS["dynamic"]
    original = fn(m.config, "cpu")[0]
    for length, seq in ((16, None), (24, 24), (20, 24), (10, None)):
        srpe_calls.clear()
        with torch.no_grad():
            m(input_ids=torch.ones(1, length, dtype=torch.long))
        want = original if seq is None else fn(m.config, "cpu", seq_len=torch.tensor(seq))[0]
        assert all(torch.equal(inv_freq, want) for inv_freq, _ in srpe_calls), length
    wk.unpatch_hf(m)


@pytest.mark.parametrize("name", ["llama3", "yarn", "longrope"])
def test_rope_srpe_arguments_apply_hfs_rope(name):
    """The function the families call: srpe with its arguments is HF's RoPE (float64 tables)
    on q and k of any layout, at positions past the original length."""
    m = rope_model(name, seed=63)
    rotary = m.model.rotary_emb
    modeling = sys.modules[type(m).__module__]
    g = torch.Generator().manual_seed(64)
    q, k = torch.randn(2, 4, 30, 16, generator=g), torch.randn(2, 2, 30, 16, generator=g)
    pos = torch.arange(30).expand(2, 30)
    args = rope_srpe_arguments(rotary, q, pos)
    assert args["scale"] == rotary.attention_scaling and args["inv_freq"] is rotary.inv_freq
    got = wk.srpe(q, k, pos, **args)
    # float64 truth from the module's own frequencies and attention factor.
    angle = pos.double()[..., None] * rotary.inv_freq.double()
    emb = torch.cat((angle, angle), -1)
    cos, sin = emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling
    want = modeling.apply_rotary_pos_emb(q.double(), k.double(), cos, sin)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tolerance(torch.float32)
    with pytest.raises(ValueError, match="rope type 'made_up'"):
        rotary.rope_type = "made_up"
        rope_srpe_arguments(rotary, q, pos)


@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_patched_rope_type_compiles_without_graph_breaks(name):
    m = wk.patch_hf(rope_model(name, seed=65)).train()
    assert_compiled_step_matches_eager(m, batch(24, "right", seed=66))
    wk.unpatch_hf(m)


def test_patched_rotary_emb_returns_the_rope_types_cos_sin():
    """Code that reads ``position_embeddings`` gets the type's tables (scaled by its factor)."""
    m = rope_model("yarn", seed=67)
    hf_rotary = m.model.rotary_emb
    wk.patch_hf(m)
    x = torch.zeros(2, 5, 64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [17, 18, 19, 40, 41]])
    for got, want in zip(m.model.rotary_emb(x, pos), hf_rotary(x, pos)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) <= tolerance(torch.float32)
    assert not math.isclose(hf_rotary.attention_scaling, 1.0)
    wk.unpatch_hf(m)


def test_an_unknown_rope_type_keeps_hf_rope_with_a_warning():
    m = model("llama", seed=68)
    rotary = m.model.rotary_emb
    rotary.rope_type = "made_up"  # a type a later transformers might add
    modeling = sys.modules[type(m).__module__]
    original_apply = modeling.apply_rotary_pos_emb
    with pytest.warns(UserWarning, match="made_up"):
        wk.patch_hf(m)
    assert m.model.rotary_emb is rotary and modeling.apply_rotary_pos_emb is original_apply
    assert isinstance(m.model.norm, wk.RMSNorm)  # the norms are still fused
    wk.unpatch_hf(m)


@pytest.mark.parametrize("name", ["default", "linear", "dynamic", "yarn", "longrope"])
def test_patched_rotary_class_builds_from_a_config_like_hfs(name):
    """transformers' own RoPE tests build fresh rotary modules as ``type(model.rotary_emb)(config=...)``
    and read ``.inv_freq``: on a patched model that class is FusedRotaryEmbedding, which then
    builds one of the config's family, returning HF's tables and exposing HF's buffers (issue 38)."""
    m = rope_model(name, seed=69)
    cfg = m.config
    wk.patch_hf(m)
    fused = type(m.model.rotary_emb)(config=cfg)
    reference = type(fused.hf_rotary)(config=cfg)  # HF's own module of the same config
    assert isinstance(fused, FusedRotaryEmbedding) and type(fused.hf_rotary).__name__ == "LlamaRotaryEmbedding"
    x = torch.zeros(1, 5, 64)
    for pos in (torch.arange(10)[None], torch.arange(100)[None], torch.arange(10)[None]):  # dynamic: grows, resets
        for got, want in zip(fused(x, pos), reference(x, pos)):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert rel_err(got, want) <= tolerance(torch.float32), name
        assert torch.equal(fused.inv_freq, reference.inv_freq)  # HF's buffer, read through
    assert fused.inv_freq is fused.hf_rotary.inv_freq and fused.attention_scaling == reference.attention_scaling
    assert m.model.rotary_emb.inv_freq is m.model.rotary_emb.hf_rotary.inv_freq
    with pytest.raises(AttributeError, match="FusedRotaryEmbedding"):
        fused.not_an_attribute
    with pytest.raises(TypeError, match="config="):
        FusedRotaryEmbedding()
    wk.unpatch_hf(m)


def test_patched_gemma3_rotary_needs_a_layer_type():
    """Gemma 3's rotary module serves each layer type; called without one (as HF's, which then fails
    on its missing argument) the fused one says which types it has."""
    from hf_helpers import config as family_config

    fused = FusedRotaryEmbedding(config=family_config("gemma3_text"))
    x, pos = torch.zeros(1, 4, 64), torch.arange(4)[None]
    with pytest.raises(TypeError, match="full_attention"):
        fused(x, pos)
    hf_rotary = fused.hf_rotary
    for layer_type in ("sliding_attention", "full_attention"):
        for got, want in zip(fused(x, pos, layer_type), hf_rotary(x, pos, layer_type)):
            assert rel_err(got, want) <= tolerance(torch.float32)
