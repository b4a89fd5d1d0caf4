"""The referee: is a configuration's difference from the reference rounding, or a bug?

The reference itself is not exact: it rounds too, just differently. So the
referee measures every run against a *truth* -- the same training in
float64 on the same batches -- and compares distances from it:

    d(x) = ‖x − x_truth‖ / ‖x_truth‖      per parameter tensor, step and
                                            quantity (gradient, parameter)

The reference's own distance, ``d_ref``, is how far rounding alone moves a
correct single-process run; the *band* of a parameter is
``max(d_ref(param), d_ref(model))`` (the whole model's distance bounds it
from below, so that a parameter the reference happened to get nearly exact
does not make a zero band). A configuration's *deviation* is
``d_config / band``: rounding of the same order as the reference's own is
O(1), whatever the batch split, order of reduction or accumulation. For a
mixed-precision configuration the band comes from a single-process
reference that computes in the same precision (``reference bfloat16``):
bfloat16 moves results ~65 000 times farther than float32, and that is
rounding too.

The rule (per configuration, over every step, parameter and quantity):

* ``rounding``  -- max deviation ≤ :data:`ROUNDING_MARGIN`;
* ``bug``       -- max deviation ≥ :data:`BUG_MARGIN` (orders of magnitude beyond);
* ``undetermined`` -- in between (beyond every correct run measured, not by
  orders of magnitude: for a low precision the band can be so wide that a
  factor-2 bug reaches only this far), or when the reference reproduces the
  truth to within one rounding of its dtype (no band to measure against,
  ``degenerate``), or when the truth itself is not finite.

How the margins were set (``bench/bench_compare.py --calibrate`` prints
the numbers): the largest deviation on *correct* code, over 20 seeds of the
shipped digits example × {MLP, deeper MLP, GroupNorm CNN} × {DDP W=2, W=3,
W=4, accumulation k=2 and k=4, Fabric, FSDP2 float32, FSDP2 bfloat16 (against
``reference bfloat16``)} × 6 steps, gradients and parameters, every
parameter, was MEASURED_MAX (see :data:`MEASURED_MAX`). ROUNDING_MARGIN gives
that a headroom of 10×; BUG_MARGIN is 100× beyond ROUNDING_MARGIN. The planted
bugs (factor W, factor k, a dropped rank, zero_grad inside accumulation)
reach deviations of 1e5–1e8 in float32.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from ddplab.records import record

__all__ = ["ROUNDING_MARGIN", "BUG_MARGIN", "MEASURED_MAX", "MODEL", "QUANTITIES", "distance_records",
           "deviation_table", "classify_deviation"]

#: Largest deviation measured on correct code (see the module docstring).
MEASURED_MAX = 10.0
#: Deviation up to which a configuration is rounding: MEASURED_MAX with 10× headroom.
ROUNDING_MARGIN = 10.0 * MEASURED_MAX
#: Deviation from which a configuration is a bug: 100× beyond ROUNDING_MARGIN.
BUG_MARGIN = 100.0 * ROUNDING_MARGIN
#: The ``param`` label of whole-model rows.
MODEL = "(model)"
#: What is compared per step: the gradient at optimizer.step() and the parameters after it.
QUANTITIES = ("grad", "param")


def _flat(tensors: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1).to(torch.float64) for n in names]) if names else \
        torch.zeros(0, dtype=torch.float64)


def _rel(x: torch.Tensor, truth: torch.Tensor, scale: float) -> float:
    """‖x − truth‖ / scale, with equal infinities/NaNs at the same places counting as equal."""
    diff = x.to(torch.float64) - truth
    same = (x.to(torch.float64) == truth) | (torch.isnan(x) & torch.isnan(truth))
    diff = torch.where(same, torch.zeros_like(diff), diff)
    if not bool(torch.isfinite(diff).all()):
        return math.inf
    num = float(torch.linalg.vector_norm(diff))
    if num == 0.0:
        return 0.0
    return num / scale if scale > 0 else math.inf


def _with_missing(values: dict | None, like: dict) -> dict:
    """``values`` with a zero tensor for every tensor of ``like`` it lacks (a missing gradient is zero)."""
    values = dict(values or {})
    for name, t in like.items():
        if name not in values:
            values[name] = torch.zeros_like(t)
    return values


def distance_records(step: int, quantity: str, truth: dict, band_run: dict, run: dict,
                     reference: dict | None, *, config: str, others: dict[int, dict] | None = None,
                     band_label: str = "reference", unit_roundoff: float = 0.0) -> list[dict]:
    """The referee's numbers for one step and quantity of one run, as tidy records.

    ``truth``, ``band_run`` (the precision-matched reference), ``run`` (the
    configuration's rank 0) and ``reference`` map parameter names to
    tensors. Per parameter and for the whole model (``param="(model)"``):
    ``distance_to_truth`` and ``band`` (both relative to ‖truth‖),
    ``deviation`` (distance / band), ``distance_to_reference`` (relative
    to ‖truth‖), and, for every other rank in ``others``, ``rank_distance``
    (its distance from rank 0, relative to ‖truth‖, with ``rank``).
    ``band`` rows carry ``band_run`` (which reference gave the band) and
    ``unit_roundoff`` (of the dtype that reference computes in).
    """
    names = [n for n in truth if truth[n] is not None]
    run = _with_missing(run, truth)
    band_run = _with_missing(band_run, truth)
    total = _flat(truth, names)
    model_scale = float(torch.linalg.vector_norm(total))
    band_model = _rel(_flat(band_run, names), total, model_scale)
    out = []
    base = dict(step=step, config=config, quantity=quantity)

    def emit(metric, value, param, rank=0, **extra):
        out.append(record(metric, value, rank=rank, param=param, **base, **extra))

    for name in names + [MODEL]:
        if name == MODEL:
            t, c = total, _flat(run, names)
            b, scale = band_model, model_scale
            ref = _flat(_with_missing(reference, truth), names) if reference is not None else None
        else:
            t = truth[name].reshape(-1).to(torch.float64)
            c = run[name].reshape(-1)
            scale = float(torch.linalg.vector_norm(t)) or model_scale
            b = max(_rel(band_run[name].reshape(-1), t, scale), band_model)
            ref = _with_missing(reference, truth)[name].reshape(-1) if reference is not None else None
        d = _rel(c, t, scale)
        emit("distance_to_truth", d, name)
        emit("band", b, name, band_run=band_label, unit_roundoff=unit_roundoff)
        emit("deviation", _deviation(d, b), name)
        if ref is not None:
            emit("distance_to_reference", _rel(c, ref.to(torch.float64), scale), name)
        for rank, other in sorted((others or {}).items()):
            other = _with_missing(other, truth)
            o = _flat(other, names) if name == MODEL else other[name].reshape(-1)
            emit("rank_distance", _rel(o, c.to(torch.float64), scale), name, rank=rank,
                 bitwise_equal=bool(torch.equal(o, c)) if o.dtype == c.dtype else False)
    return out


def _deviation(distance: float, band: float) -> float:
    if distance == 0.0:
        return 0.0
    if band == 0.0 or math.isinf(distance):
        return math.inf
    return distance / band


def deviation_table(frame, config: str):
    """The ``deviation`` rows of ``config`` (rank 0): step, param, quantity, value."""
    rows = frame[(frame["metric"] == "deviation") & (frame["config"] == config)]
    return rows[["step", "param", "quantity", "value"]]


def classify_deviation(max_deviation: float) -> str:
    """The rule on one number: "rounding", "bug" or "undetermined" (between the margins)."""
    if max_deviation <= ROUNDING_MARGIN:
        return "rounding"
    if max_deviation >= BUG_MARGIN:
        return "bug"
    return "undetermined"
