"""Cached decoding steps (python/wiola/decode.py): the attention over the cache
against the float64 SPEC oracle, the in-place KV cache against concatenation, and decoding
on the packed weights against the model's full forward (which runs the fused ops)."""

from __future__ import annotations

import pytest
import torch

from wiola import WiolaConfig, WiolaForCausalLM, decode
from wiola.decode import GrowingKV, cached_attention
from wiola.modeling_wiola import WiolaCache
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
def test_decoding_steps_equal_the_full_forward(dtype):
    model = tiny(dtype, num_key_value_heads=2)  # H 4, H_kv 2: the h mod H_kv grouping matters
    ids = torch.randint(3, model.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    got = decode_logits(model, ids, 6)
    assert_close_rel(got, full, tolerance(dtype, "attention"), "decoded logits")


def test_decoding_follows_the_weights():
    # An in-place change of a parameter (an optimizer step, load_state_dict) after decoding
    # must reach the next decoding step: oracle, the full forward of the changed model.
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


# ---- the GEMV kernel (CPU float32/bfloat16/float16; wiola_kernels.decode.gemv) ----------------------

needs_gemv = pytest.mark.skipif(not decode.gemv_applies(torch.float32, torch.device("cpu")),
                                reason="needs the C++ extension")


def held_storages(model) -> dict[int, int]:
    """``{storage address: bytes}`` of every tensor the model holds: its parameters and buffers,
    and any tensor an attribute of one of its modules keeps, walked through containers and objects."""
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
    for module in model.modules():
        walk({k: v for k, v in vars(module).items() if not k.startswith("_")})
    return found


@needs_gemv
@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("step", [1, 3])
def test_gemv_steps_equal_the_full_forward(isa, step, monkeypatch):
    # Every projection of a step on the GEMV kernel (both ISA paths where the CPU has AVX-512),
    # B·T_new = 2 and 6 rows; oracle: the full forward, which runs F.linear and the fused ops.
    from wiola_kernels.decode import gemv as decode_gemv

    rows = []
    gemv = decode_gemv.gemv
    monkeypatch.setattr(decode_gemv, "gemv", lambda x, *a, **k: rows.append(x.shape[:-1].numel()) or gemv(x, *a, **k))
    model = tiny(num_key_value_heads=2)
    ids = torch.randint(3, model.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(15))
    with torch.no_grad(), cpu_isa(None if isa == "auto" else isa):
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5], use_cache=True)
        pieces, cache = [out.logits], out.cache
        rows.clear()
        for i in range(5, 14, step):
            out = model(ids[:, i:i + step], cache=cache, use_cache=True)
            pieces.append(out.logits)
    assert_close_rel(torch.cat(pieces, 1), full, tolerance(torch.float32, "attention"), "decoded logits")
    # B·T_new = 6 rows a product; one-position steps are one C++ call (test_model_decode_step.py)
    assert set(rows) == ({6} if step == 3 else set())


