#!/usr/bin/env bash
# The performance run on a lent GPU (H100 or H200, its own image: Python 3.12, torch 2.11 +
# CUDA 13.0, Triton 3.6, transformers 5.17), sized to one command: the device-time table
# (ours beside eager, Liger-Kernel, Cut Cross-Entropy, SDPA-flash and a same-size device copy,
# at sizes that fill the GPU), host time per call, the Hugging Face Llama step (the small model
# and Llama-3.2-1B; unpatched, patched by patch_hf, patched by Liger; eager, then compiled) and
# the wiola-360m training step beside a same-size Llama. Every row is printed as it completes
# (and its JSON rewritten), so a step cut short by its timeout still leaves what it finished.
# Logs, JSON and a closing table (device, driver, versions, each step) go to $OUT (default
# /tmp/wiola-gpu-perf).
#
#   bash scripts/gpu_perf.sh            on the GPU machine (≤ BUDGET s wall, every step capped)
#   bash scripts/gpu_perf.sh --dry-run  here, no GPU: the plan, imports under the GPU image's
#                                       versions (scripts/device_env.sh), every command's --help/--list
#   bash scripts/gpu_perf.sh --plan     the plan as tab-separated rows (tests/test_gpu_perf.py)
#   (the steps run under scripts/lib/run_plan.sh, shared with gpu_check.sh: tests/test_gpu_runner.py)
#   GPU_PERF_ONLY=hf-1b,wiola-360m bash scripts/gpu_perf.sh   only those steps (and the
#                                       environment and summary): a rerun in what is left of a lease
#
# The peers: `bash scripts/device_env.sh --pkgs` (or --peers) puts the Liger-Kernel and Cut
# Cross-Entropy wheels in .whl/ and installs them into .device-pkgs/peers/; carry
# [".device-pkgs"] (or [".whl"]: they are then installed offline there, into /tmp/wiola-peers).
# Without them the table says "not installed" on their rows and goes on.
#
# With scripts/gpu_check.sh on the same warm machine first, the build step finds the extension
# built and Triton's cache warm (seconds); on a fresh machine it builds.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=0 PLAN_ONLY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  --plan) PLAN_ONLY=1 ;;
  *) echo "usage: bash scripts/gpu_perf.sh [--dry-run | --plan]" >&2; exit 2 ;;
esac

# The plan: name|timeout in seconds|what. tests/test_gpu_perf.py reads it through --plan: the
# timeouts add up to at most 480 s, BUDGET is at most 480 s, and BUDGET with gpu_check.sh's
# BUDGET and two machine starts fits the 15 minutes of GPU time a session is lent.
BUDGET=360           # seconds of wall time for the whole run; no step starts past it
BUDGET=${GPU_PERF_BUDGET:-$BUDGET}
SUMMARY_RESERVE=10   # kept back for the summary
PLAN=(
  "environment|15|GPU, driver, compilers, package and peer versions"
  "build|75|build the extension (sm_\${WIOLA_CUDA_ARCH}) unless built; Triton kernels compiled in parallel"
  "bandwidth|100|device-time table, bf16: ours, eager, Liger, CCE, SDPA-flash, device copy"
  "overhead|35|host time per call (bench --overhead --device cuda)"
  "hf-small|60|HF Llama step d 512: unpatched, patch_hf, Liger; eager, then compiled"
  "hf-1b|75|HF Llama-3.2-1B step, B 4 x T 2048: unpatched, patch_hf, Liger; eager, then compiled"
  "wiola-360m|60|wiola-360m step: fused vs reference, ATM off/on, beside a same-size HF Llama"
  "summary|10|closing table: device, driver, versions, steps, key rows"
)

source scripts/lib/run_plan.sh
if [ "$PLAN_ONLY" = 1 ]; then print_plan; exit 0; fi

export PYTHONUNBUFFERED=1 ROOT DRY
export NPROC=${NPROC:-$(nproc)}
export WIOLA_CUDA_ARCH=${WIOLA_CUDA_ARCH:-90}  # H100 and H200
export PY=${PYTHON:-python3}
export OUT=${OUT:-/tmp/wiola-gpu-perf}
mkdir -p "$OUT"

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
# The peers (Liger-Kernel, Cut Cross-Entropy): carried in .device-pkgs/peers, or as wheels in .whl/.
if [ -f .device-pkgs/peers/.stamp ]; then
  export PYTHONPATH="$PYTHONPATH:$ROOT/.device-pkgs/peers"
  echo "note: Liger-Kernel and Cut Cross-Entropy from .device-pkgs/peers/"
