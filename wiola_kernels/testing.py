"""Helpers for testing kernels against the float64 reference (SPEC §9).

Used by this project's tests and offered to users who check their own builds
(``python -m wiola_kernels check`` runs on them).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from . import dispatch

#: SPEC §9 relative-error tolerances against the float64 reference.
TOLERANCE = {
    "elementwise": {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2},
    "attention": {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2},
}


def tolerance(dtype: torch.dtype, kind: str = "elementwise") -> float:
    """The SPEC §9 relative tolerance for outputs of ``dtype`` (``kind``: elementwise|attention)."""
    return TOLERANCE[kind][dtype]


def srpe_tolerance(dtype: torch.dtype, position_ids: torch.Tensor | int, spiral_divisor: float) -> float:
    """The SPEC §9 tolerance of SRPE outputs of ``dtype`` at these positions.

    float64 is held to ``max(1e-12, 8·max_j|p·ω_j·(1+1/k_s)|·2^-52)``: the angle
    ``p·ω_j·(1+1/k_s)`` itself carries that much rounding in any float64 evaluation
    (``ω_0 = 1`` is the largest frequency). Other dtypes use :func:`tolerance`.
    """
    if dtype != torch.float64:
        return tolerance(dtype)
    p_max = float(position_ids.abs().max()) if isinstance(position_ids, torch.Tensor) and position_ids.numel() \
        else float(abs(position_ids)) if not isinstance(position_ids, torch.Tensor) else 0.0
    stretch = abs(1.0 + 1.0 / spiral_divisor)
    return max(TOLERANCE["elementwise"][torch.float64], 8.0 * p_max * stretch * 2.0**-52)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 (0 when both are all zeros); NaN anywhere gives inf."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    o, r = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    if not torch.isfinite(o).all() and not (torch.isnan(o) == torch.isnan(r)).all():
        return float("inf")
    num = torch.linalg.vector_norm(torch.nan_to_num(o - r, nan=float("inf")))
    den = torch.linalg.vector_norm(r)
    if den == 0:
        return float(num)
    return float(num / den)


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> None:
    """Assert shape and dtype-free closeness ``rel_err(out, ref) <= tol`` with a useful message."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"


def available_backends(op: str, device: str | torch.device = "cpu") -> list[str]:
    """Backends of ``op`` that can run on ``device`` here."""
    device = torch.device(device)
    return [b for b in dispatch.implemented(op) if dispatch.BACKENDS[b].unavailable_reason(device) is None]


class CopyCounter:
    """Counts, as a context manager, the ops dispatched inside the block — the ``wiola::`` ops
    and every ATen op they call, also from inside a C++ kernel (PyTorch's profiler records
    each dispatcher call). ``counts`` maps ``"namespace.op"`` (``"wiola.srpe"``,
    ``"aten.copy_"``) to calls; ``copies`` sums the copy ops (``aten::copy_``, ``aten::clone``
    — what ``.contiguous()`` of a non-contiguous tensor runs — and ``aten::_to_copy``).

    Triton's CPU interpreter copies every tensor argument of a launch to a host buffer and
    back; those copies belong to the interpreter, not to the op (a GPU launch makes none), so
    ops inside a launch are not counted.
    """

    COPY_OPS = ("aten.copy_", "aten.clone", "aten._to_copy")
    _LAUNCH = "wiola_testing::triton_launch"

    def __init__(self):
        self.counts: dict[str, int] = {}

    @property
    def copies(self) -> int:
        """How many copy ops were dispatched."""
        return sum(self.counts.get(name, 0) for name in self.COPY_OPS)

    def __enter__(self) -> "CopyCounter":
        from torch.profiler import ProfilerActivity, profile, record_function
        from triton.runtime import interpreter

        launch = self._launch = interpreter.GridExecutor.__call__

        def marked_launch(executor, *args, **kwargs):
            with record_function(self._LAUNCH):
                return launch(executor, *args, **kwargs)

        interpreter.GridExecutor.__call__ = marked_launch
        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import interpreter

        self._profile.__exit__(*exc)
        interpreter.GridExecutor.__call__ = self._launch
        for event in self._profile.events():
            if "::" not in event.name or event.name == self._LAUNCH or self._in_launch(event):
                continue
            name = event.name.replace("::", ".")
            self.counts[name] = self.counts.get(name, 0) + 1

    @classmethod
    def _in_launch(cls, event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name == cls._LAUNCH:
                return True
            parent = parent.cpu_parent
        return False


def available_cpu_isas(kernel: str | None = None) -> list[str]:
    """The instruction-set levels the C++ CPU kernels can run here, lowest first (``"generic"``
    to the CPU's best); with ``kernel``, only the levels at which that kernel runs a path of
    its own (``"rms_norm"``: ``["avx2", "avx512_bf16"]`` on a CPU with AVX512_BF16), so that
    tests run each path once. Empty without the extension."""
    from . import _extension

    module = _extension._load()[0]
    if module is None:
        return []
    levels = _extension.cpu_isa_levels()
    runs = list(levels[:levels.index(module.cpu_best_isa()) + 1])
    if kernel is None:
        return runs
    own = _extension.cpu_kernel_isas()[kernel]
    return [level for level in runs if level in own]


@contextlib.contextmanager
def cpu_isa(isa: str | None) -> Iterator[None]:
    """Run the C++ CPU kernels at level ``isa`` (``"generic"`` … ``"avx512_bf16"``) inside the
    block; None leaves the choice as it is. Not thread-safe: the choice is process-wide."""
    if isa is None:
        yield
        return
    from ._extension import set_cpu_isa

    previous = set_cpu_isa(isa)
    try:
        yield
    finally:
        set_cpu_isa(previous)


@contextlib.contextmanager
def fake_cpu(best: str) -> Iterator[None]:
    """Inside the block the CPU's probe reports at most ``best`` (``"avx2"``, ``"avx512"``…), as
    on a CPU without the higher extensions (``"avx512"``: Skylake-SP, Cascade Lake, Ice Lake —
    AVX-512 without BF16), and the process's level is reset to it, as at start-up. It can only
    lower what runs, so every kernel stays safe. Restores the real probe and the previous
    level on exit. Not thread-safe."""
    from . import _extension

    module = _extension._load()[0]
    if module is None:
        raise RuntimeError(f"fake_cpu needs the C++ extension: {_extension.load_error()}")
    level = module.cpu_isa()
    previous = module._set_cpu_probe_cap(best)
    try:
        yield
    finally:
        module._set_cpu_probe_cap(previous)
        module.set_cpu_isa(level)
