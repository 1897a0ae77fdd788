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
import wiola_kernels as wk
from wiola_kernels import SpiralRotaryEmbedding, reference, shapes, use_backend
from wiola_kernels.reference import srpe as reference_srpe
from wiola_kernels.reference import srpe_backward as reference_srpe_backward
from wiola_kernels.reference import srpe_frequencies
from wiola_kernels.testing import assert_close_rel, available_backends, rel_err, srpe_tolerance, tolerance

from helpers import (assert_bitwise, finite, forward_backward, gen, gpu_only, needs_cpu_extension,
                     run_on_thread_counts, strided_view)
from oracles import raises_naming, rel, srpe_oracle

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
    assert_close_rel(q_ref, _naive_srpe(q, pos), tolerance(torch.float64), "reference q")
    assert_close_rel(k_ref, _naive_srpe(k, pos), tolerance(torch.float64), "reference k")
    # (T,) positions: shared by the batch.
    q_ref1, _ = reference_srpe(q, k, pos[1])
    assert_close_rel(q_ref1, _naive_srpe(q, pos[1]), tolerance(torch.float64), "reference q, (T,) positions")


def test_reference_hand_worked_values():
    # d_h = 2: one pair, ω_0 = 1, Θ = 1.125 p, r = 1 + 0.1 sin(0.01 p).
    x = torch.tensor([1.0, 0.0], dtype=torch.float64).view(1, 1, 1, 2)
    for p in (0, 1, 100):
        y, _ = reference_srpe(x, x, torch.tensor([p]))
        r = 1.0 + 0.1 * math.sin(0.01 * p)
        expected = torch.tensor([r * math.cos(1.125 * p), r * math.sin(1.125 * p)], dtype=torch.float64)
        assert_close_rel(y.flatten(), expected, tolerance(torch.float64))
    # p = 0 is the identity for any d_h.
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    y, _ = reference_srpe(q, q, torch.tensor([0]))
    assert torch.equal(y, q)


def test_reference_backward_matches_autograd():
    q, k, pos = _inputs(3, 4, 2, 6, 10, torch.float64)
    q.requires_grad_(True)
    k.requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    q_out, k_out = reference_srpe(q, k, pos)
    dq, dk = torch.autograd.grad((q_out * gq).sum() + (k_out * gk).sum(), (q, k))
    bq, bk = reference_srpe_backward(gq, gk, pos)
    assert_close_rel(bq, dq, tolerance(torch.float64), "reference backward q")
    assert_close_rel(bk, dk, tolerance(torch.float64), "reference backward k")


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
    assert_close_rel(pair_out.sqrt(), r * pair_in.sqrt(), srpe_tolerance(torch.float64, pos, 8.0))
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
    assert_close_rel(q_out, reference_srpe(odd.double(), k.double(), pos)[0], tolerance(torch.float32), "strided")


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    q, k, pos = _inputs(3, 4, 2, 5, 6)
    args = (q, k, pos, 10000.0, 8.0, 0.1, 0.01)  # autograd is SRPEFunction's: the ops take no grad
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
    assert_close_rel(compiled, eager, tolerance(torch.float32))
    assert_close_rel(qc.grad, q.grad, tolerance(torch.float32))
    assert_close_rel(kc.grad, k.grad, tolerance(torch.float32))


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


# ========================================================================================
# Backends and draws of the sections below: from SPEC alone, numerics at the edges, properties,
# bitwise determinism, GPU
# ========================================================================================

SPEC_BACKENDS = [name for name, state in wk.backends("cpu")["srpe"].items() if state == "available"]
EDGE_BACKENDS = [b for b in available_backends("srpe", "cpu") if b in ("cpu", "reference")]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SEEDS = st.integers(0, 2**32 - 1)  # every tensor comes from a generator seeded by a drawn seed


# ========================================================================================
# From SPEC alone: the public API against tests/oracles.py (no wiola_kernels.reference)
# ========================================================================================

