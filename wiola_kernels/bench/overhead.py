"""``python -m wiola_kernels bench --overhead``: what one call of each public op costs on a tiny
input, where the kernel is nothing and the op layer is everything, beside a native op.

Each op runs on the smallest input a model would pass it (a decoding step's one token), forward
alone (no gradient wanted) and forward + backward, and is timed call by call: the median of
``calls`` calls after a warm-up. The yardstick is ``torch.nn.functional.rms_norm`` on the same
``(4, 64)`` tensor as our rms_norm case, timed the same way in the same process. A fresh
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
    """One public op on a tiny input: ``call(*inputs)`` returns its differentiable outputs."""

    op: str
    call: Callable[..., tuple[torch.Tensor, ...]]
    inputs: Callable[[torch.device], list]   # fresh inputs (floats become leaves for fwd+bwd)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(*shape, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def cases() -> list[OverheadCase]:
    """The tiny inputs of every public op (and the native yardstick as ``"F.rms_norm"``)."""
    import wiola_kernels as wk

    def rms_inputs(device):
        g = _gen()
        return [_randn(4, 64, g=g).to(device), torch.ones(64, device=device), torch.zeros(64, device=device)]

    def add_inputs(device):
        g = _gen()
        return [_randn(4, 64, g=g).to(device), _randn(4, 64, g=g).to(device), torch.ones(64, device=device),
                torch.zeros(64, device=device)]

    def glu_inputs(device):  # one decoding token's up projection, [a | b] of width 2·64
        g = _gen()
        return [_randn(1, 128, g=g).to(device)]

    def srpe_inputs(device):  # one decoding token, 4 query heads and 1 kv head
        g = _gen()
        return [_randn(1, 4, 1, 64, g=g).to(device), _randn(1, 1, 1, 64, g=g).to(device),
                torch.tensor([[37]], device=device)]

    def gcla_inputs(device):  # T = 1 with one summary slot
        g = _gen()
        shapes = [(1, 4, 1, 64), (1, 1, 1, 64), (1, 1, 1, 64), (1, 4, 1, 64), (1, 4, 1, 1, 64), (1, 4, 1, 1, 64), (4,)]
        return [_randn(*s, g=g).to(device) for s in shapes]

    def merge_inputs(device):
        g = _gen()
        return [_randn(1, 8, 64, g=g).to(device), torch.arange(8, device=device)]

    def unmerge_inputs(device):
        g = _gen()
        return [_randn(1, 8, 64, g=g).to(device), torch.tensor([[0, 0, 1, 2, 3, 3, 4, 5]], device=device)]

    def lce_inputs(device):  # one decoding step's loss: 4 tokens, a 128-word head
        g = _gen()
        return [_randn(4, 64, g=g).to(device), _randn(128, 64, g=g).to(device),
                torch.tensor([3, 17, -100, 90], device=device)]

    return [
        OverheadCase("F.rms_norm", lambda x, w, s: (F.rms_norm(x, (64,), w, 1e-6),), rms_inputs),
        OverheadCase("rms_norm", lambda x, w, s: (wk.rms_norm(x, w, s, 1e-6),), rms_inputs),
        OverheadCase("add_rms_norm", lambda x, r, w, s: wk.add_rms_norm(x, r, w, s, 1e-6), add_inputs),
        OverheadCase("glu", lambda u: (wk.glu(u, None, "silu"),), glu_inputs),
        OverheadCase("srpe", lambda q, k, p: wk.srpe(q, k, p), srpe_inputs),
        OverheadCase("gcla_attention", lambda *a: (wk.gcla_attention(*a),), gcla_inputs),
        OverheadCase("atm_merge", lambda x, p: wk.atm_merge(x, p, 0.9)[:1], merge_inputs),
        OverheadCase("atm_unmerge", lambda y, m: (wk.atm_unmerge(y, m),), unmerge_inputs),
        OverheadCase("linear_cross_entropy", lambda h, w, y: (wk.linear_cross_entropy(h, w, y),), lce_inputs),
    ]


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
    outs = case.call(*leaves)
    grads = [torch.ones_like(o) for o in outs]

    def step():
        torch.autograd.backward(case.call(*leaves), grads)

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
