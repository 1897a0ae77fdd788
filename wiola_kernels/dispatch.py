"""Which kernel runs an op.

**By default, PyTorch's dispatcher chooses.** Every op is declared once in C++ (beside its CPU
kernels, ``csrc/cpu/<op>.cpp``) as ``wiola::<op>`` and ``wiola::<op>_backward``, with one kernel per
dispatch key: the C++ kernels for CPU tensors, the CUDA kernels or Triton launchers for CUDA
tensors, a fake for tracing. An op's ``torch.autograd.Function`` calls
``torch.ops.wiola.<op>``, so a call costs one dispatcher lookup, as a native op does, and
nothing here runs on that path but :func:`forced_backend` (one ``ContextVar`` read).

**Forcing a backend** — for tests, benchmarks and ``python -m wiola_kernels check`` —
with :func:`use_backend` (per thread, innermost wins) or ``WIOLA_BACKEND`` (read when the
package is imported). The Function then calls that backend's functions directly, the ones
registered here with :func:`register`:

* ``reference`` — the plain-PyTorch oracle (every op, every input);
* ``cpu`` / ``cuda`` — the dispatcher's kernels of that device (``cuda`` on CPU tensors is
  an error, and so on); GCLA's ``cuda`` is its C++ composite of PyTorch's fused attention
  and our summary kernels;
* ``triton`` — the Triton launchers, also on CPU tensors in Triton's interpreter
  (``TRITON_INTERPRET=1`` set before import);
* ``cuda_emu`` — the CUDA C++ kernels run on CPU tensors by the SIMT emulator
  (``csrc/cuda/emu``; GCLA's C++ composite too, around PyTorch's CPU flash attention); a test
  backend, never chosen by default.

An op that does not implement the forced backend keeps its default (``use_backend("cuda")``
still runs RMSNorm on its Triton kernel), so one override can steer a whole model. A forced
backend the op implements but that cannot run here (no GPU, no extension, Triton without
the interpreter on CPU tensors) raises ``RuntimeError`` with the reason. A backend whose
kernels do not take the input (:class:`~wiola_kernels.validation.Limits`: dtypes, head
widths) is skipped for the next one in the device's priority order — CUDA tensors
``cuda > triton > reference``, CPU tensors ``cpu > reference`` — with a one-time
``RuntimeWarning`` naming the reason. The backward always runs on the forward's backend
(the Function keeps the name), even outside the ``use_backend`` block.

Under ``torch.compile`` the forced backend is a constant of the graph: Dynamo reads
:data:`_override_for_tracing` (the override last set by :func:`use_backend`) and guards on
it, so entering another ``use_backend`` block retraces.

Without the C++ extension there are no registered ops: every op runs its Python backends
as if forced — Triton on CUDA tensors, the reference on CPU tensors.
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
#: Without the extension: the Python backends in priority order, per device type.
_PYTHON_PRIORITY = {"cuda": ("triton", "reference"), "cpu": ("reference",)}
#: What :func:`forced_backend` returns when the extension is missing (see the module docstring).
PYTHON_DEFAULT = "auto"


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

# op name -> backend name -> its functions (a namespace, the same names for every backend).
_registry: dict[str, dict[str, object]] = {}
# op name -> backend name -> the inputs that backend takes.
_limits: dict[str, dict[str, Limits]] = {}


def register(op: str, backend: str, kernels: object, limits: Limits = NO_LIMITS) -> None:
    """Declare that ``op`` runs on ``backend`` through ``kernels`` (a namespace of functions with
    the op's signatures), taking the inputs ``limits`` allows."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    _registry.setdefault(op, {})[backend] = kernels
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


def kernels(op: str, backend: str) -> object:
    """The functions of ``backend`` for ``op`` (a name :func:`resolve` returned)."""
    return _registry[op][backend]


# --- the override ----------------------------------------------------------------------------

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("wiola_backend", default=None)
# The override as last set by use_backend, in a plain global: Dynamo cannot read a ContextVar,
# but it guards on a global it reads, so a compiled graph is retraced under another override.
_override_for_tracing: str | None = None


def _check_name(name: str, source: str) -> str:
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"WIOLA_BACKEND / use_backend must name one of {BACKEND_NAMES} or 'auto', got {name!r} "
                         f"(from {source})")
    return name


def _extension_missing() -> bool:
    from . import _extension

    return _extension.load_error() is not None