def _srpe_case(B=3, H=4, Hkv=2, T=5, dh=8, dtype=torch.float32):
    q = torch.randn(B, H, T, dh).to(dtype)
    k = torch.randn(B, Hkv, T, dh).to(dtype)
    return q, k


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_forward_positions_are_position_ids(backend):
    q, k = _srpe_case(B=3, T=5, dh=8)
    pos = torch.tensor([[7, 3, 100, 0, 41], [5, 6, 7, 8, 9], [1000, 2, 2, 513, 64]])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == q.dtype
    assert rel(qo, srpe_oracle(q, pos)) <= tolerance(torch.float32)
    assert rel(ko, srpe_oracle(k, pos)) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_shared_1d_positions(backend):
    q, k = _srpe_case(B=3, T=6, dh=6)         # d_h/2 = 3 pairs (odd count)
    pos = torch.tensor([9, 8, 7, 300, 2, 0])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    pb = pos.expand(3, 6)
    assert rel(qo, srpe_oracle(q, pb)) <= tolerance(torch.float32)
    assert rel(ko, srpe_oracle(k, pb)) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_large_positions_fp32(backend):
    # SPEC §4: float32 outputs within 1e-5 of float64 at every position below 2^20.
    T = 8
    q, k = _srpe_case(B=2, H=2, Hkv=1, T=T, dh=16)
    pos = torch.tensor([[2**20 - 1, 2**20 - 2, 65536, 999_983, 524_287, 123_457, 777_777, 3],
                        [1_048_000, 917_503, 65537, 2**19, 1, 0, 333_333, 2**20 - 7]])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    ref_q, ref_k = srpe_oracle(q, pos), srpe_oracle(k, pos)
    assert rel(qo, ref_q) <= tolerance(torch.float32)
    assert rel(ko, ref_k) <= tolerance(torch.float32)
    # also per position (an error at one position must not hide in the average)
    for t in range(T):
        assert rel(qo[:, :, t], ref_q[:, :, t]) <= tolerance(torch.float32), pos[:, t]


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_srpe_large_positions_d64(backend, dtype):
    # the model's head width: ω_j spans 1 … 1e4^(-62/64)
    q, k = _srpe_case(B=1, H=2, Hkv=1, T=4, dh=64, dtype=dtype)
    pos = torch.tensor([[2**20 - 1, 786_431, 65_536, 300_001]])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    assert rel(qo, srpe_oracle(q, pos)) <= tolerance(dtype)
    assert rel(ko, srpe_oracle(k, pos)) <= tolerance(dtype)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_hyperparameters_are_used(backend):
    q, k = _srpe_case(B=1, H=3, Hkv=1, T=4, dh=10)
    pos = torch.tensor([[1, 17, 250, 4000]])
    kw = dict(theta=500.0, spiral_divisor=3.0, radial_amplitude=0.3, radial_frequency=0.05)
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos, **kw)
    assert rel(qo, srpe_oracle(q, pos, 500.0, 3.0, 0.3, 0.05)) <= tolerance(torch.float32)
    assert rel(ko, srpe_oracle(k, pos, 500.0, 3.0, 0.3, 0.05)) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_not_norm_preserving(backend):
    # Each pair is scaled by r_j(p): |y_pair| = r_j(p) |q_pair|.
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    pos = torch.tensor([50, 120, 300])
    with wk.use_backend(backend):
        qo, _ = wk.srpe(q, k, pos)
    for t, p in enumerate(pos.tolist()):
        for j in range(2):
            w_j = 10000.0 ** (-2 * j / 4)
            r = 1 + 0.1 * math.sin(p * 0.01 * w_j)
            n_in = math.hypot(q[0, 0, t, j], q[0, 0, t, j + 2])
            n_out = math.hypot(qo[0, 0, t, j], qo[0, 0, t, j + 2])
            assert abs(n_out - r * n_in) <= srpe_tolerance(torch.float64, pos, 8.0) * max(1.0, n_in)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_srpe_dtypes(backend, dtype):
    q, k = _srpe_case(B=1, T=5, dh=8, dtype=dtype)
    pos = torch.tensor([0, 3, 11, 70, 2000])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    assert qo.dtype == dtype and ko.dtype == dtype
    pb = pos.expand(1, 5)
    assert rel(qo, srpe_oracle(q, pb)) <= tolerance(dtype)
    assert rel(ko, srpe_oracle(k, pb)) <= tolerance(dtype)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_backward_is_transpose(backend):
    q, k = _srpe_case(B=3, H=4, Hkv=2, T=5, dh=8)
    pos = torch.tensor([[4, 1, 9, 1000, 77]] * 2 + [[0, 0, 5, 5, 65536]])
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    with wk.use_backend(backend):
        qo, ko = wk.srpe(qq, kk, pos)
    torch.autograd.backward((qo, ko), (gq, gk))
    qd, kd = q.double().requires_grad_(), k.double().requires_grad_()
    torch.autograd.backward((srpe_oracle(qd, pos), srpe_oracle(kd, pos)), (gq.double(), gk.double()))
    assert rel(qq.grad, qd.grad) <= tolerance(torch.float32)
    assert rel(kk.grad, kd.grad) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_backward_half(backend):
    q, k = _srpe_case(B=1, H=2, Hkv=1, T=4, dh=8, dtype=torch.bfloat16)
    pos = torch.tensor([[3, 99, 4096, 70000]])
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    with wk.use_backend(backend):
        torch.autograd.backward(wk.srpe(qq, kk, pos), (gq, gk))
    qd, kd = q.double().requires_grad_(), k.double().requires_grad_()
    torch.autograd.backward((srpe_oracle(qd, pos), srpe_oracle(kd, pos)), (gq.double(), gk.double()))
    assert qq.grad.dtype == torch.bfloat16
    assert rel(qq.grad, qd.grad) <= tolerance(torch.bfloat16) and rel(kk.grad, kd.grad) <= tolerance(torch.bfloat16)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_gradcheck(backend):
    q = torch.randn(1, 2, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 2, 4, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[70, 1]])
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda a, b: wk.srpe(a, b, pos), (q, k))


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_noncontiguous_and_t1(backend):
    B, T, H, Hkv, dh = 3, 5, 4, 2, 8
    q = torch.randn(B, T, H, dh).transpose(1, 2)             # the usual (B,T,H,d) → (B,H,T,d) view
    k = torch.randn(B, T, Hkv, 2 * dh)[..., ::2].transpose(1, 2)
    pos = torch.arange(T) * 3 + 1
    qc, kc = q.clone(), k.clone()
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    pb = pos.expand(B, T)
    assert rel(qo, srpe_oracle(q, pb)) <= tolerance(torch.float32)
    assert rel(ko, srpe_oracle(k, pb)) <= tolerance(torch.float32)
    assert torch.equal(q, qc) and torch.equal(k, kc)        # inputs untouched
    # expanded keys and T = 1
    k1 = torch.randn(1, 1, 1, dh).expand(B, Hkv, 1, dh)
    q1 = torch.randn(B, H, 1, dh)
    p1 = torch.tensor([[5], [12345], [0]])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q1, k1, p1)
    assert rel(qo, srpe_oracle(q1, p1)) <= tolerance(torch.float32)
    assert rel(ko, srpe_oracle(k1, p1)) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_noncontiguous_grads(backend):
    q, k = _srpe_case(B=2, H=2, Hkv=1, T=3, dh=4)
    pos = torch.tensor([5, 70, 900])
    gq = torch.randn(2, 3, 2, 4).transpose(1, 2)            # strided output gradient
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    with wk.use_backend(backend):
        qo, ko = wk.srpe(qq, kk, pos)
    torch.autograd.backward((qo, ko.sum()), (gq, None))    # ko.sum(): a stride-0 gradient
    qd, kd = q.double().requires_grad_(), k.double().requires_grad_()
    torch.autograd.backward((srpe_oracle(qd, pos.expand(2, 3)), srpe_oracle(kd, pos.expand(2, 3)).sum()),
                            (gq.double(), None))
    assert rel(qq.grad, qd.grad) <= tolerance(torch.float32) and rel(kk.grad, kd.grad) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_srpe_int32_positions(backend):
    q, k = _srpe_case(B=1, T=3, dh=4)
    pos = torch.tensor([[5, 900, 2**20 - 1]], dtype=torch.int32)
    with wk.use_backend(backend):
        qo, _ = wk.srpe(q, k, pos)
    assert rel(qo, srpe_oracle(q, pos)) <= tolerance(torch.float32)


