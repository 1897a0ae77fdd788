"""WiolaRMSNorm (SPEC §3, §9): what only rms_norm has. The properties every op shares
(forward and backward against the float64 oracle per backend and dtype, strided inputs,
gradcheck, bitwise determinism across thread counts, unmodified inputs) are in
tests/test_all_ops.py; opcheck, torch.compile and the bad-input messages every backend
shares in tests/test_op_layer.py. The oracle is tests/oracles.py's ``rms_oracle``."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wiola_kernels as wk
from wiola_kernels import shapes
from wiola_kernels.testing import (assert_close_rel, available_backends, available_cpu_isas, cpu_isa, rel_err,
                                   tolerance)

from helpers import backend_variants, finite, forward_backward, gen, gpu_only, on_backend, strided_view
from op_cases import F64, OpCase, Public, randn64
from oracles import rms_oracle

BACKENDS = available_backends("rms_norm", "cpu")
# The C++ CPU backend once per instruction set its loops run here (csrc/cpu/isa.h): bf16 rows
# have separate AVX2 and AVX-512 (with BF16) loops. `backend` below is then "cpu/avx2", "cpu/avx512_bf16".
CPU_ISAS = available_cpu_isas("rms_norm")
BACKEND_ISAS = backend_variants("rms_norm")


def make(shape, dtype, seed=0):
    g = gen(seed)
    d = shape[-1]
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    w = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    s = 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype), s.to(dtype)


def run(backend, x, w, s, eps=1e-6, grad=None, **kw):
    """y and (with ``grad``) ∂x, ∂γ, ∂δ (None without δ) of wk.rms_norm on a backend variant."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, s)]  # same strides
    with on_backend(backend):
        y = wk.rms_norm(*leaves, eps, **kw)
        if grad is not None:
            y.backward(grad)
    return (y.detach(), *(t.grad if t is not None else None for t in leaves))


def want(x, w, s, eps=1e-6, grad=None):
    """The oracle's y, ∂x, ∂γ, ∂δ on the same (rounded) inputs, in float64."""
    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, w, s)]
    y = rms_oracle(*leaves, eps)
    if grad is None:
        return (y.detach(),)
    grads = torch.autograd.grad(y, [t for t in leaves if t is not None], grad.double())
    return (y.detach(), *grads)


# --- the formula ----------------------------------------------------------------------

def test_oracle_hand_worked_row():
    # x = (3, 4) - δ with δ = (1, -1): z = (3, 4), mean z² = 12.5, r = sqrt(12.5 + ε).
    x = torch.tensor([[2.0, 5.0]], dtype=torch.float64)
    s = torch.tensor([1.0, -1.0], dtype=torch.float64)
    w = torch.tensor([2.0, 0.5], dtype=torch.float64)
    r = math.sqrt(12.5 + 1e-6)
    expected = torch.tensor([[2.0 * 3 / r, 0.5 * 4 / r]], dtype=torch.float64)
    assert_close_rel(rms_oracle(x, w, s, 1e-6), expected, 1e-15)


def test_gradient_is_spec_formula_not_paper_eq10():
    """SPEC §3: ∂L/∂z_i = (1/r)(γ_i g_i − z_i/(d r²) Σ_k γ_k g_k z_k), ∂L/∂γ = Σ g z / r. The
    oracle's gradient (which every backend meets, tests/test_all_ops.py) is that closed form;
    putting γ_i on both terms (the paper's printed eq. 10) is not."""
    d, eps = 12, 1e-6
    x, w, s = make((4, d), torch.float64)
    w = w + 1.5
    g = torch.randn(4, d, generator=gen(1), dtype=torch.float64)
    y, dx, dw, ds = want(x, w, s, eps, grad=g)
    z = x + s
    r = torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    dz = (w * g - z / (d * r * r) * (w * g * z).sum(-1, keepdim=True)) / r
    assert_close_rel(dx, dz, 1e-13)
    assert_close_rel(ds, dz.sum(0), 1e-13)
    assert_close_rel(dw, (g * z / r).sum(0), 1e-13)
    paper = w / r * (g - z / r**2 * (g * z).sum(-1, keepdim=True) / d)
    assert rel_err(paper, dz) > 1e-3


