"""The command lines a new user meets first: help that explains itself, mistakes
refused up front in one line with a non-zero exit and no traceback, progress, no hangs.

Most checks call the commands' ``main`` in this process (the same code path as the
command line, seconds faster); a few run the real command line in a subprocess, with a
timeout, for what only a fresh process shows (exit status, stderr, the hang).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import wiola.__main__ as wiola_cli
import wiola_kernels.__main__ as kernels_cli
from wiola import bench as wiola_bench
from wiola import train as wiola_train
from wiola_kernels.cli import CommandError

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _one_line_error(stderr: str, prog: str) -> str:
    """The error line; the only other lines allowed are argparse's usage lines."""
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(f"{prog}") and ": error: " in ln]
    assert len(errors) == 1, stderr
    assert all(ln == errors[0] or ln.lstrip().startswith(("usage:", "[")) or ln.startswith(" ") for ln in lines), stderr
    return errors[0]


# ---- real command lines (subprocess, with a timeout) ----------------------------------------

@pytest.mark.parametrize("args, env, prog, message", [
    (["-m", "wiola_kernels", "backends"], {"WIOLA_BACKEND": "bogus"}, "wiola-kernels", "WIOLA_BACKEND"),
    (["-m", "wiola", "bench", "--fused", "bogus"], {}, "python -m wiola bench", "invalid choice: 'bogus'"),
    (["-m", "wiola_kernels", "check", "--device", "cuda"], {}, "wiola-kernels", "no CUDA device"),
])
def test_mistakes_exit_non_zero_in_one_line(args, env, prog, message):
    if "cuda" in args and torch.cuda.is_available():  # pragma: no cover - GPU machines
        pytest.skip("this machine has CUDA")
    run = _run(args, env)  # `bench --fused bogus` used to hang forever
    assert run.returncode == 2, run.stderr
    assert message in _one_line_error(run.stderr, prog)


def test_python_m_wiola_without_a_command_prints_help_and_fails():
    run = _run(["-m", "wiola"])
    assert run.returncode == 2 and "usage: python -m wiola COMMAND" in run.stderr and "Traceback" not in run.stderr


# ---- the same code paths in this process ------------------------------------------------------

def test_counts_and_temperature_are_refused_up_front(capsys):
    for main, argv, option in [
        (kernels_cli.main, ["bench", "--repeats", "0"], "--repeats"),
        (wiola_cli.main, ["train", "--steps", "0"], "--steps"),
        (wiola_cli.main, ["bench", "--steps", "0"], "--steps"),
        (wiola_cli.main, ["generate", "--checkpoint", ".", "--temperature", "-0.5", "x"], "--temperature"),
        (wiola_cli.main, ["generate", "--checkpoint", ".", "--max-new-tokens", "0", "x"], "--max-new-tokens"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert f"argument {option}:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--d", "100", "--heads", "8"], "--d 100 must be a multiple of --heads 8"),
    (["bench", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 8"),
    (["bench", "--fused", "cuda"], "--fused cuda cannot run on the CPU"),
    (["train", "--backend", "cuda", "--device", "cpu"], "--backend cuda cannot run on cpu"),
    (["train", "--seq-len", "5000"], "--seq-len 5000 exceeds"),
    (["generate", "--checkpoint", "no/such/folder", "Hi"], "--checkpoint 'no/such/folder': no such folder"),
])
def test_wiola_mistakes_are_one_line_before_any_work(argv, message, capsys, monkeypatch):
    if "cuda" in argv and torch.cuda.is_available():  # pragma: no cover - GPU machines
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(wiola_bench, "_subprocess", lambda *a: pytest.fail("a benchmark process was started"))
    monkeypatch.setattr(wiola_train, "build_model", lambda *a: pytest.fail("a model was built"))
    assert wiola_cli.main(argv) == 2
    assert message in _one_line_error(capsys.readouterr().err, f"python -m wiola {argv[0]}")


