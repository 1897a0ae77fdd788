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

import pytest
import torch

from wiola_kernels.triton import aot, cubin_table

ROOT = Path(__file__).resolve().parent.parent
CXX = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")
ARCHS = (90, 80)

#: Triton's element type names (the C++ dtype_name) of the dtypes the kernels take.
TRITON_DTYPE = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}
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
    cmd = [CXX, "-std=c++20", "-O1", "-Wall", "-Werror", f"-I{ROOT / 'csrc' / 'include'}",
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


def _line(launch: aot.Launch, arch: int, sms: int) -> str:
    """The driver's input line for a launch (glu's or rms_norm's kernels)."""
    c = launch.constexprs
    dtype = TRITON_DTYPE[launch.args[0].dtype]
    ptrs = [a.data_ptr() for a in launch.args if isinstance(a, aot.DevicePointer)]
    ints = [a for a in launch.args if not isinstance(a, aot.DevicePointer)]
    if launch.name == "_glu_fwd_kernel":
        return " ".join(map(str, ["glu_fwd", dtype, c["ACT"], *ints, *ptrs, sms, arch]))
    if launch.name == "_glu_bwd_kernel":
        return " ".join(map(str, ["glu_bwd", dtype, c["ACT"], *ints, *ptrs, sms, arch]))
    typed = [f"{TRITON_DTYPE[a.dtype]}:{a.data_ptr()}" for a in launch.args if isinstance(a, aot.DevicePointer)]
    flag = {True: 1, False: 0}
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


def _launches(arch: int):
    gpu = cubin_table._gpu(arch)
    for mod_name in cubin_table.MODULES:
        mod = __import__(f"wiola_kernels.triton.{mod_name}", fromlist=["aot_launches"])
        for launch in aot.module_launches(mod, gpu):
            yield gpu, launch


def _parse(out: str) -> dict:
    key, index, *rest = out.split(" ")
    fields = dict(f.split("=", 1) for f in rest)
    sizes = [int(s) for s in fields["sizes"].split(",")] if fields.get("sizes") else []
    return {"key": key, "index": int(index), "grid": int(fields["grid"]), "warps": int(fields["warps"]),
            "sizes": sizes, "error": fields.get("error")}


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


def _cpp_triton_ops() -> set[str]:
    """The ops csrc/python_module.cpp lists as launched from C++ (TRITON_CUDA_OPS)."""
    src = (ROOT / "csrc" / "python_module.cpp").read_text()
    m = re.search(r'"TRITON_CUDA_OPS"\) = std::vector<std::string>\{([^}]*)\}', src)
    assert m, "TRITON_CUDA_OPS not found in csrc/python_module.cpp"
    return set(re.findall(r'"(\w+)"', m.group(1)))


def test_no_wired_op_registers_a_python_cuda_kernel():
    """Each op the C++ launches has a C++ CUDA kernel (TORCH_LIBRARY_IMPL(wiola, CUDA)) and no
    ``register_kernel("<op>", "CUDA", ...)`` in the Python sources; its Python launcher is
    only the fallback op ``_triton_<op>``."""
    wired = _cpp_triton_ops()
    assert {"glu", "glu_backward", "rms_norm", "rms_norm_backward", "add_rms_norm", "add_rms_norm_backward"} <= wired
    impl = {}
    for path in (ROOT / "csrc" / "cuda").glob("triton_*_binding.cpp"):
        text = path.read_text()
        block = re.search(r"TORCH_LIBRARY_IMPL\(wiola, CUDA, m\) \{(.*?)\n\}", text, re.S)
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
    return out


def _tensors(out) -> list:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if t is not None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", ["glu", "rms_norm", "add_rms_norm", "rms_norm_backward", "rms_norm_backward no shift",
                                "add_rms_norm_backward"])
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
