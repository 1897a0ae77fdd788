"""The device-time table on CUDA: our ops at sizes that fill the GPU, beside eager PyTorch,
Liger-Kernel, Cut Cross-Entropy, SDPA-flash and a same-size device copy, in one run.

    python -m wiola_kernels.bench.gpu_cases                    # every row, printed as it completes
    python -m wiola_kernels.bench.gpu_cases --ops rms_norm,lce --json out.json
    python -m wiola_kernels.bench.gpu_cases --list             # the plan (no GPU needed)

Every number is device time (:mod:`wiola_kernels.bench.device_time`: CUDA events around
replays of a captured graph of many calls, or a queued backlog where a pass cannot be
captured, inputs rotated, L2 flushed, medians). ``GB/s`` is the fewest bytes the pass must
move (each input read once, each output written once; for ``fwd+bwd`` also the output
gradients, the input gradients and what the backward must read again — the same count for
every implementation of a row) over that time; ``% copy`` puts it against a device copy of the
same byte count timed the same way in the same run. ``x wiola`` is this implementation's time
over ours: above 1, ours is faster.

Rows ("real" sizes, ≥ 256 MB a pass for the memory-bound ops; bf16):

* rms_norm (65536, 4096): ours (δ = None, plain RMSNorm), ours with δ, ``F.rms_norm``, Liger.
* add_rms_norm (65536, 4096): ours, eager (add + ``F.rms_norm``), Liger's fused add+RMSNorm.
* glu (8192, 2·8192) — Llama-3.2-1B's MLP at B 4 × T 2048: SwiGLU packed (ours, eager, Liger's
  packed gate-up), GeGLU on separate halves (ours, eager, Liger).
* rope (B 16, H 32, H_kv 8, T 4096, d_h 64), q/k as Hugging Face lays them out: ours
  (``srpe`` with ``spiral_divisor=inf, radial_amplitude=0``), our full SRPE, eager RoPE
  (Hugging Face's rotate-half), Liger.
* linear_cross_entropy N 8192, d 2048, V 128256 (Llama-3.2-1B's head at B 4 × T 2048, 5 %
  ignored labels): ours, eager (logits + ``F.cross_entropy``), Liger FLCE, CCE; with peak memory.
* gcla_attention B 4, H 16, H_kv 4, T 4096, d_h 64 and 128, Λ' 2: ours and SDPA-flash alone.

"today" rows: every case of ``bench/cases.py`` at its usual (smaller) shape, ours and eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from . import peers
from .cases import BenchCase

PASSES = ("fwd", "fwd+bwd")
DTYPE = torch.bfloat16
EPS = 1e-6

#: The real sizes (bf16), one line each: what SPEC §11 and the issue ask for.
RMS_NORM_REAL = (65536, 4096)
ADD_RMS_NORM_REAL = (65536, 4096)
GLU_REAL = (8192, 8192)                 # (tokens, n): Llama-3.2-1B MLP at B 4 × T 2048
ROPE_REAL = (16, 32, 8, 4096, 64)       # (B, H, H_kv, T, d_h)
LCE_REAL = (8192, 2048, 128256)         # (N, d, V): Llama-3.2-1B head at B 4 × T 2048
GCLA_REAL = dict(B=4, H=16, H_kv=4, T=4096, L=2)
GCLA_REAL_HEAD_DIMS = (64, 128)
MIN_REAL_PASS_BYTES = 256 * 2**20       # what a memory-bound "real" row must move per forward


@dataclass
class Impl:
    """One implementation in a row: ``fn`` on inputs from ``make_inputs`` (default: the case's)."""

    label: str                                     # "wiola", "eager", "liger", "cce", "sdpa-flash", ...
    fn: Callable[..., object]
    make_inputs: Callable[[], tuple] | None = None
    differentiable: Sequence[int] | None = None
    peer: str | None = None                        # "liger" / "cce": skipped with a reason when unavailable
    peak_memory: bool = False

    def bench_case(self, case: BenchCase) -> BenchCase:
        """``case`` with this implementation's inputs (what ``runner.make_pass`` and ``device_time`` read)."""
        return dataclasses.replace(case, fused=self.fn, make_inputs=self.make_inputs or case.make_inputs,
                                   differentiable=self.differentiable if self.make_inputs else case.differentiable)


@dataclass
class GpuCase:
    """A row group: our case (op, shape, inputs, byte count) and the implementations timed on it."""

    case: BenchCase
    impls: list[Impl]
    size: str = "real"                              # "real" or "today"
    memory_bound: bool = True                       # False: no copy baseline (GEMMs, attention)
    passes: tuple = PASSES
    notes: dict = field(default_factory=dict)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(*shape, g, device, dtype=DTYPE, scale=1.0) -> torch.Tensor:
    """Normal random numbers drawn on ``device`` (seeded from ``g``): at these sizes a CPU draw
    takes seconds a tensor. Never zeros: they can run faster than real data."""
    seed = int(torch.randint(0, 2**62, (1,), generator=g))
    dg = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*shape, generator=dg, device=device, dtype=torch.float32 if dtype == DTYPE else dtype)
    return (x.mul_(scale) if scale != 1.0 else x).to(dtype)


