"""WiolaRMSNorm (SPEC §3, §9): every available backend against the float64 reference,
and the reference against an independent row-by-row oracle."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wiola_kernels as wk
from wiola_kernels import reference, shapes
from wiola_kernels.modules import WiolaRMSNorm
from wiola_kernels.testing import (assert_close_rel, available_backends, available_cpu_isas, cpu_isa, rel_err,
                                   tolerance)

from helpers import (assert_bitwise, finite, forward_backward, gen, gpu_only, needs_cpu_extension,
                     run_on_thread_counts, strided_view)
from oracles import raises_naming, rel, rms_oracle

BACKENDS = available_backends("rms_norm", "cpu")
# Triton runs in the numpy interpreter on the CPU: give it small shapes only.
# d = 1 is left to test_single_feature_rows: there ∂L/∂x ≈ 0 is pure cancellation.
SHAPES = {"default": [(1, 3), (1, 7), (37, 192), (5, 760), (2, 3, 50), (1151, 33)],
          "triton": [(1, 3), (3, 7), (9, 130), (2, 3, 50)]}


# The C++ CPU backend once per instruction set its loops run here (csrc/cpu/isa.h): bf16 rows
# have separate AVX2 and AVX-512 (with BF16) loops. `backend` below is then "cpu/avx2", "cpu/avx512_bf16".
CPU_ISAS = available_cpu_isas("rms_norm")
BACKEND_ISAS = [f"cpu/{isa}" for isa in CPU_ISAS if "cpu" in BACKENDS] + [b for b in BACKENDS if b != "cpu"]


@pytest.fixture
def backend(request):
    """The backend name of a test parametrised (indirectly) over BACKEND_ISAS, with the CPU
    kernels held to the named instruction set for the test."""
    name, _, isa = request.param.partition("/")
    with cpu_isa(isa or None):
        yield name


def shapes_for(backend):
    return SHAPES["triton" if backend == "triton" else "default"]


def make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    w = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    s = 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype), s.to(dtype)


def naive_rms_norm(x, w, s, eps):
    """Row-by-row Python oracle, independent of the reference's tensor code."""
    rows = x.reshape(-1, x.shape[-1]).tolist()
    out = []
    for row in rows:
        z = [a + b for a, b in zip(row, s.tolist())]
        r = math.sqrt(sum(v * v for v in z) / len(z) + eps)
        out.append([wi * zi / r for wi, zi in zip(w.tolist(), z)])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def run(backend, x, w, s, eps=1e-6, grad=None):
    x, w, s = (t.detach().clone().requires_grad_() for t in (x, w, s))
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps)
        if grad is not None:
            y.backward(grad)
    return y, x.grad, w.grad, s.grad


# --- the reference itself -------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (4, 9), (2, 3, 16)])
def test_reference_matches_naive_oracle(shape):
    x, w, s = make(shape, torch.float64)
    assert_close_rel(reference.rms_norm(x, w, s, 1e-6), naive_rms_norm(x, w, s, 1e-6), tolerance(torch.float64))


def test_reference_hand_worked_row():
    # x = (3, 4) - δ with δ = (1, -1): z = (3, 4), mean z² = 12.5, r = sqrt(12.5 + ε).
    x = torch.tensor([[2.0, 5.0]], dtype=torch.float64)
    s = torch.tensor([1.0, -1.0], dtype=torch.float64)
    w = torch.tensor([2.0, 0.5], dtype=torch.float64)
    r = math.sqrt(12.5 + 1e-6)
    expected = torch.tensor([[2.0 * 3 / r, 0.5 * 4 / r]], dtype=torch.float64)
    assert_close_rel(reference.rms_norm(x, w, s, 1e-6), expected, tolerance(torch.float64))


def test_reference_explicit_backward_matches_autograd():
    x, w, s = make((6, 11), torch.float64)
    x, w, s = (t.requires_grad_() for t in (x, w, s))
    g = torch.randn(6, 11, dtype=torch.float64)
    reference.rms_norm(x, w, s, 1e-6).backward(g)
    y, rstd = reference.rms_norm_forward(x.detach(), w.detach(), s.detach(), 1e-6)
    dx, dw, ds = reference.rms_norm_backward(g, x.detach(), w.detach(), s.detach(), rstd)
    for got, want, name in ((dx, x.grad, "dx"), (dw, w.grad, "dweight"), (ds, s.grad, "dshift")):
        assert_close_rel(got, want, tolerance(torch.float64), name)


def test_papers_eq10_is_not_the_gradient():
    """SPEC §3: putting γ_i on both terms (the paper's printed eq. 10) is wrong; our
    explicit backward must differ from that formula when γ ≠ 1."""
    x, w, s = make((3, 8), torch.float64)
    g = torch.randn(3, 8, dtype=torch.float64)
    _, rstd = reference.rms_norm_forward(x, w, s, 1e-6)
    z = x + s
    r_inv = rstd.unsqueeze(-1)
    paper = r_inv * w * (g - z * r_inv**2 * (g * z).sum(-1, keepdim=True) / 8)
    ours, _, _ = reference.rms_norm_backward(g, x, w, s, rstd)
    assert rel_err(paper, ours) > 1e-3


def test_reference_gradcheck():
    x, w, s = (t.requires_grad_() for t in make((3, 7), torch.float64))
    assert torch.autograd.gradcheck(lambda a, b, c: reference.rms_norm(a, b, c, 1e-6), (x, w, s))


