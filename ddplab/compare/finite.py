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

from typing import Callable

import torch

from ddplab.compare.captures import StepRecords, has_step
from ddplab.records import record

__all__ = ["nonfinite_at", "nonfinite_records", "nonfinite_steps"]


def nonfinite_at(capture: dict, finite: dict | None = None) -> dict | None:
    """The first (quantity, param, count) of one step's capture holding a NaN or Inf, or None.
    ``finite``: the elements of this step found finite already, by where they are in memory (another
    rank's capture read back as rank 0's tensors), filled in as tensors are looked at."""
    finite = {} if finite is None else finite
    for quantity in ("grads", "params"):
        for name, t in capture.get(quantity, {}).items():
            where = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if finite.get(where):
                continue
            # A finite sum is a finite tensor (a NaN or an Inf reaches the sum), ~25× cheaper than
            # isfinite on every element; a sum that overflows is looked at element by element.
            if t.is_floating_point() and not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                return dict(quantity=quantity[:-1], param=name, count=bad)
            finite[where] = True
    return None


def nonfinite_steps(config_ranks: list, cut: Callable[[int], None]) -> StepRecords:
    """A step at a time: where each rank of the configuration first holds a NaN or Inf (a ``nonfinite``
    record each), and ``cut(step)`` at the first such step of any of them, so that no other source
    judges it or a step after it. Reads ``config_ranks`` (``[r][step]``) past that cut, to say where each
    rank turns non-finite. (The reference's first such step is found where it trains:
    :mod:`ddplab.compare.reference_judge`.)"""
    found: set = set()
    step, cut_at = 0, None
    while True:
        looked = [(r, caps) for r, caps in enumerate(config_ranks) if r not in found and has_step(caps, step)]
        if not looked:
            return
        out = []
        finite: dict = {}   # the step's tensors found finite: rank 0's, where a rank's capture reads back as them
        for r, caps in looked:
            bad = nonfinite_at(caps[step], finite)
            if bad is not None:
                found.add(r)
                out.append(nonfinite_records(dict(bad, step=step), rank=r, run="configuration"))
        if out and cut_at is None:
            cut_at = step
            cut(step)
        yield out
        step += 1


def nonfinite_records(found: dict, **labels) -> dict:
    return record("nonfinite", found["count"], step=found["step"], quantity=found["quantity"],
                  param=found["param"], **labels)