# --- what only rms_norm's kernels do ----------------------------------------------------

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
    # g along ẑ: the projection term c = Σγgẑ/d is O(1), not O(1/√d), so an error in it shows.
    z = x.double() + s.double()
    g = (z / z.abs().amax(-1, keepdim=True) + 0.5 * torch.randn(5, 8193, dtype=torch.float64, generator=gen(4))).float()
    for a, b, name in zip(run("triton", x, w, s, grad=g), want(x, w, s, grad=g), ("y", "dx", "dweight", "dshift")):
        assert_close_rel(a, b, tolerance(torch.float32), name)


@pytest.mark.parametrize("backend", BACKEND_ISAS)
def test_single_feature_rows(backend):
    """d = 1: y = γ z / sqrt(z² + ε), i.e. ≈ γ·sign(z); ∂L/∂x ≈ 0 is pure cancellation there."""
    x, w, s = make((6, 1), torch.float32)
    assert_close_rel(run(backend, x, w, s)[0], want(x, w, s)[0], tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKEND_ISAS)
def test_mixed_precision_params(backend):
    """bf16 activations with float32 γ/δ (the usual mixed-precision setup): output in
    bf16, parameter gradients in float32."""
    x, _, _ = make((5, 40), torch.bfloat16)
    _, w, s = make((5, 40), torch.float32)
    g = torch.randn(5, 40, generator=gen(2)).bfloat16()
    y, dx, dw, ds = run(backend, x, w, s, grad=g)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16
    assert dw.dtype == torch.float32 and ds.dtype == torch.float32
    for got, ref in zip((y, dx, dw, ds), want(x, w, s, grad=g)):
        assert_close_rel(got, ref, tolerance(torch.bfloat16))


