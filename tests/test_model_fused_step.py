"""The Wiola model's fused training-step pieces (SPEC §10.2, §10.3): DSFF as the up
products + :func:`wiola_kernels.glu` per stream + the blended down products, and every norm
after the first as :func:`wiola_kernels.add_rms_norm`.

The float64 loss and every parameter gradient of the model against tests/oracles.py's
ModelOracle are tests/test_model.py's. Here: the float32 model against itself in float64
(training, ATM on); bf16 autocast against the reference ops' step; DSFF alone in bf16 and by
float64 ``gradcheck``; a checkpoint written by the model before the fusion loads unchanged
and gives its logits; a block compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import wiola_kernels
from wiola import WiolaConfig, WiolaForCausalLM
from wiola.model import WiolaDSFF
from wiola_kernels import WiolaRMSNorm
from wiola_kernels.reference import dsff as dsff_reference
from wiola_kernels.testing import rel_err, tolerance


CHECKPOINT_V0 = Path(__file__).parent / "data" / "wiola-checkpoint-v0"  # saved by the model before the fusion

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**overrides) -> WiolaConfig:
    kw = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              dsff_narrow_size=16, dsff_wide_size=48, max_position_embeddings=64, gcla_gate_init=0.0)
    kw.update(overrides)
    return WiolaConfig.from_name("wiola-tiny", **kw)


def make(config: WiolaConfig, dtype=torch.float32, seed: int = 0) -> WiolaForCausalLM:
    """A seeded model whose β, γ, δ are far from their inits (λ ≠ ½, so a wrong fold shows)."""
    torch.manual_seed(seed)
    model = WiolaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("beta", "shift")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model.to(dtype)


def ids_and_labels(vocab: int, b: int = 2, t: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (b, t), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    labels[0, 2] = -100
    return ids, labels


def model_loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_every_norm_after_the_first_is_add_rms_norm(monkeypatch):
    """One forward: WRMSNorm_0 alone, then 2L − 1 adds fused with their norms (the last the final norm)."""
    calls = {"rms_norm": 0, "add_rms_norm": 0}

    def counter(name, original):
        def counted(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return counted

    monkeypatch.setattr(wiola_kernels, "add_rms_norm", counter("add_rms_norm", wiola_kernels.add_rms_norm))
    monkeypatch.setattr(WiolaRMSNorm, "forward", counter("rms_norm", WiolaRMSNorm.forward))
    model = make(tiny())
    ids, _ = ids_and_labels(model.config.vocab_size)
    with torch.no_grad():
        model(ids, use_cache=False)
    assert calls == {"rms_norm": 1, "add_rms_norm": 2 * model.config.num_hidden_layers}


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_float32_model_matches_itself_in_float64(backend):
    """The float32 model in training (ATM on) against the same weights in float64: logits, loss
    and every parameter gradient."""
    model = make(tiny(kernel_backend=backend, atm_threshold=0.0)).train()
    ids, labels = ids_and_labels(model.config.vocab_size)

    def run(model):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels, use_cache=False, return_logits=True)
        out.loss.backward()
        return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logits, loss, grads = run(model)
    ref_logits, ref_loss, ref_grads = run(copy.deepcopy(model).double())
    assert rel_err(logits, ref_logits) <= tolerance(torch.float32)
    assert rel_err(loss, ref_loss) <= tolerance(torch.float32)
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) <= tolerance(torch.float32, "attention"), name


DSFF_NAMES = ["w_n1", "w_n3", "w_n2", "w_w1", "w_w3", "w_w2"]


def test_bf16_autocast_training_step_is_as_accurate_as_the_reference_ops():
    """CPU bf16 autocast (``python -m wiola train --precision bf16``): the GEMM outputs are
    bf16 while the residual stream stays float32. Against the float64 model, the step's loss
    is within SPEC §9's bf16 tolerance and each gradient's error is at most twice the same
    step's on the reference ops (both carry bf16 GEMM rounding; tiny gradients, e.g. the first
    layers' key projections, are dominated by it in either)."""
    model = make(tiny(atm_enabled=False)).train()
    ids, labels = ids_and_labels(model.config.vocab_size)
    want_loss, want = model_loss_and_grads(copy.deepcopy(model).double(), ids, labels)

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = run()
    with wiola_kernels.use_backend("reference"):
        _, ref_grads = run()
    assert rel_err(loss, want_loss) <= tolerance(torch.bfloat16)
    for name, g in want.items():
        assert grads[name].dtype == torch.float32, name
        assert rel_err(grads[name], g) <= max(2 * rel_err(ref_grads[name], g), tolerance(torch.bfloat16)), name


def _dsff(dtype, d=8, n=8, w=12, seed=0) -> WiolaDSFF:
    """A DSFF module with random weights and β (λ far from ½)."""
    g = torch.Generator().manual_seed(seed)
    ffn = WiolaDSFF(tiny(hidden_size=d, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                         dsff_narrow_size=n, dsff_wide_size=w))
    with torch.no_grad():
        for p in ffn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if p is ffn.beta else 0.3))
    return ffn.to(dtype)


