"""patch_hf's causal-LM loss swap (SPEC §10.4): a training-mode ``<Family>ForCausalLM`` with
labels computes Hugging Face's loss through linear_cross_entropy without the logits; the
switch, the ``return_logits`` flag, the class-level form and the undo. The loss and every
parameter gradient against the unpatched model in float64 with ignore_index labels,
num_items_in_batch, padding and gradient checkpointing are in tests/test_hf.py (its training
tests run this path)."""

from __future__ import annotations

import gc

import pytest
import torch

import wiola_kernels
import wiola_kernels as wk
from wiola_kernels.testing import rel_err, tolerance

from hf_helpers import CAUSAL_LM, config, loss_and_grads, model, training_batch  # noqa: E402

TOL = tolerance(torch.float32, "attention")


@pytest.fixture(autouse=True)
def _no_patch_outlives_its_test():
    yield
    gc.collect()
    assert not wiola_kernels.hf._installed and not wiola_kernels.hf._class_patches


def _matches(got, want):
    assert rel_err(got[0], want[0]) <= TOL
    assert got[2].keys() == want[2].keys()
    for name, g in got[2].items():
        assert rel_err(g, want[2][name]) <= TOL, name


def test_shift_labels_and_the_switch_and_the_flag(family="mistral"):
    batch = training_batch("num_items_in_batch", seed=60)
    want = loss_and_grads(model(family, seed=61).double().train(), **batch)
    m = wk.patch_hf(model(family, seed=61)).train()
    assert "forward" in vars(m)
    got = loss_and_grads(m, **batch)
    assert got[1] is None
    _matches(got, want)
    # return_logits=True: HF's own forward and loss, the logits returned.
    kept = loss_and_grads(m, return_logits=True, **batch)
    assert kept[1].shape == (3, 10, m.config.vocab_size)
    _matches(kept, want)
    # shift_labels given instead of shifting inside (HF's sequence-parallel form).
    labels = batch.pop("labels")
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    got = loss_and_grads(m, labels=labels, shift_labels=shifted, **batch)
    assert got[1] is None
    _matches(got, want)
    wk.unpatch_hf(m)
    assert "forward" not in vars(m) and not wk.is_patched(m)
    off = wk.patch_hf(model(family, seed=61), loss=False).train()
    assert "forward" not in vars(off) and off(labels=labels, **batch).logits is not None
    wk.unpatch_hf(off)


def test_positional_arguments_tuples_and_eval_mode():
    batch = training_batch("right_padding", seed=62)
    m = wk.patch_hf(model("llama", seed=63)).train()
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    out = m(ids, mask, labels=labels)
    ref = m(input_ids=ids, attention_mask=mask, labels=labels, return_logits=True)
    assert out.logits is None and rel_err(out.loss, ref.loss) <= TOL
    tup = m(ids, mask, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and rel_err(tup[0], ref.loss) <= TOL
    m.eval()
    with torch.no_grad():
        assert m(ids, mask, labels=labels).logits is not None  # evaluation loops read the logits
    wk.unpatch_hf(m)


def test_class_level_form_swaps_the_loss_and_undoes():
    batch = training_batch("ignore_index", seed=64)
    want = loss_and_grads(model("qwen2", seed=65).double().train(), **batch)
    wk.patch_hf("qwen2")
    try:
        m = model("qwen2", seed=65).train()
        assert wk.is_patched(m) and "forward" in vars(m)
        got = loss_and_grads(m, **batch)
        assert got[1] is None
        _matches(got, want)
    finally:
        wk.unpatch_hf("qwen2")
    fresh = CAUSAL_LM["qwen2"](config("qwen2"))
    assert not wk.is_patched(fresh) and "forward" not in vars(fresh)
    wk.unpatch_hf(m)
    assert "forward" not in vars(m)
