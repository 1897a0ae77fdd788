"""Device time of a pass on CUDA: what the kernels take on the GPU, apart from host time.

:func:`time_device` times a pass the way SPEC §11 asks:

* **Replays of a captured CUDA graph.** ``calls`` calls of the pass are captured into one
  graph (after warm-up calls on a side stream, as PyTorch's whole-network capture wants),
  and CUDA events around each replay give its device time; the time per call is that over
  ``calls``. The launches inside a graph cost the host nothing, so what is left is the
  kernels and the gaps between them on the device.
* **Fallback: a queued backlog.** A pass that cannot be captured (a host synchronisation, an
  allocation outside the caching allocator, a CPU tensor copied in) is queued ``calls``
  times behind a spin kernel (``torch.cuda._sleep``) long enough for the host to queue all
  of them first, and timed with events around the queued calls. The record says
  ``method="backlog"`` and why capture failed. The spin starts at twice the host's
  queueing time and doubles in the warm-up while the host needs longer; where a timed backlog
  still took the host longer to queue than the spin lasted, the device may have waited for
  launches and the record says ``host_bound``: the number is then an upper bound.
* **Caches.** The pass's inputs are rotated over ``sets`` copies so that more than
  ``ROTATE_L2_FACTOR`` × the L2 size is moved between two uses of one copy
  (:func:`rotation_sets`), and a buffer of twice the L2 size is written between replays
  (the L2 flush), untimed. At the ≥ 256 MB passes of ``bench/gpu_cases.py`` one set already
  moves more than the L2 holds.
* **Statistics.** ``warmup`` untimed replays, then ``replays`` timed ones; the reported time
  is the median (:func:`median`), the samples stay in the record.

:func:`copy_time` times a same-size device copy (``nbytes / 2`` read, ``nbytes / 2``
written) exactly the same way, so that bandwidth (``bytes / time``, :func:`gbps`) can be
put against it in the same run (:func:`pct_of_copy`).

Host time per call is a separate measurement (``bench --overhead``,
:mod:`wiola_kernels.bench.overhead`); :func:`time_device` reports the host's queueing time
per call (``host_us``) alongside, measured while it queues the warm-up calls.

The arithmetic (:func:`rotation_sets`, :func:`calls_per_replay`, :func:`median`,
:func:`gbps`, :func:`pct_of_copy`) is plain Python; the CUDA calls sit behind a small timer
object (:class:`CudaTimer`) that tests replace with a stub.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol, Sequence

import torch

ROTATE_L2_FACTOR = 2      # bytes moved between two uses of one input set, in L2 sizes
TARGET_REPLAY_MS = 5.0    # device time of one replay (or backlog) the call count aims at
MAX_CALLS = 256           # calls in one graph or backlog, at most
MAX_SETS = 64             # input sets rotated, at most
REPLAYS = 20              # timed replays (the median is reported)
WARMUP_REPLAYS = 3        # untimed replays first
SET_MEMORY_FRACTION = 0.25  # the rotated input sets may take this much of the free device memory


@dataclass
class DeviceTime:
    """One device timing (the keys of its JSON record)."""

    ms: float                 # median device time per call, ms
    method: str               # "graph" (replays of a captured graph) or "backlog" (queued calls)
    calls: int                # calls per replay (graph) or per backlog
    replays: int              # timed replays / backlogs behind the median
    sets: int                 # input sets rotated over
    host_us: float            # host time to queue one call (eager, no sync), µs
    samples: list = field(default_factory=list)  # per-call ms of each timed replay
    note: str = ""            # why a backlog, or what limited the rotation
    host_bound: bool = False  # backlog only: the host queued slower than the device ran

    def to_json(self) -> dict:
        """The record as a dict (samples rounded to µs)."""
        out = asdict(self)
        out["samples"] = [round(s, 6) for s in self.samples]
        return out


# ------------------------------------------------------------------------------ arithmetic

def median(samples: Sequence[float]) -> float:
    """The median of ``samples`` (the mean of the middle two for an even count).

    Raises:
        ValueError: when ``samples`` is empty.
    """
    if not samples:
        raise ValueError("median: samples must not be empty")
    s = sorted(samples)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def rotation_sets(pass_bytes: int, l2_bytes: int, *, set_bytes: int | None = None,
                  memory_budget: int | None = None, factor: int = ROTATE_L2_FACTOR,
                  max_sets: int = MAX_SETS) -> int:
    """How many copies of a pass's inputs to rotate over, so that more than ``factor`` L2
    sizes of traffic pass between two uses of one copy.

    Args:
        pass_bytes: the fewest bytes one pass moves (> 0).
        l2_bytes: the device's L2 size in bytes (≥ 0; 0: no cache to defeat).
        set_bytes: bytes one extra input set occupies (default: ``pass_bytes``).
        memory_budget: bytes all the sets may occupy together (None: no limit).
        factor: the traffic between two uses of a set, in L2 sizes.
        max_sets: the most sets returned.

    Returns:
        The number of sets, at least 1: ``⌈factor·l2 / pass_bytes⌉ + 1`` (one pass alone
        moving more than ``factor``·L2 needs no copies), capped by ``max_sets`` and by
        ``memory_budget // set_bytes``.
    """
    if pass_bytes <= 0:
        raise ValueError(f"rotation_sets: pass_bytes must be > 0, got {pass_bytes}")
    if l2_bytes < 0:
        raise ValueError(f"rotation_sets: l2_bytes must be >= 0, got {l2_bytes}")
    need = factor * l2_bytes
    sets = 1 if pass_bytes > need else math.ceil(need / pass_bytes) + 1
    sets = min(sets, max_sets)
    if memory_budget is not None:
        sets = min(sets, max(1, memory_budget // max(1, set_bytes if set_bytes is not None else pass_bytes)))
    return max(1, sets)


def calls_per_replay(est_ms: float, sets: int, *, target_ms: float = TARGET_REPLAY_MS,
                     max_calls: int = MAX_CALLS) -> int:
    """Calls captured in one graph (or queued in one backlog): enough for ``target_ms`` of
    device time at ``est_ms`` per call, a multiple of ``sets`` (every set used equally
    often), at least ``sets`` and at most ``max_calls`` (rounded down to a multiple of
    ``sets`` where that leaves at least one round).

    Args:
        est_ms: an estimate of one call's device time in ms (≤ 0 or NaN: take ``max_calls``).
        sets: input sets rotated over (≥ 1).
    """
    if sets < 1:
        raise ValueError(f"calls_per_replay: sets must be >= 1, got {sets}")
    want = max_calls if not est_ms > 0 else math.ceil(target_ms / est_ms)
    want = max(1, min(want, max_calls))
    rounds = max(1, math.ceil(want / sets))
    if rounds * sets > max_calls and max_calls >= sets:
        rounds = max_calls // sets
    return rounds * sets


def gbps(nbytes: int, ms: float) -> float:
    """Bandwidth in GB/s (10⁹ bytes) of ``nbytes`` moved in ``ms`` milliseconds (NaN for ms ≤ 0)."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


