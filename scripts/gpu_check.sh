#!/usr/bin/env bash
# One call on a lent GPU (an H200 with its own image: Python 3.12, torch 2.11 + CUDA 13.0,
# triton 3.6, transformers 5.17, nvcc 13.0, compute-sanitizer), sized to the time a GPU is
# lent: the extension built on all cores while the Triton kernels compile in parallel, the
# GPU tests (all of them, failures summarised), the four compute-sanitizer tools, the CUDA
# kernels against their CPU emulation, the self-check and each op's kernels by device time
# (scripts/gpu_kernel_profile.py); a short table last. Logs and JSON go to
# $OUT (default /tmp/wiola-gpu-check). The benchmarks (device time, host time per call, the
# Hugging Face and wiola steps) are scripts/gpu_perf.sh, the next command on the same machine.
#
#   bash scripts/gpu_check.sh            on the GPU machine (≤ 330 s wall, every step capped)
#   bash scripts/gpu_check.sh --dry-run  here, no GPU: the plan and its timeouts, imports under
#                                        the GPU image's package versions (scripts/device_env.sh),
#                                        and every file, test selection and command it calls
#   bash scripts/gpu_check.sh --plan     the plan as tab-separated rows (tests/test_gpu_check.py)
# The steps run under scripts/lib/run_plan.sh (shared with gpu_perf.sh; tests/test_gpu_runner.py).
#
# If the GPU image lacks pytest, pytest-benchmark, hypothesis or ninja, `bash
# scripts/device_env.sh --pkgs` makes .device-pkgs/ (Python 3.12 wheels, ~25 MB): carry it
# with the run (carry=[".device-pkgs"]); it is used only for what the image lacks.
#
# Sanitizers: each tool runs the small all-op GPU tests (`-k sanitizer`, tests/test_all_ops.py:
# every CUDA kernel, forward and backward) without PyTorch's caching allocator and must report
# nothing; scripts/planted_gpu.sh runs the planted-bug copies of the CUDA kernels
# (csrc/tests/planted_bugs.py: an overrun and a misaligned vector access for memcheck, two
# missing barriers for racecheck, a barrier in divergent code for synccheck, a read of a
# never-written partial for initcheck) under the tool that must catch each one, and the
# unplanted copies under every tool.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=0 PLAN_ONLY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  --plan) PLAN_ONLY=1 ;;
  *) echo "usage: bash scripts/gpu_check.sh [--dry-run | --plan]" >&2; exit 2 ;;
esac

# The plan: name|timeout in seconds|what. tests/test_gpu_check.py reads this table: the
# timeouts add up to at most 540 s and BUDGET is at most 480 s; with scripts/gpu_perf.sh's
# BUDGET (the benchmarks: bench, overhead and the HF step moved there) and two machine starts
# it fits the 15 minutes of GPU time a session is lent (tests/test_gpu_perf.py).
BUDGET=330           # seconds of wall time for the whole run; no step starts past it
BUDGET=${GPU_CHECK_BUDGET:-$BUDGET}  # smaller in tests/test_gpu_check.py
SUMMARY_RESERVE=10   # kept back for the summary
PLAN=(
  "environment|25|GPU, driver, compilers and package versions"
  "build|90|build the extension (sm_\${WIOLA_CUDA_ARCH}) on all cores; Triton kernels compiled in parallel"
  "gpu-tests|110|GPU tests (pytest -m gpu, no -x; 4 processes where pytest-xdist is installed)"
  "sanitizers|50|compute-sanitizer memcheck, racecheck, synccheck, initcheck; planted bugs caught"
  "cuda-vs-emu|20|CUDA kernels on the GPU vs the same kernels in the CPU emulator"
  "check|25|self-check: every backend vs the float64 oracle"
  "kernels|40|where each op's GPU time goes: its kernels by device time, fused and eager (bf16)"
  "summary|10|summary table"
)

source scripts/lib/run_plan.sh
if [ "$PLAN_ONLY" = 1 ]; then print_plan; exit 0; fi

export PYTHONUNBUFFERED=1 ROOT DRY
export NPROC=${NPROC:-$(nproc)}
export WIOLA_CUDA_ARCH=${WIOLA_CUDA_ARCH:-90}  # the H200's; setup.py embeds its PTX too
export PY=${PYTHON:-python3}
export OUT=${OUT:-/tmp/wiola-gpu-check}
mkdir -p "$OUT"
export SAN_TOOLS="memcheck racecheck synccheck initcheck"

