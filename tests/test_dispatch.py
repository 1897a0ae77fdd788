"""Backend choice (wiola_kernels.dispatch): priorities, overrides, errors, reports."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import dispatch
from wiola_kernels.testing import available_backends

CPU = torch.device("cpu")


def test_cpu_default_prefers_the_cpp_extension():
    expected = "cpu" if "cpu" in available_backends("rms_norm", CPU) else "reference"
    with wk.use_backend("auto"):
        assert dispatch.select("rms_norm", CPU) == expected


def test_use_backend_nests_and_restores():
    with wk.use_backend("reference"):
        assert dispatch.select("rms_norm", CPU) == "reference"
        with wk.use_backend("auto"):
            assert dispatch.select("rms_norm", CPU) != "reference" or "cpu" not in available_backends("rms_norm")
        assert dispatch.select("rms_norm", CPU) == "reference"


@pytest.fixture
def environment(monkeypatch):
    """Sets WIOLA_BACKEND and has the package read it again (it is read once, at import);
    restores both afterwards."""
    def set_backend(value: str) -> None:
        monkeypatch.setenv("WIOLA_BACKEND", value)
        dispatch.reload_environment()

    yield set_backend
    monkeypatch.undo()
    dispatch.reload_environment()


def test_environment_variable_and_auto_masking(environment):
    environment("reference")
    assert dispatch.select("rms_norm", CPU) == "reference"
    with wk.use_backend("auto"):  # an explicit auto masks the environment
        assert dispatch.forced_backend() is None
    environment("nonsense")
    with pytest.raises(ValueError, match="WIOLA_BACKEND"):
        dispatch.select("rms_norm", CPU)
    with pytest.raises(ValueError, match="WIOLA_BACKEND"):  # the ops refuse it too, not only reports
        wk.rms_norm(torch.ones(2, 4), torch.ones(4))


def test_forced_backend_that_cannot_run_raises_with_reason():
    with wk.use_backend("cuda"):
        # rms_norm has no CUDA-C++ backend: it keeps its default rather than failing.
        assert dispatch.select("rms_norm", CPU) in ("cpu", "reference")
    if "gcla_attention" in dispatch.ops():
        with wk.use_backend("cuda"), pytest.raises(RuntimeError, match="cuda.*cannot run"):
            dispatch.select("gcla_attention", CPU)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = dispatch.BACKENDS["triton"].unavailable_reason(CPU)
    assert reason is not None and "TRITON_INTERPRET" in reason


def test_backends_report_lists_every_op_and_reason():
    report = wk.backends("cpu")
    assert {"rms_norm", "srpe"} <= set(report)
    for op, table in report.items():
        assert table["reference"] == "available"
        assert all(v == "available" or v.startswith("unavailable: ") for v in table.values())
    assert report["rms_norm"].get("cuda") is None  # not implemented, so not listed


def test_override_is_per_thread():
    seen = {}

    def worker():
        seen["worker"] = dispatch.forced_backend()

    with wk.use_backend("reference"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        seen["main"] = dispatch.forced_backend()
    assert seen["main"] == "reference"
    assert seen["worker"] in (None, os.environ.get("WIOLA_BACKEND"))


_WITHOUT_EXTENSION = """
import importlib.abc, sys, warnings, torch
if {block}:
    class Block(importlib.abc.MetaPathFinder):  # as if the extension had failed to build
        def find_spec(self, name, path, target=None):
            if name == "wiola_kernels._C":
                raise ImportError("simulated: extension not built")
    sys.meta_path.insert(0, Block())
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import wiola_kernels as wk
    wk.backends(); wk.backends()
