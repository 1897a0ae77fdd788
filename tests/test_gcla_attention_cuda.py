"""The ``cuda`` backend of GCLA attention (wiola_kernels/ops/gcla_attention_cuda.py): PyTorch's
fused self-attention with permuted query heads plus our summary kernels
(csrc/cuda/gcla_attention.cu), against the float64 oracle.

* CPU (every CI run): the whole orchestration — head permutation, layouts, lengths, the
  float32 path's K/V expansion, the fused self-attention forward/backward (PyTorch's CPU
  flash kernel standing in for the GPU one) — with the summary kernels given twice: as
  ``torch.ops.wiola_cuda_emu`` (the CUDA kernels' bodies run by the SIMT emulator,
  csrc/cuda/emu/, when the extension is built) and as :class:`SummaryKernelModel`, a
  row-for-row PyTorch model of them (same head map ``p(h)``, per-row formulas, 64-row
  chunked sums and output layouts). One oracle run checks both.
* GPU (skipped without one; scripts/gpu_check.sh): the real kernels with flash/efficient
  attention, the kernels against the model, the self part against
  ``F.scaled_dot_product_attention``, determinism, padding.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import wiola_kernels
from wiola_kernels import dispatch
from wiola_kernels.ops import gcla_attention_cuda as gc
from wiola_kernels.ops.gcla_attention import GCLAAttentionFunction, gcla_attention_op
from wiola_kernels.reference.gcla_attention import gcla_attention_forward
from wiola_kernels.testing import tolerance

NAMES = ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate")
HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------------------------------
# A PyTorch model of csrc/cuda/gcla_attention.cu
# ---------------------------------------------------------------------------------------
class SummaryKernelModel:
    """``_gcla_summary_fwd`` / ``_gcla_summary_bwd`` as the CUDA kernels compute them: float32
    per row, natural head ``h`` reading/writing the fused kernel's head ``p(h)``, outputs in the
    binding's layouts (``(B, T, H, d)`` memory for the self tensors), S = 1 sums and dgate as
    per-64-row-chunk partials added in chunk order."""

    CHUNK = 64

    @staticmethod
    def self_head(H: int, perm_kv: int) -> torch.Tensor:
        h = torch.arange(H)
        return (h % perm_kv) * (H // perm_kv) + h // perm_kv

    @staticmethod
    def _valid(lengths, B, T):
        t = torch.arange(T)
        if lengths is None:
            return torch.ones(B, 1, T, dtype=torch.bool)
        return (t[None, :] < lengths.clamp(0, T)[:, None]).view(B, 1, T)

    @staticmethod
    def _cross(q, kc, vc, scale):
        """(a (B, H, T, L), O^cross (B, H, T, d)) in float32; S = 1 broadcasts over T."""
        z = (q.float().unsqueeze(-2) * kc.float()).sum(-1) * scale
        a = torch.softmax(z, -1)
        oc = (a.unsqueeze(-1) * vc.float()).sum(-2)
        return a, oc.expand(q.shape) if oc.shape != q.shape else oc

    def _gcla_summary_fwd(self, o_self, lse_self, q, kc, vc, gate, lengths, perm_kv):
        B, H, T, dh = q.shape
        ps = self.self_head(H, perm_kv)
        valid = self._valid(lengths, B, T)
        _, oc = self._cross(q, kc, vc, dh ** -0.5)
        sig = torch.sigmoid(gate.float())[None, :, None, None]
        out = (o_self[:, ps].float() + sig * oc).where(valid[..., None], 0.0).to(q.dtype)
        lse = lse_self[:, ps, :T].float().where(valid, 0.0)
        return out, lse

    def _gcla_summary_bwd(self, grad_out, out, lse, q_rot, q, kc, vc, gate, lengths, perm_kv, lse_columns,
                          write_q_self):
        B, H, T, dh = q.shape
        S, L = kc.shape[2], kc.shape[3]
        scale = dh ** -0.5
        ps = self.self_head(H, perm_kv)
        valid = self._valid(lengths, B, T)
        v4 = valid[..., None]
        sig = torch.sigmoid(gate.float())[None, :, None, None]
        dO = grad_out.float().where(v4, 0.0)
        a, oc = self._cross(q, kc, vc, scale)
        e = (dO.unsqueeze(-2) * vc.float()).sum(-1)                  # (B, H, T, L)
        r = (a * e).sum(-1, keepdim=True)                             # dO·O^cross
        dz = sig * a * (e - r)
        dq = ((dz.unsqueeze(-1) * kc.float()).sum(-2) * scale).where(v4, 0.0)
        dkc = (scale * dz.unsqueeze(-1) * q.float().unsqueeze(-2)).where(v4[..., None], 0.0)
        dvc = ((sig * a).unsqueeze(-1) * dO.unsqueeze(-2)).where(v4[..., None], 0.0)
        r = r.squeeze(-1).where(valid, 0.0)
        if S == 1:  # per-chunk partials, then a sum in chunk order
            chunks = range(0, T, self.CHUNK)
            dkc = sum(dkc[:, :, c:c + self.CHUNK].sum(2, keepdim=True) for c in chunks) if T else \
                torch.zeros(B, H, 1, L, dh)
            dvc = sum(dvc[:, :, c:c + self.CHUNK].sum(2, keepdim=True) for c in chunks) if T else \
                torch.zeros(B, H, 1, L, dh)
        parts = torch.stack([r[:, :, c:c + self.CHUNK].sum(-1) for c in range(0, T, self.CHUNK)], -1) if T else \
            torch.zeros(B, H, 1)
        s1 = sig.view(H)
        dgate = s1 * (1 - s1) * parts.sum((0, 2))

        def self_layout(x):  # natural (B, H, T, d) → permuted heads in (B, T, H, d) memory
            y = torch.full((B, T, H, dh), math.nan, dtype=q.dtype).transpose(1, 2)
            y[:, ps] = x.to(q.dtype)
            return y

        identity = perm_kv in (1, H)
        if write_q_self:
            q_nat = q_rot.where(v4, 0.0)
            q_self = q_nat.clone() if identity else self_layout(q_nat)
        else:
            q_self = q_rot.new_empty(0)
        lse_self = torch.zeros(B, H, lse_columns)
        lse_self[:, ps, :T] = lse.where(valid, 0.0)
        o_self = (out.float() - sig * oc).where(v4, 0.0)
        return (dq.to(q.dtype), dkc.to(q.dtype).contiguous(), dvc.to(q.dtype).contiguous(), dgate,
                self_layout(dO), self_layout(o_self), q_self, lse_self)


MODEL = SummaryKernelModel()


# ---------------------------------------------------------------------------------------
# Inputs and comparison
# ---------------------------------------------------------------------------------------
def make_inputs(B, H, H_kv, T, dh, S, L, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)

    gate = torch.randn(H, generator=g, dtype=torch.float64).to(device, torch.float64 if dtype == torch.float64
                                                                 else torch.float32)
    return [r(B, H, T, dh), r(B, H_kv, T, dh), r(B, H_kv, T, dh), r(B, H, T, dh), r(B, H, S, L, dh),
            r(B, H, S, L, dh), gate]


def close(out, ref, tol, what, floor=0.25):
    """Relative error with the reference norm floored at ``floor`` per element (inputs are
    unit-scale; some gradients are exactly zero in exact arithmetic, e.g. dq̃ at T = 1)."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    assert o.shape == r.shape, f"{what}: shape {tuple(o.shape)} != {tuple(r.shape)}"
    assert torch.isfinite(o).all(), f"{what}: non-finite"
    den = max(float(r.norm()), floor * math.sqrt(max(r.numel(), 1)))
    err = float((o - r).norm()) / den
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def oracle(ins, lengths, grad):
    """Float64 output, lse and gradients of every input (autograd through the reference)."""
    ins64 = [x.detach().double().requires_grad_() for x in ins]
    out, lse = gcla_attention_forward(*ins64, lengths)
    return out, lse, torch.autograd.grad(out, ins64, grad.to(ins64[0].device, torch.float64))


