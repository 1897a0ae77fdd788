#!/usr/bin/env bash
# CI leg: what the lent GPU machine will run, checked here with its package versions.
# triton==3.6.0 and transformers==5.17.0 go first on PYTHONPATH (scripts/device_env.sh;
# torch stays the pinned CPU build), then:
#   1. the Triton kernels in Triton 3.6's interpreter (and the emulator's own tests), the
#      Hugging Face patching and the model's transformers glue on transformers 5.17, and the
#      AOT compile of every Triton kernel for sm_90 with Triton 3.6's compiler, read back (no
#      spills, tests/test_triton_aot.py);
#   2. bash scripts/gpu_check.sh --dry-run (the plan, imports, files and test selections) and
#      bash scripts/gpu_perf.sh --dry-run (the plan, every benchmark command's --list/--help, the
#      HF and wiola step configs; Liger/CCE from .device-pkgs/peers when device_env.sh --pkgs made it);
#   3. the C++ sources against the GPU image's torch 2.11 headers (scripts/check_device_headers.sh).
# Each part prints how long it took.
#   bash scripts/test_device_versions.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3 )}
export PYTHON
dev=$(bash scripts/device_env.sh | tail -1)
export PYTHONPATH="$dev:$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "
import triton, transformers
assert triton.__version__ == '3.6.0' and transformers.__version__ == '5.17.0', (triton.__version__, transformers.__version__)
print(f'device versions: triton {triton.__version__}, transformers {transformers.__version__} (torch stays the pinned one)')"

# Two pytest workers where pytest-xdist is installed (scripts/test.sh does the same).
XDIST=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n ${WIOLA_TEST_WORKERS:-2} --dist loadfile" || true)
start=$SECONDS
failed=()
part() {  # NAME COMMAND...: run one part, say how long it took; the leg goes on after a failure
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  echo "device-versions: $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || failed+=("$name")
}

# Triton 3.6 compiles for sm_90 only, in the AOT spill check below, which reads back every
# kernel (spills, shared memory, lint) for the GPUs the image runs on. sm_80 is compiled by the
# main run's cubin table (the pinned Triton, tests/test_cubin_table.py) and by the GPU
# machine's own build (its default archs 90,80): a compile here cost CI ~100 s with cold caches.
# Only what these versions can change: the Triton kernels in Triton 3.6's interpreter, and
# the code that touches transformers (patch_hf, the model's Hugging Face glue, generate). The
# C++ kernels and their CUDA emulation do not import either package: the main run covers
# them (test_cuda_emu.py stays here as a smoke test of the emulator under this environment).
kernels=(tests/test_rms_norm.py tests/test_srpe.py tests/test_gcla_attention.py tests/test_atm.py
         tests/test_add_rms_norm.py tests/test_glu.py tests/test_linear_cross_entropy.py
         tests/test_op_layer.py tests/test_all_ops.py tests/test_triton_interpreter.py)
part "interpreter tests (Triton 3.6)" "$PYTHON" -m pytest -q -p no:cacheprovider $XDIST "${kernels[@]}" \
  tests/test_cuda_emu.py -k "triton or test_cuda_emu" "$@"
# Not here: the slow compile-per-family tests, FSDP2 (torch's sharding, the same on either
# transformers) and the fused step's arithmetic (tests/test_model_fused_step.py: our ops on
# tensors; the model's transformers glue is test_model_hf.py's); the main run has them.
part "patch_hf + model tests (transformers 5.17)" "$PYTHON" -m pytest -q -p no:cacheprovider $XDIST -m "not slow" \
  tests/test_hf*.py --ignore=tests/test_hf_distributed.py tests/test_model.py tests/test_model_hf.py \
  tests/test_model_decode.py tests/test_model_loss.py "$@"
part "AOT spill check (Triton 3.6, sm_90)" env WIOLA_AOT_ARCHS=sm_90 "$PYTHON" -m pytest -q -p no:cacheprovider \
  tests/test_triton_aot.py "$@"
dry() { OUT=$(mktemp -d) WIOLA_DEVICE_ENV=0 bash scripts/gpu_check.sh --dry-run; }
part "gpu_check.sh --dry-run" dry
dry_perf() { OUT=$(mktemp -d) WIOLA_DEVICE_ENV=0 bash scripts/gpu_perf.sh --dry-run; }
part "gpu_perf.sh --dry-run" dry_perf
if [ "${WIOLA_DEVICE_HEADERS:-1}" != 0 ]; then
  part "torch 2.11 headers" bash scripts/check_device_headers.sh
fi
echo "device-versions leg: $((SECONDS - start)) s; $([ ${#failed[@]} -eq 0 ] && echo "all parts passed" || \
  echo "FAILED: ${failed[*]}")"
[ ${#failed[@]} -eq 0 ]
