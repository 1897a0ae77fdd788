"""Ahead-of-time compilation of every Triton kernel of the package for real GPUs
(sm_90, sm_80), without a GPU: the one AOT pipeline (``gpu-report``,
``scripts/triton_warmup.py`` and the tests use it; no module re-implements it).

Each kernel module in ``wiola_kernels/triton/`` registers what its launchers launch by
defining, next to them::

    def aot_launches(sms: int) -> Iterator[Launch]
    def aot_launches(sms: int, arch: int = 90) -> Iterator[Launch]   # when the choice depends on it

which yields one :class:`Launch` per kernel launch its launchers make at the shapes of
:mod:`wiola_kernels.shapes` (the GPU test shapes and the bench shapes) on a GPU with ``sms``
SMs (and compute capability ``arch``, e.g. 90, passed when the function takes it), built
with the launchers' own choice functions. Pointer arguments are :class:`DevicePointer` stand-ins; scalar
arguments are the real values, so the JIT's launch-time specialisation (integers
divisible by 16 get ``tt.divisibility``, an integer equal to 1 becomes a constant,
16-byte aligned pointers get ``tt.divisibility``) is reproduced by Triton's own binder
(``create_function_from_signature``), not by a copy of its rules. Modules are found by
scanning the package: a new kernel module only has to define ``aot_launches``.

Compiling needs the real ``JITFunction`` s, so it runs in a process without
``TRITON_INTERPRET`` (``gpu-report`` starts one when its caller interprets; the tests run
``gpu-report`` in a subprocess). Launches that only choose (``launches``, ``variant_id``)
work in either mode. Compiled kernels land in Triton's cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``), so a second run only reads them.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class GPU:
    """Per-SM limits of one GPU, for occupancy."""

    name: str
    arch: str                  # "sm_90"
    capability: int            # 90
    sms: int
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024       # bytes, including the 1 KB each block reserves
    smem_per_block: int = 227 * 1024    # the most one block may use (opt-in)
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    reserved_smem_per_block: int = 1024


# The GPU each architecture is described on (SM count, per-SM limits).
GPUS = {
    "sm_90": GPU("H200", "sm_90", 90, sms=132),
    "sm_80": GPU("A100", "sm_80", 80, sms=108, smem_per_sm=164 * 1024, smem_per_block=163 * 1024),
}


@dataclass(frozen=True)
class DevicePointer:
    """Stands in for a CUDA tensor argument: its dtype, and an address aligned as the
    CUDA caching allocator aligns fresh tensors (256 bytes), which the JIT sees as
    divisible by 16, plus ``offset`` bytes for a view into such a tensor (the second half
    of a packed projection: ``n`` elements in)."""

    dtype: torch.dtype
    offset: int = 0

    def data_ptr(self) -> int:
        return 256 + self.offset


@dataclass
class Launch:
    """One kernel launch a launcher makes: what the JIT would compile, and the grid."""

    kernel: object                 # the @triton.jit function
    args: tuple                    # positional arguments (DevicePointer for tensors)
    constexprs: dict               # constexpr keyword arguments
    num_warps: int
    num_stages: int                # the launch's num_stages (Triton's default when the launcher sets none)
    grid: int                      # programs launched
    case: str                      # the shape that chose it, e.g. "bench x (16384, 1024) bfloat16"
    memory_bound: bool = True      # gpu-report computes bytes in flight for these
    case_grids: dict = field(default_factory=dict)  # every shape that chose the same compiled kernel: its grid

    @property
    def name(self) -> str:
        return _python_fn(self.kernel).__name__


def _python_fn(kernel):
    return getattr(kernel, "fn", kernel)


def _default_num_stages() -> int:
    from triton.backends.nvidia.compiler import CUDAOptions

    return CUDAOptions.num_stages


DEFAULT_NUM_STAGES = _default_num_stages()  # what the JIT uses when a launch sets none


def launch_modules() -> list:
    """Every module of ``wiola_kernels.triton`` that defines ``aot_launches``."""
    from . import __path__ as pkg_path

    mods = []
    for info in sorted(pkgutil.iter_modules(pkg_path), key=lambda m: m.name):
        if info.name == "aot":
            continue
        mod = importlib.import_module(f"{__package__}.{info.name}")
        if hasattr(mod, "aot_launches"):
            mods.append(mod)
    return mods


def _jit_function(kernel):
    """The ``JITFunction`` for ``kernel`` (an ``InterpretedFunction`` when the process
    interprets: then a ``JITFunction`` is built for its signature only)."""
    from triton.runtime.jit import JITFunction

    return kernel if isinstance(kernel, JITFunction) else JITFunction(_python_fn(kernel))


def _backend(gpu: GPU):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", gpu.capability, 64)
    return target, make_backend(target)


def specialise(launch: Launch, gpu: GPU):
    """``(signature, constexprs, attrs, options)`` exactly as the JIT computes them at this
    launch (Triton's binder and ``_pack_args``)."""
    from triton.runtime.jit import create_function_from_signature

    fn = _jit_function(launch.kernel)
    _, backend = _backend(gpu)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    bound, spec, opts = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return signature, constexprs, attrs, options


def variant_id(launch: Launch, gpu: GPU) -> str:
    """A readable id of the compiled kernel: name, constexprs, warps, stages, and the
    specialised signature (dtypes; ``/16`` divisible by 16; ``=1`` the constant 1)."""
    signature, constexprs, attrs, _ = specialise(launch, gpu)
    parts = []
    for i, (name, ty) in enumerate(signature.items()):
        if ty == "constexpr":
            value = constexprs.get((i,))
            if name in launch.constexprs:
                parts.append(f"{name}={value}")
            else:
                parts.append(f"{name}=1")  # an integer argument the JIT turned into the constant 1
            continue
        div = any(a[0] == "tt.divisibility" for a in attrs.get((i,), []))
        parts.append(f"{ty}{'/16' if div else ''}")
    return f"{launch.name}[{','.join(parts)},w{launch.num_warps},s{launch.num_stages}]"


def module_launches(mod, gpu: GPU):
    """``mod.aot_launches`` for ``gpu``: its SM count, and its compute capability when the
    function takes ``arch``."""
    if "arch" in inspect.signature(mod.aot_launches).parameters:
        return mod.aot_launches(gpu.sms, arch=gpu.capability)
    return mod.aot_launches(gpu.sms)


def launches(gpu: GPU) -> dict[str, Launch]:
    """Every distinct compiled kernel the launchers choose on ``gpu``, by :func:`variant_id`
    (the first launch that chose it; ``case_grids`` lists every case with its grid)."""
    out: dict[str, Launch] = {}
    for mod in launch_modules():
        for launch in module_launches(mod, gpu):
            key = variant_id(launch, gpu)
            if key not in out:
                out[key] = launch
            out[key].case_grids[launch.case] = launch.grid
    return out


def compile_launch(launch: Launch, gpu: GPU):
    """``triton.compile`` the launch for ``gpu`` (needs a process that does not interpret)."""
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(launch.kernel, JITFunction):
        raise RuntimeError("compile_launch needs real JITFunctions: run without TRITON_INTERPRET")
    signature, constexprs, attrs, options = specialise(launch, gpu)
    target, _ = _backend(gpu)
    return triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
