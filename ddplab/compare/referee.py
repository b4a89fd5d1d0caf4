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

import torch

from ddplab.records import record

__all__ = ["ROUNDING_MARGIN", "BUG_MARGIN", "MEASURED_MAX", "MODEL", "QUANTITIES", "distance_records",
           "deviation_table", "classify_deviation", "squared_difference"]

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


#: Elements of a difference computed at once: its float64 chunk stays in cache, ~9× faster on a 5M-element
#: parameter than one float64 difference of the whole tensor.
CHUNK = 1 << 18


def squared_difference(x: torch.Tensor, truth: torch.Tensor) -> float:
    """‖x − truth‖² summed in float64 a chunk at a time (NaN or inf where a difference is not finite)."""
    x, truth = x.reshape(-1), truth.reshape(-1)
    n = x.numel()
    diff = torch.empty(min(n, CHUNK), dtype=torch.float64)
    wide = torch.empty_like(diff) if truth.dtype != torch.float64 else None
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        d, t = diff[:stop - start], truth[start:stop]
        if wide is not None:   # the difference of two float32 values is exact only in float64
            t = wide[:stop - start].copy_(t)
        torch.sub(x[start:stop], t, out=d)
        total += torch.dot(d, d)
    return float(total)


def _squared(x: torch.Tensor, truth: torch.Tensor) -> float:
    """‖x − truth‖² in float64, equal infinities and NaNs at the same places counting as equal;
    inf when another difference is not finite."""
    squared = squared_difference(x, truth)
    if math.isfinite(squared):   # every difference finite: one pass, no separate check
        return squared
    x, truth = x.reshape(-1), truth.reshape(-1).to(torch.float64)
    diff = x - truth
    if not bool(torch.isfinite(diff).all()):
        # Only here can inf − inf or NaN − NaN stand for equal values: mask them and look again.
        wide = x.to(torch.float64)
        same = (wide == truth) | (torch.isnan(wide) & torch.isnan(truth))
        diff = torch.where(same, torch.zeros_like(diff), diff)
        if not bool(torch.isfinite(diff).all()):
            return math.inf
    return float(torch.linalg.vector_norm(diff)) ** 2


def _ratio(squared: float, scale: float) -> float:
    """√squared / scale: 0 for no difference, inf for an infinite one or a zero scale."""
    if squared == 0.0:
        return 0.0
    if math.isinf(squared):
        return math.inf
    return math.sqrt(squared) / scale if scale > 0 else math.inf


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
    reference = _with_missing(reference, truth) if reference is not None else None
    others = {rank: _with_missing(other, truth) for rank, other in sorted((others or {}).items())}
    # Per parameter, then the whole model from the parameters' squared distances: never a flat copy
    # of the model (in float64, twice its size) per comparison.
    rows = []  # (param, squared distances by what is compared, rank -> bitwise equal to rank 0)
    for name in names:
        t, c = truth[name], run[name]
        # The same tensor given twice (a reference run judged as its own band and reference) is measured once.
        memo: dict[tuple[int, int], float] = {}

        def squared_of(x, y):
            if x is y:
                return 0.0
            if (id(x), id(y)) not in memo:
                memo[id(x), id(y)] = _squared(x, y)
            return memo[id(x), id(y)]

        flat = t.reshape(-1).to(torch.float64)
        squared = dict(truth=float(torch.dot(flat, flat)), band=squared_of(band_run[name], t), run=squared_of(c, t))
        if reference is not None:
            squared["reference"] = squared_of(c, reference[name])
        equal = {}
        for rank, other in others.items():
            o = other[name]
            # Ranks that hold the same bits (DDP's promise) are at distance 0 without a float64 copy.
            equal[rank] = o.dtype == c.dtype and o.shape == c.shape and bool(torch.equal(o, c))
            squared[rank] = 0.0 if equal[rank] else squared_of(o, c)
        rows.append((name, squared, equal))
    compared = ["truth", "band", "run", *(["reference"] if reference is not None else []), *others]
    model = {key: sum(squared[key] for _, squared, _ in rows) for key in compared}
    rows.append((MODEL, model, {rank: all(row[2][rank] for row in rows) for rank in others}))
    model_scale = math.sqrt(model["truth"])
    band_model = _ratio(model["band"], model_scale)
    out = []
    base = dict(step=step, config=config, quantity=quantity)

    def emit(metric, value, param, rank=0, **extra):
        out.append(record(metric, value, rank=rank, param=param, **base, **extra))

    for name, squared, equal in rows:
        scale = model_scale if name == MODEL else (math.sqrt(squared["truth"]) or model_scale)
        b = band_model if name == MODEL else max(_ratio(squared["band"], scale), band_model)
        d = _ratio(squared["run"], scale)
        emit("distance_to_truth", d, name)
        emit("band", b, name, band_run=band_label, unit_roundoff=unit_roundoff)
        emit("deviation", _deviation(d, b), name)
        if reference is not None:
            emit("distance_to_reference", _ratio(squared["reference"], scale), name)
        for rank in others:
            emit("rank_distance", _ratio(squared[rank], scale), name, rank=rank,
                 bitwise_equal=equal[rank])
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
