"""The properties every op shares, tested once per op and backend (each op's own file,
tests/test_<op>.py, keeps what only that op has).

The ops come from the dispatch registry: ``CASES`` has an entry for every registered op
(``test_every_registered_op_has_a_case`` fails when one is missing) and every test here is
parametrised over ``CASES``, never over names written here. An entry says how to make the
op's inputs and call its public function. With an ``oracle`` (tests/oracles.py: float64,
written from SPEC, independent of ``wiola_kernels.reference``, which is one backend under
test) the op also gets, per backend (the C++ CPU backend once per instruction set, Triton
in its CPU interpreter here):

* forward and backward against the oracle, in float32/bfloat16/float16/float64, to SPEC §9's
  tolerances, with the outputs' dtypes and shapes, the inputs left unmodified (and every
  output poisoned with NaN before a kernel writes it: conftest);
* strided inputs (the model's views): right values, and no copy by the kernels that read
  views in place (their outputs keep the inputs' memory order);
* the float64 ``gradcheck`` of the Triton backend (the other backends' is in
  test_op_layer.py, with ``opcheck``, ``torch.compile``'s graph breaks and the bad-input
  messages of every backend);
* the C++ kernels' forward and backward bitwise the same on 1 and 2 threads, run to run.

An entry without an oracle is an op whose own test file still tests those; every entry
takes part in the tests of all ops at once: one compiled graph through all of them,
concurrent calls from Python threads, and the small GPU runs that scripts/gpu_check.sh
repeats under compute-sanitizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import wiola_kernels as wk
from cuda_targets import DEVICE, targets
from helpers import assert_bitwise, backend_variants, forward_backward, gen, gpu_only, on_backend, threads
from oracles import gcla_oracle, rms_oracle, srpe_oracle
from wiola_kernels import dispatch
from wiola_kernels.outputs import empty_output
from wiola_kernels.testing import CopyCounter, assert_close_rel, srpe_tolerance, tolerance

F64 = torch.float64


def _randn(*shape, g, scale=1.0):
    return scale * torch.randn(*shape, generator=g, dtype=F64)


# --- one entry per registered op ---------------------------------------------------------------

@dataclass(frozen=True)
class OpCase:
    """How the tests here exercise one registered op."""

    make: Callable[[tuple, torch.dtype, int], dict]  # (shape, dtype, seed) -> the public function's arguments
    call: Callable[[dict], tuple]                    # those arguments -> the outputs
    shapes: dict[str, list]   # "default" or a backend's own ("triton": the interpreter is slow, tiny), "gradcheck",
                              # "threads", "views", "dynamic" (two sizes), "concurrent", "gpu"
    oracle: Callable[[dict], tuple] | None = None    # float64 arguments -> float64 outputs, differentiable
    views: Callable[[tuple, torch.dtype, int], tuple[dict, list]] | None = None  # strided (arguments, grads)
    in_place: tuple[str, ...] = ()                   # backends that read `views` without a copy
    kind: str = "elementwise"                        # SPEC §9's tolerance row
    tol: Callable[[torch.dtype, dict], float] | None = field(default=None)  # instead of the kind's

    def tolerance(self, dtype: torch.dtype, args: dict) -> float:
        return self.tol(dtype, args) if self.tol else tolerance(dtype, self.kind)


def _rms_make(shape, dtype, seed):
    """Odd seeds: no shift δ (its own kernel path)."""
    g = gen(seed)
    d = shape[-1]
    x, w, s = _randn(*shape, g=g), torch.rand(d, generator=g, dtype=F64) + 0.5, _randn(d, g=g, scale=0.3)
    return dict(x=x.to(dtype), weight=w.to(dtype), shift=None if seed % 2 else s.to(dtype), eps=1e-6)


def _rms_views(shape, dtype, seed):
    """x a strided view both ways (transposed, every other column), γ and δ every other
    element of one tensor, the output gradient transposed."""
    g = gen(seed)
    rows, d = shape
    x = _randn(2 * d, rows, g=g).t()[:, ::2]
    wd = torch.rand(2 * d, generator=g, dtype=F64) + 0.5
    grad = _randn(d, rows, g=g).t()
    return dict(x=x.to(dtype), weight=wd[::2].to(dtype), shift=(0.1 * wd[1::2]).to(dtype), eps=1e-6), [grad.to(dtype)]


def _srpe_make(shape, dtype, seed):
    """Seeds 3n + 1: positions below 2048 (float64 then within 1e-11); 3n + 2: other
    hyperparameters than SPEC's defaults."""
    b, h, h_kv, t, dh = shape
    g = gen(seed)
    q, k = _randn(b, h, t, dh, g=g), _randn(b, h_kv, t, dh, g=g)
    pos = torch.randint(0, 2048 if seed % 3 == 1 else 2**20, (b, t), generator=g)  # not monotonic, may repeat
    params = (500.0, 3.0, 0.3, 0.05) if seed % 3 == 2 else (10000.0, 8.0, 0.1, 0.01)
    return dict(q=q.to(dtype), k=k.to(dtype), position_ids=pos,
                **dict(zip(("theta", "spiral_divisor", "radial_amplitude", "radial_frequency"), params)))


