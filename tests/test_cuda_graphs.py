"""CUDA graphs (SPEC §11): every op's forward, and forward + backward, captured with
``torch.cuda.graph`` and replayed on new inputs copied into the captured ones gives what eager
gives — both within SPEC §9 of the float64 oracle; and ``torch.compile(mode="reduce-overhead")``
of a patched Hugging Face Llama runs its graphs as CUDA graphs, none skipped.

A capture fails on a host synchronisation (``.item()``, a copy from pageable host memory), an
allocation outside PyTorch's caching allocator, a device query that syncs, or a module load
during capture; a replay that differs from eager shows a value baked into the graph that
should have been read from an input. The ops come from tests/op_cases.py (its ``"gpu"``
shape), so a new op is covered by its ``OpCase``. GPU only: everything here skips without a
CUDA device; ``tests/test_host_sync_lint.py`` is the CPU-side guard against host syncs.
"""

from __future__ import annotations

import pytest
import torch

import wiola_kernels as wk
from helpers import gen
from op_cases import CASES, F64, WITH_ORACLE
from wiola_kernels.testing import assert_close_rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
# Seeds s and s + 6 give inputs of the same structure (op_cases' makes cycle options by the
# seed mod 2, 3 and 6: δ or not, GLU layouts, linear_cross_entropy's options), new values.
NEW_VALUES = 6


def _floats(args: dict) -> list[str]:
    """The differentiable arguments (a float ``num_items`` is a divisor, not one)."""
    return [n for n, v in args.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and n != "num_items"]


def _on_device(args: dict, grad: bool) -> dict:
    """``args`` on the GPU (the same strides: a view of a larger tensor stays one); the float
    tensors as leaves that require grad when ``grad``."""
    out, bases = {}, {}
    for n, v in args.items():
        if not isinstance(v, torch.Tensor):
            out[n] = v
            continue
        base = v if v._base is None else v._base
        if id(base) not in bases:  # views of one tensor stay views of one device tensor
            bases[id(base)] = base.to(DEVICE)
        dev = bases[id(base)].as_strided(v.shape, v.stride(), v.storage_offset()) if v._base is not None \
            else bases[id(base)]
        out[n] = dev
    if grad:
        out = {n: v.detach().requires_grad_() if n in _floats(out) else v for n, v in out.items()}
    return out


def _output_grads(outs, seed: int) -> list[torch.Tensor]:
    g = gen(seed)
    return [torch.randn(o.shape, generator=g, dtype=F64).to(DEVICE, o.dtype) for o in outs if o.is_floating_point()]


def _step(case, args: dict, grads: list | None):
    """The op's outputs and (with ``grads``) the gradients of its float inputs."""
    outs = [o for o in case.call(args)]
    if grads is None:
        return [o.detach() for o in outs], []
    floats = [o for o in outs if o.is_floating_point()]
    dargs = torch.autograd.grad(floats, [args[n] for n in _floats(args)], grads)
    return [o.detach() for o in outs], list(dargs)


def _oracle(case, args: dict, grads: list | None):
    args = {n: (v.detach().cpu().double().requires_grad_() if n in _floats(args) else
                (v.cpu() if isinstance(v, torch.Tensor) else v)) for n, v in args.items()}
    outs = case.oracle(args)
    if grads is None:
        return [o.detach() for o in outs], []
    floats = [o for o in outs if o.is_floating_point()]
    return [o.detach() for o in outs], list(torch.autograd.grad(floats, [args[n] for n in _floats(args)],
                                                               [g.cpu().double() for g in grads]))


def _assert_matches(got, ref, tol, what):
    got = got.cpu()
    if ref.is_floating_point():
        assert_close_rel(got, ref, tol, what)
    else:
        assert torch.equal(got, ref.to(got.dtype)), what


