"""The reference Wiola model (python/wiola): config, parameter counts, backends, causality,
cached generation, Hugging Face round trips, convergence (SPEC §1, §2, §5.1, §6.5, §7)."""

from __future__ import annotations

import os

import pytest
import torch

from transformers import AutoConfig, AutoModelForCausalLM

import wiola_kernels
from wiola import WiolaCache, WiolaConfig, WiolaForCausalLM
from wiola.configuration_wiola import NOMINAL_PARAMETERS, PRESETS
from wiola.train import batch_iterator, build_model, corpus_tensor, decode, encode, generate_main, train_steps
from wiola.train import main as train_main
from wiola_kernels.testing import rel_err, tolerance

from oracles import ModelOracle

SEED_CONFIG = os.path.join(os.path.dirname(__file__), "data", "wiola-360m-config.json")  # copy of shared/seed


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: OpenMP spin-waits cost 40x on a busy machine


def small(**overrides) -> WiolaConfig:
    """A very small config for fast tests: d 64, L 6 (layers 2 and 3 merge under ATM)."""
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              dsff_narrow_size=64, dsff_wide_size=128)
    kw.update(overrides)
    return WiolaConfig.from_name("wiola-tiny", **kw)


def make(config: WiolaConfig, seed: int = 0, gate: float | None = 0.0) -> WiolaForCausalLM:
    """A model in eval mode; ``gate`` overrides g so the cross-layer part is large (σ(0) = 1/2)."""
    torch.manual_seed(seed)
    model = WiolaForCausalLM(config).eval()
    if gate is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.attn.gate.fill_(gate)
    return model


def count(config: WiolaConfig) -> int:
    with torch.device("meta"):
        model = WiolaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


# ---- configuration and sizes -------------------------------------------------------------

def test_seed_config_has_exactly_360_007_936_parameters():
    config = WiolaConfig.from_json_file(SEED_CONFIG)
    assert count(config) == 360_007_936


def test_seed_config_through_auto_config(tmp_path):
    (tmp_path / "config.json").write_text(open(SEED_CONFIG).read())
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, WiolaConfig) and config.gcla_summary == "causal" and config.head_dim == 64
    assert count(config) == 360_007_936


@pytest.mark.parametrize("name", sorted(NOMINAL_PARAMETERS))
def test_presets_within_5_percent_of_nominal(name):
    n = count(WiolaConfig.from_name(name))
    assert abs(n / NOMINAL_PARAMETERS[name] - 1) <= 0.05, f"{name}: {n:,}"


def test_tiny_preset_and_overrides():
    config = WiolaConfig.from_name("wiola-tiny", num_hidden_layers=3)
    assert config.num_hidden_layers == 3 and config.vocab_size == 259
    assert set(PRESETS) == {"wiola-120m", "wiola-360m", "wiola-700m", "wiola-1.5b", "wiola-tiny"}
    assert [i for i in range(16) if WiolaConfig().is_merge_layer(i)] == [5, 6, 7, 8, 9]


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 0), ("num_hidden_layers", -1), ("num_key_value_heads", 3), ("head_dim", 15),
    ("gcla_summary", "future"), ("kernel_backend", "gpu"), ("gcla_lookback", -1), ("atm_threshold", 1.5),
    ("rms_norm_eps", 0.0), ("vocab_size", "many"), ("srpe_spiral_divisor", 0),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        WiolaConfig.from_name("wiola-tiny", **{field: value})


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="wiola-360m"):
        WiolaConfig.from_name("wiola-9b")


def test_structure_init_and_tying():
    config = small()
    model = make(config, gate=None)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(not n.endswith("bias") for n, _ in model.named_parameters())
    attn = model.model.layers[1].attn
    assert torch.equal(attn.gate, torch.full((4,), -3.0))
    assert abs(float(attn.q_proj.weight.detach().std()) - config.initializer_range) < 0.004
    assert torch.equal(model.model.layers[0].attn_norm.weight, torch.ones(64))
    assert torch.equal(model.model.layers[0].attn_norm.shift, torch.zeros(64))
    assert torch.equal(model.model.layers[0].ffn.beta, torch.zeros(64))
    assert [layer.merges for layer in model.model.layers] == [False, False, True, True, False, False]


# ---- backends ------------------------------------------------------------------------------

def _logits_and_grads(model, ids, backend):
    model.config.kernel_backend = backend
    model.zero_grad(set_to_none=True)
    with model.kernel_backend():
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["causal", "paper"])
def test_forward_matches_an_independent_oracle(mode):
    """The model's float64 logits against tests/oracles.py's ModelOracle (SPEC §2-§7 written out
    from the weights alone, none of this package's code): the other tests here compare the
    model with itself (backends, caches, round trips), which a wrong formula passes."""
    model = make(small(gcla_summary=mode), gate=0.0).double()
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(ids).logits
    want = ModelOracle(model, model.config).forward(ids, mode=mode)
    assert rel_err(got, want) <= tolerance(torch.float64)


