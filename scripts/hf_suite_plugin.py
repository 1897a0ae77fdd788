"""pytest plugin for scripts/hf_suite.py: with WIOLA_HF_SUITE_PATCH=1, every model of the
patch_hf families that a test builds is patched (wiola_kernels.patch_hf's class-level form,
so from_pretrained / from_config / plain constructors all are), and each test records how
many patched models it built, and how many family models escaped the patch, as JUnit
properties (wiola_patched, wiola_unpatched) the harness reads.

Loaded with ``-p hf_suite_plugin`` (scripts/ on PYTHONPATH); without the variable set it
only counts, so both runs of a family load the same code."""

from __future__ import annotations

import os
import weakref

import pytest

_built: list = []  # weakrefs to every PreTrainedModel built since the current test started


def _enabled() -> bool:
    return os.environ.get("WIOLA_HF_SUITE_PATCH") == "1"


def pytest_configure(config):
    from transformers import PreTrainedModel

    import wiola_kernels as wk

    if _enabled():
        for family in wk.hf.supported():
            wk.patch_hf(family)
    # post_init runs inside every model's constructor (the outer ones and those nested in
    # them); the class-level patch applies after the outermost constructor returns, so a
    # model is judged at the end of the test, not here.
    original = PreTrainedModel.post_init

    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _built.append(weakref.ref(self))
        return result

    PreTrainedModel.post_init = post_init


def _family_model(model) -> bool:
    from wiola_kernels import hf

    return hf._family(model)[0] is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _built.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    import wiola_kernels as wk

    models = [m for m in (ref() for ref in _built) if m is not None]
    patched = [m for m in models if wk.is_patched(m)]
    inside = {id(sub) for m in patched for sub in m.modules()}  # covered by a patched outer model
    escaped = [m for m in models if not wk.is_patched(m) and id(m) not in inside and _family_model(m)]
    item.user_properties.append(("wiola_patched", len(patched)))
    item.user_properties.append(("wiola_unpatched", len(escaped)))
    yield
