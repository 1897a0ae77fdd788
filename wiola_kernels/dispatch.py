"""Backend choice: which implementation of an op runs for a given device.

Every op registers the backends it has (``reference`` always; ``cpu`` when the C++
extension is built; ``triton`` and/or ``cuda`` for GPU kernels; ``cuda_emu``, a test
backend, for the CUDA kernels run on CPU tensors by the SIMT emulator of
csrc/cuda/emu/ — never chosen automatically). At call time
:func:`select` picks one:

1. an override — :func:`use_backend` (innermost wins) or else the environment
   variable ``WIOLA_BACKEND`` — if the op implements that backend; an op that does
   not implement the forced backend keeps its default (``use_backend("cuda")``
   still runs RMSNorm on its Triton kernel), so one override can steer a whole model;
2. otherwise the first available backend in the device's priority order:
   CUDA tensors ``cuda > triton > reference``, CPU tensors ``cpu > reference``.

A forced backend that the op implements but cannot run here (no GPU, extension not
built, Triton without ``TRITON_INTERPRET=1`` on CPU tensors) raises ``RuntimeError``
with the reason — never a silent fallback.

A backend can also have limits on its inputs (:class:`wiola_kernels.validation.Limits`:
the CUDA GCLA kernels take d_h ∈ {64, 128} and no float64, for example). A backend
chosen — forced or by priority — for an input outside its limits is skipped: the next
backend in the device's priority order that takes the input runs, and a one-time
``RuntimeWarning`` names the skipped backend and the reason (the reference takes every
input). An op called directly with an explicit ``backend`` name the input does not fit
raises ``ValueError`` instead (:func:`resolve`). :func:`backends` lists every limit.

Under ``torch.compile`` the choice is made when Dynamo traces the call (it is a constant
of the graph, so the backward runs where the forward ran); entering a different
:func:`use_backend` block makes Dynamo retrace. ``WIOLA_BACKEND`` is read at trace time.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .validation import NO_LIMITS, Limits

BACKEND_NAMES = ("cuda", "triton", "cpu", "reference", "cuda_emu")
_PRIORITY = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("wiola_backend", default=None)
# The override as last set by use_backend, in a plain global: Dynamo cannot read a ContextVar,
# but it guards on a global it reads, so a compiled graph is retraced under another override.
_override_for_tracing: str | None = None


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
# op name -> backend name -> the inputs that backend takes.
_limits: dict[str, dict[str, Limits]] = {}


def register(op: str, backend: str, impl: object, limits: Limits = NO_LIMITS) -> None:
    """Declare that ``op`` has an implementation on ``backend``, taking the inputs ``limits`` allows."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    _registry.setdefault(op, {})[backend] = impl
    _limits.setdefault(op, {})[backend] = limits


def limits(op: str, backend: str) -> Limits:
    """What ``backend`` of ``op`` takes (dtypes, head widths)."""
    return _limits[op][backend]


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


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def reset_warnings() -> None:
    """Forget which fallback warnings were given (each is given once per process)."""
    _warned.clear()


def _select(op: str, device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> str:
    impls = _registry[op]
    forced = forced_backend()
    skipped: list[str] = []  # "backend: why" for each backend that cannot take this input
    if forced is not None and forced in impls:
        reason = BACKENDS[forced].unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"wiola: backend {forced!r} was requested for {op} but cannot run: {reason}")
        why = _limits[op][forced].reason(dtype, head_dim)
        if why is None:
            return forced
        skipped.append(f"{forced!r} cannot take {why}")
    chosen = "reference"  # takes every input
    for name in _PRIORITY.get(device.type, ("reference",)):
        if name == forced or name not in impls or BACKENDS[name].unavailable_reason(device) is not None:
            continue
        why = _limits[op][name].reason(dtype, head_dim)
        if why is None:
            chosen = name
            break
        skipped.append(f"{name!r} cannot take {why}")
    if skipped:
        _warn_once(f"wiola {op}: backend {'; '.join(skipped)}: running {chosen!r} instead")
    return chosen


