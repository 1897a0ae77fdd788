"""Compile, in parallel and ahead of use, every Triton kernel variant the GPU tests and
benchmarks launch, into Triton's cache, so that their first launches only read it.

A lent GPU starts with an empty Triton cache, and the test and bench shapes need ~100
kernel variants at a few seconds each: compiled one at a time on first launch that is
minutes of the GPU's time. Here each variant is compiled by a pool of processes on all
cores while the extension builds (scripts/gpu_check.sh).

What is compiled is what ``wiola_kernels/triton/aot.py`` enumerates (each kernel module's
``aot_launches``: its GPU test shapes and the bench shapes, built with the launchers' own
choice functions) for this GPU's compute capability and SM count. The compiled kernel's
cache key is the JIT's own (same source, specialisation, options and target), and the
small C launcher Triton builds per signature is built too.

    python scripts/triton_warmup.py [--jobs N] [--json FILE]
    python scripts/triton_warmup.py --dry-run      # no GPU: list what would be compiled (sm_90)
    python scripts/triton_warmup.py --arch sm_90 --sms 132   # compile for that GPU without one
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "python"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

_LAUNCHES: dict = {}


def _gpu(arch: str, sms: int):
    import dataclasses

    from wiola_kernels.triton import aot

    base = aot.GPUS.get(arch)
    if base is None:  # an architecture the report does not describe: same limits, its SM count
        base = dataclasses.replace(aot.GPUS["sm_90"], name=arch, arch=arch, capability=int(arch[3:]))
    return dataclasses.replace(base, sms=sms)


def _init_worker(arch: str, sms: int, launchers: bool) -> None:
    from wiola_kernels.triton import aot

    gpu = _gpu(arch, sms)
    _LAUNCHES.update(gpu=gpu, launches=aot.launches(gpu), launchers=launchers)


def _compile(key: str) -> dict:
    """Compile one variant (and, on the GPU machine, its launcher); a failure is returned,
    not raised."""
    from wiola_kernels.triton import aot

    start = time.perf_counter()
    try:
        compiled = aot.compile_launch(_LAUNCHES["launches"][key], _LAUNCHES["gpu"])
    except Exception as exc:  # reported by the caller; the run goes on
        return {"kernel": key, "error": f"{type(exc).__name__}: {exc}"[-2000:], "seconds": time.perf_counter() - start}
    launcher = "not asked"
    if _LAUNCHES["launchers"]:
        try:
            from triton.runtime.driver import driver

            driver.active.launcher_cls(compiled.src, compiled.metadata)
            launcher = "built"
        except Exception as exc:  # the first launch builds it then; not worth failing for
            launcher = f"not built ({type(exc).__name__})"
    return {"kernel": key, "seconds": time.perf_counter() - start, "launcher": launcher}


def _device() -> tuple[str, int]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("triton_warmup: no CUDA device (use --dry-run to list the variants)")
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}", torch.cuda.get_device_properties(0).multi_processor_count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: all cores)")
    parser.add_argument("--json", metavar="FILE", help="write one record per variant")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: list the variants, compile none")
    parser.add_argument("--arch", help="compile for this architecture (e.g. sm_90) instead of the device's")
    parser.add_argument("--sms", type=int, help="with --arch: its SM count (default: the described GPU's)")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the real JIT functions

    import triton

    if args.arch or args.dry_run:
        from wiola_kernels.triton import aot

        arch = args.arch or "sm_90"  # the H200 the GPU checks run on
        sms = args.sms or (aot.GPUS[arch].sms if arch in aot.GPUS else 132)
    else:
        arch, sms = _device()
    launchers = not (args.arch or args.dry_run)  # they need the GPU machine's driver
    _init_worker(arch, sms, launchers)
    keys = list(_LAUNCHES["launches"])
    per_kernel = Counter(k.split("[")[0] for k in keys)
    print(f"triton {triton.__version__}: {len(keys)} kernel variants for {arch} ({sms} SMs): "
          + ", ".join(f"{name} {n}" for name, n in sorted(per_kernel.items())))
    if args.dry_run:
        return 0
    start = time.perf_counter()
    records = []
    # spawn: the parent touched CUDA (capability, SM count); workers compile only.
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx, initializer=_init_worker,
                             initargs=(arch, sms, launchers)) as pool:
        futures = [pool.submit(_compile, key) for key in keys]
        for future in as_completed(futures):
            records.append(future.result())
    wall = time.perf_counter() - start
    errors = [r for r in records if "error" in r]
    cpu = sum(r["seconds"] for r in records)
    built = sum(r.get("launcher") == "built" for r in records)
    print(f"compiled {len(records) - len(errors)} of {len(records)} variants in {wall:.1f} s wall "
          f"({cpu:.1f} s of compiles on {args.jobs} processes)" + (f", {built} launchers" if launchers else ""))
    for r in errors:
        print(f"FAILED {r['kernel']}: {r['error'].splitlines()[-1] if r['error'] else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(sorted(records, key=lambda r: r["kernel"]), indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
