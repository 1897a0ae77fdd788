"""pytest-benchmark suite over the cases of ``python -m wiola_kernels bench``.

    pytest benchmarks --benchmark-enable            # full shapes, with torch.compile
    pytest benchmarks                                # (the default: benchmarks disabled)
                                                     # one smoke run per case, small shapes

With benchmarking disabled (as in the normal test run) every case runs once at small
shapes, so the suite doubles as a smoke test of the cases themselves.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
