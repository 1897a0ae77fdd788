"""The batch-1 decoding GEMV (wiola_kernels/decode_gemv.py, csrc/cpu/decode_gemv.cpp; issue 12 §3)
against float64 ``x @ Wᵀ``, on every instruction-set path this CPU runs (CI's has AVX-512, so
both the AVX-512 and the AVX2 paths run there), at shapes that are not multiples of the panel."""

from __future__ import annotations

import pytest
import torch

from wiola_kernels import decode_gemv as dg
from wiola_kernels.testing import assert_close_rel, tolerance

pytestmark = [pytest.mark.skipif(not dg.available(), reason="needs the C++ extension"),
              pytest.mark.usefixtures("one_thread")]

ISAS = ["avx512", "avx2", "generic"]
F32 = torch.float32


def randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(F32)


def oracle(x, w):
    """float64 ``x @ wᵀ`` (per group for a (G, n, k) ``w``)."""
    return x.double() @ w.double().transpose(-1, -2)


def need(isa):
    if isa not in dg.available_isas():
        pytest.skip(f"this CPU/build has no {isa} path")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [*range(1, 9), 11, 16])
@pytest.mark.parametrize("n,k", [(1, 1), (33, 17), (100, 64), (31, 1000), (160, 15), (257, 3)])
def test_matches_float64(isa, rows, n, k):
    # n: not a multiple of the panel (one partial panel, or only one); k: odd, not a multiple of 16.
    need(isa)
    g = torch.Generator().manual_seed(1000 * rows + 7 * n + k)
    w, x = randn(g, n, k), randn(g, rows, k)
    y = dg.gemv(x, dg.pack(w), isa=isa)
    assert y.shape == (rows, n) and y.dtype == F32
    assert torch.isfinite(y).all()  # every element written over the poisoned output (conftest)
    assert_close_rel(y, oracle(x, w), tolerance(F32), f"{isa} rows {rows} n {n} k {k}")


@pytest.mark.parametrize("isa", ISAS)
def test_wide_and_deep_shapes_of_the_model(isa):
    # The decoding step's shapes: (d, 2n+2w) up projections and the (w, d) down projection.
    need(isa)
    g = torch.Generator().manual_seed(3)
    for n, k in ((10240 + 5, 1024), (1024, 4096 + 3)):
        w, x = randn(g, n, k), randn(g, 1, k)
        assert_close_rel(dg.gemv(x, dg.pack(w), isa=isa), oracle(x, w), tolerance(F32), f"{isa} {n}x{k}")


@pytest.mark.parametrize("isa", ISAS)
def test_grouped_weights_each_read_their_own_rows(isa):
    need(isa)
    g = torch.Generator().manual_seed(4)
    for groups, rows, n, k in ((3, 1, 70, 9), (16, 2, 64, 64), (5, 8, 1, 33)):
        w, x = randn(g, groups, n, k), randn(g, groups, rows, k)
        y = dg.gemv(x, dg.pack(w), isa=isa)
        assert y.shape == (groups, rows, n)
        assert_close_rel(y, oracle(x, w), tolerance(F32), f"{isa} G {groups}")


def test_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(5)
    w = randn(g, 45, 20)
    packed = dg.pack(w)
    x = randn(g, 2, 3, 40)[..., ::2]                       # last dim strided: copied
    assert_close_rel(dg.gemv(x, packed), oracle(x, w), tolerance(F32), "strided last dim")
    x = randn(g, 6, 20)[::2]                               # rows strided: read in place
    assert_close_rel(dg.gemv(x, packed), oracle(x, w), tolerance(F32), "strided rows")
    x = randn(g, 20)                                       # one row, no leading dims
    assert dg.gemv(x, packed).shape == (45,)
    xg = randn(g, 2, 4, 20).transpose(0, 1)                # grouped x as a transposed view
    wg = randn(g, 4, 9, 20)
    assert_close_rel(dg.gemv(xg, dg.pack(wg)), oracle(xg, wg), tolerance(F32), "grouped view")


def test_threads_do_not_change_the_result():
    # Each output is one thread's sum in k order: bitwise the same on 1 and 2 threads.
    g = torch.Generator().manual_seed(6)
    w, x = randn(g, 1000, 300), randn(g, 3, 300)
    packed = dg.pack(w)
    one = dg.gemv(x, packed)
    torch.set_num_threads(2)
    try:
        two = dg.gemv(x, packed)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)


def test_environment_forces_the_path(monkeypatch):
    g = torch.Generator().manual_seed(7)
    w, x = randn(g, 50, 70), randn(g, 2, 70)
    packed = dg.pack(w)
    for isa in dg.available_isas():
        monkeypatch.setenv("WIOLA_GEMV_ISA", isa)
        assert torch.equal(dg.gemv(x, packed), dg.gemv(x, packed, isa=isa))
    monkeypatch.setenv("WIOLA_GEMV_ISA", "sse9")
    with pytest.raises(ValueError, match="isa"):
        dg.gemv(x, packed)


def test_pack_layout():
    # data[g, p, kk, c] = W[p·32 + c, kk], zeros past n.
    w = torch.arange(35 * 3, dtype=F32).view(35, 3)
    p = dg.pack(w)
    assert p.data.shape == (1, 2, 3, dg.PANEL) and (p.n, p.k, p.groups) == (35, 3, 1)
    assert torch.equal(p.data[0, 1, 2, :3], w[32:35, 2]) and not p.data[0, 1, :, 3:].any()
    assert torch.equal(p.data[0, 0, 1], w[:32, 1])


def test_bad_input():
    g = torch.Generator().manual_seed(8)
    w = randn(g, 10, 6)
    packed = dg.pack(w)
    with pytest.raises(TypeError, match="x must be float32"):
        dg.gemv(torch.ones(1, 6, dtype=torch.float64), packed)
    with pytest.raises(TypeError, match="packed"):
        dg.gemv(torch.ones(1, 6), w)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        dg.gemv([1.0] * 6, packed)
    with pytest.raises(ValueError, match=r"k = 6"):
        dg.gemv(torch.ones(1, 7), packed)
    with pytest.raises(ValueError, match="rows"):
        dg.gemv(torch.ones(17, 6), packed)
    with pytest.raises(ValueError, match="CPU"):
        dg.gemv(torch.ones(1, 6, device="meta"), packed)
    with pytest.raises(ValueError, match="isa"):
        dg.gemv(torch.ones(1, 6), packed, isa="sse")
    with pytest.raises(TypeError, match="weight must be float32"):
        dg.pack(w.double())
    with pytest.raises(ValueError, match="weight must have shape"):
        dg.pack(torch.ones(6))
    with pytest.raises(ValueError, match="weight must have shape"):
        dg.pack(torch.ones(0, 6))
    grouped = dg.pack(randn(g, 3, 10, 6))
    with pytest.raises(ValueError, match=r"G = 3"):
        dg.gemv(torch.ones(2, 1, 6), grouped)
    # the raw kernel checks its own arguments too
    with pytest.raises(ValueError, match="n must satisfy"):
        torch.ops.wiola._decode_gemv(torch.ones(1, 1, 6), packed.data, 40, "auto")
    with pytest.raises(ValueError, match="packed must be"):
        torch.ops.wiola._decode_gemv(torch.ones(1, 1, 6), packed.data[..., :16], 10, "auto")
