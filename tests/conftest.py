"""Test session setup: Triton runs in its CPU interpreter when no GPU is present, and
every kernel output starts poisoned (NaN / -1) so an element a kernel skips fails."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
os.environ["WIOLA_POISON_OUTPUTS"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N: N worker processes share the cores; one torch thread each, or idle OpenMP
    # workers spin against the other process (tests that need 2 threads set them).
    torch.set_num_threads(1)

import pytest  # noqa: E402

from hypothesis import settings  # noqa: E402

# "ci" (the default) is derandomised: the same examples on every run and machine. Tests
# draw every tensor from a torch.Generator seeded by a value Hypothesis draws, so an
# example replays exactly when Hypothesis shrinks or reports it. For bug hunts:
# HYPOTHESIS_PROFILE=random (fresh examples each run) or long (many of them).
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("random", max_examples=100, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=1000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (model tests use small shapes, where threads only add
    overhead); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running; deselect with -m 'not slow'")
