"""patch_hf with PEFT / LoRA: a ``peft``-wrapped model is patched through the model it wraps
(as the HF Trainer unwraps it), and LoRA on q/k/v/o/gate/up/down keeps training — the fused
MLP (calling PEFT's ``lora.Linear`` projections) and the fused loss run, and the loss and every
LoRA gradient stay within SPEC §9's float32 tolerance (attention class) of the unpatched
PEFT model in float64, over AdamW steps too; patching before ``get_peft_model`` works alike;
the adapter's saved keys are unchanged; the undo hands back HF's modules holding the adapters.
Skipped without ``peft``.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import hf
from wiola_kernels.hf import FusedGatedMLP, FusedPackedGatedMLP
from wiola_kernels.testing import rel_err, tolerance

from hf_helpers import loss_and_grads, model, training_batch  # noqa: E402

peft = pytest.importorskip("peft")

TOL = tolerance(torch.float32, "attention")
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "gemma3_text": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}  # Phi-3's fused projections


@pytest.fixture(autouse=True)
def _no_patch_outlives_its_test():
    yield
    gc.collect()
    assert not hf._installed and not hf._class_patches


def _lora(m, family: str, seed: int):
    # init_lora_weights=False draws B too (PEFT's default B = 0 would hide a wrong adapter path).
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], lora_dropout=0.0,
                          init_lora_weights=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return peft.get_peft_model(m, cfg)


def _inner(pm):
    return pm.get_base_model()


def _assert_matches(got, want, what=""):
    assert rel_err(got[0], want[0]) <= TOL, f"{what} loss {rel_err(got[0], want[0]):.2e}"
    assert got[2].keys() == want[2].keys() and len(got[2]) > 0
    assert all("lora_" in name for name in got[2])  # the base weights are frozen
    for name, grad in got[2].items():
        assert rel_err(grad, want[2][name]) <= TOL, f"{what} grad {name}: {rel_err(grad, want[2][name]):.2e}"


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_patch_a_peft_model_gives_hf_lora_gradients(family, monkeypatch):
    pm = _lora(model(family, seed=1), family, seed=2)
    reference = copy.deepcopy(pm).double().train()
    keys = list(pm.state_dict())
    assert wk.patch_hf(pm) is pm and wk.is_patched(pm) and wk.is_patched(_inner(pm))
    assert list(pm.state_dict()) == keys
    layers = _inner(pm).model.layers
    mlp_cls = FusedPackedGatedMLP if family == "phi3" else FusedGatedMLP
    assert all(type(layer.mlp) is mlp_cls for layer in layers)
    assert all(type(getattr(layer.mlp, part)).__module__.startswith("peft.") for layer in layers
               for part in mlp_cls.parts)  # the fused MLP calls PEFT's adapters
    glu_calls = []
    glu = hf.glu
    monkeypatch.setattr(hf, "glu", lambda *a: glu_calls.append(a[2]) or glu(*a))
    batch = training_batch("right_padding", seed=3)
    got = loss_and_grads(pm.train(), **batch)
    assert got[1] is None and len(glu_calls) == len(layers)  # the fused loss and MLPs ran
    _assert_matches(got, loss_and_grads(reference, **batch), family)
    wk.unpatch_hf(pm)
    assert not wk.is_patched(pm) and "forward" not in vars(_inner(pm))
    assert all(type(layer.mlp).__name__.endswith("MLP") and type(layer.mlp).__module__.startswith("transformers.")
               for layer in layers)
    assert all(type(getattr(layer.mlp, part)).__module__.startswith("peft.") for layer in layers
               for part in mlp_cls.parts)  # handed back holding the adapters


def test_lora_keeps_training_like_hf():
    """Three AdamW steps on the LoRA weights: the patched float32 model's losses and final
    adapter weights stay with the unpatched PEFT model run in float64."""
    pm = _lora(model("llama", seed=4), "llama", seed=5)
    reference = copy.deepcopy(pm).double().train()
    wk.patch_hf(pm).train()
    runs = []
    for m in (pm, reference):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(3):
            batch = training_batch("num_items_in_batch", seed=6 + step)
            opt.zero_grad(set_to_none=True)
            loss = m(**batch).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        runs.append((torch.stack(losses), {n: p.detach().clone() for n, p in m.named_parameters()
                                          if p.requires_grad}))
    (losses, params), (want_losses, want_params) = runs
    assert rel_err(losses, want_losses) <= TOL and not torch.equal(losses[0], losses[-1])
    for name, p in params.items():
        assert rel_err(p, want_params[name]) <= TOL, name
    wk.unpatch_hf(pm)


def test_patch_before_get_peft_model_and_saved_adapter_keys(tmp_path):
    # A model patched first (e.g. by the class-level form inside from_pretrained), then
    # wrapped: PEFT finds the projections by name inside the fused MLPs and wraps them there.
    plain = _lora(model("qwen3", seed=7), "llama", seed=8)
    patched = _lora(wk.patch_hf(model("qwen3", seed=7)), "llama", seed=8)
    assert wk.is_patched(patched) and isinstance(_inner(patched).model.layers[0].mlp, FusedGatedMLP)
    assert type(_inner(patched).model.layers[0].mlp.up_proj).__module__.startswith("peft.")
    batch = training_batch("ignore_index", seed=9)
    got = loss_and_grads(patched.train(), **batch)
    assert got[1] is None
    _assert_matches(got, loss_and_grads(copy.deepcopy(plain).double().train(), **batch), "patched first")
    patched.save_pretrained(tmp_path / "patched")
    plain.save_pretrained(tmp_path / "plain")
    load = pytest.importorskip("safetensors.torch").load_file
    saved, want = (load(str(tmp_path / d / "adapter_model.safetensors")) for d in ("patched", "plain"))
    assert sorted(saved) == sorted(want)  # the same adapter keys: loadable either way
    wk.unpatch_hf(patched)
