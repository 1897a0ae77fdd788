"""The cubin table: every Triton kernel variant the C++ launchers launch, compiled ahead of
time for each target architecture and written as a C++ source embedded in the extension.

``setup.py`` runs :func:`write` when it builds the CUDA kernels; standalone (no GPU and no
CUDA torch needed)::

    python -m wiola_kernels.triton.cubin_table --out DIR [--arch 90,80] [--ptx] [--jobs N] [--empty REASON]

writes ``DIR/wiola_cubin_table.cpp`` (the table, csrc/include/wiola/triton_table.h's
``wiola::triton::table()``), ``DIR/wiola_cubin_table.json`` (the same entries without the
cubins, for the tests) and with ``--ptx`` each entry's PTX (``DIR/ptx/<index>.ptx``).

What is compiled: :func:`wiola_kernels.triton.aot.launches` of the modules in
:data:`MODULES` (the ops whose CUDA kernel is C++), i.e. exactly the variants the Python
launchers' JIT compiles at the test and bench shapes, each keyed by
:func:`~wiola_kernels.triton.aot.variant_id`. The C++ chooser builds the same key from a
call's arguments (csrc/include/wiola/triton_table.h); a call whose key is not in the table
runs the Python launcher instead, which registers what its JIT compiles, described by
:func:`describe` as the entries here are (``runtime_table.py``).

Per entry: the cubin, the function's (mangled) name, ``num_warps``, ``num_ctas``, shared
memory, the compiled signature's runtime parameters (constexprs and integers specialised to
1 left out; pointer / i32 / i64 / fp32 kinds; the index of the Python argument each comes
from) and how many scratch pointers this Triton appends after them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

#: Kernel modules whose variants the table holds: the ops launched from C++.
MODULES = ("glu", "rms_norm", "add_rms_norm", "srpe", "linear_cross_entropy")

#: The C++ kind of each compiled-signature type (csrc/include/wiola/triton_table.h ParamKind).
#: (Narrower scalars would need their own widths: none of the kernels takes one.)
_KINDS = {"i32": "I32", "u32": "I32", "i64": "I64", "u64": "I64", "fp32": "F32", "fp64": "F64"}

GENERATED_CPP = "wiola_cubin_table.cpp"
GENERATED_JSON = "wiola_cubin_table.json"


def parse_archs(spec: str | None) -> list[int]:
    """``"90,80"`` / ``"9.0;8.0"`` / ``"sm_90"`` (WIOLA_CUDA_ARCH or TORCH_CUDA_ARCH_LIST) as
    ``[90, 80]``; ``+PTX`` and arch suffixes (``90a``) are read as the base architecture.
    None or empty: the default ``[90, 80]``."""
    if not spec or not spec.strip():
        return [90, 80]
    out = []
    for item in re.split(r"[,;\s]+", spec.strip()):
        item = item.lower().removesuffix("+ptx").removeprefix("sm_").removeprefix("compute_")
        if not item:
            continue
        if "." in item:
            major, minor = item.split(".", 1)
            item = major + minor[:1]
        digits = re.match(r"\d+", item)
        if not digits:
            raise ValueError(f"not a CUDA architecture: {item!r} in {spec!r}")
        if int(digits.group()) not in out:
            out.append(int(digits.group()))
    return out


def trailing_scratch_pointers(triton_version: str) -> int:
    """How many pointers Triton's launcher appends after a kernel's own arguments: the global
    and the profile scratch (Triton ≥ 3.5), the global scratch only (3.3, 3.4), none before."""
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", triton_version).groups())
    if (major, minor) >= (3, 5):
        return 2
    return 1 if (major, minor) >= (3, 3) else 0


def _gpu(arch: int):
    from .aot import GPU, GPUS

    for gpu in GPUS.values():
        if gpu.capability == arch:
            return gpu
    # Another architecture: the chooser needs the SM count, which only the device knows;
    # compile the H200's launch list for it (the grid is a runtime argument, not a variant).
    return GPU(f"sm_{arch}", f"sm_{arch}", arch, sms=GPUS["sm_90"].sms)


def _params(launch, gpu) -> list[dict]:
    """The compiled signature's runtime parameters, in order: ``{"arg": index of the Python
    argument, "name", "type" (Triton's), "kind" (C++'s)}``."""
    from .aot import specialise

    signature, _, _, _ = specialise(launch, gpu)
    out = []
    for i, (name, ty) in enumerate(signature.items()):
        if ty == "constexpr":
            continue
        kind = "PTR" if ty.startswith("*") else _KINDS.get(ty)
        if kind is None:
            raise ValueError(f"{launch.name}: parameter {name} of type {ty} has no C++ kind")
        out.append({"arg": i, "name": name, "type": ty, "kind": kind})
    return out


def _variants(archs: list[int], modules) -> list[tuple[int, str, str]]:
    """``(arch, module, key)`` of every distinct variant, in a fixed order."""
    import importlib

    from .aot import module_launches, variant_id

    out = []
    for arch in archs:
        gpu = _gpu(arch)
        seen = set()
        for mod_name in modules:
            mod = importlib.import_module(f"{__package__}.{mod_name}")
            for launch in module_launches(mod, gpu):
                key = variant_id(launch, gpu)
                if key not in seen:
                    seen.add(key)
                    out.append((arch, mod_name, key))
    return out


_WORKER_LAUNCHES: dict[tuple[int, str], dict] = {}  # (arch, module) -> {key: launch}, once per process


def _compile_entry(arch: int, mod_name: str, key: str, with_ptx: bool) -> dict:
    """Compile one variant and describe it (the unit of work spread over processes)."""
    import importlib

    from .aot import compile_launch, module_launches, variant_id

    gpu = _gpu(arch)
    if (arch, mod_name) not in _WORKER_LAUNCHES:
        mod = importlib.import_module(f"{__package__}.{mod_name}")
        _WORKER_LAUNCHES[(arch, mod_name)] = {variant_id(l, gpu): l for l in module_launches(mod, gpu)}
    launch = _WORKER_LAUNCHES[(arch, mod_name)][key]
    compiled = compile_launch(launch, gpu)
    entry = describe(launch, gpu, compiled, key, mod_name)
    if with_ptx:
        entry["ptx"] = compiled.asm["ptx"]
    return entry


def describe(launch, gpu, compiled, key: str, mod_name: str) -> dict:
    """The table entry of ``compiled`` (Triton's compiled kernel of ``launch`` for ``gpu``) under
    ``key``, with its ``cubin`` bytes: the static table's entries (compiled ahead of time) and the
    runtime table's (compiled by the Python launcher's JIT, ``runtime_table.py``) both come from
    here. ValueError for a kernel the C++ launcher cannot launch."""
    import triton

    md = compiled.metadata
    entry = {
        "key": key, "module": mod_name, "kernel": launch.name, "function": md.name, "arch": gpu.capability,
        "num_warps": md.num_warps, "num_ctas": md.num_ctas, "shared": md.shared,
        "global_scratch_size": getattr(md, "global_scratch_size", 0) or 0,
        "profile_scratch_size": getattr(md, "profile_scratch_size", 0) or 0,
        "cooperative": bool(getattr(md, "launch_cooperative_grid", False)),
        "pdl": bool(getattr(md, "launch_pdl", False)),
        "cluster_dims": list(getattr(md, "cluster_dims", (1, 1, 1)) or (1, 1, 1)),
        "params": _params(launch, gpu), "scratch_pointers": trailing_scratch_pointers(triton.__version__),
        "cubin": compiled.asm["cubin"],
    }
    _check_launchable(entry)
    return entry


def entries(archs: list[int], modules=MODULES, with_ptx: bool = False, jobs: int | None = None) -> list[dict]:
    """Compile every variant of ``modules`` for each of ``archs``; one dict per (arch,
    variant) with ``cubin`` bytes (and ``ptx`` text when ``with_ptx``). ``jobs`` processes
    compile them (default: the CPU count; 1: in this process)."""
    tasks = _variants(archs, modules)
    jobs = min(len(tasks), jobs or os.cpu_count() or 1)
    if jobs <= 1:
        return [_compile_entry(arch, mod, key, with_ptx) for arch, mod, key in tasks]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: a forked child would inherit this process's Triton/CUDA state.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_compile_entry, *zip(*tasks), [with_ptx] * len(tasks), chunksize=4))


def _check_launchable(entry: dict) -> None:
    """Refuse a variant the C++ launcher cannot launch as it stands: scratch memory to
    allocate, a cluster, a cooperative or programmatic-dependent launch."""
    needs = [what for what, bad in (("global scratch memory", entry["global_scratch_size"]),
                                    ("profile scratch memory", entry["profile_scratch_size"]),
                                    ("more than one CTA", entry["num_ctas"] != 1),
                                    ("a cluster", entry["cluster_dims"] != [1, 1, 1]),
                                    ("a cooperative launch", entry["cooperative"]),
                                    ("a programmatic dependent launch", entry["pdl"])) if bad]
    if needs:
        raise ValueError(f"{entry['key']} (sm_{entry['arch']}) needs {', '.join(needs)}, which "
                         "csrc/cuda/triton_launch.cpp does not provide")


def _c_string(data: bytes, width: int = 96) -> str:
    """``data`` as adjacent C string literals of hex escapes (compiles much faster than an
    initialiser list of integers)."""
    lines = []
    for i in range(0, len(data), width):
        lines.append('"' + "".join(f"\\x{b:02x}" for b in data[i:i + width]) + '"')
    return "\n    ".join(lines) if lines else '""'


def render_cpp(table: list[dict], triton_version: str | None, missing_reason: str | None = None) -> str:
    """The generated C++ source defining ``wiola::triton::table()``."""
    from .aot import DEFAULT_NUM_STAGES

    lines = ["// Generated by wiola_kernels/triton/cubin_table.py: do not edit.",
             '#include "wiola/triton_table.h"', "", "namespace wiola::triton {", "namespace {"]
    for i, e in enumerate(table):
        kinds = ", ".join(f"{{ParamKind::k{p['kind'].capitalize()}, {p['arg']}}}" for p in e["params"])
        lines.append(f"constexpr Param kParams{i}[] = {{{kinds or '{ParamKind::kPtr, -1}'}}};")
        lines.append(f"constexpr char kCubin{i}[] =\n    {_c_string(e['cubin'])};")
    lines.append("constexpr Variant kVariants[] = {")
    for i, e in enumerate(table):
        lines.append(
            f'    {{"{e["key"]}", "{e["kernel"]}", "{e["function"]}", {e["arch"]}, '
            f"kCubin{i}, sizeof(kCubin{i}) - 1, {e['num_warps']}, "
            f"{e['num_ctas']}, {e['shared']}, kParams{i}, {len(e['params'])}, {e['scratch_pointers']}, "
            f"{e['global_scratch_size']}, {e['profile_scratch_size']}, {int(e['cooperative'])}}},")
    if not table:
        lines.append('    {"", "", "", 0, nullptr, 0, 0, 0, 0, nullptr, 0, 0, 0, 0, 0},')
    lines.append("};")
    lines.append("}  // namespace")
    lines.append("")
    lines.append("const Table& table() {")
    version = f'"{triton_version}"' if triton_version else "nullptr"
    reason = json.dumps(missing_reason) if missing_reason else "nullptr"
    lines.append(f"  static const Table t{{kVariants, {len(table)}, {version}, {reason}, {DEFAULT_NUM_STAGES}}};")
    lines.append("  return t;")
    lines.append("}")
    lines.append("}  // namespace wiola::triton")
    return "\n".join(lines) + "\n"


def write(out_dir: str, archs: list[int], *, modules=MODULES, with_ptx: bool = False,
          missing_reason: str | None = None, jobs: int | None = None) -> list[dict]:
    """Write the generated C++ source and JSON manifest (and PTX files) to ``out_dir``; an
    empty table naming ``missing_reason`` when that is given. Returns the entries."""
    os.makedirs(out_dir, exist_ok=True)
    version = None
    table = []
    if missing_reason is None:
        import triton

        version = triton.__version__
        table = entries(archs, modules, with_ptx, jobs)
    _write_if_changed(os.path.join(out_dir, GENERATED_CPP), render_cpp(table, version, missing_reason))
    manifest = {"triton_version": version, "archs": archs, "missing_reason": missing_reason,
                "entries": [{k: v for k, v in e.items() if k not in ("cubin", "ptx")} for e in table]}
    _write_if_changed(os.path.join(out_dir, GENERATED_JSON), json.dumps(manifest, indent=1) + "\n")
    if with_ptx:
        os.makedirs(os.path.join(out_dir, "ptx"), exist_ok=True)
        for i, e in enumerate(table):
            with open(os.path.join(out_dir, "ptx", f"{i}.ptx"), "w") as f:
                f.write(e["ptx"])
    return table


def _write_if_changed(path: str, text: str) -> None:
    """Leave an unchanged file untouched, so that the build does not recompile it."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m wiola_kernels.triton.cubin_table", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for wiola_cubin_table.cpp/.json")
    parser.add_argument("--arch", default=None,
                        help="architectures, e.g. 90,80 (default: WIOLA_CUDA_ARCH, TORCH_CUDA_ARCH_LIST, else 90,80)")
    parser.add_argument("--ptx", action="store_true", help="also write each entry's PTX to OUT/ptx/")
    parser.add_argument("--empty", metavar="REASON", help="write an empty table naming REASON")
    parser.add_argument("--jobs", type=int, default=None, help="compiling processes (default: the CPU count)")
    args = parser.parse_args(argv)
    spec = args.arch or os.environ.get("WIOLA_CUDA_ARCH") or os.environ.get("TORCH_CUDA_ARCH_LIST")
    table = write(args.out, parse_archs(spec), with_ptx=args.ptx, missing_reason=args.empty, jobs=args.jobs)
    print(f"cubin table: {len(table)} variants written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
