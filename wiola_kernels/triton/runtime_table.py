"""The runtime table: Triton kernels the Python launchers compile at run time, handed to the C++
launcher (as PyTorch Inductor's static launcher does: Triton compiles, C++ launches).

The cubin table built with the extension (``cubin_table.py``) holds the variants of the test and
bench shapes only. A call whose variant it lacks — another width, bf16 ``x`` with float32 γ, an
odd alignment — reaches the op's C++ CUDA kernel (csrc/cuda/triton_<op>_binding.cpp), which
looks the variant up, misses, leaves the key it built in its thread's pending list and runs the
op's Python launcher (``wiola::_triton_<op>``). That launcher launches each kernel through
:func:`run`: Triton's JIT compiles and launches it as always, then, for a kernel the C++ missed,
:func:`register` checks that Triton's own specialisation of the arguments gives the very key the
C++ built (``aot.variant_id``, Triton's binder) and registers the compiled kernel under it —
cubin, function, warps, shared memory and the parameter layout, described by
``cubin_table.describe`` exactly as the static entries are. The next call with that
specialisation launches from C++ (its module is loaded at registration unless the stream is
being captured into a CUDA graph; then on its first launch outside a capture, the Python
launcher running meanwhile).

A variant that cannot be registered (another Triton at run time than the one that built the
table keys launches with another ``num_stages``; metadata the C++ launcher does not provide, such
as scratch memory) is warned about once per kernel and keeps running the Python launcher.
Without the extension's CUDA kernels, :func:`run` is a plain launch.
"""

from __future__ import annotations

import warnings

from .. import _extension

_UNRESOLVED = object()
_pending = _UNRESOLVED         # the extension's _triton_pending, or None where nothing launches from C++
_done: set[tuple[int, str]] = set()   # (arch, key) registered or refused: tried once
_warned: set[str] = set()             # kernels warned about


def _pending_misses():
    global _pending
    if _pending is _UNRESOLVED:
        module = _extension._load()[0]
        _pending = module._triton_pending if (_extension.has_cuda_kernels() and
                                              hasattr(module, "_triton_pending")) else None
    return () if _pending is None else _pending()


def run(kernel, grid: int | tuple, *args, num_warps: int, num_stages: int | None = None, **constexprs):
    """``kernel[(grid,)](*args, num_warps=num_warps, **constexprs)`` (``grid`` a tuple: that grid;
    ``num_stages`` passed when given); then, when the op's C++ kernel missed this kernel's variant
    on this call, registers what the JIT compiled. A kernel launched in several variants per call
    (:func:`several_variants`) registers a launch only under the pending key that equals its own."""
    stages = {} if num_stages is None else {"num_stages": num_stages}
    compiled = kernel[grid if isinstance(grid, tuple) else (grid,)](*args, num_warps=num_warps, **stages,
                                                                     **constexprs)
    misses = _pending_misses()
    if misses:
        name = _kernel_name(kernel)
        todo = [(key, arch, device) for miss_kernel, key, arch, device in misses
                if miss_kernel == name and (arch, key) not in _done]
        if todo and name in _several:
            _, _, ours = launch_key(kernel, args, constexprs, num_warps, todo[0][1], num_stages)
            todo = [m for m in todo if m[0] == ours]
        if todo:
            _register_miss(kernel, compiled, args, constexprs, num_warps, num_stages, *todo[0])
    return compiled


_several: set[str] = set()  # kernels launched in several variants per call


def several_variants(*kernels) -> None:
    """Declares kernels that one op call launches in several variants (linear_cross_entropy's
    chunks: the first and the others, a shorter last one): :func:`run` matches each launch to the
    pending miss of its own key, and :func:`sweep` warns about misses no launch matched."""
    _several.update(_kernel_name(k) for k in kernels)


def sweep(*kernels) -> None:
    """After an op's Python launcher ran: a pending miss of ``kernels`` that no launch matched
    (another Triton than the one the C++ keys follow specialises differently) is tried once and
    warned about once per kernel, as a refused registration is."""
    misses = _pending_misses()
    names = {_kernel_name(k) for k in kernels}
    for miss_kernel, key, arch, _ in misses:
        if miss_kernel in names and (arch, key) not in _done:
            _done.add((arch, key))
            _warn(miss_kernel, key, arch, f"no launch of the Python launcher (Triton {_triton_version()}) has the "
                                          "key the C++ launcher built")


