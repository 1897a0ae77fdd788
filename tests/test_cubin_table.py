"""The cubin table and its C++ launcher, checked without a GPU.

The table (``wiola_kernels/triton/cubin_table.py``) is generated for sm_90 and sm_80 with the
installed Triton, and compiled with the torch-free C++ side (csrc/include/wiola/triton_table.h,
triton_glu.h) into a test driver (csrc/tests/triton_table_test.cpp). For every launch the
Python launchers make at the GPU test and bench shapes (``aot_launches``):

* the C++ chooser builds the same variant id as Triton's own binder
  (:func:`wiola_kernels.triton.aot.variant_id`), the same grid and warps, and finds the entry;
* the arguments the C++ packs for that entry are the kernel's PTX ``.entry`` parameters:
  count, order and byte sizes, the trailing scratch pointers included (a planted
  mismatch, one argument dropped, fails the same comparison);
* every entry's metadata is launchable: num_warps, ``.reqntid``, shared memory within the
  architecture's limit, one CTA, no scratch memory, no cooperative launch.

The runtime table (``wiola_kernels/triton/runtime_table.py``: what the Python launcher compiles
for a call the table lacks, registered for C++ to launch next time), through the extension:

* at shapes and dtypes outside the table, the key the Python launcher registers under (Triton's
  binder on its real arguments) is the key C++ builds for the same arguments;
* a kernel compiled for sm_90 and registered under that key is found by the next lookup and
  packs as its PTX says; for a variant the static generator also compiled, what the runtime
  table stores is the static entry; a key Triton's specialisation does not give is refused;
* ``run`` registers each pending miss once and warns once per kernel when it cannot; the C++
  table is safe under concurrent registration (the driver's ``--runtime`` checks).

Also: Triton's specialisation rules at edge values (1, multiples of 16, past int32,
misaligned pointers), the table without Triton (the fallback build), and that no op the C++
launches registers a Python function for its CUDA dispatch key.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels.dtypes import compute_dtype
from wiola_kernels.triton import aot, cubin_table

ROOT = Path(__file__).resolve().parent.parent
CXX = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")
ARCHS = (90, 80)

#: Triton's element type names (the C++ dtype_name) of the dtypes the kernels take.
TRITON_DTYPE = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.int64: "i64", torch.int32: "i32"}
#: PTX parameter types by size in bytes.
PTX_SIZES = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2, "u32": 4, "s32": 4, "b32": 4,
             "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "python"), env.get("PYTHONPATH", "")])
    env["WIOLA_DISABLE_EXTENSION"] = "1"
    return env


def _generate(out: Path, *extra: str) -> None:
    cmd = [sys.executable, "-W", "ignore", "-m", "wiola_kernels.triton.cubin_table", "--out", str(out),
           "--arch", ",".join(map(str, ARCHS)), *extra]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _build(table_dir: Path) -> Path:
    exe = table_dir / "triton_table_test"
    cmd = [CXX, "-std=c++20", "-O1", "-Wall", "-Werror", "-pthread", f"-I{ROOT / 'csrc' / 'include'}",
           str(ROOT / "csrc" / "tests" / "triton_table_test.cpp"), str(table_dir / cubin_table.GENERATED_CPP),
           "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """``(directory, manifest, driver)`` of a table generated with the installed Triton."""
    out = tmp_path_factory.mktemp("cubin_table")
    _generate(out, "--ptx")
    manifest = json.loads((out / cubin_table.GENERATED_JSON).read_text())
    return out, manifest, _build(out)


def _run(exe: Path, lines: list[str], *flags: str) -> list[str]:
    proc = subprocess.run([str(exe), *flags], input="\n".join(lines) + "\n", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _ptx_entry(ptx: str) -> tuple[str, list[int], int | None]:
    """``(name, parameter sizes in bytes, reqntid)`` of the PTX's one ``.entry``."""
    m = re.search(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S)
    assert m, "no .entry in the PTX"
    sizes = []
    for param in filter(None, (p.strip() for p in m.group(2).split(","))):
        ty = re.match(r"\.param\s+\.(\w+)", param)
        assert ty and ty.group(1) in PTX_SIZES, f"unexpected parameter {param!r}"
        sizes.append(PTX_SIZES[ty.group(1)])
    req = re.search(r"\.reqntid\s+(\d+)", ptx[m.end():])
    return m.group(1), sizes, int(req.group(1)) if req else None


def params_mismatch(packed: list[int], ptx: list[int]) -> str | None:
    """Why the packed argument sizes are not the ``.entry`` parameters (None when they are)."""
    if len(packed) != len(ptx):
        return f"{len(packed)} arguments packed, the kernel takes {len(ptx)}"
    for i, (p, q) in enumerate(zip(packed, ptx)):
        if p != q:
            return f"argument {i}: {p} bytes packed, the kernel takes {q}"
    return None


def _is_pointer(a) -> bool:
    return isinstance(a, (aot.DevicePointer, torch.Tensor))


def _line(launch: aot.Launch, arch: int, sms: int) -> str:
    """The driver's input line for a launch (glu's, rms_norm's, srpe's or linear_cross_entropy's
    kernels; pointers as DevicePointer stand-ins or the tensors a launcher passed)."""
    c = launch.constexprs
    dtype = TRITON_DTYPE[launch.args[0].dtype]
    ptrs = [a.data_ptr() for a in launch.args if _is_pointer(a)]
    ints = [a for a in launch.args if not _is_pointer(a)]
    if launch.name.startswith("_lce_"):
        return _lce_line(launch, arch, sms, ints)
    if launch.name == "_glu_fwd_kernel":
        return " ".join(map(str, ["glu_fwd", dtype, c["ACT"], *ints, *ptrs, sms, arch]))
    if launch.name == "_glu_bwd_kernel":
        return " ".join(map(str, ["glu_bwd", dtype, c["ACT"], *ints, *ptrs, sms, arch]))
    typed = [f"{TRITON_DTYPE[a.dtype]}:{a.data_ptr()}" for a in launch.args if _is_pointer(a)]
    flag = {True: 1, False: 0}
    if launch.name == "_srpe_kernel":
        bt, t, h, h_kv, half, *strides = ints
        return " ".join(map(str, ["srpe", dtype, flag[c["TRANSPOSE"]], bt // t, t, h, h_kv, half, *strides, sms, arch,
                                  *ptrs]))
    if launch.name == "_rms_norm_fwd_kernel":
        rows, d, eps = ints
        return " ".join(map(str, ["rms_fwd", rows, d, repr(eps), flag[c["IS_FP64"]], flag[c["HAS_SHIFT"]],
                                  flag[c["HF_ORDER"]], flag[c["HAS_RESIDUAL"]], sms, arch, *typed]))
    if launch.name == "_rms_norm_bwd_kernel":
        rows, d = ints
        return " ".join(map(str, ["rms_bwd", rows, d, flag[c["HAS_SHIFT"]], flag[c["HAS_GRAD_S"]], sms, arch,
                                  *typed]))
    assert launch.name == "_norm_partials_sum_kernel", launch.name
    programs, d = ints
    return " ".join(map(str, ["rms_sum", programs, d, flag[c["HAS_SHIFT"]], arch, *typed]))


