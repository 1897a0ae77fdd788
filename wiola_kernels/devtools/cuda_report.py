"""The CUDA half of ``gpu-report``: every ``csrc/cuda/*.cu`` compiled by nvcc for sm_90 and
sm_80 and read back from the cubins. Needs a source checkout (``csrc/``) and nvcc; raises
:class:`~wiola_kernels.devtools.NoCheckout` without a checkout.

Launch geometry (threads per block, grid blocks, dynamic shared memory) comes from the
launchers' own constexpr functions (``csrc/include/wiola/atm_launch.h``,
``csrc/include/wiola/gcla_launch.h``), printed by ``csrc/tools/launch_geometry.cpp``,
which this module compiles and runs at the bench shape (``wiola_kernels.shapes``).

Compiled cubins and the geometry program are cached under ``$WIOLA_CUBIN_CACHE`` (default
``~/.cache/wiola_kernels/cubin``), keyed by the sources, headers and flags.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from .. import shapes
from ..triton.aot import GPUS
from .cubin import analyse_cubin, cubin_cache, narrow_store_findings, record, tool
from . import checkout

NVCC_FLAGS = ("-std=c++17", "-O3", "--use_fast_math", "--expt-relaxed-constexpr")  # as setup.py builds

#: Memory-bound CUDA sources: their kernels get bytes in flight at the bench shape (bf16).
MEMORY_BOUND = ("atm",)


def cuda_sources() -> list[Path]:
    """Every ``csrc/cuda/*.cu`` of the checkout."""
    return sorted((checkout() / "csrc" / "cuda").glob("*.cu"))


def _headers(repo: Path) -> list[Path]:
    return sorted((repo / "csrc" / "include").rglob("*.h"))


def _source_key(paths: list[Path], *flags: str) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:24]


def _nvcc() -> str:
    nvcc = tool("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found: the CUDA part of the report needs the CUDA toolkit (or pass --no-cuda)")
    return nvcc


def compile_cubins(archs=tuple(GPUS)) -> dict[tuple[str, str], Path]:
    """``{(source stem, arch): cubin}``, nvcc'd in parallel and cached."""
    repo, nvcc = checkout(), _nvcc()
    cache = cubin_cache()
    cache.mkdir(parents=True, exist_ok=True)
    jobs, out = [], {}
    for cu in cuda_sources():
        for arch in archs:
            key = _source_key([cu, *_headers(repo)], nvcc, arch, *NVCC_FLAGS)
            target = cache / f"{cu.stem}-{arch}-{key}.cubin"
            out[(cu.stem, arch)] = target
            if not target.exists():
                tmp = target.with_suffix(f".tmp{os.getpid()}")
                cmd = [nvcc, *NVCC_FLAGS, "-Xptxas", "-v", f"-arch={arch}", "-cubin",
                       f"-I{repo / 'csrc' / 'include'}", str(cu), "-o", str(tmp)]
                jobs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), tmp, target))
    for proc, tmp, target in jobs:
        log = proc.communicate()[0].decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {target.name}:\n{log}")
        target.with_suffix(".log").write_text(log)
        tmp.replace(target)
    return out


def launch_geometry(B: int, T: int, d: int, chunk_elems: int, L: int) -> dict[tuple[str, int], dict]:
    """``{(kernel name, DH or 0): {"blocks", "threads", "smem"}}`` from the launchers' constexpr
    geometry (``csrc/tools/launch_geometry.cpp``) at ATM shape (B, T, d), ``chunk_elems``
    elements per 16-byte chunk, and Λ' = L for GCLA."""
    repo, nvcc = checkout(), _nvcc()
    src = repo / "csrc" / "tools" / "launch_geometry.cpp"
    cache = cubin_cache()
    cache.mkdir(parents=True, exist_ok=True)
    exe = cache / f"launch_geometry-{_source_key([src, *_headers(repo)], nvcc)}"
    if not exe.exists():
        tmp = exe.with_suffix(f".tmp{os.getpid()}")
        subprocess.run([nvcc, "-std=c++17", f"-I{repo / 'csrc' / 'include'}", str(src), "-o", str(tmp)], check=True,
                       capture_output=True, text=True)
        tmp.replace(exe)
    out = subprocess.run([str(exe), str(B), str(T), str(d), str(chunk_elems), str(L)], check=True,
                         capture_output=True, text=True).stdout
    return {(e["kernel"], e["dh"]): e for e in json.loads(out)}


def _demangle(names: list[str]) -> list[str]:
    filt = shutil.which("c++filt")
    if not filt:
        return names
    return subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()


def short_name(demangled: str) -> tuple[str, str]:
    """(``kernel_name``, ``kernel_name<template args>``) from a demangled signature."""
    name = demangled.replace("(anonymous namespace)::", "")
    name = name[5:] if name.startswith("void ") else name
    name = name.split("(")[0]
    base = name.split("<")[0].split("::")[-1]
    tmpl = name[len(name.split("<")[0]):]
    return base, base + tmpl


def cuda_records(archs=tuple(GPUS)) -> list[dict]:
    """One record per kernel instantiation of every ``csrc/cuda/*.cu``, per arch; bytes in
    flight for the memory-bound sources' bf16 instantiations at the ATM bench shape."""
    B, T, d = shapes.ATM_BENCH["full"]
    bf16_chunk = 16 // shapes.GPU_BENCH_DTYPE.itemsize
    geometry = launch_geometry(B, T, d, bf16_chunk, shapes.GCLA_BENCH["L"])
    records = []
    for (stem, arch), cubin in compile_cubins(archs).items():
        gpu = GPUS[arch]
        analysed = analyse_cubin(cubin)
        log = cubin.with_suffix(".log").read_text()
        spills = {m.group(1): int(m.group(2)) for m in re.finditer(
            r"Function properties for (\S+)\s+\d+ bytes stack frame, (\d+) bytes spill stores", log)}
        mangled = sorted(analysed)
        for raw, dem in zip(mangled, _demangle(mangled)):
            base, full = short_name(dem)
            dh = next((int(v) for v in re.findall(r"\b\d+\b", full)[-1:]), 0)
            geo = geometry.get((base, dh)) or geometry.get((base, 0))
            if geo is None:
                raise ValueError(f"{stem}.cu: {base} has no launch geometry in csrc/tools/launch_geometry.cpp")
            memory_bound = stem in MEMORY_BOUND and "bfloat16" in full
            usage, sass = analysed[raw]
            rec = record(f"{stem}::{full}", "cuda", gpu, usage, sass, geo["threads"],
                         geo["blocks"] if memory_bound else None, memory_bound, spills[raw], dynamic_smem=geo["smem"])
            rec["lint"] = [str(f) for f in narrow_store_findings(sass)]
            records.append(rec)
    return records