elif ls .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl > /dev/null 2>&1; then
  peers_dir=${TMPDIR:-/tmp}/wiola-peers
  if PYTHON=$PY bash scripts/device_env.sh --install-peers "$peers_dir" > "$OUT/peers_install.log" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$peers_dir"
    echo "note: Liger-Kernel and Cut Cross-Entropy installed from .whl/ into $peers_dir"
  else
    echo "note: the peer wheels in .whl/ did not install ($OUT/peers_install.log): their rows say not installed"
  fi
else
  echo "note: no peer wheels carried (.device-pkgs/peers or .whl/): Liger and CCE rows say not installed"
fi
# What the GPU image may lack, from .device-pkgs/ (appended: the image's own versions win).
if ! command -v ninja >/dev/null && [ -x .device-pkgs/bin/ninja ]; then
  export PATH="$PATH:$ROOT/.device-pkgs/bin"
fi

have() { command -v "$1" >/dev/null 2>&1; }
export -f have

# ------------------------------------------------------------------------------ steps
# Each step is a function run by `timeout` in its own bash; exit 0 = PASS, 77 = SKIPPED,
# anything else = FAIL. With DRY=1 it checks only what needs no GPU.

step_environment() {
  if have nvidia-smi; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm,clocks.max.mem \
      --format=csv,noheader | tee "$OUT/nvidia-smi.csv"
  else
    echo "nvidia-smi: not here (GPU machine only)"
  fi
  WIOLA_DISABLE_EXTENSION=1 $PY - <<'EOF' | tee "$OUT/versions.txt"
import importlib, json, os, platform
out = {"python": platform.python_version()}
for name in ("torch", "triton", "transformers", "liger_kernel", "cut_cross_entropy"):
    try:
        mod = importlib.import_module(name)
        out[name] = getattr(mod, "__version__", None)
        if out[name] is None:
            import importlib.metadata as md
            out[name] = md.version(name.replace("_", "-"))
    except Exception as exc:
        out[name] = f"not installed ({type(exc).__name__})"
import torch
out["cuda"] = torch.version.cuda
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["device"] = p.name
    out["sms"] = p.multi_processor_count
    out["l2_mib"] = round(getattr(p, "L2_cache_size", 0) / 2**20, 1)
    out["memory_gib"] = round(p.total_memory / 2**30, 1)
import wiola_kernels, wiola
out["wiola_kernels"] = wiola_kernels.__file__.rsplit("/", 2)[0]
print(" ".join(f"{k}={v}" for k, v in out.items()))
json.dump(out, open(os.path.join(os.environ["OUT"], "versions.json"), "w"), indent=1)
EOF
  return "${PIPESTATUS[0]}"
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
  WIOLA_DISABLE_EXTENSION=1 $PY scripts/triton_warmup.py --jobs "$NPROC" --json "$OUT/triton_warmup.json" \
    > "$OUT/triton_warmup.log" 2>&1 &
  local warm=$!
  # Incremental: a tree gpu_check.sh built on this machine rebuilds nothing.
  MAX_JOBS=$NPROC $PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { tail -30 "$OUT/build.log"; echo "BUILD FAILED (log: $OUT/build.log)"; }
  wait $warm || echo "warning: the Triton warm-up failed (kernels compile on first use instead)"
  grep -E "kernel variants|compiled|FAILED" "$OUT/triton_warmup.log" | head -4
  $PY -m wiola_kernels backends --device cuda 2>&1 | awk '$2 == "cuda" || $2 == "triton"' | cut -c1-120 | head -20
  return $rc
}

step_bandwidth() {
  local cmd=($PY -m wiola_kernels.bench.gpu_cases)
  if [ "$DRY" = 1 ]; then
    "${cmd[@]}" --list | tee "$OUT/bandwidth.plan"
    return "${PIPESTATUS[0]}"
  fi
  "${cmd[@]}" --json "$OUT/bandwidth.json" 2> "$OUT/bandwidth.log" | tee "$OUT/bandwidth.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || tail -5 "$OUT/bandwidth.log"
  return "$rc"
}

