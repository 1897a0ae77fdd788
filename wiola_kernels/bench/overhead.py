"""``python -m wiola_kernels bench --overhead``: what one call of each public op costs on a tiny
input, where the kernel is nothing and the op layer is everything, beside a native op.

Each public function runs on the smallest input a model would pass it (a decoding step's one
token: its op's benchmark case at size ``"tiny"``, ``bench_cases`` of ``ops/<op>.py``, shapes in
``wiola_kernels.shapes.TINY_BENCH``), forward alone (no gradient wanted) and forward + backward,
and is timed call by call: the median of ``calls`` calls after a warm-up. The yardstick is
``torch.nn.functional.rms_norm`` on a ``(4, 64)`` tensor, rms_norm's tiny shape, timed the same
way in the same process. A fresh
process measures the first call of each op after ``import wiola_kernels`` (what every script
pays once), against the first ``F.rms_norm``, and whether ``torch._dynamo`` got imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

PASSES = ("fwd", "fwd+bwd")


@dataclass
class OverheadCase:
    """One public function on a tiny input: ``call(*inputs)`` calls it (its floating-point
    outputs are what the backward of ``fwd+bwd`` starts from)."""

    op: str
    call: Callable[..., object]
    inputs: Callable[[torch.device], list]   # fresh inputs (floats become leaves for fwd+bwd)


def _native_inputs(device: torch.device) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 64, generator=g).to(device), torch.ones(64, device=device), torch.zeros(64, device=device)]


def _tiny_inputs(name: str) -> Callable[[torch.device], list]:
    """Fresh inputs of the tiny case named ``name`` on a device."""
    from .cases import op_cases

    def inputs(device: torch.device) -> list:
        case = next(c for c in op_cases(device, "tiny") if c.op == name)
        return list(case.make_inputs())

    return inputs


def cases() -> list[OverheadCase]:
    """The tiny inputs of every public function of the registered ops (their cases at size
    ``"tiny"``): the native yardstick as ``"F.rms_norm"``, its counterpart ``rms_norm``, then
    the others in registry order."""
    from .cases import op_cases

    native = OverheadCase("F.rms_norm", lambda x, w, s: F.rms_norm(x, (64,), w, 1e-6), _native_inputs)
    ours = [OverheadCase(c.op, c.fused, _tiny_inputs(c.op)) for c in op_cases("cpu", "tiny")]
    return [native] + sorted(ours, key=lambda c: c.op != "rms_norm")  # stable: the others keep their order


def _median_us(fn: Callable[[], object], calls: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    times = []
    for _ in range(calls):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    times.sort()
    return times[len(times) // 2] / 1e3


def _runner(case: OverheadCase, device: torch.device, which: str) -> Callable[[], object]:
    inputs = case.inputs(device)
    if which == "fwd":
        return lambda: case.call(*inputs)
    leaves = [t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    out = case.call(*leaves)
    if isinstance(out, torch.Tensor):
        def floats(out):
            return out
        grads = torch.ones_like(out)
    else:  # a tuple: the backward starts from its floating-point outputs (not ATM's index map)
        keep = [i for i, o in enumerate(out) if o.is_floating_point()]

        def floats(out):
            return [out[i] for i in keep]
        grads = [torch.ones_like(out[i]) for i in keep]

    def step():
        torch.autograd.backward(floats(case.call(*leaves)), grads)

    return step


def measure(device: torch.device, calls: int = 1000, warmup: int = 200, progress=None) -> list[dict]:
    """One record per (op, pass): ``op``, ``pass``, ``us`` (median µs per call), ``native_us``
    (F.rms_norm's, same pass) and ``ratio``."""
    table = cases()
    native = {}
    records = []
    for which in PASSES:
        for case in table:
            us = _median_us(_runner(case, device, which), calls, warmup)
            if progress is not None:
                progress.update(1)
            if case.op == "F.rms_norm":
                native[which] = us
                continue
            records.append({"op": case.op, "pass": which, "us": us})
    for r in records:
        r["native_us"] = native[r["pass"]]
        r["ratio"] = r["us"] / r["native_us"]
    return records


def profile(device: torch.device, op: str, which: str = "fwd", calls: int = 2000, top: int = 15) -> str:
    """Where one call of ``op`` (an :func:`cases` name) spends its host time: cProfile over
    ``calls`` calls of pass ``which`` after a warm-up, the ``top`` functions by own time
    (the op layer's Python, Triton's launcher, the dispatcher's boxing)."""
    import cProfile
    import io
    import pstats

    table = {c.op: c for c in cases()}
    if op not in table:
        raise ValueError(f"--profile: op must be one of {', '.join(table)}, got {op!r}")
    if which not in PASSES:
        raise ValueError(f"--profile: the pass must be one of {', '.join(PASSES)}, got {which!r}")
    step = _runner(table[op], device, which)
    for _ in range(200):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    out = io.StringIO()
    out.write(f"{op} {which} on {device}: {calls} calls, the {top} functions with the most own time\n")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


_FIRST_CALL = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import torch.nn.functional as F
import wiola_kernels
t2 = time.perf_counter()
from wiola_kernels.bench.overhead import cases
device = torch.device(sys.argv[1])
out = {"import_torch_s": t1 - t0, "import_wiola_kernels_s": t2 - t1, "first_call_s": {}}
table = cases()
for case in table[1:] + table[:1]:  # ours first: the very first call after import is one of ours
    inputs = case.inputs(device)
    t = time.perf_counter()
    case.call(*inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    out["first_call_s"][case.op] = time.perf_counter() - t
out["dynamo_imported"] = "torch._dynamo" in sys.modules
print(json.dumps(out))
"""


def first_calls(device: torch.device) -> dict:
    """The first call of each op in a fresh process (seconds), import times, and whether
    ``torch._dynamo`` was imported by them."""
    done = subprocess.run([sys.executable, "-c", _FIRST_CALL, str(device)], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the first-call process failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_call_records(first: dict) -> list[dict]:
    """:func:`first_calls` as records like :func:`measure`'s (``pass`` = ``"first_call"``)."""
    native = first["first_call_s"]["F.rms_norm"] * 1e6
    return [{"op": op, "pass": "first_call", "us": s * 1e6, "native_us": native, "ratio": s * 1e6 / native,
             "dynamo_imported": first["dynamo_imported"]}
            for op, s in first["first_call_s"].items() if op != "F.rms_norm"]


def format_overhead(records: list[dict], first: dict | None) -> str:
    """The two tables: per-call cost vs F.rms_norm, then the first calls."""
    lines = [f"{'op':<22}{'pass':<9}{'µs/call':>9}{'F.rms_norm µs':>15}{'ratio':>7}"]
    for r in records:
        lines.append(f"{r['op']:<22}{r['pass']:<9}{r['us']:>9.1f}{r['native_us']:>15.1f}{r['ratio']:>7.2f}")
    if first is not None:
        lines.append("")
        lines.append(f"fresh process: import torch {first['import_torch_s']:.2f} s, import wiola_kernels "
                     f"{first['import_wiola_kernels_s']:.3f} s; first call (s):")
        lines.append("  " + ", ".join(f"{op} {s:.3f}" for op, s in first["first_call_s"].items()))
        lines.append(f"  torch._dynamo imported by them: {'yes' if first['dynamo_imported'] else 'no'}")
    return "\n".join(lines)
