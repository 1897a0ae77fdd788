"""The one description of every registered op that the shared suites run: ``CASES`` has
an :class:`OpCase` per op of :mod:`wiola_kernels.dispatch` (tests/test_all_ops.py fails when
one is missing), saying how to make the op's inputs at a shape, call it, and — with a float64
oracle — check it; and, per public function of the op, its autograd ``Function`` and its
registered ``wiola::`` ops (tests/test_op_layer.py: opcheck, gradcheck, ``torch.compile``, the
bad-input messages).

Each op's ``OpCase`` lives with the rest of its tests, as ``CASE`` in ``tests/test_<op>.py``;
``CASES`` collects them from the registry (:func:`wiola_kernels.dispatch.ops`), so no op is named
here. It is collected when first read, not when this module is imported: the test modules
import :class:`OpCase` from here."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

import wiola_kernels as wk
from wiola_kernels import dispatch, reference
from wiola_kernels.testing import tolerance

F64 = torch.float64


def randn64(*shape, g, scale=1.0):
    """Standard normal float64 numbers from the generator ``g`` (``scale`` times them)."""
    return scale * torch.randn(*shape, generator=g, dtype=F64)


@dataclass(frozen=True)
class Public:
    """One public function of an op (``wk.<name>``; ``reference.<name>`` is its float64
    reference), as tests/test_op_layer.py sees it."""

    name: str
    function: type                                   # its torch.autograd.Function
    op_calls: Callable                               # (arguments, ops namespace) -> [(registered op, args)]:
                                                     # the forward, then the backward
    bad: Callable[[dict], list] = lambda a: []       # float32 arguments -> [(changes, error, message)]:
                                                     # one of each kind of check
    make: Callable[[torch.dtype], dict] | None = None  # its arguments, when not the OpCase's make

    @property
    def public(self) -> Callable:
        return getattr(wk, self.name)

    @property
    def reference(self) -> Callable:
        return getattr(reference, self.name)


@dataclass(frozen=True)
class OpCase:
    """How the shared suites exercise one registered op."""

    make: Callable[..., dict]    # (shape, dtype, seed, **variant) -> the public function's arguments: the
                                 # seed draws the numbers, the variant's keywords choose the options
    call: Callable[[dict], tuple]                    # those arguments -> the outputs
    shapes: dict[str, list]   # "default" or a backend's own ("triton": the interpreter is slow, tiny),
                              # "gradcheck", "threads", "views", "dynamic" (two sizes), "concurrent",
                              # "gpu", "layer" (the op layer's)
    functions: tuple[Public, ...] = ()               # the op's public functions
    variants: tuple[dict, ...] = ({},)               # make's option sets, cycled over each list of shapes
    view_variants: tuple[dict, ...] = ({},)          # views' option sets, likewise
    layer_variant: dict = field(default_factory=dict)  # the options of the op layer's arguments
    oracle: Callable[[dict], tuple] | None = None    # float64 arguments -> float64 outputs, differentiable
    views: Callable[[tuple, torch.dtype, int], tuple[dict, list]] | None = None  # strided (arguments, grads)
    in_place: tuple[str, ...] = ()                   # backends that read `views` without a copy
    kind: str = "elementwise"                        # SPEC §9's tolerance row
    out_dtype: Callable[[torch.dtype], torch.dtype] = lambda dtype: dtype  # the float outputs' dtype
    tol: Callable[[torch.dtype, dict], float] | None = field(default=None)  # instead of the kind's

    def inputs(self, shape: tuple, dtype: torch.dtype, i: int, variant: int | None = None) -> dict:
        """The arguments for the ``i``-th shape of a list: seed ``i`` and the variant ``i``
        cycles to (or the ``variant``-th)."""
        return self.make(shape, dtype, seed=i, **self.variants[(i if variant is None else variant) % len(self.variants)])

    def view_inputs(self, shape: tuple, dtype: torch.dtype, i: int) -> tuple[dict, list]:
        """``views``' (arguments, output gradients) for the ``i``-th shape of ``shapes["views"]``."""
        return self.views(shape, dtype, seed=i, **self.view_variants[i % len(self.view_variants)])

    def tolerance(self, dtype: torch.dtype, args: dict) -> float:
        return self.tol(dtype, args) if self.tol else tolerance(dtype, self.kind)

    def layer_args(self, function: Public, dtype: torch.dtype) -> dict:
        """``function``'s arguments for the op layer's tests: every parameter of its
        signature, in order (``Function.apply`` takes them positionally)."""
        if function.make is not None:
            return function.make(dtype)
        bound = inspect.signature(function.public).bind(**self.make(self.shapes["layer"][0], dtype, seed=0, **self.layer_variant))
        bound.apply_defaults()
        return dict(bound.arguments)


def _collect() -> dict[str, OpCase]:
    """``{op: CASE of tests/test_<op>.py}`` for every registered op whose test module has one."""
    cases = {}
    for op in dispatch.ops():
        try:
            module = importlib.import_module(f"test_{op}")
        except ModuleNotFoundError as error:
            if error.name != f"test_{op}":
                raise
            continue  # no tests/test_<op>.py: test_every_registered_op_has_a_case names the op
        if isinstance(getattr(module, "CASE", None), OpCase):
            cases[op] = module.CASE
    return cases


def __getattr__(name: str):
    """``CASES`` (``{op: OpCase}``) and ``WITH_ORACLE`` (the ops whose case has an oracle), built
    on first use."""
    global CASES, WITH_ORACLE
    if name not in ("CASES", "WITH_ORACLE"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    CASES = _collect()
    WITH_ORACLE = [op for op in dispatch.ops() if op in CASES and CASES[op].oracle is not None]
    return globals()[name]