_Q, _K = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
_P = torch.arange(5)
SRPE_BAD = {
    "odd_d_h": (lambda: wk.srpe(torch.randn(2, 4, 5, 7), torch.randn(2, 2, 5, 7), _P), ["d_h", "head_dim", "q"]),
    "q_rank3": (lambda: wk.srpe(torch.randn(4, 5, 8), _K, _P), ["q"]),
    "k_d_h_mismatch": (lambda: wk.srpe(_Q, torch.randn(2, 2, 5, 6), _P), ["k"]),
    "k_T_mismatch": (lambda: wk.srpe(_Q, torch.randn(2, 2, 4, 8), _P), ["k"]),
    "k_B_mismatch": (lambda: wk.srpe(_Q, torch.randn(3, 2, 5, 8), _P), ["k"]),
    "H_not_multiple_of_H_kv": (lambda: wk.srpe(_Q, torch.randn(2, 3, 5, 8), _P), ["H_kv", "k"]),
    "positions_wrong_T": (lambda: wk.srpe(_Q, _K, torch.arange(6)), ["position_ids", "positions"]),
    "positions_wrong_B": (lambda: wk.srpe(_Q, _K, torch.zeros(3, 5, dtype=torch.long)), ["position_ids", "positions"]),
    "positions_float": (lambda: wk.srpe(_Q, _K, torch.arange(5.0)), ["position_ids", "positions"]),
    "positions_list": (lambda: wk.srpe(_Q, _K, list(range(5))), ["position_ids", "positions"]),
    "q_int": (lambda: wk.srpe(_Q.to(torch.int32), _K, _P), ["q"]),
    "q_complex": (lambda: wk.srpe(_Q.to(torch.complex64), _K, _P), ["q"]),
    "k_dtype_mismatch": (lambda: wk.srpe(_Q, _K.double(), _P), ["k"]),
    "q_list": (lambda: wk.srpe(_Q.tolist(), _K, _P), ["q"]),
    "k_other_device": (lambda: wk.srpe(_Q, _K.to("meta"), _P), ["k", "device"]),
}


