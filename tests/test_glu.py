"""Gated activations (SPEC §10.2, §9): what only glu has. Forward and backward of every
backend against the float64 oracle in every dtype, activation and layout (two tensors, the
halves of one projection, the packed form), gradcheck, inputs left unmodified and the C++
kernels' bits on any thread count are tests/test_all_ops.py's; opcheck, torch.compile and
the bad-input messages tests/test_op_layer.py's. Here: the CPU instruction sets' bits, the
halves read in place with the packed form's one-tensor gradient, other strides, the
numerics at the edges, the packed form's opcheck and compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import wiola_kernels as wk
from wiola_kernels import shapes
from wiola_kernels.testing import (CopyCounter, assert_close_rel, available_backends, available_cpu_isas, cpu_isa,
                                   tolerance)

from helpers import forward_backward, gen, gpu_only
from op_cases import F64, OpCase, Public, randn64
from oracles import glu_oracle

BACKENDS = available_backends("glu", "cpu")
CPU_ISAS = available_cpu_isas("glu")
BACKEND_ISAS = [f"cpu/{isa}" for isa in CPU_ISAS if "cpu" in BACKENDS] + [b for b in BACKENDS if b != "cpu"]
ACTS = ("silu", "gelu_tanh")


@pytest.fixture
def backend(request):
    """A backend of BACKEND_ISAS, with the CPU kernels held to the named instruction set."""
    name, _, isa = request.param.partition("/")
    with cpu_isa(isa or None):
        yield name


def run(backend, args, activation, grad=None):
    """Forward (and backward with ``grad``) of wk.glu on ``backend``: (y, grads of the tensor args)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in args]
    with wk.use_backend(backend):
        y = wk.glu(*leaves, activation)
        if grad is None:
            return y.detach(), None
        grads = torch.autograd.grad(y, [t for t in leaves if t is not None], grad)
    return y.detach(), grads


def want(a, b, activation, grad):
    """The float64 oracle on the same (rounded) inputs: y, ∂a, ∂b."""
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    y = glu_oracle(a64, b64, activation)
    return (y.detach(), *torch.autograd.grad(y, (a64, b64), grad.double()))