def _lce_line(launch: aot.Launch, arch: int, sms: int, ints: list) -> str:
    """The driver's line for a launch of linear_cross_entropy's kernels (wiola/triton_plan.h)."""
    c = launch.constexprs
    typed = [f"{TRITON_DTYPE[a.dtype]}:{a.data_ptr()}" for a in launch.args if _is_pointer(a)]
    if launch.name == "_lce_logits_kernel":
        row0, rows, V, d, s_hn, s_hd, s_wv, s_wd, _, _, _ = ints
        words = ["lce_logits", row0, rows, V, d, s_hn, s_hd, s_wv, s_wd, int(c["HAS_CAP"]), int(c["STORE_LOGITS"]),
                 int(c["WANT_SUM"]), sms, arch]
    elif launch.name == "_lce_rows_kernel":
        row0, rows, splits, V, ignore, _, _ = ints
        words = ["lce_rows", row0, rows, splits, V, ignore, arch]
    elif launch.name == "_lce_dlogits_kernel":
        row0, rows, V, _, _, ignore, _, _ = ints
        words = ["lce_dlogits", row0, rows, V, ignore, int(c["HAS_CAP"]), int(c["HAS_ROW_GRAD"]), arch]
    elif launch.name == "_lce_dw_kernel":
        row0, rows, V, d, _, s_hn, s_hd = ints
        words = ["lce_dw", row0, rows, V, d, s_hn, s_hd, int(c["FIRST"]), arch]
    else:
        assert launch.name == "_lce_reduce_kernel", launch.name
        n, ignore = ints
        words = ["lce_reduce", n, ignore, int(c["MEAN"]), int(c["HAS_ITEMS"]), int(c["BACKWARD"]), arch]
    return " ".join(map(str, words + typed))


def _launches(arch: int):
    gpu = cubin_table._gpu(arch)
    for mod_name in cubin_table.MODULES:
        mod = __import__(f"wiola_kernels.triton.{mod_name}", fromlist=["aot_launches"])
        for launch in aot.module_launches(mod, gpu):
            yield gpu, launch


def _parse(out: str) -> dict:
    """The driver's answer: ``grid`` counts every program (a 2-D grid's x·y, as ``aot.Launch.grid``),
    ``grid_xy`` is the grid as launched."""
    key, index, *rest = out.split(" ")
    fields = dict(f.split("=", 1) for f in rest)
    sizes = [int(s) for s in fields["sizes"].split(",")] if fields.get("sizes") else []
    grid_xy = (int(fields["grid"]), int(fields.get("grid_y", 1)))
    return {"key": key, "index": int(index), "grid": grid_xy[0] * grid_xy[1], "grid_xy": grid_xy,
            "warps": int(fields["warps"]), "sizes": sizes, "error": fields.get("error"),
            "runtime": fields.get("runtime") == "1"}


def _choices(exe: Path, *flags: str):
    """``(launch, gpu, driver's answer)`` for every test and bench launch on both archs."""
    cases = [(gpu, launch) for arch in ARCHS for gpu, launch in _launches(arch)]
    outs = _run(exe, [_line(launch, gpu.capability, gpu.sms) for gpu, launch in cases], *flags)
    assert len(outs) == len(cases)
    return [(launch, gpu, _parse(o)) for (gpu, launch), o in zip(cases, outs)]


def test_table_generates_for_both_archs(table):
    _, manifest, exe = table
    import triton

    assert manifest["triton_version"] == triton.__version__
    assert manifest["missing_reason"] is None
    entries = manifest["entries"]
    for arch in ARCHS:
        keys = {aot.variant_id(launch, gpu) for gpu, launch in _launches(arch)}
        assert {e["key"] for e in entries if e["arch"] == arch} == keys
    head, *rows = _run(exe, ["table"])
    assert head == f"triton {triton.__version__} stages {aot.DEFAULT_NUM_STAGES} entries {len(entries)}"
    for row, e in zip(rows, entries, strict=True):
        i, arch, key, warps, shared, size = row.split(" ")
        assert (int(arch), key, int(warps), int(shared)) == (e["arch"], e["key"], e["num_warps"], e["shared"])
        assert int(size) > 0


def test_cpp_chooses_the_python_launchers_variant(table):
    """C++ config and specialisation = the Python launcher's, for every test and bench launch."""
    _, manifest, exe = table
    for launch, gpu, got in _choices(exe):
        want = aot.variant_id(launch, gpu)
        assert got["key"] == want, launch.case
        assert got["index"] >= 0, f"{want} not in the table"
        assert manifest["entries"][got["index"]]["key"] == want and manifest["entries"][got["index"]]["arch"] == \
            gpu.capability
        assert (got["grid"], got["warps"]) == (launch.grid, launch.num_warps), launch.case


def test_packing_matches_every_entrys_ptx(table):
    out, manifest, exe = table
    seen = set()
    for launch, gpu, got in _choices(exe):
        entry = manifest["entries"][got["index"]]
        assert got["error"] is None, got["error"]
        name, sizes, _ = _ptx_entry((out / "ptx" / f"{got['index']}.ptx").read_text())
        assert name == entry["function"]
        assert params_mismatch(got["sizes"], sizes) is None, (entry["key"], params_mismatch(got["sizes"], sizes))
        # The trailing pointers are the scratch pointers this Triton appends (null).
        assert entry["scratch_pointers"] == cubin_table.trailing_scratch_pointers(manifest["triton_version"])
        assert sizes[len(sizes) - entry["scratch_pointers"]:] == [8] * entry["scratch_pointers"]
        seen.add(got["index"])
    assert seen == set(range(len(manifest["entries"]))), "entries no test or bench launch reaches"


def test_planted_mismatch_fails_the_ptx_check(table):
    """One argument dropped from the packing: the comparison above must see it for every entry."""
    out, manifest, exe = table
    for _, _, got in _choices(exe, "--drop-last"):
        _, sizes, _ = _ptx_entry((out / "ptx" / f"{got['index']}.ptx").read_text())
        assert params_mismatch(got["sizes"], sizes) is not None


def test_every_entry_is_launchable(table):
    out, manifest, _ = table
    limits = {gpu.capability: gpu.smem_per_block for gpu in aot.GPUS.values()}
    for i, e in enumerate(manifest["entries"]):
        _, sizes, reqntid = _ptx_entry((out / "ptx" / f"{i}.ptx").read_text())
        assert e["num_warps"] in (1, 2, 4, 8, 16, 32), e["key"]
        assert reqntid in (None, 32 * e["num_warps"]), e["key"]
        assert 0 <= e["shared"] <= limits[e["arch"]], e["key"]
        assert e["num_ctas"] == 1 and e["cluster_dims"] == [1, 1, 1] and not e["cooperative"], e["key"]
        assert not e["pdl"], e["key"]
        assert e["global_scratch_size"] == 0 and e["profile_scratch_size"] == 0, e["key"]
        assert len(sizes) == len(e["params"]) + e["scratch_pointers"], e["key"]
        assert [p["kind"] for p in e["params"]] == [
            "PTR" if p["type"].startswith("*") else cubin_table._KINDS[p["type"]] for p in e["params"]]


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **constexprs)`` records the call."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid[0], args, kw))


