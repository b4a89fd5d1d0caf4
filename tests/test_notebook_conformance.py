"""Every notebook is committed clean (the parameters cells are checked in test_case_contract)."""
from __future__ import annotations

import json
import pathlib

import pytest


NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def _all_notebooks():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", _all_notebooks(), ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, path.name
