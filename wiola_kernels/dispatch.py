"""Backend choice: which implementation of an op runs for a given device.

Every op registers the backends it has (``reference`` always; ``cpu`` when the C++
extension is built; ``triton`` and/or ``cuda`` for GPU kernels; ``cuda_emu``, a test
backend, for the CUDA kernels run on CPU tensors by the SIMT emulator of
csrc/cuda/emu/ — never chosen automatically). At call time
:func:`select` picks one:

1. an override — :func:`use_backend` (innermost wins) or else the environment
   variable ``WIOLA_BACKEND`` — if the op implements that backend; an op that does
   not implement the forced backend keeps its default (``use_backend("triton")``
   still runs GCLA on its CUDA kernel), so one override can steer a whole model;
2. otherwise the first available backend in the device's priority order:
   CUDA tensors ``cuda > triton > reference``, CPU tensors ``cpu > reference``.

A forced backend that the op implements but cannot run here (no GPU, extension not
built, Triton without ``TRITON_INTERPRET=1`` on CPU tensors) raises ``RuntimeError``
with the reason — never a silent fallback.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

BACKEND_NAMES = ("cuda", "triton", "cpu", "reference", "cuda_emu")
_PRIORITY = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("wiola_backend", default=None)


@dataclass(frozen=True)
class Backend:
    """One way of running ops: its name and a probe that says whether it can run."""

    name: str
    probe: Callable[[torch.device], str | None]  # None when usable on the device, else why not

    def unavailable_reason(self, device: torch.device) -> str | None:
        return self.probe(device)


def _probe_reference(device: torch.device) -> str | None:
    return None


def _probe_cpu(device: torch.device) -> str | None:
    from . import _extension

    if device.type != "cpu":
        return f"the cpu backend runs on CPU tensors, got a {device.type} tensor"
    return _extension.load_error()


def _probe_cuda(device: torch.device) -> str | None:
    from . import _extension

    if device.type != "cuda":
        return f"the cuda backend runs on CUDA tensors, got a {device.type} tensor"
    if not _extension.has_cuda_kernels():
        return "the extension was built without CUDA kernels (torch without CUDA, or nvcc missing at build time)"
    return _extension.load_error()


def _probe_cuda_emu(device: torch.device) -> str | None:
    from . import _extension

    if device.type != "cpu":
        return (f"the cuda_emu backend (CUDA kernels emulated on the CPU) runs on CPU tensors, "
                f"got a {device.type} tensor")
    if _extension.load_error() is not None:
        return _extension.load_error()
    if not _extension.has_cuda_emu():
        return "the extension was built without the CUDA kernels' CPU emulation (WIOLA_NO_CUDA_EMU=1)"
    return None


def _probe_triton(device: torch.device) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton is a dependency
        return f"triton is not importable ({exc})"
    if device.type == "cuda":
        # Ask torch, not the device string: a CPU-only torch accepts torch.device("cuda").
        return None if torch.cuda.is_available() else "torch reports no CUDA device (torch.cuda.is_available() is False)"
    if device.type == "cpu" and triton_interpret_mode():
        return None
    return "triton needs a CUDA tensor, or CPU tensors with TRITON_INTERPRET=1 set before import"


def triton_interpret_mode() -> bool:
    """True when Triton kernels run in the (numpy-backed, slow) CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


BACKENDS = {
    "reference": Backend("reference", _probe_reference),
    "cpu": Backend("cpu", _probe_cpu),
    "cuda": Backend("cuda", _probe_cuda),
    "triton": Backend("triton", _probe_triton),
    # Test-only: never in _PRIORITY, so only use_backend("cuda_emu") / WIOLA_BACKEND selects it.
    "cuda_emu": Backend("cuda_emu", _probe_cuda_emu),
}

# op name -> backend name -> implementation object (a namespace of functions).
_registry: dict[str, dict[str, object]] = {}


def register(op: str, backend: str, impl: object) -> None:
    """Declare that ``op`` has an implementation on ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    _registry.setdefault(op, {})[backend] = impl


def ops() -> list[str]:
    """Names of the registered ops."""
    return sorted(_registry)


def implemented(op: str) -> list[str]:
    """Backends that implement ``op``, in ``BACKEND_NAMES`` order."""
    return [b for b in BACKEND_NAMES if b in _registry[op]]


def forced_backend() -> str | None:
    """The backend forced by :func:`use_backend` or ``WIOLA_BACKEND``, if any."""
    name = _override.get()
    if name == "auto":
        return None
    source = "use_backend"
    if name is None:
        env = os.environ.get("WIOLA_BACKEND", "").strip()
        if env and env != "auto":
            name, source = env, "the environment variable WIOLA_BACKEND"
    if name is not None and name not in BACKENDS:
        raise ValueError(f"WIOLA_BACKEND / use_backend must name one of {BACKEND_NAMES} or 'auto', got {name!r} "
                         f"(from {source})")
    return name


def select(op: str, device: torch.device) -> str:
    """Name of the backend that runs ``op`` on ``device`` now."""
    impls = _registry[op]
    forced = forced_backend()
    if forced is not None and forced in impls:
        reason = BACKENDS[forced].unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"wiola: backend {forced!r} was requested for {op} but cannot run: {reason}")
        return forced
    for name in _PRIORITY.get(device.type, ("reference",)):
        if name in impls and BACKENDS[name].unavailable_reason(device) is None:
            return name
    return "reference"


def implementation(op: str, device: torch.device) -> object:
    """The implementation namespace that :func:`select` picks."""
    return _registry[op][select(op, device)]


def backward_implementation(op: str, device: torch.device, backend: str) -> object:
    """The implementation a backward op runs: ``backend`` — the one its forward ran, pinned
    by the op's ``setup_context`` so that the backward follows the forward even when it
    runs outside the forward's :func:`use_backend` block — or :func:`implementation` for
    ``"auto"`` (a backward op called directly)."""
    if backend == "auto":
        return implementation(op, device)
    if backend not in _registry[op]:
        raise ValueError(f"backend must be 'auto' or one of {implemented(op)} for {op}, got {backend!r}")
    return _registry[op][backend]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every op that implements backend ``name`` to use it inside the block.

    ``"auto"`` restores the automatic choice (also overriding ``WIOLA_BACKEND``).

    Example::

        with wiola_kernels.use_backend("reference"):
            y = wiola_kernels.rms_norm(x, weight, shift)
    """
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"use_backend: name must be one of {BACKEND_NAMES} or 'auto', got {name!r}")
    token = _override.set(name)  # "auto" is stored too: it masks WIOLA_BACKEND
    try:
        yield
    finally:
        _override.reset(token)


def backends(device: str | torch.device | None = None) -> dict[str, dict[str, str]]:
    """What can run where: ``{op: {backend: "available" | "unavailable: <why>"}}``.

    ``device`` defaults to CUDA when a GPU is visible, else CPU. A bad ``WIOLA_BACKEND`` is
    a ``ValueError`` here, where the environment is read, not later inside an op.
    """
    forced_backend()  # validates WIOLA_BACKEND / use_backend
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    report: dict[str, dict[str, str]] = {}
    for op in ops():
        report[op] = {}
        for name in implemented(op):
            reason = BACKENDS[name].unavailable_reason(device)
            report[op][name] = "available" if reason is None else f"unavailable: {reason}"
    return report