# --- every backend against the reference ----------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend):
    shape = (2, 5) if backend == "triton" else (2, 3, 9)  # every interpreted launch is slow
    x, w, s = (t.requires_grad_() for t in make(shape, torch.float64))
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda a, b, c: wk.rms_norm(a, b, c, 1e-6), (x, w, s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_matches_float64_reference(backend, dtype):
    for shape in shapes_for(backend):
        x, w, s = make(shape, dtype, seed=len(shape) + shape[-1])
        g = torch.randn(shape, dtype=torch.float64).to(dtype)
        y, dx, dw, ds = run(backend, x, w, s, grad=g)
        y64, dx64, dw64, ds64 = run("reference", x.double(), w.double(), s.double(), grad=g.double())
        tol = tolerance(dtype)
        assert y.dtype == dtype and y.shape == x.shape
        assert dx.dtype == dtype and dw.dtype == dtype and ds.dtype == dtype
        for got, want, name in ((y, y64, "y"), (dx, dx64, "dx"), (dw, dw64, "dweight"), (ds, ds64, "dshift")):
            assert_close_rel(got, want, tol, f"{backend} {dtype} {shape} {name}")


def test_triton_wide_rows():
    """d = 8193 (fp32): the Triton kernels walk rows too wide for registers in chunks (WIDE;
    the last chunk partial) and the backward accumulates ∂γ, ∂δ in its partial rows; 5 rows
    over 4 programs, so a program adds two rows into its partials. Row 1 overflows Σz²
    (|x| ~ 1e30), so the chunked rescaling path runs too."""
    if "triton" not in BACKENDS:
        pytest.skip("triton backend unavailable")
    from wiola_kernels.triton.rms_norm import _launch_config

    assert _launch_config(5, 8193, 4, 1, None).wide and _launch_config(5, 8193, 4, 2, None).wide
    x, w, s = make((5, 8193), torch.float32, seed=3)
    x[1] *= 1e30
    g = torch.randn(5, 8193, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).float()
    got = run("triton", x, w, s, grad=g)
    want = run("reference", x.double(), w.double(), s.double(), grad=g.double())
    for a, b, name in zip(got, want, ("y", "dx", "dweight", "dshift")):
        assert_close_rel(a, b, tolerance(torch.float32), name)


@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_single_feature_rows(backend):
    """d = 1: y = γ z / sqrt(z² + ε), i.e. ≈ γ·sign(z)."""
    x, w, s = make((6, 1), torch.float32)
    y, *_ = run(backend, x, w, s)
    assert_close_rel(y, reference.rms_norm(x.double(), w.double(), s.double(), 1e-6), tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_mixed_precision_params(backend):
    """bf16 activations with float32 γ/δ (the usual mixed-precision setup): output in
    bf16, parameter gradients in float32."""
    x, _, _ = make((5, 40), torch.bfloat16)
    _, w, s = make((5, 40), torch.float32)
    g = torch.randn(5, 40).bfloat16()
    y, dx, dw, ds = run(backend, x, w, s, grad=g)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16
    assert dw.dtype == torch.float32 and ds.dtype == torch.float32
    y64, _, dw64, ds64 = run("reference", x.double(), w.double(), s.double(), grad=g.double())
    assert_close_rel(y, y64, tolerance(torch.bfloat16))
    assert_close_rel(dw, dw64, tolerance(torch.bfloat16))
    assert_close_rel(ds, ds64, tolerance(torch.bfloat16))


@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_non_contiguous_inputs(backend):
    base = torch.randn(40, 30, dtype=torch.float64)
    x = base.t()[:, ::2]  # (30, 20), strided both ways
    w_base = torch.rand(40, dtype=torch.float64) + 0.5
    w, s = w_base[::2], 0.1 * w_base[1::2]
    assert not x.is_contiguous() and not w.is_contiguous()
    g = torch.randn(30, 20, dtype=torch.float64)
    y, dx, dw, ds = run(backend, x.float(), w.float(), s.float(), grad=g.float())
    y64, dx64, dw64, ds64 = run("reference", x.contiguous(), w.contiguous(), s.contiguous(), grad=g)
    for got, want in ((y, y64), (dx, dx64), (dw, dw64), (ds, ds64)):
        assert_close_rel(got, want, tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_zero_rows_and_zero_input(backend):
    # All-zero rows with δ = 0: ε keeps r > 0, so the output is 0, not NaN.
    x = torch.zeros(3, 16)
    w, s = torch.ones(16), torch.zeros(16)
    y, dx, dw, ds = run(backend, x, w, s, grad=torch.randn(3, 16))
    assert torch.equal(y, torch.zeros(3, 16)) and torch.isfinite(dx).all()
    # No rows at all.
    y, dx, dw, ds = run(backend, torch.zeros(0, 16), w, s, grad=torch.zeros(0, 16))
    assert y.shape == (0, 16) and torch.equal(dw, torch.zeros(16)) and torch.equal(ds, torch.zeros(16))


@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_nan_stays_in_its_row(backend):
    x, w, s = make((4, 24), torch.float32)
    x[1, 3] = float("nan")
    y, *_ = run(backend, x, w, s)
    assert torch.isnan(y[1]).all()
    assert torch.isfinite(y[[0, 2, 3]]).all()


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e25), (torch.float32, 2e38), (torch.bfloat16, 1e37),
                                         (torch.float64, 1e300)])
@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_huge_rows_match_rescaled_oracle(backend, dtype, scale):
    """Rows so large that Σz² overflows the statistic's dtype are rescaled by the kernel.
    Oracle: the float64 reference row by row on the inputs divided by c_r = 2^k ≈ scale
    (exact), where y(x, δ; ε) = y(x/c, δ/c; ε/c²), ∂L/∂x scales by 1/c and ∂L/∂γ does
    not change. Row 1 stays normal (c_1 = 1), beside the huge rows."""
    g = torch.Generator().manual_seed(5)
    d = 33
    c = [2.0 ** round(math.log2(scale)) if r != 1 else 1.0 for r in range(4)]
    x = torch.randn(4, d, generator=g, dtype=torch.float64).clamp(-1.5, 1.5)
    x *= torch.tensor(c, dtype=torch.float64).unsqueeze(1)
    w = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    s = 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    grad = torch.randn(4, d, generator=g, dtype=torch.float64)
    x, w, s, grad = x.to(dtype), w.to(dtype), s.to(dtype), grad.to(dtype)
    assert torch.isfinite(x).all() and not torch.isfinite((x + s)[0].float().pow(2).sum())
    y, dx, dw, ds = run(backend, x, w, s, grad=grad)
    with wk.use_backend(backend):
        _, rstd = torch.ops.wiola.rms_norm(x, w, s, 1e-6)

    tol = tolerance(dtype)
    gtol = tol * (10 if dtype == torch.bfloat16 else 1)  # the grads sum many rounded terms
    dw_want, ds_want = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    for r in range(4):
        xo, wo, so = (t.double().requires_grad_() for t in (x[r:r + 1] / c[r], w, s / c[r]))  # exact
        yo = reference.rms_norm(xo, wo, so, 1e-6 / c[r] / c[r])
        gxo, gwo = torch.autograd.grad(yo, (xo, wo), grad[r:r + 1].double())
        assert_close_rel(y[r], yo[0], tol, f"y row {r}")
        assert_close_rel(dx[r], gxo[0] / c[r], gtol, f"dx row {r}")
        dw_want += gwo
        ds_want += gxo[0] / c[r]
        # rstd is subnormal once r > 2^126 (float32): still ≥ 21 significant bits.
        rstd_want = 1 / (c[r] * math.sqrt((xo + so).detach().pow(2).mean() + 1e-6 / c[r] / c[r]))
        assert abs(rstd[r].item() - rstd_want) <= 2.0**-20 * rstd_want, f"rstd row {r}"
    assert_close_rel(dw, dw_want, gtol, "dweight")
    assert_close_rel(ds, ds_want, gtol, "dshift")


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_not_modified(backend):
    x, w, s = make((4, 24), torch.float32)
    copies = [t.clone() for t in (x, w, s)]
    run(backend, x, w, s, grad=torch.randn(4, 24))
    assert all(torch.equal(a, b) for a, b in zip((x, w, s), copies))


