"""ATM (SPEC §6, §9): what only atm_merge / atm_unmerge have. The properties every op shares
(forward and backward against the float64 oracle per backend and dtype, with the positions,
lengths and index map exactly; strided inputs and output gradients; the C++ kernel bitwise
the same on 1 and 2 threads — its streaming and its phased path for one row —; unmodified
inputs) are in tests/test_all_ops.py; opcheck (the emulated CUDA ops too), gradcheck,
torch.compile, the bad-input messages and the ``position_ids`` / ``lengths`` forms every
backend shares in tests/test_op_layer.py. The oracle is tests/oracles.py's ``atm_oracle``.

Every backend runs here: the reference, the C++ CPU kernel (csrc/cpu/atm.cpp) and the CUDA
kernels (csrc/cuda/atm.cu) — on a GPU (``cuda``) and in the SIMT emulator on CPU tensors
(``cuda_emu``, the CUDA kernels' only run in CI). Exact tests use small-integer tokens: every
dot product and squared norm is then exact in every dtype, so every backend decides each
``s_t > τ`` bit for bit and a threshold can sit on a similarity (strict ``>``: ties for the
rational similarities 1, 1/2, 0, −1) or one float64 ulp either side of it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import wiola_kernels as wk
from wiola_kernels import dispatch, reference
from wiola_kernels.testing import assert_close_rel, available_backends, tolerance

from cuda_targets import DEVICE, targets, with_cases
from helpers import gen, gpu_only, threads
from op_cases import F64, OpCase, Public, randn64
from oracles import atm_oracle, atm_unmerge_oracle

CUDA_DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # the CUDA kernels' (others fall back)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
CPU_BACKENDS = [b for b in ("reference", "cpu") if b in available_backends("atm")]
BACKENDS = [pytest.param(b, id=b) for b in CPU_BACKENDS] + targets()


def dtypes_of(backend: str) -> list[torch.dtype]:
    return CUDA_DTYPES if backend in DEVICE else DTYPES


def with_dtypes(params=BACKENDS) -> list:
    """(backend, dtype) for every backend and every dtype its kernels take, keeping skip marks."""
    return [pytest.param(p.values[0], dt, marks=p.marks, id=f"{p.values[0]}-{str(dt)[6:]}")
            for p in params for dt in dtypes_of(p.values[0])]


def merge(backend, x, tau, lengths=None, pos=None):
    """wk.atm_merge on ``backend`` (on its device), outputs on the CPU; positions 0..T−1 by default."""
    b, t, _ = x.shape
    pos = torch.arange(t).expand(b, t) if pos is None else pos
    dev = DEVICE.get(backend, "cpu")
    with wk.use_backend(backend):
        out = wk.atm_merge(x.to(dev), pos.to(dev), tau, None if lengths is None else lengths.to(dev))
    return tuple(o.cpu() for o in out)


def assert_merge_equals_oracle(got, x, tau, lengths=None, pos=None):
    """Decisions, positions, lengths and map equal to the oracle's; merged values exact."""
    b, t, _ = x.shape
    want = atm_oracle(x, torch.arange(t).expand(b, t) if pos is None else pos, tau, lengths)
    merged, mpos, mlen, imap = got
    assert merged.shape == x.shape and merged.dtype == x.dtype
    assert mpos.dtype == mlen.dtype == imap.dtype == torch.int64
    assert mlen.tolist() == want[2].tolist() and imap.tolist() == want[3].tolist() and mpos.tolist() == want[1].tolist()
    assert torch.equal(merged.double(), want[0].detach())
    return want


# --- exact decisions: ties, thresholds, the greedy rule, the round trip -------------------------

