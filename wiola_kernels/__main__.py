"""Command line: ``python -m wiola_kernels {bench,check,backends,gpu-report}`` (also ``wiola-kernels``)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .cli import CommandError, HelpFormatter, positive_float, positive_int, require_matplotlib, run

DESCRIPTION = "Benchmark, self-check and list the backends of the fused Wiola ops."
# Names the README and the public API use for an op, mapped to its registry name (the ops
# themselves come from the registry: wiola_kernels.dispatch.ops()).
OP_ALIASES = {"atm_merge": "atm", "atm_unmerge": "atm", "rms": "rms_norm", "gcla": "gcla_attention",
              "lce": "linear_cross_entropy"}


def op_names() -> list[str]:
    """The registered ops (:func:`wiola_kernels.dispatch.ops`), in the registry's order."""
    from . import dispatch

    return dispatch.ops()


def _device(name: str | None, must_run: bool = True) -> torch.device:
    """The ``--device`` (default: cuda if torch sees a GPU); ``must_run`` refuses a CUDA
    device that torch cannot use, before every check fails on it."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if must_run and device.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {name}: torch reports no CUDA device here (torch {torch.__version__}, "
                           f"{'CPU-only build' if torch.version.cuda is None else 'no GPU visible'}); use --device cpu")
    return device


def _ops(text: str | None) -> list[str] | None:
    """``--ops``: comma-separated op names or aliases → benchmark case names (no duplicates)."""
    if not text:
        return None
    ops: list[str] = []
    for name in (o.strip() for o in text.split(",")):
        if not name:
            continue
        op = OP_ALIASES.get(name, name)
        if op not in op_names():
            raise CommandError(f"--ops: unknown op {name!r}; choose from {', '.join(op_names() + list(OP_ALIASES))}")
        if op not in ops:
            ops.append(op)
    return ops


def _check_environment() -> None:
    """A bad WIOLA_BACKEND is reported before any work."""
    from . import dispatch

    dispatch.check_environment()


def cmd_bench_hf(args: argparse.Namespace) -> int:
    """``bench --hf FAMILY|all``: training step of Hugging Face models, unpatched and patched, eager and compiled."""
    from tqdm import tqdm

    from .bench.hf import (DEFAULT_VARIANTS, DEFAULT_VARIANTS_CUDA, format_hf_header, format_hf_records,
                           format_hf_row, hf_case, run_hf_bench)

    if args.hf == "rope":
        from .hf import format_rope_accuracy, rope_accuracy

        rows = rope_accuracy()
        print(format_rope_accuracy(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dict(op="hf_rope_accuracy", **r) for r in rows], f, indent=2)
        return 0
    device = _device(args.device)
    if args.hf == "all":
        return _bench_hf_all(args, device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or 10
    try:
        case = hf_case(args.hf, device, small=args.small, size=args.size, dtype=args.dtype)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    case.sequential = case.sequential or args.sequential
    variants = _hf_variants(args, list(DEFAULT_VARIANTS_CUDA if device.type == "cuda" and args.hf == "llama"
                                       else DEFAULT_VARIANTS))
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"threads: {torch.get_num_threads()}, torch {torch.__version__}", flush=True)
    if case.sequential:  # rows come one by one (a timeout still leaves the finished ones)
        print(format_hf_header(case, repeats, args.backend), flush=True)
    done: list[dict] = []

    def on_record(r: dict) -> None:  # sequential cases: each row printed (and saved) as it completes
        done.append(r)
        print(format_hf_row(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(done, f, indent=2)

    with tqdm(total=len(variants) * repeats, desc=f"bench --hf {args.hf}", unit="step", file=sys.stderr) as bar:
        records = run_hf_bench(case, repeats=repeats, backend=args.backend, progress=bar, variants=variants,
                               on_record=on_record if case.sequential else None)
    if not case.sequential:
        print(format_hf_records(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _hf_variants(args: argparse.Namespace, default: list[str]) -> list[str]:
    from .bench.hf import VARIANTS

    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else default
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise CommandError(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    return variants


def _bench_hf_all(args: argparse.Namespace, device: torch.device) -> int:
    """``bench --hf all``: every family's step, one family after another, each within --family-budget,
    its rows printed (and saved) as the family completes."""
    from .bench.hf import (ALL_REPEATS, ALL_VARIANTS, FAMILIES, format_hf_all_header, format_hf_all_row,
                           format_hf_all_summary, run_hf_all)

    if args.size != "default":
        raise CommandError(f"--size {args.size}: only with --hf llama")
    if args.sequential:
        raise CommandError("--sequential: not with --hf all (families run one after another, the variants of "
                           "each in rotation)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or ALL_REPEATS
    variants = _hf_variants(args, list(ALL_VARIANTS))
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"threads: {torch.get_num_threads()}, torch {torch.__version__}", flush=True)
    print(format_hf_all_header(device, repeats, args.backend, args.family_budget, small=args.small,
                               dtype=args.dtype), flush=True)
    done: list[dict] = []

    def on_record(r: dict) -> None:
        done.append(r)
        print(format_hf_all_row(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(done, f, indent=2)

    records = run_hf_all(device, variants=variants, repeats=repeats, backend=args.backend,
                         budget_s=args.family_budget, small=args.small, dtype=args.dtype, families=FAMILIES,
                         on_record=on_record)
    print(format_hf_all_summary(records))
    if args.json:
        print(f"wrote {args.json}")
    return 0


def cmd_bench_overhead(args: argparse.Namespace) -> int:
    """``bench --overhead``: one call of each op on a tiny input vs F.rms_norm, and first calls."""
    from tqdm import tqdm

    from .bench.overhead import PASSES, cases, first_call_records, first_calls, format_overhead, measure, profile

    device = _device(args.device)
    profiled = [op.strip() for op in (args.profile or "").split(",") if op.strip()]
    known = [c.op for c in cases()]
    for op in profiled:
        if op not in known:
            raise CommandError(f"--profile: unknown op {op!r}; choose from {', '.join(known)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tqdm(total=len(PASSES) * len(cases()), desc="bench --overhead", unit="op", file=sys.stderr) as bar:
        records = measure(device, calls=max(1000, 100 * (args.repeats or 10)), progress=bar)
    first = first_calls(device)
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"threads: {torch.get_num_threads()}, torch {torch.__version__}; median of "
          f"{max(1000, 100 * (args.repeats or 10))} calls per row")
    print(format_overhead(records, first))
    for op in profiled:
        for which in PASSES:
            print()
            print(profile(device, op, which))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records + first_call_records(first), f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _device_line(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (_cpu_name() or "CPU")
    return (f"device: {device} ({name}), threads: {torch.get_num_threads()}, torch {torch.__version__}"
            + (f", CPU kernels {torch.backends.cpu.get_cpu_capability()}" if device.type == "cpu" else ""))


def _cpu_name() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    if args.hf:
        return cmd_bench_hf(args)
    if args.overhead:
        return cmd_bench_overhead(args)
    if args.profile:
        raise CommandError("--profile: profiles the op layer's calls; use it with --overhead")
    if args.full and args.small:
        raise CommandError("--full and --small: choose one")
    import time

    from . import dispatch
    from .bench.runner import format_table, make_plan, plot, run_plan

    start = time.perf_counter()
    device = _device(args.device)
    ops = _ops(args.ops)
    if args.plot:
        require_matplotlib()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        plan = make_plan(device, "full" if args.full else "small" if args.small else "default", ops=ops,
                         passes=[p for p in ("fwd", "fwd+bwd") if args.passes in ("all", p)],
                         compile=not args.no_compile, repeats=args.repeats, budget_s=args.budget,
                         dtypes=None if args.dtype is None else [getattr(torch, args.dtype)])
    except ValueError as exc:
        raise CommandError(f"--{exc}" if str(exc).startswith("dtype:") else str(exc)) from None
    print(_device_line(device))
    print(plan.describe(), flush=True)
    with dispatch.use_backend(args.backend):
        records = run_plan(plan, device)
    print(f"\nsummary ({len(records)} rows in {time.perf_counter() - start:.0f} s):")
    print(format_table(records))
    if device.type == "cuda" and (ops is None or "gcla_attention" in ops) and args.full:
        from .bench.attention import format_rows, gcla_vs_flash

        print()
        print(format_rows(gcla_vs_flash(device, repeats=plan.repeats)))
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
    for case in all_cases(device, small=True, ops=_ops(args.ops)):
        for backend in available_backends(case.op, device):
            try:
                ok, err, tol = check_case(case, backend, device)
                line = f"{'PASS' if ok else 'FAIL'}  {case.op:<16} {backend:<10} {case.shape} {case.dtype}: " \
                       f"max rel err vs float64 oracle {err:.2e} (tolerance {tol:.0e})"
            except Exception as exc:  # report and go on: this is a self-test
                ok, line = False, f"FAIL  {case.op:<16} {backend:<10} raised {type(exc).__name__}: {exc}"
            failures += not ok
            print(line, flush=True)
    print(f"{'all checks passed' if failures == 0 else f'{failures} check(s) failed'}")
    return 1 if failures else 0


def cmd_backends(args: argparse.Namespace) -> int:
    from . import backends

    for op, table in backends(_device(args.device, must_run=False)).items():
        for backend, status in table.items():
            print(f"{op:<16} {backend:<10} {status} [takes {status.limits.describe()}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .bench.hf import DEFAULT_FAMILY_BUDGET_S, FAMILIES as HF_FAMILIES
    from .bench.runner import DEFAULT_BUDGET_S
    from .dispatch import BACKEND_NAMES

    parser = argparse.ArgumentParser(prog="wiola-kernels", description=DESCRIPTION, formatter_class=HelpFormatter,
                                     epilog="A mistake prints one line and exits with status 2; WIOLA_TRACEBACK=1 "
                                            "shows the traceback.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    device_help = "device to run on (default: cuda if torch sees a GPU, else cpu)"

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                              formatter_class=HelpFormatter)

    bench = command("bench", "time fused ops vs eager PyTorch (the reference) vs torch.compile(reference); "
                             "without options one shape per op, in minutes, each row printed as it is measured")
    bench.add_argument("--ops", metavar="OP[,OP...]",
                       help=f"comma-separated ops: {', '.join(op_names())} (aliases: {', '.join(OP_ALIASES)}); "
                            "default: all")
    bench.add_argument("--full", action="store_true",
                       help="every shape and dtype of each op (also bfloat16 on the CPU) and fresh-page copy "
                            "ratios, instead of one shape per op (much longer)")
    bench.add_argument("--budget", type=positive_float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                       help="time allowed per timing (one variant of one pass, warm-up and compiling included); "
                            "a variant that would take longer is reported as '> N s, skipped (reason)'")
    bench.add_argument("--device", choices=("cpu", "cuda"), help=device_help)
    bench.add_argument("--backend", default="auto", choices=("auto", *BACKEND_NAMES),
                       help="force a backend for the fused op (an op without it keeps its default)")
    bench.add_argument("--passes", default="all", choices=["all", "fwd", "fwd+bwd"], help="which passes to time")
    bench.add_argument("--repeats", type=positive_int,
                       help="timed runs per measurement (median); default: 5, with --full, --hf FAMILY or "
                            "--overhead 10, with --hf all 3")
    bench.add_argument("--threads", type=positive_int, help="CPU threads (torch.set_num_threads); default: torch's")
    bench.add_argument("--hf", choices=["all", *HF_FAMILIES, "rope"], metavar="{all,FAMILY,rope}",
                       help="instead of the ops: FAMILY (" + ", ".join(HF_FAMILIES) + ") = a training step (AdamW) "
                            "of a small random Hugging Face model of that family, unpatched and patched by "
                            "wiola_kernels.patch_hf, each eager and torch.compile'd; all = every family in one "
                            "table, eager only unless --variants, each family within --family-budget; rope = RoPE "
                            "error at large positions, ours vs HF's")
    bench.add_argument("--dtype", choices=("float32", "bfloat16"),
                       help="with --hf: the models' dtype (default: bfloat16 on CUDA, float32 on the CPU); "
                            "with the ops: only their cases of this dtype (e.g. --full --dtype float32)")
    bench.add_argument("--family-budget", type=positive_float, default=DEFAULT_FAMILY_BUDGET_S, metavar="SECONDS",
                       help="with --hf all: seconds per family, building, warm-up (compiling) and the peak-memory "
                            "step included; of the timed rounds (--repeats, default 3) as many run as fit, at "
                            "least one; a family whose warm-up does not finish in time is reported as skipped")
    bench.add_argument("--overhead", action="store_true",
                       help="instead of the ops' kernels: the cost of one call of each op on a tiny input "
                            "(the op layer) vs F.rms_norm, and the first call after import in a fresh process")
    bench.add_argument("--profile", metavar="OP[,OP...]",
                       help="with --overhead: also a cProfile of each named op's call (fwd, then fwd+bwd), the "
                            "functions with the most own time (where the op layer's host time goes)")
    bench.add_argument("--size", default="default", choices=("default", "1b"),
                       help="with --hf llama: the model; 1b = Llama-3.2-1B's shapes (d 2048, L 16, H 32, H_kv 8, "
                            "V 128256, tied head), B 4 x T 2048, variants one after another")
    bench.add_argument("--variants", metavar="V[,V...]",
                       help="with --hf: which variants (unpatched_eager, unpatched_compile, patched_eager, "
                            "patched_compile, liger_eager, liger_compile); default: the first four, and Liger's on "
                            "CUDA with --hf llama; with --hf all the two eager ones")
    bench.add_argument("--sequential", action="store_true",
                       help="with --hf FAMILY: the variants one after another, each row printed as it completes "
                            "(default for --size 1b), instead of in rotation")
    bench.add_argument("--small", action="store_true", help="small shapes, both dtypes (seconds; for smoke tests)")
    bench.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    bench.add_argument("--json", metavar="FILE", help="also write the records as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="also draw the speedups (needs matplotlib)")
    bench.set_defaults(func=cmd_bench)

    check = command("check", "run every available backend against the float64 oracle (wiola_kernels.reference), "
                                     "forward and gradients, within the SPEC §9 tolerances")
    check.add_argument("--device", choices=("cpu", "cuda"), help=device_help)
    check.add_argument("--ops", metavar="OP[,OP...]", help="comma-separated ops, as for bench; default: all")
    check.set_defaults(func=cmd_check)

    be = command("backends", "list each op's backends and why unavailable ones are")
    be.add_argument("--device", choices=("cpu", "cuda"), help=device_help)
    be.set_defaults(func=cmd_backends)

    report = sub.add_parser("gpu-report", help="registers, spills, shared memory, occupancy, SASS and bytes in "
                            "flight of every CUDA and Triton kernel compiled for sm_90/sm_80 (no GPU needed)")
    report.add_argument("--json", metavar="FILE", help="write the records as JSON")
    report.add_argument("--no-cuda", action="store_true", help="skip the nvcc-compiled CUDA kernels")
    report.add_argument("--no-triton", action="store_true", help="skip the Triton kernels")
    report.add_argument("--jobs", type=positive_int, metavar="N",
                        help="processes compiling and reading the Triton kernels (default: one per core)")
    report.add_argument("--arch", metavar="ARCHS",
                        help="comma-separated architectures to compile for (default: all, sm_90,sm_80)")
    report.set_defaults(func=lambda a: __import__("wiola_kernels.devtools.gpu_report", fromlist=["main"]).main(a))

    args = parser.parse_args(argv)

    def go() -> int:
        _check_environment()
        return args.func(args)

    return run("wiola-kernels", go)


if __name__ == "__main__":
    sys.exit(main())