@pytest.mark.parametrize("backend", [b for b in BACKEND_ISAS if b != "triton"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_bitwise_reproducible(backend, dtype):
    x, w, s = make((300, 96), dtype)
    g = torch.randn(300, 96, generator=gen(3)).to(dtype)
    first = run(backend, x, w, s, grad=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(backend, x, w, s, grad=g)
    finally:
        torch.set_num_threads(threads)
    again = run(backend, x, w, s, grad=g)
    for a, b, c in zip(first, again, single):
        assert torch.equal(a, b), "differs run to run"
        assert torch.equal(a, c), "depends on the thread count"


# --- registration, compile, module -----------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x, w, s = make((5, 12), torch.float32)
    with wk.use_backend(backend):  # autograd is RMSNormFunction's: the ops take no grad
        torch.library.opcheck(torch.ops.wiola.rms_norm.default, (x, w, s, 1e-6))
        _, rstd = torch.ops.wiola.rms_norm(x.detach(), w.detach(), s.detach(), 1e-6)
        torch.library.opcheck(torch.ops.wiola.rms_norm_backward.default,
                              (torch.randn(5, 12), x.detach(), w.detach(), s.detach(), rstd))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    norm = wk.WiolaRMSNorm(24)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.shift.normal_(0, 0.1)

    def f(x):
        return torch.tanh(norm(x) * 2).sum()

    compiled = torch.compile(f, fullgraph=True)
    x1 = torch.randn(3, 5, 24, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    f(x1).backward()
    eager_grads = [x1.grad] + [p.grad.clone() for p in norm.parameters()]
    norm.zero_grad()
    compiled(x2).backward()
    compiled_grads = [x2.grad] + [p.grad for p in norm.parameters()]
    for a, b in zip(eager_grads, compiled_grads):
        assert_close_rel(b, a, tolerance(torch.float32))


def test_module_parameters_and_init():
    norm = wk.WiolaRMSNorm(10, eps=1e-5)
    assert dict(norm.named_parameters()).keys() == {"weight", "shift"}
    assert torch.equal(norm.weight, torch.ones(10)) and torch.equal(norm.shift, torch.zeros(10))
    assert "10, eps=1e-05" in repr(norm)
    x = torch.randn(2, 10)
    want = reference.rms_norm(x.double(), norm.weight.double(), norm.shift.double(), 1e-5)
    assert_close_rel(norm(x), want, tolerance(torch.float32))
    with pytest.raises(ValueError, match="hidden_size"):
        wk.WiolaRMSNorm(0)


# --- bad input -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "make_args, error, match",
    [
        (lambda: (torch.randn(4, 8), torch.ones(7), torch.zeros(8)), ValueError, "weight must have shape"),
        (lambda: (torch.randn(4, 8), torch.ones(8), torch.zeros(8, 1)), ValueError, "shift must have shape"),
        (lambda: (torch.randn(4, 8), torch.ones(8, 8), torch.zeros(8)), ValueError, "weight"),
        (lambda: (torch.randint(0, 3, (4, 8)), torch.ones(8), torch.zeros(8)), TypeError, "x must have dtype"),
        (lambda: (torch.randn(4, 8), [1.0] * 8, torch.zeros(8)), TypeError, "weight must be a torch.Tensor"),
        (lambda: (torch.randn(()), torch.ones(1), torch.zeros(1)), ValueError, "x must have shape"),
        (lambda: (torch.randn(4, 0), torch.ones(0), torch.zeros(0)), ValueError, "non-empty"),
        (lambda: (torch.randn(4, 8), torch.ones(8, device="meta"), torch.zeros(8)), ValueError, "weight must be on"),
    ],
)
def test_bad_inputs(make_args, error, match):
    with pytest.raises(error, match=match):
        wk.rms_norm(*make_args())


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match="eps"):
        wk.rms_norm(torch.randn(2, 4), torch.ones(4), torch.zeros(4), eps)


def test_bad_backend_name():
    with pytest.raises(ValueError, match="use_backend"):
        with wk.use_backend("fortran"):
            pass


def test_poisoning_is_active():
    """The suite's outputs start as NaN (conftest); a kernel that skips an element fails."""
    from wiola_kernels.outputs import empty_output

    assert torch.isnan(empty_output((4,), dtype=torch.float32, device=torch.device("cpu"))).all()


def test_zero_dim_input_says_it_needs_a_dimension():
    with pytest.raises(ValueError, match=r"^x must have shape \(\.\.\., d\) \(at least 1 dimension\), got a 0-d"):
        wk.rms_norm(torch.tensor(1.0), torch.ones(1), torch.zeros(1))


# --- options for Hugging Face models: δ absent, HF's rounding order ----------

def _hf_rms_norm(x, w, eps):
    """Hugging Face's LlamaRMSNorm.forward, written out: normalise in float32, round to the
    input dtype, then multiply by γ in PyTorch's own type promotion."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _ulp_distance(a, b):
    """|a − b| in units in the last place, elementwise, for same-dtype floats (sign-magnitude
    bit patterns mapped to a monotone integer line)."""
    assert a.dtype == b.dtype
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    def line(t):
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & (2 ** (8 * t.element_size() - 1) - 1)), i)
    return (line(a) - line(b)).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_no_shift_matches_reference_with_zero_shift(backend, dtype):
    for shape in shapes_for(backend):
        x, w, _ = make(shape, dtype, seed=5)
        g = torch.randn(shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(dtype)
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with wk.use_backend(backend):
            y = wk.rms_norm(xr, wr, None, 1e-6)
            y.backward(g)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        y64 = reference.rms_norm(x64, w64, torch.zeros_like(w64), 1e-6)
        y64.backward(g.double())
        tol = tolerance(dtype)
        assert y.dtype == dtype and y.shape == x.shape
        assert_close_rel(y, y64, tol, f"y {shape}")
        assert_close_rel(xr.grad, x64.grad, tol, f"grad x {shape}")
        assert_close_rel(wr.grad, w64.grad, tol, f"grad weight {shape}")


def _max_ulp(backend, dtype):
    # Triton's CPU interpreter (3.9) converts float32 -> bf16 by truncation, not round to
    # nearest as the GPU does: up to one more ulp for each of the two roundings of HF's
    # order there. fp16 goes through numpy (nearest), as on the GPU.
    return 3 if backend == "triton" and dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1" else 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_order_matches_hugging_face_within_one_ulp(backend, dtype):
    # bf16/fp16: γ·round(x/r) reproduces HF bit for bit except where the float32 statistics
    # (summed in another order) round x/r to the neighbouring value: at most one ulp.
    shapes = [(7, 130), (3, 512)] if backend == "triton" else [(37, 192), (64, 1024), (5, 760)]
    for shape in shapes:
        x, w, _ = make(shape, dtype, seed=7)
        with wk.use_backend(backend):
            y = wk.rms_norm(x, w, None, 1e-6, hf_order=True)
        want = _hf_rms_norm(x, w, 1e-6)
        dist = _ulp_distance(y, want)
        assert int(dist.max()) <= _max_ulp(backend, dtype), f"{shape}: {int(dist.max())} ulp from HF"
        if _max_ulp(backend, dtype) == 1:
            exact = float((dist == 0).double().mean())
            assert exact >= 0.99, f"{shape}: only {exact:.3f} of the outputs equal HF's"
        # And it is still RMSNorm: SPEC §9 against float64.
        y64 = reference.rms_norm(x.double(), w.double(), torch.zeros_like(w.double()), 1e-6)
        assert_close_rel(y, y64, tolerance(dtype), f"y {shape} vs float64")


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_order_default_order_differs_in_bf16(backend):
    # The option is real: in bf16 our default order (one rounding) differs from HF's somewhere.
    x, w, _ = make((64, 256), torch.bfloat16, seed=8)
    with wk.use_backend(backend):
        ours = wk.rms_norm(x, w, None, 1e-6)
        hf = wk.rms_norm(x, w, None, 1e-6, hf_order=True)
    assert (ours != hf).any()
    assert (_ulp_distance(hf, _hf_rms_norm(x, w, 1e-6)) <= _max_ulp(backend, torch.bfloat16)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_order_with_shift_and_gradients(backend):
    x, w, s = make((9, 130), torch.float32, seed=9)
    g = torch.randn(9, 130, generator=torch.Generator().manual_seed(10))
    xr, wr, sr = (t.detach().clone().requires_grad_() for t in (x, w, s))
    with wk.use_backend(backend):
        y = wk.rms_norm(xr, wr, sr, 1e-6, hf_order=True)
        y.backward(g)
    x64, w64, s64 = (t.double().requires_grad_() for t in (x, w, s))
    y64 = reference.rms_norm(x64, w64, s64, 1e-6)
    y64.backward(g.double())
    tol = tolerance(torch.float32)
    assert_close_rel(y, y64, tol, "y")
    for got, want, what in ((xr.grad, x64.grad, "x"), (wr.grad, w64.grad, "weight"), (sr.grad, s64.grad, "shift")):
        assert_close_rel(got, want, tol, f"grad {what}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_without_shift(backend):
    x, w, _ = make((5, 33), torch.float32, seed=11)
    with wk.use_backend(backend):
        for hf_order in (False, True):
            torch.library.opcheck(torch.ops.wiola.rms_norm.default, (x, w, None, 1e-6, hf_order))


def test_plain_rms_norm_module_shares_weight_and_promotes_like_hf():
    w = torch.nn.Parameter(torch.rand(16, generator=torch.Generator().manual_seed(12)) + 0.5)
    mod = wk.RMSNorm(eps=1e-5, hf_order=True, weight=w)
    assert mod.weight is w and mod.variance_epsilon == 1e-5
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    y = mod(x)  # float32 γ, bf16 x: HF returns float32 γ·round_bf16(x/r)
    assert y.dtype == torch.float32
    assert rel_err(y, _hf_rms_norm(x, w, 1e-5)) <= 2.0**-8  # at most a bf16 ulp of x/r apart
    assert list(dict(mod.named_parameters())) == ["weight"]
    with pytest.raises(TypeError, match="weight"):
        wk.RMSNorm(eps=1e-5, weight=torch.ones(4))


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs the C++ extension")
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype, rows", [(torch.float32, 4096), (torch.bfloat16, 8192)])
def test_cpu_outputs_large_enough_to_stream(dtype, rows, isa):
    """16 MiB outputs: y and ∂x take the non-temporal-store path (bf16 also converts on the
    fly); against the float64 reference, and bitwise the same on 1 thread as on all."""
    with cpu_isa(isa):
        _check_streamed_rows(dtype, rows)


def _check_streamed_rows(dtype, rows):
    x, w, s = make((rows, 1024), dtype, seed=21)
    g = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(22)).to(dtype)
    got = run("cpu", x, w, s, grad=g)
    want = run("reference", x.double(), w.double(), s.double(), grad=g.double())
    tol = tolerance(dtype)
    for name, a, b in zip(("y", "grad_x", "grad_weight", "grad_shift"), got, want):
        assert a.dtype == dtype
        assert_close_rel(a, b, tol, name)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run("cpu", x, w, s, grad=g)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(got, single)), "depends on the thread count"


# --- the CPU kernels' instruction sets (csrc/cpu/isa.h) -------------------------------

ISA_SHAPES = [(3, 1024), (37, 192), (5, 760), (1151, 33), (4, 32), (2, 31), (6, 48), (1, 7)]


@pytest.mark.skipif(len(CPU_ISAS) < 2, reason="needs a CPU with AVX-512 (F/BW/VL/DQ/BF16)")
@pytest.mark.parametrize("shift", [True, False])
def test_cpu_isas_agree_to_rounding(shift):
    """bf16 rows: the AVX-512 loops sum in another order than the AVX2 ones, so outputs may
    differ where a value sits on a bf16 rounding tie (one ulp), the float statistics and the
    ∂γ/∂δ sums in their last bits; never more."""
    for shape in ISA_SHAPES:
        x, w, s = make(shape, torch.bfloat16, seed=shape[-1])
        g = torch.randn(shape, generator=gen(shape[0])).to(torch.bfloat16)
        got = {}
        for isa in CPU_ISAS:
            with cpu_isa(isa), wk.use_backend("cpu"):
                got[isa] = run("cpu", x, w, s, grad=g) if shift else _run_no_shift(x, w, g)
        for name, a, b in zip(("y", "dx", "dweight", "dshift"), got["avx2"], got["avx512_bf16"]):
            if a is None:
                continue
            if a.dtype == torch.bfloat16:  # one ulp: 2^-7 relative to the larger magnitude
                ulp = torch.maximum(a.float().abs(), b.float().abs()) * 2.0**-7
                assert ((a.float() - b.float()).abs() <= ulp).all(), f"{shape} {name}"
            else:
                assert_close_rel(a, b.double(), 1e-6, f"{shape} {name}")


def _run_no_shift(x, w, g):
    x, w = (t.detach().clone().requires_grad_() for t in (x, w))
    y = wk.rms_norm(x, w, None, 1e-6)
    y.backward(g)
    return y, x.grad, w.grad, None


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs the C++ extension")
@pytest.mark.parametrize("isa", CPU_ISAS)
def test_cpu_bf16_subnormal_and_nan_outputs_are_rounded_not_flushed(isa):
    """AVX512-BF16's conversion flushes subnormals to zero; blocks holding one take the exact
    rounding instead. Rows of small integers (Σz² exact in any order) with γ ≈ 1e-39 give
    subnormal outputs; oracle: torch's float -> bf16 rounding of (γ·z)·rstd in float32."""
    d = 64
    x = torch.randint(-8, 9, (4, d), generator=gen(7)).to(torch.bfloat16)
    x[:, 0] = 3  # no zero row
    w = torch.full((d,), 1e-39)  # a float32 subnormal
    w[::3] = 1.0
    s = torch.zeros(d)
    x[3, 5] = float("nan")
    with cpu_isa(isa), wk.use_backend("cpu"):
        y, rstd = torch.ops.wiola.rms_norm(x, w, s, 1e-6)
    z = x.float()
    want = ((w * z) * rstd[:, None]).to(torch.bfloat16)
    sub = (want[:3].float() != 0) & (want[:3].float().abs() < 2.0**-126)
    assert sub.sum() > 50, "the case must produce subnormal outputs"
    assert torch.equal(y[:3].view(torch.int16), want[:3].view(torch.int16))
    assert torch.isnan(y[3]).all()


def test_set_cpu_isa_checks_its_argument():
    with pytest.raises(ValueError, match="isa must be one of"):
        wk.set_cpu_isa("sse2")
    if "cpu" in BACKENDS:
        before = wk.cpu_isa()
        levels = available_cpu_isas()
        assert before in levels
        assert wk.set_cpu_isa("avx2") == before and wk.cpu_isa() == "avx2"
        assert wk.set_cpu_isa("auto") == "avx2" and wk.cpu_isa() == levels[-1]
        wk.set_cpu_isa(before)
        if "avx512_bf16" not in levels:
            with pytest.raises(ValueError, match="this CPU has no avx512_bf16"):
                wk.set_cpu_isa("avx512_bf16")


@pytest.mark.skipif(len(CPU_ISAS) < 2, reason="needs a CPU with AVX-512 (F/BW/VL/DQ/BF16)")
def test_environment_variable_selects_avx2():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import wiola_kernels as wk; print(wk.cpu_isa())"],
                         env={**os.environ, "WIOLA_CPU_ISA": "avx2"}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "avx2"


# ========================================================================================
# Backends and draws of the sections below: from SPEC alone, numerics at the edges, properties,
# bitwise determinism, GPU
# ========================================================================================

SPEC_BACKENDS = [name for name, state in wk.backends("cpu")["rms_norm"].items() if state == "available"]
EDGE_BACKENDS = [b for b in available_backends("rms_norm", "cpu") if b in ("cpu", "reference")]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SEEDS = st.integers(0, 2**32 - 1)  # every tensor comes from a generator seeded by a drawn seed


# ========================================================================================
# From SPEC alone: the public API against tests/oracles.py (no wiola_kernels.reference)
# ========================================================================================

@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("shape", [(2, 3, 5, 24), (24,), (1, 24), (7, 37), (2, 3000)])
def test_rms_norm_forward_matches_oracle(backend, shape):
    d = shape[-1]
    x = torch.randn(shape) * 3 + 0.5
    w = torch.randn(d)
    s = torch.randn(d) * 0.7
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel(y, rms_oracle(x, w, s, 1e-6)) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_rms_norm_eps_is_used(backend):
    # Small-magnitude input with a large ε: the ε term dominates and must be honoured.
    x = torch.randn(4, 16) * 0.1
    w, s = torch.ones(16), torch.zeros(16)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=0.5)
    assert rel(y, rms_oracle(x, w, s, 0.5)) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_rms_norm_dtypes(backend, dtype):
    x = (torch.randn(5, 40) * 4).to(dtype)
    w = torch.randn(40).to(dtype)
    s = torch.randn(40).to(dtype)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel(y, rms_oracle(x, w, s, 1e-6)) <= tolerance(dtype)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_rms_norm_half_stats_in_fp32(backend):
    # Large values whose squares overflow fp16 (65504): statistics must be float32.
    x = (torch.randn(3, 64) * 300).to(torch.float16)
    w, s = torch.ones(64, dtype=torch.float16), torch.zeros(64, dtype=torch.float16)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=1e-6)
    assert rel(y, rms_oracle(x, w, s, 1e-6)) <= tolerance(torch.bfloat16)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_rms_norm_output_dtype_is_input_dtype(backend):
    # bf16 activations with float32 parameters (the mixed-precision case): output is bf16.
    x = torch.randn(4, 32).to(torch.bfloat16)
    w, s = torch.randn(32), torch.randn(32)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=1e-6)
    assert y.dtype == torch.bfloat16
    assert rel(y, rms_oracle(x, w, s, 1e-6)) <= tolerance(torch.bfloat16)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_backward_half(backend, dtype):
    x, w, s = (torch.randn(5, 24) * 2).to(dtype), torch.randn(24).to(dtype), torch.randn(24).to(dtype)
    g = torch.randn(5, 24).to(dtype)
    xs = [t.clone().requires_grad_() for t in (x, w, s)]
    with wk.use_backend(backend):
        wk.rms_norm(*xs, eps=1e-6).backward(g)
    xd = [t.double().requires_grad_() for t in (x, w, s)]
    rms_oracle(*xd, 1e-6).backward(g.double())
    for got, ref in zip(xs, xd):
        assert got.grad.dtype == dtype
        assert rel(got.grad, ref.grad) <= tolerance(torch.bfloat16)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_rms_norm_backward_matches_oracle(backend):
    x = torch.randn(2, 3, 19) * 2
    w = torch.randn(19)
    s = torch.randn(19)
    g = torch.randn(2, 3, 19)
    xs = [t.clone().requires_grad_() for t in (x, w, s)]
    with wk.use_backend(backend):
        y = wk.rms_norm(*xs, eps=1e-6)
    y.backward(g)
    xd = [t.double().requires_grad_() for t in (x, w, s)]
    rms_oracle(*xd, 1e-6).backward(g.double())
    for got, ref in zip(xs, xd):
        assert rel(got.grad, ref.grad) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_rms_norm_backward_is_spec_formula_not_paper_eq10(backend):
    # SPEC §3: ∂L/∂z_i = (1/r)(γ_i g_i − z_i/(d r²) Σ_k γ_k g_k z_k), closed form.
    d = 12
    x = torch.randn(4, d, dtype=torch.float64)
    w = torch.randn(d, dtype=torch.float64) + 2.0
    s = torch.randn(d, dtype=torch.float64)
    g = torch.randn(4, d, dtype=torch.float64)
    eps = 1e-6
    z = x + s
    r = torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    dz = (w * g - z / (d * r * r) * (w * g * z).sum(-1, keepdim=True)) / r
    dw = (g * z / r).sum(0)
    xs = [t.clone().requires_grad_() for t in (x, w, s)]
    with wk.use_backend(backend):
        wk.rms_norm(*xs, eps=eps).backward(g)
    assert rel(xs[0].grad, dz) <= tolerance(torch.float64)
    assert rel(xs[2].grad, dz.sum(0)) <= tolerance(torch.float64)
    assert rel(xs[1].grad, dw) <= tolerance(torch.float64)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_rms_norm_gradcheck(backend):
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    s = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda a, b, c: wk.rms_norm(a, b, c, eps=1e-6), (x, w, s))


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_rms_norm_noncontiguous(backend):
    d = 20
    w, s = torch.randn(d), torch.randn(d)
    base = torch.randn(d, 6)
    cases = [
        base.t(),                               # transposed (stride (1, 6))
        torch.randn(6, 2 * d)[:, ::2],           # strided last dim
        torch.randn(1, d).expand(5, d),          # expanded (stride 0)
        torch.randn(3, 4, d).transpose(0, 1),    # permuted leading dims
    ]
    for x in cases:
        with wk.use_backend(backend):
            y = wk.rms_norm(x, w, s, eps=1e-6)
        assert rel(y, rms_oracle(x, w, s, 1e-6)) <= tolerance(torch.float32)
    # non-contiguous parameters
    w2 = torch.randn(2 * d)[::2]
    s2 = torch.randn(d, 1).expand(d, 3)[:, 1]
    x = torch.randn(4, d)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w2, s2, eps=1e-6)
    assert rel(y, rms_oracle(x, w2, s2, 1e-6)) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_rms_norm_noncontiguous_grads(backend):
    # expanded (stride-0) input from a leaf, and a transposed output gradient
    base, w, s = torch.randn(1, 12), torch.randn(12), torch.randn(12)
    gt = torch.randn(12, 5).t()
    a = [t.clone().requires_grad_() for t in (base, w, s)]
    with wk.use_backend(backend):
        wk.rms_norm(a[0].expand(5, 12), a[1], a[2], eps=1e-6).backward(gt)
    d = [t.double().requires_grad_() for t in (base, w, s)]
    rms_oracle(d[0].expand(5, 12), d[1], d[2], 1e-6).backward(gt.double())
    for got, ref in zip(a, d):
        assert rel(got.grad, ref.grad) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_rms_norm_does_not_modify_inputs(backend):
    x, w, s = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    copies = [t.clone() for t in (x, w, s)]
    with wk.use_backend(backend):
        wk.rms_norm(x, w, s, eps=1e-6)
    for a, b in zip((x, w, s), copies):
        assert torch.equal(a, b)


