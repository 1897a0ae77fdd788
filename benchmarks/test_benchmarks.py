"""One benchmark per (op case, pass, implementation); see conftest.py for how to run."""

from __future__ import annotations

import pytest
import torch

from wiola_kernels.bench import all_cases
from wiola_kernels.bench.runner import PASSES, make_pass

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IMPLS = ("fused", "eager", "compile")


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        enabled = not metafunc.config.getoption("benchmark_disable", False)
        cases = all_cases(DEVICE, small=not enabled)
        metafunc.parametrize("case", cases, ids=[f"{c.op}[{c.shape}, {str(c.dtype).replace('torch.', '')}]"
                                                 for c in cases])


@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("impl", IMPLS)
def test_bench(benchmark, case, pass_, impl):
    if impl == "compile" and benchmark.disabled:
        pytest.skip("torch.compile baselines are timed only with --benchmark-enable (compiling is slow)")
    fn = {"fused": case.fused, "eager": case.eager,
          "compile": torch.compile(case.baseline_to_compile(), dynamic=False) if impl == "compile" else None}[impl]
    run = make_pass(case, fn, pass_, case.make_inputs())
    benchmark.group = f"{case.op} {case.shape} {pass_}"
    benchmark.extra_info.update(op=case.op, shape=case.shape, dtype=str(case.dtype), impl=impl)
    out = benchmark(run)
    # Timings are never asserted; what ran must still be a real result: the tensors the eager
    # formula gives for this pass (same shapes), all finite.
    want = make_pass(case, case.eager, pass_, case.make_inputs())()
    got_t = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    want_t = [o for o in (want if isinstance(want, tuple) else (want,)) if isinstance(o, torch.Tensor)]
    assert [o.shape for o in got_t] == [o.shape for o in want_t]
    assert all(torch.isfinite(o).all() for o in got_t if o.is_floating_point())


@pytest.mark.parametrize("impl", ("patched", "unpatched"))
def test_bench_hf_llama_step(benchmark, impl):
    """The ``bench --hf llama`` case: one training step, patched by patch_hf or not."""
    pytest.importorskip("transformers")
    from wiola_kernels import patch_hf
    from wiola_kernels.bench.hf import hf_case, make_step

    case = hf_case("llama", DEVICE, small=benchmark.disabled)
    model = case.make_model()
    if impl == "patched":
        patch_hf(model)
    run = make_step(model, case.make_batch())
    benchmark.group = f"hf_llama_step {case.shape}"
    benchmark.extra_info.update(op="hf_llama_step", shape=case.shape, dtype=str(case.dtype), impl=impl)
    out = benchmark(run)
    assert out is not None and bool(out.isfinite())
