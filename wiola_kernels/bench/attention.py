"""GCLA attention against FlashAttention alone, printed by
``python -m wiola_kernels bench --device cuda``.

At bf16, B 4, H 16, H_kv 4, T 4096, d_h ∈ {64, 128}, Λ' = 2 causal summaries (S = T): the
same causal GQA self-attention through ``F.scaled_dot_product_attention`` restricted to the
flash kernel ("sdpa-flash"), then GCLA on each of its GPU backends that can run here
(``cuda``, ``triton``), forward and forward+backward (gradients of every input), timed in
alternation. ``x flash`` is the SDPA-flash time over the backend's time (1.0 = as fast as
attention alone; GCLA does strictly more work: the summary part and, for H_kv ∉ {1, H},
the head permutation).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import dispatch
from ..shapes import GCLA_BENCH as SHAPE
from ..shapes import GCLA_BENCH_HEAD_DIMS as HEAD_DIMS
from .runner import time_interleaved_ms

PASSES = ("fwd", "fwd+bwd")


def _sdpa_flash(q_rot, k_rot, v):
    """Causal GQA attention on PyTorch's flash kernel (its own p // G head grouping: the
    timing is the same as GCLA's h mod H_kv, which only permutes heads)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, enable_gqa=True)


def _pass(fn: Callable, inputs: list[torch.Tensor], pass_: str, grad: torch.Tensor) -> Callable[[], object]:
    if pass_ == "fwd":
        def run():
            with torch.no_grad():
                return fn(*inputs)
        return run
    leaves = [x.detach().requires_grad_() for x in inputs]

    def run_bwd():
        return torch.autograd.grad(fn(*leaves), leaves, grad)
    return run_bwd


def gcla_vs_flash(device: torch.device, repeats: int = 20, head_dims=HEAD_DIMS, shape=None) -> list[dict]:
    """Rows ``{d_h, pass, impl, ms, x_flash}``; ``impl`` is ``sdpa-flash`` or a GCLA backend."""
    from ..ops.gcla_attention import OP, gcla_attention

    s = dict(SHAPE, **(shape or {}))
    B, H, H_kv, T, L = s["B"], s["H"], s["H_kv"], s["T"], s["L"]
    dtype = torch.bfloat16
    backends = [b for b in ("cuda", "triton") if b in dispatch.implemented(OP)
                and dispatch.BACKENDS[b].unavailable_reason(device) is None]
    rows = []
    for dh in head_dims:
        g = torch.Generator(device=device).manual_seed(dh)

        def r(*size):
            return torch.randn(*size, generator=g, device=device, dtype=dtype)

        ins = [r(B, H, T, dh), r(B, H_kv, T, dh), r(B, H_kv, T, dh), r(B, H, T, dh), r(B, H, T, L, dh),
               r(B, H, T, L, dh), -3.0 + 0.5 * torch.randn(H, generator=g, device=device)]
        grad = r(B, H, T, dh)
        for pass_ in PASSES:
            fns = [_pass(_sdpa_flash, ins[:3], pass_, grad)]
            for b in backends:
                def gcla(*xs, _b=b):
                    with dispatch.use_backend(_b):
                        return gcla_attention(*xs)
                fns.append(_pass(gcla, ins, pass_, grad))
            times = time_interleaved_ms(fns, device, repeats=repeats, warmup=3)
            for impl, ms in zip(["sdpa-flash", *backends], times):
                rows.append(dict(d_h=dh, pass_=pass_, impl=impl, ms=ms, x_flash=times[0] / ms, shape=s))
    return rows


def format_rows(rows: list[dict]) -> str:
    """The table printed after the per-op benchmark."""
    s = rows[0]["shape"] if rows else SHAPE
    lines = [f"GCLA attention vs SDPA-flash: bf16, B {s['B']}, H {s['H']}, H_kv {s['H_kv']}, T {s['T']}, "
             f"Λ' {s['L']} causal summaries",
             f"{'d_h':>4}  {'pass':<8} {'impl':<11} {'ms':>9} {'x flash':>8}"]
    for r in rows:
        lines.append(f"{r['d_h']:>4}  {r['pass_']:<8} {r['impl']:<11} {r['ms']:>9.3f} {r['x_flash']:>8.2f}")
    return "\n".join(lines)