@pytest.mark.parametrize("case", list(SRPE_BAD))
def test_srpe_bad_inputs(case):
    fn, names = SRPE_BAD[case]
    raises_naming((ValueError, TypeError), names, fn)


def test_srpe_module_defaults():
    m = SpiralRotaryEmbedding(8)
    assert len(list(m.parameters())) == 0
    q, k = _srpe_case(B=2, H=2, Hkv=1, T=4, dh=8)
    pos = torch.tensor([[0, 1, 2, 3], [10, 20, 30, 40000]])
    qo, ko = m(q, k, pos)
    assert rel(qo, srpe_oracle(q, pos)) <= tolerance(torch.float32)   # θ₀ 1e4, k_s 8, a_s 0.1, f_s 0.01
    assert rel(ko, srpe_oracle(k, pos)) <= tolerance(torch.float32)


def test_srpe_module_custom_hyperparameters():
    m = SpiralRotaryEmbedding(6, theta=100.0, spiral_divisor=2.0, radial_amplitude=0.5, radial_frequency=0.2)
    q, k = _srpe_case(B=1, H=2, Hkv=2, T=3, dh=6)
    pos = torch.tensor([7, 30, 1])
    qo, ko = m(q, k, pos)
    pb = pos.expand(1, 3)
    assert rel(qo, srpe_oracle(q, pb, 100.0, 2.0, 0.5, 0.2)) <= tolerance(torch.float32)
    assert rel(ko, srpe_oracle(k, pb, 100.0, 2.0, 0.5, 0.2)) <= tolerance(torch.float32)


