"""Every notebook is committed clean and opens on ddplab's kernel (the parameters cells are
checked in test_case_contract)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import sys

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


@pytest.mark.parametrize("path", _all_notebooks(), ids=lambda p: p.name)
def test_opens_on_ddplabs_kernel(path):
    from ddplab.notebook import KERNELSPEC

    assert json.loads(path.read_text())["metadata"]["kernelspec"] == KERNELSPEC, path.name


def test_generated_notebooks_and_make_setup_use_the_same_kernel():
    from ddplab.notebook import KERNELSPEC, template_notebook

    assert dict(template_notebook("half_precision").metadata["kernelspec"]) == KERNELSPEC
    makefile = (NOTEBOOKS.parent / "Makefile").read_text()
    register = re.search(r"ipykernel install --sys-prefix --name (\S+) --display-name \"([^\"]+)\"", makefile)
    assert register, "make setup registers no kernel"
    assert register.groups() == (KERNELSPEC["name"], KERNELSPEC["display_name"])


def test_a_report_runs_a_notebook_whose_kernel_is_not_registered(tmp_path):
    """Reports execute with ipykernel's own "python3" (this interpreter), so they work on a machine
    where `make setup` never registered "ddplab"; the notebook's kernelspec is for JupyterLab."""
    import nbformat

    from ddplab.notebook_run import execute_notebook

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "no-such-kernel-here", "display_name": "missing", "language": "python"}
    params = nbformat.v4.new_code_cell("results_dir = None")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell("import sys\nprint(sys.executable)")]
    nbformat.write(nb, tmp_path / "in.ipynb")
    outcome = execute_notebook(tmp_path / "in.ipynb", tmp_path / "out.ipynb", parameters={}, timeout=120)
    assert outcome.status == "ok", outcome
    printed = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[-1].outputs[0]["text"].strip()
    assert os.path.realpath(printed) == os.path.realpath(sys.executable)
