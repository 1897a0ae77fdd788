"""Timing of benchmark cases: fused vs eager vs ``torch.compile(reference)``, in one process.

Every pass is timed as the median of ``repeats`` runs after warm-up. ``fwd`` runs
under ``torch.no_grad``; ``fwd+bwd`` runs the forward with gradients and
``torch.autograd.grad`` with random output gradients (never ones or zeros).

Bandwidth: ``gbps`` counts the fewest bytes the pass must move — each input read
once and each output written once (for ``fwd+bwd``: inputs, output gradients,
outputs and input gradients). ``copy_gbps`` is a same-size copy that allocates its output
like the ops do (:func:`copy_baseline`), timed in alternation with the fused op, so both see the same machine
load, and ``pct_of_copy`` says how close the pass is to the memory limit.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch

from .. import dispatch
from .cases import BenchCase

PASSES = ("fwd", "fwd+bwd")


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
    copy_gbps: float
    pct_of_copy: float
    bytes: int
    extra: dict

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
    each sees the same machine load; used to time an op against its copy baseline."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    _sync(device)
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(s) for s in samples]


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
    grad_outputs = [torch.randn_like(o) if o.is_floating_point() else None for o in probe]
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
    return total


def copy_baseline(nbytes: int, device: torch.device) -> tuple[Callable[[], object], int]:
    """A same-size copy moving ``nbytes`` (nbytes/2 read + nbytes/2 written), and its byte count.

    The copy allocates its output, as every op here does. On the CPU it is the
    extension's ``wiola::_copy``, whose output is allocated exactly like the kernels'
    (with the huge-page hint: on a virtual machine the first touch of fresh 4 KiB pages
    can cost more than the copy itself); without the extension, ``Tensor.clone``.
    """
    n = max(1, nbytes // 2 // 4)
    src = torch.randn(n, device=device)
    if device.type == "cpu" and hasattr(torch.ops.wiola, "_copy") and dispatch.BACKENDS["cpu"].unavailable_reason(
            device) is None:
        return (lambda: torch.ops.wiola._copy(src)), 2 * n * 4
    return (lambda: src.clone()), 2 * n * 4


def run_case(case: BenchCase, device: torch.device, *, repeats: int = 10, compile: bool = True,
             passes: Iterable[str] = PASSES, progress=None) -> list[Record]:
    """Time one case for each pass; ``progress`` (a tqdm bar) is advanced per timing."""
    inputs = case.make_inputs()
    compiled = torch.compile(case.baseline_to_compile(), dynamic=False) if compile else None
    backend = dispatch.select(case.op, device)
    records = []
    for pass_ in passes:
        timings = {}
        nbytes = min_bytes(case, pass_, inputs)
        copy_fn, copy_bytes = copy_baseline(nbytes, device)
        for label, fn in (("fused", case.fused), ("eager", case.eager), ("compile", compiled)):
            if progress is not None:
                progress.set_postfix_str(f"{case.op} {pass_} {label}")
            if fn is None:
                timings[label] = None
            elif label == "fused":  # timed in alternation with its copy baseline
                timings["fused"], copy_ms = time_interleaved_ms([make_pass(case, fn, pass_, inputs), copy_fn],
                                                                device, repeats=repeats)
            else:
                timings[label] = time_ms(make_pass(case, fn, pass_, inputs), device, repeats=repeats)
            if progress is not None:
                progress.update(1)
        copy = copy_bytes / (copy_ms * 1e-3) / 1e9
        gbps = nbytes / (timings["fused"] * 1e-3) / 1e9
        records.append(Record(
            op=case.op, backend=backend, shape=case.shape, dtype=str(case.dtype).replace("torch.", ""),
            pass_=pass_, ms=timings["fused"], ms_eager=timings["eager"], ms_compile=timings["compile"],
            speedup_vs_eager=timings["eager"] / timings["fused"],
            speedup_vs_compile=None if timings["compile"] is None else timings["compile"] / timings["fused"],
            gbps=gbps, copy_gbps=copy, pct_of_copy=100.0 * gbps / copy, bytes=nbytes, extra=dict(case.notes)))
    return records


def format_table(records: list[Record]) -> str:
    """A plain-text table of the records."""
    header = ("op", "backend", "shape", "dtype", "pass", "ms", "eager ms", "compile ms", "x eager", "x compile",
              "GB/s", "% copy")
    rows = [header]
    for r in records:
        rows.append((r.op, r.backend, r.shape, r.dtype, r.pass_, f"{r.ms:.3f}", f"{r.ms_eager:.3f}",
                     "-" if r.ms_compile is None else f"{r.ms_compile:.3f}", f"{r.speedup_vs_eager:.2f}",
                     "-" if r.speedup_vs_compile is None else f"{r.speedup_vs_compile:.2f}",
                     f"{r.gbps:.1f}", f"{r.pct_of_copy:.0f}%"))
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