def test_bench_dtype_that_leaves_no_case_is_one_line_before_any_work(monkeypatch, capsys):
    import wiola_kernels.bench.runner as runner

    monkeypatch.setattr(runner, "run_plan", lambda *a, **k: pytest.fail("a benchmark ran"))
    assert kernels_cli.main(["bench", "--ops", "rms", "--dtype", "bfloat16", "--device", "cpu"]) == 2
    err = _one_line_error(capsys.readouterr().err, "wiola-kernels")
    assert "--dtype: no default case in bfloat16" in err and "--full has every dtype" in err


def test_ops_accepts_the_readme_names():
    from wiola_kernels import dispatch

    assert kernels_cli._ops("atm_merge, rms_norm,atm_unmerge") == ["atm", "rms_norm"]
    assert kernels_cli._ops("gcla_attention,srpe") == ["gcla_attention", "srpe"]
    assert kernels_cli._ops(None) is None
    with pytest.raises(CommandError, match=f"unknown op 'atm_x'; choose from {', '.join(dispatch.ops())}, atm_merge"):
        kernels_cli._ops("atm_x")


def test_the_op_lists_are_the_registrys(monkeypatch, capsys):
    """`--ops`, its help and scripts/gpu_kernel_profile.py take the ops from the registry: an op
    registered there is known to them without another list to edit."""
    import importlib.util

    from wiola_kernels import dispatch

    spec = importlib.util.spec_from_file_location("gpu_kernel_profile", ROOT / "scripts" / "gpu_kernel_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    assert kernels_cli.op_names() == profile.registered_ops() == dispatch.ops()
    monkeypatch.setitem(dispatch._registry, "zz_new_op", {})
    assert kernels_cli._ops("zz_new_op,rms") == ["zz_new_op", "rms_norm"]
    assert "zz_new_op" in profile.registered_ops()
    assert "zz_new_op" in " ".join(_help(kernels_cli.main, ["bench"], capsys).split())


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys, tmp_path):
    import importlib.util

    import wiola_kernels.bench.runner as runner

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib"
                        else real_find_spec(name, *a))
    monkeypatch.setattr(runner, "run_case", lambda *a, **k: pytest.fail("the benchmark ran"))
    code = kernels_cli.main(["bench", "--small", "--ops", "rms_norm", "--device", "cpu", "--plot",
                             str(tmp_path / "p.png")])
    assert code == 2
    assert "--plot needs matplotlib" in _one_line_error(capsys.readouterr().err, "wiola-kernels")


@pytest.mark.parametrize("argv, message", [
    (["bench", "--profile", "rms_norm", "--device", "cpu"], "--profile: profiles the op layer's calls; use it with --overhead"),
    (["bench", "--overhead", "--profile", "rms_norm,rms_nrom", "--device", "cpu"],
     "--profile: unknown op 'rms_nrom'; choose from F.rms_norm, rms_norm, add_rms_norm"),
])
def test_profile_mistakes_are_refused_before_any_timing(argv, message, monkeypatch, capsys):
    import wiola_kernels.bench.overhead as overhead

    monkeypatch.setattr(overhead, "measure", lambda *a, **k: pytest.fail("the overhead was measured"))
    assert kernels_cli.main(argv) == 2
    assert message in _one_line_error(capsys.readouterr().err, "wiola-kernels")


@pytest.mark.parametrize("which", ["fwd", "fwd+bwd"])
def test_profile_names_where_an_ops_host_time_goes(which):
    """The profile of rms_norm's calls lists the op layer's own functions (the public op, and
    in the backward its autograd Function)."""
    from wiola_kernels.bench.overhead import profile

    text = profile(torch.device("cpu"), "rms_norm", which, calls=50, top=40)
    assert text.startswith(f"rms_norm {which} on cpu: 50 calls, the 40 functions with the most own time")
    assert re.search(r"wiola_kernels/ops/rms_norm\.py:\d+\(rms_norm\)", text)
    if which == "fwd+bwd":
        assert re.search(r"wiola_kernels/ops/rms_norm\.py:\d+\(backward\)", text)
    with pytest.raises(ValueError, match="op must be one of F.rms_norm, rms_norm"):
        profile(torch.device("cpu"), "nope")