_X, _W, _S = torch.randn(3, 8), torch.ones(8), torch.zeros(8)
RMS_BAD = {
    "weight_wrong_size": (lambda: wk.rms_norm(_X, torch.ones(7), _S), ["weight"]),
    "weight_wrong_rank": (lambda: wk.rms_norm(_X, torch.ones(8, 1), _S), ["weight"]),
    "shift_wrong_size": (lambda: wk.rms_norm(_X, _W, torch.zeros(9)), ["shift"]),
    "x_int": (lambda: wk.rms_norm(torch.ones(3, 8, dtype=torch.int32), _W, _S), ["x"]),
    "x_complex": (lambda: wk.rms_norm(torch.ones(3, 8, dtype=torch.complex64), _W, _S), ["x"]),
    "x_0d": (lambda: wk.rms_norm(torch.tensor(1.0), _W, _S), ["x"]),
    "x_list": (lambda: wk.rms_norm([[1.0] * 8], _W, _S), ["x"]),
    "weight_list": (lambda: wk.rms_norm(_X, [1.0] * 8, _S), ["weight"]),
    "weight_int": (lambda: wk.rms_norm(_X, torch.ones(8, dtype=torch.int64), _S), ["weight"]),
    "eps_negative": (lambda: wk.rms_norm(_X, _W, _S, eps=-1.0), ["eps"]),
    "eps_str": (lambda: wk.rms_norm(_X, _W, _S, eps="1e-6"), ["eps"]),
    "weight_other_device": (lambda: wk.rms_norm(_X, torch.ones(8, device="meta"), _S), ["device", "weight"]),
}