def _kernel_name(kernel) -> str:
    return getattr(kernel, "fn", kernel).__name__


class _Retry(Exception):
    """Nothing registered, nothing to warn: the next miss registers."""


def _register_miss(kernel, compiled, args, constexprs, num_warps, num_stages, key, arch, device) -> None:
    try:
        if num_stages is None:
            reason = register(kernel, compiled, args, constexprs, num_warps, key, arch, device)
        else:
            reason = register(kernel, compiled, args, constexprs, num_warps, key, arch, device, num_stages)
    except _Retry:
        return
    except Exception as exc:  # never fail the launch that already ran
        reason = f"{type(exc).__name__}: {exc}"
    _done.add((arch, key))
    if reason is not None:
        _warn(_kernel_name(kernel), key, arch, reason)


def _warn(name: str, key: str, arch: int, reason: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"wiola: {name} compiled by the Python Triton launcher for a call the cubin table lacks "
                      f"({key}, sm_{arch}) cannot be launched from C++: {reason}. Calls with this "
                      "specialisation keep running the Python launcher.", stacklevel=5)


def register(kernel, compiled, args, constexprs: dict, num_warps: int, key: str, arch: int, device: int = -1,
             num_stages: int | None = None) -> str | None:
    """Registers ``compiled`` (what ``kernel[grid](*args, num_warps=..., **constexprs)`` returned)
    in the C++ runtime table under ``key``, the key the C++ kernel built for this launch on an
    ``arch`` GPU, and loads it on ``device`` (-1: on its first launch). Returns None, or why it
    cannot be registered (then nothing is)."""
    from . import aot, cubin_table

    module = _extension._load()[0]
    if module is None or not hasattr(module, "_triton_register"):
        return "the C++ extension is not loaded"
    if module._triton_num_stages() == 0:
        # A build without the cubin table keys launches with the num_stages reported here, once.
        module._triton_report_num_stages(aot.DEFAULT_NUM_STAGES)
        raise _Retry
    if compiled is None or not hasattr(compiled, "asm") or "cubin" not in compiled.asm:
        return "the launch returned no compiled kernel with a cubin"
    target = getattr(compiled.metadata, "target", None)
    if target is not None and getattr(target, "arch", arch) != arch:
        return f"the kernel was compiled for sm_{target.arch}, the device is sm_{arch}"
    launch, gpu, ours = launch_key(kernel, args, constexprs, num_warps, arch, num_stages)
    if ours != key:
        return (f"Triton {_triton_version()} specialises it as {ours}, the C++ launcher keyed it {key} "
                "(another Triton than the one that built the cubin table?)")
    entry = cubin_table.describe(launch, gpu, compiled, key, getattr(kernel, "fn", kernel).__module__)
    return module._triton_register(
        key=key, kernel=entry["kernel"], function=entry["function"], arch=arch, cubin=entry["cubin"],
        num_warps=entry["num_warps"], num_ctas=entry["num_ctas"], shared=entry["shared"],
        params=[(p["kind"], p["arg"]) for p in entry["params"]], scratch_pointers=entry["scratch_pointers"],
        global_scratch_size=entry["global_scratch_size"], profile_scratch_size=entry["profile_scratch_size"],
        cooperative=entry["cooperative"], device=device)


def launch_key(kernel, args, constexprs: dict, num_warps: int, arch: int, num_stages: int | None = None):
    """``(launch, gpu, key)``: the launch as ``aot`` describes it (``num_stages``, or the JIT's
    default where the launcher sets none), the GPU of ``arch`` and the variant id Triton's binder
    gives it (``aot.variant_id``), which the C++ key of the same launch must equal."""
    from . import aot, cubin_table

    gpu = cubin_table._gpu(arch)
    stages = aot.DEFAULT_NUM_STAGES if num_stages is None else num_stages
    launch = aot.Launch(kernel, tuple(args), dict(constexprs), num_warps, stages, 0, "runtime")
    return launch, gpu, aot.variant_id(launch, gpu)


def _triton_version() -> str:
    import triton

    return triton.__version__
