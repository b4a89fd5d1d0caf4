"""The cases: one module per seed report.

Each case module defines the same small protocol, so that the notebook, the
batch report, the explorer and torchrun all drive it the same way:

``NAME``, ``TITLE``, ``SEED`` (the report's file in shared/seeds), ``NOTEBOOK``
    identification.
``PARAMETERS``
    a :class:`ddplab.parameters.ParameterSet`; the notebook's papermill
    ``parameters`` cell mirrors it name for name and default for default.
``QUICK``
    overrides that make a run take seconds (``ddplab report --quick``, tests).
``check_params(values)``
    ``PARAMETERS.validate`` plus the rules that tie parameters together;
    returns the full parsed parameters or raises ValueError naming the
    parameter. Everything that starts a case calls it first.
``worker(params)``
    what every rank runs for the current world size; it reports through
    :func:`ddplab.emit` and is launcher-agnostic (notebook launcher or torchrun).
``run(params, progress=True)``
    validates ``params`` and launches the ranks (one launch per world size
    where the case compares several), returning the tidy records DataFrame.
``verdict(records, params)``
    the verdict rule: a :class:`ddplab.verdict.Verdict` computed from the records.
``figures(records, params)``
    the case's figures (matplotlib Figures, most telling first), for the
    explorer; the notebook shows the same ones cell by cell.
"""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["CASES", "get_case", "case_names"]

#: Case name -> (module, notebook file). Order is the report order.
CASES = {
    "backend_divergence": ("ddplab.cases.backend_divergence", "01_backend_divergence.ipynb"),
    "half_precision": ("ddplab.cases.half_precision", "02_half_precision_weights.ipynb"),
    "device_roundtrip": ("ddplab.cases.device_roundtrip", "03_device_roundtrip.ipynb"),
    "allreduce_correctness": ("ddplab.cases.allreduce_correctness", "04_allreduce_correctness.ipynb"),
}


def case_names() -> list[str]:
    return list(CASES)


def get_case(name: str) -> ModuleType:
    """The case module called ``name``; ValueError naming the known cases otherwise."""
    if name not in CASES:
        raise ValueError(f"unknown case {name!r}; known cases: {', '.join(CASES)}")
    return importlib.import_module(CASES[name][0])
