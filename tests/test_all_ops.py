"""Tests about every op at once, not about one op (each op's own tests live in
tests/test_<op>.py): every op has a reference and a C++ CPU backend, one compiled graph
through all of them, concurrent calls from Python threads, and the small all-ops GPU runs
that scripts/gpu_check.sh repeats under compute-sanitizer. The op list comes from the
dispatch registry, never from a list written here."""

from __future__ import annotations

import pytest
import torch

import wiola_kernels as wk
from cuda_targets import DEVICE, targets
from helpers import forward_backward, gpu_only
from oracles import rel
from wiola_kernels import reference
from wiola_kernels.testing import assert_close_rel, available_backends, rel_err, tolerance

DEV = "cuda"  # the GPU-only test below
CPU_BACKENDS = [b for b in available_backends("rms_norm", "cpu") if b in ("cpu", "reference")]


def test_cpu_backends_present():
    # The project ships a reference and a C++ CPU backend for every registered op.
    table = wk.backends("cpu")
    assert table, "no op is registered"
    for op, states in table.items():
        assert {"reference", "cpu"} <= {name for name, state in states.items() if state == "available"}, op


def test_compile_dynamic_shapes_all_ops():
    # One compiled function over every op, with dynamic shapes and autograd (aot_eager keeps
    # this test fast; inductor was checked by hand and agrees).
    def f(x, w, s, q, k, kc, g, pos, ln):
        y = wk.rms_norm(x, w, s, eps=1e-6)
        qr, kr = wk.srpe(q, k, pos)
        o = wk.gcla_attention(qr, kr, k, q, kc, kc, g, ln)
        m, _, _, imap = wk.atm_merge(y, pos, 0.5)
        return y.sum() + o.sum() + wk.atm_unmerge(m * 2, imap).sum()

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (3, 5):
        ins = [torch.randn(2, T, 16), torch.randn(16), torch.randn(16), torch.randn(2, 2, T, 4),
               torch.randn(2, 1, T, 4), torch.randn(2, 2, T, 2, 4), torch.zeros(2)]
        a = [t.clone().requires_grad_() for t in ins]
        b = [t.clone().requires_grad_() for t in ins]
        extra = (torch.arange(T), torch.tensor([T, T - 1]))
        ra, rb = cf(*a, *extra), f(*b, *extra)
        ra.backward()
        rb.backward()
        assert abs(ra.item() - rb.item()) <= tolerance(torch.float32, "attention") * max(1.0, abs(rb.item()))
        for ta, tb in zip(a, b):
            assert rel(ta.grad, tb.grad) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ops_are_thread_safe(backend):
    """Several Python threads calling every op at once on different tensors get correct
    results (the extension holds no global mutable state)."""
    from concurrent.futures import ThreadPoolExecutor

    def job(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 200, generator=g)
        w, s = torch.rand(200, generator=g) + 0.5, torch.randn(200, generator=g)
        q, k = torch.randn(2, 4, 33, 16, generator=g), torch.randn(2, 2, 33, 16, generator=g)
        pos = torch.randint(0, 10**5, (2, 33), generator=g)
        qr, q0 = torch.randn(1, 4, 40, 16, generator=g), torch.randn(1, 4, 40, 16, generator=g)
        kr, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
        kc, vc = torch.randn(1, 4, 40, 2, 16, generator=g), torch.randn(1, 4, 40, 2, 16, generator=g)
        gate, lengths = torch.randn(4, generator=g), torch.tensor([31])
        xa = torch.randn(2, 50, 24, generator=g)
        xa[:, 1::3] = xa[:, ::3][:, : xa[:, 1::3].shape[1]]  # planted duplicates: some pairs merge
        with wk.use_backend(backend):
            y = wk.rms_norm(x, w, s)
            qo, ko = wk.srpe(q, k, pos)
            attn = wk.gcla_attention(qr, kr, v, q0, kc, vc, gate, lengths)
            merged, _, mlen, imap = wk.atm_merge(xa, torch.arange(50), 0.9)
        with wk.use_backend("reference"):
            attn_ref = wk.gcla_attention(*(t.double() for t in (qr, kr, v, q0, kc, vc, gate)), lengths)
            merged_ref, _, mlen_ref, imap_ref = wk.atm_merge(xa.double(), torch.arange(50), 0.9)
        assert torch.equal(imap, imap_ref) and torch.equal(mlen, mlen_ref) and int(mlen.sum()) < 100
        return (rel_err(y, reference.rms_norm(x.double(), w.double(), s.double())),
                rel_err(qo, reference.srpe(q.double(), k.double(), pos)[0]),
                rel_err(attn, attn_ref) / 10,  # attention's tolerance is 1e-4
                rel_err(merged, merged_ref))

    with ThreadPoolExecutor(max_workers=4) as pool:
        errors = list(pool.map(job, range(16)))
    assert all(e <= tolerance(torch.float32) for errs in errors for e in errs), errors


