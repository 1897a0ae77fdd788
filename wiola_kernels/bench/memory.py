"""Memory a benchmark step needs: on CUDA, ``torch.cuda.max_memory_allocated`` over the step;
on the CPU, the growth of the process's peak resident set over it (``VmHWM`` reset through
``/proc/self/clear_refs`` after ``malloc_trim``), i.e. the memory the step really touched.
Shared by the op benchmark (``runner``), the Hugging Face step (``hf``) and the model
package's step."""

from __future__ import annotations

import ctypes

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_mb(step, device: torch.device) -> float:
    """Memory a call of ``step()`` needs above what is live before it, in MiB (see the module docstring)."""
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so RSS ≈ live memory
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _status_kb("VmRSS")
    except OSError:
        return float("nan")  # not Linux/glibc: no measurement
    step()
    return (_status_kb("VmHWM") - base) / 1024
