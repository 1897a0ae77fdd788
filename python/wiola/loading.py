"""Checks around ``WiolaForCausalLM.from_pretrained`` that make loading mistakes say what to do.

* :func:`check_checkpoint_path` — a path that looks local but does not exist is a
  ``FileNotFoundError`` naming it (with the closest existing folder), before Hugging Face
  spends half a minute retrying a Hub it cannot reach and then blames the network; a
  folder without ``config.json`` says so (instead of "required fields are missing").
* :func:`portable_kernel_backend` — ``kernel_backend`` is saved in ``config.json``, but it
  is a property of the machine that trained, not of the weights: a saved backend that
  cannot run where the model was loaded is replaced by ``"auto"``, with a one-line note.
* :func:`quiet_load_report` — the loader's "LOAD REPORT" (missing keys "newly
  initialized") is not printed: Wiola refuses such a load and names the keys itself.

The strict policy of ``from_pretrained`` (SECURITY.md): safetensors only, never pickle —
:func:`check_load_kwargs` refuses ``use_safetensors=False`` and
``ignore_mismatched_sizes=True``, :func:`refuse_pickle_only_directory` a folder holding only
pickled weights — and every tensor accounted for: :func:`refuse_partial_load` turns the
loader's missing / unexpected / mismatched keys into one ``ValueError`` naming them all.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import warnings
from typing import Iterator

import torch

# What a Hugging Face Hub id looks like: "name" or "owner/name" (letters, digits, - _ .).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def looks_local(path: str | os.PathLike, local_files_only: bool = False) -> bool:
    """True when ``path`` can only mean a folder on this machine: a ``PathLike``, an
    absolute or ``./``/``../``/``~`` path, more than one ``/``, a character a Hub id cannot
    have, a first component that is an existing folder here (``checkpoints/tinyy`` when
    ``checkpoints/`` exists), or ``local_files_only``/``HF_HUB_OFFLINE``."""
    if local_files_only or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return True
    if not isinstance(path, str):
        return True
    if path.startswith(("/", "./", "../", "~", ".\\", "..\\")) or path in (".", "..") or "\\" in path:
        return True
    if not _HUB_ID.match(path):
        return True
    parent = os.path.dirname(path)
    return bool(parent) and os.path.isdir(parent)


def _closest(path: str) -> str:
    """`` (did you mean 'x'?)`` for the nearest existing sibling folder, or ""."""
    parent = os.path.dirname(path) or "."
    try:
        siblings = [n for n in os.listdir(parent) if os.path.isdir(os.path.join(parent, n))]
    except OSError:
        return ""
    close = difflib.get_close_matches(os.path.basename(path.rstrip("/")), siblings, 1, 0.6)
    return f" (did you mean {os.path.join(os.path.dirname(path), close[0])!r}?)" if close else ""


def check_checkpoint_path(who: str, path: str | os.PathLike, subfolder: str = "",
                          local_files_only: bool = False) -> None:
    """Raise ``FileNotFoundError`` for a local-looking checkpoint path that does not exist,
    or for a checkpoint folder without ``config.json`` (Hugging Face needs it even when a
    ``config`` is passed in). A Hub id (``owner/name`` with no such local folder) is left
    to Hugging Face."""
    text = os.fspath(path)
    expanded = os.path.expanduser(text)
    if os.path.isdir(expanded):
        folder = os.path.join(expanded, subfolder) if subfolder else expanded
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{who}.from_pretrained: {text!r} has no subfolder {subfolder!r}")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"{who}.from_pretrained: {folder!r} has no config.json; a Wiola checkpoint folder "
                                    "holds config.json and model.safetensors (save_pretrained and "
                                    "`python -m wiola train --out DIR` write both)")
        return
    if os.path.exists(expanded):
        raise NotADirectoryError(f"{who}.from_pretrained: {text!r} is a file; pass the checkpoint folder that "
                                 "holds config.json and model.safetensors")
    if looks_local(path, local_files_only):
        raise FileNotFoundError(f"{who}.from_pretrained: no checkpoint folder {text!r} "
                                f"(looked in {os.path.abspath(expanded)}){_closest(expanded)}")


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


@contextlib.contextmanager
def quiet_load_report() -> Iterator[None]:
    """Drop transformers' load report (it says missing weights were "newly initialized")
    while loading: Wiola refuses such a load with an error naming every key instead."""
    target = logging.getLogger("transformers.modeling_utils")
    report_filter = _DropLoadReport()
    target.addFilter(report_filter)
    try:
        yield
    finally:
        target.removeFilter(report_filter)


def portable_kernel_backend(who: str, config, device: torch.device, explicit: bool) -> None:
    """Reset a saved ``config.kernel_backend`` that cannot run on ``device`` to ``"auto"``
    with a one-line note. An ``explicit`` choice (``from_pretrained(..., kernel_backend=...)``)
    is kept: then the error at the first forward names the backend the caller asked for."""
    name = getattr(config, "kernel_backend", "auto")
    if explicit or name in ("auto", "reference"):
        return
    from wiola_kernels import dispatch

    backend = dispatch.BACKENDS.get(name)
    reason = None if backend is None else backend.unavailable_reason(device)
    if reason is None:
        return
    config.kernel_backend = "auto"
    warnings.warn(f"{who}.from_pretrained: the checkpoint was saved with kernel_backend={name!r}, which cannot run "
                  f"here ({reason}); loaded with kernel_backend='auto' (pass kernel_backend=... to choose)",
                  UserWarning, stacklevel=3)


def check_load_kwargs(who: str, kwargs: dict) -> None:
    """``ValueError`` for ``from_pretrained`` options that would weaken the policy: pickle
    weights (``use_safetensors=False``) or random re-initialisation of mismatched tensors
    (``ignore_mismatched_sizes=True``)."""
    if kwargs.get("use_safetensors") is False:
        raise ValueError(f"{who}.from_pretrained: use_safetensors=False is refused; Wiola checkpoints "
                         "load from safetensors only, never pickle (SECURITY.md)")
    if kwargs.get("ignore_mismatched_sizes"):
        raise ValueError(f"{who}.from_pretrained: ignore_mismatched_sizes=True is refused; loading is "
                         "strict (a mismatched tensor would be initialised at random)")


def refuse_pickle_only_directory(who: str, path, subfolder: str) -> None:
    """``OSError`` when a local checkpoint directory has pickled weights but no safetensors."""
    folder = os.path.join(str(path), subfolder) if subfolder else str(path)
    if not os.path.isdir(folder):
        return  # a Hub id or a file: use_safetensors=True makes Hugging Face refuse pickles there
    names = os.listdir(folder)
    if not any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
        pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl")))
        if pickles:
            raise OSError(f"{who}.from_pretrained: {folder} holds only pickled weights ({', '.join(pickles)}); "
                          "Wiola loads safetensors only, never pickle (SECURITY.md). Convert the checkpoint to "
                          "model.safetensors with a trusted tool first.")


def refuse_partial_load(who: str, path, info: dict) -> None:
    """``ValueError`` naming every missing, unexpected or wrongly shaped tensor (and loader
    error) of Hugging Face's loading ``info``: a partial load is never accepted."""
    problems = [f"missing {k}" for k in sorted(info["missing_keys"])]
    problems += [f"unexpected {k}" for k in sorted(info["unexpected_keys"])]
    problems += [f"{k}: shape {tuple(ckpt)} in the checkpoint, {tuple(want)} in the model"
                 for k, ckpt, want in sorted(info["mismatched_keys"], key=lambda m: m[0])]
    problems += [str(e) for e in info["error_msgs"]]
    if problems:
        raise ValueError(f"{who}.from_pretrained({str(path)!r}): the checkpoint does not match the config; "
                         f"refusing a partial load: " + "; ".join(problems))


__all__ = ["check_checkpoint_path", "check_load_kwargs", "looks_local", "portable_kernel_backend", "quiet_load_report",
           "refuse_partial_load", "refuse_pickle_only_directory"]
