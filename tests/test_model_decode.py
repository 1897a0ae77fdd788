"""Cached decoding steps (python/wiola/decode.py): the attention over the cache
against the float64 SPEC oracle, the in-place KV cache against concatenation, and decoding
on the packed weights against the model's full forward (which runs the fused ops)."""

from __future__ import annotations

import pytest
import torch

from wiola import WiolaConfig, WiolaForCausalLM, decode
from wiola.decode import GrowingKV, cached_attention
from wiola.modeling_wiola import WiolaCache, WiolaModel
from wiola_kernels.reference.gcla_attention import gcla_attention_forward
from wiola_kernels.testing import assert_close_rel, available_cpu_isas, cpu_isa, tolerance

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def randn(g, *shape, dtype=F64):
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


def no_context(b, h, dh, dtype=F64):
    """Λ' = 0 context for the reference op: plain causal attention."""
    return torch.zeros(b, h, 1, 0, dh, dtype=dtype), torch.zeros(b, h, 1, 0, dh, dtype=dtype)


# ---- attention over the cache ---------------------------------------------------------------

@pytest.mark.parametrize("h,h_kv", [(4, 4), (4, 1), (4, 2), (6, 3), (8, 2)])
@pytest.mark.parametrize("t_new", [1, 3])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_cached_attention_is_the_last_rows_of_the_full_attention(h, h_kv, t_new, dtype):
    # Oracle: SPEC §5.5's attention over the whole sequence (reference op, float64, Λ' = 0);
    # the queries of the last t_new positions against all keys are its last t_new rows.
    g = torch.Generator().manual_seed(100 * h + 10 * h_kv + t_new)
    b, t, dh = 2, 9, 8
    q, k, v = randn(g, b, h, t, dh), randn(g, b, h_kv, t, dh), randn(g, b, h_kv, t, dh)
    kc, vc = no_context(b, h, dh)
    ref = gcla_attention_forward(q, k, v, q, kc, vc, torch.zeros(h, dtype=F64))[0][:, :, -t_new:]
    out = cached_attention(q[:, :, -t_new:].to(dtype), k.to(dtype), v.to(dtype))
    assert out.shape == (b, h, t_new, dh)
    assert_close_rel(out, ref, tolerance(dtype, "attention"), "cached attention")


def test_cached_attention_leaves_padded_keys_out():
    # Row 0 is left-padded by 3 keys: its result must be that of its real keys alone
    # (oracle: the reference op on the row with the pads cut off); a query with no real key
    # at or before it gets 0.
    g = torch.Generator().manual_seed(7)
    b, h, h_kv, t, dh = 2, 6, 3, 8, 4
    q, k, v = randn(g, b, h, 2, dh), randn(g, b, h_kv, t, dh), randn(g, b, h_kv, t, dh)
    key_valid = torch.ones(b, t, dtype=torch.bool)
    key_valid[0, :3] = False
    out = cached_attention(q, k, v, key_valid)
    kc, vc = no_context(1, h, dh)
    for row, start in ((0, 3), (1, 0)):
        ks, vs = k[row:row + 1, :, start:], v[row:row + 1, :, start:]
        q_full = torch.cat([torch.zeros(1, h, ks.shape[2] - 2, dh, dtype=F64), q[row:row + 1]], 2)
        ref = gcla_attention_forward(q_full, ks, vs, q_full, kc, vc, torch.zeros(h, dtype=F64))[0][:, :, -2:]
        assert_close_rel(out[row:row + 1], ref, tolerance(F64, "attention"), f"row {row}")
    all_pad = torch.zeros(1, t, dtype=torch.bool)
    assert torch.equal(cached_attention(q[:1], k[:1], v[:1], all_pad), torch.zeros(1, h, 2, dh, dtype=F64))


# ---- the in-place KV cache --------------------------------------------------------------------

