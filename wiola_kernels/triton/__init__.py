"""Triton kernels (GPU, or the CPU interpreter under ``TRITON_INTERPRET=1``)."""
