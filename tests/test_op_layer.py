"""The op layer, across ops: per op one ``torch.autograd.Function`` over two registered ops
(``wiola::<op>`` / ``wiola::<op>_backward``, declared in C++, one kernel per dispatch key);
the dispatcher chooses the kernel unless a backend is forced; the forward's backend is the
backward's; no graph breaks under ``torch.compile``; every backend refuses a bad input with
the same words; ``position_ids`` and ``lengths`` are validated alike by every op.

The cases are the public functions of every op of :mod:`wiola_kernels.dispatch`, from the one
table of tests/op_cases.py (their arguments, ``Function``, registered ops and bad inputs).
Results are compared with the float64 reference (``wiola_kernels.reference``), never with
the code under test. The Triton backend runs in the interpreter here: tests/test_all_ops.py
covers it.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch._dynamo.utils import counters

import wiola_kernels as wk
from wiola_kernels import dispatch
from wiola_kernels.testing import CopyCounter, assert_close_rel, available_backends, tolerance
from wiola_kernels.validation import INDEX_DTYPES, Limits

from op_cases import CASES as OP_CASES
from op_cases import Public

CPU = torch.device("cpu")
HAVE_OPS = wk.ops.have_registered_ops()
needs_ops = pytest.mark.skipif(not HAVE_OPS, reason="needs the C++ extension (the registered ops)")


@dataclass(frozen=True)
class Case:
    """One public function of a registered op, as tests/op_cases.py describes it."""

    op: str                                   # its dispatch name
    entry: Public

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def function(self) -> type:
        return self.entry.function

    @property
    def public(self) -> Callable:
        return self.entry.public

    @property
    def reference(self) -> Callable:
        return self.entry.reference

    @property
    def kind(self) -> str:
        return OP_CASES[self.op].kind

    def make(self, dtype: torch.dtype) -> dict:
        return OP_CASES[self.op].layer_args(self.entry, dtype)

    def op_calls(self, args: dict, ns: str = "wiola") -> list:
        return self.entry.op_calls(args, getattr(torch.ops, ns))


CASES = [Case(op, f) for op in dispatch.ops() for f in OP_CASES[op].functions]
BY_NAME = {c.name: c for c in CASES}


def _with_grad(args: dict) -> dict:
    return {n: v.clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for n, v in args.items()}


def _float_outputs(out) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    return [o for o in outs if o.is_floating_point()]


def _loss(out) -> torch.Tensor:
    # Not a plain sum: a weight per element that differs between positions and outputs.
    total = 0
    for i, o in enumerate(_float_outputs(out)):
        w = torch.linspace(-1.0, 2.0, o.numel(), dtype=torch.float64).view(o.shape) + i
        total = total + (o.double() * w).sum()
    return total


def _leaves(args: dict) -> list[torch.Tensor]:
    return [v for v in args.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def _oracle(case: Case, args: dict):
    """Loss and gradients of the float64 reference on the same inputs."""
    ref_args = _with_grad({n: v.detach().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                           for n, v in args.items()})
    loss = _loss(case.reference(**ref_args))
    return loss, torch.autograd.grad(loss, _leaves(ref_args))


def _backends_here(op: str) -> list[str]:
    # Triton runs in the interpreter here (slow): the per-op test files cover it.
    return [b for b in available_backends(op, CPU) if b != "triton"]


def _case_backends(keep=lambda case: True):
    return [pytest.param(c, b, id=f"{c.name}-{b}") for c in CASES if keep(c) for b in _backends_here(c.op)]


@pytest.fixture
def ran(monkeypatch):
    """Records what each forward and backward ran: the forced backend's name (looked up
    through ``dispatch.kernels``), or ``"dispatcher"`` for a call of a registered ``wiola`` op."""
    calls: list[str] = []
    original = dispatch.kernels

    def recording(op, backend):
        calls.append(backend)
        return original(op, backend)

    monkeypatch.setattr(dispatch, "kernels", recording)
    return calls


@pytest.fixture
def resolved(monkeypatch):
    """Records the backend each forced forward resolves (``dispatch.resolve``: under
    ``torch.compile`` Dynamo calls it for real, a constant of the graph)."""
    calls: list[str] = []
    original = dispatch.resolve

    def recording(*args, **kwargs):
        calls.append(original(*args, **kwargs))
        return calls[-1]

    recording._dynamo_marked_constant = True
    monkeypatch.setattr(dispatch, "resolve", recording)
    return calls


# --- the Functions are the public API's autograd ----------------------------------------------

def test_every_registered_op_has_its_public_functions():
    assert all(OP_CASES[op].functions for op in dispatch.ops())


def test_functions_are_exported():
    # Their documentation: tests/test_docs.py's coverage test.
    exported = {n for n in wk.__all__ if n.endswith("Function")}
    assert {c.function.__name__ for c in CASES} <= exported
    for case in CASES:
        assert issubclass(case.function, torch.autograd.Function)
        assert getattr(wk, case.function.__name__) is case.function


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_public_function_runs_through_its_function_only_when_autograd_records(case):
    args = _with_grad(case.make(torch.float32))
    out = case.public(**args)
    for o in _float_outputs(out):
        assert type(o.grad_fn).__name__ == f"{case.function.__name__}Backward"
    direct = case.function.apply(*args.values())
    for a, b in zip(_float_outputs(out), _float_outputs(direct)):
        assert torch.equal(a, b)
    with torch.no_grad():  # nothing to record: the registered op is called directly, same result
        plain = case.public(**args)
    for a, b in zip(_float_outputs(plain), _float_outputs(out)):
        assert a.grad_fn is None and torch.equal(a, b)


def test_modules_run_through_the_functions():
    x = BY_NAME["rms_norm"].make(torch.float32)["x"].requires_grad_()
    for module in (wk.WiolaRMSNorm(8), wk.RMSNorm(8)):
        assert type(module(x).grad_fn).__name__ == "RMSNormFunctionBackward"
    a = BY_NAME["srpe"].make(torch.float32)
    q_out, _ = wk.SpiralRotaryEmbedding(8)(a["q"].requires_grad_(), a["k"], a["position_ids"])
    assert type(q_out.grad_fn).__name__ == "SRPEFunctionBackward"


@pytest.mark.parametrize("forced", [None, "reference"], ids=["dispatcher", "forced"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_function_validates_its_arguments(case, forced):
    """Function.apply is a public entry point: a non-tensor is a TypeError naming the argument,
    whether the dispatcher's kernel or a forced one would have run."""
    args = case.make(torch.float32)
    first = next(iter(args))
    with wk.use_backend(forced or "auto"), pytest.raises(TypeError, match=f"^{first} must be a torch.Tensor"):
        case.function.apply("not a tensor", *list(args.values())[1:])


