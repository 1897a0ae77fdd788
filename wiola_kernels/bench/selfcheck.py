"""``python -m wiola_kernels check``: every available backend of every op against the
reference, on the benchmark cases' (small) inputs, forward and gradients."""

from __future__ import annotations

import torch

from .. import dispatch
from ..testing import rel_err, tolerance
from .cases import BenchCase
from .runner import _differentiable, _tensors


def _run(case: BenchCase, fn, inputs, grad_outputs):
    diff = _differentiable(case, inputs)
    leaves = tuple(t.detach().clone().requires_grad_(i in diff) if isinstance(t, torch.Tensor) and t.is_floating_point()
                   else t for i, t in enumerate(inputs))
    outs = _tensors(fn(*leaves))
    pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in diff], [g for _, g in pairs],
                                allow_unused=True) if pairs else ()
    return outs, grads


def check_case(case: BenchCase, backend: str, device: torch.device) -> tuple[bool, float, float]:
    """(passed, worst relative error, tolerance) of ``backend`` vs the float64 reference."""
    inputs = case.make_inputs()
    with torch.no_grad():
        probe = _tensors(case.eager(*inputs))
    grad_outputs = [torch.randn_like(o) if o.is_floating_point() else None for o in probe]
    with dispatch.use_backend(backend):
        outs, grads = _run(case, case.fused, inputs, grad_outputs)
    as64 = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    ref_outs, ref_grads = _run(case, case.eager, tuple(as64(t) for t in inputs),
                               [None if g is None else g.double() for g in grad_outputs])
    worst = 0.0
    for a, b in list(zip(outs, ref_outs)) + [(a, b) for a, b in zip(grads, ref_grads) if a is not None]:
        worst = max(worst, rel_err(a, b))
    tol = tolerance(case.dtype, case.tolerance_kind)
    return worst <= tol, worst, tol
