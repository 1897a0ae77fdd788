#!/usr/bin/env bash
# Syntax/type-check one C++ source against the installed torch headers, without
# touching the shared build: scripts/check_cpp.sh csrc/cpu/<op>.cpp
set -euo pipefail
cd "$(dirname "$0")/.."
inc=$(python -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-isystem'+p for p in include_paths()))")
pyinc=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
exec g++ -std=c++20 -fsyntax-only -fopenmp -march=x86-64-v3 -DCPU_CAPABILITY=AVX2 -DCPU_CAPABILITY_AVX2 \
  -Wall -Wno-unused-function $inc -I"$pyinc" -Icsrc/include "$@"