@pytest.mark.parametrize("gemv,one_call", [(True, True), (True, False), (False, False)])
def test_decoding_steps_run_the_models_blocks(gemv, one_call, monkeypatch):
    # A decoding step runs each block's own forward (wiola.model), or, where the whole step is
    # one C++ call (wiola_kernels.decode.step: the GEMV kernel, one unpadded position per row),
    # that call and no block's Python. Oracle: the full forward.
    from wiola.model import WiolaBlock
    from wiola_kernels.decode import block as decode_block, step as decode_step

    if gemv and not decode.gemv_applies(torch.float32, torch.device("cpu")):
        pytest.skip("needs the C++ extension")
    if not one_call:
        monkeypatch.setattr(decode_step, "available", lambda: False)
    model = tiny(torch.float32 if gemv else F64)
    calls, step_calls = [], []
    forward, whole = WiolaBlock.forward, decode_step.decode_step
    monkeypatch.setattr(WiolaBlock, "forward", lambda self, *a, **k: calls.append(self.layer_idx) or forward(self, *a, **k))
    monkeypatch.setattr(decode_step, "decode_step", lambda *a, **k: step_calls.append(1) or whole(*a, **k))
    monkeypatch.setattr(decode_block, "decode_block", None)  # never called from Python
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :6], use_cache=True)
        cache, pieces = out.cache, [out.logits]
        calls.clear()
        for i in range(6, 9):
            pieces.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits)
    layers = model.config.num_hidden_layers
    assert calls == ([] if one_call else list(range(layers)) * 3)
    assert len(step_calls) == (3 if one_call else 0)
    dtype = torch.float32 if gemv else F64
    assert_close_rel(torch.cat(pieces, 1), full, tolerance(dtype, "attention"), "decoded logits")


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("next_norm", [True, False])
@pytest.mark.parametrize("slots", [0, 1, 2])
def test_cpp_block_equals_the_models_block(dtype, next_norm, slots):
    # wiola_kernels.decode.block (each block of the one-call step) against the model's block
    # for one new position per row, bit for bit: the output, the next norm of it (or none:
    # FSDP's sharded norms leave it to their owner), the cached key and value; with no
    # context, one slot and two.
    from wiola_kernels.decode import block as decode_block

    model = tiny(dtype, num_key_value_heads=2)
    g = torch.Generator().manual_seed(27 + slots)
    b, d = 2, model.config.hidden_size
    ids = torch.randint(3, model.config.vocab_size, (b, 6), generator=g)
    with torch.no_grad():
        caches = [model(ids, use_cache=True).cache for _ in range(2)]
        layer = slots  # layer ℓ reads min(ℓ, Λ = 2) slots
        block = model.model.layers[layer]
        x = randn(g, b, 1, d, dtype=dtype)
        context = randn(g, b, 1, slots, d, dtype=dtype)
        pos = torch.full((b, 1), 6, dtype=torch.long)
        nxt = model.model.layers[layer + 1].attn_norm
        nxt.shift.copy_(randn(g, d, dtype=dtype) * 0.1)
        normed = block.attn_norm(x)
        want = block(x, pos, context, normed, None, caches[0], nxt if next_norm else None)
        a, f = block.attn, block.ffn
        weights = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, a.kc_proj.weight,
                   a.vc_proj.weight, f.w_n1.weight, f.w_n3.weight, f.w_w1.weight, f.w_w3.weight, f.w_n2.weight,
                   f.w_w2.weight]
        grown = caches[1].layers[layer]
        k_buf, v_buf, past = grown.append_buffers(b, a.n_kv_head, a.head_dim, dtype)
        s = a.srpe
        got = decode_block.decode_block(
            x, normed, weights, (block.ffn_norm.weight, block.ffn_norm.shift, block.ffn_norm.eps),
            (nxt.weight, nxt.shift, nxt.eps) if next_norm else None, f.beta, a.gate, k_buf, v_buf, past, pos,
            a.n_head, theta=s.theta, spiral_divisor=s.spiral_divisor, radial_amplitude=s.radial_amplitude,
            radial_frequency=s.radial_frequency, context=context if slots else None)
        grown.appended(past + 1)
    assert torch.equal(got[0], want[0])
    assert (got[1] is None) == (want[1] is None) == (not next_norm)
    if next_norm:
        assert torch.equal(got[1], want[1])
    mine, theirs = caches[1].layers[layer], caches[0].layers[layer]
    assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1e20])
def test_cpp_block_norm_rows_are_the_ops(dtype, scale):
    # The next norm the C++ block returns, y = WRMSNorm(X''), against the add_rms_norm op on the
    # same rows (X'' + 0), bit for bit: γ and δ random, so rounding γ·(z·r⁻¹) instead of the op's
    # (γ·z)·r⁻¹ shows in float32; and rows of magnitude 1e20, whose squares overflow float32
    # (the op rescales; a plain Σz² gives r⁻¹ = 0).
    from wiola_kernels import add_rms_norm
    from wiola_kernels.decode import block as decode_block

    model = tiny(dtype, num_key_value_heads=2)
    g = torch.Generator().manual_seed(28)
    b, d = 3, model.config.hidden_size
    with torch.no_grad():
        cache = model(torch.randint(3, 200, (b, 5), generator=g), use_cache=True).cache
        block, nxt = model.model.layers[0], model.model.layers[1].attn_norm
        for norm in (block.ffn_norm, nxt):
            norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
            norm.shift.copy_(torch.randn(d, generator=g))
        x = (randn(g, b, 1, d) * scale).to(dtype)
        a, f = block.attn, block.ffn
        weights = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, a.kc_proj.weight,
                   a.vc_proj.weight, f.w_n1.weight, f.w_n3.weight, f.w_w1.weight, f.w_w3.weight, f.w_n2.weight,
                   f.w_w2.weight]
        k_buf, v_buf, past = cache.layers[0].append_buffers(b, a.n_kv_head, a.head_dim, dtype)
        s = a.srpe
        out, y, _, _ = decode_block.decode_block(
            x, block.attn_norm(x), weights, (block.ffn_norm.weight, block.ffn_norm.shift, block.ffn_norm.eps),
            (nxt.weight, nxt.shift, nxt.eps), f.beta, a.gate, k_buf, v_buf, past, torch.full((b, 1), 5), a.n_head,
            theta=s.theta, spiral_divisor=s.spiral_divisor, radial_amplitude=s.radial_amplitude,
            radial_frequency=s.radial_frequency)
        want, total = add_rms_norm(out, torch.zeros_like(out), nxt.weight, nxt.shift, nxt.eps)
    assert torch.equal(total, out) and torch.isfinite(want).all() and want.abs().amax() > 0.1
    assert torch.equal(y, want)


