"""Property-based tests (hypothesis) for ``gcla_attention`` and ``atm_merge`` /
``atm_unmerge`` on every CPU backend (reference, cpu): random small shapes including
degenerate ones (B = 0/1, T = 1, Λ' = 0, S = 1 and S = T, d_h not a multiple of 8,
lengths 0 and T), random strides (transposed, sliced, expanded views), every supported
dtype and random gate / threshold values. Each call either matches the float64
reference within the SPEC §9 tolerance (forward and backward) or raises
ValueError/TypeError naming an argument — nothing else.

Example counts are small for CI (profile "ci"); HYPOTHESIS_PROFILE=long runs many more."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wiola_kernels as wk
from wiola_kernels.reference import atm as atm_ref
from wiola_kernels.reference.gcla_attention import gcla_attention_backward, gcla_attention_forward
from wiola_kernels.testing import available_backends, rel_err, tolerance

GCLA_BACKENDS = [b for b in available_backends("gcla_attention", "cpu") if b in ("cpu", "reference")]
ATM_BACKENDS = [b for b in available_backends("atm", "cpu") if b in ("cpu", "reference")]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]


def _lengths(len_kind: str, b: int, t: int, g: torch.Generator) -> torch.Tensor | None:
    """Per-row lengths of one drawn kind: none, all zero, all full, random (int64 or int32)."""
    if len_kind == "none":
        return None
    if len_kind == "zeros":
        return torch.zeros(b, dtype=torch.int64)
    if len_kind == "full":
        return torch.full((b,), t, dtype=torch.int64)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    return lengths.to(torch.int32) if len_kind == "int32" else lengths


def view_as(values: torch.Tensor, dtype: torch.dtype, how: str, expand_dim: int = 0) -> torch.Tensor:
    """``values`` (float64) in ``dtype`` through a view of the given layout. For "expanded"
    the values are first made constant along ``expand_dim`` (so the view is exact)."""
    t = values.to(dtype)
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "sliced" and t.shape[-1] > 0:
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=dtype)
        big[..., 1::2] = t
        return big[..., 1::2]
    if how == "expanded" and t.dim() >= 1 and t.shape[expand_dim] > 0:
        return t.narrow(expand_dim, 0, 1).expand(*t.shape)
    return t


def close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str, floor: float = 0.25) -> None:
    """Relative error with the reference norm floored at ``floor`` per element (unit-scale
    inputs; some gradients are exactly zero where kernels see rounding noise)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.detach().double(), ref.detach().double()
    assert torch.isfinite(o).all(), f"{what}: non-finite values"
    den = max(float(r.norm()), floor * math.sqrt(max(r.numel(), 1)))
    err = float((o - r).norm()) / den
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# --- GCLA attention -------------------------------------------------------------------