@pytest.mark.parametrize("rows, d, shift, grad_s", [
    (37, 192, True, False), (37, 192, False, True), (1, 3, True, True), (5, 33, True, False), (2, 8193, True, True),
])
def test_cpp_partials_layout_is_the_python_launchers(table, monkeypatch, rows, d, shift, grad_s):
    """The backward's one partials buffer as norm_bwd allocates and slices it (its kernels
    recorded, not run): the C++ layout's size, δ's offset and total, and the second launch
    reading those partials (its grid = the first's programs)."""
    from wiola_kernels.triton import rms_norm as rn

    _, _, exe = table
    calls = []
    monkeypatch.setattr(rn, "_rms_norm_bwd_kernel", _Recorder(calls))
    monkeypatch.setattr(rn, "_norm_partials_sum_kernel", _Recorder(calls))
    monkeypatch.setattr(rn, "sm_count", lambda device: aot.GPUS["sm_90"].sms)
    x = torch.ones(rows, d, dtype=torch.bfloat16)
    w, s = torch.ones(d, dtype=torch.bfloat16), torch.ones(d, dtype=torch.float16) if shift else None
    rn.norm_bwd(x, x if grad_s else None, x, w, s, torch.ones(rows))
    (programs, bwd, _), (sum_grid, sums, _) = calls
    dw_partial, ds_partial = bwd[7], bwd[8]
    (out,) = _run(exe, [f"rms_layout {programs} {d} {int(shift)}"])
    size, ds_offset, total = map(int, out.split())
    assert dw_partial.untyped_storage().nbytes() == total * 4 and dw_partial.dtype == torch.float32
    assert (dw_partial.storage_offset(), dw_partial.numel()) == (0, size)
    assert ds_partial.untyped_storage().data_ptr() == dw_partial.untyped_storage().data_ptr()
    assert ds_partial.storage_offset() == ds_offset and ds_offset % 4 == 0
    assert sums[0] is dw_partial and sums[1] is ds_partial and sums[4:] == (programs, d)
    assert sums[2].dtype == w.dtype and (sums[3].dtype == s.dtype if shift else sums[3] is sums[2])
    # The second launch's config, as the C++ builds it.
    typed = " ".join(f"{TRITON_DTYPE[t.dtype]}:{4096 * (i + 1)}" for i, t in enumerate(sums[:4]))
    (out,) = _run(exe, [f"rms_sum {programs} {d} {int(shift)} 90 {typed}"])
    got = _parse(out)
    assert (got["grid"], got["warps"]) == (sum_grid, 4)


@pytest.mark.parametrize("rows, n, stride, offset", [
    (1, 16, 16, 0),            # rows = 1: a constant; n, stride divisible by 16
    (17, 3, 3, 12),            # nothing divisible; a misaligned b
    (2, 4096, 2 ** 31, 0),     # a stride past int32: i64
    (3, 32, 2 ** 31 - 1, 4),   # the largest i32
    (1, 1, 1, 0),              # everything 1
])
def test_specialisation_rules_match_tritons_binder(table, rows, n, stride, offset):
    """Triton's own binder (through aot.variant_id) and the C++ key agree at edge values."""
    from wiola_kernels.triton import glu as tk

    _, _, exe = table
    P = aot.DevicePointer
    for dtype in (torch.bfloat16, torch.float32):
        esize = torch.empty((), dtype=dtype).element_size()
        cfg = tk._launch_config(rows, n, esize, 2, aot.GPUS["sm_90"].sms)
        launch = aot.Launch(tk._glu_fwd_kernel, (P(dtype), P(dtype, offset), P(dtype), rows, n, stride, n),
                            dict(ROWS_PER_STEP=cfg.rows_per_step, BLOCK_N=cfg.block_n, ACT=1, IS_FP64=False),
                            cfg.num_warps, aot.DEFAULT_NUM_STAGES, cfg.programs, "edge")
        gpu = aot.GPUS["sm_90"]
        (out,) = _run(exe, [_line(launch, 90, gpu.sms)])
        assert _parse(out)["key"] == aot.variant_id(launch, gpu)


def test_table_without_triton_is_empty_and_finds_nothing(tmp_path):
    """The fallback build's table: no entries, the reason named, and every launch unmatched
    (the op then runs its Python Triton launcher)."""
    _generate(tmp_path, "--empty", "no Triton at build time")
    manifest = json.loads((tmp_path / cubin_table.GENERATED_JSON).read_text())
    assert manifest["entries"] == [] and manifest["missing_reason"] == "no Triton at build time"
    exe = _build(tmp_path)
    head, = _run(exe, ["table"])
    assert head.endswith("entries 0")
    (out,) = _run(exe, ["glu_fwd bf16 0 4 1024 2048 2048 256 2304 256 132 90"])
    assert _parse(out)["index"] == -1


