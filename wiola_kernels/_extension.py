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
        torch.ops.wiola_cuda_emu._atm_merge  # noqa: B018 - resolving the op is the probe
    except (AttributeError, RuntimeError):
        return False
    return True
