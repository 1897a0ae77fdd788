#!/usr/bin/env bash
# The whole test run (what CI runs after scripts/setup.sh):
#   1. CMake: C++ CPU kernels + their unit tests (ctest), and the CUDA compile check
#      for sm_90 with warnings as errors when nvcc is present;
#   2. the same C++ unit tests built with AddressSanitizer (skip: WIOLA_ASAN=0), and the
#      CUDA kernels run by the SIMT emulator under ThreadSanitizer (skip: WIOLA_TSAN=0);
#   3. pytest (two workers): every op and backend available here against the float64 reference,
#      Triton in the CPU interpreter, the model package; the benchmark suite runs
#      once with tiny shapes (timings are never asserted).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
prefix=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build-cmake -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build-cmake -j2
ctest --test-dir build-cmake --output-on-failure
if [ "${WIOLA_ASAN:-1}" != "0" ]; then
  cmake -S . -B build-asan -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DWIOLA_SANITIZE=address >/dev/null
  cmake --build build-asan -j2 --target wiola_cpu_tests
  # libtorch's static registries are never freed: leaks are not what this run looks for.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 ctest --test-dir build-asan -L cpu --output-on-failure
fi
if [ "${WIOLA_TSAN:-1}" != "0" ]; then
  cmake -S . -B build-tsan -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DWIOLA_SANITIZE=thread \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build-tsan -j2 --target wiola_cuda_emu_tests wiola_cuda_emu_nosync
  ctest --test-dir build-tsan -L emu --output-on-failure
fi
# Two test processes (pytest-xdist), one test file each at a time: the suite is mostly
# single-threaded Python (Triton's interpreter, small tensors). WIOLA_TEST_WORKERS=0: one process.
workers=${WIOLA_TEST_WORKERS:-2}
xdist=()
[ "$workers" != 0 ] && python -c "import xdist" 2>/dev/null && xdist=(-n "$workers" --dist loadfile)
python -m pytest "${xdist[@]}" "$@"
