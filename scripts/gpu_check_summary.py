"""The last table of scripts/gpu_check.sh: each step's status and time, then the
benchmark rows, from the files the steps left in OUT; also writes OUT/gpu_check.json.

    python scripts/gpu_check_summary.py OUT [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_steps(out: Path) -> list[dict]:
    """The rows gpu_check.sh wrote, one per finished step: name, status, seconds, timeout, title."""
    path = out / "gpu_check_steps.tsv"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, seconds, timeout, title = line.split("\t", 4)
        rows.append(dict(name=name, status=status, seconds=int(seconds), timeout=int(timeout), title=title))
    return rows


def _load(path: Path) -> list[dict] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def format_steps(rows: list[dict]) -> str:
    lines = [f"{'step':<13}{'status':<13}{'s':>5}{'timeout':>9}"]
    lines += [f"{r['name']:<13}{r['status']:<13}{r['seconds']:>5}{r['timeout']:>9}" for r in rows]
    lines.append(f"{'total':<26}{sum(r['seconds'] for r in rows):>5}{sum(r['timeout'] for r in rows):>9}")
    return "\n".join(lines)


def format_bench(rows: list[dict]) -> str:
    """One line per benchmark record; "-" where a baseline was not run (``--no-compile``)."""
    w = max([len("op"), *(len(r["op"]) for r in rows)]) + 2

    def ratio(v) -> str:
        return f"{v:>10.2f}" if v is not None else f"{'-':>10}"

    lines = [f"{'op':<{w}}{'pass':<9}{'backend':<9}{'ms':>9}{'x eager':>9}{'x compile':>10}{'GB/s':>8}{'%copy':>7}  case"]
    for r in rows:
        lines.append(f"{r['op']:<{w}}{r['pass']:<9}{r['backend']:<9}{r['ms']:>9.3f}{r['speedup_vs_eager']:>9.2f}"
                     f"{ratio(r.get('speedup_vs_compile'))}{r['gbps']:>8.0f}"
                     + (f"{r['pct_of_copy']:>6.0f}%" if r.get("pct_of_copy") is not None else f"{'-':>7}")
                     + f"  {r.get('shape', '')} {r.get('dtype', '')}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder gpu_check.sh writes to ($OUT)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU results are expected")
    args = parser.parse_args(argv)
    steps = read_steps(args.out)
    print(format_steps(steps))
    bench = _load(args.out / "bench.json")
    if bench:
        print()
        print(format_bench(bench))
    for name in ("overhead.json", "bench_hf.json"):
        rows = _load(args.out / name)
        if rows:
            print(f"\n{name}: {len(rows)} record(s)")
    if not bench and not args.dry_run and any(s["name"] == "bench" for s in steps):  # benchmarks: gpu_perf.sh
        print("\nno benchmark records (see bench.log)")
    summary = {"steps": steps, "bench": bench, "overhead": _load(args.out / "overhead.json"),
               "bench_hf": _load(args.out / "bench_hf.json"), "dry_run": args.dry_run}
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