@needs_gemv
@pytest.mark.parametrize("lookback", [0, 1, 2])
def test_fused_attention_runs_once_per_block(lookback, monkeypatch):
    # Without the C++ block (wiola_kernels.decode.block), a one-position step's attention
    # (SRPE, cache append, softmax over the cache, the Λ' context slots: none, one without
    # keys, two) is one decode_attention call per block, and the steps equal the full forward.
    # Oracle: the full forward (nn.Linear and the fused op).
    from wiola_kernels.decode import attention as decode_attention, block as decode_block

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


def without_gemv(monkeypatch) -> None:
    """Every product of the model on ``F.linear`` (the GEMV kernel said not to apply)."""
    from wiola_kernels.decode import gemv as decode_gemv

    monkeypatch.setattr(decode_gemv, "applies", lambda dtype, device: False)


@needs_gemv
def test_gemv_greedy_tokens_equal_those_of_f_linear(monkeypatch):
    model = tiny()
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(16))
    runs = {}
    for gemv in (True, False):
        if not gemv:
            without_gemv(monkeypatch)
        with torch.no_grad():
            runs[gemv] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                        do_sample=False, pad_token_id=0)
    assert torch.equal(runs[True], runs[False])


@needs_gemv
def test_gemv_steps_follow_the_small_parameters():
    # β (DSFF blend), g (context gate) and the context matrices enter the step through small
    # ops on the kernel's results: changing them in place must reach the next step. Oracle:
    # the full forward of the changed model.
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
def test_half_precision_steps_equal_the_models_own_forward(dtype):
    # A bf16/fp16 model decodes on the kernel (16-bit weights widened in registers); oracle:
    # the same model's own forward in that dtype, within SPEC §9's tolerance for it.
    model = tiny(dtype, num_key_value_heads=2)
    assert decode.gemv_applies(dtype, torch.device("cpu"))
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(19))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    got = decode_logits(model, ids, 5)
    assert got.dtype == dtype
    assert_close_rel(got, full, tolerance(dtype), f"{dtype} decoded logits")


@needs_gemv
def test_bf16_greedy_tokens_over_32_steps(monkeypatch):
    # The full wiola-tiny preset in bf16: 32 greedy steps on the kernel, on every ISA path,
    # give the tokens of the model's bf16 products on F.linear decoding the same prompt. bf16 logits tie often in a random model (init 0.02 repeats one token; ties flip on
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

    with monkeypatch.context() as patch:
        without_gemv(patch)
        ref = greedy()
        with torch.no_grad():
            top2 = model(ref, use_cache=False).logits[0, 5:-1].float().topk(2, -1).values
    assert ((top2[:, 0] - top2[:, 1]) / top2[:, 0].abs()).min() > 0.01 and len(set(ref[0, 6:].tolist())) > 20
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
    cache_lengths = []
    model.register_forward_pre_hook(lambda module, args, kwargs: cache_lengths.append(1), with_kwargs=True)
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    assert len(cache_lengths) == 4  # the prompt and three decoding steps
    assert held_storages(model) == before
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert set(model.state_dict()) == set(tiny(dtype).state_dict())