def test_setup_writes_an_empty_table_when_told(tmp_path, monkeypatch):
    """setup.py's CUDA build with WIOLA_NO_CUBIN_TABLE=1: an empty table naming why, which the
    driver compiles against."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("wiola_setup", ROOT / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    monkeypatch.setattr(setup, "HERE", str(tmp_path))
    rel = setup.write_cubin_table({"WIOLA_NO_CUBIN_TABLE": "1"})
    text = (tmp_path / rel).read_text()
    assert "WIOLA_NO_CUBIN_TABLE=1" in text
    exe = _build((tmp_path / rel).parent)
    assert _run(exe, ["table"])[0].endswith("entries 0")
    cmd = setup.cubin_table_command("OUT", {"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"})
    assert cmd[-2:] == ["--arch", "8.0;9.0+PTX"] and cubin_table.parse_archs(cmd[-1]) == [80, 90]


def test_unlaunchable_metadata_is_refused():
    entry = {"key": "k", "arch": 90, "global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1,
             "cluster_dims": [1, 1, 1], "cooperative": False, "pdl": False}
    cubin_table._check_launchable(entry)
    for field, value in (("global_scratch_size", 64), ("num_ctas", 2), ("cluster_dims", [2, 1, 1]),
                         ("cooperative", True), ("pdl", True)):
        with pytest.raises(ValueError, match="does not provide"):
            cubin_table._check_launchable(dict(entry, **{field: value}))


def test_parse_archs_and_scratch_pointers():
    assert cubin_table.parse_archs(None) == [90, 80]
    assert cubin_table.parse_archs("90,80") == [90, 80]
    assert cubin_table.parse_archs("sm_90a;8.0") == [90, 80]
    with pytest.raises(ValueError, match="not a CUDA architecture"):
        cubin_table.parse_archs("ninety")
    assert [cubin_table.trailing_scratch_pointers(v) for v in ("3.2.0", "3.3.1", "3.6.0", "3.9.0")] == [0, 1, 2, 2]


def _module_ops(attr: str) -> set[str]:
    """The ops csrc/python_module.cpp lists in ``attr`` for the CUDA build."""
    src = (ROOT / "csrc" / "python_module.cpp").read_text()
    m = re.search(rf'"{attr}"\) = std::vector<std::string>\{{([^}}]*)\}}', src)
    assert m, f"{attr} not found in csrc/python_module.cpp"
    return set(re.findall(r'"(\w+)"', m.group(1)))


def _cpp_triton_ops() -> set[str]:
    """The ops csrc/python_module.cpp lists as launched from C++ (TRITON_CUDA_OPS)."""
    return _module_ops("TRITON_CUDA_OPS")


def _cpp_composite_ops() -> set[str]:
    """The ops whose CUDA kernel is a C++ composite (COMPOSITE_CUDA_OPS)."""
    return _module_ops("COMPOSITE_CUDA_OPS")


def test_no_wired_op_registers_a_python_cuda_kernel():
    """Each op the C++ launches, or composes, has a C++ CUDA kernel (``TORCH_LIBRARY_IMPL(wiola,
    CUDA)``, or ``WIOLA_CUDA_KERNELS_IMPL`` of a CUDA kernel's binding) and no
    ``register_kernel("<op>", "CUDA", ...)`` in the Python sources; its Python kernel is only
    the fallback op ``_triton_<op>``."""
    wired = _cpp_triton_ops() | _cpp_composite_ops()
    assert {"glu", "glu_backward", "rms_norm", "rms_norm_backward", "add_rms_norm", "add_rms_norm_backward", "srpe",
            "srpe_backward", "gcla_attention", "gcla_attention_backward", "linear_cross_entropy",
            "linear_cross_entropy_backward"} <= wired
    impl = {}
    for path in (ROOT / "csrc" / "cuda").glob("*_binding.cpp"):
        text = path.read_text()
        block = re.search(r"(?:TORCH_LIBRARY_IMPL\(wiola, CUDA, m\)|WIOLA_CUDA_KERNELS_IMPL\(m\)) \{(.*?)\n\}", text, re.S)
        if block:
            impl.update({name: path.name for name in re.findall(r'm\.impl\("(\w+)"', block.group(1))})
    assert wired <= set(impl), f"no C++ CUDA kernel for {wired - set(impl)}"
    python_cuda = []
    for path in (ROOT / "wiola_kernels").rglob("*.py"):
        for m in re.finditer(r'register_kernel\(\s*"(\w+)"\s*,\s*"CUDA"', path.read_text()):
            python_cuda.append((m.group(1), path.relative_to(ROOT)))
    assert not [(op, p) for op, p in python_cuda if op in wired], python_cuda
    # The one way they register a Python CUDA kernel: the fallback, through register_triton_cuda.
    for op in wired:
        assert re.search(rf'register_triton_cuda\("{op}"', "".join(
            p.read_text() for p in (ROOT / "wiola_kernels" / "ops").glob("*.py"))), op


def test_fallback_op_schemas_parse_and_mirror_the_ops():
    """Each ``wiola::_triton_<op>`` (declared with the op's schemas, csrc/cpu/<op>.cpp) parses,
    and takes and returns what ``wiola::<op>`` does: the C++ kernel hands it the op's own arguments."""
    src = "".join(p.read_text() for p in [ROOT / "csrc" / "wiola_ops.cpp", *sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))])
    defs = {}
    for m in re.finditer(r'm\.def\(((?:\s*"(?:[^"\\]|\\.)*")+)\)', src):
        schema = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1))).replace('\\"', '"')
        parsed = torch._C.parse_schema(f"wiola::{schema}")
        defs[parsed.name.split("::")[1]] = parsed
    for op in _cpp_triton_ops():
        fallback = defs[f"_triton_{op}"]
        assert [(a.name, str(a.type)) for a in fallback.arguments] == [(a.name, str(a.type))
                                                                      for a in defs[op].arguments], op
        assert [str(r.type) for r in fallback.returns] == [str(r.type) for r in defs[op].returns], op
    # The composites' schemas are shared with their emulation (wiola/cuda_schemas.h): read them
    # from the dispatcher.
    if not wk.ops.have_registered_ops():
        pytest.skip("the extension is not loaded")
    for op in _cpp_composite_ops():
        op_schema = getattr(torch.ops.wiola, op).default._schema
        fallback = getattr(torch.ops.wiola, f"_triton_{op}").default._schema
        assert [(a.name, str(a.type)) for a in fallback.arguments] == [(a.name, str(a.type))
                                                                      for a in op_schema.arguments], op
        assert [str(r.type) for r in fallback.returns] == [str(r.type) for r in op_schema.returns], op


# ---- the runtime table: what the Python launcher compiles for a call the table lacks --------------

def _extension_hooks():
    """The extension's runtime-table hooks, its keys named with this Triton's num_stages where the
    build has no table (as the Python launcher reports them on the first miss)."""
    from wiola_kernels import _extension

    module = _extension._load()[0]
    if module is None or not hasattr(module, "_triton_plan"):
        pytest.skip("needs the C++ extension with the runtime table's hooks")
    if module._triton_num_stages() == 0:
        module._triton_report_num_stages(aot.DEFAULT_NUM_STAGES)
    return module