def _constant_when_traced(fn):
    # What torch.compiler.assume_constant_result(fn) does, without importing Dynamo (seconds)
    # with the package: Dynamo calls fn for real while tracing and bakes its result in.
    fn._dynamo_marked_constant = True
    return fn


@_constant_when_traced
def _select_when_tracing(op: str, device: torch.device, dtype: torch.dtype | None, head_dim: int | None,
                         override: str | None) -> str:
    # Dynamo calls this for real and bakes the result into the graph; ``override`` is passed
    # only so that Dynamo guards on it (it is what _override holds in this thread).
    return _select(op, device, dtype, head_dim)


def select(op: str, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """Name of the backend that runs ``op`` on ``device`` now, for an input of ``dtype`` and
    head width ``head_dim`` (None: not checked). See the module docstring for the rules."""
    if torch.compiler.is_compiling():
        if head_dim is not None:
            head_dim = len(range(head_dim))  # a symbolic size becomes a Python int (Dynamo guards on it)
        return _select_when_tracing(op, device, dtype, head_dim, _override_for_tracing)
    return _select(op, device, dtype, head_dim)


def implementation(op: str, device: torch.device, dtype: torch.dtype | None = None,
                   head_dim: int | None = None) -> object:
    """The implementation namespace that :func:`select` picks."""
    return _registry[op][select(op, device, dtype, head_dim)]


def resolve(op: str, backend: str, device: torch.device, dtype: torch.dtype | None = None,
            head_dim: int | None = None) -> object:
    """The implementation a registered op runs: ``backend`` — the name its autograd.Function
    chose with :func:`select` and kept on ``ctx``, so that the backward runs where the forward
    ran — or :func:`implementation` for ``"auto"`` (an op called directly). A named backend
    that does not take this input raises ``ValueError``."""
    if backend == "auto":
        return implementation(op, device, dtype, head_dim)
    if backend not in _registry[op]:
        raise ValueError(f"backend must be 'auto' or one of {implemented(op)} for {op}, got {backend!r}")
    why = _limits[op][backend].reason(dtype, head_dim)
    if why is not None:
        raise ValueError(f"backend {backend!r} of {op} cannot take {why}")
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
    global _override_for_tracing
    token = _override.set(name)  # "auto" is stored too: it masks WIOLA_BACKEND
    _override_for_tracing = name
    try:
        yield
    finally:
        _override.reset(token)
        _override_for_tracing = _override.get()


class BackendStatus(str):
    """One entry of :func:`backends`: the string ``"available"`` or ``"unavailable: <why>"``,
    carrying the backend's input limits in ``.limits`` (shown by ``repr``)."""

    limits: Limits

    def __new__(cls, status: str, limits: Limits) -> "BackendStatus":
        self = super().__new__(cls, status)
        self.limits = limits
        return self

    def __repr__(self) -> str:
        return f"{str.__repr__(self)} (takes {self.limits.describe()})"


def backends(device: str | torch.device | None = None) -> dict[str, dict[str, BackendStatus]]:
    """What can run where: ``{op: {backend: "available" | "unavailable: <why>"}}``; each
    entry's ``.limits`` says which inputs that backend takes (dtypes, head widths; printed by
    ``repr`` and by ``python -m wiola_kernels backends``).

    ``device`` defaults to CUDA when a GPU is visible, else CPU. A bad ``WIOLA_BACKEND`` is
    a ``ValueError`` here, where the environment is read, not later inside an op.
    """
    forced_backend()  # validates WIOLA_BACKEND / use_backend
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    report: dict[str, dict[str, BackendStatus]] = {}
    for op in ops():
        report[op] = {}
        for name in implemented(op):
            reason = BACKENDS[name].unavailable_reason(device)
            status = "available" if reason is None else f"unavailable: {reason}"
            report[op][name] = BackendStatus(status, _limits[op][name])
    return report
