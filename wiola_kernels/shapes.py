"""Every shape the kernels are benchmarked, GPU-tested and compiled ahead of time at: one table.

Read by the benchmark cases (each op's ``bench_cases`` in ``ops/<op>.py``, through
:func:`bench_shape`; ``bench/attention.py``), each Triton kernel
module's ``aot_launches`` (what ``gpu-report`` and ``scripts/triton_warmup.py`` compile), the
CUDA half of ``gpu-report``, and the GPU tests of ``tests/test_<op>.py`` (which parametrize
from here, so the compiled list covers them by construction). A leaf module: it imports
torch and nothing from this package, so kernel and op modules can read it without reaching up
into ``bench/``.
"""

from __future__ import annotations

import torch

#: The dtype of every GPU benchmark (the training dtype of the model).
GPU_BENCH_DTYPE = torch.bfloat16

# ---- rms_norm: x (rows, d) -------------------------------------------------------------------
RMS_NORM_BENCH = {"small": (256, 1024), "full": (16384, 1024)}
#: tests/test_rms_norm.py::test_rms_norm_triton_vs_float64: every shape × every dtype.
RMS_NORM_GPU_TEST_SHAPES = ((1, 3), (37, 192), (4, 33, 760), (1151, 4096), (2, 8193))
RMS_NORM_GPU_TEST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: (x shape, dtype) of every launch the GPU tests make: the product above, the bitwise
#: reproducibility test (4097, 1024), and the cross-op tests' float32 / float64 inputs that run
#: on the GPU's Triton backend (tests/test_op_layer.py, tests/test_all_ops.py).
RMS_NORM_GPU_TESTS = tuple(
    [(shape, dtype) for dtype in RMS_NORM_GPU_TEST_DTYPES for shape in RMS_NORM_GPU_TEST_SHAPES]
    + [((4097, 1024), torch.float32), ((5, 33), torch.float32), ((2, 5), torch.float64)])

# ---- srpe: q (B, H, T, d_h), k (B, H_kv, T, d_h) ----------------------------------------------
SRPE_BENCH = {"small": (2, 4, 1, 128, 64), "full": (4, 16, 4, 2048, 64)}  # (B, H, H_kv, T, d_h)
#: tests/test_srpe.py::test_srpe_triton_vs_float64: every shape × every dtype.
SRPE_GPU_TEST_SHAPES = ((1, 1, 1, 1, 64), (3, 16, 4, 257, 64), (2, 8, 8, 100, 128), (1, 4, 2, 33, 10))
SRPE_GPU_TEST_DTYPES = (torch.float32, torch.bfloat16)
#: ((B, H, H_kv, T, d_h), dtype) of every launch the GPU tests make (with the cross-op tests').
SRPE_GPU_TESTS = tuple(
    [(shape, dtype) for dtype in SRPE_GPU_TEST_DTYPES for shape in SRPE_GPU_TEST_SHAPES]
    + [((2, 4, 2, 7, 16), torch.float32), ((3, 4, 4, 5, 66), torch.float64)])

# ---- atm: x (B, T, d) -------------------------------------------------------------------------
ATM_BENCH = {"small": (2, 256, 256), "full": (8, 2048, 1024)}

# ---- gcla_attention: q (B, H, T, d_h), k/v (B, H_kv, T, d_h), kc/vc (B, H, S, Λ', d_h) ---------
#: The GPU benchmark (bench/attention.py against SDPA-flash, the op bench, the AOT compiles and
#: gpu-report): wiola-360m attention, Λ' = 2 summary slots.
GCLA_BENCH = dict(B=4, H=16, H_kv=4, T=4096, L=2)
GCLA_BENCH_HEAD_DIMS = (64, 128)   # bench/attention.py times both; the op bench the first
GCLA_BENCH_SMALL = dict(GCLA_BENCH, B=1, T=256)   # `bench --small`
GCLA_BENCH_CPU = dict(GCLA_BENCH, B=1, T=2048)    # the full op bench on the CPU
#: tests/test_gcla_attention.py::test_triton_gpu_vs_float64: ((B, H, H_kv, T, d_h, summary,
#: lengths or None), dtypes). summary "causal" is S = T, "paper" S = 1. float32 only at d_h 64:
#: the Triton kernels refuse float32 beyond (TRITON_GCLA_FP32_MAX_HEAD_DIM).
GCLA_GPU_TESTS = (
    ((2, 8, 2, 257, 64, "causal", (257, 100)), (torch.bfloat16, torch.float16, torch.float32)),
    ((1, 16, 4, 1000, 128, "paper", None), (torch.bfloat16, torch.float16)),
    ((3, 6, 3, 1, 64, "causal", (1, 0, 1)), (torch.bfloat16, torch.float16, torch.float32)),
)

# ---- glu: a, b (rows, n); "packed": the two halves of one (rows, 2n) projection ---------------
#: DSFF's two streams at wiola-360m width on 4,096 tokens (B·T): (tokens, n, activation).
GLU_BENCH = {"small": ((256, 1024, "silu"), (256, 4096, "gelu_tanh")),
             "full": ((4096, 1024, "silu"), (4096, 4096, "gelu_tanh"))}