def _outside_cases() -> dict:
    """Calls of the ops' Python launchers (what ``wiola::_triton_<op>`` runs) at shapes and dtypes
    the test and bench lists do not hold: odd widths, bf16 x with float32 γ/δ, a misaligned half."""
    from wiola_kernels import dispatch
    from wiola_kernels.ops import add_rms_norm as oa
    from wiola_kernels.ops import glu as og
    from wiola_kernels.ops import linear_cross_entropy as ol
    from wiola_kernels.ops import rms_norm as orn

    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    u, gu = t(5, 666), t(5, 333)                      # packed, n = 333: b is 666 bytes in
    a, b, ga = t(3, 40, dtype=torch.float32), t(3, 40, dtype=torch.float32), t(3, 40, dtype=torch.float32)
    h, gh = t(2, 2002, dtype=torch.float16), t(2, 1001, dtype=torch.float16)  # packed, n odd
    x, r, gy = t(7, 777), t(7, 777), t(7, 777)
    w32, s32, rstd = t(777, dtype=torch.float32), t(777, dtype=torch.float32), torch.ones(7)
    xf, wb = t(1, 5000, dtype=torch.float32), t(5000)
    qv, kv = t(2, 37, 6, 96).transpose(1, 2), t(2, 37, 2, 96).transpose(1, 2)
    q4, k4, freq = t(1, 4, 9, 40, dtype=torch.float32), t(1, 4, 9, 40, dtype=torch.float32), torch.rand(20, generator=g)
    q16, k16 = t(3, 2, 5, 256, dtype=torch.float16), t(3, 1, 5, 256, dtype=torch.float16)
    pos = torch.arange(15, dtype=torch.int32).view(3, 5)
    srpe_fwd, srpe_bwd = dispatch.kernels("srpe", "triton").forward, dispatch.kernels("srpe", "triton").backward

    def lce(n, d, V, dtype, backward=False, **kw):
        """linear_cross_entropy's Python launcher on meta tensors (nothing computed: the launches are
        recorded, the GEMMs shape-only), forward with gradients unless "none", or the backward."""
        m = dict(device="meta")
        h, W, y = torch.empty(n, d, dtype=dtype, **m), torch.empty(V, d, dtype=dtype, **m), torch.zeros(n, dtype=torch.int64, **m)
        opts = [kw.get("ignore_index", -100), kw.get("reduction", "mean"), kw.get("label_smoothing", 0.0),
                kw.get("softcap"), kw.get("z_loss", 0.0), kw.get("num_items")]
        if not backward:
            want = (False, False) if opts[1] == "none" or kw.get("loss_only") else (True, True)
            return lambda: ol._triton_forward(h, W, y, *opts, want)
        g = torch.empty((n,) if opts[1] == "none" else (), dtype=compute_dtype(dtype), **m)
        lse = torch.empty(n, dtype=compute_dtype(dtype), **m)
        gh, gw = torch.empty(n, d, dtype=dtype, **m), torch.empty(V, d, dtype=dtype, **m)
        return lambda: ol._triton_backward(g, h, W, y, lse, opts[5], gh, gw, *opts[:5], kw.get("precomputed", False))

    f32, bf16 = torch.float32, torch.bfloat16
    items32 = torch.ones((), dtype=torch.int32, device="meta")
    return {
        "linear_cross_entropy fp32 V=1001 d=100 (d and V tails), mean": lce(37, 100, 1001, f32),
        "linear_cross_entropy bf16 V=333 d=40, softcap, smoothing, sum": lce(21, 40, 333, bf16, reduction="sum",
                                                                           softcap=3.0, label_smoothing=0.1),
        "linear_cross_entropy fp32 loss alone, none, V=50000": lce(3, 24, 50000, f32, reduction="none"),
        "linear_cross_entropy bf16 loss alone, mean, int32 num_items": lce(5, 24, 999, bf16, loss_only=True,
                                                                          num_items=items32),
        "linear_cross_entropy bf16 V=128256: chunks of 256, a shorter last": lce(600, 72, 128256, bf16,
                                                                                 label_smoothing=0.2),
        "linear_cross_entropy float64 V=77, d=20, softcap": lce(9, 20, 77, torch.float64, softcap=2.0),
        "linear_cross_entropy_backward bf16 none: recomputed, row gradients": lce(37, 40, 1001, bf16, True,
                                                                                 reduction="none", softcap=3.0),
        "linear_cross_entropy_backward fp32 mean precomputed, int32 num_items": lce(7, 48, 300, f32, True,
                                                                                   num_items=items32,
                                                                                   precomputed=True),

        "glu packed bf16 n=333": lambda: og._triton_forward(u, None, "silu"),
        "glu_backward packed bf16 n=333": lambda: og._triton_backward(gu, u, None, "silu"),
        "glu fp32 separate gelu_tanh": lambda: og._triton_forward(a, b, "gelu_tanh"),
        "glu_backward fp32 separate": lambda: og._triton_backward(ga, a, b, "gelu_tanh"),
        "glu_backward packed fp16 n=1001": lambda: og._triton_backward(gh, h, None, "silu"),
        "rms_norm bf16 x, fp32 weight and shift": lambda: orn._triton_forward(x, w32, s32, 1e-6, False),
        "rms_norm hf_order, no shift": lambda: orn._triton_forward(x, w32, None, 1e-6, True),
        "rms_norm fp32 x, bf16 weight, one wide row": lambda: orn._triton_forward(xf, wb, None, 1e-6, False),
        "rms_norm_backward bf16 x, fp32 weight and shift": lambda: orn._triton_backward(gy, x, w32, s32, rstd),
        "add_rms_norm bf16 x, fp32 weight": lambda: oa._triton_forward(x, r, w32, None, 1e-6, False),
        "add_rms_norm_backward with grad_s": lambda: oa._triton_backward(gy, gy, x, w32, s32, rstd),
        "srpe bf16 (B, T, H, d_h) views, d_h = 96": lambda: srpe_fwd(qv, kv, torch.arange(37)),
        "srpe_backward fp32, given inv_freq and scale": lambda: srpe_bwd(q4, k4, torch.arange(9), 10000.0, 8.0, 0.1,
                                                                          0.01, freq, 0.5),
        "srpe fp16 d_h = 256, int32 (B, T) positions": lambda: srpe_fwd(q16, k16, pos),
    }


def _recorded(call, setattr_) -> list[aot.Launch]:
    """The launches ``call`` makes through ``runtime_table.run`` (recorded, not run), with their
    real tensors, on an H200 (its SM count)."""
    from wiola_kernels.triton import glu as tg
    from wiola_kernels.triton import linear_cross_entropy as tl
    from wiola_kernels.triton import rms_norm as tr
    from wiola_kernels.triton import srpe as ts

    launches = []

    def record(kernel, grid, *args, num_warps, num_stages=None, **constexprs):
        xy = grid if isinstance(grid, tuple) else (grid, 1)
        launches.append(aot.Launch(kernel, args, constexprs, num_warps,
                                   aot.DEFAULT_NUM_STAGES if num_stages is None else num_stages, xy[0] * xy[-1],
                                   "runtime", case_grids={"runtime": xy}))

    for mod in (tg, tr, ts, tl):
        setattr_(mod, "run", record)
        setattr_(mod, "sm_count", lambda device: aot.GPUS["sm_90"].sms)
    call()
    return launches


def _table_cases() -> dict:
    """Calls of linear_cross_entropy's Python launcher (on meta tensors) at the GPU test and bench
    shapes with the options the tests and the bench pass: every variant they launch is in the
    table (aot_launches enumerates them by hand, which this checks against the launcher)."""
    from wiola_kernels import shapes
    from wiola_kernels.ops import linear_cross_entropy as ol

    def lce(n, d, V, dtype, reduction="mean", eps=0.0, cap=None, num_items=None):
        m = dict(device="meta")
        h, W, y = torch.empty(n, d, dtype=dtype, **m), torch.empty(V, d, dtype=dtype, **m), torch.zeros(n, dtype=torch.int64, **m)
        acc = compute_dtype(dtype)
        opts = (-100, reduction, eps, cap, 0.01, num_items)
        g = torch.empty((n,) if reduction == "none" else (), dtype=acc, **m)
        lse, gh, gw = torch.empty(n, dtype=acc, **m), torch.empty(n, d, dtype=dtype, **m), torch.empty(V, d, dtype=dtype, **m)

        def call():
            want = (False, False) if reduction == "none" else (True, True)
            ol._triton_forward(h, W, y, *opts, want)
            if reduction != "none":
                ol._triton_forward(h, W, y, *opts, (False, False))  # without gradients (inference)
            ol._triton_backward(g, h, W, y, lse, num_items, gh, gw, *opts[:5], reduction != "none")
        return call

    items = torch.ones((), dtype=torch.float64, device="meta")  # the op layer's number (or CPU tensor)
    cases = {}
    for n, d, V, dtype in shapes.LCE_GPU_TESTS:  # tests/test_linear_cross_entropy.py::test_triton_on_gpu
        cases[f"linear_cross_entropy test {n, d, V} {dtype} all"] = lce(n, d, V, dtype, eps=0.2, cap=2.0,
                                                                       num_items=items)
        cases[f"linear_cross_entropy test {n, d, V} {dtype} all_none"] = lce(n, d, V, dtype, "none", 0.2, 2.0)
    for size, (n, d, V) in shapes.LCE_BENCH.items():  # the bench's call: every option at its default
        for dtype in (torch.bfloat16, torch.float32):
            cases[f"linear_cross_entropy bench {size} {dtype}"] = lce(n, d, V, dtype)
            cases[f"linear_cross_entropy bench {size} {dtype} sum"] = lce(n, d, V, dtype, "sum")
    return cases