# --- one dispatch: the default path asks nothing but the override ----------------------------------

@needs_ops
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_default_path_reads_the_override_once_and_resolves_nothing(case, monkeypatch, ran):
    """Forward and backward of the default path: one ``forced_backend()`` read in the forward,
    no backend resolution, no registry lookup; the registered ops run (the profiler sees them)."""
    reads = []
    original = dispatch.forced_backend
    monkeypatch.setattr(dispatch, "forced_backend", lambda: reads.append(1) or original())
    resolves = []
    monkeypatch.setattr(dispatch, "resolve", lambda *a, **k: resolves.append(a))
    args = _with_grad(case.make(torch.float32))
    with wk.use_backend("auto"), CopyCounter() as seen:
        out = case.public(**args)
        torch.autograd.grad(_loss(out), _leaves(args))
    assert reads == [1] and resolves == [] and ran == []
    forward = case.op_calls(case.make(torch.float32))[0][0].name().replace("::", ".")
    assert seen.counts.get(forward) == 1 and seen.counts.get(f"{forward}_backward") == 1, seen.counts


# --- the backend the forward ran is the backward's ---------------------------------------------

@pytest.mark.parametrize("case, backend", _case_backends())
def test_backward_runs_on_the_forwards_backend(case, backend, ran):
    others = [b for b in _backends_here(case.op) if b != backend]
    args = _with_grad(case.make(torch.float32))
    with wk.use_backend(backend):
        out = case.public(**args)
    assert ran == [backend]
    ctx = _float_outputs(out)[0].grad_fn
    assert ctx.backend == backend                      # kept on ctx
    ran.clear()
    with wk.use_backend(others[0] if others else "auto"):  # another override around the backward
        grads = torch.autograd.grad(_loss(out), _leaves(args))
    assert ran == [backend]
    _, want = _oracle(case, args)
    for g, w in zip(grads, want):
        assert_close_rel(g, w, tolerance(torch.float32, case.kind), "grad")


@pytest.mark.parametrize("case, backend", _case_backends(lambda c: "gradcheck" not in OP_CASES[c.op].shapes))
def test_float64_gradcheck(case, backend):
    """The ops whose gradcheck is not tests/test_all_ops.py's (no "gradcheck" shapes there)."""
    args = _with_grad(case.make(torch.float64))
    names = [n for n, v in args.items() if isinstance(v, torch.Tensor) and v.requires_grad]

    def f(*leaves):
        return case.function.apply(*{**args, **dict(zip(names, leaves))}.values())

    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(f, [args[n] for n in names], fast_mode=True)


