"""Benchmark cases, shared by ``python -m wiola_kernels bench`` and ``benchmarks/``.

A case names an op, builds its inputs on a device, and gives two callables that compute the
same thing: ``fused`` (the public op, on whatever backend dispatch picks) and ``eager``, the
op's formula from :mod:`wiola_kernels.reference` — one function that is the eager baseline
(timed in the case's dtype), what the ``torch.compile`` baseline compiles, and the oracle
that ``check`` runs in float64. No second eager copy of an op lives here.

Each registered op declares its cases where it lives, in ``bench_cases(device, size)`` of
``wiola_kernels/ops/<op>.py`` (the fields of :class:`BenchCase`), for a size of
:data:`wiola_kernels.shapes.BENCH_SIZES`: ``"small"`` (seconds; smoke tests, CI, ``check``),
``"default"`` (one case per op: what ``python -m wiola_kernels bench`` runs without options),
``"full"`` (every shape and dtype, ``bench --full``), and ``"tiny"``, what ``bench --overhead``
times (:mod:`wiola_kernels.bench.overhead`). :func:`all_cases` collects them from the registry,
so no op is named here; :func:`case_factory` adds cases of other kinds. Shapes live in
:mod:`wiola_kernels.shapes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from ..ops import op_modules

#: The sizes of a plan (see the module docstring); ``"tiny"`` is ``bench --overhead``'s alone.
SIZES = ("small", "default", "full")


@dataclass
class BenchCase:
    """One benchmark: an op at one shape and dtype."""

    op: str                                         # registry name: "rms_norm", "srpe", ... (at size "tiny":
                                                    # the public function's, "atm_merge", "atm_unmerge")
    shape: str                                      # human-readable, e.g. "x (16384, 1024)"
    dtype: torch.dtype
    make_inputs: Callable[[], tuple[torch.Tensor, ...]]  # fresh leaf tensors on the device
    fused: Callable[..., object]                    # the fused op
    eager: Callable[..., object]                    # the op's wiola_kernels.reference formula (see above)
    differentiable: Sequence[int] | None = None     # input indices that get gradients (default: float ones)
    min_bytes: Callable[[str, tuple, tuple, tuple], int] | None = None  # override of the byte count
    backward_rereads: Sequence[int] = ()             # inputs the backward must read again (bench byte count)
    notes: dict = field(default_factory=dict)       # extra numbers a case wants reported
    tolerance_kind: str = "elementwise"             # SPEC §9 class for `check`: elementwise|attention
    peak_memory: bool = False                       # also measure each variant's peak memory (runner.peak_mb)
    compute_bound: bool = False                     # bound by arithmetic (GEMMs), not memory: no copy baseline

    @property
    def oracle(self) -> Callable[..., object]:
        """What ``check`` compares with, in float64: the same reference function as ``eager``."""
        return self.eager

    def baseline_to_compile(self) -> Callable[..., object]:
        """The callable the ``torch.compile`` baseline compiles: the reference, as the eager baseline."""
        return self.eager


# ---- what a pass must move ---------------------------------------------------------------

def _tensors(obj) -> tuple[torch.Tensor, ...]:
    if isinstance(obj, torch.Tensor):
        return (obj,)
    if isinstance(obj, (tuple, list)):
        return tuple(t for o in obj for t in _tensors(o))
    return ()


def _nbytes(ts: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _differentiable(case: BenchCase, inputs: tuple) -> list[int]:
    if case.differentiable is not None:
        return list(case.differentiable)
    return [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def min_bytes(case: BenchCase, pass_: str, inputs: tuple) -> int:
    """The fewest bytes ``pass_`` must move (see the module docstring)."""
    with torch.no_grad():
        outputs = _tensors(case.fused(*inputs))
    if case.min_bytes is not None:
        return case.min_bytes(pass_, inputs, outputs, tuple(_differentiable(case, inputs)))
    total = _nbytes(_tensors(inputs)) + _nbytes(outputs)
    if pass_ == "fwd+bwd":
        float_outputs = [o for o in outputs if o.is_floating_point()]
        total += _nbytes(float_outputs) + _nbytes(inputs[i] for i in _differentiable(case, inputs))
        total += _nbytes(inputs[i] for i in case.backward_rereads)
    return total


def op_cases(device: torch.device | str, size: str) -> list[BenchCase]:
    """The cases every registered op declares (``bench_cases`` of its ``ops/<op>.py``) for
    ``device`` at ``size`` (one of :data:`wiola_kernels.shapes.BENCH_SIZES`), in registry order."""
    device = torch.device(device)
    return [BenchCase(**fields) for module in op_modules().values() for fields in module.bench_cases(device, size)]


_factories: list[Callable[[torch.device, str], list[BenchCase]]] = []


def case_factory(fn: Callable[[torch.device, str], list[BenchCase]]):
    """Register ``fn(device, size) -> [BenchCase, ...]`` (``size`` one of :data:`SIZES`): cases
    beyond the registered ops' own."""
    _factories.append(fn)
    return fn


def all_cases(device: torch.device | str, small: bool = False, ops: Sequence[str] | None = None,
              size: str | None = None) -> list[BenchCase]:
    """Every case for ``device`` (the registered ops', then :func:`case_factory`'s), optionally
    only the named ops.

    ``size`` is one of :data:`SIZES`; None means ``"small"`` if ``small`` else ``"full"``.
    """
    device = torch.device(device)
    size = size if size is not None else ("small" if small else "full")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    cases = op_cases(device, size) + [c for factory in _factories for c in factory(device, size)]
    if ops:
        known = sorted({c.op for c in cases})
        unknown = [o for o in ops if o not in known]
        if unknown:
            raise ValueError(f"--ops: unknown op(s) {unknown}; known: {known}")
        cases = [c for c in cases if c.op in ops]
    return cases
