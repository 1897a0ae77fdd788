"""``python -m wiola_kernels gpu-report``: what the GPU compilers produced, without a GPU, and
a lint of it.

For every Triton kernel the launchers compile (``wiola_kernels/triton/aot.py``) and, from a
source checkout with nvcc, every CUDA kernel instantiation (``csrc/cuda/*.cu``,
:mod:`wiola_kernels.devtools.cuda_report`), for sm_90 and sm_80, one record:

* ``registers``, ``spill_bytes``, ``shared_bytes``: from the cubin
  (``cuobjdump --dump-resource-usage``) and ptxas's report (``ptxas -v`` spill stores per
  thread; local arrays, such as sin/cos's slow-path argument reduction, are not spills);
  ``shared_bytes`` is the static shared memory per block plus the dynamic shared memory
  of the launch.
* ``blocks_per_sm`` and ``blocks_limit``: resident blocks per SM those registers, that
  shared memory and the block size allow on the architecture's reference GPU (sm_90:
  H200, 132 SMs; sm_80: A100, 108 SMs; 64 K registers, 228 / 164 KB shared memory, 2048
  threads and 32 blocks per SM), and which of them is the limit.
* ``tensor_core``: HGMMA / HMMA instructions in the SASS.
* ``global_access_bits``: the widest global load or store (LDG / STG / LDGSTS) in the
  kernel's main loop (the innermost loop that loads from global memory; the whole
  kernel when it has no such loop).
* ``bytes_in_flight_per_sm`` (memory-bound kernels at the bench shapes, bf16; else
  None): resident blocks per SM (the occupancy limit, or fewer when the grid is
  smaller than SMs × occupancy) × threads per block × the bytes of global loads each
  thread issues per iteration of the main loop (loads into shared memory by cp.async
  LDGSTS count ``num_stages − 1`` times: that many iterations are in flight). By
  Little's law an H200 needs ≈ 4.8 TB/s × ~1 µs / 132 SMs ≈ 32–40 KB in flight per SM.
* ``lint``: findings of :mod:`wiola_kernels.devtools.compiled_lint` on the compiled code — 32-bit
  ``index × stride`` products that reach pointer arithmetic (every Triton kernel, from its
  TTIR), and stores narrower than 32 bits where the layout gives each thread 16
  contiguous bytes (Triton kernels at the memory-bound bench shapes, from the TTGIR and
  PTX; CUDA kernels from the SASS: a main loop that loads 128 bits per access but stores 32
  or fewer, and runs of 16/32-bit stores to consecutive bytes of one address that one
  64/128-bit store would write).

CI (``tests/test_triton_aot.py``) fails on a compile error, a spill, shared memory over the
device limit, a kernel that cannot be resident, and a lint finding. Compiled cubins are
cached: Triton's in its cache (``TRITON_CACHE_DIR``), nvcc's and the analyses under
``$WIOLA_CUBIN_CACHE`` (default ``~/.cache/wiola_kernels/cubin``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ..triton.aot import GPUS
from .compiled_lint import Finding, i32_address_products, narrow_stores
from .cubin import LITTLE_LAW_TARGET_BYTES, analyse_cubin, cubin_cache, record, write_atomically

# --------------------------------------------------------------------------- Triton

def _ptxas_spills(ptx: str, cubin: bytes) -> int:
    """Spill-store bytes ptxas reports for a Triton kernel's PTX (cached by cubin hash)."""
    cache = cubin_cache() / "spills"
    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / hashlib.sha256(cubin).hexdigest()[:32]
    if entry.exists():
        return int(entry.read_text())
    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    capability = int(re.match(r"sm_(\d+)", arch).group(1))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        # The ptxas and register-allocation flag Triton's own compile used (compiler.py make_cubin).
        cmd = [get_ptxas(capability).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src),
               "-o", str(Path(tmp) / "k.o")]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))
    write_atomically(entry, str(spills))
    return spills


