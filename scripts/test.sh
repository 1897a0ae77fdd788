#!/usr/bin/env bash
# The whole test run (what CI runs after scripts/setup.sh):
#   1. CMake: the SIMT emulator's tests (ctest), and the CUDA compile check for sm_90 with
#      warnings as errors when nvcc is present;
#   2. the C++ CPU kernels' unit tests built with AddressSanitizer (WIOLA_ASAN=0: in the plain
#      build instead), and the CUDA kernels run by the SIMT emulator under ThreadSanitizer
#      (skip: WIOLA_TSAN=0);
#   3. pytest (two workers): every op and backend available here against the float64 reference,
#      Triton in the CPU interpreter, the model package; the benchmark suite runs
#      once with tiny shapes (timings are never asserted).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
prefix=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build-cmake -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
# The plain build: the emulator's tests at -O3 and the CUDA compile check. The C++ CPU
# kernels are built at -O3 by setup.py already; their unit tests run under ASan below
# (WIOLA_ASAN=0: here instead).
targets=(wiola_cuda_emu_tests wiola_cuda_emu_planted)
cmake --build build-cmake --target help | grep '^wiola_cuda_check' >/dev/null && targets+=(wiola_cuda_check)
labels=emu
if [ "${WIOLA_ASAN:-1}" = "0" ]; then targets+=(wiola_cpu_tests); labels='emu|cpu'; fi
cmake --build build-cmake -j2 --target "${targets[@]}"
ctest --test-dir build-cmake -L "$labels" --output-on-failure
if [ "${WIOLA_ASAN:-1}" != "0" ]; then
  cmake -S . -B build-asan -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DWIOLA_SANITIZE=address >/dev/null
  cmake --build build-asan -j2 --target wiola_cpu_tests
  # libtorch's static registries are never freed: leaks are not what this run looks for.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 ctest --test-dir build-asan -L cpu --output-on-failure
fi
if [ "${WIOLA_TSAN:-1}" != "0" ]; then
  cmake -S . -B build-tsan -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DWIOLA_SANITIZE=thread \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build-tsan -j2 --target wiola_cuda_emu_tests wiola_cuda_emu_planted
  ctest --test-dir build-tsan -L emu --output-on-failure
fi
# Two test processes (pytest-xdist), one test file each at a time: the suite is mostly
# single-threaded Python (Triton's interpreter, small tensors). WIOLA_TEST_WORKERS=0: one process.
# WIOLA_TEST_AOT=0 leaves out tests/test_triton_aot.py (the AOT compile of every Triton kernel
# with the installed Triton): CI runs it in scripts/test_device_versions.sh with the GPU
# image's Triton instead.
aot=()
[ "${WIOLA_TEST_AOT:-1}" = "0" ] && aot=(--ignore=tests/test_triton_aot.py)
workers=${WIOLA_TEST_WORKERS:-2}
xdist=()
[ "$workers" != 0 ] && python -c "import xdist" 2>/dev/null && xdist=(-n "$workers" --dist loadfile)
python -m pytest "${xdist[@]}" "${aot[@]}" "$@"