def _lce_plan_matches(cpp, launches, sms: int) -> None:
    """The chunking and workspace the C++ plans (wiola/triton_linear_cross_entropy.h ``plan``, through
    the driver's lce_plan) are the Python launcher's: the rows of each logits launch, its vocabulary
    split, and the offsets of dz, the statistics and the ∂W accumulator from the logits buffer
    (of the first pass over the rows the launches make)."""
    starts = [i for i, l in enumerate(launches) if l.name == "_lce_logits_kernel" and l.args[5] == 0]
    launches = launches[:starts[1]] if len(starts) > 1 else launches
    logits = [l for l in launches if l.name == "_lce_logits_kernel"]
    chunked = bool(logits[0].constexprs["STORE_LOGITS"])
    n = sum(l.args[6] for l in logits) if chunked else logits[0].args[6]
    V, d, dtype = logits[0].args[7], logits[0].args[8], logits[0].args[0].dtype
    dws = [l for l in launches if l.name == "_lce_dw_kernel"]
    out = cpp._triton_plan(f"lce_plan {n} {V} {d} {TRITON_DTYPE[dtype]} {sms} {int(chunked)} {int(bool(dws))} 0")
    chunk, rows_max, last_rows, chunks, splits, per, last_splits, last_per, dz_off, stats_off, dw_off, total = \
        map(int, out.split())
    want_rows = [rows_max] * (chunks - 1) + [last_rows]
    assert [l.args[6] for l in logits] == want_rows
    for i, l in enumerate(logits):
        full = l.args[6] == rows_max
        assert (l.case_grids["runtime"][1], l.args[15]) == ((splits, per) if full else (last_splits, last_per))
        assert l.args[5] == i * rows_max  # row0
    if not chunked:
        return
    base = logits[0].args[3].data_ptr()  # the logits buffer: the workspace's start
    dl = next(l for l in launches if l.name == "_lce_dlogits_kernel")
    assert dl.args[1].data_ptr() - base == dz_off and logits[0].args[4].data_ptr() - base == stats_off
    assert logits[0].args[4].untyped_storage().nbytes() == total
    if dws:
        assert dws[0].args[2].data_ptr() - base == dw_off
    else:
        assert dw_off == -1


@pytest.mark.parametrize("case", [*_outside_cases(), *_table_cases()])
def test_runtime_keys_match_cpp_outside_the_table(table, monkeypatch, case):
    """For calls whose variants the table lacks, the key the Python launcher registers under
    (Triton's binder on the launcher's real arguments, runtime_table.launch_key) is the key C++
    builds for the same arguments (the binding's launch builders and key(), through the extension),
    with the same grid and warps; linear_cross_entropy's chunking and workspace are planned alike.
    At the test and bench shapes (the table's cases), every launch's key is in the table."""
    from wiola_kernels.triton import runtime_table

    _, manifest, _ = table
    cpp = _extension_hooks()
    gpu = aot.GPUS["sm_90"]
    static = {e["key"] for e in manifest["entries"] if e["arch"] == gpu.capability}
    outside = case in _outside_cases()
    launches = _recorded((_outside_cases() if outside else _table_cases())[case], monkeypatch.setattr)
    assert launches
    assert launches[0].name != "_norm_partials_sum_kernel"
    keys = []
    for launch in launches:
        _, _, key = runtime_table.launch_key(launch.kernel, launch.args, launch.constexprs, launch.num_warps,
                                             gpu.capability, launch.num_stages)
        got = _parse(cpp._triton_plan(_line(launch, gpu.capability, gpu.sms)))
        assert got["key"] == key, case
        assert (got["grid"], got["warps"]) == (launch.grid, launch.num_warps), case
        assert got["grid_xy"] == launch.case_grids["runtime"], case
        keys.append(key)
    if launches[0].name.startswith("_lce_") and any(l.name == "_lce_logits_kernel" for l in launches):
        _lce_plan_matches(cpp, launches, gpu.sms)
    if not outside:
        assert not [k for k in keys if k not in static], case
        return
    # The call's first kernel is outside the table (its sums kernel may share a variant with one in it).
    assert keys[0] not in static, f"{case}: {keys[0]} is in the table; pick a shape outside it"


# Runs without TRITON_INTERPRET (compiling needs the real JITFunctions) and with the extension:
# compiles kernels for sm_90 as the Python launcher's JIT would, registers them as run() does,
# and reports what C++ then finds and packs.
_REGISTER_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_cubin_table as T
from wiola_kernels import _extension
from wiola_kernels.triton import aot, runtime_table

cpp = T._extension_hooks()
gpu = aot.GPUS["sm_90"]
launches = {}
for _, launch in T._launches(gpu.capability):   # one static-table variant of each kernel
    launches.setdefault("static " + launch.name, launch)
for case in ("glu packed bf16 n=333", "rms_norm_backward bf16 x, fp32 weight and shift",
             "srpe bf16 (B, T, H, d_h) views, d_h = 96"):
    for i, launch in enumerate(T._recorded(T._outside_cases()[case], setattr)):
        launches[f"{case} #{i}"] = launch
out = {}
for name, launch in launches.items():
    line = T._line(launch, gpu.capability, gpu.sms)
    before = T._parse(cpp._triton_plan(line))
    compiled = aot.compile_launch(launch, gpu)
    args = (launch.kernel, compiled, launch.args, launch.constexprs, launch.num_warps)
    wrong = before["key"].replace("/16", "", 1) if "/16" in before["key"] else before["key"].replace("]", ",x]")
    stages = dict(num_stages=launch.num_stages)
    refused = runtime_table.register(*args, wrong, gpu.capability, **stages)
    reason = runtime_table.register(*args, before["key"], gpu.capability, **stages)
    again = runtime_table.register(*args, before["key"], gpu.capability, **stages)
    after = T._parse(cpp._triton_plan(line))
    _, sizes, _ = T._ptx_entry(compiled.asm["ptx"])
    out[name] = {"before": before, "after": after, "refused": refused, "wrong": wrong, "reason": reason,
                 "again": again, "ptx_sizes": sizes, "cubin_size": len(compiled.asm["cubin"]),
                 "function": compiled.metadata.name}
# The path a C++ miss takes: pending misses set as the C++ lookup sets them, then the Python
# launcher's run() (its kernel launch standing in: it returns the compiled kernel).
class Launched:
    def __init__(self, launch, compiled):
        self.fn, self.compiled = launch.kernel.fn, compiled
    def __getitem__(self, grid):
        return lambda *args, **kw: self.compiled
(launch,) = T._recorded(T._outside_cases()["glu fp32 separate gelu_tanh"], setattr)
line = T._line(launch, gpu.capability, gpu.sms)
miss = T._parse(cpp._triton_plan(line))
kernel = Launched(launch, aot.compile_launch(launch, gpu))
runtime_table._pending = cpp._triton_pending  # the CUDA build's choice (this build has no CUDA kernels)
cpp._triton_set_pending([(launch.name, miss["key"], gpu.capability, -1)])
runtime_table.run(kernel, launch.grid, *launch.args, num_warps=launch.num_warps, **launch.constexprs)
count = len(cpp._triton_registered())
runtime_table.run(kernel, launch.grid, *launch.args, num_warps=launch.num_warps, **launch.constexprs)
cpp._triton_set_pending([])
out["run"] = {"before": miss, "after": T._parse(cpp._triton_plan(line)),
              "registered_twice": len(cpp._triton_registered()) != count}
