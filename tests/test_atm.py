"""ATM greedy adjacent merge / unmerge (SPEC §6) on every CPU backend.

The independent oracle is :func:`greedy_loop`, a plain Python loop of the greedy
left-to-right rule written here. Property tests use small-integer inputs, so every
dot product and squared norm is exact in every dtype and every backend decides each
``s_t > τ`` bit for bit: thresholds can then sit on a similarity (strict ``>``; exact
ties for the rational similarities 1, 1/2, 0, −1 of duplicates, doubles, orthogonal
and opposite neighbours) or one float64 ulp either side of it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import wiola_kernels as wk
from wiola_kernels import dispatch
from wiola_kernels.reference import atm as ref
from wiola_kernels.reference import atm as atm_ref
from wiola_kernels.testing import assert_close_rel, available_backends, rel_err, tolerance

from cuda_targets import DEVICE, targets, with_cases
from helpers import (assert_bitwise, finite, gen, lengths_of_kind, needs_cpu_extension, run_on_thread_counts,
                     view_as)
from oracles import atm_decisions, atm_oracle, greedy_groups, index_map_of, make_atm_input, raises_naming, rel

BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(
        dispatch.BACKENDS[name].unavailable_reason(torch.device("cpu")) is not None,
        reason=f"{name} backend unavailable: {dispatch.BACKENDS[name].unavailable_reason(torch.device('cpu'))}"))
    for name in ("reference", "cpu")
]


# --- the independent oracle ----------------------------------------------------------

def similarity(a: list[int], b: list[int]) -> float:
    """cos(a, b) of two integer vectors in float64 (0 for a zero vector)."""
    dot, n = sum(p * q for p, q in zip(a, b)), sum(p * p for p in a) * sum(q * q for q in b)
    return dot / math.sqrt(n) if n else 0.0


def is_candidate(a: list[int], b: list[int], tau: float) -> bool:
    """SPEC §6.1 ``s > τ`` as the module docstring of wiola_kernels/reference/atm.py fixes it
    (no square root, float64). The sums of small integers are exact in every dtype."""
    dot, n = float(sum(p * q for p, q in zip(a, b))), float(sum(p * p for p in a)) * float(sum(q * q for q in b))
    if not tau < 1:
        return False
    if n == 0:
        return tau < 0
    if (dot > 0) != (tau >= 0):
        return dot > 0                  # signs alone decide
    # The squares as with an unbounded exponent range (a tiny τ must not square to 0).
    e = math.frexp(max(abs(dot), abs(tau)))[1]
    ds, ts = math.ldexp(dot, -e), math.ldexp(tau, -e)
    d2, t2n = ds * ds, (ts * ts) * n
    return d2 > t2n if dot > 0 else d2 < t2n


def greedy_loop(rows: list[list[list[int]]], positions: list[list[int]], lengths: list[int], tau: float):
    """SPEC §6.2 on integer rows (:func:`oracles.greedy_groups` with :func:`is_candidate`):
    returns (merged rows as float lists, positions, lengths, index_map)."""
    out_x, out_p, out_len, out_map = [], [], [], []
    for row, pos, length in zip(rows, positions, lengths):
        t_len, d = len(row), len(row[0])
        groups = greedy_groups(length, lambda t, row=row: is_candidate(row[t], row[t + 1], tau))
        merged = [[sum(row[t][i] for t in grp) / len(grp) for i in range(d)] for grp in groups]
        n = len(groups)
        out_len.append(n)
        out_x.append(merged + [[0.0] * d] * (t_len - n))
        out_p.append([pos[grp[0]] for grp in groups] + [0] * (t_len - n))
        out_map.append(index_map_of(groups, t_len, length))
    return out_x, out_p, out_len, out_map


# --- strategies ------------------------------------------------------------------------

@st.composite
def planted_rows(draw, max_t: int = 24, max_b: int = 3):
    """Integer rows built from runs (length 1-9) of near-duplicate neighbours; |values| ≤ 65,
    so they are exact in bfloat16 and every dot product is exact in float32."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    d = draw(st.integers(1, 9))
    vec = st.lists(st.integers(-3, 3), min_size=d, max_size=d)
    rows = []
    for _ in range(b):
        row: list[list[int]] = []
        while len(row) < t:
            base = draw(vec)
            run = draw(st.integers(1, 9))
            row.append(base)
            for _ in range(run - 1):
                kind = draw(st.sampled_from(["copy", "double", "nudge", "fresh"]))
                prev = row[-1]
                if kind == "copy" or (kind == "double" and max(map(abs, prev)) > 32):  # stay exact in bf16
                    row.append(list(prev))
                elif kind == "double":
                    row.append([2 * v for v in prev])
                elif kind == "nudge":
                    j = draw(st.integers(0, d - 1))
                    row.append([v + (draw(st.sampled_from([-1, 1])) if i == j else 0) for i, v in enumerate(prev)])
                else:
                    row.append(draw(vec))
        rows.append(row[:t])
    lengths = [draw(st.integers(0, t)) for _ in range(b)]
    positions = [[draw(st.integers(0, 5000)) for _ in range(t)] for _ in range(b)]
    sims = sorted({similarity(r[i], r[i + 1]) for r in rows for i in range(t - 1)})
    choice = draw(st.sampled_from(["exact", "below", "above", "uniform", "edge"]))
    if sims and choice in ("exact", "below", "above"):
        s = draw(st.sampled_from(sims))
        tau = {"exact": s, "below": math.nextafter(s, -2.0), "above": math.nextafter(s, 2.0)}[choice]
        tau = min(max(tau, -1.0), 1.0)
    elif choice == "edge":
        tau = draw(st.sampled_from([-1.0, 0.0, 0.92, 1.0]))
    else:
        tau = draw(st.floats(-1.0, 1.0))
    return rows, positions, lengths, tau


def _tensors(rows, positions, lengths, dtype):
    x = torch.tensor(rows, dtype=torch.float64).to(dtype)
    return x, torch.tensor(positions, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)


