"""CONTRIBUTING.md's "Adding an op" is true: every registered op is in every place its table
names, and the table names no place this test does not check (at most 8: a new op edits no
file that lists the ops). The ops come from the registry (``dispatch.ops()``) and their public
functions from ``wiola_kernels.__all__``."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import dispatch

ROOT = Path(__file__).resolve().parents[1]


def _read(path: str) -> str:
    return (ROOT / path).read_text()


def public_functions(op: str) -> list[str]:
    """The public functions whose Function lives in ``wiola_kernels/ops/<op>.py``."""
    module = f"wiola_kernels.ops.{op}"
    return sorted(n for n in wk.__all__ if inspect.isfunction(getattr(wk, n)) and getattr(wk, n).__module__ == module)


def _schemas_and_cpu_kernel(op, fns):
    text = _read(f"csrc/cpu/{op}.cpp")
    assert text.count('m.set_python_module("wiola_kernels.ops.') == 1, f"csrc/cpu/{op}.cpp: one schema block"
    assert f'm.set_python_module("wiola_kernels.ops.{op}")' in text, op
    assert "m.set_python_module(" not in _read("csrc/wiola_ops.cpp"), "a public op's schemas in csrc/wiola_ops.cpp"
    if wk.ops.have_registered_ops():
        for fn in fns:
            for name in (fn, f"{fn}_backward"):
                assert hasattr(torch.ops.wiola, name), f"wiola::{name} is not declared"
    if "cpu" in dispatch.implemented(op):
        assert "TORCH_LIBRARY_IMPL(wiola, CPU, m)" in text
        for fn in fns:
            assert f'm.impl("{fn}"' in text and f'm.impl("{fn}_backward"' in text, fn


def _cpp_checks(op, fns):
    text = _read("csrc/include/wiola/checks.h")
    for fn in fns:
        assert re.search(rf"\binline [\w:<>]+ {fn}\(", text), f"checks::{fn} missing from checks.h"


def _triton(op, fns):
    if "triton" not in dispatch.implemented(op):
        return
    assert "def aot_launches(" in _read(f"wiola_kernels/triton/{op}.py"), op


def _shapes(op, fns):
    from wiola_kernels import shapes

    assert op in shapes.CPU_DEFAULT_BENCH, f"{op}: no shape in shapes.CPU_DEFAULT_BENCH"
    assert op in shapes.TINY_BENCH, f"{op}: no shape in shapes.TINY_BENCH"


def _reference(op, fns):
    module = importlib.import_module(f"wiola_kernels.reference.{op}")
    from wiola_kernels import reference

    for fn in fns:
        assert fn in module.__all__ and fn in reference.__all__, f"reference.{fn} not exported"


def _op_module(op, fns):
    """The op's module: its checks, registration, Function and public function, its exports (the
    package's ``__all__`` is theirs) and its benchmark cases (bench and ``bench --overhead``)."""
    module = importlib.import_module(f"wiola_kernels.ops.{op}")
    assert getattr(module, "OP", None) == op
    for fn in fns:
        assert callable(getattr(module, fn)), fn
        check = getattr(module, f"check_{fn}", None)
        assert callable(check) and check.__module__ == module.__name__, f"check_{fn} not defined in ops/{op}.py"
    assert fns, f"no public function of {op} is exported"
    assert set(module.__all__) <= set(wk.__all__), (op, module.__all__)
    functions = [n for n in module.__all__ if n.endswith("Function")]
    assert sorted(n for n in module.__all__ if n not in functions) == fns, (op, module.__all__, fns)
    assert len(functions) == len(fns), (op, functions, fns)
    from wiola_kernels.bench import all_cases
    from wiola_kernels.bench.overhead import cases

    assert op in {c.op for c in all_cases(torch.device("cpu"), small=True)}, op
    names = {c.op for c in cases()}
    for fn in fns:
        assert fn in names, fn


def _docs(op, fns):
    headings = [line for line in _read("docs/ops.md").splitlines() if line.startswith("#")]
    for fn in fns:
        assert any(f"`{fn}`" in h or f"{fn}(" in h or re.search(rf"\b{fn}\b", h) for h in headings), fn


def _tests(op, fns):
    from op_cases import CASES

    assert (ROOT / f"tests/test_{op}.py").exists(), op
    assert op in CASES, f"no OpCase (CASE) in tests/test_{op}.py"
    assert CASES[op].oracle is not None, f"{op}'s OpCase has no oracle"
    assert sorted(f.name for f in CASES[op].functions) == fns, (op, fns)


CHECKS = {
    "csrc/cpu/<op>.cpp": _schemas_and_cpu_kernel,
    "csrc/include/wiola/checks.h": _cpp_checks,
    "wiola_kernels/triton/<op>.py": _triton,
    "wiola_kernels/shapes.py": _shapes,
    "wiola_kernels/reference/<op>.py": _reference,
    "wiola_kernels/ops/<op>.py": _op_module,
    "docs/ops.md": _docs,
    "tests/test_<op>.py": _tests,
}


def recipe_rows() -> list[str]:
    """The files of CONTRIBUTING.md's "Adding an op" table, in order."""
    text = _read("CONTRIBUTING.md")
    section = text.split("## Adding an op", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| \d+ \| `([^`]+)`", section, re.M)]


def test_the_recipe_names_exactly_the_places_this_test_checks():
    assert recipe_rows() == list(CHECKS), "CONTRIBUTING.md's table and tests/test_recipe.py disagree"
    assert len(CHECKS) <= 8, "a new op touches at most 8 files"


@pytest.mark.parametrize("op", dispatch.ops())
@pytest.mark.parametrize("place", list(CHECKS))
def test_every_registered_op_is_where_the_recipe_says(op, place):
    CHECKS[place](op, public_functions(op))
