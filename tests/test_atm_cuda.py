"""ATM CUDA kernels (csrc/cuda/atm.cu) against the reference and the greedy loop of
tests/test_atm.py: decisions exactly, values within SPEC §9 tolerances. Every test runs
on the ``cuda`` backend (GPU; skipped without one) and on ``cuda_emu`` (the same kernels
and binding on CPU tensors in the SIMT emulator, in CI; smaller shapes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import wiola_kernels as wk
from wiola_kernels import dispatch
from wiola_kernels.reference import atm as ref
from wiola_kernels.testing import assert_close_rel, tolerance

from cuda_targets import DEVICE, EMULATED, targets, with_cases
from test_atm import (SCALE_EXPONENTS, _robust_inputs, _tensors, expected_merged, greedy_loop, planted_rows,
                      scaled_tensors)

TARGETS = targets()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("backend", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
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
@pytest.mark.parametrize("dtype", DTYPES)
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
@pytest.mark.parametrize("dtype", DTYPES)
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
        a = torch.ops.wiola.atm_unmerge_grad(g, imap)
        b = torch.ops.wiola.atm_unmerge_grad(g, imap)
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
        torch.library.opcheck(torch.ops.wiola.atm_merge.default, (xf, pos, lens, 0.5))
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
@pytest.mark.parametrize("dtype", DTYPES)
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
    if dtype == torch.float32 and scale < 1e-37 and backend != EMULATED:
        return                             # -ftz: merged subnormal float32 pairs are flushed (atm.cu)
    m_ref = ref.atm_merge(xs.double(), torch.arange(12), 0.5, lens)[0]
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged.double().cpu(), m_ref, rtol=tolerance(dtype), atol=0)
