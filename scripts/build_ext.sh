#!/usr/bin/env bash
# Rebuild the C++/CUDA extension in place (incremental, ninja), one build at a time:
# several shells may share this checkout, and two builds in one build/ folder collide.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/wiola-build.lock python setup.py -q build_ext --inplace "$@"