# Python path: this tree first. Dry run: the GPU image's triton/transformers versions.
PYPATH="$ROOT:$ROOT/python"
if [ "$DRY" = 1 ] && [ "${WIOLA_DEVICE_ENV:-1}" != 0 ]; then
  if dev=$(PYTHON=$PY bash scripts/device_env.sh 2>"$OUT/device_env.log" | tail -1) && [ -d "$dev" ]; then
    PYPATH="$dev:$PYPATH"
  else
    echo "note: scripts/device_env.sh failed (see $OUT/device_env.log); the dry run uses the installed versions"
  fi
fi
export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"
# What the GPU image may lack, from .device-pkgs/ (appended: the image's own versions win).
missing=$($PY -c "
import importlib.util as u
print(' '.join(m for m in ('pytest', 'pytest_benchmark', 'hypothesis') if u.find_spec(m) is None))" 2>/dev/null)
if [ -n "$missing" ] && [ -d .device-pkgs ]; then
  export PYTHONPATH="$PYTHONPATH:$ROOT/.device-pkgs"
  echo "note: $missing from .device-pkgs/ (not in this image)"
fi
if ! command -v ninja >/dev/null && [ -x .device-pkgs/bin/ninja ]; then
  export PATH="$PATH:$ROOT/.device-pkgs/bin"
  echo "note: ninja from .device-pkgs/bin (not in this image)"
fi

have() { command -v "$1" >/dev/null 2>&1; }
pytest_count() {  # ARGS...: the number of tests pytest would run (collection only)
  $PY -m pytest --collect-only -q -p no:cacheprovider "$@" 2>/dev/null \
    | sed -n 's/^\([0-9][0-9]*\)\/*[0-9]* tests* collected.*/\1/p; s/^\([0-9][0-9]*\) tests* collected.*/\1/p' | tail -1
}
gpu_test_ids() {  # the node ids of every GPU test (pytest -m gpu tests), collected once into $OUT
  [ -s "$OUT/gpu-tests.ids" ] || $PY -m pytest --collect-only -q -p no:cacheprovider -m gpu tests 2>/dev/null \
    | grep "::" > "$OUT/gpu-tests.ids"
  cat "$OUT/gpu-tests.ids"
}
export -f have pytest_count gpu_test_ids

# ------------------------------------------------------------------------------ steps
# Each step is a function run by `timeout` in its own bash; exit 0 = PASS, 77 = SKIPPED
# (nothing to do here), anything else = FAIL. With DRY=1 it checks only what needs no GPU.

step_environment() {
  if have nvidia-smi; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
  else
    echo "nvidia-smi: not here (GPU machine only)"
  fi
  for tool in nvcc compute-sanitizer cuobjdump ninja; do
    if have "$tool"; then
      echo "$tool: $("$tool" --version 2>&1 | grep -m1 -E -i "release|version|^[0-9]")"
    else
      echo "$tool: not found$([ "$DRY" = 1 ] && echo ' here')"
    fi
  done
  # The extension is built in the next step: import the packages without it (no warning).
  WIOLA_DISABLE_EXTENSION=1 $PY - <<'EOF'
import importlib, platform, sys
print(f"python {platform.python_version()}")
for name in ("torch", "triton", "transformers", "numpy", "pytest", "hypothesis", "matplotlib"):
    try:
        mod = importlib.import_module(name)
        extra = f" (CUDA {mod.version.cuda})" if name == "torch" else ""
        print(f"{name} {mod.__version__}{extra}  {mod.__file__.rsplit('/', 2)[0]}")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
import wiola_kernels, wiola  # the package and the model, under these versions
print(f"import wiola_kernels, wiola: ok, the extension not loaded ({wiola_kernels.__file__.rsplit('/', 2)[0]})")
EOF
  [ $? -eq 0 ] || return 1
  local py312="" candidate
  for candidate in python3.12 "${PYENV_ROOT:-$(pyenv root 2>/dev/null || echo /nonexistent)}"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
      py312=$candidate; break
    fi
  done
  if [ "$DRY" = 1 ] && [ -n "$py312" ]; then
    # The GPU image's Python: every file byte-compiles there, warnings (3.12 made invalid
    # escapes a SyntaxWarning) as errors; no torch needed for that.
    PYTHONPYCACHEPREFIX=$(mktemp -d) "$py312" -W error -c "
import compileall, sys
ok = all(compileall.compile_dir(d, quiet=1, force=True) for d in ('wiola_kernels', 'python/wiola', 'scripts', 'tests'))
ok = compileall.compile_file('setup.py', quiet=1, force=True) and ok
print(f'python {sys.version.split()[0]}: every file compiles' if ok else 'python 3.12: compile FAILED')
sys.exit(0 if ok else 1)" || return 1
  elif [ "$DRY" = 1 ]; then
    echo "python 3.12: not here (the byte-compile check is skipped)"
  fi
}

step_build() {
  if [ "$DRY" = 1 ]; then
    $PY - <<'EOF' || return 1
import importlib.util, os
spec = importlib.util.spec_from_file_location("wiola_setup", "setup.py")
setup = importlib.util.module_from_spec(spec); spec.loader.exec_module(setup)
print("setup.py -gencode flags:", " ".join(setup.cuda_nvcc_arch_flags(os.environ)))
EOF
    WIOLA_DISABLE_EXTENSION=1 $PY scripts/triton_warmup.py --dry-run || return 1
    return 0
  fi
  # The Triton kernels compile on every core while ninja builds; the build wins ties for
  # cores only by being first. The warm-up process never loads the extension being written.
  WIOLA_DISABLE_EXTENSION=1 $PY scripts/triton_warmup.py --jobs "$NPROC" --json "$OUT/triton_warmup.json" \
    > "$OUT/triton_warmup.log" 2>&1 &
  local warm=$!
  MAX_JOBS=$NPROC $PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; echo "BUILD FAILED (log: $OUT/build.log)"; }
  wait $warm || echo "warning: the Triton warm-up failed (kernels compile on first use instead)"
  grep -E "kernel variants|compiled|FAILED" "$OUT/triton_warmup.log" | head -8
  # A toolchain that links libstdc++ statically gives the extension a private copy that
  # clashes with torch's (setup.py shared_libstdcxx_link_args): an error message crashed.
  local so
  for so in wiola_kernels/_C*.so; do
    if [ -f "$so" ] && nm -C --defined-only "$so" 2>/dev/null | grep -q "std::codecvt"; then
      echo "BUILD FAILED: $so holds its own copy of libstdc++ (linked statically)"; rc=1
    fi
  done
  $PY -m wiola_kernels backends --device cuda 2>&1 | awk '$2 == "cuda" || $2 == "triton"' | cut -c1-160
  return $rc
}

