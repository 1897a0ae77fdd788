"""Every Triton kernel compiled ahead of time for sm_90 and sm_80 with the launch-time
specialisation its launchers produce (test and bench shapes), and every CUDA kernel compiled
by nvcc, read back from the cubins: a kernel the interpreter accepts but the GPU compiler
rejects, a register spill, shared memory over the device limit, or a finding of the
compiled-code lint (32-bit ``index × stride`` address products, narrow stores where the
layout allows 128-bit ones) fails.

The compiles run in one subprocess without TRITON_INTERPRET (``gpu-report --json``);
Triton's cache and the cubin cache make later runs fast. ``WIOLA_AOT_ARCHS=sm_90`` checks
one architecture only (CI's device-versions leg: the other is compiled there by
scripts/triton_warmup.py, which fails on a compile error, without the per-kernel analysis)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wiola_kernels import shapes
from wiola_kernels.devtools import compiled_lint, cubin, cuda_report
from wiola_kernels.triton import aot

ROOT = Path(__file__).resolve().parent.parent
HAVE_NVCC = cubin.tool("nvcc") is not None
ARCHS = tuple(a for a in os.environ.get("WIOLA_AOT_ARCHS", "").split(",") if a) or tuple(aot.GPUS)
VARIANTS = [(arch, key) for arch in ARCHS for key in aot.launches(aot.GPUS[arch])]
# Findings in CUDA kernels, kept visible rather than silently allowed: (arch, kernel prefix)
# -> spill bytes ptxas reports / lint findings (their text starts so). An entry fails the test
# when the finding changes or when it is gone (then delete the entry).
KNOWN_CUDA_SPILLS: dict[tuple[str, str], int] = {}  # none today
KNOWN_CUDA_LINT: dict[tuple[str, str], tuple[str, ...]] = {}  # none today


@pytest.fixture(scope="session")
def report(tmp_path_factory):
    """Every gpu-report record, by (source, arch, kernel), from one subprocess."""
    out = tmp_path_factory.mktemp("gpu_report") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "python"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "wiola_kernels", "gpu-report", "--json", str(out), "--arch", ",".join(ARCHS)]
    if not HAVE_NVCC:
        cmd.append("--no-cuda")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.exists(), f"gpu-report wrote nothing:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {(r["source"], r["arch"], r["kernel"]): r for r in json.loads(out.read_text())}


def _check_record(r: dict, allowed_spill: int = 0, allowed_lint: tuple[str, ...] = ()) -> None:
    assert "error" not in r, r.get("error")
    gpu = aot.GPUS[r["arch"]]
    assert r["spill_bytes"] == allowed_spill, f"{r['spill_bytes']} bytes of register spills"
    assert r["shared_bytes"] <= gpu.smem_per_block, f"{r['shared_bytes']} B shared > {gpu.smem_per_block}"
    assert r["blocks_per_sm"] >= 1
    assert r["registers"] > 0 and r["global_access_bits"] in (8, 16, 32, 64, 128)
    assert len(r["lint"]) == len(allowed_lint) and all(f.startswith(a) for f, a in zip(r["lint"], allowed_lint)), \
        "compiled-code lint:\n" + "\n".join(r["lint"])


@pytest.mark.parametrize("arch, key", VARIANTS, ids=[f"{a}-{k}" for a, k in VARIANTS])
def test_triton_kernel_compiles_without_spills_or_lint(report, arch, key):
    _check_record(report[("triton", arch, key)])


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found")
def test_cuda_kernels_compile_without_spills_or_lint(report):
    cuda = [r for r in report.values() if r["source"] == "cuda"]
    for cu in cuda_report.cuda_sources():
        for arch in ARCHS:
            assert any(r["kernel"].startswith(f"{cu.stem}::") and r["arch"] == arch for r in cuda), (cu.stem, arch)
    for r in cuda:
        spill = [v for (arch, prefix), v in KNOWN_CUDA_SPILLS.items()
                 if r["arch"] == arch and r["kernel"].startswith(prefix)]
        lint = [v for (arch, prefix), v in KNOWN_CUDA_LINT.items() if r["arch"] == arch and r["kernel"] == prefix]
        _check_record(r, spill[0] if spill else 0, lint[0] if lint else ())


def test_gcla_triton_kernels_use_tensor_cores(report):
    """The bf16/fp16 GCLA kernels run their products on the tensor cores (HGMMA on sm_90,
    HMMA on sm_80), at every shape compiled."""
    gcla = [r for r in report.values() if r["source"] == "triton" and r["kernel"].startswith("_gcla_")
            and re.search(r"\*(bf16|fp16)/16", r["kernel"])]
    assert gcla
    for r in gcla:
        assert r["tensor_core"], r["kernel"]


def test_memory_bound_triton_kernels_meet_the_h200_targets(report):
    """At the bench shapes (bf16) on sm_90: 128-bit accesses, ≥ 32 KB in flight per SM."""
    if "sm_90" not in ARCHS:
        pytest.skip("WIOLA_AOT_ARCHS leaves out sm_90")
    bench = [r for r in report.values() if r["source"] == "triton" and r["arch"] == "sm_90"
             and r["bytes_in_flight_per_sm"] is not None]
    assert {r["kernel"].split("[")[0] for r in bench} == {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel",
                                                            "_srpe_kernel", "_glu_fwd_kernel", "_glu_bwd_kernel"}
    for r in bench:
        assert r["global_access_bits"] == 128, r["kernel"]
        assert r["bytes_in_flight_per_sm"] >= cubin.LITTLE_LAW_TARGET_BYTES, r["kernel"]


#: ATM's CUDA kernels that meet the memory-bound targets (the rest are below them, listed
#: by gpu-report; move a kernel here when it is redesigned).
ATM_KERNELS_AT_TARGET = ("gather_average_kernel", "merge_backward_kernel", "unmerge_kernel",
                         "norms_and_dots_kernel", "unmerge_backward_kernel")


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found")
def test_memory_bound_atm_row_kernels_meet_the_h200_targets(report):
    """ATM's memory-bound kernels at the bench shape (bf16) on sm_90: 128-bit accesses in
    the main loop, ≥ 32 KB in flight per SM (16-byte chunks; several loaded before any is
    used: kRowChunks, norms_and_dots' 9 tokens, unmerge_backward's kUnmergeBatch)."""
    if "sm_90" not in ARCHS:
        pytest.skip("WIOLA_AOT_ARCHS leaves out sm_90")
    records = {r["kernel"]: r for r in report.values() if r["source"] == "cuda" and r["arch"] == "sm_90"
               and r["kernel"].startswith("atm::")}
    for name in ATM_KERNELS_AT_TARGET:
        r = records[f"atm::{name}<__nv_bfloat16>"]
        assert r["global_access_bits"] == 128, name
        assert r["bytes_in_flight_per_sm"] >= cubin.LITTLE_LAW_TARGET_BYTES, name


def test_every_triton_kernel_module_registers_its_launches():
    """A new kernel module must define aot_launches, and every *_kernel it defines must be
    among the compiled variants."""
    compiled = {key.split("[")[0] for _, key in VARIANTS}
    for path in sorted((ROOT / "wiola_kernels" / "triton").glob("*.py")):
        if path.stem in ("__init__", "aot"):
            continue
        mod = importlib.import_module(f"wiola_kernels.triton.{path.stem}")
        kernels = [name for name, v in vars(mod).items() if name.endswith("_kernel") and hasattr(v, "fn")]
        if kernels:
            assert hasattr(mod, "aot_launches"), f"{path.name} defines kernels but no aot_launches"
        for name in kernels:
            assert name in compiled, f"{path.name}: {name} is never compiled ahead of time"


def _parametrized(test_fn, argnames):
    marks = [m for m in getattr(test_fn, "pytestmark", []) if m.name == "parametrize"]
    return {m.args[0]: m.args[1] for m in marks if m.args[0] in argnames}


def test_gpu_tests_run_at_the_compiled_shapes():
    """The GPU tests of tests/test_rms_norm.py, tests/test_srpe.py, tests/test_gcla_attention.py,
    tests/test_glu.py, tests/test_add_rms_norm.py and tests/test_linear_cross_entropy.py take their shapes from
    wiola_kernels/shapes.py, which the AOT launch lists compile."""
    def load(name):
        spec = importlib.util.spec_from_file_location(f"_{name}_gpu_shapes", ROOT / "tests" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    p = _parametrized(load("test_rms_norm").test_rms_norm_triton_vs_float64, ("shape", "dtype"))
    assert tuple(p["shape"]) == shapes.RMS_NORM_GPU_TEST_SHAPES and tuple(p["dtype"]) == shapes.RMS_NORM_GPU_TEST_DTYPES
    assert {(s, d) for s in p["shape"] for d in p["dtype"]} <= set(shapes.RMS_NORM_GPU_TESTS)
    p = _parametrized(load("test_srpe").test_srpe_triton_vs_float64, ("b, h, h_kv, t, dh", "dtype"))
    assert tuple(p["b, h, h_kv, t, dh"]) == shapes.SRPE_GPU_TEST_SHAPES
    assert {(s, d) for s in p["b, h, h_kv, t, dh"] for d in p["dtype"]} <= set(shapes.SRPE_GPU_TESTS)
    p = _parametrized(load("test_gcla_attention").test_triton_gpu_vs_float64, ("dtype, B, H, H_kv, T, dh, mode, lens",))
    compiled = {(case[:6] + (case[6] is not None,), d) for case, dtypes in shapes.GCLA_GPU_TESTS for d in dtypes}
    assert {(tuple(c[1:7]) + (c[7] is not None,), c[0]) for c in p["dtype, B, H, H_kv, T, dh, mode, lens"]} == compiled
    p = _parametrized(load("test_add_rms_norm").test_add_rms_norm_triton_vs_float64, ("shape", "dtype"))
    assert tuple(p["shape"]) == shapes.ADD_RMS_NORM_GPU_TEST_SHAPES
    assert tuple(p["dtype"]) == shapes.ADD_RMS_NORM_GPU_TEST_DTYPES
    assert {(s, d) for s in p["shape"] for d in p["dtype"]} <= set(shapes.ADD_RMS_NORM_GPU_TESTS)
    p = _parametrized(load("test_glu").test_glu_triton_vs_float64, ("rows, n", "dtype", "packed"))
    assert tuple(p["rows, n"]) == shapes.GLU_GPU_TEST_SHAPES and tuple(p["dtype"]) == shapes.GLU_GPU_TEST_DTYPES
    assert {(r, n, pk, d) for r, n in p["rows, n"] for d in p["dtype"] for pk in p["packed"]} \
        <= set(shapes.GLU_GPU_TESTS)
    p = _parametrized(load("test_linear_cross_entropy").test_triton_on_gpu, ("n, d, V", "dtype"))
    assert tuple(p["n, d, V"]) == shapes.LCE_GPU_TEST_SHAPES and tuple(p["dtype"]) == shapes.LCE_GPU_TEST_DTYPES
    assert {(*s, d) for s in p["n, d, V"] for d in p["dtype"]} <= set(shapes.LCE_GPU_TESTS)


def test_specialisation_matches_the_jit():
    """Integer arguments: divisible by 16 → tt.divisibility, 1 → a constant; as Triton's
    own specialiser says (checked against native_specialize_impl, not our ids)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from wiola_kernels.triton import rms_norm

    gpu = aot.GPUS["sm_90"]
    for rows, d in ((1, 1024), (37, 192), (4096, 33)):
        launch = next(iter(rms_norm.aot_launches(gpu.sms)))
        first = len(launch.args) - 3  # (..., rows, d, eps): the first integer argument
        launch.args = launch.args[:first] + (rows, d, 1e-6)
        signature, constexprs, attrs, _ = aot.specialise(launch, gpu)
        for index, value in ((first, rows), (first + 1, d)):
            kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
            if kind == "constexpr":
                assert signature[list(signature)[index]] == "constexpr" and constexprs[(index,)] == value
            else:
                divisible = ["tt.divisibility", 16] in attrs.get((index,), [])
                assert divisible == (attr == "D")


