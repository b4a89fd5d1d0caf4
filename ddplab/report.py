"""Batch execution of the case notebooks (papermill) into reports/."""
from __future__ import annotations

import pathlib
import sys

__all__ = ["case_notebooks", "run_report"]

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def case_notebooks(directory: pathlib.Path = NOTEBOOK_DIR) -> list[pathlib.Path]:
    """The numbered case notebooks (``01_*.ipynb`` ...), the explorer excluded."""
    return sorted(p for p in directory.glob("[0-9][0-9]_*.ipynb") if not p.name.startswith("00_"))


def run_report(opts) -> int:
    notebooks = case_notebooks()
    if not notebooks:
        print(f"ddplab report: no case notebooks in {NOTEBOOK_DIR} yet; nothing was run",
              file=sys.stderr)
        return 1
    print("ddplab report: the batch runner is not built yet; nothing was run", file=sys.stderr)
    return 1