def _srpe_views(shape, dtype, seed):
    """q, k as the model makes them: ``Linear(x).view(B, T, H, d_h).transpose(1, 2)``, int64
    positions expanded from (1, T) (stride 0 over the batch), output gradients alike."""
    b, h, h_kv, t, dh = shape
    args = _srpe_make(shape, dtype, seed)
    g = gen(seed + 1)
    view = {n: _randn(b, t, n_h, dh, g=g).to(dtype).transpose(1, 2) for n, n_h in (("q", h), ("k", h_kv))}
    pos = torch.randperm(4 * t, generator=g)[:t].sort().values[None].expand(b, t)
    grads = [_randn(b, t, n_h, dh, g=g).to(dtype).transpose(1, 2) for n_h in (h, h_kv)]
    return dict(args, **view, position_ids=pos), grads


def _srpe_oracle(a):
    params = (a["theta"], a["spiral_divisor"], a["radial_amplitude"], a["radial_frequency"])
    return srpe_oracle(a["q"], a["position_ids"], *params), srpe_oracle(a["k"], a["position_ids"], *params)


def _add_make(shape, dtype, seed):
    return dict(_rms_make(shape, dtype, 2 * seed), residual=_randn(*shape, g=gen(seed + 1)).to(dtype))


def _glu_make(shape, dtype, seed):
    g = gen(seed)
    return dict(a=_randn(*shape, g=g, scale=2.0).to(dtype), b=_randn(*shape, g=g).to(dtype), activation="gelu_tanh")


def _lce_make(shape, dtype, seed):
    """(N, d, V): hidden rows, the head, labels with every fourth row ignored."""
    n, d, vocab = shape
    g = gen(seed)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::4] = -100
    return dict(h=_randn(n, d, g=g).to(dtype), W=_randn(vocab, d, g=g, scale=0.5).to(dtype), labels=labels)


GCLA_NAMES = ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate")


def _gcla_make(shape, dtype, seed):
    """(B, H, H_kv, T, d_h, S, Λ', lengths or None): S = 1 (one summary per sequence) or T."""
    b, h, h_kv, t, dh, s, lam, lens = shape
    g = gen(seed)
    sizes = ((b, h, t, dh), (b, h_kv, t, dh), (b, h_kv, t, dh), (b, h, t, dh), (b, h, s, lam, dh), (b, h, s, lam, dh),
             (h,))
    args = {n: _randn(*size, g=g).to(dtype) for n, size in zip(GCLA_NAMES, sizes)}
    return dict(args, lengths=None if lens is None else torch.tensor(lens))


