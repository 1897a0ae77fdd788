"""Command line: ``python -m wiola_kernels {bench,check,backends}`` (also ``wiola-kernels``)."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import dispatch
    from .bench import all_cases
    from .bench.runner import PASSES, format_table, plot, run_case

    device = _device(args.device)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    cases = all_cases(device, small=args.small, ops=ops)
    passes = [p for p in PASSES if args.passes in ("all", p)]
    records = []
    ctx = dispatch.use_backend(args.backend)
    with ctx, tqdm(total=len(cases) * len(passes) * 3, desc="bench", unit="timing", file=sys.stderr) as bar:
        for case in cases:
            records += run_case(case, device, repeats=args.repeats, compile=not args.no_compile, passes=passes,
                                progress=bar)
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"threads: {torch.get_num_threads()}, torch {torch.__version__}")
    print(format_table(records))
    if device.type == "cuda" and (ops is None or "gcla_attention" in ops) and not args.small:
        from .bench.attention import format_rows, gcla_vs_flash

        print()
        print(format_rows(gcla_vs_flash(device, repeats=args.repeats)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_json() for r in records], f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        plot(records, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .bench import all_cases
    from .bench.selfcheck import check_case
    from .testing import available_backends

    device = _device(args.device)
    failures = 0
    for case in all_cases(device, small=True):
        for backend in available_backends(case.op, device):
            try:
                ok, err, tol = check_case(case, backend, device)
                line = f"{'PASS' if ok else 'FAIL'}  {case.op:<16} {backend:<10} {case.shape} {case.dtype}: " \
                       f"max rel err {err:.2e} (tolerance {tol:.0e})"
            except Exception as exc:  # report and go on: this is a self-test
                ok, line = False, f"FAIL  {case.op:<16} {backend:<10} raised {type(exc).__name__}: {exc}"
            failures += not ok
            print(line, flush=True)
    print(f"{'all checks passed' if failures == 0 else f'{failures} check(s) failed'}")
    return 1 if failures else 0


def cmd_backends(args: argparse.Namespace) -> int:
    from . import backends

    for op, table in backends(_device(args.device)).items():
        for backend, status in table.items():
            print(f"{op:<16} {backend:<10} {status}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wiola-kernels", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="time fused ops vs eager PyTorch vs torch.compile(reference)")
    bench.add_argument("--ops", help="comma-separated op names (default: all)")
    bench.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    bench.add_argument("--backend", default="auto", help="force a backend for the fused op (default: auto)")
    bench.add_argument("--passes", default="all", choices=["all", "fwd", "fwd+bwd"])
    bench.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (median)")
    bench.add_argument("--small", action="store_true", help="small shapes (seconds; for smoke tests)")
    bench.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    bench.add_argument("--json", metavar="FILE", help="write the records as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw the speedups")
    bench.set_defaults(func=cmd_bench)

    check = sub.add_parser("check", help="run every available backend against the reference")
    check.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    check.set_defaults(func=cmd_check)

    be = sub.add_parser("backends", help="list backends and why unavailable ones are")
    be.add_argument("--device")
    be.set_defaults(func=cmd_backends)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