#: tests/test_glu.py::test_glu_triton_vs_float64: every (rows, n) × dtype × packed.
GLU_GPU_TEST_SHAPES = ((1, 3), (37, 192), (129, 1000))
GLU_GPU_TEST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: (rows, n, packed, dtype) of every launch the GPU tests make (with the cross-op tests' float64).
GLU_GPU_TESTS = tuple(
    [(rows, n, packed, dtype) for dtype in GLU_GPU_TEST_DTYPES for rows, n in GLU_GPU_TEST_SHAPES
     for packed in (False, True)]
    + [(2, 5, False, torch.float64)])

# ---- add_rms_norm: x, residual (rows, d) ------------------------------------------------------
ADD_RMS_NORM_BENCH = {"small": (256, 1024), "full": (16384, 1024)}
#: tests/test_add_rms_norm.py::test_add_rms_norm_triton_vs_float64: every shape × every dtype.
ADD_RMS_NORM_GPU_TEST_SHAPES = ((1, 3), (37, 192), (4, 33, 760), (2, 8193))
ADD_RMS_NORM_GPU_TEST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ADD_RMS_NORM_GPU_TESTS = tuple(
    [(shape, dtype) for dtype in ADD_RMS_NORM_GPU_TEST_DTYPES for shape in ADD_RMS_NORM_GPU_TEST_SHAPES]
    + [((2, 5), torch.float64)])

# ---- linear_cross_entropy: h (N, d), W (V, d) -------------------------------------------------
#: The wiola-360m head (tied embedding, V = 32000, d = 1024) on N = 4096 tokens: (N, d, V).
LCE_BENCH = {"small": (48, 32, 300), "full": (4096, 1024, 32000)}
#: tests/test_linear_cross_entropy.py::test_triton_on_gpu: every (N, d, V) × every dtype.
LCE_GPU_TEST_SHAPES = ((37, 64, 1000),)
LCE_GPU_TEST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: (N, d, V, dtype) of every launch the GPU tests make (with the cross-op tests' float64).
LCE_GPU_TESTS = tuple(
    [(*shape, dtype) for dtype in LCE_GPU_TEST_DTYPES for shape in LCE_GPU_TEST_SHAPES]
    + [(5, 16, 50, torch.float64)])

# ---- the default `python -m wiola_kernels bench` on the CPU: one shape per op -----------------
#: What ``python -m wiola_kernels bench`` runs without options on the CPU, in float32: one
#: shape per op, sized so that the whole run (fused, eager and torch.compile, fwd and
#: fwd+bwd, compiling included) takes minutes on 2 cores; ``bench --full`` runs the tables
#: above. (CUDA's default run takes each op's first full shape in GPU_BENCH_DTYPE.)
CPU_DEFAULT_BENCH = {
    "rms_norm": (4096, 1024),
    "add_rms_norm": (4096, 1024),
    "glu": (1024, 1024, "silu"),
    "srpe": (1, 16, 4, 1024, 64),
    "atm": (2, 1024, 1024),
    "gcla_attention": dict(GCLA_BENCH, B=1, T=256),
    "linear_cross_entropy": (512, 512, 8192),
}


# ---- `python -m wiola_kernels bench --overhead`: one call on the smallest input -------------------
#: What ``bench --overhead`` times call by call, in float32 on every device: per op, the
#: smallest input a model passes it (a decoding step's one token), where the kernel is nothing
#: and the op layer everything.
TINY_BENCH = {
    "rms_norm": (4, 64),
    "add_rms_norm": (4, 64),
    "glu": (1, 64, "silu"),                   # one token's up projection, [a | b] of width 2·64
    "srpe": (1, 4, 1, 1, 64),                 # 4 query heads, 1 kv head
    "atm": (1, 8, 64),
    "gcla_attention": dict(B=1, H=4, H_kv=1, T=1, L=1),
    "linear_cross_entropy": (4, 64, 128),     # 4 tokens, a 128-word head
}

#: The sizes a benchmark case is declared at: ``"small"`` (seconds; smoke tests, CI, ``check``),
#: ``"default"`` (one case per op: what ``python -m wiola_kernels bench`` runs without options),
#: ``"full"`` (every shape and dtype, ``bench --full``) and ``"tiny"`` (:data:`TINY_BENCH`).
BENCH_SIZES = ("small", "default", "full", "tiny")


def bench_dtype(device: torch.device, size: str) -> torch.dtype:
    """The dtype of a benchmark on ``device``: :data:`GPU_BENCH_DTYPE` on CUDA, float32 on the
    CPU and at size ``"tiny"``."""
    return GPU_BENCH_DTYPE if device.type == "cuda" and size != "tiny" else torch.float32


def bench_dtypes(device: torch.device, size: str, cpu_bf16: bool = True) -> list[torch.dtype]:
    """:func:`bench_dtype`; small and full runs add bf16 on the CPU (the model's training dtype,
    whose kernels convert on the fly) where ``cpu_bf16``."""
    extra = cpu_bf16 and size in ("small", "full") and device.type == "cpu"
    return [bench_dtype(device, size)] + ([torch.bfloat16] if extra else [])


def bench_shape(op: str, table: dict, device: torch.device, size: str):
    """``table[size]`` (``size`` one of :data:`BENCH_SIZES`); the default size is the full shape
    on CUDA and ``CPU_DEFAULT_BENCH[op]`` on the CPU, the tiny one ``TINY_BENCH[op]``."""
    if size not in BENCH_SIZES:
        raise ValueError(f"size must be one of {BENCH_SIZES}, got {size!r}")
    if size == "tiny" or (size == "default" and device.type == "cpu"):
        name, sizes = ("TINY_BENCH", TINY_BENCH) if size == "tiny" else ("CPU_DEFAULT_BENCH", CPU_DEFAULT_BENCH)
        if op not in sizes:
            raise ValueError(f"{op} has no shape for the {size} bench{' on the CPU' if size == 'default' else ''}: "
                             f"add one to {name} in wiola_kernels/shapes.py")
        return sizes[op]
    return table["full" if size == "default" else size]
