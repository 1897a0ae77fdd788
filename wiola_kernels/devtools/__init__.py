"""Development tools that need a source checkout of wiola-kernels (``csrc/`` next to the
package) and the CUDA toolkit; an installed wheel has neither, and each tool says so."""

from __future__ import annotations

from pathlib import Path

#: The checkout this package was imported from (``None`` for an installed package).
REPO: Path | None = Path(__file__).resolve().parents[2]
if not (REPO / "csrc" / "cuda").is_dir() or not (REPO / "csrc" / "include" / "wiola").is_dir():
    REPO = None


class NoCheckout(RuntimeError):
    """The tool needs a source checkout (``csrc/``), and this package was installed without one."""


def checkout() -> Path:
    """The checkout's root, or :class:`NoCheckout` naming what is missing."""
    if REPO is None:
        raise NoCheckout("this needs a source checkout of wiola-kernels (csrc/ next to the wiola_kernels package); "
                         "the installed package has none: run it from a git clone")
    return REPO
