"""The ``cuda`` backend of GCLA attention (SPEC §5.5): PyTorch's fused causal attention for
the self part, our summary kernels (csrc/cuda/gcla_attention.cu) for everything else.

GCLA's self part is ordinary causal GQA attention and ``σ(g)·O^cross`` enters the output
linearly, so the self part runs on the best attention kernel PyTorch ships (tensor cores,
FlashAttention-2) and only the summary part needs kernels of ours.

**Heads.** SPEC §5.2 gives head ``h`` the kv group ``h mod H_kv``; the fused kernels give
query head ``p`` the group ``p // G`` (``G = H/H_kv``). Query heads are therefore handed to
the fused kernel permuted, natural head ``h`` at ``p(h) = (h mod H_kv)·G + h // H_kv``: one
copy of ``q_rot`` (forward) and of ``dq̃`` back (backward); K and V are never copied.
Expanding K/V to H heads instead would write two Q-sized tensors per pass and need a
dK/dV reduction. ``H_kv = 1`` and ``H_kv = H`` need no permutation (the rules agree).
The summary kernels read/write the fused kernel's tensors in the permuted order, so the
permutation of ``O``, ``dO`` and ``lse`` costs no pass of its own.

**Which fused kernel** (see :func:`self_attention_kernel`): float16/bfloat16 on sm80+ use
FlashAttention-2 (``aten::_flash_attention_forward/backward``, GQA native). float32 — which
flash does not take — uses the memory-efficient (CUTLASS) kernel
(``aten::_efficient_attention_forward/backward``, O(T) memory; on sm80+ its fp32 GEMMs run
on tensor cores as 3xTF32, fp32-accurate), which has no GQA: K/V are expanded to H heads in natural order and dK/dV summed back over
the group in a fixed order. Half precision without flash (pre-sm80 GPUs, builds without
it) takes the same path with a one-time warning. Nothing falls back to an O(T²) matrix.
On CPU tensors (the ``cuda_emu`` test backend: our kernels emulated on the host) the self
part is ``aten::_scaled_dot_product_flash_attention_for_cpu`` with the same permutation.

**lengths.** Causal masking already keeps rows ``t < len_b`` off keys ``≥ len_b``, so the
fused kernel needs no mask; the summary kernels zero the rows past the length. Padded
rows of ``q_rot``, ``k_rot`` and ``v`` are zeroed before the fused kernel sees them: a
fused kernel multiplies masked-out (zero) weights by whole key blocks, and ``0 · NaN`` from
garbage in the padding would reach valid rows. With ``dO`` and ``O^self`` zero on padded
rows, those rows add exactly 0 to dK/dV.

**Layouts.** The fused kernels take any strides with a contiguous ``d_h``, so ``q_rot``,
``k_rot`` and ``v`` (the model's transposed ``(B, T, H, d_h)`` views) reach them uncopied.
The summary kernels read ``q``, ``kc``, ``vc``, ``O`` and ``dO`` contiguous and 16-byte
aligned (vector loads): those are ``.contiguous()``-ed here (a copy each for the model's
views; one more for a view that starts at an element offset), and the op layer copies
the results into the layouts its fakes promise (like the inputs). Passing strides to the
summary kernels (csrc/cuda/gcla_attention.cu) would remove these copies; not done yet.

**Determinism.** Our kernels are deterministic (no atomics). FlashAttention-2's backward
accumulates dq with atomics unless ``torch.use_deterministic_algorithms(True)`` is set,
which PyTorch passes on to it; the same holds for the efficient kernel's split-key path.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import register_fake

OP_NAMESPACE = "wiola"


def kv_order(num_heads: int, num_kv_heads: int) -> int:
    """``perm_kv`` of the kernels: ``H_kv`` when the head order must be permuted, else 1."""
    return num_kv_heads if 1 < num_kv_heads < num_heads else 1


def to_self_order(x: Tensor, perm_kv: int) -> Tensor:
    """``(B, H, T, d)`` natural heads → the fused kernel's order, as a ``(B, H, T, d)`` view of
    fresh ``(B, T, H, d)`` memory (the layout flash keeps; one copy)."""
    B, H, T, d = x.shape
    G = H // perm_kv
    # natural h = j·perm_kv + g  →  p = g·G + j
    return x.reshape(B, G, perm_kv, T, d).permute(0, 3, 2, 1, 4).reshape(B, T, H, d).transpose(1, 2)


def from_self_order(x: Tensor, perm_kv: int) -> Tensor:
    """Inverse of :func:`to_self_order`: a contiguous ``(B, H, T, d)`` in natural head order."""
    B, H, T, d = x.shape
    G = H // perm_kv
    xt = x.transpose(1, 2)  # (B, T, H, d), p = g·G + j
    return xt.reshape(B, T, perm_kv, G, d).permute(0, 3, 2, 1, 4).reshape(B, H, T, d).contiguous()


def _pad_mask(lengths: Tensor, T: int) -> Tensor:
    """``(B, 1, T, 1)``: True on rows ``t ≥ len_b``."""
    t = torch.arange(T, device=lengths.device)
    return (t[None, :] >= lengths[:, None]).view(-1, 1, T, 1)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


@functools.lru_cache(maxsize=None)
def _flash_usable(device: torch.device) -> Optional[str]:
    """None when FlashAttention-2 runs on ``device``, else why not (asked once per device: a
    device query per call is host time)."""
    if not getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)():
        return "this PyTorch build has no FlashAttention"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"FlashAttention needs sm80 or newer, this GPU is sm{major}{minor}"
    return None


def self_attention_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Name of the fused kernel that computes the self part on ``device`` for ``dtype``:
    ``"flash"`` (FlashAttention-2, GQA native), ``"efficient"`` (memory-efficient attention,
    K/V expanded) or ``"cpu_flash"`` (PyTorch's CPU flash kernel, emulation runs)."""
    if device.type == "cpu":
        return "cpu_flash"
    if dtype in (torch.float16, torch.bfloat16):
        why = _flash_usable(device)
        if why is None:
            return "flash"
        _warn_once(f"wiola gcla_attention: {why}; the self part runs on the memory-efficient attention kernel "
                   f"with K/V expanded to H heads (slower, same O(T) memory)")
    return "efficient"