def check_against_oracle(out, lse, grads, ins, lengths, grad, dtype, ref=None, who=""):
    """Output, lse and every gradient within SPEC §9's attention tolerance of the float64 oracle
    (``ref``: a precomputed :func:`oracle`); rows past the lengths exactly 0."""
    ref_out, ref_lse, ref_grads = oracle(ins, lengths, grad) if ref is None else ref
    tol = tolerance(dtype, "attention")
    floor = 0.25 if dtype == torch.float32 else 1.0
    close(out, ref_out, tol, f"{who}out")
    close(lse, ref_lse, tol, f"{who}lse", floor=1.0)
    for name, g, rg in zip(NAMES, grads, ref_grads):
        assert g.dtype == ins[NAMES.index(name)].dtype, f"{who}grad {name}: dtype {g.dtype}"
        close(g, rg, tol, f"{who}grad {name}", floor)
    if lengths is not None:
        for b, n in enumerate(lengths.tolist()):
            assert (out[b, :, n:] == 0).all() and (lse[b, :, n:] == 0).all(), f"{who}rows past the length are not 0"


def emulated_kernels():
    """torch.ops.wiola_cuda_emu (the CUDA kernels run by the SIMT emulator) when the extension
    was built with them, else None."""
    try:
        ops = torch.ops.wiola_cuda_emu
        ops._gcla_summary_fwd  # noqa: B018 - resolving the op is the probe
        return ops
    except (AttributeError, RuntimeError):
        return None


