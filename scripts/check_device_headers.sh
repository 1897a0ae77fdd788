#!/usr/bin/env bash
# The extension's C++ sources compiled (syntax only) against the GPU image's torch headers
# (torch 2.11 there, 2.13 here) with setup.py's flags and its CUDA build's defines, and
# the .cu files with nvcc as that torch's BuildExtension would (its COMMON_NVCC_FLAGS and
# C++ standard, setup.py's nvcc flags): the build is the first step of
# scripts/gpu_check.sh on a lent GPU, and a C++ API that changed between the two torches
# would fail it there. The headers come from the torch wheel on the package index
# (downloaded once, ~0.5 GB; only torch/include and cpp_extension.py are kept, in
# .venv-device-torch/).
#
#   bash scripts/check_device_headers.sh          # every csrc/**/*.cpp, one line each
#   WIOLA_DEVICE_TORCH=2.12.0 bash scripts/check_device_headers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
VERSION=${WIOLA_DEVICE_TORCH:-2.11.0}
dir=$PWD/.venv-device-torch/$VERSION
if [ ! -d "$dir/torch/include" ] || [ ! -f "$dir/torch/utils/cpp_extension.py" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$tmp" "torch==$VERSION" 2>&1 | grep -v "is ignored" >&2 || true
  mkdir -p "$dir"
  unzip -q -o "$tmp"/torch-*.whl 'torch/include/*' 'torch/version.py' 'torch/utils/cpp_extension.py' -d "$dir"
fi
cuda_include=""
if [ -n "${CUDA_HOME:-}" ] && [ -f "$CUDA_HOME/include/cuda_runtime.h" ]; then
  cuda_include=$CUDA_HOME/include
elif command -v nvcc >/dev/null; then  # where nvcc itself looks (it may be a wrapper script)
  cuda_include=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/.*INCLUDES="-I\([^" ]*\).*/\1/p' | head -1)
fi
py_include=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
# setup.py's C++ flags for this machine (its function, not a copy of its rules).
read -r -a cxx <<< "$("$PYTHON" -c "
import importlib.util
spec = importlib.util.spec_from_file_location('s', 'setup.py'); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m); print(' '.join(['-std=c++20', '-fopenmp', *m._cpu_arch_flags()]))")"
flags=("${cxx[@]}" -fsyntax-only -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C
       -Icsrc/include -I"$dir/torch/include" -I"$dir/torch/include/torch/csrc/api/include" -I"$py_include")
if [ -n "$cuda_include" ]; then
  flags+=(-DWIOLA_WITH_CUDA -I"$cuda_include")  # as the GPU build compiles every file
fi
echo "torch $(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$dir/torch/version.py") headers, $(c++ --version | head -1)"
logs=$(mktemp -d)
# The torch headers the kernels include (csrc/include/wiola/torch_headers.h, as setup.py does),
# parsed once into a GCC precompiled header that every source is given first (-include): a
# source's check then takes ~3 s instead of ~11. GCC ignores a PCH built with other flags and
# parses the headers itself (slower, same verdict).
cp csrc/include/wiola/torch_headers.h "$logs/torch_headers.h"
pch_flags=()
for f in "${flags[@]}"; do [ "$f" = -fsyntax-only ] || pch_flags+=("$f"); done
t_pch=$SECONDS
if c++ "${pch_flags[@]}" -x c++-header "$logs/torch_headers.h" -o "$logs/torch_headers.h.gch" 2> "$logs/pch.log"; then
  flags+=(-include "$logs/torch_headers.h")
else
  echo "(no precompiled header: $(grep -m1 error: "$logs/pch.log"))"
fi
sources=(csrc/*.cpp csrc/cpu/*.cpp csrc/cuda/emu/*.cpp)
if [ -n "$cuda_include" ]; then
  # The CUDA build's C++: the kernels' bindings, the Triton launcher (csrc/cuda/triton_*.cpp),
  # and the cubin table's source as setup.py writes it (here the empty one, which a build
  # without Triton links; the generated entries are checked by tests/test_cubin_table.py).
  "$PYTHON" - "$logs/gen" <<'EOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("s", "setup.py"); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m); m.HERE = sys.argv[1]; m.write_cubin_table({"WIOLA_NO_CUBIN_TABLE": "1"})
EOF
  sources+=(csrc/cuda/*.cpp "$logs/gen/build/generated/wiola_cubin_table.cpp")
fi
export logs
t_cxx=$SECONDS
printf '%s\n' "${sources[@]}" | xargs -P "$(nproc)" -I{} sh -c \
  'log="$logs/$(echo {} | tr / _).log"; if c++ "$@" {} > "$log" 2>&1; then echo "OK   {}"; else echo "FAIL {}"; fi' \
  _ "${flags[@]}" | sort -k2 > "$logs/summary"
t_nvcc=$SECONDS
if [ -n "$cuda_include" ]; then
  # nvcc as that torch's BuildExtension runs it: its COMMON_NVCC_FLAGS (read from its
  # cpp_extension.py), the C++ standard it adds when none is named, and setup.py's flags.
  read -r -a nvcc_flags <<< "$("$PYTHON" - "$dir/torch/utils/cpp_extension.py" <<'EOF'
import ast, importlib.util, os, re, sys
src = open(sys.argv[1]).read()
common = ast.literal_eval(re.search(r"^COMMON_NVCC_FLAGS = (\[.*?\])", src, re.S | re.M).group(1))
std = re.search(r"cpp_flag_prefix \+ '(c\+\+\d+)'", src).group(1)  # what torch appends when no -std is given
spec = importlib.util.spec_from_file_location("s", "setup.py"); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
arch = m.cuda_nvcc_arch_flags({"WIOLA_CUDA_ARCH": os.environ.get("WIOLA_CUDA_ARCH", "90")})
print(" ".join([*common, f"-std={std}", "-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr", *arch]))
EOF
)"
  # One nvcc per .cu, all at once (each runs a device and a host compile): the CPU count
  # bounds them better than running them in turn.
  for cu in csrc/cuda/*.cu; do
    (
      name=$(echo "$cu" | tr / _)
      if nvcc "${nvcc_flags[@]}" -DWIOLA_WITH_CUDA -Icsrc/include -I"$dir/torch/include" -c "$cu" \
          -o "$logs/$name.o" > "$logs/$name.log" 2>&1; then
        echo "OK   $cu (nvcc)" > "$logs/$name.result"
      else
        echo "FAIL $cu" > "$logs/$name.result"
      fi
    ) &
  done
  wait
  cat "$logs"/csrc_cuda_*.cu.result >> "$logs/summary"
  sources+=(csrc/cuda/*.cu)
fi
echo "(times: precompiled header and setup $((t_cxx - t_pch)) s, C++ sources $((t_nvcc - t_cxx)) s, nvcc $((SECONDS - t_nvcc)) s)"
rm -f "$logs/torch_headers.h.gch"  # ~0.4 GB
cat "$logs/summary"
if grep -q "^FAIL" "$logs/summary"; then
  for f in $(sed -n 's/^FAIL //p' "$logs/summary"); do
    echo "--- $f"
    grep -m3 -A3 "error:" "$logs/$(echo "$f" | tr / _).log" | cut -c1-240
  done
  echo "check_device_headers: $(grep -c "^FAIL" "$logs/summary") of ${#sources[@]} sources do not compile against torch $VERSION"
  exit 1
fi
echo "check_device_headers: all ${#sources[@]} sources compile against torch $VERSION"