def _robust_inputs(b: int, t: int, d: int, dtype=torch.float64, seed: int = 0, p_dup: float = 0.4):
    """Random rows whose similarities are far from τ = 0.5: tokens are (noisy) basis vectors,
    and a token repeats its predecessor's basis vector with probability p_dup."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, d, (b, t), generator=g)
    dup = torch.rand(b, t, generator=g) < p_dup
    for j in range(1, t):
        k[:, j] = torch.where(dup[:, j], k[:, j - 1], k[:, j])
    x = torch.nn.functional.one_hot(k, d).to(torch.float64) * (1 + torch.rand(b, t, 1, generator=g))
    x = x + 0.02 * torch.randn(b, t, d, generator=g, dtype=torch.float64)
    return x.to(dtype)


# --- decisions and values against the loop ----------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@given(case=planted_rows())
def test_merge_matches_greedy_loop(backend, dtype, case):
    rows, positions, lengths, tau = case
    x, pos, lens = _tensors(rows, positions, lengths, dtype)
    ex, ep, elen, emap = greedy_loop(rows, positions, lengths, tau)
    with wk.use_backend(backend):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, tau, lens)
    assert merged.shape == x.shape and merged.dtype == dtype
    assert mpos.dtype == mlen.dtype == imap.dtype == torch.int64
    assert mlen.tolist() == elen
    assert imap.tolist() == emap
    assert mpos.tolist() == ep
    # Halves of small integers are exact in every dtype.
    assert torch.equal(merged.double(), torch.tensor(ex, dtype=torch.float64))


# Exponents k for which v·2^k is exact in the dtype for every planted |v| ≤ 65, with every
# pair mean's halves still normal (so the mean is rounded once).
SCALE_EXPONENTS = {torch.float32: (-125, 120), torch.bfloat16: (-125, 120), torch.float16: (-13, 9),
                   torch.float64: (-1021, 1015)}


def scaled_tensors(rows, positions, lengths, dtype, exponents):
    """_tensors with token (b, t) multiplied by 2^exponents[b][t] (exact)."""
    x, pos, lens = _tensors(rows, positions, lengths, torch.float64)
    x = x * torch.tensor([[2.0 ** k for k in row] for row in exponents], dtype=torch.float64).unsqueeze(-1)
    assert torch.equal(x.to(dtype).double(), x)
    return x.to(dtype), pos, lens


def expected_merged(x64: torch.Tensor, index_map: list[list[int]], merged_lengths: list[int]) -> torch.Tensor:
    """Slot means of x64 (B, T, d) in float64 for a given (oracle) index map."""
    out = torch.zeros_like(x64)
    for r, (row_map, n) in enumerate(zip(index_map, merged_lengths)):
        for s in range(n):
            members = [t for t, m in enumerate(row_map) if m == s][:2]
            out[r, s] = x64[r, members].sum(0) / len(members) if len(members) == 2 else x64[r, members[0]]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@given(case=planted_rows(), data=st.data())
def test_decisions_invariant_under_power_of_two_scaling(backend, dtype, case, data):
    """s_t > τ is homogeneous in each token: scaling every token by its own power of two,
    anywhere in the dtype's range (huge, tiny, subnormal sums), must not change a decision."""
    rows, positions, lengths, tau = case
    lo, hi = SCALE_EXPONENTS[dtype]
    exponents = [data.draw(st.lists(st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0])),
                                    min_size=len(row), max_size=len(row))) for row in rows]
    x, pos, lens = scaled_tensors(rows, positions, lengths, dtype, exponents)
    _, ep, elen, emap = greedy_loop(rows, positions, lengths, tau)       # decisions of the unscaled rows
    with wk.use_backend(backend):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, tau, lens)
    assert mlen.tolist() == elen and imap.tolist() == emap and mpos.tolist() == ep
    want = expected_merged(x.double(), emap, elen)
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged.double(), want, rtol=tolerance(dtype), atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_merged_values_near_the_dtype_maximum(backend, dtype):
    """m = x_t/2 + x_{t+1}/2 never overflows, even where x_t + x_{t+1} would."""
    top = torch.finfo(dtype).max
    x = torch.tensor([[[top, -top], [top, -top], [top / 2, top], [top, top / 2]]], dtype=torch.float64).to(dtype)
    with wk.use_backend(backend):
        merged, _, mlen, imap = wk.atm_merge(x, torch.arange(4), 0.5)
    assert mlen.tolist() == [2] and imap.tolist() == [[0, 0, 1, 1]]
    want = torch.tensor([[[top, -top], [0.75 * top, 0.75 * top], [0, 0], [0, 0]]], dtype=torch.float64)
    torch.testing.assert_close(merged.double(), want, rtol=tolerance(dtype), atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=planted_rows(max_t=16))
