"""A whole cached decoding step in one C++ call (wiola_kernels.decode.step, which the model's
forward takes through wiola.decode.fused_step): the same logits, running summaries and cache
as the model's own step (bit for bit: the same kernels in the same order), the
float64 full forward as the oracle, the cases that must take the model's own path, and bad
input."""

from __future__ import annotations

import pytest
import torch

from wiola import WiolaConfig, WiolaForCausalLM
from wiola.modeling_wiola import WiolaCache
from wiola_kernels.decode import step as decode_step
from wiola_kernels.testing import assert_close_rel, tolerance

F64 = torch.float64

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not decode_step.available(), reason="needs the C++ extension")]


def tiny(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    cfg = WiolaConfig.from_name("wiola-tiny", num_hidden_layers=4, num_key_value_heads=2, **kw)
    return WiolaForCausalLM(cfg).to(dtype).eval()


def ids_for(model, b, t, seed):
    return torch.randint(3, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def step_calls(monkeypatch):
    """The calls of the one-call step (each: the number of rows it decoded)."""
    calls = []
    whole = decode_step.decode_step

    def spy(input_ids, *args, **kwargs):
        calls.append(input_ids.shape[0])
        return whole(input_ids, *args, **kwargs)

    monkeypatch.setattr(decode_step, "decode_step", spy)
    return calls


def run_steps(model, ids, prompt):
    """``(logits of every position, the cache)``: a prompt forward, then one cached step a token."""
    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        pieces, cache = [out.logits], out.cache
        for i in range(prompt, ids.shape[1]):
            pieces.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits)
    return torch.cat(pieces, 1), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lookback", [0, 1, 2])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_call_step_equals_the_models_own_step(dtype, lookback, batch, step_calls, monkeypatch):
    # Oracle: the model's own decoding step (wiola.model, the one-call op off): the same
    # kernels in the same order, the norms' rows those of the add_rms_norm op, so the logits,
    # the running summary sums and every cached key and value are equal bit for bit.
    model = tiny(dtype, gcla_lookback=lookback)
    ids = ids_for(model, batch, 11, seed=31 + batch)
    runs = {}
    for one_call in (True, False):
        monkeypatch.setattr(decode_step, "available", lambda one_call=one_call: one_call)
        runs[one_call] = run_steps(model, ids, 6)
    assert step_calls == [batch] * 5
    (got, cache), (want, ref) = runs[True], runs[False]
    assert torch.equal(got, want)
    assert sorted(cache.summary_sums) == sorted(ref.summary_sums) == (list(range(3)) if lookback else [])
    for i in ref.summary_sums:
        assert torch.equal(cache.summary_sums[i], ref.summary_sums[i]), f"summary sum of layer {i}"
    for mine, theirs in zip(cache.layers, ref.layers):
        assert mine.keys.shape[2] == theirs.keys.shape[2] == 11
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("lookback", [0, 1, 2])
def test_one_call_steps_equal_the_float64_forward(lookback, step_calls):
    # Oracle: the full (uncached) forward of the same model in float64.
    model = tiny(gcla_lookback=lookback)
    ids = ids_for(model, 2, 13, seed=40)
    got, _ = run_steps(model, ids, 5)
    with torch.no_grad():
        want = model.to(F64)(ids, use_cache=False).logits
    assert step_calls == [2] * 8
    assert_close_rel(got, want, tolerance(torch.float32, "attention"), "decoded logits")


def test_generate_takes_one_call_a_token(step_calls, monkeypatch):
    # generate(): every step after the prompt is one call, and the tokens and scores are those
    # of the block-by-block step.
    model = tiny(torch.bfloat16)
    prompt = ids_for(model, 1, 7, seed=41)
    outs = {}
    for one_call in (True, False):
        monkeypatch.setattr(decode_step, "available", lambda one_call=one_call: one_call)
        with torch.no_grad():
            outs[one_call] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                            min_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
                                            return_dict_in_generate=True)
    assert step_calls == [1] * 11
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[True].scores, outs[False].scores))


