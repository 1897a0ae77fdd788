"""The folded causal-summary sub-attention against the unfolded SPEC §5.3
formulas in float64: ``Kᶜ = C W_Kc``, ``Vᶜ = C W_Vc``, ``σ(g)·softmax_λ(q·Kᶜ/√d_h)·Vᶜ``."""

from __future__ import annotations

import math

import pytest
import torch

from wiola import WiolaConfig
from wiola import context_fold
from wiola.context_fold import folded_context_attention
from wiola.model import WiolaAttention
from wiola_kernels.reference.gcla_attention import gcla_attention_forward, gcla_context_kv
from wiola_kernels.testing import rel_err, tolerance

F64 = torch.float64


def inputs(n, h, dh, slots, dtype, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    d = h * dh

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype).requires_grad_(grad)

    return (r(n, h, dh), r(n, slots, d), r(h * dh, d, scale=d ** -0.5), r(h * dh, d, scale=d ** -0.5),
            r(h, scale=1.5))


def unfolded(q, context, w_kc, w_vc, gate):
    """SPEC §5.3–5.4 as written: project every slot, softmax over slots, mix the values."""
    n, h, dh = q.shape
    kc, vc = gcla_context_kv(context[:, None], w_kc.T, w_vc.T, h)  # (N, H, 1, Λ', d_h)
    kc, vc = kc[:, :, 0], vc[:, :, 0]
    a = torch.softmax(torch.einsum("nhe,nhle->nhl", q, kc) / math.sqrt(dh), -1)
    return torch.sigmoid(gate)[None, :, None] * torch.einsum("nhl,nhle->nhe", a, vc)


@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_folded_forward_matches_the_unfolded_float64_formulas(slots, dtype):
    args = inputs(37, 4, 8, slots, dtype, seed=slots)
    got = folded_context_attention(*args)
    assert got.dtype == dtype and got.shape == (37, 4, 8)
    want = unfolded(*(a.to(F64) for a in args))
    assert rel_err(got, want) <= tolerance(dtype, "attention")


@pytest.mark.parametrize("slots", [1, 3])
def test_folded_inference_in_row_chunks_matches_the_unfolded_float64_formulas(slots):
    # Without gradients the fold runs INFERENCE_ROWS positions at a time (a prompt's (N, H, d)
    # intermediates stay small): N past two chunks and not a multiple of one, strided q.
    n = 2 * context_fold.INFERENCE_ROWS + 5
    q, context, w_kc, w_vc, gate = inputs(n, 4, 8, slots, torch.float32, seed=40 + slots)
    q = torch.cat([q, q], -1)[..., ::2]  # a strided view, the same values
    with torch.no_grad():
        got = folded_context_attention(q, context, w_kc, w_vc, gate)
    assert got.shape == (n, 4, 8) and torch.isfinite(got).all()
    want = unfolded(*(a.to(F64) for a in (q, context, w_kc, w_vc, gate)))
    assert rel_err(got, want) <= tolerance(torch.float32, "attention")


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_folded_gradients_match_the_unfolded_float64_formulas(slots):
    args32 = inputs(19, 2, 8, slots, torch.float32, seed=10 + slots, grad=True)
    args64 = [a.detach().to(F64).requires_grad_() for a in args32]
    g = torch.randn(19, 2, 8, generator=torch.Generator().manual_seed(99), dtype=F64)
    (folded_context_attention(*args32) * g.float()).sum().backward()
    (unfolded(*args64) * g).sum().backward()
    for name, a32, a64 in zip(("q", "context", "w_kc", "w_vc", "gate"), args32, args64):
        assert rel_err(a32.grad, a64.grad) <= tolerance(torch.float32, "attention"), name


@pytest.mark.parametrize("slots", [1, 2])
def test_folded_gradcheck_float64(slots):
    args = inputs(5, 2, 4, slots, F64, seed=20 + slots, grad=True)
    assert torch.autograd.gradcheck(folded_context_attention, args)


def test_bad_shapes_are_named():
    q, context, w_kc, w_vc, gate = inputs(4, 2, 4, 2, torch.float32, seed=30)
    with pytest.raises(ValueError, match="context"):
        folded_context_attention(q, context[:3], w_kc, w_vc, gate)
    with pytest.raises(ValueError, match="w_vc"):
        folded_context_attention(q, context, w_kc, w_vc[:, :5], gate)
    with pytest.raises(ValueError, match="gate"):
        folded_context_attention(q, context, w_kc, w_vc, gate[:1])


@pytest.mark.parametrize("lengths", [None, [9, 4]])
def test_attention_layer_matches_the_spec_reference(lengths):
    """A whole GCLA layer of the model (causal context S = T, Λ' = 2) against SPEC §5.2–5.4 in
    float64: the reference attention op fed with the explicitly projected Kᶜ, Vᶜ."""
    config = WiolaConfig.from_name("wiola-tiny", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8)
    torch.manual_seed(0)
    attn = WiolaAttention(config, layer_idx=3).to(F64)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        attn.gate.copy_(torch.randn(4, generator=g, dtype=F64))
    b, t = 2, 9
    x = torch.randn(b, t, 32, generator=g, dtype=F64)
    context = torch.randn(b, t, 2, 32, generator=g, dtype=F64)
    pos = torch.arange(t).expand(b, t)
    lens = None if lengths is None else torch.tensor(lengths)
    with torch.no_grad():
        got = attn(x, pos, context, lens)
    q = (x @ attn.q_proj.weight.T).view(b, t, 4, 8).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(b, t, 2, 8).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(b, t, 2, 8).transpose(1, 2)
    q_rot, k_rot = attn.srpe(q, k, pos)
    kc, vc = gcla_context_kv(context, attn.kc_proj.weight.T, attn.vc_proj.weight.T, 4)
    out, _ = gcla_attention_forward(q_rot, k_rot, v, q, kc, vc, attn.gate, lens)
    want = out.transpose(1, 2).reshape(b, t, 32) @ attn.o_proj.weight.T
    assert rel_err(got, want) <= tolerance(F64, "attention")
