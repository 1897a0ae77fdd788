"""setup.py's CUDA build decisions, called as functions: importing setup.py builds nothing
(setuptools runs it as __main__)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import needs_cpu_extension

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("wiola_setup_under_test", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_importing_setup_py_builds_nothing(tmp_path):
    """No setup() call, no extension build, no file written on import."""
    script = ("import importlib.util, sys\n"
              "spec = importlib.util.spec_from_file_location('s', sys.argv[1])\n"
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
              "print('torch' in sys.modules, 'setuptools.command.build_ext' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script, str(ROOT / "setup.py")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]  # torch is imported only to build
    assert list(tmp_path.iterdir()) == []


def test_default_archs_are_sm90_and_sm80_with_the_newest_ptx(setup_py):
    assert setup_py.cuda_nvcc_arch_flags({}) == [
        "-gencode=arch=compute_90,code=[sm_90,compute_90]",
        "-gencode=arch=compute_80,code=sm_80",
    ]


@pytest.mark.parametrize("spec, want", [
    ("90", ["-gencode=arch=compute_90,code=[sm_90,compute_90]"]),
    ("80", ["-gencode=arch=compute_80,code=[sm_80,compute_80]"]),
    ("8.0;9.0", ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=[sm_90,compute_90]"]),
    ("sm_90, sm_80, 90", ["-gencode=arch=compute_90,code=[sm_90,compute_90]", "-gencode=arch=compute_80,code=sm_80"]),
    ("90a", ["-gencode=arch=compute_90a,code=[sm_90a,compute_90a]"]),
    ("100,90", ["-gencode=arch=compute_100,code=[sm_100,compute_100]", "-gencode=arch=compute_90,code=sm_90"]),
])
def test_wiola_cuda_arch_narrows_or_widens_the_build(setup_py, spec, want):
    assert setup_py.cuda_nvcc_arch_flags({"WIOLA_CUDA_ARCH": spec}) == want


@pytest.mark.parametrize("spec", ["", " , ", "ninety", "9", "sm_9x", "90,abc"])
def test_a_bad_wiola_cuda_arch_is_refused_by_name(setup_py, spec):
    with pytest.raises(ValueError, match="WIOLA_CUDA_ARCH"):
        setup_py.cuda_nvcc_arch_flags({"WIOLA_CUDA_ARCH": spec})


def test_torch_cuda_arch_list_alone_lets_torch_choose(setup_py):
    assert setup_py.cuda_nvcc_arch_flags({"TORCH_CUDA_ARCH_LIST": "8.6"}) == []
    both = {"TORCH_CUDA_ARCH_LIST": "8.6", "WIOLA_CUDA_ARCH": "90"}
    assert setup_py.cuda_nvcc_arch_flags(both) == ["-gencode=arch=compute_90,code=[sm_90,compute_90]"]


def test_cuda_major_mismatch_names_both_versions(setup_py):
    with pytest.raises(RuntimeError) as exc:
        setup_py.check_cuda_versions("13.0", "12.8")
    assert "nvcc is CUDA 13.0" in str(exc.value) and "CUDA 12.8 (torch.version.cuda)" in str(exc.value)


@pytest.mark.parametrize("nvcc, torch_cuda", [("13.0", "13.0"), ("13.1", "13.0"), ("12.9", "12.4"),
                                              (None, "13.0"), ("13.0", None)])
def test_same_major_or_unknown_versions_pass(setup_py, nvcc, torch_cuda):
    setup_py.check_cuda_versions(nvcc, torch_cuda)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_nvcc_version_is_read(setup_py):
    version = setup_py.nvcc_cuda_version(shutil.which("nvcc"))
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    assert version is not None and f"release {version}" in out


def test_nvcc_version_of_a_missing_binary_is_unknown(setup_py, tmp_path):
    assert setup_py.nvcc_cuda_version(str(tmp_path / "no-nvcc")) is None


def test_cpp_standard_is_named(setup_py, monkeypatch):
    """C++20 on the command line: torch < 2.13 (the GPU image has 2.11) adds -std=c++17 to
    one that names no standard, and the CPU kernels need C++20."""
    monkeypatch.delenv("WIOLA_NO_EXTENSION", raising=False)
    monkeypatch.delenv("WIOLA_FORCE_CUDA", raising=False)
    (ext,), _ = setup_py._extensions()
    assert "-std=c++20" in ext.extra_compile_args["cxx"]


def test_the_shared_libstdcxx_is_linked_by_path(setup_py):
    """The compiler's own libstdc++.so.6, so that no toolchain can link a private static copy."""
    (path,) = setup_py.shared_libstdcxx_link_args("c++ -O2")
    assert Path(path).is_absolute() and Path(path).name == "libstdc++.so.6" and Path(path).is_file()