step_overhead() {
  local help profile=()
  help=$($PY -m wiola_kernels bench --help 2>/dev/null)
  if ! grep -q -- "--overhead" <<< "$help"; then
    echo "bench --overhead: not available in this checkout (skipped)"
    return 77
  fi
  # After the table, where one rms_norm call's host time goes (cProfile, fwd and fwd+bwd).
  grep -q -- "--profile" <<< "$help" && profile=(--profile rms_norm)
  if [ "$DRY" = 1 ]; then
    echo "python -m wiola_kernels bench --overhead --device cuda ${profile[*]} --json \$OUT/overhead.json: ready"
    return
  fi
  $PY -m wiola_kernels bench --overhead --device cuda "${profile[@]}" --json "$OUT/overhead.json" \
    2> "$OUT/overhead.log" | tee "$OUT/overhead.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || tail -5 "$OUT/overhead.log"
  return "$rc"
}

hf_run() {  # NAME SIZE VARIANTS [ARGS...]: one bench --hf llama run into $OUT/hf-NAME.{txt,json,log}
  local name=$1 size=$2 variants=$3
  shift 3
  echo "--- bench --hf llama --size $size --variants $variants $*"
  $PY -m wiola_kernels bench --hf llama --device cuda --size "$size" --repeats 5 --variants "$variants" "$@" \
    --json "$OUT/hf-$name.json" 2> "$OUT/hf-$name.log" | tee "$OUT/hf-$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || tail -5 "$OUT/hf-$name.log"
  return "$rc"
}
export -f hf_run

hf_dry() {  # SIZE: the command parses and the case builds (config, shapes, parameters on the meta device)
  $PY -m wiola_kernels bench --help | grep -q -- "--size" || return 1
  $PY - "$1" <<'EOF'
import sys, torch, transformers
from wiola_kernels.bench.hf import hf_case
from wiola_kernels.bench import peers
case = hf_case("llama", "cpu", size=sys.argv[1])
with torch.device("meta"):
    n = sum(p.numel() for p in transformers.LlamaForCausalLM(transformers.LlamaConfig(**case.config_kwargs)).parameters())
print(f"bench --hf llama --size {sys.argv[1]}: {case.shape}, {n / 1e6:.1f} M parameters; "
      f"{peers.status('liger').describe()}: ready")
EOF
}
export -f hf_dry

step_hf_small() {
  [ "$DRY" = 1 ] && { hf_dry default; return; }
  local rc=0
  # Eager in rotation (the three see the same load); compiled one at a time, each row as it
  # completes (the compilations take most of the step).
  hf_run small-eager default unpatched_eager,patched_eager,liger_eager || rc=1
  hf_run small-compile default unpatched_eager,unpatched_compile,patched_compile,liger_compile --sequential || rc=1
  return $rc
}

step_hf_1b() {
  [ "$DRY" = 1 ] && { hf_dry 1b; return; }
  # One variant after another, each row as it completes: eager first (the targets), then compiled.
  local rc=0
  hf_run 1b-eager 1b unpatched_eager,patched_eager,liger_eager || rc=1
  hf_run 1b-compile 1b unpatched_eager,unpatched_compile,patched_compile,liger_compile || rc=1
  return $rc
}

step_wiola_360m() {
  if [ "$DRY" = 1 ]; then
    $PY -m wiola bench --device cuda --help > /dev/null || return 1
    $PY -c "
import torch
from wiola.bench.gpu import llama_config_like, llama_parameters, wiola_config
from wiola.modeling_wiola import WiolaForCausalLM
with torch.device('meta'):
    n = sum(p.numel() for p in WiolaForCausalLM(wiola_config()).parameters())
cfg = llama_config_like(wiola_config(), n)
print(f'python -m wiola bench --device cuda: wiola-360m {n / 1e6:.1f} M parameters, '
      f'HF Llama (intermediate {cfg[\"intermediate_size\"]}) {llama_parameters(cfg) / 1e6:.1f} M: ready')"
    return
  fi
  $PY -m wiola bench --device cuda --json "$OUT/wiola-360m.json" 2> "$OUT/wiola-360m.log" | tee "$OUT/wiola-360m.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || tail -5 "$OUT/wiola-360m.log"
  return "$rc"
}

step_summary() {
  $PY scripts/gpu_perf_summary.py "$OUT" $([ "$DRY" = 1 ] && echo --dry-run)
}
export -f step_environment step_build step_bandwidth step_overhead step_hf_small step_hf_1b step_wiola_360m \
  step_summary

# ------------------------------------------------------------------------------ runner

run_plan gpu_perf "$OUT/gpu_perf_steps.tsv" 0 "${GPU_PERF_ONLY:-}"
