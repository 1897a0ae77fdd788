"""``patch_hf`` / ``unpatch_hf`` (issue 13) checked against the models' own Hugging Face
code, which this project did not write: small random-initialised Llama, Mistral and Qwen2
models, patched (float32, on the CPU backend and on Triton in its interpreter) against
the unpatched model run in float64 — logits and every parameter gradient within SPEC §9's
float32 tolerance (the attention class: these are whole models) — greedy ``generate``,
unsupported rope types and architectures, exact restoration, and RoPE accuracy at large
positions against float64.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import subprocess
import sys

import pytest
import torch

import wiola_kernels
import wiola_kernels as wk
from wiola_kernels.hf import FusedRotaryEmbedding, is_patched, rope_accuracy
from wiola_kernels.testing import available_backends, rel_err, tolerance

transformers = pytest.importorskip("transformers")

BACKENDS = [b for b in ("cpu", "triton") if b in available_backends("rms_norm") and b in available_backends("srpe")]
FAMILIES = ["llama", "mistral", "qwen2"]
TOL = tolerance(torch.float32, "attention")


@pytest.fixture(autouse=True)
def _unpatch_leftovers():
    """Each test starts with no patched model alive: HF's modeling modules hold their own
    apply_rotary_pos_emb (unpatch_hf of the last patched model puts it back)."""
    yield
    gc.collect()  # a patched model that dies releases the function too
    assert not wiola_kernels.hf._installed, "a patched model outlived its test"


def _config(family, **overrides):
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[family]
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=101, max_position_embeddings=256, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    kw.update(overrides)
    config = cls(**kw)
    config._attn_implementation = "eager"
    return config


def _model(family, seed=0, **overrides):
    """A seeded random model, with non-trivial RMSNorm weights (HF initialises them to 1)."""
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[family]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(_config(family, **overrides))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model.eval()


def _ids(batch=2, length=9, vocab=101, seed=3):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _modules(model):
    return [(name, id(m)) for name, m in model.named_modules()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_logits_and_gradients_match_hf_float64(family, backend):
    ids = _ids()
    truth = _model(family).double()
    want_logits, want_grads = _loss_and_grads(truth, ids)
    model = wk.patch_hf(_model(family))
    assert is_patched(model)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "RMSNorm" in kinds and "FusedRotaryEmbedding" in kinds and not any(k.endswith("RotaryEmbedding")
                                                                              and k != "FusedRotaryEmbedding"
                                                                              for k in kinds)
    with wk.use_backend(backend):
        logits, grads = _loss_and_grads(model, ids)
    assert logits.dtype == torch.float32
    assert rel_err(logits, want_logits) <= TOL, f"logits {rel_err(logits, want_logits):.2e}"
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        err = rel_err(grad, want_grads[name])
        assert err <= TOL, f"grad {name}: {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_bf16_logits_within_bf16_tolerance(family):
    ids = _ids()
    want, _ = _loss_and_grads(_model(family).double(), ids)
    model = wk.patch_hf(_model(family).to(torch.bfloat16))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    assert rel_err(logits, want) <= tolerance(torch.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_same_tokens(family):
    ids = _ids(batch=2, length=5, seed=4)
    plain = _model(family, seed=5)
    patched = wk.patch_hf(copy.deepcopy(plain))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = plain.generate(ids, **kw)
        got = patched.generate(ids, **kw)
    assert want.shape == (2, 17)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_restores_exactly(family):
    model = _model(family, seed=6)
    ids = _ids(seed=7)
    modeling = sys.modules[type(model).__module__]
    original_apply = modeling.apply_rotary_pos_emb
    before_modules, before_params = _modules(model), [id(p) for p in model.parameters()]
    before_keys = list(model.state_dict())
    with torch.no_grad():
        before = model(input_ids=ids).logits
    wk.patch_hf(model)
    assert modeling.apply_rotary_pos_emb is not original_apply
    assert [id(p) for p in model.parameters()] == before_params  # optimizer state carries over
    assert list(model.state_dict()) == before_keys
    assert wk.patch_hf(model) is model  # patching twice is a no-op
    wk.unpatch_hf(model)
    assert not is_patched(model)
    assert _modules(model) == before_modules
    assert modeling.apply_rotary_pos_emb is original_apply
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert wk.unpatch_hf(model) is model  # unpatching twice is a no-op


def test_deep_copy_of_a_patched_model_outlives_the_original():
    ids = _ids(seed=19)
    model = wk.patch_hf(_model("qwen2", seed=20))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        wk.unpatch_hf(model)
        del model
        gc.collect()
        assert is_patched(twin) and torch.equal(twin(input_ids=ids).logits, want)
    wk.unpatch_hf(twin)
    assert not isinstance(twin.model.rotary_emb, FusedRotaryEmbedding)


def test_unpatched_model_of_same_class_unaffected_while_another_is_patched():
    plain, other = _model("llama", seed=8), _model("llama", seed=9)
    ids = _ids(seed=10)
    with torch.no_grad():
        before = plain(input_ids=ids).logits
        wk.patch_hf(other)
        during = plain(input_ids=ids).logits
        wk.unpatch_hf(other)
    assert torch.equal(during, before)


def test_weights_loaded_after_patching_are_used_and_kept_on_unpatch():
    model = wk.patch_hf(_model("llama", seed=11))
    source = _model("llama", seed=12)
    model.load_state_dict(source.state_dict())
    ids = _ids(seed=13)
    with torch.no_grad():
        want = source.double()(input_ids=ids).logits
        assert rel_err(model(input_ids=ids).logits, want) <= TOL
        wk.unpatch_hf(model)
        assert torch.equal(model.double()(input_ids=ids).logits, want)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
])
def test_unsupported_rope_type_keeps_hf_rope_with_a_warning(rope):
    model = _model("llama", seed=14, rope_parameters=rope)
    rotary = model.model.rotary_emb
    modeling = sys.modules[type(model).__module__]
    original_apply = modeling.apply_rotary_pos_emb
    ids = _ids(seed=15)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(input_ids=ids).logits
    with pytest.warns(UserWarning, match=rope["rope_type"]):
        wk.patch_hf(model)
    assert model.model.rotary_emb is rotary and modeling.apply_rotary_pos_emb is original_apply
    assert isinstance(model.model.norm, wk.RMSNorm)  # the norms are still fused
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, want) <= TOL
    wk.unpatch_hf(model)


def test_unknown_architecture_left_untouched_with_a_warning():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    with torch.random.fork_rng():
        torch.manual_seed(16)
        model = transformers.GPT2LMHeadModel(config).eval()
    before = _modules(model)
    with pytest.warns(UserWarning, match="GPT2LMHeadModel"):
        assert wk.patch_hf(model) is model
    assert _modules(model) == before and not is_patched(model)
    with pytest.warns(UserWarning, match="Linear"):
        wk.patch_hf(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model"):
        wk.patch_hf("llama")


def test_rope_accurate_at_large_positions():
    rows = rope_accuracy([65536, 2**20 - 1])
    for row in rows:
        print(f"p = {row['position']}: patched {row['ours']:.2e}, HF float32 {row['hf']:.2e} (vs float64)")
        assert row["ours"] <= tolerance(torch.float32), row
        assert row["hf"] > 10 * row["ours"], row  # HF's float32 angles are the worse of the two


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_rope_at_large_positions_in_the_model(backend):
    # The patched model's own rotated q/k at positions near 2^16 and 2^20, vs float64.
    model = wk.patch_hf(_model("llama", seed=17))
    modeling = sys.modules[type(model).__module__]
    assert isinstance(model.model.rotary_emb, FusedRotaryEmbedding)
    g = torch.Generator().manual_seed(18)
    pos = torch.tensor([[65535, 65536, 2**20 - 2, 2**20 - 1]])
    q, k = torch.randn(1, 4, 4, 16, generator=g), torch.randn(1, 2, 4, 16, generator=g)
    rope = model.model.rotary_emb(q, pos)
    with wk.use_backend(backend):
        q_rot, k_rot = modeling.apply_rotary_pos_emb(q, k, *rope)
    j = torch.arange(8, dtype=torch.float64)
    angle = pos.double()[:, None, :, None] * 10000.0 ** (-2.0 * j / 16)
    c, s = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
    for got, x in ((q_rot, q), (k_rot, k)):
        xd = x.double()
        want = xd * c + torch.cat((-xd[..., 8:], xd[..., :8]), -1) * s
        assert rel_err(got, want) <= tolerance(torch.float32)
    wk.unpatch_hf(model)


def test_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import wiola_kernels as wk, torch\n"
            "assert wk.patch_hf(torch.nn.Linear(2, 2)) is not None\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_bench_hf_llama_writes_the_issues_record(tmp_path):
    # No timing is asserted: only that the command runs and writes the fields issue 13 names.
    out = tmp_path / "hf.json"
    cmd = [sys.executable, "-m", "wiola_kernels", "bench", "--hf", "llama", "--small", "--repeats", "1",
           "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (record,) = json.loads(out.read_text())
    assert record["op"] == "hf_llama_step" and record["dtype"] == "float32"
    for key in ("tokens_per_s", "tokens_per_s_unpatched", "speedup_vs_eager", "peak_mb", "peak_mb_unpatched"):
        assert isinstance(record[key], float) and math.isfinite(record[key]), key
    assert record["tokens_per_s"] > 0 and record["tokens_per_s_unpatched"] > 0
    assert "patched" in run.stdout and "unpatched" in run.stdout


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = _ids(seed=21)
    want_logits, want = _loss_and_grads(_model("llama", seed=22).double(), ids)
    model = wk.patch_hf(_model("llama", seed=22)).train()
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    logits, grads = _loss_and_grads(model, ids)
    assert rel_err(logits, want_logits) <= TOL
    for name, grad in grads.items():
        assert rel_err(grad, want[name]) <= TOL, name
    wk.unpatch_hf(model)
