"""GCLA summary-augmented attention (SPEC §5): what only gcla_attention has. The properties
every op shares (forward and backward against the float64 oracle per backend and dtype, the
model's strided views read without a copy, the Triton gradcheck, bitwise determinism across
thread counts, unmodified inputs) are in tests/test_all_ops.py; opcheck, torch.compile, the
gradcheck of the other backends, the ``lengths`` checks and the bad-input messages every op
shares in tests/test_op_layer.py. The oracle is tests/oracles.py's ``gcla_oracle`` (SPEC
alone, not ``wiola_kernels.reference``, which is one backend under test).

Backends here: reference, cpu (C++), triton (its CPU interpreter) and cuda_emu (the CUDA
kernel's C++ composite on CPU tensors: PyTorch's CPU flash attention and the summary kernels run
by the SIMT emulator; d_h 64 or 128, no float64).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wiola_kernels as wk
from wiola_kernels import dispatch, shapes
from wiola_kernels.ops.gcla_attention import GCLAAttentionFunction
from wiola_kernels.reference.gcla_attention import gcla_context_kv, gcla_summary
from wiola_kernels.testing import CopyCounter, assert_close_rel, available_backends, tolerance

from helpers import close_floored, finite, gen, lengths_of_kind, needs_cpu_extension, threads, view_as
from op_cases import F64, OpCase, Public, randn64
from oracles import gcla_oracle, raises_naming

NAMES = ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate")
BACKENDS = [b for b in ("reference", "cpu", "triton", "cuda_emu") if b in available_backends("gcla_attention", "cpu")]
CPU_BACKENDS = [b for b in BACKENDS if b in ("reference", "cpu")]  # the cheap ones, for the big sweeps
NO_EMU = [b for b in BACKENDS if b != "cuda_emu"]                   # any d_h and float64
TRITON = "triton" in BACKENDS
needs_triton = pytest.mark.skipif(not TRITON, reason="the triton backend needs TRITON_INTERPRET=1 on CPU tensors")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def attn_tol(dtype: torch.dtype) -> float:
    return tolerance(dtype, "attention")


def inputs(B, H, H_kv, T, dh, S, L, dtype=torch.float32, seed=0, scales=None, device="cpu"):
    """The seven inputs (unit normal, times ``scales[i]``), the gate float32 beside 16-bit
    activations (a parameter, as in the model)."""
    g = gen(seed)
    sizes = [(B, H, T, dh), (B, H_kv, T, dh), (B, H_kv, T, dh), (B, H, T, dh), (B, H, S, L, dh), (B, H, S, L, dh), (H,)]
    scales = scales or [1.0] * 7
    ins = [(torch.randn(*size, generator=g, dtype=torch.float64) * sc).to(device, dtype) for size, sc in zip(sizes, scales)]
    ins[6] = ins[6].to(torch.float64 if dtype == torch.float64 else torch.float32)
    return ins


def run(backend, ins, lengths=None, grad=None):
    """(out, gradients of the seven inputs for ``grad``, or None) of the public op on ``backend``."""
    ins = [x.detach().clone().requires_grad_(grad is not None) for x in ins]
    with wk.use_backend(backend):
        out = wk.gcla_attention(*ins, lengths=lengths)
        if grad is None:
            return out.detach(), None
        return out.detach(), torch.autograd.grad(out, ins, grad.to(out.dtype))


def oracle(ins, lengths=None, grad=None):
    """(out, gradients for ``grad`` or None) of the float64 oracle."""
    x64 = [x.detach().cpu().double().requires_grad_(grad is not None) for x in ins]
    out = gcla_oracle(*x64, lengths=None if lengths is None else lengths.cpu())
    if grad is None:
        return out.detach(), None
    grads = torch.autograd.grad(out, x64, grad.cpu().double(), allow_unused=True)  # unused: B = 0
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(x64, grads)]


def raw_op(backend, ins, lengths=None):
    """``(out, lse)`` of ``backend``'s forward kernel."""
    return dispatch.kernels("gcla_attention", backend).forward(*ins, lengths)


def raw_grad_op(backend, grad, ins, lengths, out, lse):
    """The seven gradients of ``backend``'s backward kernel."""
    return dispatch.kernels("gcla_attention", backend).backward(grad, *ins, lengths, out, lse)


def _emu_shape(backend, dh):
    """d_h 64 where cuda_emu runs (its kernels take d_h 64 and 128 only)."""
    return 64 if backend == "cuda_emu" else dh


# --- the formula (SPEC §5.2-5.5) -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_key_per_row(backend, dtype):
    """T = 1 (and rows of length 1): each row attends to its own key only, so O = v_g + σ O^cross
    and dq̃ = dk̃ = 0 exactly; kernels see the rounding of the FlashAttention identity
    D = dO·O there (O rounded to the input dtype), hence the floor (unit-scale inputs; dk̃
    sums the noise of the H/H_kv heads of its group)."""
    for seed, (B, H, H_kv, dh, S, L, lens) in enumerate([(3, 4, 1, 16, 1, 1, (1, 0, 1)), (1, 6, 3, 8, 1, 2, None)]):
        ins = inputs(B, H, H_kv, 1, _emu_shape(backend, dh), S, L, dtype, seed=seed)
        lengths = None if lens is None else torch.tensor(lens)
        grad = torch.randn(B, H, 1, ins[0].shape[-1], generator=gen(seed + 10), dtype=torch.float64)
        out, grads = run(backend, ins, lengths, grad)
        want, dwant = oracle(ins, lengths, grad)
        floor = 1.0 if dtype in (torch.float16, torch.bfloat16) else 0.25
        close_floored(out, want, attn_tol(dtype), "out", floor)
        for name, got, ref in zip(NAMES, grads, dwant):
            close_floored(got, ref, attn_tol(dtype), f"grad {name}", floor * (H // H_kv if name == "k_rot" else 1))
        assert not dwant[0].any() and not dwant[1].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_is_h_mod_hkv(backend):
    """H = 6, H_kv = 3: head h reads group h mod 3 (0, 1, 2, 0, 1, 2; SPEC §5.2), not h // 2
    (0, 0, 1, 1, 2, 2): with constant values per group, each head's output is its group's."""
    B, H, H_kv, T, dh = 1, 6, 3, 5, _emu_shape(backend, 4)
    ins = inputs(B, H, H_kv, T, dh, T, 0)
    ins[2] = torch.stack([torch.full((T, dh), 10.0 * (g + 1)) for g in range(H_kv)])[None]
    out, _ = run(backend, ins)
    for h in range(H):
        assert torch.allclose(out[0, h], torch.full((T, dh), 10.0 * (h % H_kv + 1))), h


@pytest.mark.parametrize("backend", NO_EMU)
def test_gate_blends_the_cross_part_of_the_unrotated_query(backend):
    """σ(g) blends the cross part: g → −∞ is plain attention (Λ' = 0); dg = σ(1−σ) Σ dO·O^cross;
    the cross part reads the un-rotated q (with v = 0 and a huge q̃ it is all there is)."""
    ins = inputs(2, 4, 1, 20, 8, 1, 2, torch.float64, seed=1)
    plain, _ = run(backend, [*ins[:4], ins[4][..., :0, :], ins[5][..., :0, :], ins[6]])
    off, _ = run(backend, [*ins[:6], torch.full((4,), -1e4, dtype=torch.float64)])
    assert_close_rel(off, plain, tolerance(torch.float64), "gate -1e4")
    out, (*_, dg) = run(backend, ins, grad=torch.ones(2, 4, 20, 8, dtype=torch.float64))
    sig = torch.sigmoid(ins[6])
    o_cross = (out - plain) / sig[None, :, None, None]
    assert_close_rel(dg, sig * (1 - sig) * o_cross.sum((0, 2, 3)), attn_tol(torch.float64), "dgate")
    cross_only = [ins[0] * 100, ins[1], torch.zeros_like(ins[2]), *ins[3:6], torch.tensor([-3.0, 1.5, 0.0, 2.0],
                                                                                          dtype=torch.float64)]
    got, _ = run(backend, cross_only)
    assert_close_rel(got, oracle(cross_only)[0], attn_tol(torch.float64), "cross part")
    assert (got - oracle([*cross_only[:3], cross_only[0], *cross_only[4:]])[0]).abs().max() > 1e-2  # not q̃


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_returns_the_self_log_sum_exp(backend):
    """SPEC §5.5: the forward kernel returns the log-sum-exp of the self part its backward
    needs, (B, H, T) in float32 (the accumulation dtype), 0 on rows past the length."""
    ins = inputs(2, 4, 1, 37, _emu_shape(backend, 8), 37, 2)
    lengths = torch.tensor([37, 20])
    with wk.use_backend(backend):
        out, lse = raw_op(backend, ins, lengths)
    want, want_lse = gcla_oracle(*ins, lengths=lengths, return_lse=True)
    assert lse.shape == (2, 4, 37) and lse.dtype == torch.float32
    assert_close_rel(out, want, attn_tol(torch.float32), "out")
    assert_close_rel(lse[0], want_lse[0], tolerance(torch.float32), "lse")
    assert_close_rel(lse[1, :, :20], want_lse[1, :, :20], tolerance(torch.float32), "lse")
    assert (lse[1, :, 20:] == 0).all()


def test_summaries_and_context():
    """SPEC §5.1, §5.3 (wiola_kernels.reference's helpers): paper = the mean over all positions
    (S = 1), causal = prefix means (S = T); the context projections per head."""
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=gen(2))
    paper, causal = gcla_summary(x, "paper"), gcla_summary(x, "causal")
    assert paper.shape == (2, 1, 8) and causal.shape == (2, 6, 8)
    assert_close_rel(causal[:, -1:], paper, 1e-15)
    assert_close_rel(causal[:, 2], x[:, :3].mean(1), 1e-15)
    assert_close_rel(gcla_summary(x, "paper", torch.tensor([6, 2]))[1, 0], x[1, :2].mean(0), 1e-15)
    summ = torch.stack([causal, 2 * causal], dim=2)  # (B, S, Λ', d)
    w_kc, w_vc = torch.randn(8, 4 * 2, dtype=torch.float64), torch.randn(8, 4 * 2, dtype=torch.float64)
    kc, vc = gcla_context_kv(summ, w_kc, w_vc, num_heads=4)
    assert kc.shape == vc.shape == (2, 4, 6, 2, 2)
    assert_close_rel(kc[1, 3, 4, 1], (2 * causal[1, 4] @ w_kc)[6:8], 1e-15)
    assert gcla_context_kv(summ[:, :, :0], w_kc, w_vc, 4)[0].shape == (2, 4, 6, 0, 2)
    with pytest.raises(ValueError, match="mode"):
        gcla_summary(x, "bogus")


def test_gate_init_in_model():
    """SPEC §1/§5.4: the gate starts at g₀ = −3.0 (the module lives in the model), and the
    other SPEC §1 defaults."""
    wiola = pytest.importorskip("wiola")
    cfg = wiola.WiolaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=4, dsff_narrow_size=16, dsff_wide_size=32)
    assert cfg.gcla_gate_init == -3.0 and cfg.rms_norm_eps == 1e-6 and cfg.gcla_lookback == 2
    assert cfg.atm_threshold == 0.92 and cfg.srpe_theta == 10000 and cfg.srpe_spiral_divisor == 8
    assert cfg.srpe_radial_amplitude == 0.1 and cfg.srpe_radial_frequency == 0.01
    gates = [p for n, p in wiola.WiolaForCausalLM(cfg).named_parameters() if n.endswith("gate")]
    assert len(gates) == 3 and all(torch.equal(p, torch.full((4,), -3.0)) for p in gates)


