#!/usr/bin/env bash
# One call on a lent GPU (an H200 here), under 8 minutes: build the extension with its
# CUDA kernels, run the GPU tests, run the CUDA tests under compute-sanitizer, check
# GPU determinism, benchmark every op, and print a short table last.
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
gpu_tests=$(ls tests/test_*cuda*.py tests/test_gpu*.py 2>/dev/null)
timeout 180 $PY -m pytest -q -x -p no:cacheprovider $gpu_tests 2>&1 | tee "$OUT/pytest.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "compute-sanitizer memcheck on the CUDA kernels (small shapes)"
if command -v compute-sanitizer >/dev/null; then
  WIOLA_SANITIZER_RUN=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY -m pytest -q -x -p no:cacheprovider -k "sanitizer" $gpu_tests 2>&1 | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

step "self-check (every backend vs reference)"
timeout 60 $PY -m wiola_kernels check --device cuda || status=1

step "benchmarks"
timeout 150 $PY -m wiola_kernels bench --device cuda --repeats 20 --json "$OUT/bench.json" \
  --plot "$OUT/bench.png" 2>/dev/null | tee "$OUT/bench.txt" | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

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
