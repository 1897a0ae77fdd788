"""Where the CUDA-kernel tests run: the ``cuda`` backend on a GPU, and the same kernels on
CPU tensors in the SIMT emulator (backend ``cuda_emu``, csrc/cuda/emu/) — one test file
serves both. Each target is skipped with the reason when it cannot run here."""

from __future__ import annotations

import pytest
import torch

from wiola_kernels import dispatch

DEVICE = {"cuda": "cuda", "cuda_emu": "cpu"}
EMULATED = "cuda_emu"


def _reason(backend: str) -> str | None:
    if backend == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    return dispatch.BACKENDS[backend].unavailable_reason(torch.device(DEVICE[backend]))


def targets() -> list:
    """``pytest.param("cuda")`` (marked gpu) and ``pytest.param("cuda_emu")``, each skipped
    with the reason when it cannot run."""
    out = []
    for backend in ("cuda", "cuda_emu"):
        reason = _reason(backend)
        marks = [pytest.mark.skipif(reason is not None, reason=f"{backend} backend unavailable: {reason}")]
        if backend == "cuda":
            marks.append(pytest.mark.gpu)
        out.append(pytest.param(backend, marks=marks, id=backend))
    return out


def raw_ops(backend: str):
    """The namespace of the raw kernel ops of ``backend``: torch.ops.wiola (cuda) or
    torch.ops.wiola_cuda_emu (the emulated bindings)."""
    return torch.ops.wiola_cuda_emu if backend == EMULATED else torch.ops.wiola


def with_cases(gpu_cases: list, emu_cases: list) -> list:
    """``pytest.param(backend, *case)`` for each target and its own cases (tuples of the
    remaining arguments; smaller shapes under emulation), keeping the target's skip marks."""
    out = []
    for target in targets():
        backend = target.values[0]
        for case in (emu_cases if backend == EMULATED else gpu_cases):
            out.append(pytest.param(backend, *case, marks=target.marks))
    return out