class _SelfAttention:
    """One fused causal self-attention kernel: forward/backward on ``(B, H, T, d)`` views whose
    last dimension is contiguous; ``lse`` is ``(B, H, ≥T)`` float32 with ``t`` contiguous."""

    def __init__(self, kind: str, scale: float):
        self.kind, self.scale = kind, scale

    def lse_columns(self, T: int) -> int:
        # The efficient kernel keeps its lse rows padded to a multiple of 32.
        return (T + 31) // 32 * 32 if self.kind == "efficient" else T

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        T = q.shape[2]
        if self.kind == "flash":
            o, lse, *_ = torch.ops.aten._flash_attention_forward(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, T, T, 0.0, True, False,
                scale=self.scale)
            return o.transpose(1, 2), lse
        if self.kind == "efficient":
            o, lse, *_ = torch.ops.aten._efficient_attention_forward(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, None, None, 0.0,
                1, True, scale=self.scale)  # custom_mask_type 1: causal from the top left
            return o.transpose(1, 2), lse
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=self.scale)
        return o, lse.contiguous()

    def backward(self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
        T = q.shape[2]
        if self.kind == "flash":
            # Without dropout the RNG state is never read.
            rng = torch.empty(2, dtype=torch.uint64, device=q.device)
            unused = torch.empty((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                do.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2), lse,
                None, None, T, T, 0.0, True, rng, unused, scale=self.scale)
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        if self.kind == "efficient":
            # The efficient backward takes out's strides to be those of a (B, T, H, d) tensor
            # (it ignores out.stride(1)): the summary backward makes o_self so (empty_self in
            # csrc/cuda/gcla_attention_binding.cpp); anything else would be read wrong silently.
            if not o.transpose(1, 2).is_contiguous():
                raise RuntimeError(f"gcla_attention: the memory-efficient backward needs O^self laid out as "
                                   f"(B, T, H, d), got strides {tuple(o.stride())} for shape {tuple(o.shape)}")
            seed = torch.empty((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
                do.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, o.transpose(1, 2),
                None, None, T, T, lse, 0.0, seed, seed, 1, False, scale=self.scale)
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, True, scale=self.scale)


def _plan(q_rot: Tensor, k_rot: Tensor) -> tuple[_SelfAttention, int, int]:
    """(fused kernel, perm_kv, G) for these inputs."""
    H, H_kv, dh = q_rot.shape[1], k_rot.shape[1], q_rot.shape[3]
    attn = _SelfAttention(self_attention_kernel(q_rot.device, q_rot.dtype), 1.0 / math.sqrt(dh))
    # The efficient kernel has no GQA: K/V are expanded in natural order, heads stay natural.
    perm_kv = 1 if attn.kind == "efficient" else kv_order(H, H_kv)
    return attn, perm_kv, H // H_kv


def _self_kv(attn: _SelfAttention, k_rot: Tensor, v: Tensor, lengths: Optional[Tensor], G: int
             ) -> tuple[Tensor, Tensor]:
    if lengths is not None:
        pad = _pad_mask(lengths, k_rot.shape[2])
        k_rot, v = k_rot.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    if attn.kind == "efficient" and G > 1:
        # head j·H_kv + g reads group g: repeat, not repeat_interleave
        k_rot, v = k_rot.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1)
    return k_rot, v


#: The widest vector access of the summary kernels (16 bytes): their inputs start at a multiple of it.
_VECTOR_BYTES = 16


