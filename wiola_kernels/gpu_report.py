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
* ``lint``: findings of :mod:`wiola_kernels.compiled_lint` on the compiled code — 32-bit
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
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .compiled_lint import Finding, i32_address_products, narrow_stores
from .triton.aot import GPU, GPUS

LITTLE_LAW_TARGET_BYTES = 32 * 1024  # per SM, for HBM bandwidth on an H200
_ANALYSIS_VERSION = 3  # bump when analyse_sass's record changes (its results are cached)


# --------------------------------------------------------------------------- tools

def tool(name: str) -> str | None:
    """Path of ``cuobjdump``/``nvdisasm``/``nvcc``: Triton's wheel first, then the CUDA toolkit."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if bundled.exists():
        return str(bundled)
    found = shutil.which(name)
    if found:
        return found
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / name
    return str(cuda) if cuda.exists() else None


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def resource_usage(cubin: Path) -> dict[str, dict[str, int]]:
    """``{mangled function: {"REG": …, "SHARED": …, "LOCAL": …, "STACK": …}}`` from cuobjdump."""
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in _run([tool("cuobjdump"), "--dump-resource-usage", str(cubin)]).splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
        elif name and "REG:" in line:
            out[name] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
            name = None
    return out


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def sass_functions(cubin: Path) -> dict[str, list[tuple[int, str, str]]]:
    """``{mangled function: [(address, opcode, operands), …]}`` from ``cuobjdump -sass``."""
    funcs: dict[str, list] = {}
    current = None
    for line in _run([tool("cuobjdump"), "-sass", str(cubin)]).splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = funcs.setdefault(m.group(1), [])
            continue
        m = _SASS_LINE.search(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return funcs


def _write_atomically(path: Path, text: str) -> None:
    """A cache entry that another process may read while it is written (rename is atomic)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def analyse_cubin(cubin: Path) -> dict[str, tuple[dict, dict]]:
    """``{mangled function: (resource usage, analyse_sass result)}``, cached by the
    cubin's hash (the cuobjdump calls dominate a warm report)."""
    data = cubin.read_bytes()
    cache = cubin_cache() / f"analysis-v{_ANALYSIS_VERSION}"
    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / f"{hashlib.sha256(data).hexdigest()[:32]}.json"
    if entry.exists():
        return {k: tuple(v) for k, v in json.loads(entry.read_text()).items()}
    usage = resource_usage(cubin)
    sass = sass_functions(cubin)
    out = {name: (u, analyse_sass(sass.get(name, []))) for name, u in usage.items()}
    _write_atomically(entry, json.dumps(out))
    return out


def _access_bits(opcode: str) -> int:
    parts = opcode.split(".")
    for p in parts[1:]:
        if p in ("128", "64", "256"):
            return int(p)
        if p in ("U16", "S16"):
            return 16
        if p in ("U8", "S8"):
            return 8
    return 32


def _is_global_load(op: str) -> bool:
    return op.startswith("LDG") and not op.startswith("LDGDEPBAR")  # LDG, LDGSTS


def _is_global_access(op: str) -> bool:
    return _is_global_load(op) or op.startswith("STG")


