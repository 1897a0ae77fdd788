#!/usr/bin/env bash
# The whole test run (what CI runs after scripts/setup.sh):
#   1. CMake: C++ CPU kernels + their unit tests (ctest), and the CUDA compile check
#      for sm_90 with warnings as errors when nvcc is present;
#   2. pytest: every op and backend available here against the float64 reference,
#      Triton in the CPU interpreter, the model package; the benchmark suite runs
#      once with tiny shapes (timings are never asserted).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
prefix=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build-cmake -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build-cmake -j2
ctest --test-dir build-cmake --output-on-failure
python -m pytest "$@"
