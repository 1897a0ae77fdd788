"""Property-based tests (hypothesis): random shapes, strides, dtypes and parameters for
the public ops on every CPU backend. Each call either matches the float64 reference
within the SPEC §9 tolerance or raises ValueError/TypeError naming an argument.

Example counts are small for CI; HYPOTHESIS_PROFILE=long runs many more."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wiola_kernels as wk
from wiola_kernels import reference
from wiola_kernels.testing import available_backends, rel_err, srpe_tolerance, tolerance

CPU_BACKENDS = [b for b in available_backends("rms_norm", "cpu") if b != "triton"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


SEEDS = st.integers(0, 2**32 - 1)  # every tensor comes from a generator seeded by a drawn seed


def strided_view(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as ``t`` through a non-contiguous view."""
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "sliced":
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if how == "expanded" and t.dim() >= 2 and t.shape[0] == 1:
        return t[:1].expand(*t.shape)
    return t


@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    d=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    how=st.sampled_from(["contiguous", "transposed", "sliced", "expanded"]),
    eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    backend=st.sampled_from(CPU_BACKENDS), seed=SEEDS,
)
def test_rms_norm_any_shape_stride_dtype(lead, d, dtype, how, eps, scale, backend, seed):
    g = torch.Generator().manual_seed(seed)
    x64 = scale * torch.randn(*lead, d, dtype=torch.float64, generator=g)
    w64 = torch.rand(d, dtype=torch.float64, generator=g) + 0.5
    s64 = 0.3 * scale * torch.randn(d, dtype=torch.float64, generator=g)
    x = strided_view(x64.to(dtype), how)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w64.to(dtype), s64.to(dtype), eps)
    assert y.shape == x.shape and y.dtype == dtype
    # Compare with the reference on the same (rounded) inputs, in float64.
    want = reference.rms_norm(x.double(), w64.to(dtype).double(), s64.to(dtype).double(), eps)
    tol = tolerance(dtype) if d > 1 else tolerance(dtype) * 10
    assert rel_err(y, want) <= tol


@given(
    b=st.integers(1, 3), h_kv=st.integers(1, 3), groups=st.integers(1, 3), t=st.integers(1, 20),
    half=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
    how=st.sampled_from(["contiguous", "transposed", "sliced"]),
    pos_max=st.sampled_from([1, 2048, 2**20]), shared_positions=st.booleans(),
    theta=st.sampled_from([100.0, 10000.0, 500000.0]), k_s=st.sampled_from([-3.0, 1.0, 8.0]),
    a_s=st.sampled_from([0.0, 0.1, 0.5]), f_s=st.sampled_from([0.0, 0.01, 1.0]),
    backend=st.sampled_from(CPU_BACKENDS), seed=SEEDS,
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
    x_rank=st.integers(0, 3), w_len=st.integers(0, 6), s_len=st.integers(0, 6), d=st.integers(1, 6),
    x_dtype=st.sampled_from([torch.float32, torch.int64, torch.bool]),
    eps=st.sampled_from([1e-6, 0.0, -1.0, "1e-6", None]),
)
def test_rms_norm_bad_input_raises_named_error(x_rank, w_len, s_len, d, x_dtype, eps):
    x = torch.ones(*([2] * x_rank), d).to(x_dtype) if x_rank > 0 else torch.ones(()).to(x_dtype)
    try:
        y = wk.rms_norm(x, torch.ones(w_len), torch.zeros(s_len), eps)
    except (ValueError, TypeError) as exc:
        assert any(name in str(exc) for name in ("x", "weight", "shift", "eps"))
        return
    # Accepted: then it must have been a valid call.
    assert x_dtype == torch.float32 and w_len == s_len == d and isinstance(eps, float) and eps > 0
    assert y.shape == x.shape


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


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ops_are_thread_safe(backend):
    """Several Python threads calling every op at once on different tensors get correct
    results (the extension holds no global mutable state)."""
    from concurrent.futures import ThreadPoolExecutor

    def job(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 200, generator=g)
        w, s = torch.rand(200, generator=g) + 0.5, torch.randn(200, generator=g)
        q, k = torch.randn(2, 4, 33, 16, generator=g), torch.randn(2, 2, 33, 16, generator=g)
        pos = torch.randint(0, 10**5, (2, 33), generator=g)
        qr, q0 = torch.randn(1, 4, 40, 16, generator=g), torch.randn(1, 4, 40, 16, generator=g)
        kr, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
        kc, vc = torch.randn(1, 4, 40, 2, 16, generator=g), torch.randn(1, 4, 40, 2, 16, generator=g)
        gate, lengths = torch.randn(4, generator=g), torch.tensor([31])
        xa = torch.randn(2, 50, 24, generator=g)
        xa[:, 1::3] = xa[:, ::3][:, : xa[:, 1::3].shape[1]]  # planted duplicates: some pairs merge
        with wk.use_backend(backend):
            y = wk.rms_norm(x, w, s)
            qo, ko = wk.srpe(q, k, pos)
            attn = wk.gcla_attention(qr, kr, v, q0, kc, vc, gate, lengths)
            merged, _, mlen, imap = wk.atm_merge(xa, torch.arange(50), 0.9)
        with wk.use_backend("reference"):
            attn_ref = wk.gcla_attention(*(t.double() for t in (qr, kr, v, q0, kc, vc, gate)), lengths)
            merged_ref, _, mlen_ref, imap_ref = wk.atm_merge(xa.double(), torch.arange(50), 0.9)
        assert torch.equal(imap, imap_ref) and torch.equal(mlen, mlen_ref) and int(mlen.sum()) < 100
        return (rel_err(y, reference.rms_norm(x.double(), w.double(), s.double())),
                rel_err(qo, reference.srpe(q.double(), k.double(), pos)[0]),
                rel_err(attn, attn_ref) / 10,  # attention's tolerance is 1e-4
                rel_err(merged, merged_ref))

    with ThreadPoolExecutor(max_workers=4) as pool:
        errors = list(pool.map(job, range(16)))
    assert all(e <= 1e-5 for errs in errors for e in errs), errors
