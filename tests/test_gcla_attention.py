"""GCLA summary-augmented attention (SPEC §5.5): every CPU-runnable backend against the
float64 reference and an independent naive float64 implementation."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wiola_kernels
import wiola_kernels as wk
from wiola_kernels import dispatch, shapes
from wiola_kernels.ops import gcla_attention_cuda as gc
from wiola_kernels import dispatch as _dispatch
from wiola_kernels.ops.gcla_attention import GCLAAttentionFunction


def gcla_attention_op(*args):
    """``(out, lse)`` of the backend a forward would run now (the forced one, else the dispatcher's)."""
    backend = _dispatch.forced_backend()
    if backend is None:
        return torch.ops.wiola.gcla_attention(*args)
    q_rot = args[0]
    backend = _dispatch.resolve("gcla_attention", backend, q_rot.device, q_rot.dtype, q_rot.shape[-1])
    return _dispatch.kernels("gcla_attention", backend).forward(*args)


def gcla_attention_grad_op(*args):
    """The backward of the backend a backward would run now (see :func:`gcla_attention_op`)."""
    backend = _dispatch.forced_backend()
    if backend is None:
        return torch.ops.wiola.gcla_attention_backward(*args)
    q_rot = args[1]
    backend = _dispatch.resolve("gcla_attention", backend, q_rot.device, q_rot.dtype, q_rot.shape[-1])
    return _dispatch.kernels("gcla_attention", backend).backward(*args)

from wiola_kernels.reference.gcla_attention import (gcla_attention_backward, gcla_attention_forward,
                                                    gcla_context_kv, gcla_summary)
from wiola_kernels.testing import assert_close_rel, available_backends, rel_err, tolerance

from helpers import (assert_bitwise, close_floored, finite, gen, lengths_of_kind, needs_cpu_extension,
                     run_on_thread_counts, view_as)
from oracles import gcla_oracle, raises_naming, rel

BACKENDS = [b for b in available_backends("gcla_attention", "cpu") if b in ("cpu", "reference")]
# The Triton kernels run on CPU tensors in the interpreter (TRITON_INTERPRET=1, set by conftest):
# slow, so they join only the cheaper shared tests and have their own small cases below.
TRITON = "triton" in available_backends("gcla_attention", "cpu")
BACKENDS_ALL = BACKENDS + (["triton"] if TRITON else [])
NAMES = ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate")


def make_inputs(B, H, H_kv, T, dh, S, L, dtype=torch.float32, lengths=None, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    ins = [r(B, H, T, dh), r(B, H_kv, T, dh), r(B, H_kv, T, dh), r(B, H, T, dh), r(B, H, S, L, dh),
           r(B, H, S, L, dh), r(H)]
    lens = None if lengths is None else torch.tensor(lengths, dtype=torch.int64)
    return ins, lens


def naive(q_rot, k_rot, v, q, kc, vc, gate, lengths=None):
    """Position by position, in float64: softmax over keys u ≤ t (u < len), plus the slots."""
    q_rot, k_rot, v, q, kc, vc, gate = (t.detach().double() for t in (q_rot, k_rot, v, q, kc, vc, gate))
    B, H, T, dh = q_rot.shape
    H_kv = k_rot.shape[1]
    groups = [h % H_kv for h in range(H)]
    k_h, v_h = k_rot[:, groups], v[:, groups]
    lens = [T] * B if lengths is None else [int(x) for x in lengths]
    out = torch.zeros(B, H, T, dh, dtype=torch.float64)
    for b in range(B):
        for t in range(lens[b]):
            w = torch.einsum("hd,hud->hu", q_rot[b, :, t], k_h[b, :, : t + 1]) / math.sqrt(dh)
            o = torch.einsum("hu,hud->hd", torch.softmax(w, -1), v_h[b, :, : t + 1])
            if kc.shape[3] > 0:
                s = 0 if kc.shape[2] == 1 else t
                z = torch.einsum("hd,hld->hl", q[b, :, t], kc[b, :, s]) / math.sqrt(dh)
                o = o + torch.sigmoid(gate)[:, None] * torch.einsum("hl,hld->hd", torch.softmax(z, -1), vc[b, :, s])
            out[b, :, t] = o
    return out


def run(backend, ins, lengths):
    with wiola_kernels.use_backend(backend):
        return wiola_kernels.gcla_attention(*ins, lengths=lengths)


def run_grad(backend, ins, lengths, grad):
    """Forward and backward, both on ``backend`` (the backward runs inside the override too)."""
    with wiola_kernels.use_backend(backend):
        out = wiola_kernels.gcla_attention(*ins, lengths=lengths)
        return out, torch.autograd.grad(out, ins, grad(out) if callable(grad) else grad)


def close(out, ref, tol, what, floor=0.25):
    """Relative error, with the reference norm floored at ``floor`` per element (inputs are
    unit-scale): some gradients are exactly zero in exact arithmetic (T = 1: dq̃, dk̃), where
    kernels see the rounding noise of the FlashAttention identity D = dO·O (O rounded to
    the input dtype)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.detach().double(), ref.detach().double()
    assert torch.isfinite(o).all(), f"{what}: non-finite values"
    den = max(float(r.norm()), floor * math.sqrt(max(r.numel(), 1)))
    err = float((o - r).norm()) / den
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# (T, mode, lengths-or-None, Λ', H, H_kv); lengths chosen off any block boundary. (4, 2) and
# (6, 3) are the GQA shapes where the group h mod H_kv (SPEC §5.2) and h // (H/H_kv) differ;
# they come after the others, so the slices of CASES below keep their earlier members.
def _cases():
    cases = []
    for heads in (((0, (4, 4)), (1, (4, 1)), (2, (4, 4)), (2, (4, 1))), ((2, (4, 2)), (1, (6, 3)))):
        for T in (1, 7, 64, 257):
            for mode in ("paper", "causal"):
                for with_len in (False, True):
                    for L, (H, H_kv) in heads:
                        lens = None
                        if with_len:
                            lens = [T, 0] if T == 1 else [T - 3 if T > 3 else T, max(1, T // 3 + 1)]
                        cases.append((T, mode, lens, L, H, H_kv))
    return cases


CASES = _cases()


def _ids(c):
    T, mode, lens, L, H, H_kv = c
    return f"T{T}-{mode}-{'len' if lens else 'full'}-L{L}-H{H}kv{H_kv}"


NAIVE_CASES = [c for c in CASES[::3] if c[0] < 257] + [(257, "causal", [250, 100], 2, 4, 1)]


@pytest.mark.parametrize("case", NAIVE_CASES, ids=_ids)
def test_reference_matches_naive(case):
    T, mode, lens, L, H, H_kv = case
    S = 1 if mode == "paper" else T
    ins, lt = make_inputs(2, H, H_kv, T, 8, S, L, torch.float64, lens)
    ref = gcla_attention_forward(*ins, lt)[0]
    close(ref, naive(*ins, lt), tolerance(torch.float64), "reference vs naive")


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_forward_and_grads(backend, case):
    T, mode, lens, L, H, H_kv = case
    if backend == "reference" and CASES.index(case) % 2:
        pytest.skip("the reference backend runs every other case (it is the oracle's code)")
    S = 1 if mode == "paper" else T
    dh = 16 if T < 257 else 8
    ins, lt = make_inputs(2, H, H_kv, T, dh, S, L, torch.float32, lens, requires_grad=True)
    grad = torch.randn(2, H, T, dh)
    out, grads = run_grad(backend, ins, lt, grad)
    assert out.dtype == torch.float32 and out.shape == (2, H, T, dh)
    ins64 = [x.detach().double().requires_grad_() for x in ins]
    ref = gcla_attention_forward(*ins64, lt)[0]
    tol = tolerance(torch.float32, "attention")
    close(out, ref, tol, "out")
    ref_grads = torch.autograd.grad(ref, ins64, grad.double())
    for name, g, rg in zip(NAMES, grads, ref_grads):
        assert g.dtype == torch.float32
        close(g, rg, tol, f"grad {name}")
    if lt is not None:
        for b, n in enumerate(lens):
            assert (out[b, :, n:] == 0).all(), "outputs past the length must be exactly zero"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES[1::4], ids=_ids)
def test_bf16_forward_and_grads(backend, case):
    T, mode, lens, L, H, H_kv = case
    S = 1 if mode == "paper" else T
    ins, lt = make_inputs(2, H, H_kv, T, 16, S, L, torch.bfloat16, lens, requires_grad=True)
    ins[-1] = ins[-1].detach().float().requires_grad_()  # gate: a float32 parameter beside bf16 activations
    grad = torch.randn(2, H, T, 16, dtype=torch.float64)
    out, grads = run_grad(backend, ins, lt, grad.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    ins64 = [x.detach().double().requires_grad_() for x in ins]
    ref = gcla_attention_forward(*ins64, lt)[0]
    tol = tolerance(torch.bfloat16, "attention")
    close(out, ref, tol, "out")
    ref_grads = torch.autograd.grad(ref, ins64, grad)
    for name, g, x, rg in zip(NAMES, grads, ins, ref_grads):
        assert g.dtype == x.dtype
        # floor 1: at T = 1, dq̃ and dk̃ are exactly 0 and bf16 O leaves ~1e-2 noise in D
        close(g, rg, tol, f"grad {name}", floor=1.0)


@pytest.mark.parametrize("backend", BACKENDS)  # triton: d_h 64 is in TRITON_CASES
@pytest.mark.parametrize("mode", ["paper", "causal"])
def test_head_dim_64(backend, mode):
    T = 40
    ins, lt = make_inputs(1, 4, 2, T, 64, 1 if mode == "paper" else T, 2, torch.float32, [37], requires_grad=True)
    out, grads = run_grad(backend, ins, lt, torch.ones(1, 4, T, 64))
    close(out, naive(*ins, lt), tolerance(torch.float32, "attention"), "out")
    ins64 = [x.detach().double().requires_grad_() for x in ins]
    ref = gcla_attention_forward(*ins64, lt)[0]
    ref_grads = torch.autograd.grad(ref.sum(), ins64)
    for name, g, rg in zip(NAMES, grads, ref_grads):
        close(g, rg, tolerance(torch.float32, "attention"), f"grad {name}")


GRADCHECK_CASES = [(5, "paper", None, 2, 1), (6, "causal", [6, 3], 2, 2), (3, "causal", [0, 2], 1, 1),
                   (4, "paper", [4, 1], 0, 2)]


# The interpreter is slow: triton takes two of the four cases (both modes, lengths, Λ' 2).
@pytest.mark.parametrize("backend, T, mode, lens, L, H_kv",
                         [(b, *c) for b in BACKENDS for c in GRADCHECK_CASES]
                         + [("triton", *c) for c in GRADCHECK_CASES[:2] if TRITON])
def test_gradcheck_float64(backend, T, mode, lens, L, H_kv):
    S = 1 if mode == "paper" else T
    ins, lt = make_inputs(2, 2, H_kv, T, 4, S, L, torch.float64, lens, requires_grad=True)
    with wiola_kernels.use_backend(backend):
        assert torch.autograd.gradcheck(lambda *a: wiola_kernels.gcla_attention(*a, lengths=lt), ins,
                                        fast_mode=True)


@pytest.mark.parametrize("mode", ["paper", "causal"])
@pytest.mark.parametrize("lens", [None, [9, 4]])
def test_reference_backward_matches_autograd(mode, lens):
    T = 9
    ins, lt = make_inputs(2, 4, 2, T, 8, 1 if mode == "paper" else T, 2, torch.float64, lens, requires_grad=True)
    out, lse = gcla_attention_forward(*ins, lt)
    grad = torch.randn_like(out)
    auto = torch.autograd.grad(out, ins, grad)
    explicit = gcla_attention_backward(grad, *[x.detach() for x in ins], lt, out.detach(), lse.detach())
    for name, a, e in zip(NAMES, auto, explicit):
        assert e.shape == a.shape and e.dtype == a.dtype, name
        assert_close_rel(e, a, tolerance(torch.float64, "attention"), name)


@pytest.mark.parametrize("backend", BACKENDS_ALL)
def test_lse_matches_reference(backend):
    ins, lt = make_inputs(2, 4, 1, 37, 8, 37, 2, torch.float32, [37, 20])
    with wiola_kernels.use_backend(backend):
        _, lse = gcla_attention_op(*ins, lt)
    _, ref = gcla_attention_forward(*[x.double() for x in ins], lt)
    assert lse.dtype == torch.float32
    assert rel_err(lse, ref) <= tolerance(torch.float32)
    assert (lse[1, :, 20:] == 0).all()


@pytest.mark.parametrize("backend, mode", [(b, m) for b in BACKENDS for m in ("paper", "causal")]
                         + ([("triton", "causal")] if TRITON else []))
def test_causality(backend, mode):
    """Perturbing k/v (and causal summaries) at positions > t never changes outputs ≤ t."""
    T = 70
    S = 1 if mode == "paper" else T
    ins, _ = make_inputs(1, 4, 2, T, 8, S, 2, torch.float64)
    base = run(backend, ins, None)
    for t in (0, 1, 31, 32, 63, 64, 68):
        pert = [x.clone() for x in ins]
        pert[1][:, :, t + 1:] += 3.0  # k_rot
        pert[2][:, :, t + 1:] -= 2.0  # v
        if S == T:
            pert[4][:, :, t + 1:] += 1.0
            pert[5][:, :, t + 1:] += 1.0
        out = run(backend, pert, None)
        assert torch.equal(out[:, :, : t + 1], base[:, :, : t + 1]), f"position <= {t} saw the future"
        assert not torch.equal(out[:, :, t + 1:], base[:, :, t + 1:])
    # and the diagonal itself is attended: changing key t changes output t
    pert = [x.clone() for x in ins]
    pert[2][:, :, 5] += 1.0
    assert not torch.equal(run(backend, pert, None)[:, :, 5], base[:, :, 5])


@pytest.mark.parametrize("backend", BACKENDS_ALL)
def test_lengths_padding(backend):
    """Outputs at t ≥ len_b are exactly zero, keys there do not matter, gradients there are zero."""
    T, lens = 50, [50, 17]
    ins, lt = make_inputs(2, 4, 2, T, 8, T, 2, torch.float32, lens, requires_grad=True)
    out, grads = run_grad(backend, ins, lt, torch.randn_like)
    assert (out[1, :, 17:] == 0).all()
    pert = [x.detach().clone() for x in ins]
    junk = float("nan") if backend != "reference" else 1e3  # the oracle multiplies masked keys by 0
    for i in range(6):
        pert[i][1, :, 17:] = junk if i in (1, 2) else 1e3  # padding content is never read
    out2 = run(backend, pert, lt)
    if backend == "reference":
        assert rel_err(out2, out.detach()) <= tolerance(torch.float32)
    else:
        assert torch.equal(out2, out.detach())
    for name, g in zip(NAMES[:6], grads[:6]):
        assert (g[1, :, 17:] == 0).all(), f"grad {name} past the length"
    # a row of length T equals the unpadded op
    full = run(backend, [x.detach() for x in ins], None)
    assert torch.equal(full[0], out.detach()[0]) or rel_err(full[0], out[0]) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS_ALL)
def test_gate(backend):
    """σ(g) blends the cross part: g → −∞ is plain attention; the gate gradient is Σ σ'(g) dO·O^cross."""
    ins, _ = make_inputs(2, 4, 1, 20, 8, 1, 2, torch.float64, requires_grad=True)
    plain = run(backend, [*ins[:4], ins[4][:, :, :, :0], ins[5][:, :, :, :0], ins[6]], None)
    off = run(backend, [*ins[:6], torch.full((4,), -1e4, dtype=torch.float64)], None)
    assert rel_err(off, plain) <= tolerance(torch.float64)
    with wiola_kernels.use_backend(backend):
        out = wiola_kernels.gcla_attention(*ins)
        (dg,) = torch.autograd.grad(out.sum(), [ins[6]])
    sig = torch.sigmoid(ins[6].detach())
    o_cross = (out.detach() - plain.detach()) / sig[None, :, None, None]
    assert rel_err(dg, sig * (1 - sig) * o_cross.sum((0, 2, 3))) <= tolerance(torch.float64, "attention")


@pytest.mark.parametrize("backend", BACKENDS_ALL)
def test_noncontiguous_and_deterministic(backend):
    ins, lt = make_inputs(2, 4, 2, 40, 8, 1, 2, torch.float32, [40, 29])
    nc = [x.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_() for x in ins[:6]]
    nc.append(ins[6].clone().requires_grad_())
    assert not nc[0].is_contiguous()
    g = torch.randn(2, 4, 40, 8)
    out, g1 = run_grad(backend, nc, lt, g)
    close(out, gcla_attention_forward(*[x.detach().double() for x in ins], lt)[0], tolerance(torch.float32, "attention"), "out")
    _, g2 = run_grad(backend, nc, lt, g)
    for name, a, b in zip(NAMES, g1, g2):
        assert torch.equal(a, b), f"grad {name} not bitwise reproducible"


def test_opcheck():
    for lens in (None, torch.tensor([7, 3])):
        ins, _ = make_inputs(2, 4, 2, 7, 4, 7, 2, torch.float32)  # autograd is GCLAAttentionFunction's
        torch.library.opcheck(torch.ops.wiola.gcla_attention.default, (*[x.detach() for x in ins], lens))  # no grad: the Function's
        out, lse = gcla_attention_op(*[x.detach() for x in ins], lens)
        torch.library.opcheck(torch.ops.wiola.gcla_attention_backward.default,
                              (torch.randn_like(out), *[x.detach() for x in ins], lens, out, lse))


@pytest.mark.parametrize("compile_backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph(compile_backend):
    """Dynamo traces the op without graph breaks, AOT autograd runs its fake + backward
    (aot_eager; the inductor variant adds ~1 min of C++ codegen on 2 cores)."""
    ins, lt = make_inputs(2, 4, 2, 9, 8, 1, 2, torch.float32, [9, 5], requires_grad=True)

    def f(*args):
        return wiola_kernels.gcla_attention(*args, lengths=lt).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend=compile_backend)
    loss = compiled(*ins)
    grads = torch.autograd.grad(loss, ins)
    ref_loss = f(*ins)
    ref_grads = torch.autograd.grad(ref_loss, ins)
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_summaries_and_context():
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    paper = gcla_summary(x, "paper")
    causal = gcla_summary(x, "causal")
    assert paper.shape == (2, 1, 8) and causal.shape == (2, 6, 8)
    torch.testing.assert_close(causal[:, -1:], paper)
    torch.testing.assert_close(causal[:, 2], x[:, :3].mean(1))
    torch.testing.assert_close(gcla_summary(x, "paper", torch.tensor([6, 2]))[1, 0], x[1, :2].mean(0))
    summ = torch.stack([causal, 2 * causal], dim=2)  # (B, S, Λ', d)
    w_kc, w_vc = torch.randn(8, 4 * 2, dtype=torch.float64), torch.randn(8, 4 * 2, dtype=torch.float64)
    kc, vc = gcla_context_kv(summ, w_kc, w_vc, num_heads=4)
    assert kc.shape == vc.shape == (2, 4, 6, 2, 2)
    torch.testing.assert_close(kc[1, 3, 4, 1], (2 * causal[1, 4] @ w_kc)[6:8])
    assert gcla_context_kv(summ[:, :, :0], w_kc, w_vc, 4)[0].shape == (2, 4, 6, 0, 2)
    with pytest.raises(ValueError, match="mode"):
        gcla_summary(x, "bogus")


def _good():
    ins, _ = make_inputs(2, 4, 2, 5, 8, 5, 2)
    return ins


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: a.__setitem__(1, torch.randn(2, 3, 5, 8)), ValueError, "multiple of"),
    (lambda a: a.__setitem__(1, torch.randn(2, 2, 4, 8)), ValueError, "k_rot"),
    (lambda a: a.__setitem__(2, torch.randn(2, 2, 5, 6)), ValueError, "v must have shape"),
    (lambda a: a.__setitem__(3, torch.randn(2, 4, 5, 6)), ValueError, "q must have shape"),
    (lambda a: [a.__setitem__(i, torch.randn(*a[i].shape[:3], 7)) for i in (0, 1, 2, 3)], ValueError, "even"),
    (lambda a: a.__setitem__(4, torch.randn(2, 4, 3, 2, 8)), ValueError, "S in"),
    (lambda a: a.__setitem__(5, torch.randn(2, 4, 5, 1, 8)), ValueError, "vc must have the shape of kc"),
    (lambda a: a.__setitem__(4, torch.randn(2, 4, 5, 8)), ValueError, "kc must have shape"),
    (lambda a: a.__setitem__(6, torch.randn(3)), ValueError, "gate"),
    (lambda a: a.__setitem__(0, torch.randn(2, 4, 5)), ValueError, "q_rot"),
    (lambda a: a.__setitem__(2, a[2].double()), TypeError, "v must have dtype"),
    (lambda a: a.__setitem__(0, a[0].int()), TypeError, "q_rot must have dtype"),
    (lambda a: a.__setitem__(6, [0.0] * 4), TypeError, "gate must be a torch.Tensor"),
])
def test_bad_inputs(mutate, exc, match):
    args = _good()
    mutate(args)
    with pytest.raises(exc, match=match):
        wiola_kernels.gcla_attention(*args)