def _capture(fn, warmups: int = 3):
    """``fn()`` captured in a CUDA graph after ``warmups`` eager runs on a side stream (lazy
    initialisation, Triton's compiles and cuBLAS's workspaces happen before the capture);
    returns ``(graph, fn's result in the graph's memory)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def _check_graph_equals_eager(case, make, backward: bool, dtype, what: str):
    """Capture the op on ``make(0)``'s inputs, replay on ``make(NEW_VALUES)``'s copied in, and
    compare the replay and eager on the new inputs with the float64 oracle."""
    static = _on_device(make(0), backward)
    static_grads = _output_grads(case.call({n: v.detach() if isinstance(v, torch.Tensor) else v
                                            for n, v in static.items()}), 1) if backward else None
    graph, (outs, dargs) = _capture(lambda: _step(case, static, static_grads))

    new = make(NEW_VALUES)
    new_dev = _on_device(new, backward)
    new_grads = _output_grads(outs, 2) if backward else None
    with torch.no_grad():
        for n, v in new_dev.items():
            if isinstance(v, torch.Tensor):
                static[n].copy_(v)
        for s, v in zip(static_grads or [], new_grads or []):
            s.copy_(v)
    graph.replay()
    torch.cuda.synchronize()

    eager_outs, eager_dargs = _step(case, new_dev, new_grads)
    want, dwant = _oracle(case, new, new_grads)
    tol = case.tolerance(dtype, new)
    assert len(outs) == len(want) and len(dargs) == len(dwant)
    for i, (replayed, eager, ref) in enumerate(zip(outs, eager_outs, want)):
        _assert_matches(replayed, ref, tol, f"{what}: replayed output {i}")
        _assert_matches(eager, ref, tol, f"{what}: eager output {i}")
    for name, replayed, eager, ref in zip(_floats(new), dargs, eager_dargs, dwant):
        assert_close_rel(replayed.cpu(), ref, tol, f"{what}: replayed grad {name}")
        assert_close_rel(eager.cpu(), ref, tol, f"{what}: eager grad {name}")
    del graph


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("op", WITH_ORACLE)
def test_captured_graph_replays_like_eager(op, seed, dtype, backward):
    """Every op (each seed its own options: with and without δ, GLU's layouts, the loss's
    options), at its GPU shape, on the backend the dispatcher picks for CUDA tensors."""
    case = CASES[op]
    shape = case.shapes["gpu"][0]
    _check_graph_equals_eager(case, lambda s: case.make(shape, dtype, seed + s), backward, dtype,
                              f"{op} {shape} {dtype} seed {seed}")


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("num_items", ["number", "tensor"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_num_items_in_a_graph(num_items, reduction, backward):
    """``num_items`` as a Python number (a fill kernel carries it: no host-to-device copy,
    which a capture refuses) and as a device tensor (read by the kernel at replay: a new value
    copied in changes the loss)."""
    case = CASES["linear_cross_entropy"]
    shape = case.shapes["gpu"][0]

    def make(s):
        args = dict(case.make(shape, torch.float32, s), reduction=reduction)
        value = 29.0  # the number is a constant of the graph; a tensor's value may change
        args["num_items"] = value if num_items == "number" else torch.tensor(value + s, dtype=torch.float64)
        return args

    _check_graph_equals_eager(case, make, backward, torch.float32, f"linear_cross_entropy num_items {num_items}")


def test_reduce_overhead_compile_of_a_patched_llama_skips_no_cudagraph():
    """``torch.compile(mode="reduce-overhead")`` of a patched tiny Llama, trained for a few
    steps: Inductor runs the graphs as CUDA graphs (none of its cudagraph skips: a CPU tensor,
    a mutated input, an op it cannot capture), and the loss and gradients match eager."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from hf_helpers import loss_and_grads, model, training_batch

    torch._dynamo.reset()
    counters.clear()
    m = wk.patch_hf(model("llama", seed=51)).train().to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in training_batch("ignore_index", seed=52).items()}
    want = loss_and_grads(m, **batch)
    compiled = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up runs, then the recorded graph replays
        loss, _, grads = loss_and_grads(compiled, **batch)
    skips = dict(counters["inductor"])
    assert skips.get("cudagraph_skips", 0) == 0, f"cudagraph skips: {skips}"
    assert_close_rel(loss.cpu(), want[0].cpu(), 1e-5, "loss")
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
    assert grads.keys() == want[2].keys()
    for name, grad in grads.items():
        assert_close_rel(grad.cpu(), want[2][name].cpu(), 1e-4, name)
    del compiled
    torch._dynamo.reset()
    wk.unpatch_hf(m)