def _for_kernel(x: Tensor) -> Tensor:
    """``x`` contiguous and 16-byte aligned, as the summary kernels read it (8/16-byte vector
    loads; their binding refuses a misaligned tensor): a contiguous view at an element
    offset (``t[1:]``) is copied. While ``torch.compile`` traces, an address cannot be read
    (no int may leave an autograd.Function's graph): the binding's check then refuses a
    misaligned view with a ValueError that names it, and never reads it misaligned."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return x
    return x if x.data_ptr() % _VECTOR_BYTES == 0 else x.clone()


def _kernels(device: torch.device):
    return getattr(torch.ops, OP_NAMESPACE if device.type == "cuda" else "wiola_cuda_emu")


def forward(q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor, gate: Tensor,
            lengths: Optional[Tensor], kernels=None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of SPEC §5.5 (``lengths`` int64 or None; any strides with ``d_h`` contiguous).

    ``kernels`` holds ``_gcla_summary_fwd`` / ``_gcla_summary_bwd`` (default: the CUDA kernels
    for CUDA tensors, their emulation for CPU tensors).
    """
    kernels = _kernels(q_rot.device) if kernels is None else kernels
    attn, perm_kv, G = _plan(q_rot, k_rot)
    T = q_rot.shape[2]
    q_self = q_rot if perm_kv == 1 else to_self_order(q_rot, perm_kv)
    if lengths is not None:
        q_self = q_self.masked_fill(_pad_mask(lengths, T), 0.0) if perm_kv == 1 else \
            q_self.masked_fill_(_pad_mask(lengths, T), 0.0)
    k_self, v_self = _self_kv(attn, k_rot, v, lengths, G)
    o_self, lse_self = attn.forward(q_self, k_self, v_self)
    return kernels._gcla_summary_fwd(o_self, lse_self, _for_kernel(q), _for_kernel(kc), _for_kernel(vc), gate,
                                     lengths, perm_kv)


def backward(grad_out: Tensor, q_rot: Tensor, k_rot: Tensor, v: Tensor, q: Tensor, kc: Tensor, vc: Tensor,
             gate: Tensor, lengths: Optional[Tensor], out: Tensor, lse: Tensor, kernels=None
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(d q_rot, d k_rot, d v, d q, d kc, d vc, d gate)`` for :func:`forward`'s ``out, lse``."""
    kernels = _kernels(q_rot.device) if kernels is None else kernels
    attn, perm_kv, G = _plan(q_rot, k_rot)
    B, H, T, dh = q_rot.shape
    write_q_self = perm_kv != 1 or lengths is not None
    dq, dkc, dvc, dgate, do_self, o_self, q_self, lse_self = kernels._gcla_summary_bwd(
        _for_kernel(grad_out), _for_kernel(out), lse, _for_kernel(q_rot), _for_kernel(q), _for_kernel(kc),
        _for_kernel(vc), gate, lengths, perm_kv, attn.lse_columns(T), write_q_self)
    if not write_q_self:
        q_self = q_rot
    k_self, v_self = _self_kv(attn, k_rot, v, lengths, G)
    dq_self, dk, dv = attn.backward(do_self, q_self, k_self, v_self, o_self, lse_self)
    dq_rot = from_self_order(dq_self, perm_kv) if perm_kv != 1 else dq_self  # the op lays it out like q_rot
    if attn.kind == "efficient" and G > 1:
        H_kv = k_rot.shape[1]
        dk = dk.reshape(B, G, H_kv, T, dh).sum(1)
        dv = dv.reshape(B, G, H_kv, T, dh).sum(1)
    return (dq_rot, dk, dv, dq, dkc, dvc, dgate.to(gate.dtype))


# --- fakes of the summary kernels (torch.compile of a forced cuda / cuda_emu backend) ---------------

def _summary_fwd_fake(o_self, lse_self, q, kc, vc, gate, lengths, perm_kv):
    B, H, T, _ = q.shape
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty((B, H, T), dtype=torch.float32)


def _summary_bwd_fake(grad_out, out, lse, q_rot, q, kc, vc, gate, lengths, perm_kv, lse_columns, write_q_self):
    B, H, T, dh = q.shape

    def self_order():  # (B, H, T, d_h) view of (B, T, H, d_h) memory, as the binding's empty_self
        return q.new_empty((B, T, H, dh)).transpose(1, 2)

    identity = perm_kv == 1 or perm_kv == H
    q_self = q.new_empty((0,)) if not write_q_self else (q.new_empty(q.shape) if identity else self_order())
    return (q.new_empty(q.shape), kc.new_empty(kc.shape), vc.new_empty(vc.shape),
            q.new_empty((H,), dtype=torch.float32), self_order(), self_order(), q_self,
            q.new_empty((B, H, lse_columns), dtype=torch.float32))


for _ns in ("wiola", "wiola_cuda_emu"):
    register_fake(f"{_ns}::_gcla_summary_fwd")(_summary_fwd_fake)
    register_fake(f"{_ns}::_gcla_summary_bwd")(_summary_bwd_fake)
