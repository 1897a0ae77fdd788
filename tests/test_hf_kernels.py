"""Our layers through Hugging Face's own ``kernels`` switch (wiola_kernels/hf_kernels.py), offline:
``kernels.kernelize`` under :func:`wiola_kernels.kernel_mapping` and ``from_pretrained(...,
use_kernels=True, kernel_config=wk.kernel_config())`` on small random models of the families
whose layers transformers decorates. Each test proves our ops run (it counts the calls of the
registered ops ``torch.ops.wiola.*`` with a dispatch mode, forward and backward), and compares
loss, logits and every parameter gradient with the unpatched model run in float64 (SPEC §9's
float32 tolerance, attention class: these are whole models).
"""

from __future__ import annotations

import collections
import copy
import inspect
import logging
import subprocess
import sys
import warnings

import pytest
import torch

kernels = pytest.importorskip("kernels", reason="Hugging Face's `kernels` package is not installed "
                                                "(pip install 'kernels>=0.19.1,<0.20')")

import wiola_kernels as wk  # noqa: E402
from wiola_kernels import hf_kernels  # noqa: E402
from wiola_kernels.testing import rel_err, tolerance  # noqa: E402

from helpers import WiolaOpCalls  # noqa: E402
from hf_helpers import VOCAB, randomise_norms, recording_backend, training_batch, transformers  # noqa: E402

TOL = tolerance(torch.float32, "attention")
Mode = kernels.Mode
# kernels >= 0.17 asks a registration's condition per instance (older: our forward decides)
CONDITIONS = "condition" in inspect.signature(kernels.replace_kernel_forward_from_hub).parameters

# model_type -> (config class, causal-LM class, what transformers lets us swap there)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"norm", "rope"}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"norm", "rope"}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"norm", "rope"}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"norm", "rope"}),  # q/k norms per head too
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"norm", "rope"}),  # every 4th layer without RoPE
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"rope"}),  # its x̂·(1+γ) norm has no kernels hook
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"rope"}),  # soft-capping and sliding windows stay HF's
}


def _model(family: str, seed: int = 0, attn: str = "eager", **overrides):
    """A seeded random ``<Family>ForCausalLM`` (d 64, 4 heads of 16, 2 KV heads, 4 layers) in
    eval mode, with non-trivial norm weights."""
    config_cls, model_cls, _ = FAMILIES[family]
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    kw.update(overrides)
    if "head_dim" not in inspect.signature(getattr(transformers, config_cls).__init__).parameters:
        kw.pop("head_dim")  # d / heads = 16 there
    cfg = getattr(transformers, config_cls)(**kw)
    cfg._attn_implementation = attn
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        m = getattr(transformers, model_cls)(cfg)
    randomise_norms(m, seed + 1)
    return m.eval()


def _kernelize(m, mode=Mode.TRAINING, device="cpu"):
    with kernels.use_kernel_mapping(wk.kernel_mapping()):
        return kernels.kernelize(m, mode=mode, device=device)


OUR_FORWARDS = {getattr(hf_kernels.layers, name).forward: name for name in hf_kernels.LAYER_NAMES.values()}


def _served(m) -> collections.Counter:
    """How many modules / rotary functions of ``m`` run one of our layers, by layer (kernels
    binds the layer's ``forward`` to the instance)."""
    served = collections.Counter()
    for module in m.modules():
        for sub in (module, *getattr(module, "_kernel_funcs", {}).values()):
            bound = sub.__dict__.get("forward")
            served.update([OUR_FORWARDS[bound.__func__]] if getattr(bound, "__func__", None) in OUR_FORWARDS else [])
    return served


def _expected_calls(m, family: str) -> dict:
    """Our op calls in one forward: every RMSNorm (Qwen3's q/k norms too), one RoPE per layer
    that applies it."""
    cfg = m.config
    swaps = FAMILIES[family][2]
    norms = sum(type(mod).__dict__.get("kernel_layer_name") == "RMSNorm" for mod in m.modules())
    rope_layers = cfg.num_hidden_layers
    if family == "smollm3":
        rope_layers = sum(cfg.no_rope_layers)  # 1: the layer applies RoPE
    return {"rms_norm": norms if "norm" in swaps else 0, "srpe": rope_layers if "rope" in swaps else 0}


