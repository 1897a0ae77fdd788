"""The batch-1 decoding GEMV (wiola_kernels/decode_gemv.py, csrc/cpu/decode_gemv.cpp) against
float64 ``x @ Wᵀ``, on every instruction-set path this CPU runs, for float32, bfloat16 and
float16 weights, at shapes that are not multiples of any vector width; and the CPU kernels'
shared instruction-set choice (csrc/cpu/isa.h)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import _extension
from wiola_kernels.decode import gemv as dg
from wiola_kernels.testing import assert_close_rel, available_cpu_isas, cpu_isa, fake_cpu, tolerance

pytestmark = [pytest.mark.skipif(not dg.available(), reason="needs the C++ extension"),
              pytest.mark.usefixtures("one_thread")]

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
ISAS = available_cpu_isas("decode_gemv")  # generic, avx2 and avx512 where the CPU has AVX-512


def randn(g, *shape, dtype=F32):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def oracle(x, *weights):
    """float64 ``[x W_0ᵀ | x W_1ᵀ …]`` of the tensors' own values (a bf16 weight is exact in float64)."""
    return torch.cat([x.double() @ w.double().t() for w in weights], -1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", [F32, BF16, F16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 11, 16])  # each register block (≤ 4 rows), and several
@pytest.mark.parametrize("n,k", [(1, 1), (33, 17), (100, 64), (31, 1000), (257, 3)])
def test_matches_float64(isa, wdtype, rows, n, k):
    # n odd or one row; k odd, below one chunk, or not a multiple of 8/16/32. float32
    # activations: the weights' values are exact, so float32 accumulation is all the error.
    g = torch.Generator().manual_seed(1000 * rows + 7 * n + k)
    w, x = randn(g, n, k, dtype=wdtype), randn(g, rows, k)
    with cpu_isa(isa):
        y = dg.gemv(x, w)
    assert y.shape == (rows, n) and y.dtype == F32
    assert torch.isfinite(y).all()  # every element written over the poisoned output (conftest)
    assert_close_rel(y, oracle(x, w), tolerance(F32), f"{isa} {wdtype} rows {rows} n {n} k {k}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", [F32, BF16, F16])
def test_model_shapes_and_activation_dtypes(isa, wdtype):
    # A decoding step's shapes (the (d, 2n+2w) up projections, the (w, d) down projection),
    # activations in the weights' dtype as in a bf16/fp16 model: the output is rounded once
    # to that dtype (SPEC §9 tolerance of the dtype).
    g = torch.Generator().manual_seed(3)
    for n, k, rows in ((2560 + 5, 1024, 1), (512, 4096 + 3, 3)):
        w, x = randn(g, n, k, dtype=wdtype), randn(g, rows, k, dtype=wdtype)
        with cpu_isa(isa):
            y = dg.gemv(x, w)
        assert y.dtype == wdtype
        assert_close_rel(y, oracle(x, w), tolerance(wdtype), f"{isa} {wdtype} {n}x{k}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", [F32, BF16])
def test_several_weights_in_one_call(isa, wdtype):
    g = torch.Generator().manual_seed(4)
    ws = [randn(g, n, 70, dtype=wdtype) for n in (64, 9, 33)]
    x = randn(g, 2, 70)
    with cpu_isa(isa):
        y = dg.gemv(x, ws)                                              # every weight reads x
        assert_close_rel(y, oracle(x, *ws), tolerance(F32), f"{isa} shared")
        parts = [randn(g, 40, k, dtype=wdtype) for k in (50, 21)]
        xs = randn(g, 3, 71)
        y = dg.gemv(xs, parts, split_input=True)                        # weight i reads its own columns
        ref = torch.cat([xs[:, :50].double() @ parts[0].double().t(), xs[:, 50:].double() @ parts[1].double().t()], -1)
        assert_close_rel(y, ref, tolerance(F32), f"{isa} split")


def test_strided_inputs_and_weight_views():
    g = torch.Generator().manual_seed(5)
    w = randn(g, 45, 20, dtype=BF16)
    x = randn(g, 2, 3, 40)[..., ::2]                       # last dim strided: copied
    assert_close_rel(dg.gemv(x, w), oracle(x, w), tolerance(F32), "strided last dim")
    x = randn(g, 6, 20)[::2]                               # rows strided: read in place
    assert_close_rel(dg.gemv(x, w), oracle(x, w), tolerance(F32), "strided rows")
    x = randn(g, 20)                                       # one row, no leading dims
    assert dg.gemv(x, w).shape == (45,)
    wide = randn(g, 45, 37, dtype=F16)
    view = wide[:, 3:23]                                   # rows 37 apart: read in place
    x = randn(g, 4, 20)
    assert_close_rel(dg.gemv(x, view), oracle(x, view), tolerance(F32), "weight view")
    heads = randn(g, 4, 9, 20).transpose(0, 1)             # (9, 4, 20): per-head weights of a view
    assert_close_rel(dg.gemv(x, [heads[:, 1], heads[:, 3]]), oracle(x, heads[:, 1], heads[:, 3]), tolerance(F32),
                     "per-head views")


@pytest.mark.parametrize("isa", ISAS)
# weight rows are read as concurrent streams, grouped by the split: 4 with 1–3 rows of x, 2 with
# 4 rows of 16-bit weights, and 6 rows are a block of 4 and one of 2 against the same group
@pytest.mark.parametrize("xrows", [1, 2, 3, 4, 6])
def test_threads_do_not_change_the_result(isa, xrows):
    # Each output is one thread's sum in a fixed order: bitwise the same on 1 and 2 threads
    # (the split moves which weight rows are read side by side; 701 and 301 rows leave remainders).
    g = torch.Generator().manual_seed(6)
    for dtype in (F32, BF16, F16):
        ws, x = [randn(g, 701, 300, dtype=dtype), randn(g, 301, 300, dtype=dtype)], randn(g, xrows, 300)
        with cpu_isa(isa):
            one = dg.gemv(x, ws)
            torch.set_num_threads(2)
            try:
                two = dg.gemv(x, ws)
            finally:
                torch.set_num_threads(1)
        assert torch.equal(one, two), (isa, dtype)
        assert_close_rel(one, oracle(x, *ws), tolerance(F32), f"{isa} {dtype}")


def test_reads_the_weight_in_place():
    # No copy: a change to the weight is seen by the next call.
    g = torch.Generator().manual_seed(9)
    w, x = randn(g, 40, 30, dtype=BF16), randn(g, 1, 30)
    before = dg.gemv(x, w)
    w[7].mul_(-2)
    after = dg.gemv(x, w)
    assert_close_rel(after, oracle(x, w), tolerance(F32), "after the change")
    assert torch.equal(before[:, :7], after[:, :7]) and not torch.equal(before[:, 7], after[:, 7])


def test_bad_input():
    g = torch.Generator().manual_seed(8)
    w = randn(g, 10, 6)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        dg.gemv(torch.ones(1, 6, dtype=torch.float64), w)
    with pytest.raises(TypeError, match="weight must be float32, bfloat16 or float16"):
        dg.gemv(torch.ones(1, 6), w.double())
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        dg.gemv(torch.ones(1, 6), "w")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        dg.gemv([1.0] * 6, w)
    with pytest.raises(TypeError, match="share one dtype"):
        dg.gemv(torch.ones(1, 6), [w, w.bfloat16()])
    with pytest.raises(TypeError, match=r"weights\[1\] must be float32"):
        dg.gemv(torch.ones(1, 6), [w, w.int()])
    with pytest.raises(ValueError, match=r"k = 6"):
        dg.gemv(torch.ones(1, 7), w)
    with pytest.raises(ValueError, match=r"Σ k_i = 12"):
        dg.gemv(torch.ones(1, 7), [w, w], split_input=True)
    with pytest.raises(ValueError, match="rows"):
        dg.gemv(torch.ones(17, 6), w)
    with pytest.raises(ValueError, match="CPU"):
        dg.gemv(torch.ones(1, 6, device="meta"), w)
    with pytest.raises(ValueError, match="CPU"):
        dg.gemv(torch.ones(1, 6), w.to("meta"))
    with pytest.raises(ValueError, match="weight must have shape"):
        dg.gemv(torch.ones(1, 6), torch.ones(6))
    with pytest.raises(ValueError, match="weight must have shape"):
        dg.gemv(torch.ones(1, 3), torch.ones(3, 0))
    with pytest.raises(ValueError, match="k >= 1"):
        dg.gemv(torch.ones(1, 0), w)
    with pytest.raises(ValueError, match="contiguous rows"):
        dg.gemv(torch.ones(1, 10), w.t())
    with pytest.raises(ValueError, match=r"k = 6\) to match every"):
        dg.gemv(torch.ones(1, 6), [w, torch.ones(3, 5)])


# ---- the shared instruction-set level (csrc/cpu/isa.h) ------------------------------------------

LEVELS = _extension.cpu_isa_levels()


def test_each_kernel_takes_the_highest_path_it_has_at_or_below_the_level():
    # The pure decision, over every (implemented, chosen) pair the kernels have.
    choose = _extension._load()[0]._choose_isa
    table = _extension.cpu_kernel_isas()
    gemv, norm = table["decode_gemv"], table["rms_norm"]
    assert [choose(list(gemv), c) for c in LEVELS] == ["generic", "avx2", "avx512", "avx512"]
    assert [choose(list(norm), c) for c in LEVELS] == ["avx2", "avx2", "avx2", "avx512_bf16"]
    assert table["glu"] == table["add_rms_norm"] == table["linear_cross_entropy"] == norm
    assert LEVELS == ("generic", "avx2", "avx512", "avx512_bf16")
    with pytest.raises(ValueError, match="chosen must be one of"):
        choose(["avx2"], "avx1024")


def test_avx512_without_bf16_runs_the_avx512_gemv_and_the_avx2_norm():
    # A Skylake-SP / Cascade Lake / Ice Lake CPU: AVX-512 F/BW/VL/DQ, no BF16. The probe is
    # capped (it can only lower what runs), so on a CPU without AVX-512 the cap changes nothing.
    best = wk.cpu_isa()
    with fake_cpu("avx512"):
        if LEVELS.index(_extension.cpu_best_isa()) < LEVELS.index("avx512"):
            assert wk.kernel_isa("decode_gemv") == _extension.cpu_best_isa()  # the decision is tested above
            return
        assert wk.cpu_isa() == "avx512" and _extension.cpu_best_isa() == "avx512"
        assert wk.kernel_isa("decode_gemv") == "avx512"
        assert [wk.kernel_isa(k) for k in ("rms_norm", "add_rms_norm", "glu", "linear_cross_entropy")] == ["avx2"] * 4
        with pytest.raises(ValueError, match="no avx512_bf16"):
            wk.set_cpu_isa("avx512_bf16")
        g = torch.Generator().manual_seed(10)
        w, x = randn(g, 70, 45, dtype=BF16), randn(g, 2, 45)
        assert_close_rel(dg.gemv(x, w), oracle(x, w), tolerance(F32), "avx512 gemv")
        xb = randn(g, 3, 64, dtype=BF16)
        with wk.use_backend("cpu"):
            y = wk.rms_norm(xb, torch.ones(64), None, 1e-6)
        ref = xb.double() * torch.rsqrt(xb.double().pow(2).mean(-1, keepdim=True) + 1e-6)
        assert_close_rel(y, ref, tolerance(BF16), "rms_norm on its avx2 path")
    assert wk.cpu_isa() == best and _extension.cpu_best_isa() == available_cpu_isas()[-1]


def test_the_level_names_and_the_old_ones():
    before = wk.cpu_isa()
    try:
        assert wk.set_cpu_isa("avx2") == before and wk.kernel_isa("decode_gemv") == "avx2"
        assert wk.set_cpu_isa("generic") == "avx2" and wk.kernel_isa("decode_gemv") == "generic"
        assert wk.kernel_isa("rms_norm") == "avx2"  # its lowest path
        assert wk.set_cpu_isa("auto") == "generic" and wk.cpu_isa() == available_cpu_isas()[-1]
        if "avx512" in available_cpu_isas():
            wk.set_cpu_isa("avx512")
            assert wk.kernel_isa("decode_gemv") == "avx512"
    finally:
        wk.set_cpu_isa(before)
    with pytest.raises(ValueError, match="isa must be one of"):
        wk.set_cpu_isa("sse2")
    with pytest.raises(ValueError, match="kernel must be one of"):
        wk.kernel_isa("matmul")


def test_environment_variable_chooses_the_level():
    level = "avx512" if "avx512" in available_cpu_isas() else "avx2"
    code = ("import wiola_kernels as wk; print(wk.cpu_isa(), wk.kernel_isa('decode_gemv'), "
            "wk.kernel_isa('rms_norm'), wk.kernel_isa('glu'))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "WIOLA_CPU_ISA": level},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == [level, level, "avx2", "avx2"]
