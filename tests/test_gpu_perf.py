"""scripts/gpu_perf.sh fits one command on a lent GPU, and beside scripts/gpu_check.sh the 15
minutes a session is lent with two machine starts: its plan is read from the script itself
(``--plan``). Its dry run (what needs no GPU) runs in CI (scripts/test_device_versions.sh)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_perf.sh"
MAX_COMMAND_S = 480       # one command's wall time, and the steps' timeouts added up
LEASE_S = 15 * 60         # device time of a session, every start and idle second counted
START_S = 90              # one machine start ("a minute or more")


def plan(env: dict | None = None) -> dict:
    out = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **(env or {})}, check=True).stdout
    rows = [ln.split("\t") for ln in out.splitlines()]
    steps = [(r[1], int(r[2]), r[3]) for r in rows if r[0] == "step"]
    values = {r[0]: int(r[1]) for r in rows if r[0] != "step"}
    return dict(steps=steps, **values)


def gpu_check_budget() -> int:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--plan"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return next(int(ln.split("\t")[1]) for ln in out.splitlines() if ln.startswith("BUDGET\t"))


def test_the_plan_fits_one_command():
    p = plan()
    timeouts = [t for _, t, _ in p["steps"]]
    assert sum(timeouts) <= MAX_COMMAND_S, p["steps"]
    assert p["BUDGET"] <= MAX_COMMAND_S and all(0 < t <= p["BUDGET"] for t in timeouts)
    assert 0 < p["SUMMARY_RESERVE"] <= dict((n, t) for n, t, _ in p["steps"])["summary"]
    assert len({n for n, _, _ in p["steps"]}) == len(p["steps"])


def test_check_and_perf_fit_the_lease_with_two_machine_starts():
    assert gpu_check_budget() + plan()["BUDGET"] + 2 * START_S <= LEASE_S


def test_the_budget_can_be_lowered_from_outside():
    assert plan({"GPU_PERF_BUDGET": "100"})["BUDGET"] == 100


def test_the_steps_are_what_the_issue_asks_in_order():
    names = [n for n, _, _ in plan()["steps"]]
    assert names == ["environment", "build", "bandwidth", "overhead", "hf-small", "hf-1b", "wiola-360m", "summary"]


def test_no_step_starts_past_the_budget_and_the_table_still_comes(tmp_path):
    """A spent budget: every step is OUT-OF-TIME, none runs, the summary still prints its table
    (the device and versions line, the steps), and the run fails."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "GPU_PERF_BUDGET": "0", "PYTHON": sys.executable,
           "HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    rows = [ln.split("\t") for ln in (tmp_path / "gpu_perf_steps.tsv").read_text().splitlines()]
    names = [n for n, _, _ in plan()["steps"]]
    assert [r[0] for r in rows] == names
    assert {r[1] for r in rows[:-1]} == {"OUT-OF-TIME"} and rows[-1][:2] == ["summary", "PASS"]
    assert not (tmp_path / "build.log").exists()
    assert re.search(r"^bandwidth\s+OUT-OF-TIME\s+0\s+\d+$", out.stdout, re.M), out.stdout[-2000:]
    assert f"gpu_perf: FAILED ({len(names) - 1} step(s))" in out.stdout


def test_summary_lists_the_rows_each_step_left(tmp_path):
    (tmp_path / "gpu_perf_steps.tsv").write_text("bandwidth\tTIMEOUT\t100\t100\tthe table\nhf-1b\tPASS\t60\t75\t1b\n")
    (tmp_path / "versions.json").write_text(json.dumps(dict(python="3.12.3", torch="2.11.0", cuda="13.0",
                                                            triton="3.6.0", liger_kernel="0.8.5")))
    (tmp_path / "nvidia-smi.csv").write_text("NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 9.0, 1980 MHz, 2619 MHz\n")
    bandwidth = [
        dict(op="rms_norm", size="real", pass_="fwd", impl="copy", ms=0.3, pct_of_copy=100.0),
        dict(op="rms_norm", size="real", pass_="fwd", impl="wiola", ms=0.36, pct_of_copy=83.3, x_wiola=1.0),
        dict(op="rms_norm", size="real", pass_="fwd", impl="liger", skipped="Liger-Kernel: not installed"),
        dict(op="linear_cross_entropy", size="real", pass_="fwd+bwd", impl="cce", ms=20.5, x_wiola=0.9,
             peak_mb=1200.0),
    ]
    (tmp_path / "bandwidth.json").write_text(json.dumps(bandwidth))
    (tmp_path / "hf-1b-eager.json").write_text(json.dumps([
        dict(variant="unpatched_eager", shape="d 2048", tokens_per_s=40000.0, speedup_vs_unpatched_eager=1.0,
             peak_mb=30000.0, peak_vs_unpatched_eager=1.0),
        dict(variant="liger_eager", skipped="Liger-Kernel: not installed")]))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_perf_summary.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("device: NVIDIA H100 80GB HBM3, 580.159.04")
    assert "torch 2.11.0" in text and "liger_kernel 0.8.5" in text
    assert re.search(r"^bandwidth\s+TIMEOUT\s+100\s+100$", text, re.M)
    assert re.search(r"^rms_norm\s+real\s+fwd\s+wiola\s+0\.3600\s+83%\s+1\.00\s+-$", text, re.M)
    assert re.search(r"^rms_norm\s+real\s+fwd\s+liger\s+Liger-Kernel: not installed$", text, re.M)
    assert re.search(r"^linear_cross_entropy\s+real\s+fwd\+bwd\s+cce\s+20\.5000\s+-\s+0\.90\s+1200$", text, re.M)
    assert "  liger_eager        skipped: Liger-Kernel: not installed" in text
    saved = json.loads((tmp_path / "gpu_perf.json").read_text())
    assert len(saved["bandwidth"]) == 4 and saved["hf_1b-eager"][0]["tokens_per_s"] == 40000.0


def test_the_peer_wheels_are_pinned_where_the_bench_pins_them():
    from wiola_kernels.bench import peers

    text = (ROOT / "scripts" / "device_env.sh").read_text()
    pinned = re.search(r'^PEER_WHEELS=\(([^)]*)\)', text, re.M).group(1).split()
    assert sorted(p.strip('"') for p in pinned) == sorted(f"{dist}=={ver}" for _, ver, dist, _ in peers.PEERS.values())


@pytest.mark.slow
def test_a_rerun_of_some_steps_skips_the_others(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "GPU_PERF_BUDGET": "0", "PYTHON": sys.executable,
           "HOME": str(tmp_path), "GPU_PERF_ONLY": "hf-1b,wiola-360m"}
    subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    status = dict(ln.split("\t")[:2] for ln in (tmp_path / "gpu_perf_steps.tsv").read_text().splitlines())
    assert status == {"environment": "OUT-OF-TIME", "build": "SKIPPED", "bandwidth": "SKIPPED", "overhead": "SKIPPED",
                      "hf-small": "SKIPPED", "hf-1b": "OUT-OF-TIME", "wiola-360m": "OUT-OF-TIME", "summary": "PASS"}
