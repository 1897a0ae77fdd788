"""Other kernel packages timed beside ours in the same run: Liger-Kernel and Cut Cross-Entropy.

Both are pure Python + Triton and are not dependencies of this package: on the lent GPU
they are installed offline from wheels carried there (``bash scripts/device_env.sh
--peers`` downloads them into ``.whl/``; ``scripts/gpu_perf.sh`` installs them into a
private folder). A peer that is missing, or fails to import, or cannot run on the device
(both need a GPU: their kernels are Triton's) is reported with the reason — "not
installed", "needs a CUDA device", "import failed: ..." — and its rows are skipped; the
benchmark never crashes on a peer.

The callables here wrap each peer's public API at the call a user makes, read from the
wheels' sources (liger_kernel 0.8.5: ``liger_kernel.transformers.functional`` and
``liger_kernel.ops``; cut_cross_entropy 25.1.1: ``cut_cross_entropy.linear_cross_entropy``),
and take the same inputs as our op's benchmark case, or the layout the peer is made for where
that differs (noted per function).
"""

from __future__ import annotations

import importlib
import importlib.util
import importlib.metadata
from dataclasses import dataclass

import torch

#: peer name -> (module, pinned version, distribution name, what it is)
PEERS = {
    "liger": ("liger_kernel", "0.8.5", "liger-kernel", "Liger-Kernel"),
    "cce": ("cut_cross_entropy", "25.1.1", "cut-cross-entropy", "Cut Cross-Entropy"),
}


@dataclass(frozen=True)
class PeerStatus:
    """Whether a peer can run here: ``available``, its ``version``, and ``reason`` when not."""

    name: str
    available: bool
    version: str | None
    reason: str

    def describe(self) -> str:
        """One line: ``Liger-Kernel 0.8.5`` or ``Liger-Kernel: not installed``."""
        title = PEERS[self.name][3]
        if self.available:
            pinned = PEERS[self.name][1]
            return f"{title} {self.version}" + ("" if self.version == pinned else f" (pinned {pinned})")
        return f"{title}: {self.reason}"


_cache: dict[tuple[str, str], PeerStatus] = {}


def status(name: str, device: torch.device | str | None = None) -> PeerStatus:
    """Whether peer ``name`` (``"liger"`` or ``"cce"``) can run on ``device`` (None: whether it imports).

    Never raises for a missing or broken package: the reason is in the result.

    Raises:
        ValueError: for an unknown peer name.
    """
    if name not in PEERS:
        raise ValueError(f"peers.status: name must be one of {sorted(PEERS)}, got {name!r}")
    dev = "any" if device is None else torch.device(device).type
    key = (name, dev)
    if key in _cache:
        return _cache[key]
    module, _, dist, _ = PEERS[name]
    version = None
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec(module) is None:
        result = PeerStatus(name, False, version, "not installed")
    else:
        try:
            mod = importlib.import_module(module)
            version = version or getattr(mod, "__version__", None)
            if dev not in ("any", "cuda"):
                result = PeerStatus(name, False, version, f"needs a CUDA device (Triton kernels), not {dev}")
            else:
                result = PeerStatus(name, True, version, "")
        except Exception as exc:  # noqa: BLE001 - a broken peer is reported, not raised
            result = PeerStatus(name, False, version, f"import failed: {type(exc).__name__}: {exc}"[:200])
    _cache[key] = result
    return result


def clear_cache() -> None:
    """Forget the statuses (tests that fake a missing package)."""
    _cache.clear()


def versions() -> dict[str, str]:
    """``{peer: "Liger-Kernel 0.8.5" | "Liger-Kernel: not installed", ...}`` for the closing tables."""
    return {name: status(name).describe() for name in PEERS}


# ------------------------------------------------------------------------------ Liger-Kernel

def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Liger's RMSNorm (``LigerRMSNormFunction``, Llama casting, its default in-place backward
    that writes ∂x over the incoming gradient): ``x / rms(x) ⊙ γ``."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", True)