def triton_lint(compiled, launch) -> list[Finding]:
    """The compiled-code lint of one Triton kernel: 32-bit address products (always) and
    narrow stores (memory-bound kernels chosen at a bench shape, whose sizes and strides
    are multiples of 16: only the kernel's addressing can keep a store narrow there)."""
    findings = i32_address_products(compiled.asm["ttir"])
    if launch.memory_bound and any(c.startswith("bench") for c in launch.case_grids):
        findings += narrow_stores(compiled.asm["ttgir"], compiled.asm["ptx"])
    return findings


_WORKER_LAUNCHES: dict[str, dict] = {}  # arch -> aot.launches, once per worker process


def _triton_record(arch: str, key: str) -> dict:
    """One Triton launch compiled for ``arch`` and described (a compile failure becomes a
    record with an ``error`` key): the unit of work :func:`triton_records` spreads over
    processes."""
    from ..triton import aot

    gpu = GPUS[arch]
    if arch not in _WORKER_LAUNCHES:
        _WORKER_LAUNCHES[arch] = aot.launches(gpu)
    launch = _WORKER_LAUNCHES[arch][key]
    try:
        compiled = aot.compile_launch(launch, gpu)
    except Exception as exc:  # reported per kernel; the caller fails on it
        return {"kernel": key, "source": "triton", "arch": arch, "error": f"{type(exc).__name__}: {exc}"[-4000:]}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage, sass = next(iter(analyse_cubin(cubin).values()))
    grid = next((g for c, g in launch.case_grids.items() if c.startswith("bench full")), None)
    spill = _ptxas_spills(compiled.asm["ptx"], compiled.asm["cubin"])
    rec = record(key, "triton", gpu, usage, sass, launch.num_warps * 32, grid, launch.memory_bound,
                 spill, dynamic_smem=compiled.metadata.shared, num_stages=launch.num_stages)
    rec["cases"] = sorted(launch.case_grids)
    rec["lint"] = [str(f) for f in triton_lint(compiled, launch)]
    return rec


def triton_records(archs=tuple(GPUS), jobs: int | None = None) -> list[dict]:
    """Compile every Triton launch (``aot.launches``) for each arch and describe it, in
    ``jobs`` processes (default: one per core; the compiles, ``ptxas -v`` and ``cuobjdump``
    of ~500 variants are minutes of single-threaded work). Records come back in launch
    order. Needs a non-interpreting process."""
    from ..triton import aot

    work = [(arch, key) for arch in archs for key in aot.launches(GPUS[arch])]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    if jobs == 1:
        return [_triton_record(arch, key) for arch, key in work]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: a parent that touched CUDA cannot fork safely; the workers only compile.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_triton_record, *zip(*work), chunksize=4))



# --------------------------------------------------------------------------- report

def collect(cuda: bool = True, triton: bool = True, jobs: int | None = None,
            archs: tuple[str, ...] = tuple(GPUS)) -> list[dict]:
    """Every record, for the architectures ``archs``. The CUDA part needs a source checkout
    (:class:`~wiola_kernels.devtools.NoCheckout` without one). When this process runs
    Triton's interpreter, the Triton part runs in a subprocess without
    ``TRITON_INTERPRET`` (compiling needs the real JIT functions)."""
    records = []
    if cuda:
        from .cuda_report import cuda_records

        records += cuda_records(archs)
    if triton:
        from ..dispatch import triton_interpret_mode

        if triton_interpret_mode():
            records += _triton_records_subprocess(jobs, archs)
        else:
            records += triton_records(archs, jobs=jobs)
    return records


