#!/usr/bin/env bash
# One call on a lent GPU (an H200 here), under 8 minutes: build the extension with its
# CUDA kernels, run the GPU tests, run the CUDA tests under compute-sanitizer, compare the
# CUDA kernels with their CPU emulation (backend cuda_emu) on the same inputs, check GPU
# determinism, benchmark every op, and print a short table last.
#   bash scripts/gpu_check.sh            (results also land in $OUT when it is set)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} WIOLA_CUDA_ARCH=${WIOLA_CUDA_ARCH:-90}
export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/wiola-gpu-check}; mkdir -p "$OUT"
status=0
step() { echo; echo "=== $1 ($(date +%T))"; }

step "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

step "build (CUDA kernels for sm_$WIOLA_CUDA_ARCH)"
if ! timeout 240 $PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
$PY -m wiola_kernels backends --device cuda

step "GPU tests"
# GPU tests live in each op's tests/test_<op>.py (and the all-ops runs in tests/test_all_ops.py),
# marked gpu. Their cuda_emu variants run in CI; here the next steps compare the two.
timeout 180 $PY -m pytest -q -x -p no:cacheprovider -m gpu -k "not cuda_emu" tests 2>&1 | tee "$OUT/pytest.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "compute-sanitizer memcheck on the CUDA kernels (small shapes)"
if command -v compute-sanitizer >/dev/null; then
  WIOLA_SANITIZER_RUN=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY -m pytest -q -x -p no:cacheprovider -m gpu -k "sanitizer and not cuda_emu" tests/test_all_ops.py 2>&1 | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

step "cuda vs cuda_emu (the same kernels on the GPU and in the CPU emulator, same inputs)"
timeout 150 $PY - <<'PY' || status=1
import torch
import wiola_kernels as wk
from wiola_kernels.testing import rel_err, tolerance

fails = 0
def compare(what, got, emu, tol):
    global fails
    err = rel_err(got.detach().cpu().double(), emu.detach().double())
    ok = err <= tol and torch.isfinite(got).all().item() == torch.isfinite(emu).all().item()
    fails += not ok
    print(f"{'PASS' if ok else 'FAIL'}  {what:<48} rel err {err:.2e} (tolerance {tol:.0e})")

def run(backend, device, fn, inputs, grad):
    leaves = [t.detach().to(device).requires_grad_(t.is_floating_point()) for t in inputs]
    with wk.use_backend(backend):
        out = fn(*leaves)
        grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad.to(device))
    return out, grads

g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for dh, S, L in ((64, 1, 2), (128, 100, 2)):  # L = 1 would make grad q, kc exactly 0
        B, H, Hkv, T = 2, 4, 2, 100
        r = lambda *s: torch.randn(*s, generator=g).to(dtype)
        ins = [r(B, H, T, dh), r(B, Hkv, T, dh), r(B, Hkv, T, dh), r(B, H, T, dh), r(B, H, S, L, dh),
               r(B, H, S, L, dh), torch.randn(H, generator=g)]
        lengths = torch.tensor([T, 61])
        grad = r(B, H, T, dh)
        fn = lambda *a, dev: wk.gcla_attention(*a, lengths=lengths.to(dev))
        o1, g1 = run("cuda", "cuda", lambda *a: fn(*a, dev="cuda"), ins, grad)
        o2, g2 = run("cuda_emu", "cpu", lambda *a: fn(*a, dev="cpu"), ins, grad)
        tol = tolerance(dtype, "attention")
        compare(f"gcla {dtype} dh={dh} S={S} out", o1, o2, tol)
        for name, a, b in zip(("q_rot", "k_rot", "v", "q", "kc", "vc", "gate"), g1, g2):
            compare(f"gcla {dtype} dh={dh} S={S} grad {name}", a, b, tol)
    x = torch.randn(3, 1100, 96, generator=g)
    x[:, 1::3] = x[:, ::3][:, :x[:, 1::3].shape[1]] * 1.01 + 0.02 * torch.randn(3, 367, 96, generator=g)
    x = x.to(dtype)
    pos, lens = torch.arange(1100).expand(3, 1100), torch.tensor([1100, 700, 0])
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
    for name, i in (("merged", 0), ("restored", 4), ("grad x", 5)):
        compare(f"atm {dtype} {name}", c[i], e[i], tolerance(dtype))
print("cuda and cuda_emu agree" if fails == 0 else f"{fails} comparison(s) failed")
raise SystemExit(1 if fails else 0)
PY

step "self-check (every backend vs reference)"
timeout 60 $PY -m wiola_kernels check --device cuda || status=1

step "benchmarks"
timeout 150 $PY -m wiola_kernels bench --device cuda --repeats 20 --json "$OUT/bench.json" \
  --plot "$OUT/bench.png" 2>/dev/null | tee "$OUT/bench.txt" | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "Hugging Face Llama training step, bf16: patch_hf vs unpatched"
timeout 90 $PY -m wiola_kernels bench --hf llama --device cuda --json "$OUT/bench_hf.json" 2>/dev/null | tail -5; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "summary"
sed -n '/^GCLA attention vs SDPA-flash/,$p' "$OUT/bench.txt"
$PY - "$OUT/bench.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except Exception as exc:
    print("no benchmark records:", exc); sys.exit(0)
print(f"{'op':<16}{'pass':<9}{'backend':<9}{'ms':>9}{'x eager':>9}{'x compile':>10}{'GB/s':>8}{'%copy':>7}")
for r in rows:
    sc = r['speedup_vs_compile']
    print(f"{r['op']:<16}{r['pass']:<9}{r['backend']:<9}{r['ms']:>9.3f}{r['speedup_vs_eager']:>9.2f}"
          f"{(sc if sc else 0):>10.2f}{r['gbps']:>8.0f}{r['pct_of_copy']:>6.0f}%")
PY
echo "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
