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
from wiola_kernels.testing import assert_close_rel, tolerance

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
    """Plain loop of SPEC §6.2: returns (merged rows as float lists, positions, lengths, index_map)."""
    out_x, out_p, out_len, out_map = [], [], [], []
    for row, pos, length in zip(rows, positions, lengths):
        t_len, d = len(row), len(row[0])
        merged, mpos, imap = [], [], [0] * t_len
        t = 0
        while t < length:
            take = t + 1 < length and is_candidate(row[t], row[t + 1], tau)
            imap[t] = len(merged)
            mpos.append(pos[t])
            if take:
                imap[t + 1] = len(merged)
                merged.append([(p + q) / 2 for p, q in zip(row[t], row[t + 1])])
                t += 2
            else:
                merged.append([float(v) for v in row[t]])
                t += 1
        n = len(merged)
        for p in range(length, t_len):
            imap[p] = n + (p - length)
        out_len.append(n)
        out_x.append(merged + [[0.0] * d] * (t_len - n))
        out_p.append(mpos + [0] * (t_len - n))
        out_map.append(imap)
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
        out1 = torch.ops.wiola.atm_unmerge_grad(g, imap)
        out2 = torch.ops.wiola.atm_unmerge_grad(g, imap)
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
        torch.library.opcheck(torch.ops.wiola.atm_merge.default, (x.detach(), pos, lens, 0.5))
        torch.library.opcheck(torch.ops.wiola.atm_unmerge.default, (y, imap))
        torch.library.opcheck(torch.ops.wiola.atm_merge_grad.default, (torch.randn(2, 7, 5), imap, mlen))
        torch.library.opcheck(torch.ops.wiola.atm_unmerge_grad.default, (torch.randn(2, 7, 5), imap))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    def layer(x, pos):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, 0.5)
        y = torch.tanh(merged) * (mpos.unsqueeze(-1) + 1)
        return wk.atm_unmerge(y, imap), mlen

    x = _robust_inputs(2, 10, 6, dtype=torch.float32, seed=5).requires_grad_()
    pos = torch.arange(10)
    torch._dynamo.reset()
    with wk.use_backend(backend):
        out, mlen = torch.compile(layer, fullgraph=True)(x, pos)
        eager, emlen = layer(x, pos)
        assert torch.equal(mlen, emlen)
        torch.testing.assert_close(out, eager)
        (g,) = torch.autograd.grad(out.sum(), x)
        (ge,) = torch.autograd.grad(eager.sum(), x)
        torch.testing.assert_close(g, ge)
