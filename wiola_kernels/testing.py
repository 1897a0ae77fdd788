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
    """A ``TorchDispatchMode`` (use as a context manager) that counts the copies made inside
    the ``wiola::`` ops: ``aten::copy_``, ``aten::clone`` (what ``.contiguous()`` of a
    non-contiguous tensor runs), ``aten::_to_copy``, and ``contiguous``/``reshape``/``to``
    when the mode sees them whole and they return new storage.

    A mode does not see inside an op it intercepts, so the ops' own Python bodies (the
    ``torch.library.custom_op`` implementations: validation, backend call, output layout)
    are run with the mode pushed again, and every aten op they call is seen. The raw kernels
    (``wiola::_srpe``, …) are counted as one op each; C++ kernels allocate their outputs
    with ``empty_like`` and make no copy. ``counts`` holds every op seen, ``copies`` the sum
    of the three copy ops.

    Triton's CPU interpreter copies every tensor argument of a launch to a host buffer and
    back (``GridExecutor``); those copies belong to the interpreter, not to the op (a GPU
    launch makes none), so launches run with the mode suspended.
    """

    COPY_OPS = ("aten.copy_", "aten.clone", "aten._to_copy", "aten.contiguous (copied)", "aten.reshape (copied)",
                "aten.to (copied)")
    # Composite ops a mode may see before they decompose: a copy when the result has new storage.
    MAYBE_COPY_OPS = ("aten.contiguous", "aten.reshape", "aten.to")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = str(func.overloadpacket)
                counter.counts[name] = counter.counts.get(name, 0) + 1
                opdef = _custom_op_def(func)
                if opdef is not None:
                    with self:  # see inside the op's Python body
                        return opdef._init_fn(*args, **kwargs)
                out = func(*args, **kwargs)
                if name in counter.MAYBE_COPY_OPS and isinstance(out, torch.Tensor) and \
                        out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr():
                    counter.counts[f"{name} (copied)"] = counter.counts.get(f"{name} (copied)", 0) + 1
                return out

        self.counts: dict[str, int] = {}
        self._mode = _Mode()

    @property
    def copies(self) -> int:
        """How many copy ops were dispatched."""
        return sum(self.counts.get(name, 0) for name in self.COPY_OPS)

    def __enter__(self) -> "CopyCounter":
        from torch.utils._python_dispatch import _disable_current_modes
        from triton.runtime import interpreter

        launch = self._launch = interpreter.GridExecutor.__call__

        def unobserved_launch(executor, *args, **kwargs):
            with _disable_current_modes():
                return launch(executor, *args, **kwargs)

        interpreter.GridExecutor.__call__ = unobserved_launch
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import interpreter

        self._mode.__exit__(*exc)
        interpreter.GridExecutor.__call__ = self._launch


def _custom_op_def(func):
    """The ``torch.library.custom_op`` definition behind ``func`` (an OpOverload), or None."""
    from torch._library.custom_ops import OPDEFS

    return OPDEFS.get(f"{func.namespace}::{func._opname}") if hasattr(func, "_opname") else None


def available_cpu_isas() -> list[str]:
    """The instruction sets the C++ CPU kernels can run here (``"avx2"``, and ``"avx512"``
    where the CPU has it); empty without the extension."""
    from . import _extension

    module = _extension._load()[0]
    if module is None:
        return []
    return ["avx2", "avx512"] if module.cpu_has_avx512() else ["avx2"]


@contextlib.contextmanager
def cpu_isa(isa: str | None) -> Iterator[None]:
    """Run the C++ CPU kernels on ``isa`` (``"avx2"``/``"avx512"``) inside the block; None
    leaves the choice as it is. Not thread-safe: the choice is process-wide."""
    if isa is None:
        yield
        return
    from ._extension import set_cpu_isa

    previous = set_cpu_isa(isa)
    try:
        yield
    finally:
        set_cpu_isa(previous)
