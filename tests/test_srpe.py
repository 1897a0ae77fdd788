"""SRPE (SPEC §4, §9): what only srpe has. The properties every op shares (forward and
backward against the float64 oracle per backend and dtype, the model's strided views read
without a copy, gradcheck, bitwise determinism across thread counts, unmodified inputs) are
in tests/test_all_ops.py; opcheck, torch.compile, the bad-input messages and the
``position_ids`` forms every backend shares in tests/test_op_layer.py. The oracle is
tests/oracles.py's ``srpe_oracle``.

SRPE position range. Every backend computes the angle ``p·ω_j·(1 + 1/k_s)`` in float64
and reduces it modulo 2π in float64 (the CPU kernel's Cody–Waite reduction uses FMA, so
the reduction adds ~1e-16 absolute). The remaining error is that of the float64 angle
itself: ``ω_j`` and the product are each rounded once, so the angle error is at most
``≈ p·ω_j·(1 + 1/k_s)·2^-52``, and a pair rotated by a wrong angle δ has relative error ≈ δ.
With ``ω_0 = 1`` the worst pair meets the float32 tolerance 1e-5 while
``p ≤ 1e-5·2^52 / (1 + 1/k_s)``: ``2^35.2`` for the default ``k_s = 8``, ``2^34.4`` for
``k_s = 1``. The SPEC requires 2^20; the tests below check 2^31 (and 2^34 against mpmath).
``wk.srpe`` refuses CPU positions beyond ``wiola_kernels.ops.srpe.max_accurate_position(k_s)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wiola_kernels as wk
from wiola_kernels import SpiralRotaryEmbedding, shapes
from wiola_kernels.testing import assert_close_rel, available_backends, rel_err, srpe_tolerance, tolerance

from helpers import finite, forward_backward, gen, gpu_only, strided_view
from op_cases import F64, OpCase, Public, randn64
from oracles import srpe_oracle

BACKENDS = available_backends("srpe")
DEFAULTS = dict(theta=10000.0, spiral_divisor=8.0, radial_amplitude=0.1, radial_frequency=0.01)


def inputs(b, h, h_kv, t, dh, dtype=torch.float32, max_pos=4096, seed=0):
    g = gen(seed)
    q = torch.randn(b, h, t, dh, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, h_kv, t, dh, generator=g, dtype=torch.float64).to(dtype)
    pos = torch.randint(0, max_pos, (b, t), generator=g)  # arbitrary: not monotonic, may repeat
    return q, k, pos


def run(backend, q, k, pos, grad=None, **params):
    """q_out, k_out and (with ``grad`` = (g_q, g_k)) ∂q, ∂k of wk.srpe on ``backend``."""
    q, k = q.detach().requires_grad_(grad is not None), k.detach().requires_grad_(grad is not None)
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos, **params)
        if grad is None:
            return qo.detach(), ko.detach()
        return (qo.detach(), ko.detach(), *torch.autograd.grad((qo, ko), (q, k), grad))


def oracle(x, pos, grad=None, theta=10000.0, spiral_divisor=8.0, radial_amplitude=0.1, radial_frequency=0.01):
    """The float64 oracle of one of q, k (with ``grad``: and its vector-Jacobian product)."""
    params = (theta, spiral_divisor, radial_amplitude, radial_frequency)
    if grad is None:
        return srpe_oracle(x, pos, *params)
    x = x.detach().double().requires_grad_()
    y = srpe_oracle(x, pos, *params)
    return y.detach(), torch.autograd.grad(y, x, grad.double())[0]


# --- the formula ----------------------------------------------------------------------------

def test_oracle_hand_worked_values_and_radius():
    # d_h = 2: one pair, ω_0 = 1, Θ = 1.125 p, r = 1 + 0.1 sin(0.01 p).
    x = torch.tensor([1.0, 0.0], dtype=torch.float64).view(1, 1, 1, 2)
    for p in (0, 1, 100):
        r = 1.0 + 0.1 * math.sin(0.01 * p)
        expected = torch.tensor([r * math.cos(1.125 * p), r * math.sin(1.125 * p)], dtype=torch.float64)
        assert_close_rel(oracle(x, torch.tensor([p])).flatten(), expected, 1e-15)
    q = torch.randn(1, 2, 1, 8, generator=gen(1), dtype=torch.float64)
    assert torch.equal(oracle(q, torch.tensor([0])), q)  # p = 0 is the identity for any d_h
    # Not norm-preserving: each pair is scaled by its own r_j(p).
    q = torch.randn(2, 2, 6, 8, generator=gen(2), dtype=torch.float64)
    pos = torch.randint(0, 4096, (2, 6), generator=gen(3))
    pos[:, 0] = 150  # sin(150 · 0.01) ≈ 1: r ≈ 1.1 for the first pair
    out = oracle(q, pos)
    omega = 10000.0 ** (-2.0 * torch.arange(4, dtype=torch.float64) / 8)
    r = 1.0 + 0.1 * torch.sin(pos.double()[:, None, :, None] * 0.01 * omega)
    pair = lambda t: (t[..., :4] ** 2 + t[..., 4:] ** 2).sqrt()  # noqa: E731
    assert_close_rel(pair(out), r * pair(q), 1e-13)
    assert not torch.allclose(out.norm(), q.norm(), rtol=1e-3)


# --- positions ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_large_positions_float32(backend):
    """float32 within SPEC's 1e-5 at every position below 2^20 (SPEC §4) and on to 2^31, for
    k_s = 8 and 1, per position (an error at one position must not hide in the average);
    bf16 at the model's head width. A float32 angle p·ω(1 + 1/k_s) would miss by far."""
    b, h, h_kv, t, dh = 2, 2, 1, 16, 64
    q, k, _ = inputs(b, h, h_kv, t, dh, seed=4)
    pos = torch.cat([torch.randint(2**19, 2**20, (b, t // 2), generator=gen(5)),
                     torch.randint(2**31 - 2**24, 2**31 + 1, (b, t // 2), generator=gen(6))], 1)
    pos[0, :6] = torch.tensor([2**20 - 1, 65536, 1, 2**31, 2**30, 2**24 + 1])
    for ks in (8.0, 1.0):
        q_out, k_out = run(backend, q, k, pos, spiral_divisor=ks)
        q_ref, k_ref = oracle(q, pos, spiral_divisor=ks), oracle(k, pos, spiral_divisor=ks)
        assert_close_rel(k_out, k_ref, tolerance(torch.float32), f"k_s {ks}")
        for i in range(t):
            assert_close_rel(q_out[:, :, i], q_ref[:, :, i], tolerance(torch.float32), f"k_s {ks} position {pos[:, i]}")
    qb, kb = q.bfloat16(), k.bfloat16()
    for got, x in zip(run(backend, qb, kb, pos), (qb, kb)):
        assert_close_rel(got, oracle(x, pos), tolerance(torch.bfloat16), "bf16")
    # The float32 angle this test can tell apart.
    p32, omega = pos.float()[:, None, :, None], 10000.0 ** (-2.0 * torch.arange(dh // 2) / dh)
    angle, radius = p32 * (omega * 1.125).float(), 1.0 + 0.1 * torch.sin(p32 * (omega * 0.01).float())
    c, s = radius * torch.cos(angle), radius * torch.sin(angle)
    x1, x2 = q[..., : dh // 2], q[..., dh // 2:]
    assert rel_err(torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1), oracle(q, pos)) > 10 * tolerance(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_positions_against_mpmath(backend):
    """The float64 angle error bound of the module docstring, against a 200-bit evaluation."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.prec = 200
    dh, theta, ks, a_s, f_s = 64, 10000.0, 8.0, 0.1, 0.01
    half = dh // 2
    g = gen(5)
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
        qo, _ = run(backend, q.float(), q.float(), torch.tensor([p]), theta=theta, spiral_divisor=ks,
                    radial_amplitude=a_s, radial_frequency=f_s)
        bound = max(p * (1 + 1 / ks) * 2.0**-52, 1e-7)  # worst pair; + float32 rounding of the output
        assert rel_err(qo, exact) <= min(bound, 1e-5), p


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_ids_forms_and_dtypes_give_the_same_bits(backend):
    """(T,), (1, T) (the Hugging Face habit: one row for the batch), (B, T) and int32
    positions: the same result, bit for bit, which is the oracle's."""
    q, k, _ = inputs(3, 4, 2, 5, 8, seed=7)
    pos = torch.tensor([7, 0, 4096, 3, 65536])
    want = run(backend, q, k, pos.expand(3, 5).contiguous())
    for form in (pos, pos[None], pos.to(torch.int32), pos.expand(3, 5).to(torch.int32)):
        for a, b in zip(run(backend, q, k, form), want):
            assert torch.equal(a, b), form
    for got, x in zip(want, (q, k)):
        assert_close_rel(got, oracle(x, pos), tolerance(torch.float32))


@pytest.mark.parametrize("k_s", [8.0, 1.0, 0.5])
def test_refuses_positions_beyond_the_accurate_range(k_s):
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


# --- plain RoPE: k_s = ∞ (1/k_s = 0) and a_s = 0 (Hugging Face models) ------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_divisor_is_plain_rope(backend):
    """k_s = ±∞, a_s = 0: rotate-half RoPE, float32 accurate to 2^20 like SRPE; the backward
    is Rᵀ g, the rotation by −Θ, i.e. the rotation at −p."""
    shape = (1, 2, 1, 3, 6) if backend == "triton" else (3, 4, 2, 7, 66)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for divisor in (math.inf, -math.inf):
            q, k, pos = inputs(*shape, dtype=dtype, max_pos=2**20, seed=3)
            pos[0, :3] = torch.tensor([2**20 - 1, 65536, 0])
            params = dict(theta=500000.0, spiral_divisor=divisor, radial_amplitude=0.0, radial_frequency=0.0)
            rope = dict(params, spiral_divisor=math.inf)
            q_out, k_out, gq, gk = run(backend, q, k, pos, grad=(q, torch.full_like(k, 2.0)), **params)
            tol = srpe_tolerance(dtype, pos, divisor)
            assert_close_rel(q_out, oracle(q, pos, **rope), tol, f"q {dtype} {divisor}")
            assert_close_rel(k_out, oracle(k, pos, **rope), tol, f"k {dtype} {divisor}")
            assert_close_rel(gq, oracle(q, -pos, **rope), tol, f"grad q {dtype} {divisor}")
            assert_close_rel(gk, oracle(torch.full_like(k, 2.0), -pos, **rope), tol, f"grad k {dtype} {divisor}")


# --- given frequencies and an output scale (SPEC §4, "Given frequencies") -----------------------

ROPE = dict(spiral_divisor=math.inf, radial_amplitude=0.0, radial_frequency=0.0)


def given_oracle(x, pos, inv_freq, scale=1.0, spiral_divisor=math.inf, radial_amplitude=0.0, radial_frequency=0.0,
                 grad=None, theta=None):
    """``m R(p) x`` in float64, one pair at a time, with ``ω_j = inv_freq[j]`` (taken in float64;
    ``theta`` is not used); with ``grad``: also its vector-Jacobian product (autograd of this loop)."""
    x = x.detach().double().requires_grad_(grad is not None)
    b, _, t, dh = x.shape
    half = dh // 2
    p = pos.to(torch.int64).expand(b, t).double()
    lo, hi = [], []
    for j in range(half):
        w = float(inv_freq[j].double())
        ang = p * w * (1.0 + 1.0 / spiral_divisor)
        r = scale * (1.0 + radial_amplitude * torch.sin(p * radial_frequency * w))
        c, s = (r * torch.cos(ang))[:, None], (r * torch.sin(ang))[:, None]
        lo.append(x[..., j] * c - x[..., j + half] * s)
        hi.append(x[..., j] * s + x[..., j + half] * c)
    y = torch.stack(lo + hi, dim=-1)
    if grad is None:
        return y.detach()
    return y.detach(), torch.autograd.grad(y, x, grad.double())[0]


def llama3_frequencies(dh, theta=500000.0, factor=8.0, low=1.0, high=4.0, original=8192):
    """Llama 3.1's rope_type "llama3" frequencies, in float32 as Hugging Face keeps them (written
    here from Meta's published formula: long wavelengths divided by ``factor``, a smooth ramp
    between)."""
    omega = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    wavelen = 2 * math.pi / omega
    smooth = (original / wavelen - low) / (high - low)
    ramp = (1 - smooth) * omega / factor + smooth * omega
    out = torch.where(wavelen > original / low, omega / factor, torch.where(wavelen < original / high, omega, ramp))
    return out.float()


def yarn_like_frequencies(dh, theta=10000.0, factor=4.0):
    """Frequencies interpolated between ``ω`` and ``ω/factor`` along the pairs (the shape of
    yarn's), with yarn's attention factor ``0.1 ln(factor) + 1``."""
    omega = theta ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    ramp = torch.linspace(1.0, 0.0, dh // 2, dtype=torch.float64)
    return omega * ramp + omega / factor * (1 - ramp), 0.1 * math.log(factor) + 1.0


def _given_cases(dh):
    """``(name, inv_freq, scale, params)``: HF-like frequencies (float32 and float64), RoPE and SRPE
    parameters, scale 1 and not."""
    llama3 = llama3_frequencies(dh)
    yarn, attention_factor = yarn_like_frequencies(dh)
    return [("llama3 float32", llama3, 1.0, ROPE), ("yarn float64", yarn, attention_factor, ROPE),
            ("llama3 srpe", llama3, 0.75, DEFAULTS), ("yarn bf16 inv_freq", yarn.bfloat16(), attention_factor, ROPE)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_frequencies_and_scale_against_float64(backend):
    """Forward and backward (``m R(p)ᵀ g``) with HF-like frequencies at positions up to 2^20,
    float32 per position within 1e-5, bf16 within 1e-2, float64 within the angle's own bound."""
    shape = (1, 2, 1, 12, 16) if backend == "triton" else (2, 4, 2, 24, 64)
    b, h, h_kv, t, dh = shape
    q64, k64, pos = inputs(*shape, dtype=torch.float64, max_pos=2**20, seed=11)
    pos[0, :4] = torch.tensor([2**20 - 1, 2**20, 65536, 131071])
    g = [torch.randn_like(x, dtype=torch.float64) for x in (q64, k64)]
    for name, inv_freq, scale, params in _given_cases(dh):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            q, k = q64.to(dtype), k64.to(dtype)
            got = run(backend, q, k, pos, grad=[x.to(dtype) for x in g], inv_freq=inv_freq, scale=scale, **params)
            (q_ref, gq_ref), (k_ref, gk_ref) = (given_oracle(x, pos, inv_freq, scale, grad=gx.to(dtype), **params)
                                                for x, gx in zip((q, k), g))
            tol = srpe_tolerance(dtype, pos, params["spiral_divisor"])
            for out, ref, what in zip(got, (q_ref, k_ref, gq_ref, gk_ref), ("q", "k", "grad q", "grad k")):
                assert out.dtype == dtype and out.shape == ref.shape
                if dtype == torch.float32:  # per position: an error at one must not hide in the average
                    for i in range(t):
                        assert_close_rel(out[:, :, i], ref[:, :, i], tol, f"{name} {what} position {pos[:, i]}")
                assert_close_rel(out, ref, tol, f"{name} {dtype} {what}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_default_frequencies_reproduce_the_default_exactly(backend):
    """``inv_freq = θ₀^(−2j/d_h)`` (float64, formed as every backend forms it: C's ``pow(θ₀, j·(−2/d_h))``)
    with ``scale = 1``: the same bits as without them, forward and backward, for SRPE and RoPE
    parameters, at head widths where torch's vectorised pow would differ by an ulp."""
    shape = (1, 2, 1, 5, 12) if backend == "triton" else (2, 4, 2, 9, 128)
    dh = shape[-1]
    for theta, params in ((10000.0, DEFAULTS), (500000.0, ROPE)):
        params = dict(params, theta=theta)
        inv_freq = torch.tensor([theta ** (j * (-2.0 / dh)) for j in range(dh // 2)], dtype=torch.float64)
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            q, k, pos = inputs(*shape, dtype=dtype, max_pos=2**20, seed=12)
            grad = [torch.randn(x.shape, generator=gen(13)).to(dtype) for x in (q, k)]
            want = run(backend, q, k, pos, grad=grad, **params)
            got = run(backend, q, k, pos, grad=grad, inv_freq=inv_freq, scale=1.0, **params)
            for a, w in zip(got, want):
                assert torch.equal(a, w), (theta, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_multiplies_the_output_and_the_gradient(backend):
    """``y = m R(p) q`` and ``∂q = m R(p)ᵀ g`` for m = 2.5, −0.5 and 0 (all outputs zero)."""
    q, k, pos = inputs(1, 2, 1, 6, 8, seed=14, max_pos=70000)
    inv_freq = llama3_frequencies(8)
    grad = [torch.randn(x.shape, generator=gen(15)) for x in (q, k)]
    for scale in (2.5, -0.5, 0.0):
        got = run(backend, q, k, pos, grad=grad, inv_freq=inv_freq, scale=scale)
        refs = [*(given_oracle(x, pos, inv_freq, scale, grad=gx, **DEFAULTS) for x, gx in zip((q, k), grad))]
        for out, ref in zip(got, (refs[0][0], refs[1][0], refs[0][1], refs[1][1])):
            if scale == 0.0:
                assert torch.equal(out, torch.zeros_like(out))
            else:
                assert_close_rel(out, ref, tolerance(torch.float32), f"scale {scale}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_frequencies_are_read_at_every_call(backend):
    """Strided and non-float64 ``inv_freq`` are read as given; a tensor changed in place (as
    ``dynamic`` rope does) is read anew: no backend keeps a stale table of it."""
    q, k, pos = inputs(1, 2, 1, 4, 8, seed=16, max_pos=5000)
    base = torch.rand(8, generator=gen(17), dtype=torch.float64)
    for inv_freq in (base[::2], base[::2].half(), base[::2].clone()):
        for got, x in zip(run(backend, q, k, pos, inv_freq=inv_freq, **ROPE), (q, k)):
            assert_close_rel(got, given_oracle(x, pos, inv_freq), tolerance(torch.float32), str(inv_freq.dtype))
    inv_freq = base[:4].clone()
    run(backend, q, k, pos, inv_freq=inv_freq, **ROPE)
    inv_freq.mul_(0.5)
    for got, x in zip(run(backend, q, k, pos, inv_freq=inv_freq, **ROPE), (q, k)):
        assert_close_rel(got, given_oracle(x, pos, inv_freq), tolerance(torch.float32), "updated in place")


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_frequencies_gradcheck(backend):
    """float64 gradcheck in q and k with given frequencies and a scale; no gradient reaches inv_freq."""
    shape = (1, 2, 1, 3, 6) if backend == "triton" else (2, 4, 2, 5, 10)
    q, k, pos = inputs(*shape, dtype=torch.float64, max_pos=2**20, seed=18)
    inv_freq = torch.rand(shape[-1] // 2, generator=gen(19), dtype=torch.float64).requires_grad_()
    for params in (ROPE, DEFAULTS):
        def f(a, c):
            return wk.srpe(a, c, pos, inv_freq=inv_freq, scale=1.3, **params)

        with wk.use_backend(backend):
            assert torch.autograd.gradcheck(f, (q.clone().requires_grad_(), k.clone().requires_grad_()),
                                            fast_mode=True)
            qo, ko = f(q.clone().requires_grad_(), k)
            (qo.sum() + ko.sum()).backward()
        assert inv_freq.grad is None


@pytest.mark.skipif("cpu" not in BACKENDS, reason="C++ extension not built")
def test_given_frequencies_opcheck():
    g = gen(20)
    q, k, gq, gk = (torch.randn(2, 5, n, 8, generator=g).transpose(1, 2) for n in (4, 2, 4, 2))
    pos = torch.arange(5)[None].expand(2, 5)
    inv_freq = llama3_frequencies(8)
    for params in ((10000.0, 8.0, 0.1, 0.01), (10000.0, math.inf, 0.0, 0.0)):
        torch.library.opcheck(torch.ops.wiola.srpe.default, (q, k, pos, *params, inv_freq, 1.25))
        torch.library.opcheck(torch.ops.wiola.srpe_backward.default, (gq, gk, pos, *params, inv_freq, 1.25))
        torch.library.opcheck(torch.ops.wiola.srpe.default, (q, k, pos, *params, None, 0.5))


def test_given_frequencies_compile_fullgraph():
    """torch.compile of a step with given frequencies and a scale: no graph break, the
    backward follows, the result is the oracle's; new frequencies do not recompile."""
    from torch._dynamo.utils import counters

    q, k, pos = inputs(2, 4, 2, 7, 16, seed=21, max_pos=2**20)
    inv_freq = llama3_frequencies(16)

    def f(a, c, w):
        qo, ko = wk.srpe(a, c, pos, inv_freq=w, scale=1.2, **ROPE)
        return (qo * qo).sum() + ko.sum()

    torch._dynamo.reset()
    assert torch._dynamo.explain(f)(q, k, inv_freq).graph_break_count == 0
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for w in (inv_freq, inv_freq * 0.5):
        leaves = (q.clone().requires_grad_(), k.clone().requires_grad_())
        loss = compiled(*leaves, w)
        gq, gk = torch.autograd.grad(loss, leaves)
        q_ref, gq_ref = given_oracle(q, pos, w, 1.2, grad=2 * given_oracle(q, pos, w, 1.2))
        k_ref, gk_ref = given_oracle(k, pos, w, 1.2, grad=torch.ones(k.shape))
        want = float((q_ref * q_ref).sum() + k_ref.sum())
        assert abs(float(loss.detach()) - want) <= tolerance(torch.float32) * abs(want)
        assert_close_rel(gq, gq_ref, tolerance(torch.float32), "grad q")
        assert_close_rel(gk, gk_ref, tolerance(torch.float32), "grad k")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 0


def _given_bad_cases():
    return [
        ("list", dict(inv_freq=[1.0, 0.5, 0.25, 0.1]), TypeError, r"^inv_freq must be a torch.Tensor, got list"),
        ("int dtype", dict(inv_freq=torch.ones(4, dtype=torch.int64)), TypeError, r"^inv_freq must have dtype in"),
        ("too long", dict(inv_freq=torch.ones(8)), ValueError,
         r"^inv_freq must have shape \(d_h/2,\) = \(4,\), got \(8,\)"),
        ("2-D", dict(inv_freq=torch.ones(1, 4)), ValueError,
         r"^inv_freq must have shape \(d_h/2,\) = \(4,\), got \(1, 4\)"),
        ("scalar", dict(inv_freq=torch.tensor(1.0)), ValueError,
         r"^inv_freq must have shape \(d_h/2,\) = \(4,\), got a 0-d"),
        ("device", dict(inv_freq=torch.ones(4, device="meta")), ValueError,
         r"^inv_freq must be on cpu like q, got meta"),
        ("nan", dict(inv_freq=torch.tensor([1.0, 0.5, float("nan"), 0.1])), ValueError,
         r"^inv_freq must hold finite frequencies, got nan at pair 2"),
        ("inf", dict(inv_freq=torch.tensor([float("-inf"), 0.5, 0.2, 0.1])), ValueError,
         r"^inv_freq must hold finite frequencies, got -inf at pair 0"),
        ("scale nan", dict(scale=math.nan), ValueError, r"^scale must be finite, got nan"),
        ("scale str", dict(scale="1"), TypeError, r"^scale must be a real number"),
        ("positions", dict(inv_freq=torch.tensor([4.0, 0.5, 0.2, 0.1]), position_ids=torch.full((2, 3), 2**34)),
         ValueError, r"^position_ids must lie within ±\d+ \(float32 SRPE outputs lose SPEC accuracy beyond it for "
                     r"spiral_divisor=8.0 and max \|inv_freq\| = 4.0\), got \|p\| = 17179869184"),
    ]


@pytest.mark.parametrize("case", _given_bad_cases(), ids=lambda c: c[0])
def test_bad_given_frequencies_and_scale_raise_the_same_words_everywhere(case):
    """The C++ checks (the dispatcher's kernel), validation.py (the forced backends) and the fake
    name ``inv_freq`` / ``scale`` in the same words, with and without autograd."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, changes, error, message = case
    args = dict(dict(q=torch.randn(2, 4, 3, 8), k=torch.randn(2, 2, 3, 8), position_ids=torch.arange(3)), **changes)
    for backend in ["auto", *BACKENDS]:
        for grad in (False, True):
            call = dict(args, q=args["q"].clone().requires_grad_(grad))
            with wk.use_backend(backend), pytest.raises(error, match=message):
                wk.srpe(**call)
    if "finite frequencies" in message or "lie within" in message:
        return  # values: not read while tracing
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises(error, match=message):
        wk.srpe(**{n: mode.from_tensor(v) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
                   for n, v in args.items()})


def test_accurate_range_follows_the_given_frequencies():
    """``max_accurate_position(k_s, max_j |ω_j|)``: frequencies at most ½ double the range."""
    from wiola_kernels.ops.srpe import max_accurate_position

    limit = max_accurate_position(math.inf, 0.5)
    assert limit == int(1e-5 * 2.0**52 / 0.5) and abs(limit - 2 * max_accurate_position(math.inf)) <= 1
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 2, 8)
    inv_freq = torch.tensor([0.5, 0.25, 0.1, 0.01])
    for backend in ["auto", *BACKENDS]:
        with wk.use_backend(backend):
            wk.srpe(q, k, torch.tensor([0, limit]), inv_freq=inv_freq, **ROPE)
            with pytest.raises(ValueError, match="position_ids must lie within"):
                wk.srpe(q, k, torch.tensor([0, limit + 1]), inv_freq=inv_freq, **ROPE)


# --- numerics at the edges ------------------------------------------------------------------

@pytest.mark.parametrize("dtype,scale,a_s", [(torch.float32, 1e30, 0.1), (torch.float32, 1e-30, 0.1),
                                             (torch.bfloat16, 1e37, 0.0), (torch.bfloat16, 1e-30, 0.1),
                                             (torch.float16, 2e4, 0.0), (torch.float16, 1e-3, 0.1)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_and_tiny_magnitudes(backend, dtype, scale, a_s):
    """Linear in q, k: the relative tolerance holds while outputs are representable (|y| ≤ √2·(1+a_s)·|q|)."""
    g = gen(6)
    q, k = [(torch.randn(2, n, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype) for n in (2, 1)]
    pos = torch.randint(0, 2**20, (2, 9), generator=g)
    grad = [(torch.randn(2, n, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype) for n in (2, 1)]
    got = run(backend, q, k, pos, grad=grad, radial_amplitude=a_s)
    assert finite(*got)
    (q_ref, gq_ref), (k_ref, gk_ref) = (oracle(x, pos, gx, radial_amplitude=a_s) for x, gx in zip((q, k), grad))
    for a, b in zip(got, (q_ref, k_ref, gq_ref, gk_ref)):
        assert rel_err(a, b) <= tolerance(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_token_is_confined(backend):
    """A NaN/Inf in one token's head vector of q (or of ∂k) changes nothing else, bit for bit."""
    q, k, pos = inputs(2, 4, 2, 10, 8, seed=7, max_pos=1000)
    grad = [torch.randn(2, n, 10, 8, generator=gen(8)) for n in (4, 2)]
    q0, k0, gq0, gk0 = run(backend, q, k, pos, grad=grad)
    for bad in (float("nan"), float("inf")):
        qb = q.clone()
        qb[1, 2, 3, 1] = bad
        qo, ko = run(backend, qb, k, pos)
        mask = torch.ones_like(qo, dtype=torch.bool)
        mask[1, 2, 3] = False  # the token's own head vector (its pair partner) may be affected
        assert torch.equal(qo[mask], q0[mask]) and torch.equal(ko, k0)
        gb = [grad[0], grad[1].clone()]
        gb[1][0, 1, 9, 7] = bad
        _, _, gq, gk = run(backend, q, k, pos, grad=gb)
        mask = torch.ones_like(gk, dtype=torch.bool)
        mask[0, 1, 9] = False
        assert torch.equal(gq, gq0) and torch.equal(gk[mask], gk0[mask])


# --- layouts --------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_any_strides_match_the_oracle_and_the_fake_layout(backend):
    """Layouts the kernels cannot read in place are still right: a last dimension with stride
    ≠ 1 (copied first), q sliced out of a fused qkv projection (not dense: contiguous output),
    keys expanded over batch and heads (stride 0), positions with a stride ≠ 1 over T, an
    output gradient of stride 0. Every backend returns the layout the op's fake promises
    (torch.empty_like of the input), which torch.compile relies on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = gen(7)
    b, h, h_kv, t, dh = 2, 4, 2, 9, 10
    qkv = torch.randn(b, t, h + 2 * h_kv, dh, generator=g, dtype=torch.float64)
    cases = {
        "fused qkv slice": (qkv[:, :, :h].transpose(1, 2), qkv[:, :, h:h + h_kv].transpose(1, 2)),
        "last stride 2": (torch.randn(b, h, t, 2 * dh, generator=g, dtype=torch.float64)[..., ::2],
                          torch.randn(b, h_kv, t, 2 * dh, generator=g, dtype=torch.float64)[..., ::2]),
        "d_h-major": (torch.randn(b, h, dh, t, generator=g, dtype=torch.float64).transpose(2, 3),
                      torch.randn(b, h_kv, dh, t, generator=g, dtype=torch.float64).transpose(2, 3)),
        "expanded k": (torch.randn(b, h, t, dh, generator=g, dtype=torch.float64),
                       torch.randn(1, 1, t, dh, generator=g, dtype=torch.float64).expand(b, h_kv, t, dh)),
    }
    pos = torch.randint(0, 5000, (b, 2 * t), generator=g)[:, ::2]
    for name, (q, k) in cases.items():
        gq = torch.randn(b, t, h, dh, generator=g, dtype=torch.float64).transpose(1, 2)
        q_out, k_out, dq, dk = run(backend, q, k, pos, grad=(gq, torch.ones(()).expand(k.shape)))
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake_q, fake_k = torch.ops.wiola.srpe(q, k, pos, 10000.0, 8.0, 0.1, 0.01)
        for out, fake in ((q_out, fake_q), (k_out, fake_k)):
            significant = [s for n, s in zip(out.shape, out.stride()) if n > 1]
            assert significant == [s for n, s in zip(fake.shape, fake.stride()) if n > 1], (name, out.stride())
        tol = srpe_tolerance(torch.float64, pos, 8.0)
        (q_ref, dq_ref), (k_ref, dk_ref) = oracle(q, pos, gq), oracle(k, pos, torch.ones(k.shape))
        for got, ref in zip((q_out, k_out, dq, dk), (q_ref, k_ref, dq_ref, dk_ref)):
            assert_close_rel(got, ref, tol, f"{backend} {name}")


def test_opcheck_on_the_models_views():
    # tests/test_op_layer.py checks the ops on contiguous tensors: here on the model's views.
    g = gen(3)
    q, k, gq, gk = (torch.randn(2, 5, n, 6, generator=g).transpose(1, 2) for n in (4, 2, 4, 2))
    pos = torch.arange(5)[None].expand(2, 5)
    params = (10000.0, 8.0, 0.1, 0.01)
    torch.library.opcheck(torch.ops.wiola.srpe.default, (q, k, pos, *params))
    torch.library.opcheck(torch.ops.wiola.srpe_backward.default, (gq, gk, pos, *params))


@given(
    b=st.integers(1, 3), h_kv=st.integers(1, 3), groups=st.integers(1, 3), t=st.integers(1, 20),
    half=st.integers(1, 40), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    how=st.sampled_from(["contiguous", "transposed", "sliced"]),
    lo=st.integers(-2**20, 2**20), span=st.sampled_from([0, 1, 2048, 2**20]), shared_positions=st.booleans(),
    theta=st.sampled_from([100.0, 10000.0, 500000.0]), k_s=st.sampled_from([-3.0, 1.0, 8.0]),
    a_s=st.sampled_from([0.0, 0.1, 0.5]), f_s=st.sampled_from([0.0, 0.01, 1.0]),
    backend=st.sampled_from([b for b in BACKENDS if b != "triton"]), seed=st.integers(0, 2**32 - 1),
)
def test_any_shape_stride_dtype_position_and_parameters(b, h_kv, groups, t, half, dtype, how, lo, span,
                                                         shared_positions, theta, k_s, a_s, f_s, backend, seed):
    h, dh = h_kv * groups, 2 * half
    g = gen(seed)
    q64 = torch.randn(b, h, t, dh, dtype=torch.float64, generator=g)
    k64 = torch.randn(b, h_kv, t, dh, dtype=torch.float64, generator=g)
    pos = torch.randint(lo, lo + span + 1, (t,) if shared_positions else (b, t), generator=g)  # also negative
    q, k = strided_view(q64.to(dtype), how), strided_view(k64.to(dtype), how)
    params = dict(theta=theta, spiral_divisor=k_s, radial_amplitude=a_s, radial_frequency=f_s)
    q_out, k_out = run(backend, q, k, pos, **params)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    tol = srpe_tolerance(dtype, pos, k_s)  # float64: bounded by the float64 angle's own rounding
    assert rel_err(q_out, oracle(q, pos, **params)) <= tol
    assert rel_err(k_out, oracle(k, pos, **params)) <= tol


@pytest.mark.skipif("cpu" not in BACKENDS, reason="C++ extension not built")
@pytest.mark.parametrize("shared_positions", [True, False])
def test_cpu_large_output_paths(shared_positions):
    """17 MB of float32 output (>= 16 MiB): the C++ kernel's non-temporal-store and
    multi-thread paths, with positions shared by the batch (table reuse) or not."""
    b, t = 3, 1400  # t: not a multiple of the kernel's 32-row tiles
    q, k = torch.randn(b, 8, t, 64, generator=gen(9)), torch.randn(b, 8, t, 64, generator=gen(10))
    pos = torch.randint(0, 2**20, (t,)).expand(b, t) if shared_positions else torch.randint(0, 2**20, (b, t))
    with wk.use_backend("cpu"):
        q_out, k_out = wk.srpe(q, k, pos)
        gq, gk = torch.ops.wiola.srpe_backward(q, k, pos.contiguous(), 10000.0, 8.0, 0.1, 0.01)
    assert finite(q_out, k_out, gq, gk)  # every element written (outputs start as NaN)
    # The oracle on every 13th token (its cost): 13 and the kernel's 32-row tiles are coprime,
    # so every row of a tile is sampled somewhere, the last, partial tile too.
    every = (slice(None), slice(None), slice(None, None, 13))
    pos13 = pos[:, ::13]
    (q_ref, bq), (k_ref, bk) = oracle(q[every], pos13, q[every]), oracle(k[every], pos13, k[every])  # vjp: Rᵀ g
    for got, ref, name in ((q_out, q_ref, "q_out"), (k_out, k_ref, "k_out"), (gq, bq, "backward q"),
                           (gk, bk, "backward k")):
        assert_close_rel(got[every], ref, tolerance(torch.float32), name)


# --- module, bad input ----------------------------------------------------------------------

def test_module():
    mod = SpiralRotaryEmbedding(10, theta=500.0, spiral_divisor=4.0, radial_amplitude=0.2, radial_frequency=0.05)
    assert "head_dim=10" in repr(mod) and list(mod.parameters()) == []
    q, k, pos = inputs(2, 4, 2, 5, 10)
    params = dict(theta=500.0, spiral_divisor=4.0, radial_amplitude=0.2, radial_frequency=0.05)
    for got, x in zip(mod(q, k, pos), (q, k)):
        assert_close_rel(got, oracle(x, pos, **params), tolerance(torch.float32), "module")
    q, k, pos = inputs(2, 2, 1, 4, 8)  # SPEC defaults: θ₀ 1e4, k_s 8, a_s 0.1, f_s 0.01
    for got, x in zip(SpiralRotaryEmbedding(8)(q, k, pos), (q, k)):
        assert_close_rel(got, oracle(x, pos), tolerance(torch.float32), "module defaults")
    with pytest.raises(ValueError, match="head dim"):
        mod(torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), pos)
    with pytest.raises(ValueError, match="head_dim"):
        SpiralRotaryEmbedding(7)


def _bad_cases():
    # Only what tests/test_op_layer.py's table of messages and its position_ids checks do not hold.
    q, k, pos = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.arange(3)
    return [
        ("B mismatch", (q, torch.randn(1, 2, 3, 8), pos), {}, ValueError, "k must have shape"),
        ("d_h mismatch", (q, torch.randn(2, 2, 3, 6), pos), {}, ValueError, "k must have shape"),
        ("q rank", (q[0], k, pos), {}, ValueError, "q must have shape"),
        ("k rank", (q, k[0], pos), {}, ValueError, "k must have shape"),
        ("positions batch", (q, k, torch.zeros(3, 3, dtype=torch.long)), {}, ValueError, "position_ids"),
        ("int dtype q", (q.long(), k, pos), {}, TypeError, "q must have dtype"),
        ("complex q", (q.to(torch.complex64), k, pos), {}, TypeError, "q must have dtype"),
        ("not a tensor", (q.tolist(), k, pos), {}, TypeError, "q must be a torch.Tensor"),
        ("device mismatch", (q, k, pos.to("meta")), {}, ValueError, "position_ids must be on cpu"),
        ("k on another device", (q, k.to("meta"), pos), {}, ValueError, "k must be on"),
        ("amplitude a string", (q, k, pos), dict(radial_amplitude="0.1"), TypeError, "radial_amplitude"),
        ("divisor nan", (q, k, pos), dict(spiral_divisor=math.nan), ValueError, "spiral_divisor"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_raise(case):
    _, args, kwargs, exc, match = case
    with pytest.raises(exc, match=match):
        wk.srpe(*args, **kwargs)


@given(
    q_dh=st.integers(1, 9), k_dh=st.integers(1, 9), h=st.integers(1, 6), h_kv=st.integers(1, 6),
    t_q=st.integers(1, 4), t_k=st.integers(1, 4),
    pos_kind=st.sampled_from(["T", "BT", "float", "wrong_len", "3d"]), seed=st.integers(0, 2**32 - 1),
)
def test_bad_input_raises_named_error(q_dh, k_dh, h, h_kv, t_q, t_k, pos_kind, seed):
    g = gen(seed)
    q, k = torch.randn(2, h, t_q, q_dh, generator=g), torch.randn(2, h_kv, t_k, k_dh, generator=g)
    pos = {"T": torch.arange(t_q), "BT": torch.arange(t_q).expand(2, t_q), "float": torch.arange(t_q) * 1.0,
           "wrong_len": torch.arange(t_q + 1), "3d": torch.zeros(1, 2, t_q, dtype=torch.long)}[pos_kind]
    try:
        q_out, k_out = wk.srpe(q, k, pos)
    except (ValueError, TypeError) as exc:
        assert any(name in str(exc) for name in ("q", "k", "position_ids"))
        return
    assert q_dh == k_dh and q_dh % 2 == 0 and h % h_kv == 0 and t_q == t_k and pos_kind in ("T", "BT")
    assert q_out.shape == q.shape and k_out.shape == k.shape


@pytest.mark.skipif("cpu" not in BACKENDS, reason="C++ extension not built")
def test_registered_op_checks_its_own_inputs():
    """The C++ kernel behind torch.ops.wiola.srpe checks what the public function would (it is
    the only check on the default path), and reads a non-unit last stride through a copy."""
    q, k, pos = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="^position_ids must have shape"):
        torch.ops.wiola.srpe(q, k, pos[:, :2])
    with pytest.raises(ValueError, match="^k must have shape"):
        torch.ops.wiola.srpe(q, k[:, :, :2], pos)
    with pytest.raises(ValueError, match="multiple"):
        torch.ops.wiola.srpe(q, torch.randn(2, 3, 3, 8), pos)
    with pytest.raises(TypeError, match="^position_ids must have dtype"):
        torch.ops.wiola.srpe(q, k, pos.float())
    with pytest.raises(ValueError, match="^grad_k must have shape"):
        torch.ops.wiola.srpe_backward(q, k[:, :, :2], pos, 10000.0, 8.0, 0.1, 0.01)
    odd = torch.randn(2, 4, 8, 3).transpose(2, 3)  # last stride 3
    q_out, _ = torch.ops.wiola.srpe(odd, k, pos)
    assert_close_rel(q_out, oracle(odd, pos), tolerance(torch.float32), "strided")


def test_transposed_q_k_get_a_transpose_hint_only_when_it_fits():
    g = gen(0)
    b, t, h, h_kv, dh = 2, 5, 4, 2, 8
    q, k = torch.randn(b, t, h, dh, generator=g), torch.randn(b, t, h_kv, dh, generator=g)
    with pytest.raises(ValueError, match=r"^k must have shape.*pass \.transpose\(1, 2\)"):
        wk.srpe(q, k, torch.arange(t))
    # H = H_kv: q and k agree in either layout, but the positions (length T) give it away.
    k = torch.randn(b, t, h, dh, generator=g)
    with pytest.raises(ValueError, match=r"^position_ids must have shape.*pass \.transpose\(1, 2\)"):
        wk.srpe(q, k, torch.arange(t))
    with pytest.raises(ValueError, match=r"^position_ids.*pass \.transpose\(1, 2\)"):
        wk.srpe(q, k, torch.arange(t).expand(b, t))
    # The fix the hint names works.
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    for got, x in zip(wk.srpe(qt, kt, torch.arange(t)), (qt, kt)):
        assert_close_rel(got, oracle(x, torch.arange(t)), tolerance(torch.float32))
    # T differs: no layout fits, no hint.
    with pytest.raises(ValueError, match=r"^k must have shape") as info:
        wk.srpe(torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.arange(5))
    assert "transpose" not in str(info.value)


def test_srpe_docstring_states_the_layout_and_the_accuracy_range_first():
    from wiola_kernels.ops.srpe import max_accurate_position

    doc = wk.srpe.__doc__
    head = doc.split("\n\n")[1]
    assert "(B, H, T, d_h)" in head and ".transpose(1, 2)" in head and "H = H_kv = T" in head
    assert "2^20" not in doc and "max_accurate_position" in doc  # the range agrees with the code and README
    assert 2**34 < max_accurate_position(8.0) < 2**36  # "about 2^35 for k_s = 8"


# --- on a GPU (skipped without one) -----------------------------------------------------------

@pytest.mark.parametrize("dtype", shapes.SRPE_GPU_TEST_DTYPES)
@pytest.mark.parametrize("b, h, h_kv, t, dh", shapes.SRPE_GPU_TEST_SHAPES)  # what gpu-report compiles ahead of time
@gpu_only
def test_srpe_triton_vs_float64(b, h, h_kv, t, dh, dtype):
    q, k, pos = inputs(b, h, h_kv, t, dh, torch.float64, max_pos=2**20)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    with wk.use_backend("triton"):
        outs, grads = forward_backward(lambda a, c: wk.srpe(a, c, pos.to("cuda")),
                                       [q.to("cuda", dtype), k.to("cuda", dtype)],
                                       [gq.to("cuda", dtype), gk.to("cuda", dtype)])
    (q_ref, dq), (k_ref, dk) = oracle(q, pos, gq), oracle(k, pos, gk)
    for got, ref in zip(outs + grads, (q_ref, k_ref, dq, dk)):
        assert_close_rel(got.cpu(), ref, tolerance(dtype))


# --- this op in the shared suites: its OpCase (tests/op_cases.py collects CASE for
# tests/test_all_ops.py and tests/test_op_layer.py) -------------------------------------------

SRPE_SPEC_PARAMS = (10000.0, 8.0, 0.1, 0.01)


def _srpe_make(shape, dtype, seed, max_position=2**20, params=SRPE_SPEC_PARAMS):
    """Positions in ``[0, max_position)`` (below 256, float64 is within 1e-12 and every index
    dtype, uint8 too, holds them); ``params``: (θ₀, k_s, a_s, f_s)."""
    b, h, h_kv, t, dh = shape
    g = gen(seed)
    q, k = randn64(b, h, t, dh, g=g), randn64(b, h_kv, t, dh, g=g)
    pos = torch.randint(0, max_position, (b, t), generator=g)  # not monotonic, may repeat
    return dict(q=q.to(dtype), k=k.to(dtype), position_ids=pos,
                **dict(zip(("theta", "spiral_divisor", "radial_amplitude", "radial_frequency"), params)))


def _srpe_views(shape, dtype, seed):
    """q, k as the model makes them: ``Linear(x).view(B, T, H, d_h).transpose(1, 2)``, int64
    positions expanded from (1, T) (stride 0 over the batch), output gradients alike."""
    b, h, h_kv, t, dh = shape
    args = _srpe_make(shape, dtype, seed)
    g = gen(seed + 1)
    view = {n: randn64(b, t, n_h, dh, g=g).to(dtype).transpose(1, 2) for n, n_h in (("q", h), ("k", h_kv))}
    pos = torch.randperm(4 * t, generator=g)[:t].sort().values[None].expand(b, t)
    grads = [randn64(b, t, n_h, dh, g=g).to(dtype).transpose(1, 2) for n_h in (h, h_kv)]
    return dict(args, **view, position_ids=pos), grads


def _srpe_oracle(a):
    params = (a["theta"], a["spiral_divisor"], a["radial_amplitude"], a["radial_frequency"])
    return srpe_oracle(a["q"], a["position_ids"], *params), srpe_oracle(a["k"], a["position_ids"], *params)


def _srpe_calls(a, ops):
    params = (a["theta"], a["spiral_divisor"], a["radial_amplitude"], a["radial_frequency"])
    return [(ops.srpe.default, (a["q"], a["k"], a["position_ids"], *params)),
            (ops.srpe_backward.default, (torch.randn_like(a["q"]), torch.randn_like(a["k"]), a["position_ids"], *params))]


def _srpe_bad(a):
    return [
        (dict(k=a["k"][:, :, :3]), ValueError, r"^k must have shape \(B, H_kv, T, d_h\) = \(2, H_kv, 5, 8\) to match q, got \(2, 2, 3, 8\)"),
        (dict(k=a["k"].double()), TypeError, r"^k must have dtype torch.float32 like q, got torch.float64"),
        (dict(q=a["q"][..., :7], k=a["k"][..., :7]), ValueError, r"^q must have an even, non-zero head dim d_h \(last dim\), got d_h = 7"),
        (dict(k=torch.randn(2, 3, 5, 8)), ValueError, r"^q's heads H = 4 \(dim 1\) must be a multiple of k's heads H_kv = 3 \(dim 1\)"),
        (dict(q=a["q"].transpose(1, 2).contiguous(), k=a["k"].transpose(1, 2).contiguous()),
         ValueError, r"these look like \(B, T, H, d_h\) = \(2, 5, 4, 8\), but the layout is \(B, H, T, d_h\)"),
        (dict(theta=0.0), ValueError, r"^theta must be a finite number > 0, got 0.0"),
        (dict(spiral_divisor=0.0), ValueError, r"^spiral_divisor must be non-zero"),
        (dict(radial_amplitude=float("inf")), ValueError, r"^radial_amplitude must be finite, got inf"),
        (dict(position_ids=torch.full((2, 5), 2**40)), ValueError, r"^position_ids must lie within ±\d+ \(float32 SRPE outputs lose SPEC accuracy beyond it for spiral_divisor=8.0\), got \|p\| = 1099511627776"),
    ]


CASE = OpCase(
    _srpe_make, lambda a: wk.srpe(**a),
    # (B, H, H_kv, T, d_h): T = 1, odd B, H/H_kv in {1, 4}, d_h not a power of two, 64, 128
    dict(default=[(1, 1, 1, 1, 6), (3, 4, 1, 7, 10), (3, 4, 4, 5, 66), (2, 4, 1, 9, 64), (1, 2, 2, 3, 128)],
         triton=[(1, 1, 1, 1, 6), (3, 4, 1, 7, 10), (1, 2, 2, 3, 128)], gradcheck=[(3, 2, 1, 3, 4)],
         threads=[(2, 4, 2, 300, 64)], views=[(2, 4, 2, 37, 16), (3, 2, 1, 5, 66), (1, 4, 4, 1, 64)],
         dynamic=[(2, 2, 1, 3, 4), (2, 2, 1, 5, 4)], concurrent=[(2, 4, 2, 33, 16)], gpu=[(2, 4, 2, 7, 16)],
         layer=[(2, 4, 2, 5, 8)]),
    (Public("srpe", wk.SRPEFunction, _srpe_calls, _srpe_bad),),
    variants=(dict(), dict(max_position=256), dict(params=(500.0, 3.0, 0.3, 0.05))),
    layer_variant=dict(max_position=256),
    oracle=_srpe_oracle, views=_srpe_views, in_place=("cpu", "triton"),
    # float64 at positions ~2^20: the angle p·ω itself carries ~1e-10 of rounding (SPEC §9)
    tol=lambda dtype, a: srpe_tolerance(dtype, a["position_ids"], a["spiral_divisor"]))
