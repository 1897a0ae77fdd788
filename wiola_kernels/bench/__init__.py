"""Benchmark cases and the timing harness behind ``python -m wiola_kernels bench``."""

from .cases import BenchCase, all_cases, case_factory

__all__ = ["BenchCase", "all_cases", "case_factory"]