@pytest.mark.parametrize("lengths, exc, match", [
    (torch.tensor([5, 6]), ValueError, r"\[0, T\]"),
    (torch.tensor([-1, 2]), ValueError, r"\[0, T\]"),
    (torch.tensor([5.0, 2.0]), TypeError, "lengths must have dtype"),
    (torch.tensor([5, 2, 1]), ValueError, r"lengths must have shape \(B,\)"),
])
def test_bad_lengths(lengths, exc, match):
    with pytest.raises(exc, match=match):
        wiola_kernels.gcla_attention(*_good(), lengths=lengths)


def test_int32_lengths_and_plain_attention():
    ins, _ = make_inputs(1, 4, 4, 12, 8, 1, 0, torch.float64)
    out = wiola_kernels.gcla_attention(*ins, lengths=torch.tensor([9], dtype=torch.int32))
    q_rot, k_rot, v = ins[:3]
    ref = torch.nn.functional.scaled_dot_product_attention(q_rot[:, :, :9], k_rot[:, :, :9], v[:, :, :9],
                                                           is_causal=True)
    torch.testing.assert_close(out[:, :, :9], ref)
    assert (out[:, :, 9:] == 0).all()



# ---- (B, T, H, d_h) passed instead of (B, H, T, d_h) (issue 15) --------------------------------

