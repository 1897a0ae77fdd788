"""GCLA summary-augmented attention (SPEC §5.5): every CPU-runnable backend against the
float64 reference and an independent naive float64 implementation."""

from __future__ import annotations

import math
import os

import pytest
import torch

import wiola_kernels
from wiola_kernels.ops.gcla_attention import gcla_attention_backward_op, gcla_attention_op
from wiola_kernels.reference.gcla_attention import (gcla_attention_backward, gcla_attention_forward,
                                                    gcla_context_kv, gcla_summary)
from wiola_kernels.testing import available_backends, rel_err, tolerance

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


# (T, mode, lengths-or-None, Λ', H, H_kv); lengths chosen off any block boundary.
def _cases():
    cases = []
    for T in (1, 7, 64, 257):
        for mode in ("paper", "causal"):
            for with_len in (False, True):
                for L, (H, H_kv) in ((0, (4, 4)), (1, (4, 1)), (2, (4, 4)), (2, (4, 1))):
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
    close(ref, naive(*ins, lt), 1e-12, "reference vs naive")


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
        torch.testing.assert_close(e, a, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("backend", BACKENDS_ALL)
def test_lse_matches_reference(backend):
    ins, lt = make_inputs(2, 4, 1, 37, 8, 37, 2, torch.float32, [37, 20])
    with wiola_kernels.use_backend(backend):
        _, lse = gcla_attention_op(*ins, lt)
    _, ref = gcla_attention_forward(*[x.double() for x in ins], lt)
    assert lse.dtype == torch.float32
    assert rel_err(lse, ref) < 1e-6
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
        torch.testing.assert_close(out2, out.detach(), rtol=0, atol=1e-6)
    else:
        assert torch.equal(out2, out.detach())
    for name, g in zip(NAMES[:6], grads[:6]):
        assert (g[1, :, 17:] == 0).all(), f"grad {name} past the length"
    # a row of length T equals the unpadded op
    full = run(backend, [x.detach() for x in ins], None)
    assert torch.equal(full[0], out.detach()[0]) or rel_err(full[0], out[0]) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS_ALL)
def test_gate(backend):
    """σ(g) blends the cross part: g → −∞ is plain attention; the gate gradient is Σ σ'(g) dO·O^cross."""
    ins, _ = make_inputs(2, 4, 1, 20, 8, 1, 2, torch.float64, requires_grad=True)
    plain = run(backend, [*ins[:4], ins[4][:, :, :, :0], ins[5][:, :, :, :0], ins[6]], None)
    off = run(backend, [*ins[:6], torch.full((4,), -1e4, dtype=torch.float64)], None)
    torch.testing.assert_close(off, plain, rtol=0, atol=1e-12)
    with wiola_kernels.use_backend(backend):
        out = wiola_kernels.gcla_attention(*ins)
        (dg,) = torch.autograd.grad(out.sum(), [ins[6]])
    sig = torch.sigmoid(ins[6].detach())
    o_cross = (out.detach() - plain.detach()) / sig[None, :, None, None]
    torch.testing.assert_close(dg, sig * (1 - sig) * o_cross.sum((0, 2, 3)), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS_ALL)
def test_noncontiguous_and_deterministic(backend):
    ins, lt = make_inputs(2, 4, 2, 40, 8, 1, 2, torch.float32, [40, 29])
    nc = [x.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_() for x in ins[:6]]
    nc.append(ins[6].clone().requires_grad_())
    assert not nc[0].is_contiguous()
    g = torch.randn(2, 4, 40, 8)
    out, g1 = run_grad(backend, nc, lt, g)
    close(out, gcla_attention_forward(*[x.detach().double() for x in ins], lt)[0], 1e-4, "out")
    _, g2 = run_grad(backend, nc, lt, g)
    for name, a, b in zip(NAMES, g1, g2):
        assert torch.equal(a, b), f"grad {name} not bitwise reproducible"