@pytest.mark.parametrize("backend", BACKEND_ISAS)
def test_zero_rows_and_no_rows(backend):
    """δ = 0 and all-zero rows: ε keeps r > 0, so y = 0 exactly and ∂L/∂x = γ g/√ε there;
    no rows at all: ∂γ = ∂δ = 0."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.randn(5, 40, generator=gen(2)).to(dtype)
        x[1] = 0
        x[4] = 0
        w, s = (torch.rand(40, generator=gen(3)) + 0.5).to(dtype), torch.zeros(40, dtype=dtype)
        grad = torch.randn(5, 40, generator=gen(4)).to(dtype)
        y, gx, gw, gs = run(backend, x, w, s, eps=1e-5, grad=grad)
        assert finite(y, gx, gw, gs)
        assert (y[1] == 0).all() and (y[4] == 0).all()
        assert_close_rel(gx[1], w.double() * grad[1].double() / math.sqrt(1e-5), tolerance(dtype), str(dtype))
    y, _, gw, gs = run(backend, torch.zeros(0, 16), w[:16].float(), s[:16].float(), grad=torch.zeros(0, 16))
    assert y.shape == (0, 16) and torch.equal(gw, torch.zeros(16)) and torch.equal(gs, torch.zeros(16))


@pytest.mark.parametrize("backend", BACKEND_ISAS)
def test_nonfinite_row_is_confined(backend):
    """A NaN/Inf in one row of x (beside a huge, rescaled row) changes no other row of y or
    ∂L/∂x, bit for bit; a non-finite gradient row reaches only that row of ∂L/∂x (∂γ, ∂δ sum
    over rows: non-finite then)."""
    x, w, s = make((6, 40), torch.float32, seed=3)
    x[1] *= 1e30
    grad = torch.randn(6, 40, generator=gen(4))
    y0, gx0, _, _ = run(backend, x, w, s, grad=grad)
    for bad in (float("nan"), float("inf"), -float("inf")):
        xb = x.clone()
        xb[2, 7] = bad
        y, gx, _, _ = run(backend, xb, w, s, grad=grad)
        others = [0, 1, 3, 4, 5]
        assert torch.equal(y[others], y0[others]) and torch.equal(gx[others], gx0[others]), bad
        assert not torch.isfinite(y[2]).all() and not torch.isfinite(gx[2]).all(), bad
        gb = grad.clone()
        gb[4, 0] = bad
        _, gx2, gw, gs = run(backend, x, w, s, grad=gb)
        others = [0, 1, 2, 3, 5]
        assert torch.equal(gx2[others], gx0[others]) and not finite(gw, gs), bad


def _rescaled_oracle(x, w, s, grad, eps=1e-6):
    """float64 ``(y, ∂L/∂x, ∂L/∂γ, ∂L/∂δ)`` row by row, each row first scaled by an exact
    power of two c = 2^-k to max|x| < 1, using y(x, δ; ε) = y(cx, cδ; c²ε) and
    ∂y/∂x(x; ε) = c ∂y/∂x(cx; c²ε): the float64 oracle never sees a huge (or tiny) row."""
    ys, gxs = [], []
    gw, gs = torch.zeros(x.shape[-1], dtype=torch.float64), torch.zeros(x.shape[-1], dtype=torch.float64)
    for xr, gr in zip(x.double(), grad.double()):
        c = 2.0 ** -int(torch.frexp(xr.abs().max()).exponent)
        y, gx, gwr, _ = want((xr * c)[None], w.double(), s.double() * c, eps * c * c, grad=gr[None])
        ys.append(y[0])
        gxs.append(gx[0] * c)
        gw += gwr
        gs += gx[0] * c
    return torch.stack(ys), torch.stack(gxs), gw, gs


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e-30), (torch.float32, 1e17), (torch.float32, 1e30),
                                         (torch.float32, 1.1e38), (torch.bfloat16, 1e-30), (torch.bfloat16, 1e37),
                                         (torch.float16, 1e-6), (torch.float16, 2e4), (torch.float64, 5e307)])
@pytest.mark.parametrize("backend", BACKEND_ISAS)
def test_any_magnitude_matches_float64(backend, dtype, scale):
    """Every other row scaled by ``scale`` (|x| up to 3·scale): tiny rows are ε-dominated
    (y = γz/√ε); in range y is scale-invariant; where Σz² overflows the statistic's dtype
    (float32: |z| ≳ 1.8e19/√d; float64: ≳ 1.3e154/√d) the kernel rescales the row by a
    power of two. y, the gradients and rstd match the float64 oracle; the normal rows
    beside are unaffected."""
    g = gen(5)
    x = torch.randn(8, 48, generator=g, dtype=torch.float64).clamp(-3, 3)
    x[::2] *= scale
    w, s = torch.rand(48, generator=g, dtype=torch.float64) + 0.5, 0.3 * torch.randn(48, generator=g, dtype=torch.float64)
    s *= min(scale, 1.0)  # tiny rows: δ no larger than x
    grad = torch.randn(8, 48, generator=g)
    x, w, s, grad = x.to(dtype), w.to(dtype), s.to(dtype), grad.to(dtype)
    assert torch.isfinite(x).all()
    got = run(backend, x, w, s, grad=grad)
    assert got[0].dtype == dtype and finite(*got)
    tol = tolerance(dtype)
    gtol = tol * (1 if dtype in (torch.float32, torch.float64) else 10)  # the grads sum many rounded terms
    wy, wgx, wgw, wgs = _rescaled_oracle(x, w, s, grad)
    for r in range(8):  # row by row: huge rows' ∂L/∂x are ~1/scale of the others'
        assert rel_err(got[0][r], wy[r]) <= tol, f"y row {r}"
        if torch.isfinite(wgx[r].to(dtype)).all():  # a representable gradient
            assert rel_err(got[1][r], wgx[r]) <= gtol, f"grad x row {r}"
    assert rel_err(got[2], wgw) <= gtol and rel_err(got[3], wgs) <= gtol
    if backend.startswith("cpu/"):  # rstd (the registered op's): subnormal once r > 2^126 in float32
        _, rstd = torch.ops.wiola.rms_norm(x, w, s, 1e-6)
        z = x.double() + s.double()
        c = torch.tensor([2.0 ** -int(torch.frexp(row.abs().max()).exponent) for row in z], dtype=torch.float64)
        rstd_want = c / torch.sqrt((z * c[:, None]).pow(2).mean(-1) + 1e-6 * c * c)
        assert ((rstd.double() - rstd_want).abs() <= 2.0**-20 * rstd_want).all()


@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    d=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    how=st.sampled_from(["contiguous", "transposed", "sliced", "expanded"]),
    eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    shift=st.booleans(),
    backend=st.sampled_from([b for b in BACKEND_ISAS if b != "triton"]), seed=st.integers(0, 2**32 - 1),
)
def test_any_shape_stride_dtype(lead, d, dtype, how, eps, scale, shift, backend, seed):
    g = gen(seed)
    x64 = scale * torch.randn(*lead, d, dtype=torch.float64, generator=g)
    w64 = torch.rand(d, dtype=torch.float64, generator=g) + 0.5
    s64 = 0.3 * scale * torch.randn(d, dtype=torch.float64, generator=g) if shift else None
    x = strided_view(x64.to(dtype), how)
    w, s = w64.to(dtype), None if s64 is None else s64.to(dtype)
    y = run(backend, x, w, s, eps)[0]
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, want(x, w, s, eps)[0]) <= tolerance(dtype) * (10 if d == 1 else 1)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs the C++ extension")
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype, rows", [(torch.float32, 4096), (torch.bfloat16, 8192)])
def test_cpu_outputs_large_enough_to_stream(dtype, rows, isa):
    """16 MiB outputs: y and ∂x take the non-temporal-store path (bf16 also converts on the
    fly); against the float64 oracle, and bitwise the same on 1 thread as on all."""
    x, w, s = make((rows, 1024), dtype, seed=21)
    g = torch.randn(rows, 1024, generator=gen(22)).to(dtype)
    got = run(f"cpu/{isa}", x, w, s, grad=g)
    for name, a, b in zip(("y", "grad_x", "grad_weight", "grad_shift"), got, want(x, w, s, grad=g)):
        assert a.dtype == dtype
        assert_close_rel(a, b, tolerance(dtype), name)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(f"cpu/{isa}", x, w, s, grad=g)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(got, single)), "depends on the thread count"


# --- module, registration, bad input -----------------------------------------------------

def test_module_parameters_init_and_kwargs():
    norm = wk.WiolaRMSNorm(10, eps=1e-5)
    assert dict(norm.named_parameters()).keys() == {"weight", "shift"}
    assert torch.equal(norm.weight, torch.ones(10)) and torch.equal(norm.shift, torch.zeros(10))  # SPEC §3
    assert "10, eps=1e-05" in repr(norm) and wk.WiolaRMSNorm(4).eps == 1e-6  # SPEC §1 rms_norm_eps
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.shift.normal_(0, 0.1)
    x = torch.randn(2, 5, 10, requires_grad=True)
    y = norm(x)
    assert_close_rel(y, rms_oracle(x.detach(), norm.weight.detach(), norm.shift.detach(), 1e-5), tolerance(torch.float32))
    y.sum().backward()
    assert norm.weight.grad is not None and norm.shift.grad is not None
    assert all(p.dtype == torch.float64 for p in wk.WiolaRMSNorm(8, dtype=torch.float64).parameters())
    with pytest.raises(ValueError, match="hidden_size"):
        wk.WiolaRMSNorm(0)


def test_opcheck_without_shift_in_hf_order():
    # tests/test_op_layer.py checks the op with a shift in the default order.
    x, w, _ = make((5, 33), torch.float32, seed=11)
    torch.library.opcheck(torch.ops.wiola.rms_norm.default, (x, w, None, 1e-6, True))


# Only what tests/test_op_layer.py's table of messages does not hold.
@pytest.mark.parametrize(
    "make_args, error, match",
    [
        (lambda: (torch.randn(4, 8), torch.ones(8, 8), torch.zeros(8)), ValueError, "weight"),
        (lambda: (torch.randint(0, 3, (4, 8)), torch.ones(8), torch.zeros(8)), TypeError, "x must have dtype"),
        (lambda: (torch.ones(3, 8, dtype=torch.complex64), torch.ones(8), torch.zeros(8)), TypeError, "x must have dtype"),
        (lambda: (torch.randn(4, 8), torch.ones(8, dtype=torch.int64), torch.zeros(8)), TypeError, "weight"),
        (lambda: ([[1.0] * 8], torch.ones(8), torch.zeros(8)), TypeError, "x must be a torch.Tensor"),
        (lambda: (torch.randn(4, 8), [1.0] * 8, torch.zeros(8)), TypeError, "weight must be a torch.Tensor"),
        (lambda: (torch.randn(4, 8), torch.ones(8, device="meta"), torch.zeros(8)), ValueError, "weight must be on"),
        (lambda: (torch.randn(4, 8), torch.ones(8), torch.zeros(8), "1e-6"), TypeError, "eps"),
        (lambda: (torch.randn(4, 8), torch.ones(8), torch.zeros(8), 0.0), ValueError, "eps"),
        (lambda: (torch.randn(4, 8), torch.ones(8), torch.zeros(8), float("inf")), ValueError, "eps"),
    ],
)
def test_bad_inputs(make_args, error, match):
    with pytest.raises(error, match=match):
        wk.rms_norm(*make_args())


@given(
    x_rank=st.integers(0, 3), w_len=st.integers(0, 6), s_len=st.integers(0, 6), d=st.integers(1, 6),
    x_dtype=st.sampled_from([torch.float32, torch.int64, torch.bool]),
    eps=st.sampled_from([1e-6, 0.0, -1.0, "1e-6", None]),
)
def test_bad_input_raises_named_error(x_rank, w_len, s_len, d, x_dtype, eps):
    x = torch.ones(*([2] * x_rank), d).to(x_dtype) if x_rank > 0 else torch.ones(()).to(x_dtype)
    try:
        y = wk.rms_norm(x, torch.ones(w_len), torch.zeros(s_len), eps)
    except (ValueError, TypeError) as exc:
        assert any(name in str(exc) for name in ("x", "weight", "shift", "eps"))
        return
    # Accepted: then it must have been a valid call.
    assert x_dtype == torch.float32 and w_len == s_len == d and isinstance(eps, float) and eps > 0
    assert y.shape == x.shape


# --- options for Hugging Face models: δ absent, HF's rounding order ----------------------

def _ulp_distance(a, b):
    """|a − b| in units in the last place, elementwise, for same-dtype floats (sign-magnitude
    bit patterns mapped to a monotone integer line)."""
    assert a.dtype == b.dtype
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    def line(t):
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & (2 ** (8 * t.element_size() - 1) - 1)), i)
    return (line(a) - line(b)).abs()


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
    shapes_ = [(7, 130), (3, 512)] if backend == "triton" else [(37, 192), (64, 1024), (5, 760)]
    for shape in shapes_:
        x, w, _ = make(shape, dtype, seed=7)
        y = run(backend, x, w, None, hf_order=True)[0]
        dist = _ulp_distance(y, rms_oracle(x, w, None, 1e-6, hf_order=True))
        assert int(dist.max()) <= _max_ulp(backend, dtype), f"{shape}: {int(dist.max())} ulp from HF"
        if _max_ulp(backend, dtype) == 1:
            exact = float((dist == 0).double().mean())
            assert exact >= 0.99, f"{shape}: only {exact:.3f} of the outputs equal HF's"
        # And it is still RMSNorm: SPEC §9 against float64.
        assert_close_rel(y, want(x, w, None)[0], tolerance(dtype), f"y {shape} vs float64")
    if dtype == torch.bfloat16:  # the option is real: our default order (one rounding) differs somewhere
        x, w, _ = make((64, 256), dtype, seed=8)
        assert (run(backend, x, w, None)[0] != run(backend, x, w, None, hf_order=True)[0]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_order_with_shift_matches_the_rounding_oracle(backend):
    """bf16 with a shift δ large enough to move every row's statistics: the HF-order oracle
    adds δ before normalising (an oracle that dropped δ is far off, and this test fails on
    it), and the op rounds as that oracle does, to within one ulp."""
    x, w, s = make((37, 192), torch.bfloat16, seed=11)
    s = (s.float() * 10).to(torch.bfloat16)
    y = run(backend, x, w, s, hf_order=True)[0]
    assert int(_ulp_distance(y, rms_oracle(x, w, s, 1e-6, hf_order=True)).max()) <= _max_ulp(backend, torch.bfloat16)
    assert rel_err(rms_oracle(x, w, None, 1e-6, hf_order=True), want(x, w, s)[0]) > 0.1  # δ matters here


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_order_with_shift_and_gradients(backend):
    x, w, s = make((9, 130), torch.float32, seed=9)
    g = torch.randn(9, 130, generator=gen(10))
    got = run(backend, x, w, s, grad=g, hf_order=True)
    for a, b, what in zip(got, want(x, w, s, grad=g), ("y", "grad x", "grad weight", "grad shift")):
        assert_close_rel(a, b, tolerance(torch.float32), what)


def test_plain_rms_norm_module_shares_weight_and_promotes_like_hf():
    w = torch.nn.Parameter(torch.rand(16, generator=gen(12)) + 0.5)
    mod = wk.RMSNorm(eps=1e-5, hf_order=True, weight=w)
    assert mod.weight is w and mod.variance_epsilon == 1e-5
    x = torch.randn(3, 16, generator=gen(13)).to(torch.bfloat16)
    y = mod(x)  # float32 γ, bf16 x: HF returns float32 γ·round_bf16(x/r)
    assert y.dtype == torch.float32
    assert rel_err(y, rms_oracle(x, w, None, 1e-5, hf_order=True)) <= 2.0**-8  # at most a bf16 ulp of x/r apart
    assert list(dict(mod.named_parameters())) == ["weight"]
    with pytest.raises(TypeError, match="weight"):
        wk.RMSNorm(eps=1e-5, weight=torch.ones(4))


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
        got = {isa: run(f"cpu/{isa}", x, w, s if shift else None, grad=g) for isa in CPU_ISAS}
        for name, a, b in zip(("y", "dx", "dweight", "dshift"), got["avx2"], got["avx512_bf16"]):
            if a is None:
                continue
            if a.dtype == torch.bfloat16:  # one ulp: 2^-7 relative to the larger magnitude
                ulp = torch.maximum(a.float().abs(), b.float().abs()) * 2.0**-7
                assert ((a.float() - b.float()).abs() <= ulp).all(), f"{shape} {name}"
            else:
                assert_close_rel(a, b.double(), 1e-6, f"{shape} {name}")


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
    want_y = ((w * z) * rstd[:, None]).to(torch.bfloat16)
    sub = (want_y[:3].float() != 0) & (want_y[:3].float().abs() < 2.0**-126)
    assert sub.sum() > 50, "the case must produce subnormal outputs"
    assert torch.equal(y[:3].view(torch.int16), want_y[:3].view(torch.int16))
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


# --- on a GPU (skipped without one) ----------------------------------------------------

@gpu_only
@pytest.mark.parametrize("dtype", shapes.RMS_NORM_GPU_TEST_DTYPES)
@pytest.mark.parametrize("shape", shapes.RMS_NORM_GPU_TEST_SHAPES)  # what gpu-report compiles ahead of time
def test_rms_norm_triton_vs_float64(shape, dtype):
    x, w, s = make(shape, torch.float64)
    g = torch.randn(shape, dtype=torch.float64)
    with wk.use_backend("triton"):
        outs, grads = forward_backward(wk.rms_norm, [t.to("cuda", dtype) for t in (x, w, s)], [g.to("cuda", dtype)])
    for got, ref in zip(outs + grads, want(x, w, s, grad=g)):
        assert_close_rel(got.cpu(), ref, tolerance(dtype))


@gpu_only
def test_gpu_backwards_are_bitwise_reproducible():
    x = torch.randn(4097, 1024, device="cuda")
    w, s = torch.rand(1024, device="cuda") + 0.5, torch.randn(1024, device="cuda")
    g = torch.randn_like(x)
    runs = [forward_backward(wk.rms_norm, [x, w, s], [g])[1] for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


# --- this op in the shared suites: its OpCase (tests/op_cases.py collects CASE for
# tests/test_all_ops.py and tests/test_op_layer.py) -------------------------------------------

def _rms_make(shape, dtype, seed, shift=True):
    """``shift=False``: no δ (its own kernel path)."""
    g = gen(seed)
    d = shape[-1]
    x, w, s = randn64(*shape, g=g), torch.rand(d, generator=g, dtype=F64) + 0.5, randn64(d, g=g, scale=0.3)
    return dict(x=x.to(dtype), weight=w.to(dtype), shift=s.to(dtype) if shift else None, eps=1e-6)


def _rms_views(shape, dtype, seed):
    """x a strided view both ways (transposed, every other column), γ and δ every other
    element of one tensor, the output gradient transposed."""
    g = gen(seed)
    rows, d = shape
    x = randn64(2 * d, rows, g=g).t()[:, ::2]
    wd = torch.rand(2 * d, generator=g, dtype=F64) + 0.5
    grad = randn64(d, rows, g=g).t()
    return dict(x=x.to(dtype), weight=wd[::2].to(dtype), shift=(0.1 * wd[1::2]).to(dtype), eps=1e-6), [grad.to(dtype)]


def _rms_calls(a, ops):
    fwd = (a["x"], a["weight"], a["shift"], a["eps"], a["hf_order"])
    _, rstd = ops.rms_norm(*fwd)
    return [(ops.rms_norm.default, fwd),
            (ops.rms_norm_backward.default, (torch.randn_like(a["x"]), a["x"], a["weight"], a["shift"], rstd))]


def _rms_bad(a):
    return [
        (dict(x=a["x"].long()), TypeError, r"^x must have dtype in \(float32, float64, bfloat16, float16\), got int64"),
        (dict(weight=a["weight"][:4]), ValueError, r"^weight must have shape \(d,\) = \(8,\), got \(4,\)"),
        (dict(shift=a["shift"][None]), ValueError, r"^shift must have shape \(d,\) = \(8,\), got \(1, 8\)"),
        (dict(x=torch.tensor(1.0)), ValueError, r"^x must have shape \(\.\.\., d\) \(at least 1 dimension\), got a 0-d tensor"),
        (dict(x=torch.zeros(3, 0), weight=torch.ones(0), shift=torch.zeros(0)), ValueError, r"^x must have a non-empty last dimension d, got d = 0"),
        (dict(eps=-1e-6), ValueError, r"^eps must be a finite number > 0, got -1e-06"),
        (dict(eps=float("nan")), ValueError, r"^eps must be a finite number > 0, got nan"),
    ]


CASE = OpCase(
    _rms_make, lambda a: (wk.rms_norm(**a),),
    dict(default=[(1, 3), (7,), (37, 192), (5, 760), (2, 3, 50), (1151, 33)],
         triton=[(1, 3), (3, 7), (9, 130), (2, 3, 50)], gradcheck=[(2, 3, 9)], threads=[(3001, 320)],
         views=[(30, 20)], dynamic=[(2, 3, 16), (2, 5, 16)], concurrent=[(64, 200)], gpu=[(5, 33)],
         layer=[(3, 5, 8)]),
    (Public("rms_norm", wk.RMSNormFunction, _rms_calls, _rms_bad),),
    variants=(dict(shift=True), dict(shift=False)),
    oracle=lambda a: (rms_oracle(a["x"], a["weight"], a["shift"], a["eps"]),), views=_rms_views)
