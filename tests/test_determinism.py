"""Determinism of the C++ CPU kernels (issue 6): every forward and backward is bitwise
reproducible run to run and independent of the thread count (torch.set_num_threads 1
vs 2). Reductions over rows (rms_norm's dweight/dshift, GCLA's dk/dv over heads and
query blocks, dkc/dvc for S = 1, dgate, ATM's unmerge sums) split the work into a fixed
number of chunks, summed in a fixed order, so the bits do not depend on scheduling.

Shapes are large enough that at::parallel_for really splits the work (several GCLA
query/key blocks, many rms_norm rows), and ATM covers both merge paths (B < threads:
phased; B ≥ threads: row-streaming)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels.testing import available_backends

pytestmark = pytest.mark.skipif("cpu" not in available_backends("rms_norm", "cpu"),
                                reason="the C++ extension is not built")


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _run(fn, inputs):
    """``fn`` forward + backward on the cpu backend, for 1 thread twice and 2 threads twice."""
    results = []
    for n in (1, 2, 1, 2):
        ins = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        with threads(n), wk.use_backend("cpu"):
            outs = fn(*ins)
            diff = [x for x in ins if x.requires_grad]
            grads = torch.autograd.grad(outs[0], diff, outs[1], allow_unused=True)
        extras = list(outs[2]) if len(outs) > 2 else []  # outputs compared without a gradient
        results.append([outs[0].detach()] + [g for g in grads if g is not None] + [e.detach() for e in extras])
    return results


def _assert_bitwise(results, names):
    first = results[0]
    for k, res in enumerate(results[1:], 1):
        for name, a, b in zip(names, first, res):
            assert a.dtype == b.dtype and a.shape == b.shape
            # Bitwise, NaN-safe: compare the raw bytes.
            assert torch.equal(_bits(a), _bits(b)), \
                f"{name} differs between run 0 (1 thread) and run {k} ({(1, 2, 1, 2)[k]} threads)"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as an integer tensor (bitwise comparison, NaN-safe)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_bitwise_reproducible(dtype):
    g = _gen(0)
    rows, d = 3001, 320  # many rows: dweight/dshift are reductions across threads' chunks
    x = torch.randn(rows, d, generator=g).to(dtype)
    w, s = (torch.rand(d, generator=g) + 0.5).to(dtype), torch.randn(d, generator=g).to(dtype)
    grad = torch.randn(rows, d, generator=g).to(dtype)

    def fn(x, w, s):
        return wk.rms_norm(x, w, s), grad

    _assert_bitwise(_run(fn, [x, w, s]), ["y", "grad_x", "grad_weight", "grad_shift"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_srpe_bitwise_reproducible(dtype):
    g = _gen(1)
    q, k = torch.randn(2, 4, 300, 64, generator=g).to(dtype), torch.randn(2, 2, 300, 64, generator=g).to(dtype)
    pos = torch.randint(0, 2**20, (2, 300), generator=g)
    gq, gk = torch.randn(2, 4, 300, 64, generator=g).to(dtype), torch.randn(2, 2, 300, 64, generator=g).to(dtype)

    def fn(q, k, pos):
        qo, ko = wk.srpe(q, k, pos)
        # one output for the harness: concatenate along heads (grad split back by autograd)
        return torch.cat([qo, ko], 1), torch.cat([gq, gk], 1)

    _assert_bitwise(_run(fn, [q, k, pos]), ["out", "grad_q", "grad_k"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,lengths", [(1, None), (1, [200, 77]), (200, [131, 200])])
def test_gcla_attention_bitwise_reproducible(dtype, S, lengths):
    g = _gen(2)
    B, H, H_kv, T, dh, L = 2, 4, 2, 200, 24, 3  # 4 query blocks, 2 key blocks
    shapes = [(B, H, T, dh), (B, H_kv, T, dh), (B, H_kv, T, dh), (B, H, T, dh), (B, H, S, L, dh), (B, H, S, L, dh)]
    ins = [torch.randn(*sh, generator=g).to(dtype) for sh in shapes] + [torch.randn(H, generator=g)]
    grad = torch.randn(B, H, T, dh, generator=g).to(dtype)
    lens = None if lengths is None else torch.tensor(lengths)

    def fn(*args):
        return wk.gcla_attention(*args, lengths=lens), grad

    _assert_bitwise(_run(fn, ins), ["out", "q_rot", "k_rot", "v", "q", "kc", "vc", "gate"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3])  # B = 1 < 2 threads: phased path; with 1 thread: streaming path
def test_atm_bitwise_reproducible(dtype, B):
    g = _gen(3)
    T, d = 257, 48
    k = torch.randint(0, 4, (B, T), generator=g)
    x = (torch.nn.functional.one_hot(k, d).float() + 0.05 * torch.randn(B, T, d, generator=g)).to(dtype)
    pos = torch.arange(T).expand(B, T)
    lens = torch.randint(T // 2, T + 1, (B,), generator=g)
    gm = torch.randn(B, T, d, generator=g).to(dtype)
    y = torch.randn(B, T, d, generator=g).to(dtype)
    gr = torch.randn(B, T, d, generator=g).to(dtype)

    def fn(x, y, pos, lens):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, 0.5, lens)
        restored = wk.atm_unmerge(y, imap)
        # merged and restored in one output (one backward through both ops); maps compared as extras
        return torch.cat([merged, restored], 1), torch.cat([gm, gr], 1), (mpos, mlen, imap)

    _assert_bitwise(_run(fn, [x, y, pos, lens]),
                    ["merged|restored", "grad_x", "grad_y", "merged_positions", "merged_lengths", "index_map"])