def test_round_trip(backend, case):
    rows, positions, lengths, tau = case
    x, pos, lens = _tensors(rows, positions, lengths, torch.float32)
    with wk.use_backend(backend):
        merged, _, mlen, imap = wk.atm_merge(x, pos, tau, lens)
        restored = wk.atm_unmerge(merged, imap)
    assert restored.shape == x.shape                          # length T restored
    b, t, _ = x.shape
    for i in range(b):
        for j in range(t):
            if j >= lengths[i]:
                assert torch.equal(restored[i, j], torch.zeros_like(x[i, j]))     # padding
            elif j + 1 < t and imap[i, j] == imap[i, j + 1] and j + 1 < lengths[i]:
                mean = (x[i, j] + x[i, j + 1]) / 2
                assert torch.equal(restored[i, j], mean) and torch.equal(restored[i, j + 1], mean)
            elif not (j > 0 and imap[i, j] == imap[i, j - 1]):
                assert torch.equal(restored[i, j], x[i, j])          # nothing merged: x itself
    assert int(mlen.sum() + (t - lens).sum()) == len(set((i, int(s)) for i in range(b) for s in imap[i]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_rule_run_parity(backend):
    # One row with runs of candidate edges of every length 1..9 separated by a fresh token.
    rows = []
    basis = [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    for run in range(1, 10):
        rows += [basis[run % 3]] * (run + 1)
    x = torch.tensor([rows], dtype=torch.float32)
    t = x.shape[1]
    with wk.use_backend(backend):
        _, _, mlen, imap = wk.atm_merge(x, torch.arange(t), 0.5)
    _, _, elen, emap = greedy_loop([rows], [list(range(t))], [t], 0.5)
    assert imap.tolist() == emap and mlen.tolist() == elen
    # A run of r candidate edges (r + 1 tokens) takes ceil(r / 2) pairs.
    assert elen[0] == t - sum((r + 1) // 2 for r in range(1, 10))


@pytest.mark.parametrize("backend", BACKENDS)
def test_special_cases(backend):
    with wk.use_backend(backend):
        # T = 1: nothing to merge.
        x = torch.randn(3, 1, 5)
        merged, mpos, mlen, imap = wk.atm_merge(x, torch.tensor([7]), 0.0)
        assert torch.equal(merged, x) and mpos.tolist() == [[7]] * 3 and mlen.tolist() == [1] * 3
        assert imap.tolist() == [[0]] * 3
        # Zero vectors have similarity 0: merged only when τ < 0.
        z = torch.zeros(1, 4, 3)
        assert wk.atm_merge(z, torch.arange(4), 0.0)[2].tolist() == [4]
        assert wk.atm_merge(z, torch.arange(4), -0.5)[2].tolist() == [2]
        # τ = 1 never merges, even exact duplicates (s is clamped to 1).
        x = torch.full((2, 6, 7), 0.1)
        assert wk.atm_merge(x, torch.arange(6), 1.0)[2].tolist() == [6, 6]
        assert wk.atm_merge(x, torch.arange(6), 0.99)[2].tolist() == [3, 3]
        # A rational similarity is an exact tie: cos([1,1,0], [1,0,1]) = 1/2 is not > 1/2.
        x = torch.tensor([[[1.0, 1, 0], [1, 0, 1]]])
        assert wk.atm_merge(x, torch.arange(2), 0.5)[2].tolist() == [2]
        assert wk.atm_merge(x, torch.arange(2), math.nextafter(0.5, 0.0))[2].tolist() == [1]
        assert wk.atm_merge(-x[:, [0, 1]] * torch.tensor([[[1.0], [-1.0]]]), torch.arange(2), -0.5)[2].tolist() == [2]
        # τ or D far below 2^-511: their squares must not flush to 0 (s = 0 > τ = −5e-324;
        # s = 1e-200 > 0 in float64, s ≈ 1e-40 > 1e-41 in float32).
        x = torch.tensor([[[1.0, 0], [0, 1]]])
        assert wk.atm_merge(x, torch.arange(2), -5e-324)[2].tolist() == [1]
        assert wk.atm_merge(x, torch.arange(2), 5e-324)[2].tolist() == [2]
        x = torch.tensor([[[1.0, 0], [1e-200, 1]]], dtype=torch.float64)
        assert [wk.atm_merge(x, torch.arange(2), tau)[2].item() for tau in (0.0, 1e-201, 1e-199)] == [1, 1, 2]
        x = torch.tensor([[[1.0, 0], [1e-40, 1]]])
        assert [wk.atm_merge(x, torch.arange(2), tau)[2].item() for tau in (0.0, 1e-41, 1e-39)] == [1, 1, 2]
        # NaN/Inf tokens never merge, even at τ = −1.
        for bad in (float("nan"), float("inf"), -float("inf")):
            x = torch.ones(1, 5, 3)
            x[0, 2, 1] = bad
            _, _, mlen, imap = wk.atm_merge(x, torch.arange(5), -1.0)
            assert imap.tolist() == [[0, 0, 1, 2, 2]] and mlen.tolist() == [3]
        # Non-contiguous x and a length that cuts a run.
        base = torch.ones(6, 2, 4).transpose(0, 1)                 # (2, 6, 4), non-contiguous
        merged, _, mlen, imap = wk.atm_merge(base, torch.arange(6), 0.5, torch.tensor([5, 0], dtype=torch.int32))
        assert mlen.tolist() == [3, 0]
        assert imap.tolist() == [[0, 0, 1, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
        assert torch.equal(merged[1], torch.zeros(6, 4)) and torch.equal(merged[0, 3:], torch.zeros(3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_streaming_and_phased_paths_agree(dtype):
    """csrc/cpu/atm.cpp streams rows when B >= threads and runs phased steps otherwise;
    both must give bitwise the same outputs (same sums, same decisions)."""
    if dispatch.BACKENDS["cpu"].unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("cpu backend unavailable")
    x = _robust_inputs(3, 50, 37, seed=9) + 0.3 * torch.randn(3, 50, 37, dtype=torch.float64)
    x[:2, 5:20] *= 1e30                 # tokens that take the rescaled path (norm overflows / underflows)
    x[:2, 12:30] *= 1e-45
    x = x.to(dtype)
    lens = torch.tensor([50, 31, 0])
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 8):                                  # B = 3 >= 1: streaming; 3 < 8: phased
            torch.set_num_threads(n)
            with wk.use_backend("cpu"):
                outs.append(wk.atm_merge(x, torch.arange(50), 0.2, lens))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert int((lens - outs[0][2]).sum()) > 0


# --- gradients -------------------------------------------------------------------------

def test_reference_backward_matches_autograd():
    x = _robust_inputs(3, 11, 6).requires_grad_()
    lens = torch.tensor([11, 7, 0])
    merged, _, mlen, imap = ref.atm_merge(x, torch.arange(11), 0.5, lens)
    assert 0 < int((lens - mlen).sum())                       # some pairs merged
    g = torch.randn_like(merged)
    (gx,) = torch.autograd.grad(merged, x, g)
    torch.testing.assert_close(ref.atm_merge_backward(g, imap, mlen), gx, rtol=0, atol=0)
    y = torch.randn(3, 11, 6, dtype=torch.float64, requires_grad=True)
    restored = ref.atm_unmerge(y, imap)
    g2 = torch.randn_like(restored)
    (gy,) = torch.autograd.grad(restored, y, g2)
    torch.testing.assert_close(ref.atm_unmerge_backward(g2, imap), gy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend):
    x = _robust_inputs(3, 9, 5, seed=1).requires_grad_()
    pos, lens = torch.arange(9), torch.tensor([9, 6, 1])
    with wk.use_backend(backend):
        _, _, mlen, imap = wk.atm_merge(x.detach(), pos, 0.5, lens)
        assert int((lens - mlen).sum()) > 0
        assert torch.autograd.gradcheck(lambda v: wk.atm_merge(v, pos, 0.5, lens)[0], (x,))
        y = torch.randn(3, 9, 5, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda v: wk.atm_unmerge(v, imap), (y,))
        # Decisions fixed: merge then unmerge composes the two backwards.
        assert torch.autograd.gradcheck(lambda v: wk.atm_unmerge(wk.atm_merge(v, pos, 0.5, lens)[0], imap), (x,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_against_float64_reference(backend, dtype):
    b, t, d = 3, 37, 40
    x64 = _robust_inputs(b, t, d, seed=2)
    pos, lens = torch.randint(0, 100, (b, t)), torch.tensor([37, 20, 3])
    m_ref, p_ref, l_ref, i_ref = ref.atm_merge(x64, pos, 0.5, lens)
    y64 = torch.randn(b, t, d, dtype=torch.float64)
    g64 = torch.randn(b, t, d, dtype=torch.float64)
    x = x64.to(dtype).requires_grad_()
    y = y64.to(dtype).requires_grad_()
    with wk.use_backend(backend):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, 0.5, lens)
        restored = wk.atm_unmerge(y, imap)
    assert torch.equal(imap, i_ref) and torch.equal(mlen, l_ref) and torch.equal(mpos, p_ref)
    tol = tolerance(dtype)
    assert_close_rel(merged, m_ref, tol, "merged")
    assert_close_rel(restored, ref.atm_unmerge(y64, i_ref), tol, "restored")
    (gx,) = torch.autograd.grad(merged, x, g64.to(dtype))
    (gy,) = torch.autograd.grad(restored, y, g64.to(dtype))
    assert gx.dtype == gy.dtype == dtype
    assert_close_rel(gx, ref.atm_merge_backward(g64, i_ref, l_ref), tol, "grad_x")
    assert_close_rel(gy, ref.atm_unmerge_backward(g64, i_ref), tol, "grad_y")


@pytest.mark.parametrize("backend", BACKENDS)
def test_unmerge_backward_any_map_deterministic(backend):
    # A map not produced by merge (slots repeat out of order, some slots unused).
    g = torch.randn(2, 9, 11, dtype=torch.float32)
    imap = torch.tensor([[3, 3, 0, 3, 8, 8, 8, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    with wk.use_backend(backend):
        out1 = torch.ops.wiola.atm_unmerge_backward(g, imap)
        out2 = torch.ops.wiola.atm_unmerge_backward(g, imap)
    assert torch.equal(out1, out2)
    torch.testing.assert_close(out1, ref.atm_unmerge_backward(g.double(), imap).float())


# --- causality (SPEC §6.5) --------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_causality_leak_with_merging(backend):
    """With merging on, position t's output depends on token t + 1 (SPEC §6.5).

    merge → a strictly causal op (prefix sum over slots) → unmerge. Tokens 2 and 3 merge;
    perturbing token 3 (the later member, keeping the decision) changes output 2. With
    merging off (τ = 1) the same perturbation leaves outputs 0..2 unchanged.
    """
    x = _robust_inputs(1, 8, 6, seed=3, p_dup=0.0)
    x[0, 3] = x[0, 2] * 1.1
    pos = torch.arange(8)

    def pipeline(v, tau):
        merged, _, _, imap = wk.atm_merge(v, pos, tau, None)
        return wk.atm_unmerge(merged.cumsum(dim=1), imap)     # causal over merged slots

    with wk.use_backend(backend):
        assert wk.atm_merge(x, pos, 0.5)[3][0, 2] == wk.atm_merge(x, pos, 0.5)[3][0, 3]
        x2 = x.clone()
        x2[0, 3] += 0.05 * torch.randn(6, dtype=torch.float64)
        assert torch.equal(wk.atm_merge(x2, pos, 0.5)[3], wk.atm_merge(x, pos, 0.5)[3])   # same decisions
        leak = (pipeline(x2, 0.5)[0, 2] - pipeline(x, 0.5)[0, 2]).abs().max()
        assert leak > 1e-3                                      # output 2 saw token 3
        no_merge = (pipeline(x2, 1.0)[0, :3] - pipeline(x, 1.0)[0, :3]).abs().max()
        assert no_merge == 0                                    # causal again without merging
        # The same fact through autograd: ∂out_2/∂x_3 ≠ 0.
        xr = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(pipeline(xr, 0.5)[0, 2].sum(), xr)
        assert g[0, 3].abs().max() > 0 and g[0, 4:].abs().max() == 0


# --- bad inputs --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs(backend):
    x, pos = torch.randn(2, 5, 4), torch.arange(5)
    with wk.use_backend(backend):
        with pytest.raises(ValueError, match="threshold"):
            wk.atm_merge(x, pos, 1.5)
        with pytest.raises(ValueError, match="threshold"):
            wk.atm_merge(x, pos, -1.01)
        with pytest.raises(ValueError, match="threshold"):
            wk.atm_merge(x, pos, float("nan"))
        with pytest.raises(TypeError, match="threshold"):
            wk.atm_merge(x, pos, "0.5")
        with pytest.raises(ValueError, match=r"x must have shape \(B, T, d\)"):
            wk.atm_merge(x[0], pos, 0.5)
        with pytest.raises(ValueError, match="x must have a non-empty"):
            wk.atm_merge(x[..., :0], pos, 0.5)
        with pytest.raises(TypeError, match="x must have dtype"):
            wk.atm_merge(x.to(torch.int32), pos, 0.5)
        with pytest.raises(TypeError, match="position_ids"):
            wk.atm_merge(x, pos.float(), 0.5)
        with pytest.raises(ValueError, match=r"position_ids must have shape"):
            wk.atm_merge(x, torch.arange(4), 0.5)
        with pytest.raises(ValueError, match=r"position_ids must have shape"):
            wk.atm_merge(x, torch.zeros(3, 5, dtype=torch.int64), 0.5)
        with pytest.raises(ValueError, match=r"lengths must have shape \(B,\)"):
            wk.atm_merge(x, pos, 0.5, torch.tensor([5]))
        with pytest.raises(TypeError, match="lengths"):
            wk.atm_merge(x, pos, 0.5, torch.tensor([5.0, 5.0]))
        with pytest.raises(ValueError, match="lengths must lie in"):
            wk.atm_merge(x, pos, 0.5, torch.tensor([6, 5]))
        with pytest.raises(ValueError, match="lengths must lie in"):
            wk.atm_merge(x, pos, 0.5, torch.tensor([-1, 5]))
        imap = wk.atm_merge(x, pos, 0.5)[3]
        with pytest.raises(ValueError, match=r"y must have shape \(B, T, d\)"):
            wk.atm_unmerge(x[0], imap)
        with pytest.raises(ValueError, match=r"index_map must have shape \(B, T\) = \(2, 5\)"):
            wk.atm_unmerge(x, imap[:, :4])
        with pytest.raises(ValueError, match=r"index_map must have shape"):
            wk.atm_unmerge(torch.randn(3, 5, 4), imap)          # index_map from another shape
        with pytest.raises(TypeError, match="index_map"):
            wk.atm_unmerge(x, imap.to(torch.int32))
        with pytest.raises(ValueError, match="index_map values must lie in"):
            wk.atm_unmerge(x, imap + 5)
        with pytest.raises(ValueError, match="index_map values must lie in"):
            wk.atm_unmerge(x, imap - 1)


# --- torch.library integration ------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x = _robust_inputs(2, 7, 5, dtype=torch.float32, seed=4).requires_grad_()
    pos, lens = torch.arange(7).expand(2, 7).contiguous(), torch.tensor([7, 4])
    with wk.use_backend(backend):
        merged, _, mlen, imap = wk.atm_merge(x.detach(), pos, 0.5, lens)
        y = torch.randn(2, 7, 5)  # autograd is ATMMergeFunction's / ATMUnmergeFunction's
        torch.library.opcheck(torch.ops.wiola.atm_merge.default, (x.detach(), pos, 0.5, lens))
        torch.library.opcheck(torch.ops.wiola.atm_unmerge.default, (y, imap))
        torch.library.opcheck(torch.ops.wiola.atm_merge_backward.default, (torch.randn(2, 7, 5), imap, mlen))
        torch.library.opcheck(torch.ops.wiola.atm_unmerge_backward.default, (torch.randn(2, 7, 5), imap))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    def layer(x, pos):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, 0.5)
        y = torch.tanh(merged) * (mpos.unsqueeze(-1) + 1)
        return wk.atm_unmerge(y, imap), mlen

    x = _robust_inputs(2, 10, 6, dtype=torch.float32, seed=5).requires_grad_()
    pos = torch.arange(10)
    torch._dynamo.reset()
    # A forced Python backend is traced into; Inductor's code for the reference's integer
    # arithmetic is PyTorch's concern (and differs between CPUs), so it gets aot_eager.
    compiler = "inductor" if backend == "cpu" else "aot_eager"
    with wk.use_backend(backend):
        out, mlen = torch.compile(layer, fullgraph=True, backend=compiler)(x, pos)
        eager, emlen = layer(x, pos)
        assert torch.equal(mlen, emlen)
        torch.testing.assert_close(out, eager)
        (g,) = torch.autograd.grad(out.sum(), x)
        (ge,) = torch.autograd.grad(eager.sum(), x)
        torch.testing.assert_close(g, ge)


# ========================================================================================
# Backends and draws of the sections below: from SPEC alone, numerics at the edges, properties,
# bitwise determinism, GPU
# ========================================================================================

SPEC_BACKENDS = [name for name, state in wk.backends("cpu")["atm"].items() if state == "available"]
EDGE_BACKENDS = [b for b in available_backends("atm", "cpu") if b in ("cpu", "reference")]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]


# ========================================================================================
# From SPEC alone: the public API against tests/oracles.py (no wiola_kernels.reference)
# ========================================================================================

def _check_merge(res, x, pos, threshold, lengths, tol):
    merged, mpos, mlen, imap = res
    B, T, d = x.shape
    groups = atm_decisions(x, threshold, lengths)
    r_merged, r_pos, r_len, r_map = atm_oracle(x, pos, groups, lengths)
    assert merged.shape == (B, T, d) and merged.dtype == x.dtype
    assert mpos.shape == (B, T) and mlen.shape == (B,) and imap.shape == (B, T)
    assert mlen.tolist() == r_len.tolist()
    assert imap.tolist() == r_map.tolist()
    assert rel(merged, r_merged) <= tol
    for b in range(B):
        Tp = int(r_len[b])
        assert mpos[b, :Tp].tolist() == r_pos[b, :Tp].tolist()
        assert torch.equal(merged[b, Tp:], torch.zeros_like(merged[b, Tp:]))   # exactly zero
    return groups


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("threshold", [0.92, 0.5, -1.0, 1.0])
def test_atm_merge_matches_greedy_oracle(backend, threshold):
    B, T, d = 5, 23, 12
    x = make_atm_input(B, T, d)
    pos = torch.stack([torch.randperm(1000)[:T] for _ in range(B)])   # not the row index
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, threshold)
    groups = _check_merge(res, x, pos, threshold, None, tolerance(torch.float32))
    if threshold == 0.92:
        # the input has runs of length ≥ 3, so the greedy rule is exercised
        assert any(len(g) == 2 for row in groups for g in row)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_atm_merge_long_rows_with_lengths(backend):
    # T not a multiple of any block size, per-row lengths, per-row positions.
    B, T, d = 3, 70, 8
    x = make_atm_input(B, T, d, seed=9)
    pos = torch.stack([torch.randperm(5000)[:T] for _ in range(B)])
    lengths = torch.tensor([70, 33, 69])
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, 0.92, lengths)
    _check_merge(res, x, pos, 0.92, lengths, tolerance(torch.float32))


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_atm_greedy_runs(backend):
    # Identical-direction runs of lengths 1..5: run of n tokens → pairs (a,a+1),(a+2,a+3),…
    d = 4
    e = torch.eye(d)
    seq = [e[0]] + [e[1]] * 2 + [e[2]] * 3 + [e[3]] * 4 + [e[0]] * 5 + [e[1]]
    x = torch.stack(seq)[None] * torch.linspace(1, 2, len(seq))[None, :, None]   # scale: cos still 1
    T = x.shape[1]
    pos = torch.arange(T)[None] * 10
    with wk.use_backend(backend):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, 0.5)
    expect = [0, 1, 1, 2, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 9]
    assert imap[0].tolist() == expect
    assert int(mlen[0]) == 10
    assert mpos[0, :10].tolist() == [0, 10, 30, 50, 60, 80, 100, 120, 140, 150]
    _check_merge((merged, mpos, mlen, imap), x, pos, 0.5, None, tolerance(torch.float32))


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_atm_threshold_is_strict(backend):
    # cos((3,4),(4,3)) = 24/25 = 0.96 exactly in float64.
    x = torch.tensor([[[3.0, 4.0], [4.0, 3.0]]], dtype=torch.float64)
    pos = torch.tensor([[0, 1]])
    with wk.use_backend(backend):
        _, _, n_eq, _ = wk.atm_merge(x, pos, 0.96)
        _, _, n_lt, _ = wk.atm_merge(x, pos, 0.9599)
    assert n_eq.tolist() == [2] and n_lt.tolist() == [1]
    # identical tokens have cos exactly 1, which is not > 1
    y = torch.randn(1, 4, 8)
    y[0, 1] = y[0, 0]
    with wk.use_backend(backend):
        _, _, n1, _ = wk.atm_merge(y, torch.arange(4), 1.0)
    assert n1.tolist() == [4]


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_atm_lengths_padding(backend):
    B, T, d = 4, 13, 6
    x = make_atm_input(B, T, d, seed=3)
    x[:, :, :] = x[:, :1, :] + 0.01 * x          # everything similar: all candidates
    lengths = torch.tensor([13, 7, 0, 1])
    pos = torch.arange(T).expand(B, T)
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, 0.5, lengths)
    _check_merge(res, x, pos, 0.5, lengths, tolerance(torch.float32))
    merged, _, mlen, imap = res
    # row 1: length 7 → pairs (0,1),(2,3),(4,5), singleton 6 (not merged with padding 7)
    assert mlen.tolist() == [7, 4, 0, 1]
    assert imap[1].tolist() == [0, 0, 1, 1, 2, 2, 3] + [4 + (t - 7) for t in range(7, 13)]
    assert imap[2].tolist() == list(range(13))
    # zero gradient for padding tokens, halves for members, own for singletons
    xx = x.clone().requires_grad_()
    with wk.use_backend(backend):
        m = wk.atm_merge(xx, pos, 0.5, lengths)[0]
    gm = torch.randn_like(m)
    m.backward(gm)
    assert torch.equal(xx.grad[1, 7:], torch.zeros_like(xx.grad[1, 7:]))
    assert torch.equal(xx.grad[2], torch.zeros_like(xx.grad[2]))
    assert torch.allclose(xx.grad[1, 0], gm[1, 0] / 2) and torch.allclose(xx.grad[1, 1], gm[1, 0] / 2)
    assert torch.allclose(xx.grad[1, 6], gm[1, 3])
    assert torch.allclose(xx.grad[3, 0], gm[3, 0])


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_atm_backward_matches_oracle(backend):
    B, T, d = 3, 11, 8
    x = make_atm_input(B, T, d, seed=5)
    lengths = torch.tensor([11, 8, 5])
    pos = torch.arange(T)
    groups = atm_decisions(x, 0.92, lengths)
    xx = x.clone().requires_grad_()
    with wk.use_backend(backend):
        merged, _, _, imap = wk.atm_merge(xx, pos, 0.92, lengths)
        y = merged * 3 + 1                    # a stand-in for the merged layer
        restored = wk.atm_unmerge(y, imap)
    g1, g2 = torch.randn_like(merged), torch.randn_like(restored)
    torch.autograd.backward((merged, restored), (g1, g2))
    xd = x.double().requires_grad_()
    rm, _, _, rmap = atm_oracle(xd, pos.expand(B, T), groups, lengths)
    ry = rm * 3 + 1
    rr = torch.stack([ry[b, rmap[b]] for b in range(B)])
    torch.autograd.backward((rm, rr), (g1.double(), g2.double()))
    assert rel(restored, rr) <= tolerance(torch.float32)
    assert rel(xx.grad, xd.grad) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_atm_unmerge_forward_and_sum_of_gradients(backend):
    B, T, d = 2, 6, 3
    y = torch.randn(B, T, d, requires_grad=True)
    imap = torch.tensor([[0, 0, 1, 2, 2, 3], [0, 1, 1, 2, 3, 4]])
    with wk.use_backend(backend):
        out = wk.atm_unmerge(y, imap)
    for b in range(B):
        for t in range(T):
            assert torch.equal(out[b, t], y[b, imap[b, t]].detach())
    g = torch.randn(B, T, d, dtype=torch.float32)
    out.backward(g)
    expect = torch.zeros(B, T, d, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            expect[b, imap[b, t]] += g[b, t].double()
    assert rel(y.grad, expect) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_atm_noncontiguous_grads(backend):
    x = make_atm_input(2, 7, 4)
    pos = torch.arange(7)
    groups = atm_decisions(x, 0.92)
    g = torch.randn(4, 7, 2).permute(2, 1, 0)               # strided gradient of the restored output
    xx, xd = x.clone().requires_grad_(), x.double().requires_grad_()
    with wk.use_backend(backend):
        m, _, _, imap = wk.atm_merge(xx, pos, 0.92)
        r = wk.atm_unmerge(m, imap)
    torch.autograd.backward((r, m.sum()), (g, None))      # m.sum(): a stride-0 gradient
    rm, _, _, rmap = atm_oracle(xd, pos.expand(2, 7), groups)
    rr = torch.stack([rm[b, rmap[b]] for b in range(2)])
    torch.autograd.backward((rr, rm.sum()), (g.double(), None))
    assert rel(xx.grad, xd.grad) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_atm_gradcheck(backend):
    x = make_atm_input(2, 7, 4, dtype=torch.float64, seed=1).requires_grad_()
    pos = torch.arange(7)
    lengths = torch.tensor([7, 5])
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda a: wk.atm_merge(a, pos, 0.92, lengths)[0], (x,))
        _, _, _, imap = wk.atm_merge(x.detach(), pos, 0.92, lengths)
        y = torch.randn(2, 7, 4, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a: wk.atm_unmerge(a, imap), (y,))


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_atm_dtypes(backend, dtype):
    x = make_atm_input(3, 9, 8, seed=2).to(dtype)
    pos = torch.arange(9)
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, 0.92)
    _check_merge(res, x, pos.expand(3, 9), 0.92, None, tolerance(dtype))
    with wk.use_backend(backend):
        out = wk.atm_unmerge(res[0], res[3])
    assert out.dtype == dtype


@pytest.mark.parametrize("backend", SPEC_BACKENDS)
def test_atm_noncontiguous_t1_odd_batch(backend):
    x = make_atm_input(7, 3, 10, seed=4).transpose(0, 1).contiguous().transpose(0, 1)  # strided batch
    assert not x.is_contiguous()
    pos = torch.arange(3)[None].expand(7, 3)
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, 0.92)
    _check_merge(res, x, pos, 0.92, None, tolerance(torch.float32))
    x1 = torch.randn(3, 1, 5)
    with wk.use_backend(backend):
        m, p, n, i = wk.atm_merge(x1, torch.tensor([4]), 0.92)
    assert n.tolist() == [1, 1, 1] and i.tolist() == [[0]] * 3 and p.tolist() == [[4]] * 3
    assert torch.equal(m, x1)
    # non-contiguous y and index map for unmerge
    y = torch.randn(4, 2, 6).transpose(1, 2)                # (B=4, T=6, d=2), strided
    imap = torch.tensor([[0, 0, 1, 2, 3, 4]] * 4).t().contiguous().t()
    with wk.use_backend(backend):
        out = wk.atm_unmerge(y, imap)
    assert torch.equal(out, torch.stack([y[b, imap[b]] for b in range(4)]))


_AX = torch.randn(2, 5, 4)
_AP = torch.arange(5)
_AM = torch.zeros(2, 5, dtype=torch.long)
ATM_BAD = {
    "x_rank2": (lambda: wk.atm_merge(_AX[0], _AP, 0.9), ["x"]),
    "x_int": (lambda: wk.atm_merge(_AX.to(torch.int32), _AP, 0.9), ["x"]),
    "x_complex": (lambda: wk.atm_merge(_AX.to(torch.complex64), _AP, 0.9), ["x"]),
    "x_list": (lambda: wk.atm_merge(_AX.tolist(), _AP, 0.9), ["x"]),
    "positions_wrong_T": (lambda: wk.atm_merge(_AX, torch.arange(6), 0.9), ["position_ids", "positions"]),
    "positions_float": (lambda: wk.atm_merge(_AX, torch.arange(5.0), 0.9), ["position_ids", "positions"]),
    "lengths_above_T": (lambda: wk.atm_merge(_AX, _AP, 0.9, torch.tensor([6, 1])), ["lengths"]),
    "lengths_negative": (lambda: wk.atm_merge(_AX, _AP, 0.9, torch.tensor([-1, 1])), ["lengths"]),
    "lengths_wrong_B": (lambda: wk.atm_merge(_AX, _AP, 0.9, torch.tensor([1])), ["lengths"]),
    "lengths_float": (lambda: wk.atm_merge(_AX, _AP, 0.9, torch.tensor([1.0, 2.0])), ["lengths"]),
    "lengths_list": (lambda: wk.atm_merge(_AX, _AP, 0.9, [5, 5]), ["lengths"]),
    "threshold_str": (lambda: wk.atm_merge(_AX, _AP, "0.9"), ["threshold"]),
    "threshold_nan": (lambda: wk.atm_merge(_AX, _AP, float("nan")), ["threshold"]),
    "positions_other_device": (lambda: wk.atm_merge(_AX, _AP.to("meta"), 0.9), ["position", "device"]),
    "index_map_above": (lambda: wk.atm_unmerge(_AX, torch.full((2, 5), 5)), ["index_map"]),
    "index_map_negative": (lambda: wk.atm_unmerge(_AX, torch.full((2, 5), -1)), ["index_map"]),
    "index_map_wrong_T": (lambda: wk.atm_unmerge(_AX, torch.zeros(2, 4, dtype=torch.long)), ["index_map"]),
    "index_map_float": (lambda: wk.atm_unmerge(_AX, _AM.float()), ["index_map"]),
    "index_map_list": (lambda: wk.atm_unmerge(_AX, _AM.tolist()), ["index_map"]),
    "y_rank2": (lambda: wk.atm_unmerge(_AX[0], _AM), ["y"]),
    "y_int": (lambda: wk.atm_unmerge(_AX.to(torch.int64), _AM), ["y"]),
    "y_list": (lambda: wk.atm_unmerge(_AX.tolist(), _AM), ["y"]),
}


@pytest.mark.parametrize("case", list(ATM_BAD))
def test_atm_bad_inputs(case):
    fn, names = ATM_BAD[case]
    raises_naming((ValueError, TypeError), names, fn)


def test_atm_opcheck():
    x = make_atm_input(2, 6, 4)  # the registered ops take no grad (autograd is wk.ATM*Function's)
    pos = torch.arange(6).expand(2, 6).contiguous()
    lengths = torch.tensor([6, 4])
    torch.library.opcheck(torch.ops.wiola.atm_merge.default, (x, pos, 0.92, lengths))
    _, _, _, imap = wk.atm_merge(x.detach(), pos, 0.92, lengths)
    y = torch.randn(2, 6, 4)
    torch.library.opcheck(torch.ops.wiola.atm_unmerge.default, (y, imap))


def test_atm_compile_fullgraph():
    x = make_atm_input(2, 6, 4).requires_grad_()
    pos = torch.arange(6)
    lengths = torch.tensor([6, 4])

    def f(a):
        m, p, n, imap = wk.atm_merge(a, pos, 0.92, lengths)
        return wk.atm_unmerge(m * 2, imap), n

    out, n = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    ref_out, ref_n = f(x)
    assert torch.equal(n, ref_n) and rel(out, ref_out) <= tolerance(torch.float32)
    out.sum().backward()
    assert x.grad is not None


# ========================================================================================
# Numerics at the edges
# Every CPU backend (reference, cpu): huge and tiny magnitudes, all-zero rows, masked rows,
# and NaN/Inf confinement (a non-finite value in one row never reaches another row or batch
# element, forward or backward). What must hold:
#
# * ATM — ``τ = 1`` never merges (cos ≤ 1); ``τ = −1`` merges every non-opposite adjacent
#   pair greedily (zero vectors have s = 0 > −1; exactly opposite vectors have s = −1 and
#   never merge; NaN/Inf tokens never merge). The criterion is exactly scale-invariant at
#   every magnitude: a token whose ``‖x‖²`` would overflow, underflow or lose precision in
#   the accumulation dtype is rescaled by a power of two first (the test is homogeneous in
#   each token), and ``D² > τ² n_t n_{t+1}`` is compared as with an unbounded exponent
#   range, so scaling any token by any power of two that keeps it representable never
#   changes a decision — from subnormal to the dtype's maximum, in every dtype. The pair
#   mean is ``x_t/2 + x_{t+1}/2``: no overflow up to the dtype's maximum.
# ========================================================================================

def _merge(backend, x, tau, lengths=None, pos=None):
    b, t, _ = x.shape
    pos = torch.arange(t).expand(b, t) if pos is None else pos
    with wk.use_backend(backend):
        return wk.atm_merge(x, pos, tau, lengths)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_atm_threshold_one_never_merges(backend, dtype):
    g = gen(12)
    x = torch.randint(-2, 3, (3, 12, 5), generator=g).to(dtype)
    x[:, 1::2] = x[:, 0::2]          # every other token identical to its predecessor (s = 1)
    x[1] = 0                         # all-zero row (s = 0)
    x[2, :, :] = 7.0                 # all tokens identical
    merged, _, mlen, imap = _merge(backend, x, 1.0)
    assert (mlen == 12).all() and torch.equal(imap, torch.arange(12).expand(3, 12))
    assert torch.equal(merged, x)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_atm_threshold_minus_one_merges_all_but_opposite(backend, dtype):
    g = gen(13)
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
    groups = [greedy_groups(int(lengths[r]), lambda i, c=cand[r]: c[i]) for r in range(b)]
    want = torch.tensor([index_map_of(grp, t, int(lengths[r])) for r, grp in enumerate(groups)])
    assert torch.equal(imap, want)
    assert torch.equal(mlen, torch.tensor([len(grp) for grp in groups]))
    r_merged, _, _, _ = atm_oracle(xs.double(), torch.arange(t).expand(b, t), groups, lengths)
    assert rel_err(merged, r_merged) <= tolerance(dtype)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
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
    assert rel_err(merged, (want * scale).to(dtype).double()) <= tolerance(dtype) and finite(merged)


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
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


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
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


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_atm_nonfinite_token_is_confined(backend, bad):
    """A NaN/Inf token is never merged (s is NaN, or the pair would not be finite), appears only
    in its own slot, and never changes another row; gradients likewise stay in their slots."""
    g = gen(14)
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


# ========================================================================================
# Properties (hypothesis): any shape, stride, dtype, threshold; bad input names the argument
# ========================================================================================

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
    backend=st.sampled_from(EDGE_BACKENDS), data=st.data(),
)
def test_atm_any_shape_stride_dtype(b, t, d, dtype, how, tau, len_kind, shared_pos, p_dup, p_neg, p_zero, backend,
                                    data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = view_as(_atm_rows(g, b, t, d, p_dup, p_neg, p_zero), dtype, how, expand_dim=0)
    x64 = x.double()
    pos = torch.randint(0, 10**6, (t,) if shared_pos else (b, t), generator=g)
    lengths = lengths_of_kind(len_kind, b, t, g)
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
    backend=st.sampled_from(EDGE_BACKENDS),
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


# ========================================================================================
# Bitwise determinism of the C++ kernel, 1 vs 2 threads (helpers.run_on_thread_counts)
# ========================================================================================

@needs_cpu_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("B", [1, 3])  # B = 1 < 2 threads: phased path; with 1 thread: streaming path
def test_atm_bitwise_reproducible(dtype, B):
    g = gen(3)
    T, d = 257, 48
    k = torch.randint(0, 4, (B, T), generator=g)
    x = (torch.nn.functional.one_hot(k, d).float() + 0.05 * torch.randn(B, T, d, generator=g)).to(dtype)
    pos = torch.arange(T).expand(B, T)
    lens = torch.randint(T // 2, T + 1, (B,), generator=g)
    gm = torch.randn(B, T, d, generator=g).to(dtype)
    y = torch.randn(B, T, d, generator=g).to(dtype)
    gr = torch.randn(B, T, d, generator=g).to(dtype)

    def fn(x, y, pos, lens):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, 0.5, lens)
        restored = wk.atm_unmerge(y, imap)
        # merged and restored in one output (one backward through both ops); maps compared as extras
        return torch.cat([merged, restored], 1), torch.cat([gm, gr], 1), (mpos, mlen, imap)

    assert_bitwise(run_on_thread_counts(fn, [x, y, pos, lens]),
                    ["merged|restored", "grad_x", "grad_y", "merged_positions", "merged_lengths", "index_map"])


# ========================================================================================
# The CUDA kernels (csrc/cuda/atm.cu), on the GPU (cuda, skipped without one) and in the SIMT
# emulator (cuda_emu, CPU tensors, every CI run; smaller shapes): decisions exactly, values
# within SPEC §9 tolerances
# ========================================================================================

TARGETS = targets()
CUDA_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("backend", TARGETS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@given(case=planted_rows(max_t=40))
def test_cuda_matches_greedy_loop(backend, dtype, case):
    rows, positions, lengths, tau = case
    x, pos, lens = (t.to(DEVICE[backend]) for t in _tensors(rows, positions, lengths, dtype))
    ex, ep, elen, emap = greedy_loop(rows, positions, lengths, tau)
    with wk.use_backend(backend):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, tau, lens)
    assert mlen.tolist() == elen and imap.tolist() == emap and mpos.tolist() == ep
    assert torch.equal(merged.double().cpu(), torch.tensor(ex, dtype=torch.float64))


GPU_SHAPES = [(3, 37, 40), (2, 3001, 96), (1, 1, 8), (5, 1024, 33)]
# 1100: two scan tiles of 1024 tokens; 1032: rows of several 16-byte-chunk steps (row kernels), the last partial
EMU_SHAPES = [(3, 37, 40), (2, 1100, 24), (1, 1, 8), (2, 5, 1032)]


@pytest.mark.parametrize("backend, shape", with_cases([(s,) for s in GPU_SHAPES], [(s,) for s in EMU_SHAPES]))
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_cuda_against_reference(backend, dtype, shape):
    """Several scan tiles (1024 tokens each), odd sizes, T = 1; values and gradients."""
    dev = DEVICE[backend]
    b, t, d = shape
    x64 = _robust_inputs(b, t, d, seed=7)
    pos = torch.randint(0, 10_000, (b, t))
    lens = torch.randint(0, t + 1, (b,))
    lens[0] = t
    x64 = x64.to(dtype).double()                                    # the input as the kernel sees it
    m_ref, p_ref, l_ref, i_ref = ref.atm_merge(x64, pos, 0.5, lens)
    g64 = torch.randn(b, t, d, dtype=torch.float64)
    x = x64.to(dtype).to(dev).requires_grad_()
    y = g64.flip(1).to(dtype).to(dev).requires_grad_()
    with wk.use_backend(backend):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos.to(dev), 0.5, lens.to(dev))
        restored = wk.atm_unmerge(y, imap)
    assert torch.equal(imap.cpu(), i_ref) and torch.equal(mlen.cpu(), l_ref) and torch.equal(mpos.cpu(), p_ref)
    tol = tolerance(dtype)
    assert_close_rel(merged.cpu(), m_ref, tol, "merged")
    assert_close_rel(restored.cpu(), ref.atm_unmerge(g64.flip(1), i_ref), tol, "restored")
    (gx,) = torch.autograd.grad(merged, x, g64.to(dtype).to(dev))
    (gy,) = torch.autograd.grad(restored, y, g64.to(dtype).to(dev))
    assert_close_rel(gx.cpu(), ref.atm_merge_backward(g64, i_ref, l_ref), tol, "grad_x")
    assert_close_rel(gy.cpu(), ref.atm_unmerge_backward(g64, i_ref), tol, "grad_y")


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data starts one element past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    start = next(k for k in range(1, 17) if (buf.data_ptr() + k * t.element_size()) % 16 != 0)
    out = buf[start:start + t.numel()].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("backend", TARGETS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_cuda_row_kernels_on_misaligned_rows(backend, dtype):
    """d allows 16-byte chunks but the tensors do not start 16-byte aligned: the row
    kernels (gather_average, merge_backward, unmerge) take their element-wise path."""
    dev = DEVICE[backend]
    b, t, d = 2, 9, 16
    x64 = _robust_inputs(b, t, d, seed=11).to(dtype).double()
    pos, lens = torch.arange(t).expand(b, t).contiguous(), torch.tensor([t, 6])
    m_ref, _, l_ref, i_ref = ref.atm_merge(x64, pos, 0.5, lens)
    g64 = torch.randn(b, t, d, dtype=torch.float64, generator=torch.Generator().manual_seed(12)).to(dtype).double()
    x = _misaligned(x64.to(dtype).to(dev)).requires_grad_()
    y = _misaligned(g64.flip(1).to(dtype).to(dev))
    assert x.data_ptr() % 16 != 0 and y.data_ptr() % 16 != 0
    with wk.use_backend(backend):
        merged, _, _, imap = wk.atm_merge(x, pos.to(dev), 0.5, lens.to(dev))
        restored = wk.atm_unmerge(y, imap)
        (gx,) = torch.autograd.grad(merged, x, _misaligned(g64.to(dtype).to(dev)))
    assert torch.equal(imap.cpu(), i_ref)
    tol = tolerance(dtype)
    assert_close_rel(merged.cpu(), m_ref, tol, "merged")
    assert_close_rel(restored.cpu(), ref.atm_unmerge(g64.flip(1), i_ref), tol, "restored")
    assert_close_rel(gx.cpu(), ref.atm_merge_backward(g64, i_ref, l_ref), tol, "grad_x")


@pytest.mark.parametrize("backend", TARGETS)
def test_cuda_backward_deterministic_any_map(backend):
    g = torch.randn(2, 9, 300, device=DEVICE[backend])
    imap = torch.tensor([[3, 3, 0, 3, 8, 8, 8, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8]], device=DEVICE[backend])
    with wk.use_backend(backend):
        a = torch.ops.wiola.atm_unmerge_backward(g, imap)
        b = torch.ops.wiola.atm_unmerge_backward(g, imap)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.cpu(), ref.atm_unmerge_backward(g.cpu().double(), imap.cpu()).float())


@pytest.mark.parametrize("backend", TARGETS)
def test_cuda_float64_and_opcheck(backend):
    dev = DEVICE[backend]
    x = _robust_inputs(2, 7, 5, seed=4).to(dev).requires_grad_()
    pos, lens = torch.arange(7, device=dev).expand(2, 7).contiguous(), torch.tensor([7, 4], device=dev)
    with wk.use_backend(backend):
        merged, _, mlen, imap = wk.atm_merge(x, pos, 0.5, lens)                # float64: reference path
        assert torch.equal(imap.cpu(), ref.atm_merge(x.detach().cpu(), pos.cpu(), 0.5, lens.cpu())[3])
        xf = x.detach().float()  # autograd is ATMMergeFunction's: the ops take no grad
        torch.library.opcheck(torch.ops.wiola.atm_merge.default, (xf, pos, 0.5, lens))
        torch.library.opcheck(torch.ops.wiola.atm_unmerge.default, (xf, imap))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or dispatch.BACKENDS["cuda"].unavailable_reason(
    torch.device("cuda")) is not None, reason="needs the cuda backend (compiling for the CPU is too slow for CI)")
def test_cuda_torch_compile_fullgraph():
    def layer(x, pos):
        merged, mpos, _, imap = wk.atm_merge(x, pos, 0.5)
        return wk.atm_unmerge(torch.tanh(merged) * (mpos.unsqueeze(-1) + 1), imap)

    x = _robust_inputs(2, 300, 64, dtype=torch.float32, seed=5).cuda().requires_grad_()
    pos = torch.arange(300, device="cuda")
    torch._dynamo.reset()
    with wk.use_backend("cuda"):
        out = torch.compile(layer, fullgraph=True)(x, pos)
        eager = layer(x, pos)
    torch.testing.assert_close(out, eager)


# --- magnitudes at the edges of each dtype's range -------------------------------------------

@pytest.mark.parametrize("backend", TARGETS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@given(case=planted_rows(max_t=40), data=st.data())
def test_cuda_decisions_invariant_under_power_of_two_scaling(backend, dtype, case, data):
    """Every token scaled by its own power of two, anywhere in the dtype's range (the
    rescaled double path of norms_and_dots, subnormal float32 under -ftz): same decisions."""
    rows, positions, lengths, tau = case
    lo, hi = SCALE_EXPONENTS[dtype]
    exponents = [data.draw(st.lists(st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0])),
                                    min_size=len(row), max_size=len(row))) for row in rows]
    x, pos, lens = scaled_tensors(rows, positions, lengths, dtype, exponents)
    _, ep, elen, emap = greedy_loop(rows, positions, lengths, tau)
    dev = DEVICE[backend]
    with wk.use_backend(backend):
        merged, mpos, mlen, imap = wk.atm_merge(x.to(dev), pos.to(dev), tau, lens.to(dev))
    assert mlen.tolist() == elen and imap.tolist() == emap and mpos.tolist() == ep
    torch.testing.assert_close(merged.double().cpu(), expected_merged(x.double(), emap, elen),
                               rtol=tolerance(dtype), atol=0)


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e25), (torch.float32, 1e-25), (torch.float32, 2e38),
                                         (torch.float32, 1e-40), (torch.bfloat16, 1e38), (torch.bfloat16, 1e-38),
                                         (torch.float16, 4e4), (torch.float16, 1e-7)])