def test_srpe_opcheck():
    q = torch.randn(1, 2, 3, 4)  # the registered ops take no grad (autograd is wk.SRPEFunction's)
    k = torch.randn(1, 1, 3, 4)
    pos = torch.tensor([[0, 5, 9]])
    torch.library.opcheck(torch.ops.wiola.srpe.default, (q, k, pos, 10000.0, 8.0, 0.1, 0.01))


def test_srpe_compile_fullgraph():
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    k = torch.randn(1, 1, 3, 4, requires_grad=True)
    pos = torch.tensor([[0, 5, 9]])
    f = torch.compile(lambda a, b, p: wk.srpe(a, b, p), fullgraph=True, backend="aot_eager")
    qo, ko = f(q, k, pos)
    assert rel(qo, srpe_oracle(q.detach(), pos)) <= tolerance(torch.float32)
    (qo.sum() + ko.sum()).backward()
    assert q.grad is not None and k.grad is not None


# ========================================================================================
# Numerics at the edges
# Every CPU backend (reference, cpu): huge and tiny magnitudes, all-zero rows, masked rows,
# and NaN/Inf confinement (a non-finite value in one row never reaches another row or batch
# element, forward or backward). What must hold:
#
# * srpe — linear in q, k: huge/tiny magnitudes keep the relative tolerance as long as
#   the output is representable.
#
# SRPE position range. Every backend computes the angle ``p·ω_j·(1 + 1/k_s)`` in float64
# and reduces it modulo 2π in float64 (the CPU kernel's Cody–Waite reduction uses FMA, so
# the reduction adds ~1e-16 absolute). The remaining error is that of the float64 angle
# itself: ``ω_j`` and the product are each rounded once, so the angle error is at most
# ``≈ p·ω_j·(1 + 1/k_s)·2^-52`` (two half-ulps of a number of size ``p·ω_j(1+1/k_s)``), and
# a pair rotated by a wrong angle δ has relative error ≈ δ. With ``ω_0 = 1`` the worst pair
# meets the float32 tolerance 1e-5 while ``p ≤ 1e-5·2^52 / (1 + 1/k_s) ≈ 4.5e10/(1 + 1/k_s)``:
# for the default ``k_s = 8`` that is ``p ≤ 4.0e10 ≈ 2^35.2``; for ``k_s = 1``,
# ``p ≤ 2.3e10 ≈ 2^34.4``. **Largest safe position: 2^34 (≈1.7e10) for every k_s ≥ 1;
# 2^35 for the default k_s = 8.** Measured (d_h = 128, defaults, against a 200-bit
# mpmath evaluation): relative error 5e-8 at 2^31, 4e-7 at 2^35, 3.4e-6 at 2^38,
# 1.6e-5 at 2^40 — the whole-vector error is ~10× below the worst-pair bound. The SPEC
# requires 2^20; tests below check 2^31 (and 2^34 against mpmath). Positions are int64;
# beyond 2^53 the float64 conversion of p itself is inexact. ``wk.srpe`` refuses CPU
# positions beyond ``wiola_kernels.ops.srpe.max_accurate_position(k_s)`` (tested below).
# ========================================================================================

def _srpe(backend, q, k, pos, grad=None, **kw):
    q = q.clone().requires_grad_(grad is not None)
    k = k.clone().requires_grad_(grad is not None)
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos, **kw)
        if grad is None:
            return qo.detach(), ko.detach(), None
        return qo.detach(), ko.detach(), torch.autograd.grad((qo, ko), (q, k), grad)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