def _loss_and_grads(m, batch):
    m.zero_grad(set_to_none=True)
    out = m(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def _assert_matches(got, want, what: str) -> None:
    loss, logits, grads = got
    want_loss, want_logits, want_grads = want
    assert loss.dtype == torch.float32 and logits.dtype == torch.float32
    assert rel_err(loss, want_loss) <= TOL, f"{what} loss {rel_err(loss, want_loss):.2e}"
    assert rel_err(logits, want_logits) <= TOL, f"{what} logits {rel_err(logits, want_logits):.2e}"
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        assert rel_err(grad, want_grads[name]) <= TOL, f"{what} grad {name}: {rel_err(grad, want_grads[name]):.2e}"


def _check_step(m, ref64, family: str, batch: dict, what: str) -> None:
    """One training step of ``m`` runs our ops (counted) and matches ``ref64`` (float64, unpatched)."""
    want = _loss_and_grads(ref64, {k: v for k, v in batch.items()})
    with WiolaOpCalls() as ops:
        got = _loss_and_grads(m, batch)
    expected = _expected_calls(m, family)
    for op, n in expected.items():
        assert ops.calls[op] == n and ops.calls[f"{op}_backward"] == n, f"{what}: {op} {dict(ops.calls)}"
    assert sum(expected.values()) > 0
    _assert_matches(got, want, what)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernelize_training_runs_our_layers_and_matches_float64(family):
    m = _model(family, seed=1)
    ref64 = copy.deepcopy(m).double().train()
    assert _kernelize(m.train()) is m
    served = _served(m)
    swaps = FAMILIES[family][2]
    n_norms = sum(type(mod).__dict__.get("kernel_layer_name") == "RMSNorm" for mod in m.modules())
    assert served["RMSNorm"] == (n_norms if "norm" in swaps else 0)
    assert served["ApplyRotaryPosEmb"] == m.config.num_hidden_layers and served["RotaryEmbedding"] == 1
    for case in ("plain", "ignore_index"):
        _check_step(m, ref64, family, training_batch(case, seed=2), f"{family} {case}")


def test_kernelize_with_per_row_positions_and_inference_mode():
    # Left padding with per-row position_ids (as generate makes them): srpe gets (B, T) positions.
    m = _model("llama", seed=3, attn="sdpa")
    ref64 = copy.deepcopy(m).double().train()
    _kernelize(m.train())
    _check_step(m, ref64, "llama", training_batch("left_padding", seed=4), "left padding")
    # Inference mode: the same layers, no backward.
    m = _model("qwen3", seed=5)
    ref64 = copy.deepcopy(m).double()
    _kernelize(m, mode=Mode.INFERENCE)
    batch = training_batch("plain", seed=6)
    with torch.no_grad():
        want = ref64(**batch).logits
        with WiolaOpCalls() as ops:
            got = m(**batch).logits
    assert ops.calls == collections.Counter(_expected_calls(m, "qwen3"))
    assert rel_err(got, want) <= TOL


def test_from_pretrained_use_kernels_with_our_kernel_config(tmp_path):
    saved = _model("llama", seed=7)
    saved.save_pretrained(tmp_path)
    ref64 = copy.deepcopy(saved).double().train()
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True,
                                                          kernel_config=wk.kernel_config())
    assert not m.training and m.use_kernels and getattr(m, "kernels_mode", Mode.INFERENCE) == Mode.INFERENCE
    assert _served(m) == {"RMSNorm": 9, "ApplyRotaryPosEmb": 4, "RotaryEmbedding": 1}
    batch = training_batch("ignore_index", seed=8)
    with torch.no_grad(), WiolaOpCalls() as ops:
        logits = m(input_ids=batch["input_ids"]).logits
    assert ops.calls == {"rms_norm": 9, "srpe": 4}
    with torch.no_grad():
        assert rel_err(logits, ref64(input_ids=batch["input_ids"]).logits) <= TOL
    # model.train() re-kernelizes for Mode.TRAINING (transformers does it): still ours.
    m.train()
    assert getattr(m, "kernels_mode", Mode.TRAINING) == Mode.TRAINING and _served(m)["RMSNorm"] == 9
    _check_step(m, ref64, "llama", batch, "from_pretrained")
    if not hasattr(m, "reset_kernels"):
        return  # transformers < 5.2x cannot undo kernelize
    # transformers' off switch puts HF's forwards back.
    m.use_kernels = False
    assert not _served(m)
    with torch.no_grad(), WiolaOpCalls() as ops:
        m(input_ids=batch["input_ids"])
    assert not ops.calls


def test_torch_compile_mode_is_one_graph_with_our_ops():
    torch._dynamo.reset()
    m = _model("llama", seed=9).train()
    ref64 = copy.deepcopy(m).double()
    _kernelize(m, mode=Mode.TRAINING | Mode.TORCH_COMPILE)
    batch = training_batch("right_padding", seed=10)
    eager = _loss_and_grads(m, batch)
    backend, graphs = recording_backend()
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    loss, logits, grads = _loss_and_grads(compiled, batch)
    assert len(graphs) == 1 and {"wiola.rms_norm.default", "wiola.srpe.default", "wiola.rms_norm_backward.default",
                                 "wiola.srpe_backward.default"} <= graphs[0]
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
    assert rel_err(loss, eager[0]) <= 1e-6 and rel_err(logits, eager[1]) <= 1e-5
    for name, grad in grads.items():
        assert rel_err(grad, eager[2][name]) <= 1e-5, name
    _assert_matches((loss, logits, grads), _loss_and_grads(ref64, batch), "compiled")
    del compiled
    torch._dynamo.reset()


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_other_rope_types_keep_hf_rope_and_still_fuse_the_norms(rope):
    m = _model("llama", seed=11, rope_parameters=rope)
    ref64 = copy.deepcopy(m).double().train()
    _kernelize(m.train())
    if CONDITIONS:
        assert _served(m)["RotaryEmbedding"] == 0  # the registration's condition: default RoPE only
    assert _served(m)["ApplyRotaryPosEmb"] == 4  # ... which rotates HF's tables itself
    batch = training_batch("plain", seed=12)
    want = _loss_and_grads(ref64, batch)
    with WiolaOpCalls() as ops:
        got = _loss_and_grads(m, batch)
    assert ops.calls == {"rms_norm": 9, "rms_norm_backward": 9}
    _assert_matches(got, want, rope["rope_type"])