@pytest.mark.parametrize("h_kv, s", [(2, 6), (4, 6), (4, 1)])
def test_transposed_inputs_get_a_transpose_hint(h_kv, s):
    gen = torch.Generator().manual_seed(0)
    b, t, h, dh = 2, 6, 4, 8
    q = torch.randn(b, t, h, dh, generator=gen)               # (B, T, H, d_h): the mistake
    k, v = (torch.randn(b, t, h_kv, dh, generator=gen) for _ in range(2))
    kc = torch.randn(b, h, s, 2, dh, generator=gen)           # context in the right layout, S ∈ {1, T}
    gate = torch.zeros(h)
    # H_kv < H: k_rot gives it away; H_kv = H: q/k/v agree in either layout, kc does.
    with pytest.raises(ValueError, match=r"^(k_rot|kc) must have shape.*pass \.transpose\(1, 2\)"):
        wiola_kernels.gcla_attention(q, k, v, q, kc, kc, gate)
    empty = torch.zeros(b, t, 1, 0, dh)  # Λ' = 0 read with the (wrong) H = T heads: only the gate is left
    if h_kv == h:
        with pytest.raises(ValueError, match=r"^gate must have shape \(H,\) = \(6,\).*pass \.transpose\(1, 2\)"):
            wiola_kernels.gcla_attention(q, k, v, q, empty, empty, gate)


def test_gcla_docstring_states_the_layout_first():
    head = wiola_kernels.gcla_attention.__doc__.split("\n\n")[1]
    assert "(B, heads, T, d_h)" in head and ".transpose(1, 2)" in head and "H = H_kv = T" in head


# ---- the Triton kernels (interpreter on CPU; checks on a GPU below) ----

needs_triton = pytest.mark.skipif(not TRITON, reason="the triton backend needs TRITON_INTERPRET=1 on CPU tensors")

# (T, mode, lengths, Λ', H, H_kv, d_h): odd T, both summary modes, Λ' ∈ {0, 1, 2}, lengths off
# block edges, GQA pairs where h mod H_kv and h // (H/H_kv) differ ((4, 2), (6, 3)), padded
# head widths (8 → 16 columns, 24 → 32). The interpreter's blocks are 32 × 16 (dk/dv: 16 × 32),
# so T = 33, 40 span several query and key blocks and several diagonal sub-blocks.
TRITON_CASES = [
    (1, "paper", None, 0, 4, 2, 16),
    (1, "causal", [1, 0], 2, 6, 3, 16),
    (7, "paper", [7, 3], 1, 4, 2, 16),
    (7, "causal", None, 2, 6, 3, 64),
    (33, "paper", None, 2, 6, 3, 16),
    (33, "causal", [33, 20], 2, 4, 2, 16),
    (33, "causal", [17, 33], 0, 4, 1, 64),
    (40, "paper", [40, 9], 2, 4, 4, 8),
    (20, "causal", None, 1, 2, 2, 24),
]


def _triton_ids(c):
    T, mode, lens, L, H, H_kv, dh = c
    return f"T{T}-{mode}-{'len' if lens else 'full'}-L{L}-H{H}kv{H_kv}-d{dh}"


def _check_against_oracle(dtype, case, tol, floor=0.25, seed=0):
    """Forward and backward on the triton backend vs autograd through the float64 oracle."""
    T, mode, lens, L, H, H_kv, dh = case
    B = 2 if lens is None else len(lens)
    S = 1 if mode == "paper" else T
    ins, lt = make_inputs(B, H, H_kv, T, dh, S, L, dtype, lens, requires_grad=True, seed=seed)
    grad = torch.randn(B, H, T, dh, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    out, grads = run_grad("triton", ins, lt, grad.to(dtype))
    assert out.dtype == dtype and out.shape == (B, H, T, dh)
    ins64 = [x.detach().double().requires_grad_() for x in ins]
    ref, ref_lse = gcla_attention_forward(*ins64, lt)
    close(out, ref, tol, "out", floor)
    for name, g, x, rg in zip(NAMES, grads, ins, torch.autograd.grad(ref, ins64, grad)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        close(g, rg, tol, f"grad {name}", floor)
    with wiola_kernels.use_backend("triton"):
        _, lse = gcla_attention_op(*[x.detach() for x in ins], lt)
    close(lse, ref_lse, tol, "lse")
    if lt is not None:
        for b, n in enumerate(lens):
            assert (out[b, :, n:] == 0).all() and (lse[b, :, n:] == 0).all(), "rows past the length must be 0"
            for name, g in zip(NAMES[:4], grads[:4]):
                assert (g[b, :, n:] == 0).all(), f"grad {name} past the length"


@needs_triton
@pytest.mark.parametrize("case", TRITON_CASES, ids=_triton_ids)
def test_triton_fp32_forward_and_grads(case):
    _check_against_oracle(torch.float32, case, tolerance(torch.float32, "attention"))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [TRITON_CASES[5], TRITON_CASES[3]], ids=_triton_ids)
def test_triton_half_forward_and_grads(dtype, case):
    # floor 1: as in test_bf16_forward_and_grads (exact-zero gradients see the rounding of O in D)
    _check_against_oracle(dtype, case, tolerance(dtype, "attention"), floor=1.0)


@needs_triton
def test_triton_float64():
    _check_against_oracle(torch.float64, (33, "causal", [33, 12], 2, 6, 3, 16), tolerance(torch.float64, "attention"))


@needs_triton
def test_triton_gpu_block_sizes_in_the_interpreter():
    """The blocks launch_config picks for an H200 (bf16, d_h 64: forward 128 × 64, dq pass
    128 × 32, dk/dv pass 32 × 64) on a sequence spanning several of them, against the oracle."""
    from wiola_kernels.triton import gcla_attention as tk

    cfg = tk.launch_config(64, torch.bfloat16, 90)
    T, lens = 300, [300, 133]
    ins, lt = make_inputs(2, 2, 1, T, 64, T, 2, torch.float32, lens, seed=3)
    out, lse = tk.gcla_attention_fwd(*ins, lt, config=cfg)
    ins64 = [x.double().requires_grad_() for x in ins]
    ref, _ = gcla_attention_forward(*ins64, lt)
    close(out, ref, tolerance(torch.float32, "attention"), "out")
    grad = torch.randn(2, 2, T, 64, generator=torch.Generator().manual_seed(4))
    grads = tk.gcla_attention_bwd(grad, *ins, lt, out, lse, config=cfg)
    for name, g, rg in zip(NAMES, grads, torch.autograd.grad(ref, ins64, grad.double())):
        close(g, rg, tolerance(torch.float32, "attention"), f"grad {name}")


@needs_triton
def test_triton_dkv_split_in_the_interpreter():
    """The dk/dv pass with each group's heads split over several programs (what a grid smaller
    than the GPU gets, dkv_split), unevenly (4 heads over 3 programs), against the oracle."""
    from wiola_kernels.triton import gcla_attention as tk

    assert tk.dkv_split(1, 16, 1, 2048, 128, 132) == 9   # 16 programs, each group split 9 ways
    assert tk.dkv_split(4, 16, 4, 4096, 64, 132) == 1    # the bench grid fills the GPU
    assert tk.dkv_split(1, 4, 4, 64, 64, 132) == 1       # one head per group: nothing to split
    T, lens = 40, [40, 23]
    ins, lt = make_inputs(2, 4, 1, T, 16, T, 2, torch.float32, lens, seed=7)
    out, lse = tk.gcla_attention_fwd(*ins, lt)
    grad = torch.randn(2, 4, T, 16, generator=torch.Generator().manual_seed(8))
    grads = tk.gcla_attention_bwd(grad, *ins, lt, out, lse, split=3)
    ins64 = [x.double().requires_grad_() for x in ins]
    ref, _ = gcla_attention_forward(*ins64, lt)
    for name, g, rg in zip(NAMES, grads, torch.autograd.grad(ref, ins64, grad.double())):
        close(g, rg, tolerance(torch.float32, "attention"), f"grad {name}")


@needs_triton
def test_triton_head_dim_limits():
    """Even d_h up to 256 run (tiles of max(16, next power of two) columns); wider run on
    another backend, with a warning that states the supported range."""
    ins, _ = make_inputs(1, 2, 1, 3, 258, 1, 1)
    wiola_kernels.dispatch.reset_warnings()
    with wiola_kernels.use_backend("triton"), pytest.warns(RuntimeWarning, match=r"even head widths d_h in \[2, 256\]"):
        wiola_kernels.gcla_attention(*ins)
    ins, _ = make_inputs(1, 2, 1, 3, 2, 3, 1, torch.float64)
    with wiola_kernels.use_backend("triton"):
        out = wiola_kernels.gcla_attention(*ins)
    close(out, gcla_attention_forward(*ins)[0], tolerance(torch.float64, "attention"), "d_h = 2")


@needs_triton
def test_triton_refuses_float32_beyond_d_h_64():
    """float32 at d_h > 64 (its exact FMA products spill registers on a GPU) goes to the next
    backend in line, with a warning that says why; the GPU launch configuration refuses it by name."""
    from wiola_kernels.triton import gcla_attention as tk

    with pytest.raises(ValueError, match=r"float32 on a GPU only up to d_h = 64, got d_h = 128.*cuda backend"):
        tk.launch_config(128, torch.float32, 90)
    assert tk.launch_config(128, torch.bfloat16, 90) and tk.launch_config(64, torch.float32, 80)
    ins, _ = make_inputs(1, 2, 1, 3, 66, 3, 1)
    wiola_kernels.dispatch.reset_warnings()
    with wiola_kernels.use_backend("triton"), pytest.warns(RuntimeWarning, match=r"float32 only up to d_h 64"):
        assert wiola_kernels.dispatch.select("gcla_attention", torch.device("cpu"), torch.float32, 66) != "triton"
        out = wiola_kernels.gcla_attention(*ins)
    close(out, gcla_attention_forward(*ins)[0], tolerance(torch.float32, "attention"), "d_h = 66")


@needs_triton
def test_triton_dispatch():
    """CPU tensors never pick triton by default (only when forced); CUDA tensors prefer cuda."""
    from wiola_kernels import dispatch

    assert "triton" in dispatch.implemented("gcla_attention")
    assert dispatch.select("gcla_attention", torch.device("cpu")) != "triton"
    with wiola_kernels.use_backend("triton"):
        assert dispatch.select("gcla_attention", torch.device("cpu")) == "triton"
    priority = dispatch._PRIORITY["cuda"]
    assert priority.index("cuda") < priority.index("triton")


# ---- on a GPU ----

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, B, H, H_kv, T, dh, mode, lens", [
    (dtype, *case[:6], None if case[6] is None else list(case[6]))
    for case, dtypes in shapes.GCLA_GPU_TESTS for dtype in dtypes])  # what gpu-report compiles ahead of time
