"""Timing of benchmark cases: fused vs eager vs ``torch.compile`` of a baseline, in one process.

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
  ``pct_of_copy_fresh``). Both are reported on the CPU because both matter there.
* Load. The machine is shared; the op and the copy are timed in alternation, and on one
  CPU thread ``pct_of_copy`` is the median over pairs of the ratio of their CPU times (a
  process waiting for a core accrues none); with more threads, of their wall times (idle
  OpenMP workers spin, which CPU time counts; see :func:`time_vs_copy`). ``ms``, ``gbps`` and
  ``copy_gbps`` stay wall-time medians, so on a loaded machine ``pct_of_copy`` need not
  equal ``gbps / copy_gbps``.

A case marked ``compute_bound`` (its time is GEMMs, not memory traffic) has no copy
baseline: its fused pass and the two baselines are timed in alternation (the order flipped
every round), so that their ratios see the same machine load — timed one after the other,
seconds-long passes on this shared VM moved by 10–25 % between the blocks of runs — and the
copy fields are None.

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
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator

import torch

from .. import dispatch
from . import device_time
from .cases import BenchCase
from .hf import peak_mb

PASSES = ("fwd", "fwd+bwd")
PAGE_POLICIES = ("warm", "fresh")
MIN_COPY_PAIRS = 20  # op/copy pairs behind pct_of_copy, whatever --repeats says


@dataclass
class Record:
    """One row of results (the keys of ``--json`` records)."""

    op: str
    backend: str
    shape: str
    dtype: str
    pass_: str
    ms: float
    ms_eager: float
    ms_compile: float | None
    speedup_vs_eager: float
    speedup_vs_compile: float | None
    gbps: float
    copy_gbps: float | None   # None: a compute-bound case (no copy baseline)
    pct_of_copy: float | None
    bytes: int
    extra: dict
    # The same as ms/gbps/copy_gbps/pct_of_copy with every large output on fresh pages
    # (CPU only; None on CUDA, whose caching allocator always reuses memory).
    ms_fresh: float | None = None
    gbps_fresh: float | None = None
    copy_gbps_fresh: float | None = None
    pct_of_copy_fresh: float | None = None
    # Peak memory of the pass in MiB (cases marked peak_memory; see the module docstring).
    peak_mb: float | None = None
    peak_mb_eager: float | None = None
    peak_mb_compile: float | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        out["pass"] = out.pop("pass_")
        out.update(out.pop("extra"))
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 10, warmup: int = 2,
            min_seconds: float = 0.0) -> float:
    """Median wall time of ``fn()`` in milliseconds."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    start = time.perf_counter()
    while len(samples) < repeats or (time.perf_counter() - start) < min_seconds:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
        if len(samples) >= 10 * repeats:
            break
    return statistics.median(samples)


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


def make_pass(case: BenchCase, fn: Callable[..., object], pass_: str, inputs: tuple) -> Callable[[], object]:
    """A zero-argument callable running ``fn`` for one pass on fixed inputs."""
    if pass_ == "fwd":
        def run_fwd():
            with torch.no_grad():
                return fn(*inputs)
        return run_fwd
    diff = _differentiable(case, inputs)
    leaves = tuple(t.detach().requires_grad_(i in diff) if isinstance(t, torch.Tensor) and t.is_floating_point()
                   else t for i, t in enumerate(inputs))
    with torch.no_grad():
        probe = _tensors(fn(*inputs))
    g = torch.Generator(device="cpu").manual_seed(0)
    grad_outputs = [torch.randn(o.shape, generator=g).to(o) if o.is_floating_point() else None for o in probe]
    wrt = [leaves[i] for i in diff]

    def run_fwd_bwd():
        outs = [o for o in _tensors(fn(*leaves))]
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        return torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    return run_fwd_bwd


def min_bytes(case: BenchCase, pass_: str, inputs: tuple) -> int:
    """The fewest bytes ``pass_`` must move (see the module docstring)."""
    with torch.no_grad():
        outputs = _tensors(case.eager(*inputs))
    if case.min_bytes is not None:
        return case.min_bytes(pass_, inputs, outputs, tuple(_differentiable(case, inputs)))
    total = _nbytes(_tensors(inputs)) + _nbytes(outputs)
    if pass_ == "fwd+bwd":
        float_outputs = [o for o in outputs if o.is_floating_point()]
        total += _nbytes(float_outputs) + _nbytes(inputs[i] for i in _differentiable(case, inputs))
        total += _nbytes(inputs[i] for i in case.backward_rereads)
    return total


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