print(json.dumps({"launches": out, "registered": cpp._triton_registered()}))
"""


@pytest.fixture(scope="module")
def registered(table):
    """The probe's answer (see _REGISTER_PROBE)."""
    env = {k: v for k, v in _env().items() if k != "WIOLA_DISABLE_EXTENSION"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _REGISTER_PROBE, str(ROOT / "tests")], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0 and "needs the C++ extension" in proc.stderr:
        pytest.skip("needs the C++ extension with the runtime table's hooks")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_registered_variant_is_found_and_packs_as_the_static_generator(table, registered):
    """A kernel registered at run time under the key C++ built is found by the next lookup (where
    the static table does not have it first), its packed arguments are its PTX ``.entry``
    parameters, and what the runtime table stores for a variant the static generator also
    compiled is the static entry: function, warps, shared memory, parameter layout, scratch
    pointers. A key Triton's specialisation does not give is refused, and registering twice
    keeps the first. A miss left pending as the C++ lookup leaves it reaches the same
    registration through runtime_table.run and the extension's pending list, once."""
    _, manifest, _ = table
    static = {(e["arch"], e["key"]): e for e in manifest["entries"]}
    stored = {(r["arch"], r["key"]): r for r in registered["registered"]}
    assert len(stored) == len(registered["registered"])
    run = registered["launches"].pop("run")  # a pending miss through runtime_table.run
    assert not run["before"]["runtime"] and run["after"]["runtime"] and not run["registered_twice"]
    assert run["after"]["key"] == run["before"]["key"] and run["after"]["error"] is None
    kernels = set()
    for name, got in registered["launches"].items():
        before, after = got["before"], got["after"]
        assert not before["runtime"], name
        assert got["reason"] is None and got["again"] is None, (name, got["reason"])
        assert got["refused"] is not None and "specialises it as" in got["refused"], name
        assert (90, got["wrong"]) not in stored, name
        if before["index"] < 0:  # the extension's own table lacks it: now the runtime table has it
            assert after["runtime"] and after["error"] is None, name
            assert params_mismatch(after["sizes"], got["ptx_sizes"]) is None, (name, after["sizes"], got["ptx_sizes"])
        r = stored[(90, before["key"])]
        assert (r["function"], r["cubin_size"]) == (got["function"], got["cubin_size"]), name
        if name.startswith("static "):
            e = static[(90, before["key"])]
            assert r["function"] == e["function"] and r["num_warps"] == e["num_warps"], name
            assert (r["shared"], r["num_ctas"], r["scratch_pointers"]) == (e["shared"], e["num_ctas"],
                                                                           e["scratch_pointers"]), name
            assert [tuple(p) for p in r["params"]] == [(p["kind"], p["arg"]) for p in e["params"]], name
            kernels.add(r["kernel"])
        else:
            assert before["key"] not in {k for _, k in static} or name.endswith("#1"), name
    assert kernels == {"_glu_fwd_kernel", "_glu_bwd_kernel", "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel",
                       "_norm_partials_sum_kernel", "_srpe_kernel", "_lce_logits_kernel", "_lce_rows_kernel",
                       "_lce_dlogits_kernel", "_lce_dw_kernel", "_lce_reduce_kernel"}


def test_runtime_table_is_thread_safe_and_refuses_what_it_cannot_launch(table):
    """The driver's --runtime checks: concurrent registrations and lookups, each key stored once
    with its own cubin and packed as its layout says; scratch memory or clusters refused; the
    pending misses scoped to one op call (a nested call keeps its own)."""
    _, _, exe = table
    assert _run(exe, [], "--runtime") == ["ok"]


class _Compiled:
    """Stands in for the kernel Triton's JIT returns."""


class _FakeKernel:
    """``kernel[grid](...)`` returning a fixed compiled kernel; named as a real kernel."""

    def __init__(self, name):
        self.fn = SimpleNamespace(__name__=name)
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        return lambda *args, **kw: self.compiled


def test_run_registers_each_pending_miss_once_and_warns_once_when_it_cannot(monkeypatch):
    """runtime_table.run: a launch whose kernel the C++ missed on this call is registered under
    the key C++ built (once: a key tried is not tried again); a kernel C++ did not miss is not;
    a registration refused warns once per kernel and does not fail the launch."""
    import warnings

    from wiola_kernels.triton import runtime_table

    calls = []
    answers = {"K1": None, "K2": "Triton 9 specialises it as other", "K3": "again"}
    monkeypatch.setattr(runtime_table, "_done", set())
    monkeypatch.setattr(runtime_table, "_warned", set())
    monkeypatch.setattr(runtime_table, "register", lambda kernel, compiled, args, constexprs, num_warps, key, arch,
                        device: calls.append((kernel.fn.__name__, compiled, key, arch, device)) or answers[key])
    misses = []
    monkeypatch.setattr(runtime_table, "_pending_misses", lambda: misses)
    fwd, bwd = _FakeKernel("_glu_fwd_kernel"), _FakeKernel("_glu_bwd_kernel")
    assert runtime_table.run(fwd, 4, 1, 2, num_warps=4, BLOCK=8) is fwd.compiled  # nothing pending
    misses[:] = [("_glu_bwd_kernel", "K1", 90, 0)]
    runtime_table.run(fwd, 4, num_warps=4)                                          # another kernel's miss
    assert calls == []
    runtime_table.run(bwd, 4, num_warps=4)
    runtime_table.run(bwd, 4, num_warps=4)                                          # tried already
    assert calls == [("_glu_bwd_kernel", bwd.compiled, "K1", 90, 0)]
    misses[:] = [("_glu_fwd_kernel", "K2", 80, 1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime_table.run(fwd, 4, num_warps=4)
        misses[:] = [("_glu_fwd_kernel", "K3", 80, 1)]
        runtime_table.run(fwd, 4, num_warps=4)
    assert [c[2] for c in calls] == ["K1", "K2", "K3"]
    assert len(caught) == 1 and "cannot be launched from C++" in str(caught[0].message)
    assert "Triton 9 specialises it as other" in str(caught[0].message)


# ---- on a GPU: the C++ launches themselves (skipped without one) -------------------------------

def _gpu_cases():
    """``{op: (C++ call, Python launcher's call)}``: one call of each op launched from C++, at a
    test shape the table holds (γ and δ in x's dtype, as the tests, the bench and the models pass
    them), on CUDA."""
    import wiola_kernels as wk

    g = torch.Generator(device="cuda").manual_seed(0)

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    u, x, r, gy, gs = t(129, 2000), t(37, 192), t(37, 192), t(37, 192), t(37, 192)
    w, s = t(192), t(192)
    ops = torch.ops.wiola
    _, rstd = ops._triton_rms_norm(x, w, s, 1e-6, False)

    def python(call):
        def run():
            with wk.use_backend("triton"):
                return call()
        return run

    cases = {
        "glu": lambda: wk.glu(u, activation="silu"),
        "rms_norm": lambda: wk.rms_norm(x, w, s),
        "add_rms_norm": lambda: wk.add_rms_norm(x, r, w, s),
    }
    out = {op: (call, python(call)) for op, call in cases.items()}
    out["rms_norm_backward"] = (lambda: ops.rms_norm_backward(gy, x, w, s, rstd),
                                lambda: ops._triton_rms_norm_backward(gy, x, w, s, rstd))
    # Without δ: the bench shape, whose Hugging Face variant (no δ) the table holds.
    xb, gyb, wb = t(256, 1024), t(256, 1024), t(1024)
    _, rstd_b = ops._triton_rms_norm(xb, wb, None, 1e-6, True)
    out["rms_norm_backward no shift"] = (lambda: ops.rms_norm_backward(gyb, xb, wb, None, rstd_b),
                                         lambda: ops._triton_rms_norm_backward(gyb, xb, wb, None, rstd_b))
    out["add_rms_norm_backward"] = (lambda: ops.add_rms_norm_backward(gy, gs, x, w, s, rstd),
                                    lambda: ops._triton_add_rms_norm_backward(gy, gs, x, w, s, rstd))
    # srpe at a test shape, (B, H, T, d_h)-contiguous with (B, T) positions, as the table holds it.
    q, k = t(3, 16, 257, 64), t(3, 4, 257, 64)
    pos = torch.arange(3 * 257, device="cuda").view(3, 257)
    params = (10000.0, 8.0, 0.1, 0.01, None, 1.0)
    out["srpe"] = (lambda: ops.srpe(q, k, pos, *params), lambda: ops._triton_srpe(q, k, pos, *params))
    out["srpe_backward"] = (lambda: ops.srpe_backward(q, k, pos, *params),
                            lambda: ops._triton_srpe_backward(q, k, pos, *params))
    # linear_cross_entropy at its test shape with every option (as test_triton_on_gpu): the forward
    # with gradients (chunk loop, GEMMs, the mean over num_items), and "none"'s recomputing backward.
    hl, Wl = t(37, 64), t(1000, 64)
    yl = torch.randint(0, 1000, (37,), generator=g, device="cuda")
    yl[::5] = -100
    items = torch.tensor(33.0, dtype=torch.float64, device="cuda")
    lce = (hl, Wl, yl, -100, "mean", 0.2, 2.0, 0.01, items, [True, True])
    out["linear_cross_entropy"] = (lambda: ops.linear_cross_entropy(*lce), lambda: ops._triton_linear_cross_entropy(*lce))
    _, lse_l, _, _ = ops._triton_linear_cross_entropy(hl, Wl, yl, -100, "none", 0.2, 2.0, 0.01, None, [False, False])
    gl = t(37, dtype=torch.float32)

    def lce_backward(op):
        def call():
            gh, gw = torch.empty_like(hl), torch.empty_like(Wl)
            op(gl, hl, Wl, yl, lse_l, None, gh, gw, -100, "none", 0.2, 2.0, 0.01, False)
            return gh, gw
        return call

    out["linear_cross_entropy_backward"] = (lce_backward(ops.linear_cross_entropy_backward),
                                            lce_backward(ops._triton_linear_cross_entropy_backward))
    return out


def _tensors(out) -> list:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if t is not None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", ["glu", "rms_norm", "add_rms_norm", "rms_norm_backward", "rms_norm_backward no shift",
                                "add_rms_norm_backward", "srpe", "srpe_backward", "linear_cross_entropy",
                                "linear_cross_entropy_backward"])