def test_triton_gpu_vs_float64(dtype, B, H, H_kv, T, dh, mode, lens):
    """Compiled kernels on the device against the float64 oracle (SPEC §9), bitwise reproducible."""
    S = 1 if mode == "paper" else T
    ins, lt = make_inputs(B, H, H_kv, T, dh, S, 2, torch.float64, lens, seed=5)
    grad = torch.randn(B, H, T, dh, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    dev = [x.to("cuda", dtype).requires_grad_() for x in ins]
    dev[-1] = ins[-1].float().cuda().requires_grad_()
    ltd = None if lt is None else lt.cuda()
    outs = []
    for _ in range(2):
        with wiola_kernels.use_backend("triton"):
            out = wiola_kernels.gcla_attention(*dev, lengths=ltd)
            outs.append((out, torch.autograd.grad(out, dev, grad.to("cuda", dtype))))
    ins64 = [x.requires_grad_() for x in ins]
    ref = gcla_attention_forward(*ins64, lt)[0]
    tol = tolerance(dtype, "attention")
    close(outs[0][0].cpu(), ref, tol, "out", floor=1.0)
    for name, g, g2, rg in zip(NAMES, outs[0][1], outs[1][1], torch.autograd.grad(ref, ins64, grad)):
        close(g.cpu(), rg, tol, f"grad {name}", floor=1.0)
        assert torch.equal(g, g2), f"grad {name} not bitwise reproducible"


# ========================================================================================
# Backends and draws of the sections below: from SPEC alone, numerics at the edges, properties,
# bitwise determinism, GPU
# ========================================================================================

# cuda_emu is left out here: its kernels take d_h in {64, 128} and no float64, so at these
# shapes it would be skipped for cpu (one warning) and the test would only repeat cpu's. The
# CUDA section below runs it at its own shapes.
SPEC_BACKENDS = [name for name, state in wk.backends("cpu")["gcla_attention"].items()
                 if state == "available" and name != "cuda_emu"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]


# ========================================================================================
# From SPEC alone: the public API against tests/oracles.py (no wiola_kernels.reference)
# ========================================================================================

def _gcla_case(B=3, H=4, Hkv=2, T=7, dh=8, S=None, Lam=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q_rot, k_rot, v, q = r(B, H, T, dh), r(B, Hkv, T, dh), r(B, Hkv, T, dh), r(B, H, T, dh)
    kc, vc = r(B, H, S, Lam, dh), r(B, H, S, Lam, dh)
    gate = torch.randn(H, generator=g) * 2
    return q_rot, k_rot, v, q, kc, vc, gate


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("S_mode", ["paper", "causal"])
@pytest.mark.parametrize("Lam", [0, 1, 2])
def test_gcla_forward_matches_oracle(backend, S_mode, Lam):
    T = 7
    args = _gcla_case(B=3, H=4, Hkv=2, T=T, S=1 if S_mode == "paper" else T, Lam=Lam)
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    assert rel(out, gcla_oracle(*args)) <= tolerance(torch.float32, "attention")


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_group_is_h_mod_hkv(backend):
    # H = 6, H_kv = 3: h mod 3 (0,1,2,0,1,2) differs from h // 2 (0,0,1,1,2,2) for h = 1..4.
    B, H, Hkv, T, dh = 1, 6, 3, 5, 4
    q_rot, k_rot, v, q, kc, vc, gate = _gcla_case(B, H, Hkv, T, dh, Lam=0)
    v = torch.stack([torch.full((T, dh), float(10 * (g + 1))) for g in range(Hkv)])[None]
    with wk.use_backend(backend):
        out = wk.gcla_attention(q_rot, k_rot, v, q, kc, vc, gate)
    for h in range(H):
        assert torch.allclose(out[0, h], torch.full((T, dh), float(10 * (h % Hkv + 1)))), h


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_cross_uses_unrotated_q_and_gate(backend):
    # Zero self-values isolate σ(g_h)·O_cross; q_rot is garbage for the cross part.
    B, H, Hkv, T, dh = 2, 2, 1, 4, 8
    q_rot, k_rot, v, q, kc, vc, gate = _gcla_case(B, H, Hkv, T, dh, S=T, Lam=2)
    v = torch.zeros_like(v)
    gate = torch.tensor([-3.0, 1.5])
    with wk.use_backend(backend):
        out = wk.gcla_attention(q_rot * 100, k_rot, v, q, kc, vc, gate)
    ref = gcla_oracle(q_rot * 100, k_rot, v, q, kc, vc, gate)
    assert rel(out, ref) <= tolerance(torch.float32, "attention")
    # and explicitly: it is not the rotated query
    wrong = gcla_oracle(q_rot * 100, k_rot, v, q_rot * 100, kc, vc, gate)
    assert rel(out, wrong) > 1e-2


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("S_mode", ["paper", "causal"])
def test_gcla_lengths_mask_and_zero(backend, S_mode):
    B, T = 4, 9
    args = list(_gcla_case(B=B, H=4, Hkv=2, T=T, dh=8, S=1 if S_mode == "paper" else T, Lam=2))
    lengths = torch.tensor([9, 5, 0, 1])
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args, lengths)
    ref = gcla_oracle(*args, lengths=lengths)
    assert rel(out, ref) <= tolerance(torch.float32, "attention")
    for b, L in enumerate(lengths.tolist()):
        assert torch.equal(out[b, :, L:], torch.zeros_like(out[b, :, L:]))   # exactly zero
    # Perturbing keys/values/queries past the length changes nothing (even with NaN).
    k2, v2, q2 = args[1].clone(), args[2].clone(), args[0].clone()
    k2[1, :, 5:] = float("nan")
    v2[1, :, 5:] = 1e6
    q2[1, :, 5:] = float("nan")
    with wk.use_backend(backend):
        out2 = wk.gcla_attention(q2, k2, v2, *args[3:], lengths)
    assert torch.equal(out2[1], out[1])


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_lengths_int32_and_full(backend):
    args = _gcla_case(B=2, H=2, Hkv=1, T=6, dh=4, S=6, Lam=1)
    with wk.use_backend(backend):
        a = wk.gcla_attention(*args, torch.tensor([6, 6], dtype=torch.int32))
        b = wk.gcla_attention(*args)
    assert rel(a, gcla_oracle(*args)) <= tolerance(torch.float32, "attention")
    assert rel(b, gcla_oracle(*args)) <= tolerance(torch.float32, "attention")


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_odd_sizes_t1_and_long(backend):
    # T = 1, B odd, T not a multiple of any block size (37 > typical 16/32 blocks).
    for B, H, Hkv, T, dh in [(1, 2, 2, 1, 8), (3, 3, 1, 37, 16), (5, 4, 4, 2, 4), (1, 2, 1, 70, 4)]:
        args = _gcla_case(B, H, Hkv, T, dh, S=T, Lam=2)
        lengths = torch.tensor([max(T - b * 7, 0) for b in range(B)])
        with wk.use_backend(backend):
            out = wk.gcla_attention(*args, lengths)
        assert rel(out, gcla_oracle(*args, lengths=lengths)) <= tolerance(torch.float32, "attention"), (B, H, Hkv, T, dh)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_gcla_dtypes(backend, dtype):
    args = _gcla_case(B=1, H=2, Hkv=1, T=6, dh=8, S=6, Lam=2, dtype=dtype)
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args)
    assert out.dtype == dtype
    assert rel(out, gcla_oracle(*args)) <= tolerance(dtype, "attention")


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("S_mode", ["paper", "causal"])
def test_gcla_backward_matches_oracle(backend, S_mode):
    T = 6
    args = _gcla_case(B=2, H=4, Hkv=2, T=T, dh=8, S=1 if S_mode == "paper" else T, Lam=2)
    lengths = torch.tensor([6, 4])
    gout = torch.randn(2, 4, T, 8)
    xs = [a.clone().requires_grad_() for a in args]
    with wk.use_backend(backend):
        out = wk.gcla_attention(*xs, lengths)
    out.backward(gout)
    xd = [a.double().requires_grad_() for a in args]
    gcla_oracle(*xd, lengths=lengths).backward(gout.double())
    names = ["q_rot", "k_rot", "v", "q", "kc", "vc", "gate"]
    for n, got, ref in zip(names, xs, xd):
        assert got.grad is not None, n
        assert rel(got.grad, ref.grad) <= tolerance(torch.float32, "attention"), n


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_backward_half_and_empty_rows(backend):
    T = 5
    args = _gcla_case(B=3, H=2, Hkv=1, T=T, dh=8, S=T, Lam=2, dtype=torch.bfloat16)
    lengths = torch.tensor([5, 0, 2])
    gout = torch.randn(3, 2, T, 8).to(torch.bfloat16)
    xs = [a.clone().requires_grad_() for a in args]
    with wk.use_backend(backend):
        wk.gcla_attention(*xs, lengths).backward(gout)
    xd = [a.double().requires_grad_() for a in args]
    gcla_oracle(*xd, lengths=lengths).backward(gout.double())
    for n, got, ref in zip(["q_rot", "k_rot", "v", "q", "kc", "vc", "gate"], xs, xd):
        assert rel(got.grad, ref.grad) <= tolerance(torch.bfloat16), n
    # a row of length 0 gets exactly zero gradient everywhere
    for a in xs[:6]:
        assert torch.equal(a.grad[1], torch.zeros_like(a.grad[1]))


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_large_scores_stable(backend):
    # Scores of several hundred (softmax nearly one-hot) must not overflow or lose accuracy.
    q_rot, k_rot, v, q, kc, vc, gate = _gcla_case(B=1, H=2, Hkv=1, T=20, dh=8, S=20, Lam=2)
    args = (q_rot * 12, k_rot * 12, v, q * 12, kc * 12, vc, gate)
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args, torch.tensor([17]))
    assert rel(out, gcla_oracle(*args, lengths=torch.tensor([17]))) <= tolerance(torch.float32, "attention")


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_is_causal(backend):
    # Changing keys/values/queries at positions > t never changes outputs at positions ≤ t.
    T, t0 = 10, 4
    args = list(_gcla_case(B=1, H=2, Hkv=1, T=T, dh=4, S=T, Lam=2))
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args)
    pert = [a.clone() for a in args]
    for i in range(6):
        pert[i][:, :, t0 + 1:] += 5 * torch.randn_like(pert[i][:, :, t0 + 1:])
    with wk.use_backend(backend):
        out2 = wk.gcla_attention(*pert)
    assert rel(out2[:, :, : t0 + 1], out[:, :, : t0 + 1]) <= tolerance(torch.float32)
    assert not torch.allclose(out2[:, :, t0 + 1:], out[:, :, t0 + 1:])


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("S,Lam,lengths", [(1, 2, None), (3, 1, [3, 2]), (3, 0, [1, 3])])
def test_gcla_gradcheck(backend, S, Lam, lengths):
    # fast_mode (random projections) keeps this cheap; the next test is a full gradcheck.
    args = _gcla_case(B=2, H=2, Hkv=1, T=3, dh=4, S=S, Lam=Lam, dtype=torch.float64)
    args = [a.double().requires_grad_() for a in args]
    ln = None if lengths is None else torch.tensor(lengths)
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda *a: wk.gcla_attention(*a, ln), tuple(args), fast_mode=True)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_gradcheck_full_tiny(backend):
    args = _gcla_case(B=2, H=2, Hkv=1, T=2, dh=2, S=2, Lam=1, dtype=torch.float64)
    args = [a.double().requires_grad_() for a in args]
    ln = torch.tensor([2, 1])
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda *a: wk.gcla_attention(*a, ln), tuple(args))


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_noncontiguous(backend):
    B, H, Hkv, T, dh = 2, 4, 2, 5, 8
    q_rot = torch.randn(B, T, H, dh).transpose(1, 2)
    k_rot = torch.randn(B, T, Hkv, dh).transpose(1, 2)
    v = torch.randn(B, T, Hkv, 2 * dh)[..., ::2].transpose(1, 2)
    q = torch.randn(B, T, H, dh).transpose(1, 2)
    kc = torch.randn(B, H, 1, 2, dh).expand(B, H, T, 2, dh)          # expanded paper summary
    vc = torch.randn(B, H, T, dh, 2).transpose(-1, -2)
    gate = torch.randn(2 * H)[::2]
    args = (q_rot, k_rot, v, q, kc, vc, gate)
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args)
    assert rel(out, gcla_oracle(*args)) <= tolerance(torch.float32, "attention")


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_noncontiguous_grads(backend):
    args = _gcla_case(B=2, H=2, Hkv=1, T=5, dh=4, S=5, Lam=2)
    ln = torch.tensor([5, 3])
    g = torch.randn(2, 5, 2, 4).transpose(1, 2)
    for gout in (g, None):                                  # strided, then stride-0 (from .sum())
        xs = [a.clone().requires_grad_() for a in args]
        xd = [a.double().requires_grad_() for a in args]
        with wk.use_backend(backend):
            out = wk.gcla_attention(*xs, ln)
        ref = gcla_oracle(*xd, lengths=ln)
        if gout is None:
            out.sum().backward()
            ref.sum().backward()
        else:
            out.backward(gout)
            ref.backward(gout.double())
        for got, r in zip(xs, xd):
            assert rel(got.grad, r.grad) <= tolerance(torch.float32, "attention")


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_gcla_raw_op_returns_self_lse(backend):
    # SPEC §5.5: the op returns the log-sum-exp it needs for its backward.
    args = _gcla_case(B=2, H=2, Hkv=1, T=5, dh=4, S=5, Lam=2)
    lengths = torch.tensor([5, 3])
    with wk.use_backend(backend):
        out, lse = torch.ops.wiola.gcla_attention(*args, lengths)
    ref_out, ref_lse = gcla_oracle(*args, lengths=lengths, return_lse=True)
    assert rel(out, ref_out) <= tolerance(torch.float32, "attention")
    assert lse.shape == (2, 2, 5)                 # (definition used here: (B, H, T) of the self part)
    valid = torch.isfinite(ref_lse)
    assert rel(lse[valid], ref_lse[valid]) <= tolerance(torch.float32, "attention")


