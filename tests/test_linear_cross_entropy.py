"""Linear cross-entropy (SPEC §10.1): every backend against the float64 reference, the
reference against a row-by-row oracle and against ``F.cross_entropy``, every argument, the
edges (ignored rows, all rows ignored, N = 1, V not a multiple of any block, chunks),
strided inputs, determinism, gradient accumulation, compile. Forward and backward of every
backend against the oracle in every dtype, and gradcheck, are also tests/test_all_ops.py's;
the bad-input messages are tests/test_op_layer.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import wiola_kernels as wk
from wiola_kernels import reference, shapes
from wiola_kernels.testing import assert_close_rel, available_backends, available_cpu_isas, cpu_isa, tolerance

from helpers import gen, gpu_only, needs_cpu_extension, threads
from op_cases import F64, OpCase, Public, randn64
from oracles import lce_oracle

BACKENDS = available_backends("linear_cross_entropy", "cpu")
PY_BACKENDS = [b for b in BACKENDS if b != "triton"]  # the interpreter is slow: its own tests below
TOL = {dtype: tolerance(dtype, "attention") for dtype in (torch.float32, torch.float64, torch.bfloat16,
                                                        torch.float16)}
OPTIONS = {  # one of each argument, and all of them together
    "plain": {},
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "smoothing": dict(label_smoothing=0.1),
    "softcap": dict(softcap=3.0),
    "z_loss": dict(z_loss=1e-2),
    "num_items": dict(num_items=50),
    "all": dict(label_smoothing=0.2, softcap=2.0, z_loss=1e-2, num_items=torch.tensor(33)),
    "all_none": dict(reduction="none", label_smoothing=0.2, softcap=2.0, z_loss=1e-2),
}


def make(n, d, V, dtype=torch.float32, seed=0, ignored=0.2, lead=None):
    """h (n, d) (or lead + (d,)), W (V, d) with unit-scale logits, labels with a fraction
    ``ignored`` of ignore_index rows."""
    g = gen(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    W = torch.randn(V, d, generator=g, dtype=torch.float64) * d ** -0.5 * 2
    y = torch.randint(0, V, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignored] = -100
    if lead is not None:
        h, y = h.reshape(*lead, d), y.reshape(lead)
    return h.to(dtype), W.to(dtype), y


def loss_grad(n, reduction="mean"):
    """A gradient for the loss: random, away from 0 (float32, the loss's dtype)."""
    shape = (n,) if reduction == "none" else ()
    return torch.randn(shape, generator=gen(9), dtype=torch.float64).float() + 0.5


def run(backend, h, W, y, grad=None, **kw):
    """(loss, grad_h, grad_W) of ``backend``; ``grad``: the loss's gradient (default loss_grad)."""
    h, W = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    with wk.use_backend(backend):
        loss = wk.linear_cross_entropy(h, W, y, **kw)
    loss.backward(loss_grad(y.numel(), kw.get("reduction", "mean")) if grad is None else grad)
    return loss.detach(), h.grad, W.grad


def oracle(h, W, y, grad, **kw):
    h, W = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    loss = lce_oracle(h, W, y, **kw)
    if not loss.requires_grad:  # every row ignored: a constant 0
        return loss, torch.zeros_like(h), torch.zeros_like(W)
    loss.backward(grad.double())
    return loss.detach(), h.grad, W.grad


def assert_matches(got, want, tol, what):
    for a, b, name in zip(got, want, ("loss", "grad_h", "grad_W")):
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert_close_rel(a, b, tol, f"{what} {name}")


# --- the reference itself -------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_matches_torch_cross_entropy(reduction):
    """An oracle outside this project: F.cross_entropy (with label smoothing) on float64 logits."""
    h, W, y = make(23, 16, 37, torch.float64)
    for eps in (0.0, 0.3):
        want = F.cross_entropy(h @ W.T, y, ignore_index=-100, reduction=reduction, label_smoothing=eps)
        got = reference.linear_cross_entropy(h, W, y, reduction=reduction, label_smoothing=eps)
        assert_close_rel(got, want, TOL[torch.float64], f"eps {eps}")


@pytest.mark.parametrize("name", list(OPTIONS))
def test_reference_matches_row_oracle_and_its_backward_matches_autograd(name):
    kw = OPTIONS[name]
    h, W, y = make(19, 12, 29, torch.float64, seed=1)
    h, W = h.requires_grad_(), W.requires_grad_()
    loss = reference.linear_cross_entropy(h, W, y, **kw)
    assert_close_rel(loss, lce_oracle(h, W, y, **kw), TOL[torch.float64], "loss")
    g = torch.randn(loss.shape, generator=gen(2), dtype=torch.float64)
    want = torch.autograd.grad(loss, (h, W), g)
    _, lse = reference.linear_cross_entropy_forward(h.detach(), W.detach(), y, **kw)
    opts = {k: v for k, v in kw.items()}
    got = reference.linear_cross_entropy_backward(g, h.detach(), W.detach(), y, lse, **opts)
    for a, b, what in zip(got, want, ("grad_h", "grad_W")):
        assert_close_rel(a, b, TOL[torch.float64], what)


# --- every backend against the float64 oracle ---------------------------------------------

@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("backend", PY_BACKENDS)
def test_backends_match_oracle_every_option(backend, name, monkeypatch):
    """float32, 61 rows in chunks of 16 (the last one partial), V = 4100: one or two
    vocabulary blocks on the CPU (a block is half the core's L2: 4096–16384 columns at 16 rows)."""
    monkeypatch.setenv("WIOLA_LCE_CHUNK_ROWS", "16")
    kw = OPTIONS[name]
    h, W, y = make(61, 24, 4100, seed=3)
    got = run(backend, h, W, y, **kw)
    want = oracle(h, W, y, loss_grad(61, kw.get("reduction", "mean")), **kw)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_matches(got, want, TOL[torch.float32], f"{backend} {name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", PY_BACKENDS)
def test_backends_reduced_precision(backend, dtype, monkeypatch):
    """bf16/fp16 within 1e-2 of float64 on the same (rounded) inputs; several chunks and, in
    bf16, V = 8200 (one or two vocabulary blocks: 8192–32768 columns at 16 rows)."""
    monkeypatch.setenv("WIOLA_LCE_CHUNK_ROWS", "16")
    for kw in (OPTIONS["plain"], OPTIONS["all"], OPTIONS["all_none"]):
        h, W, y = make(40, 32, 8200 if dtype == torch.bfloat16 else 300, dtype, seed=4)
        got = run(backend, h, W, y, **kw)
        assert got[0].dtype == torch.float32 and got[1].dtype == dtype and got[2].dtype == dtype
        grad = loss_grad(40, kw.get("reduction", "mean"))
        assert_matches(got, oracle(h, W, y, grad, **kw), TOL[dtype], f"{backend} {dtype} {kw}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_interpreter(dtype):
    """The Triton kernels in the interpreter: 37 rows in chunks of 16, V = 75 over three
    32-column tiles and two vocabulary splits, d = 40 over three 16-wide steps; every
    argument, each reduction (loss alone, with gradients, and "none"'s recomputation)."""
    if "triton" not in BACKENDS:
        pytest.skip("triton backend unavailable")
    h, W, y = make(37, 40, 75, dtype, seed=5)
    for kw in (OPTIONS["all"], OPTIONS["all_none"], dict(reduction="sum")):
        got = run("triton", h, W, y, **kw)
        grad = loss_grad(37, kw.get("reduction", "mean"))
        assert_matches(got, oracle(h, W, y, grad, **kw), TOL[dtype], f"triton {dtype} {kw}")
    with torch.no_grad(), wk.use_backend("triton"):  # the loss alone: one launch, nothing stored
        loss = wk.linear_cross_entropy(h, W, y, label_smoothing=0.1)
    assert_close_rel(loss, lce_oracle(h, W, y, label_smoothing=0.1), TOL[dtype], "no-grad loss")


@pytest.mark.parametrize("kw", [dict(num_items=23), dict(num_items=torch.tensor(23.5, dtype=torch.float64)),
                                dict(num_items=torch.tensor([7], dtype=torch.int32)), {}, dict(reduction="sum")],
                         ids=["number", "float64", "int32", "counted", "sum"])
def test_triton_reduction_on_the_device(kw):
    """The mean's divisor and the backward's factor computed by one kernel on the device
    (_lce_reduce_kernel): num_items as a number (a fill kernel carries it), as tensors of
    other dtypes, the counted rows (every other row ignored), and "sum"; with gradients and
    without (the loss-only launch)."""
    if "triton" not in BACKENDS:
        pytest.skip("triton backend unavailable")
    h, W, y = make(9, 8, 21, seed=11, ignored=0.5)
    grad = loss_grad(9, kw.get("reduction", "mean"))
    assert_matches(run("triton", h, W, y, grad, **kw), oracle(h, W, y, grad, **kw), TOL[torch.float32], str(kw))
    with torch.no_grad(), wk.use_backend("triton"):
        loss = wk.linear_cross_entropy(h, W, y, **kw)
    assert_close_rel(loss, lce_oracle(h, W, y, **kw), TOL[torch.float32], "no-grad loss")


def test_triton_out_of_range_label_is_nan_when_values_are_not_read():
    """On a GPU the labels are not read on the host; a label outside [0, V) gives its row a
    NaN loss (run here by calling the launcher directly, below the CPU value check)."""
    if "triton" not in BACKENDS:
        pytest.skip("triton backend unavailable")
    from wiola_kernels.triton.linear_cross_entropy import lce_forward

    h, W, y = make(5, 16, 20, ignored=0.0)
    y[2] = 20
    rows, *_ = lce_forward(h, W, y, -100, 0.0, None, 0.0)
    assert torch.isnan(rows[2]) and torch.isfinite(rows[[0, 1, 3, 4]]).all()


def test_gpu_chunk_rows_follow_the_measuring_override(monkeypatch):
    """WIOLA_LCE_CHUNK_ROWS sets the GPU launcher's rows per chunk too (rounded down to its row
    tile, at least one tile), for measuring other sizes; unset or not a positive int: the default."""
    pytest.importorskip("triton")
    from wiola_kernels.triton.linear_cross_entropy import _CHUNK_BYTES, _launch_config

    monkeypatch.delenv("WIOLA_LCE_CHUNK_ROWS", raising=False)
    default = _launch_config(4096, 32000, 1024, torch.bfloat16, 132)
    tile = default.logits.block_m
    # The GPU's byte budget: 1,024 rows at V = 32000, not the 256 of a CPU-cache-sized chunk.
    assert default.chunk % tile == 0 and default.chunk * 32000 * 4 <= _CHUNK_BYTES and default.chunk >= 1024
    for value, want in (("4096", 4096), (str(tile + 5), tile), ("1", tile), ("0", default.chunk),
                        ("many", default.chunk), ("", default.chunk)):
        monkeypatch.setenv("WIOLA_LCE_CHUNK_ROWS", value)
        assert _launch_config(4096, 32000, 1024, torch.bfloat16, 132).chunk == want, value
    assert _launch_config(4096, 32000, 1024, torch.bfloat16, None).chunk == 16  # the interpreter's own


# --- edges ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", PY_BACKENDS)
def test_all_rows_ignored(backend):
    """"mean" with no counted row is 0 with zero gradients (F.cross_entropy: NaN); "sum" 0;
    "none" zeros."""
    h, W, y = make(6, 8, 11, ignored=1.0)
    assert (y == -100).all()
    assert torch.isnan(F.cross_entropy(h @ W.T, y))  # what this op defines differently
    for reduction in ("mean", "sum", "none"):
        loss, gh, gw = run(backend, h, W, y, reduction=reduction)
        assert torch.equal(loss, torch.zeros_like(loss)), reduction
        assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw)), reduction