def _gcla_views(shape, dtype, seed):
    """The model's views (S = T): q_rot, q, k_rot, v transposed from (B, T, heads, d_h), kc, vc
    permuted from the context projection's (B, T, Λ', H, d_h), a float32 gate (a parameter;
    float64 beside float64), the output gradient transposed alike (stride 0 over the batch for
    odd seeds: the gradient of a sum). S = 1's layouts: tests/test_gcla_attention.py."""
    b, h, h_kv, t, dh, s, lam, lens = shape
    g = gen(seed)
    args = dict(_gcla_make(shape, dtype, seed), gate=_randn(h, g=g).to(F64 if dtype == F64 else torch.float32))
    for n, n_h in (("q_rot", h), ("k_rot", h_kv), ("v", h_kv), ("q", h)):
        args[n] = _randn(b, t, n_h, dh, g=g).to(dtype).transpose(1, 2)
    for n in ("kc", "vc"):
        args[n] = _randn(b, s, lam, h, dh, g=g).to(dtype).permute(0, 3, 1, 2, 4)
    grad = _randn(1 if seed % 2 else b, t, h, dh, g=g).to(dtype).transpose(1, 2).expand(b, h, t, dh)
    return args, [grad]


def _gcla_oracle(a):
    return (gcla_oracle(*(a[n] for n in GCLA_NAMES), lengths=a["lengths"]),)


def _atm_make(shape, dtype, seed):
    """Tokens whose every third neighbour pair is an exact repeat (cosine 1) among random
    neighbours (cosine far below the threshold 0.9 in d ≥ 16)."""
    b, t, d = shape
    x = _randn(b, t, d, g=gen(seed))
    x[:, 1::3] = x[:, ::3][:, :x[:, 1::3].shape[1]]
    return dict(x=x.to(dtype), position_ids=torch.arange(t), threshold=0.9)


def _atm_call(a):
    merged, _, merged_lengths, index_map = wk.atm_merge(a["x"], a["position_ids"], a["threshold"])
    return merged, merged_lengths, index_map, wk.atm_unmerge(merged * 2, index_map)