def test_growing_cache_holds_what_concatenation_would():
    g = torch.Generator().manual_seed(3)
    cache = WiolaCache()
    assert cache.layer_class_to_replicate is GrowingKV
    chunks = [randn(g, 2, 3, n, 4, dtype=torch.float32) for n in (5, 1, 1, 300, 1, 2)]
    vals = [c * 2 + 1 for c in chunks]
    for c, v in zip(chunks, vals):
        keys, values = cache.update(c, v, 0)
    assert torch.equal(keys, torch.cat(chunks, 2)) and torch.equal(values, torch.cat(vals, 2))
    assert cache.get_seq_length() == sum(c.shape[2] for c in chunks)
    # Hugging Face methods that replace the tensors (beam reordering, repeats) or slice them (crop)
    beam = torch.tensor([1, 0])
    cache.layers[0].reorder_cache(beam)
    new = randn(g, 2, 3, 1, 4, dtype=torch.float32)
    keys, _ = cache.update(new, new, 0)
    assert torch.equal(keys, torch.cat([torch.cat(chunks, 2).index_select(0, beam), new], 2))
    cache.layers[0].crop(-4)
    newer = randn(g, 2, 3, 2, 4, dtype=torch.float32)
    keys, _ = cache.update(newer, newer, 0)
    expect = torch.cat([torch.cat([torch.cat(chunks, 2).index_select(0, beam), new], 2)[:, :, :-4], newer], 2)
    assert torch.equal(keys, expect)
    cache.layers[0].batch_repeat_interleave(2)
    last = randn(g, 4, 3, 1, 4, dtype=torch.float32)
    keys, _ = cache.update(last, last, 0)
    assert torch.equal(keys, torch.cat([expect.repeat_interleave(2, 0), last], 2))


# ---- decoding steps on the packed weights ----------------------------------------------------------

