"""Black-box tests of the public ops, written from SPEC.md alone.

Everything here uses only the public API (``wiola_kernels``'s functions and modules,
``torch.ops.wiola.*``, ``use_backend``/``backends``) and compares with naive float64
oracles written inline from the SPEC formulas (loops over heads, pairs and tokens; no
use of ``wiola_kernels.reference``). Each CPU-runnable backend is exercised (reference,
cpu, and triton under ``TRITON_INTERPRET=1``, which ``conftest.py`` sets).
"""

import math

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels.modules import SpiralRotaryEmbedding, WiolaRMSNorm

# ----------------------------------------------------------------------------- helpers

FP32_ELEM_TOL = 1e-5   # SPEC §9: float32 elementwise / norm ops
FP32_ATTN_TOL = 1e-4   # SPEC §9: float32 attention
HALF_TOL = 1e-2        # SPEC §9: bf16 / fp16


def _backends(op):
    table = wk.backends("cpu")[op]
    return [name for name, state in table.items() if state == "available"]


RMS_BACKENDS = _backends("rms_norm")
SRPE_BACKENDS = _backends("srpe")
GCLA_BACKENDS = _backends("gcla_attention")
ATM_BACKENDS = _backends("atm")


def test_cpu_backends_present():
    # The project ships a reference and a C++ CPU backend for every op.
    for op in ("rms_norm", "srpe", "gcla_attention", "atm"):
        assert {"reference", "cpu"} <= set(_backends(op)), op


def rel(out, ref):
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all()
    den = ref.norm()
    num = (out - ref).norm()
    if den == 0:
        return num.item()
    return (num / den).item()


def tol_for(dtype, attention=False):
    if dtype in (torch.bfloat16, torch.float16):
        return HALF_TOL
    if dtype == torch.float64:
        return 1e-12  # SPEC §9 float64 kernels
    return FP32_ATTN_TOL if attention else FP32_ELEM_TOL


def _raises_naming(exc_types, names, fn):
    with pytest.raises(exc_types) as info:
        fn()
    msg = str(info.value)
    assert any(n in msg for n in names), f"message {msg!r} names none of {names}"


# ----------------------------------------------------------------------------- oracles


def rms_oracle(x, w, s, eps):
    x, w, s = x.double(), w.double(), s.double()
    z = x + s
    r = torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    return w * z / r


def srpe_oracle(x, pos, theta=10000.0, ks=8.0, a_s=0.1, f_s=0.01):
    """x (B, Hx, T, d_h) float64; pos (B, T) python-int positions. Pair loop, rotate-half."""
    x = x.double()
    B, Hx, T, dh = x.shape
    half = dh // 2
    pos = pos.to(torch.int64)
    cols_lo, cols_hi = [], []
    for j in range(half):
        w_j = theta ** (-2.0 * j / dh)
        p = pos.double()                                      # (B, T)
        ang = p * w_j * (1.0 + 1.0 / ks)
        r = 1.0 + a_s * torch.sin(p * f_s * w_j)
        c = (r * torch.cos(ang))[:, None, :]
        sn = (r * torch.sin(ang))[:, None, :]
        a, b = x[..., j], x[..., j + half]
        cols_lo.append(a * c - b * sn)
        cols_hi.append(a * sn + b * c)
    return torch.stack(cols_lo + cols_hi, dim=-1)


def gcla_oracle(q_rot, k_rot, v, q, kc, vc, gate, lengths=None, return_lse=False):
    q_rot, k_rot, v, q, kc, vc, gate = (t.double() for t in (q_rot, k_rot, v, q, kc, vc, gate))
    B, H, T, dh = q_rot.shape
    Hkv = k_rot.shape[1]
    S, Lam = kc.shape[2], kc.shape[3]
    scale = 1.0 / math.sqrt(dh)
    outs, lses = [], []
    for b in range(B):
        L = T if lengths is None else int(lengths[b])
        heads, lse_h = [], []
        for h in range(H):
            g = h % Hkv                                       # SPEC §5.2: h mod H_kv
            rows, lrow = [], []
            for t in range(T):
                if t >= L:
                    rows.append(torch.zeros(dh, dtype=torch.float64))
                    lrow.append(torch.tensor(float("nan"), dtype=torch.float64))
                    continue
                sc = (k_rot[b, g, : t + 1] @ q_rot[b, h, t]) * scale      # keys 0..t (all < L)
                lse = torch.logsumexp(sc, 0)
                o = torch.softmax(sc, 0) @ v[b, g, : t + 1]
                if Lam > 0:
                    sidx = 0 if S == 1 else t
                    cs = (kc[b, h, sidx] @ q[b, h, t]) * scale             # (Λ',)
                    oc = torch.softmax(cs, 0) @ vc[b, h, sidx]
                    o = o + torch.sigmoid(gate[h]) * oc
                rows.append(o)
                lrow.append(lse)
            heads.append(torch.stack(rows))
            lse_h.append(torch.stack(lrow))
        outs.append(torch.stack(heads))
        lses.append(torch.stack(lse_h))
    out = torch.stack(outs)
    if return_lse:
        return out, torch.stack(lses)
    return out


def atm_decisions(x, threshold, lengths=None):
    """Python greedy loop (SPEC §6.1-6.2). Returns per-row list of groups (tuples of t)."""
    x = x.double()
    B, T, _ = x.shape
    groups = []
    for b in range(B):
        L = T if lengths is None else int(lengths[b])
        taken = [False] * T
        pairs = set()
        for t in range(T - 1):
            if t + 1 >= L:
                break
            s = torch.nn.functional.cosine_similarity(x[b, t], x[b, t + 1], dim=0, eps=0.0).item()
            if s > threshold and not taken[t] and not taken[t + 1]:
                taken[t] = taken[t + 1] = True
                pairs.add(t)
        row, t = [], 0
        while t < L:
            if t in pairs:
                row.append((t, t + 1))
                t += 2
            else:
                row.append((t,))
                t += 1
        groups.append(row)
    return groups