# What an unforced call runs: None (the dispatcher) or, without the extension, PYTHON_DEFAULT.
_unforced: str | None = None
# WIOLA_BACKEND when the package was imported (a bad name raises then, and again from backends()).
_environment: str | None = None
_environment_error: ValueError | None = None


def reload_environment() -> None:
    """Read ``WIOLA_BACKEND`` again (it is read once, when the package is imported) and whether
    the extension loaded. A bad name raises ``ValueError`` here and from :func:`backends`."""
    global _unforced, _environment, _environment_error
    _unforced = PYTHON_DEFAULT if _extension_missing() else None
    env = os.environ.get("WIOLA_BACKEND", "").strip()
    try:
        _check_name(env or "auto", "the environment variable WIOLA_BACKEND")
        _environment_error = None
    except ValueError as exc:
        _environment_error = exc
    _environment = _unforced if env in ("", "auto") else env


def check_environment() -> None:
    """Raise the ``ValueError`` of a bad ``WIOLA_BACKEND`` (read when the package was imported)."""
    if _environment_error is not None:
        raise _environment_error


def forced_backend() -> str | None:
    """The backend forced by :func:`use_backend` or ``WIOLA_BACKEND``: None when the
    dispatcher chooses (the default path, one ContextVar read); :data:`PYTHON_DEFAULT` when
    the extension is missing. Pass the name to :func:`resolve`."""
    if torch.compiler.is_compiling():
        name = _override_for_tracing
    else:
        name = _override.get()
    if name is None:
        return _environment
    return _unforced if name == "auto" else name


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def reset_warnings() -> None:
    """Forget which fallback warnings were given (each is given once per process)."""
    _warned.clear()


def _constant_when_traced(fn):
    # What torch.compiler.assume_constant_result(fn) does, without importing Dynamo (seconds)
    # with the package: Dynamo calls fn for real while tracing and bakes its result in.
    fn._dynamo_marked_constant = True
    return fn


@_constant_when_traced
def resolve(op: str, forced: str, device: torch.device, dtype: torch.dtype | None = None,
            head_dim: int | None = None) -> str:
    """The backend that runs ``op`` when ``forced`` (from :func:`forced_backend`, not None) is
    forced, for an input on ``device`` of ``dtype`` and head width ``head_dim`` (None: not
    checked). See the module docstring for the rules; a constant under ``torch.compile``."""
    if forced != PYTHON_DEFAULT and forced not in BACKENDS:  # a bad WIOLA_BACKEND
        check_environment()
    impls = _registry[op]
    skipped: list[str] = []  # "backend: why" for each backend that cannot take this input
    if forced != PYTHON_DEFAULT and forced in impls:
        reason = BACKENDS[forced].unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"wiola: backend {forced!r} was requested for {op} but cannot run: {reason}")
        why = _limits[op][forced].reason(dtype, head_dim)
        if why is None:
            return forced
        skipped.append(f"{forced!r} cannot take {why}")
    table = _PYTHON_PRIORITY if forced == PYTHON_DEFAULT else _PRIORITY
    chosen = "reference"  # takes every input
    for name in table.get(device.type, ("reference",)):
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


# op name -> device type -> the backend its registered kernel for that device is.
_defaults: dict[str, dict[str, str]] = {}


def register_default(op: str, device_type: str, backend: str) -> None:
    """Declare that the dispatcher's kernel of ``op`` for ``device_type`` tensors is ``backend``'s."""
    _defaults.setdefault(op, {})[device_type] = backend


def default_backend(op: str, device: torch.device) -> str:
    """The backend whose kernel ``op`` runs on ``device`` when nothing is forced."""
    return _defaults.get(op, {}).get(device.type, "reference")


def select(op: str, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """Name of the backend that runs ``op`` on ``device`` now, for an input of ``dtype`` and head
    width ``head_dim`` (for reports and tests: the ops themselves call :func:`forced_backend`
    and, only when something is forced, :func:`resolve`)."""
    forced = forced_backend()
    return resolve(op, default_backend(op, device) if forced is None else forced, device, dtype, head_dim)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every op that implements backend ``name`` to use it inside the block (this thread).

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

    ``device`` defaults to CUDA when a GPU is visible, else CPU. A bad ``WIOLA_BACKEND`` is a
    ``ValueError`` here (and when the package is imported).
    """
    check_environment()
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