@needs_ops
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_opcheck_forward_and_backward_ops(case):
    calls = case.op_calls(case.make(torch.float32))
    assert [op.name() for op, _ in calls] == [f"wiola::{case.name}", f"wiola::{case.name}_backward"]
    for op, args in calls:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("case", [c for c in CASES if "cuda_emu" in dispatch.implemented(c.op)
                                  and hasattr(torch.ops.wiola_cuda_emu, c.name)], ids=lambda c: c.name)
def test_opcheck_the_emulated_cuda_ops(case):
    """The CUDA kernels' emulation, where registered as ops, is declared like the public ops
    (same schema, same fakes)."""
    if "cuda_emu" not in available_backends(case.op, CPU):
        pytest.skip("the extension was built without the emulated CUDA kernels")
    for op, args in case.op_calls(case.make(torch.float32), ns="wiola_cuda_emu"):
        torch.library.opcheck(op, args)


# --- torch.compile ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compile_fullgraph_no_graph_breaks_and_follows_use_backend(case, resolved):
    args = _with_grad(case.make(torch.float32))
    names = list(args)

    def f(*values):
        return _loss(case.public(**dict(zip(names, values))))

    want_loss, want_grads = _oracle(case, args)
    torch._dynamo.reset()
    counters.clear()
    explained = torch._dynamo.explain(f)(*args.values())
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    forced = ["reference"] + [b for b in _backends_here(case.op) if b not in ("reference", "cpu")][:1]
    for backend in ["auto", *forced]:  # a different use_backend block retraces (Dynamo guards on it)
        resolved.clear()
        with wk.use_backend(backend):
            loss = compiled(*args.values())
        grads = torch.autograd.grad(loss, _leaves(args))
        assert resolved == ([] if backend == "auto" else [backend]), resolved  # the backward follows ctx
        tol = tolerance(torch.float32, case.kind)
        assert abs(float(loss.detach()) - float(want_loss)) <= tol * max(1.0, abs(float(want_loss)))
        for g, w in zip(grads, want_grads):
            assert_close_rel(g, w, tol, "grad")
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled_call_on_new_tensors_does_not_recompile(case):
    """A training loop hands a compiled step new tensors every time: the op layer must not
    make Dynamo guard on their identities (it once did, through ``id()`` in ``distinct``)."""
    names = list(case.make(torch.float32))

    def f(*values):
        return _loss(case.public(**dict(zip(names, values))))

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        args = _with_grad(case.make(torch.float32))
        torch.autograd.grad(compiled(*args.values()), _leaves(args))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


# --- one validation for every op, the same words from every backend ---------------------------

def _taking(parameter: str) -> list[Case]:
    """The cases whose public function has ``parameter`` (found from the signatures)."""
    takers = [n for n in wk.__all__ if callable(getattr(wk, n)) and not inspect.isclass(getattr(wk, n))
              and n in BY_NAME and parameter in inspect.signature(getattr(wk, n)).parameters]
    assert takers, parameter
    return [BY_NAME[n] for n in takers]


def _validating_backends(op: str) -> list[str]:
    """"auto" (the dispatcher: C++ checks) and every forced backend here (Python checks)."""
    return ["auto", *_backends_here(op)]


@pytest.mark.parametrize("case", _taking("position_ids"), ids=lambda c: c.name)
def test_position_ids_shapes_and_dtypes_agree_across_ops(case):
    """(B, T), (1, T) and (T,), in every integer dtype of INDEX_DTYPES, give the same result."""
    args = case.make(torch.float64)
    pos = args["position_ids"]
    b, t = pos.shape
    shared = pos[:1].expand(b, t).contiguous()
    want = case.reference(**dict(args, position_ids=shared))
    for backend in _validating_backends(case.op):
        for variant in (shared, shared[:1], shared[0]):
            for dtype in INDEX_DTYPES:
                with wk.use_backend(backend):
                    got = case.public(**dict(args, position_ids=variant.to(dtype)))
                for g, w in zip(got, want):
                    assert_close_rel(g, w, tolerance(torch.float64), f"{backend} position_ids {tuple(variant.shape)}")
        for bad, error in ((shared[:, :-1], ValueError), (shared[None], ValueError), (shared.float(), TypeError),
                           (shared.bool(), TypeError), (shared.tolist(), TypeError)):
            with wk.use_backend(backend), pytest.raises(error, match="^position_ids"):
                case.public(**dict(args, position_ids=bad))


