"""Build wiola_kernels and its extension ``wiola_kernels._C``.

C++ CPU kernels are always built; CUDA kernels only when the installed torch has
CUDA and nvcc is found (or WIOLA_FORCE_CUDA=1). The decision comes from the build
environment, never from probing a GPU. Environment knobs:

* ``WIOLA_FORCE_CUDA=1``   build the CUDA kernels even if torch reports no CUDA.
* ``WIOLA_NO_EXTENSION=1`` skip the extension (pure Python: reference + Triton).
* ``WIOLA_CPU_ARCH``       ``-march`` for the CPU kernels (default ``x86-64-v3``,
  i.e. AVX2+FMA, on x86-64; ``native`` for the build machine; ``none`` for no flag).
* ``WIOLA_CUDA_ARCH``      CUDA architectures, e.g. ``90`` or ``90,80`` (default ``90,80``: SASS
  for sm_90 and sm_80, and the newest one's PTX embedded, which the driver JIT-compiles on
  newer GPUs). Unset with ``TORCH_CUDA_ARCH_LIST`` set: torch's own arch selection.
* ``WIOLA_NO_CUDA_EMU=1``  leave out the CUDA kernels' CPU emulation (backend ``cuda_emu``).
* ``WIOLA_NO_CUBIN_TABLE=1`` build the CUDA kernels without the table of ahead-of-time compiled
  Triton kernels (the ops it serves then run their Python Triton launchers, with a warning).
* ``WIOLA_DEBUG_INFO=1``   keep the debug information Python's flags ask for (``-g``); by default
  the C++ is built without it (``-g0``), which compiles it about a fifth faster.
* ``WIOLA_NO_PCH=1``       no precompiled header (see :func:`precompiled_header_command`).

A CUDA build compiles every Triton kernel variant the C++ launchers launch, for each
architecture of ``WIOLA_CUDA_ARCH`` / ``TORCH_CUDA_ARCH_LIST`` (default 90,80), into a
generated source (``build/generated/wiola_cubin_table.cpp``, by
``python -m wiola_kernels.triton.cubin_table``) linked into the extension.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shlex
import subprocess

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "90,80"


def cuda_arch_flags(spec: str) -> list[str]:
    """nvcc ``-gencode`` flags for ``WIOLA_CUDA_ARCH=spec`` (``"90,80"``; ``"9.0;8.0"`` and
    ``"sm_90"`` are read too): SASS for every architecture, plus the PTX of the newest
    (``code=[sm_90,compute_90]``) so that a newer GPU can JIT-compile it."""
    archs = []
    for item in re.split(r"[,;\s]+", spec.strip()):
        if not item:
            continue
        digits = item.lower().removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not re.fullmatch(r"[1-9]\d{1,2}[af]?", digits):
            raise ValueError(f"WIOLA_CUDA_ARCH: {item!r} is not a CUDA architecture; expected a comma-separated "
                             f"list such as '90,80' (sm_90, sm_80), got {spec!r}")
        if digits not in archs:
            archs.append(digits)
    if not archs:
        raise ValueError(f"WIOLA_CUDA_ARCH names no architecture; expected e.g. '90,80', got {spec!r}")
    newest = max(archs, key=lambda a: int(re.match(r"\d+", a).group()))
    return [f"-gencode=arch=compute_{a},code=[sm_{a},compute_{a}]" if a == newest
            else f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def nvcc_cuda_version(nvcc: str) -> str | None:
    """The CUDA release ``nvcc --version`` names (``"13.0"``), or None when it cannot run."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def check_cuda_versions(nvcc_version: str | None, torch_cuda: str | None) -> None:
    """Refuse, before compiling anything, an nvcc whose CUDA major differs from the one
    torch was built with (the extension would not load); unknown versions pass."""
    if not nvcc_version or not torch_cuda:
        return
    if nvcc_version.split(".")[0] != torch_cuda.split(".")[0]:
        raise RuntimeError(
            f"nvcc is CUDA {nvcc_version} but torch was built with CUDA {torch_cuda} (torch.version.cuda): "
            f"their major versions must match. Point CUDA_HOME at a CUDA {torch_cuda.split('.')[0]}.x toolkit "
            f"or install a torch built for CUDA {nvcc_version.split('.')[0]}.x.")


