"""The float64 questions: is a computation, run in float64, one process's computation?

In float64 rounding moves a result by ~1e-16 relative, so a distance from
the float64 single-process truth of more than :data:`SEMANTIC_TOLERANCE`
(1e-9) is not rounding: the computation is another one. Two runs are asked:

* ``semantic`` -- ddplab's emulation of the data-parallel promise (each
  rank's share, k micro-batches each divided by k, the mean over ranks), run
  in one process beside the truth and judged there as both train
  (:class:`PromiseJudge`): the parent receives records, not the promise's
  tensors;
* ``float64`` -- the configuration itself, the user's own step, wrap and
  hooks on W real ranks, with model and batches in float64
  (:data:`ddplab.compare.runners.VARIANTS`). It needs no specification of
  what the step promises, and catches a semantic difference whether or not
  it depends on the rank.

Where the step still computes in a lower precision in float64 -- a
compression hook, a collective in bfloat16, a ``MixedPrecisionPolicy`` --
the float64 run is judged at that precision: the tolerance becomes
:func:`precision_tolerance` of the lowest dtype it used, and the finding
says so. (autocast leaves float64 tensors alone, so an autocast step runs
wholly in float64 here.)

Records: ``{name}_distance`` = ‖run − truth‖ / max(‖truth‖, max(1e-5, tolerance) ‖truth of
the whole model‖) per step, quantity and parameter (label ``tolerance``); at the first step beyond the tolerance,
``{name}_difference`` with the kind the piece fit names (``factor``,
``missing_contribution``, ``other``).
"""
from __future__ import annotations

import math

import torch

from ddplab.compare.captures import RecentSteps, StepRecords, common_steps
from ddplab.compare.referee import squared_difference
from ddplab.compare.setup import Setup
from ddplab.compare.streaming import NEXT_STEP_READS
from ddplab.numerics import unit_roundoff
from ddplab.records import record

__all__ = ["SEMANTIC_TOLERANCE", "distance_records", "precision_tolerance", "lowest_precision", "PromiseJudge"]

#: Relative distance of a float64 run from the float64 truth beyond which it is not one process's
#: computation: ~1e7 × float64's unit roundoff (1.1e-16), where float64 rounding stayed below 1e-13
#: on correct runs (``tests/test_compare_replay.py``), and 1/60 of float32's unit roundoff, so no
#: float32 rounding reaches it while a summed loss, per-rank statistics or local negatives stand
#: 1e-4 and more above one process.
SEMANTIC_TOLERANCE = 1e-9


def precision_tolerance(dtype: torch.dtype | None, world: int) -> float:
    """The float64 run's tolerance when it computed partly in ``dtype``: 4·(W+1)·u(dtype).

    Rounding a gradient to ``dtype`` and summing W of them there moves it by at most ~(W+1)·u
    relative per element; 4× that is headroom for the steps that follow. None: SEMANTIC_TOLERANCE.
    """
    if dtype is None or dtype == torch.float64:
        return SEMANTIC_TOLERANCE
    return max(SEMANTIC_TOLERANCE, 4.0 * (world + 1) * unit_roundoff(dtype))


def lowest_precision(dtype_names) -> torch.dtype | None:
    """The floating dtype with the largest unit roundoff among ``dtype_names`` (None if none is below float64)."""
    dtypes = [getattr(torch, name) for name in dtype_names if isinstance(getattr(torch, str(name), None), torch.dtype)]
    dtypes = [d for d in dtypes if d.is_floating_point and d != torch.float64]
    return max(dtypes, key=unit_roundoff) if dtypes else None


#: A parameter whose true value is this small against the whole model's (a bias before a
#: normalization, whose gradient is exactly zero in exact arithmetic) is measured against this
#: fraction of the model's norm instead: its own norm is rounding noise, ~1e-16 of the model's.
NEGLIGIBLE = 1e-5


def _squared_norm(x: torch.Tensor) -> float:
    x = x.reshape(-1)
    x = x if x.dtype == torch.float64 else x.to(torch.float64)
    return float(torch.dot(x, x))


