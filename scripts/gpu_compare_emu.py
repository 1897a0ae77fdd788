"""The CUDA kernels on the GPU (backend ``cuda``) against the same kernels in the CPU
emulator (backend ``cuda_emu``), on the same inputs: GCLA's output and every gradient,
ATM's merge decisions (bitwise) and values. One line per comparison; exit status 1 when
any differs beyond the op's tolerance (scripts/gpu_check.sh runs it).

    python scripts/gpu_compare_emu.py            # needs a GPU and the built extension
    python scripts/gpu_compare_emu.py --dry-run  # no GPU: the inputs are built, nothing runs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

import torch  # noqa: E402

import wiola_kernels as wk  # noqa: E402
from wiola_kernels.testing import rel_err, tolerance  # noqa: E402


def _compare(what: str, got: torch.Tensor, emu: torch.Tensor, tol: float) -> bool:
    err = rel_err(got.detach().cpu().double(), emu.detach().double())
    ok = err <= tol and torch.isfinite(got).all().item() == torch.isfinite(emu).all().item()
    print(f"{'PASS' if ok else 'FAIL'}  {what:<48} rel err {err:.2e} (tolerance {tol:.0e})", flush=True)
    return ok


def _run(backend: str, device: str, fn, inputs, grad):
    leaves = [t.detach().to(device).requires_grad_(t.is_floating_point()) for t in inputs]
    with wk.use_backend(backend):
        out = fn(*leaves)
        grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad.to(device))
    return out, grads


def gcla_cases(g: torch.Generator, dtype: torch.dtype):
    """(name, inputs, lengths, output gradient): one head width with paper summaries (S = 1),
    one with causal ones (S = T); L = 1 would make grad q and kc exactly 0."""
    for dh, S, L in ((64, 1, 2), (128, 100, 2)):
        B, H, Hkv, T = 2, 4, 2, 100

        def r(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        ins = [r(B, H, T, dh), r(B, Hkv, T, dh), r(B, Hkv, T, dh), r(B, H, T, dh), r(B, H, S, L, dh),
               r(B, H, S, L, dh), torch.randn(H, generator=g)]
        yield f"gcla {dtype} dh={dh} S={S}", ins, torch.tensor([T, 61]), r(B, H, T, dh)


def atm_input(g: torch.Generator, dtype: torch.dtype):
    """(x, positions, lengths) with planted near-duplicates (every third token), so that
    merges happen, and rows of full, partial and zero length."""
    x = torch.randn(3, 1100, 96, generator=g)
    x[:, 1::3] = x[:, ::3][:, :x[:, 1::3].shape[1]] * 1.01 + 0.02 * torch.randn(3, 367, 96, generator=g)
    return x.to(dtype), torch.arange(1100).expand(3, 1100), torch.tensor([1100, 700, 0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="build the inputs, run nothing (no GPU needed)")
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    fails = 0
    for dtype in (torch.float32, torch.bfloat16):
        for name, ins, lengths, grad in gcla_cases(g, dtype):
            if args.dry_run:
                continue
            o1, g1 = _run("cuda", "cuda", lambda *a: wk.gcla_attention(*a, lengths=lengths.cuda()), ins, grad)
            o2, g2 = _run("cuda_emu", "cpu", lambda *a: wk.gcla_attention(*a, lengths=lengths), ins, grad)
            tol = tolerance(dtype, "attention")
            fails += not _compare(f"{name} out", o1, o2, tol)
            for what, a, b in zip(("q_rot", "k_rot", "v", "q", "kc", "vc", "gate"), g1, g2):
                fails += not _compare(f"{name} grad {what}", a, b, tol)
        x, pos, lens = atm_input(g, dtype)
        if args.dry_run:
            continue
        res = {}
        for backend, dev in (("cuda", "cuda"), ("cuda_emu", "cpu")):
            xl = x.to(dev).requires_grad_()
            with wk.use_backend(backend):
                merged, mpos, mlen, imap = wk.atm_merge(xl, pos.to(dev), 0.9, lens.to(dev))
                restored = wk.atm_unmerge(merged * 2, imap)
                (gx,) = torch.autograd.grad(restored, xl, torch.ones_like(restored))
            res[backend] = [t.detach().cpu() for t in (merged, mpos, mlen, imap, restored, gx)]
        c, e = res["cuda"], res["cuda_emu"]
        same = all(torch.equal(c[i], e[i]) for i in (1, 2, 3))
        fails += not same
        print(f"{'PASS' if same else 'FAIL'}  atm {dtype} decisions (index map, positions, lengths) identical")
        for what, i in (("merged", 0), ("restored", 4), ("grad x", 5)):
            fails += not _compare(f"atm {dtype} {what}", c[i], e[i], tolerance(dtype))
    if args.dry_run:
        print("gpu_compare_emu: inputs built; the comparisons need a GPU")
        return 0
    print("cuda and cuda_emu agree" if fails == 0 else f"{fails} comparison(s) failed")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