# ------------------------------------------------------------------------------ real sizes

def rms_norm_case(device: torch.device, shape=RMS_NORM_REAL) -> GpuCase:
    from ..ops.rms_norm import rms_norm

    rows, d = shape

    def make_inputs():
        g = _gen()
        return (_randn(rows, d, g=g, device=device), (torch.rand(d, generator=g) + 0.5).to(device, DTYPE))

    def make_inputs_shift():
        x, w = make_inputs()
        return x, w, _randn(d, g=_gen(1), device=device, scale=0.1)

    case = BenchCase(op="rms_norm", shape=f"x ({rows}, {d})", dtype=DTYPE, make_inputs=make_inputs,
                     fused=lambda x, w: rms_norm(x, w, None, EPS), eager=lambda x, w: F.rms_norm(x, (d,), w, EPS),
                     backward_rereads=(0, 1))
    return GpuCase(case, [
        Impl("wiola", case.fused), Impl("eager", case.eager),
        Impl("wiola+δ", lambda x, w, s: rms_norm(x, w, s, EPS), make_inputs=make_inputs_shift),
        Impl("liger", lambda x, w: peers.liger_rms_norm(x, w, EPS), peer="liger"),
    ])


def add_rms_norm_case(device: torch.device, shape=ADD_RMS_NORM_REAL) -> GpuCase:
    from ..ops.add_rms_norm import add_rms_norm

    rows, d = shape

    def make_inputs():
        g = _gen()
        return (_randn(rows, d, g=g, device=device), _randn(rows, d, g=g, device=device),
                (torch.rand(d, generator=g) + 0.5).to(device, DTYPE))

    def eager(x, r, w):
        s = x + r
        return F.rms_norm(s, (d,), w, EPS), s

    def min_bytes(pass_, inputs, outputs, diff):
        # Read x, residual, γ; write y, s. The backward reads ∂y, ∂s and s and writes ∂x (= ∂residual), ∂γ.
        x, _, w = inputs
        row, par = x.numel() * x.element_size(), w.numel() * w.element_size()
        fwd = 4 * row + par
        return fwd if pass_ == "fwd" else fwd + 4 * row + par

    case = BenchCase(op="add_rms_norm", shape=f"x, residual ({rows}, {d})", dtype=DTYPE, make_inputs=make_inputs,
                     fused=lambda x, r, w: add_rms_norm(x, r, w, None, EPS), eager=eager,
                     min_bytes=min_bytes)
    return GpuCase(case, [Impl("wiola", case.fused), Impl("eager", eager),
                          Impl("liger", lambda x, r, w: peers.liger_add_rms_norm(x, r, w, EPS), peer="liger")])


