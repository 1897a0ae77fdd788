"""Timing of benchmark cases: fused vs eager vs ``torch.compile`` of a baseline, in one process.

A run follows a :class:`BenchPlan` (:func:`make_plan`): ``default`` (what ``python -m
wiola_kernels bench`` runs without options: one case per registered op, both passes, in
minutes), ``full`` (``--full``: every shape and dtype of :mod:`.cases`) or ``small`` (smoke
tests). :func:`run_plan` prints a :class:`StreamTable` as it goes: a fixed header, then each
row's cells the moment they are measured (the fused and eager cells before torch.compile
has compiled its baseline), and returns the :class:`Record` of every row.

Every timing has a budget (``budget_s``, ``bench --budget``): one variant of one pass,
warm-up and compiling included. A variant whose first run does not finish within it, or
whose warm-up shows that its timed runs would end past it, is not timed: its cell reads
``> N s, skipped (reason)`` and the run goes on (:class:`BudgetExceeded`). Where the runner
is Python's main thread on a POSIX system a timer interrupts a run at the budget (between
two PyTorch calls: a single long kernel call still finishes first); elsewhere only the
projection from the warm-up applies.

One function times a pass: :func:`time_pass` (:data:`PassTimer` is its signature). Another
timer with that signature — say one reading CUDA events — is given to :func:`run_case` /
:func:`run_plan` as ``timer``; it times the ``ms`` of all three variants. The copy
baseline of ``pct_of_copy`` and the alternating timing of compute-bound cases on the CPU
(below) are the two places that time by wall clock themselves.

Every pass is timed as the median of ``repeats`` runs after warm-up. ``fwd`` runs
under ``torch.no_grad``; ``fwd+bwd`` runs the forward with gradients and
``torch.autograd.grad`` with random output gradients (never ones or zeros).

Bandwidth: ``gbps`` counts the fewest bytes the pass must move — each input read
once and each output written once (for ``fwd+bwd``: inputs, output gradients,
outputs and input gradients, plus the inputs the backward needs again, the case's
``backward_rereads``: the backward runs after the forward has finished, and an input
larger than the caches has left them by then). ``copy_gbps`` is a copy of the same byte count that
allocates its output like the ops do (:func:`copy_baseline`), and ``pct_of_copy`` says
how close the pass is to the memory limit. Two things made that ratio move between runs
while the ops did not, and both are pinned here:

* Pages. glibc hands out an allocation of 32 MiB or more as fresh pages (mmap; every page
  faults and is zeroed on first touch, which on this VM costs as much as the copy itself),
  while a smaller one may reuse freed, already-mapped pages — by a threshold that moves with
  the allocation history. An op writing a 32 + 8 MiB pair of outputs and a copy writing one
  40 MiB buffer then paid for different pages. :func:`page_policy` fixes the rule for op and
  copy alike: ``warm`` (freed memory is kept and reused: the steady state of a training
  loop; ``pct_of_copy``) and ``fresh`` (every large output is newly mapped:
  ``pct_of_copy_fresh``). The full plan reports both on the CPU; the default plan ``warm``.
* Load. The machine is shared; the op and the copy are timed in alternation, and on one
  CPU thread ``pct_of_copy`` is the median over pairs of the ratio of their CPU times (a
  process waiting for a core accrues none); with more threads, of their wall times (idle
  OpenMP workers spin, which CPU time counts; see :func:`time_vs_copy`). ``ms``, ``gbps`` and
  ``copy_gbps`` stay wall-time medians, so on a loaded machine ``pct_of_copy`` need not
  equal ``gbps / copy_gbps``.

A case marked ``compute_bound`` (its time is GEMMs, not memory traffic) has no copy
baseline: on the CPU its fused pass and the two baselines are timed in alternation (the
order flipped every round), so that their ratios see the same machine load — timed one
after the other, seconds-long passes on this shared VM moved by 10–25 % between the blocks
of runs — and the copy fields are None. (On CUDA each variant goes through the timer.)

Peak memory (cases marked ``peak_memory``): after the timings, each variant's pass runs once
more under :func:`peak_mb` — on CUDA ``torch.cuda.max_memory_allocated`` above what was
allocated before the pass; on the CPU the growth of the process's peak resident set over the
pass (``VmHWM`` reset through ``/proc/self/clear_refs`` after ``malloc_trim``), i.e. every
page the pass touched above what was resident before it, the GEMM libraries' own buffers
included. The inputs are excluded, the outputs and gradients included (for every variant).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, TextIO

import torch

from .. import dispatch
from . import device_time
from .cases import BenchCase, _differentiable, _nbytes, _tensors, all_cases, min_bytes
from .memory import peak_mb

PASSES = ("fwd", "fwd+bwd")
VARIANTS = ("fused", "eager", "compile")
PAGE_POLICIES = ("warm", "fresh")
MIN_COPY_PAIRS = 20  # op/copy pairs behind pct_of_copy in the full plan, whatever --repeats says
DEFAULT_BUDGET_S = 30.0  # per timing: one variant of one pass, warm-up and compiling included
PLANS = ("default", "full", "small")


@dataclass
class Record:
    """One row of results (the keys of ``--json`` records). A timing that ran past its budget
    is None, with the reason in ``skipped`` (variant → reason)."""

    op: str
    backend: str
    shape: str
    dtype: str
    pass_: str
    ms: float | None
    ms_eager: float | None
    ms_compile: float | None
    speedup_vs_eager: float | None
    speedup_vs_compile: float | None
    gbps: float | None
    copy_gbps: float | None   # None: a compute-bound case (no copy baseline)
    pct_of_copy: float | None
    bytes: int
    extra: dict
    # The same as ms/gbps/copy_gbps/pct_of_copy with every large output on fresh pages
    # (CPU, full plan only; None on CUDA, whose caching allocator always reuses memory).
    ms_fresh: float | None = None
    gbps_fresh: float | None = None
    copy_gbps_fresh: float | None = None
    pct_of_copy_fresh: float | None = None
    # Peak memory of the pass in MiB (cases marked peak_memory; see the module docstring).
    peak_mb: float | None = None
    peak_mb_eager: float | None = None
    peak_mb_compile: float | None = None
    skipped: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        out["pass"] = out.pop("pass_")
        out.update(out.pop("extra"))
        return out


# ---- budgets ----------------------------------------------------------------------------------

class BudgetExceeded(Exception):
    """A timing that would run past its budget; ``str()`` is the table cell,
    ``> {budget_s} s, skipped ({reason})``. ``first_run``: the first run itself (for the
    compile baseline: compiling) did not finish within the budget."""

    def __init__(self, budget_s: float, reason: str, first_run: bool = False):
        super().__init__(f"> {budget_s:g} s, skipped ({reason})")
        self.budget_s, self.reason, self.first_run = budget_s, reason, first_run


class _Overrun(BaseException):
    """Raised by the SIGALRM handler into a run that passed its deadline. A BaseException, so
    that no ``except Exception`` inside PyTorch (Dynamo, autograd) swallows it on the way up."""


def _can_interrupt() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`_Overrun` in the block once ``seconds`` have passed (None: never).

    Uses ``SIGALRM`` (main thread, POSIX; elsewhere a no-op): Python runs the handler between
    bytecodes, so a run stops at its next PyTorch call. The previous handler is put back, and
    a timer that was already running is re-armed with what was left of it.
    """
    if seconds is None or not _can_interrupt():
        yield
        return

    def on_alarm(signum, frame):
        raise _Overrun()

    start = time.monotonic()
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 1e-3), outer_interval)