def kernel_sets():
    """(name, kernels) to run the orchestration with on CPU: the PyTorch model always, the
    emulated CUDA kernels when built."""
    emu = emulated_kernels()
    return [("model: ", MODEL)] + ([("cuda_emu: ", emu)] if emu is not None else [])


def check_kernel_sets(ins, lengths, grad, dtype):
    ref = oracle(ins, lengths, grad)
    for who, kernels in kernel_sets():
        out, lse, grads = run_orchestration(ins, lengths, grad, kernels)
        check_against_oracle(out, lse, grads, ins, lengths, grad, dtype, ref=ref, who=who)


def _lengths(T, with_len, device="cpu"):
    if not with_len:
        return None
    lens = [T, 0] if T == 1 else [T - 3 if T > 3 else T, T // 3 + 1]
    return torch.tensor(lens, dtype=torch.int64, device=device)


# (T, S mode, lengths?, Λ', H, H_kv): T ∈ {1, 7, 257}, both summary modes, Λ' ∈ {0, 1, 2},
# H/H_kv ∈ {1, 4} and the pairs where h mod H_kv and h // (H/H_kv) differ.
CASES = [
    (1, "paper", False, 2, 4, 4), (1, "causal", True, 1, 4, 1), (1, "paper", True, 2, 4, 2),
    (7, "causal", False, 2, 4, 2), (7, "paper", True, 1, 6, 3), (7, "causal", True, 0, 4, 1),
    (7, "paper", False, 2, 4, 4), (7, "causal", True, 2, 6, 3),
    (257, "causal", True, 2, 4, 2), (257, "paper", True, 2, 4, 1), (257, "paper", False, 0, 6, 3),
    (257, "causal", False, 1, 4, 4),
]


def _ids(c):
    T, mode, with_len, L, H, H_kv = c
    return f"T{T}-{mode}-{'len' if with_len else 'full'}-L{L}-H{H}kv{H_kv}"


@contextlib.contextmanager
def deterministic():
    """torch.use_deterministic_algorithms(True) inside the block (PyTorch passes it on to the
    fused attention backward; our kernels are deterministic regardless)."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def run_orchestration(ins, lengths, grad, kernels):
    """The cuda backend's forward and backward on CPU tensors with ``kernels``."""
    ins = [x.contiguous() for x in ins]
    out, lse = gc.forward(*ins, lengths, kernels=kernels)
    grads = gc.backward(grad.to(ins[0].dtype), *ins, lengths, out, lse, kernels=kernels)
    return out, lse, grads


# ---------------------------------------------------------------------------------------
# CPU: orchestration + kernel model
# ---------------------------------------------------------------------------------------
def test_head_permutation_maps_to_paper_groups():
    """p(h) // G = h mod H_kv for every (H, H_kv), and to/from_self_order are that map."""
    for H, H_kv in ((4, 1), (4, 4), (4, 2), (6, 3), (16, 4), (8, 2)):
        P = gc.kv_order(H, H_kv)
        ps = SummaryKernelModel.self_head(H, P)
        assert sorted(ps.tolist()) == list(range(H))
        assert ((ps // (H // H_kv)) == torch.arange(H) % H_kv).all(), (H, H_kv)
        x = torch.randn(2, H, 3, 8, generator=torch.Generator().manual_seed(H))
        y = gc.to_self_order(x, P) if P > 1 else x
        assert torch.equal(y[:, ps], x)
        assert torch.equal(gc.from_self_order(y, P) if P > 1 else y, x)


# d_h 128 at every T ≤ 7 and once at T = 257 (the oracle's T×T float64 autograd dominates the run time).
FP32_CASES = [(c, 64) for c in CASES] + [(c, 128) for c in CASES if c[0] <= 7 or c is CASES[8]]
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="CPU check of the orchestration; a GPU runs the kernels themselves")


@cpu_only
@pytest.mark.parametrize("case, dh", FP32_CASES, ids=lambda x: _ids(x) if isinstance(x, tuple) else f"dh{x}")
def test_model_orchestration_matches_oracle_fp32(case, dh):
    T, mode, with_len, L, H, H_kv = case
    S = 1 if mode == "paper" else T
    ins = make_inputs(2, H, H_kv, T, dh, S, L, torch.float32, seed=T + L + H)
    lengths = _lengths(T, with_len)
    grad = torch.randn(2, H, T, dh, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    check_kernel_sets(ins, lengths, grad, torch.float32)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES[::2], ids=_ids)
def test_model_orchestration_matches_oracle_half(case, dtype):
    T, mode, with_len, L, H, H_kv = case
    S = 1 if mode == "paper" else T
    ins = make_inputs(2, H, H_kv, T, 64, S, L, dtype, seed=7)
    lengths = _lengths(T, with_len)
    grad = torch.randn(2, H, T, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    check_kernel_sets(ins, lengths, grad, dtype)


class _ExpandedCpuAttention(gc._SelfAttention):
    """The float32 CUDA path's structure on CPU: no native GQA (K/V expanded), lse rows padded
    to 32 columns — computed by the CPU flash kernel on the expanded heads."""

    def forward(self, q, k, v):
        assert k.shape[1] == q.shape[1], "the efficient path must see K/V expanded to H heads"
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=self.scale)
        T = q.shape[2]
        padded = torch.full((*lse.shape[:2], self.lse_columns(T)), math.nan)
        padded[..., :T] = lse
        return o, padded

    def backward(self, do, q, k, v, o, lse):
        assert k.shape[1] == q.shape[1]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse[..., :q.shape[2]].contiguous(), 0.0, True, scale=self.scale)


@cpu_only
@pytest.mark.parametrize("case", [CASES[4], CASES[8], CASES[10]], ids=_ids)
def test_model_expanded_kv_path_matches_oracle(case, monkeypatch):
    """float32 on CUDA: the memory-efficient kernel has no GQA, so heads stay natural, K/V are
    repeated (head j·H_kv + g reads g) and dK/dV summed back over the group."""
    T, mode, with_len, L, H, H_kv = case
    monkeypatch.setattr(gc, "self_attention_kernel", lambda device, dtype: "efficient")
    monkeypatch.setattr(gc, "_SelfAttention", _ExpandedCpuAttention)
    S = 1 if mode == "paper" else T
    ins = make_inputs(2, H, H_kv, T, 64, S, L, torch.float32, seed=3)
    lengths = _lengths(T, with_len)
    grad = torch.randn(2, H, T, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    check_kernel_sets(ins, lengths, grad, torch.float32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_padding_garbage_never_read(device):
    """NaN in q_rot, k_rot, v, q, kc, vc (S = T) and dO past the lengths changes nothing: the
    padding is zeroed before the fused kernel multiplies masked zeros by whole key blocks.
    CPU: the model and the emulated kernels; CUDA: the real ones with flash attention."""
    if (device == "cuda") != HAS_CUDA:
        pytest.skip("the CPU variant runs without a GPU, the CUDA one with it")
    for who, kernels in (kernel_sets() if device == "cpu" else [("cuda: ", None)]):
        _check_padding_garbage(device, kernels, who)


def _check_padding_garbage(device, kernels, who):
    T, H, H_kv = 70, 4, 2
    ins = make_inputs(2, H, H_kv, T, 64, T, 2, torch.bfloat16, device=device, seed=5)
    lengths = torch.tensor([70, 33], device=device)
    grad = torch.randn(2, H, T, 64, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(device)
    dirty_ins = [x.clone() for x in ins]
    for x in dirty_ins[:6]:
        x[1, :, 33:] = math.nan
    dirty_grad = grad.clone()
    dirty_grad[1, :, 33:] = math.nan
    with deterministic():  # flash's backward adds dq with atomics unless asked not to
        clean = run_orchestration(ins, lengths, grad, kernels)
        dirty = run_orchestration(dirty_ins, lengths, dirty_grad, kernels)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    for name, a, b in zip(NAMES, clean[2], dirty[2]):
        assert torch.equal(a, b), f"{who}grad {name} depends on the padding"


@cpu_only
def test_model_and_emulation_are_deterministic():
    ins = make_inputs(2, 6, 3, 130, 64, 1, 2, torch.bfloat16, seed=8)
    lengths = torch.tensor([130, 61])
    grad = torch.randn(2, 6, 130, 64, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for who, kernels in kernel_sets():
        a = run_orchestration(ins, lengths, grad, kernels)
        b = run_orchestration(ins, lengths, grad, kernels)
        for x, y in zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2])):
            assert torch.equal(x, y), who


def test_self_attention_kernel_choice_on_cpu():
    assert gc.self_attention_kernel(torch.device("cpu"), torch.float32) == "cpu_flash"


# ---------------------------------------------------------------------------------------
# GPU: the real kernels (scripts/gpu_check.sh)
# ---------------------------------------------------------------------------------------


@pytest.fixture
def cuda_kernels():
    reason = dispatch.BACKENDS["cuda"].unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)


# bf16 over every case; float32 (the efficient kernel, K/V expanded), d_h 128 and fp16 on subsets.
GPU_CASES = ([(c, 64, torch.bfloat16) for c in CASES] + [(c, 64, torch.float32) for c in CASES[::2]]
             + [(c, 128, dt) for c in CASES[1::4] for dt in (torch.bfloat16, torch.float32)]
             + [(c, 64, torch.float16) for c in CASES[2::4]])


@pytest.mark.parametrize("case, dh, dtype", GPU_CASES,
                         ids=lambda x: _ids(x) if isinstance(x, tuple) else str(x).replace("torch.", ""))
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_matches_oracle(case, dh, dtype):
    T, mode, with_len, L, H, H_kv = case
    S = 1 if mode == "paper" else T
    ins = [x.requires_grad_() for x in make_inputs(2, H, H_kv, T, dh, S, L, dtype, device="cuda", seed=T + L)]
    lengths = _lengths(T, with_len, "cuda")
    grad = torch.randn(2, H, T, dh, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with wiola_kernels.use_backend("cuda"):
        out, lse = GCLAAttentionFunction.apply(*ins, lengths), gcla_attention_op(*ins, lengths)[1]
        grads = torch.autograd.grad(out, ins, grad.to("cuda", dtype))
    check_against_oracle(out, lse, grads, ins, lengths, grad, dtype)


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_self_part_matches_sdpa(dtype):
    """With Λ' = 0 GCLA is causal attention with the h mod H_kv grouping: F.sdpa (GQA) on the
    permuted heads gives the same output and gradients (the same PyTorch kernels, so tight)."""
    import torch.nn.functional as F

    B, H, H_kv, T, dh = 2, 8, 2, 300, 64
    ins = [x.requires_grad_() for x in make_inputs(B, H, H_kv, T, dh, 1, 0, dtype, device="cuda", seed=11)]
    grad = torch.randn(B, H, T, dh, device="cuda", dtype=dtype)
    with wiola_kernels.use_backend("cuda"):
        out = wiola_kernels.gcla_attention(*ins)
        g = torch.autograd.grad(out, ins[:3], grad)
    idx = torch.arange(H, device="cuda") % H_kv
    ref = F.scaled_dot_product_attention(ins[0], ins[1][:, idx], ins[2][:, idx], is_causal=True)
    g_ref = torch.autograd.grad(ref, ins[:3], grad)
    tol = 2 * tolerance(dtype, "attention") if dtype != torch.float32 else tolerance(dtype, "attention")
    close(out, ref, tol, "out")
    for name, a, b in zip(NAMES, g, g_ref):
        close(a, b, tol, f"grad {name}")


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_deterministic():
    """Our kernels are always deterministic; the fused attention backward is under
    torch.use_deterministic_algorithms(True), which PyTorch passes on to it."""
    ins = [x.requires_grad_() for x in make_inputs(2, 8, 2, 200, 64, 1, 2, torch.bfloat16, device="cuda", seed=2)]
    lengths = torch.tensor([200, 77], device="cuda")
    g = torch.randn(2, 8, 200, 64, device="cuda", dtype=torch.bfloat16)
    with deterministic(), wiola_kernels.use_backend("cuda"):
        out = wiola_kernels.gcla_attention(*ins, lengths=lengths)
        g1 = torch.autograd.grad(out, ins, g, retain_graph=True)
        g2 = torch.autograd.grad(out, ins, g)
    for name, a, b in zip(NAMES, g1, g2):
        assert torch.equal(a, b), f"grad {name} not bitwise reproducible"


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_float64_and_odd_head_dim_use_reference():
    ins = [x.requires_grad_() for x in make_inputs(1, 2, 1, 5, 8, 1, 1, torch.float64, device="cuda")]
    with wiola_kernels.use_backend("cuda"), pytest.warns(RuntimeWarning, match="'cuda' cannot take dtype float64"):
        dispatch.reset_warnings()
        assert torch.autograd.gradcheck(lambda *a: wiola_kernels.gcla_attention(*a), ins, fast_mode=True)


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_kernel_rejects_bad_arguments():
    ins = [x.float() for x in make_inputs(1, 2, 1, 5, 32, 1, 1, torch.float32, device="cuda")]
    o = torch.zeros_like(ins[0])
    lse = torch.zeros(1, 2, 5, device="cuda")
    with pytest.raises(ValueError, match="d_h in"):
        torch.ops.wiola._gcla_summary_fwd(o, lse, ins[3], ins[4], ins[5], ins[6], None, 1)
    ins = [x.float() for x in make_inputs(1, 4, 2, 5, 64, 1, 1, torch.float32, device="cuda")]
    with pytest.raises(ValueError, match="perm_kv"):
        torch.ops.wiola._gcla_summary_fwd(torch.zeros_like(ins[0]), torch.zeros(1, 4, 5, device="cuda"), ins[3],
                                          ins[4], ins[5], ins[6], None, 3)


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_summary_kernels_match_model():
    """The real kernels against the PyTorch model on the same inputs (permuted order, S = 1
    and S = T, lengths) — isolates the kernels from the fused attention."""
    for S_T, (H, H_kv) in ((False, (6, 3)), (True, (4, 2))):
        B, T, dh, L = 2, 100, 64, 2
        ins = make_inputs(B, H, H_kv, T, dh, T if S_T else 1, L, torch.bfloat16, device="cuda", seed=13)
        lengths = torch.tensor([100, 41], device="cuda")
        P = gc.kv_order(H, H_kv)
        o_self = gc.to_self_order(torch.randn(B, H, T, dh, device="cuda", dtype=torch.bfloat16), P)
        lse_self = torch.randn(B, H, T, device="cuda")
        q, kc, vc, gate = ins[3], ins[4], ins[5], ins[6]
        got = torch.ops.wiola._gcla_summary_fwd(o_self, lse_self, q, kc, vc, gate, lengths, P)
        want = MODEL._gcla_summary_fwd(*[x.cpu() for x in (o_self, lse_self, q, kc, vc, gate, lengths)], P)
        for a, b in zip(got, want):
            close(a, b, 1e-2, "summary forward")
        grad = torch.randn(B, H, T, dh, device="cuda", dtype=torch.bfloat16)
        args = (grad, got[0], got[1], ins[0], q, kc, vc, gate, lengths)
        got_b = torch.ops.wiola._gcla_summary_bwd(*args, P, T, True)
        want_b = MODEL._gcla_summary_bwd(*[x.cpu() for x in args], P, T, True)
        for i, (a, b) in enumerate(zip(got_b, want_b)):
            assert a.shape == b.shape and a.stride() == b.stride(), f"output {i}: layout"
            close(a, b, 1e-2, f"summary backward output {i}")


@cpu_only
def test_cuda_emu_backend_through_the_public_op():
    """use_backend("cuda_emu") routes the public op (and its backward) to this orchestration
    with the emulated kernels."""
    if dispatch.BACKENDS["cuda_emu"].unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("the extension was built without the emulated CUDA kernels")
    ins = [x.requires_grad_() for x in make_inputs(2, 6, 3, 40, 64, 40, 2, torch.bfloat16, seed=21)]
    lengths = torch.tensor([40, 17])
    grad = torch.randn(2, 6, 40, 64, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    with wiola_kernels.use_backend("cuda_emu"):
        assert dispatch.select("gcla_attention", torch.device("cpu")) == "cuda_emu"
        out, lse = GCLAAttentionFunction.apply(*ins, lengths), gcla_attention_op(*ins, lengths)[1]
        grads = torch.autograd.grad(out, ins, grad.to(torch.bfloat16))
    check_against_oracle(out, lse, grads, ins, lengths, grad, torch.bfloat16)