def glu_cases(device: torch.device, shape=GLU_REAL) -> list[GpuCase]:
    from .. import reference
    from ..ops.glu import glu

    tokens, n = shape

    def packed():
        return (_randn(tokens, 2 * n, g=_gen(), device=device),)

    def halves():
        g = _gen()
        return _randn(tokens, n, g=g, device=device), _randn(tokens, n, g=g, device=device)

    swiglu = BenchCase(op="glu", shape=f"u ({tokens}, 2·{n}), silu, packed", dtype=DTYPE, make_inputs=packed,
                       fused=lambda u: glu(u, None, "silu"), eager=lambda u: reference.glu(u, None, "silu"),
                       backward_rereads=(0,))
    geglu = BenchCase(op="glu", shape=f"a, b ({tokens}, {n}), gelu_tanh", dtype=DTYPE, make_inputs=halves,
                      fused=lambda a, b: glu(a, b, "gelu_tanh"),
                      eager=lambda a, b: F.gelu(a, approximate="tanh") * b, backward_rereads=(0, 1))
    return [
        GpuCase(swiglu, [Impl("wiola", swiglu.fused), Impl("eager", swiglu.eager),
                         Impl("liger", peers.liger_swiglu_packed, peer="liger"),
                         Impl("liger (a, b)", peers.liger_swiglu, make_inputs=halves, peer="liger")]),
        GpuCase(geglu, [Impl("wiola", geglu.fused), Impl("eager", geglu.eager),
                        Impl("liger", peers.liger_geglu, peer="liger")]),
    ]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(t: int, dh: int, device, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face Llama's ``(cos, sin)`` of shape ``(1, T, d_h)`` in bf16 (float32 angles)."""
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh)
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None].to(device, DTYPE), emb.sin()[None].to(device, DTYPE)


def rope_case(device: torch.device, shape=ROPE_REAL) -> GpuCase:
    from ..ops.srpe import srpe

    b, h, h_kv, t, dh = shape
    tables: dict = {}  # positions and HF's cos/sin, made with the first inputs (nothing is allocated before)

    def make_inputs():  # the q/k projections, (B, T, H·d_h) and (B, T, H_kv·d_h), as Hugging Face has them
        if not tables:
            tables["positions"] = torch.arange(t, device=device)[None]
            tables["cos"], tables["sin"] = rope_tables(t, dh, device)
        g = _gen()
        return _randn(b, t, h * dh, g=g, device=device), _randn(b, t, h_kv * dh, g=g, device=device)

    def heads(qp, kp):  # HF: .view(B, T, H, d_h).transpose(1, 2), no copy
        return qp.view(b, t, h, dh).transpose(1, 2), kp.view(b, t, h_kv, dh).transpose(1, 2)

    def ours(qp, kp):
        return srpe(*heads(qp, kp), tables["positions"], spiral_divisor=math.inf, radial_amplitude=0.0)

    def ours_spiral(qp, kp):
        return srpe(*heads(qp, kp), tables["positions"])

    def eager(qp, kp):
        q, k = heads(qp, kp)
        c, s = tables["cos"][:, None], tables["sin"][:, None]
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    def liger(qp, kp):
        return peers.liger_rope(*heads(qp, kp), tables["cos"], tables["sin"])

    def min_bytes(pass_, inputs, outputs, diff):  # q, k read and written; the gradients likewise
        qk = sum(x.numel() * x.element_size() for x in inputs)
        return 2 * qk if pass_ == "fwd" else 4 * qk

    case = BenchCase(op="rope", shape=f"q ({b}, {h}, {t}, {dh}), k ({b}, {h_kv}, {t}, {dh}), HF layout",
                     dtype=DTYPE, make_inputs=make_inputs, fused=ours, eager=eager, min_bytes=min_bytes)
    return GpuCase(case, [Impl("wiola", ours), Impl("eager", eager), Impl("wiola srpe", ours_spiral),
                          Impl("liger", liger, peer="liger")])


def linear_cross_entropy_case(device: torch.device, shape=LCE_REAL) -> GpuCase:
    from .. import reference
    from ..ops.linear_cross_entropy import linear_cross_entropy

    n, d, V = shape

    def make_inputs():
        g = _gen()
        h = _randn(n, d, g=g, device=device)
        W = _randn(V, d, g=g, device=device, scale=d ** -0.5)
        labels = torch.randint(0, V, (n,), generator=g)
        labels[torch.rand(n, generator=g) < 0.05] = -100
        return h, W, labels.to(device)

    case = BenchCase(op="linear_cross_entropy", shape=f"h ({n}, {d}), W ({V}, {d})", dtype=DTYPE,
                     make_inputs=make_inputs, fused=lambda h, W, y: linear_cross_entropy(h, W, y),
                     eager=lambda h, W, y: reference.linear_cross_entropy(h, W, y), differentiable=(0, 1),
                     backward_rereads=(0, 1, 2), peak_memory=True, compute_bound=True)
    return GpuCase(case, [Impl("wiola", case.fused, peak_memory=True), Impl("eager", case.eager, peak_memory=True),
                          Impl("liger", peers.liger_linear_cross_entropy, peer="liger", peak_memory=True),
                          Impl("cce", peers.cce_linear_cross_entropy, peer="cce", peak_memory=True)],
                   memory_bound=False)


