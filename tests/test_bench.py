"""The benchmark harness and the `bench`/`check` commands (no timing is asserted)."""

from __future__ import annotations

import io
import json
import time

import pytest
import torch

from wiola_kernels.bench import all_cases
from wiola_kernels.bench.runner import copy_baseline, min_bytes

REQUIRED_KEYS = {"op", "backend", "shape", "dtype", "pass", "ms", "ms_eager", "ms_compile", "speedup_vs_eager",
                 "speedup_vs_compile", "gbps", "copy_gbps", "pct_of_copy"}


def test_every_op_has_a_case():
    from wiola_kernels import dispatch

    assert {c.op for c in all_cases("cpu", small=True)} == set(dispatch.ops())


def test_default_shapes_are_the_issues():
    shapes = {c.op: c.shape for c in all_cases("cpu")}
    assert "16384, 1024" in shapes["rms_norm"]
    assert "(4, 16, 2048, 64)" in shapes["srpe"] and "(4, 4, 2048, 64)" in shapes["srpe"]


def test_min_bytes_counts_each_tensor_once():
    case = next(c for c in all_cases("cpu", small=True) if c.op == "rms_norm" and c.dtype == torch.float32)
    inputs = case.make_inputs()
    x, w, s = inputs
    x_bytes, p_bytes = x.numel() * 4, w.numel() * 4
    assert min_bytes(case, "fwd", inputs) == 2 * x_bytes + 2 * p_bytes  # read x, w, s; write y
    # fwd+bwd: + read dy, + write dx, dw, ds, + read x, w, s again (the backward runs after the
    # forward, when a 64 MiB x has left the caches)
    assert min_bytes(case, "fwd+bwd", inputs) == 5 * x_bytes + 6 * p_bytes
    srpe = next(c for c in all_cases("cpu", small=True) if c.op == "srpe")
    q, k, pos = srpe.make_inputs()
    qk_bytes = (q.numel() + k.numel()) * 4
    # fwd: read q, k, positions, write q', k'; bwd: read dq', dk', positions again, write dq, dk
    assert min_bytes(srpe, "fwd+bwd", (q, k, pos)) == 4 * qk_bytes + 2 * pos.numel() * 8


@pytest.mark.parametrize("policy", ["warm", "fresh"])
def test_copies_under_each_page_policy_are_exact(policy):
    from wiola_kernels.bench.runner import page_policy

    copy = torch.ops.wiola._copy if hasattr(torch.ops.wiola, "_copy") else torch.clone
    with page_policy(policy, torch.device("cpu")) as before:
        for seed in range(3):  # 64 MiB: mmapped by default, from the heap under "warm"
            x = torch.randn(1 << 24, generator=torch.Generator().manual_seed(seed))
            before()
            assert torch.equal(copy(x), x)
    with pytest.raises(ValueError, match="policy"):
        with page_policy("lukewarm", torch.device("cpu")):
            pass


def test_copy_baseline_copies():
    fn, nbytes = copy_baseline(4096, torch.device("cpu"))
    out = fn()
    assert nbytes == 4096 and out.numel() * out.element_size() * 2 == 4096


@pytest.mark.skipif(not hasattr(torch.ops.wiola, "_copy"), reason="needs the C++ extension")
def test_extension_copy_is_exact():
    x = torch.randn(3, 1000, 777)
    assert torch.equal(torch.ops.wiola._copy(x), x)


def test_bench_command_writes_json_and_plot(tmp_path, capsys):
    # The command's main, as `python -m wiola_kernels bench` runs it (tests/test_cli.py runs the
    # real command lines in a process of their own).
    import wiola_kernels.__main__ as cli

    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    assert cli.main(["bench", "--small", "--ops", "rms_norm,atm", "--repeats", "1", "--no-compile", "--json",
                     str(out_json), "--plot", str(out_png)]) == 0
    stdout = capsys.readouterr().out
    records = json.loads(out_json.read_text())
    assert {(r["op"], r["pass"]) for r in records} == {(o, p) for o in ("rms_norm", "atm") for p in ("fwd", "fwd+bwd")}
    for r in records:
        assert REQUIRED_KEYS <= set(r)
        assert r["ms"] > 0 and r["gbps"] > 0 and r["ms_compile"] is None
    assert out_png.stat().st_size > 1000
    assert "x eager" in stdout and "% copy" in stdout