def liger_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's fused residual add + RMSNorm (``LigerFusedAddRMSNormFunction``): ``(y, s = x + residual)``."""
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    return LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "llama", False)


def liger_swiglu_packed(u: torch.Tensor) -> torch.Tensor:
    """Liger's SwiGLU on one ``(…, 2n)`` tensor ``[gate | up]`` (``LigerFusedGateUpSiLUMulFunction``),
    the layout of our packed ``glu(u, None, "silu")``."""
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    return LigerFusedGateUpSiLUMulFunction.apply(u)


def liger_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Liger's SwiGLU on separate gate and up tensors (``LigerSiLUMulFunction``, what its Llama MLP calls)."""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(a, b)


def liger_geglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Liger's GeGLU, tanh-approximated GELU (``LigerGELUMulFunction``) on separate gate and up tensors."""
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    return LigerGELUMulFunction.apply(a, b)


def liger_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Liger's RoPE (``LigerRopeFunction``; Hugging Face's rotate-half layout). ``q (B, H, T, d_h)``
    and ``k`` as transposed views of ``(B, T, H, d_h)`` projections (what Hugging Face passes;
    Liger rotates them in place), ``cos``/``sin`` ``(1, T, d_h)``."""
    from liger_kernel.ops.rope import LigerRopeFunction

    return LigerRopeFunction.apply(q, k, cos, sin, None, 1)


def liger_linear_cross_entropy(h: torch.Tensor, W: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Liger's fused linear cross-entropy (``liger_fused_linear_cross_entropy``, mean over
    labels ≠ -100; it computes the gradients during the forward when inputs need them)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(h, W, labels, ignore_index=-100)


# ------------------------------------------------------------------------------ Cut Cross-Entropy

def cce_linear_cross_entropy(h: torch.Tensor, W: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cut Cross-Entropy's ``linear_cross_entropy`` (its ``cce`` Triton implementation, default
    gradient filter), mean over labels ≠ -100."""
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, W, labels, ignore_index=-100, reduction="mean")


# ------------------------------------------------------------------------------ Hugging Face

def apply_liger_to_llama(model) -> object:
    """Patch one Hugging Face Llama model instance with Liger (``apply_liger_kernel_to_llama``:
    RoPE, RMSNorm, SwiGLU, fused linear cross-entropy) without leaving Liger in the way of
    other models in the process.

    Liger replaces module-level names of ``transformers.models.llama.modeling_llama`` even when
    given a model (``apply_rotary_pos_emb``, ``LlamaRMSNorm``, ``LlamaMLP``): those are put back
    here, and the RoPE function Liger installed is returned so the caller can set it around
    this model's steps (:func:`liger_rope_scope`); the model's own modules and ``forward`` stay
    patched.

    Returns:
        Liger's ``apply_rotary_pos_emb`` replacement.
    """
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    before = {n: getattr(modeling_llama, n) for n in names}
    try:
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                                    cross_entropy=False, model=model)
        rope = modeling_llama.apply_rotary_pos_emb
    finally:
        for n, v in before.items():
            setattr(modeling_llama, n, v)
    return rope


class liger_rope_scope:  # noqa: N801 - used as a context manager, like torch's
    """``with liger_rope_scope(rope): ...`` sets Llama's module-level ``apply_rotary_pos_emb``
    to Liger's for the block (what :func:`apply_liger_to_llama` put back), then restores it."""

    def __init__(self, rope) -> None:
        self.rope = rope

    def __enter__(self):
        from transformers.models.llama import modeling_llama

        self._saved = modeling_llama.apply_rotary_pos_emb
        modeling_llama.apply_rotary_pos_emb = self.rope
        return self

    def __exit__(self, *exc) -> None:
        from transformers.models.llama import modeling_llama

        modeling_llama.apply_rotary_pos_emb = self._saved
