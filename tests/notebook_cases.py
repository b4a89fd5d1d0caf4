"""A case made of a notebook alone, for the report tests (a helper module, not tests)."""
from __future__ import annotations

import pathlib

from ddplab.cases import Case
from ddplab.parameters import ParameterSet


def notebook_case(name: str, notebook: pathlib.Path, parameters: ParameterSet = ParameterSet([]), *,
                  title: str | None = None, quick: dict | None = None) -> Case:
    """A :class:`~ddplab.cases.Case` called ``name`` whose notebook is ``notebook`` (absolute)."""
    attributes = {"name": name, "title": title or name, "notebook": str(pathlib.Path(notebook).resolve()),
                  "parameters": parameters, "quick": dict(quick or {})}
    return type("NotebookCase", (Case,), attributes)()