def tiny(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    cfg = WiolaConfig.from_name("wiola-tiny", num_hidden_layers=4, **kw)
    return WiolaForCausalLM(cfg).to(dtype).eval()


def decode_logits(model, ids, prompt):
    """Logits of ``ids`` from a prompt forward and then one cached step per token."""
    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        pieces, cache = [out.logits], out.cache
        for i in range(prompt, ids.shape[1]):
            out = model(ids[:, i:i + 1], cache=cache, use_cache=True)
            pieces.append(out.logits)
    return torch.cat(pieces, 1)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("packing", [True, False])
def test_decoding_steps_equal_the_full_forward(dtype, packing, monkeypatch):
    monkeypatch.setattr(WiolaModel, "decode_packing", packing)
    model = tiny(dtype, num_key_value_heads=2)  # H 4, H_kv 2: the h mod H_kv grouping matters
    ids = torch.randint(3, model.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    got = decode_logits(model, ids, 6)
    assert_close_rel(got, full, tolerance(dtype, "attention"), "decoded logits")
    assert (model.model._decode_weights is not None) == packing


def test_packed_copies_follow_the_weights(monkeypatch):
    # An in-place change of a parameter (an optimizer step, load_state_dict) after decoding
    # must reach the next decoding step: oracle, the full forward of the changed model.
    monkeypatch.setattr(WiolaModel, "decode_packing", True)
    model = tiny()
    ids = torch.randint(3, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(6))
    decode_logits(model, ids, 5)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        blk = model.model.layers[1]
        for p in (blk.attn.k_proj.weight, blk.ffn.w_w3.weight, model.model.embed_tokens.weight):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        full = model(ids, use_cache=False).logits
    assert_close_rel(decode_logits(model, ids, 5), full, tolerance(torch.float32, "attention"), "after the change")
    model.train()
    assert model.model._decode_weights is None  # train() frees the copies


def test_padded_batch_decodes_each_row_as_alone():
    model = tiny()
    g = torch.Generator().manual_seed(9)
    long, short = torch.randint(3, 200, (1, 9), generator=g), torch.randint(3, 200, (1, 6), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        alone = model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=6, do_sample=False)
    assert torch.equal(batch[1, 9:], alone[0, 6:])


# ---- the GEMV kernel (CPU float32/bfloat16/float16; wiola_kernels.decode_gemv) ----------------------

needs_gemv = pytest.mark.skipif(not decode.gemv_applies(torch.float32, torch.device("cpu")),
                                reason="needs the C++ extension")


def held_storages(model) -> dict[int, int]:
    """``{storage address: bytes}`` of every tensor the model holds: parameters, buffers and
    whatever decoding keeps (``_decode_weights``), walked through containers and objects."""
    found: dict[int, int] = {}

    def walk(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            found[st.data_ptr()] = st.nbytes()
        elif depth < 6 and isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif depth < 6 and isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif depth < 6 and hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
            walk(vars(obj), depth + 1)

    for t in [*model.parameters(), *model.buffers()]:
        walk(t)
    walk(model.model._decode_weights)
    return found


@needs_gemv
@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("step", [1, 3])
def test_gemv_steps_equal_the_full_forward(isa, step, monkeypatch):
    # Every projection of a step on the GEMV kernel (both ISA paths where the CPU has AVX-512),
    # B·T_new = 2 and 6 rows; oracle: the full forward, which runs nn.Linear and the fused ops.
    monkeypatch.setattr(WiolaModel, "decode_packing", True)
    model = tiny(num_key_value_heads=2)
    ids = torch.randint(3, model.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(15))
    with torch.no_grad(), cpu_isa(None if isa == "auto" else isa):
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5], use_cache=True)
        pieces, cache = [out.logits], out.cache
        for i in range(5, 14, step):
            out = model(ids[:, i:i + step], cache=cache, use_cache=True)
            pieces.append(out.logits)
    assert_close_rel(torch.cat(pieces, 1), full, tolerance(torch.float32, "attention"), "decoded logits")
    weights = model.model._decode_weights
    assert not weights.blocks and weights.head is None  # the kernel read the parameters: no copies


@pytest.mark.parametrize("gemv,fuse,one_call", [(True, True, True), (True, True, False), (True, False, False),
                                                 (False, True, False), (False, False, False)])
def test_decoding_steps_run_the_blocks_own_sequence(gemv, fuse, one_call, monkeypatch):
    # The block's norms, residual adds and their fusion are written once in Python
    # (WiolaBlock.sequence) and once in C++ (wiola_kernels.decode_block, the same kernels in the
    # same order): a decoding step on the GEMV kernel with the add-and-norm fusion on runs the
    # whole step as one C++ call (wiola_kernels.decode_step, which runs the C++ block for every
    # block) or, without that op, the C++ block from Python for every block; otherwise the
    # block's own sequence (the packed copies, or the fusion off as the block says). Oracle:
    # the full forward.
    from wiola.modeling_wiola import WiolaBlock
    from wiola_kernels import decode_block, decode_step

    if gemv and not decode.gemv_applies(torch.float32, torch.device("cpu")):
        pytest.skip("needs the C++ extension")
    monkeypatch.setattr(WiolaBlock, "fuse_add_norm", fuse)
    if not one_call:
        monkeypatch.setattr(decode_step, "available", lambda: False)
    model = tiny(torch.float32 if gemv else F64)
    calls, fused_calls, step_calls = [], [], []
    sequence, fused, whole = WiolaBlock.sequence, decode_block.decode_block, decode_step.decode_step

    def spy(self, *args, **kwargs):
        calls.append(self.layer_idx)
        return sequence(self, *args, **kwargs)

    def fused_spy(*args, **kwargs):
        fused_calls.append(1)
        return fused(*args, **kwargs)

    def step_spy(*args, **kwargs):
        step_calls.append(1)
        return whole(*args, **kwargs)

    monkeypatch.setattr(WiolaBlock, "sequence", spy)
    monkeypatch.setattr(decode_block, "decode_block", fused_spy)
    monkeypatch.setattr(decode_step, "decode_step", step_spy)
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :6], use_cache=True)
        cache, pieces = out.cache, [out.logits]
        calls.clear()
        for i in range(6, 9):
            pieces.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits)
    layers = model.config.num_hidden_layers
    in_cpp = gemv and fuse
    assert calls == ([] if in_cpp else list(range(layers)) * 3)
    assert len(step_calls) == (3 if one_call else 0)
    assert len(fused_calls) == (layers * 3 if in_cpp and not one_call else 0)
    assert (model.model._decode_weights.blocks == {}) == gemv
    dtype = torch.float32 if gemv else F64
    assert_close_rel(torch.cat(pieces, 1), full, tolerance(dtype, "attention"), "decoded logits")


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("next_norm", [True, False])
@pytest.mark.parametrize("lookback", [0, 1, 2])
def test_fused_block_equals_the_python_sequence(dtype, next_norm, lookback, monkeypatch):
    # The C++ block runs the Python step's GEMV and attention kernels and, between them, its own
    # loops with the Python step's roundings: the same logits and running summaries to
    # rounding, with and without the next norm fused into the block (FSDP's sharded norms leave
    # it to its owner), with no context, one slot and two.
    from wiola import modeling_wiola
    from wiola_kernels import decode_block

    if not next_norm:
        monkeypatch.setattr(modeling_wiola, "holds_its_weights", lambda norm, d: False)
    model = tiny(dtype, num_key_value_heads=2, gcla_lookback=lookback)
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(25))
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(decode_block, "available", lambda fused=fused: fused)
        with torch.no_grad():
            out = model(ids[:, :6], use_cache=True)
            cache, pieces = out.cache, [out.logits]
            for i in range(6, 10):
                pieces.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits)
        runs[fused] = torch.cat(pieces, 1), dict(cache.summary_sums)
    tol = tolerance(dtype, "attention")
    assert_close_rel(runs[True][0], runs[False][0], tol, "logits")
    assert runs[True][1].keys() == runs[False][1].keys()
    for k in runs[True][1]:
        assert_close_rel(runs[True][1][k], runs[False][1][k], tol, f"summary sum {k}")