def test_blocks_per_sm_follows_the_occupancy_rules():
    h200 = aot.GPUS["sm_90"]
    assert cubin.blocks_per_sm(h200, registers=32, threads=128, shared_bytes=0) == 16  # thread limit
    assert cubin.blocks_per_sm(h200, registers=32, threads=32, shared_bytes=0) == 32   # block limit
    assert cubin.blocks_per_sm(h200, registers=128, threads=256, shared_bytes=0) == 2  # registers
    assert cubin.blocks_per_sm(h200, registers=33, threads=256, shared_bytes=0) == 6   # 40 per thread
    assert cubin.blocks_per_sm(h200, registers=32, threads=128, shared_bytes=100 * 1024) == 2  # smem
    assert cubin.blocks_per_sm(h200, registers=32, threads=128, shared_bytes=228 * 1024) == 0
    assert cubin.occupancy(h200, registers=128, threads=256, shared_bytes=0) == (2, "registers")
    assert cubin.occupancy(h200, registers=32, threads=128, shared_bytes=100 * 1024) == (2, "shared memory")
    assert cubin.occupancy(h200, registers=32, threads=128, shared_bytes=0) == (16, "threads")


def test_sass_analysis_finds_the_main_loop():
    sass = [
        (0x00, "LDG.E", "R1, desc[UR4][R2.64]"),           # before the loop: ignored
        (0x10, "LDG.E.128", "R4, desc[UR4][R6.64]"),       # main loop body: 2 × 16 B
        (0x20, "LDG.E.128", "R8, desc[UR4][R6.64+0x800]"),
        (0x30, "HMMA.16816.F32", "R12, R4, R8, R12"),
        (0x40, "STG.E.64", "desc[UR4][R6.64], R12"),
        (0x50, "BRA", "0x10"),
        (0x60, "LDG.E", "R1, desc[UR4][R2.64]"),            # a small loop (one 4-byte load)
        (0x70, "BRA", "0x60"),
        (0x80, "BRA", "0x80"),                              # the trailing self-loop: not a loop
    ]
    got = cubin.analyse_sass(sass)
    assert got == {"tensor_core": True, "global_access_bits": 128, "load_bytes": 32, "async_load_bytes": 0,
                   "in_loop": True, "load_bits": 128, "store_bits": [64], "split_stores": []}
    no_loop = cubin.analyse_sass([(0x0, "LDG.E.U16", "R1, [R2.64]"), (0x10, "STG.E", "[R2.64], R1")])
    assert no_loop["global_access_bits"] == 32 and no_loop["load_bytes"] == 2 and not no_loop["tensor_core"]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found")