@pytest.mark.parametrize("mode", ["causal", "paper"])
@pytest.mark.parametrize("training", [False, True])
def test_reference_and_auto_backends_agree(mode, training):
    chosen = {op: wiola_kernels.dispatch.select(op, torch.device("cpu")) for op in wiola_kernels.dispatch.ops()}
    if set(chosen.values()) == {"reference"}:
        pytest.skip(f"no fused backend can run here, 'auto' is the reference: {chosen}")
    model = make(small(gcla_summary=mode), gate=0.0).train(training)
    ids = torch.randint(3, 259, (3, 23))
    ref_logits, ref_grads = _logits_and_grads(model, ids, "reference")
    logits, grads = _logits_and_grads(model, ids, "auto")
    assert rel_err(logits, ref_logits) <= tolerance(torch.float32)
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) <= tolerance(torch.float32, "attention"), name


def test_gradient_checkpointing_from_the_config():
    model = WiolaForCausalLM(small(gradient_checkpointing=True))
    assert model.is_gradient_checkpointing and model.model.layers[0].gradient_checkpointing


def test_gradient_checkpointing_gives_the_same_gradients():
    model = make(small(), gate=0.0).train()
    ids = torch.randint(3, 259, (2, 17))
    _, plain = _logits_and_grads(model, ids, "reference")
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    _, ckpt = _logits_and_grads(model, ids, "reference")
    for name, g in plain.items():
        assert rel_err(ckpt[name], g) <= tolerance(torch.float32), name


# ---- causality (SPEC §5.1, §6.5) -------------------------------------------------------------

def _changes_before(model, ids, t):
    """Largest change of logits at positions ≤ t when token t+1 is replaced."""
    other = ids.clone()
    other[:, t + 1] = 3 + (other[:, t + 1] - 3 + 101) % 256
    with torch.no_grad():
        a = model(ids, use_cache=False).logits[:, : t + 1]
        b = model(other, use_cache=False).logits[:, : t + 1]
    return float((a - b).abs().max())


def test_causal_summaries_are_causal_in_eval():
    model = make(small(), gate=0.0)
    seq = torch.randint(3, 259, (16,))
    variants = seq.repeat(16, 1)  # row 0: the sequence; row r ≥ 1: token r replaced
    rows = torch.arange(1, 16)
    variants[rows, rows] = 3 + (seq[1:] - 3 + 101) % 256
    with torch.no_grad():
        out = model(variants, use_cache=False).logits
    for r in range(1, 16):  # token r changed: logits at positions < r must not move
        assert float((out[r, :r] - out[0, :r]).abs().max()) <= 1e-6, f"token {r} changed logits before it"
        assert float((out[r, r:] - out[0, r:]).abs().max()) > 1e-4


def test_paper_summaries_leak_the_future():
    model = make(small(gcla_summary="paper"), gate=0.0)
    ids = torch.randint(3, 259, (2, 16))
    assert _changes_before(model, ids, 0) > 1e-4  # position 0 sees the mean over all tokens


def test_atm_in_training_leaks_and_eval_does_not():
    # τ = −1 merges every pair it can; a merged pair (t, t+1) gives t the output of both.
    model = make(small(atm_threshold=-1.0, kernel_backend="reference"), gate=0.0)
    ids = torch.randint(3, 259, (2, 16))
    model.train()
    assert _changes_before(model, ids, 0) > 1e-4
    model.eval()
    assert _changes_before(model, ids, 0) == 0.0


def test_first_member_of_each_merged_slot():
    from wiola.modeling_wiola import first_member

    index_map = torch.tensor([[0, 0, 1, 2, 2, 3], [0, 1, 2, 3, 4, 5]])
    assert first_member(index_map).tolist() == [[0, 2, 3, 5, 0, 0], [0, 1, 2, 3, 4, 5]]


def test_atm_merges_happen_and_training_runs():
    model = make(small(atm_threshold=-1.0, kernel_backend="reference"), gate=0.0).train()
    ids = torch.randint(3, 259, (2, 16))
    out = model(ids, labels=ids)  # training mode: no cache by default, so ATM runs
    assert out.cache is None
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_right_padding_matches_unpadded_rows():
    model = make(small(), gate=0.0)
    ids = torch.randint(3, 259, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=False).logits
        alone = model(ids[1:, :7], use_cache=False).logits
    assert rel_err(padded[1, :7], alone[0]) <= tolerance(torch.float32)
    holed = mask.clone()
    holed[0, 3] = 0
    with pytest.raises(ValueError, match="contiguous"):
        model(ids, attention_mask=holed)