def test_bench_rejects_unknown_op(capsys):
    import wiola_kernels.__main__ as cli

    assert cli.main(["bench", "--ops", "nope"]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err


def test_check_command_passes(capsys):
    # The command end to end on two ops (an elementwise one and the loss with its 16-bit GEMM
    # path): every op × backend against the oracle is tests/test_all_ops.py's job, and the
    # whole `check` took 105 s of CI's 30 minutes.
    status, lines = _check(capsys, "--ops", "rms_norm,linear_cross_entropy")
    assert status == 0 and lines and all(ln.startswith("PASS") for ln in lines), lines
    assert {ln.split()[1] for ln in lines} == {"rms_norm", "linear_cross_entropy"}


# ---- `check` compares with the float64 oracle ----------------------------------------------

def _plant(monkeypatch, op: str, backend: str, *, forward=None, backward=None):
    """Replace ``backend``'s implementation of ``op`` by one with a planted bug."""
    from types import SimpleNamespace

    from wiola_kernels import dispatch

    good = dispatch._registry[op][backend]
    monkeypatch.setitem(dispatch._registry[op], backend, SimpleNamespace(
        forward=forward(good.forward) if forward else good.forward,
        backward=backward(good.backward) if backward else good.backward))


def _check(capsys, *args: str) -> tuple[int, list[str]]:
    import wiola_kernels.__main__ as cli

    status = cli.main(["check", "--device", "cpu", *args])
    return status, [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("PASS", "FAIL"))]


def _scaled(fn, index: int, rel: dict):
    """``fn`` with its output number ``index`` multiplied by ``1 + rel[dtype]``."""
    def wrong(*args, **kwargs):
        outs = list(fn(*args, **kwargs))
        outs[index] = outs[index] * (1 + rel[outs[index].dtype])
        return tuple(outs)
    return wrong


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_check_reports_a_planted_wrong_backend(monkeypatch, capsys, where):
    # A relative error in y (forward) or in grad_x (backward) of 10x the float32 tolerance
    # (1e-5; the correct kernel shows ~4e-7) and 3x the bfloat16 one (1e-2).
    rel = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
    _plant(monkeypatch, "rms_norm", "cpu", **{where: lambda fn: _scaled(fn, 0, rel)})
    status, lines = _check(capsys, "--ops", "rms_norm")
    assert status == 1
    cpu = [ln for ln in lines if ln.split()[2] == "cpu"]
    assert len(cpu) == 2 and all(ln.startswith("FAIL") and "rms_norm" in ln for ln in cpu)  # float32, bfloat16
    assert all(ln.startswith("PASS") for ln in lines if ln.split()[2] == "reference")


# ---- the plans, budgets and the streaming table ---------------------------------------------

def test_the_eager_baselines_are_the_references(monkeypatch):
    """Every case's eager baseline (also what torch.compile compiles, and check's oracle) runs
    the op's function of wiola_kernels.reference, not a copy of it beside the case."""
    import wiola_kernels.reference as reference

    called: set[str] = set()
    for name in reference.__all__:
        fn = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _fn=fn, _name=name, **k: called.add(_name) or _fn(*a, **k))
    for case in all_cases("cpu", small=True):
        assert case.baseline_to_compile() is case.eager and case.oracle is case.eager
        inputs = case.make_inputs()
        called.clear()
        with torch.no_grad():
            case.eager(*inputs)
        assert {"atm": {"atm_merge", "atm_unmerge"}}.get(case.op, {case.op}) <= called, (case.op, called)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_default_plan_is_each_registered_op_once_with_both_passes(device):
    from wiola_kernels import dispatch
    from wiola_kernels.bench.runner import make_plan

    plan = make_plan(device)
    assert sorted(c.op for c in plan.cases) == dispatch.ops()  # each op once, none missing
    assert plan.passes == ("fwd", "fwd+bwd") and plan.compile and plan.budget_s is not None
    expected = torch.float32 if device == "cpu" else torch.bfloat16
    assert {c.dtype for c in plan.cases} == {expected}
    assert f"in {str(expected).replace('torch.', '')};" in plan.describe()  # the header names the dtype


def test_full_plan_is_every_case():
    from wiola_kernels.bench.runner import PAGE_POLICIES, make_plan

    plan = make_plan("cpu", "full")
    assert [(c.op, c.shape, c.dtype) for c in plan.cases] == [(c.op, c.shape, c.dtype) for c in all_cases("cpu")]
    assert plan.page_policies == PAGE_POLICIES and plan.repeats == 10
    assert {c.dtype for c in plan.cases} == {torch.float32, torch.bfloat16}