@pytest.mark.parametrize("d", [4, 1000])
@pytest.mark.parametrize("backend", TARGETS)
def test_cuda_scale_invariant_extreme(backend, dtype, scale, d):
    """Identical neighbours merge, orthogonal ones don't, s = −1 never merges, at every
    magnitude; 12 tokens span two norms_and_dots blocks (the look-ahead token is rescaled)."""
    x = torch.zeros(2, 12, d, dtype=torch.float64)
    x[:, 0, 0] = x[:, 1, 0] = 1.5          # identical: merge
    x[:, 2, 1] = 1.0                       # orthogonal to both neighbours
    x[:, 3, 2] = x[:, 4, 2] = -0.75        # identical: merge
    x[:, 5, 3] = 1.25
    x[:, 6, 3] = -1.25                     # opposite (s = −1)
    x[:, 7, 0] = 1.0
    x[:, 8, 0] = x[:, 9, 0] = 1.0          # run of three: (7, 8) merges, 9 alone
    x[:, 10, 1] = x[:, 11, 1] = 0.5
    k = 20 if dtype == torch.float16 else 60
    x[1, :8] *= 2.0 ** (-k if scale > 1 else k)   # row 1: magnitudes far apart inside one block
    xs = (x * scale).to(dtype)
    lens = torch.tensor([12, 12])
    dev = DEVICE[backend]
    with wk.use_backend(backend):
        merged, _, mlen, imap = wk.atm_merge(xs.to(dev), torch.arange(12).expand(2, 12).to(dev), 0.5, lens.to(dev))
        _, _, mlen1, _ = wk.atm_merge(xs.to(dev), torch.arange(12).expand(2, 12).to(dev), 1.0, lens.to(dev))
    want_map = torch.tensor([0, 0, 1, 2, 2, 3, 4, 5, 5, 6, 7, 7]).expand(2, 12)
    assert torch.equal(imap.cpu(), want_map) and (mlen.cpu() == 8).all() and (mlen1.cpu() == 12).all()
    m_ref = ref.atm_merge(xs.double(), torch.arange(12), 0.5, lens)[0]
    assert torch.isfinite(merged).all()
    got = merged.double().cpu()
    if dtype in (torch.float32, torch.bfloat16):
        # -ftz (the device and the emulator): a pair mean that is a float32 subnormal is 0 (atm.cu)
        flushed = (got == 0) & (m_ref.abs() < torch.finfo(torch.float32).tiny)
        got = torch.where(flushed, m_ref, got)
    torch.testing.assert_close(got, m_ref, rtol=tolerance(dtype), atol=0)