def _gcla_bad_call(**over):
    B, H, Hkv, T, dh = 2, 4, 2, 5, 8
    q_rot, k_rot, v, q, kc, vc, gate = _gcla_case(B, H, Hkv, T, dh, S=T, Lam=2)
    a = dict(q_rot=q_rot, k_rot=k_rot, v=v, q=q, kc=kc, vc=vc, gate=gate, lengths=None)
    for k_, f_ in over.items():
        a[k_] = f_(a)
    return wk.gcla_attention(**a)


_C64 = {n: (lambda a, n=n: a[n].to(torch.complex64)) for n in ("q_rot", "k_rot", "v", "q", "kc", "vc")}
GCLA_BAD = {
    "q_rot_rank3": (dict(q_rot=lambda a: a["q_rot"][0]), ["q_rot"]),
    "H_not_multiple_of_H_kv": (dict(k_rot=lambda a: torch.randn(2, 3, 5, 8), v=lambda a: torch.randn(2, 3, 5, 8)),
                               ["k_rot", "H_kv"]),
    "v_wrong_T": (dict(v=lambda a: torch.randn(2, 2, 6, 8)), ["v"]),
    "k_rot_wrong_d_h": (dict(k_rot=lambda a: torch.randn(2, 2, 5, 10)), ["k_rot"]),
    "q_wrong_T": (dict(q=lambda a: torch.randn(2, 4, 4, 8)), ["q"]),
    "kc_S_not_1_or_T": (dict(kc=lambda a: torch.randn(2, 4, 2, 2, 8), vc=lambda a: torch.randn(2, 4, 2, 2, 8)), ["kc"]),
    "vc_lambda_mismatch": (dict(vc=lambda a: torch.randn(2, 4, 5, 1, 8)), ["vc"]),
    "kc_rank4": (dict(kc=lambda a: torch.randn(2, 4, 5, 8)), ["kc"]),
    "gate_wrong_size": (dict(gate=lambda a: torch.zeros(5)), ["gate"]),
    "gate_list": (dict(gate=lambda a: [0.0] * 4), ["gate"]),
    "lengths_above_T": (dict(lengths=lambda a: torch.tensor([6, 1])), ["lengths"]),
    "lengths_negative": (dict(lengths=lambda a: torch.tensor([-1, 1])), ["lengths"]),
    "lengths_wrong_B": (dict(lengths=lambda a: torch.tensor([1, 2, 3])), ["lengths"]),
    "lengths_float": (dict(lengths=lambda a: torch.tensor([1.0, 2.0])), ["lengths"]),
    "lengths_list": (dict(lengths=lambda a: [5, 5]), ["lengths"]),
    "lengths_int": (dict(lengths=lambda a: 5), ["lengths"]),
    "v_dtype_mismatch": (dict(v=lambda a: a["v"].double()), ["v", "dtype"]),
    "q_rot_int": (dict(q_rot=lambda a: a["q_rot"].to(torch.int32)), ["q_rot"]),
    "all_complex": (_C64, ["q_rot", "dtype"]),
    "q_rot_list": (dict(q_rot=lambda a: a["q_rot"].tolist()), ["q_rot"]),
    "k_rot_other_device": (dict(k_rot=lambda a: a["k_rot"].to("meta")), ["k_rot", "device"]),
}


@pytest.mark.parametrize("case", list(GCLA_BAD))
def test_gcla_bad_inputs(case):
    over, names = GCLA_BAD[case]
    raises_naming((ValueError, TypeError), names, lambda: _gcla_bad_call(**over))


def test_gcla_opcheck():
    args = _gcla_case(B=1, H=2, Hkv=1, T=3, dh=4, S=3, Lam=2)  # no grad: autograd is wk.GCLAAttentionFunction's
    torch.library.opcheck(torch.ops.wiola.gcla_attention.default, (*args, torch.tensor([2])))
    torch.library.opcheck(torch.ops.wiola.gcla_attention.default, (*args, None))


def test_gcla_compile_fullgraph():
    args = [a.requires_grad_() for a in _gcla_case(B=1, H=2, Hkv=1, T=3, dh=4, S=1, Lam=2)]
    lengths = torch.tensor([2])
    f = torch.compile(lambda *a: wk.gcla_attention(*a, lengths), fullgraph=True, backend="aot_eager")
    out = f(*args)
    assert rel(out, gcla_oracle(*[a.detach() for a in args], lengths=lengths)) <= tolerance(torch.float32, "attention")
    out.sum().backward()
    assert all(a.grad is not None for a in args)


def test_gcla_gate_init_in_model():
    # SPEC §1/§5.4: the gate g is initialised to g₀ = −3.0 (the module lives in the model).
    wiola = pytest.importorskip("wiola")
    cfg = wiola.WiolaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=4, dsff_narrow_size=16, dsff_wide_size=32)
    assert cfg.gcla_gate_init == -3.0 and cfg.rms_norm_eps == 1e-6 and cfg.gcla_lookback == 2
    assert cfg.atm_threshold == 0.92 and cfg.srpe_theta == 10000 and cfg.srpe_spiral_divisor == 8
    assert cfg.srpe_radial_amplitude == 0.1 and cfg.srpe_radial_frequency == 0.01
    model = wiola.WiolaForCausalLM(cfg)
    gates = [p for n, p in model.named_parameters() if n.endswith("gate")]
    assert len(gates) == 3
    for p in gates:
        assert p.shape == (4,) and torch.equal(p, torch.full((4,), -3.0))


# ========================================================================================
# Numerics at the edges
# Every CPU backend (reference, cpu): huge and tiny magnitudes, all-zero rows, masked rows,
# and NaN/Inf confinement (a non-finite value in one row never reaches another row or batch
# element, forward or backward). What must hold:
#
# * gcla_attention — rows whose keys are all masked by ``lengths`` are exactly 0 with
#   zero (finite) gradients; scores up to ~1e30 in float32 saturate the softmax correctly.
# ========================================================================================

