"""A cached decoding step's attention in one call (wiola_kernels/decode_attention.py,
csrc/cpu/decode_attention.cpp) against a float64 oracle written here from SPEC §4–5: SRPE of
q and k at each row's position, the cache append, GQA softmax over the cache and the gated
context slots. Shapes cover every register path of the kernel (groups of 4, 2 and 1 heads;
key counts around multiples of 8; head sizes that are and are not multiples of 8 and 16)."""

from __future__ import annotations

import math

import pytest
import torch

from wiola_kernels.decode import attention as da
from wiola_kernels.reference.srpe import srpe as srpe_reference
from wiola_kernels.testing import assert_close_rel, tolerance

pytestmark = pytest.mark.skipif(not da.available(), reason="needs the C++ extension")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SRPE = dict(theta=10000.0, spiral_divisor=8.0, radial_amplitude=0.1, radial_frequency=0.01)


def randn(g, *shape, dtype=F32):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def make(g, b, h, h_kv, dh, past, n_ctx, dtype, capacity=None, with_keys=True):
    """Inputs of one step: qkv, caches holding `past` rows (NaN past them), positions, context."""
    capacity = capacity or past + 5
    qkv = randn(g, b, (h + 2 * h_kv) * dh, dtype=dtype)
    k_cache = torch.full((b, h_kv, capacity, dh), float("nan"), dtype=dtype)
    v_cache = torch.full((b, h_kv, capacity, dh), float("nan"), dtype=dtype)
    k_cache[:, :, :past] = randn(g, b, h_kv, past, dh, dtype=dtype)
    v_cache[:, :, :past] = randn(g, b, h_kv, past, dh, dtype=dtype)
    positions = torch.randint(past, past + 50, (b, 1), generator=g)
    ctx = {}
    if n_ctx:
        ctx["context_v"] = randn(g, b, n_ctx, h * dh, dtype=dtype)
        ctx["context_k"] = randn(g, b, n_ctx, h * dh, dtype=dtype) if with_keys else None
        ctx["gate"] = randn(g, h, dtype=dtype)
    return qkv, k_cache, v_cache, positions, ctx


def oracle(qkv, k_cache, v_cache, past, positions, h, context_k=None, context_v=None, gate=None):
    """float64 ``(out (B, H·d_h), k̃ (B, H_kv, d_h))`` of the inputs' own values (SPEC §4–5)."""
    b = qkv.shape[0]
    h_kv, dh = k_cache.shape[1], k_cache.shape[3]
    x = qkv.double()
    q = x[:, :h * dh].view(b, h, 1, dh)
    k = x[:, h * dh:(h + h_kv) * dh].view(b, h_kv, 1, dh)
    v = x[:, (h + h_kv) * dh:].view(b, h_kv, 1, dh)
    q_rot, k_rot = srpe_reference(q, k, positions.view(b, 1), **SRPE)
    keys = torch.cat([k_cache[:, :, :past].double(), k_rot], 2)            # (B, H_kv, T, d_h)
    values = torch.cat([v_cache[:, :, :past].double(), v], 2)
    group = torch.arange(h) % h_kv                                          # head h reads group h mod H_kv
    scores = (q_rot @ keys[:, group].transpose(-1, -2)) / math.sqrt(dh)    # (B, H, 1, T)
    out = torch.softmax(scores, -1) @ values[:, group]                     # (B, H, 1, d_h)
    if context_v is not None:
        n_ctx = context_v.shape[1]
        vc = context_v.double().view(b, n_ctx, h, dh).transpose(1, 2)       # (B, H, Λ', d_h)
        if context_k is None:
            mixed = vc[:, :, 0]
        else:
            kc = context_k.double().view(b, n_ctx, h, dh).transpose(1, 2)
            a = torch.softmax((q[:, :, 0, None, :] * kc).sum(-1) / math.sqrt(dh), -1)  # (B, H, Λ')
            mixed = (a[..., None] * vc).sum(2)
        out = out + torch.sigmoid(gate.double())[None, :, None, None] * mixed[:, :, None]
    return out.reshape(b, h * dh), k_rot[:, :, 0]


def run(qkv, k_cache, v_cache, past, positions, h, ctx):
    return da.decode_attention(qkv, k_cache, v_cache, past, positions, h, **SRPE, **ctx)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("h,h_kv", [(16, 4), (6, 2), (3, 3), (7, 1)])   # R = 4, 3 (= 2 + 1), 1, 7 (= 4 + 2 + 1)
