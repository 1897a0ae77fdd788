"""The closing table of scripts/gpu_perf.sh: device, driver and versions, each step's status
and time, then the key rows of each benchmark from the JSON the steps left in OUT (the rows a
step finished before its timeout included); also writes OUT/gpu_perf.json.

    python scripts/gpu_perf_summary.py OUT [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HF_RUNS = ("small-eager", "small-compile", "1b-eager", "1b-compile")


def read_steps(out: Path) -> list[dict]:
    """The rows gpu_perf.sh wrote, one per finished step: name, status, seconds, timeout, title."""
    path = out / "gpu_perf_steps.tsv"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, seconds, timeout, title = line.split("\t", 4)
        rows.append(dict(name=name, status=status, seconds=int(seconds), timeout=int(timeout), title=title))
    return rows


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def environment(out: Path) -> str:
    """Device, driver and versions from the environment step's files."""
    v = _load(out / "versions.json") or {}
    smi = (out / "nvidia-smi.csv").read_text().strip().splitlines() if (out / "nvidia-smi.csv").exists() else []
    device = smi[0] if smi else v.get("device", "no GPU (dry run)")
    keys = ("python", "torch", "cuda", "triton", "transformers", "liger_kernel", "cut_cross_entropy")
    return f"device: {device}\nversions: " + ", ".join(f"{k} {v[k]}" for k in keys if k in v)


def format_steps(rows: list[dict]) -> str:
    lines = [f"{'step':<13}{'status':<13}{'s':>5}{'timeout':>9}"]
    lines += [f"{r['name']:<13}{r['status']:<13}{r['seconds']:>5}{r['timeout']:>9}" for r in rows]
    lines.append(f"{'total':<26}{sum(r['seconds'] for r in rows):>5}{sum(r['timeout'] for r in rows):>9}")
    return "\n".join(lines)


def format_bandwidth(rows: list[dict]) -> str:
    """One line per timed row: op, size, pass, impl, device ms, % copy, x wiola (ours' speedup over it)."""
    lines = [f"{'op':<21}{'size':<6}{'pass':<9}{'impl':<14}{'ms':>10}{'% copy':>8}{'x wiola':>8}{'peak MiB':>10}"]
    for r in rows:
        if r.get("impl") == "copy":
            continue
        head = f"{r['op']:<21}{r['size']:<6}{r['pass_']:<9}{r['impl']:<14}"
        if "ms" not in r:
            lines.append(head + f"  {r.get('skipped') or 'ERROR: ' + str(r.get('error'))}"[:110])
            continue
        pct = f"{r['pct_of_copy']:>7.0f}%" if r.get("pct_of_copy") is not None else f"{'-':>8}"
        x = f"{r['x_wiola']:>8.2f}" if r.get("x_wiola") is not None else f"{'-':>8}"
        peak = f"{r['peak_mb']:>10.0f}" if r.get("peak_mb") is not None else f"{'-':>10}"
        lines.append(head + f"{r['ms']:>10.4f}{pct}{x}{peak}")
    return "\n".join(lines)


def format_hf(name: str, rows: list[dict]) -> str:
    lines = [f"hf {name}: {rows[0].get('shape', '')}" if rows else f"hf {name}"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"  {r['variant']:<18} skipped: {r['skipped']}")
        else:
            lines.append(f"  {r['variant']:<18} {r['tokens_per_s']:>10.0f} tok/s {r['speedup_vs_unpatched_eager']:>6.2f}x "
                         f"peak {r['peak_mb']:>8.0f} MiB ({r['peak_vs_unpatched_eager']:.2f}x)")
    return "\n".join(lines)


def format_wiola(rows: list[dict]) -> str:
    lines = ["wiola-360m step:"]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['case']:<44} ERROR: {r['error'][:60]}")
        else:
            lines.append(f"  {r['case']:<44} {r['tokens_per_s']:>10.0f} tok/s peak {r['peak_mb']:>8.0f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder gpu_perf.sh writes to ($OUT)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU results are expected")
    args = parser.parse_args(argv)
    out = args.out
    print(environment(out))
    steps = read_steps(out)
    print(format_steps(steps))
    summary = {"steps": steps, "versions": _load(out / "versions.json"), "dry_run": args.dry_run}
    bandwidth = _load(out / "bandwidth.json")
    if bandwidth:
        print()
        print(format_bandwidth(bandwidth))
    summary["bandwidth"] = bandwidth
    overhead = _load(out / "overhead.json")
    if overhead:
        print("\nhost µs per call (fwd / fwd+bwd; F.rms_norm's beside): " + ", ".join(
            f"{r['op']} {r['pass']} {r['us']:.0f} ({r['ratio']:.1f}x)" for r in overhead if r["pass"] != "first_call"))
    summary["overhead"] = overhead
    for name in HF_RUNS:
        rows = _load(out / f"hf-{name}.json")
        if rows:
            print()
            print(format_hf(name, rows))
        summary[f"hf_{name}"] = rows
    wiola = _load(out / "wiola-360m.json")
    if wiola:
        print()
        print(format_wiola(wiola))
    summary["wiola_360m"] = wiola
    if not args.dry_run and not (bandwidth or overhead or wiola):
        print("\nno benchmark rows (see the step logs in OUT)")
    (out / "gpu_perf.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