def test_a_compiler_without_a_shared_libstdcxx_takes_the_loaded_one(setup_py, tmp_path):
    """A toolchain that has only the static archive: the copy torch runs with."""
    fake = tmp_path / "fake-g++"
    fake.write_text("#!/bin/sh\necho libstdc++.so.6\n")  # what gcc prints for a file it cannot find
    fake.chmod(0o755)
    import torch  # noqa: F401  (maps libstdc++.so.6 into this process)

    loaded = setup_py._loaded_libstdcxx()
    assert loaded is not None and Path(loaded).name.startswith("libstdc++.so.6") and Path(loaded).is_file()
    assert setup_py.shared_libstdcxx_link_args(str(fake)) == [loaded]
    assert setup_py.shared_libstdcxx_link_args(str(tmp_path / "missing")) == [loaded]


@needs_cpu_extension
def test_the_extension_uses_the_process_libstdcxx():
    """No libstdc++ code inside wiola_kernels._C: a static copy's locale facets clash with the
    shared copy torch loads (an integer in an error message crashed on the GPU image)."""
    import wiola_kernels._C as extension

    nm = shutil.which("nm")  # binutils, which the linker that built the extension comes with
    if nm is None:
        pytest.skip("binutils' nm is not installed (an extension built elsewhere)")
    defined = subprocess.run([nm, "-C", "--defined-only", extension.__file__], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    assert "std::codecvt" not in defined and "std::locale::classic" not in defined


def test_the_precompiled_header_is_compiled_with_the_sources_flags(setup_py, tmp_path):
    """GCC uses a precompiled header only when it was built with the flags of the source that
    reads it: the command keeps every flag the sources get, in their order, around the header."""
    cflags, post = ["-DNDEBUG", "-O3", "-fPIC", "-I/x"], ["-std=c++20", "-march=x86-64-v3", "-g0"]
    header = str(tmp_path / "torch_headers.h")
    cmd = setup_py.precompiled_header_command("c++", cflags, post, header)
    assert cmd == ["c++", *cflags, "-x", "c++-header", header, "-o", header + ".gch", *post]
    assert (ROOT / setup_py.PCH_HEADER).is_file()


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_a_source_reads_the_precompiled_header_it_was_built_for(setup_py, tmp_path):
    """The mechanism setup.py relies on, with a stand-in header: built and read with the same
    flags, the precompiled header is used (GCC says nothing with -Winvalid-pch); with another
    -O it is refused, and said so, which is why setup.py derives one from the other."""
    if not setup_py._is_gcc("c++"):
        pytest.skip("setup.py precompiles headers with GCC only")
    header = tmp_path / "torch_headers.h"
    header.write_text("#pragma once\n#include <vector>\ninline int answer() { return 42; }\n")
    source = tmp_path / "use.cpp"
    source.write_text("int f() { return answer(); }\n")
    flags = ["-O2", "-fPIC", "-std=c++20"]
    subprocess.run(setup_py.precompiled_header_command("c++", flags, [], str(header)), check=True, timeout=120)
    same = subprocess.run(["c++", *flags, "-Winvalid-pch", "-include", str(header), "-c", str(source),
                           "-o", str(tmp_path / "a.o")], capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and "not used" not in same.stderr, same.stderr
    other = subprocess.run(["c++", "-O0", "-fPIC", "-std=c++20", "-Winvalid-pch", "-include", str(header), "-c",
                            str(source), "-o", str(tmp_path / "b.o")], capture_output=True, text=True, timeout=120)
    assert other.returncode == 0 and "not used" in other.stderr, other.stderr
