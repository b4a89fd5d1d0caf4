"""Measure a reduction's result against the exact value: ulps, errors, and the rounding verdict.

:func:`measure` answers "how wrong is this result, and can rounding explain
it?" for one reduced tensor: its distance in ulps from the correctly rounded
value, its absolute error against the exact value (not the rounded one), the
error relative to Σ|x_r| (the scale rounding errors live on), and the
largest ratio of error to :func:`~ddplab.numerics.bounds.rounding_bound`.
:func:`error_records` turns the same numbers into tidy
:mod:`ddplab.records` rows for plots, verdicts and reports.

Example::

    >>> x = torch.randn(4, 1000)
    >>> m = measure(reduce(x, "gloo_ring"), x, "gloo_ring")
    >>> m["classification"], m["max_bound_ratio"] <= 1.0
    ('rounding', True)
"""
from __future__ import annotations

import math

import torch

from ddplab.numerics.bounds import abs_sum, classify, rounding_bound
from ddplab.numerics.contributions import as_contributions
from ddplab.numerics.exact import exact_parts, round_to_dtype
from ddplab.numerics.fpformat import float_format, parse_dtype
from ddplab.numerics.ulp import ulp_distance
from ddplab.records import record

__all__ = ["METRICS", "measure", "error_records"]

# The numeric entries of measure()'s dict, in the order error_records emits them.
METRICS = ("numel", "max_ulp", "mean_ulp", "frac_correctly_rounded", "max_abs_error",
           "max_rel_error", "max_bound_ratio", "within_bound")


def _reference_parts(c, op, reference):
    if reference is None:
        return exact_parts(c, op)
    if isinstance(reference, tuple):
        hi, lo = reference
        return hi.to(torch.float64).reshape(-1), lo.to(torch.float64).reshape(-1)
    hi = torch.as_tensor(reference).to(torch.float64).reshape(-1)
    return hi, torch.zeros_like(hi)


def measure(result, contributions, order: str | None = None, *, op: str = "sum", reference=None,
            averaging: str | None = None, accumulate=None, **options) -> dict:
    """Return the accuracy of ``result`` (the reduction of ``contributions``) as a dict.

    Keys: ``numel``; ``max_ulp`` and ``mean_ulp`` (|distance| to the
    correctly rounded value in result's dtype); ``frac_correctly_rounded``;
    ``max_abs_error`` (against the exact value); ``max_rel_error`` (max of
    |error| / Σ|x_r|); with ``order`` also ``max_bound_ratio`` (max of
    |error| / rounding bound), ``within_bound`` (1.0 or 0.0) and
    ``classification`` ("rounding" or "not rounding"); without, those are
    NaN and None. ``op``, ``averaging``, ``accumulate`` and ``options``
    describe how the result was computed, as for
    :func:`ddplab.numerics.reduce`. ``reference`` may carry the exact value
    already computed: ``exact_parts(contributions, op)``'s ``(hi, lo)``.
    """
    c = as_contributions(contributions)
    if not isinstance(result, torch.Tensor):
        raise ValueError(f"result must be a tensor, got {type(result).__name__}")
    result = result.detach().cpu().reshape(-1)
    dtype = parse_dtype(result.dtype)
    if result.numel() != c.numel:
        raise ValueError(f"result has {result.numel()} elements, the contributions {c.numel}")
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    hi, lo = _reference_parts(c, op, reference)
    if hi.numel() != c.numel:
        raise ValueError(f"reference has {hi.numel()} elements, the contributions {c.numel}")
    out = {"numel": c.numel}
    if c.numel == 0:
        out.update(max_ulp=0, mean_ulp=0.0, frac_correctly_rounded=1.0, max_abs_error=0.0,
                   max_rel_error=0.0, max_bound_ratio=0.0 if order else math.nan,
                   within_bound=1.0 if order else math.nan, classification="rounding" if order else None)
        return out
    rounded = round_to_dtype(hi, lo, dtype)
    ulps = ulp_distance(result, rounded).abs()
    y = result.to(torch.float64)
    # Same infinity or both NaN: nothing to measure there (y - hi would be NaN).
    same = (y == hi) | (torch.isnan(y) & torch.isnan(hi))
    error = torch.where(same, torch.zeros_like(y), ((y - hi) - lo).abs())
    error = torch.where(torch.isnan(error), torch.full_like(error, math.inf), error)
    total = abs_sum(c)
    rel = torch.where(error == 0, torch.zeros_like(error), error / total)
    out.update(
        max_ulp=int(ulps.max()),
        mean_ulp=float(ulps.to(torch.float64).mean()),
        frac_correctly_rounded=float((ulps == 0).to(torch.float64).mean()),
        max_abs_error=float(error.max()),
        max_rel_error=float(rel.max()),
    )
    if order is None:
        out.update(max_bound_ratio=math.nan, within_bound=math.nan, classification=None)
        return out
    bound = rounding_bound(c, order, dtype, op=op, averaging=averaging, accumulate=accumulate,
                           abs_total=total, exact_value=hi.abs(), **options)
    label, ratio = classify(error, bound)
    out.update(max_bound_ratio=ratio, within_bound=float(ratio <= 1.0), classification=label)
    return out


def error_records(result, contributions, order: str | None, *, op: str = "sum", reference=None,
                  averaging: str | None = None, accumulate=None, options: dict | None = None,
                  step: int | None = None, rank: int | None = None, bucket: int | None = None,
                  **labels) -> list[dict]:
    """The :func:`measure` numbers as tidy records, one per metric in :data:`METRICS`.

    Every record carries the labels ``order``, ``op``, ``dtype`` and
    ``world_size`` plus ``labels``; ``options`` are the order's options.

    Example::

        >>> x = torch.randn(3, 10)
        >>> [r["metric"] for r in error_records(reduce(x, "sequential"), x, "sequential", step=0)][:3]
        ['numel', 'max_ulp', 'mean_ulp']
    """
    c = as_contributions(contributions)
    m = measure(result, c, order, op=op, reference=reference, averaging=averaging,
                accumulate=accumulate, **(options or {}))
    base = dict(order=order, op=op, dtype=float_format(result.dtype).name, world_size=c.world_size)
    if averaging is not None:
        base["averaging"] = averaging
    if accumulate is not None:
        base["accumulate"] = float_format(accumulate).name
    base.update(labels)
    return [record(metric, m[metric], step=step, rank=rank, bucket=bucket, **base) for metric in METRICS]