def _triton_records_subprocess(jobs: int | None, archs: tuple[str, ...]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "triton.json"
        cmd = [sys.executable, "-m", "wiola_kernels", "gpu-report", "--no-cuda", "--json", str(out),
               "--arch", ",".join(archs)]
        subprocess.run(cmd + ([f"--jobs={jobs}"] if jobs else []),
                       env=env, check=False, capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError("the Triton AOT subprocess wrote no records")
        return json.loads(out.read_text())


def problems(records: list[dict]) -> list[str]:
    """What CI fails on: compile errors, spills, shared memory over the device limit, a
    kernel that cannot be resident, lint findings."""
    bad = []
    for r in records:
        where = f"{r['source']} {r['arch']} {r['kernel']}"
        if "error" in r:
            bad.append(f"{where}: does not compile: {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        if r["spill_bytes"]:
            bad.append(f"{where}: {r['spill_bytes']} bytes of register spills (ptxas)")
        if r["shared_bytes"] > GPUS[r["arch"]].smem_per_block:
            bad.append(f"{where}: {r['shared_bytes']} bytes of shared memory > {GPUS[r['arch']].smem_per_block}")
        if r["blocks_per_sm"] < 1:
            bad.append(f"{where}: not one block fits on an SM")
        bad += [f"{where}: {finding}" for finding in r.get("lint", [])]
    return bad


def format_table(records: list[dict]) -> str:
    """The records as an aligned text table (Triton kernel ids shortened: the first pointer's
    element type stands for the pointer arguments; plain integer arguments are left out)."""
    head = ("kernel", "src", "arch", "regs", "spill", "smem", "blk/SM (limit)", "TC", "bits", "in flight/SM", "lint")
    rows = [head]
    for r in records:
        name = r["kernel"]
        first = re.search(r"\[\*(\w+?)(?:/16)?,", name)
        name = re.sub(r"\*\w+(?:/16)?,|\bi32(?:/16)?,|\bfp32,", "", name)
        if first:
            name = name.replace("[", f"[{first.group(1)},", 1)
        if "error" in r:
            rows.append((name, r["source"], r["arch"], "ERROR", "", "", "", "", "", "", ""))
            continue
        flight = r["bytes_in_flight_per_sm"]
        rows.append((name, r["source"], r["arch"], str(r["registers"]), str(r["spill_bytes"]),
                     str(r["shared_bytes"]), f"{r['blocks_per_sm']} ({r.get('blocks_limit', '?')})",
                     "yes" if r["tensor_core"] else "no", str(r["global_access_bits"]),
                     "-" if flight is None else f"{flight / 1024:.1f} KB", str(len(r.get("lint", [])) or "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def parse_archs(text: str | None) -> tuple[str, ...]:
    """``"sm_90,sm_80"`` → ``("sm_90", "sm_80")``; None or empty: every architecture."""
    from ..cli import CommandError

    archs = tuple(a.strip() for a in (text or "").split(",") if a.strip()) or tuple(GPUS)
    unknown = [a for a in archs if a not in GPUS]
    if unknown:
        raise CommandError(f"--arch: unknown architecture {', '.join(unknown)} (known: {', '.join(GPUS)})")
    return archs


def main(args) -> int:
    """The ``gpu-report`` subcommand."""
    from . import REPO

    cuda = not args.no_cuda
    if cuda and REPO is None:
        print("gpu-report: no source checkout (csrc/ next to the package): the CUDA kernels are not reported, "
              "only the Triton ones", file=sys.stderr)
        cuda = False
    records = collect(cuda=cuda, triton=not args.no_triton, jobs=args.jobs, archs=parse_archs(args.arch))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print(format_table(records))
    bad = problems(records)
    for line in bad:
        print(f"PROBLEM: {line}", file=sys.stderr)
    short = [r for r in records if r.get("bytes_in_flight_per_sm") is not None
             and r["bytes_in_flight_per_sm"] < LITTLE_LAW_TARGET_BYTES]
    if short:
        print(f"\n{len(short)} memory-bound kernel(s) below {LITTLE_LAW_TARGET_BYTES // 1024} KB in flight per SM "
              "(design target; not a failure).")
    print("(design figures from the compilers' output; not measured on a GPU)")
    if args.json:
        print(f"wrote {args.json}")
    return 1 if bad else 0
