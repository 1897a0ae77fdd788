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
#                                        # pass carry=[".device-pkgs"] to the run); and the peers
#                                        # below
#   bash scripts/device_env.sh --peers   # the benchmark's peers, Liger-Kernel 0.8.5 and Cut
#                                        # Cross-Entropy 25.1.1 (pure Python + Triton wheels):
#                                        # downloaded into .whl/ (ignored by git), installed
#                                        # --no-deps into .device-pkgs/peers/ (gpu_perf.sh puts
#                                        # that on the path; carry=[".device-pkgs"])
#   bash scripts/device_env.sh --install-peers DIR   # on the GPU machine, offline: the wheels
#                                        # carried in .whl/ installed into DIR (gpu_perf.sh does
#                                        # this when .device-pkgs/peers/ did not come along)
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
PEER_WHEELS=("liger-kernel==0.8.5" "cut-cross-entropy==25.1.1")  # bench/peers.py's pins

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

peers() {  # the peer wheels into .whl/, then installed (no dependencies: torch/triton are the image's) into DIR
  local dir=$1 stamp="${PEER_WHEELS[*]}"
  mkdir -p .whl
  if [ ! -f "$dir/.stamp" ] || [ "$(cat "$dir/.stamp")" != "$stamp" ]; then
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps -d .whl "${PEER_WHEELS[@]}" 2>&1 \
      | grep -v -e "is ignored: it is neither a file nor a directory" >&2 || true
    rm -rf "$dir"
    pip_target "$dir" --no-deps --no-index .whl/liger_kernel-0.8.5-*.whl .whl/cut_cross_entropy-25.1.1-*.whl
    [ -d "$dir/liger_kernel" ] && [ -d "$dir/cut_cross_entropy" ] && echo "$stamp" > "$dir/.stamp"
  fi
  [ -f "$dir/.stamp" ] || { echo "device_env.sh: the peer wheels did not install into $dir" >&2; return 1; }
}

case "${1:-}" in
  --peers)
    peers "$PWD/.device-pkgs/peers"
    ls .whl/*.whl | sed "s|^|wheel: |"
    echo "$PWD/.device-pkgs/peers"
    ;;
  --install-peers)
    # On the GPU machine (no registry): only the carried wheels, nothing downloaded.
    dir=${2:?usage: bash scripts/device_env.sh --install-peers DIR}
    ls .whl/liger_kernel-0.8.5-*.whl .whl/cut_cross_entropy-25.1.1-*.whl > /dev/null || exit 1
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-deps --no-index --target "$dir" \
      .whl/liger_kernel-0.8.5-*.whl .whl/cut_cross_entropy-25.1.1-*.whl
    echo "$dir"
    ;;
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
    peers "$dir/peers"  # its own stamp: kept across the test tools' reinstall only if already there
    du -sh "$dir" | cut -f1 | sed "s|^|$dir: |"
    ;;
  *)
    echo "usage: bash scripts/device_env.sh [--path | --pkgs | --peers | --install-peers DIR]" >&2
    exit 2
    ;;
esac