def test_a_dtype_keeps_only_that_dtypes_cases():
    from wiola_kernels.bench.runner import make_plan

    plan = make_plan("cpu", "full", dtypes=[torch.float32])
    full = [(c.op, c.shape) for c in all_cases("cpu") if c.dtype == torch.float32]
    assert [(c.op, c.shape) for c in plan.cases] == full and {c.dtype for c in plan.cases} == {torch.float32}
    assert "plan full: every shape — " in plan.describe() and "in float32;" in plan.describe()
    assert "every shape and dtype" in make_plan("cpu", "full").describe()
    with pytest.raises(ValueError, match=r"dtype: no default case in bfloat16 \(this plan has float32; --full"):
        make_plan("cpu", dtypes=[torch.bfloat16])


def test_a_registered_op_without_a_case_is_refused(monkeypatch):
    from wiola_kernels import dispatch
    from wiola_kernels.bench.runner import make_plan

    monkeypatch.setitem(dispatch._registry, "zz_new_op", {})  # the plan follows the registry
    with pytest.raises(ValueError, match="zz_new_op.*no benchmark case"):
        make_plan("cpu")


def _fake_case(op: str, eager_sleep: float = 0.0, on_fused=None):
    from wiola_kernels.bench.cases import BenchCase

    def fused(x):
        if on_fused is not None:
            on_fused()
        return x * 2

    def eager(x):
        time.sleep(eager_sleep)
        return x * 2

    return BenchCase(op=op, shape="x (8, 16)", dtype=torch.float32, fused=fused, eager=eager,
                     make_inputs=lambda: (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),))


@pytest.fixture(scope="module", autouse=False)
def autograd_warm():
    """The first autograd call of a process imports sympy (seconds): out of the tiny budgets."""
    x = torch.ones(2, requires_grad=True)
    torch.autograd.grad(x * 2, x, torch.ones(2))


def test_a_timing_past_its_budget_is_skipped_and_the_run_goes_on(autograd_warm):
    from wiola_kernels.bench.runner import BenchPlan, run_plan

    out = io.StringIO()
    # The eager baseline sleeps 30 s a call: the timer stops it at the budget (0.3 s).
    plan = BenchPlan(name="small", cases=[_fake_case("slow", eager_sleep=30.0), _fake_case("after")],
                     passes=("fwd",), compile=False, repeats=3, budget_s=0.3)
    start = time.perf_counter()
    records = run_plan(plan, "cpu", out=out)
    assert time.perf_counter() - start < 20
    slow, after = records
    assert slow.ms is not None and slow.ms_eager is None and slow.speedup_vs_eager is None
    assert "unfinished at 0.3 s" in slow.skipped["eager"]
    assert after.ms is not None and after.ms_eager is not None and after.skipped == {}
    rows = out.getvalue().splitlines()
    assert any(r.startswith("slow") and "> 0.3 s, skipped (the first run unfinished at 0.3 s)" in r for r in rows)


def test_every_variant_is_timed_under_the_warm_page_policy(monkeypatch):
    """The ``ms`` of each variant, not only the op/copy pairs, is taken with freed memory kept:
    a process's first cases once paid for fresh pages (a 10x spread in one row)."""
    import contextlib

    import wiola_kernels.bench.runner as runner
    from wiola_kernels.bench.runner import BenchPlan, run_plan

    active, seen = [], []
    real = runner.page_policy

    @contextlib.contextmanager
    def recording(policy, device):
        active.append(policy)
        try:
            with real(policy, device) as before:
                yield before
        finally:
            active.pop()

    def timer(run, device, repeats, budget_s):
        seen.append(tuple(active))
        run()
        return 1.0

    monkeypatch.setattr(runner, "page_policy", recording)
    plan = BenchPlan(name="small", cases=[_fake_case("a")], passes=("fwd",), compile=False, repeats=3,
                     budget_s=None, page_policies=("warm",), copy_pairs=3)
    run_plan(plan, "cpu", out=io.StringIO(), timer=timer)
    assert seen == [("warm",), ("warm",)]  # fused, eager