def _seconds(s: float) -> str:
    return f"{s:.2g} s" if s < 10 else f"{s:.0f} s"


# Least seconds of warm-up runs before a timing: two calls of a 1 ms pass did not reach the
# steady state (ATM's forward took 7.5 ms for its first four calls, then 1; the bench's median
# of 5 read 2 to 13 ms from one run to the next).
WARMUP_S = 0.2


def warm_up(run: Callable[[], object], device: torch.device, warmup: int, repeats: int,
            budget_s: float | None, min_s: float = 0.0) -> float:
    """Run ``run()`` ``warmup`` (≥ 1) times, and on until ``min_s`` seconds have passed; the
    seconds of the last run. Raises :class:`BudgetExceeded` when a run does not finish within
    ``budget_s`` or when ``repeats`` more runs of the last one's length would end past it."""
    start = time.perf_counter()
    last, i = 0.0, 0
    try:
        with deadline(budget_s):
            while i < max(1, warmup) or time.perf_counter() - start < min_s:
                t0 = time.perf_counter()
                run()
                _sync(device)
                last = time.perf_counter() - t0
                i += 1
    except _Overrun:
        which = "the first run" if i == 0 else f"warm-up run {i + 1}"
        raise BudgetExceeded(budget_s, f"{which} unfinished at {_seconds(budget_s)}", first_run=i == 0) from None
    elapsed = time.perf_counter() - start
    if budget_s is not None and elapsed + repeats * last > budget_s:
        raise BudgetExceeded(budget_s, f"one run takes {_seconds(last)}: {repeats} timed runs would end at "
                                       f"{_seconds(elapsed + repeats * last)}")
    return last


class PassTimer(Protocol):
    """The signature of :func:`time_pass`: ``timer(run, device, repeats, budget_s) -> ms``."""

    def __call__(self, run: Callable[[], object], device: torch.device, repeats: int,
                 budget_s: float | None) -> float: ...