# ---- cache and generation ---------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [(5, 1, 1, 1, 1, 1, 1, 1), (3, 4, 1, 4)])
def test_cached_decoding_equals_full_forward(chunks):
    model = make(small(), gate=0.0)
    ids = torch.randint(3, 259, (2, sum(chunks)))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache, pieces, start = WiolaCache(), [], 0
        for n in chunks:
            out = model(ids[:, start:start + n], cache=cache, use_cache=True)
            cache, start = out.cache, start + n
            pieces.append(out.logits)
    assert cache.get_seq_length() == ids.shape[1]
    assert rel_err(torch.cat(pieces, 1), full) <= tolerance(torch.float32)


def _greedy_by_hand(model, ids, n):
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    return ids


@pytest.mark.parametrize("mode", ["causal", "paper"])
def test_generate_greedy_matches_full_recompute(mode):
    model = make(small(gcla_summary=mode), gate=0.0)
    prompt = torch.randint(3, 259, (2, 5))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    assert torch.equal(out, _greedy_by_hand(model, prompt, 8))


def test_generate_sampling():
    model = make(small(), gate=0.0)
    prompt = torch.randint(3, 259, (1, 4))
    torch.manual_seed(1)
    a = model.generate(prompt, max_new_tokens=10, do_sample=True, top_k=20, temperature=1.0, pad_token_id=0,
                       eos_token_id=None)
    torch.manual_seed(1)
    b = model.generate(prompt, max_new_tokens=10, do_sample=True, top_k=20, temperature=1.0, pad_token_id=0,
                       eos_token_id=None)
    assert a.shape == (1, 14) and torch.equal(a, b) and torch.equal(a[:, :4], prompt)
    assert int(a.max()) < 259


def test_paper_mode_refuses_a_filled_cache():
    model = make(small(gcla_summary="paper"), gate=0.0)
    ids = torch.randint(3, 259, (1, 6))
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        with pytest.raises(ValueError, match="paper"):
            model(ids[:, 5:], cache=out.cache, use_cache=True)


# ---- Hugging Face round trip ---------------------------------------------------------------------

def test_save_and_load_round_trip_bit_exact(tmp_path):
    model = make(small(gcla_summary="paper", atm_threshold=0.8), gate=None)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # every tensor differs from its init
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, WiolaForCausalLM)
    assert loaded.config.gcla_summary == "paper" and loaded.config.atm_threshold == 0.8
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    ids = torch.randint(3, 259, (1, 9))
    with torch.no_grad():  # same weights; BLAS may round differently on differently aligned buffers
        assert rel_err(loaded.eval()(ids).logits, model(ids).logits) <= tolerance(torch.float32)


# ---- training ---------------------------------------------------------------------------------

def test_tokenizer_round_trip():
    text = "Wiola — spiral positions, ünïcode."
    ids = encode(text)
    assert ids[0] == 1 and min(ids[1:]) >= 3 and max(ids) < 259
    assert decode(ids) == text


def _curve(backend: str, steps: int = 30) -> list[float]:
    config = WiolaConfig.from_name("wiola-tiny", kernel_backend=backend)
    model = build_model(config, seed=0)
    batches = batch_iterator(corpus_tensor(), batch_size=4, seq_len=32, seed=0)
    return train_steps(model, config, batches, steps, lr=3e-3, warmup=5)


def test_convergence_reference_vs_fused_30_steps():
    ref = _curve("reference")
    fused = _curve("auto")
    assert ref[-1] < ref[0] - 0.5, f"loss did not fall: {ref[0]:.3f} -> {ref[-1]:.3f}"
    for step, (a, b) in enumerate(zip(ref, fused)):
        assert abs(a - b) <= 1e-3 * abs(a), f"step {step}: reference {a:.6f} vs fused {b:.6f}"


def test_train_and_generate_command_line(tmp_path, capsys):
    losses = train_main(["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--out", str(tmp_path),
                         "--no-progress", "--losses-json", str(tmp_path / "losses.json")])
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "train_state.json").exists()
    text = generate_main(["--checkpoint", str(tmp_path), "--max-new-tokens", "6", "--temperature", "0", "Hi"])
    assert "Hi" + text in capsys.readouterr().out


def test_model_package_reaches_no_private_name_of_wiola_kernels():
    """python/wiola runs the code its users run: every name it takes from wiola_kernels
    (imports and attribute chains such as ``wiola_kernels.dispatch.select``) is public, no
    path component starting with an underscore."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "python" / "wiola"
    found = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        aliases = {"wiola_kernels"}  # local names bound to wiola_kernels (import wiola_kernels as wk)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "wiola_kernels":
                        found.append((path.name, a.name))
                        aliases.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "wiola_kernels":
                found += [(path.name, f"{node.module}.{a.name}") for a in node.names]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, inner = [node.attr], node.value
                while isinstance(inner, ast.Attribute):
                    chain.append(inner.attr)
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id in aliases:
                    found.append((path.name, ".".join([inner.id, *reversed(chain)])))
    assert len(found) > 10, found  # the walk sees the package's imports
    private = sorted({(f, name) for f, name in found if any(p.startswith("_") for p in name.split("."))})
    assert not private, private
