"""No CUDA path of the op layer waits on the GPU or queries the device per call (SPEC §11),
checked without a GPU: an AST scan of ``wiola_kernels/ops/*.py`` and ``wiola_kernels/triton/*.py``
for the calls that synchronise the host with the device or read device properties —
``.item()``, ``.cpu()``, ``.tolist()``, ``.numpy()``, ``torch.tensor(..., device=...)`` (a copy
from pageable host memory), ``torch.cuda.synchronize``, and ``torch.cuda.get_device_properties`` /
``get_device_capability`` outside a function cached per device (``functools.lru_cache`` /
``cache``, or a dict kept by the function). Each exception is allow-listed below with why it
is safe; an entry that no longer matches a call fails, so the list cannot go stale.

tests/test_cuda_graphs.py checks the same on a GPU, by capturing every op in a CUDA graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = sorted([*(ROOT / "wiola_kernels" / "ops").glob("*.py"), *(ROOT / "wiola_kernels" / "triton").glob("*.py")])

SYNC_METHODS = {"item", "cpu", "tolist", "numpy"}
DEVICE_QUERIES = {"get_device_properties", "get_device_capability", "synchronize"}

# (file relative to wiola_kernels/, enclosing function, call) -> why the call is safe there.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("triton/__init__.py", "sm_count", "get_device_properties"):
        "read once per device and kept in _SM_COUNTS (the launchers' only device query)",
}
# Known per-call queries left for the branch that owns the file (listed, not hidden: an entry
# fails once the call is gone, so it is deleted with the fix).
PENDING: dict[tuple[str, str, str], str] = {
    ("triton/srpe.py", "_build_constants", "torch.tensor(device=)"):
        "the kernel's 6 float64 scalars copied to the device: cached per configuration and device "
        "(functools.lru_cache around it) outside a capture, but built anew while a CUDA graph is "
        "captured, which is not graph-safe; pass them as launch arguments instead",
    ("triton/srpe.py", "kernel_omega", "torch.tensor(device=)"):
        "the default frequencies ω copied to the device: the same as _build_constants (cached per "
        "configuration and device outside a capture, built anew inside one; it lived in "
        "srpe_tables.py, outside this scan, until it was folded into its one user)",
}


def _decorated_as_cache(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        name = d.func if isinstance(d, ast.Call) else d
        text = ast.unparse(name)
        if text.split(".")[-1] in ("lru_cache", "cache", "cached_property"):
            return True
    return False


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else None)


def findings(source: str, rel: str) -> list[tuple[str, str, str, int]]:
    """``(rel, function, call, line)`` of every host-sync or device-query call in ``source``
    made from a function that runs per call (not one cached per device, not module level)."""
    tree = ast.parse(source, filename=rel)
    found = []

    def visit(node, fn_name: str | None, cached: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name, cached or _decorated_as_cache(child))
                continue
            if isinstance(child, ast.Call) and fn_name is not None and not cached:
                name = _call_name(child)
                text = ast.unparse(child.func)
                hit = None
                if name in SYNC_METHODS and isinstance(child.func, ast.Attribute) and not child.args:
                    hit = name
                elif name in DEVICE_QUERIES and "cuda" in text:
                    hit = name
                elif text == "torch.tensor" and any(k.arg == "device" for k in child.keywords):
                    hit = "torch.tensor(device=)"
                if hit is not None:
                    found.append((rel, fn_name, hit, child.lineno))
            visit(child, fn_name, cached)

    visit(tree, None, False)
    return found


def _all_findings():
    return [f for path in SCANNED
            for f in findings(path.read_text(), path.relative_to(ROOT / "wiola_kernels").as_posix())]


def test_no_cuda_path_syncs_the_host_or_queries_the_device():
    bad = [f"{file}:{line}: {call} in {fn}()" for file, fn, call, line in _all_findings()
           if (file, fn, call) not in ALLOWED and (file, fn, call) not in PENDING]
    assert not bad, ("host syncs / device queries on a per-call path (make the value a launch argument or "
                     "keep it on the device; cache device queries per device), or allow-list them with why:\n"
                     + "\n".join(bad))


def test_every_allow_list_entry_still_matches():
    seen = {(file, fn, call) for file, fn, call, _ in _all_findings()}
    stale = [key for key in [*ALLOWED, *PENDING] if key not in seen]
    assert not stale, f"allow-list entries that match no call any more (delete them): {stale}"


@pytest.mark.parametrize("source, want", [
    ("def f(x):\n    return x.sum().item()\n", [("f", "item")]),
    ("def f(x):\n    return x.cpu()\n", [("f", "cpu")]),
    ("import torch\ndef f(d):\n    return torch.cuda.get_device_properties(d).multi_processor_count\n",
     [("f", "get_device_properties")]),
    ("import torch\ndef f(v, d):\n    return torch.tensor(v, device=d)\n", [("f", "torch.tensor(device=)")]),
    ("import functools, torch\n@functools.lru_cache(maxsize=None)\ndef f(d):\n"
     "    return torch.cuda.get_device_capability(d)\n", []),
    ("import torch\nX = torch.tensor(1.0).item()\n", []),          # module level: once, at import
    ("def f(x):\n    return x.to('cpu', non_blocking=True)\n", []),  # not in the list: the scan is what it says
])
def test_the_scan_finds_what_it_should(source, want):
    """The scan flags a planted sync in a per-call function, and not the cached or module-level forms."""
    assert [(fn, call) for _, fn, call, _ in findings(source, "ops/planted.py")] == want