@pytest.mark.parametrize("case", list(RMS_BAD))
def test_rms_norm_bad_inputs(case):
    fn, names = RMS_BAD[case]
    raises_naming((ValueError, TypeError), names, fn)


def test_rms_norm_module_defaults():
    m = WiolaRMSNorm(16)
    params = dict(m.named_parameters())
    assert len(params) == 2
    ones = [p for p in params.values() if torch.equal(p, torch.ones(16))]
    zeros = [p for p in params.values() if torch.equal(p, torch.zeros(16))]
    assert len(ones) == 1 and len(zeros) == 1          # γ = 1, δ = 0 at init (SPEC §3)
    assert m.eps == 1e-6                               # SPEC §1 rms_norm_eps
    # forward with trained-looking parameters follows the formula
    with torch.no_grad():
        ones[0].copy_(torch.randn(16))
        zeros[0].copy_(torch.randn(16))
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = m(x)
    assert rel(y, rms_oracle(x.detach(), ones[0].detach(), zeros[0].detach(), 1e-6)) <= tolerance(torch.float32)
    y.sum().backward()
    assert ones[0].grad is not None and zeros[0].grad is not None


def test_rms_norm_module_dtype_and_eps_kwargs():
    m = WiolaRMSNorm(8, eps=1e-3, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in m.parameters())
    x = torch.randn(3, 8, dtype=torch.float64) * 0.01
    w = [p for p in m.parameters() if torch.equal(p, torch.ones(8, dtype=torch.float64))][0]
    s = [p for p in m.parameters() if torch.equal(p, torch.zeros(8, dtype=torch.float64))][0]
    assert rel(m(x), rms_oracle(x, w.detach(), s.detach(), 1e-3)) <= tolerance(torch.float64)