def _help(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _parsers(main, argv: list[str], monkeypatch) -> list:
    """The parser ``main(argv)`` builds, and its sub-command parsers."""
    import argparse

    seen = []

    def capture(self, *args, **kwargs):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        main(argv)
    parser = seen[0]
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser] + [p for a in subs for p in a.choices.values()]


@pytest.mark.parametrize("main, argv, shown", [
    (kernels_cli.main, ["bench"], ["{auto,", "(default: auto)", "(default: 30.0)", "{cpu,cuda}", "atm_merge",
                                   "--full"]),
    (kernels_cli.main, ["check"], ["{cpu,cuda}"]),
    (kernels_cli.main, ["backends"], ["{cpu,cuda}"]),
    (wiola_train.main, [], ["{wiola-1.5b,", "(default: wiola-tiny)", "(default: 300)", "{auto,reference,cpu,cuda,triton}"]),
    (wiola_train.generate_main, [], ["(default: 0.8)", "greedy", "{auto,reference,cpu,cuda,triton}"]),
    (wiola_bench.main, [], ["(default: auto)", "(default: 3)", "{auto,reference,cpu,cuda,triton}", "--full"]),
])
def test_help_is_plain_text_with_defaults_choices_and_a_line_per_option(main, argv, shown, capsys):
    text = " ".join(_help(main, argv, capsys).split())  # argparse wraps lines anywhere
    assert "``" not in text and ":func:" not in text and "**" not in text, text
    for piece in shown:
        assert piece in text, (piece, text)
    monkeypatch = pytest.MonkeyPatch()
    try:
        for parser in _parsers(main, argv, monkeypatch):
            for action in parser._actions:
                if action.option_strings and action.dest != "help":
                    assert action.help and "\n" not in action.help, (parser.prog, action.option_strings)
                    assert "``" not in action.help
    finally:
        monkeypatch.undo()


def test_top_level_help_is_plain_text(capsys):
    text = _help(kernels_cli.main, [], capsys)
    assert "``" not in text and "bench" in text and "check" in text and "backends" in text


# ---- progress ----------------------------------------------------------------------------------

def test_train_bar_tokens_per_second_agrees_with_the_summary(tmp_path, capsys):
    wiola_train.main(["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--threads", "1",
                      "--out", str(tmp_path)])
    captured = capsys.readouterr()
    bar = [float(x.replace(",", "")) for x in re.findall(r"tok_s=([\d,]+)", captured.err)]
    summary = float(re.search(r"([\d,]+) tokens/s", captured.out).group(1).replace(",", ""))
    assert bar, captured.err
    assert abs(bar[-1] - summary) <= 0.2 * summary, (bar[-1], summary)


def test_generate_streams_tokens_as_they_come():
    import io

    out = io.StringIO()
    streamer = wiola_train._PrintStreamer(out)
    streamer.put(torch.tensor([[1, 75, 108]]))                      # the prompt: already printed
    assert out.getvalue() == ""
    streamer.put(torch.tensor([ord("A") + 3]))
    assert out.getvalue() == "A"                                    # shown before generation ends
    euro = "€".encode()                                             # 3 bytes, 3 tokens
    for byte in euro:
        streamer.put(torch.tensor([byte + 3]))
    streamer.put(torch.tensor([wiola_train.EOS]))                   # special ids print nothing
    streamer.end()
    assert out.getvalue() == "A€\n"