@pytest.mark.skipif(len(CPU_ISAS) < 2, reason="one CPU instruction set here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_isas_give_the_same_bits(dtype):
    """The AVX-512 loops compute the AVX2 lanes' float steps in the same order."""
    args = ((4 * torch.randn(5, 2 * 77, generator=gen(11), dtype=torch.float64)).to(dtype), None)
    g = torch.randn(5, 77, generator=gen(12)).to(dtype)
    results = []
    for isa in CPU_ISAS:
        with cpu_isa(isa):
            y, grads = run("cpu", args, "gelu_tanh", grad=g)
        results.append((y, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_halves_of_one_projection_are_read_in_place(backend):
    """``a, b = u[..., :n], u[..., n:]`` (row stride 2n) and the packed ``u``: the kernels copy
    nothing, forward or backward; the packed form's gradient is one contiguous (..., 2n) tensor,
    so autograd copies nothing either (the halves' gradients reach u through slicing)."""
    u = torch.randn(2, 3, 2 * 24, generator=gen(3))
    g = torch.randn(2, 3, 24, generator=gen(4))
    a, b = u[..., :24], u[..., 24:]
    kernels = wk.dispatch.kernels("glu", backend)
    with CopyCounter() as seen:
        y = kernels.forward(a, b, "silu")
        da, db = kernels.backward(g, a, b, "silu")
    assert seen.copies == 0, seen.counts
    leaf = u.clone().requires_grad_()
    with wk.use_backend(backend), CopyCounter() as seen:
        (grad_u,) = torch.autograd.grad(wk.glu(leaf, None, "silu"), leaf, g)
    assert seen.copies == 0, seen.counts
    assert grad_u.shape == u.shape and grad_u.is_contiguous()
    y64, da64, db64 = want(a, b, "silu", g)
    for got, ref in ((y, y64), (da, da64), (db, db64), (grad_u, torch.cat([da64, db64], -1))):
        assert_close_rel(got, ref, tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_strides(backend):
    """Transposed and column-strided operands (copied once, as documented), a row-strided b
    whose rows are expanded (stride 0), and empty inputs."""
    base = torch.randn(40, 30, generator=gen(5), dtype=torch.float64)
    a = base.t()[:, ::2]                       # (30, 20): last dim strided
    b = torch.randn(1, 20, generator=gen(6), dtype=torch.float64).expand(30, 20)  # row stride 0
    g = torch.randn(30, 20, generator=gen(7), dtype=torch.float64)
    y, (da, db) = run(backend, (a.float(), b.float()), "gelu_tanh", grad=g.float())
    for got, ref in zip((y, da, db), want(a.float(), b.float(), "gelu_tanh", g.float())):
        assert_close_rel(got, ref, tolerance(torch.float32))
    y, (gu,) = run(backend, (torch.zeros(0, 8), None), "silu", grad=torch.zeros(0, 4))
    assert y.shape == (0, 4) and gu.shape == (0, 8)


# --- numerics at the edges --------------------------------------------------------------------

# Far in each tail act(a) is exactly a (a → +∞) or 0 (a → −∞: a·σ(a) underflows), act'(a)
# exactly 1 or 0.
EDGES = {torch.float32: [200.0, 1e4, 1e20, 3e38, float("inf")],
         torch.bfloat16: [200.0, 1e4, 3e38, float("inf")],
         torch.float16: [200.0, 6e4, float("inf")],
         torch.float64: [1000.0, 1e5, 1e200, 1.7e308, float("inf")]}


KERNELS = [b for b in BACKEND_ISAS if b != "reference"]  # the oracle itself is for finite, moderate inputs


@pytest.mark.parametrize("dtype", list(EDGES))
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("backend", KERNELS, indirect=True)
def test_large_inputs_give_the_exact_limits(backend, activation, dtype):
    big = torch.tensor(EDGES[dtype], dtype=torch.float64)
    a = torch.cat([big, -big]).to(dtype)
    # Powers of two: every expected product is exact (or ±inf), whatever the rounding mode
    # (Triton's interpreter rounds float32 -> bfloat16 toward zero, a GPU to nearest even).
    i = torch.arange(a.numel(), dtype=torch.float64)
    b = 2.0 ** (i % 3 - 1)
    g = (-1.0) ** i * 2.0 ** (1 - i % 4)
    b, g = b.to(dtype), g.to(dtype)
    y, (da, db) = run(backend, (a, b), activation, grad=g)
    k = big.numel()
    assert torch.equal(y[:k], (a[:k].double() * b[:k].double()).to(dtype))  # act(a) = a
    assert torch.equal(y[k:], torch.zeros(k, dtype=dtype))                    # act(a) = 0 (or -0)
    assert torch.equal(da, torch.cat([(g[:k].double() * b[:k].double()).to(dtype), torch.zeros(k, dtype=dtype)]))
    assert torch.equal(db[k:], torch.zeros(k, dtype=dtype))
    assert torch.equal(db[:k], (g[:k].double() * a[:k].double()).to(dtype))


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_moderate_tails_and_zero_match_float64(backend, activation):
    """|a| up to 120 (where exp overflows float32 on the way) and a = 0: float32 outputs and
    gradients against float64, no NaN."""
    a = torch.cat([torch.linspace(-120, 120, 481, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)])
    b = torch.linspace(-1, 1, a.numel(), dtype=torch.float64)
    g = torch.linspace(2, -1, a.numel(), dtype=torch.float64)
    y, (da, db) = run(backend, (a.float(), b.float()), activation, grad=g.float())
    for got, ref in zip((y, da, db), want(a.float(), b.float(), activation, g.float())):
        assert torch.isfinite(got).all()
        assert_close_rel(got, ref, tolerance(torch.float32))


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("backend", BACKEND_ISAS, indirect=True)
def test_nan_stays_in_its_element(backend, activation):
    a = torch.randn(3, 20, generator=gen(8))
    b = torch.randn(3, 20, generator=gen(9))
    a[1, 4] = float("nan")
    b[2, 7] = float("nan")
    y, (da, db) = run(backend, (a, b), activation, grad=torch.ones(3, 20))
    bad = torch.zeros(3, 20, dtype=torch.bool)
    bad[1, 4] = bad[2, 7] = True
    assert torch.isnan(y[bad]).all() and torch.isfinite(y[~bad]).all()
    assert torch.isnan(da[1, 4]) and torch.isnan(db[1, 4]) and torch.isnan(da[2, 7])
    assert torch.isfinite(da[~bad]).all() and torch.isfinite(db[~bad]).all()


# --- the packed form: opcheck, compile ---------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_packed_form(backend):
    """The halves are opchecked in tests/test_op_layer.py; here the packed form."""
    u = torch.randn(5, 12, generator=gen(10))
    with wk.use_backend(backend):
        torch.library.opcheck(torch.ops.wiola.glu.default, (u, None, "gelu_tanh"))
        torch.library.opcheck(torch.ops.wiola.glu_backward.default, (torch.randn(5, 6), u, None, "gelu_tanh"))


def test_torch_compile_fullgraph_dsff_stream():
    """The packed form (b None) compiled, as a DSFF stream writes it: one up projection, the
    packed glu, the down projection; 0 graph breaks and equal to eager (the halves' compile
    is tests/test_op_layer.py's)."""
    torch._dynamo.reset()
    w13 = torch.randn(2 * 16, 8, generator=gen(11)) / 3
    w2 = torch.randn(8, 16, generator=gen(12)) / 4

    def stream(x, w13, w2):
        return F.linear(wk.glu(F.linear(x, w13), None, "gelu_tanh"), w2)

    x = torch.randn(3, 8, generator=gen(13))
    explained = torch._dynamo.explain(stream)(x, w13, w2)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(stream, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    eager = [t.clone().requires_grad_() for t in (x, w13, w2)]
    compiled(*leaves).square().sum().backward()
    stream(*eager).square().sum().backward()
    for a, b in zip(leaves, eager):
        assert_close_rel(a.grad, b.grad, tolerance(torch.float32))


# --- on a GPU (skipped without one) -----------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", shapes.GLU_GPU_TEST_DTYPES)
@pytest.mark.parametrize("rows, n", shapes.GLU_GPU_TEST_SHAPES)
def test_glu_triton_vs_float64(rows, n, dtype, activation, packed):
    u = 2 * torch.randn(rows, 2 * n, dtype=torch.float64)
    g = torch.randn(rows, n, dtype=torch.float64)
    uc = u.to("cuda", dtype)
    fn = (lambda v: wk.glu(v, None, activation)) if packed else (lambda v: wk.glu(v[:, :n], v[:, n:], activation))
    with wk.use_backend("triton"):
        outs, grads = forward_backward(fn, [uc], [g.to("cuda", dtype)])
    ref_outs, ref_grads = forward_backward(lambda v: glu_oracle(v, None, activation), [uc.cpu().double()], [g])
    for got, ref in zip(outs + grads, ref_outs + ref_grads):
        assert_close_rel(got.cpu(), ref, tolerance(dtype))


# --- this op in the shared suites: its OpCase (tests/op_cases.py collects CASE for
# tests/test_all_ops.py and tests/test_op_layer.py) -------------------------------------------

_GLU_LAYOUTS = ("halves", "separate", "packed")


def _glu_make(shape, dtype, seed, activation="gelu_tanh", layout="halves"):
    """``layout``: the two halves of one projection's output (row stride 2n, read in place),
    two tensors (``separate``), or that output itself (``packed``: b None)."""
    n = shape[-1]
    u = randn64(*shape[:-1], 2 * n, g=gen(seed), scale=2.0).to(dtype)
    if layout == "packed":
        return dict(a=u, b=None, activation=activation)
    a, b = u[..., :n], u[..., n:]
    if layout == "separate":
        a, b = a.contiguous(), b.contiguous()
    return dict(a=a, b=b, activation=activation)


def _glu_calls(a, ops):
    fwd = (a["a"], a["b"], a["activation"])
    return [(ops.glu.default, fwd), (ops.glu_backward.default, (torch.randn_like(a["a"]), *fwd))]


def _glu_bad(a):
    return [
        (dict(b=a["b"][..., :7]), ValueError, r"^b must have the shape of a \(\.\.\., n\) = \(3, 5, 8\), got \(3, 5, 7\)"),
        (dict(b=a["b"].double()), TypeError, r"^b must have dtype torch.float32 like a, got torch.float64"),
        (dict(a=a["a"][..., :7].contiguous(), b=None), ValueError, r"^a must have an even last dimension 2n when b is None"),
        (dict(activation="gelu"), ValueError, r"^activation must be 'silu' or 'gelu_tanh', got 'gelu'"),
        (dict(a=a["a"].long()), TypeError, r"^a must have dtype in \(float32, float64, bfloat16, float16\), got int64"),
        (dict(a=torch.randn(()), b=torch.randn(())), ValueError, r"^a must have shape \(\.\.\., n\) \(at least 1 dimension\)"),
        (dict(a=[1.0, 2.0], b=None), TypeError, r"^a must be a torch.Tensor"),
        (dict(activation=3), TypeError, r"^activation must be a str, got int"),
    ]


CASE = OpCase(
    _glu_make, lambda a: (wk.glu(**a),),
    # six shapes: the six (activation, layout) pairs; n not a multiple of any vector width;
    # Triton's n = 1100: more than one column tile in every dtype (BLOCK_N ≤ 1024)
    dict(default=[(1, 3), (37, 40), (2, 5, 130), (7,), (3, 2, 17), (5, 33)],
         triton=[(3, 37), (1, 3), (2, 5), (5,), (2, 2, 9), (4, 6), (3, 1100)], gradcheck=[(2, 3)] * 6,
         threads=[(301, 100)], dynamic=[(2, 3, 16), (2, 5, 16)], concurrent=[(64, 200)], gpu=[(5, 33)],
         layer=[(3, 5, 8)]),
    (Public("glu", wk.GLUFunction, _glu_calls, _glu_bad),),
    variants=tuple(dict(activation=act, layout=layout) for layout in _GLU_LAYOUTS for act in ("gelu_tanh", "silu")),
    oracle=lambda a: (glu_oracle(a["a"], a["b"], a["activation"]),))