@st.composite
def planted_rows(draw, max_t: int = 40, max_b: int = 3):
    """(x (B, T, d) float64 of small integers, positions, lengths, τ): runs (1-9 tokens) of
    copies, doubles and ±1 nudges of a token, |values| ≤ 65 (exact in bfloat16, every sum
    exact in float32); τ on one of the row's similarities, one ulp either side, at an edge
    (−1, 0, 0.92, 1) or anywhere."""
    b, t, d = draw(st.integers(1, max_b)), draw(st.integers(1, max_t)), draw(st.integers(1, 9))
    vec = st.lists(st.integers(-3, 3), min_size=d, max_size=d)
    rows = []
    for _ in range(b):
        row: list[list[int]] = []
        while len(row) < t:
            row.append(draw(vec))
            for _ in range(draw(st.integers(1, 9)) - 1):
                kind, prev = draw(st.sampled_from(["copy", "double", "nudge", "fresh"])), row[-1]
                if kind == "copy" or (kind == "double" and max(map(abs, prev)) > 32):
                    row.append(list(prev))
                elif kind == "double":
                    row.append([2 * v for v in prev])
                elif kind == "nudge":
                    j, step = draw(st.integers(0, d - 1)), draw(st.sampled_from([-1, 1]))
                    row.append([v + step * (i == j) for i, v in enumerate(prev)])
                else:
                    row.append(draw(vec))
        rows.append(row[:t])
    x = torch.tensor(rows, dtype=torch.float64)
    sims = sorted({float(torch.nn.functional.cosine_similarity(r[i], r[i + 1], dim=0))
                   for r in x for i in range(t - 1) if r[i].any() and r[i + 1].any()})
    choice = draw(st.sampled_from(["exact", "below", "above", "uniform", "edge"]))
    if sims and choice in ("exact", "below", "above"):
        s = draw(st.sampled_from(sims))
        tau = {"exact": s, "below": math.nextafter(s, -2.0), "above": math.nextafter(s, 2.0)}[choice]
        tau = min(max(tau, -1.0), 1.0)
    elif choice == "edge":
        tau = draw(st.sampled_from([-1.0, 0.0, 0.92, 1.0]))
    else:
        tau = draw(st.floats(-1.0, 1.0))
    pos = torch.tensor([[draw(st.integers(0, 5000)) for _ in range(t)] for _ in range(b)])
    return x, pos, torch.tensor([draw(st.integers(0, t)) for _ in range(b)]), tau


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=planted_rows(), data=st.data())
def test_merge_and_round_trip_match_the_oracle_exactly(backend, case, data):
    """Every decision at and next to ties, the positions, lengths and map, the merged values
    exactly (halves of small integers); then merge → unmerge: a pair's members both get its
    mean, a token alone gets itself back, padding zeros, length T again."""
    x64, pos, lengths, tau = case
    x = x64.to(data.draw(st.sampled_from(dtypes_of(backend)), label="dtype"))
    merged, _, mlen, imap = got = merge(backend, x, tau, lengths, pos)
    want = assert_merge_equals_oracle(got, x, tau, lengths, pos)
    dev = DEVICE.get(backend, "cpu")
    with wk.use_backend(backend):
        restored = wk.atm_unmerge(merged.to(dev), imap.to(dev)).cpu()
    assert restored.dtype == x.dtype and torch.equal(restored.double(), atm_unmerge_oracle(want[0], want[3]).detach())
    real = torch.arange(x.shape[1])[None] < lengths[:, None]
    alone = real & (torch.nn.functional.one_hot(imap, x.shape[1]).sum(1).gather(1, imap) == 1)
    assert torch.equal(restored[alone], x[alone]) and not restored[~real].any()
    assert int((mlen + x.shape[1] - lengths).sum()) == len({(i, int(s)) for i in range(len(imap)) for s in imap[i]})