@needs_gemv
@pytest.mark.parametrize("lookback", [0, 1, 2])
def test_fused_attention_runs_once_per_block(lookback, monkeypatch):
    # Without the C++ block (wiola_kernels.decode_block), a one-position step's attention
    # (SRPE, cache append, softmax over the cache, the Λ' context slots: none, one without
    # keys, two) is one decode_attention call per block, and the steps equal the full forward.
    # Oracle: the full forward (nn.Linear and the fused op).
    from wiola_kernels import decode_attention, decode_block

    monkeypatch.setattr(decode_block, "available", lambda: False)
    model = tiny(num_key_value_heads=2, gcla_lookback=lookback)
    calls = []
    fused = decode_attention.decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["context_v"].shape[1] if kwargs["context_v"] is not None else 0)
        return fused(*args, **kwargs)

    monkeypatch.setattr(decode_attention, "decode_attention", spy)
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(23))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    got = decode_logits(model, ids, 6)
    layers = model.config.num_hidden_layers
    assert calls == [min(i, lookback) for i in range(layers)] * 5
    assert_close_rel(got, full, tolerance(torch.float32, "attention"), "decoded logits")


@needs_gemv
def test_fused_attention_leaves_other_cache_layers_to_update(monkeypatch):
    # A cache whose layers are not GrowingKV (a plain DynamicLayer) is updated the ordinary
    # way, with the same result.
    from transformers.cache_utils import DynamicLayer

    model = tiny(num_key_value_heads=2)
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(24))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5], use_cache=True)
        cache, pieces = out.cache, [out.logits]
        cache.layers = [DynamicLayer() for _ in cache.layers]  # re-seeded below from the prompt's keys
        fresh = model(ids[:, :5], use_cache=True, cache=WiolaCache()).cache
        for mine, theirs in zip(cache.layers, fresh.layers):
            mine.lazy_initialization(theirs.keys, theirs.values)
            mine.keys, mine.values = theirs.keys.clone(), theirs.values.clone()
        for i in range(5, 9):
            pieces.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits)
    assert all(type(layer) is DynamicLayer and layer.keys.shape[2] == 9 for layer in cache.layers)
    assert_close_rel(torch.cat(pieces, 1), full, tolerance(torch.float32, "attention"), "decoded logits")


