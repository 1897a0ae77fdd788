"""The Hugging Face side of the model package: the declared transformers floor."""

from __future__ import annotations

import os
import re

import transformers

import wiola

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared(path: str) -> tuple[int, ...]:
    text = open(os.path.join(ROOT, path)).read()
    found = re.findall(r"transformers>=(\d+)\.(\d+)", text)
    assert len(found) == 1, f"{path}: expected one transformers floor, got {found}"
    return tuple(int(x) for x in found[0])


def test_declared_transformers_floor_is_the_one_enforced_and_installed():
    assert _declared("requirements.txt") == _declared("setup.py") == wiola.MIN_TRANSFORMERS
    assert wiola.MIN_TRANSFORMERS >= (5, 0)  # the code uses transformers-5 APIs
    assert wiola._version_tuple(transformers.__version__) >= wiola.MIN_TRANSFORMERS


def test_version_parsing_orders_releases():
    assert wiola._version_tuple("4.57.1") < (5, 24) <= wiola._version_tuple("5.24.0")
    assert wiola._version_tuple("5.30.0.dev0") > (5, 24) > wiola._version_tuple("5.3.0rc1")