def test_gcla_s1_backward_shared_memory_leaves_eight_blocks_resident(report):
    """The S = 1 summary backward at the bench Λ': the context-slot sums live in registers and
    the block keeps only each row's coefficients in shared memory, so its shared memory does
    not grow with d_h (per-warp [Λ'][d_h] sums took 9.3 KB at d_h 128 and left 6 blocks per SM
    on sm_90) and ≥ 8 blocks are resident on sm_90 and sm_80."""
    rows = [r for r in report.values() if r["kernel"].startswith("gcla_attention::summary_backward_kernel<")]
    assert len(rows) == 6 * len(ARCHS)  # 3 dtypes x 2 head widths per architecture
    for r in rows:
        assert r["shared_bytes"] <= 5 * 1024 and r["blocks_per_sm"] >= 8, r

def test_sass_lint_finds_split_stores():
    """A thread's 8 or 16 contiguous bytes written as 16/32-bit pieces from one address
    (what NVVM made of the GCLA kernels' struct stores: 4 x STG.E.U16 for a lane's 4 bf16,
    4 x STG.E for 4 floats) is a finding; one wide store, strided stores, stores from
    different addresses and a lone 32-bit store are not."""
    sass = [
        (0x00, "STG.E.U16", "desc[UR6][R8.64], R3"),          # 4 x 16 bits at +0, +2, +4, +6: one run
        (0x10, "STG.E.U16", "desc[UR6][R8.64+0x2], R5"),
        (0x20, "FADD", "R1, R2, R3"),
        (0x30, "STG.E.U16", "desc[UR6][R8.64+0x4], R6"),
        (0x40, "STG.E.U16", "desc[UR6][R8.64+0x6], R7"),
        (0x50, "STG.E", "desc[UR6][R2.64], R19"),             # 32-bit stores 512 B apart: a strided loop
        (0x60, "STG.E", "desc[UR6][R2.64+0x200], R21"),
        (0x70, "STG.E", "desc[UR6][R4.64+-0x8], R1"),         # 4 x 32 bits from a negative offset
        (0x80, "STG.E", "desc[UR6][R4.64+-0x4], R1"),
        (0x90, "STG.E", "desc[UR6][R4.64], R1"),
        (0xa0, "STG.E", "desc[UR6][R4.64+0x4], R1"),
        (0xb0, "STG.E.128", "desc[UR6][R10.64], R12"),        # one vector store
        (0xc0, "STG.E", "desc[UR6][R14.64], R1"),             # two addresses
        (0xd0, "STG.E", "desc[UR6][R16.64+0x4], R1"),
    ]
    assert cubin.split_stores(sass) == [[0x00, 4, 16], [0x70, 4, 32]]
    findings = [str(f) for f in cubin.narrow_store_findings(cubin.analyse_sass(sass))]
    assert findings == ["SASS 0x0000: 4 stores of 16 bits to consecutive bytes of one address: one STG.E.64 when "
                        "aligned (a thread's elements stored as one vector, wiola/cuda_vector.cuh)",
                        "SASS 0x0070: 4 stores of 32 bits to consecutive bytes of one address: one STG.E.128 when "
                        "aligned (a thread's elements stored as one vector, wiola/cuda_vector.cuh)"]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found")