CASES: dict[str, OpCase] = {
    "rms_norm": OpCase(
        _rms_make, lambda a: (wk.rms_norm(**a),),
        dict(default=[(1, 3), (7,), (37, 192), (5, 760), (2, 3, 50), (1151, 33)],
             triton=[(1, 3), (3, 7), (9, 130), (2, 3, 50)], gradcheck=[(2, 3, 9)], threads=[(3001, 320)],
             views=[(30, 20)], dynamic=[(2, 3, 16), (2, 5, 16)], concurrent=[(64, 200)], gpu=[(5, 33)]),
        oracle=lambda a: (rms_oracle(a["x"], a["weight"], a["shift"], a["eps"]),), views=_rms_views),
    "srpe": OpCase(
        _srpe_make, lambda a: wk.srpe(**a),
        # (B, H, H_kv, T, d_h): T = 1, odd B, H/H_kv in {1, 4}, d_h not a power of two, 64, 128
        dict(default=[(1, 1, 1, 1, 6), (3, 4, 1, 7, 10), (3, 4, 4, 5, 66), (2, 4, 1, 9, 64), (1, 2, 2, 3, 128)],
             triton=[(1, 1, 1, 1, 6), (3, 4, 1, 7, 10), (1, 2, 2, 3, 128)], gradcheck=[(3, 2, 1, 3, 4)],
             threads=[(2, 4, 2, 300, 64)], views=[(2, 4, 2, 37, 16), (3, 2, 1, 5, 66), (1, 4, 4, 1, 64)],
             dynamic=[(2, 2, 1, 3, 4), (2, 2, 1, 5, 4)], concurrent=[(2, 4, 2, 33, 16)], gpu=[(2, 4, 2, 7, 16)]),
        oracle=_srpe_oracle, views=_srpe_views, in_place=("cpu", "triton"),
        # float64 at positions ~2^20: the angle p·ω itself carries ~1e-10 of rounding (SPEC §9)
        tol=lambda dtype, a: srpe_tolerance(dtype, a["position_ids"], a["spiral_divisor"])),
    "add_rms_norm": OpCase(
        _add_make, lambda a: wk.add_rms_norm(**a),
        dict(dynamic=[(2, 3, 16), (2, 5, 16)], concurrent=[(64, 200)], gpu=[(5, 33)])),
    "glu": OpCase(
        _glu_make, lambda a: (wk.glu(**a),),
        dict(dynamic=[(2, 3, 16), (2, 5, 16)], concurrent=[(64, 200)], gpu=[(5, 33)])),
    "linear_cross_entropy": OpCase(
        _lce_make, lambda a: (wk.linear_cross_entropy(**a),),
        dict(dynamic=[(6, 8, 11), (9, 8, 11)], concurrent=[(64, 32, 300)], gpu=[(33, 64, 1000)]),
        kind="attention"),
    "gcla_attention": OpCase(
        _gcla_make, lambda a: (wk.gcla_attention(**a),),
        # (B, H, H_kv, T, d_h, S, Λ', lengths): odd B, rows of length 0 and 1, Λ' ∈ {0, 1, 2}, GQA
        # pairs where h mod H_kv and h // (H/H_kv) differ ((6, 3), (4, 2)), d_h not a power of two
        # (T = 1, where dq̃ = dk̃ = 0 exactly: tests/test_gcla_attention.py).
        # The C++ kernel's blocks are 64 query × 128 key rows (T = 257: five and three, lengths off
        # their edges); the interpreter's are 32 × 16 (dk/dv: 16 × 32); cuda_emu takes d_h 64, 128.
        dict(default=[(3, 4, 1, 2, 16, 1, 1, (2, 0, 1)), (3, 6, 3, 7, 24, 7, 2, (7, 3, 0)),
                      (2, 4, 2, 7, 10, 1, 0, None), (2, 4, 2, 40, 64, 1, 2, (37, 40)), (2, 4, 4, 64, 16, 64, 1, (64, 23)),
                      (2, 4, 1, 257, 8, 257, 2, (250, 100)), (1, 6, 3, 257, 8, 1, 2, None)],
             triton=[(3, 6, 3, 20, 16, 1, 2, (20, 9, 0)), (2, 4, 2, 7, 64, 7, 0, None), (2, 6, 3, 33, 16, 1, 2, (33, 20)),
                     (2, 4, 1, 40, 8, 40, 1, (17, 40)), (1, 2, 2, 20, 24, 20, 2, None)],
             cuda_emu=[(2, 4, 1, 2, 64, 1, 1, (2, 0)), (2, 6, 3, 7, 128, 1, 2, (7, 4)), (2, 4, 2, 257, 64, 257, 2, (254, 86)),
                       (1, 6, 3, 257, 64, 1, 0, None)],
             gradcheck=[(2, 2, 1, 5, 4, 1, 2, (5, 2))], threads=[(2, 4, 2, 200, 24, 1, 3, (200, 77))],
             views=[(2, 6, 3, 21, 64, 21, 2, (21, 0)), (2, 4, 2, 9, 64, 9, 2, None)],
             dynamic=[(2, 2, 1, 3, 4, 3, 2, (3, 1)), (2, 2, 1, 5, 4, 5, 2, (5, 2))],
             concurrent=[(1, 4, 2, 40, 16, 40, 2, None)], gpu=[(2, 4, 2, 19, 64, 19, 2, (19, 14))]),
        oracle=_gcla_oracle, views=_gcla_views, in_place=("cpu", "triton"), kind="attention"),
    "atm": OpCase(
        _atm_make, _atm_call, dict(dynamic=[(2, 6, 16), (2, 9, 16)], concurrent=[(2, 50, 24)], gpu=[(3, 21, 48)])),
}
WITH_ORACLE = [op for op in dispatch.ops() if op in CASES and CASES[op].oracle is not None]


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
        grads = [torch.randn(o.shape, generator=g, dtype=F64).to(o.dtype) for o in floats]
    dargs = torch.autograd.grad(floats, [args[n] for n in _tensors(args)], grads)
    return [o.detach() for o in outs], list(dargs), grads


