"""The docs hold inside a clone: every link in the Markdown files points to a file
(and heading) of this repository, and the facts they state match the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "SECURITY.md", *ROOT.glob("docs/*.md"),
               ROOT / "python" / "wiola" / "README.md"])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces to -."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower())
        out.add(text.replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository(doc):
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        assert not re.match(r"[a-z]+:", target), f"{doc.name} links outside the repository: {target}"
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.is_relative_to(ROOT), f"{doc.name} links outside the clone: {target}"
        assert resolved.exists(), f"{doc.name} links to a missing file: {target}"
        if anchor:
            assert anchor in _anchors(resolved.read_text(encoding="utf-8")), f"{doc.name}: no heading #{anchor}"


def test_every_public_name_is_documented_and_every_op_has_its_contract():
    """The one docs-coverage test: every name ``wiola_kernels`` exports has a docstring; every
    registered op's public functions and autograd Functions are in docs/ops.md; its accuracy
    table states the tolerances the tests use."""
    import wiola_kernels
    from wiola_kernels.testing import TOLERANCE

    text = (ROOT / "docs" / "ops.md").read_text(encoding="utf-8")
    for name in wiola_kernels.__all__:
        assert (getattr(wiola_kernels, name).__doc__ or "").strip(), f"wiola_kernels.{name} has no docstring"
    # Every registered op's public functions (atm: atm_merge, atm_unmerge); no op list here.
    public = [n for n in wiola_kernels.__all__ if n.islower() and callable(getattr(wiola_kernels, n))]
    for op in wiola_kernels.dispatch.ops():
        names = [n for n in public if n.startswith(op)]
        assert names, f"{op}: no public function in wiola_kernels.__all__"
        for name in names:
            assert f"`{name}(" in text, name
    for name in (n for n in wiola_kernels.__all__ if n.endswith("Function")):
        assert name in text, f"{name} missing from docs/ops.md"
    table = text.split("## Accuracy", 1)[1]
    for kind, column in (("elementwise", 2), ("attention", 3)):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            name = str(dtype).removeprefix("torch.")
            row = next(ln for ln in table.splitlines() if ln.startswith("| ") and name in ln.split("|")[1])
            written = f"{TOLERANCE[kind][dtype]:.0e}".replace("e-0", "e-")  # 1e-05 -> 1e-5
            assert written in row.split("|")[column], (kind, name, row)


def test_readme_names_the_build_s_cxx_standard():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    standard = re.search(r"CMAKE_CXX_STANDARD (\d+)", (ROOT / "CMakeLists.txt").read_text()).group(1)
    stated = set(re.findall(r"C\+\+(\d+) compiler", readme))
    assert stated == {standard}, (stated, standard)


def test_security_contact_is_in_the_package_metadata():
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    email = re.search(r'author_email="([^"]+)"', setup).group(1)
    assert re.search(r'\bauthor="[^"]+"', setup)
    assert email in (ROOT / "SECURITY.md").read_text(encoding="utf-8")
