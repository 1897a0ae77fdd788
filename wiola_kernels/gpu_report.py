"""``python -m wiola_kernels gpu-report``: what the GPU compilers produced, without a GPU
(issue 10 §3).

For every CUDA kernel instantiation (``nvcc -cubin`` of each ``csrc/cuda/*.cu``) and every
Triton kernel the launchers compile (``wiola_kernels/triton/aot.py``), for sm_90 and
sm_80, one record:

* ``registers``, ``spill_bytes``, ``shared_bytes``: from the cubin
  (``cuobjdump --dump-resource-usage``) and ptxas's report; ``shared_bytes`` is
  the static shared memory per block, plus a Triton kernel's dynamic shared memory (its
  launch size); a CUDA kernel's dynamic shared memory is evaluated from its launch in
  the ``.cu`` (``sizeof(float) * (…)`` of the file's constants and ``DH``).
* ``blocks_per_sm``: resident blocks per SM those resources and the block size allow on
  the architecture's reference GPU (sm_90: H200, 132 SMs; sm_80: A100, 108 SMs; 64 K
  registers, 228 / 164 KB shared memory, 2048 threads and 32 blocks per SM).
  ``spill_bytes`` are ptxas's spill stores per thread (``ptxas -v``; local arrays, such
  as sin/cos's slow-path argument reduction, are not spills).
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

Compiled cubins are cached: Triton's in its cache (``TRITON_CACHE_DIR``), nvcc's under
``$WIOLA_CUBIN_CACHE`` (default ``~/.cache/wiola_kernels/cubin``), keyed by the sources,
headers and flags.
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

from .triton.aot import GPU, GPUS

KEYS = ("kernel", "source", "arch", "registers", "spill_bytes", "shared_bytes", "blocks_per_sm", "tensor_core",
        "global_access_bits", "bytes_in_flight_per_sm")
LITTLE_LAW_TARGET_BYTES = 32 * 1024  # per SM, for HBM bandwidth on an H200
REPO = Path(__file__).resolve().parent.parent
NVCC_FLAGS = ("-std=c++17", "-O3", "--use_fast_math", "--expt-relaxed-constexpr")  # as setup.py builds

# ATM (memory-bound) kernels' grids at the bench shape (bench/cases.py: B, T, d), as the
# launchers in csrc/cuda/atm.cu compute them; block sizes are read from the source.
ATM_BENCH = {"B": 8, "T": 2048, "d": 1024}
ATM_GRIDS = {
    "norms_and_dots_kernel": lambda B, T, d: B * math.ceil(T / _cuda_constant("atm", "kSimTokens")),
    "select_kernel": lambda B, T, d: B,
    "gather_average_kernel": lambda B, T, d: B * T,
    "merge_backward_kernel": lambda B, T, d: B * T,
    "unmerge_kernel": lambda B, T, d: B * T,
    "map_sorted_kernel": lambda B, T, d: B,
    # segments × column blocks of 16-byte chunks (8 bf16 columns each), × rows
    "unmerge_backward_kernel": lambda B, T, d: (math.ceil(T / _cuda_constant("atm", "kUnmergeSegment"))
                                                * math.ceil(d / 8 / _cuda_constant("atm", "kColumnThreads"))
                                                * min(B, 65535)),
}


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


def analyse_cubin(cubin: Path) -> dict[str, tuple[dict, dict]]:
    """``{mangled function: (resource usage, analyse_sass result)}``, cached by the
    cubin's hash (the cuobjdump calls dominate a warm report)."""
    data = cubin.read_bytes()
    cache = _cubin_cache() / "analysis"
    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / f"{hashlib.sha256(data).hexdigest()[:32]}.json"
    if entry.exists():
        return {k: tuple(v) for k, v in json.loads(entry.read_text()).items()}
    usage = resource_usage(cubin)
    sass = sass_functions(cubin)
    out = {name: (u, analyse_sass(sass.get(name, []))) for name, u in usage.items()}
    entry.write_text(json.dumps(out))
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
    """Tensor-core use, the main loop's widest global access and its load bytes per thread."""
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
    return {
        "tensor_core": tensor_core,
        "global_access_bits": max(widths) if widths else 0,
        "load_bytes": sum(_access_bits(op) // 8 for _, op, _ in body if op.startswith("LDG") and
                          not op.startswith(("LDGSTS", "LDGDEPBAR"))),
        "async_load_bytes": sum(_access_bits(op) // 8 for _, op, _ in body if op.startswith("LDGSTS")),
        "in_loop": bool(loaded),
    }


def blocks_per_sm(gpu: GPU, registers: int, threads: int, shared_bytes: int) -> int:
    """Resident blocks per SM (CUDA occupancy rules: registers allocated per warp in units
    of 256, 1 KB of shared memory reserved per block)."""
    warps = math.ceil(threads / 32)
    by_threads = gpu.max_threads_per_sm // (warps * 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_regs = (gpu.regs_per_sm // regs_per_warp) // warps
    by_smem = gpu.smem_per_sm // (shared_bytes + gpu.reserved_smem_per_block)
    return max(0, min(gpu.max_blocks_per_sm, by_threads, by_regs, by_smem))


def _record(kernel, source, gpu, usage, sass, threads, grid, memory_bound, spill, dynamic_smem=0, num_stages=1):
    shared = usage.get("SHARED", 0) + dynamic_smem
    blocks = blocks_per_sm(gpu, usage.get("REG", 0), threads, shared)
    in_flight = None
    if memory_bound and grid is not None:
        resident = min(blocks, math.ceil(grid / gpu.sms))
        per_thread = sass["load_bytes"] + sass["async_load_bytes"] * max(1, num_stages - 1)
        in_flight = resident * threads * per_thread
    return {"kernel": kernel, "source": source, "arch": gpu.arch, "registers": usage.get("REG", 0),
            "spill_bytes": spill, "shared_bytes": shared, "blocks_per_sm": blocks,
            "tensor_core": sass["tensor_core"], "global_access_bits": sass["global_access_bits"],
            "bytes_in_flight_per_sm": in_flight}


# --------------------------------------------------------------------------- Triton

def _ptxas_spills(ptx: str, cubin: bytes) -> int:
    """Spill-store bytes ptxas reports for a Triton kernel's PTX (cached by cubin hash)."""
    cache = _cubin_cache() / "spills"
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
    entry.write_text(str(spills))
    return spills


def triton_records(archs=tuple(GPUS)) -> list[dict]:
    """Compile every Triton launch (``aot.launches``) for each arch and describe it. A
    compile failure becomes a record with an ``error`` key. Needs a non-interpreting process."""
    from .triton import aot

    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            gpu = GPUS[arch]
            for key, launch in aot.launches(gpu).items():
                try:
                    compiled = aot.compile_launch(launch, gpu)
                except Exception as exc:  # reported per kernel; the caller fails on it
                    records.append({"kernel": key, "source": "triton", "arch": arch,
                                    "error": f"{type(exc).__name__}: {exc}"[-4000:]})
                    continue
                cubin = Path(tmp) / "k.cubin"
                cubin.write_bytes(compiled.asm["cubin"])
                usage, sass = next(iter(analyse_cubin(cubin).values()))
                grid = next((g for c, g in launch.case_grids.items() if c.startswith("bench full")), None)
                spill = _ptxas_spills(compiled.asm["ptx"], compiled.asm["cubin"])
                rec = _record(key, "triton", gpu, usage, sass, launch.num_warps * 32, grid, launch.memory_bound,
                              spill, dynamic_smem=compiled.metadata.shared, num_stages=launch.num_stages)
                rec["cases"] = sorted(launch.case_grids)
                records.append(rec)
    return records


# --------------------------------------------------------------------------- CUDA

def cuda_sources() -> list[Path]:
    return sorted((REPO / "csrc" / "cuda").glob("*.cu"))


def _cubin_cache() -> Path:
    return Path(os.environ.get("WIOLA_CUBIN_CACHE", Path.home() / ".cache" / "wiola_kernels" / "cubin"))


def _source_key(cu: Path, arch: str, nvcc: str) -> str:
    h = hashlib.sha256()
    for path in [cu, *sorted((REPO / "csrc" / "include").rglob("*.h"))]:
        h.update(path.read_bytes())
    h.update(" ".join((nvcc, arch, *NVCC_FLAGS)).encode())
    return h.hexdigest()[:24]


def compile_cubins(archs=tuple(GPUS)) -> dict[tuple[str, str], Path]:
    """``{(source stem, arch): cubin}``, nvcc'd in parallel and cached."""
    nvcc = tool("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found: the CUDA part of the report needs the CUDA toolkit")
    cache = _cubin_cache()
    cache.mkdir(parents=True, exist_ok=True)
    jobs, out = [], {}
    for cu in cuda_sources():
        for arch in archs:
            target = cache / f"{cu.stem}-{arch}-{_source_key(cu, arch, nvcc)}.cubin"
            out[(cu.stem, arch)] = target
            if not target.exists():
                tmp = target.with_suffix(f".tmp{os.getpid()}")
                cmd = [nvcc, *NVCC_FLAGS, "-Xptxas", "-v", f"-arch={arch}", "-cubin", f"-I{REPO / 'csrc' / 'include'}", str(cu),
                       "-o", str(tmp)]
                jobs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), tmp, target))
    for proc, tmp, target in jobs:
        log = proc.communicate()[0].decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {target.name}:\n{log}")
        target.with_suffix(".log").write_text(log)
        tmp.replace(target)
    return out