# --- causality and lengths -----------------------------------------------------------------------

@pytest.mark.parametrize("backend, S", [(b, s) for b in NO_EMU for s in ("T", 1) if b != "triton" or s == "T"])
def test_causal(backend, S):
    """Changing q̃, k̃, v, q (and kc, vc when S = T) at positions > t never changes the outputs
    ≤ t, for t on either side of every block edge (C++: 64-row query blocks; interpreter: 32 ×
    16); the outputs > t do change, and the diagonal key is attended."""
    T = 70
    ins = inputs(1, 4, 2, T, 8, T if S == "T" else 1, 2, torch.float64, seed=3)
    base, _ = run(backend, ins)
    for t in (0, 1, 15, 16, 31, 32, 63, 64, 68):
        pert = [x.clone() for x in ins]
        for i in range(6 if S == "T" else 4):
            pert[i][:, :, t + 1:] += 3.0
        out, _ = run(backend, pert)
        assert torch.equal(out[:, :, :t + 1], base[:, :, :t + 1]), f"rows <= {t} saw the future"
        assert not torch.equal(out[:, :, t + 1:], base[:, :, t + 1:])
    pert = [x.clone() for x in ins]
    pert[2][:, :, 5] += 1.0
    assert not torch.equal(run(backend, pert)[0][:, :, 5], base[:, :, 5])


@pytest.mark.parametrize("backend, S", [(b, s) for b in BACKENDS for s in ("T", 1)])
def test_lengths(backend, S):
    """Rows t ≥ len_b: outputs and the gradients of every per-row input exactly 0, their content
    (NaN, Inf, or a NaN output gradient) never read; a row of length 0 gives nothing, a batch of
    them every gradient (the gate's too) 0; a row of length T equals the unpadded op."""
    T, dh = 50, _emu_shape(backend, 8)
    ins = inputs(3, 4, 2, T, dh, T if S == "T" else 1, 2, seed=4)
    lengths = torch.tensor([T, 17, 0])
    grad = torch.randn(3, 4, T, dh, generator=gen(5), dtype=torch.float64)
    out, grads = run(backend, ins, lengths, grad)
    assert (out[1, :, 17:] == 0).all() and (out[2] == 0).all()
    for name, g in zip(NAMES[:6], grads[:6]):
        assert (g[1, :, 17:] == 0).all() and (g[2] == 0).all(), f"grad {name} past the length"
    dirty, dirty_grad = [x.clone() for x in ins], grad.clone()
    for i, x in enumerate(dirty[:6]):
        if S == "T" or i < 4:  # S = 1: one summary row for all positions
            x[1, :, 17:] = float("nan") if i % 2 else float("inf")
        x[2] = float("nan")
    dirty_grad[1, :, 17:] = float("nan")
    out2, grads2 = run(backend, dirty, lengths, dirty_grad)
    assert torch.equal(out2, out)
    for name, a, b in zip(NAMES, grads2, grads):
        assert torch.equal(a, b), f"grad {name} read the padding"
    full, _ = run(backend, ins, None)
    assert_close_rel(full[0], out[0], tolerance(torch.float32), "length T")
    _, grads = run(backend, ins, torch.zeros(3, dtype=torch.int64), grad)
    assert all(not g.any() for g in grads), "a batch of empty rows has gradients"


# --- bad input (the messages every op shares: test_op_layer.py) ----------------------------------

def _bad_call(**changes):
    args = dict(zip(NAMES, inputs(2, 4, 2, 5, 8, 5, 2)), lengths=None)
    for name, change in changes.items():
        args[name] = change(args)
    return wk.gcla_attention(**args)