@pytest.mark.parametrize("case", _taking("lengths"), ids=lambda c: c.name)
def test_lengths_checks_agree_across_ops(case):
    args = case.make(torch.float64)
    lengths = args["lengths"]
    b, t = lengths.shape[0], int(lengths.max())  # the makers' first row is full: T
    want = case.reference(**args)
    bad_cases = ((lengths.float(), TypeError, "^lengths must have dtype"),
                 ([int(v) for v in lengths], TypeError, "^lengths must be a torch.Tensor"),
                 (lengths[:1], ValueError, r"^lengths must have shape \(B,\)"),
                 (torch.full((b,), t + 1), ValueError, r"^lengths must lie in \[0, T\]"),
                 (torch.full((b,), -1), ValueError, r"^lengths must lie in \[0, T\]"))
    for backend in _validating_backends(case.op):
        for dtype in INDEX_DTYPES:
            with wk.use_backend(backend):
                got = case.public(**dict(args, lengths=lengths.to(dtype)))
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert_close_rel(g, w, tolerance(torch.float64, case.kind), f"{backend} lengths {dtype}")
        for bad, error, match in bad_cases:
            with wk.use_backend(backend), pytest.raises(error, match=match):
                case.public(**dict(args, lengths=bad))


def _bad_inputs() -> list[tuple[str, dict, type, str]]:
    """(public function, changed arguments, error, message): each function's ``bad`` list."""
    return [(c.name, *bad) for c in CASES for bad in c.entry.bad(c.make(torch.float32))]


@pytest.mark.parametrize("name, changes, error, message", _bad_inputs(),
                         ids=[f"{n}-{'-'.join(c)}-{i}" for i, (n, c, _, _) in enumerate(_bad_inputs())])
def test_every_backend_refuses_bad_input_with_the_same_words(name, changes, error, message):
    """The C++ kernels (wiola/checks.h, the default path), the kernels written in Python
    (validation.py, forced backends) and the fakes (validation.py, torch.compile) make the
    same checks with the same messages."""
    case = BY_NAME[name]
    args = dict(case.make(torch.float32), **changes)
    for backend in _validating_backends(case.op):
        for call_args in (args, _with_grad(args)):  # the registered op directly, and through the Function
            with wk.use_backend(backend), pytest.raises(error, match=message):
                case.public(**call_args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    if any(v in message for v in ("lie within", "values must lie", "labels must lie", "num_items must be a finite")):
        return  # a check of values: not made while tracing (no data), the kernels make it at run time
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises(error, match=message):
        case.public(**{n: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for n, v in args.items()})


def test_index_dtypes_are_the_only_integer_dtypes_accepted():
    args = BY_NAME["srpe"].make(torch.float32)
    for dtype in (torch.int8, torch.bool):
        if dtype in INDEX_DTYPES:
            continue
        for backend in _validating_backends("srpe"):
            with wk.use_backend(backend), pytest.raises(TypeError, match="position_ids must have dtype in"):
                wk.srpe(**dict(args, position_ids=args["position_ids"].to(dtype)))


# --- the fallback policy ------------------------------------------------------------------------

def _count_fallback_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "instead" in str(w.message)]


def test_a_forced_backend_that_cannot_take_an_input_warns_once_and_another_runs(monkeypatch, ran):
    if "cpu" not in available_backends("rms_norm", CPU):
        pytest.skip("needs the C++ extension")
    monkeypatch.setitem(dispatch._limits["rms_norm"], "cpu", Limits(dtypes=(torch.float32,)))
    dispatch.reset_warnings()
    args = _with_grad(BY_NAME["rms_norm"].make(torch.float64))

    def run():
        with wk.use_backend("cpu"):
            return wk.rms_norm(**args)

    messages = _count_fallback_warnings(run) + _count_fallback_warnings(run)
    assert len(messages) == 1, messages
    assert re.search(r"rms_norm: backend 'cpu' cannot take dtype float64 \(it takes float32\): running "
                     r"'reference' instead", messages[0]), messages[0]
    assert set(ran) == {"reference"}
    want = BY_NAME["rms_norm"].reference(*(v.detach() if isinstance(v, torch.Tensor) else v for v in args.values()))
    assert_close_rel(run(), want, tolerance(torch.float64))


