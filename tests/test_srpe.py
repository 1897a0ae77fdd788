"""SRPE (SPEC §4) against the float64 reference, for every backend that runs here.

The reference itself is checked first, against an independent scalar oracle (a Python
loop building each pair's 2×2 matrix with ``math.cos``/``math.sin``) and hand-worked
values; its explicit backward against autograd of its forward. Triton runs in the CPU
interpreter here, so its shapes stay tiny.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wiola_kernels
from wiola_kernels import SpiralRotaryEmbedding, use_backend
from wiola_kernels.reference import srpe as reference_srpe
from wiola_kernels.reference import srpe_backward as reference_srpe_backward
from wiola_kernels.reference import srpe_frequencies
from wiola_kernels.testing import assert_close_rel, available_backends, rel_err, srpe_tolerance, tolerance

BACKENDS = available_backends("srpe")
PARAMS = dict(theta=10000.0, spiral_divisor=8.0, radial_amplitude=0.1, radial_frequency=0.01)

# (B, H, H_kv, T, d_h): T = 1, odd B, H/H_kv ∈ {1, 4}, d_h not a power of two, 64, 128.
SHAPES = [
    (1, 1, 1, 1, 6),
    (3, 4, 1, 7, 10),
    (3, 4, 4, 5, 66),
    (2, 4, 1, 9, 64),
    (1, 2, 2, 3, 128),
]


def _inputs(b, h, h_kv, t, dh, dtype=torch.float32, max_pos=4096):
    q = torch.randn(b, h, t, dh, dtype=dtype)
    k = torch.randn(b, h_kv, t, dh, dtype=dtype)
    pos = torch.randint(0, max_pos, (b, t))  # arbitrary: not monotonic, may repeat
    return q, k, pos


def _naive_srpe(x, pos, theta=10000.0, spiral_divisor=8.0, radial_amplitude=0.1, radial_frequency=0.01):
    """Independent oracle: per pair, the 2×2 matrix r [[cos, −sin], [sin, cos]] from math.*."""
    b_, h_, t_, dh = x.shape
    half = dh // 2
    out = torch.empty(x.shape, dtype=torch.float64)
    xd = x.to(torch.float64)
    for b in range(b_):
        for t in range(t_):
            p = int(pos[b, t]) if pos.dim() == 2 else int(pos[t])
            for j in range(half):
                omega = theta ** (-2.0 * j / dh)
                angle = p * omega * (1.0 + 1.0 / spiral_divisor)
                r = 1.0 + radial_amplitude * math.sin(p * radial_frequency * omega)
                m = torch.tensor([[r * math.cos(angle), -r * math.sin(angle)],
                                  [r * math.sin(angle), r * math.cos(angle)]], dtype=torch.float64)
                for h in range(h_):
                    v = torch.stack((xd[b, h, t, j], xd[b, h, t, j + half]))
                    y = m @ v
                    out[b, h, t, j], out[b, h, t, j + half] = y[0], y[1]
    return out


# --- the reference itself ------------------------------------------------------------

def test_reference_matches_scalar_oracle():
    q, k, pos = _inputs(2, 2, 1, 5, 6, torch.float64)
    pos[0] = torch.tensor([7, 0, 3000, 3, 3])  # non-monotonic, repeated, zero
    q_ref, k_ref = reference_srpe(q, k, pos)
    assert_close_rel(q_ref, _naive_srpe(q, pos), 1e-12, "reference q")
    assert_close_rel(k_ref, _naive_srpe(k, pos), 1e-12, "reference k")
    # (T,) positions: shared by the batch.
    q_ref1, _ = reference_srpe(q, k, pos[1])
    assert_close_rel(q_ref1, _naive_srpe(q, pos[1]), 1e-12, "reference q, (T,) positions")


def test_reference_hand_worked_values():
    # d_h = 2: one pair, ω_0 = 1, Θ = 1.125 p, r = 1 + 0.1 sin(0.01 p).
    x = torch.tensor([1.0, 0.0], dtype=torch.float64).view(1, 1, 1, 2)
    for p in (0, 1, 100):
        y, _ = reference_srpe(x, x, torch.tensor([p]))
        r = 1.0 + 0.1 * math.sin(0.01 * p)
        expected = torch.tensor([r * math.cos(1.125 * p), r * math.sin(1.125 * p)], dtype=torch.float64)
        torch.testing.assert_close(y.flatten(), expected, rtol=1e-14, atol=1e-14)
    # p = 0 is the identity for any d_h.
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    y, _ = reference_srpe(q, q, torch.tensor([0]))
    torch.testing.assert_close(y, q, rtol=0, atol=0)


def test_reference_backward_matches_autograd():
    q, k, pos = _inputs(3, 4, 2, 6, 10, torch.float64)
    q.requires_grad_(True)
    k.requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    q_out, k_out = reference_srpe(q, k, pos)
    dq, dk = torch.autograd.grad((q_out * gq).sum() + (k_out * gk).sum(), (q, k))
    bq, bk = reference_srpe_backward(gq, gk, pos)
    assert_close_rel(bq, dq, 1e-13, "reference backward q")
    assert_close_rel(bk, dk, 1e-13, "reference backward k")


# --- every backend -------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend):
    q, k, pos = _inputs(3, 2, 1, 3, 4, torch.float64)
    pos[1] = torch.tensor([9, 2, 2])
    q.requires_grad_(True)
    k.requires_grad_(True)
    # The interpreter runs a few hundred launches per second: Triton gets the randomised
    # (fast_mode) gradcheck, the others the full Jacobian.
    with use_backend(backend):
        assert torch.autograd.gradcheck(lambda a, b: wiola_kernels.srpe(a, b, pos, **PARAMS), (q, k),
                                        fast_mode=backend == "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_grad_match_reference(backend, dtype, shape):
    if backend != "cpu" and shape[-1] == 128 and dtype != torch.float32:
        pytest.skip("keep the interpreter / reference runs short")
    q, k, pos = _inputs(*shape, dtype=dtype, max_pos=2**20)
    q.requires_grad_(True)
    k.requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    with use_backend(backend):
        q_out, k_out = wiola_kernels.srpe(q, k, pos)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.dtype == dtype and k_out.dtype == dtype
    with use_backend(backend):
        ((q_out * gq).sum() + (k_out * gk).sum()).backward()
    q_ref, k_ref = reference_srpe(q.detach().double(), k.detach().double(), pos)
    dq_ref, dk_ref = reference_srpe_backward(gq.double(), gk.double(), pos)
    # float64 at positions ~2^20: p·ω itself carries ~1e-10 of rounding in any float64
    # implementation; SPEC §9 bounds float64 by that (small positions: 1e-12 below).
    tol = srpe_tolerance(dtype, pos, 8.0)
    assert_close_rel(q_out, q_ref, tol, f"{backend} q_out")
    assert_close_rel(k_out, k_ref, tol, f"{backend} k_out")
    assert_close_rel(q.grad, dq_ref, tol, f"{backend} grad q")
    assert_close_rel(k.grad, dk_ref, tol, f"{backend} grad k")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_small_positions_tight(backend):
    q, k, pos = _inputs(2, 4, 2, 8, 66, torch.float64, max_pos=2048)
    with use_backend(backend):
        q_out, k_out = wiola_kernels.srpe(q, k, pos)
    q_ref, k_ref = reference_srpe(q, k, pos)
    assert_close_rel(q_out, q_ref, tolerance(torch.float64), f"{backend} q_out")
    assert_close_rel(k_out, k_ref, tolerance(torch.float64), f"{backend} k_out")


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_positions_float32(backend):
    """Positions up to 2^20 meet the float32 tolerance; a float32 angle would not."""
    b, h, h_kv, t, dh = 2, 2, 1, 32, 64
    q, k, _ = _inputs(b, h, h_kv, t, dh)
    pos = torch.randint(2**19, 2**20, (b, t))
    pos[0, :4] = torch.tensor([2**20 - 1, 65536, 1, 2**20 - 2])
    with use_backend(backend):
        q_out, k_out = wiola_kernels.srpe(q, k, pos)
    q_ref, k_ref = reference_srpe(q.double(), k.double(), pos)
    tol = tolerance(torch.float32)
    assert_close_rel(q_out, q_ref, tol, f"{backend} q_out")
    assert_close_rel(k_out, k_ref, tol, f"{backend} k_out")
    # The naive float32 angle p·ω(1 + 1/k_s) misses the tolerance by orders of magnitude,
    # so this test can fail.
    angle_freq, radial_freq = srpe_frequencies(dh, **{n: PARAMS[n] for n in ("theta", "spiral_divisor",
                                                                          "radial_frequency")})
    p32 = pos.float()[:, None, :, None]
    angle = p32 * angle_freq.float()
    radius = 1.0 + 0.1 * torch.sin(p32 * radial_freq.float())
    c, s = radius * torch.cos(angle), radius * torch.sin(angle)
    x1, x2 = q[..., : dh // 2], q[..., dh // 2:]
    naive = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    assert rel_err(naive, q_ref) > 10 * tol


@pytest.mark.skipif("cpu" not in BACKENDS, reason="C++ extension not built")
@pytest.mark.parametrize("shared_positions", [True, False])
def test_cpu_large_output_paths(shared_positions):
    """17 MB of float32 output (>= 16 MiB): the C++ kernel's non-temporal-store and
    multi-thread paths, with positions shared by the batch (table reuse) or not."""
    b, t = 3, 1400  # t: not a multiple of the kernel's 32-row tiles
    q, k = torch.randn(b, 8, t, 64), torch.randn(b, 8, t, 64)
    pos = torch.randint(0, 2**20, (t,)).expand(b, t) if shared_positions else torch.randint(0, 2**20, (b, t))
    with use_backend("cpu"):
        q_out, k_out = wiola_kernels.srpe(q, k, pos)
        gq, gk = torch.ops.wiola.srpe_backward(q, k, pos.contiguous(), 10000.0, 8.0, 0.1, 0.01)
    q_ref, k_ref = reference_srpe(q.double(), k.double(), pos)
    assert_close_rel(q_out, q_ref, tolerance(torch.float32), "q_out")
    assert_close_rel(k_out, k_ref, tolerance(torch.float32), "k_out")
    bq, bk = reference_srpe_backward(q.double(), k.double(), pos)
    assert_close_rel(gq, bq, tolerance(torch.float32), "backward q")
    assert_close_rel(gk, bk, tolerance(torch.float32), "backward k")


@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_1d_equal_2d_and_int32(backend):
    q, k, pos = _inputs(3, 4, 2, 5, 10)
    pos1 = torch.tensor([4, 1, 100, 1, 0])
    with use_backend(backend):
        a = wiola_kernels.srpe(q, k, pos1)
        b = wiola_kernels.srpe(q, k, pos1.expand(3, 5))
        c = wiola_kernels.srpe(q, k, pos1.to(torch.int32))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    for x, y in zip(a, c):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_and_no_mutation(backend):
    b, h, h_kv, t, dh = 3, 4, 2, 5, 10
    q = torch.randn(b, t, h, dh).transpose(1, 2)   # (B, H, T, d_h) view of a (B, T, H, d_h)
    k = torch.randn(b, t, h_kv, dh).transpose(1, 2)
    pos = torch.randint(0, 1000, (b, t))
    assert not q.is_contiguous() and not k.is_contiguous()
    q_before, k_before, pos_before = q.clone(), k.clone(), pos.clone()
    q.requires_grad_(True)
    k.requires_grad_(True)
    with use_backend(backend):
        q_out, k_out = wiola_kernels.srpe(q, k, pos)
        (q_out.sum() + 2 * k_out.sum()).backward()
    q_ref, k_ref = reference_srpe(q_before.double(), k_before.double(), pos)
    assert_close_rel(q_out, q_ref, tolerance(torch.float32), "q_out")
    assert_close_rel(k_out, k_ref, tolerance(torch.float32), "k_out")
    dq_ref, dk_ref = reference_srpe_backward(torch.ones_like(q_ref), torch.full_like(k_ref, 2.0), pos)
    assert_close_rel(q.grad, dq_ref, tolerance(torch.float32), "grad q")
    assert_close_rel(k.grad, dk_ref, tolerance(torch.float32), "grad k")
    assert torch.equal(q.detach(), q_before) and torch.equal(k.detach(), k_before) and torch.equal(pos, pos_before)
    assert q_out.data_ptr() != q.data_ptr() and k_out.data_ptr() != k.data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_scaled_by_radius_not_preserved(backend):
    q, k, pos = _inputs(2, 2, 1, 6, 8, torch.float64)
    pos[:, 0] = 150  # sin(150 · 0.01) ≈ 1: r ≈ 1.1 for the first pair
    with use_backend(backend):
        q_out, _ = wiola_kernels.srpe(q, k, pos)
    half = 4
    pair_in = q[..., :half] ** 2 + q[..., half:] ** 2
    pair_out = q_out[..., :half] ** 2 + q_out[..., half:] ** 2
    _, radial_freq = srpe_frequencies(8, 10000.0, 8.0, 0.01)
    r = 1.0 + 0.1 * torch.sin(pos.double()[:, None, :, None] * radial_freq)
    torch.testing.assert_close(pair_out.sqrt(), r * pair_in.sqrt(), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(q_out.norm(), q.norm(), rtol=1e-3)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])  # the interpreter is too slow
@given(b=st.integers(1, 3), h_kv=st.integers(1, 3), group=st.integers(1, 3), t=st.integers(1, 40),
       half=st.integers(1, 40), lo=st.integers(-2**20, 2**20), data=st.data())
def test_random_shapes_and_positions(backend, b, h_kv, group, t, half, lo, data):
    """Property test: any shape, any (also negative) positions, fp32 within tolerance."""
    span = data.draw(st.integers(0, 2**20), label="span")
    gen = torch.Generator().manual_seed(b * 1000003 + t * 1009 + half)
    q = torch.randn(b, h_kv * group, t, 2 * half, generator=gen)
    k = torch.randn(b, h_kv, t, 2 * half, generator=gen)
    pos = torch.randint(lo, lo + span + 1, (b, t), generator=gen)
    with use_backend(backend):
        q_out, k_out = wiola_kernels.srpe(q, k, pos)
    q_ref, k_ref = reference_srpe(q.double(), k.double(), pos)
    assert_close_rel(q_out, q_ref, tolerance(torch.float32), f"{backend} q_out")
    assert_close_rel(k_out, k_ref, tolerance(torch.float32), f"{backend} k_out")


def _bad_cases():
    q, k, pos = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.arange(3)
    return [
        ("odd d_h", (torch.randn(2, 4, 3, 7), torch.randn(2, 2, 3, 7), pos), ValueError, "d_h"),
        ("H % H_kv", (q, torch.randn(2, 3, 3, 8), pos), ValueError, "H_kv"),
        ("B mismatch", (q, torch.randn(1, 2, 3, 8), pos), ValueError, "k must have shape"),
        ("T mismatch", (q, torch.randn(2, 2, 4, 8), pos), ValueError, "k must have shape"),
        ("d_h mismatch", (q, torch.randn(2, 2, 3, 6), pos), ValueError, "k must have shape"),
        ("q rank", (q[0], k, pos), ValueError, "q must have shape"),
        ("k rank", (q, k[0], pos), ValueError, "k must have shape"),
        ("positions length", (q, k, torch.arange(4)), ValueError, "position_ids"),
        ("positions batch", (q, k, torch.zeros(3, 3, dtype=torch.long)), ValueError, "position_ids"),
        ("positions rank", (q, k, torch.zeros(2, 3, 1, dtype=torch.long)), ValueError, "position_ids"),
        ("float positions", (q, k, pos.float()), TypeError, "position_ids"),
        ("int dtype q", (q.long(), k, pos), TypeError, "q must have dtype"),
        ("dtype mismatch", (q, k.double(), pos), TypeError, "k must have dtype"),
        ("not a tensor", (q.tolist(), k, pos), TypeError, "q must be a torch.Tensor"),
        ("device mismatch", (q, k, pos.to("meta")), ValueError, "position_ids must be on cpu"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_raise(case):
    _, args, exc, match = case
    with pytest.raises(exc, match=match):
        wiola_kernels.srpe(*args)


def test_bad_parameters_raise():
    q, k, pos = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.arange(2)
    with pytest.raises(ValueError, match="theta"):
        wiola_kernels.srpe(q, k, pos, theta=0.0)
    with pytest.raises(ValueError, match="spiral_divisor"):
        wiola_kernels.srpe(q, k, pos, spiral_divisor=0.0)
    with pytest.raises(TypeError, match="radial_amplitude"):
        wiola_kernels.srpe(q, k, pos, radial_amplitude="0.1")


@pytest.mark.skipif("cpu" not in BACKENDS, reason="C++ extension not built")
def test_cpp_kernel_rejects_bad_shapes():
    """The raw kernel checks its own inputs (it is reachable as torch.ops.wiola._srpe)."""
    af, rf = srpe_frequencies(8, 10000.0, 8.0, 0.01)
    q, k, pos = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="positions must have shape"):
        torch.ops.wiola._srpe(q, k, pos[:1], af, rf, 0.1, False)
    with pytest.raises(ValueError, match="k must have shape"):
        torch.ops.wiola._srpe(q, k[:, :, :2], pos, af, rf, 0.1, False)
    with pytest.raises(ValueError, match="multiple"):
        torch.ops.wiola._srpe(q, torch.randn(2, 3, 3, 8), pos, af, rf, 0.1, False)
    with pytest.raises(ValueError, match="contiguous last dimension"):  # other strides are read in place
        torch.ops.wiola._srpe(torch.randn(2, 4, 8, 3).transpose(2, 3), k, pos, af, rf, 0.1, False)
    with pytest.raises(TypeError, match="float64"):
        torch.ops.wiola._srpe(q, k, pos, af.float(), rf, 0.1, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    q, k, pos = _inputs(3, 4, 2, 5, 6)
    args = (q.requires_grad_(True), k.requires_grad_(True), pos, 10000.0, 8.0, 0.1, 0.01)
    with use_backend(backend):
        torch.library.opcheck(torch.ops.wiola.srpe.default, args)
        torch.library.opcheck(torch.ops.wiola.srpe_backward.default,
                              (torch.randn_like(q), torch.randn_like(k), pos, 10000.0, 8.0, 0.1, 0.01))


def test_torch_compile_fullgraph_matches_eager():
    def f(q, k, pos):
        q_out, k_out = wiola_kernels.srpe(q, k, pos)
        return (q_out * q_out).sum() + (k_out * 3).sum()

    q, k, pos = _inputs(3, 4, 2, 5, 10)
    qc, kc = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    q.requires_grad_(True)
    k.requires_grad_(True)
    eager = f(q, k, pos)
    eager.backward()
    compiled = torch.compile(f, fullgraph=True)(qc, kc, pos)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(qc.grad, q.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc.grad, k.grad, rtol=1e-6, atol=1e-6)


def test_module():
    mod = SpiralRotaryEmbedding(10, theta=500.0, spiral_divisor=4.0, radial_amplitude=0.2, radial_frequency=0.05)
    assert "head_dim=10" in repr(mod) and list(mod.parameters()) == []
    q, k, pos = _inputs(2, 4, 2, 5, 10)
    q_out, k_out = mod(q, k, pos)
    q_ref, k_ref = reference_srpe(q.double(), k.double(), pos, 500.0, 4.0, 0.2, 0.05)
    assert_close_rel(q_out, q_ref, tolerance(torch.float32), "module q")
    assert_close_rel(k_out, k_ref, tolerance(torch.float32), "module k")
    with pytest.raises(ValueError, match="head dim"):
        mod(torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), pos)
    with pytest.raises(ValueError, match="head_dim"):
        SpiralRotaryEmbedding(7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_ids_shared_by_the_batch(backend):
    """``(1, T)`` and ``(T,)`` position_ids (the Hugging Face habit) mean the same positions for
    every batch row; checked against the scalar oracle with those positions per row."""
    q, k, _ = _inputs(3, 4, 2, 5, 8)
    pos = torch.tensor([7, 0, 4096, 3, 65536])
    want_q, want_k = _naive_srpe(q, pos.expand(3, 5)), _naive_srpe(k, pos.expand(3, 5))
    with use_backend(backend):
        for shared in (pos, pos[None]):
            got_q, got_k = wiola_kernels.srpe(q, k, shared)
            assert rel_err(got_q, want_q) <= tolerance(torch.float32)
            assert rel_err(got_k, want_k) <= tolerance(torch.float32)


# ---- (B, T, H, d_h) passed instead of (B, H, T, d_h) (issue 15) --------------------------------

def test_transposed_q_k_get_a_transpose_hint():
    gen = torch.Generator().manual_seed(0)
    b, t, h, h_kv, dh = 2, 5, 4, 2, 8
    q, k = torch.randn(b, t, h, dh, generator=gen), torch.randn(b, t, h_kv, dh, generator=gen)
    with pytest.raises(ValueError, match=r"^k must have shape.*pass \.transpose\(1, 2\)"):
        wiola_kernels.srpe(q, k, torch.arange(t))
    # H = H_kv: q and k agree in either layout, but the positions (length T) give it away.
    k = torch.randn(b, t, h, dh, generator=gen)
    with pytest.raises(ValueError, match=r"^position_ids must have shape.*pass \.transpose\(1, 2\)"):
        wiola_kernels.srpe(q, k, torch.arange(t))
    with pytest.raises(ValueError, match=r"^position_ids.*pass \.transpose\(1, 2\)"):
        wiola_kernels.srpe(q, k, torch.arange(t).expand(b, t))
    # The fix the hint names works: same result as the reference on the transposed tensors.
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    out_q, out_k = wiola_kernels.srpe(qt, kt, torch.arange(t))
    ref_q, ref_k = reference_srpe(qt.double(), kt.double(), torch.arange(t).expand(b, t), 10000.0, 8.0, 0.1, 0.01)
    assert rel_err(out_q, ref_q) <= tolerance(torch.float32) and rel_err(out_k, ref_k) <= tolerance(torch.float32)


def test_no_transpose_hint_when_the_shapes_do_not_fit_that_mistake():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen)  # T differs: no layout fits
    with pytest.raises(ValueError, match=r"^k must have shape") as info:
        wiola_kernels.srpe(q, k, torch.arange(5))
    assert "transpose" not in str(info.value)


def test_srpe_docstring_states_the_layout_and_the_accuracy_range_first():
    from wiola_kernels.ops.srpe import max_accurate_position

    doc = wiola_kernels.srpe.__doc__
    head = doc.split("\n\n")[1]
    assert "(B, H, T, d_h)" in head and ".transpose(1, 2)" in head and "H = H_kv = T" in head
    assert "2^20" not in doc and "max_accurate_position" in doc  # the range agrees with the code and README
    assert 2**34 < max_accurate_position(8.0) < 2**36  # "about 2^35 for k_s = 8"


# --- plain RoPE: k_s = ∞ (1/k_s = 0) and a_s = 0 (issue 13, Hugging Face models) ---------

def _rope_inputs(b, h, h_kv, t, dh, dtype, max_pos, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, dh, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, h_kv, t, dh, generator=g, dtype=torch.float64).to(dtype)
    pos = torch.randint(0, max_pos, (b, t), generator=g)
    return q, k, pos


def _naive_rope(x, pos, theta):
    """Independent float64 oracle of rotate-half RoPE (no SRPE terms): y = x cos + rot(x) sin."""
    dh = x.shape[-1]
    omega = theta ** (-2.0 * torch.arange(dh // 2, dtype=torch.float64) / dh)
    angle = pos.to(torch.float64)[:, None, :, None] * omega  # (B, 1, T, d_h/2)
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)
    xd = x.to(torch.float64)
    rot = torch.cat((-xd[..., dh // 2:], xd[..., :dh // 2]), -1)
    return xd * cos + rot * sin


@pytest.mark.parametrize("divisor", [math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_divisor_is_plain_rope(backend, dtype, divisor):
    b, h, h_kv, t, dh = (1, 2, 1, 3, 6) if backend == "triton" else (3, 4, 2, 7, 66)
    q, k, pos = _rope_inputs(b, h, h_kv, t, dh, dtype, max_pos=70000)
    q.requires_grad_(), k.requires_grad_()
    with use_backend(backend):
        q_out, k_out = wiola_kernels.srpe(q, k, pos, 500000.0, spiral_divisor=divisor, radial_amplitude=0.0,
                                          radial_frequency=0.0)
        gq, gk = torch.autograd.grad((q_out * q_out.detach()).sum() + (k_out * 2).sum(), (q, k))
    tol = srpe_tolerance(dtype, pos, divisor)
    assert_close_rel(q_out, _naive_rope(q.detach(), pos, 500000.0), tol, "q")
    assert_close_rel(k_out, _naive_rope(k.detach(), pos, 500000.0), tol, "k")
    # Backward: Rᵀ g, i.e. the rotation by −Θ = the rotation at −p.
    assert_close_rel(gq, _naive_rope(q_out.detach(), -pos, 500000.0), max(tol, 2 * tolerance(dtype)), "grad q")
    assert_close_rel(gk, _naive_rope(torch.full_like(k_out, 2.0), -pos, 500000.0), tol, "grad k")


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_rope_float32_accurate_to_2_pow_20(backend):
    # The float64 angle reduction holds for plain RoPE too: SPEC §9's 1e-5 at p < 2^20,
    # where a float32 p·ω loses ~1e-1 (see tests/test_hf.py for HF's own RoPE).
    q, k, pos = _rope_inputs(1, 2, 1, 16, 64, torch.float32, max_pos=2**20, seed=3)
    pos[0, :4] = torch.tensor([2**20 - 1, 65536, 65535, 0])
    with use_backend(backend):
        q_out, k_out = wiola_kernels.srpe(q, k, pos, 10000.0, spiral_divisor=math.inf, radial_amplitude=0.0,
                                          radial_frequency=0.0)
    assert_close_rel(q_out, _naive_rope(q, pos, 10000.0), tolerance(torch.float32), "q")
    assert_close_rel(k_out, _naive_rope(k, pos, 10000.0), tolerance(torch.float32), "k")


@pytest.mark.parametrize("divisor", [math.nan, 0.0])
def test_bad_divisor_still_rejected(divisor):
    q, k, pos = _rope_inputs(1, 1, 1, 2, 4, torch.float32, max_pos=8)
    with pytest.raises(ValueError, match="spiral_divisor"):
        wiola_kernels.srpe(q, k, pos, spiral_divisor=divisor)


# --- strided inputs, no hidden copies (issue 14 §3) ----------------------------------------

STRIDED_BACKENDS = [b for b in BACKENDS if b in ("cpu", "triton")]  # the kernels that take strides


def _model_layout_inputs(b, h, h_kv, t, dh, dtype, seed):
    """q, k as the model makes them: ``Linear(x).view(B, T, H, d_h).transpose(1, 2)`` views,
    and int64 positions expanded from ``(1, T)`` (stride 0 over the batch)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dh, generator=g, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, t, h_kv, dh, generator=g, dtype=dtype).transpose(1, 2)
    pos = torch.randperm(4 * t, generator=g)[:t].sort().values[None].expand(b, t)
    gq = torch.randn(b, t, h, dh, generator=g, dtype=dtype).transpose(1, 2)
    gk = torch.randn(b, t, h_kv, dh, generator=g, dtype=dtype).transpose(1, 2)
    return q, k, pos, gq, gk


