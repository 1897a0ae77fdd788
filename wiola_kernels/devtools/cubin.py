"""Reading compiled CUDA code without a GPU, shared by both halves of ``gpu-report``
(:mod:`~wiola_kernels.devtools.gpu_report`'s Triton kernels and
:mod:`~wiola_kernels.devtools.cuda_report`'s nvcc ones): the CUDA tools
(``cuobjdump``, ``nvcc``), a cubin's resource usage and SASS (main loop, access widths,
bytes in flight, narrow stores), occupancy on the reference GPUs, and one report record
(the fields are described in :mod:`~wiola_kernels.devtools.gpu_report`). Analyses are cached
under ``$WIOLA_CUBIN_CACHE`` (default ``~/.cache/wiola_kernels/cubin``)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

from ..triton.aot import GPU
from .compiled_lint import Finding

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


def write_atomically(path: Path, text: str) -> None:
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
    write_atomically(entry, json.dumps(out))
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

def cubin_cache() -> Path:
    """Where compiled cubins and their analyses are cached (``$WIOLA_CUBIN_CACHE``)."""
    return Path(os.environ.get("WIOLA_CUBIN_CACHE", Path.home() / ".cache" / "wiola_kernels" / "cubin"))
