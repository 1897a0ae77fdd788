"""The properties every op shares, tested once per op and backend (each op's own file,
tests/test_<op>.py, keeps what only that op has).

The ops come from the dispatch registry: ``CASES`` (tests/op_cases.py, which
tests/test_op_layer.py reads too) has an entry for every registered op
(``test_every_registered_op_has_a_case`` fails when one is missing) and every test here is
parametrised over ``CASES``, never over names written here. An entry says how to make the
op's inputs and call its public function. With an ``oracle`` (tests/oracles.py: float64,
written from SPEC, independent of ``wiola_kernels.reference``, which is one backend under
test) the op also gets, per backend (the C++ CPU backend once per instruction set, Triton
in its CPU interpreter here):

* forward and backward against the oracle, in float32/bfloat16/float16/float64, to SPEC §9's
  tolerances (integer outputs, such as ATM's index map, exactly), with the outputs' dtypes
  and shapes, the inputs left unmodified (and every output poisoned with NaN before a kernel
  writes it: conftest);
* strided inputs (the model's views): right values, and no copy by the kernels that read
  views in place (their outputs keep the inputs' memory order);
* the float64 ``gradcheck`` of every backend, at the entry's "gradcheck" shapes
  (test_op_layer.py has it for an entry without them, with ``opcheck``, ``torch.compile``'s
  graph breaks and the bad-input messages of every backend);
* the C++ kernels' forward and backward bitwise the same on 1 and 2 threads, run to run.

Every entry has an oracle (``test_every_op_has_an_oracle``), and every entry takes part
in the tests of all ops at once: one compiled graph through all of them,
concurrent calls from Python threads, and the small GPU runs that scripts/gpu_check.sh
repeats under compute-sanitizer.
"""

from __future__ import annotations

import pytest
import torch

import wiola_kernels as wk
from cuda_targets import DEVICE, targets
from helpers import assert_bitwise, backend_variants, forward_backward, gen, gpu_only, on_backend, threads
from op_cases import CASES, F64, WITH_ORACLE, OpCase
from wiola_kernels import dispatch
from wiola_kernels.outputs import empty_output
from wiola_kernels.testing import CopyCounter, assert_close_rel, tolerance


