"""Residual add + WiolaRMSNorm (SPEC §10.3, §9): what only add_rms_norm has. Forward and
backward of every backend against the float64 oracle in every dtype, strided inputs,
gradcheck and the C++ kernels' bits on any thread count are tests/test_all_ops.py's; opcheck,
torch.compile and the bad-input messages tests/test_op_layer.py's. Here: y as the norm of
the *rounded* sum, Triton's wide rows, one output unused, hf_order on views and the CPU
kernel's copies, rows whose Σz² overflows, NaN, the opcheck without ∂s and δ."""

from __future__ import annotations

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import shapes
from wiola_kernels.testing import (CopyCounter, assert_close_rel, available_backends, available_cpu_isas, cpu_isa,
                                   tolerance)

from helpers import forward_backward, gen, gpu_only
from op_cases import F64, OpCase, Public, randn64
from oracles import add_rms_norm_oracle, rms_oracle

BACKENDS = available_backends("add_rms_norm", "cpu")
CPU_ISAS = available_cpu_isas("add_rms_norm")
BACKEND_ISAS = [f"cpu/{isa}" for isa in CPU_ISAS if "cpu" in BACKENDS] + [b for b in BACKENDS if b != "cpu"]


@pytest.fixture
def backend(request):
    """A backend of BACKEND_ISAS, with the CPU kernels held to the named instruction set."""
    name, _, isa = request.param.partition("/")
    with cpu_isa(isa or None):
        yield name


def interpreted_bf16(backend, dtype):
    """Triton's CPU interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to
    nearest even, as PyTorch does): its bf16 s is not bit for bit PyTorch's x + residual."""
    return backend == "triton" and dtype == torch.bfloat16 and wk.dispatch.triton_interpret_mode()


def make(shape, dtype, seed=0):
    g = gen(seed)
    d = shape[-1]
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    residual = 2 * torch.randn(shape, generator=g, dtype=torch.float64)
    w = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    s = 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    return x.to(dtype), residual.to(dtype), w.to(dtype), s.to(dtype)


def run(backend, x, residual, w, shift, grads=None, eps=1e-6, hf_order=False):
    """``(y, s)`` and, with ``grads = (g_y, g_s)`` (either may be None: that output unused),
    the gradients of x, residual, weight, shift."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, residual, w, shift)]
    with wk.use_backend(backend):
        y, s = wk.add_rms_norm(*leaves, eps, hf_order=hf_order)
        if grads is None:
            return (y.detach(), s.detach()), None
        pairs = [(o, g) for o, g in zip((y, s), grads) if g is not None]
        got = torch.autograd.grad([o for o, _ in pairs], [t for t in leaves if t is not None],
                                  [g for _, g in pairs])
    return (y.detach(), s.detach()), got


def oracle(x, residual, w, shift, grads, eps=1e-6):
    """The float64 oracle on the same (rounded) inputs: (y, s) and the four gradients."""
    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, residual, w, shift)]
    y, s = add_rms_norm_oracle(*leaves, eps)
    pairs = [(o, g.double()) for o, g in zip((y, s), grads) if g is not None]
    wrt = [t for t in leaves if t is not None]
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    return (y.detach(), s.detach()), [torch.zeros_like(t) if g is None else g for g, t in zip(got, wrt)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_y_is_the_norm_of_the_rounded_sum(backend, dtype):
    """s is PyTorch's ``x + residual`` bit for bit, and y the norm of that rounded s: equal to
    the unfused ops on the same backend. Inputs where the rounding of s matters: s ≈ 100
    keeps few of x's bits in bf16/fp16."""
    g = gen(5)
    x = torch.randn(9, 40, generator=g, dtype=torch.float64).to(dtype)
    r = (100 + 3 * torch.randn(9, 40, generator=g, dtype=torch.float64)).to(dtype)
    w, shift = (torch.rand(40, generator=g) + 0.5).to(dtype), (0.1 * torch.randn(40, generator=g)).to(dtype)
    (y, total), _ = run(backend, x, r, w, shift)
    if not interpreted_bf16(backend, dtype):
        assert torch.equal(total, x + r)
    with wk.use_backend(backend):
        assert torch.equal(y, wk.rms_norm(total, w, shift, 1e-6))
    want = rms_oracle(x + r, w, shift, 1e-6)
    assert_close_rel(y, want, tolerance(dtype))