def test_every_cuda_launch_has_its_geometry():
    """Every kernel csrc/cuda/*.cu launches has a launch geometry (threads, grid, shared memory)
    from the launchers' own constexpr functions (csrc/tools/launch_geometry.cpp), at the bench
    shape; none is re-derived by the report."""
    launched = {m.group(1) for cu in cuda_report.cuda_sources()
                for m in re.finditer(r"\blaunch_kernel\(\s*(\w+)", cu.read_text())}
    B, T, d = shapes.ATM_BENCH["full"]
    geometry = cuda_report.launch_geometry(B, T, d, 8, shapes.GCLA_BENCH["L"])
    assert launched == {kernel for kernel, _ in geometry}
    assert all(g["threads"] > 0 and g["blocks"] > 0 and g["smem"] >= 0 for g in geometry.values())


def test_cuda_report_needs_a_checkout(monkeypatch):
    """From an installed wheel (no csrc/ next to the package) the CUDA half says so."""
    from wiola_kernels import devtools

    monkeypatch.setattr(devtools, "REPO", None)
    with pytest.raises(devtools.NoCheckout, match="source checkout"):
        cuda_report.cuda_sources()


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt not found")
def test_kernel_names_demangle():
    assert cuda_report.short_name("void wiola::atm::(anonymous namespace)::unmerge_kernel<float>"
                                  "(float const*, long const*, float*, long, long)") == \
        ("unmerge_kernel", "unmerge_kernel<float>")


