"""Numerics at the edges for rms_norm, srpe, gcla_attention and ATM on every CPU backend
(reference, cpu): huge and tiny magnitudes, all-zero rows, fully masked attention rows,
ATM thresholds of exactly ±1, and NaN/Inf confinement (a non-finite value in one row
never reaches another row or batch element, forward or backward).

What must hold, op by op:

* rms_norm — ``y = γ z / sqrt(mean z² + ε)`` is scale-invariant once ``mean z² ≫ ε``,
  so ``y(s·x) = y(x)`` for every representable ``s·x``; tiny inputs (``mean z² ≪ ε``)
  give ``γ z / √ε`` (ε does its job), all-zero rows give exactly 0 and finite
  gradients. Huge rows too: where the statistic ``Σ z²`` overflows (float32: ``|z| ≳
  1.8e19/√d``, fp32/bf16 inputs; float64: ``≳ 1.3e154/√d``) a finite row is rescaled by
  an exact power of two, so y and the gradients match the float64 oracle for every
  finite z up to the dtype's maximum (gradients work with ẑ = z/r, nothing overflows);
  rows with NaN/Inf stay non-finite and alone.
* srpe — linear in q, k: huge/tiny magnitudes keep the relative tolerance as long as
  the output is representable.
* gcla_attention — rows whose keys are all masked by ``lengths`` are exactly 0 with
  zero (finite) gradients; scores up to ~1e30 in float32 saturate the softmax correctly.
* ATM — ``τ = 1`` never merges (cos ≤ 1); ``τ = −1`` merges every non-opposite adjacent
  pair greedily (zero vectors have s = 0 > −1; exactly opposite vectors have s = −1 and
  never merge; NaN/Inf tokens never merge). The criterion is exactly scale-invariant at
  every magnitude: a token whose ``‖x‖²`` would overflow, underflow or lose precision in
  the accumulation dtype is rescaled by a power of two first (the test is homogeneous in
  each token), and ``D² > τ² n_t n_{t+1}`` is compared as with an unbounded exponent
  range, so scaling any token by any power of two that keeps it representable never
  changes a decision — from subnormal to the dtype's maximum, in every dtype. The pair
  mean is ``x_t/2 + x_{t+1}/2``: no overflow up to the dtype's maximum.

SRPE position range. Every backend computes the angle ``p·ω_j·(1 + 1/k_s)`` in float64
and reduces it modulo 2π in float64 (the CPU kernel's Cody–Waite reduction uses FMA, so
the reduction adds ~1e-16 absolute). The remaining error is that of the float64 angle
itself: ``ω_j`` and the product are each rounded once, so the angle error is at most
``≈ p·ω_j·(1 + 1/k_s)·2^-52`` (two half-ulps of a number of size ``p·ω_j(1+1/k_s)``), and
a pair rotated by a wrong angle δ has relative error ≈ δ. With ``ω_0 = 1`` the worst pair
meets the float32 tolerance 1e-5 while ``p ≤ 1e-5·2^52 / (1 + 1/k_s) ≈ 4.5e10/(1 + 1/k_s)``:
for the default ``k_s = 8`` that is ``p ≤ 4.0e10 ≈ 2^35.2``; for ``k_s = 1``,
``p ≤ 2.3e10 ≈ 2^34.4``. **Largest safe position: 2^34 (≈1.7e10) for every k_s ≥ 1;
2^35 for the default k_s = 8.** Measured (d_h = 128, defaults, against a 200-bit
mpmath evaluation): relative error 5e-8 at 2^31, 4e-7 at 2^35, 3.4e-6 at 2^38,
1.6e-5 at 2^40 — the whole-vector error is ~10× below the worst-pair bound. The SPEC
requires 2^20; tests below check 2^31 (and 2^34 against mpmath). Positions are int64;
beyond 2^53 the float64 conversion of p itself is inexact. ``wk.srpe`` refuses CPU
positions beyond ``wiola_kernels.ops.srpe.max_accurate_position(k_s)`` (tested below).
"""

from __future__ import annotations

import math

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import reference
from wiola_kernels.reference import atm as atm_ref
from wiola_kernels.reference.gcla_attention import gcla_attention_forward
from wiola_kernels.testing import available_backends, rel_err, tolerance


def _cpu_backends(op: str) -> list[str]:
    return [b for b in available_backends(op, "cpu") if b in ("cpu", "reference")]


