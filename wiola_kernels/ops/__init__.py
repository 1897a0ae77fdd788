"""The op layer (CONTRIBUTING.md, "The op pattern"): per op, a module ``ops/<op>.py`` with the
Python half of its registered ops ``wiola::<op>`` / ``wiola::<op>_backward`` (declared beside
its CPU kernels in csrc/cpu/<op>.cpp: the fakes and the CUDA kernels written in Python), its
argument checks ``check_<op>``, the ``torch.autograd.Function`` that drives them, the public
function, and its benchmark cases. Shared helpers for those files live here; :func:`op_modules`
finds them (the package and the bench read the op list from there, not from a list of names)."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType, SimpleNamespace

import torch

from .. import _extension, dispatch


def have_registered_ops() -> bool:
    """True when the C++ extension loaded, declaring the ``wiola::`` ops."""
    return _extension.load_error() is None


_library: torch.library.Library | None = None


def register_kernel(name: str, dispatch_key: str, kernel) -> None:
    """``kernel`` (Python: a Triton launcher, a composite of PyTorch and our kernels, or for a
    Triton-only op the reference on ``"CPU"``) as the ``dispatch_key`` kernel of
    ``wiola::<name>``; nothing without the extension."""
    global _library
    if not have_registered_ops():
        return
    if _library is None:
        _library = torch.library.Library("wiola", "IMPL")
    _library.impl(name, kernel, dispatch_key)


def register_triton_cuda(name: str, kernel) -> None:
    """``kernel``, the Python Triton launcher of ``wiola::<name>``, for the op whose CUDA kernel
    is C++ (launching the cubin table, csrc/cuda/triton_<op>_binding.cpp; GCLA's composite,
    csrc/cuda/gcla_attention_binding.cpp): registered as ``wiola::_triton_<name>``'s CUDA
    kernel, which the C++ kernel runs for a call it does not launch itself (no variant in the
    table; an input outside the composite's limits); and as ``wiola::<name>``'s own only when
    this build has no C++ CUDA kernel for it (an extension built without CUDA, on a CUDA torch)."""
    if _declared(f"wiola::_triton_{name}"):
        register_kernel(f"_triton_{name}", "CUDA", kernel)
    if name not in _extension.cpp_cuda_ops():
        register_kernel(name, "CUDA", kernel)


def _declared(qualname: str) -> bool:
    namespace, name = qualname.split("::")
    return have_registered_ops() and hasattr(getattr(torch.ops, namespace), name)


def register_fake(qualname: str):
    """``torch.library.register_fake(qualname)`` as a decorator, to be applied in the op module
    that csrc/cpu/<op>.cpp names in ``set_python_module`` (torch checks that the fake comes
    from there); nothing when the op is not declared (no extension, no emulation)."""
    def decorate(fn):
        if _declared(qualname):
            torch.library.register_fake(qualname, fn, _stacklevel=3)  # the frame that applies decorate
        return fn

    return decorate


def registered_ops(*names: str) -> SimpleNamespace:
    """``torch.ops.wiola.<name>.default`` of each name, as attributes (empty without the
    extension: the ops then run their Python backends, see :mod:`wiola_kernels.dispatch`)."""
    if not have_registered_ops():
        return SimpleNamespace()
    return SimpleNamespace(**{name: getattr(torch.ops.wiola, name).default for name in names})


def registered(namespace: str, name: str, check):
    """``torch.ops.<namespace>.<name>`` as a plain function, looked up when called (a forced
    backend's kernel). A call the schema's argument parser refuses (a list for a tensor, a str
    for a float) is re-checked by ``check`` (the op's ``check_<op>``) so the error names
    the argument as every other path does."""
    def call(*args):
        try:
            return getattr(getattr(torch.ops, namespace), name)(*args)
        except RuntimeError:
            check(*args)
            raise

    return call


def distinct(*args: object) -> tuple:
    """``args`` with every repeated tensor replaced by a view of it. Dynamo cannot trace an
    ``autograd.Function.apply`` that receives one tensor twice (``gcla_attention(..., kc, kc,
    ...)``); a view is a distinct tensor to it, costs no copy, and passes gradients through.
    Only needed while tracing: the public functions call it under ``torch.compile``."""
    # ``is``, not ``id()``: Dynamo would guard on every argument's id and recompile for each
    # new tensor, where ``is`` between two inputs is the aliasing it already guards on.
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and any(a is b for b in args[:i]):
            a = a.view_as(a)
        out.append(a)
    return tuple(out)


def needs_grad(*tensors: object) -> bool:
    """Whether autograd must record a call on ``tensors`` (grad mode on and one of them
    requires grad); the public functions skip the Function otherwise (no graph to record)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False


def op_modules() -> dict[str, ModuleType]:
    """``{op: its module}`` for every registered op (:func:`wiola_kernels.dispatch.ops`, in
    that order). Imports every module of this package first: importing ``ops/<op>.py`` is what
    registers the op, so a new op module is found without being named anywhere."""
    modules = [importlib.import_module(f"{__name__}.{found.name}") for found in pkgutil.iter_modules(__path__)]
    by_op = {module.OP: module for module in modules if hasattr(module, "OP")}
    return {op: by_op[op] for op in dispatch.ops() if op in by_op}
