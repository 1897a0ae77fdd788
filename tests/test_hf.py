"""``patch_hf`` numerics, checked against the models' own Hugging Face code, which this
project did not write: small random-initialised Llama, Mistral and Qwen2 models, patched
(float32, on the CPU backend and on Triton in its interpreter), against the unpatched
model run in float64 — loss, logits and every parameter gradient within SPEC §9's float32
tolerance (the attention class: these are whole models) — with ignore-index labels,
``num_items_in_batch``, right and left padding (per-row positions) and gradient
checkpointing; bf16, greedy ``generate``, RoPE accuracy at large positions against float64,
and the ``bench --hf llama`` command. What the patch swaps and how it is undone:
tests/test_hf_patching.py.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import sys

import pytest
import torch

import wiola_kernels
import wiola_kernels as wk
from wiola_kernels.hf import FusedRotaryEmbedding, rope_accuracy
from wiola_kernels.testing import available_backends, rel_err, tolerance

from hf_helpers import (ATTENTION, FAMILIES, TRAINING_CASES, ids, loss_and_grads, model,  # noqa: E402
                        model_tester_case, training_batch)

BACKENDS = [b for b in ("cpu", "triton") if b in available_backends("rms_norm") and b in available_backends("srpe")]
TOL = tolerance(torch.float32, "attention")


@pytest.fixture(autouse=True)
def _no_patch_outlives_its_test():
    """HF's modeling modules hold their own apply_rotary_pos_emb (unpatching the last
    patched model puts it back): each test leaves none patched."""
    yield
    gc.collect()  # a patched model that dies releases the function too
    assert not wiola_kernels.hf._installed, "a patched model outlived its test"


def _assert_matches(got, want, what=""):
    loss, logits, grads = got
    want_loss, want_logits, want_grads = want
    assert loss.dtype == torch.float32
    assert rel_err(loss, want_loss) <= TOL, f"{what} loss {rel_err(loss, want_loss):.2e}"
    if logits is not None:  # None: the patched training loss (linear_cross_entropy) made none
        assert logits.dtype == torch.float32
        assert rel_err(logits, want_logits) <= TOL, f"{what} logits {rel_err(logits, want_logits):.2e}"
    assert grads.keys() == want_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        err = rel_err(grad, want_grads[name])
        assert err <= TOL, f"{what} grad {name}: {err:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_loss_logits_and_gradients_match_hf_float64(family, backend):
    batch = dict(input_ids=ids(), labels=ids())
    want = loss_and_grads(model(family).double(), **batch)
    m = wk.patch_hf(model(family))
    assert wk.is_patched(m)
    kinds = {type(sub).__name__ for sub in m.modules()}
    assert "RMSNorm" in kinds and "FusedRotaryEmbedding" in kinds and not any(k.endswith("RMSNorm") and k != "RMSNorm"
                                                                              for k in kinds)
    with wk.use_backend(backend):
        _assert_matches(loss_and_grads(m, **batch), want)
    wk.unpatch_hf(m)


@pytest.mark.parametrize("case", TRAINING_CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_batches_match_hf_float64(family, case):
    batch = training_batch(case, seed=30)
    want = loss_and_grads(model(family, seed=31, attn=ATTENTION[case]).double().train(), **batch)
    m = wk.patch_hf(model(family, seed=31, attn=ATTENTION[case])).train()
    got = loss_and_grads(m, **batch)
    assert got[1] is None  # the loss went through linear_cross_entropy
    _assert_matches(got, want, case)
    wk.unpatch_hf(m)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_model_tester_config_matches_hf_float64(family):
    # The config and inputs Hugging Face's own tests use for these families (d_h 8, width 37).
    reference, batch = model_tester_case(family, seed=50)
    want = loss_and_grads(copy.deepcopy(reference).double().train(), **batch)
    m = wk.patch_hf(reference).train()
    _assert_matches(loss_and_grads(m, **batch), want, "model tester")
    wk.unpatch_hf(m)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_hf_gradients(family, reentrant, monkeypatch):
    batch = training_batch("right_padding", seed=21)
    fused_calls = []
    apply = wiola_kernels.hf.RotaryPositions.apply
    monkeypatch.setattr(wiola_kernels.hf.RotaryPositions, "apply",
                        lambda self, *a, **kw: fused_calls.append(1) or apply(self, *a, **kw))
    want = loss_and_grads(model(family, seed=22).double().train(), **batch)
    m = wk.patch_hf(model(family, seed=22)).train()
    kwargs = {"use_reentrant": reentrant}
    if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name is deprecated
        m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        assert m.is_activation_checkpointing
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert m.is_gradient_checkpointing
    _assert_matches(loss_and_grads(m, **batch), want, f"checkpointing (reentrant={reentrant})")
    assert len(fused_calls) == 2 * m.config.num_hidden_layers  # the recomputed layers use the fused RoPE too
    wk.unpatch_hf(m)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_bf16_logits_within_bf16_tolerance(family):
    x = ids()
    want = model(family).double()(input_ids=x).logits.detach()
    m = wk.patch_hf(model(family).to(torch.bfloat16))
    with torch.no_grad():
        logits = m(input_ids=x).logits
    assert logits.dtype == torch.bfloat16
    assert rel_err(logits, want) <= tolerance(torch.bfloat16)
    wk.unpatch_hf(m)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_same_tokens(family):
    x = ids(batch=2, length=5, seed=4)
    plain = model(family, seed=5)
    patched = wk.patch_hf(copy.deepcopy(plain))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = plain.generate(x, **kw)
        got = patched.generate(x, **kw)
    assert want.shape == (2, 17)
    assert torch.equal(got, want)
    wk.unpatch_hf(patched)


def test_left_padded_generate_same_tokens():
    # generate builds per-row positions from the attention mask: the fused RoPE must follow them.
    x = ids(batch=2, length=6, seed=40)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    x = x.masked_fill(mask == 0, 0)
    plain = model("llama", seed=41)
    patched = wk.patch_hf(copy.deepcopy(plain))
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(patched.generate(x, **kw), plain.generate(x, **kw))
    wk.unpatch_hf(patched)


def test_rope_accurate_at_large_positions():
    rows = rope_accuracy([65536, 2**20 - 1])
    for row in rows:
        print(f"p = {row['position']}: patched {row['ours']:.2e}, HF float32 {row['hf']:.2e} (vs float64)")
        assert row["ours"] <= tolerance(torch.float32), row
        assert row["hf"] > 10 * row["ours"], row  # HF's float32 angles are the worse of the two


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_rope_at_large_positions_in_the_model(backend):
    # The patched model's own rotated q/k at positions near 2^16 and 2^20, vs float64.
    m = wk.patch_hf(model("llama", seed=17))
    modeling = sys.modules[type(m).__module__]
    assert isinstance(m.model.rotary_emb, FusedRotaryEmbedding)
    g = torch.Generator().manual_seed(18)
    pos = torch.tensor([[65535, 65536, 2**20 - 2, 2**20 - 1]])
    q, k = torch.randn(1, 4, 4, 16, generator=g), torch.randn(1, 2, 4, 16, generator=g)
    rope = m.model.rotary_emb(q, pos)
    with wk.use_backend(backend):
        q_rot, k_rot = modeling.apply_rotary_pos_emb(q, k, *rope)
    j = torch.arange(8, dtype=torch.float64)
    angle = pos.double()[:, None, :, None] * 10000.0 ** (-2.0 * j / 16)
    c, s = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
    for got, x in ((q_rot, q), (k_rot, k)):
        xd = x.double()
        want = xd * c + torch.cat((-xd[..., 8:], xd[..., :8]), -1) * s
        assert rel_err(got, want) <= tolerance(torch.float32)
    wk.unpatch_hf(m)


def test_bench_hf_llama_writes_four_rows(tmp_path, capsys):
    # No timing is asserted: only that the command (its main) runs and writes one record per variant.
    from wiola_kernels import __main__ as kernels_cli

    out = tmp_path / "hf.json"
    try:
        assert kernels_cli.main(["bench", "--hf", "llama", "--small", "--repeats", "1", "--json", str(out)]) == 0
    finally:
        torch._dynamo.reset()  # the compiled variants' graphs are not this process's business after
    stdout = capsys.readouterr().out
    records = json.loads(out.read_text())
    assert [r["variant"] for r in records] == ["unpatched_eager", "unpatched_compile", "patched_eager",
                                               "patched_compile"]
    for r in records:
        assert r["op"] == "hf_llama_step" and r["dtype"] == "float32" and r["timing"] == "process_cpu"
        for key in ("tokens_per_s", "tokens_per_s_wall", "peak_mb", "ms", "cpu_ms"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["variant"], key)
        assert r["tokens_per_s"] > 0 and r["loss"] > 0
    # The four models start from the same weights and batch: their first losses agree.
    losses = [r["loss"] for r in records]
    assert max(losses) - min(losses) <= 1e-4 * max(losses), losses
    for variant in ("unpatched_eager", "unpatched_compile", "patched_eager", "patched_compile"):
        assert variant in stdout
