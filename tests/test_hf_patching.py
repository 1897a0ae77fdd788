"""What ``patch_hf`` swaps, how it is undone, and the ways models get built: each swap
switchable; all or nothing (a failure injected while planning or midway through the swaps
leaves the model exactly as it was); unpatching restores the same modules, function and
bit-identical outputs; models built on the meta device, with accelerate's
``init_empty_weights`` or materialised by ``to_empty`` (before or after patching); a
hand-edited ``inv_freq`` keeps HF's RoPE; the patched rotary embedding still returns HF's
``(cos, sin)`` tensors; the class-level form before ``from_pretrained``; ``torch.compile``
with no graph break; deep copies and unknown architectures (the rope types: tests/test_hf_rope.py). Numbers are
checked against the unpatched Hugging Face model in float64 (SPEC §9's float32 tolerance,
attention class), or bit for bit where nothing should have changed.
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys

import pytest
import torch

import wiola_kernels
import wiola_kernels as wk
from wiola_kernels import hf
from wiola_kernels.hf import FusedGatedMLP, FusedRotaryEmbedding
from wiola_kernels.testing import rel_err, tolerance

from hf_helpers import (CAUSAL_LM, FAMILIES, assert_compiled_step_matches_eager, config, ids, loss_and_grads, model,  # noqa: E402
                        module_ids, randomise_norms, training_batch, transformers)

TOL = tolerance(torch.float32, "attention")


@pytest.fixture(autouse=True)
def _nothing_patched_after_the_test():
    yield
    leftovers = list(hf._class_patches)
    for family in leftovers:  # don't let one failure patch the classes of every later test
        wk.unpatch_hf(family)
    gc.collect()
    assert not hf._installed, "a patched model outlived its test"
    assert not leftovers, f"class-level patches left on: {leftovers}"


def _modeling(m):
    return sys.modules[type(m).__module__]


def _hf_apply(m):
    fn = _modeling(m).apply_rotary_pos_emb
    return getattr(fn, "__wrapped__", fn)


def _logits(m, x):
    with torch.no_grad():
        return m(input_ids=x).logits


def _assert_matches_float64(m, reference, batch, what=""):
    want_loss, want_logits, want_grads = loss_and_grads(reference.double(), **batch)
    loss, logits, grads = loss_and_grads(m, **batch)
    assert rel_err(loss, want_loss) <= TOL and rel_err(logits, want_logits) <= TOL, what
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert rel_err(grad, want_grads[name]) <= TOL, f"{what} grad {name}"


# ---- switches ------------------------------------------------------------------------

@pytest.mark.parametrize("switches", [dict(rms_norm=False), dict(rope=False), dict(mlp=False),
                                      dict(rms_norm=False, rope=False, mlp=False)])
def test_each_swap_is_switchable(switches):
    m = model("mistral", seed=1)
    wk.patch_hf(m, **switches)
    assert wk.is_patched(m)
    norms = [sub for sub in m.modules() if type(sub).__name__.endswith("RMSNorm")]
    assert all(isinstance(n, wk.RMSNorm) for n in norms) == switches.get("rms_norm", True)
    assert all(type(n).__name__ == "MistralRMSNorm" for n in norms) == (not switches.get("rms_norm", True))
    assert isinstance(m.model.rotary_emb, FusedRotaryEmbedding) == switches.get("rope", True)
    mlps = [layer.mlp for layer in m.model.layers]
    assert all(isinstance(x, FusedGatedMLP) for x in mlps) == switches.get("mlp", True)
    assert all(type(x).__name__ == "MistralMLP" for x in mlps) == (not switches.get("mlp", True))
    _assert_matches_float64(m, model("mistral", seed=1), dict(input_ids=ids(), labels=ids()), str(switches))
    wk.unpatch_hf(m)
    with pytest.raises(TypeError, match="rope"):
        wk.patch_hf(m, rope="yes")
    assert not wk.is_patched(m)


# ---- all or nothing -------------------------------------------------------------------

def _snapshot(m):
    return module_ids(m), [id(p) for p in m.parameters()], _modeling(m).apply_rotary_pos_emb


@pytest.mark.parametrize("where", ["plan", "first swap", "third swap", "last swap", "install rope"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_failure_anywhere_leaves_the_model_as_it_was(family, where, monkeypatch):
    m = model(family, seed=2)
    x = ids(seed=3)
    before, outputs = _snapshot(m), _logits(m, x)
    n_swaps = sum(1 for sub in m.modules() if type(sub).__name__.endswith(("RMSNorm", "RotaryEmbedding", "MLP")))
    fail_at = {"first swap": 1, "third swap": 3, "last swap": n_swaps}.get(where)
    calls = []

    def failing_swap(parent, name, new):
        calls.append(name)
        if len(calls) == fail_at:
            raise RuntimeError("injected failure")
        setattr(parent, name, new)

    if where == "plan":
        built = []

        def failing_norm(*args, **kwargs):
            built.append(1)
            if len(built) == 3:
                raise RuntimeError("injected failure")
            return wk.RMSNorm(*args, **kwargs)

        monkeypatch.setattr(hf, "RMSNorm", failing_norm)
    elif where == "install rope":
        monkeypatch.setattr(hf, "_install_apply", lambda *a: (_ for _ in ()).throw(RuntimeError("injected failure")))
    else:
        monkeypatch.setattr(hf, "_swap", failing_swap)
    with pytest.raises(RuntimeError, match="injected failure"):
        wk.patch_hf(m)
    monkeypatch.undo()
    if fail_at is not None:
        assert len(calls) == fail_at  # it did fail midway, after fail_at - 1 swaps
    assert _snapshot(m) == before and not wk.is_patched(m) and not hf._installed
    assert torch.equal(_logits(m, x), outputs)
    wk.patch_hf(m)  # and it can be patched afterwards
    assert wk.is_patched(m) and isinstance(m.model.rotary_emb, FusedRotaryEmbedding)
    wk.unpatch_hf(m)


# ---- unpatching -----------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_restores_exactly(family):
    m = model(family, seed=6)
    x = ids(seed=7)
    modeling = _modeling(m)
    original_apply = modeling.apply_rotary_pos_emb
    before_modules, before_params = module_ids(m), [id(p) for p in m.parameters()]
    before_keys = list(m.state_dict())
    before = _logits(m, x)
    wk.patch_hf(m)
    assert modeling.apply_rotary_pos_emb is not original_apply
    assert [id(p) for p in m.parameters()] == before_params  # optimizer state carries over
    assert list(m.state_dict()) == before_keys
    assert wk.patch_hf(m) is m  # patching twice is a no-op
    _logits(m, x)
    wk.unpatch_hf(m)
    assert not wk.is_patched(m)
    assert module_ids(m) == before_modules
    assert modeling.apply_rotary_pos_emb is original_apply
    assert torch.equal(_logits(m, x), before)
    assert wk.unpatch_hf(m) is m  # unpatching twice is a no-op


def test_deep_copy_of_a_patched_model_outlives_the_original():
    x = ids(seed=19)
    m = wk.patch_hf(model("qwen2", seed=20))
    twin = copy.deepcopy(m)
    want = _logits(m, x)
    wk.unpatch_hf(m)
    del m
    gc.collect()
    assert wk.is_patched(twin) and torch.equal(_logits(twin, x), want)
    wk.unpatch_hf(twin)
    assert not isinstance(twin.model.rotary_emb, FusedRotaryEmbedding)


def test_unpatched_model_of_same_class_unaffected_while_another_is_patched():
    plain, other = model("llama", seed=8), model("llama", seed=9)
    x = ids(seed=10)
    before = _logits(plain, x)
    wk.patch_hf(other)
    _logits(other, x)
    assert torch.equal(_logits(plain, x), before)
    wk.unpatch_hf(other)


def test_weights_loaded_after_patching_are_used_and_kept_on_unpatch():
    m = wk.patch_hf(model("llama", seed=11))
    source = model("llama", seed=12)
    m.load_state_dict(source.state_dict())
    x = ids(seed=13)
    want = _logits(source.double(), x)
    assert rel_err(_logits(m, x), want) <= TOL
    wk.unpatch_hf(m)
    assert torch.equal(_logits(m.double(), x), want)


# ---- the MLP ---------------------------------------------------------------------------

def test_mlp_swap_shares_the_projections_and_runs_glu(monkeypatch):
    """Each SiLU-gated MLP becomes a FusedGatedMLP holding HF's own projection modules (same
    keys, same Parameters), whose gate product is one wiola_kernels.glu call; projections
    replaced after patching (as an adapter would) are used, and handed back on unpatch."""
    m = model("qwen2", seed=41)
    originals = [layer.mlp for layer in m.model.layers]
    keys = list(m.state_dict())
    wk.patch_hf(m)
    assert list(m.state_dict()) == keys
    for layer, original in zip(m.model.layers, originals):
        assert isinstance(layer.mlp, FusedGatedMLP)
        assert all(getattr(layer.mlp, p) is getattr(original, p) for p in ("gate_proj", "up_proj", "down_proj"))
    calls = []
    glu = hf.glu
    monkeypatch.setattr(hf, "glu", lambda *a: calls.append(a[2]) or glu(*a))
    x = ids(seed=42)
    _logits(m, x)
    assert calls == ["silu"] * len(originals)
    replacement = copy.deepcopy(originals[0].up_proj)
    with torch.no_grad():
        replacement.weight.mul_(2.0)
    m.model.layers[0].mlp.up_proj = replacement
    patched = _logits(m, x)
    wk.unpatch_hf(m)
    assert m.model.layers[0].mlp is originals[0] and originals[0].up_proj is replacement
    assert rel_err(_logits(m, x), patched) <= tolerance(torch.float32, "attention")


def test_mlp_with_another_activation_keeps_hf_mlp_with_a_warning():
    m = model("llama", seed=43, hidden_act="gelu_pytorch_tanh")
    mlps = [layer.mlp for layer in m.model.layers]
    x = ids(seed=44)
    want = _logits(copy.deepcopy(m).double(), x)
    with pytest.warns(UserWarning, match="gelu_pytorch_tanh"):
        wk.patch_hf(m)
    assert [layer.mlp for layer in m.model.layers] == mlps and isinstance(m.model.norm, wk.RMSNorm)
    assert rel_err(_logits(m, x), want) <= TOL
    wk.unpatch_hf(m)


# ---- the rotary embedding's outputs ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_rotary_emb_returns_hf_cos_sin_tensors(dtype):
    m = model("llama", seed=23)
    hf_rotary = m.model.rotary_emb
    wk.patch_hf(m)
    x = torch.zeros(2, 5, 64, dtype=dtype)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 200, 201]])
    want_cos, want_sin = hf_rotary(x, pos)
    cos, sin = m.model.rotary_emb(x, pos)
    for got, want in ((cos, want_cos), (sin, want_sin)):
        assert type(got) is torch.Tensor and got.shape == want.shape == (2, 5, 16) and got.dtype == dtype
        assert rel_err(got, want) <= tolerance(dtype)
    # Code that reads them as tensors (HF's own apply_rotary_pos_emb, here) gets HF's RoPE.
    g = torch.Generator().manual_seed(24)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    tables = m.model.rotary_emb(q, pos)  # float32, like q
    ours = _modeling(m).apply_rotary_pos_emb(q, k, *tables)
    theirs = _hf_apply(m)(q, k, *(t.clone() for t in tables))  # plain tensors: HF's arithmetic
    for a, b in zip(ours, theirs):
        assert rel_err(a, b) <= tolerance(torch.float32)
    wk.unpatch_hf(m)


def test_a_hand_edited_inv_freq_keeps_hf_rope_with_a_warning():
    m = model("llama", seed=25)
    with torch.no_grad():
        m.model.rotary_emb.inv_freq.mul_(0.5)  # e.g. a context-extension hack
    reference = copy.deepcopy(m)
    wk.patch_hf(m)
    batch = dict(input_ids=ids(seed=26), labels=ids(seed=26))
    with pytest.warns(UserWarning, match="inv_freq"):
        _logits(m, batch["input_ids"])
    assert m.model.rotary_emb.buffer_check == "hf"
    _assert_matches_float64(m, reference, batch)
    wk.unpatch_hf(m)


@pytest.mark.parametrize("head_dim", [24, 40])
def test_hfs_float32_inv_freq_passes_the_check_when_head_dim_is_not_a_power_of_two(head_dim, recwarn):
    # HF forms θ₀^(−2j/d_h) in float32, up to ~5 ulp from the float64 value when 2j/d_h is
    # not exact: still the default RoPE, so the fused RoPE runs.
    m = model("llama", seed=27, head_dim=head_dim)
    reference = copy.deepcopy(m)
    wk.patch_hf(m)
    batch = dict(input_ids=ids(seed=28), labels=ids(seed=28))
    _logits(m, batch["input_ids"])
    assert m.model.rotary_emb.buffer_check == "fused"
    assert not [w for w in recwarn if "wiola" in str(w.message)], [str(w.message) for w in recwarn]
    _assert_matches_float64(m, reference, batch)
    wk.unpatch_hf(m)


# ---- meta-device and to_empty models ------------------------------------------------------

def _materialise(m, source):
    """What FSDP-style meta initialisation does: real (uninitialised) storage, HF's own
    initialisation (which also fills the non-persistent rotary buffers), then the weights."""
    m.to_empty(device="cpu")
    m.initialize_weights()
    m.load_state_dict(source.state_dict())
    return m


@pytest.mark.parametrize("when", ["before to_empty", "after to_empty"])
@pytest.mark.parametrize("family", FAMILIES)
def test_meta_device_model(family, when, recwarn):
    source = model(family, seed=27)
    with torch.device("meta"):
        m = CAUSAL_LM[family](config(family))
    if when == "before to_empty":
        wk.patch_hf(m)  # nothing on meta can be read: the patch needs only the config
        assert wk.is_patched(m) and m.model.rotary_emb.hf_rotary.inv_freq.is_meta
        m.to_empty(device="cpu")
        m.initialize_weights()
        m.load_state_dict(source.state_dict())
    else:
        m.to_empty(device="cpu")  # inv_freq is garbage until HF's initialisation
        wk.patch_hf(m)
        m.initialize_weights()
        m.load_state_dict(source.state_dict())
    assert isinstance(m.model.rotary_emb, FusedRotaryEmbedding) and isinstance(m.model.norm, wk.RMSNorm)
    m.eval()
    _assert_matches_float64(m, copy.deepcopy(source), training_batch("ignore_index", seed=28), when)
    assert m.model.rotary_emb.buffer_check == "fused"  # the deferred check passed: the fused RoPE ran
    assert not [w for w in recwarn if "wiola" in str(w.message)]
    x = ids(seed=29)
    wk.unpatch_hf(m)
    assert torch.equal(_logits(m, x), _logits(source, x))  # HF's modules back, materialised


def test_forward_on_a_meta_model_gives_meta_outputs():
    with torch.device("meta"):
        m = wk.patch_hf(CAUSAL_LM["llama"](config("llama")))
    out = m(input_ids=torch.zeros(2, 7, dtype=torch.long, device="meta"))
    assert out.logits.is_meta and out.logits.shape == (2, 7, 101)
    assert m.model.rotary_emb.buffer_check == "pending"
    wk.unpatch_hf(m)


def test_accelerate_init_empty_weights():
    accelerate = pytest.importorskip("accelerate")
    source = model("qwen2", seed=32)
    with accelerate.init_empty_weights():  # parameters on meta, buffers real
        m = CAUSAL_LM["qwen2"](config("qwen2")).eval()  # eval: the loss keeps the logits to compare
    assert next(m.parameters()).is_meta
    wk.patch_hf(m)
    m.load_state_dict(source.state_dict(), assign=True)
    _assert_matches_float64(m, copy.deepcopy(source), training_batch("right_padding", seed=33))
    assert m.model.rotary_emb.buffer_check == "fused"
    wk.unpatch_hf(m)
    x = ids(seed=34)
    assert torch.equal(_logits(m, x), _logits(source, x))


# ---- the class-level form ---------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_class_level_patch_before_from_pretrained(family, tmp_path):
    source = model(family, seed=35)
    source.save_pretrained(tmp_path)
    cls = CAUSAL_LM[family]
    plain = cls.from_pretrained(tmp_path).eval()
    assert wk.patch_hf(cls) is cls and wk.is_patched(cls) and wk.is_patched(family)
    m = cls.from_pretrained(tmp_path).eval()
    assert wk.is_patched(m)
    assert isinstance(m.model.rotary_emb, FusedRotaryEmbedding) and isinstance(m.model.norm, wk.RMSNorm)
    assert not m.model.rotary_emb.hf_rotary.inv_freq.is_meta
    _assert_matches_float64(m, copy.deepcopy(plain), training_batch("num_items_in_batch", seed=36))
    assert m.model.rotary_emb.buffer_check == "fused"
    # Every model of the family is patched, however it is built; and only the outermost.
    auto = transformers.AutoModelForCausalLM.from_config(config(family))
    bare = transformers.AutoModel.from_config(config(family))
    assert wk.is_patched(auto) and not wk.is_patched(auto.model) and wk.is_patched(bare)
    wk.unpatch_hf(cls)
    assert not wk.is_patched(cls) and not wk.is_patched(family)
    assert "__init__" not in cls.__dict__ or not hasattr(cls.__init__, "_wiola_wrapped")
    later = cls.from_pretrained(tmp_path).eval()
    assert not wk.is_patched(later) and module_ids(later) != module_ids(m)
    assert wk.is_patched(m)  # models built while patched stay so until unpatched themselves
    wk.unpatch_hf(m)
    x = ids(seed=37)
    assert torch.equal(_logits(m, x), _logits(plain, x)) and torch.equal(_logits(later, x), _logits(plain, x))
    assert [type(s) for s in m.modules()] == [type(s) for s in plain.modules()]
    for built in (auto, bare):
        wk.unpatch_hf(built)


def test_class_level_patch_by_name_with_switches(tmp_path):
    model("llama", seed=38).save_pretrained(tmp_path)
    wk.patch_hf("llama", rope=False)
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert wk.is_patched(m) and isinstance(m.model.norm, wk.RMSNorm)
    assert type(m.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    wk.patch_hf("llama")  # patching again changes the switches for later models
    m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(m2.model.rotary_emb, FusedRotaryEmbedding)
    wk.unpatch_hf("llama")
    assert not wk.is_patched("llama") and not wk.is_patched(transformers.LlamaModel)
    for built in (m, m2):
        wk.unpatch_hf(built)
    with pytest.raises(ValueError, match="family"):
        wk.patch_hf("gpt2")
    with pytest.warns(UserWarning, match="GPT2LMHeadModel"):
        assert wk.patch_hf(transformers.GPT2LMHeadModel) is transformers.GPT2LMHeadModel
    assert not hf._class_patches


# ---- torch.compile ---------------------------------------------------------------------

def test_patched_model_compiles_without_graph_breaks():
    m = wk.patch_hf(model("llama", seed=39)).train()
    assert_compiled_step_matches_eager(m, training_batch("right_padding", seed=40))
    wk.unpatch_hf(m)


# ---- what is left alone ----------------------------------------------------------------

def test_unknown_architecture_left_untouched_with_a_warning():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    with torch.random.fork_rng():
        torch.manual_seed(16)
        m = transformers.GPT2LMHeadModel(cfg).eval()
    before = module_ids(m)
    with pytest.warns(UserWarning, match="GPT2LMHeadModel"):
        assert wk.patch_hf(m) is m
    assert module_ids(m) == before and not wk.is_patched(m)
    with pytest.warns(UserWarning, match="Linear"):
        wk.patch_hf(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="target"):
        wk.patch_hf(3)


def test_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import wiola_kernels as wk, torch\n"
            "assert wk.patch_hf(torch.nn.Linear(2, 2)) is not None and not wk.is_patched(torch.nn.Linear(2, 2))\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