@gpu_only
def test_sanitizer_all_gpu_ops():
    """Small shapes of every GPU kernel, forward and backward (run under compute-sanitizer
    by scripts/gpu_check.sh); also checked against the reference so it can fail."""
    x = torch.randn(5, 33, device=DEV)
    w, s = torch.rand(33, device=DEV) + 0.5, torch.randn(33, device=DEV)
    with wk.use_backend("triton"):
        outs, _ = forward_backward(wk.rms_norm, [x, w, s], [torch.randn_like(x)])
    want = reference.rms_norm(x.cpu().double(), w.cpu().double(), s.cpu().double())
    assert_close_rel(outs[0].cpu(), want, tolerance(torch.float32))
    q, k = torch.randn(2, 4, 7, 16, device=DEV), torch.randn(2, 2, 7, 16, device=DEV)
    pos = torch.arange(7, device=DEV)
    with wk.use_backend("triton"):
        outs, _ = forward_backward(lambda a, c: wk.srpe(a, c, pos), [q, k], [torch.randn_like(q), torch.randn_like(k)])
    want = reference.srpe(q.cpu().double(), k.cpu().double(), pos.cpu())[0]
    assert_close_rel(outs[0].cpu(), want, tolerance(torch.float32))


@pytest.mark.parametrize("backend", targets())
def test_sanitizer_cuda_kernels(backend):
    """Small shapes of every CUDA kernel (GCLA: the summary forward and backward with S = T and
    with S = 1, whose backward adds context_sum_kernel, dgate_kernel; float32 d_h 64 and bf16
    d_h 128. ATM: the merge's norms_and_dots, select and gather_average kernels, its backward,
    unmerge and its backward), forward and backward, against the reference: on the GPU under
    compute-sanitizer (scripts/gpu_check.sh), and emulated."""
    DEV = DEVICE[backend]  # noqa: N806 - the same body serves both targets
    if hasattr(wk, "gcla_attention"):
        b, h, h_kv, t = 2, 4, 2, 19
        lengths = torch.tensor([t, t - 5], device=DEV)
        for dh, s, lam, dtype in ((64, t, 2, torch.float32), (128, 1, 2, torch.bfloat16)):
            qr, q0 = torch.randn(b, h, t, dh, device=DEV), torch.randn(b, h, t, dh, device=DEV)
            kr, v = torch.randn(b, h_kv, t, dh, device=DEV), torch.randn(b, h_kv, t, dh, device=DEV)
            kc, vc = torch.randn(b, h, s, lam, dh, device=DEV), torch.randn(b, h, s, lam, dh, device=DEV)
            gate = torch.randn(h, device=DEV)
            args = [qr, kr, v, q0, kc, vc, gate]
            with wk.use_backend(backend):
                outs, grads = forward_backward(lambda *a: wk.gcla_attention(*a, lengths=lengths),
                                               [a.to(dtype) if a is not gate else a for a in args],
                                               [torch.randn_like(qr).to(dtype)])
            assert all(torch.isfinite(g).all() for g in grads)
            with wk.use_backend("reference"):
                want = wk.gcla_attention(*[a.to(dtype).double() for a in args], lengths=lengths)
            assert_close_rel(outs[0].cpu(), want.cpu(), tolerance(dtype, "attention"))
    if hasattr(wk, "atm_merge"):
        xa = torch.randn(3, 21, 48, device=DEV)
        xa[:, 5] = xa[:, 4] + 1e-3  # a planted near-duplicate pair
        pos = torch.arange(21, device=DEV).expand(3, 21)
        with wk.use_backend(backend):
            (merged, mpos, mlen, imap), (gx,) = forward_backward(lambda x: wk.atm_merge(x, pos, 0.9), [xa],
                                                                 [torch.ones_like(xa), None, None, None])
        with wk.use_backend("reference"):
            ref = wk.atm_merge(xa.cpu().double(), torch.arange(21).expand(3, 21), 0.9)
        assert torch.equal(imap.cpu(), ref[3]) and torch.equal(mlen.cpu(), ref[2])
        assert_close_rel(merged.cpu(), ref[0], tolerance(torch.float32))
        # Tokens per slot (1 or 2; 0 past T'_b): a ones gradient reaches a token as 1 / its slot's count,
        # and the unmerge's backward of a ones gradient is that count.
        counts = torch.zeros(3, 21, dtype=torch.float64).scatter_add_(1, ref[3], torch.ones(3, 21, dtype=torch.float64))
        assert torch.equal(gx.cpu().double(), (1 / counts.gather(1, ref[3])).unsqueeze(-1).expand(3, 21, 48))
        with wk.use_backend(backend):
            (restored,), (gy,) = forward_backward(lambda y: wk.atm_unmerge(y, imap), [merged], [torch.ones_like(xa)])
        assert restored.shape == xa.shape
        assert torch.equal(gy.cpu().double(), counts.unsqueeze(-1).expand(3, 21, 48))