def _params(ffn: WiolaDSFF) -> list[torch.Tensor]:
    return [getattr(ffn, k).weight for k in DSFF_NAMES] + [ffn.beta]


def test_dsff_gradcheck_float64():
    ffn = _dsff(torch.float64)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    keys = [f"{k}.weight" for k in DSFF_NAMES] + ["beta"]

    def fn(x, *weights):
        return torch.func.functional_call(ffn, dict(zip(keys, weights)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *[p.detach().requires_grad_() for p in _params(ffn)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dsff_output_and_gradients_within_spec_tolerance(dtype):
    """Fused DSFF in float32 / bf16 against the §7 reference in float64: output, ∂x, every
    weight's gradient and ∂β (through the λ fold) — with a strided input (a slice)."""
    ffn = _dsff(dtype)
    ffn64 = copy.deepcopy(ffn).double()  # the same (rounded) weights: only the arithmetic differs
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 7, 8, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(3, 5, 8, generator=gen).to(dtype)
    x64 = x.detach().double().requires_grad_()
    want = dsff_reference(x64[:, 1:6], *_params(ffn64))
    want_grads = torch.autograd.grad(want, [x64, *_params(ffn64)], g.double())
    y = ffn(x[:, 1:6])
    grads = torch.autograd.grad(y, [x, *_params(ffn)], g)
    # float32: the GEMMs' reductions make this the matmul (attention) class of §9
    tol = tolerance(dtype, "attention")
    assert y.dtype == dtype and rel_err(y, want) <= tol
    for name, got, ref in zip(["x"] + DSFF_NAMES + ["beta"], grads, want_grads):
        assert got.dtype == dtype and rel_err(got, ref) <= tol, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_dsff_without_gradients_within_spec_tolerance(dtype, mode):
    """No gradient wanted (a prompt's forward, evaluation, frozen weights and input; on the CPU
    a few rows run on the decoding GEMV kernel): §7's float64 reference within SPEC tolerance
    (strided input)."""
    ffn = _dsff(dtype, d=8, n=8, w=12, seed=3)
    ffn64 = copy.deepcopy(ffn).double()
    x = torch.randn(3, 7, 8, generator=torch.Generator().manual_seed(4)).to(dtype)
    want = dsff_reference(x.double()[:, 1:6], *_params(ffn64))
    out = torch.full((3, 5, 8), float("nan"), dtype=dtype)
    if mode == "frozen":
        ffn.requires_grad_(False)
        out.copy_(ffn(x[:, 1:6]))
    else:
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            out.copy_(ffn(x[:, 1:6]))
    assert out.dtype == dtype and rel_err(out, want) <= tolerance(dtype, "attention")


def test_dsff_without_gradients_compiles_fullgraph():
    # Without gradients under torch.compile: one graph, §7's float64 reference within tolerance.
    torch._dynamo.reset()
    ffn = _dsff(torch.float32, seed=5)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(6))
    want = dsff_reference(x.double(), *_params(copy.deepcopy(ffn).double()))
    with torch.no_grad():
        got = torch.compile(ffn, fullgraph=True, backend="inductor")(x)
    assert rel_err(got, want) <= tolerance(torch.float32, "attention")


def test_checkpoint_saved_before_the_fusion_loads_unchanged():
    """A checkpoint written by the model before DSFF and the norms were fused (same keys and
    shapes) loads strictly and gives the logits that model computed."""
    model = WiolaForCausalLM.from_pretrained(CHECKPOINT_V0).eval()
    expected = load_file(CHECKPOINT_V0 / "expected_logits.safetensors")
    saved = load_file(CHECKPOINT_V0 / "model.safetensors")
    state = model.state_dict()
    assert set(saved) <= set(state) and set(state) - set(saved) <= {"lm_head.weight"}  # tied head
    for name, t in saved.items():
        assert state[name].shape == t.shape and torch.equal(state[name], t), name
    with torch.no_grad():
        logits = model(expected["input_ids"], use_cache=False).logits
    assert rel_err(logits, expected["logits"]) <= tolerance(torch.float32)


def test_block_compiles_fullgraph_with_the_next_norm():
    """A training block with the fused DSFF and both add+norms: ``torch.compile(fullgraph=True)``
    (no graph break), forward and backward equal to eager."""
    config = tiny(atm_enabled=False)
    model = make(config).train()
    block, nxt = model.model.layers[1], model.model.layers[2].attn_norm
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 32, generator=g, requires_grad=True)
    pos = torch.arange(6).expand(2, 6)
    ctx = torch.randn(2, 6, 1, 32, generator=g)

    def run(fn):
        out, normed = fn(x, pos, ctx, None, next_norm=nxt)
        loss = (out * out).sum() + (normed * normed.cos()).sum()
        grads = torch.autograd.grad(loss, [x, *block.parameters(), *nxt.parameters()])
        return out.detach(), normed.detach(), grads

    eager = run(block)
    torch._dynamo.reset()
    compiled = run(torch.compile(block, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled[:2] + compiled[2], eager[:2] + eager[2]):
        assert rel_err(got, want) <= tolerance(torch.float32)