def test_rms_norm_opcheck():
    # The registered ops take no grad (autograd is wk.RMSNormFunction's): plain inputs.
    x = torch.randn(3, 8)
    w = torch.randn(8)
    s = torch.randn(8)
    torch.library.opcheck(torch.ops.wiola.rms_norm.default, (x, w, s, 1e-6))


def test_rms_norm_compile_fullgraph():
    x = torch.randn(4, 16, requires_grad=True)
    w, s = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    f = torch.compile(lambda a, b, c: wk.rms_norm(a, b, c, eps=1e-6), fullgraph=True, backend="aot_eager")
    y = f(x, w, s)
    assert rel(y, rms_oracle(x.detach(), w.detach(), s.detach(), 1e-6)) <= tolerance(torch.float32)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None and s.grad is not None


# ========================================================================================
# Numerics at the edges
# Every CPU backend (reference, cpu): huge and tiny magnitudes, all-zero rows, masked rows,
# and NaN/Inf confinement (a non-finite value in one row never reaches another row or batch
# element, forward or backward). What must hold:
#
# * rms_norm — ``y = γ z / sqrt(mean z² + ε)`` is scale-invariant once ``mean z² ≫ ε``,
#   so ``y(s·x) = y(x)`` for every representable ``s·x``; tiny inputs (``mean z² ≪ ε``)
#   give ``γ z / √ε`` (ε does its job), all-zero rows give exactly 0 and finite
#   gradients. Huge rows too: where the statistic ``Σ z²`` overflows (float32: ``|z| ≳
#   1.8e19/√d``, fp32/bf16 inputs; float64: ``≳ 1.3e154/√d``) a finite row is rescaled by
#   an exact power of two, so y and the gradients match the float64 oracle for every
#   finite z up to the dtype's maximum (gradients work with ẑ = z/r, nothing overflows);
#   rows with NaN/Inf stay non-finite and alone.
# ========================================================================================

def _rms(backend, x, w, s, eps=1e-6, grad=None):
    x = x.clone().requires_grad_(grad is not None)
    w = w.clone().requires_grad_(grad is not None)
    s = s.clone().requires_grad_(grad is not None)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps)
        if grad is None:
            return y.detach(), None
        return y.detach(), torch.autograd.grad(y, (x, w, s), grad)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("scale", [1e-3, 1e3, 1e10, 1e17])