def cuda_nvcc_arch_flags(environ) -> list[str]:
    """The ``-gencode`` flags of the build: ``WIOLA_CUDA_ARCH`` (default ``90,80``), or none
    (torch chooses, from ``TORCH_CUDA_ARCH_LIST``) when only that is set."""
    spec = environ.get("WIOLA_CUDA_ARCH")
    if spec is None and environ.get("TORCH_CUDA_ARCH_LIST"):
        return []
    return cuda_arch_flags(DEFAULT_CUDA_ARCHS if spec is None else spec)


GENERATED_DIR = os.path.join("build", "generated")


def cubin_table_command(out_dir: str, environ) -> list[str]:
    """The command that writes the cubin table to ``out_dir``: every Triton variant for the
    architectures of ``WIOLA_CUDA_ARCH`` (else ``TORCH_CUDA_ARCH_LIST``, else 90,80)."""
    import sys

    spec = environ.get("WIOLA_CUDA_ARCH") or environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCHS
    return [sys.executable, "-m", "wiola_kernels.triton.cubin_table", "--out", out_dir, "--arch", spec]


def write_cubin_table(environ) -> str:
    """Generate the cubin table source for a CUDA build (in a subprocess that imports this
    checkout's wiola_kernels and the installed Triton, not the extension being built); an
    empty table naming the reason when that fails or ``WIOLA_NO_CUBIN_TABLE=1``. Returns the
    source's path relative to the checkout."""
    out_dir = os.path.join(HERE, GENERATED_DIR)
    env = {k: v for k, v in environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([HERE, environ.get("PYTHONPATH", "")]), WIOLA_DISABLE_EXTENSION="1")
    reason = "WIOLA_NO_CUBIN_TABLE=1" if environ.get("WIOLA_NO_CUBIN_TABLE", "0") == "1" else None
    if reason is None:
        done = subprocess.run(cubin_table_command(out_dir, environ), cwd=HERE, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            print(done.stdout.strip())
            return os.path.join(GENERATED_DIR, "wiola_cubin_table.cpp")
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        reason = f"compiling the Triton kernels failed at build time: {last}"
        print(f"wiola-kernels: {reason}; building without the cubin table")
    os.makedirs(out_dir, exist_ok=True)
    escaped = reason.replace("\\", "\\\\").replace('"', '\\"')
    with open(os.path.join(out_dir, "wiola_cubin_table.cpp"), "w") as f:
        f.write('// Generated by setup.py: a build without the cubin table.\n#include "wiola/triton_table.h"\n'
                "namespace wiola::triton {\nconst Table& table() {\n"
                f'  static const Table t{{nullptr, 0, nullptr, "{escaped}", 0}};\n  return t;\n}}\n}}\n')
    return os.path.join(GENERATED_DIR, "wiola_cubin_table.cpp")


def _cpu_arch_flags() -> list[str]:
    arch = os.environ.get("WIOLA_CPU_ARCH", "x86-64-v3" if platform.machine() in ("x86_64", "AMD64") else "none")
    if arch == "none":
        return []
    flags = [f"-march={arch}"]
    if arch in ("x86-64-v3", "x86-64-v4", "native"):
        # at::vec picks its AVX2 specialisations from this macro.
        flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def shared_libstdcxx_link_args(cxx: str) -> list[str]:
    """The shared libstdc++ of compiler ``cxx``, as a link argument ([] when it has none).

    Some toolchains link libstdc++ statically (the GPU image's /opt/gcc does). The extension
    then carries a private copy whose locale facets are numbered differently from those of
    the shared copy torch loads, and a stream made by one and written by the other calls the
    wrong facet: formatting an integer in a TORCH_CHECK message crashed the interpreter.
    Named before the driver's own libraries, the shared library satisfies every reference,
    so nothing is taken from the static archive."""
    try:
        out = subprocess.run([*shlex.split(cxx)[:1], "-print-file-name=libstdc++.so.6"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    if os.path.isabs(out) and os.path.isfile(out):
        return [out]
    loaded = _loaded_libstdcxx()  # the compiler has none: the copy this process (torch) runs with
    return [loaded] if loaded else []


def _loaded_libstdcxx() -> str | None:
    """The path of the libstdc++.so.6 mapped into this process, if any (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {m.group(0) for m in map(re.compile(r"/\S*/libstdc\+\+\.so\.6[.\d]*$").search, maps) if m}
    except OSError:
        return None
    return min(paths) if paths else None


PCH_HEADER = os.path.join("csrc", "include", "wiola", "torch_headers.h")


def precompiled_header_command(cxx: str, cflags: list[str], post_cflags: list[str], header: str) -> list[str]:
    """The compile of ``header`` into ``header + ".gch"`` with exactly the flags of the sources
    that read it (GCC ignores a precompiled header built with other options, with a warning
    from -Winvalid-pch, and parses the header itself: slower, same objects)."""
    return [cxx, *cflags, "-x", "c++-header", header, "-o", header + ".gch", *post_cflags]


def _is_gcc(cxx: str) -> bool:
    try:
        out = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out and "clang" not in out


def _build_extension_class(base):
    """torch's BuildExtension, whose C++ sources first read :data:`PCH_HEADER` precompiled
    (GCC only; WIOLA_NO_PCH=1: never). The header is compiled into the build folder with the
    flags torch's ninja build gives the sources (read from the same compiler object torch reads
    them from), and again only when those flags, torch's version or the header change."""

    class BuildExtensionWithPch(base):
        def build_extension(self, ext):
            compile_sources = self.compiler.compile  # torch's: writes and runs build.ninja

            def compile_with_pch(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                                 extra_preargs=None, extra_postargs=None, depends=None):
                if isinstance(extra_postargs, dict) and any(s.endswith(".cpp") for s in sources):
                    extra_postargs = dict(extra_postargs)
                    extra_postargs["cxx"] = list(extra_postargs["cxx"]) + self._pch_flags(
                        output_dir, macros, include_dirs, debug, extra_preargs, extra_postargs)
                return compile_sources(sources, output_dir, macros, include_dirs, debug, extra_preargs,
                                       extra_postargs, depends)

            self.compiler.compile = compile_with_pch
            try:
                super().build_extension(ext)
            finally:
                self.compiler.compile = compile_sources

        def _pch_flags(self, output_dir, macros, include_dirs, debug, extra_preargs, extra_postargs) -> list[str]:
            import torch
            from torch.utils.cpp_extension import get_cxx_compiler

            cxx = get_cxx_compiler()
            if os.environ.get("WIOLA_NO_PCH", "0") == "1" or not _is_gcc(cxx):
                return []
            try:  # the flags torch's ninja compile gives every source (cpp_extension.unix_wrap_ninja_compile)
                self.compiler.include_dirs[:] = map(os.path.abspath, self.compiler.include_dirs)  # as torch does
                *_, pp_opts, _ = self.compiler._setup_compile(os.path.abspath(output_dir), macros, include_dirs, [],
                                                              depends=None, extra=extra_postargs)
                cflags = [*self.compiler._get_cc_args(pp_opts, debug, extra_preargs), *self.compiler.compiler_so[1:]]
            except Exception as err:  # noqa: BLE001 - another distutils: build without it
                print(f"wiola-kernels: no precompiled header ({type(err).__name__}: {err})")
                return []
            folder = os.path.join(os.path.abspath(output_dir), "wiola_pch")
            header = os.path.join(folder, os.path.basename(PCH_HEADER))
            text = open(os.path.join(HERE, PCH_HEADER)).read()
            command = precompiled_header_command(cxx, cflags, list(extra_postargs["cxx"]), header)
            stamp = "\n".join([torch.__version__, text, shlex.join(command)])
            os.makedirs(folder, exist_ok=True)
            if not os.path.exists(header) or open(header).read() != text:
                with open(header, "w") as f:  # rewritten only when changed: the sources depend on it
                    f.write(text)
            stamp_path = header + ".stamp"
            if not (os.path.exists(header + ".gch") and os.path.exists(stamp_path) and open(stamp_path).read() == stamp):
                print(f"wiola-kernels: precompiling {PCH_HEADER}")
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"wiola-kernels: no precompiled header: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
                    return []
                with open(stamp_path, "w") as f:
                    f.write(stamp)
            return ["-include", header, "-Winvalid-pch"]

    return BuildExtensionWithPch


def _extensions() -> tuple[list, dict]:
    if os.environ.get("WIOLA_NO_EXTENSION", "0") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = [os.path.relpath(p, HERE) for p in ["csrc/python_module.cpp", "csrc/wiola_ops.cpp", *sorted(glob.glob(f"{HERE}/csrc/cpu/*.cpp"))]]
    # C++20 named: torch < 2.13 would add -std=c++17 to a command line that has none.
    cxx = ["-O3", "-std=c++20", "-fopenmp", *_cpu_arch_flags()]
    if os.environ.get("WIOLA_DEBUG_INFO", "0") != "1":
        cxx.append("-g0")  # after Python's -g, which it overrides
    link = ["-fopenmp", *shared_libstdcxx_link_args(os.environ.get("CXX", "c++"))]  # torch's choice of driver
    if os.environ.get("WIOLA_NO_CUDA_EMU", "0") != "1":
        # The CUDA kernels compiled as host C++ for the SIMT emulator (test backend cuda_emu),
        # in every build: on a GPU build too, so that scripts/gpu_check.sh compares the two.
        sources += [os.path.relpath(p, HERE) for p in sorted(glob.glob(f"{HERE}/csrc/cuda/emu/*.cpp"))]
    with_cuda = os.environ.get("WIOLA_FORCE_CUDA", "0") == "1" or (
        torch.version.cuda is not None and CUDA_HOME is not None)
    if with_cuda:
        cuda_sources = sorted(glob.glob(f"{HERE}/csrc/cuda/*.cu")) + sorted(glob.glob(f"{HERE}/csrc/cuda/*.cpp"))
        sources += [os.path.relpath(p, HERE) for p in cuda_sources]
        sources.append(write_cubin_table(os.environ))
        check_cuda_versions(nvcc_cuda_version(os.path.join(CUDA_HOME, "bin", "nvcc")) if CUDA_HOME else None,
                            torch.version.cuda)
        nvcc = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
        nvcc += cuda_nvcc_arch_flags(os.environ)
        ext = CUDAExtension("wiola_kernels._C", sources, include_dirs=[f"{HERE}/csrc/include"],
                            define_macros=[("WIOLA_WITH_CUDA", None)],
                            extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=link)
    else:
        ext = CppExtension("wiola_kernels._C", sources, include_dirs=[f"{HERE}/csrc/include"],
                           extra_compile_args={"cxx": cxx}, extra_link_args=link)
    return [ext], {"build_ext": _build_extension_class(BuildExtension).with_options(use_ninja=True)}


def main() -> None:
    ext_modules, cmdclass = _extensions()
    setup(**_metadata(), ext_modules=ext_modules, cmdclass=cmdclass)


def _metadata() -> dict:
    return dict(
        name="wiola-kernels",
        version="0.1.0",
        description="Fused Triton/CUDA/C++ kernels for the Wiola small-language-model architecture",
        long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
        long_description_content_type="text/markdown",
        # The contact SECURITY.md names for private reports (the address the project's commits use).
        author="The wiola-kernels developers",
        author_email="dev@wiola.local",
        maintainer="The wiola-kernels developers",
        maintainer_email="dev@wiola.local",
        packages=find_packages(include=["wiola_kernels", "wiola_kernels.*"])
        + find_packages(where="python", include=["wiola", "wiola.*"]),
        package_dir={"wiola": "python/wiola"},
        package_data={"wiola": ["data/*.txt"]},
        python_requires=">=3.10",
        install_requires=["torch>=2.11", "numpy", "tqdm"],
        extras_require={
            "triton": ["triton>=3.6"],
            "model": ["transformers>=5.17", "tokenizers", "safetensors"],  # transformers 5 APIs; 5.17 and newer tested
            "plot": ["matplotlib"],  # python -m wiola_kernels bench --plot
            "llama-cpp": ["gguf"],  # python -m wiola bench --decode --llama-cpp (writes the GGUF file)
            "test": ["pytest", "pytest-benchmark", "hypothesis", "matplotlib", "triton>=3.6"],
        },
        entry_points={"console_scripts": ["wiola-kernels=wiola_kernels.__main__:main"]},
    )


# setuptools runs this file as __main__ (python setup.py ..., pip's build backend); importing
# it (tests/test_setup_build.py) builds nothing.
if __name__ == "__main__":
    main()