def _distance(squared_diff: float, squared_scale: float, floor: float = 0.0) -> float:
    """‖a − b‖ / max(‖a‖, floor) from the squared norms; inf where either is not finite."""
    scale, diff = max(math.sqrt(squared_scale), floor), math.sqrt(squared_diff)
    if not (math.isfinite(diff) and math.isfinite(scale)):
        return math.inf
    return 0.0 if diff == 0 else (diff / scale if scale > 0 else math.inf)


def distance_records(name: str, setup: Setup, shape: tuple[int, int, int], run: list[dict], caps: dict,
                     tolerance: float, **labels) -> StepRecords:
    """``{name}_distance`` of the float64 captures ``run`` from the truth (``caps["truth"]``), per step,
    quantity and parameter; and ``{name}_difference`` at the first step beyond ``tolerance``, fitted on
    the pieces of ``shape`` = (W, k, pieces) (:func:`ddplab.compare.localization.semantic_fit`)."""
    truth = caps["truth"]
    first = None
    for step in common_steps(truth, run):
        out = []
        for quantity in ("grad", "param"):
            t, p = truth[step][quantity + "s"], run[step][quantity + "s"]
            names = [n for n in t if n in p]
            worst = 0.0
            # Per parameter, and the whole model from their squared norms (never a float64 copy of it).
            scales = {n: _squared_norm(t[n]) for n in names}
            diffs = {n: squared_difference(p[n], t[n]) for n in names}
            scales["(model)"], diffs["(model)"] = sum(scales.values()), sum(diffs.values())
            whole = math.sqrt(scales["(model)"])
            for param in names + ["(model)"]:
                # A run judged at a lower precision leaves a zero-gradient parameter that precision's
                # noise, not float64's: its floor grows with the tolerance.
                d = _distance(diffs[param], scales[param], max(NEGLIGIBLE, tolerance) * whole)
                out.append(record(f"{name}_distance", d, step=step, quantity=quantity, param=param,
                                  tolerance=tolerance, **labels))
                worst = max(worst, d)
            if worst > tolerance and first is None:
                first = (step, quantity, worst)
            del t, p   # nothing of the step is held while the generator waits for the next
        if first is not None and first[0] == step:
            # Named at its step, while the captures it is fitted on exist (they are deleted once judged).
            out.append(_difference(name, setup, shape, run, caps, *first, labels))
        yield out


def _difference(name: str, setup: Setup, shape: tuple[int, int, int], run, caps: dict, step: int,
                quantity: str, worst: float, labels: dict) -> dict:
    """``{name}_difference`` at ``step``: how far, and what the piece fit names it."""
    from ddplab.compare.localization import semantic_fit

    fit = dict(kind="other", factor=math.nan, factor_name="", missing=[], residual=math.nan)
    grads = run[step]["grads"]
    if all(bool(torch.isfinite(g).all()) for g in grads.values()):  # no solver on non-finite input
        fit = semantic_fit(setup, shape, step, {n: g.double() for n, g in grads.items()}, caps)
    return record(f"{name}_difference", worst, step=step, quantity=quantity, kind=fit["kind"],
                  factor=fit["factor"], factor_name=fit["factor_name"] or "",
                  missing=",".join(map(str, fit["missing"])), residual=fit["residual"], **labels)


class PromiseJudge:
    """The semantic question, asked where the float64 promise and the float64 truth both train (the
    reference process): after each step, ``judge(step, truth, promise)`` (the two runs' captures of it)
    returns ``semantic_distance`` of the promise from the truth per quantity and parameter, and
    ``semantic_difference`` at the first step beyond :data:`SEMANTIC_TOLERANCE`, labelled with the
    promise's run label; the parent gives them to each configuration that promises it."""

    def __init__(self, setup: Setup, label: str, world_size: int, k: int, steps: int):
        self.truth, self.promise = RecentSteps(steps), RecentSteps(steps)
        self._records = distance_records("semantic", setup, (world_size, k, world_size * k), self.promise,
                                         {"truth": self.truth}, SEMANTIC_TOLERANCE, config=label)

    def __call__(self, step: int, truth: dict, promise: dict) -> list[dict]:
        self.truth.put(step, truth)
        self.promise.put(step, promise)
        records = next(self._records)
        # Judged: only the fit at the next step reads of it again, the truth's parameters.
        self.truth.judged(step, NEXT_STEP_READS["truth"])
        self.promise.judged(step)
        return records
