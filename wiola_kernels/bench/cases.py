"""Benchmark cases, shared by ``python -m wiola_kernels bench`` and ``benchmarks/``.

A case names an op, builds its inputs on a device, and gives callables that compute the
same thing: ``fused`` (the public op, on whatever backend dispatch picks), ``eager`` (the
plain PyTorch baseline a model author would write), ``compiled_baseline`` (what the
``torch.compile`` baseline compiles; by default ``eager``) and ``oracle`` (the SPEC
formula from :mod:`wiola_kernels.reference`, which ``check`` runs in float64; never
timed). Each op contributes a factory decorated
with :func:`case_factory` that returns its cases for a device; ``small=True`` asks for
shapes that run in seconds (smoke tests, CI).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .. import reference
from ..ops.add_rms_norm import add_rms_norm
from ..ops.atm import atm_merge, atm_unmerge
from ..ops.glu import glu
from ..ops.rms_norm import rms_norm
from ..ops.srpe import srpe
from ..shapes import ADD_RMS_NORM_BENCH as ADD_RMS_NORM_SHAPES
from ..shapes import ATM_BENCH, GCLA_BENCH, GCLA_BENCH_CPU, GCLA_BENCH_HEAD_DIMS, GCLA_BENCH_SMALL, GPU_BENCH_DTYPE
from ..shapes import GLU_BENCH as GLU_SHAPES
from ..shapes import RMS_NORM_BENCH as RMS_NORM_SHAPES
from ..shapes import SRPE_BENCH as SRPE_SHAPES


@dataclass
class BenchCase:
    """One benchmark: an op at one shape and dtype."""

    op: str                                         # registry name: "rms_norm", "srpe", ...
    shape: str                                      # human-readable, e.g. "x (16384, 1024)"
    dtype: torch.dtype
    make_inputs: Callable[[], tuple[torch.Tensor, ...]]  # fresh leaf tensors on the device
    fused: Callable[..., object]                    # the fused op
    eager: Callable[..., object]                    # eager PyTorch baseline
    oracle: Callable[..., object]                   # wiola_kernels.reference's formula (`check`, in float64)
    compiled_baseline: Callable[..., object] | None = None  # what torch.compile compiles (default: eager)
    differentiable: Sequence[int] | None = None     # input indices that get gradients (default: float ones)
    min_bytes: Callable[[str, tuple, tuple, tuple], int] | None = None  # override of the byte count
    backward_rereads: Sequence[int] = ()             # inputs the backward must read again (bench byte count)
    notes: dict = field(default_factory=dict)       # extra numbers a case wants reported
    tolerance_kind: str = "elementwise"             # SPEC §9 class for `check`: elementwise|attention

    def baseline_to_compile(self) -> Callable[..., object]:
        """The callable the ``torch.compile`` baseline compiles (``compiled_baseline``, else ``eager``)."""
        return self.compiled_baseline if self.compiled_baseline is not None else self.eager


_factories: list[Callable[[torch.device, bool], list[BenchCase]]] = []


def case_factory(fn: Callable[[torch.device, bool], list[BenchCase]]):
    """Register ``fn(device, small) -> [BenchCase, ...]``."""
    _factories.append(fn)
    return fn


def all_cases(device: torch.device | str, small: bool = False, ops: Sequence[str] | None = None) -> list[BenchCase]:
    """Every registered case for ``device``, optionally only the named ops."""
    device = torch.device(device)
    cases = [c for factory in _factories for c in factory(device, small)]
    if ops:
        known = sorted({c.op for c in cases})
        unknown = [o for o in ops if o not in known]
        if unknown:
            raise ValueError(f"--ops: unknown op(s) {unknown}; known: {known}")
        cases = [c for c in cases if c.op in ops]
    return cases


# Shapes per op, small (smoke tests) and full: wiola_kernels/shapes.py, which the AOT compiles
# and gpu-report read too.


def _default_dtype(device: torch.device) -> torch.dtype:
    return GPU_BENCH_DTYPE if device.type == "cuda" else torch.float32


@case_factory
def rms_norm_cases(device: torch.device, small: bool) -> list[BenchCase]:
    # On the CPU also in bf16 (the training dtype of the model), whose kernels convert on the fly.
    rows, d = RMS_NORM_SHAPES["small" if small else "full"]
    dtypes = [_default_dtype(device)] + ([torch.bfloat16] if device.type == "cpu" else [])

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
            eager=lambda x, w, s: _rms_norm_eager(x, w, s, 1e-6),
            oracle=lambda x, w, s: reference.rms_norm(x, w, s, 1e-6),
            backward_rereads=(0, 1, 2),  # ∂x needs z = x + δ and γ
        )

    return [case(dtype) for dtype in dtypes]


def _rms_norm_eager(x, weight, shift, eps):
    """WiolaRMSNorm as plain eager PyTorch, the way a model author writes it (float32 statistics,
    none of the oracle's overflow care, which would slow the baseline down)."""
    z = x.float() + shift.float()
    return (weight.float() * z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@case_factory
def add_rms_norm_cases(device: torch.device, small: bool) -> list[BenchCase]:
    # The residual add before each norm of a layer (x: the attention or DSFF output), as rms_norm's case.
    rows, d = ADD_RMS_NORM_SHAPES["small" if small else "full"]
    dtypes = [_default_dtype(device)] + ([torch.bfloat16] if device.type == "cpu" else [])

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

        def eager(x, residual, weight, shift):
            s = x + residual
            return _rms_norm_eager(s, weight, shift, 1e-6), s

        return BenchCase(
            op="add_rms_norm", shape=f"x, residual ({rows}, {d})", dtype=dtype, make_inputs=make_inputs,
            fused=lambda x, r, w, s: add_rms_norm(x, r, w, s, 1e-6), eager=eager,
            oracle=lambda x, r, w, s: reference.add_rms_norm(x, r, w, s, 1e-6), min_bytes=min_bytes,
        )

    return [case(dtype) for dtype in dtypes]


def _glu_eager(u: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated activation on one projection's output as eager PyTorch, the way a model author
    writes it (``chunk``: its backward is one ``cat`` of the halves' gradients)."""
    import torch.nn.functional as F

    a, b = u.chunk(2, dim=-1)
    return (F.silu(a) if activation == "silu" else F.gelu(a, approximate="tanh")) * b


@case_factory
def glu_cases(device: torch.device, small: bool) -> list[BenchCase]:
    # DSFF's narrow (SiLU, n) and wide (GELU_tanh, w) streams: u = x·[W1; W3]ᵀ of width 2n, one
    # projection's output, given to glu whole (the packed form: its gradient is one tensor).
    dtype = _default_dtype(device)

    def case(tokens: int, n: int, activation: str) -> BenchCase:
        def make_inputs():
            g = torch.Generator(device="cpu").manual_seed(0)
            return (torch.randn(tokens, 2 * n, generator=g).to(device=device, dtype=dtype),)

        return BenchCase(
            op="glu", shape=f"u ({tokens}, 2·{n}), {activation}", dtype=dtype, make_inputs=make_inputs,
            fused=lambda u: glu(u, None, activation), eager=lambda u: _glu_eager(u, activation),
            oracle=lambda u: reference.glu(u, None, activation),
            backward_rereads=(0,),  # ∂a, ∂b recompute act(a) from u
        )

    return [case(*stream) for stream in GLU_SHAPES["small" if small else "full"]]


@case_factory
def srpe_cases(device: torch.device, small: bool) -> list[BenchCase]:
    # wiola-360m attention shapes: H = 16, H_kv = 4, d_h = 64.
    b, h, h_kv, t, dh = SRPE_SHAPES["small" if small else "full"]
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
        oracle=lambda q, k, p: reference.srpe(q, k, p),
        backward_rereads=(2,),  # the rotation is linear: its backward needs the positions, not q or k
    )]


def _atm_merge_eager(x, positions, tau):
    """ATM merge as plain eager PyTorch, the way a model author writes it: ``F.cosine_similarity``,
    the parallel form of the greedy rule, a scatter-add mean (none of the oracle's care for
    extreme magnitudes, which would slow the baseline down). Returns what ``atm_merge`` does."""
    import torch.nn.functional as F

    b, t, d = x.shape
    cand = F.cosine_similarity(x[:, :-1].float(), x[:, 1:].float(), dim=-1) > tau  # (B, T-1)
    edge = torch.arange(t - 1, device=x.device)
    run_start = torch.where(cand & ~F.pad(cand[:, :-1], (1, 0)), edge, 0).cummax(1).values
    taken = cand & ((edge - run_start) % 2 == 0)  # a, a+2, ... of every run of candidates
    index_map = torch.arange(t, device=x.device) - F.pad(taken.long().cumsum(1), (1, 0))
    slots = index_map.unsqueeze(-1)
    count = torch.zeros(b, t, 1, device=x.device).scatter_add(1, slots, torch.ones(b, t, 1, device=x.device))
    merged = torch.zeros(b, t, d, device=x.device).scatter_add(1, slots.expand(b, t, d), x.float())
    merged = (merged / count.clamp(min=1)).to(x.dtype)
    merged_positions = torch.full_like(positions, t).scatter_reduce(1, index_map, positions, "amin")
    merged_lengths = t - taken.sum(1)
    return merged, merged_positions, merged_lengths, index_map


@case_factory
def atm_cases(device: torch.device, small: bool) -> list[BenchCase]:
    # ATM merge + unmerge at τ = 0.92 on random tokens with ~10% of adjacent pairs planted as
    # near-duplicates (cos ≈ 0.998; unplanted pairs have |cos| ≈ 0.03 at d = 1024).
    b, t, d = ATM_BENCH["small" if small else "full"]
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
        merged, _, _, index_map = _atm_merge_eager(x, positions, tau)
        return merged.gather(1, index_map.unsqueeze(-1).expand_as(x))

    def oracle(x, positions):
        merged, _, _, index_map = reference.atm_merge(x, positions, tau)
        return reference.atm_unmerge(merged, index_map)

    return [BenchCase(op="atm", shape=f"x ({b}, {t}, {d}), merge+unmerge", dtype=dtype, make_inputs=make_inputs,
                      fused=fused, eager=eager, oracle=oracle, differentiable=(0,), notes=notes)]


def _gcla_eager(num_heads: int, num_kv_heads: int):
    """GCLA as eager PyTorch pieces: SDPA (causal, GQA) + cross softmax + blend.

    SDPA's GQA gives query head p the kv group p // (H/H_kv); GCLA uses h mod H_kv, so the
    query heads are permuted in (p ← h = (p mod G)·H_kv + p // G) and back out.
    """
    import torch.nn.functional as F

    groups = num_heads // num_kv_heads
    perm = [(p % groups) * num_kv_heads + p // groups for p in range(num_heads)]
    inv = sorted(range(num_heads), key=lambda p: perm[p])

    def eager(q_rot, k_rot, v, q, kc, vc, gate):
        o_self = F.scaled_dot_product_attention(q_rot[:, perm], k_rot, v, is_causal=True, enable_gqa=True)[:, inv]
        z = (q.unsqueeze(-2) * kc).sum(-1) * q.shape[-1] ** -0.5
        o_cross = (torch.softmax(z, dim=-1).unsqueeze(-1) * vc).sum(-2)
        return o_self + torch.sigmoid(gate)[None, :, None, None].to(o_self.dtype) * o_cross

    return eager


@case_factory
def gcla_attention_cases(device: torch.device, small: bool) -> list[BenchCase]:
    # wiola-360m attention (H 16, H_kv 4, d_h 64) with Λ' = 2 causal (prefix-mean) summaries.
    from ..ops.gcla_attention import gcla_attention

    shape = GCLA_BENCH_SMALL if small else (GCLA_BENCH if device.type == "cuda" else GCLA_BENCH_CPU)
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
        make_inputs=make_inputs, fused=gcla_attention, eager=_gcla_eager(h, h_kv),
        oracle=reference.gcla_attention, compiled_baseline=reference.gcla_attention, tolerance_kind="attention",
        backward_rereads=tuple(range(7)),  # attention's backward recomputes from every input
    )]
