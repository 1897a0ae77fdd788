"""GPU tests of the Triton kernels (RMSNorm, SRPE), determinism of every GPU backward,
and small all-ops runs that scripts/gpu_check.sh repeats under compute-sanitizer.
Skipped without a CUDA device, except the CUDA-kernel run, which also runs on ``cuda_emu``
(the kernels on CPU tensors in the SIMT emulator); GCLA/ATM CUDA kernels have their own
*_cuda.py files."""

from __future__ import annotations

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import reference
from wiola_kernels.testing import assert_close_rel, tolerance

from cuda_targets import DEVICE, targets

GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def gpu_only(fn):
    for mark in GPU_ONLY:
        fn = mark(fn)
    return fn


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward([o for o in outs if o.requires_grad],
                            [g for o, g in zip(outs, grad_out) if o.requires_grad])
    return [o.detach() for o in outs], [t.grad for t in leaves if t.is_floating_point()]


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3), (37, 192), (4, 33, 760), (1151, 4096), (2, 8193)])
def test_rms_norm_triton_vs_float64(shape, dtype):
    d = shape[-1]
    x = torch.randn(shape, dtype=torch.float64)
    w, s = torch.rand(d, dtype=torch.float64) + 0.5, 0.3 * torch.randn(d, dtype=torch.float64)
    g = torch.randn(shape, dtype=torch.float64)
    with wk.use_backend("triton"):
        outs, grads = _grads(wk.rms_norm, [t.to(DEV, dtype) for t in (x, w, s)], [g.to(DEV, dtype)])
    ref_outs, ref_grads = _grads(reference.rms_norm, [x, w, s], [g])
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert_close_rel(got.cpu(), want, tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, h, h_kv, t, dh", [(1, 1, 1, 1, 64), (3, 16, 4, 257, 64), (2, 8, 8, 100, 128),
                                               (1, 4, 2, 33, 10)])
@gpu_only
def test_srpe_triton_vs_float64(b, h, h_kv, t, dh, dtype):
    q, k = torch.randn(b, h, t, dh, dtype=torch.float64), torch.randn(b, h_kv, t, dh, dtype=torch.float64)
    pos = torch.randint(0, 2**20, (b, t))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    with wk.use_backend("triton"):
        outs, grads = _grads(lambda a, c: wk.srpe(a, c, pos.to(DEV)), [q.to(DEV, dtype), k.to(DEV, dtype)],
                             [gq.to(DEV, dtype), gk.to(DEV, dtype)])
    ref_outs, ref_grads = _grads(lambda a, c: reference.srpe(a, c, pos), [q, k], [gq, gk])
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert_close_rel(got.cpu(), want, tolerance(dtype))
@gpu_only
def test_gpu_backwards_are_bitwise_reproducible():
    x = torch.randn(4097, 1024, device=DEV)
    w, s = torch.rand(1024, device=DEV) + 0.5, torch.randn(1024, device=DEV)
    g = torch.randn_like(x)
    runs = [_grads(wk.rms_norm, [x, w, s], [g])[1] for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
@gpu_only
def test_sanitizer_all_gpu_ops():
    """Small shapes of every GPU kernel, forward and backward (run under compute-sanitizer
    by scripts/gpu_check.sh); also checked against the reference so it can fail."""
    x = torch.randn(5, 33, device=DEV)
    w, s = torch.rand(33, device=DEV) + 0.5, torch.randn(33, device=DEV)
    with wk.use_backend("triton"):
        outs, _ = _grads(wk.rms_norm, [x, w, s], [torch.randn_like(x)])
    assert_close_rel(outs[0].cpu(), reference.rms_norm(x.cpu().double(), w.cpu().double(), s.cpu().double()), 1e-5)
    q, k = torch.randn(2, 4, 7, 16, device=DEV), torch.randn(2, 2, 7, 16, device=DEV)
    pos = torch.arange(7, device=DEV)
    with wk.use_backend("triton"):
        outs, _ = _grads(lambda a, c: wk.srpe(a, c, pos), [q, k], [torch.randn_like(q), torch.randn_like(k)])
    assert_close_rel(outs[0].cpu(), reference.srpe(q.cpu().double(), k.cpu().double(), pos.cpu())[0], 1e-5)


@pytest.mark.parametrize("backend", targets())
def test_sanitizer_cuda_kernels(backend):
    """Small shapes of the CUDA kernels (GCLA, ATM), forward and backward, against the
    reference: on the GPU under compute-sanitizer (scripts/gpu_check.sh), and emulated."""
    DEV = DEVICE[backend]  # noqa: N806 - the same body serves both targets
    if hasattr(wk, "gcla_attention"):
        b, h, h_kv, t, dh, lam = 2, 4, 2, 19, 64, 2
        qr, q0 = torch.randn(b, h, t, dh, device=DEV), torch.randn(b, h, t, dh, device=DEV)
        kr, v = torch.randn(b, h_kv, t, dh, device=DEV), torch.randn(b, h_kv, t, dh, device=DEV)
        kc, vc = torch.randn(b, h, t, lam, dh, device=DEV), torch.randn(b, h, t, lam, dh, device=DEV)
        gate = torch.randn(h, device=DEV)
        lengths = torch.tensor([t, t - 5], device=DEV)
        args = [qr, kr, v, q0, kc, vc, gate]
        with wk.use_backend(backend):
            outs, grads = _grads(lambda *a: wk.gcla_attention(*a, lengths=lengths), args, [torch.randn_like(qr)])
        assert all(torch.isfinite(g).all() for g in grads)
        with wk.use_backend("reference"):
            want = wk.gcla_attention(*[a.double() for a in args], lengths=lengths)
        assert_close_rel(outs[0].cpu(), want.cpu(), 1e-4)
    if hasattr(wk, "atm_merge"):
        xa = torch.randn(3, 21, 48, device=DEV)
        xa[:, 5] = xa[:, 4] + 1e-3  # a planted near-duplicate pair
        with wk.use_backend(backend):
            merged, mpos, mlen, imap = wk.atm_merge(xa, torch.arange(21, device=DEV).expand(3, 21), 0.9)
        with wk.use_backend("reference"):
            ref = wk.atm_merge(xa.cpu().double(), torch.arange(21).expand(3, 21), 0.9)
        assert torch.equal(imap.cpu(), ref[3]) and torch.equal(mlen.cpu(), ref[2])
        assert_close_rel(merged.cpu(), ref[0], 1e-5)
        with wk.use_backend(backend):
            restored = wk.atm_unmerge(merged, imap)
        assert restored.shape == xa.shape
