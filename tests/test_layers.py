"""The package's import layers: every import of ``wiola_kernels`` (module level or inside a
function: the AST of every module) goes down a layer or stays in its own, never up.

    0 leaves    shapes, dtypes, outputs, validation, _extension, cli
    1 dispatch  dispatch
    2 kernels   triton/*, reference/*
    3 ops       ops/*, decode/*
    4 modules   modules/*, hf
    5 package   wiola_kernels (its __init__)
    6 tools     bench/*, testing, devtools/*, __main__

So a kernel module (``triton/*``, ``ops/*``, ``reference/*``) never imports ``bench/`` or
``testing``, and nothing below the tools imports the package root (which imports everything).
A new top-level module must be given a layer here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "wiola_kernels"

LAYERS = {
    "shapes": 0, "dtypes": 0, "outputs": 0, "validation": 0, "_extension": 0, "cli": 0,
    "dispatch": 1,
    "triton": 2, "reference": 2,
    "ops": 3, "decode": 3,
    "modules": 4, "hf": 4, "hf_kernels": 4,
    "": 5,
    "bench": 6, "testing": 6, "devtools": 6, "__main__": 6,
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer(module: str) -> int:
    """The layer of ``wiola_kernels[.x[.y]]``: its first component below the package."""
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else ""
    if key not in LAYERS:
        raise KeyError(f"{module}: no layer for wiola_kernels.{key} in tests/test_layers.py LAYERS")
    return LAYERS[key]


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``[(line, imported wiola_kernels module)]`` of every import statement in the file,
    resolving relative imports; ``from X import name`` counts as ``X.name`` when that is a
    module of the package, else as ``X``."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "wiola_kernels"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "wiola_kernels":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                rel = Path(*sub.split("."))
                is_module = (root / rel).with_suffix(".py").exists() or (root / rel / "__init__.py").exists()
                out.append((node.lineno, sub if is_module else target))
    return sorted(set(out))


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    for path in MODULES:
        layer(module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_go_down_the_layers(path):
    me = module_name(path)
    bad = [f"{path.relative_to(ROOT)}:{line}: {me} (layer {layer(me)}) imports {target} (layer {layer(target)})"
           for line, target in imports(path) if layer(target) > layer(me)]
    assert not bad, "imports up a layer:\n" + "\n".join(bad)


def test_the_walk_sees_lazy_imports(tmp_path):
    """The check reads imports inside functions too: the lazy import that held the old
    kernels → bench/cases.py → ops → kernels circle apart is caught."""
    mod = tmp_path / "wiola_kernels" / "triton" / "x.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("def aot_launches(sms):\n    from ..bench.cases import GPU_BENCH_DTYPE\n")
    got = [t for _, t in imports(mod, tmp_path)]
    assert got == ["wiola_kernels.bench.cases"] and layer(got[0]) > layer("wiola_kernels.triton.x")