@pytest.mark.parametrize("backend", STRIDED_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 16), (3, 2, 1, 5, 66), (1, 4, 4, 1, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_strided_views_make_no_copies(backend, dtype, shape):
    """The model's transposed q/k views go through forward and backward without one
    aten::copy_/clone/_to_copy (counted by a TorchDispatchMode inside the ops), the outputs and
    the input gradients keep the views' (B, T, H, d_h) memory order, and the values equal the
    float64 reference."""
    from wiola_kernels.testing import CopyCounter

    q, k, pos, gq, gk = _model_layout_inputs(*shape, dtype, seed=sum(shape))
    q.requires_grad_(True)
    k.requires_grad_(True)
    with use_backend(backend), CopyCounter() as fwd:
        q_out, k_out = wiola_kernels.srpe(q, k, pos)
    with use_backend(backend), CopyCounter() as bwd:
        dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (gq, gk))
    assert fwd.counts.get("wiola.srpe") == 1 and bwd.counts.get("wiola.srpe_backward") == 1
    assert fwd.copies == 0, fwd.counts
    assert bwd.copies == 0, bwd.counts
    for out, like in ((q_out, q), (k_out, k), (dq, q), (dk, k)):
        assert out.stride() == like.stride(), (out.stride(), like.stride())
    tol = srpe_tolerance(dtype, pos, 8.0)
    q_ref, k_ref = reference_srpe(q.detach().double(), k.detach().double(), pos)
    dq_ref, dk_ref = reference_srpe_backward(gq.double(), gk.double(), pos)
    assert_close_rel(q_out, q_ref, tol, f"{backend} q_out")
    assert_close_rel(k_out, k_ref, tol, f"{backend} k_out")
    assert_close_rel(dq, dq_ref, tol, f"{backend} grad q")
    assert_close_rel(dk, dk_ref, tol, f"{backend} grad k")


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_strides_match_the_reference_and_the_fake_layout(backend):
    """Layouts the kernels cannot read in place are still right: a last dimension with stride
    ≠ 1 (copied first), q sliced out of a fused qkv projection (not dense: contiguous output),
    positions with a stride ≠ 1 over T. Every backend returns the layout the op's fake
    promises (torch.empty_like of the input), which torch.compile relies on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(7)
    b, h, h_kv, t, dh = 2, 4, 2, 9, 10
    qkv = torch.randn(b, t, h + 2 * h_kv, dh, generator=g, dtype=torch.float64)
    cases = {
        "fused qkv slice": (qkv[:, :, :h].transpose(1, 2), qkv[:, :, h:h + h_kv].transpose(1, 2)),
        "last stride 2": (torch.randn(b, h, t, 2 * dh, generator=g, dtype=torch.float64)[..., ::2],
                          torch.randn(b, h_kv, t, 2 * dh, generator=g, dtype=torch.float64)[..., ::2]),
        "d_h-major": (torch.randn(b, h, dh, t, generator=g, dtype=torch.float64).transpose(2, 3),
                      torch.randn(b, h_kv, dh, t, generator=g, dtype=torch.float64).transpose(2, 3)),
    }
    pos = torch.randint(0, 5000, (b, 2 * t), generator=g)[:, ::2]
    for name, (q, k) in cases.items():
        with use_backend(backend):
            q_out, k_out = wiola_kernels.srpe(q, k, pos)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake_q, fake_k = torch.ops.wiola.srpe(q, k, pos, 10000.0, 8.0, 0.1, 0.01)
        for out, fake in ((q_out, fake_q), (k_out, fake_k)):
            significant = [s for n, s in zip(out.shape, out.stride()) if n > 1]
            assert significant == [s for n, s in zip(fake.shape, fake.stride()) if n > 1], (name, out.stride())
        q_ref, k_ref = reference_srpe(q, k, pos)
        tol = srpe_tolerance(torch.float64, pos, 8.0)
        assert_close_rel(q_out, q_ref, tol, f"{backend} {name} q_out")
        assert_close_rel(k_out, k_ref, tol, f"{backend} {name} k_out")


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_on_the_models_views(backend):
    q, k, pos, gq, gk = _model_layout_inputs(2, 4, 2, 5, 6, torch.float32, seed=3)
    with use_backend(backend):
        torch.library.opcheck(torch.ops.wiola.srpe.default,
                              (q.requires_grad_(True), k.requires_grad_(True), pos, 10000.0, 8.0, 0.1, 0.01))
        torch.library.opcheck(torch.ops.wiola.srpe_backward.default, (gq, gk, pos, 10000.0, 8.0, 0.1, 0.01))
