"""Non-finite values: where a gradient or parameter first became NaN or Inf, as a finding.

A NaN compares unequal to itself and poisons every distance after it, so
the steps from the first non-finite value on are not judged: the verdict
rests on the steps before it, and says where the values stopped being
finite -- the first step, rank and parameter -- and whether the
single-process reference does the same there. If it does, the data or the
model produce it, not distribution; if it does not, the configuration made
a value non-finite that one process keeps finite: a bug.

Records: ``nonfinite`` (value: the number of non-finite elements) at the
first step of each rank of the configuration (``run="configuration"``) and
of the reference (``run="reference"``, rank 0), with ``quantity`` and ``param``.
"""
from __future__ import annotations

import torch

from ddplab.records import record

__all__ = ["first_nonfinite", "nonfinite_records", "finite_steps"]


def first_nonfinite(captures: list[dict]) -> dict | None:
    """The first (step, quantity, param, count) of ``captures`` holding a NaN or Inf, or None."""
    for step, cap in enumerate(captures):
        for quantity in ("grads", "params"):
            for name, t in cap.get(quantity, {}).items():
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad = int((~torch.isfinite(t)).sum())
                    return dict(step=step, quantity=quantity[:-1], param=name, count=bad)
    return None


def finite_steps(config_ranks: list[list[dict]], reference: list[dict]) -> tuple[int | None, list[dict]]:
    """How many leading steps are finite everywhere (None: all), and the ``nonfinite`` records."""
    found = [(r, first_nonfinite(caps)) for r, caps in enumerate(config_ranks)]
    ref = first_nonfinite(reference)
    out = [nonfinite_records(f, rank=r, run="configuration") for r, f in found if f is not None]
    if ref is not None:
        out.append(nonfinite_records(ref, rank=0, run="reference"))
    steps = [f["step"] for _, f in found if f is not None] + ([ref["step"]] if ref is not None else [])
    return (min(steps) if steps else None), out


def nonfinite_records(found: dict, **labels) -> dict:
    return record("nonfinite", found["count"], step=found["step"], quantity=found["quantity"],
                  param=found["param"], **labels)