def test_srpe_float32_meets_tolerance_up_to_2_31(backend):
    g = gen(4)
    b, h, h_kv, t, dh = 2, 2, 1, 64, 128
    pos = torch.randint(2**31 - 2**24, 2**31 + 1, (b, t), generator=g)
    pos[0, :5] = torch.tensor([2**31, 2**31 - 1, 2**30, 2**24 + 1, 2**20])
    q, k = torch.randn(b, h, t, dh, generator=g), torch.randn(b, h_kv, t, dh, generator=g)
    for ks in (8.0, 1.0):
        qo, ko, _ = _srpe(backend, q, k, pos, spiral_divisor=ks)
        q_ref, k_ref = reference.srpe(q.double(), k.double(), pos, spiral_divisor=ks)
        assert rel_err(qo, q_ref) <= tolerance(torch.float32) and rel_err(ko, k_ref) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
def test_srpe_large_positions_against_mpmath(backend):
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
        qo, _, _ = _srpe(backend, q.float(), q.float(), torch.tensor([p]), theta=theta, spiral_divisor=ks,
                         radial_amplitude=a_s, radial_frequency=f_s)
        bound = max(p * (1 + 1 / ks) * 2.0**-52, 1e-7)  # worst pair; + float32 rounding of the output
        assert rel_err(qo, exact) <= min(bound, 1e-5), p


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("dtype,scale,a_s", [(torch.float32, 1e30, 0.1), (torch.float32, 1e-30, 0.1),
                                             (torch.bfloat16, 1e37, 0.0), (torch.bfloat16, 1e-30, 0.1),
                                             (torch.float16, 2e4, 0.0), (torch.float16, 1e-3, 0.1)])