def run_case(case: BenchCase, device: torch.device, *, repeats: int = 10, compile: bool = True,
             passes: Iterable[str] = PASSES, progress=None) -> list[Record]:
    """Time one case for each pass; ``progress`` (a tqdm bar) is advanced per timing.

    Everything runs under ``page_policy("warm")``; on the CPU the fused op and its copy
    are timed once more under ``page_policy("fresh")``.
    """
    policies = PAGE_POLICIES if device.type == "cpu" and not case.compute_bound else ("warm",)
    inputs = case.make_inputs()
    compiled = torch.compile(case.baseline_to_compile(), dynamic=False) if compile else None
    backend = dispatch.select(case.op, device)
    records = []
    for pass_ in passes:
        timings: dict = {}
        nbytes = min_bytes(case, pass_, inputs)
        copy_fn, copy_bytes = (None, 0) if case.compute_bound else copy_baseline(nbytes, device)
        vs_copy = {}
        peaks: dict = {}
        variants = (("fused", case.fused), ("eager", case.eager), ("compile", compiled))
        if case.compute_bound:  # the three in alternation: each sees the same machine load
            runs = {label: make_pass(case, fn, pass_, inputs) for label, fn in variants if fn is not None}
            if progress is not None:
                progress.set_postfix_str(f"{case.op} {pass_} {' / '.join(runs)} alternating")
            with page_policy("warm", device):
                medians = time_interleaved_ms(list(runs.values()), device, repeats=repeats)
            timings = {label: None for label, _ in variants} | dict(zip(runs, medians))
            if case.peak_memory:
                peaks = {label: peak_mb(run, device) for label, run in runs.items()}
            if progress is not None:
                progress.update(len(variants))
        for label, fn in () if case.compute_bound else variants:
            if progress is not None:
                progress.set_postfix_str(f"{case.op} {pass_} {label}")
            if fn is None:
                timings[label] = None
            elif label == "fused" and not case.compute_bound:  # in alternation with its copy, per page policy
                run = make_pass(case, fn, pass_, inputs)
                for policy in policies:
                    with page_policy(policy, device) as before:
                        vs_copy[policy] = time_vs_copy(run, copy_fn, device, repeats=max(repeats, MIN_COPY_PAIRS),
                                                       before=before)
                timings["fused"] = vs_copy["warm"][0]
                if case.peak_memory:
                    peaks[label] = peak_mb(run, device)
            else:
                run = make_pass(case, fn, pass_, inputs)
                with page_policy("warm", device):
                    timings[label] = time_ms(run, device, repeats=repeats)
                if case.peak_memory:
                    peaks[label] = peak_mb(run, device)
            if progress is not None:
                progress.update(1)
        gb = {p: (nbytes / (op_ms * 1e-3) / 1e9, copy_bytes / (copy_ms * 1e-3) / 1e9,
                  100.0 * nbytes / copy_bytes * ratio) for p, (op_ms, copy_ms, ratio) in vs_copy.items()}
        if case.compute_bound:
            gb["warm"] = (nbytes / (timings["fused"] * 1e-3) / 1e9, None, None)
        fresh = gb.get("fresh")
        # On CUDA, the fused pass's device time and a same-size copy's (bench/device_time.py):
        # CUDA events around graph replays; extra record fields device_ms, device_pct_of_copy, ...
        device_fields = device_time.record_fields(case, pass_, nbytes, device) if device.type == "cuda" else {}
        records.append(Record(
            op=case.op, backend=backend, shape=case.shape, dtype=str(case.dtype).replace("torch.", ""),
            pass_=pass_, ms=timings["fused"], ms_eager=timings["eager"], ms_compile=timings["compile"],
            speedup_vs_eager=timings["eager"] / timings["fused"],
            speedup_vs_compile=None if timings["compile"] is None else timings["compile"] / timings["fused"],
            gbps=gb["warm"][0], copy_gbps=gb["warm"][1], pct_of_copy=gb["warm"][2], bytes=nbytes,
            extra=dict(case.notes, **device_fields), ms_fresh=vs_copy["fresh"][0] if fresh else None,
            gbps_fresh=fresh[0] if fresh else None, copy_gbps_fresh=fresh[1] if fresh else None,
            pct_of_copy_fresh=fresh[2] if fresh else None, peak_mb=peaks.get("fused"),
            peak_mb_eager=peaks.get("eager"), peak_mb_compile=peaks.get("compile")))
    return records


def format_table(records: list[Record]) -> str:
    """A plain-text table of the records."""
    header = ("op", "backend", "shape", "dtype", "pass", "ms", "eager ms", "compile ms", "x eager", "x compile",
              "GB/s", "% copy", "fresh ms", "fresh GB/s", "fresh % copy")
    peaks = any(r.peak_mb is not None for r in records)
    if peaks:
        header += ("peak MiB", "eager MiB", "compile MiB")

    def opt(v, fmt):
        return "-" if v is None else format(v, fmt)

    rows = [header]
    for r in records:
        row = (r.op, r.backend, r.shape, r.dtype, r.pass_, f"{r.ms:.3f}", f"{r.ms_eager:.3f}",
               opt(r.ms_compile, ".3f"), f"{r.speedup_vs_eager:.2f}", opt(r.speedup_vs_compile, ".2f"),
               f"{r.gbps:.1f}", opt(r.pct_of_copy, ".0f") + ("%" if r.pct_of_copy is not None else ""),
               opt(r.ms_fresh, ".3f"), opt(r.gbps_fresh, ".1f"),
               opt(r.pct_of_copy_fresh, ".0f") + ("%" if r.pct_of_copy_fresh is not None else ""))
        if peaks:
            row += (opt(r.peak_mb, ".1f"), opt(r.peak_mb_eager, ".1f"), opt(r.peak_mb_compile, ".1f"))
        rows.append(row)
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if i >= 5 else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def plot(records: list[Record], path: str) -> None:
    """Bar chart of the fused op's speedup over eager and over torch.compile, per op and pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.op}\n{r.pass_}" for r in records]
    xs = range(len(records))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(records)), 4))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r.speedup_vs_eager for r in records], width, label="vs eager")
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