def atm_oracle(x, pos, groups, lengths=None):
    """Given decisions, build merged/positions/lengths/index_map in float64 (differentiable)."""
    B, T, d = x.shape
    xd = x.double()
    merged_rows, mpos, mlen, imap = [], torch.zeros(B, T, dtype=torch.int64), [], torch.zeros(B, T, dtype=torch.int64)
    for b in range(B):
        L = T if lengths is None else int(lengths[b])
        rows = []
        for slot, grp in enumerate(groups[b]):
            rows.append(sum(xd[b, t] for t in grp) / len(grp))
            mpos[b, slot] = pos[b, grp[0]]
            for t in grp:
                imap[b, t] = slot
        Tp = len(rows)
        for t in range(L, T):
            imap[b, t] = Tp + (t - L)
        rows += [torch.zeros(d, dtype=torch.float64)] * (T - Tp)
        merged_rows.append(torch.stack(rows))
        mlen.append(Tp)
    return torch.stack(merged_rows), mpos, torch.tensor(mlen), imap


def make_atm_input(B, T, d, dtype=torch.float32, seed=0):
    """Random tokens with runs of near-duplicates (runs of 2, 3, 4 and 5) so the greedy
    rule matters, and clearly dissimilar neighbours elsewhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    for b in range(B):
        t = b % 2
        run = 2 + b % 4
        while t + run <= T:
            base = x[b, t].clone()
            for u in range(t, t + run):
                x[b, u] = base + 0.05 * torch.randn(d, generator=g, dtype=torch.float64)
            t += run + 1 + (t % 3)
            run = 2 + (run - 1) % 4
    return x.to(dtype)


# ============================================================================ RMSNorm §3


@pytest.mark.parametrize("backend", RMS_BACKENDS)
@pytest.mark.parametrize("shape", [(2, 3, 5, 24), (24,), (1, 24), (7, 37), (2, 3000)])
def test_rms_norm_forward_matches_oracle(backend, shape):
    d = shape[-1]
    x = torch.randn(shape) * 3 + 0.5
    w = torch.randn(d)
    s = torch.randn(d) * 0.7
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel(y, rms_oracle(x, w, s, 1e-6)) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_eps_is_used(backend):
    # Small-magnitude input with a large ε: the ε term dominates and must be honoured.
    x = torch.randn(4, 16) * 0.1
    w, s = torch.ones(16), torch.zeros(16)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=0.5)
    assert rel(y, rms_oracle(x, w, s, 0.5)) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", RMS_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_rms_norm_dtypes(backend, dtype):
    x = (torch.randn(5, 40) * 4).to(dtype)
    w = torch.randn(40).to(dtype)
    s = torch.randn(40).to(dtype)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel(y, rms_oracle(x, w, s, 1e-6)) <= tol_for(dtype)


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_half_stats_in_fp32(backend):
    # Large values whose squares overflow fp16 (65504): statistics must be float32.
    x = (torch.randn(3, 64) * 300).to(torch.float16)
    w, s = torch.ones(64, dtype=torch.float16), torch.zeros(64, dtype=torch.float16)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=1e-6)
    assert rel(y, rms_oracle(x, w, s, 1e-6)) <= HALF_TOL


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_output_dtype_is_input_dtype(backend):
    # bf16 activations with float32 parameters (the mixed-precision case): output is bf16.
    x = torch.randn(4, 32).to(torch.bfloat16)
    w, s = torch.randn(32), torch.randn(32)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w, s, eps=1e-6)
    assert y.dtype == torch.bfloat16
    assert rel(y, rms_oracle(x, w, s, 1e-6)) <= HALF_TOL


@pytest.mark.parametrize("backend", RMS_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_backward_half(backend, dtype):
    x, w, s = (torch.randn(5, 24) * 2).to(dtype), torch.randn(24).to(dtype), torch.randn(24).to(dtype)
    g = torch.randn(5, 24).to(dtype)
    xs = [t.clone().requires_grad_() for t in (x, w, s)]
    with wk.use_backend(backend):
        wk.rms_norm(*xs, eps=1e-6).backward(g)
    xd = [t.double().requires_grad_() for t in (x, w, s)]
    rms_oracle(*xd, 1e-6).backward(g.double())
    for got, ref in zip(xs, xd):
        assert got.grad.dtype == dtype
        assert rel(got.grad, ref.grad) <= HALF_TOL


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_backward_matches_oracle(backend):
    x = torch.randn(2, 3, 19) * 2
    w = torch.randn(19)
    s = torch.randn(19)
    g = torch.randn(2, 3, 19)
    xs = [t.clone().requires_grad_() for t in (x, w, s)]
    with wk.use_backend(backend):
        y = wk.rms_norm(*xs, eps=1e-6)
    y.backward(g)
    xd = [t.double().requires_grad_() for t in (x, w, s)]
    rms_oracle(*xd, 1e-6).backward(g.double())
    for got, ref in zip(xs, xd):
        assert rel(got.grad, ref.grad) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_backward_is_spec_formula_not_paper_eq10(backend):
    # SPEC §3: ∂L/∂z_i = (1/r)(γ_i g_i − z_i/(d r²) Σ_k γ_k g_k z_k), closed form.
    d = 12
    x = torch.randn(4, d, dtype=torch.float64)
    w = torch.randn(d, dtype=torch.float64) + 2.0
    s = torch.randn(d, dtype=torch.float64)
    g = torch.randn(4, d, dtype=torch.float64)
    eps = 1e-6
    z = x + s
    r = torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    dz = (w * g - z / (d * r * r) * (w * g * z).sum(-1, keepdim=True)) / r
    dw = (g * z / r).sum(0)
    xs = [t.clone().requires_grad_() for t in (x, w, s)]
    with wk.use_backend(backend):
        wk.rms_norm(*xs, eps=eps).backward(g)
    assert rel(xs[0].grad, dz) <= 1e-12
    assert rel(xs[2].grad, dz.sum(0)) <= 1e-12
    assert rel(xs[1].grad, dw) <= 1e-12


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_gradcheck(backend):
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    s = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda a, b, c: wk.rms_norm(a, b, c, eps=1e-6), (x, w, s))


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_noncontiguous(backend):
    d = 20
    w, s = torch.randn(d), torch.randn(d)
    base = torch.randn(d, 6)
    cases = [
        base.t(),                               # transposed (stride (1, 6))
        torch.randn(6, 2 * d)[:, ::2],           # strided last dim
        torch.randn(1, d).expand(5, d),          # expanded (stride 0)
        torch.randn(3, 4, d).transpose(0, 1),    # permuted leading dims
    ]
    for x in cases:
        with wk.use_backend(backend):
            y = wk.rms_norm(x, w, s, eps=1e-6)
        assert rel(y, rms_oracle(x, w, s, 1e-6)) <= FP32_ELEM_TOL
    # non-contiguous parameters
    w2 = torch.randn(2 * d)[::2]
    s2 = torch.randn(d, 1).expand(d, 3)[:, 1]
    x = torch.randn(4, d)
    with wk.use_backend(backend):
        y = wk.rms_norm(x, w2, s2, eps=1e-6)
    assert rel(y, rms_oracle(x, w2, s2, 1e-6)) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_noncontiguous_grads(backend):
    # expanded (stride-0) input from a leaf, and a transposed output gradient
    base, w, s = torch.randn(1, 12), torch.randn(12), torch.randn(12)
    gt = torch.randn(12, 5).t()
    a = [t.clone().requires_grad_() for t in (base, w, s)]
    with wk.use_backend(backend):
        wk.rms_norm(a[0].expand(5, 12), a[1], a[2], eps=1e-6).backward(gt)
    d = [t.double().requires_grad_() for t in (base, w, s)]
    rms_oracle(d[0].expand(5, 12), d[1], d[2], 1e-6).backward(gt.double())
    for got, ref in zip(a, d):
        assert rel(got.grad, ref.grad) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_does_not_modify_inputs(backend):
    x, w, s = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    copies = [t.clone() for t in (x, w, s)]
    with wk.use_backend(backend):
        wk.rms_norm(x, w, s, eps=1e-6)
    for a, b in zip((x, w, s), copies):
        assert torch.equal(a, b)


_X, _W, _S = torch.randn(3, 8), torch.ones(8), torch.zeros(8)
RMS_BAD = {
    "weight_wrong_size": (lambda: wk.rms_norm(_X, torch.ones(7), _S), ["weight"]),
    "weight_wrong_rank": (lambda: wk.rms_norm(_X, torch.ones(8, 1), _S), ["weight"]),
    "shift_wrong_size": (lambda: wk.rms_norm(_X, _W, torch.zeros(9)), ["shift"]),
    "x_int": (lambda: wk.rms_norm(torch.ones(3, 8, dtype=torch.int32), _W, _S), ["x"]),
    "x_complex": (lambda: wk.rms_norm(torch.ones(3, 8, dtype=torch.complex64), _W, _S), ["x"]),
    "x_0d": (lambda: wk.rms_norm(torch.tensor(1.0), _W, _S), ["x"]),
    "x_list": (lambda: wk.rms_norm([[1.0] * 8], _W, _S), ["x"]),
    "weight_list": (lambda: wk.rms_norm(_X, [1.0] * 8, _S), ["weight"]),
    "weight_int": (lambda: wk.rms_norm(_X, torch.ones(8, dtype=torch.int64), _S), ["weight"]),
    "eps_negative": (lambda: wk.rms_norm(_X, _W, _S, eps=-1.0), ["eps"]),
    "eps_str": (lambda: wk.rms_norm(_X, _W, _S, eps="1e-6"), ["eps"]),
    "weight_other_device": (lambda: wk.rms_norm(_X, torch.ones(8, device="meta"), _S), ["device", "weight"]),
}


@pytest.mark.parametrize("case", list(RMS_BAD))
def test_rms_norm_bad_inputs(case):
    fn, names = RMS_BAD[case]
    _raises_naming((ValueError, TypeError), names, fn)


def test_rms_norm_module_defaults():
    m = WiolaRMSNorm(16)
    params = dict(m.named_parameters())
    assert len(params) == 2
    ones = [p for p in params.values() if torch.equal(p, torch.ones(16))]
    zeros = [p for p in params.values() if torch.equal(p, torch.zeros(16))]
    assert len(ones) == 1 and len(zeros) == 1          # γ = 1, δ = 0 at init (SPEC §3)
    assert m.eps == 1e-6                               # SPEC §1 rms_norm_eps
    # forward with trained-looking parameters follows the formula
    with torch.no_grad():
        ones[0].copy_(torch.randn(16))
        zeros[0].copy_(torch.randn(16))
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = m(x)
    assert rel(y, rms_oracle(x.detach(), ones[0].detach(), zeros[0].detach(), 1e-6)) <= FP32_ELEM_TOL
    y.sum().backward()
    assert ones[0].grad is not None and zeros[0].grad is not None


def test_rms_norm_module_dtype_and_eps_kwargs():
    m = WiolaRMSNorm(8, eps=1e-3, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in m.parameters())
    x = torch.randn(3, 8, dtype=torch.float64) * 0.01
    w = [p for p in m.parameters() if torch.equal(p, torch.ones(8, dtype=torch.float64))][0]
    s = [p for p in m.parameters() if torch.equal(p, torch.zeros(8, dtype=torch.float64))][0]
    assert rel(m(x), rms_oracle(x, w.detach(), s.detach(), 1e-3)) <= 1e-12


def test_rms_norm_opcheck():
    # The registered ops take no grad (autograd is wk.RMSNormFunction's): plain inputs.
    x = torch.randn(3, 8)
    w = torch.randn(8)
    s = torch.randn(8)
    torch.library.opcheck(torch.ops.wiola.rms_norm.default, (x, w, s, 1e-6))


def test_rms_norm_compile_fullgraph():
    x = torch.randn(4, 16, requires_grad=True)
    w, s = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    f = torch.compile(lambda a, b, c: wk.rms_norm(a, b, c, eps=1e-6), fullgraph=True, backend="aot_eager")
    y = f(x, w, s)
    assert rel(y, rms_oracle(x.detach(), w.detach(), s.detach(), 1e-6)) <= FP32_ELEM_TOL
    y.sum().backward()
    assert x.grad is not None and w.grad is not None and s.grad is not None


# ============================================================================ SRPE §4


def _srpe_case(B=3, H=4, Hkv=2, T=5, dh=8, dtype=torch.float32):
    q = torch.randn(B, H, T, dh).to(dtype)
    k = torch.randn(B, Hkv, T, dh).to(dtype)
    return q, k


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
def test_srpe_forward_positions_are_position_ids(backend):
    q, k = _srpe_case(B=3, T=5, dh=8)
    pos = torch.tensor([[7, 3, 100, 0, 41], [5, 6, 7, 8, 9], [1000, 2, 2, 513, 64]])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == q.dtype
    assert rel(qo, srpe_oracle(q, pos)) <= FP32_ELEM_TOL
    assert rel(ko, srpe_oracle(k, pos)) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
def test_srpe_shared_1d_positions(backend):
    q, k = _srpe_case(B=3, T=6, dh=6)         # d_h/2 = 3 pairs (odd count)
    pos = torch.tensor([9, 8, 7, 300, 2, 0])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    pb = pos.expand(3, 6)
    assert rel(qo, srpe_oracle(q, pb)) <= FP32_ELEM_TOL
    assert rel(ko, srpe_oracle(k, pb)) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
def test_srpe_large_positions_fp32(backend):
    # SPEC §4: float32 outputs within 1e-5 of float64 at every position below 2^20.
    T = 8
    q, k = _srpe_case(B=2, H=2, Hkv=1, T=T, dh=16)
    pos = torch.tensor([[2**20 - 1, 2**20 - 2, 65536, 999_983, 524_287, 123_457, 777_777, 3],
                        [1_048_000, 917_503, 65537, 2**19, 1, 0, 333_333, 2**20 - 7]])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    ref_q, ref_k = srpe_oracle(q, pos), srpe_oracle(k, pos)
    assert rel(qo, ref_q) <= FP32_ELEM_TOL
    assert rel(ko, ref_k) <= FP32_ELEM_TOL
    # also per position (an error at one position must not hide in the average)
    for t in range(T):
        assert rel(qo[:, :, t], ref_q[:, :, t]) <= FP32_ELEM_TOL, pos[:, t]


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_srpe_large_positions_d64(backend, dtype):
    # the model's head width: ω_j spans 1 … 1e4^(-62/64)
    q, k = _srpe_case(B=1, H=2, Hkv=1, T=4, dh=64, dtype=dtype)
    pos = torch.tensor([[2**20 - 1, 786_431, 65_536, 300_001]])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    assert rel(qo, srpe_oracle(q, pos)) <= tol_for(dtype)
    assert rel(ko, srpe_oracle(k, pos)) <= tol_for(dtype)


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
def test_srpe_hyperparameters_are_used(backend):
    q, k = _srpe_case(B=1, H=3, Hkv=1, T=4, dh=10)
    pos = torch.tensor([[1, 17, 250, 4000]])
    kw = dict(theta=500.0, spiral_divisor=3.0, radial_amplitude=0.3, radial_frequency=0.05)
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos, **kw)
    assert rel(qo, srpe_oracle(q, pos, 500.0, 3.0, 0.3, 0.05)) <= FP32_ELEM_TOL
    assert rel(ko, srpe_oracle(k, pos, 500.0, 3.0, 0.3, 0.05)) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
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
            assert abs(n_out - r * n_in) <= 1e-9 * max(1.0, n_in)


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_srpe_dtypes(backend, dtype):
    q, k = _srpe_case(B=1, T=5, dh=8, dtype=dtype)
    pos = torch.tensor([0, 3, 11, 70, 2000])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    assert qo.dtype == dtype and ko.dtype == dtype
    pb = pos.expand(1, 5)
    assert rel(qo, srpe_oracle(q, pb)) <= tol_for(dtype)
    assert rel(ko, srpe_oracle(k, pb)) <= tol_for(dtype)


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
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
    assert rel(qq.grad, qd.grad) <= FP32_ELEM_TOL
    assert rel(kk.grad, kd.grad) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
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
    assert rel(qq.grad, qd.grad) <= HALF_TOL and rel(kk.grad, kd.grad) <= HALF_TOL


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
def test_srpe_gradcheck(backend):
    q = torch.randn(1, 2, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 2, 4, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[70, 1]])
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda a, b: wk.srpe(a, b, pos), (q, k))


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
def test_srpe_noncontiguous_and_t1(backend):
    B, T, H, Hkv, dh = 3, 5, 4, 2, 8
    q = torch.randn(B, T, H, dh).transpose(1, 2)             # the usual (B,T,H,d) → (B,H,T,d) view
    k = torch.randn(B, T, Hkv, 2 * dh)[..., ::2].transpose(1, 2)
    pos = torch.arange(T) * 3 + 1
    qc, kc = q.clone(), k.clone()
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q, k, pos)
    pb = pos.expand(B, T)
    assert rel(qo, srpe_oracle(q, pb)) <= FP32_ELEM_TOL
    assert rel(ko, srpe_oracle(k, pb)) <= FP32_ELEM_TOL
    assert torch.equal(q, qc) and torch.equal(k, kc)        # inputs untouched
    # expanded keys and T = 1
    k1 = torch.randn(1, 1, 1, dh).expand(B, Hkv, 1, dh)
    q1 = torch.randn(B, H, 1, dh)
    p1 = torch.tensor([[5], [12345], [0]])
    with wk.use_backend(backend):
        qo, ko = wk.srpe(q1, k1, p1)
    assert rel(qo, srpe_oracle(q1, p1)) <= FP32_ELEM_TOL
    assert rel(ko, srpe_oracle(k1, p1)) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
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
    assert rel(qq.grad, qd.grad) <= FP32_ELEM_TOL and rel(kk.grad, kd.grad) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", SRPE_BACKENDS)
def test_srpe_int32_positions(backend):
    q, k = _srpe_case(B=1, T=3, dh=4)
    pos = torch.tensor([[5, 900, 2**20 - 1]], dtype=torch.int32)
    with wk.use_backend(backend):
        qo, _ = wk.srpe(q, k, pos)
    assert rel(qo, srpe_oracle(q, pos)) <= FP32_ELEM_TOL


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
    _raises_naming((ValueError, TypeError), names, fn)


def test_srpe_module_defaults():
    m = SpiralRotaryEmbedding(8)
    assert len(list(m.parameters())) == 0
    q, k = _srpe_case(B=2, H=2, Hkv=1, T=4, dh=8)
    pos = torch.tensor([[0, 1, 2, 3], [10, 20, 30, 40000]])
    qo, ko = m(q, k, pos)
    assert rel(qo, srpe_oracle(q, pos)) <= FP32_ELEM_TOL   # θ₀ 1e4, k_s 8, a_s 0.1, f_s 0.01
    assert rel(ko, srpe_oracle(k, pos)) <= FP32_ELEM_TOL


def test_srpe_module_custom_hyperparameters():
    m = SpiralRotaryEmbedding(6, theta=100.0, spiral_divisor=2.0, radial_amplitude=0.5, radial_frequency=0.2)
    q, k = _srpe_case(B=1, H=2, Hkv=2, T=3, dh=6)
    pos = torch.tensor([7, 30, 1])
    qo, ko = m(q, k, pos)
    pb = pos.expand(1, 3)
    assert rel(qo, srpe_oracle(q, pb, 100.0, 2.0, 0.5, 0.2)) <= FP32_ELEM_TOL
    assert rel(ko, srpe_oracle(k, pb, 100.0, 2.0, 0.5, 0.2)) <= FP32_ELEM_TOL


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
    assert rel(qo, srpe_oracle(q.detach(), pos)) <= FP32_ELEM_TOL
    (qo.sum() + ko.sum()).backward()
    assert q.grad is not None and k.grad is not None


# ============================================================================ GCLA §5.5


def _gcla_case(B=3, H=4, Hkv=2, T=7, dh=8, S=None, Lam=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q_rot, k_rot, v, q = r(B, H, T, dh), r(B, Hkv, T, dh), r(B, Hkv, T, dh), r(B, H, T, dh)
    kc, vc = r(B, H, S, Lam, dh), r(B, H, S, Lam, dh)
    gate = torch.randn(H, generator=g) * 2
    return q_rot, k_rot, v, q, kc, vc, gate


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
@pytest.mark.parametrize("S_mode", ["paper", "causal"])
@pytest.mark.parametrize("Lam", [0, 1, 2])
def test_gcla_forward_matches_oracle(backend, S_mode, Lam):
    T = 7
    args = _gcla_case(B=3, H=4, Hkv=2, T=T, S=1 if S_mode == "paper" else T, Lam=Lam)
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    assert rel(out, gcla_oracle(*args)) <= FP32_ATTN_TOL


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_group_is_h_mod_hkv(backend):
    # H = 6, H_kv = 3: h mod 3 (0,1,2,0,1,2) differs from h // 2 (0,0,1,1,2,2) for h = 1..4.
    B, H, Hkv, T, dh = 1, 6, 3, 5, 4
    q_rot, k_rot, v, q, kc, vc, gate = _gcla_case(B, H, Hkv, T, dh, Lam=0)
    v = torch.stack([torch.full((T, dh), float(10 * (g + 1))) for g in range(Hkv)])[None]
    with wk.use_backend(backend):
        out = wk.gcla_attention(q_rot, k_rot, v, q, kc, vc, gate)
    for h in range(H):
        assert torch.allclose(out[0, h], torch.full((T, dh), float(10 * (h % Hkv + 1)))), h


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_cross_uses_unrotated_q_and_gate(backend):
    # Zero self-values isolate σ(g_h)·O_cross; q_rot is garbage for the cross part.
    B, H, Hkv, T, dh = 2, 2, 1, 4, 8
    q_rot, k_rot, v, q, kc, vc, gate = _gcla_case(B, H, Hkv, T, dh, S=T, Lam=2)
    v = torch.zeros_like(v)
    gate = torch.tensor([-3.0, 1.5])
    with wk.use_backend(backend):
        out = wk.gcla_attention(q_rot * 100, k_rot, v, q, kc, vc, gate)
    ref = gcla_oracle(q_rot * 100, k_rot, v, q, kc, vc, gate)
    assert rel(out, ref) <= FP32_ATTN_TOL
    # and explicitly: it is not the rotated query
    wrong = gcla_oracle(q_rot * 100, k_rot, v, q_rot * 100, kc, vc, gate)
    assert rel(out, wrong) > 1e-2


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
@pytest.mark.parametrize("S_mode", ["paper", "causal"])
def test_gcla_lengths_mask_and_zero(backend, S_mode):
    B, T = 4, 9
    args = list(_gcla_case(B=B, H=4, Hkv=2, T=T, dh=8, S=1 if S_mode == "paper" else T, Lam=2))
    lengths = torch.tensor([9, 5, 0, 1])
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args, lengths)
    ref = gcla_oracle(*args, lengths=lengths)
    assert rel(out, ref) <= FP32_ATTN_TOL
    for b, L in enumerate(lengths.tolist()):
        assert torch.equal(out[b, :, L:], torch.zeros_like(out[b, :, L:]))   # exactly zero
    # Perturbing keys/values/queries past the length changes nothing (even with NaN).
    k2, v2, q2 = args[1].clone(), args[2].clone(), args[0].clone()
    k2[1, :, 5:] = float("nan")
    v2[1, :, 5:] = 1e6
    q2[1, :, 5:] = float("nan")
    with wk.use_backend(backend):
        out2 = wk.gcla_attention(q2, k2, v2, *args[3:], lengths)
    assert torch.equal(out2[1], out[1])


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_lengths_int32_and_full(backend):
    args = _gcla_case(B=2, H=2, Hkv=1, T=6, dh=4, S=6, Lam=1)
    with wk.use_backend(backend):
        a = wk.gcla_attention(*args, torch.tensor([6, 6], dtype=torch.int32))
        b = wk.gcla_attention(*args)
    assert rel(a, gcla_oracle(*args)) <= FP32_ATTN_TOL
    assert rel(b, gcla_oracle(*args)) <= FP32_ATTN_TOL


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_odd_sizes_t1_and_long(backend):
    # T = 1, B odd, T not a multiple of any block size (37 > typical 16/32 blocks).
    for B, H, Hkv, T, dh in [(1, 2, 2, 1, 8), (3, 3, 1, 37, 16), (5, 4, 4, 2, 4), (1, 2, 1, 70, 4)]:
        args = _gcla_case(B, H, Hkv, T, dh, S=T, Lam=2)
        lengths = torch.tensor([max(T - b * 7, 0) for b in range(B)])
        with wk.use_backend(backend):
            out = wk.gcla_attention(*args, lengths)
        assert rel(out, gcla_oracle(*args, lengths=lengths)) <= FP32_ATTN_TOL, (B, H, Hkv, T, dh)


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_gcla_dtypes(backend, dtype):
    args = _gcla_case(B=1, H=2, Hkv=1, T=6, dh=8, S=6, Lam=2, dtype=dtype)
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args)
    assert out.dtype == dtype
    assert rel(out, gcla_oracle(*args)) <= tol_for(dtype, attention=True)


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
@pytest.mark.parametrize("S_mode", ["paper", "causal"])
def test_gcla_backward_matches_oracle(backend, S_mode):
    T = 6
    args = _gcla_case(B=2, H=4, Hkv=2, T=T, dh=8, S=1 if S_mode == "paper" else T, Lam=2)
    lengths = torch.tensor([6, 4])
    gout = torch.randn(2, 4, T, 8)
    xs = [a.clone().requires_grad_() for a in args]
    with wk.use_backend(backend):
        out = wk.gcla_attention(*xs, lengths)
    out.backward(gout)
    xd = [a.double().requires_grad_() for a in args]
    gcla_oracle(*xd, lengths=lengths).backward(gout.double())
    names = ["q_rot", "k_rot", "v", "q", "kc", "vc", "gate"]
    for n, got, ref in zip(names, xs, xd):
        assert got.grad is not None, n
        assert rel(got.grad, ref.grad) <= FP32_ATTN_TOL, n


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_backward_half_and_empty_rows(backend):
    T = 5
    args = _gcla_case(B=3, H=2, Hkv=1, T=T, dh=8, S=T, Lam=2, dtype=torch.bfloat16)
    lengths = torch.tensor([5, 0, 2])
    gout = torch.randn(3, 2, T, 8).to(torch.bfloat16)
    xs = [a.clone().requires_grad_() for a in args]
    with wk.use_backend(backend):
        wk.gcla_attention(*xs, lengths).backward(gout)
    xd = [a.double().requires_grad_() for a in args]
    gcla_oracle(*xd, lengths=lengths).backward(gout.double())
    for n, got, ref in zip(["q_rot", "k_rot", "v", "q", "kc", "vc", "gate"], xs, xd):
        assert rel(got.grad, ref.grad) <= HALF_TOL, n
    # a row of length 0 gets exactly zero gradient everywhere
    for a in xs[:6]:
        assert torch.equal(a.grad[1], torch.zeros_like(a.grad[1]))


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_large_scores_stable(backend):
    # Scores of several hundred (softmax nearly one-hot) must not overflow or lose accuracy.
    q_rot, k_rot, v, q, kc, vc, gate = _gcla_case(B=1, H=2, Hkv=1, T=20, dh=8, S=20, Lam=2)
    args = (q_rot * 12, k_rot * 12, v, q * 12, kc * 12, vc, gate)
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args, torch.tensor([17]))
    assert rel(out, gcla_oracle(*args, lengths=torch.tensor([17]))) <= FP32_ATTN_TOL


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_is_causal(backend):
    # Changing keys/values/queries at positions > t never changes outputs at positions ≤ t.
    T, t0 = 10, 4
    args = list(_gcla_case(B=1, H=2, Hkv=1, T=T, dh=4, S=T, Lam=2))
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args)
    pert = [a.clone() for a in args]
    for i in range(6):
        pert[i][:, :, t0 + 1:] += 5 * torch.randn_like(pert[i][:, :, t0 + 1:])
    with wk.use_backend(backend):
        out2 = wk.gcla_attention(*pert)
    assert torch.allclose(out2[:, :, : t0 + 1], out[:, :, : t0 + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(out2[:, :, t0 + 1:], out[:, :, t0 + 1:])


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
@pytest.mark.parametrize("S,Lam,lengths", [(1, 2, None), (3, 1, [3, 2]), (3, 0, [1, 3])])
def test_gcla_gradcheck(backend, S, Lam, lengths):
    # fast_mode (random projections) keeps this cheap; the next test is a full gradcheck.
    args = _gcla_case(B=2, H=2, Hkv=1, T=3, dh=4, S=S, Lam=Lam, dtype=torch.float64)
    args = [a.double().requires_grad_() for a in args]
    ln = None if lengths is None else torch.tensor(lengths)
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda *a: wk.gcla_attention(*a, ln), tuple(args), fast_mode=True)


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_gradcheck_full_tiny(backend):
    args = _gcla_case(B=2, H=2, Hkv=1, T=2, dh=2, S=2, Lam=1, dtype=torch.float64)
    args = [a.double().requires_grad_() for a in args]
    ln = torch.tensor([2, 1])
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda *a: wk.gcla_attention(*a, ln), tuple(args))


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_noncontiguous(backend):
    B, H, Hkv, T, dh = 2, 4, 2, 5, 8
    q_rot = torch.randn(B, T, H, dh).transpose(1, 2)
    k_rot = torch.randn(B, T, Hkv, dh).transpose(1, 2)
    v = torch.randn(B, T, Hkv, 2 * dh)[..., ::2].transpose(1, 2)
    q = torch.randn(B, T, H, dh).transpose(1, 2)
    kc = torch.randn(B, H, 1, 2, dh).expand(B, H, T, 2, dh)          # expanded paper summary
    vc = torch.randn(B, H, T, dh, 2).transpose(-1, -2)
    gate = torch.randn(2 * H)[::2]
    args = (q_rot, k_rot, v, q, kc, vc, gate)
    with wk.use_backend(backend):
        out = wk.gcla_attention(*args)
    assert rel(out, gcla_oracle(*args)) <= FP32_ATTN_TOL


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_noncontiguous_grads(backend):
    args = _gcla_case(B=2, H=2, Hkv=1, T=5, dh=4, S=5, Lam=2)
    ln = torch.tensor([5, 3])
    g = torch.randn(2, 5, 2, 4).transpose(1, 2)
    for gout in (g, None):                                  # strided, then stride-0 (from .sum())
        xs = [a.clone().requires_grad_() for a in args]
        xd = [a.double().requires_grad_() for a in args]
        with wk.use_backend(backend):
            out = wk.gcla_attention(*xs, ln)
        ref = gcla_oracle(*xd, lengths=ln)
        if gout is None:
            out.sum().backward()
            ref.sum().backward()
        else:
            out.backward(gout)
            ref.backward(gout.double())
        for got, r in zip(xs, xd):
            assert rel(got.grad, r.grad) <= FP32_ATTN_TOL


@pytest.mark.parametrize("backend", GCLA_BACKENDS)
def test_gcla_raw_op_returns_self_lse(backend):
    # SPEC §5.5: the op returns the log-sum-exp it needs for its backward.
    args = _gcla_case(B=2, H=2, Hkv=1, T=5, dh=4, S=5, Lam=2)
    lengths = torch.tensor([5, 3])
    with wk.use_backend(backend):
        out, lse = torch.ops.wiola.gcla_attention(*args, lengths)
    ref_out, ref_lse = gcla_oracle(*args, lengths=lengths, return_lse=True)
    assert rel(out, ref_out) <= FP32_ATTN_TOL
    assert lse.shape == (2, 2, 5)                 # (definition used here: (B, H, T) of the self part)
    valid = torch.isfinite(ref_lse)
    assert rel(lse[valid], ref_lse[valid]) <= FP32_ATTN_TOL


def _gcla_bad_call(**over):
    B, H, Hkv, T, dh = 2, 4, 2, 5, 8
    q_rot, k_rot, v, q, kc, vc, gate = _gcla_case(B, H, Hkv, T, dh, S=T, Lam=2)
    a = dict(q_rot=q_rot, k_rot=k_rot, v=v, q=q, kc=kc, vc=vc, gate=gate, lengths=None)
    for k_, f_ in over.items():
        a[k_] = f_(a)
    return wk.gcla_attention(**a)


_C64 = {n: (lambda a, n=n: a[n].to(torch.complex64)) for n in ("q_rot", "k_rot", "v", "q", "kc", "vc")}
GCLA_BAD = {
    "q_rot_rank3": (dict(q_rot=lambda a: a["q_rot"][0]), ["q_rot"]),
    "H_not_multiple_of_H_kv": (dict(k_rot=lambda a: torch.randn(2, 3, 5, 8), v=lambda a: torch.randn(2, 3, 5, 8)),
                               ["k_rot", "H_kv"]),
    "v_wrong_T": (dict(v=lambda a: torch.randn(2, 2, 6, 8)), ["v"]),
    "k_rot_wrong_d_h": (dict(k_rot=lambda a: torch.randn(2, 2, 5, 10)), ["k_rot"]),
    "q_wrong_T": (dict(q=lambda a: torch.randn(2, 4, 4, 8)), ["q"]),
    "kc_S_not_1_or_T": (dict(kc=lambda a: torch.randn(2, 4, 2, 2, 8), vc=lambda a: torch.randn(2, 4, 2, 2, 8)), ["kc"]),
    "vc_lambda_mismatch": (dict(vc=lambda a: torch.randn(2, 4, 5, 1, 8)), ["vc"]),
    "kc_rank4": (dict(kc=lambda a: torch.randn(2, 4, 5, 8)), ["kc"]),
    "gate_wrong_size": (dict(gate=lambda a: torch.zeros(5)), ["gate"]),
    "gate_list": (dict(gate=lambda a: [0.0] * 4), ["gate"]),
    "lengths_above_T": (dict(lengths=lambda a: torch.tensor([6, 1])), ["lengths"]),
    "lengths_negative": (dict(lengths=lambda a: torch.tensor([-1, 1])), ["lengths"]),
    "lengths_wrong_B": (dict(lengths=lambda a: torch.tensor([1, 2, 3])), ["lengths"]),
    "lengths_float": (dict(lengths=lambda a: torch.tensor([1.0, 2.0])), ["lengths"]),
    "lengths_list": (dict(lengths=lambda a: [5, 5]), ["lengths"]),
    "lengths_int": (dict(lengths=lambda a: 5), ["lengths"]),
    "v_dtype_mismatch": (dict(v=lambda a: a["v"].double()), ["v", "dtype"]),
    "q_rot_int": (dict(q_rot=lambda a: a["q_rot"].to(torch.int32)), ["q_rot"]),
    "all_complex": (_C64, ["q_rot", "dtype"]),
    "q_rot_list": (dict(q_rot=lambda a: a["q_rot"].tolist()), ["q_rot"]),
    "k_rot_other_device": (dict(k_rot=lambda a: a["k_rot"].to("meta")), ["k_rot", "device"]),
}


@pytest.mark.parametrize("case", list(GCLA_BAD))
def test_gcla_bad_inputs(case):
    over, names = GCLA_BAD[case]
    _raises_naming((ValueError, TypeError), names, lambda: _gcla_bad_call(**over))


def test_gcla_opcheck():
    args = _gcla_case(B=1, H=2, Hkv=1, T=3, dh=4, S=3, Lam=2)  # no grad: autograd is wk.GCLAAttentionFunction's
    torch.library.opcheck(torch.ops.wiola.gcla_attention.default, (*args, torch.tensor([2])))
    torch.library.opcheck(torch.ops.wiola.gcla_attention.default, (*args, None))


def test_gcla_compile_fullgraph():
    args = [a.requires_grad_() for a in _gcla_case(B=1, H=2, Hkv=1, T=3, dh=4, S=1, Lam=2)]
    lengths = torch.tensor([2])
    f = torch.compile(lambda *a: wk.gcla_attention(*a, lengths), fullgraph=True, backend="aot_eager")
    out = f(*args)
    assert rel(out, gcla_oracle(*[a.detach() for a in args], lengths=lengths)) <= FP32_ATTN_TOL
    out.sum().backward()
    assert all(a.grad is not None for a in args)


def test_gcla_gate_init_in_model():
    # SPEC §1/§5.4: the gate g is initialised to g₀ = −3.0 (the module lives in the model).
    wiola = pytest.importorskip("wiola")
    cfg = wiola.WiolaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=4, dsff_narrow_size=16, dsff_wide_size=32)
    assert cfg.gcla_gate_init == -3.0 and cfg.rms_norm_eps == 1e-6 and cfg.gcla_lookback == 2
    assert cfg.atm_threshold == 0.92 and cfg.srpe_theta == 10000 and cfg.srpe_spiral_divisor == 8
    assert cfg.srpe_radial_amplitude == 0.1 and cfg.srpe_radial_frequency == 0.01
    model = wiola.WiolaForCausalLM(cfg)
    gates = [p for n, p in model.named_parameters() if n.endswith("gate")]
    assert len(gates) == 3
    for p in gates:
        assert p.shape == (4,) and torch.equal(p, torch.full((4,), -3.0))


# ============================================================================ ATM §6


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


@pytest.mark.parametrize("backend", ATM_BACKENDS)
@pytest.mark.parametrize("threshold", [0.92, 0.5, -1.0, 1.0])
def test_atm_merge_matches_greedy_oracle(backend, threshold):
    B, T, d = 5, 23, 12
    x = make_atm_input(B, T, d)
    pos = torch.stack([torch.randperm(1000)[:T] for _ in range(B)])   # not the row index
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, threshold)
    groups = _check_merge(res, x, pos, threshold, None, FP32_ELEM_TOL)
    if threshold == 0.92:
        # the input has runs of length ≥ 3, so the greedy rule is exercised
        assert any(len(g) == 2 for row in groups for g in row)


@pytest.mark.parametrize("backend", ATM_BACKENDS)
def test_atm_merge_long_rows_with_lengths(backend):
    # T not a multiple of any block size, per-row lengths, per-row positions.
    B, T, d = 3, 70, 8
    x = make_atm_input(B, T, d, seed=9)
    pos = torch.stack([torch.randperm(5000)[:T] for _ in range(B)])
    lengths = torch.tensor([70, 33, 69])
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, 0.92, lengths)
    _check_merge(res, x, pos, 0.92, lengths, FP32_ELEM_TOL)


@pytest.mark.parametrize("backend", ATM_BACKENDS)
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
    _check_merge((merged, mpos, mlen, imap), x, pos, 0.5, None, FP32_ELEM_TOL)


@pytest.mark.parametrize("backend", ATM_BACKENDS)
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


@pytest.mark.parametrize("backend", ATM_BACKENDS)
def test_atm_lengths_padding(backend):
    B, T, d = 4, 13, 6
    x = make_atm_input(B, T, d, seed=3)
    x[:, :, :] = x[:, :1, :] + 0.01 * x          # everything similar: all candidates
    lengths = torch.tensor([13, 7, 0, 1])
    pos = torch.arange(T).expand(B, T)
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, 0.5, lengths)
    _check_merge(res, x, pos, 0.5, lengths, FP32_ELEM_TOL)
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


@pytest.mark.parametrize("backend", ATM_BACKENDS)
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
    assert rel(restored, rr) <= FP32_ELEM_TOL
    assert rel(xx.grad, xd.grad) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", ATM_BACKENDS)
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
    assert rel(y.grad, expect) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", ATM_BACKENDS)
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
    assert rel(xx.grad, xd.grad) <= FP32_ELEM_TOL


@pytest.mark.parametrize("backend", ATM_BACKENDS)
def test_atm_gradcheck(backend):
    x = make_atm_input(2, 7, 4, dtype=torch.float64, seed=1).requires_grad_()
    pos = torch.arange(7)
    lengths = torch.tensor([7, 5])
    with wk.use_backend(backend):
        assert torch.autograd.gradcheck(lambda a: wk.atm_merge(a, pos, 0.92, lengths)[0], (x,))
        _, _, _, imap = wk.atm_merge(x.detach(), pos, 0.92, lengths)
        y = torch.randn(2, 7, 4, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a: wk.atm_unmerge(a, imap), (y,))


@pytest.mark.parametrize("backend", ATM_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_atm_dtypes(backend, dtype):
    x = make_atm_input(3, 9, 8, seed=2).to(dtype)
    pos = torch.arange(9)
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, 0.92)
    _check_merge(res, x, pos.expand(3, 9), 0.92, None, tol_for(dtype))
    with wk.use_backend(backend):
        out = wk.atm_unmerge(res[0], res[3])
    assert out.dtype == dtype


@pytest.mark.parametrize("backend", ATM_BACKENDS)
def test_atm_noncontiguous_t1_odd_batch(backend):
    x = make_atm_input(7, 3, 10, seed=4).transpose(0, 1).contiguous().transpose(0, 1)  # strided batch
    assert not x.is_contiguous()
    pos = torch.arange(3)[None].expand(7, 3)
    with wk.use_backend(backend):
        res = wk.atm_merge(x, pos, 0.92)
    _check_merge(res, x, pos, 0.92, None, FP32_ELEM_TOL)
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
    _raises_naming((ValueError, TypeError), names, fn)


def test_atm_opcheck():
    x = make_atm_input(2, 6, 4)  # the registered ops take no grad (autograd is wk.ATM*Function's)
    pos = torch.arange(6).expand(2, 6).contiguous()
    lengths = torch.tensor([6, 4])
    torch.library.opcheck(torch.ops.wiola.atm_merge.default, (x, pos, lengths, 0.92))
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
    assert torch.equal(n, ref_n) and rel(out, ref_out) <= FP32_ELEM_TOL
    out.sum().backward()
    assert x.grad is not None


# ============================================================================ all ops together


def test_compile_dynamic_shapes_all_ops():
    # One compiled function over every op, with dynamic shapes and autograd (aot_eager keeps
    # this test fast; inductor was checked by hand and agrees).
    def f(x, w, s, q, k, kc, g, pos, ln):
        y = wk.rms_norm(x, w, s, eps=1e-6)
        qr, kr = wk.srpe(q, k, pos)
        o = wk.gcla_attention(qr, kr, k, q, kc, kc, g, ln)
        m, _, _, imap = wk.atm_merge(y, pos, 0.5)
        return y.sum() + o.sum() + wk.atm_unmerge(m * 2, imap).sum()

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (3, 5):
        ins = [torch.randn(2, T, 16), torch.randn(16), torch.randn(16), torch.randn(2, 2, T, 4),
               torch.randn(2, 1, T, 4), torch.randn(2, 2, T, 2, 4), torch.zeros(2)]
        a = [t.clone().requires_grad_() for t in ins]
        b = [t.clone().requires_grad_() for t in ins]
        extra = (torch.arange(T), torch.tensor([T, T - 1]))
        ra, rb = cf(*a, *extra), f(*b, *extra)
        ra.backward()
        rb.backward()
        assert abs(ra.item() - rb.item()) <= 1e-4 * max(1.0, abs(rb.item()))
        for ta, tb in zip(a, b):
            assert rel(ta.grad, tb.grad) <= 1e-5
