"""No import circle in the model package (python/wiola) or the kernels (wiola_kernels): the
module graph of their import statements, read from the source (AST), has no cycle, and the
kernels never import the model. ``wiola.model`` imports no other module of the model package
but its configuration (the Hugging Face glue and the decoding step build on it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"wiola": ROOT / "python" / "wiola", "wiola_kernels": ROOT / "wiola_kernels"}


def module_names() -> dict[str, Path]:
    """``{dotted module name: source file}`` of every module of the two packages."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path], top_level: bool) -> set[str]:
    """The modules of ``modules`` that ``name`` imports (``top_level``: only statements run when
    it is imported, not those inside functions)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = ast.walk(tree)
    if top_level:  # module body, including if/try blocks, not function or class bodies
        nodes, stack = [], list(tree.body)
        while stack:
            node = stack.pop()
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                stack += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                          *[s for h in getattr(node, "handlers", []) for s in h.body]]
    found = set()
    for node in nodes:
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` imports a and a.b too
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(top_level: bool) -> list[list[str]]:
    modules = module_names()
    graph = {name: imports_of(name, path, modules, top_level) for name, path in modules.items()}
    # a package imports its __init__ first: an edge to a package's own parent is not a cycle
    # of the code's making, so leave out edges from a module to a package containing it
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def test_no_import_cycle_between_the_modules():
    assert cycles(top_level=False) == []


def test_the_scan_sees_imports_and_would_see_a_cycle(tmp_path, monkeypatch):
    # The scan is not vacuous: it finds decode.py's import of the model, and a planted
    # back-import (the model importing decode) is reported as a cycle.
    modules = module_names()
    assert "wiola.model" in imports_of("wiola.decode", modules["wiola.decode"], modules, True)
    planted = tmp_path / "model.py"
    planted.write_text(modules["wiola.model"].read_text() + "\nfrom . import decode\n")
    original = imports_of

    def with_plant(name, path, mods, top):
        return original(name, planted if name == "wiola.model" else path, mods, top)

    monkeypatch.setitem(globals(), "imports_of", with_plant)
    assert any("wiola.model" in c and "wiola.decode" in c for c in cycles(top_level=False))


def test_the_kernels_never_import_the_model_and_the_model_only_its_config():
    modules = module_names()
    for name, path in modules.items():
        if name.startswith("wiola_kernels"):
            assert not {m for m in imports_of(name, path, modules, False) if m.split(".")[0] == "wiola"}, name
    mine = {m for m in imports_of("wiola.model", modules["wiola.model"], modules, False) if m.startswith("wiola.")}
    assert mine == {"wiola.configuration_wiola"}