def test_a_variant_that_raises_is_reported_and_the_run_goes_on(autograd_warm):
    """An Inductor compile error in a baseline (as ATM's reference's ``torch.frexp`` once gave
    on AVX2) fails its cell, not the run; the later pass does not try it again."""
    from wiola_kernels.bench.runner import BenchPlan, run_plan

    calls = []

    def broken(x):
        calls.append(1)
        raise RuntimeError("C++ compile error\nmore lines")

    case = _fake_case("broken")
    case.eager = broken
    out = io.StringIO()
    records = run_plan(BenchPlan(name="small", cases=[case, _fake_case("after")], compile=False, repeats=2,
                                 budget_s=30), "cpu", out=out)
    assert [(r.op, r.ms_eager is None) for r in records] == [("broken", True), ("broken", True), ("after", False),
                                                             ("after", False)]
    assert records[0].skipped["eager"] == "failed: RuntimeError: C++ compile error" and len(calls) == 2
    assert records[0].ms is not None and "failed (RuntimeError)" in out.getvalue().splitlines()[2]


def test_a_timing_the_warm_up_shows_too_long_is_skipped_before_its_runs(autograd_warm, monkeypatch):
    import wiola_kernels.bench.runner as runner
    from wiola_kernels.bench.runner import BudgetExceeded, time_pass

    monkeypatch.setattr(runner, "WARMUP_S", 0.0)  # the two warm-up calls alone
    calls = []

    def run():
        calls.append(1)
        time.sleep(0.05)

    with pytest.raises(BudgetExceeded, match=r"> 0.5 s, skipped \(one run takes .*: 20 timed runs would end at"):
        time_pass(run, torch.device("cpu"), 20, 0.5)
    assert len(calls) == 2  # the warm-up only


def test_a_short_pass_warms_up_for_its_seconds_before_it_is_timed(monkeypatch):
    """Two calls of a 1 ms pass were not its steady state: the warm-up runs on to WARMUP_S."""
    import wiola_kernels.bench.runner as runner

    calls, timed_from = [], []

    def run():
        calls.append(time.perf_counter())

    monkeypatch.setattr(runner, "WARMUP_S", 0.05)
    start = time.perf_counter()
    real_deadline = runner.deadline

    def deadline(seconds):  # time_pass enters its timed runs' deadline after the warm-up
        timed_from.append(len(calls))
        return real_deadline(seconds)

    monkeypatch.setattr(runner, "deadline", deadline)
    runner.time_pass(run, torch.device("cpu"), 3, None)
    warm = timed_from[-1]
    assert warm > 2 and calls[warm - 1] - start >= 0.05 and len(calls) == warm + 3
    assert runner.warm_up(run, torch.device("cpu"), 2, 0, None) >= 0 and len(calls) == warm + 5  # default: 2 calls


def test_rows_are_printed_as_they_are_measured(autograd_warm):
    from wiola_kernels.bench.runner import BenchPlan, run_plan

    out = io.StringIO()
    seen_when_second_ran: list[str] = []
    second = _fake_case("second", on_fused=lambda: seen_when_second_ran.append(out.getvalue()))
    plan = BenchPlan(name="small", cases=[_fake_case("first"), second], compile=False, repeats=2, budget_s=30)
    run_plan(plan, "cpu", out=out)
    before = seen_when_second_ran[0].splitlines()
    assert [ln.split()[:3] for ln in before if ln.startswith("first")] == [["first", "float32", "fwd"],
                                                                           ["first", "float32", "fwd+bwd"]]
    assert before[0].split()[:3] == ["op", "dtype", "pass"] and not any(ln.startswith("second") for ln in before[:-1])
    first_rows = [ln for ln in before if ln.startswith("first")]
    assert all(ln.rstrip().endswith("x (8, 16)") for ln in first_rows)  # complete rows, shape last


def test_time_alternating_times_what_fits_and_says_why_for_the_rest():
    """The public face of the alternating timing (python -m wiola bench --full uses it): a run
    past its budget is stopped, one that raises is reported, the others are timed."""
    from wiola_kernels.bench.runner import time_alternating

    calls = {"fast": 0, "slow": 0, "slow done": 0}

    def fast():
        calls["fast"] += 1

    def slow():
        calls["slow"] += 1
        time.sleep(30)
        calls["slow done"] += 1

    def broken():
        raise ValueError("boom\nsecond line")

    ms, skipped = time_alternating({"fast": fast, "slow": slow, "broken": broken}, torch.device("cpu"), 3, 0.3)
    assert set(ms) == {"fast"} and ms["fast"] >= 0 and calls["fast"] == 2 + 3  # 2 warm-up runs, 3 rounds
    assert skipped["slow"] == "> 0.3 s, skipped (the first run unfinished at 0.3 s)"
    assert calls == {"fast": 5, "slow": 1, "slow done": 0}  # stopped, not left to run
    assert skipped["broken"] == "failed: ValueError: boom"