@given(
    b=st.integers(0, 3), h_kv=st.integers(1, 3), groups=st.integers(1, 2), t=st.integers(1, 18),
    half=st.integers(1, 12), s_full=st.booleans(), slots=st.integers(0, 3),
    dtype=st.sampled_from(DTYPES), how=st.sampled_from(LAYOUTS),
    gate=st.lists(st.floats(-8.0, 8.0), min_size=1, max_size=1),
    len_kind=st.sampled_from(["none", "random", "zeros", "full", "int32"]),
    scale=st.sampled_from([0.3, 1.0, 3.0]), check_grad=st.booleans(),
    backend=st.sampled_from(GCLA_BACKENDS), data=st.data(),
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
    lengths = _lengths(len_kind, b, t, g)

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


# --- ATM --------------------------------------------------------------------------------

def _atm_rows(g: torch.Generator, b: int, t: int, d: int, p_dup: float, p_neg: float, p_zero: float) -> torch.Tensor:
    """Rows of noisy (signed) basis vectors: adjacent similarities cluster near −1, 0 and 1
    (away from the thresholds ±0.5 and 0, mostly), with some all-zero tokens."""
    k = torch.randint(0, d, (b, t), generator=g)
    dup = torch.rand(b, t, generator=g) < p_dup
    for j in range(1, t):
        k[:, j] = torch.where(dup[:, j], k[:, j - 1], k[:, j])
    sign = torch.where(torch.rand(b, t, 1, generator=g) < p_neg, -1.0, 1.0).double()
    x = torch.nn.functional.one_hot(k, d).double() * sign * (1 + torch.rand(b, t, 1, generator=g, dtype=torch.float64))
    x = x + 0.02 * torch.randn(b, t, d, generator=g, dtype=torch.float64)
    zero = torch.rand(b, t, 1, generator=g) < p_zero
    return torch.where(zero, torch.zeros_like(x), x)


def _expected_merged(x64: torch.Tensor, index_map: torch.Tensor, merged_lengths: torch.Tensor) -> torch.Tensor:
    """The merged tensor that ``index_map`` implies, in float64 (pair means, zeros after T')."""
    w = atm_ref._merge_weights(index_map, merged_lengths, torch.float64)
    b, t, d = x64.shape
    return torch.zeros_like(x64).scatter_add(1, index_map.unsqueeze(-1).expand(b, t, d), x64 * w.unsqueeze(-1))


def _ambiguous(x64: torch.Tensor, lengths: torch.Tensor, tau: float, margin: float) -> bool:
    """Whether some valid edge has a similarity within ``margin`` of τ (or at an exact ±1 or
    zero-norm boundary), where the accumulation dtype may legitimately decide either way."""
    if x64.shape[1] < 2:
        return False
    sim = atm_ref.atm_similarity(x64)
    edge = torch.arange(x64.shape[1] - 1)
    valid = edge[None, :] + 1 < lengths[:, None]
    return bool(((sim - tau).abs() <= margin)[valid].any())


@given(
    b=st.integers(0, 4), t=st.integers(1, 24), d=st.integers(1, 20), dtype=st.sampled_from(DTYPES),
    how=st.sampled_from(LAYOUTS), tau=st.sampled_from([-1.0, -0.5, 0.0, 0.5, 0.9, 1.0]) | st.floats(-1.0, 1.0),
    len_kind=st.sampled_from(["none", "random", "zeros", "full", "int32"]), shared_pos=st.booleans(),
    p_dup=st.sampled_from([0.0, 0.5, 0.9]), p_neg=st.sampled_from([0.0, 0.3]), p_zero=st.sampled_from([0.0, 0.2]),
    backend=st.sampled_from(ATM_BACKENDS), data=st.data(),
)
def test_atm_any_shape_stride_dtype(b, t, d, dtype, how, tau, len_kind, shared_pos, p_dup, p_neg, p_zero, backend,
                                    data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = view_as(_atm_rows(g, b, t, d, p_dup, p_neg, p_zero), dtype, how, expand_dim=0)
    x64 = x.double()
    pos = torch.randint(0, 10**6, (t,) if shared_pos else (b, t), generator=g)
    lengths = _lengths(len_kind, b, t, g)
    lens64 = torch.full((b,), t, dtype=torch.int64) if lengths is None else lengths.long()
    y = view_as(torch.randn(b, t, d, generator=g, dtype=torch.float64), dtype, how, expand_dim=0)
    grad = torch.randn(b, t, d, generator=g, dtype=torch.float64).to(dtype)

    xg, yg = x.requires_grad_(), y.requires_grad_()
    with wk.use_backend(backend):
        merged, mpos, mlen, imap = wk.atm_merge(xg, pos, tau, lengths)
        restored = wk.atm_unmerge(yg, imap)
        gx, = torch.autograd.grad(merged, xg, grad)
        gy, = torch.autograd.grad(restored, yg, grad)

    assert merged.shape == (b, t, d) and merged.dtype == dtype
    assert mpos.shape == imap.shape == (b, t) and mlen.shape == (b,)
    assert mpos.dtype == mlen.dtype == imap.dtype == torch.int64
    # Decisions: equal to the float64 reference unless a similarity sits within rounding of τ.
    r_merged, r_pos, r_len, r_map = atm_ref.atm_merge(x64, pos, tau, lens64)
    same = torch.equal(imap, r_map) and torch.equal(mlen, r_len) and torch.equal(mpos, r_pos)
    if not same:
        assert _ambiguous(x64, lens64, tau, 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5), \
            "decisions differ from the float64 reference on an unambiguous input"
    # Whatever the decisions, they are a valid merge: every slot holds 1 or 2 consecutive
    # real tokens, T' = L − #pairs, padding maps into the zero region.
    assert (mlen <= lens64).all() and (2 * mlen >= lens64).all()
    steps = imap[:, 1:] - imap[:, :-1] if t > 1 else imap[:, :0]
    assert ((steps == 0) | (steps == 1)).all() and (imap[:, :1] == 0).all()
    tok = torch.arange(t)[None, :]
    assert torch.equal(imap[tok >= lens64[:, None]], (mlen[:, None] + tok - lens64[:, None])[tok >= lens64[:, None]])
    tol = tolerance(dtype)
    if same:
        assert rel_err(merged, r_merged) <= tol
    assert rel_err(merged, _expected_merged(x64, imap, mlen)) <= tol
    assert rel_err(restored, atm_ref.atm_unmerge(y.detach().double(), imap)) <= tol
    assert gx.shape == x.shape and gx.dtype == dtype and gy.dtype == dtype
    assert rel_err(gx, atm_ref.atm_merge_backward(grad.double(), imap, mlen)) <= tol
    assert rel_err(gy, atm_ref.atm_unmerge_backward(grad.double(), imap)) <= tol


@given(
    x_rank=st.integers(1, 4), d=st.integers(0, 3), x_dtype=st.sampled_from([torch.float32, torch.int64]),
    pos_kind=st.sampled_from(["T", "BT", "float", "wrong", "3d"]),
    tau=st.sampled_from([0.5, -1.0, 1.0, 1.5, -2.0, float("nan"), "0.5", None]),
    len_kind=st.sampled_from(["none", "ok", "float", "too_long", "negative", "wrong_b"]),
    map_kind=st.sampled_from(["own", "int32", "too_big", "negative", "wrong_shape"]),
    backend=st.sampled_from(ATM_BACKENDS),
)
def test_atm_bad_input_raises_named_error(x_rank, d, x_dtype, pos_kind, tau, len_kind, map_kind, backend):
    B, T = 2, 5
    x = torch.ones(*([B, T, d][3 - x_rank:] if x_rank <= 3 else [1, B, T, d])).to(x_dtype)
    pos = {"T": torch.arange(T), "BT": torch.arange(T).expand(B, T), "float": torch.arange(T) * 1.0,
           "wrong": torch.arange(T + 1), "3d": torch.zeros(1, B, T, dtype=torch.long)}[pos_kind]
    lengths = {"none": None, "ok": torch.tensor([T, 2]), "float": torch.tensor([5.0, 2.0]),
               "too_long": torch.tensor([T + 1, 1]), "negative": torch.tensor([-1, 1]),
               "wrong_b": torch.tensor([T])}[len_kind]
    names = ("x", "position_ids", "threshold", "lengths")
    with wk.use_backend(backend):
        try:
            merged, _, _, imap = wk.atm_merge(x, pos, tau, lengths)
        except (ValueError, TypeError) as exc:
            assert any(n in str(exc) for n in names), str(exc)
            return
        assert (x_rank == 3 and d > 0 and x_dtype == torch.float32 and pos_kind in ("T", "BT")
                and isinstance(tau, float) and -1 <= tau <= 1 and len_kind in ("none", "ok")), "invalid call accepted"
        assert merged.shape == x.shape
        bad_map = {"own": imap, "int32": imap.to(torch.int32), "too_big": torch.full((B, T), T),
                   "negative": torch.full((B, T), -1), "wrong_shape": imap[:, :-1]}[map_kind]
        try:
            restored = wk.atm_unmerge(merged, bad_map)
        except (ValueError, TypeError) as exc:
            assert map_kind != "own" and "index_map" in str(exc), str(exc)
            return
        assert map_kind == "own" and restored.shape == x.shape
