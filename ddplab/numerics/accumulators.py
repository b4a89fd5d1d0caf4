"""Accumulators of limited precision with K partial sums ("lanes"), as vectorized kernels use them.

A reduction kernel that keeps its running sum in the data's dtype loses every
increment below half an ulp of that sum: a float16 sum of squares that has
reached 4.0 (ulp 2^-8) ignores squares below 2^-9 and *stalls*. Vectorized
kernels keep K partial sums: element i goes to lane ``i mod K``, each lane
adds its elements one by one, rounding to the dtype at every step, and the
lanes are combined at the end in the dtype, lane 0 first:
``((lane_0 + lane_1) + lane_2) + ...``. Squares are rounded to the dtype
before they are added, and the norm is the dtype's rounding of the square
root of the combined sum. Every operation is correctly rounded.

This reproduces seed 001's number exactly: the float16 weights of
``nn.Linear(512, 512, bias=False)`` after ``torch.manual_seed(42)`` make
every lane stall at 4.0, so K lanes give ``sqrt(4K)``, and K = 8 gives
``sqrt(32) = 5.65625`` in float16 against a true norm of about 13.08.

Example::

    >>> torch.manual_seed(42)
    <torch._C.Generator object at ...>
    >>> w = torch.nn.Linear(512, 512, bias=False, dtype=torch.float16).weight.detach()
    >>> [lane_norm(w, torch.float16, lanes=k).item() for k in (1, 8)]
    [2.0, 5.65625]
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ddplab.numerics._numba_cache import njit
from ddplab.numerics._rounding import round_scaled
from ddplab.numerics.fpformat import float_format

__all__ = ["lane_partials", "lane_sum", "lane_sum_of_squares", "lane_norm", "running_sum_of_squares"]


@njit(inline="always")
def _rn(v, p, emin, emax):
    # For p <= 24 the float64 result of one operation on dtype values, rounded
    # once more to the dtype, is the correctly rounded operation (53 >= 2p + 2).
    return v if p == 53 else round_scaled(v, 0.0, 0, p, emin, emax)


@njit
def _accumulate(x, lanes, square, p, emin, emax, trace, running):
    """Lane sums of x (float64 holding dtype values); ``running[t, k]`` = lane k after step t if ``trace``."""
    acc = np.zeros(lanes)
    n = x.size
    for step in range((n + lanes - 1) // lanes):
        for k in range(lanes):
            i = step * lanes + k
            if i < n:
                v = x[i]
                if square:
                    v = _rn(v * v, p, emin, emax)
                acc[k] = _rn(acc[k] + v, p, emin, emax)
        if trace:
            running[step, :] = acc
    return acc


@njit
def _combine(partials, p, emin, emax):
    total = partials[0]
    for k in range(1, partials.size):
        total = _rn(total + partials[k], p, emin, emax)
    return total


def _prepare(x: torch.Tensor, dtype, lanes: int):
    if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
        raise ValueError(f"lanes must be a positive int, got {lanes!r}")
    fmt = float_format(x.dtype if dtype is None else dtype)
    values = x.detach().cpu().reshape(-1).to(fmt.dtype)   # the data as the kernel sees it
    if values.numel() == 0:
        raise ValueError("an accumulator needs at least one element")
    return fmt, values.to(torch.float64).contiguous().numpy()


def _to_dtype(values, fmt) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64).to(fmt.dtype)   # exact: already dtype values


def lane_partials(x: torch.Tensor, dtype=None, lanes: int = 1, *, square: bool = False) -> torch.Tensor:
    """Each lane's final sum (of squares with ``square=True``) in ``dtype`` (default: x's): shape [lanes]."""
    fmt, values = _prepare(x, dtype, lanes)
    acc = _accumulate(values, lanes, square, fmt.p, fmt.emin, fmt.emax, False, np.empty((0, lanes)))
    return _to_dtype(acc, fmt)


def lane_sum(x: torch.Tensor, dtype=None, lanes: int = 1) -> torch.Tensor:
    """Sum of x's elements in ``dtype`` with ``lanes`` partial accumulators (a 0-d tensor)."""
    fmt, values = _prepare(x, dtype, lanes)
    acc = _accumulate(values, lanes, False, fmt.p, fmt.emin, fmt.emax, False, np.empty((0, lanes)))
    return _to_dtype(_combine(acc, fmt.p, fmt.emin, fmt.emax), fmt)


def lane_sum_of_squares(x: torch.Tensor, dtype=None, lanes: int = 1) -> torch.Tensor:
    """Sum of the squares of x's elements in ``dtype`` with ``lanes`` partial accumulators."""
    fmt, values = _prepare(x, dtype, lanes)
    acc = _accumulate(values, lanes, True, fmt.p, fmt.emin, fmt.emax, False, np.empty((0, lanes)))
    return _to_dtype(_combine(acc, fmt.p, fmt.emin, fmt.emax), fmt)


def lane_norm(x: torch.Tensor, dtype=None, lanes: int = 1) -> torch.Tensor:
    """Euclidean norm in ``dtype`` with ``lanes`` accumulators: RN(sqrt(lane_sum_of_squares))."""
    fmt, values = _prepare(x, dtype, lanes)
    acc = _accumulate(values, lanes, True, fmt.p, fmt.emin, fmt.emax, False, np.empty((0, lanes)))
    total = _combine(acc, fmt.p, fmt.emin, fmt.emax)
    root = math.sqrt(total) if fmt.p == 53 else _rn(math.sqrt(total), fmt.p, fmt.emin, fmt.emax)
    return _to_dtype(root, fmt)


def running_sum_of_squares(x: torch.Tensor, dtype=None, lanes: int = 1) -> torch.Tensor:
    """Every lane's running sum of squares after each step: shape [ceil(n / lanes), lanes], in ``dtype``.

    Row t holds the lanes after elements ``[0, (t+1)*lanes)`` have been
    added; plotted against the exact running sum it shows where each lane
    stalls.
    """
    fmt, values = _prepare(x, dtype, lanes)
    steps = -(-values.size // lanes)
    running = np.empty((steps, lanes))
    _accumulate(values, lanes, True, fmt.p, fmt.emin, fmt.emax, True, running)
    return _to_dtype(running, fmt)