def _cuda_constant(stem: str, name: str) -> int:
    text = (REPO / "csrc" / "cuda" / f"{stem}.cu").read_text()
    m = re.search(rf"constexpr\s+int\s+{name}\s*=\s*([^;]+);", text)
    if not m:
        raise ValueError(f"{stem}.cu: no constexpr int {name}")
    expr = m.group(1)
    for other in set(re.findall(r"\bk\w+", expr)) - {name}:
        expr = expr.replace(other, str(_cuda_constant(stem, other)))
    return int(eval(expr, {"__builtins__": {}}))  # noqa: S307 - products of integer constants


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated arguments of ``text`` (brackets and templates nest)."""
    depth, args, cur = 0, [], ""
    for ch in text:
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    args.append(cur.strip())
    return args


def _launches(stem: str) -> dict[str, tuple[list[str], int]]:
    """``{kernel name: ([grid, block, smem, stream, …], offset in the source)}`` for every
    launch in ``csrc/cuda/<stem>.cu``: ``launch_kernel(kernel<…>, grid, block, smem, stream,
    …)`` (the launch helper, csrc/include/wiola/cuda_launch.cuh) or ``kernel<…><<<grid,
    block, smem, stream>>>``."""
    text = (REPO / "csrc" / "cuda" / f"{stem}.cu").read_text()
    out = {}
    for m in re.finditer(r"(\w+)(?:<[^<>;]*>)?<<<(.*?)>>>", text, re.S):
        out[m.group(1)] = (_split_args(m.group(2)), m.start())
    for m in re.finditer(r"\blaunch_kernel\((.*?)\);", text, re.S):
        args = _split_args(m.group(1))
        name = re.match(r"\w+", args[0])
        if name:
            out[name.group(0)] = (args[1:], m.start())
    return out


def launch_block_sizes(stem: str) -> dict[str, int]:
    """``{kernel name: threads per block}`` from the ``<<<grid, block, …>>>`` launches of
    ``csrc/cuda/<stem>.cu`` (the block argument, a literal or a ``constexpr int``)."""
    return {name: int(args[1]) if args[1].isdigit() else _cuda_constant(stem, args[1])
            for name, (args, _) in _launches(stem).items()}


#: Context slots (Λ') of the GCLA bench shape: a run-time size of the summary kernels' shared memory.
BENCH_CONTEXT_SLOTS = 2


def dynamic_smem(stem: str, kernel: str, template_ints: list[int]) -> int:
    """Dynamic shared memory of a launch: its third ``<<<>>>`` argument, a literal or a
    ``size_t`` defined before the launch as ``sizeof(float) * (…)`` of ``constexpr int``
    constants and the kernel's ``int`` template parameter (``DH``)."""
    text = (REPO / "csrc" / "cuda" / f"{stem}.cu").read_text()
    args, at = _launches(stem)[kernel]
    expr = args[2] if len(args) > 2 else "0"
    if not expr.isdigit():
        defs = list(re.finditer(rf"size_t\s+{re.escape(expr)}\s*=\s*([^;]+);", text[:at]))
        if not defs:
            raise ValueError(f"{stem}.cu: shared memory size {expr!r} of {kernel} not found")
        expr = defs[-1].group(1)
    expr = expr.replace("sizeof(float)", "4")
    if "DH" in expr:
        expr = re.sub(r"\bDH\b", str(template_ints[-1]), expr)
    # Run-time sizes: the bench's context slots (Λ' = 2), and the larger side of a
    # run-time choice (`cond ? a : b`), so the report shows the worst case.
    expr = re.sub(r"\bp\.L\b", str(BENCH_CONTEXT_SLOTS), expr)
    expr = re.sub(r"\(\s*\w+\s*\?\s*([^:()]+?)\s*:\s*([^()]+?)\s*\)", r"max(\1, \2)", expr)
    for name in set(re.findall(r"\bk\w+", expr)):
        expr = re.sub(rf"\b{name}\b", str(_cuda_constant(stem, name)), expr)
    if not re.fullmatch(r"(?:[\d\s()+*,-]|max)+", expr):
        raise ValueError(f"{stem}.cu: cannot evaluate the shared memory of {kernel}: {expr}")
    return int(eval(expr, {"__builtins__": {}, "max": max}))  # noqa: S307 - integer arithmetic only


