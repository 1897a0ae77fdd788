"""GCLA attention CUDA kernels against the float64 reference. Every test runs on the
``cuda`` backend (GPU, run by scripts/gpu_check.sh on a lent GPU; skipped without one) and
on ``cuda_emu`` (the same kernels and binding on CPU tensors in the SIMT emulator, in CI;
smaller shapes)."""

from __future__ import annotations

import math

import pytest
import torch

import wiola_kernels
from wiola_kernels.ops.gcla_attention import gcla_attention_op
from wiola_kernels.reference.gcla_attention import gcla_attention_forward
from wiola_kernels.testing import tolerance

from cuda_targets import DEVICE, EMULATED, raw_ops, targets, with_cases

TARGETS = targets()
NAMES = ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate")


def make_inputs(B, H, H_kv, T, dh, S, L, dtype, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()

    return [r(B, H, T, dh), r(B, H_kv, T, dh), r(B, H_kv, T, dh), r(B, H, T, dh), r(B, H, S, L, dh),
            r(B, H, S, L, dh),  # gate logits: float32, float64 with float64 inputs (gradcheck)
            torch.randn(H, generator=g).to(device, torch.float64 if dtype == torch.float64 else torch.float32)
            .requires_grad_()]


def close(out, ref, tol, what, floor=0.25):
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    assert o.shape == r.shape, what
    assert torch.isfinite(o).all(), f"{what}: non-finite"
    den = max(float(r.norm()), floor * math.sqrt(max(r.numel(), 1)))
    err = float((o - r).norm()) / den
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


GPU_CASES = [(1, "paper", None, 2, 4), (7, "causal", [7, 3], 1, 1), (64, "paper", None, 0, 4),
             (257, "causal", [257, 100], 2, 1), (300, "paper", [0, 299], 2, 2)]
# Emulated: the same situations on fewer keys (odd T over two tiles, lengths 0 and T − 1).
EMU_CASES = [(1, "paper", None, 2, 4), (7, "causal", [7, 3], 1, 1), (64, "paper", None, 0, 4),
             (37, "causal", [37, 20], 2, 1), (45, "paper", [0, 44], 2, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dh", [64, 128])
@pytest.mark.parametrize("backend, T, mode, lens, L, H_kv", with_cases(GPU_CASES, EMU_CASES))
def test_cuda_matches_reference(backend, dtype, dh, T, mode, lens, L, H_kv):
    dev = DEVICE[backend]
    S = 1 if mode == "paper" else T
    ins = make_inputs(2, 4, H_kv, T, dh, S, L, dtype, device=dev)
    lt = None if lens is None else torch.tensor(lens, device=dev)
    grad = torch.randn(2, 4, T, dh, dtype=torch.float64, device=dev)
    with wiola_kernels.use_backend(backend):
        out = wiola_kernels.gcla_attention(*ins, lengths=lt)
        grads = torch.autograd.grad(out, ins, grad.to(dtype))
    ins64 = [x.detach().double().requires_grad_() for x in ins]
    ref = gcla_attention_forward(*ins64, lt)[0]
    ref_grads = torch.autograd.grad(ref, ins64, grad)
    tol = tolerance(dtype, "attention")
    floor = 0.25 if dtype == torch.float32 else 1.0
    close(out, ref, tol, "out")
    for name, g, rg in zip(NAMES, grads, ref_grads):
        close(g, rg, tol, f"grad {name}", floor)
    if lt is not None:
        for b, n in enumerate(lens):
            assert (out[b, :, n:] == 0).all()


@pytest.mark.parametrize("backend", TARGETS)
def test_cuda_lse_and_determinism(backend):
    dev = DEVICE[backend]
    H, T, n = (4, 70, 33) if backend == EMULATED else (8, 200, 77)
    ins = make_inputs(2, H, 2, T, 64, 1, 2, torch.bfloat16, device=dev)
    lt = torch.tensor([T, n], device=dev)
    with wiola_kernels.use_backend(backend):
        _, lse = gcla_attention_op(*[x.detach() for x in ins], lt)
        _, ref = gcla_attention_forward(*[x.detach().double() for x in ins], lt)
        assert lse.dtype == torch.float32
        torch.testing.assert_close(lse.double(), ref, rtol=0, atol=2e-2)
        g = torch.randn(2, H, T, 64, device=dev, dtype=torch.bfloat16)
        out = wiola_kernels.gcla_attention(*ins, lengths=lt)
        g1 = torch.autograd.grad(out, ins, g, retain_graph=True)
        g2 = torch.autograd.grad(out, ins, g)
    for name, a, b in zip(NAMES, g1, g2):
        assert torch.equal(a, b), f"grad {name} not bitwise reproducible"


@pytest.mark.parametrize("backend", TARGETS)
def test_cuda_float64_and_odd_head_dim_use_reference(backend):
    ins = make_inputs(1, 2, 1, 5, 8, 1, 1, torch.float64, device=DEVICE[backend])
    with wiola_kernels.use_backend(backend):
        assert torch.autograd.gradcheck(lambda *a: wiola_kernels.gcla_attention(*a), ins, fast_mode=True)


@pytest.mark.parametrize("backend", TARGETS)
def test_cuda_kernel_rejects_unsupported_head_dim(backend):
    ins = [x.detach().float() for x in make_inputs(1, 2, 1, 5, 32, 1, 1, torch.float32, device=DEVICE[backend])]
    with pytest.raises(ValueError, match="d_h in"):
        raw_ops(backend)._gcla_attention_fwd(*ins, None)


@pytest.mark.parametrize("backend", TARGETS)
@pytest.mark.parametrize("where", ["v", "k_rot", "q_rot", "grad_out"])
def test_cuda_nonfinite_stays_causal(backend, where):
    """A NaN at position 40 reaches only the rows/keys that attend to it: outputs and dq of rows
    < 40 stay finite for a NaN key/value, dk/dv of keys > 40 for a NaN query row or gradient
    (T = 80 spans tiles, so a kernel multiplying masked zeros by a whole tile would fail)."""
    dev = DEVICE[backend]
    ins = [x.detach() for x in make_inputs(1, 4, 2, 80, 64, 1, 2, torch.float32, device=dev)]
    grad = torch.randn(1, 4, 80, 64, device=dev)
    index = {"v": 2, "k_rot": 1, "q_rot": 0}.get(where)
    if index is None:
        grad[0, 1, 40, 3] = float("nan")
    else:
        ins[index][0, 1, 40, 3] = float("nan")
    ins = [x.requires_grad_() for x in ins]
    with wiola_kernels.use_backend(backend):
        out = wiola_kernels.gcla_attention(*ins)
        grads = torch.autograd.grad(out, ins, grad)
    if where in ("v", "k_rot"):
        assert torch.isfinite(out[0, :, :40]).all() and torch.isfinite(grads[0][0, :, :40]).all()
        assert not torch.isfinite(out[0, :, 40:]).all()
    else:
        assert torch.isfinite(grads[1][0, :, 41:]).all() and torch.isfinite(grads[2][0, :, 41:]).all()
