"""Shared pieces of the command lines (``python -m wiola_kernels``, ``python -m wiola``):
help that shows defaults, option types that refuse nonsense up front, and one-line errors.

A user's mistake (a bad option, a missing file, an input an op refuses) prints one line,
``PROG: error: MESSAGE``, and exits with status 2 — no traceback. ``WIOLA_TRACEBACK=1``
shows the traceback instead (for reporting a bug).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Callable


class CommandError(Exception):
    """A mistake in how a command was called; printed as one line, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to every option with a help text, except flags (default
    False) and options whose default is None (their help says what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or "%(default)" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse type: an int ≥ 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an int ≥ 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    return _float(text, allow_zero=False)


def non_negative_float(text: str) -> float:
    """argparse type: a finite float ≥ 0."""
    return _float(text, allow_zero=True)


def _float(text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>= 0' if allow_zero else '> 0'}, got {text}")
    return value


def require_matplotlib(option: str = "--plot") -> None:
    """Refuse ``--plot`` before a long run when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise CommandError(f"{option} needs matplotlib, which is not installed: pip install matplotlib "
                           "(it is in requirements.txt), or leave out the option")


def run(prog: str, fn: Callable[[], int | None]) -> int:
    """Run ``fn``; a user mistake (``CommandError``, ``ValueError``, ``TypeError``, ``OSError``,
    ``RuntimeError``) becomes one line on stderr and exit status 2."""
    try:
        return int(fn() or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (CommandError, ValueError, TypeError, OSError, RuntimeError) as exc:
        if os.environ.get("WIOLA_TRACEBACK", "0") not in ("", "0"):
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        mistake = isinstance(exc, (CommandError, ValueError))  # others may be a bug: say how to see where
        kind = "" if mistake else f"{type(exc).__name__}: "
        where = "" if mistake else " (WIOLA_TRACEBACK=1 shows the traceback)"
        print(f"{prog}: error: {kind}{message}{where}", file=sys.stderr)
        return 2


__all__ = ["CommandError", "HelpFormatter", "non_negative_float", "non_negative_int", "positive_float",
           "positive_int", "require_matplotlib", "run"]
