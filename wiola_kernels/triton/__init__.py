"""Triton kernels (GPU, or the CPU interpreter under ``TRITON_INTERPRET=1``)."""

import os


# Host-side integer helpers for grids and launch configurations. Triton's own ``triton.cdiv``
# and ``triton.next_power_of_2`` are constexpr functions usable inside kernels too, and cost
# ~1 µs a call on the host through that wrapper: a launcher makes several per launch.
def cdiv(x: int, y: int) -> int:
    """⌈x / y⌉ for ints (as ``triton.cdiv``)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n, 0 for n ≤ 0 (as ``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_SM_COUNTS: dict[int, int] = {}


def sm_count(device) -> int | None:
    """The SM count of a CUDA ``device`` (a ``torch.device``), read once per device and cached
    (a device-property query costs host time on every launch otherwise); None for any other
    device (the interpreter)."""
    if device.type != "cuda":
        return None
    index = device.index
    if index is None:
        import torch

        index = torch.cuda.current_device()
    sms = _SM_COUNTS.get(index)
    if sms is None:
        import torch

        sms = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return sms


def _fix_interpreter_loop_bounds() -> None:
    """Let Triton's interpreter take runtime loop bounds on every Triton we support.

    The interpreter keeps a scalar (a kernel argument, ``tl.program_id``) as a 1-element
    array, and ``range(start, n, step)`` converts it with ``int(array)``. Triton 3.6 does
    exactly that, which NumPy >= 2.4 refuses for arrays of one dimension ("only
    0-dimensional arrays can be converted to Python scalars"); later Tritons squeeze the
    array first. This applies the same squeeze when, and only when, the installed
    interpreter needs it (probed, not guessed from version numbers). Compiled kernels are
    untouched: the interpreter is a CPU test tool."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_wiola_squeezes_index", False):
        return

    class _Probe:
        pass

    class _Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    class _Handle:
        data = np.array([3], dtype=np.int32)

    try:
        original(_Probe, _Scope())
        probe = _Probe()
        probe.handle = _Handle()
        if _Probe.__index__(probe) == 3:
            return  # this interpreter already converts 1-element arrays
    except TypeError:
        pass
    except Exception:  # an interpreter whose internals differ: leave it alone
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0])
                       if self.handle.data.size == 1 else int(self.handle.data))

    patch_lang_tensor._wiola_squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


_fix_interpreter_loop_bounds()