msgs = [str(x.message) for x in w if "C++ extension" in str(x.message)]
assert len(msgs) == {warnings}, msgs
r = wk.backends("cpu")["rms_norm"]
assert r["cpu"].startswith("unavailable") and {reason!r} in r["cpu"], r
x = torch.randn(4, 8, requires_grad=True)
y = wk.rms_norm(x, torch.ones(8), torch.zeros(8)); y.sum().backward()
assert torch.isfinite(x.grad).all()
print("ok")
"""


@pytest.mark.parametrize("how", ["failed build", "disabled"])
def test_package_works_without_the_extension(how):
    """Failed build: one clear warning, the reason in backends(), reference kernels work.
    WIOLA_DISABLE_EXTENSION=1: the same without a warning (the user asked for it)."""
    if how == "failed build":
        code = _WITHOUT_EXTENSION.format(block=True, warnings=1, reason="simulated: extension not built")
        env = dict(os.environ)
    else:
        code = _WITHOUT_EXTENSION.format(block=False, warnings=0, reason="WIOLA_DISABLE_EXTENSION")
        env = dict(os.environ, WIOLA_DISABLE_EXTENSION="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def _count_calls(monkeypatch, op, backend, attr):
    calls = []
    impl = dispatch._registry[op][backend]
    original = getattr(impl, attr)

    def counted(*args, **kwargs):
        calls.append(attr)
        return original(*args, **kwargs)

    monkeypatch.setattr(impl, attr, counted)
    return calls


def test_backward_runs_on_the_forwards_backend(monkeypatch):
    """use_backend around the forward also governs its backward, even when backward()
    runs after the block has closed (as in a training loop)."""
    calls = _count_calls(monkeypatch, "rms_norm", "reference", "backward")
    x = torch.randn(4, 8, requires_grad=True)
    with wk.use_backend("reference"):
        y = wk.rms_norm(x, torch.ones(8), torch.zeros(8))
    y.sum().backward()
    assert calls == ["backward"]
    if "cpu" in available_backends("rms_norm"):
        calls.clear()
        x.grad = None
        wk.rms_norm(x, torch.ones(8), torch.zeros(8)).sum().backward()  # auto: cpu, not reference
        assert calls == []
        with wk.use_backend("reference"):  # backward inside a different override: still the forward's
            y = wk.rms_norm(x, torch.ones(8), torch.zeros(8))
        with wk.use_backend("auto"):
            y.sum().backward()
        assert calls == ["backward"]


@pytest.mark.parametrize("op, attr, call", [
    ("srpe", "backward", lambda: wk.srpe(torch.randn(1, 2, 3, 4, requires_grad=True), torch.randn(1, 1, 3, 4),
                                      torch.arange(3))[0]),
    ("gcla_attention", "backward", lambda: wk.gcla_attention(
        *[torch.randn(1, h, 5, 8, requires_grad=True) for h in (2, 1, 1, 2)],
        torch.randn(1, 2, 5, 1, 8), torch.randn(1, 2, 5, 1, 8), torch.zeros(2))),
    ("atm", "unmerge_backward", lambda: wk.atm_unmerge(torch.randn(1, 4, 3, requires_grad=True),
                                                       torch.tensor([[0, 0, 1, 2]]))),
])
def test_every_op_backward_follows_its_forward(monkeypatch, op, attr, call):
    calls = _count_calls(monkeypatch, op, "reference", attr)
    with wk.use_backend("reference"):
        out = call()
    n_forward = len(calls)
    out.sum().backward()
    assert len(calls) == n_forward + 1


def test_triton_probe_asks_torch_whether_cuda_exists(monkeypatch):
    # A CPU-only torch accepts torch.device("cuda"); the probe must not call Triton available there.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = dispatch.BACKENDS["triton"].unavailable_reason(torch.device("cuda"))
    assert reason is not None and "is_available" in reason
    assert wk.backends("cuda")["rms_norm"]["triton"].startswith("unavailable")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dispatch.BACKENDS["triton"].unavailable_reason(torch.device("cuda")) is None


def test_bad_wiola_backend_is_reported_where_the_environment_is_read(environment):
    environment("bogus")
    with pytest.raises(ValueError, match=r"'bogus' \(from the environment variable WIOLA_BACKEND\)"):
        wk.backends("cpu")
