"""Test helpers shared by the per-op test files (no oracles here: those live in
tests/oracles.py): seeded generators, strided views of exact values, a floored relative
error, per-row lengths of a drawn kind, the bitwise-determinism harness of the C++ CPU
kernels, and GPU-only marks."""

from __future__ import annotations

import collections
import contextlib
import math
import socket

import pytest
import torch
import torch.utils._python_dispatch

import wiola_kernels as wk
from wiola_kernels._extension import cpu_kernel_isas
from wiola_kernels.testing import available_backends, available_cpu_isas, cpu_isa


# --- backends ----------------------------------------------------------------------------

def backend_variants(op: str) -> list[str]:
    """Every backend of ``op`` that runs here, the C++ CPU backend once per instruction-set
    path of its own on this CPU (``"cpu/avx2"``, ``"cpu/avx512_bf16"``; csrc/cpu/isa.h), or
    once (``"cpu"``) for a kernel with one path."""
    out = []
    for backend in available_backends(op, "cpu"):
        if backend != "cpu":
            out.append(backend)
            continue
        isas = available_cpu_isas(op) if op in cpu_kernel_isas() else []
        out += [f"cpu/{isa}" for isa in isas] or ["cpu"]
    return out


@contextlib.contextmanager
def on_backend(variant: str):
    """``wk.use_backend`` of a :func:`backend_variants` entry, the CPU kernels held to its
    instruction set inside the block."""
    name, _, isa = variant.partition("/")
    with cpu_isa(isa or None), wk.use_backend(name):
        yield


def gen(seed: int = 0) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def finite(*ts: torch.Tensor) -> bool:
    """Whether every element of every tensor is finite."""
    return all(bool(torch.isfinite(t).all()) for t in ts)


# --- layouts ------------------------------------------------------------------------------

def strided_view(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as ``t`` through a non-contiguous view."""
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "sliced":
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if how == "expanded" and t.dim() >= 2 and t.shape[0] == 1:
        return t[:1].expand(*t.shape)
    return t


def view_as(values: torch.Tensor, dtype: torch.dtype, how: str, expand_dim: int = 0) -> torch.Tensor:
    """``values`` (float64) in ``dtype`` through a view of the given layout. For "expanded"
    the values are first made constant along ``expand_dim`` (so the view is exact)."""
    t = values.to(dtype)
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "sliced" and t.shape[-1] > 0:
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=dtype)
        big[..., 1::2] = t
        return big[..., 1::2]
    if how == "expanded" and t.dim() >= 1 and t.shape[expand_dim] > 0:
        return t.narrow(expand_dim, 0, 1).expand(*t.shape)
    return t


def lengths_of_kind(len_kind: str, b: int, t: int, g: torch.Generator) -> torch.Tensor | None:
    """Per-row lengths of one drawn kind: none, all zero, all full, random (int64 or int32)."""
    if len_kind == "none":
        return None
    if len_kind == "zeros":
        return torch.zeros(b, dtype=torch.int64)
    if len_kind == "full":
        return torch.full((b,), t, dtype=torch.int64)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    return lengths.to(torch.int32) if len_kind == "int32" else lengths


def close_floored(out, ref, tol, what, floor=0.25):
    """Relative error with the reference norm floored at ``floor`` per element (inputs are
    unit-scale; some gradients are exactly zero in exact arithmetic, e.g. dq̃ at T = 1, where
    kernels see rounding noise). Either tensor may be on any device."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    assert o.shape == r.shape, f"{what}: shape {tuple(o.shape)} != {tuple(r.shape)}"
    assert torch.isfinite(o).all(), f"{what}: non-finite values"
    den = max(float(r.norm()), floor * math.sqrt(max(r.numel(), 1)))
    err = float((o - r).norm()) / den
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# --- bitwise determinism of the C++ CPU kernels ---------------------------------
# Every forward and backward is bitwise reproducible run to run and independent of the
# thread count (torch.set_num_threads 1 vs 2): reductions over rows split the work into a
# fixed number of chunks, summed in a fixed order.

needs_cpu_extension = pytest.mark.skipif("cpu" not in available_backends("rms_norm", "cpu"),
                                         reason="the C++ extension is not built")


@contextlib.contextmanager
def threads(n: int):
    """``torch.set_num_threads(n)`` inside the block."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_on_thread_counts(fn, inputs):
    """``fn`` forward + backward on the cpu backend, for 1 thread twice and 2 threads twice.
    ``fn`` returns (output, its gradient[, extra outputs compared without a gradient])."""
    results = []
    for n in (1, 2, 1, 2):
        ins = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        with threads(n), wk.use_backend("cpu"):
            outs = fn(*ins)
            diff = [x for x in ins if x.requires_grad]
            grads = torch.autograd.grad(outs[0], diff, outs[1], allow_unused=True)
        extras = list(outs[2]) if len(outs) > 2 else []
        results.append([outs[0].detach()] + [g for g in grads if g is not None] + [e.detach() for e in extras])
    return results


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as an integer tensor (bitwise comparison, NaN-safe)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(results, names):
    """Every run of :func:`run_on_thread_counts` equal to the first, bit for bit."""
    first = results[0]
    for k, res in enumerate(results[1:], 1):
        for name, a, b in zip(names, first, res):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(bits(a), bits(b)), \
                f"{name} differs between run 0 (1 thread) and run {k} ({(1, 2, 1, 2)[k]} threads)"


# --- GPU ----------------------------------------------------------------------------------

GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpu_only(fn):
    """Mark a test ``gpu`` and skip it without a CUDA device."""
    for mark in GPU_ONLY:
        fn = mark(fn)
    return fn


def forward_backward(fn, inputs, grad_out):
    """``fn(*inputs)`` and the gradients of its floating-point inputs for ``grad_out``
    (one gradient per output)."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward([o for o in outs if o.requires_grad],
                            [g for o, g in zip(outs, grad_out) if o.requires_grad])
    return [o.detach() for o in outs], [t.grad for t in leaves if t.is_floating_point()]


# --- the model ---------------------------------------------------------------------------

def randomise(model, seed=0):
    """Non-init values in every parameter of a Wiola model, so that init shortcuts (γ = 1,
    δ = 0, β = 0, g = −3) show: γ ≈ 1 ± 0.3, δ, β and g of order 1, projections scaled by
    1/√fan_in."""
    g = gen(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.3 * r
            elif name.endswith("norm.shift"):
                v = 0.5 * r
            elif name.endswith("gate") or name.endswith("beta"):
                v = 1.5 * r
            elif "embed" in name:
                v = r
            else:
                v = r / math.sqrt(p.shape[1])
            p.copy_(v.to(p.dtype))
    return model


class WiolaOpCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the calls of the registered ops ``torch.ops.wiola.*`` (forward and backward) in
    ``.calls``, by op name, while active."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "wiola":
            self.calls[func._opname] += 1
        return func(*args, **(kwargs or {}))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test's process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp2_available() -> bool:
    """torch.distributed with gloo and FSDP2's ``fully_shard`` (torch >= 2.6)."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()