RMS_BACKENDS = _cpu_backends("rms_norm")
SRPE_BACKENDS = _cpu_backends("srpe")
GCLA_BACKENDS = _cpu_backends("gcla_attention")
ATM_BACKENDS = _cpu_backends("atm")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _finite(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


# =====================================================================================
# rms_norm
# =====================================================================================

def _rms(backend, x, w, s, eps=1e-6, grad=None):
    x = x.clone().requires_grad_(grad is not None)
    w = w.clone().requires_grad_(grad is not None)
    s = s.clone().requires_grad_(grad is not None)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps)
        if grad is None:
            return y.detach(), None
        return y.detach(), torch.autograd.grad(y, (x, w, s), grad)


@pytest.mark.parametrize("backend", RMS_BACKENDS)
@pytest.mark.parametrize("scale", [1e-3, 1e3, 1e10, 1e17])
def test_rms_norm_scale_invariant_in_range(backend, scale):
    g = _gen()
    x = torch.randn(8, 64, generator=g)
    w, s = torch.rand(64, generator=g) + 0.5, torch.zeros(64)
    y1, _ = _rms(backend, x, w, s, eps=1e-12)
    ys, _ = _rms(backend, x * scale, w, s, eps=1e-12)
    assert _finite(ys)
    # eps/mean(z²) ≤ 1e-6 at scale 1e-3: the two outputs agree to the fp32 tolerance.
    assert rel_err(ys, y1) <= 1e-5
    assert rel_err(ys, reference.rms_norm((x * scale).double(), w.double(), s.double(), 1e-12)) <= 1e-5


def _rms_rescaled_oracle(x, w, grad, eps=1e-6):
    """float64 ``(y, ∂L/∂x, ∂L/∂γ)`` of rms_norm with δ = 0, row by row: each row is
    first scaled by an exact power of two 2^-k to max|x| < 1, using y(x; ε) = y(2^-k x;
    2^-2k ε) and ∂y/∂x(x; ε) = 2^-k ∂y/∂x(2^-k x; 2^-2k ε), so the float64 reference
    never sees a huge row (nor the code path under test)."""
    wd = w.double()
    ys, gxs, gw = [], [], torch.zeros_like(wd)
    for xr, gr in zip(x.double(), grad.double()):
        c = 2.0 ** -int(torch.frexp(xr.abs().max()).exponent)
        xs, wr = (xr * c).unsqueeze(0).requires_grad_(), wd.clone().requires_grad_()
        y = reference.rms_norm(xs, wr, torch.zeros_like(wd), eps * c * c)
        gx, gwr = torch.autograd.grad(y, (xs, wr), gr.unsqueeze(0))
        ys.append(y[0].detach())
        gxs.append(gx[0] * c)
        gw += gwr
    return torch.stack(ys), torch.stack(gxs), gw


@pytest.mark.parametrize("backend", RMS_BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e20), (torch.float32, 1e30), (torch.float32, 1e38),
                                         (torch.float32, 1.1e38), (torch.bfloat16, 1e37), (torch.float64, 1e200),
                                         (torch.float64, 5e307)])
def test_rms_norm_scale_invariant_huge(backend, dtype, scale):
    """Rows whose Σz² overflows the statistic's dtype (every other row here; |x| up to
    3·scale, i.e. to the dtype's maximum) give y(x) and the float64 oracle's gradients;
    the normal rows beside them are unaffected."""
    g = _gen()
    x = torch.randn(8, 64, generator=g, dtype=torch.float64).clamp(-3, 3)
    w, s = torch.rand(64, generator=g) + 0.5, torch.zeros(64)
    huge = [0, 2, 4, 6]
    xs = x.clone()
    xs[huge] *= scale
    x, xs, w, s = x.to(dtype), xs.to(dtype), w.to(dtype), s.to(dtype)
    grad = torch.randn(8, 64, generator=g).to(dtype)
    assert torch.isfinite(xs).all() and torch.isinf(xs[0].double().pow(2).sum().to(dtype).float())
    y1, _ = _rms(backend, x, w, s)
    ys, (gx, gw, gs) = _rms(backend, xs, w, s, grad=grad)
    assert ys.dtype == dtype and _finite(ys, gx, gw, gs)
    assert rel_err(ys[huge], y1[huge]) <= max(tolerance(dtype), 1e-5)  # ε/mean z² ~ 1e-6 at scale 1
    want_y, want_gx, want_gw = _rms_rescaled_oracle(xs, w, grad)
    tol = tolerance(dtype)
    gtol = tol * (10 if dtype == torch.bfloat16 else 1)  # the grad sums many rounded terms
    for r in range(8):  # row by row: huge rows' ∂L/∂x are ~1/scale of the others'
        assert rel_err(ys[r], want_y[r]) <= tol, f"y row {r}"
        assert rel_err(gx[r], want_gx[r]) <= gtol, f"grad_x row {r}"
    assert rel_err(gw, want_gw) <= gtol
    assert rel_err(gs, want_gx.sum(0)) <= gtol


