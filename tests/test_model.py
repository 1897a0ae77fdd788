"""The reference Wiola model (python/wiola) against tests/oracles.py's ModelOracle — SPEC
§2–§7 written out in float64 from the weights alone (embedding, WRMSNorm, SRPE, GQA with
group ``h mod H_kv``, the cross-layer sub-attention over the summaries of the up-to-Λ
previous layers, the gate, DSFF, both summary modes, ATM in the middle third in training,
the tied head) — and the model's own properties: backends, causality, caches and
generation, padding, loss and gradients, input errors, training. Configuration and
parameter counts: test_model_config.py; checkpoints: test_model_checkpoint.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import wiola_kernels
from wiola import WiolaCache, WiolaConfig, WiolaForCausalLM
from wiola.train import batch_iterator, build_model, corpus_tensor, decode, encode, generate_main, train_steps
from wiola.train import main as train_main
from wiola_kernels.testing import rel_err, tolerance

from helpers import randomise
from oracles import ModelOracle

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: OpenMP spin-waits cost 40x on a busy machine

def tiny_config(**overrides) -> WiolaConfig:
    kw = dict(
        vocab_size=61, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, dsff_narrow_size=24, dsff_wide_size=40,
        max_position_embeddings=64, gcla_lookback=2,
    )
    kw.update(overrides)
    return WiolaConfig(**kw)


def make_model(seed=0, **overrides):
    """A float64 model of ``tiny_config(**overrides)`` in eval mode, every parameter randomised."""
    cfg = tiny_config(**overrides)
    torch.manual_seed(seed)
    model = randomise(WiolaForCausalLM(cfg), seed).to(F64).eval()
    return model, cfg

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


# Every comparison with the oracle runs the model in float64, far below what any SPEC choice
# moves (each "discriminates" assert shows > 1e-3). transformers' generate() casts the scores
# it returns to float32: GENERATE_TOL is the float32 rounding of those.
TOL = 1e-12
GENERATE_TOL = 1e-6

def rel(a, b):
    return float((a - b).norm() / b.norm())


def middle_third(L):
    return tuple(range(L // 3, (2 * L) // 3))


# ---- SPEC §2-§7: forward against the oracle ------------------------------------------------------

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


# ---- parameters: no biases, tied head, init values -----------------------------------------------

def test_no_biases_and_tied_head():
    cfg = tiny_config()
    model = WiolaForCausalLM(cfg)
    for name, mod in model.named_modules():
        assert getattr(mod, "bias", None) is None, name
    assert not any("bias" in n for n, _ in model.named_parameters())
    inp, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert inp.data_ptr() == out.data_ptr() and inp.shape == out.shape
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
    std = float(P["model.layers.1.attn.q_proj.weight"].detach().std())
    assert abs(std - model.config.initializer_range) < 0.1 * model.config.initializer_range
    assert [layer.merges for layer in model.model.layers] == [i in middle_third(6) for i in range(6)]


# ---- backends ------------------------------------------------------------------------------------

def _logits_and_grads(model, ids, backend):
    """Logits and every parameter's gradient of the loss (the fused loss: the logits come from
    a second, gradient-free forward)."""
    model.config.kernel_backend = backend
    model.zero_grad(set_to_none=True)
    with model.kernel_backend():
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


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
    # The config's flag turns checkpointing on: in training, the backward runs every block's
    # forward a second time (the recomputation), and not without the flag.
    for flag in (True, False):
        model = WiolaForCausalLM(small(gradient_checkpointing=flag)).train()
        assert model.is_gradient_checkpointing == flag
        calls = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *args: calls.append(1))
        ids = torch.randint(3, 259, (1, 8), generator=torch.Generator().manual_seed(1))
        model(ids, labels=ids).loss.backward()
        assert len(calls) == (2 if flag else 1) * len(model.model.layers)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = make(small(), gate=0.0).train()
    ids = torch.randint(3, 259, (2, 17))
    _, plain = _logits_and_grads(model, ids, "reference")
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    _, ckpt = _logits_and_grads(model, ids, "reference")
    for name, g in plain.items():
        assert rel_err(ckpt[name], g) <= tolerance(torch.float32), name


# ---- ATM: training only, middle third only, slot context from its first member -------------------

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


def test_first_member_of_each_merged_slot():
    from wiola.modeling_wiola import first_member

    index_map = torch.tensor([[0, 0, 1, 2, 2, 3], [0, 1, 2, 3, 4, 5]])
    assert first_member(index_map).tolist() == [[0, 2, 3, 5, 0, 0], [0, 1, 2, 3, 4, 5]]


# ---- causality (SPEC §5.1, §6.5) -----------------------------------------------------------------

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


# ---- cache and generation ------------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [(4, 1, 1, 1, 1, 1, 1), (3, 4, 1, 2)])
def test_cached_decoding_equals_full_forward(chunks):
    """A cached forward of the prompt, then one token or several per call: each call's
    logits are the oracle's full forward's."""
    model, cfg = make_model(seed=9)
    ids = torch.randint(0, cfg.vocab_size, (2, sum(chunks)))
    want = ModelOracle(model, cfg).forward(ids)
    with torch.no_grad():
        cache, pieces, start = WiolaCache(), [], 0
        for n in chunks:
            out = model(ids[:, start:start + n], cache=cache, use_cache=True)
            cache, start = out.cache, start + n
            pieces.append(out.logits)
        assert rel(model(ids).logits, want) < TOL
    assert cache.get_seq_length() == ids.shape[1]
    assert rel(torch.cat(pieces, 1), want) < TOL


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


# ---- loss, gradients, padding --------------------------------------------------------------------

def _oracle_grads(model, cfg, ids, labels, **kw):
    oracle = ModelOracle(model, cfg, requires_grad=True)
    leaves = oracle.P
    logits = oracle.forward(ids, **kw)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    # layer 0 has no context, so its kc/vc projections and gate get no gradient
    return loss.detach(), {k: torch.zeros_like(v) if v.grad is None else v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("train", [False, True])
def test_loss_and_gradients_match_oracle(train):
    """§8: next-token cross-entropy with an ignored label, and the gradient of every
    parameter, through the fused ops (SPEC §10: the head's loss, DSFF's glu, add + norm) in
    float64; ATM on in training."""
    model, cfg = make_model(atm_threshold=0.1, hidden_size=16, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, seed=16)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    labels = ids.clone()
    labels[0, 2] = -100
    info = {}
    atm = middle_third(6) if train else ()
    want_loss, want = _oracle_grads(model, cfg, ids, labels, atm_layers=atm, info=info)
    if train:
        assert min(info["margin"]) > 1e-8 and all(info["merges"][l] > 0 for l in atm)
    model.train(train)
    out = model(ids, labels=labels)  # training mode: no cache by default, so ATM runs
    assert (out.cache is None) == train
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


# ---- input errors: ids, sequence lengths, masks, labels ------------------------------------------

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


@pytest.fixture(scope="module")
def model() -> WiolaForCausalLM:
    return short_model()


def short_model(**overrides) -> WiolaForCausalLM:
    """Two layers, max_position_embeddings = 16."""
    return make(small(num_hidden_layers=2, max_position_embeddings=16, **overrides), gate=None)

@pytest.mark.parametrize("batch", [1, 2])
def test_generate_refuses_an_empty_prompt(model, batch):
    empty = torch.zeros(batch, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate(empty, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate(input_ids=empty, max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("summary", ["causal", "paper"])
def test_generate_refuses_sequences_past_max_position_embeddings(summary):
    model = short_model(gcla_summary=summary)
    ids = torch.randint(3, 259, (2, 17))
    with pytest.raises(ValueError, match="17 tokens, more than max_position_embeddings = 16"):
        model.generate(ids, max_new_tokens=1, do_sample=False)
    with pytest.raises(ValueError, match="17 positions exceed max_position_embeddings = 16.* at most 6"):
        model.generate(ids[:, :10], max_new_tokens=7, do_sample=False)
    with pytest.raises(ValueError, match="max_position_embeddings = 16"):
        model.generate(ids[:, :10], max_length=17, do_sample=False)
    with torch.no_grad():  # exactly filling the context is fine
        out = model.generate(ids[:, :10], attention_mask=torch.ones(2, 10, dtype=torch.long), max_new_tokens=6,
                             do_sample=False, eos_token_id=None)
    assert out.shape == (2, 16)


def test_forward_refuses_empty_and_too_long_inputs(model):
    with torch.no_grad():
        with pytest.raises(ValueError, match="empty"):
            model(torch.zeros(1, 0, dtype=torch.long))
        with pytest.raises(ValueError, match="max_position_embeddings = 16"):
            model(torch.randint(3, 259, (1, 17)))
        out = model(torch.randint(3, 259, (1, 10)), use_cache=True)
        with pytest.raises(ValueError, match="10 cached \\+ 7 new positions exceed max_position_embeddings"):
            model(torch.randint(3, 259, (1, 7)), cache=out.cache, use_cache=True)
        assert model(torch.randint(3, 259, (1, 6)), cache=out.cache, use_cache=True).logits.shape == (1, 6, 259)


def test_generate_refuses_a_1d_prompt_naming_the_shape(model):
    with pytest.raises(ValueError, match=r"\(B, T\), got \(3,\).*ids\[None\]"):
        model.generate(torch.tensor([1, 75, 108]), max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"\(B, T\), got \(3,\)"):
        model.generate(input_ids=torch.tensor([1, 75, 108]), max_new_tokens=2, do_sample=False)


def test_attention_mask_and_labels_of_the_wrong_shape_are_named(model):
    ids = torch.tensor([[1, 75, 108]])
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, cached \+ T\) = \(1, 3\).*\(1, 5\)"):
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0]]))
    with pytest.raises(ValueError, match=r"attention_mask.*\(1, 2\)"):
        model(ids, attention_mask=torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(B, T\) = \(1, 3\), got \(1, 2\)"):
        model(ids, labels=torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        model(ids, labels=ids.float())
    # A full mask of the right shape is still accepted, and generate's (B, cached + T) masks too.
    torch.testing.assert_close(model(ids, attention_mask=torch.ones_like(ids)).logits, model(ids).logits,
                               rtol=0, atol=0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


# ---- training ------------------------------------------------------------------------------------

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