def test_bench_prints_progress_and_checks_in_the_parent(monkeypatch, capsys):
    calls = []

    def fake_subprocess(target, args, *rest, limit_s=None):
        calls.append(target.__name__)
        if target is wiola_bench._timing:
            results = [dict(backend=b, atm=atm, step_s=0.1, steps_s=[0.1], tokens_per_s=100.0, ops={},
                            peak_rss_mb=None, step_peak_mb=None, skipped=None)
                       for b, atm in (("auto", False), ("reference", False), ("auto", True), ("reference", True))]
            return dict(results=results, threads=1, atm_merged_fraction=0.25, atm_lengths=[[8, 6], [4, 4]])
        return dict(peak_rss_mb=100.0, step_peak_mb=10.0)

    monkeypatch.setattr(wiola_bench, "_subprocess", fake_subprocess)
    flops = dict(off=4e9, on=3e9, merged_layers_off=2e9, merged_layers_on=1e9)
    monkeypatch.setattr(wiola_bench, "_atm_flops", lambda args, lengths: flops if lengths == [[8, 6], [4, 4]] else {})
    wiola_bench.main(["--full", "--steps", "1", "--threads", "1"])
    captured = capsys.readouterr()
    assert calls == ["_timing"] + ["_memory"] * 4
    assert "[bench] timing" in captured.err and captured.err.count("[bench] memory") == 4
    assert "fused/reference (ATM off)" in captured.out
    assert "3.00 of 4.00 GFLOP, 25.0% saved over all layers (50.0% in the merged layers)" in captured.out


def test_wiola_bench_default_runs_in_this_process_and_prints_each_row_when_done(monkeypatch, capsys):
    """Without --full no process is spawned and each case's row is out before the next case runs
    (the three cases of the default: fused vs reference with ATM off, fused with ATM on)."""
    import wiola_kernels

    monkeypatch.setattr(wiola_kernels.ATMMergeFunction, "apply", wiola_kernels.ATMMergeFunction.apply)  # undo
    monkeypatch.setattr(wiola_bench, "_subprocess", lambda *a: pytest.fail("a benchmark process was started"))
    real, printed_before = wiola_bench._in_process, []

    def in_process(args, backend, atm, budget_s):
        printed_before.append(capsys.readouterr().out)
        return real(args, backend, atm, budget_s)

    monkeypatch.setattr(wiola_bench, "_in_process", in_process)
    results = wiola_bench.main(["--d", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq", "16",
                                "--batch", "1", "--steps", "1", "--threads", "1"])
    printed_before.append(capsys.readouterr().out)
    rows = [[ln for ln in out.splitlines() if re.match(r"\s+(auto|reference)\s+(on|off)\s", ln)]
            for out in printed_before]
    assert [len(r) for r in rows] == [0, 1, 1, 1]  # one row out between two cases, the last at the end
    assert "tok/s" in printed_before[0] and "step +MiB" in printed_before[0]
    assert [(r["backend"], r["atm"]) for r in results] == [("auto", False), ("reference", False), ("auto", True)]
    assert all(r["tokens_per_s"] > 0 and r["step_peak_mb"] >= 0 and r["peak_rss_mb"] is None for r in results)
    assert all(r["skipped"] is None and len(r["steps_s"]) == 1 for r in results)
    assert "fused/reference (ATM off)" in printed_before[-1]


def test_bench_refuses_full_with_small_and_a_zero_budget(capsys):
    assert kernels_cli.main(["bench", "--full", "--small", "--device", "cpu"]) == 2
    assert "--full and --small" in _one_line_error(capsys.readouterr().err, "wiola-kernels")
    with pytest.raises(SystemExit):
        kernels_cli.main(["bench", "--budget", "0"])
    assert "argument --budget:" in capsys.readouterr().err


def test_a_failing_benchmark_process_is_reported_not_waited_for():
    # Bypasses the parent's checks: the child itself fails building the model.
    bad = dict(d=256, layers=1, heads=3, kv_heads=1, seq=8, batch=1, vocab=259, steps=1, threads=1, fused="auto")
    outcome = {}

    def call():
        try:
            wiola_bench._subprocess(wiola_bench._memory, bad, "reference", False, 60.0)
        except RuntimeError as exc:
            outcome["error"] = str(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=240)
    assert not worker.is_alive(), "the benchmark parent hung on a failed child"
    assert re.search(r"memory process failed: ValueError: WiolaConfig\.head_dim must be even", outcome["error"])