@pytest.mark.parametrize("backend", PY_BACKENDS)
def test_one_row_and_leading_dimensions(backend):
    h, W, y = make(1, 5, 7, ignored=0.0, seed=7)
    got = run(backend, h, W, y, grad=torch.full((), 1.5))
    assert_matches(got, oracle(h, W, y, torch.full((), 1.5)), TOL[torch.float32], "N = 1")
    h3, W3, y3 = make(12, 8, 13, lead=(2, 3, 2), seed=8)  # h (2, 3, 2, 8), labels (2, 3, 2)
    for labels in (y3, y3.reshape(-1)):
        got = run(backend, h3, W3, labels, grad=torch.full((), 0.7))
        assert got[1].shape == h3.shape
        assert_matches(got, oracle(h3, W3, labels, torch.full((), 0.7)), TOL[torch.float32], "leading dims")
    loss = run(backend, h3, W3, y3, reduction="none")[0]
    assert loss.shape == (12,)  # "none": (N,), as SPEC §10.1 says


@pytest.mark.parametrize("backend", PY_BACKENDS)
def test_strided_inputs(backend):
    """W a transposed view, a row slice and a column-strided slice of a larger embedding;
    h transposed and sliced. Same result as contiguous copies."""
    h, W, y = make(21, 16, 30, seed=10)
    g = torch.full((), 1.3)
    want = oracle(h, W, y, g)
    big = torch.zeros(40, 32)
    big[5:35, ::2] = W
    views = {"W transposed": (h, W.t().contiguous().t()), "W row slice": (h, big[5:35, ::2].contiguous()[:, :]),
             "W strided slice": (h, big[5:35, ::2]), "h transposed": (h.t().contiguous().t(), W),
             "h sliced": (torch.zeros(21, 48)[:, 8:24].copy_(h), W)}
    for what, (hv, Wv) in views.items():
        assert_matches(run(backend, hv, Wv, y, grad=g), want, TOL[torch.float32], f"{backend} {what}")


