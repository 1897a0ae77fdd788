"""WiolaRMSNorm (SPEC §3, §9): every available backend against the float64 reference,
and the reference against an independent row-by-row oracle."""

from __future__ import annotations

import math
import os

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import reference
from wiola_kernels.testing import assert_close_rel, available_backends, rel_err, tolerance

BACKENDS = available_backends("rms_norm", "cpu")
# Triton runs in the numpy interpreter on the CPU: give it small shapes only.
# d = 1 is left to test_single_feature_rows: there ∂L/∂x ≈ 0 is pure cancellation.
SHAPES = {"default": [(1, 3), (1, 7), (37, 192), (5, 760), (2, 3, 50), (1151, 33)],
          "triton": [(1, 3), (3, 7), (9, 130), (2, 3, 50)]}


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
    assert_close_rel(reference.rms_norm(x, w, s, 1e-6), naive_rms_norm(x, w, s, 1e-6), 1e-13)


def test_reference_hand_worked_row():
    # x = (3, 4) - δ with δ = (1, -1): z = (3, 4), mean z² = 12.5, r = sqrt(12.5 + ε).
    x = torch.tensor([[2.0, 5.0]], dtype=torch.float64)
    s = torch.tensor([1.0, -1.0], dtype=torch.float64)
    w = torch.tensor([2.0, 0.5], dtype=torch.float64)
    r = math.sqrt(12.5 + 1e-6)
    expected = torch.tensor([[2.0 * 3 / r, 0.5 * 4 / r]], dtype=torch.float64)
    assert_close_rel(reference.rms_norm(x, w, s, 1e-6), expected, 1e-15)


def test_reference_explicit_backward_matches_autograd():
    x, w, s = make((6, 11), torch.float64)
    x, w, s = (t.requires_grad_() for t in (x, w, s))
    g = torch.randn(6, 11, dtype=torch.float64)
    reference.rms_norm(x, w, s, 1e-6).backward(g)
    y, rstd = reference.rms_norm_forward(x.detach(), w.detach(), s.detach(), 1e-6)
    dx, dw, ds = reference.rms_norm_backward(g, x.detach(), w.detach(), s.detach(), rstd)
    for got, want, name in ((dx, x.grad, "dx"), (dw, w.grad, "dweight"), (ds, s.grad, "dshift")):
        assert_close_rel(got, want, 1e-13, name)


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
@pytest.mark.parametrize("backend", BACKENDS)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_feature_rows(backend):
    """d = 1: y = γ z / sqrt(z² + ε), i.e. ≈ γ·sign(z)."""
    x, w, s = make((6, 1), torch.float32)
    y, *_ = run(backend, x, w, s)
    assert_close_rel(y, reference.rms_norm(x.double(), w.double(), s.double(), 1e-6), 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
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
    assert_close_rel(y, y64, 1e-2)
    assert_close_rel(dw, dw64, 1e-2)
    assert_close_rel(ds, ds64, 1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
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
        assert_close_rel(got, want, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows_and_zero_input(backend):
    # All-zero rows with δ = 0: ε keeps r > 0, so the output is 0, not NaN.
    x = torch.zeros(3, 16)
    w, s = torch.ones(16), torch.zeros(16)
    y, dx, dw, ds = run(backend, x, w, s, grad=torch.randn(3, 16))
    assert torch.equal(y, torch.zeros(3, 16)) and torch.isfinite(dx).all()
    # No rows at all.
    y, dx, dw, ds = run(backend, torch.zeros(0, 16), w, s, grad=torch.zeros(0, 16))
    assert y.shape == (0, 16) and torch.equal(dw, torch.zeros(16)) and torch.equal(ds, torch.zeros(16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_stays_in_its_row(backend):
    x, w, s = make((4, 24), torch.float32)
    x[1, 3] = float("nan")
    y, *_ = run(backend, x, w, s)
    assert torch.isnan(y[1]).all()
    assert torch.isfinite(y[[0, 2, 3]]).all()


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e25), (torch.float32, 2e38), (torch.bfloat16, 1e37),
                                         (torch.float64, 1e300)])
@pytest.mark.parametrize("backend", BACKENDS)
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


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_backward_is_bitwise_reproducible(backend):
    x, w, s = make((300, 96), torch.float32)
    g = torch.randn(300, 96)
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
    x.requires_grad_()
    w.requires_grad_()
    s.requires_grad_()
    with wk.use_backend(backend):
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
        assert_close_rel(b, a, 1e-6)


def test_module_parameters_and_init():
    norm = wk.WiolaRMSNorm(10, eps=1e-5)
    assert dict(norm.named_parameters()).keys() == {"weight", "shift"}
    assert torch.equal(norm.weight, torch.ones(10)) and torch.equal(norm.shift, torch.zeros(10))
    assert "10, eps=1e-05" in repr(norm)
    x = torch.randn(2, 10)
    assert_close_rel(norm(x), reference.rms_norm(x.double(), norm.weight.double(), norm.shift.double(), 1e-5), 1e-5)
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


# --- options for Hugging Face models (issue 13): δ absent, HF's rounding order ----------

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
@pytest.mark.parametrize("backend", BACKENDS)
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
            torch.library.opcheck(torch.ops.wiola.rms_norm.default, (x, w.requires_grad_(), None, 1e-6, hf_order))


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
@pytest.mark.parametrize("dtype, rows", [(torch.float32, 4096), (torch.bfloat16, 8192)])
def test_cpu_outputs_large_enough_to_stream(dtype, rows):
    """16 MiB outputs: y and ∂x take the non-temporal-store path (bf16 also converts on the
    fly); against the float64 reference, and bitwise the same on 1 thread as on all."""
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
