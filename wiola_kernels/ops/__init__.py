"""The op layer: per op, the registered kernel ops (``torch.ops.wiola.<op>`` and
``torch.ops.wiola.<op>_grad``), the ``torch.autograd.Function`` that drives them, and the
public Python function (see CONTRIBUTING.md, "The op pattern")."""

from __future__ import annotations

import torch


def distinct(*args: object) -> tuple:
    """``args`` with every repeated tensor replaced by a view of it. Dynamo cannot trace an
    ``autograd.Function.apply`` that receives one tensor twice (``gcla_attention(..., kc, kc,
    ...)``); a view is a distinct tensor to it, costs no copy, and passes gradients through."""
    seen: set[int] = set()
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if id(a) in seen:
                a = a.view_as(a)
            seen.add(id(a))
        out.append(a)
    return tuple(out)