step_gpu_tests() {
  # Four processes share the GPU: a quarter of the time, and a test that crashes its process
  # is reported as failed instead of ending the run (pytest-xdist restarts the worker).
  local XDIST=()
  $PY -c "import xdist" 2>/dev/null && XDIST=(-n 4)
  if [ "$DRY" = 1 ]; then
    gpu_test_ids > /dev/null || return 1
    local n
    n=$(grep -v -c -i "cuda_emu" "$OUT/gpu-tests.ids")
    echo "GPU tests selected: $n (pytest -m gpu -k 'not cuda_emu' ${XDIST[*]} tests)"
    [ "$n" -gt 0 ]
    return
  fi
  $PY -m pytest -q -p no:cacheprovider -m gpu -k "not cuda_emu" -rfE --tb=short --durations=10 "${XDIST[@]}" \
    --junitxml "$OUT/pytest-gpu.xml" tests > "$OUT/pytest-gpu.log" 2>&1
  local rc=$?
  grep -E "^(FAILED|ERROR) " "$OUT/pytest-gpu.log" | cut -c1-200 | head -40
  tail -1 "$OUT/pytest-gpu.log"
  # Every test skipped (no CUDA device visible, no extension) is not a pass.
  tail -1 "$OUT/pytest-gpu.log" | grep -q -E "[0-9]+ passed" || { echo "no GPU test ran"; rc=1; }
  return $rc
}

sanitize() {  # TOOL: the small all-op GPU tests under one compute-sanitizer tool, into $OUT/sanitizer-TOOL.{log,rc}
  local tool=$1
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
    $PY -m pytest -q -p no:cacheprovider -m gpu -k "sanitizer and not cuda_emu" tests/test_all_ops.py \
    > "$OUT/sanitizer-$tool.log" 2>&1
  echo $? > "$OUT/sanitizer-$tool.rc"
}
export -f sanitize

