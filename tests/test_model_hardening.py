"""Hardening of the reference model: a bad config.json is refused naming
the field, a checkpoint that does not match its config is refused naming the tensor (never a
partial load, never pickle), and generation / forward refuse empty or too-long sequences."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from wiola import WiolaConfig, WiolaForCausalLM
from wiola.configuration_wiola import REQUIRED_FIELDS

SEED_CONFIG = Path(__file__).parent / "data" / "wiola-360m-config.json"  # copy of shared/seed
SEED = json.loads(SEED_CONFIG.read_text())

# A tiny, valid config (2 layers, d 64): every test below starts from it.
TINY = dict(vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, dsff_narrow_size=64, dsff_wide_size=128, max_position_embeddings=16)


pytestmark = pytest.mark.usefixtures("one_thread")  # small shapes: threads only add overhead


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


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


# ---- config.json: required fields, defaults, unknown keys ------------------------------------

def test_seed_config_loads_every_way_without_warnings(tmp_path):
    folder = write_config(tmp_path, SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        configs = [WiolaConfig.from_json_file(SEED_CONFIG), WiolaConfig.from_pretrained(folder),
                   AutoConfig.from_pretrained(folder)]
    for config in configs:
        assert isinstance(config, WiolaConfig)
        assert (config.hidden_size, config.head_dim, config.gcla_summary, config.kernel_backend) == \
            (1024, 64, "causal", "auto")


@pytest.mark.parametrize("field", REQUIRED_FIELDS)
def test_missing_required_field_is_named(tmp_path, field):
    assert field in SEED
    folder = write_config(tmp_path, {k: v for k, v in SEED.items() if k != field})
    for load in (WiolaConfig.from_pretrained, AutoConfig.from_pretrained, WiolaForCausalLM.from_pretrained,
                 AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=f"missing the required field.*{field}"):
            load(folder)
    with pytest.raises(ValueError, match=field):
        WiolaConfig.from_json_file(folder / "config.json")


def test_defaulted_fields_may_be_left_out(tmp_path):
    """Every other field of the seed config has the SPEC §1 default."""
    defaults = WiolaConfig()
    optional = [k for k in SEED if k not in REQUIRED_FIELDS and k not in ("model_type", "architectures",
                                                                           "transformers_version", "dtype")]
    assert "srpe_theta" in optional and "atm_threshold" in optional
    minimal = {k: v for k, v in SEED.items() if k not in optional}
    config = WiolaConfig.from_pretrained(write_config(tmp_path, minimal))
    for name in optional:
        assert getattr(config, name) == getattr(defaults, name) == SEED[name], name
    assert config.head_dim == 64  # derived: hidden_size / num_attention_heads


def test_unknown_keys_are_kept_and_typos_warned(tmp_path):
    folder = write_config(tmp_path / "a", {**SEED, "future_field": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert WiolaConfig.from_pretrained(folder).future_field == 3
    folder = write_config(tmp_path / "b", {**SEED, "atm_treshold": 0.5})  # misspelt: the default stays
    with pytest.warns(UserWarning, match="atm_treshold.*atm_threshold"):
        config = WiolaConfig.from_pretrained(folder)
    assert config.atm_threshold == 0.92
    with pytest.warns(UserWarning, match="did you mean 'gcla_summary'"):
        WiolaConfig(**TINY, gcla_sumary="paper")


BAD_VALUES = [
    ("hidden_size", "64"), ("hidden_size", 64.0), ("hidden_size", 0), ("hidden_size", -64), ("hidden_size", True),
    ("hidden_size", 96),                  # ≠ num_attention_heads · head_dim
    ("vocab_size", "many"), ("vocab_size", None), ("num_hidden_layers", 2.5), ("num_hidden_layers", 0),
    ("num_attention_heads", 3),           # 3 · 16 ≠ 64
    ("num_key_value_heads", 3),           # does not divide 4
    ("num_key_value_heads", 0), ("head_dim", 15), ("head_dim", 8), ("head_dim", "16"),
    ("max_position_embeddings", 0), ("max_position_embeddings", 1e3), ("dsff_narrow_size", -1),
    ("dsff_wide_size", [128]),
    ("gcla_summary", "future"), ("gcla_summary", None), ("gcla_summary", ["causal"]), ("kernel_backend", "gpu"),
    ("gcla_lookback", -1), ("gcla_lookback", 1.5),
    ("atm_threshold", 1.5), ("atm_threshold", -1.01), ("atm_threshold", "high"), ("atm_threshold", float("nan")),
    ("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-6), ("rms_norm_eps", "1e-6"), ("rms_norm_eps", float("inf")),
    ("srpe_theta", 0), ("srpe_spiral_divisor", 0), ("srpe_radial_amplitude", None), ("gcla_gate_init", "x"),
    ("initializer_range", 0), ("atm_enabled", "yes"), ("use_cache", 1), ("tie_word_embeddings", "false"),
    ("bos_token_id", 259), ("pad_token_id", -1), ("eos_token_id", [2, 999]), ("eos_token_id", 2.0),
]


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_bad_field_is_named_in_kwargs_and_config_json(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        WiolaConfig(**{**TINY, field: value})
    folder = write_config(tmp_path, {**TINY, "model_type": "wiola", field: value})
    for load in (WiolaConfig.from_pretrained, AutoConfig.from_pretrained, WiolaForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=field):
            load(folder)


def test_exact_atm_threshold_bounds_and_int_reals_are_accepted():
    for tau in (-1, -1.0, 1, 1.0):
        assert WiolaConfig(**TINY, atm_threshold=tau).atm_threshold == tau
    assert WiolaConfig(**TINY, srpe_theta=500000, rms_norm_eps=1).srpe_theta == 500000


def test_wrong_model_type_is_refused(tmp_path):
    folder = write_config(tmp_path, {**SEED, "model_type": "llama"})
    for load in (WiolaConfig.from_pretrained, WiolaForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match="model_type"):
            load(folder)
    with pytest.raises(ValueError, match="model_type"):
        WiolaConfig(**TINY, model_type="llama")
    with pytest.raises(ValueError, match="model_type"):
        WiolaConfig.from_pretrained(write_config(tmp_path / "ok", SEED), model_type="llama")


def test_from_pretrained_overrides_are_checked(tmp_path):
    folder = write_config(tmp_path, SEED)
    with pytest.raises(ValueError, match="hidden_size"):
        WiolaConfig.from_pretrained(folder, hidden_size="1024")
    with pytest.raises(ValueError, match="atm_threshold"):
        AutoConfig.from_pretrained(folder, atm_threshold=2.0)


def test_a_config_broken_after_construction_is_refused_by_the_model():
    config = WiolaConfig(**TINY)
    config.num_key_value_heads = 3
    with pytest.raises(ValueError, match="num_key_value_heads"):
        WiolaForCausalLM(config)


# ---- checkpoints: strict, safetensors only ------------------------------------------------

def test_strict_round_trip_loads_everything(checkpoint):
    model, info = WiolaForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    ref = tiny_model().state_dict()
    assert all(torch.equal(ref[k], v) for k, v in model.state_dict().items())
    assert isinstance(AutoModelForCausalLM.from_pretrained(checkpoint), WiolaForCausalLM)


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


# ---- sequence lengths: generation and forward ----------------------------------------------

@pytest.fixture(scope="module")
def model() -> WiolaForCausalLM:
    return tiny_model()  # max_position_embeddings = 16


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_refuses_an_empty_prompt(model, batch):
    empty = torch.zeros(batch, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate(empty, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate(input_ids=empty, max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("summary", ["causal", "paper"])
def test_generate_refuses_sequences_past_max_position_embeddings(summary):
    model = tiny_model(gcla_summary=summary)
    ids = torch.randint(3, 259, (2, 17))
    with pytest.raises(ValueError, match="17 tokens, more than max_position_embeddings = 16"):
        model.generate(ids, max_new_tokens=1, do_sample=False)
    with pytest.raises(ValueError, match="17 positions exceed max_position_embeddings = 16.* at most 6"):
        model.generate(ids[:, :10], max_new_tokens=7, do_sample=False)
    with pytest.raises(ValueError, match="max_position_embeddings = 16"):
        model.generate(ids[:, :10], max_length=17, do_sample=False)
    with torch.no_grad():  # exactly filling the context is fine
        out = model.generate(ids[:, :10], attention_mask=torch.ones(2, 10, dtype=torch.long), max_new_tokens=6,
                             do_sample=False, eos_token_id=None)
    assert out.shape == (2, 16)


def test_forward_refuses_empty_and_too_long_inputs(model):
    with torch.no_grad():
        with pytest.raises(ValueError, match="empty"):
            model(torch.zeros(1, 0, dtype=torch.long))
        with pytest.raises(ValueError, match="max_position_embeddings = 16"):
            model(torch.randint(3, 259, (1, 17)))
        out = model(torch.randint(3, 259, (1, 10)), use_cache=True)
        with pytest.raises(ValueError, match="10 cached \\+ 7 new positions exceed max_position_embeddings"):
            model(torch.randint(3, 259, (1, 7)), cache=out.cache, use_cache=True)
        assert model(torch.randint(3, 259, (1, 6)), cache=out.cache, use_cache=True).logits.shape == (1, 6, 259)


# ---- a new user's first mistakes: errors that say what to do --------------------

def test_generate_refuses_a_1d_prompt_naming_the_shape(model):
    with pytest.raises(ValueError, match=r"\(B, T\), got \(3,\).*ids\[None\]"):
        model.generate(torch.tensor([1, 75, 108]), max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"\(B, T\), got \(3,\)"):
        model.generate(input_ids=torch.tensor([1, 75, 108]), max_new_tokens=2, do_sample=False)


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


def test_attention_mask_and_labels_of_the_wrong_shape_are_named(model):
    ids = torch.tensor([[1, 75, 108]])
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, cached \+ T\) = \(1, 3\).*\(1, 5\)"):
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0]]))
    with pytest.raises(ValueError, match=r"attention_mask.*\(1, 2\)"):
        model(ids, attention_mask=torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(B, T\) = \(1, 3\), got \(1, 2\)"):
        model(ids, labels=torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        model(ids, labels=ids.float())
    # A full mask of the right shape is still accepted, and generate's (B, cached + T) masks too.
    torch.testing.assert_close(model(ids, attention_mask=torch.ones_like(ids)).logits, model(ids).logits,
                               rtol=0, atol=0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)