def _demangle(names: list[str]) -> list[str]:
    filt = shutil.which("c++filt")
    if not filt:
        return names
    return subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()


def _short_name(demangled: str) -> tuple[str, str]:
    """(``kernel_name``, ``kernel_name<template args>``) from a demangled signature."""
    name = demangled.replace("(anonymous namespace)::", "")
    name = name[5:] if name.startswith("void ") else name
    name = name.split("(")[0]
    base = name.split("<")[0].split("::")[-1]
    tmpl = name[len(name.split("<")[0]):]
    return base, base + tmpl


def cuda_records(archs=tuple(GPUS)) -> list[dict]:
    """One record per kernel instantiation of every ``csrc/cuda/*.cu``, per arch."""
    records = []
    for (stem, arch), cubin in compile_cubins(archs).items():
        gpu = GPUS[arch]
        analysed = analyse_cubin(cubin)
        blocks = launch_block_sizes(stem)
        log = cubin.with_suffix(".log").read_text()
        spills = {m.group(1): int(m.group(2)) for m in re.finditer(
            r"Function properties for (\S+)\s+\d+ bytes stack frame, (\d+) bytes spill stores", log)}
        mangled = sorted(analysed)
        for raw, dem in zip(mangled, _demangle(mangled)):
            base, full = _short_name(dem)
            if base not in blocks:
                raise ValueError(f"{stem}.cu: no launch of {base} found (block size unknown)")
            memory_bound = stem == "atm"
            grid = ATM_GRIDS[base](**ATM_BENCH) if memory_bound and "bfloat16" in full else None
            records.append(_record(f"{stem}::{full}", "cuda", gpu, *analysed[raw],
                                   blocks[base], grid, memory_bound and grid is not None, spills[raw],
                                   dynamic_smem=dynamic_smem(stem, base, [int(v) for v in re.findall(r"\b\d+\b", full)])))
    return records