def test_triton_wide_rows():
    """d = 8193 (fp32): rows too wide for registers; the sum is written first, then the norm's
    chunked passes read it back. Row 1 overflows Σz², so the chunked rescaling runs on s too."""
    if "triton" not in BACKENDS:
        pytest.skip("triton backend unavailable")
    from wiola_kernels.triton.rms_norm import _launch_config

    assert _launch_config(3, 8193, 4, 2, None).wide and _launch_config(3, 8193, 4, 3, None).wide
    x, r, w, s = make((3, 8193), torch.float32, seed=21)
    x[1] *= 1e30
    grads = tuple(torch.randn(3, 8193, generator=gen(i)) for i in (22, 23))
    (y, total), got = run("triton", x, r, w, s, grads)
    (y64, total64), want = oracle(x, r, w, s, grads)
    assert torch.equal(total, x + r)
    for a, b, name in ((y, y64, "y"), *zip(got, want, ("dx", "dresidual", "dw", "dshift"))):
        assert_close_rel(a, b, tolerance(torch.float32), name)


@pytest.mark.parametrize("used", ["y", "s"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_output_unused(backend, used):
    """Only y (∂L/∂s = 0: the backward gets None) or only s (∂L/∂y = 0) reaches the loss."""
    x, r, w, s = make((5, 24), torch.float32, seed=6)
    g = torch.randn(5, 24, generator=gen(7))
    grads = (g, None) if used == "y" else (None, g)
    _, got = run(backend, x, r, w, s, grads)
    _, want = oracle(x, r, w, s, grads)
    for a, b in zip(got, want):
        assert_close_rel(a, b, tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_order_on_halves_and_no_copy(backend):
    """x and the residual as the halves of one tensor (row stride 2d), no δ: in hf_order y is
    the backend's own rms_norm of s bit for bit, and the CPU kernel reads the halves in place
    (their values against the oracle: tests/test_all_ops.py's strided inputs)."""
    d = 20
    both = torch.randn(30, 2 * d, generator=gen(8))
    x, r = both[:, :d], both[:, d:]
    w = torch.rand(d, generator=gen(10)) + 0.5
    (y, total), _ = run(backend, x.bfloat16(), r.bfloat16(), w.bfloat16(), None, hf_order=True)
    with wk.use_backend(backend):
        assert torch.equal(y, wk.rms_norm(total, w.bfloat16(), None, hf_order=True))
    if backend == "cpu":
        with CopyCounter() as seen:
            torch.ops.wiola.add_rms_norm(x, r, w, None)
        assert seen.copies == 0, seen.counts


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e25), (torch.bfloat16, 1e37), (torch.float64, 1e300)])
@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_huge_rows(backend, dtype, scale):
    """Rows of s whose Σz² overflows the statistic's dtype take rms_norm's rescaled path: y is
    right (against the float64 norm of the rounded s, row by row: the rows differ in scale)
    and finite, next to a normal row."""
    g = gen(13)
    x = torch.randn(3, 33, generator=g, dtype=torch.float64).clamp(-1.5, 1.5)
    x[[0, 2]] *= scale
    r = torch.randn(3, 33, generator=g, dtype=torch.float64)
    w, s = (torch.rand(33, generator=g) + 0.5).to(dtype), (0.3 * torch.randn(33, generator=g)).to(dtype)
    x, r = x.to(dtype), r.to(dtype)
    (y, total), _ = run(backend, x, r, w, s)
    assert torch.isfinite(y).all() and (interpreted_bf16(backend, dtype) or torch.equal(total, x + r))
    for row in range(3):
        c = 2.0 ** -int(torch.frexp(total[row].double().abs().max()).exponent)  # exact rescale of the oracle's input
        want = rms_oracle(total[row:row + 1].double() * c, w, s.double() * c, 1e-6 * c * c)
        assert_close_rel(y[row:row + 1], want, tolerance(dtype), f"row {row}")


@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_nan_stays_in_its_row(backend):
    x, r, w, s = make((4, 24), torch.float32)
    r[2, 5] = float("nan")
    (y, total), _ = run(backend, x, r, w, s)
    assert torch.isnan(y[2]).all() and torch.isnan(total[2, 5])
    assert torch.isfinite(y[[0, 1, 3]]).all() and torch.isfinite(total[[0, 1, 3]]).all()


# --- registration ---------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_without_grad_s_and_shift(backend):
    """With δ and ∂L/∂s is opchecked in tests/test_op_layer.py; here without them."""
    x, r, w, _ = make((5, 12), torch.float32)
    with wk.use_backend(backend):
        torch.library.opcheck(torch.ops.wiola.add_rms_norm.default, (x, r, w, None, 1e-6, True))
        _, total, rstd = torch.ops.wiola.add_rms_norm(x, r, w, None)
        torch.library.opcheck(torch.ops.wiola.add_rms_norm_backward.default,
                              (torch.randn(5, 12), None, total, w, None, rstd))


