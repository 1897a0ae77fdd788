"""Triton's CPU interpreter (how CI runs the Triton kernels) with loop bounds that are
runtime values, on every Triton the package supports: Triton 3.6's interpreter converted
such bounds with ``int()`` of a 1-element array, which NumPy >= 2.4 refuses;
``wiola_kernels.triton`` makes it squeeze first, as later Tritons do."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import wiola_kernels.triton  # noqa: E402,F401  (applies the interpreter fix)


@triton.jit
def _count_steps_kernel(out_ptr, start, n, STEP: tl.constexpr):
    """out[pid] = len(range(start + pid, n, programs · STEP)): bounds from an argument, the
    program id and the grid size."""
    pid = tl.program_id(0)
    count = 0
    for _ in range(start + pid, n, tl.num_programs(0) * STEP):
        count += 1
    tl.store(out_ptr + pid, count)


@pytest.mark.parametrize("start, n, step, programs", [(0, 10, 1, 4), (3, 100, 7, 5), (0, 0, 2, 3), (5, 2, 1, 2)])
def test_interpreter_takes_runtime_loop_bounds(start, n, step, programs):
    out = torch.full((programs,), -1, dtype=torch.int32)
    _count_steps_kernel[(programs,)](out, start, n, STEP=step)
    want = [len(range(start + pid, n, programs * step)) for pid in range(programs)]
    assert out.tolist() == want