def time_pass(run: Callable[[], object], device: torch.device, repeats: int, budget_s: float | None, *,
              warmup_s: float | None = None) -> float:
    """Median wall time in milliseconds of ``repeats`` calls of ``run()`` (one pass of one
    variant), after warm-up calls (two, and at least :data:`WARMUP_S` seconds of them) — the
    function that times a pass (:data:`PassTimer`).

    Args:
        run: a zero-argument callable running the pass (:func:`make_pass`); its first call
            may compile (the ``torch.compile`` baseline), which counts against the budget.
        device: where ``run`` computes; a CUDA device is synchronized after each call.
        repeats: timed calls behind the median.
        budget_s: seconds the whole timing may take, warm-up included (None: unlimited).
        warmup_s: least seconds of warm-up (None: :data:`WARMUP_S`; 0: the two calls alone).

    Returns:
        The median in milliseconds.

    Raises:
        BudgetExceeded: the warm-up did not finish within ``budget_s``, or showed that the
            timed calls would end past it, or they did not.
    """
    start = time.perf_counter()
    warm_up(run, device, 2, repeats, budget_s, min_s=WARMUP_S if warmup_s is None else warmup_s)
    samples: list[float] = []
    left = None if budget_s is None else budget_s - (time.perf_counter() - start)
    try:
        with deadline(left):
            for _ in range(repeats):
                t0 = time.perf_counter()
                run()
                _sync(device)
                samples.append((time.perf_counter() - t0) * 1e3)
    except _Overrun:
        raise BudgetExceeded(budget_s, f"{len(samples)} of {repeats} timed runs done at "
                                       f"{_seconds(budget_s)} (the machine slowed down?)") from None
    return statistics.median(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved_ms(fns: list[Callable[[], object]], device: torch.device, repeats: int = 10,
                        warmup: int = 2) -> list[float]:
    """Median times of several callables run in alternation (a, b, a, b, ...), so that
    each sees the same machine load."""
    return [statistics.median(s) for s in _interleaved_samples(fns, device, repeats, warmup)]


def _interleaved_samples(fns: list[Callable[[], object]], device: torch.device, repeats: int, warmup: int,
                         before: Callable[[], object] | None = None, cpu_times: list[list[float]] | None = None
                         ) -> list[list[float]]:
    """Wall times (ms) of ``fns`` run in alternation, the order flipped every round; with
    ``cpu_times``, the process's CPU times (ms, all threads, user + system) are appended there."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    _sync(device)
    samples: list[list[float]] = [[] for _ in fns]
    if cpu_times is not None:
        cpu_times[:] = [[] for _ in fns]
    for r in range(repeats):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))  # no fixed "runs first"
        for i in order:
            if before is not None:
                before()
            c0, t0 = time.process_time(), time.perf_counter()
            fns[i]()
            _sync(device)
            samples[i].append((time.perf_counter() - t0) * 1e3)
            if cpu_times is not None:
                cpu_times[i].append((time.process_time() - c0) * 1e3)
    return samples


def time_vs_copy(op: Callable[[], object], copy: Callable[[], object], device: torch.device, repeats: int = 10,
                 warmup: int = 2, before: Callable[[], object] | None = None) -> tuple[float, float, float]:
    """``(op ms, copy ms, copy/op time ratio)``: the op and its copy baseline in alternation
    (``before()``, untimed, ahead of each run), wall-time medians, and the median over pairs
    of the ratio of their times. On the CPU with one thread the ratio is of CPU time (page
    faults included), which leaves out the time the process waited for a core: on a shared
    machine that wait swamps everything else (measured: 8 ms of CPU time in 48 ms of wall
    time at a load average of 12 on 2 cores). With more threads it is of wall time, as on a
    GPU: idle OpenMP workers spin after each parallel region and that spinning counts as
    CPU time, more for short ops (measured, 2 threads on a quiet machine: SRPE fwd 17–55 %
    of copy by CPU time, 41–67 % by wall time, five runs)."""
    cpu: list[list[float]] = []
    by_cpu_time = device.type == "cpu" and torch.get_num_threads() == 1
    op_ms, copy_ms = _interleaved_samples([op, copy], device, repeats, warmup, before,
                                          cpu if by_cpu_time else None)
    ratio_of = cpu if by_cpu_time else [op_ms, copy_ms]
    ratios = [c / o for o, c in zip(*ratio_of) if o > 0 and c > 0]
    return statistics.median(op_ms), statistics.median(copy_ms), statistics.median(ratios) if ratios else float("nan")


def _libc():
    """glibc's ``mallopt`` and ``malloc_trim``, or None (another C library: pages stay as it decides)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters


@contextlib.contextmanager
def page_policy(policy: str, device: torch.device) -> Iterator[Callable[[], None]]:
    """Pin where the CPU allocator puts outputs inside the block (glibc; elsewhere a no-op).

    Yields a ``before()`` to call, untimed, ahead of each timed run. ``warm``: no allocation
    is mmapped and freed memory is never returned to the system, so each call's outputs
    reuse the already-faulted pages of the previous call's (``before`` does nothing).
    ``fresh``: ``before`` returns every free page to the system (``malloc_trim(0)``, which
    also drops the pages of free chunks inside the heap), so each call faults in and
    zeroes new pages for its outputs, wherever malloc puts them. Afterwards glibc's
    defaults are set back (as fixed values) and free memory is returned.
    """
    if policy not in PAGE_POLICIES:
        raise ValueError(f"policy must be one of {PAGE_POLICIES}, got {policy!r}")
    libc = _libc() if device.type == "cpu" else None
    if libc is None:
        yield lambda: None
        return
    if policy == "warm":
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    try:
        yield (lambda: None) if policy == "warm" else (lambda: libc.malloc_trim(0))
    finally:
        libc.mallopt(_M_MMAP_MAX, 65536)
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)