@needs_gemv
def test_gemv_greedy_tokens_equal_the_unpacked_path(monkeypatch):
    model = tiny()
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(16))
    runs = {}
    for packing in (True, False):
        monkeypatch.setattr(WiolaModel, "decode_packing", packing)
        with torch.no_grad():
            runs[packing] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                           do_sample=False, pad_token_id=0)
    assert model.model._decode_weights is None  # packing off drops the copies
    assert torch.equal(runs[True], runs[False])


@needs_gemv
def test_gemv_steps_follow_the_folded_parameters(monkeypatch):
    # β (DSFF blend), g (context gate) and the context matrices enter the step through small
    # ops on the kernel's results: changing them in place must reach the next step. Oracle:
    # the full forward of the changed model.
    monkeypatch.setattr(WiolaModel, "decode_packing", True)
    model = tiny()
    ids = torch.randint(3, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(17))
    decode_logits(model, ids, 5)
    g = torch.Generator().manual_seed(18)
    with torch.no_grad():
        for blk in model.model.layers:
            for p in (blk.ffn.beta, blk.attn.gate, blk.attn.kc_proj.weight, blk.ffn.w_n2.weight):
                p.add_(torch.randn(p.shape, generator=g))
        full = model(ids, use_cache=False).logits
    assert_close_rel(decode_logits(model, ids, 5), full, tolerance(torch.float32, "attention"), "after the change")


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_steps_equal_the_models_own_forward(dtype, monkeypatch):
    # A bf16/fp16 model decodes on the kernel (16-bit weights widened in registers); oracle:
    # the same model's own forward in that dtype, within SPEC §9's tolerance for it.
    monkeypatch.setattr(WiolaModel, "decode_packing", True)
    model = tiny(dtype, num_key_value_heads=2)
    assert decode.gemv_applies(dtype, torch.device("cpu"))
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(19))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    got = decode_logits(model, ids, 5)
    assert got.dtype == dtype
    assert_close_rel(got, full, tolerance(dtype), f"{dtype} decoded logits")


@needs_gemv
def test_bf16_greedy_tokens_over_32_steps():
    # The full wiola-tiny preset in bf16: 32 greedy steps on the kernel, on every ISA path,
    # give the tokens of the model's own bf16 modules decoding the same prompt (decode_packing
    # off). bf16 logits tie often in a random model (init 0.02 repeats one token; ties flip on
    # any change of rounding), so the weights are drawn wider (init 0.15, varied tokens) and the
    # prompt is one whose reference keeps every step's top-2 gap above 1% of the top logit
    # (≈ 5 bf16 steps): a real difference in the decoding path flips a token, rounding does not.
    torch.manual_seed(0)
    model = WiolaForCausalLM(WiolaConfig.from_name("wiola-tiny", initializer_range=0.15)).to(torch.bfloat16).eval()
    prompt = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(26))

    def greedy():
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                                  min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)

    model.model.decode_packing = False
    ref = greedy()
    with torch.no_grad():
        top2 = model(ref, use_cache=False).logits[0, 5:-1].float().topk(2, -1).values
    assert ((top2[:, 0] - top2[:, 1]) / top2[:, 0].abs()).min() > 0.01 and len(set(ref[0, 6:].tolist())) > 20
    model.model.decode_packing = True
    for isa in available_cpu_isas("decode_gemv"):
        with cpu_isa(isa):
            got = greedy()
        assert got.shape == (1, 6 + 32) and torch.equal(got, ref), isa


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_holds_no_second_copy_of_the_weights(dtype):
    # After generate() the model holds the same storages as before: the parameters, where they
    # were, and nothing packed beside them.
    model = tiny(dtype)
    before = held_storages(model)
    ptrs = [p.data_ptr() for p in model.parameters()]
    prompt = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    assert model.model._decode_weights is not None  # the decoding path ran
    assert held_storages(model) == before
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert set(model.state_dict()) == set(tiny(dtype).state_dict())