BAD = {  # what test_op_layer.py's table has not: (changes, error, names one of)
    "H_not_multiple_of_H_kv": (dict(k_rot=lambda a: torch.randn(2, 3, 5, 8), v=lambda a: torch.randn(2, 3, 5, 8)),
                               ValueError, ["multiple of"]),
    "odd_d_h": ({n: (lambda a, n=n: a[n][..., :7]) for n in ("q_rot", "k_rot", "v", "q")}, ValueError, ["even"]),
    "k_rot_wrong_T": (dict(k_rot=lambda a: torch.randn(2, 2, 4, 8)), ValueError, ["k_rot"]),
    "k_rot_wrong_d_h": (dict(k_rot=lambda a: torch.randn(2, 2, 5, 10)), ValueError, ["k_rot"]),
    "q_wrong_d_h": (dict(q=lambda a: torch.randn(2, 4, 5, 6)), ValueError, ["q must have shape"]),
    "q_rot_rank3": (dict(q_rot=lambda a: a["q_rot"][0]), ValueError, ["q_rot"]),
    "q_rot_int": (dict(q_rot=lambda a: a["q_rot"].int()), TypeError, ["q_rot must have dtype"]),
    "all_complex": ({n: (lambda a, n=n: a[n].to(torch.complex64)) for n in NAMES[:6]}, TypeError, ["q_rot"]),
    "q_rot_list": (dict(q_rot=lambda a: a["q_rot"].tolist()), TypeError, ["q_rot"]),
    "gate_list": (dict(gate=lambda a: [0.0] * 4), TypeError, ["gate must be a torch.Tensor"]),
    "lengths_int": (dict(lengths=lambda a: 5), TypeError, ["lengths"]),
    "k_rot_other_device": (dict(k_rot=lambda a: a["k_rot"].to("meta")), ValueError, ["k_rot"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_name_the_argument(case):
    changes, error, names = BAD[case]
    raises_naming((error,), names, lambda: _bad_call(**changes))


@given(
    q_rank=st.integers(3, 5), b_k=st.integers(1, 3), h=st.integers(1, 4), h_kv=st.integers(1, 4),
    t=st.integers(1, 4), t_k=st.integers(1, 4), dh=st.integers(1, 9), s=st.integers(1, 5),
    kv_dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
    gate_len=st.integers(0, 5), lengths_kind=st.sampled_from(["ok", "none", "float", "too_long", "negative", "2d"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_bad_input_raises_named_error(q_rank, b_k, h, h_kv, t, t_k, dh, s, kv_dtype, gate_len, lengths_kind, seed):
    """Any mix of wrong ranks, sizes, dtypes and lengths raises an error naming an argument;
    every call accepted is valid."""
    B = 2
    g = gen(seed)
    q_shape = (B, h, t, dh)[4 - q_rank:] if q_rank <= 4 else (1, B, h, t, dh)
    q_rot, q = torch.randn(q_shape, generator=g), torch.randn(q_shape, generator=g)
    k_rot, v = (torch.randn(b_k, h_kv, t_k, dh, generator=g).to(kv_dtype) for _ in range(2))
    kc, vc = (torch.randn(B, h, s, 2, dh, generator=g) for _ in range(2))
    lengths = {"ok": torch.full((B,), t), "none": None, "float": torch.full((B,), float(t)),
               "too_long": torch.full((B,), t + 1), "negative": torch.full((B,), -1),
               "2d": torch.full((B, 1), t)}[lengths_kind]
    try:
        out = wk.gcla_attention(q_rot, k_rot, v, q, kc, vc, torch.zeros(gate_len), lengths)
    except (ValueError, TypeError) as exc:
        assert any(n in str(exc) for n in (*NAMES, "lengths", "H_kv", "d_h")), str(exc)
        return
    assert (q_rank == 4 and b_k == B and t_k == t and h % h_kv == 0 and dh % 2 == 0 and s in (1, t)
            and kv_dtype == torch.float32 and gate_len == h and lengths_kind in ("ok", "none")), "an invalid call ran"
    assert out.shape == q_rot.shape


@pytest.mark.parametrize("h_kv, s", [(2, 6), (4, 6), (4, 1)])
def test_transposed_inputs_get_a_transpose_hint(h_kv, s):
    """(B, T, H, d_h) passed instead of (B, H, T, d_h): the message says to transpose."""
    g = gen(0)
    b, t, h, dh = 2, 6, 4, 8
    q = torch.randn(b, t, h, dh, generator=g)
    k, v = (torch.randn(b, t, h_kv, dh, generator=g) for _ in range(2))
    kc = torch.randn(b, h, s, 2, dh, generator=g)  # the context in the right layout, S ∈ {1, T}
    gate = torch.zeros(h)
    # H_kv < H: k_rot gives it away; H_kv = H: q/k/v agree in either layout, kc does.
    with pytest.raises(ValueError, match=r"^(k_rot|kc) must have shape.*pass \.transpose\(1, 2\)"):
        wk.gcla_attention(q, k, v, q, kc, kc, gate)
    empty = torch.zeros(b, t, 1, 0, dh)  # Λ' = 0 read with the (wrong) H = T heads: only the gate is left
    if h_kv == h:
        with pytest.raises(ValueError, match=r"^gate must have shape \(H,\) = \(6,\).*pass \.transpose\(1, 2\)"):
            wk.gcla_attention(q, k, v, q, empty, empty, gate)


def test_docstring_states_the_layout_first():
    head = wk.gcla_attention.__doc__.split("\n\n")[1]
    assert "(B, heads, T, d_h)" in head and ".transpose(1, 2)" in head and "H = H_kv = T" in head


# --- numerics at the edges (the cheap backends) --------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype, scales", [
    (torch.float32, [1e15, 1e15, 1, 1, 1, 1, 1]),          # scores ~1e30: a saturated softmax
    (torch.float32, [12, 12, 1, 12, 12, 1, 1]),            # scores of several hundred: nearly one-hot
    (torch.float32, [1e-20, 1e-20, 1, 1e-20, 1e-20, 1, 1]),  # scores ~1e-40: uniform softmax
    (torch.float32, [1, 1, 1e30, 1, 1, 1e30, 1]),           # huge values
    (torch.float32, [1, 1, 1e-30, 1, 1, 1e-30, 1]),         # tiny values
    (torch.float16, [20, 20, 1e4, 20, 20, 1e4, 1]),         # near the fp16 limits (|out| ≤ 3e4·(1 + σ) < 65504)
    (torch.bfloat16, [1e15, 1e15, 1e37, 1, 1, 1e37, 1]),    # near the bf16 limits
])
def test_huge_and_tiny_magnitudes(backend, dtype, scales):
    ins = [x.clamp(-3 * s, 3 * s) for x, s in zip(inputs(2, 4, 2, 21, 8, 21, 2, dtype, seed=8, scales=scales), scales)]
    lengths = torch.tensor([21, 13])
    out, _ = run(backend, ins, lengths)
    assert finite(out)
    assert_close_rel(out, oracle(ins, lengths)[0], attn_tol(dtype))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nonfinite_batch_row_is_confined(backend):
    """A NaN/Inf anywhere in batch row 0 of any input, or in its output gradient, never reaches
    batch row 1's output or gradients; in one head's gate it reaches that head only."""
    ins = inputs(2, 4, 2, 21, 8, 1, 2, seed=8)
    grad = torch.randn(2, 4, 21, 8, generator=gen(10))
    out0, g0 = run(backend, ins, grad=grad)
    for bad in (float("nan"), float("inf")):
        for which in range(7):
            dirty = [x.clone() for x in ins]
            dirty[which][(1,) if which == 6 else (0, 1, 5, 3) if which < 4 else (0, 1, 0, 1, 3)] = bad
            out, grads = run(backend, dirty, grad=grad)
            if which == 6:  # the gate of head 1
                keep = [0, 2, 3]
                assert torch.equal(out[:, keep], out0[:, keep]), (bad, "gate")
                assert torch.equal(grads[0][:, keep], g0[0][:, keep]) and torch.equal(grads[3][:, keep], g0[3][:, keep])
                continue
            assert torch.equal(out[1], out0[1]), (bad, NAMES[which])
            for name, g, g_0 in zip(NAMES[:6], grads, g0):
                assert torch.equal(g[1], g_0[1]), (bad, NAMES[which], name)
        dirty_grad = grad.clone()
        dirty_grad[0, 2, 4, 1] = bad
        _, grads = run(backend, ins, grad=dirty_grad)
        for name, g, g_0 in zip(NAMES[:6], grads, g0):
            assert torch.equal(g[1], g_0[1]), (bad, "grad_out", name)


@pytest.mark.parametrize("backend", CPU_BACKENDS)  # triton: a NaN key reaches its diagonal tile (module docstring)
@pytest.mark.parametrize("where", ["v", "k_rot"])
def test_nonfinite_future_key_does_not_reach_earlier_rows(backend, where):
    """A NaN/Inf at key 40 never reaches query rows < 40 (outputs or dq̃): the T = 80 rows span
    a query block, so a kernel multiplying whole tiles by masked zeros would fail."""
    clean = inputs(2, 4, 2, 80, 8, 1, 2, seed=8)
    ins = [x.clone() for x in clean]
    ins[NAMES.index(where)][0, 0, 40, 3] = float("nan") if where == "v" else float("inf")
    grad = torch.zeros(2, 4, 80, 8)
    grad[:, :, :40] = 1.0
    out, grads = run(backend, ins, grad=grad)
    assert finite(out[0, :, :40], grads[0][0, :, :40])
    assert not finite(out[0, :, 40:])  # the rows that see it do show it
    assert_close_rel(out[0, :, :40], run(backend, clean)[0][0, :, :40], tolerance(torch.float32))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("where", ["q_rot", "grad_out"])
def test_nonfinite_query_row_does_not_reach_later_keys(backend, where):
    """A NaN/Inf in query row 40 (or in its output gradient) reaches dk̃/dv of the keys that row
    attends to (j ≤ 40) only: a dense dSᵀ Q̃ or Pᵀ dO would give 0·NaN = NaN at keys j > 40."""
    for bad in (float("nan"), float("inf")):
        ins = inputs(2, 4, 2, 80, 8, 1, 2, seed=8)
        grad = torch.randn(2, 4, 80, 8, generator=gen(12))
        if where == "q_rot":
            ins[0][0, 1, 40, 3] = bad
        else:
            grad[0, 1, 40, 3] = bad
        _, (_, dk, dv, *_) = run(backend, ins, grad=grad)
        assert finite(dk[0, :, 41:], dv[0, :, 41:], dk[1], dv[1]), bad
        if where == "grad_out":  # row 40 does reach its own keys
            assert not finite(dv[0, 1, :41])


@given(
    b=st.integers(0, 3), h_kv=st.integers(1, 3), groups=st.integers(1, 2), t=st.integers(1, 18),
    half=st.integers(1, 12), s_full=st.booleans(), slots=st.integers(0, 3),
    dtype=st.sampled_from(DTYPES), how=st.sampled_from(["contiguous", "transposed", "sliced", "expanded"]),
    gate=st.floats(-8.0, 8.0), len_kind=st.sampled_from(["none", "random", "zeros", "full", "int32"]),
    scale=st.sampled_from([0.3, 1.0, 3.0]), check_grad=st.booleans(), backend=st.sampled_from(CPU_BACKENDS),
    data=st.data(),
)
def test_any_shape_stride_dtype(b, h_kv, groups, t, half, s_full, slots, dtype, how, gate, len_kind, scale, check_grad,
                                backend, data):
    """B = 0/1, T = 1, Λ' = 0, S = 1 and T, odd d_h / 2, lengths 0 and T, any view, a gate of any
    float dtype: the outputs' shape and dtype, values and gradients against the oracle."""
    h, dh, s = h_kv * groups, 2 * half, t if s_full else 1
    g = gen(data.draw(st.integers(0, 2**31 - 1)))
    sizes = [(b, h, t, dh), (b, h_kv, t, dh), (b, h_kv, t, dh), (b, h, t, dh), (b, h, s, slots, dh), (b, h, s, slots, dh)]
    # "expanded": k_rot/v replicated over heads, kc/vc over positions (or slots), q_rot, q over the batch.
    expand_dims = [0, 1, 1, 0, 2 if s > 1 else 3, 2 if s > 1 else 3]
    ins = [view_as(scale * torch.randn(*size, generator=g, dtype=torch.float64), dtype, how, dim)
           for size, dim in zip(sizes, expand_dims)]
    ins.append(view_as(gate + torch.randn(h, generator=g, dtype=torch.float64), data.draw(st.sampled_from(DTYPES)), how))
    lengths = lengths_of_kind(len_kind, b, t, g)
    grad = torch.randn(b, h, t, dh, generator=g, dtype=torch.float64).to(dtype)
    with wk.use_backend(backend):
        args = [x.requires_grad_(check_grad) for x in ins]
        out = wk.gcla_attention(*args, lengths=lengths)
        assert out.shape == (b, h, t, dh) and out.dtype == dtype
        grads = torch.autograd.grad(out, args, grad, allow_unused=True) if check_grad else None
    want, dwant = oracle(ins, lengths, grad if check_grad else None)
    low = dtype in (torch.bfloat16, torch.float16)
    close_floored(out, want, attn_tol(dtype), "out", floor=1.0 if low else 0.25)
    if not check_grad:
        return
    for name, got, ref, x in zip(NAMES, grads, dwant, ins):
        got = torch.zeros_like(x) if got is None else got
        assert got.shape == x.shape and got.dtype == x.dtype, name
        tol = max(attn_tol(dtype), attn_tol(x.dtype))
        # Gradients scale like scale² (and exact zeros — T = 1 — see the rounding noise of
        # D = dO·O with O rounded to the input dtype): floor accordingly.
        close_floored(got, ref, tol, f"grad {name}", floor=(1.0 if tol >= 1e-2 else 0.25) * max(scale, 1.0) ** 2)


# --- the C++ kernel ------------------------------------------------------------------------------

@needs_cpu_extension
def test_cpu_never_allocates_a_t_by_t_matrix():
    """SPEC §5.5: no T×T matrix. T = 4096 (a float32 T×T is 64 MiB): the forward and backward
    allocate nothing near that (the profiler sees every allocation of the CPU allocator)."""
    T = 4096
    ins = [x.requires_grad_() for x in inputs(1, 2, 1, T, 8, 1, 2, seed=13)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with wk.use_backend("cpu"):
            out = wk.gcla_attention(*ins)
            torch.autograd.grad(out, ins, torch.ones_like(out))
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest < T * T * 4 // 16, biggest


@needs_cpu_extension
@pytest.mark.parametrize("mode, lens", [("causal", [21, 17]), ("paper", [0, 12])])
def test_cpu_interleaved_views_on_any_thread_count(mode, lens):
    """On the model's interleaved views the C++ kernel groups heads per task by the thread count
    (1 thread: all 6 heads in a task, 2: 3, 3: 2): every partition gives bitwise the same values
    and gradients, and those match the oracle."""
    B, H, H_kv, T, dh, L = 2, 6, 3, 21, 16, 2
    ins, grad = model_layout_inputs(B, H, H_kv, T, dh, T if mode == "causal" else 1, L, seed=11)
    lengths = torch.tensor(lens)
    want, dwant = oracle(ins, lengths, grad)
    results = []
    for n in (1, 2, 3):
        with threads(n):
            out, grads = run("cpu", ins, lengths, grad)
        results.append((out, *grads))
    assert_close_rel(results[0][0], want, attn_tol(torch.float32), "out")
    for name, g, r in zip(NAMES, results[0][1:], dwant):
        assert_close_rel(g, r, attn_tol(torch.float32), f"grad {name}")
    for n, res in zip((2, 3), results[1:]):
        for name, a, b in zip(("out", *NAMES), res, results[0]):
            assert torch.equal(a, b), f"{name} with {n} threads differs from 1 thread"


# --- the model's layouts -------------------------------------------------------------------------

def model_layout_inputs(B, H, H_kv, T, dh, S, L, dtype=torch.float32, seed=0):
    """The seven inputs as the model makes them: q_rot, q ``(B, T, H, d_h)``-ordered and k_rot, v
    ``(B, T, H_kv, d_h)``-ordered transposed views; kc, vc ``view(B, S, Λ', H, d_h).permute(0, 3,
    1, 2, 4)`` of a context projection; and an output gradient that is a transposed view too
    (the gradient of ``O.transpose(1, 2).reshape(B, T, H·d_h)``)."""
    g = gen(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    ins = [r(B, T, H, dh).transpose(1, 2), r(B, T, H_kv, dh).transpose(1, 2), r(B, T, H_kv, dh).transpose(1, 2),
           r(B, T, H, dh).transpose(1, 2), r(B, S, L, H, dh).permute(0, 3, 1, 2, 4),
           r(B, S, L, H, dh).permute(0, 3, 1, 2, 4), r(H)]
    return ins, r(B, T, H, dh).transpose(1, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_returns_the_fakes_layouts(backend):
    """Every backend returns the layouts the op's fakes promise on the model's views: O and
    the per-row gradients in their inputs' layout (O in (B, T, H, d_h) memory, so the output
    projection's reshape is a view), ∂kc, ∂vc contiguous for S = 1 (sums over positions); the
    kernels that read views (cpu, triton) without one copy; the right values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, H, H_kv, T, dh, L = 2, 4, 2, 9, 64, 2
    for S in (T, 1):
        ins, grad = model_layout_inputs(B, H, H_kv, T, dh, S, L, seed=S)
        lengths = torch.tensor([9, 5])
        with wk.use_backend(backend), CopyCounter() as copied:
            out, lse = raw_op(backend, ins, lengths)
            grads = raw_grad_op(backend, grad, ins, lengths, out, lse)
        if backend in ("cpu", "triton"):
            assert copied.copies == 0, (S, copied.counts)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake_out, _ = torch.ops.wiola.gcla_attention(*ins, lengths)
            fake_grads = torch.ops.wiola.gcla_attention_backward(grad, *ins, lengths, out, lse)
        for name, real, fake in zip(("out",) + NAMES, (out, *grads), (fake_out, *fake_grads)):
            significant = [s for n, s in zip(real.shape, real.stride()) if n > 1]
            assert significant == [s for n, s in zip(fake.shape, fake.stride()) if n > 1], (S, name)
        assert out.transpose(1, 2).reshape(B, T, H * dh).data_ptr() == out.data_ptr()
        assert_close_rel(out, oracle(ins, lengths)[0], attn_tol(torch.float32), f"S={S} out")


@pytest.mark.slow
def test_inductor_compiles_the_op_on_the_models_views():
    """Inductor's codegen around the op (its C++ compile takes a while on 2 cores), forward and
    backward against the oracle (aot_eager and graph breaks: test_op_layer.py)."""
    ins, grad = model_layout_inputs(2, 4, 2, 9, 8, 1, 2, seed=1)
    lengths = torch.tensor([9, 5])
    leaves = [x.detach().requires_grad_() for x in ins]
    out = torch.compile(lambda *a: wk.gcla_attention(*a, lengths=lengths), fullgraph=True, backend="inductor")(*leaves)
    want, dwant = oracle(ins, lengths, grad)
    assert_close_rel(out, want, attn_tol(torch.float32), "out")
    for name, g, r in zip(NAMES, torch.autograd.grad(out, leaves, grad), dwant):
        assert_close_rel(g, r, attn_tol(torch.float32), f"grad {name}")


def test_opcheck_on_the_models_views():
    """opcheck of the registered ops (fakes against the kernel) on the model's strided views
    (the plain layouts: test_op_layer.py)."""
    for S, lens in ((7, None), (1, torch.tensor([7, 3]))):
        ins, grad = model_layout_inputs(2, 4, 2, 7, 4, S, 2, seed=S)
        torch.library.opcheck(torch.ops.wiola.gcla_attention.default, (*ins, lens))  # autograd: the Function's
        out, lse = torch.ops.wiola.gcla_attention(*ins, lens)
        torch.library.opcheck(torch.ops.wiola.gcla_attention_backward.default, (grad, *ins, lens, out, lse))


# --- the Triton kernels (the interpreter on CPU; on a GPU below) ---------------------------------

def _triton_against_oracle(fwd, bwd, B, H, H_kv, T, dh, S, lens, seed):
    """``fwd(ins, lengths)``, ``bwd(grad, ins, lengths, out, lse)`` (the launchers with their
    overrides) in float32 against the oracle."""
    ins = inputs(B, H, H_kv, T, dh, S, 2, seed=seed)
    lengths = torch.tensor(lens)
    grad = torch.randn(B, H, T, dh, generator=gen(seed + 1))
    out, lse = fwd(ins, lengths)
    want, dwant = oracle(ins, lengths, grad)
    assert_close_rel(out, want, attn_tol(torch.float32), "out")
    for name, g, r in zip(NAMES, bwd(grad, ins, lengths, out, lse), dwant):
        assert_close_rel(g, r, attn_tol(torch.float32), f"grad {name}")


@needs_triton
def test_triton_gpu_block_sizes_in_the_interpreter():
    """The blocks launch_config picks for an H200 (bf16, d_h 64: forward 128 × 64, dq pass
    128 × 32, dk/dv pass 32 × 64) on a sequence spanning several of them."""
    from wiola_kernels.triton import gcla_attention as tk

    cfg = tk.launch_config(64, torch.bfloat16, 90)
    _triton_against_oracle(lambda ins, lt: tk.gcla_attention_fwd(*ins, lt, config=cfg),
                           lambda grad, ins, lt, out, lse: tk.gcla_attention_bwd(grad, *ins, lt, out, lse, config=cfg),
                           2, 2, 1, 300, 64, 300, (300, 133), seed=3)


@needs_triton
def test_triton_dkv_split_in_the_interpreter():
    """The dk/dv pass with each group's heads split over several programs (what a grid smaller
    than the GPU gets, dkv_split), unevenly (4 heads over 3 programs)."""
    from wiola_kernels.triton import gcla_attention as tk

    assert tk.dkv_split(1, 16, 1, 2048, 128, 132) == 9   # 16 programs, each group split 9 ways
    assert tk.dkv_split(4, 16, 4, 4096, 64, 132) == 1    # the bench grid fills the GPU
    assert tk.dkv_split(1, 4, 4, 64, 64, 132) == 1       # one head per group: nothing to split
    _triton_against_oracle(lambda ins, lt: tk.gcla_attention_fwd(*ins, lt),
                           lambda grad, ins, lt, out, lse: tk.gcla_attention_bwd(grad, *ins, lt, out, lse, split=3),
                           2, 4, 1, 40, 16, 40, (40, 23), seed=7)


@needs_triton
def test_triton_head_dim_limits():
    """Even d_h from 2 up to 256 run (tiles of max(16, next power of two) columns); wider, and
    float32 beyond d_h 64 (its exact FMA products spill registers on a GPU), run on another
    backend with a warning that says why; the GPU launch configuration refuses the latter."""
    from wiola_kernels.triton import gcla_attention as tk

    ins = inputs(1, 2, 1, 3, 2, 3, 1, torch.float64)
    assert_close_rel(run("triton", ins)[0], oracle(ins)[0], attn_tol(torch.float64), "d_h = 2")
    for dh, dtype, match in ((258, torch.float32, r"even head widths d_h in \[2, 256\]"),
                             (66, torch.float32, r"float32 only up to d_h 64")):
        ins = inputs(1, 2, 1, 3, dh, 3, 1, dtype)
        dispatch.reset_warnings()
        with wk.use_backend("triton"), pytest.warns(RuntimeWarning, match=match):
            assert dispatch.select("gcla_attention", torch.device("cpu"), dtype, dh) != "triton"
            out = wk.gcla_attention(*ins)
        assert_close_rel(out, oracle(ins)[0], attn_tol(dtype), f"d_h = {dh}")
    with pytest.raises(ValueError, match=r"float32 on a GPU only up to d_h = 64, got d_h = 128.*cuda backend"):
        tk.launch_config(128, torch.float32, 90)
    assert tk.launch_config(128, torch.bfloat16, 90) and tk.launch_config(64, torch.float32, 80)


def test_triton_dispatch():
    """CPU tensors never pick triton by default (only when forced); CUDA tensors prefer cuda."""
    assert "triton" in dispatch.implemented("gcla_attention")
    assert dispatch.select("gcla_attention", torch.device("cpu")) != "triton"
    if TRITON:
        with wk.use_backend("triton"):
            assert dispatch.select("gcla_attention", torch.device("cpu")) == "triton"
    priority = dispatch._PRIORITY["cuda"]
    assert priority.index("cuda") < priority.index("triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, B, H, H_kv, T, dh, mode, lens", [
    (dtype, *case[:6], None if case[6] is None else list(case[6]))
    for case, dtypes in shapes.GCLA_GPU_TESTS for dtype in dtypes])  # what gpu-report compiles ahead of time
def test_triton_gpu_vs_float64(dtype, B, H, H_kv, T, dh, mode, lens):
    """Compiled kernels on the device against the oracle (SPEC §9), bitwise reproducible."""
    ins = inputs(B, H, H_kv, T, dh, 1 if mode == "paper" else T, 2, torch.float64, seed=5)
    lengths = None if lens is None else torch.tensor(lens)
    grad = torch.randn(B, H, T, dh, generator=gen(6), dtype=torch.float64)
    dev = [x.to("cuda", dtype if i < 6 else torch.float32) for i, x in enumerate(ins)]
    ltd = None if lengths is None else lengths.cuda()
    (out, grads), (_, grads2) = (run("triton", dev, ltd, grad.cuda()) for _ in range(2))
    want, dwant = oracle(dev, lengths, grad)
    close_floored(out, want, attn_tol(dtype), "out", floor=1.0)
    for name, g, g2, r in zip(NAMES, grads, grads2, dwant):
        close_floored(g, r, attn_tol(dtype), f"grad {name}", floor=1.0)
        assert torch.equal(g, g2), f"grad {name} not bitwise reproducible"


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
def cuda_oracle(ins, lengths, grad):
    """The oracle's float64 output, lse (0 past the lengths, the kernels' convention) and gradients."""
    x64 = [x.detach().cpu().double().requires_grad_() for x in ins]
    out, lse = gcla_oracle(*x64, lengths=None if lengths is None else lengths.cpu(), return_lse=True)
    return out, lse.nan_to_num(0.0), torch.autograd.grad(out, x64, grad.cpu().double())


def check_against_oracle(out, lse, grads, ins, lengths, grad, dtype, ref=None, who=""):
    """Output, lse and every gradient within SPEC §9's attention tolerance of the float64 cuda_oracle
    (``ref``: a precomputed :func:`cuda_oracle`); rows past the lengths exactly 0."""
    ref_out, ref_lse, ref_grads = cuda_oracle(ins, lengths, grad) if ref is None else ref
    tol = tolerance(dtype, "attention")
    floor = 0.25 if dtype == torch.float32 else 1.0
    close_floored(out, ref_out, tol, f"{who}out")
    close_floored(lse, ref_lse, tol, f"{who}lse", floor=1.0)
    for name, g, rg in zip(NAMES, grads, ref_grads):
        assert g.dtype == ins[NAMES.index(name)].dtype, f"{who}grad {name}: dtype {g.dtype}"
        close_floored(g, rg, tol, f"{who}grad {name}", floor)
    if lengths is not None:
        for b, n in enumerate(lengths.tolist()):
            assert (out[b, :, n:] == 0).all() and (lse[b, :, n:] == 0).all(), f"{who}rows past the length are not 0"


def emulated_kernels():
    """torch.ops.wiola_cuda_emu (the CUDA composite and kernels, the kernels run by the SIMT
    emulator) when the extension was built with them, else None."""
    try:
        ops = torch.ops.wiola_cuda_emu
        ops.gcla_attention  # noqa: B018 - resolving the op is the probe
        return ops
    except (AttributeError, RuntimeError):
        return None


needs_emu = pytest.mark.skipif(emulated_kernels() is None, reason="the extension was built without the emulated CUDA kernels")


def check_composite(ins, lengths, grad, dtype):
    """The CUDA composite (emulated, on CPU tensors) against the float64 oracle."""
    out, lse, grads = run_composite(ins, lengths, grad)
    check_against_oracle(out, lse, grads, ins, lengths, grad, dtype)


def _cuda_lengths(T, with_len, device="cpu"):
    if not with_len:
        return None
    lens = [T, 0] if T == 1 else [T - 3 if T > 3 else T, T // 3 + 1]
    return torch.tensor(lens, dtype=torch.int64, device=device)


# (T, S mode, lengths?, Λ', H, H_kv): T ∈ {1, 7, 257}, both summary modes, Λ' ∈ {0, 1, 2},
# H/H_kv ∈ {1, 4} and the pairs where h mod H_kv and h // (H/H_kv) differ.
CUDA_CASES = [
    (1, "paper", False, 2, 4, 4), (1, "causal", True, 1, 4, 1), (1, "paper", True, 2, 4, 2),
    (7, "causal", False, 2, 4, 2), (7, "paper", True, 1, 6, 3), (7, "causal", True, 0, 4, 1),
    (7, "paper", False, 2, 4, 4), (7, "causal", True, 2, 6, 3),
    (257, "causal", True, 2, 4, 2), (257, "paper", True, 2, 4, 1), (257, "paper", False, 0, 6, 3),
    (257, "causal", False, 1, 4, 4),
]


def _cuda_ids(c):
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


def run_composite(ins, lengths, grad):
    """The CUDA kernel's forward and backward (``wiola::gcla_attention(_backward)``): on CUDA
    tensors the real one, on CPU tensors its emulation (``wiola_cuda_emu``)."""
    ops = torch.ops.wiola if ins[0].is_cuda else torch.ops.wiola_cuda_emu
    out, lse = ops.gcla_attention(*ins, lengths)
    grads = ops.gcla_attention_backward(grad.to(ins[0].device, ins[0].dtype), *ins, lengths, out, lse)
    return out, lse, grads


def kv_order(H, H_kv):
    """``perm_kv`` of the summary kernels beside a GQA-native fused kernel."""
    return H_kv if 1 < H_kv < H else 1


def to_self_order(x, P):
    """Natural heads → the fused kernel's order p(h), as a (B, H, T, d) view of (B, T, H, d) memory."""
    B, H, T, d = x.shape
    y = torch.empty(B, T, H, d, dtype=x.dtype, device=x.device).transpose(1, 2)
    y[:, SummaryKernelModel.self_head(H, P).to(x.device)] = x
    return y


# ---------------------------------------------------------------------------------------
# CPU: the composite, emulated
# ---------------------------------------------------------------------------------------
def test_head_permutation_maps_to_paper_groups():
    """p(h) // G = h mod H_kv for every (H, H_kv): the order the summary kernels assume."""
    for H, H_kv in ((4, 1), (4, 4), (4, 2), (6, 3), (16, 4), (8, 2)):
        ps = SummaryKernelModel.self_head(H, kv_order(H, H_kv))
        assert sorted(ps.tolist()) == list(range(H))
        assert ((ps // (H // H_kv)) == torch.arange(H) % H_kv).all(), (H, H_kv)


# The cuda_emu backend through the public op: tests/test_all_ops.py (its shapes). Here the
# composite itself: T ∈ {1, 7, 257} in float32 over GQA ratios 1, 2 and H, with and without
# lengths, both summary modes; d_h 128 and the 16-bit types on subsets.
ORCHESTRATION_CASES = ([(c, 64, torch.float32) for c in CUDA_CASES[::2]] + [(CUDA_CASES[1], 128, torch.float32)]
                       + [(c, 64, dt) for c, dt in zip(CUDA_CASES[3::4], (torch.bfloat16, torch.float16, torch.bfloat16))])
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="CPU check of the composite; a GPU runs the kernels themselves")


@cpu_only
@needs_emu
@pytest.mark.parametrize("case, dh, dtype", ORCHESTRATION_CASES,
                         ids=lambda x: _cuda_ids(x) if isinstance(x, tuple) else str(x).replace("torch.", ""))
def test_emulated_composite_matches_oracle(case, dh, dtype):
    T, mode, with_len, L, H, H_kv = case
    ins = inputs(2, H, H_kv, T, dh, 1 if mode == "paper" else T, L, dtype, seed=T + L + H)
    grad = torch.randn(2, H, T, dh, generator=gen(1), dtype=torch.float64)
    check_composite(ins, _cuda_lengths(T, with_len), grad, dtype)


@cpu_only
@needs_emu
@pytest.mark.parametrize("case", [CUDA_CASES[4], CUDA_CASES[8], CUDA_CASES[10]], ids=_cuda_ids)
def test_emulated_expanded_kv_path_matches_oracle(case, monkeypatch):
    """float32 on CUDA: the memory-efficient kernel has no GQA, so heads stay natural, K/V are
    repeated (head j·H_kv + g reads g), dK/dV summed back over the group, and its lse rows are
    padded to 32 columns (NaN here: never read). WIOLA_EMU_GCLA_SELF=efficient gives the
    emulated composite that structure around the CPU flash kernel."""
    T, mode, with_len, L, H, H_kv = case
    monkeypatch.setenv("WIOLA_EMU_GCLA_SELF", "efficient")
    S = 1 if mode == "paper" else T
    ins = inputs(2, H, H_kv, T, 64, S, L, torch.float32, seed=3)
    lengths = _cuda_lengths(T, with_len)
    grad = torch.randn(2, H, T, 64, generator=gen(4), dtype=torch.float64)
    check_composite(ins, lengths, grad, torch.float32)
    monkeypatch.setenv("WIOLA_EMU_GCLA_SELF", "sideways")
    with pytest.raises(ValueError, match="^WIOLA_EMU_GCLA_SELF must be flash or efficient, got 'sideways'"):
        run_composite(ins, lengths, grad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("self_kernel", ["flash", "efficient"])
def test_padding_garbage_never_read(device, self_kernel, monkeypatch):
    """NaN in q_rot, k_rot, v, q, kc, vc (S = T) and dO past the lengths changes nothing: the
    padding is zeroed before the fused kernel multiplies masked zeros by whole key blocks.
    CPU: the emulated composite (both fused kernels' structures); CUDA: the real one (bf16:
    flash attention; the efficient kernel is float32's, tested by test_cuda_matches_oracle)."""
    if (device == "cuda") != HAS_CUDA:
        pytest.skip("the CPU variant runs without a GPU, the CUDA one with it")
    if device == "cpu" and emulated_kernels() is None:
        pytest.skip("the extension was built without the emulated CUDA kernels")
    if device == "cuda" and self_kernel == "efficient":
        pytest.skip("bf16 on a GPU runs flash")
    monkeypatch.setenv("WIOLA_EMU_GCLA_SELF", self_kernel)
    T, H, H_kv = 70, 4, 2
    ins = inputs(2, H, H_kv, T, 64, T, 2, torch.bfloat16, device=device, seed=5)
    lengths = torch.tensor([70, 33], device=device)
    grad = torch.randn(2, H, T, 64, generator=gen(6), dtype=torch.float64).to(device)
    dirty_ins = [x.clone() for x in ins]
    for x in dirty_ins[:6]:
        x[1, :, 33:] = math.nan
    dirty_grad = grad.clone()
    dirty_grad[1, :, 33:] = math.nan
    with deterministic():  # flash's backward adds dq with atomics unless asked not to
        clean = run_composite(ins, lengths, grad)
        dirty = run_composite(dirty_ins, lengths, dirty_grad)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    for name, a, b in zip(NAMES, clean[2], dirty[2]):
        assert torch.equal(a, b), f"grad {name} depends on the padding"


@cpu_only
@needs_emu
def test_emulated_composite_is_deterministic():
    ins = inputs(2, 6, 3, 130, 64, 1, 2, torch.bfloat16, seed=8)
    lengths = torch.tensor([130, 61])
    grad = torch.randn(2, 6, 130, 64, generator=gen(9), dtype=torch.float64)
    a = run_composite(ins, lengths, grad)
    b = run_composite(ins, lengths, grad)
    for x, y in zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2])):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------
# GPU: the real kernels (scripts/gpu_check.sh)
# ---------------------------------------------------------------------------------------


@pytest.fixture
def cuda_kernels():
    reason = dispatch.BACKENDS["cuda"].unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)


# bf16 over every case; float32 (the efficient kernel, K/V expanded), d_h 128 and fp16 on subsets.
GPU_CASES = ([(c, 64, torch.bfloat16) for c in CUDA_CASES] + [(c, 64, torch.float32) for c in CUDA_CASES[::2]]
             + [(c, 128, dt) for c in CUDA_CASES[1::4] for dt in (torch.bfloat16, torch.float32)]
             + [(c, 64, torch.float16) for c in CUDA_CASES[2::4]])


@pytest.mark.parametrize("case, dh, dtype", GPU_CASES,
                         ids=lambda x: _cuda_ids(x) if isinstance(x, tuple) else str(x).replace("torch.", ""))
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_matches_oracle(case, dh, dtype):
    T, mode, with_len, L, H, H_kv = case
    S = 1 if mode == "paper" else T
    ins = [x.requires_grad_() for x in inputs(2, H, H_kv, T, dh, S, L, dtype, device="cuda", seed=T + L)]
    lengths = _cuda_lengths(T, with_len, "cuda")
    grad = torch.randn(2, H, T, dh, generator=gen(1), dtype=torch.float64)
    with wk.use_backend("cuda"):
        out, lse = GCLAAttentionFunction.apply(*ins, lengths), raw_op("cuda", ins, lengths)[1]
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
    ins = [x.requires_grad_() for x in inputs(B, H, H_kv, T, dh, 1, 0, dtype, device="cuda", seed=11)]
    grad = torch.randn(B, H, T, dh, device="cuda", dtype=dtype)
    with wk.use_backend("cuda"):
        out = wk.gcla_attention(*ins)
        g = torch.autograd.grad(out, ins[:3], grad)
    idx = torch.arange(H, device="cuda") % H_kv
    ref = F.scaled_dot_product_attention(ins[0], ins[1][:, idx], ins[2][:, idx], is_causal=True)
    g_ref = torch.autograd.grad(ref, ins[:3], grad)
    tol = 2 * tolerance(dtype, "attention") if dtype != torch.float32 else tolerance(dtype, "attention")
    close_floored(out, ref, tol, "out")
    for name, a, b in zip(NAMES, g, g_ref):
        close_floored(a, b, tol, f"grad {name}")


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_deterministic():
    """Our kernels are always deterministic; the fused attention backward is under
    torch.use_deterministic_algorithms(True), which PyTorch passes on to it."""
    ins = [x.requires_grad_() for x in inputs(2, 8, 2, 200, 64, 1, 2, torch.bfloat16, device="cuda", seed=2)]
    lengths = torch.tensor([200, 77], device="cuda")
    g = torch.randn(2, 8, 200, 64, device="cuda", dtype=torch.bfloat16)
    with deterministic(), wk.use_backend("cuda"):
        out = wk.gcla_attention(*ins, lengths=lengths)
        g1 = torch.autograd.grad(out, ins, g, retain_graph=True)
        g2 = torch.autograd.grad(out, ins, g)
    for name, a, b in zip(NAMES, g1, g2):
        assert torch.equal(a, b), f"grad {name} not bitwise reproducible"


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_float64_and_odd_head_dim_use_reference():
    ins = [x.requires_grad_() for x in inputs(1, 2, 1, 5, 8, 1, 1, torch.float64, device="cuda")]
    with wk.use_backend("cuda"), pytest.warns(RuntimeWarning, match="'cuda' cannot take dtype float64"):
        dispatch.reset_warnings()
        assert torch.autograd.gradcheck(lambda *a: wk.gcla_attention(*a), ins, fast_mode=True)


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_kernel_rejects_bad_arguments():
    ins = [x.float() for x in inputs(1, 2, 1, 5, 32, 1, 1, torch.float32, device="cuda")]
    o = torch.zeros_like(ins[0])
    lse = torch.zeros(1, 2, 5, device="cuda")
    with pytest.raises(ValueError, match="d_h in"):
        torch.ops.wiola._gcla_summary_fwd(o, lse, ins[3], ins[4], ins[5], ins[6], None, 1)
    ins = [x.float() for x in inputs(1, 4, 2, 5, 64, 1, 1, torch.float32, device="cuda")]
    with pytest.raises(ValueError, match="perm_kv"):
        torch.ops.wiola._gcla_summary_fwd(torch.zeros_like(ins[0]), torch.zeros(1, 4, 5, device="cuda"), ins[3],
                                          ins[4], ins[5], ins[6], None, 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_summary_kernels_match_model(device):
    """The summary kernels (CPU: emulated) against the PyTorch model on the same inputs
    (permuted order, S = 1 and S = T, lengths) — isolates them from the fused attention."""
    if device == "cuda":
        reason = "needs a CUDA device" if not HAS_CUDA else dispatch.BACKENDS["cuda"].unavailable_reason(torch.device("cuda"))
    else:
        reason = None if emulated_kernels() is not None else "the extension was built without the emulated CUDA kernels"
    if reason is not None:
        pytest.skip(reason)
    ops = torch.ops.wiola if device == "cuda" else torch.ops.wiola_cuda_emu
    for S_T, (H, H_kv) in ((False, (6, 3)), (True, (4, 2))):
        B, T, dh, L = 2, 100, 64, 2
        ins = inputs(B, H, H_kv, T, dh, T if S_T else 1, L, torch.bfloat16, device=device, seed=13)
        lengths = torch.tensor([100, 41], device=device)
        P = kv_order(H, H_kv)
        o_self = to_self_order(torch.randn(B, H, T, dh, generator=gen(14)).to(device, torch.bfloat16), P)
        lse_self = torch.randn(B, H, T, generator=gen(15)).to(device)
        q, kc, vc, gate = ins[3], ins[4], ins[5], ins[6]
        got = ops._gcla_summary_fwd(o_self, lse_self, q, kc, vc, gate, lengths, P)
        want = MODEL._gcla_summary_fwd(*[x.cpu() for x in (o_self, lse_self, q, kc, vc, gate, lengths)], P)
        for a, b in zip(got, want):
            close_floored(a, b, tolerance(torch.bfloat16), "summary forward")
        grad = torch.randn(B, H, T, dh, generator=gen(16)).to(device, torch.bfloat16)
        args = (grad, got[0], got[1], ins[0], q, kc, vc, gate, lengths)
        got_b = ops._gcla_summary_bwd(*args, P, T, True)
        want_b = MODEL._gcla_summary_bwd(*[x.cpu() for x in args], P, T, True)
        for i, (a, b) in enumerate(zip(got_b, want_b)):
            assert a.shape == b.shape and a.stride() == b.stride(), f"output {i}: layout"
            close_floored(a, b, tolerance(torch.bfloat16), f"summary backward output {i}")


@cpu_only
@pytest.mark.parametrize("order, case", [
    ("reverse", (1, 4, 2, 70, 64, 1, 2, torch.float32)),       # S = 1: two chunks of 64 rows
    ("shuffle:3", (1, 6, 3, 33, 128, 33, 1, torch.bfloat16)),  # S = T, d_h 128
])
def test_cuda_emu_under_other_thread_orders(order, case, monkeypatch):
    """The emulated kernels with the threads of a block run in reverse, or in a seeded shuffle
    at every barrier (the session runs another shuffle, tests/conftest.py): a kernel whose
    result depends on the order has a race."""
    if dispatch.BACKENDS["cuda_emu"].unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("the extension was built without the emulated CUDA kernels")
    monkeypatch.setenv("WIOLA_EMU_SCHEDULE", order)
    B, H, H_kv, T, dh, S, L, dtype = case
    ins = [x.requires_grad_() for x in inputs(B, H, H_kv, T, dh, S, L, dtype, seed=31)]
    lengths = torch.tensor([T - 5])
    grad = torch.randn(B, H, T, dh, generator=gen(32), dtype=torch.float64)
    with wk.use_backend("cuda_emu"):
        out, lse = raw_op("cuda_emu", ins, lengths)
        grads = torch.autograd.grad(GCLAAttentionFunction.apply(*ins, lengths), ins, grad.to(dtype))
    check_against_oracle(out, lse, grads, ins, lengths, grad, dtype)


def _misaligned_view(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x that starts one element past a 16-byte boundary."""
    buf = torch.empty(x.numel() + 16, dtype=x.dtype)
    k = next(k for k in range(1, 17) if (buf.data_ptr() + k * x.element_size()) % 16 != 0)
    out = buf[k:k + x.numel()].view(x.shape)
    return out.copy_(x)


@cpu_only
def test_cuda_binding_refuses_misaligned_inputs():
    """The summary kernels read q, kc, vc, O, dO and q_rot with d_h/32-element vectors: a
    contiguous view at an element offset is a misaligned address on the device (the CUDA
    context dies). The binding names it in a ValueError (through cuda_emu, whose vector
    accesses fault when misaligned, as the device's do)."""
    ops = emulated_kernels()
    if ops is None:
        pytest.skip("the extension was built without the emulated CUDA kernels")
    g = gen(33)
    q, kc = torch.randn(1, 2, 4, 64, generator=g), torch.randn(1, 2, 1, 2, 64, generator=g)
    gate, o_self, lse_self = torch.zeros(2), torch.zeros(1, 2, 4, 64), torch.zeros(1, 2, 4)
    fwd = dict(o_self=o_self, lse_self=lse_self, q=q, kc=kc, vc=kc, gate=gate, lengths=None, perm_kv=1)
    out, lse = ops._gcla_summary_fwd(*fwd.values())
    for name in ("q", "kc", "vc"):
        args = dict(fwd, **{name: _misaligned_view(fwd[name])})
        with pytest.raises(ValueError, match=rf"^{name} must start at an address aligned to 8 bytes"):
            ops._gcla_summary_fwd(*args.values())
    bwd = dict(grad_out=torch.randn(q.shape, generator=g), out=out, lse=lse, q_rot=q, q=q, kc=kc, vc=kc, gate=gate,
               lengths=None, perm_kv=1, lse_columns=4, write_q_self=True)
    ops._gcla_summary_bwd(*bwd.values())
    for name in ("grad_out", "out", "q_rot", "q", "kc"):
        args = dict(bwd, **{name: _misaligned_view(bwd[name])})
        with pytest.raises(ValueError, match=rf"^{name} must start at an address aligned to 8 bytes"):
            ops._gcla_summary_bwd(*args.values())


@cpu_only
def test_cuda_emu_misaligned_views_through_the_public_op():
    """Misaligned contiguous views reach the kernels as aligned copies (the orchestration's
    safe path): same results as aligned inputs."""
    if dispatch.BACKENDS["cuda_emu"].unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("the extension was built without the emulated CUDA kernels")
    ins = inputs(1, 2, 1, 9, 64, 1, 2, torch.bfloat16, seed=34)
    views = [_misaligned_view(x).requires_grad_() for x in ins]
    grad = torch.randn(1, 2, 9, 64, generator=gen(35), dtype=torch.float64)
    with wk.use_backend("cuda_emu"):
        out, lse = raw_op("cuda_emu", views, None)
        grads = torch.autograd.grad(GCLAAttentionFunction.apply(*views, None), views, grad.to(torch.bfloat16))
    check_against_oracle(out, lse, grads, ins, None, grad, torch.bfloat16)


# --- this op in the shared suites: its OpCase (tests/op_cases.py collects CASE for
# tests/test_all_ops.py and tests/test_op_layer.py) -------------------------------------------

def _gcla_make(shape, dtype, seed):
    """(B, H, H_kv, T, d_h, S, Λ', lengths or None): S = 1 (one summary per sequence) or T."""
    b, h, h_kv, t, dh, s, lam, lens = shape
    g = gen(seed)
    sizes = ((b, h, t, dh), (b, h_kv, t, dh), (b, h_kv, t, dh), (b, h, t, dh), (b, h, s, lam, dh), (b, h, s, lam, dh),
             (h,))
    args = {n: randn64(*size, g=g).to(dtype) for n, size in zip(NAMES, sizes)}
    return dict(args, lengths=None if lens is None else torch.tensor(lens))


def _gcla_views(shape, dtype, seed, broadcast_grad=False):
    """The model's views (S = T): q_rot, q, k_rot, v transposed from (B, T, heads, d_h), kc, vc
    permuted from the context projection's (B, T, Λ', H, d_h), a float32 gate (a parameter;
    float64 beside float64), the output gradient transposed alike (``broadcast_grad``: stride 0
    over the batch, the gradient of a sum). S = 1's layouts: tests/test_gcla_attention.py."""
    b, h, h_kv, t, dh, s, lam, lens = shape
    g = gen(seed)
    args = dict(_gcla_make(shape, dtype, seed), gate=randn64(h, g=g).to(F64 if dtype == F64 else torch.float32))
    for n, n_h in (("q_rot", h), ("k_rot", h_kv), ("v", h_kv), ("q", h)):
        args[n] = randn64(b, t, n_h, dh, g=g).to(dtype).transpose(1, 2)
    for n in ("kc", "vc"):
        args[n] = randn64(b, s, lam, h, dh, g=g).to(dtype).permute(0, 3, 1, 2, 4)
    grad = randn64(1 if broadcast_grad else b, t, h, dh, g=g).to(dtype).transpose(1, 2).expand(b, h, t, dh)
    return args, [grad]


def _gcla_oracle(a):
    return (gcla_oracle(*(a[n] for n in NAMES), lengths=a["lengths"]),)


def _gcla_calls(a, ops):
    ins = [a[n] for n in ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate")]
    out, lse = ops.gcla_attention(*ins, a["lengths"])
    return [(ops.gcla_attention.default, (*ins, a["lengths"])),
            (ops.gcla_attention_backward.default, (torch.randn_like(out), *ins, a["lengths"], out, lse))]


def _gcla_bad(a):
    return [
        (dict(v=a["v"][:, :1]), ValueError, r"^v must have shape \(B, H_kv, T, d_h\) = \(2, 2, 5, 64\), got \(2, 1, 5, 64\)"),
        (dict(kc=a["kc"][:, :, :2]), ValueError, r"^kc must have shape \(B, H, S, Λ', d_h\) = \(2, 4, S, Λ', 64\) with S in \{1, T = 5\}, got \(2, 4, 2, 2, 64\)"),
        (dict(vc=a["vc"][..., :1, :]), ValueError, r"^vc must have the shape of kc"),
        (dict(gate=a["gate"][:3]), ValueError, r"^gate must have shape \(H,\) = \(4,\), got \(3,\)"),
        (dict(q=a["q"].double()), TypeError, r"^q must have dtype torch.float32 like q_rot, got torch.float64"),
        (dict(kc=a["kc"][0]), ValueError, r"^kc must have shape \(B, H, S, Λ', d_h\) \(5-D\), got \(4, 5, 2, 64\)"),
    ]


CASE = OpCase(
    _gcla_make, lambda a: (wk.gcla_attention(**a),),
    # (B, H, H_kv, T, d_h, S, Λ', lengths): odd B, rows of length 0 and 1, Λ' ∈ {0, 1, 2}, GQA
    # pairs where h mod H_kv and h // (H/H_kv) differ ((6, 3), (4, 2)), d_h not a power of two
    # (T = 1, where dq̃ = dk̃ = 0 exactly: tests/test_gcla_attention.py).
    # The C++ kernel's blocks are 64 query × 128 key rows (T = 257: five and three, lengths off
    # their edges); the interpreter's are 32 × 16 (dk/dv: 16 × 32); cuda_emu takes d_h 64, 128.
    dict(default=[(3, 4, 1, 2, 16, 1, 1, (2, 0, 1)), (3, 6, 3, 7, 24, 7, 2, (7, 3, 0)),
                  (2, 4, 2, 7, 10, 1, 0, None), (2, 4, 2, 40, 64, 1, 2, (37, 40)), (2, 4, 4, 64, 16, 64, 1, (64, 23)),
                  (2, 4, 1, 257, 8, 257, 2, (250, 100)), (1, 6, 3, 257, 8, 1, 2, None)],
         triton=[(3, 6, 3, 20, 16, 1, 2, (20, 9, 0)), (2, 4, 2, 7, 64, 7, 0, None), (2, 6, 3, 33, 16, 1, 2, (33, 20)),
                 (2, 4, 1, 40, 8, 40, 1, (17, 40)), (1, 2, 2, 20, 24, 20, 2, None)],
         cuda_emu=[(2, 4, 1, 2, 64, 1, 1, (2, 0)), (2, 6, 3, 7, 128, 1, 2, (7, 4)), (2, 4, 2, 257, 64, 257, 2, (254, 86)),
                   (1, 6, 3, 257, 64, 1, 0, None)],
         gradcheck=[(2, 2, 1, 5, 4, 1, 2, (5, 2))], threads=[(2, 4, 2, 200, 24, 1, 3, (200, 77))],
         views=[(2, 6, 3, 21, 64, 21, 2, (21, 0)), (2, 4, 2, 9, 64, 9, 2, None)],
         dynamic=[(2, 2, 1, 3, 4, 3, 2, (3, 1)), (2, 2, 1, 5, 4, 5, 2, (5, 2))],
         concurrent=[(1, 4, 2, 40, 16, 40, 2, None)], gpu=[(2, 4, 2, 19, 64, 19, 2, (19, 14))], layer=[(2, 4, 2, 5, 64, 5, 2, (5, 2))]),
    (Public("gcla_attention", wk.GCLAAttentionFunction, _gcla_calls, _gcla_bad),),
    view_variants=(dict(), dict(broadcast_grad=True)),
    oracle=_gcla_oracle, views=_gcla_views, in_place=("cpu", "triton"), kind="attention")
