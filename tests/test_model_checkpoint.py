"""Checkpoints of the model: a save/load round trip is exact; a checkpoint that does not
match its config is refused naming the tensor (never a partial load, never pickle); a
mistyped path, a folder without config.json and a kernel backend that cannot run here say so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from wiola import WiolaConfig, WiolaForCausalLM

from helpers import randomise
from oracles import ModelOracle, rel

# A tiny, valid config (2 layers, d 64).
TINY = dict(vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, dsff_narrow_size=64, dsff_wide_size=128, max_position_embeddings=16)


pytestmark = pytest.mark.usefixtures("one_thread")  # small shapes: threads only add overhead


def tiny_model(**overrides) -> WiolaForCausalLM:
    torch.manual_seed(0)
    return WiolaForCausalLM(WiolaConfig(**{**TINY, **overrides})).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A saved tiny model (config.json + model.safetensors)."""
    folder = tmp_path_factory.mktemp("ckpt")
    tiny_model().save_pretrained(folder)
    return folder


def copy_checkpoint(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


# ---- checkpoints: strict, safetensors only ------------------------------------------------

def test_save_and_load_round_trip(tmp_path):
    """Every tensor bit for bit (non-init values everywhere, float64), nothing missing or
    unexpected, the tied head tied, the config's fields kept, and the loaded model's logits
    the float64 oracle's — through WiolaForCausalLM and AutoModelForCausalLM."""
    torch.manual_seed(20)
    config = WiolaConfig(**{**TINY, "gcla_summary": "paper", "gcla_gate_init": -2.0, "atm_threshold": 0.5})
    model = randomise(WiolaForCausalLM(config), seed=20).double().eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded, info = WiolaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert isinstance(auto, WiolaForCausalLM)
    assert auto.lm_head.weight is auto.model.embed_tokens.weight
    for key in ("gcla_summary", "gcla_gate_init", "atm_threshold", "head_dim", "gcla_lookback",
                "num_key_value_heads", "srpe_spiral_divisor"):
        assert getattr(auto.config, key) == getattr(config, key), key
    ids = torch.randint(0, config.vocab_size, (2, 7))
    with torch.no_grad():
        assert rel(auto(ids).logits, ModelOracle(model, config).forward(ids, mode="paper")) < 1e-12


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.attn.gate"), r"missing model\.layers\.1\.attn\.gate"),
    (lambda t: t.pop("model.norm.weight"), r"missing model\.norm\.weight"),
    (lambda t: t.__setitem__("model.layers.0.attn.extra.weight", torch.zeros(3)),
     r"unexpected model\.layers\.0\.attn\.extra\.weight"),
    (lambda t: t.__setitem__("model.layers.0.attn.gate", torch.zeros(5)),
     r"model\.layers\.0\.attn\.gate: shape \(5,\) in the checkpoint, \(4,\) in the model"),
    (lambda t: t.__setitem__("model.layers.1.ffn.w_w1.weight", torch.zeros(128, 32)),
     r"model\.layers\.1\.ffn\.w_w1\.weight: shape \(128, 32\)"),
])
@pytest.mark.parametrize("loader", [WiolaForCausalLM, AutoModelForCausalLM])
def test_checkpoint_tensor_mismatch_is_refused_by_name(checkpoint, tmp_path, edit, message, loader):
    folder = copy_checkpoint(checkpoint, tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(ValueError, match=message):
        loader.from_pretrained(folder)


@pytest.mark.parametrize("change, name", [
    (dict(vocab_size=300), r"model\.embed_tokens\.weight: shape \(259, 64\) in the checkpoint, \(300, 64\)"),
    (dict(hidden_size=128, head_dim=32), r"model\.embed_tokens\.weight"),
    (dict(dsff_wide_size=256), r"model\.layers\.0\.ffn\.w_w1\.weight"),
    (dict(num_hidden_layers=3), r"missing model\.layers\.2\."),
    (dict(num_hidden_layers=1), r"unexpected model\.layers\.1\."),
])
def test_checkpoint_into_a_different_config_is_refused(checkpoint, tmp_path, change, name):
    folder = copy_checkpoint(checkpoint, tmp_path / "bad", edit_config=lambda c: c.update(change))
    with pytest.raises(ValueError, match=name):
        WiolaForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match=name):  # the same through from_pretrained's config overrides
        WiolaForCausalLM.from_pretrained(checkpoint, **change)


def test_pickle_only_checkpoint_is_refused(checkpoint, tmp_path, monkeypatch):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(checkpoint / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"never unpickled")  # not a real pickle: nothing may read it

    def no_torch_load(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_torch_load)
    for loader in (WiolaForCausalLM, AutoModelForCausalLM):
        with pytest.raises(OSError, match=r"pytorch_model\.bin.*safetensors only"):
            loader.from_pretrained(folder)
    with pytest.raises(ValueError, match="use_safetensors=False"):
        WiolaForCausalLM.from_pretrained(checkpoint, use_safetensors=False)
    with pytest.raises(ValueError, match="ignore_mismatched_sizes"):
        WiolaForCausalLM.from_pretrained(checkpoint, ignore_mismatched_sizes=True)


# ---- paths and backends ------------------------------------------------------------------

def test_mistyped_local_checkpoint_path_is_file_not_found_without_the_hub(checkpoint, tmp_path, monkeypatch):
    import time

    import wiola.loading

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hugging Face loader was reached for a local path")

    (tmp_path / "checkpoints" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("transformers.PreTrainedModel.from_pretrained", no_hub)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint folder 'checkpoints/tinyy'.*did you mean "
                                                r"'checkpoints/tiny'"):
        WiolaForCausalLM.from_pretrained("checkpoints/tinyy")
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        WiolaForCausalLM.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        WiolaForCausalLM.from_pretrained("./nowhere")
    assert time.perf_counter() - start < 5  # no network retries
    assert not wiola.loading.looks_local("someone/wiola-360m")  # a Hub id is left to Hugging Face


def test_folder_without_config_json_says_so(checkpoint, tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    shutil.copy(checkpoint / "model.safetensors", folder)
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        WiolaForCausalLM.from_pretrained(folder)


def test_saved_kernel_backend_that_cannot_run_here_loads_as_auto(checkpoint, tmp_path):
    from wiola_kernels import dispatch

    if dispatch.BACKENDS["cuda"].unavailable_reason(torch.device("cpu")) is None:  # pragma: no cover
        pytest.skip("the cuda backend runs on CPU tensors here")
    folder = copy_checkpoint(checkpoint, tmp_path / "cuda-trained",
                             edit_config=lambda c: c.update(kernel_backend="cuda"))
    with pytest.warns(UserWarning, match=r"kernel_backend='cuda'.*loaded with kernel_backend='auto'"):
        model = WiolaForCausalLM.from_pretrained(folder)
    assert model.config.kernel_backend == "auto"
    ids = torch.tensor([[1, 75, 108, 4]])
    reference = tiny_model()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    # An explicit choice is the caller's: kept, and the forward names the backend it cannot run.
    kept = WiolaForCausalLM.from_pretrained(folder, kernel_backend="cuda")
    assert kept.config.kernel_backend == "cuda"
    with pytest.raises(RuntimeError, match="backend 'cuda'"), torch.no_grad():
        kept(ids)


def test_refused_load_prints_no_newly_initialized_report(checkpoint, tmp_path, capfd):
    folder = copy_checkpoint(checkpoint, tmp_path / "bad", edit_tensors=lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"missing model\.norm\.weight"):
        WiolaForCausalLM.from_pretrained(folder)
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "newly initialized" not in err