def fallbacks():
    """Forwards the one-call step must leave to the model's own path: (name, setup, call)."""
    def hidden(model, ids, cache):
        return model(ids, cache=cache, use_cache=True, output_hidden_states=True)

    def two_tokens(model, ids, cache):
        return model(ids.expand(-1, 2), cache=cache, use_cache=True)

    def embeds(model, ids, cache):
        return model(inputs_embeds=model.get_input_embeddings()(ids), cache=cache, use_cache=True)

    def forced_backend(model, ids, cache):
        import wiola_kernels
        with wiola_kernels.use_backend("reference"):
            return model(ids, cache=cache, use_cache=True)

    def sharded_norms(model, ids, cache):  # the test makes the norms look sharded (FSDP)
        return model(ids, cache=cache, use_cache=True)

    return [("hidden states", hidden), ("two new tokens", two_tokens), ("inputs_embeds", embeds),
            ("forced backend", forced_backend), ("sharded norms", sharded_norms)]


@pytest.mark.parametrize("name,call", fallbacks(), ids=[f[0] for f in fallbacks()])
def test_other_forwards_take_the_models_path(name, call, step_calls, monkeypatch):
    # Oracle: the full float32 forward of the whole sequence.
    if name == "sharded norms":  # a norm whose parameters another module may not read (FSDP)
        from wiola import decode, model as wiola_model
        for module in (decode, wiola_model):
            monkeypatch.setattr(module, "holds_its_weights", lambda norm, d: False)
    model = tiny()
    ids = ids_for(model, 1, 7, seed=42)
    with torch.no_grad():
        full = model(torch.cat([ids, ids[:, -1:]], 1) if name == "two new tokens" else ids, use_cache=False).logits
        cache = model(ids[:, :6], use_cache=True).cache
        out = call(model, ids[:, 6:7], cache)
    assert step_calls == []
    assert_close_rel(out.logits[:, -1], full[:, -1], tolerance(torch.float32, "attention"), name)


def test_padded_batch_takes_the_models_path(step_calls):
    # A left-padded batch: the cache records which keys are padding; the one-call step (which
    # assumes none) must not run. Oracle: each row decoded alone.
    model = tiny()
    ids = ids_for(model, 2, 9, seed=43)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        out = model(ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
        got = model(ids[:, 8:], attention_mask=mask, cache=out.cache, use_cache=True).logits
        alone = model(ids[:1, 3:], use_cache=False).logits[:, -1:]
    assert step_calls == []
    assert_close_rel(got[:1], alone, tolerance(torch.float32, "attention"), "padded row")


def test_an_all_ones_mask_is_no_padding(step_calls):
    model = tiny()
    ids = ids_for(model, 2, 8, seed=44)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = model(ids[:, :7], attention_mask=torch.ones(2, 7, dtype=torch.long), use_cache=True).cache
        got = model(ids[:, 7:], attention_mask=torch.ones(2, 8, dtype=torch.long), cache=cache, use_cache=True)
    assert step_calls == [2]
    assert_close_rel(got.logits, full[:, 7:], tolerance(torch.float32, "attention"), "logits")


def test_an_id_outside_the_vocabulary_is_refused_before_the_cache_moves(step_calls):
    model = tiny()
    ids = ids_for(model, 1, 6, seed=45)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        keys = [layer.keys.clone() for layer in cache.layers]
        bad = torch.tensor([[model.config.vocab_size]])
        with pytest.raises(ValueError, match=r"^input_ids must lie in \[0, vocab_size\) = \[0, 259\), got values "
                                             r"in \[259, 259\]"):
            model(bad, cache=cache, use_cache=True)
    assert step_calls == [1]
    assert cache.get_seq_length() == 6
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, keys))


def step_arguments(model, ids, cache):
    """The arguments :func:`decode.fused_step` passes for one step of ``model``."""
    seen = {}
    whole = decode_step.decode_step

    def capture(*args, **kwargs):
        seen["args"], seen["kwargs"] = list(args), dict(kwargs)
        return whole(*args, **kwargs)

    decode_step.decode_step = capture
    try:
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
    finally:
        decode_step.decode_step = whole
    return seen["args"], seen["kwargs"]