def pct_of_copy(nbytes: int, ms: float, copy_bytes: int, copy_ms: float) -> float:
    """The pass's bandwidth as a percentage of the copy's (both ``bytes / time``)."""
    return 100.0 * gbps(nbytes, ms) / gbps(copy_bytes, copy_ms)


# ------------------------------------------------------------------------------ the timer

class Timer(Protocol):
    """What :func:`time_device` needs from the device (:class:`CudaTimer` on CUDA; a stub in tests)."""

    def l2_bytes(self) -> int: ...
    def free_bytes(self) -> int: ...
    def flush(self) -> None: ...
    def enqueue_us(self, fn: Callable[[], object], calls: int) -> float: ...
    def event_ms(self, fn: Callable[[], object]) -> float: ...
    def capture(self, fn: Callable[[], object]) -> Callable[[], object]: ...
    def backlog_ms(self, fn: Callable[[], object], spin_ms: float) -> tuple[float, float]: ...
    def synchronize(self) -> None: ...


class CudaTimer:
    """:class:`Timer` on one CUDA device: events, graphs, an L2 flush buffer, ``torch.cuda._sleep``."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        props = torch.cuda.get_device_properties(self.device)
        self._l2 = int(getattr(props, "L2_cache_size", 0) or 0)
        self._flush_buf: torch.Tensor | None = None
        self._cycles_per_ms: float | None = None

    def l2_bytes(self) -> int:
        return self._l2

    def free_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)

    def flush(self) -> None:
        if self._flush_buf is None:  # twice the L2, written: every line of the pass's data leaves it
            self._flush_buf = torch.empty(max(2 * self._l2, 1 << 20) // 4, dtype=torch.int32, device=self.device)
        self._flush_buf.zero_()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def enqueue_us(self, fn: Callable[[], object], calls: int) -> float:
        self.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        us = (time.perf_counter() - t0) * 1e6 / calls
        self.synchronize()
        return us

    def event_ms(self, fn: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def capture(self, fn: Callable[[], object]) -> Callable[[], object]:
        # Warm-up on a side stream first (autograd's and the caching allocator's state), as
        # PyTorch's whole-network capture does; then capture on torch.cuda.graph's own stream.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                fn()
        except Exception:
            self.synchronize()
            raise
        self.synchronize()
        return graph.replay

    def _calibrate(self) -> float:
        if self._cycles_per_ms is None:
            cycles = 1_000_000
            self.synchronize()
            ms = self.event_ms(lambda: torch.cuda._sleep(cycles))
            self._cycles_per_ms = cycles / max(ms, 1e-3)
        return self._cycles_per_ms

    def backlog_ms(self, fn: Callable[[], object], spin_ms: float) -> tuple[float, float]:
        # The spin kernel holds the device while the host queues fn's launches behind it;
        # the events around the queued calls then time the device, not the host. Returns
        # (device ms between the events, host ms spent queueing).
        cycles = int(self._calibrate() * spin_ms)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host_ms


# ------------------------------------------------------------------------------ timing

def time_device(make_run: Callable[[int], Callable[[], object]], pass_bytes: int, *,
                device: torch.device | str | None = None, timer: Timer | None = None,
                set_bytes: int | None = None, replays: int = REPLAYS, warmup: int = WARMUP_REPLAYS,
                sets: int | None = None, allow_graph: bool = True) -> DeviceTime:
    """Device time of one call of a pass, per the module docstring.

    Args:
        make_run: ``make_run(i)`` builds the pass on input set ``i`` (fresh inputs each
            time) and returns a zero-argument callable running it once.
        pass_bytes: the fewest bytes one pass moves (for the rotation).
        device: the CUDA device (used to build a :class:`CudaTimer` when ``timer`` is None).
        timer: the device interface (tests pass a stub).
        set_bytes: device bytes one input set occupies (default ``pass_bytes``).
        replays: timed replays (median reported).
        warmup: untimed replays first.
        sets: input sets to rotate over (default: :func:`rotation_sets`).
        allow_graph: False times a backlog without trying to capture.

    Returns:
        A :class:`DeviceTime`.
    """
    if timer is None:
        if device is None or torch.device(device).type != "cuda":
            raise ValueError(f"time_device: device must be a CUDA device (or pass a timer), got {device!r}")
        timer = CudaTimer(torch.device(device))
    if replays < 1:
        raise ValueError(f"time_device: replays must be >= 1, got {replays}")
    note = ""
    if sets is None:
        budget = int(SET_MEMORY_FRACTION * timer.free_bytes())
        sets = rotation_sets(pass_bytes, timer.l2_bytes(), set_bytes=set_bytes, memory_budget=budget)
        wanted = rotation_sets(pass_bytes, timer.l2_bytes())
        if sets < wanted:
            note = f"rotation limited to {sets} of {wanted} input sets by device memory"
    runs = [make_run(i) for i in range(sets)]

    def one_round() -> None:
        for run in runs:
            run()

    # Warm-up: compilation, autotuning, the allocator's first allocations; the host's
    # queueing time per call; a first estimate of the device time per call.
    timer.enqueue_us(one_round, 2)
    host_us = timer.enqueue_us(one_round, 2) / sets
    timer.flush()
    est_ms = timer.event_ms(one_round) / sets
    calls = calls_per_replay(est_ms, sets)

    def all_calls() -> None:
        for _ in range(calls // sets):
            one_round()

    method, replay, host_bound = "graph", None, False
    if allow_graph:
        try:
            replay = timer.capture(all_calls)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: time a backlog instead
            why = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
            note = "; ".join(filter(None, [note, f"not capturable ({type(exc).__name__}: {why})"]))
    else:
        note = "; ".join(filter(None, [note, "graph capture not attempted"]))
    if replay is None:
        method = "backlog"
        spin_ms = 2.0 + 2.0 * host_us * calls / 1e3  # twice the host's queueing time, and 2 ms
        samples = []
        for i in range(warmup + replays):
            timer.flush()
            device_ms, host_ms = timer.backlog_ms(all_calls, spin_ms)
            if i < warmup:
                if host_ms > spin_ms:  # the spin ended before the queue was full: a longer one
                    spin_ms = 2.0 * host_ms
                continue
            samples.append(device_ms / calls)
            host_bound = host_bound or host_ms > spin_ms  # the device may have waited for launches
    else:
        samples = []
        for i in range(warmup + replays):
            timer.flush()
            ms = timer.event_ms(replay) / calls
            if i >= warmup:
                samples.append(ms)
    timer.synchronize()
    return DeviceTime(ms=median(samples), method=method, calls=calls, replays=replays, sets=sets, host_us=host_us,
                      samples=samples, note=note, host_bound=host_bound)


def copy_runs(nbytes: int, device: torch.device | str) -> Callable[[int], Callable[[], object]]:
    """``make_run`` for a device copy moving ``nbytes`` (``nbytes / 2`` read + written), on random data."""
    n = max(1, nbytes // 2 // 4)

    def make_run(i: int) -> Callable[[], object]:
        g = torch.Generator(device=device).manual_seed(i)
        src = torch.randn(n, generator=g, device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    return make_run


def copy_time(nbytes: int, device: torch.device | str, *, timer: Timer | None = None,
              replays: int = REPLAYS) -> tuple[DeviceTime, int]:
    """``(timing, bytes)`` of a same-size device copy (float32, random data), timed as
    :func:`time_device` times a pass; ``bytes`` is what it moves (``nbytes`` rounded)."""
    moved = 2 * 4 * max(1, nbytes // 2 // 4)
    return time_device(copy_runs(nbytes, device), moved, device=device, timer=timer, replays=replays), moved


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def device_pass(case, fn: Callable[..., object], pass_: str, inputs: tuple, seed: int = 0) -> Callable[[], object]:
    """A zero-argument callable running ``fn`` for one pass on fixed inputs, as the runner's
    ``make_pass`` does (``fwd`` under ``no_grad``; ``fwd+bwd`` the forward on leaves and
    ``torch.autograd.grad`` with random output gradients), with those gradients drawn on the
    inputs' device (at ≥ 256 MB a pass, drawing them on the CPU took seconds per row)."""
    if pass_ == "fwd":
        def run_fwd():
            with torch.no_grad():
                return fn(*inputs)
        return run_fwd
    if pass_ != "fwd+bwd":
        raise ValueError(f"device_pass: pass_ must be 'fwd' or 'fwd+bwd', got {pass_!r}")
    diff = list(case.differentiable) if case.differentiable is not None else \
        [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    leaves = tuple(t.detach().requires_grad_(i in diff) if isinstance(t, torch.Tensor) and t.is_floating_point()
                   else t for i, t in enumerate(inputs))
    with torch.no_grad():
        probe = _tensors(fn(*inputs))
    grads = []
    for k, o in enumerate(probe):
        if not o.is_floating_point():
            grads.append(None)
            continue
        g = torch.Generator(device=o.device).manual_seed(seed + k)
        grads.append(torch.randn(o.shape, generator=g, device=o.device, dtype=o.dtype))
    del probe
    wrt = [leaves[i] for i in diff]

    def run_fwd_bwd():
        outs = _tensors(fn(*leaves))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        return torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    return run_fwd_bwd


def pass_time(case, pass_: str, fn: Callable[..., object], device: torch.device, *, timer: Timer | None = None,
              nbytes: int | None = None, replays: int = REPLAYS) -> DeviceTime:
    """Device time of ``fn`` (a case's fused, eager or a peer callable) for one pass of a
    :class:`~wiola_kernels.bench.cases.BenchCase`: each input set from ``case.make_inputs()``,
    the pass built by :func:`device_pass`."""
    from .cases import min_bytes

    first = case.make_inputs()
    if nbytes is None:
        nbytes = min_bytes(case, pass_, first)
    set_bytes = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))

    def make_run(i: int) -> Callable[[], object]:
        return device_pass(case, fn, pass_, first if i == 0 else case.make_inputs())

    return time_device(make_run, nbytes, device=device, timer=timer, set_bytes=set_bytes, replays=replays)