SCALE_EXPONENTS = {torch.float32: (-125, 120), torch.bfloat16: (-125, 120), torch.float16: (-13, 9),
                   torch.float64: (-1021, 1015)}  # v·2^k exact for |v| ≤ 65, pair halves still normal


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=planted_rows(), data=st.data())
def test_decisions_invariant_under_power_of_two_scaling(backend, case, data):
    """s_t > τ is homogeneous in each token: every token scaled by its own power of two,
    anywhere in the dtype's range (huge, tiny, subnormal sums; the kernels' rescaled paths),
    decides as the unscaled row."""
    x64, pos, lengths, tau = case
    dtype = data.draw(st.sampled_from(dtypes_of(backend)), label="dtype")
    lo, hi = SCALE_EXPONENTS[dtype]
    exps = data.draw(st.lists(st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0])),
                              min_size=x64.shape[0] * x64.shape[1], max_size=x64.shape[0] * x64.shape[1]))
    xs = x64 * torch.tensor([2.0 ** k for k in exps], dtype=torch.float64).view(*x64.shape[:2], 1)
    x = xs.to(dtype)
    assert torch.equal(x.double(), xs)
    merged, mpos, mlen, imap = merge(backend, x, tau, lengths, pos)
    _, wpos, wlen, wmap = atm_oracle(x64, pos, tau, lengths)             # the unscaled row's decisions
    assert mlen.tolist() == wlen.tolist() and imap.tolist() == wmap.tolist() and mpos.tolist() == wpos.tolist()
    torch.testing.assert_close(merged.double(), atm_oracle(xs, pos, tau, lengths)[0].detach(),
                               rtol=tolerance(dtype), atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_rule_on_runs_of_every_length(backend):
    """A run of r candidate edges takes edges a, a+2, … (⌈r/2⌉ pairs; SPEC §6.2's two forms).
    Row 0: runs of 1..9 edges; row 1: a run across the CUDA select kernel's 1024-token tiles
    (the parity carried from tile to tile) and its 8-token norms_and_dots blocks."""
    basis, t = torch.eye(4), 1100
    row0 = [basis[run % 3] for run in range(1, 10) for _ in range(run + 1)]
    row0 += [basis[(k + 1) % 3] for k in range(t - len(row0))]          # orthogonal neighbours: no edges
    row1 = [basis[k % 3] for k in range(t)]
    for a, n in ((1015, 14), (1060, 11), (1090, 2)):
        row1[a:a + n] = [basis[3]] * n
    x = torch.stack([torch.stack(row0), torch.stack(row1)]) * (torch.arange(t) % 4 + 1)[None, :, None]  # cos still 1
    pos = 10 * torch.arange(t).expand(2, t)
    got = merge(backend, x, 0.5, pos=pos)
    assert_merge_equals_oracle(got, x, 0.5, pos=pos)
    _, mpos, mlen, imap = got
    assert mlen[0] == t - sum((r + 1) // 2 for r in range(1, 10))
    assert mlen[1] == t - (13 + 1) // 2 - (10 + 1) // 2 - 1
    assert imap[0, :16].tolist() == [0, 0, 1, 1, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 8, 8]   # runs of 1, 2, 3, 4 edges
    assert mpos[0, :9].tolist() == [0, 20, 40, 50, 70, 90, 110, 130, 140]


@pytest.mark.parametrize("backend, dtype", with_dtypes())
def test_threshold_edges(backend, dtype):
    """τ at ±1, at 0 with zero and orthogonal tokens, on exact ties; NaN/Inf tokens; T = 1; a
    length that cuts a run."""
    ones = torch.ones(1, 5, 3, dtype=dtype)
    # τ = 1 never merges (s ≤ 1), not even exact copies, a zero row or a constant row.
    x = torch.randint(-2, 3, (3, 12, 5), generator=gen(12)).to(dtype)
    x[:, 1::2] = x[:, 0::2]
    x[1], x[2] = 0, 7
    merged, _, mlen, imap = merge(backend, x, 1.0)
    assert (mlen == 12).all() and torch.equal(imap, torch.arange(12).expand(3, 12)) and torch.equal(merged, x)
    assert merge(backend, x, 0.99)[2].tolist() == [6, 12, 6]
    # τ = −1 merges every neighbour pair but exactly opposite ones (s = −1, not > −1); a zero
    # token (s = 0) merges.
    x = torch.randint(-3, 4, (3, 15, 4), generator=gen(13)).double()
    x[x.abs().sum(-1) == 0] = 1.0
    x[0, 3], x[0, 9], x[1, 5] = -x[0, 2], -x[0, 8], 0
    x[2, 1] = x[2, 3] = -x[2, 0]
    x[2, 2] = x[2, 0]                                   # a run of opposites: edges 0, 1, 2 are not candidates
    x = x.to(dtype)
    lengths = torch.tensor([15, 11, 15])
    want = assert_merge_equals_oracle(merge(backend, x, -1.0, lengths), x, -1.0, lengths)
    assert want[3][0, 2] != want[3][0, 3] and want[3][2, :4].tolist() == [0, 1, 2, 3]
    # Zero tokens and orthogonal ones (s = 0): merged only when τ < 0, however tiny (τ² must not
    # flush to 0); NaN/Inf tokens never, even at τ = −1.
    assert [merge(backend, ones * 0, tau)[2].item() for tau in (0.0, -0.5)] == [5, 3]
    x = torch.tensor([[[1.0, 0], [0, 1]]], dtype=dtype)
    assert [merge(backend, x, tau)[2].item() for tau in (0.0, -5e-324, 5e-324)] == [2, 1, 2]
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = ones.clone()
        x[0, 2, 1] = bad
        _, _, mlen, imap = merge(backend, x, -1.0)
        assert imap.tolist() == [[0, 0, 1, 2, 2]] and mlen.tolist() == [3]
    # Strict >: a rational similarity is an exact tie (1/2, −1/2, 24/25), one ulp below it merges.
    x = torch.tensor([[[1.0, 1, 0], [1, 0, 1]]], dtype=dtype)
    assert [merge(backend, x, tau)[2].item() for tau in (0.5, math.nextafter(0.5, 0.0))] == [2, 1]
    assert [merge(backend, x * torch.tensor([[[-1.0], [1]]], dtype=dtype), tau)[2].item()
            for tau in (-0.5, math.nextafter(-0.5, -1.0))] == [2, 1]
    x = torch.tensor([[[3.0, 4.0], [4.0, 3.0]]], dtype=dtype)
    assert [merge(backend, x, tau)[2].item() for tau in (0.96, 0.9599)] == [2, 1]
    # A tiny D must not square to 0: s ≈ D > τ near 0.
    # (Not on the CUDA kernels: under -ftz a subnormal element of a token with a normal maximum
    # is flushed, the rounding wiola_kernels/reference/atm.py allows at such a tie.)
    tiny = {torch.float64: 1e-200, torch.float32: 1e-40}.get(dtype)
    if tiny is not None and backend not in DEVICE:
        x = torch.tensor([[[1.0, 0], [tiny, 1]]], dtype=dtype)
        assert [merge(backend, x, tau)[2].item() for tau in (0.0, tiny / 10, tiny * 10)] == [1, 1, 2]
    # T = 1: nothing to merge; a length cuts a run (the last real token never pairs with padding).
    x = torch.randn(3, 1, 5, generator=gen(1)).to(dtype)
    merged, mpos, mlen, imap = merge(backend, x, 0.0, pos=torch.tensor([7]))
    assert torch.equal(merged, x) and mpos.tolist() == [[7]] * 3 and mlen.tolist() == [1] * 3 and not imap.any()
    _, _, mlen, imap = merge(backend, torch.ones(2, 6, 4, dtype=dtype), 0.5, torch.tensor([5, 0], dtype=torch.int32))
    assert mlen.tolist() == [3, 0] and imap.tolist() == [[0, 0, 1, 1, 2, 3], list(range(6))]


# Scales whose squared norms leave the accumulation dtype's range (over/underflow, subnormal
# tokens) and some inside it.
SCALES = {torch.float32: (1e15, 1e-15, 1e25, 1e-25, 2e38, 1e-40, 1e-44), torch.bfloat16: (1e15, 1e30, 1e38, 1e-38),
          torch.float16: (1e4, 1e-3, 4e4, 1e-7), torch.float64: (1e60, 1e-60, 1e150, 1e-150, 1e300, 1e-300, 1e-320)}
HUGE_TINY = {torch.float32: (2.0 ** 125, 2.0 ** -140), torch.bfloat16: (2.0 ** 125, 2.0 ** -125),
             torch.float16: (2.0 ** 14, 2.0 ** -23), torch.float64: (2.0 ** 1020, 2.0 ** -1070)}


@pytest.mark.parametrize("backend, dtype", with_dtypes())
def test_decisions_and_means_at_every_magnitude(backend, dtype):
    """Identical neighbours merge, orthogonal ones don't, s = −1 never merges, τ = 1 never
    merges, from subnormal to the dtype's maximum; 12 tokens span two of the CUDA
    norms_and_dots blocks (the look-ahead token rescaled), and row 1 mixes magnitudes 2^±60
    apart inside one block; d = 1000: several vector steps per row."""
    flush = backend in DEVICE and dtype != torch.float16   # -ftz: a float32-subnormal pair mean is 0 (atm.cu)
    for d in (4, 1000):
        x = torch.zeros(2, 12, d, dtype=torch.float64)
        x[:, 0, 0] = x[:, 1, 0] = 1.5           # identical: merge
        x[:, 2, 1] = 1.0                        # orthogonal to both neighbours
        x[:, 3, 2] = x[:, 4, 2] = -0.75         # identical: merge
        x[:, 5, 3], x[:, 6, 3] = 1.25, -1.25    # opposite (s = −1)
        x[:, 7:10, 0] = 1.0                     # a run of three: (7, 8) merges, 9 alone
        x[:, 10:, 1] = 0.5
        for scale in SCALES[dtype]:
            xs = x.clone()
            xs[1, :8] *= 2.0 ** ((-1 if scale > 1 else 1) * (20 if dtype == torch.float16 else 60))
            xs = (xs * scale).to(dtype)
            merged, _, mlen, imap = merge(backend, xs, 0.5)
            assert torch.equal(imap, torch.tensor([0, 0, 1, 2, 2, 3, 4, 5, 5, 6, 7, 7]).expand(2, 12)), (d, scale)
            assert (mlen == 8).all() and (merge(backend, xs, 1.0)[2] == 12).all(), (d, scale)
            want, got = atm_oracle(xs, torch.arange(12), 0.5)[0].detach(), merged.double()
            if flush:
                got = torch.where((got == 0) & (want.abs() < torch.finfo(torch.float32).tiny), want, got)
            torch.testing.assert_close(got, want, rtol=tolerance(dtype), atol=0)
    # cos(huge·u, tiny·u) = 1 and cos(tiny·u, −tiny·u) = −1 whatever the magnitudes.
    huge, tiny = HUGE_TINY[dtype]
    u = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    x = torch.stack([huge * u, tiny * u, -huge * u, tiny * u, -tiny * u, huge * u])[None]
    merged, _, mlen, imap = merge(backend, x.to(dtype), 0.5)
    assert imap.tolist() == [[0, 0, 1, 2, 3, 4]] and mlen.tolist() == [5]
    torch.testing.assert_close(merged[0, :5].double(), torch.cat([(huge * u + tiny * u)[None] / 2, x[0, 2:]]),
                               rtol=tolerance(dtype), atol=0)
    assert [merge(backend, x[:, 3:5].to(dtype), -1.0)[2].item(), merge(backend, x[:, :2].to(dtype), 1.0)[2].item(),
            merge(backend, x[:, :2].to(dtype), math.nextafter(1.0, 0.0))[2].item()] == [2, 2, 1]
    # The pair mean x_t/2 + x_{t+1}/2 never overflows, even where x_t + x_{t+1} would.
    top = torch.finfo(dtype).max
    x = torch.tensor([[[top, -top], [top, -top], [top / 2, top], [top, top / 2]]], dtype=torch.float64).to(dtype)
    merged, _, mlen, imap = merge(backend, x, 0.5)
    assert mlen.tolist() == [2] and imap.tolist() == [[0, 0, 1, 1]]
    torch.testing.assert_close(merged.double(), torch.tensor([[[top, -top], [0.75 * top, 0.75 * top], [0, 0], [0, 0]]],
                                                             dtype=torch.float64), rtol=tolerance(dtype), atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_token_is_confined(backend):
    """A NaN/Inf token is never merged, reaches only its own slot and never another row;
    gradients likewise stay in their slots (merge's backward, unmerge and its backward)."""
    dev = DEVICE.get(backend, "cpu")
    b, t, d = 3, 10, 4
    g = gen(14)
    x = torch.ones(b, t, d) + 0.01 * torch.randn(b, t, d, generator=g)   # all neighbours similar
    merged0, _, _, imap0 = merge(backend, x, 0.5)
    for bad in (float("nan"), float("inf")):
        xb = x.clone()
        xb[1, 4, 2] = bad
        xb = xb.to(dev).requires_grad_()
        grad, y, gr = (torch.randn(b, t, d, generator=g) for _ in range(3))
        with wk.use_backend(backend):
            merged, _, mlen, imap = (o.cpu() for o in wk.atm_merge(xb, torch.arange(t, device=dev), 0.5))
            slot = int(imap[1, 4])
            grad[1, slot, 0] = bad
            (gx,) = (v.cpu() for v in torch.autograd.grad(merged, xb, grad))  # merged: a CPU copy
            y[2, 1, 3], gr[0, 7, 1] = bad, bad
            y = y.to(dev).requires_grad_()
            restored = wk.atm_unmerge(y, imap0.to(dev))
            (gy,) = (v.cpu() for v in torch.autograd.grad(restored, y, gr.to(dev)))
        restored = restored.detach().cpu()
        assert torch.equal(merged[[0, 2]], merged0[[0, 2]]) and torch.equal(imap[[0, 2]], imap0[[0, 2]])
        assert int((imap[1] == slot).sum()) == 1
        finite = torch.isfinite(merged[1].detach()).all(-1)
        assert not finite[slot] and finite[:slot].all() and finite[slot + 1:int(mlen[1])].all()
        hit = imap[1] == slot
        assert torch.isfinite(gx[[0, 2]]).all() and torch.isfinite(gx[1][~hit]).all()
        tok = imap0[2] == 1
        assert torch.isfinite(restored[[0, 1]]).all() and torch.isfinite(restored[2][~tok]).all()
        assert not torch.isfinite(restored[2][tok]).all(-1).any()
        slots = torch.arange(t) == int(imap0[0, 7])
        assert torch.isfinite(gy[[1, 2]]).all() and torch.isfinite(gy[0][~slots]).all()
        assert not torch.isfinite(gy[0][slots]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unmerge_of_any_map(backend):
    """A map merge does not make (slots repeated out of order, unused slots; a strided map):
    the forward is the gather, the backward the sum over each slot's tokens, the same bits on
    every call; d = 600 spans several column blocks of the CUDA backward."""
    dev = DEVICE.get(backend, "cpu")
    imap = torch.tensor([[3, 3, 0, 3, 8, 8, 8, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8]]).t().contiguous().t()
    y64, g64 = (torch.randn(2, 9, 600, generator=gen(seed), dtype=torch.float64) for seed in (5, 6))
    y = y64.float().to(dev).requires_grad_()
    with wk.use_backend(backend):
        restored = wk.atm_unmerge(y, imap.to(dev))
        grads = [torch.autograd.grad(restored, y, g64.float().to(dev), retain_graph=True)[0].cpu() for _ in range(2)]
    assert torch.equal(grads[0], grads[1])
    yr = y64.float().double().requires_grad_()
    want = atm_unmerge_oracle(yr, imap)
    assert torch.equal(restored.detach().cpu().double(), want.detach())
    assert_close_rel(grads[0], torch.autograd.grad(want, yr, g64.float().double())[0], tolerance(torch.float32))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_causality_leak_with_merging(backend):
    """With merging on, position t's output depends on token t + 1 (SPEC §6.5).

    merge → a strictly causal op (prefix sum over slots) → unmerge. Tokens 2 and 3 merge;
    perturbing token 3 (the later member, keeping the decision) changes output 2. With
    merging off (τ = 1) the same perturbation leaves outputs 0..2 unchanged.
    """
    x = torch.eye(6, dtype=torch.float64)[torch.arange(8) % 6][None] + 0.02 * torch.randn(1, 8, 6, generator=gen(3),
                                                                                          dtype=torch.float64)
    x[0, 3] = x[0, 2] * 1.1                                   # neighbours near-orthogonal but for (2, 3)
    pos = torch.arange(8)

    def pipeline(v, tau):
        merged, _, _, imap = wk.atm_merge(v, pos, tau, None)
        return wk.atm_unmerge(merged.cumsum(dim=1), imap)     # causal over merged slots

    with wk.use_backend(backend):
        imap = wk.atm_merge(x, pos, 0.5)[3]
        assert imap[0, 2] == imap[0, 3]
        x2 = x.clone()
        x2[0, 3] += 0.05 * torch.randn(6, generator=gen(4), dtype=torch.float64)
        assert torch.equal(wk.atm_merge(x2, pos, 0.5)[3], imap)   # same decisions
        assert (pipeline(x2, 0.5)[0, 2] - pipeline(x, 0.5)[0, 2]).abs().max() > 1e-3   # output 2 saw token 3
        assert torch.equal(pipeline(x2, 1.0)[0, :3], pipeline(x, 1.0)[0, :3])          # causal again without merging
        xr = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(pipeline(xr, 0.5)[0, 2].sum(), xr)                  # ∂out_2/∂x_3 ≠ 0
        assert g[0, 3].abs().max() > 0 and g[0, 4:].abs().max() == 0


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="C++ extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_streaming_and_phased_paths_agree_on_rescaled_tokens(dtype):
    """csrc/cpu/atm.cpp streams rows when B ≥ threads and runs phased steps otherwise; tokens
    whose norms over- or underflow take the rescaled path in both: the same bits."""
    x = torch.randn(3, 50, 37, generator=gen(9), dtype=torch.float64)
    x[:, 1::3] = x[:, ::3][:, :x[:, 1::3].shape[1]] + 0.1 * x[:, 1::3]   # candidates among the rest
    x[:2, 5:20] *= 1e30
    x[:2, 12:30] *= 1e-45
    x, lengths = x.to(dtype), torch.tensor([50, 31, 0])
    outs = []
    for n in (1, 8):                                  # B = 3 ≥ 1: streaming; 3 < 8: phased
        with threads(n):
            outs.append(merge("cpu", x, 0.2, lengths))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert int((lengths - outs[0][2]).sum()) > 0


# --- bad input: what tests/test_op_layer.py does not already refuse for every op ----------------

_X, _P, _M = torch.randn(2, 5, 4), torch.arange(5), torch.zeros(2, 5, dtype=torch.long)
BAD = {
    "x_rank4": (lambda: wk.atm_merge(_X[None], _P, 0.9), ValueError, "x"),
    "x_int": (lambda: wk.atm_merge(_X.to(torch.int32), _P, 0.9), TypeError, "x"),
    "x_complex": (lambda: wk.atm_merge(_X.to(torch.complex64), _P, 0.9), TypeError, "x"),
    "x_list": (lambda: wk.atm_merge(_X.tolist(), _P, 0.9), TypeError, "x"),
    "positions_wrong_B": (lambda: wk.atm_merge(_X, torch.zeros(3, 5, dtype=torch.long), 0.9), ValueError,
                          "position_ids"),
    "positions_other_device": (lambda: wk.atm_merge(_X, _P.to("meta"), 0.9), ValueError, "position_ids"),
    "threshold_below": (lambda: wk.atm_merge(_X, _P, -1.01), ValueError, "threshold"),
    "threshold_nan": (lambda: wk.atm_merge(_X, _P, float("nan")), ValueError, "threshold"),
    "threshold_str": (lambda: wk.atm_merge(_X, _P, "0.9"), TypeError, "threshold"),
    "threshold_none": (lambda: wk.atm_merge(_X, _P, None), TypeError, "threshold"),
    "y_rank2": (lambda: wk.atm_unmerge(_X[0], _M), ValueError, "y"),
    "y_int": (lambda: wk.atm_unmerge(_X.to(torch.int64), _M), TypeError, "y"),
    "y_list": (lambda: wk.atm_unmerge(_X.tolist(), _M), TypeError, "y"),
    "index_map_negative": (lambda: wk.atm_unmerge(_X, _M - 1), ValueError, "index_map"),
    "index_map_float": (lambda: wk.atm_unmerge(_X, _M.float()), TypeError, "index_map"),
    "index_map_list": (lambda: wk.atm_unmerge(_X, _M.tolist()), TypeError, "index_map"),
    "index_map_other_B": (lambda: wk.atm_unmerge(torch.randn(3, 5, 4), _M), ValueError, "index_map"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_argument(case):
    fn, error, name = BAD[case]
    for backend in ["auto", *available_backends("atm")]:
        with wk.use_backend(backend), pytest.raises(error, match=name):
            fn()


def test_inductor_around_the_cpu_kernels():
    """Inductor compiles a layer around merge and unmerge without a graph break (the op
    layer's compile tests use aot_eager), and its values and gradient are the oracle's."""
    def layer(x, pos):
        merged, mpos, mlen, imap = wk.atm_merge(x, pos, 0.5)
        return wk.atm_unmerge(torch.tanh(merged) * (mpos.unsqueeze(-1) + 1), imap), mlen

    x, pos = _tokens(2, 10, 6, 5).float().requires_grad_(), torch.arange(10)
    torch._dynamo.reset()
    with wk.use_backend("cpu"):
        out, mlen = torch.compile(layer, fullgraph=True, backend="inductor")(x, pos)
        (gx,) = torch.autograd.grad(out.sum(), x)
    x64 = x.detach().double().requires_grad_()
    merged, mpos, mlen64, imap = atm_oracle(x64, pos, 0.5)
    want = atm_unmerge_oracle(torch.tanh(merged) * (mpos.unsqueeze(-1) + 1), imap)
    assert torch.equal(mlen, mlen64)
    assert_close_rel(out.detach(), want.detach(), tolerance(torch.float32), "restored")
    assert_close_rel(gx, torch.autograd.grad(want.sum(), x64)[0], tolerance(torch.float32), "grad x")


def test_reference_exponent_is_frexps_and_the_reference_compiles():
    """The reference's exponents (read from the float64 bits) are ``math.frexp``'s at every
    magnitude, subnormals included; and Inductor compiles the reference (the bench's
    ``torch.compile`` baseline, which ``torch.frexp`` on float64 broke) with its decisions."""
    from wiola_kernels.reference.atm import _exponent

    g = gen(3)
    m = torch.cat([torch.tensor([5e-324, 1e-320, 2.0 ** -1022, 0.75 * 2.0 ** -1022, 0.5, 1.0, 3.0,
                                 1.7976931348623157e308, 0.0, -0.0, -2.0, math.inf, math.nan], dtype=torch.float64),
                   torch.exp(torch.randn(2000, generator=g, dtype=torch.float64) * 300),
                   torch.rand(200, generator=g, dtype=torch.float64) * 2.0 ** -1022])
    want = [math.frexp(v)[1] if math.isfinite(v) and v > 0 else 0 for v in m.tolist()]
    assert _exponent(m).tolist() == want
    assert _exponent(m.float()).tolist() == [math.frexp(v)[1] if math.isfinite(v) and v > 0 else 0
                                             for v in m.float().double().tolist()]
    x, pos = _tokens(2, 12, 8, 6).float(), torch.arange(12)
    torch._dynamo.reset()
    compiled = torch.compile(reference.atm_merge, fullgraph=True, backend="inductor")
    for got, exp in zip(compiled(x, pos, 0.5), reference.atm_merge(x, pos, 0.5)):
        assert torch.equal(got, exp)


# --- the CUDA kernels: their block edges, alignment, and on a GPU opcheck and compile ----------

# 1100 tokens: two select tiles of 1024; d = 1032: rows of several 16-byte-chunk steps, the last partial
EMU_SHAPES = [(3, 37, 40), (2, 1100, 24), (1, 1, 8), (2, 5, 1032)]
GPU_SHAPES = [(3, 37, 40), (2, 3001, 96), (1, 1, 8), (5, 1024, 33)]


def _tokens(b, t, d, seed):
    """Noisy basis vectors, a token repeating its predecessor's direction with probability
    0.4: similarities near 0 or 1, far from τ = 0.5 in every dtype."""
    g = gen(seed)
    k = torch.randint(0, d, (b, t), generator=g)
    dup = torch.rand(b, t, generator=g) < 0.4
    for j in range(1, t):
        k[:, j] = torch.where(dup[:, j], k[:, j - 1], k[:, j])
    x = torch.nn.functional.one_hot(k, d).double() * (1 + torch.rand(b, t, 1, generator=g, dtype=torch.float64))
    return x + 0.02 * torch.randn(b, t, d, generator=g, dtype=torch.float64)


def _against_oracle(backend, x, y, grad, pos, lengths):
    """Merge of x and unmerge of y on ``backend`` with their backwards (output gradient
    ``grad``) against the oracle: decisions exactly, values within SPEC §9's tolerance."""
    dev, dtype = DEVICE[backend], x.dtype
    xg, yg = x.to(dev).requires_grad_(), y.to(dev).requires_grad_()
    with wk.use_backend(backend):
        merged, mpos, mlen, imap = wk.atm_merge(xg, pos.to(dev), 0.5, lengths.to(dev))
        restored = wk.atm_unmerge(yg, imap)
        (gx,), (gy,) = torch.autograd.grad(merged, xg, grad.to(dev)), torch.autograd.grad(restored, yg, grad.to(dev))
    x64, y64, g64 = (v.detach().cpu().double().requires_grad_(v is not grad) for v in (x, y, grad))
    want = atm_oracle(x64, pos, 0.5, lengths)
    restored64 = atm_unmerge_oracle(y64, want[3])
    assert all(torch.equal(a.cpu(), b) for a, b in zip((mpos, mlen, imap), want[1:]))
    tol = tolerance(dtype)
    for got, ref, what in ((merged, want[0], "merged"), (restored, restored64, "restored"),
                           (gx, torch.autograd.grad(want[0], x64, g64)[0], "grad x"),
                           (gy, torch.autograd.grad(restored64, y64, g64)[0], "grad y")):
        assert got.dtype == dtype
        assert_close_rel(got.detach().cpu(), ref.detach(), tol, what)


@pytest.mark.parametrize("backend, shape", with_cases([(s,) for s in GPU_SHAPES], [(s,) for s in EMU_SHAPES]))
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_cuda_block_edges(backend, dtype, shape):
    """Several select tiles, odd sizes, T = 1, long rows; values and gradients."""
    b, t, d = shape
    g = gen(8)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = t
    _against_oracle(backend, _tokens(b, t, d, 7).to(dtype), torch.randn(b, t, d, generator=g).to(dtype),
                    torch.randn(b, t, d, generator=g).to(dtype), torch.randint(0, 10_000, (b, t), generator=g), lengths)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data starts one element past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    start = next(k for k in range(1, 17) if (buf.data_ptr() + k * t.element_size()) % 16 != 0)
    return buf[start:start + t.numel()].view(t.shape).copy_(t)


@pytest.mark.parametrize("backend", targets())
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_cuda_row_kernels_on_misaligned_rows(backend, dtype):
    """d allows 16-byte chunks but the tensors do not start 16-byte aligned: the row kernels
    (gather_average, merge_backward, unmerge) take their element-wise path."""
    b, t, d = 2, 9, 16
    g = gen(12)
    x, y, grad = (_misaligned(v.to(dtype).to(DEVICE[backend]))
                  for v in (_tokens(b, t, d, 11), torch.randn(b, t, d, generator=g), torch.randn(b, t, d, generator=g)))
    assert x.data_ptr() % 16 and y.data_ptr() % 16
    _against_oracle(backend, x, y, grad, torch.arange(t).expand(b, t), torch.tensor([t, 6]))


@gpu_only
@pytest.mark.skipif(not torch.cuda.is_available() or dispatch.BACKENDS["cuda"].unavailable_reason(
    torch.device("cuda")) is not None, reason="needs the cuda backend")
def test_cuda_opcheck_and_torch_compile_fullgraph():
    """The CUDA kernels as registered ops (test_op_layer.py opchecks the CPU and emulated ones)."""
    x = _tokens(2, 300, 64, 5).float().cuda()
    pos, lengths = torch.arange(300, device="cuda").expand(2, 300).contiguous(), torch.tensor([300, 200], device="cuda")
    merged, _, mlen, imap = torch.ops.wiola.atm_merge(x, pos, 0.5, lengths)
    for op, args in ((torch.ops.wiola.atm_merge.default, (x, pos, 0.5, lengths)),
                     (torch.ops.wiola.atm_merge_backward.default, (torch.randn_like(x), imap, mlen)),
                     (torch.ops.wiola.atm_unmerge.default, (x, imap)),
                     (torch.ops.wiola.atm_unmerge_backward.default, (torch.randn_like(x), imap))):
        torch.library.opcheck(op, args)

    def layer(v, p):
        merged, mpos, _, imap = wk.atm_merge(v, p, 0.5)
        return wk.atm_unmerge(torch.tanh(merged) * (mpos.unsqueeze(-1) + 1), imap)

    xg = x.requires_grad_()
    torch._dynamo.reset()
    with wk.use_backend("cuda"):
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(xg, pos), layer(xg, pos))


# --- this op in the shared suites: its OpCase (tests/op_cases.py collects CASE for
# tests/test_all_ops.py and tests/test_op_layer.py) -------------------------------------------

def _atm_make(shape, dtype, seed):
    """Runs of repeated tokens (cosine 1) of every length among random neighbours (cosine far
    below τ = 0.9 for d ≥ 16), so the greedy rule decides; per-row lengths (row 0 full, the
    others anything in [0, T]) and positions of any order."""
    b, t, d = shape
    g = gen(seed)
    x = randn64(b, t, d, g=g)
    repeat = torch.rand(b, t, generator=g) < 0.6
    for j in range(1, t):
        x[:, j] = torch.where(repeat[:, j, None], x[:, j - 1], x[:, j])
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[:1] = t
    return dict(x=x.to(dtype), position_ids=torch.randint(0, 2**20, (b, t), generator=g), threshold=0.9,
                lengths=lengths)


def _atm_views(shape, dtype, seed):
    """x every other column of a (T, B, 2d) buffer, positions expanded from (1, T) (stride 0
    over the batch), lengths every other element; the output gradients: merged's expanded
    from one row (stride 0), restored's transposed."""
    b, t, d = shape
    args = _atm_make(shape, dtype, seed)
    wide = torch.zeros(t, b, 2 * d, dtype=dtype)
    wide[..., ::2] = args["x"].transpose(0, 1)
    g = gen(seed + 1)
    grads = [randn64(1, t, d, g=g).to(dtype).expand(b, t, d), randn64(b, d, t, g=g).to(dtype).transpose(1, 2)]
    return dict(args, x=wide.transpose(0, 1)[..., ::2], position_ids=args["position_ids"][:1].expand(b, t),
                lengths=torch.stack([args["lengths"], args["lengths"]], 1).flatten()[::2]), grads


def _atm_call(a):
    merged, merged_positions, merged_lengths, index_map = wk.atm_merge(**a)
    return merged, merged_positions, merged_lengths, index_map, wk.atm_unmerge(merged * 2, index_map)


def _atm_oracle(a):
    merged, merged_positions, merged_lengths, index_map = atm_oracle(**a)
    return merged, merged_positions, merged_lengths, index_map, atm_unmerge_oracle(merged * 2, index_map)


def _atm_tokens(dtype, seed):
    """(2, 6, 4) tokens whose neighbour cosines are 1 (repeats) or at most ~0.1: far from τ."""
    basis = torch.tensor([[0, 0, 1, 2, 2, 3], [1, 1, 1, 0, 3, 3]])
    x = torch.nn.functional.one_hot(basis, 4).to(F64) * (1 + torch.rand(2, 6, 1, generator=gen(seed)))
    return (x + 0.01 * torch.randn(2, 6, 4, generator=gen(seed + 1), dtype=F64)).to(dtype)


def _merge_make(dtype):
    return dict(x=_atm_tokens(dtype, 20), position_ids=torch.arange(6).expand(2, 6) + 3, threshold=0.5,
                lengths=torch.tensor([6, 4]))


def _merge_calls(a, ops):
    fwd = (a["x"], a["position_ids"], a["threshold"], a["lengths"])
    merged, _, merged_lengths, index_map = ops.atm_merge(*fwd)
    return [(ops.atm_merge.default, fwd),
            (ops.atm_merge_backward.default, (torch.randn_like(merged), index_map, merged_lengths))]


def _merge_bad(a):
    return [
        (dict(x=a["x"][0]), ValueError, r"^x must have shape \(B, T, d\) \(3-D\), got \(6, 4\)"),
        (dict(threshold=1.5), ValueError, r"^threshold must lie in \[-1, 1\] \(a cosine similarity\), got 1.5"),
        (dict(x=a["x"][..., :0]), ValueError, r"^x must have a non-empty last dimension d, got shape \(2, 6, 0\)"),
    ]


def _unmerge_make(dtype):
    index_map = reference.atm_merge(_atm_tokens(F64, 20), torch.arange(6), 0.5)[3]
    return dict(y=randn64(2, 6, 4, g=gen(30)).to(dtype), index_map=index_map)


def _unmerge_calls(a, ops):
    return [(ops.atm_unmerge.default, (a["y"], a["index_map"])),
            (ops.atm_unmerge_backward.default, (torch.randn_like(a["y"]), a["index_map"]))]


def _unmerge_bad(a):
    return [
        (dict(index_map=a["index_map"].int()), TypeError, r"^index_map must have dtype in \(int64\), got int32"),
        (dict(index_map=a["index_map"][:, :4]), ValueError, r"^index_map must have shape \(B, T\) = \(2, 6\) to match y, got \(2, 4\)"),
        (dict(index_map=a["index_map"] + 6), ValueError, r"^index_map values must lie in \[0, T\) = \[0, 6\), got values in"),
    ]


CASE = OpCase(
    _atm_make, _atm_call,
    # (B, T, d): T = 1, B = 0, odd B; T across the CUDA kernels' 8-token and 16-token blocks, d odd
    # (their element-wise path) and across the C++ unmerge backward's 512-column blocks
    dict(default=[(1, 1, 16), (0, 4, 16), (3, 7, 16), (2, 37, 24), (5, 20, 33), (2, 9, 520)],
         threads=[(1, 257, 48)],  # one row: 1 thread streams it, 2 threads run the phased steps
         views=[(3, 19, 16)], dynamic=[(2, 6, 16), (2, 9, 16)],
         concurrent=[(2, 50, 24)], gpu=[(3, 21, 48)]),
    (Public("atm_merge", wk.ATMMergeFunction, _merge_calls, _merge_bad, make=_merge_make),
     Public("atm_unmerge", wk.ATMUnmergeFunction, _unmerge_calls, _unmerge_bad, make=_unmerge_make)),
    oracle=_atm_oracle, views=_atm_views)