def analyse_sass(instrs: list[tuple[int, str, str]]) -> dict:
    """Tensor-core use, the main loop's widest global access, its load bytes per thread, and
    the widths of its global loads (widest) and stores (each)."""
    tensor_core = any(op.startswith(("HGMMA", "HMMA")) for _, op, _ in instrs)
    loops = []
    for addr, op, operands in instrs:
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", operands)
            if m and int(m.group(1), 16) < addr:
                loops.append((int(m.group(1), 16), addr))
    body = instrs

    def load_bytes(lo, hi):
        return sum(_access_bits(op) // 8 for a, op, _ in instrs if lo <= a <= hi and _is_global_load(op))

    loaded = [(lo, hi) for lo, hi in loops if load_bytes(lo, hi)]
    if loaded:
        # The main loop: most bytes loaded per iteration; of equals, the innermost. (Not
        # merely the innermost: sin/cos's slow-path argument reduction is a small loop
        # that reads a constant table.)
        lo, hi = max(loaded, key=lambda r: (load_bytes(*r), r[0] - r[1]))
        body = [i for i in instrs if lo <= i[0] <= hi]
    widths = [_access_bits(op) for _, op, _ in body if _is_global_access(op)]
    loads = [_access_bits(op) for _, op, _ in body if _is_global_load(op)]
    return {
        "tensor_core": tensor_core,
        "global_access_bits": max(widths) if widths else 0,
        "load_bytes": sum(_access_bits(op) // 8 for _, op, _ in body if op.startswith("LDG") and
                          not op.startswith(("LDGSTS", "LDGDEPBAR"))),
        "async_load_bytes": sum(_access_bits(op) // 8 for _, op, _ in body if op.startswith("LDGSTS")),
        "in_loop": bool(loaded),
        "load_bits": max(loads) if loads else 0,
        "store_bits": sorted({_access_bits(op) for _, op, _ in body if op.startswith("STG")}),
        "split_stores": split_stores(instrs),
    }


_STG_ADDRESS = re.compile(r"\[(U?R\d+)(?:\.64)?(?:\+(-?0x[0-9a-f]+))?\]\s*,")


def split_stores(instrs: list[tuple[int, str, str]]) -> list[list[int]]:
    """Runs of global stores, anywhere in the kernel, that write consecutive bytes from one
    address register with stores of 32 bits or fewer, 4 bytes or more in all: ``[[address
    of the first, stores, bits each], …]``. That is what a plain store of a thread's aligned
    struct of elements became in the GCLA kernels (4 x 16-bit for bf16, 4 x 32-bit for fp32:
    NVVM split it) where one STG.E.64 / STG.E.128 would do."""
    runs, run = [], None  # run: [first address, stores, bits, base register, next offset]
    for addr, op, operands in instrs:
        if not op.startswith("STG"):
            continue
        m = _STG_ADDRESS.search(operands)
        bits = _access_bits(op)
        if m is None:
            run = None
            continue
        base, offset = m.group(1), int(m.group(2) or "0", 16)
        if run is not None and run[3] == base and run[2] == bits and run[4] == offset:
            run[1] += 1
            run[4] += bits // 8
        else:
            run = [addr, 1, bits, base, offset + bits // 8]
            runs.append(run)
    return [r[:3] for r in runs if r[1] >= 2 and r[2] <= 32 and r[1] * r[2] >= 32]


def _store_name(bits: int) -> str:
    return "STG.E" if bits == 32 else f"STG.E.{bits}"


def narrow_store_findings(sass: dict) -> list[Finding]:
    """The SASS form of the narrow-store check (CUDA kernels, whose layout is not visible):
    a main loop whose loads are 128 bits wide (a thread owns 16 contiguous bytes) but whose
    stores are all 32 bits or narrower; and, anywhere in the kernel, runs of 16/32-bit
    stores to consecutive bytes of one address (:func:`split_stores`: one thread's 8 or 16
    contiguous bytes written piecewise)."""
    found = []
    if sass.get("load_bits", 0) >= 128 and sass.get("store_bits") and max(sass["store_bits"]) <= 32:
        found.append(Finding("narrow-store", "main loop",
                             f"stores of {max(sass['store_bits'])} bits where the loads are 128-bit: each thread's "
                             "16 contiguous bytes could be one STG.E.128"))
    for addr, count, bits in sass.get("split_stores", []):
        found.append(Finding("split-store", f"SASS {addr:#06x}",
                             f"{count} stores of {bits} bits to consecutive bytes of one address: one "
                             f"{_store_name(min(count * bits, 128))} when aligned "
                             "(a thread's elements stored as one vector, wiola/cuda_vector.cuh)"))
    return found


def occupancy(gpu: GPU, registers: int, threads: int, shared_bytes: int) -> tuple[int, str]:
    """``(resident blocks per SM, what limits it)`` by the CUDA occupancy rules (registers
    allocated per warp in units of 256, 1 KB of shared memory reserved per block)."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    limits = {
        "blocks": gpu.max_blocks_per_sm,
        "threads": gpu.max_threads_per_sm // (warps * 32),
        "registers": (gpu.regs_per_sm // regs_per_warp) // warps,
        "shared memory": gpu.smem_per_sm // (shared_bytes + gpu.reserved_smem_per_block),
    }
    limit = min(limits, key=lambda k: (limits[k], list(limits).index(k)))  # ties: the per-SM block/thread caps
    return max(0, limits[limit]), limit


def blocks_per_sm(gpu: GPU, registers: int, threads: int, shared_bytes: int) -> int:
    """Resident blocks per SM (:func:`occupancy`)."""
    return occupancy(gpu, registers, threads, shared_bytes)[0]


def record(kernel, source, gpu, usage, sass, threads, grid, memory_bound, spill, dynamic_smem=0, num_stages=1):
    """One report record (see the module docstring) from a kernel's resources and SASS analysis."""
    shared = usage.get("SHARED", 0) + dynamic_smem
    blocks, limit = occupancy(gpu, usage.get("REG", 0), threads, shared)
    in_flight = None
    if memory_bound and grid is not None:
        resident = min(blocks, math.ceil(grid / gpu.sms))
        per_thread = sass["load_bytes"] + sass["async_load_bytes"] * max(1, num_stages - 1)
        in_flight = resident * threads * per_thread
    return {"kernel": kernel, "source": source, "arch": gpu.arch, "registers": usage.get("REG", 0),
            "spill_bytes": spill, "shared_bytes": shared, "threads": threads, "blocks_per_sm": blocks,
            "blocks_limit": limit, "tensor_core": sass["tensor_core"], "global_access_bits": sass["global_access_bits"],
            "bytes_in_flight_per_sm": in_flight, "lint": []}


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
    _write_atomically(entry, str(spills))
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
    from .triton import aot

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
    from .triton import aot

    work = [(arch, key) for arch in archs for key in aot.launches(GPUS[arch])]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    if jobs == 1:
        return [_triton_record(arch, key) for arch, key in work]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: a parent that touched CUDA cannot fork safely; the workers only compile.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_triton_record, *zip(*work), chunksize=4))


def cubin_cache() -> Path:
    """Where compiled cubins and their analyses are cached (``$WIOLA_CUBIN_CACHE``)."""
    return Path(os.environ.get("WIOLA_CUBIN_CACHE", Path.home() / ".cache" / "wiola_kernels" / "cubin"))


# --------------------------------------------------------------------------- report

def collect(cuda: bool = True, triton: bool = True, jobs: int | None = None) -> list[dict]:
    """Every record. The CUDA part needs a source checkout
    (:class:`~wiola_kernels.devtools.NoCheckout` without one). When this process runs
    Triton's interpreter, the Triton part runs in a subprocess without
    ``TRITON_INTERPRET`` (compiling needs the real JIT functions)."""
    records = []
    if cuda:
        from .devtools.cuda_report import cuda_records

        records += cuda_records()
    if triton:
        from .dispatch import triton_interpret_mode

        if triton_interpret_mode():
            records += _triton_records_subprocess(jobs)
        else:
            records += triton_records(jobs=jobs)
    return records


def _triton_records_subprocess(jobs: int | None = None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "triton.json"
        cmd = [sys.executable, "-m", "wiola_kernels", "gpu-report", "--no-cuda", "--json", str(out)]
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


def main(args) -> int:
    """The ``gpu-report`` subcommand."""
    from .devtools import REPO

    cuda = not args.no_cuda
    if cuda and REPO is None:
        print("gpu-report: no source checkout (csrc/ next to the package): the CUDA kernels are not reported, "
              "only the Triton ones", file=sys.stderr)
        cuda = False
    records = collect(cuda=cuda, triton=not args.no_triton, jobs=args.jobs)
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