def test_a_kernel_the_gpu_compiler_rejects_fails(tmp_path):
    """A ``break`` in a kernel loop: the interpreter runs it (plain Python), the GPU
    compiler rejects it (unsupported AST node). The AOT path must report the rejection:
    the harness can fail."""
    (tmp_path / "bad_kernel.py").write_text(
        "import triton, triton.language as tl\n"
        "@triton.jit\n"
        "def _copy_kernel(a_ptr, o_ptr, n, BLOCK: tl.constexpr):\n"
        "    i = tl.arange(0, BLOCK)\n"
        "    for start in range(0, n, BLOCK):\n"
        "        m = start + i < n\n"
        "        tl.store(o_ptr + start + i, tl.load(a_ptr + start + i, mask=m), mask=m)\n"
        "        if start > 1000000:\n"
        "            break\n")
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); import bad_kernel\n"
        "from wiola_kernels.triton import aot\n"
        "l = aot.Launch(bad_kernel._copy_kernel, (aot.DevicePointer(torch.float32),) * 2 + (100,), dict(BLOCK=16),"
        " 4, 3, 1, 'x')\n"
        "try:\n    aot.compile_launch(l, aot.GPUS['sm_90'])\nexcept Exception as e:\n"
        "    print('REJECTED', type(e).__name__); sys.exit(0)\nprint('ACCEPTED')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True)
    assert "REJECTED" in out.stdout, out.stdout + out.stderr[-2000:]
    if os.environ.get("TRITON_INTERPRET") == "1":  # ... while the interpreter runs it
        sys.path.insert(0, str(tmp_path))
        try:
            import bad_kernel

            a = torch.arange(100, dtype=torch.float32)
            o = torch.full((100,), float("nan"))
            bad_kernel._copy_kernel[(1,)](a, o, 100, BLOCK=16)
            assert torch.equal(o, a)
        finally:
            sys.path.remove(str(tmp_path))
            sys.modules.pop("bad_kernel", None)