def test_opcheck():
    for lens in (None, torch.tensor([7, 3])):
        ins, _ = make_inputs(2, 4, 2, 7, 4, 7, 2, torch.float32, requires_grad=True)
        torch.library.opcheck(gcla_attention_op, (*ins, lens))
        out, lse = gcla_attention_op(*[x.detach() for x in ins], lens)
        torch.library.opcheck(gcla_attention_backward_op,
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


# ---- the Triton kernels (interpreter on CPU; tests/test_gpu-style checks on a GPU below) ----

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
    128 × 32, dk/dv pass 32 × 128) on a sequence spanning several of them, against the oracle."""
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
def test_triton_head_dim_limits():
    """Even d_h up to 256 run (tiles of max(16, next power of two) columns); wider raise a
    ValueError that states the supported range."""
    ins, _ = make_inputs(1, 2, 1, 3, 258, 1, 1)
    with wiola_kernels.use_backend("triton"), pytest.raises(ValueError, match=r"even head widths d_h in \[2, 256\]"):
        wiola_kernels.gcla_attention(*ins)
    ins, _ = make_inputs(1, 2, 1, 3, 2, 3, 1, torch.float64)
    with wiola_kernels.use_backend("triton"):
        out = wiola_kernels.gcla_attention(*ins)
    close(out, gcla_attention_forward(*ins)[0], tolerance(torch.float64, "attention"), "d_h = 2")


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
    (dtype, *case) for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for case in ((2, 8, 2, 257, 64, "causal", [257, 100]), (1, 16, 4, 1000, 128, "paper", None),
                 (3, 6, 3, 1, 64, "causal", [1, 0, 1]))
    if dtype != torch.float32 or case[:5] == (2, 8, 2, 257, 64)])  # the AOT-checked set: wiola_kernels/triton/gcla_attention.GPU_TEST_CASES
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


# ---- compiled ahead of time for sm_90 / sm_80 at the bench shapes (no GPU needed) ----

def _nvidia_toolchain() -> bool:
    """Triton's NVIDIA backend with its bundled ptxas and cuobjdump."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        return False
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.access(os.path.join(bindir, name), os.X_OK) for name in ("ptxas", "cuobjdump"))


SMEM_PER_BLOCK = {90: 227 * 1024, 80: 163 * 1024}  # opt-in shared memory per block (H100/H200, A100)

# Runs in a child process: conftest sets TRITON_INTERPRET=1 here, and interpreted kernels
# cannot be compiled.
_AOT_SCRIPT = """
import json, sys
from wiola_kernels.triton import gcla_attention as tk
arch, head_dim = int(sys.argv[1]), int(sys.argv[2])
shape = next(s for s in tk.BENCH_SHAPES if s["head_dim"] == head_dim)
rows = []
for summary, lengths in (("causal", False), ("paper", True)):
    for cfg in tk.compile_configs(arch, **shape, summary=summary, lengths=lengths):
        use = tk.cubin_resources(cfg.compile(arch), arch)
        rows.append(dict(use, kernel=cfg.name, summary=summary, block_m=cfg.constexprs["BLOCK_M"],
                         block_n=cfg.constexprs["BLOCK_N"], num_warps=cfg.num_warps, num_stages=cfg.num_stages))
print(json.dumps(rows))
"""


@pytest.mark.skipif(not _nvidia_toolchain(), reason="Triton's NVIDIA compile toolchain (ptxas, cuobjdump) is missing")
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_aot_bench_shapes_no_spills_tensor_cores(arch, head_dim):
    """Every GCLA Triton kernel at the bench shapes (bf16, B 4, H 16, H_kv 4, T 4096; causal
    summaries without lengths and paper summaries with lengths), compiled as the JIT would
    on sm_<arch>: no register spills, shared memory within the per-block limit, tensor-core
    MMA instructions (HGMMA / HMMA) in the SASS."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, str(arch), str(head_dim)], capture_output=True,
                          text=True, env=env, cwd=root, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in rows} == {"_gcla_fwd_kernel", "_gcla_bwd_dq_kernel", "_gcla_bwd_dkv_kernel"}
    for r in rows:
        assert r["stack_bytes"] == 0 and r["local_bytes"] == 0 and r["spill_instructions"] == 0, r
        assert r["shared_bytes"] <= SMEM_PER_BLOCK[arch], r
        assert r["tensor_core_instructions"] > 0, r


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
    assert fwd.counts.get("wiola.gcla_attention") == 1 and bwd.counts.get("wiola.gcla_attention_backward") == 1
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
            grads = gcla_attention_backward_op(grad, *[x.detach() for x in ins], lengths, out, lse, backend)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake_out, _ = gcla_attention_op(*[x.detach() for x in ins], lengths)
            fake_grads = gcla_attention_backward_op(grad, *[x.detach() for x in ins], lengths, out, lse, backend)
        for name, real, fake in zip(("out",) + NAMES, (out, *grads), (fake_out, *fake_grads)):
            significant = [s for n, s in zip(real.shape, real.stride()) if n > 1]
            assert significant == [s for n, s in zip(fake.shape, fake.stride()) if n > 1], (backend, S, name)
        close(out, naive(*ins, lengths), tolerance(torch.float32, "attention"), f"{backend} S={S} out")


def test_opcheck_on_the_models_views():
    for S, lens in ((7, None), (1, torch.tensor([7, 3]))):
        ins, grad = model_layout_inputs(2, 4, 2, 7, 4, S, 2, seed=S)
        torch.library.opcheck(gcla_attention_op, (*ins, lens))
        out, lse = gcla_attention_op(*[x.detach() for x in ins], lens)
        torch.library.opcheck(gcla_attention_backward_op, (grad, *[x.detach() for x in ins], lens, out, lse))