@pytest.mark.parametrize("dh", [64, 16, 24, 6])                        # x16, x16, x8 only, neither
@pytest.mark.parametrize("past", [0, 7, 8, 33])
def test_matches_float64(dtype, h, h_kv, dh, past):
    g = torch.Generator().manual_seed(1000 * h + 10 * dh + past)
    qkv, k_cache, v_cache, positions, ctx = make(g, 2, h, h_kv, dh, past, 2, dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    ref, k_rot = oracle(qkv, before_k, before_v, past, positions, h, **ctx)
    out = run(qkv, k_cache, v_cache, past, positions, h, ctx)
    assert out.dtype == dtype and out.shape == (2, h * dh)
    assert_close_rel(out, ref, tolerance(dtype, "attention"), "output")
    # the new row: the rotated key (rounded to the dtype) and the value as projected
    assert_close_rel(k_cache[:, :, past], k_rot, tolerance(dtype), "appended key")
    v_new = qkv[:, (h + h_kv) * dh:].view(2, h_kv, dh)
    assert torch.equal(v_cache[:, :, past], v_new)
    # nothing else written: earlier rows unchanged, later ones still NaN
    keep = [i for i in range(k_cache.shape[2]) if i != past]
    assert torch.equal(k_cache[:, :, keep].nan_to_num(7.0), before_k[:, :, keep].nan_to_num(7.0))
    assert torch.equal(v_cache[:, :, keep].nan_to_num(7.0), before_v[:, :, keep].nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("n_ctx,with_keys", [(0, True), (1, False), (1, True), (3, True)])
def test_context_slots(dtype, n_ctx, with_keys):
    """No context, one slot without keys (weight 1), one and three slots with their softmax."""
    g = torch.Generator().manual_seed(n_ctx * 2 + with_keys)
    qkv, k_cache, v_cache, positions, ctx = make(g, 3, 8, 2, 32, 20, n_ctx, dtype, with_keys=with_keys)
    ref, _ = oracle(qkv, k_cache.clone(), v_cache.clone(), 20, positions, 8, **ctx)
    assert_close_rel(run(qkv, k_cache, v_cache, 20, positions, 8, ctx), ref, tolerance(dtype, "attention"))


def test_one_slot_without_keys_ignores_the_query():
    """With one slot the softmax weight is 1: context_k, had it been given, changes nothing."""
    g = torch.Generator().manual_seed(5)
    qkv, k_cache, v_cache, positions, ctx = make(g, 1, 4, 2, 16, 9, 1, F32)
    with_keys = run(qkv, k_cache.clone(), v_cache.clone(), 9, positions, 4, ctx)
    ctx["context_k"] = None
    without = run(qkv, k_cache, v_cache, 9, positions, 4, ctx)
    torch.testing.assert_close(without, with_keys, rtol=1e-6, atol=1e-6)


def test_strided_inputs():
    """qkv rows and context rows read through their strides; a cache buffer whose rows are
    not adjacent (a view of a wider buffer) is read and written in place."""
    g = torch.Generator().manual_seed(11)
    qkv, k_cache, v_cache, positions, ctx = make(g, 2, 8, 4, 16, 12, 2, BF16)
    ref, k_rot = oracle(qkv, k_cache.clone(), v_cache.clone(), 12, positions, 8, **ctx)
    wide_qkv = torch.zeros(2, qkv.shape[1] + 40, dtype=BF16)
    wide_qkv[:, 3:3 + qkv.shape[1]] = qkv
    k_wide = torch.zeros(2, 4, k_cache.shape[2], 3, 16, dtype=BF16)
    v_wide = torch.zeros_like(k_wide)
    k_wide[:, :, :, 1], v_wide[:, :, :, 2] = k_cache, v_cache
    kv = torch.cat([ctx["context_k"], ctx["context_v"]], -1)                 # slots as one (B, Λ', 2·H·d_h) row
    strided = dict(context_k=kv[..., :128], context_v=kv[..., 128:], gate=ctx["gate"])
    out = run(wide_qkv[:, 3:3 + qkv.shape[1]], k_wide[:, :, :, 1], v_wide[:, :, :, 2], 12, positions.view(2), 8,
              strided)
    assert_close_rel(out, ref, tolerance(BF16, "attention"))
    assert_close_rel(k_wide[:, :, 12, 1], k_rot, tolerance(BF16), "appended key")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_threads_do_not_change_the_result(dtype):
    """One task per (row, group), each sum in a fixed order: the bits are the thread count's own."""
    g = torch.Generator().manual_seed(3)
    qkv, k_cache, v_cache, positions, ctx = make(g, 2, 16, 4, 64, 700, 2, dtype)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(run(qkv, k_cache.clone(), v_cache.clone(), 700, positions, 16, ctx))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_bad_inputs_name_the_argument():
    g = torch.Generator().manual_seed(0)
    qkv, k_cache, v_cache, positions, ctx = make(g, 1, 4, 2, 8, 3, 2, F32)

    def call(**over):
        args = dict(qkv=qkv, k_cache=k_cache, v_cache=v_cache, past=3, position_ids=positions, n_head=4, **ctx)
        args.update(over)
        return da.decode_attention(args.pop("qkv"), args.pop("k_cache"), args.pop("v_cache"), args.pop("past"),
                                   args.pop("position_ids"), args.pop("n_head"), **SRPE, **args)

    with pytest.raises(TypeError, match="qkv must be float32"):
        call(qkv=qkv.double())
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        call(qkv=[1.0])
    with pytest.raises(TypeError, match="k_cache must have qkv's dtype"):
        call(k_cache=k_cache.to(BF16))
    with pytest.raises(ValueError, match="past must be in"):
        call(past=k_cache.shape[2])
    with pytest.raises(ValueError, match="qkv must have"):
        call(qkv=qkv[:, :-8])
    with pytest.raises(ValueError, match="n_head must be a positive multiple"):
        call(n_head=3)
    with pytest.raises(ValueError, match="v_cache must have k_cache's shape"):
        call(v_cache=v_cache[:, :, :-1])
    with pytest.raises(ValueError, match="position_ids must have shape"):
        call(position_ids=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="position_ids must be int64"):
        call(position_ids=positions.int())
    with pytest.raises(ValueError, match="context_k may be None only with one context slot"):
        call(context_k=None)
    with pytest.raises(ValueError, match="gate"):
        call(gate=None)
    with pytest.raises(ValueError, match="context_k needs context_v"):
        call(context_v=None, gate=None)
    with pytest.raises(ValueError, match="context_v must have shape"):
        call(context_v=ctx["context_v"][..., :-1])


# ---- the whole block (wiola_kernels.decode.block) ---------------------------------------------------------
# Its results are checked in the model (tests/test_model_decode.py: against the Python step and the
# full forward); here, what it refuses.

def test_block_bad_inputs_name_the_argument():
    from wiola_kernels.decode import block as db  # the extension's, like decode_attention (pytestmark)

    g = torch.Generator().manual_seed(0)
    d, h, h_kv, dh, n, w = 16, 4, 2, 4, 8, 12
    x = randn(g, 1, 1, d)
    weights = [randn(g, *shape) for shape in [(h * dh, d), (h_kv * dh, d), (h_kv * dh, d), (d, h * dh),
                                                (h * dh, d), (h * dh, d), (n, d), (n, d), (w, d), (w, d), (d, n), (d, w)]]
    norm = (torch.ones(d), torch.zeros(d), 1e-6)
    k_cache, v_cache = torch.zeros(1, h_kv, 8, dh), torch.zeros(1, h_kv, 8, dh)

    def call(**over):
        args = dict(x=x, normed=x, weights=weights, ffn_norm=norm, next_norm=norm, beta=torch.zeros(d),
                    gate=torch.zeros(h))
        args.update(over)
        return db.decode_block(args["x"], args["normed"], args["weights"], args["ffn_norm"], args["next_norm"],
                               args["beta"], args["gate"], k_cache, v_cache, 3, torch.tensor([3]), h, **SRPE)

    out, y, s, summary = call()
    assert out.shape == y.shape == (1, 1, d) and s is None and summary is None
    with pytest.raises(ValueError, match="weights must be the 12 matrices"):
        call(weights=weights[:-1])
    with pytest.raises(ValueError, match="beta must be a CPU tensor of shape"):
        call(beta=torch.zeros(d + 1))
    with pytest.raises(ValueError, match="ffn_norm_weight must be"):
        call(ffn_norm=(torch.ones(d - 1), None, 1e-6))
    with pytest.raises(ValueError, match="x and normed must have shape"):
        call(x=randn(g, 1, 2, d))
    with pytest.raises(TypeError, match="share one dtype"):
        call(normed=x.to(BF16))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        call(x=None)