# --- on a GPU (skipped without one) -----------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("dtype", shapes.ADD_RMS_NORM_GPU_TEST_DTYPES)
@pytest.mark.parametrize("shape", shapes.ADD_RMS_NORM_GPU_TEST_SHAPES)
def test_add_rms_norm_triton_vs_float64(shape, dtype):
    x, r, w, s = make(shape, torch.float64)
    grads = [torch.randn(shape, dtype=torch.float64) for _ in range(2)]
    with wk.use_backend("triton"):
        outs, got = forward_backward(lambda *a: wk.add_rms_norm(*a), [t.to("cuda", dtype) for t in (x, r, w, s)],
                                     [g.to("cuda", dtype) for g in grads])
    rounded = [t.to(dtype).double() for t in (x, r, w, s)]
    ref_outs, want = forward_backward(lambda *a: add_rms_norm_oracle(*a, 1e-6),
                                      rounded, [g.to(dtype).double() for g in grads])
    for a, b in zip(outs + got, ref_outs + want):
        assert_close_rel(a.cpu(), b, tolerance(dtype))


# --- this op in the shared suites: its OpCase (tests/op_cases.py collects CASE for
# tests/test_all_ops.py and tests/test_op_layer.py) -------------------------------------------

def _add_make(shape, dtype, seed, shift=True):
    """x, γ, δ drawn as rms_norm's OpCase draws them (``shift=False``: no δ), and a residual
    twice x's scale."""
    g = gen(seed)
    d = shape[-1]
    x, w, s = randn64(*shape, g=g), torch.rand(d, generator=g, dtype=F64) + 0.5, randn64(d, g=g, scale=0.3)
    return dict(x=x.to(dtype), weight=w.to(dtype), shift=s.to(dtype) if shift else None, eps=1e-6,
                residual=randn64(*shape, g=gen(seed + 1), scale=2.0).to(dtype))


def _add_views(shape, dtype, seed, residual="transposed"):
    """x a half of a (rows, 2d) tensor (row stride 2d); the residual its other half
    (``residual="half"``) or transposed; γ every other element, no δ; the output gradients
    transposed."""
    g = gen(seed)
    rows, d = shape
    both = randn64(rows, 2 * d, g=g)
    residual = both[:, d:] if residual == "half" else randn64(d, rows, g=g).t()
    wd = torch.rand(2 * d, generator=g, dtype=F64) + 0.5
    grads = [randn64(d, rows, g=g).t().to(dtype) for _ in range(2)]
    return dict(x=both[:, :d].to(dtype), residual=residual.to(dtype), weight=wd[::2].to(dtype), shift=None,
                eps=1e-6), grads


def _add_calls(a, ops):
    fwd = (a["x"], a["residual"], a["weight"], a["shift"], a["eps"], a["hf_order"])
    _, s, rstd = ops.add_rms_norm(*fwd)
    return [(ops.add_rms_norm.default, fwd),
            (ops.add_rms_norm_backward.default,
             (torch.randn_like(a["x"]), torch.randn_like(a["x"]), s, a["weight"], a["shift"], rstd))]


def _add_bad(a):
    return [
        (dict(residual=a["residual"][..., :7]), ValueError, r"^residual must have the shape of x \(\.\.\., d\) = \(3, 5, 8\), got \(3, 5, 7\)"),
        (dict(residual=a["residual"].double()), TypeError, r"^residual must have dtype torch.float32 like x, got torch.float64"),
        (dict(shift=a["shift"][:4]), ValueError, r"^shift must have shape \(d,\) = \(8,\), got \(4,\)"),
        (dict(eps=0.0), ValueError, r"^eps must be a finite number > 0, got 0.0"),
        (dict(weight=a["weight"][:7]), ValueError, r"^weight must have shape \(d,\) = \(8,\), got \(7,\)"),
        (dict(residual=[0.0] * 8), TypeError, r"^residual must be a torch.Tensor"),
    ]


CASE = OpCase(
    _add_make, lambda a: wk.add_rms_norm(**a),
    dict(default=[(1, 3), (37, 192), (2, 3, 50), (7,)], triton=[(3, 37), (2, 5)], gradcheck=[(2, 5), (2, 3, 4)],
         threads=[(601, 96)], views=[(30, 20), (7, 33)], dynamic=[(2, 3, 16), (2, 5, 16)],
         concurrent=[(64, 200)], gpu=[(5, 33)], layer=[(3, 5, 8)]),
    (Public("add_rms_norm", wk.AddRMSNormFunction, _add_calls, _add_bad),),
    variants=(dict(shift=True), dict(shift=False)),
    view_variants=(dict(residual="transposed"), dict(residual="half")),
    oracle=lambda a: add_rms_norm_oracle(a["x"], a["residual"], a["weight"], a["shift"], a["eps"]),
    views=_add_views)
