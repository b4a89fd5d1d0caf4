"""The ``Example::`` blocks in ddplab.numerics' docstrings run and print what they claim."""
from __future__ import annotations

import doctest
import importlib

import pytest
import torch

import ddplab.numerics as numerics

MODULES = ["fpformat", "contributions", "exact", "orders", "ulp", "bounds", "accuracy", "accumulation", "accumulators",
           "fixed_point"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"ddplab.numerics.{name}")
    names = {key: getattr(numerics, key) for key in numerics.__all__}
    result = doctest.testmod(module, extraglobs={"torch": torch, **names},
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