step_sanitizers() {
  local planted=scripts/planted_gpu.sh  # planted-bug kernel copies, each run under the tool that must catch it
  if [ "$DRY" = 1 ]; then
    local n
    n=$(pytest_count -m gpu -k "sanitizer and not cuda_emu" tests/test_all_ops.py)
    echo "sanitizer runs: ${n:-no} small all-op GPU tests under each of: $SAN_TOOLS"
    if [ -f "$planted" ]; then
      echo "planted bugs: $planted run: $($PY csrc/tests/planted_bugs.py --list 2>/dev/null \
        | awk -F'\t' '{printf "%s%s (%s)", (NR > 1 ? ", " : ""), $1, $2}'), and the unplanted copies under every tool"
    else
      echo "planted bugs: $planted not available in this checkout"
    fi
    have compute-sanitizer || echo "compute-sanitizer: not here (GPU machine only)"
    [ -n "$n" ] && [ "$n" -gt 0 ]
    return
  fi
  have compute-sanitizer || { echo "compute-sanitizer not found"; return 1; }
  # Every tool at once, one process each (the GPU has room), and the planted bugs beside
  # them (nvcc builds on the CPU first): the step takes as long as the slowest.
  local pid_planted=""
  if [ -f "$planted" ]; then
    bash "$planted" run "$OUT/planted_gpu" > "$OUT/planted_gpu.log" 2>&1 &
    pid_planted=$!
  fi
  local pids=() bad=0 rc errors
  for tool in $SAN_TOOLS; do
    sanitize "$tool" &
    pids+=($!)
  done
  wait "${pids[@]}"
  for tool in $SAN_TOOLS; do
    rc=$(cat "$OUT/sanitizer-$tool.rc" 2>/dev/null || echo missing)
    errors=$(grep -o "ERROR SUMMARY: [0-9]* error" "$OUT/sanitizer-$tool.log" | tail -1 | grep -o "[0-9]*")
    if [ "$rc" = 0 ]; then
      echo "$tool: clean ($(tail -1 "$OUT/sanitizer-$tool.log"))"
    else
      bad=1
      echo "$tool: FAILED (exit $rc, ${errors:-?} sanitizer errors; $OUT/sanitizer-$tool.log)"
      grep -m3 -E "^========= (Invalid|Race|Barrier|Uninitialized|Error|Program hit)" "$OUT/sanitizer-$tool.log"
    fi
  done
  if [ -n "$pid_planted" ]; then
    wait "$pid_planted"
    rc=$?
    grep -v -E "^(built|nvcc)" "$OUT/planted_gpu.log" | tail -25
    [ "$rc" = 0 ] || { bad=1; echo "planted bugs: FAILED (exit $rc; $OUT/planted_gpu.log)"; }
  else
    echo "planted bugs: $planted not available in this checkout"
  fi
  return $bad
}

step_cuda_vs_emu() {
  if [ "$DRY" = 1 ]; then
    $PY scripts/gpu_compare_emu.py --dry-run
    return
  fi
  $PY scripts/gpu_compare_emu.py 2>&1 | tee "$OUT/cuda_vs_emu.txt" | grep -v "^PASS"
  return "${PIPESTATUS[0]}"
}

step_check() {
  if [ "$DRY" = 1 ]; then
    $PY -m wiola_kernels check --help > /dev/null && echo "python -m wiola_kernels check --device cuda: ready"
    return
  fi
  $PY -m wiola_kernels check --device cuda 2>&1 | tee "$OUT/check.txt" | grep -v "^PASS"
  return "${PIPESTATUS[0]}"
}

step_kernels() {
  if [ "$DRY" = 1 ]; then
    $PY scripts/gpu_kernel_profile.py --dry-run > "$OUT/kernels.txt" 2>&1 || { grep FAILED "$OUT/kernels.txt"; return 1; }
    echo "python scripts/gpu_kernel_profile.py: ready ($(grep -c ': ready$' "$OUT/kernels.txt") fused and eager cases build)"
    return
  fi
  $PY scripts/gpu_kernel_profile.py > "$OUT/kernels.txt" 2> "$OUT/kernels.log"
  local rc=$?
  # The screen gets each variant's three costliest kernels; $OUT/kernels.txt has the tables.
  awk '/ fwd\+bwd, (fused|eager): / {print; n = 0; next} /^-+/ {dash++; next} dash % 3 == 2 && n < 3 && NF {print "   " substr($0, 1, 150); n++}' \
    "$OUT/kernels.txt" | head -80
  [ $rc -eq 0 ] || tail -5 "$OUT/kernels.log"
  return $rc
}

step_summary() {
  $PY scripts/gpu_check_summary.py "$OUT" $([ "$DRY" = 1 ] && echo --dry-run)
}
export -f step_environment step_build step_gpu_tests step_sanitizers step_cuda_vs_emu step_check \
  step_kernels step_summary

# ------------------------------------------------------------------------------ runner

rm -f "$OUT/gpu-tests.ids"
run_plan gpu_check "$OUT/gpu_check_steps.tsv" 1