def _oracle(case: OpCase, args: dict, grads: list):
    args = {n: v.detach().double().requires_grad_() if n in _tensors(args) else v for n, v in args.items()}
    outs = case.oracle(args)
    return [o.detach() for o in outs], list(torch.autograd.grad(outs, [args[n] for n in _tensors(args)],
                                                               [g.double() for g in grads]))


def _params(*props):
    return [pytest.param(op, variant, id=f"{op}-{variant}") for op in WITH_ORACLE for variant in backend_variants(op)
            if all(p(op, variant) for p in props)]


# --- the registry ------------------------------------------------------------------------------

def test_every_registered_op_has_a_case():
    assert set(CASES) == set(dispatch.ops())


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
        args = case.make(shape, dtype, seed=i)
        before = {n: v.clone() for n, v in args.items() if isinstance(v, torch.Tensor)}
        with on_backend(backend):
            outs, dargs, grads = _run(case, args, 100 + i)
        want, dwant = _oracle(case, args, grads)
        tol = case.tolerance(dtype, args)
        for got, ref, name in zip(outs, want, range(len(want))):
            assert got.dtype == dtype, f"{shape} output {name}: {got.dtype}"
            assert_close_rel(got, ref, tol, f"{shape} output {name}")
        for got, ref, name in zip(dargs, dwant, _tensors(args)):
            assert got.dtype == args[name].dtype, f"{shape} grad {name}: {got.dtype}"
            assert_close_rel(got, ref, tol, f"{shape} grad {name}")
        assert all(torch.equal(args[n], v) for n, v in before.items()), "an input was modified"
        assert not {o.data_ptr() for o in outs + dargs if o.numel()} & {v.data_ptr() for v in before.values()}, \
            "output aliases input"


@pytest.mark.parametrize("op, backend", _params(lambda op, b: CASES[op].views is not None))
def test_strided_inputs(op, backend):
    case = CASES[op]
    reads_in_place = backend.partition("/")[0] in case.in_place
    for i, shape in enumerate(case.shapes["views"]):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            args, grads = case.views(shape, dtype, seed=i)
            with on_backend(backend), CopyCounter() as copied:
                outs, dargs, _ = _run(case, args, grads)
            want, dwant = _oracle(case, args, grads)
            tol = case.tolerance(dtype, args)
            for got, ref in zip(outs + dargs, want + dwant):
                assert_close_rel(got, ref, tol, f"{shape} {dtype}")
            if reads_in_place:
                assert copied.copies == 0, copied.counts
                views = [args[n] for n in _tensors(args)]
                for out in outs + dargs:  # the layout of the input of its shape
                    like = next(v for v in views if v.shape == out.shape)
                    assert out.stride() == like.stride(), (shape, out.shape, out.stride(), like.stride())


@pytest.mark.parametrize("op, backend", _params(lambda op, b: b == "triton"))
def test_triton_float64_gradcheck(op, backend):
    """The interpreter runs a few hundred launches a second: the randomised gradcheck."""
    case = CASES[op]
    args = case.make(case.shapes["gradcheck"][0], F64, seed=0)
    names = _tensors(args)

    def f(*leaves):
        return case.call(dict(args, **dict(zip(names, leaves))))

    leaves = [args[n].clone().requires_grad_() for n in names]
    with on_backend(backend):
        assert torch.autograd.gradcheck(f, leaves, fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("op, backend", _params(lambda op, b: b.partition("/")[0] == "cpu"))
def test_cpu_bitwise_on_any_thread_count(op, backend, dtype):
    """Forward and backward on 1, 2, 1, 2 threads: the same bits each time (reductions over
    rows split the work into a fixed number of chunks, summed in a fixed order)."""
    case = CASES[op]
    args = case.make(case.shapes["threads"][0], dtype, seed=0)
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
    template = [(case, case.make(case.shapes["dynamic"][0], torch.float32, 0)) for case in CASES.values()]
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
        ins = [v for case in CASES.values() for v in case.make(case.shapes["dynamic"][size], torch.float32, 2 * size).values()
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
            args = case.make(case.shapes["concurrent"][0], torch.float32, seed)
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
    args = case.make(case.shapes["gpu"][0], torch.float32, 0)
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