def _gcla_inputs(B=2, H=4, H_kv=2, T=21, dh=8, S=1, L=2, dtype=torch.float32, seed=8, scales=None):
    g = gen(seed)
    shapes = [(B, H, T, dh), (B, H_kv, T, dh), (B, H_kv, T, dh), (B, H, T, dh), (B, H, S, L, dh), (B, H, S, L, dh),
              (H,)]
    scales = scales or [1.0] * 7
    return [(torch.randn(*sh, generator=g).clamp(-3, 3) * sc).to(dtype if i < 6 else torch.float32)
            for i, (sh, sc) in enumerate(zip(shapes, scales))]


def _gcla(backend, ins, lengths=None, grad=None):
    ins = [x.clone().requires_grad_(grad is not None) for x in ins]
    with wk.use_backend(backend):
        out = wk.gcla_attention(*ins, lengths=lengths)
        if grad is None:
            return out.detach(), None
        return out.detach(), torch.autograd.grad(out, ins, grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("S", [1, 21])
def test_gcla_fully_masked_rows(backend, S):
    """lengths = 0 (every key of the row masked) and a partial length: rows past the length are
    exactly 0, gradients are finite, and a fully masked batch row contributes nothing."""
    ins = _gcla_inputs(S=S)
    lengths = torch.tensor([0, 7])
    grad = torch.randn(2, 4, 21, 8, generator=gen(9))
    out, grads = _gcla(backend, ins, lengths, grad)
    assert finite(out, *grads)
    assert (out[0] == 0).all() and (out[1, :, 7:] == 0).all()
    for name, gr in zip(("q_rot", "k_rot", "v", "q", "kc", "vc"), grads[:6]):
        assert (gr[0] == 0).all(), name
    assert (grads[0][1, :, 7:] == 0).all() and (grads[1][1, :, 7:] == 0).all() and (grads[2][1, :, 7:] == 0).all()
    # All rows of the batch masked: output 0, every gradient (gate included) 0.
    out, grads = _gcla(backend, ins, torch.tensor([0, 0]), grad)
    assert (out == 0).all() and all(bool((gr == 0).all()) for gr in grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,scales", [
    (torch.float32, [1e15, 1e15, 1, 1, 1, 1, 1]),          # scores ~1e30: a saturated softmax
    (torch.float32, [1e-20, 1e-20, 1, 1e-20, 1e-20, 1, 1]),  # scores ~1e-40: uniform softmax
    (torch.float32, [1, 1, 1e30, 1, 1, 1e30, 1]),           # huge values
    (torch.float32, [1, 1, 1e-30, 1, 1, 1e-30, 1]),         # tiny values
    (torch.float16, [20, 20, 1e4, 20, 20, 1e4, 1]),         # near the fp16 limits (|out| ≤ 3e4·(1 + σ) < 65504)
    (torch.bfloat16, [1e15, 1e15, 1e37, 1, 1, 1e37, 1]),    # near the bf16 limits
])
def test_gcla_huge_and_tiny_magnitudes(backend, dtype, scales):
    ins = _gcla_inputs(dtype=dtype, scales=scales, S=21)
    lengths = torch.tensor([21, 13])
    out, _ = _gcla(backend, ins, lengths)
    assert finite(out)
    want, _ = gcla_attention_forward(*[x.double() for x in ins], lengths)
    assert rel_err(out, want) <= tolerance(dtype, "attention")


def _poison(ins, which, index, bad):
    ins = [x.clone() for x in ins]
    ins[which][index] = bad
    return ins


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", range(7))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gcla_nonfinite_batch_row_is_confined(backend, which, bad):
    """A NaN/Inf anywhere in batch row 0 (or in one head's gate) never reaches batch row 1's output
    or its per-row gradients; a non-finite grad_out in row 0 likewise."""
    ins = _gcla_inputs(S=1)
    grad = torch.randn(2, 4, 21, 8, generator=gen(10))
    out0, g0 = _gcla(backend, ins, None, grad)
    index = (1,) if which == 6 else (0, 1, 5, 3) if which < 4 else (0, 1, 0, 1, 3)
    out, grads = _gcla(backend, _poison(ins, which, index, bad), None, grad)
    if which == 6:  # gate of head 1: only head 1 is affected
        keep = [0, 2, 3]
        assert torch.equal(out[:, keep], out0[:, keep])
        assert torch.equal(grads[0][:, keep], g0[0][:, keep]) and torch.equal(grads[3][:, keep], g0[3][:, keep])
        return
    assert torch.equal(out[1], out0[1])
    for name, gr, gr0 in zip(("q_rot", "k_rot", "v", "q", "kc", "vc"), grads[:6], g0[:6]):
        assert torch.equal(gr[1], gr0[1]), name
    gb = grad.clone()
    gb[0, 2, 4, 1] = bad
    out, grads = _gcla(backend, ins, None, gb)
    for name, gr, gr0 in zip(("q_rot", "k_rot", "v", "q", "kc", "vc"), grads[:6], g0[:6]):
        assert torch.equal(gr[1], gr0[1]), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gcla_nonfinite_padding_is_ignored(backend, bad):
    """Garbage (NaN/Inf) in padded positions t ≥ len_b of k_rot, v, q_rot, q, kc, vc never reaches
    the valid rows (the kernels skip all work past the length)."""
    ins = _gcla_inputs(S=21)
    lengths = torch.tensor([12, 21])
    grad = torch.randn(2, 4, 21, 8, generator=gen(11))
    out0, g0 = _gcla(backend, ins, lengths, grad)
    bad_ins = [x.clone() for x in ins]
    for i in range(6):
        bad_ins[i][0, :, 12:] = bad
    out, grads = _gcla(backend, bad_ins, lengths, grad)
    assert torch.equal(out, out0)
    for name, gr, gr0 in zip(("q_rot", "k_rot", "v", "q", "kc", "vc", "gate"), grads, g0):
        assert torch.equal(gr[:, :, :12] if gr.dim() > 1 else gr, gr0[:, :, :12] if gr0.dim() > 1 else gr0), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["v", "k_rot"])
def test_gcla_nonfinite_future_value_does_not_reach_earlier_rows(backend, where):
    """A NaN/Inf at key 40 never reaches query rows < 40 (outputs or dq): the T = 80 rows
    span a query block, so a kernel multiplying whole tiles by masked zeros would fail."""
    ins = _gcla_inputs(T=80, S=1)
    index = {"v": 2, "k_rot": 1}[where]
    ins = _poison(ins, index, (0, 0, 40, 3), float("nan") if where == "v" else float("inf"))
    grad = torch.zeros_like(ins[0])
    grad[:, :, :40] = 1.0
    out, grads = _gcla(backend, ins, grad=grad)
    assert torch.isfinite(out[0, :, :40]).all()
    assert not torch.isfinite(out[0, :, 40:]).all()  # the rows that see it do show it
    assert torch.isfinite(grads[0][0, :, :40]).all()  # dq_rot of the clean rows
    clean, _ = _gcla(backend, _gcla_inputs(T=80, S=1))
    assert rel_err(out[0, :, :40], clean[0, :, :40]) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["q_rot", "grad_out"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gcla_nonfinite_query_row_does_not_reach_later_keys(backend, where, bad):
    """A NaN/Inf in query row 40 (or in its upstream gradient) reaches dk/dv only of the keys
    that row attends to (j ≤ 40): keys j > 40 are never seen by it, so their gradients stay
    finite (a dense dS^T @ Q or P^T @ dO would give 0 · NaN = NaN there)."""
    ins = _gcla_inputs(T=80, S=1)
    grad = torch.randn(2, 4, 80, 8, generator=gen(12))
    if where == "q_rot":
        ins = _poison(ins, 0, (0, 1, 40, 3), bad)
    else:
        grad[0, 1, 40, 3] = bad
    _, grads = _gcla(backend, ins, grad=grad)
    dk, dv = grads[1], grads[2]
    assert torch.isfinite(dk[0, :, 41:]).all() and torch.isfinite(dv[0, :, 41:]).all()
    assert torch.isfinite(dk[1]).all() and torch.isfinite(dv[1]).all()
    if where == "grad_out":  # row 40 does reach its own keys
        assert not torch.isfinite(dv[0, 1, :41]).all()


# ========================================================================================
# Properties (hypothesis): any shape, stride, dtype (B = 0/1, T = 1, Λ' = 0, S = 1 and S = T, odd d_h,
# lengths 0 and T); bad input names the argument
# ========================================================================================

@given(
    b=st.integers(0, 3), h_kv=st.integers(1, 3), groups=st.integers(1, 2), t=st.integers(1, 18),
    half=st.integers(1, 12), s_full=st.booleans(), slots=st.integers(0, 3),
    dtype=st.sampled_from(DTYPES), how=st.sampled_from(LAYOUTS),
    gate=st.lists(st.floats(-8.0, 8.0), min_size=1, max_size=1),
    len_kind=st.sampled_from(["none", "random", "zeros", "full", "int32"]),
    scale=st.sampled_from([0.3, 1.0, 3.0]), check_grad=st.booleans(),
    backend=st.sampled_from(BACKENDS), data=st.data(),
)
def test_gcla_attention_any_shape_stride_dtype(b, h_kv, groups, t, half, s_full, slots, dtype, how, gate, len_kind,
                                               scale, check_grad, backend, data):
    h, dh = h_kv * groups, 2 * half
    s = t if s_full else 1
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))

    def r(*shape):
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

    shapes = [(b, h, t, dh), (b, h_kv, t, dh), (b, h_kv, t, dh), (b, h, t, dh), (b, h, s, slots, dh),
              (b, h, s, slots, dh)]
    # "expanded": k_rot/v replicated over heads, kc/vc over positions (or slots), q over batch.
    expand_dims = [0, 1, 1, 0, 2 if s > 1 else 3, 2 if s > 1 else 3]
    ins = [view_as(r(*shape), dtype, how, dim) for shape, dim in zip(shapes, expand_dims)]
    gate_dtype = data.draw(st.sampled_from(DTYPES))  # the gate may have any float dtype
    gate_t = view_as(gate[0] + torch.randn(h, generator=g, dtype=torch.float64), gate_dtype, how)
    lengths = lengths_of_kind(len_kind, b, t, g)

    args = [x.requires_grad_(check_grad) for x in (*ins, gate_t)]
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args, lengths=lengths)
        assert out.shape == (b, h, t, dh) and out.dtype == dtype
        grad = torch.randn(b, h, t, dh, generator=g, dtype=torch.float64)
        if check_grad:
            grads = torch.autograd.grad(out, args, grad.to(dtype), allow_unused=True)

    x64 = [x.detach().double() for x in args]
    ref_out, ref_lse = gcla_attention_forward(*x64, lengths)
    low = dtype in (torch.bfloat16, torch.float16)
    close(out, ref_out, tolerance(dtype, "attention"), "out", floor=1.0 if low else 0.25)
    if lengths is not None:  # rows past the length are exactly zero
        pad = torch.arange(t)[None, :] >= lengths.long()[:, None]
        assert (out.detach().permute(0, 2, 1, 3)[pad] == 0).all()
    if not check_grad:
        return
    want = gcla_attention_backward(grad.to(dtype).double(), *x64, lengths, ref_out, ref_lse)
    for name, got, w, x in zip(("q_rot", "k_rot", "v", "q", "kc", "vc", "gate"), grads, want, args):
        got = torch.zeros_like(x) if got is None else got
        assert got.shape == x.shape and got.dtype == x.dtype, name
        tol = max(tolerance(dtype, "attention"), tolerance(x.dtype, "attention"))
        # Gradients scale like scale² (and exact zeros — T = 1 — see the rounding noise of the
        # FlashAttention identity D = dO·O with O rounded to the input dtype): floor accordingly.
        close(got, w, tol, f"grad {name}", floor=(1.0 if tol >= 1e-2 else 0.25) * max(scale, 1.0) ** 2)