@pytest.mark.parametrize("backend", PY_BACKENDS)
def test_label_dtypes(backend):
    h, W, y = make(10, 8, 20, ignored=0.0, seed=11)
    want = run(backend, h, W, y)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        got = run(backend, h, W, y.to(dtype))
        for a, b in zip(got, want):
            assert torch.equal(a, b), dtype


@pytest.mark.parametrize("backend", PY_BACKENDS)
def test_gradient_accumulation_with_num_items_equals_one_batch(backend):
    """Micro-batches with num_items = counted rows of the whole batch (an int or a tensor, as
    Hugging Face passes num_items_in_batch) sum to the loss and gradients of one batch."""
    h, W, y = make(30, 8, 17, seed=12)
    whole = run(backend, h, W, y, grad=torch.ones(()))
    n = int((y != -100).sum())
    for items in (n, torch.tensor(n), torch.tensor(float(n))):
        parts = [run(backend, h[a:b], W, y[a:b], grad=torch.ones(()), num_items=items) for a, b in ((0, 11), (11, 30))]
        assert_close_rel(parts[0][0] + parts[1][0], whole[0], TOL[torch.float32], "loss")
        assert_close_rel(torch.cat([parts[0][1], parts[1][1]]), whole[1], TOL[torch.float32], "grad_h")
        assert_close_rel(parts[0][2] + parts[1][2], whole[2], TOL[torch.float32], "grad_W")