def gcla_cases(device: torch.device, shape=None, head_dims=GCLA_REAL_HEAD_DIMS) -> list[GpuCase]:
    from .. import reference
    from ..ops.gcla_attention import gcla_attention
    from .attention import _sdpa_flash

    s = dict(GCLA_REAL, **(shape or {}))
    b, h, h_kv, t, lam = s["B"], s["H"], s["H_kv"], s["T"], s["L"]
    out = []
    for dh in head_dims:
        def make_inputs(dh=dh):
            g = _gen(dh)

            def r(*size):
                return _randn(*size, g=g, device=device)

            return (r(b, h, t, dh), r(b, h_kv, t, dh), r(b, h_kv, t, dh), r(b, h, t, dh), r(b, h, t, lam, dh),
                    r(b, h, t, lam, dh), (-3.0 + 0.5 * torch.randn(h, generator=g)).to(device))

        def flash_inputs(make_inputs=make_inputs):
            return make_inputs()[:3]

        case = BenchCase(op="gcla_attention", shape=f"q ({b}, {h}, {t}, {dh}), kv heads {h_kv}, Λ' {lam} causal",
                         dtype=DTYPE, make_inputs=make_inputs, fused=gcla_attention, eager=reference.gcla_attention,
                         backward_rereads=tuple(range(7)), compute_bound=True)
        out.append(GpuCase(case, [Impl("wiola", gcla_attention), Impl("eager", case.eager),
                                  Impl("sdpa-flash", _sdpa_flash, make_inputs=flash_inputs)], memory_bound=False))
    return out


REAL_FACTORIES = {
    "rms_norm": lambda dev: [rms_norm_case(dev)],
    "add_rms_norm": lambda dev: [add_rms_norm_case(dev)],
    "glu": glu_cases,
    "rope": lambda dev: [rope_case(dev)],
    "linear_cross_entropy": lambda dev: [linear_cross_entropy_case(dev)],
    "gcla_attention": gcla_cases,
}
OP_ALIASES = {"lce": "linear_cross_entropy", "gcla": "gcla_attention", "srpe": "rope", "rms": "rms_norm"}


def today_cases(device: torch.device, ops: Sequence[str] | None = None) -> list[GpuCase]:
    """Every ``bench/cases.py`` case at its usual shape, ours and eager ("today" rows)."""
    from .cases import all_cases

    known = {c.op for c in all_cases(device, small=True)}
    wanted = None if ops is None else [o for o in ops if o in known]
    if wanted == []:
        return []
    return [GpuCase(c, [Impl("wiola", c.fused), Impl("eager", c.eager)], size="today",
                    memory_bound=not c.compute_bound) for c in all_cases(device, ops=wanted)]


def gpu_cases(device: torch.device | str, ops: Sequence[str] | None = None,
              sizes: Sequence[str] = ("real", "today")) -> list[GpuCase]:
    """The row groups of the table, real sizes first (no tensor is allocated until a row runs).

    Raises:
        ValueError: an unknown op or size.
    """
    device = torch.device(device)
    ops = None if ops is None else [OP_ALIASES.get(o, o) for o in ops]
    known = set(REAL_FACTORIES) | {"srpe", "atm"}
    bad = [o for o in ops or () if o not in known]
    if bad:
        raise ValueError(f"--ops: unknown {bad}; known: {sorted(known | set(OP_ALIASES))}")
    bad = [s for s in sizes if s not in ("real", "today")]
    if bad:
        raise ValueError(f"--sizes: unknown {bad}; known: ['real', 'today']")
    out: list[GpuCase] = []
    if "real" in sizes:
        for op, factory in REAL_FACTORIES.items():
            if ops is None or op in ops:
                out += factory(device)
    if "today" in sizes:
        today_ops = None if ops is None else [("srpe" if o == "rope" else o) for o in ops]
        today = today_cases(device, today_ops)
        real_shapes = {(g.case.op, g.case.shape) for g in out}
        out += [g for g in today if (g.case.op, g.case.shape) not in real_shapes]  # GCLA's is a real row already
    return out