@pytest.mark.parametrize("change,error,match", [
    (lambda a, k: a.__setitem__(2, a[2][:-1]), ValueError, r"^weights must hold the 12 matrices"),
    (lambda a, k: a.__setitem__(3, a[3][:-1]), ValueError, r"norm_weights, norm_shifts and norm_eps must hold"),
    (lambda a, k: a.__setitem__(3, [(w, s) for w, s, e in a[3]]), TypeError, r"^norms must be"),
    (lambda a, k: a.__setitem__(0, a[0].float()), TypeError, r"input_ids must be int64"),
    (lambda a, k: a.__setitem__(0, a[0][:, None]), ValueError, r"input_ids must be a CPU \(B, 1\) tensor"),
    (lambda a, k: a.__setitem__(6, a[6][:-1]), ValueError, r"gates, k_caches and v_caches must hold one tensor"),
    (lambda a, k: k.__setitem__("lookback", True), TypeError, r"^lookback must be an int"),
    (lambda a, k: k.__setitem__("summary_sums", k["summary_sums"][:-1]), ValueError, r"summary_sums must hold 3"),
    (lambda a, k: a.__setitem__(0, "ids"), TypeError, r"^input_ids must be a torch.Tensor"),
])
def test_decode_step_names_bad_arguments(change, error, match):
    model = tiny()
    ids = ids_for(model, 1, 7, seed=46)
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).cache
    args, kwargs = step_arguments(model, ids[:, 6:], cache)
    args[0] = ids[:, 6:]
    kwargs["summary_sums"] = list(kwargs["summary_sums"])
    change(args, kwargs)
    with pytest.raises(error, match=match):
        decode_step.decode_step(*args, **kwargs)


def test_fused_step_leaves_a_cache_it_cannot_append_to(step_calls):
    # A cache layer that is not a GrowingKV (a plain DynamicLayer) is updated the ordinary way.
    from transformers.cache_utils import DynamicLayer

    model = tiny()
    ids = ids_for(model, 1, 8, seed=47)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        fresh = model(ids[:, :7], use_cache=True).cache
        cache = WiolaCache()
        cache.summary_sums = dict(fresh.summary_sums)
        cache.layers = []
        for theirs in fresh.layers:
            mine = DynamicLayer()
            mine.lazy_initialization(theirs.keys, theirs.values)
            mine.keys, mine.values = theirs.keys.clone(), theirs.values.clone()
            cache.layers.append(mine)
        got = model(ids[:, 7:], cache=cache, use_cache=True).logits
    assert step_calls == []
    assert_close_rel(got, full[:, 7:], tolerance(torch.float32, "attention"), "logits")


def test_the_op_declares_what_it_mutates():
    # torch.library's schema check: the op writes the cache buffers (declared Tensor(a!)[] /
    # Tensor(b!)[]) and nothing else it is given (the summary sums come back as new tensors).
    import wiola_kernels.decode.step as ds

    model = tiny(gcla_lookback=2)
    ids = ids_for(model, 2, 7, seed=48)
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).cache
    args, kwargs = step_arguments(model, ids[:, 6:], cache)
    (input_ids, emb, weights, norms, betas, gates, k_bufs, v_bufs, past, positions, n_head) = args
    op_args = (ids[:, 6:], emb, list(weights), [n[0] for n in norms], [n[1] for n in norms],
               [float(n[2]) for n in norms], list(betas), list(gates), list(k_bufs), list(v_bufs), past - 1,
               positions - 1, n_head, kwargs["theta"], kwargs["spiral_divisor"], kwargs["radial_amplitude"],
               kwargs["radial_frequency"], kwargs["lookback"], list(kwargs["summary_sums"]), emb)
    with torch.no_grad():
        torch.library.opcheck(ds._kernel(), op_args, test_utils="test_schema")
