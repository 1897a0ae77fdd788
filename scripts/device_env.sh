#!/usr/bin/env bash
# The lent GPU machine's package versions, beside the pinned ones, without a second torch.
# That machine runs its own image (Python 3.12, torch 2.11 + CUDA 13.0, triton 3.6,
# transformers 5.17) and cannot install anything, so what it runs is checked here first:
#
#   bash scripts/device_env.sh           # triton==3.6.0, transformers==5.17.0 (and a
#                                        # huggingface_hub and kernels it accepts) into .venv-device/;
#                                        # put that first on PYTHONPATH (prints the path)
#   bash scripts/device_env.sh --pkgs    # .device-pkgs/: pytest, pytest-benchmark, hypothesis
#                                        # and ninja for Python 3.12, for a GPU image that has
#                                        # none (gpu_check.sh uses them only where missing;
#                                        # pass carry=[".device-pkgs"] to the run)
#
# Both are idempotent (a stamp file records what was installed) and take seconds from the
# local package store. CI (.ci/run) uses the first for its device-versions leg.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TRITON_VERSION=3.6.0
TRANSFORMERS_VERSION=5.17.0
HUB_SPEC='huggingface_hub>=1.5,<2'  # what transformers 5.17 accepts
KERNELS_VERSION=0.16.2               # Hugging Face's kernels switch: transformers 5.17 accepts 0.16.x

pip_target() {  # DIR ARGS...: pip install --target DIR ARGS (the store's "ignored" notes dropped)
  local dir=$1; shift
  "$PYTHON" -m pip install -q --disable-pip-version-check --target "$dir" "$@" 2>&1 \
    | grep -v -e "is ignored: it is neither a file nor a directory" -e "already exists. Specify --upgrade" -e "Running pip as the .root. user" >&2 || true
}

fresh() {  # DIR STAMP: true (and DIR emptied) unless DIR/.stamp already says STAMP
  if [ -f "$1/.stamp" ] && [ "$(cat "$1/.stamp")" = "$2" ]; then
    return 1
  fi
  rm -rf "$1"
}

case "${1:-}" in
  ""|--path)
    dir=$PWD/.venv-device
    stamp="triton==$TRITON_VERSION transformers==$TRANSFORMERS_VERSION $HUB_SPEC kernels==$KERNELS_VERSION"
    if [ "${1:-}" != "--path" ] && fresh "$dir" "$stamp"; then
      # --no-deps: torch, numpy, tokenizers, safetensors... stay the pinned environment's.
      pip_target "$dir" --no-deps "triton==$TRITON_VERSION" "transformers==$TRANSFORMERS_VERSION" \
        "kernels==$KERNELS_VERSION" "kernels-data==$KERNELS_VERSION"
      # transformers 5.17 refuses huggingface_hub 2.x: a 1.x, with what it needs.
      pip_target "$dir" "$HUB_SPEC"
      "$PYTHON" -c "import sys; sys.path.insert(0, '$dir'); import triton, transformers, huggingface_hub, kernels" \
        && echo "$stamp" > "$dir/.stamp"
    fi
    echo "$dir"
    ;;
  --pkgs)
    dir=$PWD/.device-pkgs
    stamp="py3.12 pytest pytest-benchmark hypothesis ninja"
    if fresh "$dir" "$stamp"; then
      pip_target "$dir" --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
        --platform manylinux2014_x86_64 pytest pytest-benchmark hypothesis ninja
      echo "$stamp" > "$dir/.stamp"
    fi
    du -sh "$dir" | cut -f1 | sed "s|^|$dir: |"
    ;;
  *)
    echo "usage: bash scripts/device_env.sh [--path | --pkgs]" >&2
    exit 2
    ;;
esac