_LINT_KERNEL = r"""
import triton, triton.language as tl

@triton.jit
def _rows_kernel(x_ptr, y_ptr, stride, n, BLOCK: tl.constexpr, MODE: tl.constexpr):
    r = tl.arange(0, BLOCK)
    cols = tl.arange(0, 16)
    if MODE == 0:    # rows from the program id, 32-bit row × stride: wraps past 2^31
        rows = tl.program_id(0) * BLOCK + r
        offs = rows[:, None] * stride + cols[None, :]
        tl.store(y_ptr + offs, tl.load(x_ptr + offs))
    elif MODE == 1:  # rows from a loop variable, likewise
        for r0 in range(0, n, BLOCK):
            offs = (r0 + r)[:, None] * stride + cols[None, :]
            tl.store(y_ptr + offs, tl.load(x_ptr + offs))
    elif MODE == 2:  # a 64-bit base at the block's first row, a 32-bit tile inside the block
        base = tl.program_id(0).to(tl.int64) * BLOCK * stride
        offs = r[:, None] * stride + cols[None, :]
        tl.store(y_ptr + base + offs, tl.load(x_ptr + base + offs))
    else:            # the same 16-byte tiles stored one element off 16-byte alignment
        offs = r[:, None] * 16 + cols[None, :]
        tl.store(y_ptr + 1 + offs, tl.load(x_ptr + offs))
"""

_LINT_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from lint_kernel import _rows_kernel
from wiola_kernels.devtools import compiled_lint
from wiola_kernels.triton import aot

out = {}
for mode in range(4):
    launch = aot.Launch(_rows_kernel, (aot.DevicePointer(torch.bfloat16),) * 2 + (4096, 1000), dict(BLOCK=64, MODE=mode),
                        1, 1, 1, "lint")
    c = aot.compile_launch(launch, aot.GPUS["sm_90"])
    out[mode] = [f.check for f in compiled_lint.i32_address_products(c.asm["ttir"])
                 + compiled_lint.narrow_stores(c.asm["ttgir"], c.asm["ptx"])]
