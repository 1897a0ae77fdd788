"""The Wiola model's training loss through wiola_kernels.linear_cross_entropy (SPEC §10.1):
the tied head's logits are not materialised when labels are given, and the loss and every
parameter gradient equal the unfused model's in float64 (``return_logits=True``: the head,
then ``F.cross_entropy``) within SPEC §9's float32 tolerance."""

from __future__ import annotations

import copy

import pytest
import torch

import wiola.model
from wiola import WiolaConfig, WiolaForCausalLM
from wiola_kernels.testing import rel_err, tolerance

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(dtype: torch.dtype) -> WiolaForCausalLM:
    cfg = WiolaConfig.from_name("wiola-tiny", hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=16, dsff_narrow_size=32, dsff_wide_size=64, num_hidden_layers=2,
                                vocab_size=300)
    torch.manual_seed(0)
    return WiolaForCausalLM(cfg).to(dtype).train()


def _step(model, ids, labels, mask, **kw):
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=labels, use_cache=False, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100                      # a masked prompt
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0                           # right padding, its labels ignored
    labels[1, 6:] = -100
    return ids, labels, mask


def test_fused_loss_and_gradients_equal_the_unfused_float64_model(monkeypatch):
    model = _model(torch.float32)
    ids, labels, mask = _batch()
    calls = []
    product = wiola.model.linear  # every product of the model, the head's too

    def spy(x, weights):
        calls.extend(1 for w in weights if w.shape[0] == 300)  # the head: (V, d)
        return product(x, weights)

    monkeypatch.setattr(wiola.model, "linear", spy)
    fused, got = _step(model, ids, labels, mask)
    assert fused.logits is None and calls == []          # the head never ran: no (B, T, V) tensor
    unfused, want = _step(copy.deepcopy(model).double(), ids, labels, mask, return_logits=True)
    assert unfused.logits.shape == (2, 9, 300) and len(calls) == 1
    assert fused.loss.dtype == torch.float32
    assert rel_err(fused.loss, unfused.loss) <= tolerance(torch.float32, "attention")
    assert set(got) == set(want)
    for name, g in want.items():
        assert rel_err(got[name], g) <= tolerance(torch.float32, "attention"), name


def test_without_labels_and_in_generation_the_logits_are_unchanged():
    model = _model(torch.float32).eval()
    ids, _, _ = _batch()
    with torch.no_grad():
        plain = model(ids).logits
        kept = model(ids, return_logits=True).logits
        out = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(plain, kept) and plain.shape == (2, 9, 300)
    assert out.shape == (2, 7)


def test_bf16_autocast_runs_the_head_in_bf16_like_f_linear():
    """Under autocast the head's F.linear runs in bf16; the fused loss takes h and E in bf16
    too (not a dtype mismatch between float32 E and bf16 h)."""
    model = _model(torch.float32)
    ids, labels, mask = _batch()
    want = _step(copy.deepcopy(model).double(), ids, labels, mask, return_logits=True)[0].loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(ids, attention_mask=mask, labels=labels, use_cache=False)
    got.loss.backward()
    assert got.logits is None and got.loss.dtype == torch.float32
    assert rel_err(got.loss, want) <= tolerance(torch.bfloat16, "attention")
    assert model.lm_head.weight.grad.dtype == torch.float32 and torch.isfinite(model.lm_head.weight.grad).all()
