"""The cuda_emu test backend itself: how it is chosen, that it goes through
the CUDA bindings' argument checks, and that its schemas are those of the real kernels.
The kernels' results are tested by the cuda/cuda_emu sections of tests/test_gcla_attention.py, tests/test_atm.py
and tests/test_all_ops.py (which run on cuda_emu in CI) and by the ctest targets wiola_cuda_emu_* (also under TSan)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import dispatch

CPU = torch.device("cpu")
_REASON = dispatch.BACKENDS["cuda_emu"].unavailable_reason(CPU)
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"cuda_emu unavailable: {_REASON}")

OPS = ["gcla_attention", "gcla_attention_backward", "_gcla_summary_fwd", "_gcla_summary_bwd", "atm_merge",
       "atm_merge_backward", "atm_unmerge", "atm_unmerge_backward"]


@pytest.mark.parametrize("name", OPS)
def test_schemas_match_the_kernels(name):
    real = str(getattr(torch.ops.wiola, name).default._schema).split("::", 1)[1]
    emu = str(getattr(torch.ops.wiola_cuda_emu, name).default._schema).split("::", 1)[1]
    assert emu == real


@pytest.mark.parametrize("op", ["atm", "gcla_attention"])
def test_never_chosen_by_default(op):
    with wk.use_backend("auto"):
        assert dispatch.select(op, CPU) != "cuda_emu"
    with wk.use_backend("cuda"):  # forcing the GPU backend does not fall back to the emulator
        with pytest.raises(RuntimeError, match="cuda.*cannot run"):
            dispatch.select(op, CPU)
    with wk.use_backend("cuda_emu"):
        assert dispatch.select(op, CPU) == "cuda_emu"
        assert dispatch.select("rms_norm", CPU) in ("cpu", "reference")  # no emulated kernel: its default


def test_environment_variable_selects_it():
    code = ("import torch, wiola_kernels as wk; from wiola_kernels import dispatch; "
            "print(dispatch.select('atm', torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "WIOLA_BACKEND": "cuda_emu"})
    assert out.stdout.strip() == "cuda_emu"


def test_probe_refuses_cuda_tensors():
    reason = dispatch.BACKENDS["cuda_emu"].unavailable_reason(torch.device("cuda"))
    assert reason is not None and "CPU tensors" in reason


def test_binding_argument_checks():
    """The emulated ops are the CUDA bindings: their checks, naming the argument."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g)
    pos, lens = torch.arange(5).expand(2, 5).contiguous(), torch.tensor([5, 3])
    ops = torch.ops.wiola_cuda_emu
    with pytest.raises(ValueError, match=r"^x must have shape \(B, T, d\) \(3-D\)"):
        ops.atm_merge(x[:, :, 0], pos, 0.5, lens)
    with pytest.raises(TypeError, match="^lengths must have dtype in"):
        ops.atm_merge(x, pos, 0.5, lens.float())
    with pytest.raises(ValueError, match="^threshold must lie in"):
        ops.atm_merge(x, pos, 1.5, lens)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16 for the CUDA kernels"):
        ops.atm_merge(x.double(), pos, 0.5, lens)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # any strides: the binding copies once
    with wk.use_backend("reference"):
        want = wk.atm_merge(x, pos, 0.5, lens)
    for got, ref in zip(ops.atm_merge(strided, pos, 0.5, lens.int()), want):
        assert torch.equal(got, ref) if not got.is_floating_point() else torch.allclose(got, ref)
    q = torch.randn(1, 2, 4, 64, generator=g)
    kc = torch.randn(1, 2, 1, 1, 64, generator=g)
    gate = torch.zeros(2)
    o_self, lse_self = torch.zeros_like(q), torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match=r"kc must be a contiguous CPU \(cuda_emu\) tensor"):
        ops._gcla_summary_fwd(o_self, lse_self, q, kc[..., :32], kc, gate, None, 1)
    with pytest.raises(TypeError, match="vc must have dtype"):
        ops._gcla_summary_fwd(o_self, lse_self, q, kc, kc.half(), gate, None, 1)
    with pytest.raises(ValueError, match="perm_kv must divide H"):
        ops._gcla_summary_fwd(o_self, lse_self, q, kc, kc, gate, None, 3)
    with pytest.raises(ValueError, match=r"lengths must be a contiguous int64 CPU \(cuda_emu\) tensor"):
        ops._gcla_summary_fwd(o_self, lse_self, q, kc, kc, gate, torch.tensor([4], dtype=torch.int32), 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conversions_round_like_the_device(dtype):
    """A merged pair is from_float((a + c) · ½), the float32 mean being exact here: the
    emulated kernel's bf16/fp16 round-to-nearest-even must equal torch's rounding of the
    same value bit for bit (means that need rounding, ties included)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(4096, generator=g).to(dtype)
    step = torch.randint(-3, 4, (4096,), generator=g) * 2.0 ** -9
    c = (a.float() * (1 + step)).to(dtype)                  # same sign as a: d = 1 tokens with s = 1 (or 0)
    x = torch.stack([a, c], 1).reshape(1, 8192, 1)          # tokens a_0, c_0, a_1, c_1, ...
    with wk.use_backend("cuda_emu"):
        merged, _, mlen, _ = wk.atm_merge(x, torch.arange(8192), -1.0)
    assert int(mlen) == 4096                                # s > τ = −1 on every even edge: all pairs merge
    want = ((a.float() + c.float()) * 0.5).to(dtype)
    assert torch.equal(merged[0, :4096, 0].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("var, value, match", [
    ("WIOLA_EMU_SCHEDULE", "sideways", "schedule must be forward, reverse or shuffle:<decimal seed>, got 'sideways'"),
    ("WIOLA_EMU_FTZ", "yes", "WIOLA_EMU_FTZ must be 0 or 1, got 'yes'"),
])
def test_emulator_settings_are_checked(var, value, match, monkeypatch):
    """The emulator's modes come from the environment at every launch; a bad value is an error."""
    monkeypatch.setenv(var, value)
    x = torch.ones(1, 4, 8)
    with pytest.raises((RuntimeError, ValueError), match=match):
        torch.ops.wiola_cuda_emu.atm_unmerge(x, torch.arange(4).view(1, 4))


def test_flush_to_zero_like_the_device(monkeypatch):
    """The GPU build flushes float32 subnormals (--use_fast_math: -ftz=true), and so does the
    emulator by default: a merged pair of subnormal tokens is 0 there and its exact mean with
    WIOLA_EMU_FTZ=0. The merge decisions are the reference's either way (the kernels decide
    from exact values, atm.cu: exact_double)."""
    g = torch.Generator().manual_seed(3)
    scale = torch.tensor([2.0 ** -140, 2.0 ** -140, 1.0, 1.0, 2.0 ** -133, 2.0 ** -133])
    direction = torch.randn(6, 16, generator=g, dtype=torch.float64)
    direction[1] = 3 * direction[0]                 # tokens 0, 1: subnormal and parallel: they merge
    direction[5] = -direction[4]                    # tokens 4, 5: subnormal and antiparallel: they do not
    x = (direction * scale[:, None]).float().view(1, 6, 16)
    assert (x[0, 0] != 0).all() and (x[0, 0].abs() < torch.finfo(torch.float32).tiny).all()
    pos = torch.arange(6).view(1, 6)
    with wk.use_backend("reference"):
        _, _, want_len, want_map = wk.atm_merge(x, pos, 0.5)
    exact_mean = ((x[0, 0].double() + x[0, 1].double()) / 2).float()
    assert (exact_mean != 0).all()
    results = {}
    for ftz in ("0", "1"):
        monkeypatch.setenv("WIOLA_EMU_FTZ", ftz)
        with wk.use_backend("cuda_emu"):
            merged, _, mlen, imap = wk.atm_merge(x, pos, 0.5)
        assert torch.equal(imap, want_map) and torch.equal(mlen, want_len), f"FTZ={ftz}: decisions"
        assert int(imap[0, 1]) == 0, "tokens 0 and 1 merge"
        results[ftz] = merged[0, 0]
    assert torch.equal(results["0"], exact_mean)
    assert torch.equal(results["1"], torch.zeros(16))


def test_plant_sites_are_in_the_kernels(tmp_path):
    """Each planted bug's site occurs once in the shipped kernel it is planted in (the copies
    the emulator's ctest wiola_cuda_emu_detects_<plant> and scripts/planted_gpu.sh run), so a
    kernel edit cannot silently un-plant one."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = root / "csrc" / "tests" / "planted_bugs.py"
    subprocess.run([sys.executable, str(script), "--write", str(tmp_path)], check=True, timeout=60)
    names = subprocess.run([sys.executable, str(script), "--list"], capture_output=True, text=True, check=True,
                           timeout=60).stdout.splitlines()
    text = "".join(p.read_text() for p in sorted(tmp_path.glob("*_planted.cu")))
    for line in names:
        flag = line.split("\t")[2]
        assert text.count(f"WIOLA_PLANT({flag})") >= 1, line
