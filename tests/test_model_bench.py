"""``python -m wiola bench`` (the training step): the default set, ``--full``, ``--budget``,
and what a case past its budget prints. The slow steps are faked (a sleep the budget's timer
must interrupt), so no assertion depends on how fast this machine is."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

import wiola.__main__ as wiola_cli
import wiola_kernels
from wiola import bench as wiola_bench

TINY = ["--d", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq", "16", "--batch", "1",
        "--threads", "1"]
TINY_ARGS = dict(d=32, layers=2, heads=4, kv_heads=2, seq=16, batch=1, vocab=259, steps=2, threads=1, fused="auto")


@pytest.fixture(autouse=True)
def _keep_merge_apply(monkeypatch):
    """The bench wraps ATMMergeFunction.apply to count merges: put the original back after."""
    monkeypatch.setattr(wiola_kernels.ATMMergeFunction, "apply", wiola_kernels.ATMMergeFunction.apply)


@pytest.fixture
def slow_reference(monkeypatch):
    """Every reference-backend step sleeps 30 s (the budget stops it); the others return at
    once. Counts the steps begun and the slow ones that finished."""
    calls = {"fast": 0, "slow": 0, "slow finished": 0}

    def step(model, opt, ids):
        if model.config.kernel_backend == "reference":
            calls["slow"] += 1
            time.sleep(30)
            calls["slow finished"] += 1
        else:
            calls["fast"] += 1
        return 0.01

    monkeypatch.setattr(wiola_bench, "_step", step)
    return calls


def _rows(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if re.match(r"\s+(auto|reference)\s+(on|off)\s", ln)]


def test_default_runs_one_case_per_comparison_and_full_all_four(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(wiola_bench, "_in_process", lambda args, backend, atm, budget: seen.append(
        (backend, atm, args["seq"], budget)) or dict(backend=backend, atm=atm, step_s=None, steps_s=[],
                                                     tokens_per_s=None, ops={}, peak_rss_mb=None, step_peak_mb=None,
                                                     skipped="> 1 s, skipped (faked)"))
    wiola_bench.main(["--threads", "1"])
    header = capsys.readouterr().out.splitlines()
    assert "T 128" in header[0] and "threads 1 (--threads)" in header[0] and "budget 45 s per case" in header[1]
    assert header[2].startswith("--full: also reference with ATM on, T 512")
    assert seen == [("auto", False, 128, 45.0), ("reference", False, 128, 45.0), ("auto", True, 128, 45.0)]

    calls = []

    def fake_subprocess(target, *args, limit_s=None):
        calls.append((target.__name__, args[1:], limit_s))
        if target is wiola_bench._timing:
            results = [wiola_bench._record(b, atm, args[0], [0.1], None) for b, atm in args[1]]
            return dict(results=results, threads=1, atm_merged_fraction=0.1, atm_lengths=[])
        return dict(peak_rss_mb=100.0, step_peak_mb=10.0)

    monkeypatch.setattr(wiola_bench, "_subprocess", fake_subprocess)
    results = wiola_bench.main(["--full", "--threads", "1", "--budget", "7"])
    cases = [("auto", False), ("reference", False), ("auto", True), ("reference", True)]
    assert calls[0] == ("_timing", (cases, 7.0), 2 * 4 * 7.0 + wiola_bench.PROCESS_GRACE_S)
    assert [c[:2] for c in calls[1:]] == [("_memory", (b, atm, 7.0)) for b, atm in cases]
    assert all(c[2] == 7.0 + wiola_bench.PROCESS_GRACE_S for c in calls[1:])
    assert [(r["backend"], r["atm"], r["budget_s"]) for r in results] == [(b, atm, 7.0) for b, atm in cases]


def test_full_defaults_to_its_own_sequence_and_budget(monkeypatch):
    calls = []

    def fake_subprocess(target, *args, limit_s=None):
        calls.append((target.__name__, args))
        if target is wiola_bench._timing:
            return dict(results=[wiola_bench._record(b, atm, args[0], [0.1], None) for b, atm in args[1]],
                        threads=1, atm_merged_fraction=0.1, atm_lengths=[])
        return dict(peak_rss_mb=100.0, step_peak_mb=10.0)

    monkeypatch.setattr(wiola_bench, "_subprocess", fake_subprocess)
    wiola_bench.main(["--full", "--threads", "1"])
    assert calls[0][1][0]["seq"] == wiola_bench.FULL_SEQ and calls[0][1][2] == wiola_bench.FULL_BUDGET_S


def test_a_case_past_its_budget_is_stopped_and_reported_and_the_others_run(slow_reference, capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    results = wiola_bench.main([*TINY, "--steps", "2", "--budget", "1", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert slow_reference == {"fast": 2 * (2 + 2), "slow": 1, "slow finished": 0}  # stopped, not left to run
    rows = _rows(out)
    assert len(rows) == 3 and "skipped" not in rows[0] and "skipped" not in rows[2]
    assert re.match(r"\s+reference\s+off\s+> 1 s, skipped \(the first run unfinished at 1 s\)", rows[1]), rows[1]
    fused, ref, fused_atm = results
    assert ref["step_s"] is None and ref["tokens_per_s"] is None and ref["skipped"].startswith("> 1 s, skipped")
    assert fused["skipped"] is None and fused["step_s"] == 0.01 and fused["steps_s"] == [0.01, 0.01]
    assert "fused/reference (ATM off): n/a tokens/s (reference ATM off skipped)" in out
    assert "1 case(s) not timed" in out and "--budget SECONDS" in out
    assert json.loads(out_json.read_text())[1]["skipped"] == ref["skipped"]


def test_a_step_the_warm_up_shows_too_long_is_skipped_before_its_timed_steps(monkeypatch, capsys):
    calls = []

    def step(model, opt, ids):
        calls.append(model.config.kernel_backend)
        if model.config.kernel_backend == "reference":
            time.sleep(0.2)
        return 0.2

    monkeypatch.setattr(wiola_bench, "_step", step)
    # Two warm-up steps of 0.2 s, then 20 timed ones would end at ~4.4 s: past the 2 s budget.
    wiola_bench.main([*TINY, "--steps", "20", "--budget", "2"])
    out = capsys.readouterr().out
    assert calls.count("reference") == 2
    assert re.search(r"reference\s+off\s+> 2 s, skipped \(one run takes .*: 20 timed runs would end at", out), out


def test_full_timing_and_memory_runs_keep_their_budgets(slow_reference):
    """--full's two children, run here (this is the main thread, as in the child): the
    interleaved timing skips the slow cases and times the others; a memory run past its
    budget says so."""
    class Queue(list):
        put = list.append

    q = Queue()
    cases = [("auto", False), ("reference", False)]
    wiola_bench._timing(TINY_ARGS, cases, 1.0, q)
    fused, ref = q[0]["results"]
    assert fused["skipped"] is None and fused["steps_s"] == [0.01, 0.01] and fused["tokens_per_s"] == 16 / 0.01
    assert ref["step_s"] is None and ref["skipped"] == "> 1 s, skipped (the first run unfinished at 1 s)"
    assert slow_reference["slow finished"] == 0
    wiola_bench._memory(TINY_ARGS, "reference", False, 1.0, q)
    assert q[1] == dict(peak_rss_mb=None, step_peak_mb=None,
                        memory_skipped="> 1 s, skipped (the first run unfinished at 1 s)")
    assert "(memory run: > 1 s, skipped" in wiola_bench._row({**ref, **q[1]}, None)


def test_a_benchmark_process_past_its_limit_is_stopped():
    from wiola_kernels.bench.runner import BudgetExceeded

    args = dict(TINY_ARGS, d=256, layers=6, heads=8, seq=512, batch=4)
    start = time.monotonic()
    # Spawning, importing torch and two steps take far longer than 0.5 s: the parent stops the child.
    with pytest.raises(BudgetExceeded, match=r"> 0.5 s, skipped \(its process was still running then"):
        wiola_bench._subprocess(wiola_bench._memory, args, "reference", False, 1000.0, limit_s=0.5)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("load, cpus, default, expected", [
    (4.3, 2, 2, 1),    # this shared machine: other work holds both CPUs
    (0.2, 2, 2, 2),    # idle: torch's default
    (1.2, 2, 2, 1),    # one CPU busy elsewhere
    (3.0, 16, 8, 8),   # plenty free: never more than torch's default
    (9.0, 16, 16, 7),
])
def test_auto_threads_leaves_the_cpus_other_work_holds(monkeypatch, load, cpus, default, expected):
    monkeypatch.setattr(wiola_bench.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(wiola_bench.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    threads, why = wiola_bench.auto_threads(default)
    assert threads == expected
    assert f"load average {load:.1f} on {cpus} CPUs" in why
    assert why.startswith("auto") == (expected < default)


def test_budget_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        wiola_cli.main(["bench", "--budget", "0"])
    assert exit_info.value.code == 2 and "argument --budget:" in capsys.readouterr().err