# --------------------------------------------------------------------------- report

def collect(cuda: bool = True, triton: bool = True) -> list[dict]:
    """Every record. When this process runs Triton's interpreter, the Triton part runs in a
    subprocess without ``TRITON_INTERPRET`` (compiling needs the real JIT functions)."""
    records = []
    if cuda:
        records += cuda_records()
    if triton:
        from .dispatch import triton_interpret_mode

        if triton_interpret_mode():
            records += _triton_records_subprocess()
        else:
            records += triton_records()
    return records


def _triton_records_subprocess() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "triton.json"
        subprocess.run([sys.executable, "-m", "wiola_kernels", "gpu-report", "--no-cuda", "--json", str(out)],
                       env=env, check=False, capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError("the Triton AOT subprocess wrote no records")
        return json.loads(out.read_text())


def problems(records: list[dict]) -> list[str]:
    """What CI fails on: compile errors, spills, shared memory over the device limit, a
    kernel that cannot be resident at all."""
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
    return bad


def format_table(records: list[dict]) -> str:
    """The records as an aligned text table."""
    head = ("kernel", "src", "arch", "regs", "spill", "smem", "blk/SM", "TC", "bits", "in flight/SM")
    rows = [head]
    for r in records:
        if "error" in r:
            rows.append((r["kernel"], r["source"], r["arch"], "ERROR", "", "", "", "", "", ""))
            continue
        flight = r["bytes_in_flight_per_sm"]
        rows.append((r["kernel"], r["source"], r["arch"], str(r["registers"]), str(r["spill_bytes"]),
                     str(r["shared_bytes"]), str(r["blocks_per_sm"]), "yes" if r["tensor_core"] else "no",
                     str(r["global_access_bits"]), "-" if flight is None else f"{flight / 1024:.1f} KB"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def main(args) -> int:
    """The ``gpu-report`` subcommand."""
    records = collect(cuda=not args.no_cuda, triton=not args.no_triton)
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