@pytest.mark.parametrize("backend", PY_BACKENDS)
def test_only_one_input_needs_grad(backend):
    h, W, y = make(9, 8, 15, seed=13)
    want = oracle(h, W, y, torch.ones(()))
    for wants_h in (True, False):
        hh, WW = h.clone().requires_grad_(wants_h), W.clone().requires_grad_(not wants_h)
        with wk.use_backend(backend):
            loss = wk.linear_cross_entropy(hh, WW, y)
        loss.backward()
        grad = hh.grad if wants_h else WW.grad
        assert (WW.grad if wants_h else hh.grad) is None
        assert_close_rel(grad, want[1] if wants_h else want[2], TOL[torch.float32], "grad")


@pytest.mark.parametrize("backend", PY_BACKENDS)
def test_a_second_backward_through_the_graph_recomputes_the_same_bits(backend):
    """The forward's gradients are scaled in place and used up by the first backward; a
    second one (retain_graph) recomputes them, with the same result."""
    h, W, y = make(20, 8, 13, seed=14)
    h, W = h.requires_grad_(), W.requires_grad_()
    with wk.use_backend(backend):
        loss = wk.linear_cross_entropy(h, W, y, label_smoothing=0.1)
    first = torch.autograd.grad(loss, (h, W), torch.tensor(2.0), retain_graph=True)
    second = torch.autograd.grad(loss, (h, W), torch.tensor(2.0))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_inference_needs_no_gradients():
    h, W, y = make(9, 8, 15, seed=15)
    with torch.no_grad():
        loss = wk.linear_cross_entropy(h.requires_grad_(), W, y)
    assert loss.grad_fn is None
    assert_close_rel(loss, lce_oracle(h, W, y), TOL[torch.float32], "loss")


