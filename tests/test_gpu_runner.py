"""The step runner of scripts/gpu_check.sh and scripts/gpu_perf.sh (scripts/lib/run_plan.sh),
run here on a plan of its own: each step's status from its exit (pass, fail, skip, cut by
its timeout), a step's limit cut to what the budget has left, no step started once the budget
is spent, the summary always run, and the run failing exactly when a step did."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parent.parent / "scripts" / "lib" / "run_plan.sh"

FAKE = r"""
set -uo pipefail
source "$LIB"
step_passes() { echo passing; }
step_fails() { echo failing; exit 3; }
step_skips() { exit 77; }
step_hangs() { echo started; sleep 60; }
step_late() { echo "ran past the budget" > "$OUT/late-ran"; }
step_summary() { echo "the table"; }
export -f step_passes step_fails step_skips step_hangs step_late step_summary
PLAN=("passes|20|a step that passes" "fails|20|a step that fails" "skips|20|a step that skips"
      "hangs|100|a step past its time" "late|20|a step with no time left" "summary|5|the table")
DRY=0 BUDGET=$BUDGET SUMMARY_RESERVE=1
run_plan fake "$OUT/steps.tsv" "$TIMEOUT_FAILS" "$ONLY"
"""


def run(tmp_path: Path, budget: int, timeout_fails: int = 1, only: str = ""):
    env = {"PATH": "/usr/bin:/bin", "LIB": str(LIB), "OUT": str(tmp_path), "BUDGET": str(budget),
           "TIMEOUT_FAILS": str(timeout_fails), "ONLY": only}
    proc = subprocess.run(["bash", "-c", FAKE], env=env, capture_output=True, text=True, timeout=120)
    rows = {r[0]: r for r in (ln.split("\t") for ln in (tmp_path / "steps.tsv").read_text().splitlines())}
    return proc, rows


@pytest.mark.parametrize("timeout_fails", [1, 0])
def test_statuses_budget_and_summary(tmp_path, timeout_fails):
    """Budget 8 s, 1 kept for the summary: "hangs" (its own limit 100 s) is cut to the ≤ 7 s
    left and times out; then under 5 s are left, so "late" never starts; the summary runs."""
    proc, rows = run(tmp_path, budget=8, timeout_fails=timeout_fails)
    status = {name: r[1] for name, r in rows.items()}
    assert status == {"passes": "PASS", "fails": "FAIL", "skips": "SKIPPED", "hangs": "TIMEOUT",
                      "late": "OUT-OF-TIME", "summary": "PASS"}, proc.stdout
    assert 5 <= int(rows["hangs"][3]) <= 7 and int(rows["hangs"][3]) <= int(rows["hangs"][2]) <= 15  # limit cut; stopped at it
    assert not (tmp_path / "late-ran").exists()
    assert (tmp_path / "step-hangs.log").read_text().startswith("started")  # what it printed stays
    assert (tmp_path / "step-summary.log").read_text() == "the table\n"
    assert proc.returncode != 0
    bad = 3 if timeout_fails else 2  # fails, late (and hangs when a timeout fails the run)
    assert f"fake: FAILED ({bad} step(s))" in proc.stdout


def test_a_run_where_every_step_passes_passes(tmp_path):
    proc, rows = run(tmp_path, budget=100, only="passes,skips")
    assert {n: r[1] for n, r in rows.items()} == {"passes": "PASS", "fails": "SKIPPED", "skips": "SKIPPED",
                                                  "hangs": "SKIPPED", "late": "SKIPPED", "summary": "PASS"}
    assert proc.returncode == 0 and "fake: PASSED" in proc.stdout, proc.stdout
