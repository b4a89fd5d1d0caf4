"""Every case notebook is clean and its parameters cell mirrors its case module."""
from __future__ import annotations

import ast
import json
import pathlib

import papermill
import pytest

from ddplab.cases import CASES, get_case

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
#: Parameters every case notebook has besides its case's own.
IO_PARAMETERS = {"results_dir": None, "run_dir": None}


def _all_notebooks():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", _all_notebooks(), ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, path.name


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_cell_mirrors_the_case(case):
    path = NOTEBOOKS / CASES[case][1]
    assert path.exists(), f"case {case!r} has no notebook {path.name}"
    nb = json.loads(path.read_text())
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    inspected = papermill.inspect_notebook(str(path))
    module = get_case(case)
    expected = {**module.PARAMETERS.defaults(), **IO_PARAMETERS}
    assert set(inspected) == set(expected)
    for name, info in inspected.items():
        assert ast.literal_eval(info["default"]) == expected[name], name
        assert info["help"], f"parameter {name!r} needs a trailing '# help' comment"
    # Quick mode must be valid parameters of the case.
    module.PARAMETERS.validate(module.QUICK)
