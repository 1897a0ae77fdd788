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


def has_cuda_kernels() -> bool:
    """True when the extension was compiled with its CUDA kernels."""
    module = _load()[0]
    return bool(module is not None and getattr(module, "WITH_CUDA", False))


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


CPU_ISAS = ("auto", "avx2", "avx512")


def cpu_isa() -> str | None:
    """The instruction set the C++ CPU kernels' hot loops use now (``"avx2"`` or
    ``"avx512"``), or None without the extension. AVX-512 is used where the CPU has it,
    unless ``WIOLA_CPU_ISA=avx2`` was set before the extension loaded. The two agree to
    rounding (bf16 RMSNorm: sums in another order), each deterministic on its own."""
    module = _load()[0]
    return None if module is None else module.cpu_isa()


def set_cpu_isa(isa: str) -> str:
    """Choose the CPU kernels' instruction set: ``"auto"`` (the CPU's best), ``"avx2"`` or
    ``"avx512"``. Returns the previous one. Raises ValueError for another name or for
    ``"avx512"`` on a CPU without it, RuntimeError without the extension."""
    if isa not in CPU_ISAS:
        raise ValueError(f"isa must be one of {CPU_ISAS}, got {isa!r}")
    module = _load()[0]
    if module is None:
        raise RuntimeError(f"set_cpu_isa needs the C++ extension: {load_error()}")
    if isa == "avx512" and not module.cpu_has_avx512():
        raise ValueError("isa: this CPU has no AVX-512 (F/BW/VL/DQ/BF16); use 'avx2' or 'auto'")
    return module.set_cpu_isa(isa)