def test_rms_norm_scale_invariant_in_range(backend, scale):
    g = gen()
    x = torch.randn(8, 64, generator=g)
    w, s = torch.rand(64, generator=g) + 0.5, torch.zeros(64)
    y1, _ = _rms(backend, x, w, s, eps=1e-12)
    ys, _ = _rms(backend, x * scale, w, s, eps=1e-12)
    assert finite(ys)
    # eps/mean(z²) ≤ 1e-6 at scale 1e-3: the two outputs agree to the fp32 tolerance.
    assert rel_err(ys, y1) <= tolerance(torch.float32)
    want = reference.rms_norm((x * scale).double(), w.double(), s.double(), 1e-12)
    assert rel_err(ys, want) <= tolerance(torch.float32)


def _rms_rescaled_oracle(x, w, grad, eps=1e-6):
    """float64 ``(y, ∂L/∂x, ∂L/∂γ)`` of rms_norm with δ = 0, row by row: each row is
    first scaled by an exact power of two 2^-k to max|x| < 1, using y(x; ε) = y(2^-k x;
    2^-2k ε) and ∂y/∂x(x; ε) = 2^-k ∂y/∂x(2^-k x; 2^-2k ε), so the float64 reference
    never sees a huge row (nor the code path under test)."""
    wd = w.double()
    ys, gxs, gw = [], [], torch.zeros_like(wd)
    for xr, gr in zip(x.double(), grad.double()):
        c = 2.0 ** -int(torch.frexp(xr.abs().max()).exponent)
        xs, wr = (xr * c).unsqueeze(0).requires_grad_(), wd.clone().requires_grad_()
        y = reference.rms_norm(xs, wr, torch.zeros_like(wd), eps * c * c)
        gx, gwr = torch.autograd.grad(y, (xs, wr), gr.unsqueeze(0))
        ys.append(y[0].detach())
        gxs.append(gx[0] * c)
        gw += gwr
    return torch.stack(ys), torch.stack(gxs), gw


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e20), (torch.float32, 1e30), (torch.float32, 1e38),
                                         (torch.float32, 1.1e38), (torch.bfloat16, 1e37), (torch.float64, 1e200),
                                         (torch.float64, 5e307)])
def test_rms_norm_scale_invariant_huge(backend, dtype, scale):
    """Rows whose Σz² overflows the statistic's dtype (every other row here; |x| up to
    3·scale, i.e. to the dtype's maximum) give y(x) and the float64 oracle's gradients;
    the normal rows beside them are unaffected."""
    g = gen()
    x = torch.randn(8, 64, generator=g, dtype=torch.float64).clamp(-3, 3)
    w, s = torch.rand(64, generator=g) + 0.5, torch.zeros(64)
    huge = [0, 2, 4, 6]
    xs = x.clone()
    xs[huge] *= scale
    x, xs, w, s = x.to(dtype), xs.to(dtype), w.to(dtype), s.to(dtype)
    grad = torch.randn(8, 64, generator=g).to(dtype)
    assert torch.isfinite(xs).all() and torch.isinf(xs[0].double().pow(2).sum().to(dtype).float())
    y1, _ = _rms(backend, x, w, s)
    ys, (gx, gw, gs) = _rms(backend, xs, w, s, grad=grad)
    assert ys.dtype == dtype and finite(ys, gx, gw, gs)
    assert rel_err(ys[huge], y1[huge]) <= max(tolerance(dtype), 1e-5)  # ε/mean z² ~ 1e-6 at scale 1
    want_y, want_gx, want_gw = _rms_rescaled_oracle(xs, w, grad)
    tol = tolerance(dtype)
    gtol = tol * (10 if dtype == torch.bfloat16 else 1)  # the grad sums many rounded terms
    for r in range(8):  # row by row: huge rows' ∂L/∂x are ~1/scale of the others'
        assert rel_err(ys[r], want_y[r]) <= tol, f"y row {r}"
        assert rel_err(gx[r], want_gx[r]) <= gtol, f"grad_x row {r}"
    assert rel_err(gw, want_gw) <= gtol
    assert rel_err(gs, want_gx.sum(0)) <= gtol


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e30), (torch.bfloat16, 1e37), (torch.float64, 1e200)])
def test_rms_norm_huge_row_beside_nonfinite_rows(backend, dtype, scale):
    """A huge (rescaled) row next to a NaN row and an Inf row: the huge row is right,
    the bad rows are non-finite, and the other rows are bitwise what they are alone."""
    g = gen(4)
    x = torch.randn(6, 40, generator=g, dtype=torch.float64)
    x[1] *= scale
    w, s = (torch.rand(40, generator=g) + 0.5).to(dtype), torch.zeros(40, dtype=dtype)
    grad = torch.randn(6, 40, generator=g).to(dtype)
    x = x.to(dtype)
    xb = x.clone()
    xb[3, 5] = float("nan")
    xb[4, 9] = float("inf")
    y0, (gx0, _, _) = _rms(backend, x, w, s, grad=grad)
    y, (gx, _, _) = _rms(backend, xb, w, s, grad=grad)
    clean = [0, 1, 2, 5]
    assert torch.equal(y[clean], y0[clean]) and torch.equal(gx[clean], gx0[clean])
    for bad in (3, 4):
        assert not torch.isfinite(y[bad]).all() and not torch.isfinite(gx[bad]).all()
    want_y, want_gx, _ = _rms_rescaled_oracle(x[1:2], w, grad[1:2])
    assert rel_err(y[1], want_y[0]) <= tolerance(dtype)
    assert rel_err(gx[1], want_gx[0]) <= tolerance(dtype) * (10 if dtype == torch.bfloat16 else 1)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e-30), (torch.float32, 1e-20), (torch.bfloat16, 1e-30),
                                         (torch.float16, 1e-6), (torch.float16, 2e4), (torch.bfloat16, 1e18)])
