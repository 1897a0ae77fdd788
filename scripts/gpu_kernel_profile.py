"""Where each op's GPU time goes, kernel by kernel: ``torch.profiler`` over a few forward +
backward passes of the fused op and of eager PyTorch at the benchmark shapes
(``python -m wiola_kernels bench --full --device cuda``'s cases, bf16), the kernels that took the most
device time first. ``scripts/gpu_check.sh`` runs it on a lent GPU: the bench step says how
fast an op is, this says which of its kernels (or which cuBLAS call, or which copy) to fix.

    python scripts/gpu_kernel_profile.py [--ops linear_cross_entropy,glu] [--steps 3] [--top 8]
    python scripts/gpu_kernel_profile.py --dry-run     # no GPU: the cases and passes build on the CPU
"""

from __future__ import annotations

import argparse
import sys

import torch


def registered_ops() -> list[str]:
    """Every op of the registry (:func:`wiola_kernels.dispatch.ops`): the default ``--ops``."""
    from wiola_kernels import dispatch

    return dispatch.ops()


def kernel_table(step, steps: int, top: int) -> str:
    """The ``top`` kernels of ``steps`` calls of ``step`` by total device time (after two warm-up calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    try:
        return averages.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70)
    except (AttributeError, KeyError):  # a torch that still names it after CUDA
        return averages.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=70)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated bench op names (default: every registered op)")
    parser.add_argument("--steps", type=int, default=3, help="profiled forward + backward passes per variant")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per variant")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: build every case and pass on the CPU")
    args = parser.parse_args(argv)

    from wiola_kernels.bench import all_cases
    from wiola_kernels.bench.runner import make_pass

    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else registered_ops()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_kernel_profile: no CUDA device (use --dry-run here)", file=sys.stderr)
        return 2
    cases = all_cases(device, small=args.dry_run, ops=ops)
    failed = 0
    for case in cases:
        inputs = case.make_inputs()
        for variant, fn in (("fused", case.fused), ("eager", case.eager)):
            title = f"{case.op} fwd+bwd, {variant}: {case.shape} {str(case.dtype).replace('torch.', '')}"
            try:  # one failing case is reported; the others still run
                step = make_pass(case, fn, "fwd+bwd", inputs)
                if args.dry_run:
                    step()
                    print(f"{title}: ready")
                    continue
                table = kernel_table(step, args.steps, args.top)
            except Exception as exc:  # noqa: BLE001 (reported and counted)
                failed += 1
                print(f"{title}: FAILED ({type(exc).__name__}: {str(exc)[:300]})")
                continue
            print(f"\n{title}, {args.steps} passes")
            print(table)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