# --- the C++ CPU kernel ---------------------------------------------------------------------

@needs_cpu_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_is_bitwise_reproducible_across_thread_counts(dtype, monkeypatch):
    monkeypatch.setenv("WIOLA_LCE_CHUNK_ROWS", "16")
    h, W, y = make(50, 32, 2100, dtype, seed=16)
    results = []
    for n in (2, 1, 2):
        with threads(n):
            results.append(run("cpu", h, W, y, grad=torch.tensor(0.5), label_smoothing=0.1, softcap=3.0))
            results.append(run("cpu", h, W, y, reduction="none"))
    for a, b in zip(results[0] + results[1], results[2] + results[3]):
        assert torch.equal(a, b), "depends on the thread count"
    for a, b in zip(results[0] + results[1], results[4] + results[5]):
        assert torch.equal(a, b), "differs run to run"


@needs_cpu_extension
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_16bit_paths_match_oracle_over_many_blocks(dtype, monkeypatch):
    """Both 16-bit GEMM paths (csrc/cpu/linear_cross_entropy.cpp widened_bf16_gemms) that this CPU
    runs — float32 GEMMs on widened operands below avx512_bf16, bf16 GEMMs at it — over
    17–66 vocabulary blocks (512-row chunks: 128–512 float32 columns, by the L2 size) and two
    chunks, so the widened path's eight ∂h groups hold two or more blocks each: within 1e-2
    of float64 with every option, and the same bits at 1 and 2 threads."""
    monkeypatch.setenv("WIOLA_LCE_CHUNK_ROWS", "512")
    h, W, y = make(600, 32, 8400, dtype, seed=21)
    kw = OPTIONS["all"]
    want = oracle(h, W, y, loss_grad(600), **kw)
    for isa in available_cpu_isas("linear_cross_entropy"):
        with cpu_isa(isa):
            with threads(1):
                one = run("cpu", h, W, y, **kw)
            with threads(2):
                two = run("cpu", h, W, y, **kw)
        assert_matches(one, want, TOL[dtype], f"cpu/{isa} {dtype}")
        for a, b in zip(one, two):
            assert torch.equal(a, b), f"cpu/{isa} {dtype}: depends on the thread count"


@needs_cpu_extension
@pytest.mark.parametrize("d", [20, 512, 600, 1100])
def test_cpu_float32_grad_h_column_slabs(d, monkeypatch):
    """∂h is computed in an even number of equal column slabs (multiples of 16, at most 512
    wide: d 20 → 16 + 4, 512 → 2 × 256, 600 → 304 + 296, 1100 → 3 × 288 + 236), the last one
    partial: within 1e-4 of float64, and the same bits at 1 and 2 threads."""
    monkeypatch.setenv("WIOLA_LCE_CHUNK_ROWS", "32")
    h, W, y = make(70, d, 300, seed=23)
    want = oracle(h, W, y, loss_grad(70, OPTIONS["all"].get("reduction", "mean")), **OPTIONS["all"])
    with threads(1):
        one = run("cpu", h, W, y, **OPTIONS["all"])
    with threads(2):
        two = run("cpu", h, W, y, **OPTIONS["all"])
    assert_matches(one, want, TOL[torch.float32], f"cpu d={d}")
    for a, b in zip(one, two):
        assert torch.equal(a, b), f"cpu d={d}: depends on the thread count"


@needs_cpu_extension
def test_cpu_float32_gemm_spans(monkeypatch):
    """float32 with 512-row chunks (two, the second partial) and V = 9000: the logits and ∂W
    GEMMs run over spans of 4096 columns (8–32 L2-sized blocks each), the last span partial
    (808 columns), with the block statistics and dz walked block by block inside each span:
    every option within 1e-4 of float64, the same bits at 1 and 2 threads."""
    monkeypatch.setenv("WIOLA_LCE_CHUNK_ROWS", "512")
    h, W, y = make(600, 16, 9000, seed=22)
    for name in ("plain", "all", "all_none"):
        kw = OPTIONS[name]
        want = oracle(h, W, y, loss_grad(600, kw.get("reduction", "mean")), **kw)
        with threads(1):
            one = run("cpu", h, W, y, **kw)
        with threads(2):
            two = run("cpu", h, W, y, **kw)
        assert_matches(one, want, TOL[torch.float32], f"cpu {name}")
        for a, b in zip(one, two):
            assert torch.equal(a, b), f"cpu {name}: depends on the thread count"