def test_gpu_launch_from_the_table_equals_the_python_launcher(op):
    """The C++ launches give the Python Triton launcher's result bit for bit (same cubins, same
    arguments; the backward's two launches and their partials buffer), without the fallback
    warning; then a CUDA graph captures and replays them."""
    import warnings

    from wiola_kernels import _extension

    info = _extension.cubin_table()
    if info is None or not info["entries"]:
        pytest.skip(f"this build launches no cubin table: {info}")
    call, python_call = _gpu_cases()[op]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the fallback's warning would fail here
        got = call()
    want = python_call()
    assert len(_tensors(got)) == len(_tensors(want))
    for a, b in zip(_tensors(got), _tensors(want)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(_tensors(captured), _tensors(want)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_runtime_table_launches_shapes_outside_the_table_from_cpp(monkeypatch):
    """Calls outside the table (bf16 x with float32 γ/δ at d = 777, a packed glu at n = 333, srpe
    on transposed views with given frequencies, linear_cross_entropy at d = 100, V = 1001):
    the first runs the Python launcher, which registers its variants without a warning; the next
    launches from C++ (the Python launcher is not called) with its result bit for bit; a CUDA
    graph then captures the C++ launches and replays them."""
    import warnings

    from wiola_kernels import _extension
    from wiola_kernels.triton import glu as tg
    from wiola_kernels.triton import linear_cross_entropy as tl
    from wiola_kernels.triton import rms_norm as tr
    from wiola_kernels.triton import srpe as ts

    if _extension.cubin_table() is None:
        pytest.skip("this build has no C++ CUDA kernels")
    g = torch.Generator(device="cuda").manual_seed(0)
    x, gy = (torch.randn(7, 777, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    w, s = (torch.randn(777, generator=g, device="cuda") for _ in range(2))
    u = torch.randn(5, 666, generator=g, device="cuda").to(torch.bfloat16)
    # (B, T, H, d_h) views with positions shared by the batch, d_h = 96, given frequencies.
    qv = torch.randn(2, 37, 6, 96, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    kv = torch.randn(2, 37, 2, 96, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    tpos = torch.arange(37, device="cuda")
    params = (10000.0, 8.0, 0.1, 0.01, torch.rand(48, generator=g, device="cuda"), 0.5)
    # linear_cross_entropy in float32 with d and V tails (d = 100, V = 1001), a sum with gradients.
    hx, Wx = torch.randn(7, 100, generator=g, device="cuda"), torch.randn(1001, 100, generator=g, device="cuda")
    lce = (hx, Wx, torch.randint(0, 1001, (7,), generator=g, device="cuda"), -100, "sum", 0.0, None, 0.0, None,
           [True, True])
    ops = torch.ops.wiola
    _, rstd = ops._triton_rms_norm(x, w, s, 1e-6, False)
    cases = {
        "rms_norm": (lambda: ops.rms_norm(x, w, s, 1e-6, False), lambda: ops._triton_rms_norm(x, w, s, 1e-6, False)),
        "rms_norm_backward": (lambda: ops.rms_norm_backward(gy, x, w, s, rstd),
                              lambda: ops._triton_rms_norm_backward(gy, x, w, s, rstd)),
        "glu": (lambda: ops.glu(u, None, "silu"), lambda: ops._triton_glu(u, None, "silu")),
        "srpe": (lambda: ops.srpe(qv, kv, tpos, *params), lambda: ops._triton_srpe(qv, kv, tpos, *params)),
        "linear_cross_entropy": (lambda: ops.linear_cross_entropy(*lce), lambda: ops._triton_linear_cross_entropy(*lce)),
    }
    for op, (call, python_call) in cases.items():
        registered = _extension.cubin_table()["registered"]
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            call()  # compiles and registers (a build without the table: the second call registers)
            call()
        assert _extension.cubin_table()["registered"] > registered, op
        python_runs = []
        for mod in (tg, tr, ts, tl):
            monkeypatch.setattr(mod, "run", lambda *a, **kw: python_runs.append(a[0]))
        got = call()
        monkeypatch.undo()
        assert python_runs == [], op
        want = python_call()
        for a, b in zip(_tensors(got), _tensors(want), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), op
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(_tensors(captured), _tensors(want), strict=True):
            assert torch.equal(a, b), op
