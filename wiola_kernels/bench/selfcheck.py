"""``python -m wiola_kernels check``: every available backend of every op against the
float64 oracle (:mod:`wiola_kernels.reference`, through each case's ``oracle``), on the
benchmark cases' small inputs, forward and gradients, within the SPEC §9 tolerances of
:mod:`wiola_kernels.testing`."""

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


def _as64(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def check_case(case: BenchCase, backend: str, device: torch.device) -> tuple[bool, float, float]:
    """``(passed, worst relative error, tolerance)`` of ``backend`` on ``case``.

    The backend runs ``case.fused`` in the case's dtype; ``case.oracle`` runs on float64
    copies of the same inputs with the same (float64) output gradients. Every output and
    every input gradient is compared as ‖out − oracle‖ / ‖oracle‖ against the SPEC §9
    tolerance of the case's dtype and kind.
    """
    inputs = case.make_inputs()
    with torch.no_grad():
        probe = _tensors(case.oracle(*(_as64(t) for t in inputs)))
    g = torch.Generator(device="cpu").manual_seed(0)
    # Drawn in the case's dtype, so that the backend and the oracle see the same values.
    grad_outputs = [torch.randn(o.shape, generator=g).to(device=o.device, dtype=case.dtype)
                    if o.is_floating_point() else None for o in probe]
    with dispatch.use_backend(backend):
        outs, grads = _run(case, case.fused, inputs, grad_outputs)
    ref_outs, ref_grads = _run(case, case.oracle, tuple(_as64(t) for t in inputs), [_as64(go) for go in grad_outputs])
    if len(outs) != len(ref_outs) or len(grads) != len(ref_grads):
        raise ValueError(f"{case.op} on {backend}: {len(outs)} outputs and {len(grads)} gradients, "
                         f"the oracle gives {len(ref_outs)} and {len(ref_grads)}")
    worst = 0.0
    for a, b in list(zip(outs, ref_outs)) + list(zip(grads, ref_grads)):
        if (a is None) != (b is None):
            return False, float("inf"), tolerance(case.dtype, case.tolerance_kind)
        if a is not None:
            worst = max(worst, rel_err(a, b))
    tol = tolerance(case.dtype, case.tolerance_kind)
    return worst <= tol, worst, tol