def test_default_rope_found_where_float32_inv_freq_is_ulps_off():
    # θ₀ 1e7 and d_h 30: HF's float32 inv_freq is up to 4 ulp from float64 θ₀^(−2j/d_h), and
    # a bf16 model holds the buffer in bf16; both are still the default RoPE (served by srpe).
    for dtype in (torch.float32, torch.bfloat16):
        m = _model("llama", seed=17, head_dim=30, rope_parameters={"rope_type": "default", "rope_theta": 1e7}).to(dtype)
        _kernelize(m)
        assert _served(m)["RotaryEmbedding"] == 1
        with torch.no_grad(), WiolaOpCalls() as ops:
            m(input_ids=training_batch("plain", seed=18)["input_ids"])
        assert ops.calls["srpe"] == 4


def test_hand_edited_inv_freq_keeps_hf_rope():
    m = _model("llama", seed=13)
    with torch.no_grad():
        m.model.rotary_emb.inv_freq.mul_(0.5)
    ref64 = copy.deepcopy(m).double()
    _kernelize(m)
    if CONDITIONS:
        assert _served(m)["RotaryEmbedding"] == 0
    x = training_batch("plain", seed=14)["input_ids"]
    with torch.no_grad(), WiolaOpCalls() as ops:
        got = m(input_ids=x).logits
    assert ops.calls == {"rms_norm": 9} and rel_err(got, ref64(input_ids=x).logits) <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_layer_keeps_hf_dtype_rules(dtype):
    # γ in float32 and bf16/fp16 activations: HF's output is promoted to float32 (γ · round(x/r)).
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(16)
    norm = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) + 0.5)
    x = torch.randn(3, 5, 48, generator=g).to(dtype)
    for weight_dtype in (torch.float32, dtype):
        norm.to(weight_dtype)
        want = LlamaRMSNorm.forward(norm, x)
        truth = LlamaRMSNorm.forward(copy.deepcopy(norm).double(), x.double())
        with kernels.use_kernel_mapping(wk.kernel_mapping()):
            kernels.kernelize(norm, mode=Mode.INFERENCE, device="cpu")
        with WiolaOpCalls() as ops:
            got = norm(x)
        assert ops.calls == {"rms_norm": 1}
        assert got.dtype == want.dtype
        assert rel_err(got, truth) <= tolerance(dtype)


def test_mapping_shape_and_bad_arguments():
    mapping = wk.kernel_mapping()
    assert set(mapping) == {"RMSNorm", "rotary_pos_emb", "WiolaRotaryEmbedding"}
    modes = {Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE, Mode.INFERENCE | Mode.TORCH_COMPILE}
    for by_device in mapping.values():
        assert set(by_device) == {"cpu", "cuda"}
        for by_mode in by_device.values():
            assert set(by_mode) == modes
    assert set(wk.kernel_mapping("cpu")["RMSNorm"]) == {"cpu"}
    with pytest.raises(ValueError, match="devices"):
        wk.kernel_mapping(("cpu", "mps"))
    with pytest.raises(ValueError, match="layer_name"):
        hf_kernels.Repository("LayerNorm")
    with pytest.raises(ValueError, match="families"):
        hf_kernels.register_rotary_layers(["gpt2"])
    # Outside our mapping the marked rotary classes keep their forward, without a warning.
    m = _model("llama", seed=15)
    with warnings.catch_warnings(record=True) as caught, _LogRecords("kernels") as logged:
        warnings.simplefilter("always")
        kernels.kernelize(m, mode=Mode.INFERENCE, device="cpu")
    assert not _served(m)
    assert not [w for w in caught if "WiolaRotaryEmbedding" in str(w.message)]
    assert not [r for r in logged if "WiolaRotaryEmbedding" in r.getMessage()]
    # use_fallback=False: kernels raises rather than keeping a forward it cannot serve.
    m = _model("llama", seed=15)
    with kernels.use_kernel_mapping(wk.kernel_mapping("cuda"), inherit_mapping=False):
        with pytest.raises(ValueError, match="device type"):
            kernels.kernelize(m, mode=Mode.INFERENCE, device="cpu", use_fallback=False)


class _LogRecords(logging.Handler):
    """The records a logger (and its children) emit inside the block."""

    def __init__(self, name: str):
        super().__init__(logging.DEBUG)
        self.logger, self.records = logging.getLogger(name), []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.logger.addHandler(self)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def test_imports_without_kernels():
    code = ("import sys; sys.modules['kernels'] = None\n"
            "import wiola_kernels as wk\n"
            "try:\n    wk.kernel_mapping()\nexcept ImportError:\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
