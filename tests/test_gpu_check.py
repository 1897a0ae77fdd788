"""scripts/gpu_check.sh fits the time a GPU is lent (15 minutes in all, 10 per command, a
minute or more to start): its own step table is read here. The dry run itself (what needs
no GPU) runs in CI (.ci/run)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TEXT = SCRIPT.read_text()
MAX_WALL_S = 480        # the whole run, wall time
MAX_TIMEOUTS_S = 540    # the steps' timeouts added up


def _plan_rows() -> list[list[str]]:
    out = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return [ln.split("\t") for ln in out.splitlines()]


def plan() -> list[tuple[str, int, str]]:
    """The steps (name, timeout, title), as the script prints them (``--plan``)."""
    return [(r[1], int(r[2]), r[3]) for r in _plan_rows() if r[0] == "step"]


def plan_value(name: str) -> int:
    return next(int(r[1]) for r in _plan_rows() if r[0] == name)


def test_step_timeouts_add_up_to_what_a_lent_gpu_allows():
    steps = plan()
    budget, reserve = plan_value("BUDGET"), plan_value("SUMMARY_RESERVE")
    assert budget <= MAX_WALL_S
    assert sum(t for _, t, _ in steps) <= MAX_TIMEOUTS_S, [(n, t) for n, t, _ in steps]
    assert all(0 < t <= budget for _, t, _ in steps)
    assert 0 < reserve <= dict((n, t) for n, t, _ in steps)["summary"]
    assert len({n for n, _, _ in steps}) == len(steps)


def test_every_planned_step_is_defined_and_every_step_is_planned():
    defined = set(re.findall(r"^step_([a-z0-9_]+)\(\) \{", TEXT, re.M))
    assert defined == {name.replace("-", "_") for name, _, _ in plan()}


def test_the_environment_comes_first_the_build_before_what_needs_it_and_the_summary_last():
    names = [n for n, _, _ in plan()]
    assert names[0] == "environment" and names[1] == "build" and names[-1] == "summary"
    # The benchmarks (bench, overhead, the HF step) are scripts/gpu_perf.sh's (tests/test_gpu_perf.py);
    # how the runner times and budgets the steps: tests/test_gpu_runner.py.
    assert {"gpu-tests", "sanitizers", "cuda-vs-emu", "check"} <= set(names[2:-1])


def _function(name: str) -> str:
    start = TEXT.index(f"\n{name}() {{")
    return TEXT[start:TEXT.index("\n}\n", start)]


def test_gpu_tests_run_to_the_end_with_a_failure_summary():
    body = _function("step_gpu_tests")
    command = [ln for ln in body.splitlines() if "-m pytest" in ln and "-m gpu" in ln]
    assert command and not re.search(r"(^|\s)-x(\s|$)", " ".join(command))
    assert "^(FAILED|ERROR) " in body  # the failures listed


def test_sanitizers_cover_the_four_tools_without_the_caching_allocator():
    assert re.search(r'^export SAN_TOOLS="memcheck racecheck synccheck initcheck"$', TEXT, re.M)
    body = _function("sanitize")
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in body and 'compute-sanitizer --tool "$tool"' in body
    assert "--error-exitcode 9" in body and '-k "sanitizer and not cuda_emu" tests/test_all_ops.py' in body
    steps = _function("step_sanitizers")
    assert 'for tool in $SAN_TOOLS; do\n    sanitize "$tool" &' in steps
    # The planted-bug copies, each under the tool that must catch it, where the checkout has them.
    assert 'bash "$planted" run "$OUT/planted_gpu"' in steps and "not available in this checkout" in steps
    assert "WIOLA_SANITIZER_RUN" not in TEXT  # set by the old script and read by nothing


def test_files_the_script_calls_exist():
    paths = set(re.findall(r"(?<![\w/.])((?:scripts|tests|csrc)/[\w./-]+\.(?:py|sh))\b", TEXT)) | {"setup.py"}
    assert {"scripts/triton_warmup.py", "scripts/gpu_compare_emu.py", "scripts/gpu_check_summary.py",
            "scripts/planted_gpu.sh", "csrc/tests/planted_bugs.py", "scripts/gpu_kernel_profile.py"} <= paths
    for path in paths:
        assert (ROOT / path).is_file(), path
    assert 'local planted=scripts/planted_gpu.sh' in TEXT


def test_planted_bugs_cover_every_sanitizer_tool():
    """scripts/planted_gpu.sh runs each plant of csrc/tests/planted_bugs.py under its tool: every
    tool of the sanitizer step has a plant to catch, and csrc/tests/planted_gpu.cu (the GPU driver)
    and csrc/tests/planted.h know every plant."""
    out = subprocess.run([sys.executable, str(ROOT / "csrc" / "tests" / "planted_bugs.py"), "--list"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    plants = [line.split("\t") for line in out.splitlines()]
    tools = set(re.search(r'^export SAN_TOOLS="([^"]+)"$', TEXT, re.M).group(1).split())
    assert {tool for _, tool, _, _ in plants} == tools
    driver = (ROOT / "csrc" / "tests" / "planted_gpu.cu").read_text()
    header = (ROOT / "csrc" / "tests" / "planted.h").read_text()
    for name, _, flag, _ in plants:
        assert f'{{"{name}", wiola_plant::{flag},' in driver, name
        assert re.search(rf"^\s*{flag},", header, re.M), flag
    runner = (ROOT / "scripts" / "planted_gpu.sh").read_text()
    assert 'tools="memcheck racecheck synccheck initcheck"' in runner and "--error-exitcode 9" in runner


@pytest.fixture()
def summary_out(tmp_path):
    rows = [("environment", "PASS", 4, 10), ("build", "FAIL", 151, 150), ("overhead", "SKIPPED", 1, 15)]
    (tmp_path / "gpu_check_steps.tsv").write_text(
        "".join(f"{n}\t{s}\t{sec}\t{t}\tthe {n} step\n" for n, s, sec, t in rows))
    bench = [dict(op="rms_norm", backend="triton", shape="x", dtype="bfloat16", ms=0.0312, speedup_vs_eager=4.5,
                  speedup_vs_compile=None, gbps=2100.0, pct_of_copy=71.0, **{"pass": "fwd"}),
             dict(op="linear_cross_entropy", backend="triton", shape="h (4096, 1024)", dtype="bfloat16", ms=1.154,
                  speedup_vs_eager=1.07, speedup_vs_compile=1.25, gbps=64.0, pct_of_copy=None, **{"pass": "fwd+bwd"})]
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    return tmp_path


def test_summary_tabulates_steps_and_benchmarks(summary_out):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), str(summary_out)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"build\s+FAIL\s+151\s+150", lines[2])
    assert re.fullmatch(r"total\s+156\s+175", lines[4])
    # No compile baseline: "-", not a ratio of 0; a long op name keeps its columns apart.
    assert any(re.fullmatch(r"rms_norm\s+fwd\s+triton\s+0\.031\s+4\.50\s+-\s+2100\s+71%\s+x bfloat16", ln)
               for ln in lines)
    assert any(re.fullmatch(r"linear_cross_entropy\s+fwd\+bwd\s+triton\s+1\.154\s+1\.07\s+1\.25\s+64\s+-\s+"
                            r"h \(4096, 1024\) bfloat16", ln) for ln in lines)
    saved = json.loads((summary_out / "gpu_check.json").read_text())
    assert [s["status"] for s in saved["steps"]] == ["PASS", "FAIL", "SKIPPED"] and len(saved["bench"]) == 2


def test_no_step_starts_past_the_budget_and_the_table_still_comes(tmp_path):
    """A spent budget (GPU_CHECK_BUDGET=0): every step is OUT-OF-TIME, none runs, the summary
    still prints its table, and the run fails."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "GPU_CHECK_BUDGET": "0", "PYTHON": sys.executable,
           "HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    rows = [ln.split("\t") for ln in (tmp_path / "gpu_check_steps.tsv").read_text().splitlines()]
    assert [r[0] for r in rows] == [n for n, _, _ in plan()]
    assert {r[1] for r in rows[:-1]} == {"OUT-OF-TIME"} and rows[-1][:2] == ["summary", "PASS"]
    assert not (tmp_path / "build.log").exists()
    build = dict((n, t) for n, t, _ in plan())["build"]
    assert re.search(rf"^build\s+OUT-OF-TIME\s+0\s+{build}$", out.stdout, re.M), out.stdout[-2000:]
    assert f"gpu_check: FAILED ({len(plan()) - 1} step(s))" in out.stdout  # all but the summary


def test_kernel_profile_builds_its_cases_here_and_refuses_without_a_gpu(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_kernel_profile", ROOT / "scripts" / "gpu_kernel_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    assert profile.main(["--dry-run", "--ops", "glu,linear_cross_entropy"]) == 0
    ready = [ln for ln in capsys.readouterr().out.splitlines() if ln.endswith(": ready")]
    assert {ln.split(" fwd+bwd")[0] for ln in ready} == {"glu", "linear_cross_entropy"}
    assert any(", fused: " in ln for ln in ready) and any(", eager: " in ln for ln in ready)
    if not torch.cuda.is_available():
        assert profile.main([]) == 2 and "no CUDA device" in capsys.readouterr().err