@given(
    q_rank=st.integers(3, 5), b_k=st.integers(1, 3), h=st.integers(1, 4), h_kv=st.integers(1, 4),
    t=st.integers(1, 4), t_k=st.integers(1, 4), dh=st.integers(1, 9), s=st.integers(1, 5),
    kv_dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
    gate_len=st.integers(0, 5), lengths_kind=st.sampled_from(["ok", "none", "float", "too_long", "negative", "2d"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_gcla_attention_bad_input_raises_named_error(q_rank, b_k, h, h_kv, t, t_k, dh, s, kv_dtype, gate_len,
                                                     lengths_kind, seed):
    B = 2
    g = torch.Generator().manual_seed(seed)
    q_shape = (B, h, t, dh)[4 - q_rank:] if q_rank <= 4 else (1, B, h, t, dh)
    q_rot = torch.randn(q_shape, generator=g)
    k_rot = torch.randn(b_k, h_kv, t_k, dh, generator=g).to(kv_dtype)
    v = torch.randn(b_k, h_kv, t_k, dh, generator=g).to(kv_dtype)
    q = torch.randn(q_shape, generator=g)
    kc = torch.randn(B, h, s, 2, dh, generator=g)
    vc = torch.randn(B, h, s, 2, dh, generator=g)
    gate = torch.zeros(gate_len)
    lengths = {"ok": torch.full((B,), t), "none": None, "float": torch.full((B,), float(t)),
               "too_long": torch.full((B,), t + 1), "negative": torch.full((B,), -1),
               "2d": torch.full((B, 1), t)}[lengths_kind]
    try:
        out = wk.gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths)
    except (ValueError, TypeError) as exc:
        assert any(n in str(exc) for n in ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate", "lengths", "H_kv",
                                           "d_h")), str(exc)
        return
    valid = (q_rank == 4 and b_k == B and t_k == t and h % h_kv == 0 and dh % 2 == 0 and s in (1, t)
             and kv_dtype == torch.float32 and gate_len == h and lengths_kind in ("ok", "none"))
    assert valid, "an invalid call was accepted"
    assert out.shape == q_rot.shape


# ========================================================================================
# Bitwise determinism of the C++ kernel, 1 vs 2 threads (helpers.run_on_thread_counts)
# ========================================================================================

@needs_cpu_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("S,lengths", [(1, None), (1, [200, 77]), (200, [131, 200])])
def test_gcla_attention_bitwise_reproducible(dtype, S, lengths):
    g = gen(2)
    B, H, H_kv, T, dh, L = 2, 4, 2, 200, 24, 3  # 4 query blocks, 2 key blocks
    shapes = [(B, H, T, dh), (B, H_kv, T, dh), (B, H_kv, T, dh), (B, H, T, dh), (B, H, S, L, dh), (B, H, S, L, dh)]
    ins = [torch.randn(*sh, generator=g).to(dtype) for sh in shapes] + [torch.randn(H, generator=g)]
    grad = torch.randn(B, H, T, dh, generator=g).to(dtype)
    lens = None if lengths is None else torch.tensor(lengths)

    def fn(*args):
        return wk.gcla_attention(*args, lengths=lens), grad

    assert_bitwise(run_on_thread_counts(fn, ins), ["out", "q_rot", "k_rot", "v", "q", "kc", "vc", "gate"])


# ========================================================================================
# The cuda backend (wiola_kernels/ops/gcla_attention_cuda.py): PyTorch's fused self-attention
# with permuted query heads plus our summary kernels (csrc/cuda/gcla_attention.cu), against
# the float64 oracle.
#
# * CPU (every CI run): the whole orchestration — head permutation, layouts, lengths, the
#   float32 path's K/V expansion, the fused self-attention forward/backward (PyTorch's CPU
#   flash kernel standing in for the GPU one) — with the summary kernels given twice: as
#   ``torch.ops.wiola_cuda_emu`` (the CUDA kernels' bodies run by the SIMT emulator,
#   csrc/cuda/emu/, when the extension is built) and as :class:`SummaryKernelModel`, a
#   row-for-row PyTorch model of them (same head map ``p(h)``, per-row formulas, 64-row
#   chunked sums and output layouts). One oracle run checks both.
# * GPU (skipped without one; scripts/gpu_check.sh): the real kernels with flash/efficient
#   attention, the kernels against the model, the self part against
#   ``F.scaled_dot_product_attention``, determinism, padding.
# ========================================================================================

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
def cuda_inputs(B, H, H_kv, T, dh, S, L, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)

    gate = torch.randn(H, generator=g, dtype=torch.float64).to(device, torch.float64 if dtype == torch.float64
                                                                 else torch.float32)
    return [r(B, H, T, dh), r(B, H_kv, T, dh), r(B, H_kv, T, dh), r(B, H, T, dh), r(B, H, S, L, dh),
            r(B, H, S, L, dh), gate]


def cuda_oracle(ins, lengths, grad):
    """Float64 output, lse and gradients of every input (autograd through the reference)."""
    ins64 = [x.detach().double().requires_grad_() for x in ins]
    out, lse = gcla_attention_forward(*ins64, lengths)
    return out, lse, torch.autograd.grad(out, ins64, grad.to(ins64[0].device, torch.float64))


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
    ref = cuda_oracle(ins, lengths, grad)
    for who, kernels in kernel_sets():
        out, lse, grads = run_orchestration(ins, lengths, grad, kernels)
        check_against_oracle(out, lse, grads, ins, lengths, grad, dtype, ref=ref, who=who)


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


# d_h 128 at every T ≤ 7 and once at T = 257 (the cuda_oracle's T×T float64 autograd dominates the run time).
FP32_CASES = [(c, 64) for c in CUDA_CASES] + [(c, 128) for c in CUDA_CASES if c[0] <= 7 or c is CUDA_CASES[8]]
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="CPU check of the orchestration; a GPU runs the kernels themselves")


@cpu_only
@pytest.mark.parametrize("case, dh", FP32_CASES, ids=lambda x: _cuda_ids(x) if isinstance(x, tuple) else f"dh{x}")
def test_model_orchestration_matches_oracle_fp32(case, dh):
    T, mode, with_len, L, H, H_kv = case
    S = 1 if mode == "paper" else T
    ins = cuda_inputs(2, H, H_kv, T, dh, S, L, torch.float32, seed=T + L + H)
    lengths = _cuda_lengths(T, with_len)
    grad = torch.randn(2, H, T, dh, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    check_kernel_sets(ins, lengths, grad, torch.float32)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CUDA_CASES[::2], ids=_cuda_ids)
def test_model_orchestration_matches_oracle_half(case, dtype):
    T, mode, with_len, L, H, H_kv = case
    S = 1 if mode == "paper" else T
    ins = cuda_inputs(2, H, H_kv, T, 64, S, L, dtype, seed=7)
    lengths = _cuda_lengths(T, with_len)
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
@pytest.mark.parametrize("case", [CUDA_CASES[4], CUDA_CASES[8], CUDA_CASES[10]], ids=_cuda_ids)
def test_model_expanded_kv_path_matches_oracle(case, monkeypatch):
    """float32 on CUDA: the memory-efficient kernel has no GQA, so heads stay natural, K/V are
    repeated (head j·H_kv + g reads g) and dK/dV summed back over the group."""
    T, mode, with_len, L, H, H_kv = case
    monkeypatch.setattr(gc, "self_attention_kernel", lambda device, dtype: "efficient")
    monkeypatch.setattr(gc, "_SelfAttention", _ExpandedCpuAttention)
    S = 1 if mode == "paper" else T
    ins = cuda_inputs(2, H, H_kv, T, 64, S, L, torch.float32, seed=3)
    lengths = _cuda_lengths(T, with_len)
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
    ins = cuda_inputs(2, H, H_kv, T, 64, T, 2, torch.bfloat16, device=device, seed=5)
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
    ins = cuda_inputs(2, 6, 3, 130, 64, 1, 2, torch.bfloat16, seed=8)
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
    ins = [x.requires_grad_() for x in cuda_inputs(2, H, H_kv, T, dh, S, L, dtype, device="cuda", seed=T + L)]
    lengths = _cuda_lengths(T, with_len, "cuda")
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
    ins = [x.requires_grad_() for x in cuda_inputs(B, H, H_kv, T, dh, 1, 0, dtype, device="cuda", seed=11)]
    grad = torch.randn(B, H, T, dh, device="cuda", dtype=dtype)
    with wiola_kernels.use_backend("cuda"):
        out = wiola_kernels.gcla_attention(*ins)
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
    ins = [x.requires_grad_() for x in cuda_inputs(2, 8, 2, 200, 64, 1, 2, torch.bfloat16, device="cuda", seed=2)]
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
    ins = [x.requires_grad_() for x in cuda_inputs(1, 2, 1, 5, 8, 1, 1, torch.float64, device="cuda")]
    with wiola_kernels.use_backend("cuda"), pytest.warns(RuntimeWarning, match="'cuda' cannot take dtype float64"):
        dispatch.reset_warnings()
        assert torch.autograd.gradcheck(lambda *a: wiola_kernels.gcla_attention(*a), ins, fast_mode=True)


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_kernel_rejects_bad_arguments():
    ins = [x.float() for x in cuda_inputs(1, 2, 1, 5, 32, 1, 1, torch.float32, device="cuda")]
    o = torch.zeros_like(ins[0])
    lse = torch.zeros(1, 2, 5, device="cuda")
    with pytest.raises(ValueError, match="d_h in"):
        torch.ops.wiola._gcla_summary_fwd(o, lse, ins[3], ins[4], ins[5], ins[6], None, 1)
    ins = [x.float() for x in cuda_inputs(1, 4, 2, 5, 64, 1, 1, torch.float32, device="cuda")]
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
        ins = cuda_inputs(B, H, H_kv, T, dh, T if S_T else 1, L, torch.bfloat16, device="cuda", seed=13)
        lengths = torch.tensor([100, 41], device="cuda")
        P = gc.kv_order(H, H_kv)
        o_self = gc.to_self_order(torch.randn(B, H, T, dh, device="cuda", dtype=torch.bfloat16), P)
        lse_self = torch.randn(B, H, T, device="cuda")
        q, kc, vc, gate = ins[3], ins[4], ins[5], ins[6]
        got = torch.ops.wiola._gcla_summary_fwd(o_self, lse_self, q, kc, vc, gate, lengths, P)
        want = MODEL._gcla_summary_fwd(*[x.cpu() for x in (o_self, lse_self, q, kc, vc, gate, lengths)], P)
        for a, b in zip(got, want):
            close_floored(a, b, tolerance(torch.bfloat16), "summary forward")
        grad = torch.randn(B, H, T, dh, device="cuda", dtype=torch.bfloat16)
        args = (grad, got[0], got[1], ins[0], q, kc, vc, gate, lengths)
        got_b = torch.ops.wiola._gcla_summary_bwd(*args, P, T, True)
        want_b = MODEL._gcla_summary_bwd(*[x.cpu() for x in args], P, T, True)
        for i, (a, b) in enumerate(zip(got_b, want_b)):
            assert a.shape == b.shape and a.stride() == b.stride(), f"output {i}: layout"
            close_floored(a, b, tolerance(torch.bfloat16), f"summary backward output {i}")