def record_fields(case, pass_: str, nbytes: int, device: torch.device) -> dict:
    """The runner's hook (``bench/runner.py`` ``run_case``, on CUDA only): the fused pass's
    device time and the same-size copy's, as extra record fields (``device_ms``,
    ``device_gbps``, ``device_copy_ms``, ``device_copy_gbps``, ``device_pct_of_copy``,
    ``device_method``, ``device_host_us``, ``device_note``). A failure is reported in
    ``device_error``, never raised: the host-time row stays."""
    if device.type != "cuda":
        return {}
    try:
        timer = CudaTimer(device)
        t = pass_time(case, pass_, case.fused, device, timer=timer, nbytes=nbytes)
        fields = dict(device_ms=t.ms, device_gbps=gbps(nbytes, t.ms), device_method=t.method,
                      device_host_us=t.host_us, device_note=t.note)
        if not case.compute_bound:
            c, moved = copy_time(nbytes, device, timer=timer)
            fields.update(device_copy_ms=c.ms, device_copy_gbps=gbps(moved, c.ms),
                          device_pct_of_copy=pct_of_copy(nbytes, t.ms, moved, c.ms))
        return fields
    except Exception as exc:  # noqa: BLE001 - a bench row must not be lost to its device timing
        return dict(device_error=f"{type(exc).__name__}: {exc}"[:300])