# ------------------------------------------------------------------------------ running

def run_group(group: GpuCase, device: torch.device, *, replays: int = 10,
              emit: Callable[[dict], None] | None = None, passes: Sequence[str] = PASSES,
              timer=None) -> list[dict]:
    """Time every implementation of ``group`` for each pass (and the copy, memory-bound groups).

    Args:
        group: the row group.
        device: the CUDA device.
        replays: timed replays per row.
        emit: called with each row as it completes (printing, saving).
        passes: which passes.
        timer: a :class:`~wiola_kernels.bench.device_time.Timer` (default: CUDA's; tests pass a stub).

    Returns:
        The rows: dicts with ``op, shape, dtype, size, pass_, bytes, impl`` and ``ms, gbps,
        pct_of_copy, x_wiola, method, host_us, peak_mb`` — or ``skipped`` (a peer that cannot
        run here, with the reason) or ``error`` (an implementation that failed).
    """
    from . import device_time as dt
    from .memory import peak_mb
    from .cases import min_bytes

    case = group.case
    rows = []
    first_inputs = case.make_inputs()
    for pass_ in [p for p in group.passes if p in passes]:
        nbytes = min_bytes(case, pass_, first_inputs)
        base = dict(op=case.op, shape=case.shape, dtype=str(case.dtype).replace("torch.", ""), size=group.size,
                    pass_=pass_, bytes=nbytes)
        copy = None
        if group.memory_bound:
            try:
                c, moved = dt.copy_time(nbytes, device, timer=timer, replays=replays)
                copy = (c, moved)
                row = dict(base, impl="copy", ms=c.ms, gbps=dt.gbps(moved, c.ms), pct_of_copy=100.0,
                           method=c.method, host_us=None, note=c.note)
            except Exception as exc:  # noqa: BLE001
                row = dict(base, impl="copy", error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            if emit is not None:
                emit(row)
        ours_ms = None
        for impl in group.impls:
            row = dict(base, impl=impl.label)
            if impl.peer is not None:
                st = peers.status(impl.peer, device)
                if not st.available:
                    row["skipped"] = st.describe()
                    rows.append(row)
                    if emit is not None:
                        emit(row)
                    continue
            try:
                icase = impl.bench_case(case)
                t = dt.pass_time(icase, pass_, impl.fn, device, timer=timer, nbytes=nbytes, replays=replays)
                row.update(ms=t.ms, gbps=dt.gbps(nbytes, t.ms), method=t.method, host_us=t.host_us, note=t.note,
                           calls=t.calls, sets=t.sets, host_bound=t.host_bound)
                if copy is not None:
                    row["pct_of_copy"] = dt.pct_of_copy(nbytes, t.ms, copy[1], copy[0].ms)
                if impl.label == "wiola":
                    ours_ms = t.ms
                if ours_ms is not None:
                    row["x_wiola"] = t.ms / ours_ms
                if impl.peak_memory and pass_ == "fwd+bwd":
                    row["peak_mb"] = peak_mb(dt.device_pass(icase, impl.fn, pass_, icase.make_inputs()), device)
            except Exception as exc:  # noqa: BLE001 - one implementation failing must not end the table
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            rows.append(row)
            if emit is not None:
                emit(row)
    del first_inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


HEADER = (f"{'op':<21}{'size':<6}{'pass':<9}{'impl':<14}{'ms':>10}{'GB/s':>8}{'% copy':>8}{'x wiola':>8}"
          f"{'host µs':>9}{'peak MiB':>10}  {'method':<8} shape")


def format_row(r: dict) -> str:
    """One table line (a skipped peer or an error says why)."""
    head = f"{r['op']:<21}{r['size']:<6}{r['pass_']:<9}{r['impl']:<14}"
    if "skipped" in r:
        return head + f"{'-':>10}  skipped: {r['skipped']}"
    if "error" in r:
        return head + f"{'-':>10}  ERROR: {r['error']}"

    def opt(key, fmt, width):
        v = r.get(key)
        return f"{'-':>{width}}" if v is None else f"{v:>{width}{fmt}}"

    return (head + f"{r['ms']:>10.4f}" + opt("gbps", ".0f", 8) + opt("pct_of_copy", ".0f", 8)
            + opt("x_wiola", ".2f", 8) + opt("host_us", ".1f", 9) + opt("peak_mb", ".0f", 10)
            + f"  {r['method'] + ('!' if r.get('host_bound') else ''):<8} {r['shape']}"
            + (f"  [{r['note']}]" if r.get("note") else ""))


def environment_line(device: torch.device) -> str:
    """Device, driver, torch/CUDA/Triton and the peers' versions, in one line."""
    parts = [f"torch {torch.__version__}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts.insert(0, f"{props.name} ({props.multi_processor_count} SMs, "
                        f"L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MiB)")
        parts.append(f"CUDA {torch.version.cuda}")
        try:
            import subprocess

            drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
            parts.append(f"driver {drv[0] if drv else '?'}")
        except (OSError, subprocess.SubprocessError):
            parts.append("driver ?")
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("triton: not installed")
    parts += list(peers.versions().values())
    return ", ".join(parts)


def plan_lines(groups: list[GpuCase], device: torch.device) -> list[str]:
    """What the table will time, without allocating anything (``--list``)."""
    lines = []
    for g in groups:
        labels = []
        for impl in g.impls:
            st = peers.status(impl.peer, device) if impl.peer else None
            labels.append(impl.label if st is None or st.available else f"{impl.label} ({st.reason})")
        copy = " + copy" if g.memory_bound else ""
        lines.append(f"{g.case.op:<21}{g.size:<6}{g.case.shape}: {', '.join(labels)}{copy}; {'/'.join(g.passes)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m wiola_kernels.bench.gpu_cases``: the device-time table (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m wiola_kernels.bench.gpu_cases",
                                description="Device time of our ops at sizes that fill the GPU, beside eager, "
                                            "Liger-Kernel, Cut Cross-Entropy, SDPA-flash and a device copy.")
    p.add_argument("--ops", help=f"comma-separated: {', '.join(REAL_FACTORIES)} (aliases: {', '.join(OP_ALIASES)})")
    p.add_argument("--sizes", default="real,today", help="real, today or both (default)")
    p.add_argument("--passes", default="all", choices=("all", *PASSES))
    p.add_argument("--replays", type=int, default=10, help="timed graph replays per row (median)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON (rewritten after every row)")
    p.add_argument("--list", action="store_true", help="print the plan and the peers' status; no GPU needed")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    ops = [o.strip() for o in a.ops.split(",") if o.strip()] if a.ops else None
    try:
        groups = gpu_cases(device, ops, [s.strip() for s in a.sizes.split(",") if s.strip()])
    except ValueError as exc:
        print(f"gpu_cases: {exc}", file=sys.stderr)
        return 2
    if a.list:
        print(f"device-time table plan ({len(groups)} row groups): {environment_line(torch.device('cpu'))}")
        print("\n".join(plan_lines(groups, device)))
        return 0
    if device.type != "cuda" or not torch.cuda.is_available():
        print("gpu_cases: device time needs a CUDA device (use --list here)", file=sys.stderr)
        return 2
    passes = PASSES if a.passes == "all" else (a.passes,)
    print(f"device-time table: {environment_line(device)}", flush=True)
    print("(ms: median device time per call; x wiola: its time over ours; method graph = CUDA-graph replays, "
          "backlog = queued calls, ! = host-bound)", flush=True)
    print(HEADER, flush=True)
    all_rows: list[dict] = []
    t0 = time.perf_counter()

    def emit(row: dict) -> None:
        all_rows.append(row)
        print(format_row(row), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(all_rows, f, indent=1)

    for g in groups:
        run_group(g, device, replays=a.replays, emit=emit, passes=passes)
    print(f"{len(all_rows)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