@needs_cpu_extension
def test_cpu_never_holds_the_logits(monkeypatch):
    """The largest allocation of a forward + backward is one chunk of logits, far below the
    (N, V) float32 tensor (the profiler records every allocation through PyTorch's allocator)."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("WIOLA_LCE_CHUNK_ROWS", "32")
    h, W, y = make(512, 16, 3000, seed=17)
    h, W = h.requires_grad_(), W.requires_grad_()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with wk.use_backend("cpu"):
            wk.linear_cross_entropy(h, W, y).backward()
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert sizes, "the profiler recorded no allocation"
    assert max(sizes) <= max(32 * 3000 * 4, 3000 * 16 * 4), max(sizes)  # one chunk, or ∂W itself
    assert max(sizes) < 512 * 3000 * 4 / 8


@needs_cpu_extension
def test_cpu_bf16_weight_gradient_summed_over_many_chunks(monkeypatch):
    """bf16 ∂W is a sum over every chunk: N = 4096 rows in 256 chunks of 16 (and in the default
    chunks) stays within 1e-2 of float64. A bf16 running sum of the chunks' rounded partials is
    2.2e-2 off at 256 chunks (measured: an emulation in float64 of that sum on these sizes);
    the kernel keeps the sum to 24 bits, leaving the error of the rounded partials (2.6e-3).
    The float64 reference, not the row-by-row oracle (4096 rows through autograd: minutes);
    test_reference_matches_row_oracle_and_its_backward_matches_autograd ties the two."""
    h, W, y = make(4096, 64, 1000, torch.bfloat16, seed=21, ignored=0.05)
    grad = torch.tensor(0.75)
    hd, Wd = h.double().requires_grad_(), W.double().requires_grad_()
    want_loss = reference.linear_cross_entropy(hd, Wd, y, reduction="sum")
    want_loss.backward(grad.double())
    want = (want_loss.detach(), hd.grad, Wd.grad)
    for chunk_rows in (16, None):
        if chunk_rows is not None:
            monkeypatch.setenv("WIOLA_LCE_CHUNK_ROWS", str(chunk_rows))
        else:
            monkeypatch.delenv("WIOLA_LCE_CHUNK_ROWS", raising=False)
        got = run("cpu", h, W, y, grad=grad, reduction="sum")
        assert_matches(got, want, TOL[torch.bfloat16], f"chunks of {chunk_rows or 'the default size'}")


# --- registration, compile ----------------------------------------------------------------------

@needs_cpu_extension
def test_opcheck_both_ops():
    h, W, y = make(11, 8, 13, seed=18)
    items = torch.tensor(7.0)
    for kw in (dict(), dict(reduction="none", label_smoothing=0.1, softcap=2.0, z_loss=0.01)):
        red = kw.get("reduction", "mean")
        fwd = (h, W, y, -100, red, kw.get("label_smoothing", 0.0), kw.get("softcap"), kw.get("z_loss", 0.0),
               items if red == "mean" else None, [red != "none", red != "none"])
        torch.library.opcheck(torch.ops.wiola.linear_cross_entropy.default, fwd)
        loss, lse, gh, gw = torch.ops.wiola.linear_cross_entropy(*fwd)
        for precomputed in ((False, True) if red != "none" else (False,)):
            bwd = (torch.randn(loss.shape), h, W, y, lse, fwd[8], gh.clone() if precomputed else torch.empty_like(gh
                   if red != "none" else h), gw.clone() if precomputed else torch.empty(13, 8), -100, red, *fwd[5:8],
                   precomputed)
            torch.library.opcheck(torch.ops.wiola.linear_cross_entropy_backward.default, bwd)


def test_compile_fullgraph_with_ignored_rows_and_gradient_accumulation():
    """One compiled micro-batch step (ignored rows, num_items a tensor as Hugging Face passes
    it), run on two micro-batches with gradients accumulated: 0 graph breaks, and the
    accumulated gradients of the whole batch."""
    h, W, y = make(24, 8, 19, seed=19)
    n = torch.tensor(int((y != -100).sum()))
    torch._dynamo.reset()
    counters.clear()

    def step(h, W, y, n):
        return wk.linear_cross_entropy(h, W, y, num_items=n, label_smoothing=0.1) * 1.0

    explained = torch._dynamo.explain(step)(h, W, y, n)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
    total = sum(compiled(hh[a:b], WW, y[a:b], n) for a, b in ((0, 12), (12, 24)))
    total.backward()
    want = oracle(h, W, y, torch.ones(()), label_smoothing=0.1, num_items=int(n))
    assert_matches((total.detach(), hh.grad, WW.grad), want, TOL[torch.float32], "compiled")
    assert sum(counters["graph_break"].values()) == 0


# --- property: any combination of arguments --------------------------------------------------

@given(reduction=st.sampled_from(["mean", "sum", "none"]), eps=st.sampled_from([0.0, 0.05, 1.0]),
       cap=st.sampled_from([None, 0.5, 30.0]), zl=st.sampled_from([0.0, 1e-3]),
       ignored=st.sampled_from([0.0, 0.5, 1.0]), n=st.integers(1, 40), V=st.integers(1, 70),
       items=st.sampled_from([None, 3, 1000]), backend=st.sampled_from(PY_BACKENDS), seed=st.integers(0, 2**16))
def test_any_arguments_match_the_oracle(reduction, eps, cap, zl, ignored, n, V, items, backend, seed):
    kw = dict(reduction=reduction, label_smoothing=eps, softcap=cap, z_loss=zl,
              num_items=items if reduction == "mean" else None)
    h, W, y = make(n, 8, V, seed=seed, ignored=ignored)
    got = run(backend, h, W, y, **kw)
    want = oracle(h, W, y, loss_grad(n, reduction), **kw)
    for a, b, name in zip(got, want, ("loss", "grad_h", "grad_W")):  # floored: exact zeros occur
        den = max(float(b.norm()), 1e-3)
        assert float((a.double() - b).norm()) / den <= TOL[torch.float32], (name, kw)


# --- GPU ---------------------------------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("n, d, V", shapes.LCE_GPU_TEST_SHAPES)  # what gpu-report compiles ahead of time
@pytest.mark.parametrize("dtype", shapes.LCE_GPU_TEST_DTYPES)
def test_triton_on_gpu(n, d, V, dtype):
    """The Triton kernels on a GPU at the shapes of wiola_kernels/shapes.py (compiled ahead of
    time by tests/test_triton_aot.py)."""
    h, W, y = make(n, d, V, dtype, seed=20)
    for kw in (OPTIONS["all"], OPTIONS["all_none"]):
        got = run("triton", h.cuda(), W.cuda(), y.cuda(), grad=loss_grad(n, kw.get("reduction", "mean")).cuda(), **kw)
        want = oracle(h, W, y, loss_grad(n, kw.get("reduction", "mean")), **kw)
        assert_matches(tuple(t.cpu() for t in got), want, TOL[dtype], f"gpu {dtype}")


# --- this op in the shared suites: its OpCase (tests/op_cases.py collects CASE for
# tests/test_all_ops.py and tests/test_op_layer.py) -------------------------------------------

def _lce_make(shape, dtype, seed, reduction="mean", options=False):
    """(N, d, V): hidden rows, the head, labels with every fourth row ignored (from row 1:
    N = 1 still counts a row). ``options``: label smoothing, softcap and z-loss all on."""
    n, d, vocab = shape
    g = gen(seed)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[1::4] = -100
    args = dict(h=randn64(n, d, g=g).to(dtype), W=randn64(vocab, d, g=g, scale=0.5).to(dtype), labels=labels)
    if reduction != "mean":
        args["reduction"] = reduction
    if options:
        args.update(label_smoothing=0.1, softcap=4.0, z_loss=1e-2)
    return args


def _lce_oracle(a):
    return (lce_oracle(a["h"], a["W"], a["labels"], **{n: v for n, v in a.items() if n not in ("h", "W", "labels")}),)


def _lce_calls(a, ops):
    opts = (a["ignore_index"], a["reduction"], a["label_smoothing"], a["softcap"], a["z_loss"], a["num_items"])
    fwd = (a["h"], a["W"], a["labels"], *opts, [True, True])
    loss, lse, grad_h, grad_W = ops.linear_cross_entropy(*fwd)
    bwd = (torch.randn_like(loss), a["h"], a["W"], a["labels"], lse, a["num_items"], grad_h, grad_W, *opts[:5], True)
    return [(ops.linear_cross_entropy.default, fwd), (ops.linear_cross_entropy_backward.default, bwd)]


def _lce_bad(a):
    return [
        (dict(W=a["W"][:, :5]), ValueError, r"^W must have shape \(V, d\) = \(V, 6\) to match h, got \(13, 5\)"),
        (dict(h=a["h"][0]), ValueError, r"^h must have shape \(\.\.\., d\) \(at least 2 dimensions\), got \(6,\)"),
        (dict(W=a["W"].double()), TypeError, r"^W must have dtype torch.float32 like h, got torch.float64"),
        (dict(labels=a["labels"].float()), TypeError, r"^labels must have dtype in \(int64, int32, int16, uint8\), got float32"),
        (dict(labels=a["labels"][:5]), ValueError, r"^labels must have shape h.shape\[:-1\] = \(7,\) or \(N,\) = \(7,\), got \(5,\)"),
        (dict(reduction="avg"), ValueError, r"^reduction must be one of 'mean', 'sum', 'none', got 'avg'"),
        (dict(label_smoothing=1.5), ValueError, r"^label_smoothing must lie in \[0, 1\], got 1.5"),
        (dict(softcap=0.0), ValueError, r"^softcap must be a finite number > 0, got 0.0"),
        (dict(z_loss=-0.5), ValueError, r"^z_loss must be a finite number >= 0, got -0.5"),
        (dict(num_items=torch.ones(3)), ValueError, r"^num_items must be a number > 0 or a real tensor of one element"),
        (dict(labels=torch.full((7,), 13)), ValueError, r"^labels must lie in \[0, V\) = \[0, 13\) or equal ignore_index = -100, got 13"),
        (dict(labels=torch.full((7,), -3)), ValueError, r"^labels must lie in \[0, V\) .* got -3"),
        (dict(W=a["W"][None]), ValueError, r"^W must have shape \(V, d\) \(2-D\), got \(1, 13, 6\)"),
        (dict(h=a["h"].long()), TypeError, r"^h must have dtype in \(float32, float64, bfloat16, float16\), got int64"),
        (dict(label_smoothing=-0.1), ValueError, r"^label_smoothing must lie in \[0, 1\], got -0.1"),
        (dict(label_smoothing=float("nan")), ValueError, r"^label_smoothing must be finite, got nan"),
        (dict(softcap=-2.0), ValueError, r"^softcap must be a finite number > 0, got -2.0"),
        (dict(num_items=0), ValueError, r"^num_items must be a finite number > 0, got 0"),
        (dict(num_items=torch.tensor(0.0)), ValueError, r"^num_items must be a finite number > 0, got 0.0"),
        (dict(num_items="4"), TypeError, r"^num_items must be a real number, got str"),
    ]


CASE = OpCase(
    _lce_make, lambda a: (wk.linear_cross_entropy(**a),),
    # (N, d, V); the lists cycle the variants
    dict(default=[(7, 6, 13), (37, 16, 75), (1, 8, 5), (64, 32, 300), (9, 3, 1000), (2, 1, 2)],
         triton=[(7, 6, 13), (5, 4, 9), (9, 8, 37)], gradcheck=[(6, 4, 7)] * 6,
         dynamic=[(6, 8, 11), (9, 8, 11)], concurrent=[(64, 32, 300)], gpu=[(33, 64, 1000)], threads=[(300, 64, 1000)], layer=[(7, 6, 13)]),
    (Public("linear_cross_entropy", wk.LinearCrossEntropyFunction, _lce_calls, _lce_bad),),
    variants=(dict(), dict(options=True), dict(reduction="none"), dict(options=True), dict(),
              dict(reduction="none", options=True)),
    layer_variant=dict(options=True),
    oracle=_lce_oracle, kind="attention",
    out_dtype=lambda dtype: torch.float64 if dtype == F64 else torch.float32)