def make_pass(case: BenchCase, fn: Callable[..., object], pass_: str, inputs: tuple) -> Callable[[], object]:
    """A zero-argument callable running ``fn`` (the case's fused op, its eager baseline or a
    compiled baseline) for one pass on fixed inputs. For ``fwd+bwd`` the output gradients
    are drawn for the shapes of ``case.fused``'s outputs, which every variant shares."""
    if pass_ == "fwd":
        def run_fwd():
            with torch.no_grad():
                return fn(*inputs)
        return run_fwd
    diff = _differentiable(case, inputs)
    leaves = tuple(t.detach().requires_grad_(i in diff) if isinstance(t, torch.Tensor) and t.is_floating_point()
                   else t for i, t in enumerate(inputs))
    with torch.no_grad():  # output shapes, from the fused op: a baseline may be slow or compile here
        probe = _tensors(case.fused(*inputs))
    g = torch.Generator(device="cpu").manual_seed(0)
    grad_outputs = [torch.randn(o.shape, generator=g).to(o) if o.is_floating_point() else None for o in probe]
    wrt = [leaves[i] for i in diff]

    def run_fwd_bwd():
        outs = [o for o in _tensors(fn(*leaves))]
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        return torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    return run_fwd_bwd


def copy_baseline(nbytes: int, device: torch.device) -> tuple[Callable[[], object], int]:
    """A same-size copy moving ``nbytes`` (nbytes/2 read + nbytes/2 written), and its byte count.

    The copy allocates its output, as every op here does. On the CPU it is the
    extension's ``wiola::_copy``, whose output is allocated exactly like the kernels'
    (with the huge-page hint); without the extension, ``Tensor.clone``. Where the output's
    pages come from is :func:`page_policy`'s business, the same for the copy and the op.
    """
    n = max(1, nbytes // 2 // 4)
    src = torch.randn(n, generator=torch.Generator(device="cpu").manual_seed(0)).to(device)
    if device.type == "cpu" and hasattr(torch.ops.wiola, "_copy") and dispatch.BACKENDS["cpu"].unavailable_reason(
            device) is None:
        return (lambda: torch.ops.wiola._copy(src)), 2 * n * 4
    return (lambda: src.clone()), 2 * n * 4


# ---- the streaming table ----------------------------------------------------------------------

class StreamTable:
    """The table a run prints while it measures: a fixed header, then each cell of a row as
    soon as it is known (flushed), the row ending with the case's shape.

    A skipped timing's cell is its :class:`BudgetExceeded` text, ``> N s, skipped (reason)``,
    wider than the column (the rest of that row shifts right).
    """

    COLUMNS = (("op", 20, "<"), ("dtype", 8, "<"), ("pass", 7, "<"), ("ms", 9, ">"), ("GB/s", 6, ">"),
               ("% copy", 6, ">"), ("eager ms", 9, ">"), ("x eager", 7, ">"), ("compile ms", 10, ">"),
               ("x compile", 9, ">"), ("shape", 0, "<"))

    def __init__(self, out: TextIO | None = None):
        self.out = out if out is not None else sys.stdout
        self._next = len(self.COLUMNS)
        header = self._join(name for name, _, _ in self.COLUMNS)
        self._write(header + "\n" + "-" * len(header) + "\n")

    def _join(self, cells: Iterable[str]) -> str:
        return "  ".join(format(c, f"{align}{width}") for c, (_, width, align) in zip(cells, self.COLUMNS)).rstrip()

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def begin(self, op: str, dtype: str, pass_: str) -> None:
        """Start a row (ending an unfinished one)."""
        if self._next < len(self.COLUMNS):
            self._write("\n")
        self._next = 0
        for text in (op, dtype, pass_):
            self.put(text)

    def put(self, text: str) -> None:
        """Print the next cell of the row."""
        _, width, align = self.COLUMNS[self._next]
        self._write(("" if self._next == 0 else "  ") + format(text, f"{align}{width}"))
        self._next += 1
        if self._next == len(self.COLUMNS):
            self._write("\n")


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


# ---- one case ---------------------------------------------------------------------------------

@dataclass
class _PassResult:
    timings: dict = field(default_factory=dict)    # variant -> ms or None
    skipped: dict = field(default_factory=dict)    # variant -> reason
    cells: dict = field(default_factory=dict)      # variant -> table cell
    peaks: dict = field(default_factory=dict)
    vs_copy: dict = field(default_factory=dict)    # page policy -> (op ms, copy ms, ratio)
    copy_bytes: int = 0


def _skip(label: str, exc: BudgetExceeded, result: _PassResult) -> None:
    """Record ``label`` as skipped (its cell: the budget and the reason)."""
    reason = exc.reason + ("; compiling counts" if label == "compile" and exc.first_run else "")
    result.timings[label], result.skipped[label] = None, reason
    result.cells[label] = str(BudgetExceeded(exc.budget_s, reason))


def _time_variant(label: str, run: Callable[[], object], device: torch.device, repeats: int,
                  budget_s: float | None, timer: PassTimer, result: _PassResult) -> BudgetExceeded | None:
    """Time one variant into ``result``; the :class:`BudgetExceeded` when it was skipped."""
    try:
        # The warm page policy, as for the op/copy pairs and the alternating timings: otherwise
        # the first cases of a process pay for fresh pages while glibc's threshold settles
        # (add_rms_norm's fwd read 3 to 37 ms from one run of the default bench to the next).
        with page_policy("warm", device):
            ms = timer(run, device, repeats, budget_s)
    except BudgetExceeded as exc:
        _skip(label, exc, result)
        return exc
    except Exception as exc:  # noqa: BLE001 - e.g. an Inductor compile error: reported, the run goes on
        return _failed(label, exc, result)
    result.timings[label], result.cells[label] = ms, f"{ms:.3f}"
    return None


def _failed(label: str, exc: Exception, result: _PassResult) -> BudgetExceeded:
    """Record ``label`` as failed (its cell: ``failed (ErrorType)``, the message in ``skipped``);
    returned as a first-run overrun, so that a baseline that cannot compile is not tried again."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:200]
    result.timings[label] = None
    result.skipped[label] = f"failed: {type(exc).__name__}: {first_line}"
    result.cells[label] = f"failed ({type(exc).__name__})"
    return BudgetExceeded(0, result.skipped[label], first_run=True)


def _alternating(runs: dict, device: torch.device, repeats: int, budget_s: float | None,
                 result: _PassResult, warmup_s: float = 0.0) -> dict[str, BudgetExceeded]:
    """A compute-bound case on the CPU: each variant warmed up alone (within its budget, for
    at least ``warmup_s``), then the ones that fit timed in alternation, so that their ratios
    see the same load. Returns the variants skipped and why."""
    kept, skipped = {}, {}
    for label, run in runs.items():
        try:
            with page_policy("warm", device):  # the pages the timed rounds will reuse
                warm_up(run, device, 2, repeats, budget_s, min_s=warmup_s)
            kept[label] = run
        except BudgetExceeded as exc:
            _skip(label, exc, result)
            skipped[label] = exc
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            skipped[label] = _failed(label, exc, result)
    if not kept:
        return skipped
    total = None if budget_s is None else budget_s * len(kept)
    try:
        with page_policy("warm", device), deadline(total):
            medians = time_interleaved_ms(list(kept.values()), device, repeats=repeats, warmup=0)
    except _Overrun:
        for label in kept:
            skipped[label] = BudgetExceeded(total, f"{repeats} alternating rounds unfinished at {_seconds(total)}")
            _skip(label, skipped[label], result)
        return skipped
    for label, ms in zip(kept, medians):
        result.timings[label], result.cells[label] = ms, f"{ms:.3f}"
    return skipped


def time_alternating(runs: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                     budget_s: float | None) -> tuple[dict[str, float], dict[str, str]]:
    """Time ``runs`` in alternation within budgets, as :func:`run_case` times a compute-bound
    case on the CPU: each run warmed up alone (two runs, within ``budget_s``, and skipped when
    ``repeats`` more would end past it), then the ones that fit run ``repeats`` rounds in
    alternation (the order flipped every round, freed memory kept: :func:`page_policy`
    ``warm``) within ``budget_s`` times their number.

    Returns ``(ms, skipped)``: the median milliseconds of each run timed, and for each other
    one why not: its table cell ``> N s, skipped (reason)``, or ``failed: Error: message``
    when it raised. (Used by ``python -m wiola bench --full`` for its model steps.)
    """
    result = _PassResult()
    _alternating(runs, device, repeats, budget_s, result)
    ms = {label: t for label, t in result.timings.items() if t is not None}
    skipped = {label: result.cells[label] if not why.startswith("failed") else why
               for label, why in result.skipped.items()}
    return ms, skipped


def _peak(run: Callable[[], object], device: torch.device, budget_s: float | None) -> float | None:
    try:
        with deadline(budget_s):
            return peak_mb(run, device)
    except _Overrun:
        return None


def run_case(case: BenchCase, device: torch.device, *, repeats: int = 10, compile: bool = True,
             passes: Iterable[str] = PASSES, budget_s: float | None = DEFAULT_BUDGET_S,
             page_policies: Iterable[str] = PAGE_POLICIES, copy_pairs: int = MIN_COPY_PAIRS,
             table: StreamTable | None = None, timer: PassTimer = time_pass) -> list[Record]:
    """Time one case for each pass; one :class:`Record` per pass.

    Args:
        case: the case (:mod:`.cases`).
        device: where its inputs live.
        repeats: timed runs per variant (the median).
        compile: also time ``torch.compile`` of the case's reference (compiled lazily: its
            first run, in this case's first pass, compiles).
        passes: a subset of :data:`PASSES`.
        budget_s: seconds per timing (one variant of one pass, warm-up and compiling
            included; None: unlimited); see the module docstring.
        page_policies: the CPU page policies the fused op and its copy are timed under
            (``warm`` always; ``fresh`` adds the ``*_fresh`` fields).
        copy_pairs: op/copy pairs behind ``pct_of_copy`` (at least ``repeats``).
        table: where to print each cell as it is measured (None: nothing printed).
        timer: the function that times a pass (:func:`time_pass`, or one with its signature).

    Returns:
        One record per pass, in ``passes``' order.
    """
    policies = tuple(p for p in PAGE_POLICIES if p == "warm" or p in tuple(page_policies)) \
        if device.type == "cpu" and not case.compute_bound else ("warm",)
    inputs = case.make_inputs()
    compiled = torch.compile(case.baseline_to_compile(), dynamic=False) if compile else None
    backend = dispatch.select(case.op, device) if case.op in dispatch.ops() else "-"
    dtype = str(case.dtype).replace("torch.", "")
    records = []
    compile_skipped: tuple[str, str] | None = None  # (cell, reason) for the passes after a failed compile
    for pass_ in passes:
        if table is not None:
            table.begin(case.op, dtype, pass_)
        result = _PassResult()
        nbytes = min_bytes(case, pass_, inputs)
        variants = {"fused": case.fused, "eager": case.eager, "compile": compiled}
        runs = {label: make_pass(case, fn, pass_, inputs) for label, fn in variants.items() if fn is not None}
        if compile_skipped is not None:  # compiling an earlier pass failed or overran: this one would too
            result.timings["compile"] = None
            result.cells["compile"], result.skipped["compile"] = compile_skipped
            runs.pop("compile", None)
        alternate = case.compute_bound and device.type == "cpu"
        skipped = _alternating(runs, device, repeats, budget_s, result, WARMUP_S) if alternate else {}
        for label in VARIANTS:
            if label in runs and not alternate:
                skipped[label] = _time_variant(label, runs[label], device, repeats, budget_s, timer, result)
                if skipped[label] is None and label == "fused" and not case.compute_bound:
                    _time_vs_copy(runs[label], nbytes, device, policies, max(repeats, copy_pairs), budget_s, result)
            if table is not None:
                _put_cells(table, label, result, nbytes)
        if compile_skipped is None and result.skipped.get("compile", "").startswith("failed"):
            compile_skipped = ("failed (as in " + pass_ + ")", f"compiling the {pass_} pass failed")
        elif compile_skipped is None and skipped.get("compile") is not None and skipped["compile"].first_run:
            why = f"compiling the {pass_} pass ran past the budget"
            compile_skipped = (str(BudgetExceeded(budget_s, why)), why)
        if case.peak_memory:
            result.peaks = {label: _peak(run, device, budget_s) for label, run in runs.items()
                            if result.timings.get(label) is not None}
        if table is not None:
            table.put(case.shape)
        # On CUDA, the fused pass's device time and a same-size copy's (bench/device_time.py): CUDA
        # events around graph replays; extra record fields device_ms, device_pct_of_copy, ...
        device_fields = device_time.record_fields(case, pass_, nbytes, device) if device.type == "cuda" else {}
        records.append(_record(case, backend, dtype, pass_, nbytes, result, device_fields))
    return records


def _time_vs_copy(run: Callable[[], object], nbytes: int, device: torch.device, policies: tuple[str, ...],
                  pairs: int, budget_s: float | None, result: _PassResult) -> None:
    """The fused op in alternation with a same-size copy, per page policy, into ``result.vs_copy``
    (within the budget; past it the copy fields stay None)."""
    copy_fn, result.copy_bytes = copy_baseline(nbytes, device)
    try:
        with deadline(budget_s):
            for policy in policies:
                with page_policy(policy, device) as before:
                    result.vs_copy[policy] = time_vs_copy(run, copy_fn, device, repeats=pairs, before=before)
    except _Overrun:
        result.skipped["copy"] = f"the comparison with a copy unfinished at {_seconds(budget_s)}"
        result.vs_copy.clear()


def _put_cells(table: StreamTable, label: str, result: _PassResult, nbytes: int) -> None:
    """Print ``label``'s cells: ms, GB/s and % copy for the fused op; ms and speedup for a baseline."""
    ms = result.timings.get(label)
    table.put(result.cells.get(label, "-"))
    fused = result.timings.get("fused")
    if label == "fused":
        table.put(_fmt(None if ms is None else nbytes / (ms * 1e-3) / 1e9, ".1f"))
        warm = result.vs_copy.get("warm")
        table.put(_fmt(None if warm is None else 100.0 * nbytes / result.copy_bytes * warm[2], ".0f", "%"))
    else:
        table.put(_fmt(None if ms is None or fused is None else ms / fused, ".2f"))


def _record(case: BenchCase, backend: str, dtype: str, pass_: str, nbytes: int, result: _PassResult,
            device_fields: dict) -> Record:
    t = {label: result.timings.get(label) for label in VARIANTS}
    copy_bytes = result.copy_bytes
    gb = {p: (nbytes / (op_ms * 1e-3) / 1e9, copy_bytes / (copy_ms * 1e-3) / 1e9,
              100.0 * nbytes / copy_bytes * ratio) for p, (op_ms, copy_ms, ratio) in result.vs_copy.items()}
    warm, fresh = gb.get("warm"), gb.get("fresh")

    def speedup(other: float | None) -> float | None:
        return None if other is None or t["fused"] is None else other / t["fused"]

    return Record(
        op=case.op, backend=backend, shape=case.shape, dtype=dtype, pass_=pass_, ms=t["fused"],
        ms_eager=t["eager"], ms_compile=t["compile"], speedup_vs_eager=speedup(t["eager"]),
        speedup_vs_compile=speedup(t["compile"]),
        gbps=None if t["fused"] is None else nbytes / (t["fused"] * 1e-3) / 1e9,
        copy_gbps=warm[1] if warm else None, pct_of_copy=warm[2] if warm else None, bytes=nbytes,
        extra=dict(case.notes, **device_fields), ms_fresh=result.vs_copy["fresh"][0] if fresh else None,
        gbps_fresh=fresh[0] if fresh else None, copy_gbps_fresh=fresh[1] if fresh else None,
        pct_of_copy_fresh=fresh[2] if fresh else None, peak_mb=result.peaks.get("fused"),
        peak_mb_eager=result.peaks.get("eager"), peak_mb_compile=result.peaks.get("compile"),
        skipped=dict(result.skipped))


# ---- plans ------------------------------------------------------------------------------------

@dataclass
class BenchPlan:
    """What a run measures: the cases, the passes and how (see :func:`make_plan`)."""

    name: str                          # one of PLANS
    cases: list[BenchCase]
    passes: tuple[str, ...] = PASSES
    compile: bool = True
    repeats: int = 10
    budget_s: float | None = DEFAULT_BUDGET_S
    page_policies: tuple[str, ...] = ("warm",)
    copy_pairs: int = MIN_COPY_PAIRS

    def describe(self) -> str:
        """The header line: what runs, in which dtype(s), and what ``--full`` adds."""
        ops = list(dict.fromkeys(c.op for c in self.cases))
        dtypes = ", ".join(dict.fromkeys(str(c.dtype).replace("torch.", "") for c in self.cases))
        what = {"default": "one shape per op", "full": "every shape" + (" and dtype" if ", " in dtypes else ""),
                "small": "small shapes"}[self.name]
        variants = "fused / eager (wiola_kernels.reference)" + (" / torch.compile(reference)" if self.compile else "")
        budget = "none" if self.budget_s is None else f"{self.budget_s:g} s"
        line = (f"plan {self.name}: {what} — {len(self.cases)} case(s) of {len(ops)} op(s) in {dtypes}; "
                f"{' and '.join(self.passes)}; {variants}; median of {self.repeats} runs; budget per timing {budget}")
        if self.name == "default":
            line += "\n--full: every shape of each op, also bfloat16 on the CPU, fresh-page copy ratios (longer)"
        return line


def make_plan(device: torch.device | str, plan: str = "default", *, ops: Iterable[str] | None = None,
              passes: Iterable[str] = PASSES, compile: bool = True, repeats: int | None = None,
              budget_s: float | None = DEFAULT_BUDGET_S, dtypes: Iterable[torch.dtype] | None = None) -> BenchPlan:
    """The plan named ``plan`` (one of :data:`PLANS`) on ``device``.

    ``default``: one case per op of the registry (:func:`wiola_kernels.dispatch.ops`), in
    the default dtype (float32 on the CPU, bfloat16 on CUDA), 5 timed runs, the ``warm``
    page policy; ``full``: every case, 10 runs, both page policies; ``small``: the small
    cases (smoke tests). ``ops`` restricts any plan to those ops, ``dtypes`` to cases of
    those dtypes; ``repeats`` overrides the runs. Raises ``ValueError`` for an unknown plan
    or op, a registered op without a benchmark case, or ``dtypes`` that leave no case.
    """
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
    device = torch.device(device)
    ops = list(ops) if ops else None
    cases = all_cases(device, size=plan, ops=ops)
    missing = sorted(set(ops or dispatch.ops()) - {c.op for c in cases})
    if missing:
        raise ValueError(f"registered op(s) {missing} have no benchmark case (bench_cases of wiola_kernels/ops/<op>.py)")
    if dtypes is not None:
        wanted = tuple(dtypes)
        kept = [c for c in cases if c.dtype in wanted]
        if not kept:
            have = ", ".join(dict.fromkeys(str(c.dtype).replace("torch.", "") for c in cases))
            raise ValueError(f"dtype: no {plan} case in {', '.join(str(d).replace('torch.', '') for d in wanted)} "
                             f"(this plan has {have}{'' if plan == 'full' else '; --full has every dtype'})")
        cases = kept
    full = plan == "full"
    return BenchPlan(name=plan, cases=cases, passes=tuple(p for p in PASSES if p in tuple(passes)),
                     compile=compile, repeats=repeats or (10 if full else 5), budget_s=budget_s,
                     page_policies=PAGE_POLICIES if full else ("warm",),
                     copy_pairs=MIN_COPY_PAIRS if full else 10)


def run_plan(plan: BenchPlan, device: torch.device | str, out: TextIO | None = None,
             timer: PassTimer = time_pass) -> list[Record]:
    """Run ``plan``, printing the :class:`StreamTable` to ``out`` (default stdout) row by
    row; the records of every row. ``timer`` times each pass (:data:`PassTimer`)."""
    device = torch.device(device)
    table = StreamTable(out)
    records: list[Record] = []
    for case in plan.cases:
        records += run_case(case, device, repeats=plan.repeats, compile=plan.compile, passes=plan.passes,
                            budget_s=plan.budget_s, page_policies=plan.page_policies, copy_pairs=plan.copy_pairs,
                            table=table, timer=timer)
    return records


def format_table(records: list[Record]) -> str:
    """A plain-text table of the records (every field; skipped timings as ``skipped``)."""
    header = ("op", "backend", "shape", "dtype", "pass", "ms", "eager ms", "compile ms", "x eager", "x compile",
              "GB/s", "% copy", "fresh ms", "fresh GB/s", "fresh % copy")
    peaks = any(r.peak_mb is not None for r in records)
    if peaks:
        header += ("peak MiB", "eager MiB", "compile MiB")

    def opt(v, fmt, skipped=False):
        return ("skipped" if skipped else "-") if v is None else format(v, fmt)

    rows = [header]
    for r in records:
        row = (r.op, r.backend, r.shape, r.dtype, r.pass_, opt(r.ms, ".3f", "fused" in r.skipped),
               opt(r.ms_eager, ".3f", "eager" in r.skipped), opt(r.ms_compile, ".3f", "compile" in r.skipped),
               opt(r.speedup_vs_eager, ".2f"), opt(r.speedup_vs_compile, ".2f"),
               opt(r.gbps, ".1f"), opt(r.pct_of_copy, ".0f") + ("%" if r.pct_of_copy is not None else ""),
               opt(r.ms_fresh, ".3f"), opt(r.gbps_fresh, ".1f"),
               opt(r.pct_of_copy_fresh, ".0f") + ("%" if r.pct_of_copy_fresh is not None else ""))
        if peaks:
            row += (opt(r.peak_mb, ".1f"), opt(r.peak_mb_eager, ".1f"), opt(r.peak_mb_compile, ".1f"))
        rows.append(row)
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if i >= 5 else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    skipped = [f"  {r.op} {r.dtype} {r.pass_} {variant}: skipped ({why})" for r in records
               for variant, why in r.skipped.items()]
    return "\n".join(lines + (["skipped:"] + skipped if skipped else []))


def plot(records: list[Record], path: str) -> None:
    """Bar chart of the fused op's speedup over eager and over torch.compile, per op and pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.op}\n{r.pass_}" for r in records]
    xs = range(len(records))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(records)), 4))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r.speedup_vs_eager or 0 for r in records], width, label="vs eager")
    ax.bar([x + width / 2 for x in xs], [r.speedup_vs_compile or 0 for r in records], width, label="vs torch.compile")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("speedup of the fused op (×)")
    device = records[0].backend if records else ""
    ax.set_title(f"wiola-kernels: fused op speedup ({device} backend, median times)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
