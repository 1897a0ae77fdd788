"""wiola-kernels: fused kernels for the Wiola small-language-model architecture.

Public ops, each a function over one ``torch.autograd.Function`` that drives the registered
ops ``torch.ops.wiola.<name>`` (forward) and ``torch.ops.wiola.<name>_backward`` (backward),
declared once in C++ with a kernel per device that PyTorch's dispatcher picks:

* :func:`rms_norm` / :class:`RMSNormFunction` — WiolaRMSNorm (SPEC §3)
* :func:`add_rms_norm` / :class:`AddRMSNormFunction` — residual add + WiolaRMSNorm in one pass (SPEC §10.3)
* :func:`glu` / :class:`GLUFunction` — gated activations SiLU / GELU_tanh, DSFF's streams (SPEC §10.2)
* :func:`srpe` / :class:`SRPEFunction` — spiral rotary position encoding of Q and K (SPEC §4)
* :func:`gcla_attention` / :class:`GCLAAttentionFunction` — GCLA summary-augmented causal attention (SPEC §5.5)
* :func:`atm_merge` / :class:`ATMMergeFunction`, :func:`atm_unmerge` / :class:`ATMUnmergeFunction` —
  ATM greedy adjacent token merging (SPEC §6)
* :func:`linear_cross_entropy` / :class:`LinearCrossEntropyFunction` — the head's cross-entropy without
  the logits tensor (SPEC §10.1)
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

from . import _extension
from ._extension import cpu_isa, kernel_isa, set_cpu_isa
from . import dispatch
from .dispatch import backends, use_backend

_extension.load_error()  # import the C++ extension (registers its kernels), warn once if missing
dispatch.reload_environment()  # WIOLA_BACKEND, and whether the ops were declared

from .hf import is_patched, patch_hf, unpatch_hf  # noqa: E402  (Hugging Face models; transformers not needed to import)
from .modules import RMSNorm, SpiralRotaryEmbedding, WiolaRMSNorm  # noqa: E402
from .ops.add_rms_norm import AddRMSNormFunction, add_rms_norm  # noqa: E402
from .ops.atm import ATMMergeFunction, ATMUnmergeFunction, atm_merge, atm_unmerge  # noqa: E402
from .ops.gcla_attention import GCLAAttentionFunction, gcla_attention  # noqa: E402
from .ops.linear_cross_entropy import LinearCrossEntropyFunction, linear_cross_entropy  # noqa: E402
from .ops.glu import GLUFunction, glu  # noqa: E402
from .ops.rms_norm import RMSNormFunction, rms_norm  # noqa: E402
from .ops.srpe import SRPEFunction, srpe  # noqa: E402
from .hf_kernels import kernel_config, kernel_mapping  # noqa: E402  (Hugging Face's `kernels`, imported lazily)

__version__ = "0.1.0"

__all__ = ["ATMMergeFunction", "ATMUnmergeFunction", "AddRMSNormFunction", "GCLAAttentionFunction", "GLUFunction",
           "LinearCrossEntropyFunction", "RMSNorm", "RMSNormFunction", "SRPEFunction", "SpiralRotaryEmbedding",
           "WiolaRMSNorm", "add_rms_norm", "atm_merge", "atm_unmerge", "backends", "cpu_isa", "gcla_attention", "glu",
           "is_patched", "kernel_isa", "linear_cross_entropy", "patch_hf", "rms_norm", "set_cpu_isa", "srpe",
           "unpatch_hf", "use_backend"]
__all__ += ["kernel_config", "kernel_mapping"]