def test_srpe_huge_and_tiny_magnitudes(backend, dtype, scale, a_s):
    """Linear in q, k: the relative tolerance holds while outputs are representable (|y| ≤ √2·(1+a_s)·|q|)."""
    g = gen(6)
    q = (torch.randn(2, 2, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype)
    k = (torch.randn(2, 1, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype)
    pos = torch.randint(0, 2**20, (2, 9), generator=g)
    grad = (torch.randn(2, 2, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype), \
        (torch.randn(2, 1, 9, 16, generator=g).clamp(-2, 2) * scale).to(dtype)
    qo, ko, (gq, gk) = _srpe(backend, q, k, pos, grad=grad, radial_amplitude=a_s)
    assert finite(qo, ko, gq, gk)
    q_ref, k_ref = reference.srpe(q.double(), k.double(), pos, radial_amplitude=a_s)
    gq_ref, gk_ref = reference.srpe_backward(grad[0].double(), grad[1].double(), pos, radial_amplitude=a_s)
    for got, want in ((qo, q_ref), (ko, k_ref), (gq, gq_ref), (gk, gk_ref)):
        assert rel_err(got, want) <= tolerance(dtype)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_srpe_nonfinite_token_is_confined(backend, bad):
    g = gen(7)
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


# ========================================================================================
# Properties (hypothesis): any shape, stride, dtype; bad input names the argument
# ========================================================================================

@given(
    b=st.integers(1, 3), h_kv=st.integers(1, 3), groups=st.integers(1, 3), t=st.integers(1, 20),
    half=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
    how=st.sampled_from(["contiguous", "transposed", "sliced"]),
    pos_max=st.sampled_from([1, 2048, 2**20]), shared_positions=st.booleans(),
    theta=st.sampled_from([100.0, 10000.0, 500000.0]), k_s=st.sampled_from([-3.0, 1.0, 8.0]),
    a_s=st.sampled_from([0.0, 0.1, 0.5]), f_s=st.sampled_from([0.0, 0.01, 1.0]),
    backend=st.sampled_from(EDGE_BACKENDS), seed=SEEDS,
)
def test_srpe_any_shape_stride_dtype(b, h_kv, groups, t, half, dtype, how, pos_max, shared_positions, theta,
                                     k_s, a_s, f_s, backend, seed):
    h, dh = h_kv * groups, 2 * half
    g = torch.Generator().manual_seed(seed)
    q64 = torch.randn(b, h, t, dh, dtype=torch.float64, generator=g)
    k64 = torch.randn(b, h_kv, t, dh, dtype=torch.float64, generator=g)
    pos = torch.randint(0, pos_max, (t,) if shared_positions else (b, t), generator=g)
    q, k = strided_view(q64.to(dtype), how), strided_view(k64.to(dtype), how)
    with wk.use_backend(backend):
        q_out, k_out = wk.srpe(q, k, pos, theta, k_s, a_s, f_s)
    q_ref, k_ref = reference.srpe(q.double(), k.double(), pos, theta, k_s, a_s, f_s)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    tol = srpe_tolerance(dtype, pos, k_s)  # float64: bounded by the float64 angle's own rounding
    assert rel_err(q_out, q_ref) <= tol
    assert rel_err(k_out, k_ref) <= tol



@given(
    q_dh=st.integers(1, 9), k_dh=st.integers(1, 9), h=st.integers(1, 6), h_kv=st.integers(1, 6),
    t_q=st.integers(1, 4), t_k=st.integers(1, 4),
    pos_kind=st.sampled_from(["T", "BT", "float", "wrong_len", "3d"]), seed=SEEDS,
)
def test_srpe_bad_input_raises_named_error(q_dh, k_dh, h, h_kv, t_q, t_k, pos_kind, seed):
    g = torch.Generator().manual_seed(seed)
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


# ========================================================================================
# Bitwise determinism of the C++ kernel, 1 vs 2 threads (helpers.run_on_thread_counts)
# ========================================================================================

@needs_cpu_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_srpe_bitwise_reproducible(dtype):
    g = gen(1)
    q, k = torch.randn(2, 4, 300, 64, generator=g).to(dtype), torch.randn(2, 2, 300, 64, generator=g).to(dtype)
    pos = torch.randint(0, 2**20, (2, 300), generator=g)
    gq, gk = torch.randn(2, 4, 300, 64, generator=g).to(dtype), torch.randn(2, 2, 300, 64, generator=g).to(dtype)

    def fn(q, k, pos):
        qo, ko = wk.srpe(q, k, pos)
        # one output for the harness: concatenate along heads (grad split back by autograd)
        return torch.cat([qo, ko], 1), torch.cat([gq, gk], 1)

    assert_bitwise(run_on_thread_counts(fn, [q, k, pos]), ["out", "grad_q", "grad_k"])


# ========================================================================================
# On a GPU (skipped without one)
# ========================================================================================

@pytest.mark.parametrize("dtype", shapes.SRPE_GPU_TEST_DTYPES)
@pytest.mark.parametrize("b, h, h_kv, t, dh", shapes.SRPE_GPU_TEST_SHAPES)  # what gpu-report compiles ahead of time
@gpu_only
def test_srpe_triton_vs_float64(b, h, h_kv, t, dh, dtype):
    q, k = torch.randn(b, h, t, dh, dtype=torch.float64), torch.randn(b, h_kv, t, dh, dtype=torch.float64)
    pos = torch.randint(0, 2**20, (b, t))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    with wk.use_backend("triton"):
        outs, grads = forward_backward(lambda a, c: wk.srpe(a, c, pos.to("cuda")),
                                       [q.to("cuda", dtype), k.to("cuda", dtype)],
                                       [gq.to("cuda", dtype), gk.to("cuda", dtype)])
    ref_outs, ref_grads = forward_backward(lambda a, c: reference.srpe(a, c, pos), [q, k], [gq, gk])
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert_close_rel(got.cpu(), want, tolerance(dtype))


# ---- (B, T, H, d_h) passed instead of (B, H, T, d_h) --------------------------------

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


# --- plain RoPE: k_s = ∞ (1/k_s = 0) and a_s = 0 (Hugging Face models) ---------

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


# --- strided inputs, no hidden copies ----------------------------------------

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
    dispatched = 1 if backend == "cpu" else None  # a forced Python backend calls no registered op
    assert fwd.counts.get("wiola.srpe") == dispatched and bwd.counts.get("wiola.srpe_backward") == dispatched
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
                              (q, k, pos, 10000.0, 8.0, 0.1, 0.01))  # the ops take no grad: SRPEFunction's
        torch.library.opcheck(torch.ops.wiola.srpe_backward.default, (gq, gk, pos, 10000.0, 8.0, 0.1, 0.01))
