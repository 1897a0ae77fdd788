"""The op layer, across ops (issue 14 §1–2): per op one ``torch.autograd.Function`` drives the
registered forward and grad ops, keeps the forward's backend on ``ctx`` for the backward,
traces under ``torch.compile`` without graph breaks; every op validates ``position_ids`` and
``lengths`` the same way; a backend that cannot take an input is skipped with one warning.

Each op is a :class:`Case` below; ``test_every_registered_op_has_a_case`` fails when an op
is added to :mod:`wiola_kernels.dispatch` without one. Results are compared with the float64
reference (``wiola_kernels.reference``), never with the code under test.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch._dynamo.utils import counters

import wiola_kernels as wk
from wiola_kernels import dispatch, reference
from wiola_kernels.testing import assert_close_rel, available_backends, tolerance
from wiola_kernels.validation import INDEX_DTYPES, Limits

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(dtype)


# --- one Case per op: inputs, its registered ops' arguments, its oracle ------------------------

@dataclass(frozen=True)
class Case:
    name: str                      # the public function, wk.<name>
    function: type                 # its torch.autograd.Function
    op: str                        # its dispatch name
    make: Callable[[torch.dtype], dict]                 # arguments of wk.<name>, in order
    op_calls: Callable[[dict], list]                    # [(registered op, args)]: forward, then grad
    reference: Callable                                  # the float64 oracle, same arguments

    @property
    def public(self) -> Callable:
        return getattr(wk, self.name)


def _rms_make(dtype):
    return dict(x=_rand(3, 5, 8, dtype=dtype, seed=1), weight=_rand(8, dtype=dtype, seed=2) * 0.3 + 1,
                shift=_rand(8, dtype=dtype, seed=3) * 0.1, eps=1e-6, hf_order=False)


def _rms_calls(a):
    x2 = a["x"].reshape(-1, 8)
    fwd = (x2, a["weight"], a["shift"], a["eps"], a["hf_order"])
    _, rstd = torch.ops.wiola.rms_norm(*fwd)
    return [(torch.ops.wiola.rms_norm.default, fwd),
            (torch.ops.wiola.rms_norm_grad.default, (torch.randn_like(x2), x2, a["weight"], a["shift"], rstd))]


def _srpe_make(dtype):
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    return dict(q=_rand(2, 4, 5, 8, dtype=dtype, seed=4), k=_rand(2, 2, 5, 8, dtype=dtype, seed=5), position_ids=pos,
                theta=10000.0, spiral_divisor=8.0, radial_amplitude=0.1, radial_frequency=0.01)


def _srpe_calls(a):
    params = (a["theta"], a["spiral_divisor"], a["radial_amplitude"], a["radial_frequency"])
    return [(torch.ops.wiola.srpe.default, (a["q"], a["k"], a["position_ids"], *params)),
            (torch.ops.wiola.srpe_grad.default,
             (torch.randn_like(a["q"]), torch.randn_like(a["k"]), a["position_ids"], *params))]


def _gcla_make(dtype):
    # d_h = 64: a head width the CUDA kernels (cuda_emu here) take, so every backend runs it.
    shapes = dict(q_rot=(2, 4, 5, 64), k_rot=(2, 2, 5, 64), v=(2, 2, 5, 64), q=(2, 4, 5, 64),
                  kc=(2, 4, 5, 2, 64), vc=(2, 4, 5, 2, 64), gate=(4,))
    args = {name: _rand(*shape, dtype=dtype, seed=10 + i) for i, (name, shape) in enumerate(shapes.items())}
    return dict(args, lengths=torch.tensor([5, 3]))


def _gcla_calls(a):
    ins = [a[n] for n in ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate")]
    out, lse = torch.ops.wiola.gcla_attention(*ins, a["lengths"])
    return [(torch.ops.wiola.gcla_attention.default, (*ins, a["lengths"])),
            (torch.ops.wiola.gcla_attention_grad.default, (torch.randn_like(out), *ins, a["lengths"], out, lse))]


def _atm_tokens(dtype, seed):
    """(2, 6, 4) tokens whose neighbour cosines are 1 (repeats) or at most ~0.1: far from τ."""
    basis = torch.tensor([[0, 0, 1, 2, 2, 3], [1, 1, 1, 0, 3, 3]])
    x = torch.nn.functional.one_hot(basis, 4).to(torch.float64) * (1 + torch.rand(2, 6, 1, generator=_gen(seed)))
    return (x + 0.01 * torch.randn(2, 6, 4, generator=_gen(seed + 1), dtype=torch.float64)).to(dtype)


def _merge_make(dtype):
    return dict(x=_atm_tokens(dtype, 20), position_ids=torch.arange(6).expand(2, 6) + 3, threshold=0.5,
                lengths=torch.tensor([6, 4]))


def _merge_calls(a):
    fwd = (a["x"], a["position_ids"].contiguous(), a["lengths"], a["threshold"])
    merged, _, merged_lengths, index_map = torch.ops.wiola.atm_merge(*fwd)
    return [(torch.ops.wiola.atm_merge.default, fwd),
            (torch.ops.wiola.atm_merge_grad.default, (torch.randn_like(merged), index_map, merged_lengths))]


def _unmerge_make(dtype):
    index_map = reference.atm_merge(_atm_tokens(torch.float64, 20), torch.arange(6), 0.5)[3]
    return dict(y=_rand(2, 6, 4, dtype=dtype, seed=30), index_map=index_map)


def _unmerge_calls(a):
    return [(torch.ops.wiola.atm_unmerge.default, (a["y"], a["index_map"])),
            (torch.ops.wiola.atm_unmerge_grad.default, (torch.randn_like(a["y"]), a["index_map"]))]


CASES = [
    Case("rms_norm", wk.RMSNormFunction, "rms_norm", _rms_make, _rms_calls, reference.rms_norm),
    Case("srpe", wk.SRPEFunction, "srpe", _srpe_make, _srpe_calls, reference.srpe),
    Case("gcla_attention", wk.GCLAAttentionFunction, "gcla_attention", _gcla_make, _gcla_calls,
         reference.gcla_attention),
    Case("atm_merge", wk.ATMMergeFunction, "atm", _merge_make, _merge_calls, reference.atm_merge),
    Case("atm_unmerge", wk.ATMUnmergeFunction, "atm", _unmerge_make, _unmerge_calls, reference.atm_unmerge),
]
BY_NAME = {c.name: c for c in CASES}


def _kind(case: Case) -> str:
    return "attention" if case.name == "gcla_attention" else "elementwise"


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


def _case_backends():
    return [pytest.param(c, b, id=f"{c.name}-{b}") for c in CASES for b in _backends_here(c.op)]


@pytest.fixture
def resolved(monkeypatch):
    """Records the backend every registered-op call runs on (``dispatch.resolve``)."""
    calls: list[str] = []
    original = dispatch.resolve

    def recording(op, backend, *args, **kwargs):
        impl = original(op, backend, *args, **kwargs)
        calls.append(next(name for name, i in dispatch._registry[op].items() if i is impl))
        return impl

    monkeypatch.setattr(dispatch, "resolve", recording)
    return calls


# --- the Functions are the public API's autograd ----------------------------------------------

def test_every_registered_op_has_a_case():
    assert {c.op for c in CASES} == set(dispatch.ops())


def test_functions_are_exported_and_documented():
    docs = (ROOT / "docs" / "ops.md").read_text() + (ROOT / "CONTRIBUTING.md").read_text()
    exported = {n for n in wk.__all__ if n.endswith("Function")}
    assert exported == {c.function.__name__ for c in CASES}
    for case in CASES:
        assert issubclass(case.function, torch.autograd.Function)
        assert getattr(wk, case.function.__name__) is case.function
        assert case.function.__name__ in docs, f"{case.function.__name__} missing from docs/ops.md / CONTRIBUTING.md"
        assert case.function.__doc__ and case.public.__doc__


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_public_function_runs_through_its_function(case):
    args = _with_grad(case.make(torch.float32))
    out = case.public(**args)
    for o in _float_outputs(out):
        assert type(o.grad_fn).__name__ == f"{case.function.__name__}Backward"
    direct = case.function.apply(*args.values())
    for a, b in zip(_float_outputs(out), _float_outputs(direct)):
        assert torch.equal(a, b)


def test_modules_run_through_the_functions():
    x = _rand(2, 3, 8, dtype=torch.float32, seed=40).requires_grad_()
    for module in (wk.WiolaRMSNorm(8), wk.RMSNorm(8)):
        assert type(module(x).grad_fn).__name__ == "RMSNormFunctionBackward"
    a = _srpe_make(torch.float32)
    q_out, _ = wk.SpiralRotaryEmbedding(8)(a["q"].requires_grad_(), a["k"], a["position_ids"])
    assert type(q_out.grad_fn).__name__ == "SRPEFunctionBackward"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_function_validates_its_arguments(case):
    """Function.apply is a public entry point: it checks its arguments like the function does."""
    args = case.make(torch.float32)
    first = next(iter(args))
    with pytest.raises(TypeError, match=f"^{first} must be a torch.Tensor"):
        case.function.apply("not a tensor", *list(args.values())[1:])


# --- the backend the forward ran is the backward's ---------------------------------------------

@pytest.mark.parametrize("case, backend", _case_backends())
def test_backward_runs_on_the_forwards_backend(case, backend, resolved):
    others = [b for b in _backends_here(case.op) if b != backend]
    args = _with_grad(case.make(torch.float32))
    with wk.use_backend(backend):
        out = case.public(**args)
    assert resolved == [backend]
    ctx = _float_outputs(out)[0].grad_fn
    assert ctx.backend == backend                      # kept on ctx
    resolved.clear()
    with wk.use_backend(others[0] if others else "auto"):  # another override around the backward
        grads = torch.autograd.grad(_loss(out), _leaves(args))
    assert resolved == [backend]
    _, want = _oracle(case, args)
    for g, w in zip(grads, want):
        assert_close_rel(g, w, tolerance(torch.float32, _kind(case)), "grad")


@pytest.mark.parametrize("case, backend", _case_backends())
def test_float64_gradcheck(case, backend):
    args = _with_grad(case.make(torch.float64))
    names = [n for n, v in args.items() if isinstance(v, torch.Tensor) and v.requires_grad]

    def f(*leaves):
        return case.function.apply(*{**args, **dict(zip(names, leaves))}.values())

    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(f, [args[n] for n in names], fast_mode=True)


@pytest.mark.parametrize("case, backend", _case_backends())
def test_opcheck_forward_and_grad_ops(case, backend):
    with wk.use_backend(backend):
        calls = case.op_calls(case.make(torch.float32))
        assert [op.name() for op, _ in calls] == [f"wiola::{case.name}", f"wiola::{case.name}_grad"]
        for op, args in calls:
            torch.library.opcheck(op, args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_explicit_backend_argument_of_the_ops(case):
    """The registered ops run on the backend they are given; a backend the input is outside
    the limits of raises ValueError (no fallback there); a name the op lacks too."""
    (forward, args), _ = case.op_calls(case.make(torch.float32))
    first = args[0]
    want = forward(*args, "reference")
    for backend in _backends_here(case.op):
        why = dispatch.limits(case.op, backend).reason(first.dtype, first.shape[-1])
        if why is not None:
            with pytest.raises(ValueError, match=f"backend '{backend}' of {case.op} cannot take"):
                forward(*args, backend)
            continue
        got = forward(*args, backend)
        for x, y in zip(_float_outputs(got), _float_outputs(want)):
            assert_close_rel(x, y, tolerance(torch.float32, _kind(case)), backend)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        forward(*args, "nonsense")


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
    backends = ["reference"] + [b for b in _backends_here(case.op) if b != "reference"][:1]
    for backend in backends:  # a different use_backend block retraces (Dynamo guards on it)
        resolved.clear()
        with wk.use_backend(backend):
            loss = compiled(*args.values())
        grads = torch.autograd.grad(loss, _leaves(args))
        assert resolved and set(resolved) == {backend}, resolved  # forward and backward
        tol = tolerance(torch.float32, _kind(case))
        assert abs(float(loss.detach()) - float(want_loss)) <= tol * max(1.0, abs(float(want_loss)))
        for g, w in zip(grads, want_grads):
            assert_close_rel(g, w, tol, "grad")
    assert sum(counters["graph_break"].values()) == 0


# --- one validation for every op ----------------------------------------------------------------

def _taking(parameter: str) -> list[Case]:
    """The cases whose public function has ``parameter`` (found from the signatures)."""
    takers = [n for n in wk.__all__ if callable(getattr(wk, n)) and not inspect.isclass(getattr(wk, n))
              and parameter in inspect.signature(getattr(wk, n)).parameters]
    assert takers, parameter
    return [BY_NAME[n] for n in takers]


@pytest.mark.parametrize("case", _taking("position_ids"), ids=lambda c: c.name)
def test_position_ids_shapes_and_dtypes_agree_across_ops(case):
    """(B, T), (1, T) and (T,), in every integer dtype of INDEX_DTYPES, give the same result."""
    args = case.make(torch.float64)
    pos = args["position_ids"]
    b, t = pos.shape
    shared = pos[:1].expand(b, t).contiguous()
    want = case.reference(**dict(args, position_ids=shared))
    for variant in (shared, shared[:1], shared[0]):
        for dtype in INDEX_DTYPES:
            got = case.public(**dict(args, position_ids=variant.to(dtype)))
            for g, w in zip(got, want):
                assert_close_rel(g, w, tolerance(torch.float64), f"position_ids {tuple(variant.shape)} {dtype}")
    for bad, error in ((shared[:, :-1], ValueError), (shared[None], ValueError), (shared.float(), TypeError),
                       (shared.bool(), TypeError), (shared.tolist(), TypeError)):
        with pytest.raises(error, match="^position_ids"):
            case.public(**dict(args, position_ids=bad))


@pytest.mark.parametrize("case", _taking("lengths"), ids=lambda c: c.name)
def test_lengths_checks_agree_across_ops(case):
    args = case.make(torch.float64)
    lengths = args["lengths"]
    b, t = lengths.shape[0], args[next(iter(args))].shape[-2 if case.name == "gcla_attention" else 1]
    want = case.reference(**args)
    for dtype in INDEX_DTYPES:
        got = case.public(**dict(args, lengths=lengths.to(dtype)))
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert_close_rel(g, w, tolerance(torch.float64, _kind(case)), f"lengths {dtype}")
    bad_cases = ((lengths.float(), TypeError, "^lengths must have dtype"),
                 ([int(v) for v in lengths], TypeError, "^lengths must be a torch.Tensor"),
                 (lengths[:1], ValueError, r"^lengths must have shape \(B,\)"),
                 (torch.full((b,), t + 1), ValueError, r"^lengths must lie in \[0, T\]"),
                 (torch.full((b,), -1), ValueError, r"^lengths must lie in \[0, T\]"))
    for bad, error, match in bad_cases:
        with pytest.raises(error, match=match):
            case.public(**dict(args, lengths=bad))


def test_index_dtypes_are_the_only_integer_dtypes_accepted():
    args = _srpe_make(torch.float32)
    for dtype in (torch.int8, torch.bool):
        if dtype in INDEX_DTYPES:
            continue
        with pytest.raises(TypeError, match="position_ids must have dtype in"):
            wk.srpe(**dict(args, position_ids=args["position_ids"].to(dtype)))


# --- the fallback policy ------------------------------------------------------------------------

def _count_fallback_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "instead" in str(w.message)]


@pytest.mark.parametrize("forced", [False, True], ids=["auto", "forced"])
def test_a_backend_that_cannot_take_an_input_warns_once_and_another_runs(forced, monkeypatch, resolved):
    if "cpu" not in available_backends("rms_norm", CPU):
        pytest.skip("needs the C++ extension")
    monkeypatch.setitem(dispatch._limits["rms_norm"], "cpu", Limits(dtypes=(torch.float32,)))
    dispatch.reset_warnings()
    args = _with_grad(_rms_make(torch.float64))

    def run():
        with wk.use_backend("cpu") if forced else wk.use_backend("auto"):
            return wk.rms_norm(**args)

    messages = _count_fallback_warnings(run) + _count_fallback_warnings(run)
    assert len(messages) == 1, messages
    assert re.search(r"rms_norm: backend 'cpu' cannot take dtype float64 \(it takes float32\): running "
                     r"'reference' instead", messages[0]), messages[0]
    assert set(resolved) == {"reference"}
    want = reference.rms_norm(*(v.detach() if isinstance(v, torch.Tensor) else v for v in args.values()))
    assert_close_rel(run(), want, tolerance(torch.float64))
    x2 = args["x"].detach().reshape(-1, 8)
    with pytest.raises(ValueError, match="backend 'cpu' of rms_norm cannot take dtype float64"):
        torch.ops.wiola.rms_norm(x2, args["weight"].detach(), args["shift"].detach(), 1e-6, False, "cpu")


@pytest.mark.parametrize("case", [c for c in CASES if "cuda_emu" in dispatch.implemented(c.op)], ids=lambda c: c.name)
def test_cuda_kernel_limits_fall_back_with_a_warning(case, resolved):
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
    assert "cuda_emu" not in resolved


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