@pytest.mark.parametrize("case", [c for c in CASES if "cuda_emu" in dispatch.implemented(c.op)], ids=lambda c: c.name)
def test_cuda_kernel_limits_fall_back_with_a_warning(case, ran):
    """The CUDA kernels (run here by the emulator, backend cuda_emu) take no float64: the op
    warns once and runs the CPU backend, whose result matches the oracle."""
    if "cuda_emu" not in available_backends(case.op, CPU):
        pytest.skip("the extension was built without the emulated CUDA kernels")
    why = dispatch.limits(case.op, "cuda_emu").reason(torch.float64, None)
    assert why is not None and "float64" in why
    dispatch.reset_warnings()
    args = case.make(torch.float64)
    with wk.use_backend("cuda_emu"):
        messages = _count_fallback_warnings(lambda: case.public(**args))
    assert len(messages) == 1 and "'cuda_emu' cannot take dtype float64" in messages[0], messages
    assert "cuda_emu" not in ran


def test_backends_lists_each_backends_limits():
    report = wk.backends("cpu")
    for op in dispatch.ops():
        for backend, status in report[op].items():
            assert status == "available" or status.startswith("unavailable: ")
            assert status.limits == dispatch.limits(op, backend)
            assert status.limits.describe() in repr(status)
    gcla = report["gcla_attention"]
    assert gcla["cuda"].limits.head_dims == (64, 128) and torch.float64 not in gcla["cuda"].limits.dtypes
    assert "d_h in {64, 128}" in repr(gcla["cuda"]) and "even d_h in [2, 256]" in repr(gcla["triton"])
    assert report["rms_norm"]["reference"].limits.describe() == "any input"


def test_each_op_registers_a_kernel_per_device_and_a_fake():
    """The dispatcher, not Python, picks the kernel: every public op has a CPU kernel (C++), a
    CUDA kernel (CUDA C++ or a Triton launcher, registered whether or not a GPU is here) and a
    fake, and no autograd kernel of its own (the Function is the autograd)."""
    if not HAVE_OPS:
        pytest.skip("needs the C++ extension")
    for case in CASES:
        for name in (case.name, f"{case.name}_backward"):
            qualname = f"wiola::{name}"
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"), qualname
            if torch.version.cuda is not None or name.startswith(("rms_norm", "srpe", "gcla")):
                assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"), qualname
            assert torch._library.simple_registry.singleton.find(qualname).fake_impl.kernel is not None, qualname
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "AutogradCPU"), qualname


# --- the cost of a call -------------------------------------------------------------------------

_FIRST_CALL = """
import sys, time, torch
import wiola_kernels as wk
t = time.perf_counter()
wk.rms_norm(torch.randn(4, 64), torch.ones(64), torch.zeros(64))
first = time.perf_counter() - t
x = torch.randn(4, 64, requires_grad=True)
wk.rms_norm(x, torch.ones(64), torch.zeros(64)).sum().backward()
q, k = wk.srpe(torch.randn(1, 4, 1, 64), torch.randn(1, 1, 1, 64), torch.tensor([[3]]))
print("dynamo" if "torch._dynamo" in sys.modules else "no_dynamo", first)
"""


@needs_ops
def test_first_calls_import_no_dynamo():
    """The op layer is the dispatcher's: calling ops (forward and backward) imports no
    ``torch._dynamo`` (seconds), only ``torch.compile`` does. (The time is printed, not judged.)"""
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, WIOLA_BACKEND=""))
    assert out.returncode == 0, out.stderr[-2000:]
    verdict, seconds = out.stdout.split()
    assert verdict == "no_dynamo", out.stdout
    print(f"first wk.rms_norm call after import: {float(seconds):.3f} s")


def test_wiola_backend_is_read_at_import():
    """WIOLA_BACKEND set before the import forces the backend; a bad name is a ValueError from
    backends() and from every op call, naming the variable."""
    code = ("import torch, wiola_kernels as wk\n"
            "from wiola_kernels import dispatch\n"
            "print(dispatch.select('rms_norm', torch.device('cpu')))\n"
            "with wk.use_backend('auto'):\n"
            "    print(dispatch.forced_backend())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, WIOLA_BACKEND="reference"))
    assert out.returncode == 0, out.stderr[-2000:]
    selected, masked = out.stdout.split()
    assert selected == "reference" and masked == ("None" if HAVE_OPS else dispatch.PYTHON_DEFAULT)
    code = ("import torch, wiola_kernels as wk\n"
            "for call in (lambda: wk.backends('cpu'), lambda: wk.rms_norm(torch.ones(2, 4), torch.ones(4))):\n"
            "    try:\n        call()\n    except ValueError as e:\n        print('ValueError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, WIOLA_BACKEND="bogus"))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all("'bogus' (from the environment variable WIOLA_BACKEND)" in ln for ln in lines), lines
