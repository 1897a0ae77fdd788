"""wiola-kernels: fused kernels for the Wiola small-language-model architecture.

Public ops, each a function over one ``torch.autograd.Function`` that drives the registered
ops ``torch.ops.wiola.<name>`` (forward) and ``torch.ops.wiola.<name>_backward`` (backward),
declared once in C++ with a kernel per device that PyTorch's dispatcher picks. They are
listed at the end: one line per registered op, from its module ``wiola_kernels/ops/<op>.py``,
whose ``__all__`` this package exports. Besides them:

* :func:`patch_hf` / :func:`unpatch_hf` — these kernels in Hugging Face Llama / Mistral / Qwen2 models

Hugging Face's own ``kernels`` switch (``kernels.kernelize``, ``from_pretrained(...,
use_kernels=True)``) reaches our layers through :func:`kernel_mapping` / :func:`kernel_config`
(:mod:`wiola_kernels.hf_kernels`).

Force a backend (tests, benchmarks) with :func:`use_backend` or ``WIOLA_BACKEND`` (see
:mod:`wiola_kernels.dispatch`), and see what runs here with :func:`backends`.
The C++ CPU kernels run AVX-512 loops where the CPU has them; one level for all of them —
generic, avx2, avx512, avx512_bf16 — says which (:func:`cpu_isa`, :func:`set_cpu_isa`,
``WIOLA_CPU_ISA``, :func:`kernel_isa`). :mod:`wiola_kernels.decode.gemv` is the batch-1
decoding GEMV (CPU, float32/bfloat16/float16 weights read in place) and
:mod:`wiola_kernels.decode.attention` a decoding step's attention over a KV cache in one call,
:mod:`wiola_kernels.decode.block` a whole Wiola block of such a step in one call, and
:mod:`wiola_kernels.decode.step` the whole step (every block and the head) in one call.
"""

import re

from . import _extension
from ._extension import cpu_isa, kernel_isa, set_cpu_isa
from . import dispatch
from .dispatch import backends, use_backend

_extension.load_error()  # import the C++ extension (registers its kernels), warn once if missing
dispatch.reload_environment()  # WIOLA_BACKEND, and whether the ops were declared

from .hf import is_patched, patch_hf, unpatch_hf  # noqa: E402  (Hugging Face models; transformers not needed to import)
from .modules import RMSNorm, SpiralRotaryEmbedding, WiolaRMSNorm  # noqa: E402
from .ops import op_modules as _op_modules  # noqa: E402
from .hf_kernels import kernel_config, kernel_mapping  # noqa: E402  (Hugging Face's `kernels`, imported lazily)

__version__ = "0.1.0"


def _export_ops() -> tuple[list[str], str]:
    """Bind each registered op's public names (its module's ``__all__``) here; returns them
    and the docstring's list of the ops (one line each, titled by its module's docstring)."""
    names, lines = [], []
    for module in _op_modules().values():
        for name in module.__all__:
            globals()[name] = getattr(module, name)
        names += module.__all__
        functions = ", ".join(f":func:`{n}`" for n in module.__all__ if not n[0].isupper())
        classes = ", ".join(f":class:`{n}`" for n in module.__all__ if n[0].isupper())
        title = " ".join(re.split(r":\s", module.__doc__ or module.OP, maxsplit=1)[0].split())  # -OO: no docstring
        lines.append(f"* {functions} / {classes} — {title}")
    return names, "\n".join(lines)


_op_names, _op_lines = _export_ops()
if __doc__:
    __doc__ += f"\nPublic ops:\n\n{_op_lines}\n"

__all__ = sorted(["RMSNorm", "SpiralRotaryEmbedding", "WiolaRMSNorm", "backends", "cpu_isa", "is_patched",
                  "kernel_isa", "patch_hf", "set_cpu_isa", "unpatch_hf", "use_backend", *_op_names])
__all__ += ["kernel_config", "kernel_mapping"]