@cpu_only
def test_cuda_emu_backend_through_the_public_op():
    """use_backend("cuda_emu") routes the public op (and its backward) to this orchestration
    with the emulated kernels."""
    if dispatch.BACKENDS["cuda_emu"].unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("the extension was built without the emulated CUDA kernels")
    ins = [x.requires_grad_() for x in cuda_inputs(2, 6, 3, 40, 64, 40, 2, torch.bfloat16, seed=21)]
    lengths = torch.tensor([40, 17])
    grad = torch.randn(2, 6, 40, 64, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    with wiola_kernels.use_backend("cuda_emu"):
        assert dispatch.select("gcla_attention", torch.device("cpu")) == "cuda_emu"
        out, lse = GCLAAttentionFunction.apply(*ins, lengths), gcla_attention_op(*ins, lengths)[1]
        grads = torch.autograd.grad(out, ins, grad.to(torch.bfloat16))
    check_against_oracle(out, lse, grads, ins, lengths, grad, torch.bfloat16)


# --- strided inputs, no hidden copies (issue 14 §3) ----------------------------------------

STRIDED_BACKENDS = [b for b in BACKENDS_ALL if b in ("cpu", "triton")]  # the kernels that take strides


def model_layout_inputs(B, H, H_kv, T, dh, S, L, dtype=torch.float32, seed=0):
    """The seven inputs as the model makes them, requiring grad: q_rot, q
    ``(B, T, H, d_h)``-ordered and k_rot, v ``(B, T, H_kv, d_h)``-ordered transposed views;
    kc, vc ``view(B, S, Λ', H, d_h).permute(0, 3, 1, 2, 4)`` of a context projection; and an
    upstream gradient ∂L/∂O that is a transposed view too (the gradient of
    ``O.transpose(1, 2).reshape(B, T, H·d_h)``)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    ins = [r(B, T, H, dh).transpose(1, 2), r(B, T, H_kv, dh).transpose(1, 2), r(B, T, H_kv, dh).transpose(1, 2),
           r(B, T, H, dh).transpose(1, 2), r(B, S, L, H, dh).permute(0, 3, 1, 2, 4),
           r(B, S, L, H, dh).permute(0, 3, 1, 2, 4), r(H)]
    return [x.requires_grad_() for x in ins], r(B, T, H, dh).transpose(1, 2)


@pytest.mark.parametrize("backend", STRIDED_BACKENDS)
@pytest.mark.parametrize("mode, lens", [("causal", None), ("paper", [21, 9]), ("causal", [0, 17])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_strided_views_make_no_copies(backend, mode, lens, dtype):
    """The model's views go through forward and backward without one aten::copy_/clone/_to_copy
    (counted by a TorchDispatchMode inside the ops); O is in (B, T, H, d_h) memory order, so
    the output projection's reshape is a view; every gradient takes its input's layout
    (∂kc, ∂vc contiguous for S = 1, where they are sums over positions); values and
    gradients equal the float64 reference."""
    from wiola_kernels.testing import CopyCounter

    B, H, H_kv, T, dh, L = 2, 6, 3, 21, 16, 2
    S = T if mode == "causal" else 1
    ins, grad = model_layout_inputs(B, H, H_kv, T, dh, S, L, dtype, seed=len(mode) + T)
    lengths = None if lens is None else torch.tensor(lens, dtype=torch.int64)
    with wiola_kernels.use_backend(backend), CopyCounter() as fwd:
        out = wiola_kernels.gcla_attention(*ins, lengths=lengths)
    with wiola_kernels.use_backend(backend), CopyCounter() as bwd:
        grads = torch.autograd.grad(out, ins, grad)
    dispatched = 1 if backend == "cpu" else None  # a forced Python backend calls no registered op
    assert fwd.counts.get("wiola.gcla_attention") == dispatched
    assert bwd.counts.get("wiola.gcla_attention_backward") == dispatched
    assert fwd.copies == 0, fwd.counts
    assert bwd.copies == 0, bwd.counts
    assert out.stride() == ins[0].stride()
    flat = out.transpose(1, 2).reshape(B, T, H * dh)
    assert flat.data_ptr() == out.data_ptr() and flat.is_contiguous(), "the output projection's input is a view"
    for name, g_, x in zip(NAMES, grads, ins):
        want = x.stride() if name not in ("kc", "vc") or S != 1 else x.contiguous().stride()
        assert g_.stride() == want, (name, g_.stride(), want)
    from wiola_kernels.reference.gcla_attention import gcla_attention as gcla_attention_reference

    ref = [x.detach().double().requires_grad_() for x in ins]
    with torch.enable_grad():
        out_ref = gcla_attention_reference(*ref, lengths=lengths)
        grads_ref = torch.autograd.grad(out_ref, ref, grad.double())
    tol = tolerance(dtype, "attention")
    close(out, out_ref, tol, f"{backend} out")
    for name, g_, r_ in zip(NAMES, grads, grads_ref):
        close(g_, r_, tol, f"{backend} grad {name}")


@needs_cpu_extension
@pytest.mark.parametrize("mode, lens", [("causal", [21, 17]), ("paper", [0, 12])])
def test_cpu_strided_views_independent_of_thread_count(mode, lens):
    """On the model's interleaved views the C++ kernel groups heads per task by the thread
    count (1 thread: all 6 heads in a task, 2: 3, 3: 2); every partition gives bitwise the same
    values and gradients, and those equal the float64 reference."""
    from wiola_kernels.reference.gcla_attention import gcla_attention as gcla_attention_reference

    B, H, H_kv, T, dh, L = 2, 6, 3, 21, 16, 2
    S = T if mode == "causal" else 1
    ins, grad = model_layout_inputs(B, H, H_kv, T, dh, S, L, torch.float32, seed=11 + S)
    lengths = torch.tensor(lens, dtype=torch.int64)
    ref = [x.detach().double().requires_grad_() for x in ins]
    with torch.enable_grad():
        out_ref = gcla_attention_reference(*ref, lengths=lengths)
        grads_ref = torch.autograd.grad(out_ref, ref, grad.double())
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with wiola_kernels.use_backend("cpu"):
                out = wiola_kernels.gcla_attention(*ins, lengths=lengths)
                results.append((out, *torch.autograd.grad(out, ins, grad)))
    finally:
        torch.set_num_threads(threads)
    tol = tolerance(torch.float32, "attention")
    close(results[0][0], out_ref, tol, "out")
    for name, g_, r_ in zip(NAMES, results[0][1:], grads_ref):
        close(g_, r_, tol, f"grad {name}")
    for n, res in zip((2, 3), results[1:]):
        for name, a, b in zip(("out", *NAMES), res, results[0]):
            assert torch.equal(a, b), f"{name} with {n} threads differs from 1 thread"


@pytest.mark.parametrize("backend", BACKENDS + ["cuda_emu"])
def test_every_backend_returns_the_fakes_layouts(backend):
    """Backends that copy (the reference oracle; the cuda composite, here emulated) still return
    the layouts the op's fakes promise, and the right values."""
    if backend not in available_backends("gcla_attention", "cpu"):
        pytest.skip(f"{backend} unavailable here")
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, H, H_kv, T, dh, L = 2, 4, 2, 9, 64, 2
    for S in (T, 1):
        ins, grad = model_layout_inputs(B, H, H_kv, T, dh, S, L, seed=S)
        lengths = torch.tensor([9, 5])
        with wiola_kernels.use_backend(backend):
            out, lse = gcla_attention_op(*[x.detach() for x in ins], lengths)
            grads = gcla_attention_grad_op(grad, *[x.detach() for x in ins], lengths, out, lse)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake_out, _ = torch.ops.wiola.gcla_attention(*[x.detach() for x in ins], lengths)
            fake_grads = gcla_attention_grad_op(grad, *[x.detach() for x in ins], lengths, out, lse)
        for name, real, fake in zip(("out",) + NAMES, (out, *grads), (fake_out, *fake_grads)):
            significant = [s for n, s in zip(real.shape, real.stride()) if n > 1]
            assert significant == [s for n, s in zip(fake.shape, fake.stride()) if n > 1], (backend, S, name)
        close(out, naive(*ins, lengths), tolerance(torch.float32, "attention"), f"{backend} S={S} out")


def test_opcheck_on_the_models_views():
    for S, lens in ((7, None), (1, torch.tensor([7, 3]))):
        ins, grad = model_layout_inputs(2, 4, 2, 7, 4, S, 2, seed=S)
        torch.library.opcheck(torch.ops.wiola.gcla_attention.default, (*[x.detach() for x in ins], lens))  # no grad: the Function's
        out, lse = gcla_attention_op(*[x.detach() for x in ins], lens)
        torch.library.opcheck(torch.ops.wiola.gcla_attention_backward.default, (grad, *[x.detach() for x in ins], lens, out, lse))
