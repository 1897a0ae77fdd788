"""Benchmark cases, shared by ``python -m wiola_kernels bench`` and ``benchmarks/``.

A case names an op, builds its inputs on a device, and gives two callables that compute the
same thing: ``fused`` (the public op, on whatever backend dispatch picks) and ``eager``, the
op's formula from :mod:`wiola_kernels.reference` — one function that is the eager baseline
(timed in the case's dtype), what the ``torch.compile`` baseline compiles, and the oracle
that ``check`` runs in float64. No second eager copy of an op lives here.

Each op contributes a factory decorated with :func:`case_factory` that returns its cases for
a device and a size (:data:`SIZES`): ``"small"`` (seconds; smoke tests, CI, ``check``),
``"default"`` (one case per op: what ``python -m wiola_kernels bench`` runs without
options) and ``"full"`` (every shape and dtype, ``bench --full``). Shapes live in
:mod:`wiola_kernels.shapes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from .. import reference
from ..ops.add_rms_norm import add_rms_norm
from ..ops.atm import atm_merge, atm_unmerge
from ..ops.glu import glu
from ..ops.rms_norm import rms_norm
from ..ops.srpe import srpe
from ..shapes import ADD_RMS_NORM_BENCH as ADD_RMS_NORM_SHAPES
from ..shapes import ATM_BENCH, CPU_DEFAULT_BENCH, GCLA_BENCH, GCLA_BENCH_CPU, GCLA_BENCH_HEAD_DIMS, GCLA_BENCH_SMALL
from ..shapes import GLU_BENCH as GLU_SHAPES
from ..shapes import GPU_BENCH_DTYPE, LCE_BENCH
from ..shapes import RMS_NORM_BENCH as RMS_NORM_SHAPES
from ..shapes import SRPE_BENCH as SRPE_SHAPES

#: The sizes a factory is asked for (see the module docstring).
SIZES = ("small", "default", "full")


@dataclass
class BenchCase:
    """One benchmark: an op at one shape and dtype."""

    op: str                                         # registry name: "rms_norm", "srpe", ...
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


_factories: list[Callable[[torch.device, str], list[BenchCase]]] = []


def case_factory(fn: Callable[[torch.device, str], list[BenchCase]]):
    """Register ``fn(device, size) -> [BenchCase, ...]`` (``size`` one of :data:`SIZES`)."""
    _factories.append(fn)
    return fn


def all_cases(device: torch.device | str, small: bool = False, ops: Sequence[str] | None = None,
              size: str | None = None) -> list[BenchCase]:
    """Every registered case for ``device``, optionally only the named ops.

    ``size`` is one of :data:`SIZES`; None means ``"small"`` if ``small`` else ``"full"``.
    """
    device = torch.device(device)
    size = size if size is not None else ("small" if small else "full")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    cases = [c for factory in _factories for c in factory(device, size)]
    if ops:
        known = sorted({c.op for c in cases})
        unknown = [o for o in ops if o not in known]
        if unknown:
            raise ValueError(f"--ops: unknown op(s) {unknown}; known: {known}")
        cases = [c for c in cases if c.op in ops]
    return cases


def _default_dtype(device: torch.device) -> torch.dtype:
    return GPU_BENCH_DTYPE if device.type == "cuda" else torch.float32


def _dtypes(device: torch.device, size: str, cpu_bf16: bool = True) -> list[torch.dtype]:
    """The default dtype (bf16 on CUDA, float32 on the CPU); small and full runs add bf16 on
    the CPU (the model's training dtype, whose kernels convert on the fly) where ``cpu_bf16``."""
    extra = cpu_bf16 and size != "default" and device.type == "cpu"
    return [_default_dtype(device)] + ([torch.bfloat16] if extra else [])


def _shape(op: str, table: dict, device: torch.device, size: str):
    """``table[size]``; the default size is the full shape on CUDA and ``CPU_DEFAULT_BENCH[op]`` on the CPU."""
    if size == "default" and device.type == "cpu":
        if op not in CPU_DEFAULT_BENCH:
            raise ValueError(f"{op} has no shape for the default CPU bench: add one to CPU_DEFAULT_BENCH in "
                             "wiola_kernels/shapes.py")
        return CPU_DEFAULT_BENCH[op]
    return table["full" if size == "default" else size]


@case_factory
def rms_norm_cases(device: torch.device, size: str) -> list[BenchCase]:
    rows, d = _shape("rms_norm", RMS_NORM_SHAPES, device, size)

    def case(dtype: torch.dtype) -> BenchCase:
        def make_inputs():
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(rows, d, generator=g).to(device=device, dtype=dtype)
            weight = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype)
            shift = (0.1 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
            return x, weight, shift

        return BenchCase(
            op="rms_norm", shape=f"x ({rows}, {d})", dtype=dtype, make_inputs=make_inputs,
            fused=lambda x, w, s: rms_norm(x, w, s, 1e-6),
            eager=lambda x, w, s: reference.rms_norm(x, w, s, 1e-6),
            backward_rereads=(0, 1, 2),  # ∂x needs z = x + δ and γ
        )

    return [case(dtype) for dtype in _dtypes(device, size)]


@case_factory
def add_rms_norm_cases(device: torch.device, size: str) -> list[BenchCase]:
    # The residual add before each norm of a layer (x: the attention or DSFF output), as rms_norm's case.
    rows, d = _shape("add_rms_norm", ADD_RMS_NORM_SHAPES, device, size)

    def min_bytes(pass_, inputs, outputs, diff):
        # Read x, residual, γ, δ; write y, s. The backward reads ∂L/∂y, ∂L/∂s and s again and
        # writes one tensor, ∂L/∂x = ∂L/∂residual, plus ∂γ, ∂δ.
        x, residual, weight, shift = inputs
        row_tensor, params = x.numel() * x.element_size(), 2 * weight.numel() * weight.element_size()
        fwd = 4 * row_tensor + params
        return fwd if pass_ == "fwd" else fwd + 4 * row_tensor + params

    def case(dtype: torch.dtype) -> BenchCase:
        def make_inputs():
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(rows, d, generator=g).to(device=device, dtype=dtype)
            residual = torch.randn(rows, d, generator=g).to(device=device, dtype=dtype)
            weight = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype)
            shift = (0.1 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
            return x, residual, weight, shift

        return BenchCase(
            op="add_rms_norm", shape=f"x, residual ({rows}, {d})", dtype=dtype, make_inputs=make_inputs,
            fused=lambda x, r, w, s: add_rms_norm(x, r, w, s, 1e-6),
            eager=lambda x, r, w, s: reference.add_rms_norm(x, r, w, s, 1e-6), min_bytes=min_bytes,
        )

    return [case(dtype) for dtype in _dtypes(device, size)]


@case_factory
def glu_cases(device: torch.device, size: str) -> list[BenchCase]:
    # DSFF's narrow (SiLU, n) and wide (GELU_tanh, w) streams: u = x·[W1; W3]ᵀ of width 2n, one
    # projection's output, given to glu whole (the packed form: its gradient is one tensor).
    dtype = _default_dtype(device)

    def case(tokens: int, n: int, activation: str) -> BenchCase:
        def make_inputs():
            g = torch.Generator(device="cpu").manual_seed(0)
            return (torch.randn(tokens, 2 * n, generator=g).to(device=device, dtype=dtype),)

        return BenchCase(
            op="glu", shape=f"u ({tokens}, 2·{n}), {activation}", dtype=dtype, make_inputs=make_inputs,
            fused=lambda u: glu(u, None, activation), eager=lambda u: reference.glu(u, None, activation),
            backward_rereads=(0,),  # ∂a, ∂b recompute act(a) from u
        )

    streams = [_shape("glu", {"full": GLU_SHAPES["full"][0]}, device, size)] if size == "default" else GLU_SHAPES[size]
    return [case(*stream) for stream in streams]


@case_factory
def srpe_cases(device: torch.device, size: str) -> list[BenchCase]:
    # wiola-360m attention shapes: H = 16, H_kv = 4, d_h = 64.
    b, h, h_kv, t, dh = _shape("srpe", SRPE_SHAPES, device, size)
    dtype = _default_dtype(device)

    def make_inputs():
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(b, h, t, dh, generator=g).to(device=device, dtype=dtype)
        k = torch.randn(b, h_kv, t, dh, generator=g).to(device=device, dtype=dtype)
        positions = torch.arange(t, device=device).expand(b, t).contiguous()
        return q, k, positions

    return [BenchCase(
        op="srpe", shape=f"q ({b}, {h}, {t}, {dh}), k ({b}, {h_kv}, {t}, {dh})", dtype=dtype,
        make_inputs=make_inputs,
        fused=lambda q, k, p: srpe(q, k, p),
        eager=lambda q, k, p: reference.srpe(q, k, p),
        backward_rereads=(2,),  # the rotation is linear: its backward needs the positions, not q or k
    )]


@case_factory
def atm_cases(device: torch.device, size: str) -> list[BenchCase]:
    # ATM merge + unmerge at τ = 0.92 on random tokens with ~10% of adjacent pairs planted as
    # near-duplicates (cos ≈ 0.998; unplanted pairs have |cos| ≈ 0.03 at d = 1024).
    b, t, d = _shape("atm", ATM_BENCH, device, size)
    dtype = torch.float32 if device.type == "cpu" else _default_dtype(device)
    tau, planted = 0.92, 0.10
    notes: dict = {"tau": tau, "planted_pair_rate": planted}

    def make_inputs():
        g = torch.Generator(device="cpu").manual_seed(0)
        copy_prev = torch.rand(b, t, generator=g) < planted           # token t repeats token t-1
        copy_prev[:, 0] = False
        group = torch.cumsum(~copy_prev, dim=1) - 1                    # (B, T) source token
        base = torch.randn(b, t, d, generator=g)
        x = base.gather(1, group.unsqueeze(-1).expand(b, t, d)) + 0.05 * torch.randn(b, t, d, generator=g)
        x = x.to(device=device, dtype=dtype)
        positions = torch.arange(t, device=device).expand(b, t).contiguous()
        with torch.no_grad():
            merged_len = reference.atm_merge(x, positions, tau)[2].double()
        # Attention FLOPs scale with T² per row (a causal mask halves both sides alike).
        notes["merged_token_pct"] = round(100.0 * float(1 - merged_len.sum() / (b * t)), 2)
        notes["attention_flops_saved_pct"] = round(100.0 * float(1 - (merged_len ** 2).sum() / (b * t * t)), 2)
        return x, positions

    def fused(x, positions):
        merged, _, _, index_map = atm_merge(x, positions, tau)
        return atm_unmerge(merged, index_map)

    def eager(x, positions):
        merged, _, _, index_map = reference.atm_merge(x, positions, tau)
        return reference.atm_unmerge(merged, index_map)

    return [BenchCase(op="atm", shape=f"x ({b}, {t}, {d}), merge+unmerge", dtype=dtype, make_inputs=make_inputs,
                      fused=fused, eager=eager, differentiable=(0,), notes=notes)]


@case_factory
def gcla_attention_cases(device: torch.device, size: str) -> list[BenchCase]:
    # wiola-360m attention (H 16, H_kv 4, d_h 64) with Λ' = 2 causal (prefix-mean) summaries.
    from ..ops.gcla_attention import gcla_attention

    full = GCLA_BENCH if device.type == "cuda" else GCLA_BENCH_CPU
    shape = _shape("gcla_attention", {"small": GCLA_BENCH_SMALL, "full": full}, device, size)
    b, h, h_kv, t, lam = (shape[k] for k in ("B", "H", "H_kv", "T", "L"))
    dh = GCLA_BENCH_HEAD_DIMS[0]
    dtype = _default_dtype(device)

    def make_inputs():
        g = torch.Generator(device="cpu").manual_seed(0)

        def r(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        gate = (-3.0 + 0.5 * torch.randn(h, generator=g)).to(device)
        return r(b, h, t, dh), r(b, h_kv, t, dh), r(b, h_kv, t, dh), r(b, h, t, dh), r(b, h, t, lam, dh), \
            r(b, h, t, lam, dh), gate

    return [BenchCase(
        op="gcla_attention", shape=f"q ({b}, {h}, {t}, {dh}), kv heads {h_kv}, Λ' {lam} causal", dtype=dtype,
        make_inputs=make_inputs, fused=gcla_attention, eager=reference.gcla_attention, tolerance_kind="attention",
        backward_rereads=tuple(range(7)),  # attention's backward recomputes from every input
    )]


@case_factory
def linear_cross_entropy_cases(device: torch.device, size: str) -> list[BenchCase]:
    # The wiola-360m head (tied embedding, V = 32000, d = 1024) on N = 4096 tokens, 5% of
    # them padding (ignore_index); float32 and bfloat16 on the CPU.
    from ..ops.linear_cross_entropy import linear_cross_entropy

    n, d, V = _shape("linear_cross_entropy", LCE_BENCH, device, size)

    def case(dtype: torch.dtype) -> BenchCase:
        def make_inputs():
            g = torch.Generator(device="cpu").manual_seed(0)
            h = torch.randn(n, d, generator=g).to(device=device, dtype=dtype)
            W = (torch.randn(V, d, generator=g) * d ** -0.5).to(device=device, dtype=dtype)
            labels = torch.randint(0, V, (n,), generator=g)
            labels[torch.rand(n, generator=g) < 0.05] = -100
            return h, W, labels.to(device)

        return BenchCase(
            op="linear_cross_entropy", shape=f"h ({n}, {d}), W ({V}, {d})", dtype=dtype, make_inputs=make_inputs,
            fused=lambda h, W, y: linear_cross_entropy(h, W, y),
            eager=lambda h, W, y: reference.linear_cross_entropy(h, W, y),
            differentiable=(0, 1), backward_rereads=(0, 1, 2), tolerance_kind="attention",
            peak_memory=True, compute_bound=True,
        )

    return [case(dtype) for dtype in _dtypes(device, size)]