def _tensors(args: dict) -> list[str]:
    return [n for n, v in args.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _leaves(args: dict) -> dict:
    """``args`` with its floating-point tensors as leaves that require grad: the same memory
    (a kernel that writes its input shows in ``args``), the same strides."""
    return {n: v.detach().requires_grad_() if n in _tensors(args) else v for n, v in args.items()}


def _run(case: OpCase, args: dict, grads: list | int | None):
    """Outputs, the gradients of the floating-point arguments and the output gradients
    ``grads`` (one per floating-point output; an int: drawn from that seed): the public
    function, under the backend in force. ``grads`` None: the forward only."""
    args = _leaves(args)
    outs = case.call(args)
    floats = [o for o in outs if o.is_floating_point()]
    if grads is None:
        return [o.detach() for o in outs], [], []
    if isinstance(grads, int):
        g = gen(grads)
        grads = [torch.randn(o.shape, generator=g, dtype=F64).to(o.device, o.dtype) for o in floats]
    dargs = torch.autograd.grad(floats, [args[n] for n in _tensors(args)], grads)
    return [o.detach() for o in outs], list(dargs), grads


def _oracle(case: OpCase, args: dict, grads: list):
    args = {n: v.detach().double().requires_grad_() if n in _tensors(args) else v for n, v in args.items()}
    outs = case.oracle(args)
    floats = [o for o in outs if o.is_floating_point()]
    return [o.detach() for o in outs], list(torch.autograd.grad(floats, [args[n] for n in _tensors(args)],
                                                               [g.double() for g in grads]))


def _assert_matches(got, ref, tol, what):
    """Floating-point outputs within ``tol`` of the oracle; integer ones (indices, lengths) equal."""
    if ref.is_floating_point():
        assert_close_rel(got, ref, tol, what)
    else:
        assert got.dtype == ref.dtype and torch.equal(got, ref), what


def _params(*props):
    return [pytest.param(op, variant, id=f"{op}-{variant}") for op in WITH_ORACLE for variant in backend_variants(op)
            if all(p(op, variant) for p in props)]


# --- the registry ------------------------------------------------------------------------------

def test_every_registered_op_has_a_case():
    assert set(CASES) == set(dispatch.ops())


def test_every_op_has_an_oracle():
    """Every op's forward and backward are checked against an oracle independent of the code
    under test (a new op without one would be tested only against itself)."""
    assert [op for op, case in CASES.items() if case.oracle is None] == []


def test_cpu_backends_present():
    # The project ships a reference and a C++ CPU backend for every registered op.
    table = wk.backends("cpu")
    assert table, "no op is registered"
    for op, states in table.items():
        assert {"reference", "cpu"} <= {name for name, state in states.items() if state == "available"}, op


def test_bad_backend_name():
    with pytest.raises(ValueError, match="use_backend"):
        with wk.use_backend("fortran"):
            pass


def test_poisoning_is_active():
    """The suite's outputs start as NaN (conftest): a kernel that skips an element fails."""
    assert torch.isnan(empty_output((4,), dtype=torch.float32, device=torch.device("cpu"))).all()


# --- every op with an oracle, every backend -----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("op, backend", _params())
def test_forward_and_backward_match_the_oracle(op, backend, dtype):
    case = CASES[op]
    for i, shape in enumerate(case.shapes.get(backend, case.shapes["default"])):
        args = case.inputs(shape, dtype, i)
        before = {n: v.clone() for n, v in args.items() if isinstance(v, torch.Tensor)}
        with on_backend(backend):
            outs, dargs, grads = _run(case, args, 100 + i)
        want, dwant = _oracle(case, args, grads)
        tol = case.tolerance(dtype, args)
        for got, ref, name in zip(outs, want, range(len(want))):
            assert got.dtype == case.out_dtype(dtype) or not ref.is_floating_point(), f"{shape} output {name}: {got.dtype}"
            _assert_matches(got, ref, tol, f"{shape} output {name}")
        for got, ref, name in zip(dargs, dwant, _tensors(args)):
            assert got.dtype == args[name].dtype, f"{shape} grad {name}: {got.dtype}"
            assert_close_rel(got, ref, tol, f"{shape} grad {name}")
        assert all(torch.equal(args[n], v) for n, v in before.items()), "an input was modified"
        storage = {v.data_ptr() for v in before.values() if v.numel()}  # an empty tensor has no storage
        assert not {o.data_ptr() for o in outs + dargs if o.numel()} & storage, "output aliases input"


@pytest.mark.parametrize("op, backend", _params(lambda op, b: CASES[op].views is not None))
def test_strided_inputs(op, backend):
    case = CASES[op]
    reads_in_place = backend.partition("/")[0] in case.in_place
    for i, shape in enumerate(case.shapes["views"]):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            args, grads = case.view_inputs(shape, dtype, i)
            with on_backend(backend), CopyCounter() as copied:
                outs, dargs, _ = _run(case, args, grads)
            want, dwant = _oracle(case, args, grads)
            tol = case.tolerance(dtype, args)
            for got, ref in zip(outs + dargs, want + dwant):
                _assert_matches(got, ref, tol, f"{shape} {dtype}")
            if reads_in_place:
                assert copied.copies == 0, copied.counts
                views = [args[n] for n in _tensors(args)]
                for out in outs + dargs:  # the layout of the input of its shape
                    like = next(v for v in views if v.shape == out.shape)
                    assert out.stride() == like.stride(), (shape, out.shape, out.stride(), like.stride())


@pytest.mark.parametrize("op, backend", _params(lambda op, b: "gradcheck" in CASES[op].shapes))
def test_float64_gradcheck(op, backend):
    """The randomised gradcheck (Triton's interpreter runs a few hundred launches a second)."""
    case = CASES[op]
    for i, shape in enumerate(case.shapes["gradcheck"]):
        args = case.inputs(shape, F64, i)
        names = _tensors(args)

        def f(*leaves):
            return case.call(dict(args, **dict(zip(names, leaves))))

        leaves = [args[n].clone().requires_grad_() for n in names]
        with on_backend(backend):
            assert torch.autograd.gradcheck(f, leaves, fast_mode=True), shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("op, backend", _params(lambda op, b: b.partition("/")[0] == "cpu"))
def test_cpu_bitwise_on_any_thread_count(op, backend, dtype):
    """Forward and backward on 1, 2, 1, 2 threads: the same bits each time (reductions over
    rows split the work into a fixed number of chunks, summed in a fixed order)."""
    case = CASES[op]
    args = case.inputs(case.shapes["threads"][0], dtype, 0)
    results = []
    for n in (1, 2, 1, 2):
        with threads(n), on_backend(backend):
            outs, dargs, _ = _run(case, args, 1)
        results.append(outs + dargs)
    assert_bitwise(results, [f"output {i}" for i in range(len(outs))] + [f"grad {n}" for n in _tensors(args)])


# --- all ops at once ----------------------------------------------------------------------------

def _loss(outs) -> torch.Tensor:
    return sum((o.float() * o.float()).sum() for o in outs if o.is_floating_point())


def test_compile_dynamic_shapes_all_ops():
    """One compiled function over every op, with dynamic shapes and autograd (aot_eager keeps
    this test fast), against the same calls eagerly."""
    template = [(case, case.inputs(case.shapes["dynamic"][0], torch.float32, 0)) for case in CASES.values()]
    layout = [(case, {n: v for n, v in a.items() if not isinstance(v, torch.Tensor)},
               [n for n, v in a.items() if isinstance(v, torch.Tensor)]) for case, a in template]

    def f(*tensors):
        it = iter(tensors)
        total = 0
        for case, fixed, names in layout:
            total = total + _loss(case.call(dict(fixed, **{n: next(it) for n in names})))
        return total

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for size in (0, 1):
        ins = [v for case in CASES.values() for v in case.inputs(case.shapes["dynamic"][size], torch.float32, size, variant=0).values()
               if isinstance(v, torch.Tensor)]
        a = [t.clone().requires_grad_(t.is_floating_point()) for t in ins]
        b = [t.clone().requires_grad_(t.is_floating_point()) for t in ins]
        ra, rb = cf(*a), f(*b)
        ra.backward()
        rb.backward()
        assert abs(ra.item() - rb.item()) <= tolerance(torch.float32) * max(1.0, abs(rb.item()))
        for ta, tb in zip(a, b):
            if tb.grad is not None:
                assert_close_rel(ta.grad, tb.grad, tolerance(torch.float32))


def _agree(outs, want, kind, what):
    for got, ref in zip(outs, want):
        if ref.is_floating_point():
            assert_close_rel(got.cpu(), ref.cpu(), tolerance(torch.float32, kind), what)
        else:
            assert torch.equal(got.cpu(), ref.cpu()), what


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_ops_are_thread_safe(backend):
    """Several Python threads calling every op at once on different tensors get correct
    results (the extension holds no global mutable state)."""
    from concurrent.futures import ThreadPoolExecutor

    def job(seed):
        for op, case in CASES.items():
            args = case.inputs(case.shapes["concurrent"][0], torch.float32, seed)
            with wk.use_backend(backend):
                outs = case.call(args)
            with wk.use_backend("reference"):
                want = case.call({n: v.double() if n in _tensors(args) else v for n, v in args.items()})
            _agree(outs, want, case.kind, f"{op} seed {seed}")

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(job, range(8)))


def _on_device_against_reference(op, backend, device):
    """Forward and backward on ``device``: the outputs against the float64 reference (on the
    CPU), the gradients finite (every element written)."""
    case = CASES[op]
    args = case.inputs(case.shapes["gpu"][0], torch.float32, 0)
    with wk.use_backend(backend):
        outs, dargs, _ = _run(case, {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in args.items()}, 1)
    with wk.use_backend("reference"):
        want, _, _ = _run(case, {n: v.double() if n in _tensors(args) else v for n, v in args.items()}, None)
    _agree(outs, want, case.kind, f"{op} on {backend}")
    assert all(torch.isfinite(g).all() for g in dargs), f"{op} on {backend}: gradients"


@gpu_only
@pytest.mark.parametrize("op", [op for op in dispatch.ops() if "triton" in dispatch.implemented(op)])
def test_sanitizer_triton_kernels(op):
    """Small shapes of every Triton kernel, forward and backward (run under compute-sanitizer
    by scripts/gpu_check.sh), against the reference so it can fail."""
    _on_device_against_reference(op, "triton", "cuda")


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