@pytest.mark.parametrize("backend", RMS_BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e30), (torch.bfloat16, 1e37), (torch.float64, 1e200)])
def test_rms_norm_huge_row_beside_nonfinite_rows(backend, dtype, scale):
    """A huge (rescaled) row next to a NaN row and an Inf row: the huge row is right,
    the bad rows are non-finite, and the other rows are bitwise what they are alone."""
    g = _gen(4)
    x = torch.randn(6, 40, generator=g, dtype=torch.float64)
    x[1] *= scale
    w, s = (torch.rand(40, generator=g) + 0.5).to(dtype), torch.zeros(40, dtype=dtype)
    grad = torch.randn(6, 40, generator=g).to(dtype)
    x = x.to(dtype)
    xb = x.clone()
    xb[3, 5] = float("nan")
    xb[4, 9] = float("inf")
    y0, (gx0, _, _) = _rms(backend, x, w, s, grad=grad)
    y, (gx, _, _) = _rms(backend, xb, w, s, grad=grad)
    clean = [0, 1, 2, 5]
    assert torch.equal(y[clean], y0[clean]) and torch.equal(gx[clean], gx0[clean])
    for bad in (3, 4):
        assert not torch.isfinite(y[bad]).all() and not torch.isfinite(gx[bad]).all()
    want_y, want_gx, _ = _rms_rescaled_oracle(x[1:2], w, grad[1:2])
    assert rel_err(y[1], want_y[0]) <= tolerance(dtype)
    assert rel_err(gx[1], want_gx[0]) <= tolerance(dtype) * (10 if dtype == torch.bfloat16 else 1)


@pytest.mark.parametrize("backend", RMS_BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e-30), (torch.float32, 1e-20), (torch.bfloat16, 1e-30),
                                         (torch.float16, 1e-6), (torch.float16, 2e4), (torch.bfloat16, 1e18)])
def test_rms_norm_tiny_and_near_limits_match_float64(backend, dtype, scale):
    """Tiny rows are ε-dominated (y = γz/√ε); fp16 up to ~6e4 and bf16 up to ~1e18 stay exact-ish."""
    g = _gen(1)
    x = (torch.randn(8, 48, generator=g).clamp(-3, 3) * scale).to(dtype)
    w, s = (torch.rand(48, generator=g) + 0.5).to(dtype), torch.zeros(48, dtype=dtype)
    grad = torch.randn(8, 48, generator=g).to(dtype)
    y, (gx, gw, gs) = _rms(backend, x, w, s, grad=grad)
    assert _finite(y, gx, gw, gs)
    xd, wd, sd = x.double().requires_grad_(), w.double().requires_grad_(), s.double().requires_grad_()
    want = reference.rms_norm(xd, wd, sd, 1e-6)
    assert rel_err(y, want) <= tolerance(dtype)
    wgx, wgw, wgs = torch.autograd.grad(want, (xd, wd, sd), grad.double())
    tol = tolerance(dtype) * (10 if dtype != torch.float32 else 1)  # the grad sums many rounded terms
    for got, ref_g in ((gx, wgx), (gw, wgw), (gs, wgs)):
        # A representable reference: gradients of huge inputs can be tiny, tiny inputs' large.
        if torch.isfinite(ref_g.to(dtype)).all():
            assert rel_err(got, ref_g) <= tol


