"""Loading the compiled extension ``wiola_kernels._C`` (C++ CPU and CUDA kernels).

The package works without it (reference and Triton backends); a failed load is
reported once, with the reason, and :func:`wiola_kernels.backends` repeats it.
``WIOLA_DISABLE_EXTENSION=1`` skips loading it (to compare, or to test that fallback).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings


@functools.lru_cache(maxsize=None)
def _load() -> tuple[object | None, str | None]:
    if os.environ.get("WIOLA_DISABLE_EXTENSION", "0") not in ("", "0"):
        return None, "the C++ extension is disabled by WIOLA_DISABLE_EXTENSION=1"
    try:
        module = importlib.import_module("wiola_kernels._C")
    except ImportError as exc:
        reason = (
            f"the C++ extension wiola_kernels._C is not available ({exc}); "
            "build it with `pip install -e . --no-build-isolation`"
        )
        warnings.warn(f"wiola_kernels: {reason}. Falling back to the reference/Triton backends.", stacklevel=3)
        return None, reason
    return module, None


def load_error() -> str | None:
    """None when the extension loaded, else why it did not."""
    return _load()[1]


def has_cpu_op(name: str) -> bool:
    """Whether the extension loaded and registered ``torch.ops.wiola.<name>``."""
    import torch

    return load_error() is None and hasattr(torch.ops, "wiola") and hasattr(torch.ops.wiola, name)


@functools.lru_cache(maxsize=None)
def cpu_op(name: str, module: str):
    """``torch.ops.wiola.<name>.default``, looked up once (a decoding step calls such ops
    dozens of times per token, and the ``torch.ops`` lookup costs more than the checks around
    them); RuntimeError naming ``module`` where the extension is not loaded."""
    import torch

    if not has_cpu_op(name):
        raise RuntimeError(f"{module} needs the C++ extension (wiola_kernels._C), which is not loaded")
    return getattr(torch.ops.wiola, name).default


def has_cuda_kernels() -> bool:
    """True when the extension was compiled with its CUDA kernels."""
    module = _load()[0]
    return bool(module is not None and getattr(module, "WITH_CUDA", False))


def triton_cuda_ops() -> frozenset[str]:
    """The ops whose CUDA kernel in this build is C++ launching the Triton kernels compiled
    ahead of time (the cubin table; csrc/cuda/triton_*_binding.cpp). Empty without the
    extension's CUDA kernels: those ops then register their Python Triton launchers."""
    module = _load()[0]
    return frozenset(getattr(module, "TRITON_CUDA_OPS", ()) if module is not None else ())


def cpp_cuda_ops() -> frozenset[str]:
    """The ops whose CUDA kernel in this build is C++ with a Python kernel registered as
    ``wiola::_triton_<op>`` for the calls it does not launch itself: :func:`triton_cuda_ops` and
    GCLA's composite of fused attention and summary kernels (csrc/cuda/gcla_attention_binding.cpp)."""
    module = _load()[0]
    composite = getattr(module, "COMPOSITE_CUDA_OPS", ()) if module is not None else ()
    return triton_cuda_ops() | frozenset(composite)


def cubin_table() -> dict | None:
    """This build's cubin table: ``{"triton_version", "missing_reason", "entries",
    "registered"}`` (the Triton that compiled it, why the build has none, how many variants, and
    how many the Python launcher has compiled and registered since: the runtime table), or None
    without the extension's CUDA kernels. Where a call's variant is in neither (another
    architecture, a shape the table was not built for, no table), the op runs its Python Triton
    launcher, which registers the variant it compiles so that the next such call launches from
    C++ (``wiola_kernels/triton/runtime_table.py``), or warns once why it cannot."""
    module = _load()[0]
    if module is None or not hasattr(module, "cubin_table"):
        return None
    version, reason, entries, registered = module.cubin_table()
    return {"triton_version": version, "missing_reason": reason, "entries": entries, "registered": registered}


@functools.lru_cache(maxsize=None)
def has_cuda_emu() -> bool:
    """True when the extension holds the CUDA kernels compiled for the CPU SIMT emulator
    (``torch.ops.wiola_cuda_emu``, the test backend ``cuda_emu``)."""
    if _load()[0] is None:
        return False
    import torch

    try:
        torch.ops.wiola_cuda_emu.atm_merge  # noqa: B018 - resolving the op is the probe
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def cpu_isa_levels() -> tuple[str, ...]:
    """The CPU kernels' instruction-set levels, lowest first (``"generic"``, ``"avx2"``,
    ``"avx512"``, ``"avx512_bf16"``), as csrc/cpu/isa.h defines them; empty without the
    extension."""
    module = _load()[0]
    return () if module is None else tuple(module.isa_levels())


@functools.lru_cache(maxsize=None)
def cpu_kernel_isas() -> dict[str, tuple[str, ...]]:
    """The CPU kernels with more than one path and the levels each implements, lowest first
    (``{"rms_norm": ("avx2", "avx512_bf16"), ...}``): csrc/cpu/isa.h's table, read from the
    extension; empty without it."""
    module = _load()[0]
    return {} if module is None else {kernel: tuple(levels) for kernel, levels in module.kernel_isas()}


def cpu_isa() -> str | None:
    """The instruction-set level the C++ CPU kernels use now — ``"generic"``, ``"avx2"``,
    ``"avx512"`` (F/BW/VL/DQ) or ``"avx512_bf16"`` (also AVX512_BF16) — or None without the
    extension. It is the CPU's best unless ``WIOLA_CPU_ISA`` (read when the extension loads)
    or :func:`set_cpu_isa` chose a lower one. Each kernel runs the highest path it
    implements at or below it (:func:`kernel_isa`); a kernel's paths agree to rounding,
    each deterministic on its own."""
    module = _load()[0]
    return None if module is None else module.cpu_isa()


def cpu_best_isa() -> str | None:
    """The highest level this CPU runs (see :func:`cpu_isa`), or None without the extension."""
    module = _load()[0]
    return None if module is None else module.cpu_best_isa()


def kernel_isa(kernel: str) -> str | None:
    """The level ``kernel`` (a key of :func:`cpu_kernel_isas`: ``"decode_gemv"``,
    ``"rms_norm"``, ``"add_rms_norm"``, ``"glu"``, ``"linear_cross_entropy"``) runs at now:
    the highest it implements at or below :func:`cpu_isa`. None without the extension.
    Raises ValueError for another kernel name."""
    module = _load()[0]
    return None if module is None else module.kernel_isa(kernel)


def set_cpu_isa(isa: str) -> str:
    """Choose the CPU kernels' instruction-set level: ``"auto"`` (the CPU's best) or one of
    :func:`cpu_isa_levels`. Returns the previous level. Raises ValueError for another name
    or for a level above what this CPU runs, RuntimeError without the extension."""
    module = _load()[0]
    if module is None:
        raise RuntimeError(f"set_cpu_isa needs the C++ extension: {load_error()}")
    return module.set_cpu_isa(isa)
