"""Build wiola_kernels and its extension ``wiola_kernels._C``.

C++ CPU kernels are always built; CUDA kernels only when the installed torch has
CUDA and nvcc is found (or WIOLA_FORCE_CUDA=1). The decision comes from the build
environment, never from probing a GPU. Environment knobs:

* ``WIOLA_FORCE_CUDA=1``   build the CUDA kernels even if torch reports no CUDA.
* ``WIOLA_NO_EXTENSION=1`` skip the extension (pure Python: reference + Triton).
* ``WIOLA_CPU_ARCH``       ``-march`` for the CPU kernels (default ``x86-64-v3``,
  i.e. AVX2+FMA, on x86-64; ``native`` for the build machine; ``none`` for no flag).
* ``WIOLA_CUDA_ARCH``      CUDA architectures (default ``90``).
* ``WIOLA_NO_CUDA_EMU=1``  leave out the CUDA kernels' CPU emulation (backend ``cuda_emu``).
"""

from __future__ import annotations

import glob
import os
import platform

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_arch_flags() -> list[str]:
    arch = os.environ.get("WIOLA_CPU_ARCH", "x86-64-v3" if platform.machine() in ("x86_64", "AMD64") else "none")
    if arch == "none":
        return []
    flags = [f"-march={arch}"]
    if arch in ("x86-64-v3", "x86-64-v4", "native"):
        # at::vec picks its AVX2 specialisations from this macro.
        flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def _extensions() -> tuple[list, dict]:
    if os.environ.get("WIOLA_NO_EXTENSION", "0") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = [os.path.relpath(p, HERE) for p in ["csrc/python_module.cpp", "csrc/wiola_ops.cpp", *sorted(glob.glob(f"{HERE}/csrc/cpu/*.cpp"))]]
    cxx = ["-O3", "-fopenmp", *_cpu_arch_flags()]  # torch picks the C++ standard
    if os.environ.get("WIOLA_NO_CUDA_EMU", "0") != "1":
        # The CUDA kernels compiled as host C++ for the SIMT emulator (test backend cuda_emu),
        # in every build: on a GPU build too, so that scripts/gpu_check.sh compares the two.
        sources += [os.path.relpath(p, HERE) for p in sorted(glob.glob(f"{HERE}/csrc/cuda/emu/*.cpp"))]
    with_cuda = os.environ.get("WIOLA_FORCE_CUDA", "0") == "1" or (
        torch.version.cuda is not None and CUDA_HOME is not None)
    if with_cuda:
        cuda_sources = sorted(glob.glob(f"{HERE}/csrc/cuda/*.cu")) + sorted(glob.glob(f"{HERE}/csrc/cuda/*.cpp"))
        sources += [os.path.relpath(p, HERE) for p in cuda_sources]
        archs = os.environ.get("WIOLA_CUDA_ARCH", "90").split(",")
        nvcc = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
        nvcc += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        ext = CUDAExtension("wiola_kernels._C", sources, include_dirs=[f"{HERE}/csrc/include"],
                            define_macros=[("WIOLA_WITH_CUDA", None)],
                            extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=["-fopenmp"])
    else:
        ext = CppExtension("wiola_kernels._C", sources, include_dirs=[f"{HERE}/csrc/include"],
                           extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
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
    install_requires=["torch>=2.6", "numpy", "tqdm"],
    extras_require={
        "triton": ["triton"],
        "model": ["transformers>=5.24", "tokenizers", "safetensors"],  # transformers 5 APIs; 5.24 tested
        "plot": ["matplotlib"],  # python -m wiola_kernels bench --plot
        "test": ["pytest", "pytest-benchmark", "hypothesis", "matplotlib", "triton"],
    },
    entry_points={"console_scripts": ["wiola-kernels=wiola_kernels.__main__:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