@pytest.mark.parametrize("backend", RMS_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_rms_norm_zero_rows_with_zero_shift(backend, dtype):
    """δ = 0 and an all-zero row: y = 0 exactly, gradients finite (∂y/∂x = γ/√ε there)."""
    g = _gen(2)
    x = torch.randn(5, 40, generator=g).to(dtype)
    x[1] = 0
    x[4] = 0
    w, s = (torch.rand(40, generator=g) + 0.5).to(dtype), torch.zeros(40, dtype=dtype)
    grad = torch.randn(5, 40, generator=g).to(dtype)
    y, (gx, gw, gs) = _rms(backend, x, w, s, eps=1e-5, grad=grad)
    assert _finite(y, gx, gw, gs)
    assert (y[1] == 0).all() and (y[4] == 0).all()
    want_gx = w.double() * grad[1].double() / math.sqrt(1e-5)
    assert rel_err(gx[1], want_gx) <= tolerance(dtype)


@pytest.mark.parametrize("backend", RMS_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_rms_norm_nonfinite_row_is_confined(backend, bad):
    g = _gen(3)
    x = torch.randn(6, 40, generator=g)
    w, s = torch.rand(40, generator=g) + 0.5, 0.1 * torch.randn(40, generator=g)
    grad = torch.randn(6, 40, generator=g)
    y0, (gx0, _, _) = _rms(backend, x, w, s, grad=grad)
    xb = x.clone()
    xb[2, 7] = bad
    y, (gx, gw, gs) = _rms(backend, xb, w, s, grad=grad)
    others = [0, 1, 3, 4, 5]
    assert torch.equal(y[others], y0[others]) and torch.equal(gx[others], gx0[others])
    assert not torch.isfinite(y[2]).all()  # the bad row is affected
    # A non-finite gradient in one row reaches only that row of grad_x.
    gb = grad.clone()
    gb[4, 0] = bad
    _, (gx2, _, _) = _rms(backend, x, w, s, grad=gb)
    others = [0, 1, 2, 3, 5]
    assert torch.equal(gx2[others], gx0[others])
    # grad_weight / grad_shift sum over all rows: they are necessarily non-finite then.
    assert not _finite(gw, gs)


# =====================================================================================
# srpe
# =====================================================================================

def _srpe(backend, q, k, pos, grad=None, **kw):
    q = q.clone().requires_grad_(grad is not None)
    k = k.clone().requires_grad_(grad is not None)
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos, **kw)
        if grad is None:
            return qo.detach(), ko.detach(), None
        return qo.detach(), ko.detach(), torch.autograd.grad((qo, ko), (q, k), grad)


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
def test_srpe_float32_meets_tolerance_up_to_2_31(backend):
    g = _gen(4)
    b, h, h_kv, t, dh = 2, 2, 1, 64, 128
    pos = torch.randint(2**31 - 2**24, 2**31 + 1, (b, t), generator=g)
    pos[0, :5] = torch.tensor([2**31, 2**31 - 1, 2**30, 2**24 + 1, 2**20])
    q, k = torch.randn(b, h, t, dh, generator=g), torch.randn(b, h_kv, t, dh, generator=g)
    for ks in (8.0, 1.0):
        qo, ko, _ = _srpe(backend, q, k, pos, spiral_divisor=ks)
        q_ref, k_ref = reference.srpe(q.double(), k.double(), pos, spiral_divisor=ks)
        assert rel_err(qo, q_ref) <= 1e-5 and rel_err(ko, k_ref) <= 1e-5


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
def test_srpe_large_positions_against_mpmath(backend):
    """The float64 angle error bound of the module docstring, against a 200-bit evaluation."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.prec = 200
    dh, theta, ks, a_s, f_s = 64, 10000.0, 8.0, 0.1, 0.01
    half = dh // 2
    g = _gen(5)
    for p in (2**20, 2**31, 2**34):
        q = torch.randn(1, 1, 1, dh, generator=g, dtype=torch.float64)
        c, s = [], []
        for j in range(half):
            om = mpmath.power(theta, mpmath.mpf(-2 * j) / dh)
            r = 1 + mpmath.mpf(a_s) * mpmath.sin(p * om * mpmath.mpf(f_s))
            ang = p * om * (1 + 1 / mpmath.mpf(ks))
            c.append(float(r * mpmath.cos(ang)))
            s.append(float(r * mpmath.sin(ang)))
        c64, s64 = torch.tensor(c, dtype=torch.float64), torch.tensor(s, dtype=torch.float64)
        x1, x2 = q[..., :half], q[..., half:]
        exact = torch.cat((x1 * c64 - x2 * s64, x1 * s64 + x2 * c64), -1)
        qo, _, _ = _srpe(backend, q.float(), q.float(), torch.tensor([p]), theta=theta, spiral_divisor=ks,
                         radial_amplitude=a_s, radial_frequency=f_s)
        bound = max(p * (1 + 1 / ks) * 2.0**-52, 1e-7)  # worst pair; + float32 rounding of the output
        assert rel_err(qo, exact) <= min(bound, 1e-5), p


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
@pytest.mark.parametrize("dtype,scale,a_s", [(torch.float32, 1e30, 0.1), (torch.float32, 1e-30, 0.1),
                                             (torch.bfloat16, 1e37, 0.0), (torch.bfloat16, 1e-30, 0.1),
                                             (torch.float16, 2e4, 0.0), (torch.float16, 1e-3, 0.1)])
def test_srpe_huge_and_tiny_magnitudes(backend, dtype, scale, a_s):
    """Linear in q, k: the relative tolerance holds while outputs are representable (|y| ≤ √2·(1+a_s)·|q|)."""
    g = _gen(6)
    q = (torch.randn(2, 2, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype)
    k = (torch.randn(2, 1, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype)
    pos = torch.randint(0, 2**20, (2, 9), generator=g)
    grad = (torch.randn(2, 2, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype), \
        (torch.randn(2, 1, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype)
    qo, ko, (gq, gk) = _srpe(backend, q, k, pos, grad=grad, radial_amplitude=a_s)
    assert _finite(qo, ko, gq, gk)
    q_ref, k_ref = reference.srpe(q.double(), k.double(), pos, radial_amplitude=a_s)
    gq_ref, gk_ref = reference.srpe_backward(grad[0].double(), grad[1].double(), pos, radial_amplitude=a_s)
    for got, want in ((qo, q_ref), (ko, k_ref), (gq, gq_ref), (gk, gk_ref)):
        assert rel_err(got, want) <= tolerance(dtype)


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_srpe_nonfinite_token_is_confined(backend, bad):
    g = _gen(7)
    q, k = torch.randn(2, 4, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    pos = torch.randint(0, 1000, (2, 10), generator=g)
    grad = torch.randn(2, 4, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    q0, k0, (gq0, gk0) = _srpe(backend, q, k, pos, grad=grad)
    qb = q.clone()
    qb[1, 2, 3, 1] = bad
    qo, ko, _ = _srpe(backend, qb, k, pos)
    mask = torch.ones_like(qo, dtype=torch.bool)
    mask[1, 2, 3] = False  # the token's own head vector (its pair partner) may be affected
    assert torch.equal(qo[mask], q0[mask]) and torch.equal(ko, k0)
    gb = (grad[0], grad[1].clone())
    gb[1][0, 1, 9, 7] = bad
    _, _, (gq, gk) = _srpe(backend, q, k, pos, grad=gb)
    mask = torch.ones_like(gk, dtype=torch.bool)
    mask[0, 1, 9] = False
    assert torch.equal(gq, gq0) and torch.equal(gk[mask], gk0[mask])


# =====================================================================================
# gcla_attention
# =====================================================================================

def _gcla_inputs(B=2, H=4, H_kv=2, T=21, dh=8, S=1, L=2, dtype=torch.float32, seed=8, scales=None):
    g = _gen(seed)
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


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
@pytest.mark.parametrize("S", [1, 21])
def test_gcla_fully_masked_rows(backend, S):
    """lengths = 0 (every key of the row masked) and a partial length: rows past the length are
    exactly 0, gradients are finite, and a fully masked batch row contributes nothing."""
    ins = _gcla_inputs(S=S)
    lengths = torch.tensor([0, 7])
    grad = torch.randn(2, 4, 21, 8, generator=_gen(9))
    out, grads = _gcla(backend, ins, lengths, grad)
    assert _finite(out, *grads)
    assert (out[0] == 0).all() and (out[1, :, 7:] == 0).all()
    for name, gr in zip(("q_rot", "k_rot", "v", "q", "kc", "vc"), grads[:6]):
        assert (gr[0] == 0).all(), name
    assert (grads[0][1, :, 7:] == 0).all() and (grads[1][1, :, 7:] == 0).all() and (grads[2][1, :, 7:] == 0).all()
    # All rows of the batch masked: output 0, every gradient (gate included) 0.
    out, grads = _gcla(backend, ins, torch.tensor([0, 0]), grad)
    assert (out == 0).all() and all(bool((gr == 0).all()) for gr in grads)


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
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
    assert _finite(out)
    want, _ = gcla_attention_forward(*[x.double() for x in ins], lengths)
    assert rel_err(out, want) <= tolerance(dtype, "attention")


def _poison(ins, which, index, bad):
    ins = [x.clone() for x in ins]
    ins[which][index] = bad
    return ins


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
@pytest.mark.parametrize("which", range(7))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gcla_nonfinite_batch_row_is_confined(backend, which, bad):
    """A NaN/Inf anywhere in batch row 0 (or in one head's gate) never reaches batch row 1's output
    or its per-row gradients; a non-finite grad_out in row 0 likewise."""
    ins = _gcla_inputs(S=1)
    grad = torch.randn(2, 4, 21, 8, generator=_gen(10))
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


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gcla_nonfinite_padding_is_ignored(backend, bad):
    """Garbage (NaN/Inf) in padded positions t ≥ len_b of k_rot, v, q_rot, q, kc, vc never reaches
    the valid rows (the kernels skip all work past the length)."""
    ins = _gcla_inputs(S=21)
    lengths = torch.tensor([12, 21])
    grad = torch.randn(2, 4, 21, 8, generator=_gen(11))
    out0, g0 = _gcla(backend, ins, lengths, grad)
    bad_ins = [x.clone() for x in ins]
    for i in range(6):
        bad_ins[i][0, :, 12:] = bad
    out, grads = _gcla(backend, bad_ins, lengths, grad)
    assert torch.equal(out, out0)
    for name, gr, gr0 in zip(("q_rot", "k_rot", "v", "q", "kc", "vc", "gate"), grads, g0):
        assert torch.equal(gr[:, :, :12] if gr.dim() > 1 else gr, gr0[:, :, :12] if gr0.dim() > 1 else gr0), name


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
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
    torch.testing.assert_close(out[0, :, :40], clean[0, :, :40], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
@pytest.mark.parametrize("where", ["q_rot", "grad_out"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gcla_nonfinite_query_row_does_not_reach_later_keys(backend, where, bad):
    """A NaN/Inf in query row 40 (or in its upstream gradient) reaches dk/dv only of the keys
    that row attends to (j ≤ 40): keys j > 40 are never seen by it, so their gradients stay
    finite (a dense dS^T @ Q or P^T @ dO would give 0 · NaN = NaN there)."""
    ins = _gcla_inputs(T=80, S=1)
    grad = torch.randn(2, 4, 80, 8, generator=_gen(12))
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


# =====================================================================================
# ATM
# =====================================================================================

def _merge(backend, x, tau, lengths=None, pos=None):
    b, t, _ = x.shape
    pos = torch.arange(t).expand(b, t) if pos is None else pos
    with wk.use_backend(backend):
        return wk.atm_merge(x, pos, tau, lengths)


def _greedy(cand_rows: list[list[bool]]) -> list[list[int]]:
    """index maps of the greedy left-to-right scan over candidate edges."""
    maps = []
    for cand in cand_rows:
        t = len(cand) + 1
        m, slot, i = [0] * t, 0, 0
        while i < t:
            m[i] = slot
            if i + 1 < t and cand[i]:
                m[i + 1] = slot
                i += 1
            i += 1
            slot += 1
        maps.append(m)
    return maps


@pytest.mark.parametrize("backend", ATM_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_atm_threshold_one_never_merges(backend, dtype):
    g = _gen(12)
    x = torch.randint(-2, 3, (3, 12, 5), generator=g).to(dtype)
    x[:, 1::2] = x[:, 0::2]          # every other token identical to its predecessor (s = 1)
    x[1] = 0                         # all-zero row (s = 0)
    x[2, :, :] = 7.0                 # all tokens identical
    merged, _, mlen, imap = _merge(backend, x, 1.0)
    assert (mlen == 12).all() and torch.equal(imap, torch.arange(12).expand(3, 12))
    assert torch.equal(merged, x)


@pytest.mark.parametrize("backend", ATM_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_atm_threshold_minus_one_merges_all_but_opposite(backend, dtype):
    g = _gen(13)
    b, t, d = 3, 15, 4
    x = torch.randint(-3, 4, (b, t, d), generator=g).double()
    x[x.abs().sum(-1) == 0] = 1.0
    x[0, 3] = -x[0, 2]               # exactly opposite: s = −1, not > −1
    x[0, 9] = -x[0, 8]
    x[1, 5] = 0                      # zero vector: s = 0 > −1, merges
    x[2, 1] = -x[2, 0]
    x[2, 2] = -x[2, 1]
    x[2, 3] = -x[2, 2]               # a run of opposites: edges 0, 1, 2 are not candidates
    lengths = torch.tensor([t, 11, t])
    xs = x.to(dtype)
    merged, mpos, mlen, imap = _merge(backend, xs, -1.0, lengths)
    dots = (x[:, :-1] * x[:, 1:]).sum(-1)          # small integers: exact
    nsq = (x * x).sum(-1)
    opposite = (dots < 0) & (dots * dots == nsq[:, :-1] * nsq[:, 1:])   # s = −1 exactly
    cand = (~opposite).tolist()
    for r in range(b):
        cand[r] = [c and i + 1 < int(lengths[r]) for i, c in enumerate(cand[r])]
    want = torch.tensor(_greedy(cand))
    for r in range(b):  # padding: T' + (t − len)
        L = int(lengths[r])
        if L < t:
            want[r, L:] = want[r, L - 1] + 1 + torch.arange(t - L)
    assert torch.equal(imap, want)
    assert torch.equal(mlen, torch.tensor([int(want[r, int(lengths[r]) - 1]) + 1 for r in range(b)]))
    r_merged, _, _, _ = atm_ref.atm_merge(xs.double(), torch.arange(t).expand(b, t), -1.0, lengths)
    assert rel_err(merged, r_merged) <= tolerance(dtype)


@pytest.mark.parametrize("backend", ATM_BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e15), (torch.float32, 1e-15), (torch.float64, 1e60),
                                         (torch.float64, 1e-60), (torch.bfloat16, 1e15), (torch.float16, 1e4),
                                         (torch.float16, 1e-3)])
def test_atm_scale_invariant_in_range(backend, dtype, scale):
    """Identical neighbours merge, orthogonal ones don't, at any magnitude whose squared
    norms stay normal in the accumulation dtype; merged values stay exact."""
    x = torch.zeros(2, 6, 4, dtype=torch.float64)
    x[:, 0, 0] = x[:, 1, 0] = 1.5          # identical: merge
    x[:, 2, 1] = 1.0                       # orthogonal to both neighbours
    x[:, 3, 2] = x[:, 4, 2] = -0.75         # identical: merge
    x[:, 5, 3] = 1.25
    xs = (x * scale).to(dtype)
    merged, _, mlen, imap = _merge(backend, xs, 0.5)
    assert torch.equal(imap, torch.tensor([0, 0, 1, 2, 2, 3]).expand(2, 6)) and (mlen == 4).all()
    want = torch.zeros_like(x)
    want[:, :4] = x[:, [0, 2, 3, 5]]
    assert rel_err(merged, (want * scale).to(dtype).double()) <= tolerance(dtype) and _finite(merged)


@pytest.mark.parametrize("backend", ATM_BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e25), (torch.float32, 1e-25), (torch.float32, 2e38),
                                         (torch.float32, 1e-40), (torch.float32, 1e-44),
                                         (torch.bfloat16, 1e30), (torch.bfloat16, 1e38), (torch.bfloat16, 1e-38),
                                         (torch.float16, 4e4), (torch.float16, 1e-7),
                                         (torch.float64, 1e150), (torch.float64, 1e-150), (torch.float64, 1e300),
                                         (torch.float64, 1e-300), (torch.float64, 1e-320)])
def test_atm_scale_invariant_extreme(backend, dtype, scale):
    """As in range, out to the dtype's limits (|x| up to ~1.5·scale, subnormals included):
    identical neighbours merge, orthogonal ones don't; τ = 1 still never merges."""
    test_atm_scale_invariant_in_range(backend, dtype, scale)
    x = torch.zeros(1, 2, 4, dtype=torch.float64)
    x[0, :, 0] = 1.5
    assert int(_merge(backend, (x * scale).to(dtype), 1.0)[2][0]) == 2


# A huge and a tiny token (powers of two, so exact in the dtype) times the same direction u.
_U = [1.0, 2.0, -1.0, 0.5]
_HUGE_TINY = [(torch.float32, 2.0 ** 125, 2.0 ** -140), (torch.bfloat16, 2.0 ** 125, 2.0 ** -125),
              (torch.float16, 2.0 ** 14, 2.0 ** -23), (torch.float64, 2.0 ** 1020, 2.0 ** -1070)]


@pytest.mark.parametrize("backend", ATM_BACKENDS)
@pytest.mark.parametrize("dtype,huge,tiny", _HUGE_TINY)
def test_atm_huge_and_tiny_parallel_neighbours(backend, dtype, huge, tiny):
    """cos(huge·u, tiny·u) = 1 and cos(huge·u, −tiny·u) = −1 whatever the magnitudes."""
    u = torch.tensor(_U, dtype=torch.float64)
    x = torch.stack([huge * u, tiny * u, -huge * u, tiny * u, -tiny * u, huge * u]).unsqueeze(0)
    xs = x.to(dtype)
    assert torch.equal(xs.double(), x)
    merged, _, mlen, imap = _merge(backend, xs, 0.5)
    assert imap.tolist() == [[0, 0, 1, 2, 3, 4]] and mlen.tolist() == [5]   # (−tiny·u, huge·u): s = −1
    want = torch.zeros_like(x)
    want[0, 0] = (huge * u + tiny * u) / 2
    want[0, 1:5] = x[0, 2:6]
    torch.testing.assert_close(merged.double(), want, rtol=tolerance(dtype), atol=0)
    # s = −1 exactly: never > τ, even at τ = −1; s = +1 never > 1.
    assert _merge(backend, xs[:, 3:5], -1.0)[2].tolist() == [2]
    assert _merge(backend, xs[:, 0:2], 1.0)[2].tolist() == [2]
    assert _merge(backend, xs[:, 0:2], math.nextafter(1.0, 0.0))[2].tolist() == [1]


@pytest.mark.parametrize("backend", ATM_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_atm_nonfinite_token_is_confined(backend, bad):
    """A NaN/Inf token is never merged (s is NaN, or the pair would not be finite), appears only
    in its own slot, and never changes another row; gradients likewise stay in their slots."""
    g = _gen(14)
    b, t, d = 3, 10, 4
    x = torch.ones(b, t, d) + 0.01 * torch.randn(b, t, d, generator=g)  # all neighbours similar
    merged0, _, mlen0, imap0 = _merge(backend, x, 0.5)
    xb = x.clone()
    xb[1, 4, 2] = bad
    xb.requires_grad_()
    with wk.use_backend(backend):
        merged, _, mlen, imap = wk.atm_merge(xb, torch.arange(t).expand(b, t), 0.5)
    assert torch.equal(merged[[0, 2]], merged0[[0, 2]].detach()) and torch.equal(imap[[0, 2]], imap0[[0, 2]])
    bad_slot = int(imap[1, 4])
    assert int((imap[1] == bad_slot).sum()) == 1  # a NaN/Inf token is never merged
    finite_rows = torch.isfinite(merged[1].detach()).all(-1)
    assert not finite_rows[bad_slot] and finite_rows[:bad_slot].all() and finite_rows[bad_slot + 1:int(mlen[1])].all()
    # Backward: a non-finite slot gradient reaches only the tokens mapped to it.
    grad = torch.randn(b, t, d, generator=g)
    grad[1, bad_slot, 0] = bad
    with wk.use_backend(backend):
        (gx,) = torch.autograd.grad(merged, xb, grad)
    hit = (imap[1] == bad_slot)
    assert torch.isfinite(gx[[0, 2]]).all() and torch.isfinite(gx[1][~hit]).all()
    # Unmerge and its backward: a non-finite slot reaches only its tokens; a non-finite
    # token gradient reaches only its slot.
    y = torch.randn(b, t, d, generator=g)
    y[2, 1, 3] = bad
    y.requires_grad_()
    with wk.use_backend(backend):
        restored = wk.atm_unmerge(y, imap0)
        gr = torch.randn(b, t, d, generator=g)
        gr[0, 7, 1] = bad
        (gy,) = torch.autograd.grad(restored, y, gr)
    tok_hit = imap0[2] == 1
    assert torch.isfinite(restored[[0, 1]]).all() and torch.isfinite(restored[2][~tok_hit]).all()
    assert not torch.isfinite(restored[2][tok_hit]).all(-1).any()
    slot_hit = torch.zeros(t, dtype=torch.bool)
    slot_hit[int(imap0[0, 7])] = True
    assert torch.isfinite(gy[[1, 2]]).all() and torch.isfinite(gy[0][~slot_hit]).all()


@pytest.mark.parametrize("k_s", [8.0, 1.0, 0.5])
def test_srpe_refuses_positions_beyond_the_accurate_range(k_s):
    from wiola_kernels.ops.srpe import max_accurate_position

    limit = max_accurate_position(k_s)
    assert limit == int(1e-5 * 2.0**52 / abs(1 + 1 / k_s))
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 2, 8)
    wk.srpe(q, k, torch.tensor([0, limit]), spiral_divisor=k_s)  # at the limit: accepted
    with pytest.raises(ValueError, match="position_ids must lie within"):
        wk.srpe(q, k, torch.tensor([0, limit + 1]), spiral_divisor=k_s)
    with pytest.raises(ValueError, match="position_ids must lie within"):
        wk.srpe(q, k, torch.tensor([-(limit + 1), 0]), spiral_divisor=k_s)
    assert max_accurate_position(-1.0) == 2**53  # 1 + 1/k_s = 0: no rotation at all