def test_rms_norm_tiny_and_near_limits_match_float64(backend, dtype, scale):
    """Tiny rows are ε-dominated (y = γz/√ε); fp16 up to ~6e4 and bf16 up to ~1e18 stay exact-ish."""
    g = gen(1)
    x = (torch.randn(8, 48, generator=g).clamp(-3, 3) * scale).to(dtype)
    w, s = (torch.rand(48, generator=g) + 0.5).to(dtype), torch.zeros(48, dtype=dtype)
    grad = torch.randn(8, 48, generator=g).to(dtype)
    y, (gx, gw, gs) = _rms(backend, x, w, s, grad=grad)
    assert finite(y, gx, gw, gs)
    xd, wd, sd = x.double().requires_grad_(), w.double().requires_grad_(), s.double().requires_grad_()
    want = reference.rms_norm(xd, wd, sd, 1e-6)
    assert rel_err(y, want) <= tolerance(dtype)
    wgx, wgw, wgs = torch.autograd.grad(want, (xd, wd, sd), grad.double())
    tol = tolerance(dtype) * (10 if dtype != torch.float32 else 1)  # the grad sums many rounded terms
    for got, ref_g in ((gx, wgx), (gw, wgw), (gs, wgs)):
        # A representable reference: gradients of huge inputs can be tiny, tiny inputs' large.
        if torch.isfinite(ref_g.to(dtype)).all():
            assert rel_err(got, ref_g) <= tol


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_rms_norm_zero_rows_with_zero_shift(backend, dtype):
    """δ = 0 and an all-zero row: y = 0 exactly, gradients finite (∂y/∂x = γ/√ε there)."""
    g = gen(2)
    x = torch.randn(5, 40, generator=g).to(dtype)
    x[1] = 0
    x[4] = 0
    w, s = (torch.rand(40, generator=g) + 0.5).to(dtype), torch.zeros(40, dtype=dtype)
    grad = torch.randn(5, 40, generator=g).to(dtype)
    y, (gx, gw, gs) = _rms(backend, x, w, s, eps=1e-5, grad=grad)
    assert finite(y, gx, gw, gs)
    assert (y[1] == 0).all() and (y[4] == 0).all()
    want_gx = w.double() * grad[1].double() / math.sqrt(1e-5)
    assert rel_err(gx[1], want_gx) <= tolerance(dtype)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_rms_norm_nonfinite_row_is_confined(backend, bad):
    g = gen(3)
    x = torch.randn(6, 40, generator=g)
    w, s = torch.rand(40, generator=g) + 0.5, 0.1 * torch.randn(40, generator=g)
    grad = torch.randn(6, 40, generator=g)
    y0, (gx0, _, _) = _rms(backend, x, w, s, grad=grad)
    xb = x.clone()
    xb[2, 7] = bad
    y, (gx, gw, gs) = _rms(backend, xb, w, s, grad=grad)
    others = [0, 1, 3, 4, 5]
    assert torch.equal(y[others], y0[others]) and torch.equal(gx[others], gx0[others])
    assert not torch.isfinite(y[2]).all()  # the bad row is affected
    # A non-finite gradient in one row reaches only that row of grad_x.
    gb = grad.clone()
    gb[4, 0] = bad
    _, (gx2, _, _) = _rms(backend, x, w, s, grad=gb)
    others = [0, 1, 2, 3, 5]
    assert torch.equal(gx2[others], gx0[others])
    # grad_weight / grad_shift sum over all rows: they are necessarily non-finite then.
    assert not finite(gw, gs)


# ========================================================================================
# Properties (hypothesis): any shape, stride, dtype; bad input names the argument
# ========================================================================================

@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    d=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    how=st.sampled_from(["contiguous", "transposed", "sliced", "expanded"]),
    eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    backend=st.sampled_from(EDGE_BACKENDS), seed=SEEDS,
)
def test_rms_norm_any_shape_stride_dtype(lead, d, dtype, how, eps, scale, backend, seed):
    g = torch.Generator().manual_seed(seed)
    x64 = scale * torch.randn(*lead, d, dtype=torch.float64, generator=g)
    w64 = torch.rand(d, dtype=torch.float64, generator=g) + 0.5
    s64 = 0.3 * scale * torch.randn(d, dtype=torch.float64, generator=g)
    x = strided_view(x64.to(dtype), how)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w64.to(dtype), s64.to(dtype), eps)
    assert y.shape == x.shape and y.dtype == dtype
    # Compare with the reference on the same (rounded) inputs, in float64.
    want = reference.rms_norm(x.double(), w64.to(dtype).double(), s64.to(dtype).double(), eps)
    tol = tolerance(dtype) if d > 1 else tolerance(dtype) * 10
    assert rel_err(y, want) <= tol



@given(
    x_rank=st.integers(0, 3), w_len=st.integers(0, 6), s_len=st.integers(0, 6), d=st.integers(1, 6),
    x_dtype=st.sampled_from([torch.float32, torch.int64, torch.bool]),
    eps=st.sampled_from([1e-6, 0.0, -1.0, "1e-6", None]),
)
def test_rms_norm_bad_input_raises_named_error(x_rank, w_len, s_len, d, x_dtype, eps):
    x = torch.ones(*([2] * x_rank), d).to(x_dtype) if x_rank > 0 else torch.ones(()).to(x_dtype)
    try:
        y = wk.rms_norm(x, torch.ones(w_len), torch.zeros(s_len), eps)
    except (ValueError, TypeError) as exc:
        assert any(name in str(exc) for name in ("x", "weight", "shift", "eps"))
        return
    # Accepted: then it must have been a valid call.
    assert x_dtype == torch.float32 and w_len == s_len == d and isinstance(eps, float) and eps > 0
    assert y.shape == x.shape


# ========================================================================================
# Bitwise determinism of the C++ kernel, 1 vs 2 threads (helpers.run_on_thread_counts)
# ========================================================================================

@needs_cpu_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rms_norm_bitwise_reproducible(dtype):
    g = gen(0)
    rows, d = 3001, 320  # many rows: dweight/dshift are reductions across threads' chunks
    x = torch.randn(rows, d, generator=g).to(dtype)
    w, s = (torch.rand(d, generator=g) + 0.5).to(dtype), torch.randn(d, generator=g).to(dtype)
    grad = torch.randn(rows, d, generator=g).to(dtype)

    def fn(x, w, s):
        return wk.rms_norm(x, w, s), grad

    assert_bitwise(run_on_thread_counts(fn, [x, w, s]), ["y", "grad_x", "grad_weight", "grad_shift"])


# ========================================================================================
# On a GPU (skipped without one)
# ========================================================================================

@gpu_only
@pytest.mark.parametrize("dtype", shapes.RMS_NORM_GPU_TEST_DTYPES)
@pytest.mark.parametrize("shape", shapes.RMS_NORM_GPU_TEST_SHAPES)  # what gpu-report compiles ahead of time
def test_rms_norm_triton_vs_float64(shape, dtype):
    d = shape[-1]
    x = torch.randn(shape, dtype=torch.float64)
    w, s = torch.rand(d, dtype=torch.float64) + 0.5, 0.3 * torch.randn(d, dtype=torch.float64)
    g = torch.randn(shape, dtype=torch.float64)
    with wk.use_backend("triton"):
        outs, grads = forward_backward(wk.rms_norm, [t.to("cuda", dtype) for t in (x, w, s)], [g.to("cuda", dtype)])
    ref_outs, ref_grads = forward_backward(reference.rms_norm, [x, w, s], [g])
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert_close_rel(got.cpu(), want, tolerance(dtype))


@gpu_only
def test_gpu_backwards_are_bitwise_reproducible():
    x = torch.randn(4097, 1024, device="cuda")
    w, s = torch.rand(1024, device="cuda") + 0.5, torch.randn(1024, device="cuda")
    g = torch.randn_like(x)
    runs = [forward_backward(wk.rms_norm, [x, w, s], [g])[1] for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