print(json.dumps(out))
"""


def test_the_lint_flags_32_bit_row_offsets_and_narrow_stores(tmp_path):
    """On real TTIR/TTGIR/PTX of this Triton: ``rows × stride`` in 32 bits with rows from the
    program id or a loop variable is flagged, the 64-bit base + block tile form is not; a
    store whose 16-byte-per-thread tile is pushed off alignment is flagged as narrow."""
    (tmp_path / "lint_kernel.py").write_text(_LINT_KERNEL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _LINT_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"0": ["i32-address-product"], "1": ["i32-address-product"], "2": [], "3": ["narrow-store"]}


_TTIR = """
#loc = loc("/k.py":1:1)
#loc1 = loc("/k.py":5:3)
#loc2 = loc("/k.py":6:3)
module {
  tt.func public @k(%x_ptr: !tt.ptr<f32> {tt.divisibility = 16 : i32} loc("x_ptr"(#loc)), %n: i32 loc("n"(#loc)), %st: i32 loc("st"(#loc))) attributes {noinline = false} {
    %c0_i32 = arith.constant 0 : i32 loc(#loc)
    %c16_i32 = arith.constant 16 : i32 loc(#loc)
    %r = tt.make_range {end = 16 : i32, start = 0 : i32} : tensor<16xi32> loc(#loc)
    %a = scf.for %i = %c0_i32 to %n step %c16_i32 iter_args(%acc = %c0_i32) -> (i32)  : i32 {
      %k = arith.muli %r, %r : tensor<16xi32> loc(#loc)
      %next = arith.addi %acc, %i : i32 loc(#loc)
      scf.yield %next : i32 loc(#loc)
    } loc(#loc)
    %b = scf.for %i = %c0_i32 to %n step %c16_i32 iter_args(%acc = %c0_i32) -> (i32)  : i32 {
      %k = tt.splat %st : i32 -> tensor<16xi32> loc(#loc)
      %t = arith.muli %r, %k : tensor<16xi32> loc(#loc1)
      %p = tt.splat %x_ptr : !tt.ptr<f32> -> tensor<16x!tt.ptr<f32>> loc(#loc)
      %q = tt.addptr %p, %t : tensor<16x!tt.ptr<f32>>, tensor<16xi32> loc(#loc)
      scf.yield %acc : i32 loc(#loc)
    } loc(#loc)
    %m = arith.muli %a, %st : i32 loc(#loc2)
    %z = tt.addptr %x_ptr, %m : !tt.ptr<f32>, i32 loc(#loc2)
    tt.return loc(#loc)
  } loc(#loc)
} loc(#loc)
"""


def test_the_lint_follows_loops_and_scopes():
    """A value carried out of a loop (its yield) keeps the loop variable's index taint, so
    ``loop result × stride`` is flagged (k.py:6); a name reused in a sibling loop body
    (``%k``, a tile product there, a splat of the stride here) is a different value, so the
    bounded ``arange × stride`` tile (k.py:5) is not."""
    found = compiled_lint.i32_address_products(_TTIR)
    assert [(f.check, f.where) for f in found] == [("i32-address-product", "k.py:6")]
    assert "st" in found[0].message


def test_host_integer_helpers_match_tritons():
    """The launchers' cdiv / next_power_of_2 (plain ints, no constexpr wrapper) give Triton's
    values, so every grid and tile is the one the kernels were compiled for."""
    triton = pytest.importorskip("triton")
    from wiola_kernels.triton import cdiv, next_power_of_2

    for n in [*range(0, 2050), 4095, 4096, 4097, 32000, 2**20 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for y in (1, 2, 3, 16, 64, 128, 132):
            assert cdiv(n, y) == triton.cdiv(n, y), (n, y)
