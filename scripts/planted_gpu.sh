#!/usr/bin/env bash
# The planted bugs (csrc/tests/planted_bugs.py) under compute-sanitizer on a GPU: the copies of
# the CUDA kernels with every plant off must run clean under memcheck, racecheck, synccheck and
# initcheck, and each plant must be reported by its tool. torch-free: nvcc builds
# csrc/tests/planted_gpu.cu with the planted copies (sm_${WIOLA_CUDA_ARCH:-90}, one binary).
# scripts/gpu_check.sh runs it beside the sanitizer step; the emulator catches the same
# plants in CI (ctest wiola_cuda_emu_detects_<plant>).
#
#   bash scripts/planted_gpu.sh run   [DIR]   build, then every run (default DIR /tmp/wiola-planted)
#   bash scripts/planted_gpu.sh build [DIR]   build only (needs nvcc, no GPU)
#
# Logs: DIR/<tool>-<mode>.log. Exit 0 when every control is clean and every plant reported.
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
out=${2:-/tmp/wiola-planted}
case "$cmd" in
  run|build) ;;
  *) echo "usage: bash scripts/planted_gpu.sh run|build [DIR]" >&2; exit 2 ;;
esac
PY=${PY:-${PYTHON:-python3}}
arch=${WIOLA_CUDA_ARCH:-90}
arch=${arch%%[;, ]*}  # the first architecture of a list
RUN_TIMEOUT=${PLANTED_RUN_TIMEOUT:-45}  # seconds per sanitizer run (they run in parallel)
mkdir -p "$out/src"

t0=$(date +%s)
$PY csrc/tests/planted_bugs.py --write "$out/src" || exit 1
nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -lineinfo -arch="sm_$arch" \
  -Icsrc/include -Icsrc/cuda -Icsrc/tests -I"$out/src" csrc/tests/planted_gpu.cu -o "$out/planted_gpu" \
  > "$out/nvcc.log" 2>&1 || { tail -30 "$out/nvcc.log"; echo "nvcc FAILED ($out/nvcc.log)"; exit 1; }
echo "built $out/planted_gpu (sm_$arch) in $(( $(date +%s) - t0 )) s"
[ "$cmd" = build ] && exit 0

command -v compute-sanitizer > /dev/null || { echo "compute-sanitizer not found"; exit 1; }
tools="memcheck racecheck synccheck initcheck"
# What each tool's report of a plant starts with (any one line of the log).
declare -A report=(
  [memcheck]="Invalid __global__ (read|write)|[Mm]isaligned"
  [racecheck]="Race reported|[Hh]azard"
  [synccheck]="Barrier error|[Dd]ivergent|Invalid arguments"
  [initcheck]="Uninitialized __global__ memory read"
)

run() {  # TOOL MODE: one sanitizer run into $out/TOOL-MODE.{log,rc}
  local tool=$1 mode=$2
  timeout -k 5 "$RUN_TIMEOUT" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 10 \
    "$out/planted_gpu" "$mode" > "$out/$tool-$mode.log" 2>&1
  echo $? > "$out/$tool-$mode.rc"
}

t1=$(date +%s)
pids=()
for tool in $tools; do run "$tool" none & pids+=($!); done
plants=$($PY csrc/tests/planted_bugs.py --list | cut -f1,2)
while IFS=$'\t' read -r name tool; do run "$tool" "$name" & pids+=($!); done <<< "$plants"
wait "${pids[@]}"

bad=0
printf '%-20s %-10s %-9s %s\n' "copy" "tool" "result" "first report"
for tool in $tools; do
  rc=$(cat "$out/$tool-none.rc")
  if [ "$rc" = 0 ] && grep -q -E "(ERROR|RACECHECK) SUMMARY: 0 " "$out/$tool-none.log"; then
    result=clean
  else
    result="NOT-CLEAN"; bad=1
  fi
  first=$(grep -m1 -E "${report[$tool]}" "$out/$tool-none.log" || grep -m1 -E "SUMMARY" "$out/$tool-none.log")
  printf '%-20s %-10s %-9s %s\n' "unplanted" "$tool" "$result" "$(cut -c1-100 <<< "${first:-(rc $rc)}")"
done
while IFS=$'\t' read -r name tool; do
  rc=$(cat "$out/$tool-$name.rc")
  first=$(grep -m1 -E "${report[$tool]}" "$out/$tool-$name.log" | cut -c1-100)
  if [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$rc" != 137 ] && [ -n "$first" ]; then
    result=caught
  else
    result=MISSED; bad=1
  fi
  printf '%-20s %-10s %-9s %s\n' "$name" "$tool" "$result" "${first:-(rc $rc; $out/$tool-$name.log)}"
done <<< "$plants"
echo "planted bugs: $( [ $bad = 0 ] && echo "every plant caught, the unplanted copies clean" || echo FAILED )" \
     "(runs in $(( $(date +%s) - t1 )) s; logs in $out)"
exit $bad
