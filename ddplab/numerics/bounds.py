"""Classical rounding-error bounds: how far from the exact sum rounding alone can take a result.

Model (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 4):
``fl(a + b) = (a + b)(1 + δ)``, ``|δ| <= u``. A summation tree in which no
addend passes through more than ``d`` additions satisfies

    |Ŝ - S| <= γ_d · Σ_r |x_r|,        γ_k = k·u / (1 - k·u),

with ``d = W - 1`` for sequential sums and rings, ``ceil(log2 W)`` for
pairwise trees. The right-hand side uses Σ|x_r|, never |S|: under
cancellation |S| is tiny and a legal result can be far from S relative to
|S|. Two orders A and B may therefore differ by up to
``(γ_dA + γ_dB) · Σ|x_r|`` per element.

The averaging variants add roughly ``u·|mean|`` (one more rounding, or one
per contribution before the sum), accumulating in a wider dtype adds the
final rounding ``u·|result|``, and scaling each contribution by 1/W can
underflow (an absolute ``W·η`` with η the smallest subnormal): all included,
so a result beyond :func:`rounding_bound` cannot be explained by rounding.

Example::

    >>> x = torch.tensor([[1.0, 3.0], [2.0 ** -24, -3.0]])
    >>> rounding_bound(x, "sequential").tolist() == [gamma(1, torch.float32) * (1 + 2.0 ** -24), gamma(1, torch.float32) * 6]
    True
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ddplab.numerics.contributions import as_contributions
from ddplab.numerics.fpformat import float_format, parse_dtype, unit_roundoff
from ddplab.numerics.orders import AVERAGING, default_averaging, order_options, reduction_pieces

__all__ = ["gamma", "abs_sum", "rounding_bound", "pair_bound", "classify", "Classification"]

ROUNDING = "rounding"
NOT_ROUNDING = "not rounding"


def gamma(k, dtype) -> float:
    """γ_k = k·u / (1 - k·u) for the unit roundoff u of ``dtype``; inf once k·u >= 1 (no bound)."""
    if k < 0:
        raise ValueError(f"gamma needs k >= 0, got {k}")
    ku = k * unit_roundoff(dtype)
    return math.inf if ku >= 1 else ku / (1 - ku)


def _gamma_tensor(k: torch.Tensor, u: float) -> torch.Tensor:
    ku = k.to(torch.float64) * u
    return torch.where(ku < 1, ku / (1 - ku), torch.full_like(ku, math.inf))


def abs_sum(contributions) -> torch.Tensor:
    """Σ_r |x_r| per element, in float64 (relative error below W·2^-53)."""
    c = as_contributions(contributions)
    total = torch.zeros(c.numel, dtype=torch.float64)
    if c.streams_rows:
        for r in range(c.world_size):
            total += c.row(r).to(torch.float64).abs()   # not abs_(): .to() may return the caller's tensor
        return total
    for start, stop, cols in c.blocks(max(1, (8 << 20) // (8 * c.world_size))):
        total[start:stop] = cols.to(torch.float64).abs().sum(0)
    return total


def _depth_per_element(order: str, numel: int, world_size: int, element_size: int, options: dict) -> torch.Tensor:
    from ddplab.numerics._programs import program_depth

    depth = torch.empty(numel, dtype=torch.int64)
    for piece in reduction_pieces(order, numel, world_size, element_size, **options):
        depth[piece.start:piece.stop] = program_depth(piece.program)
    return depth


def rounding_bound(contributions, order: str, dtype=None, *, op: str = "sum", averaging: str | None = None,
                   accumulate=None, abs_total: torch.Tensor | None = None,
                   exact_value: torch.Tensor | None = None, **options) -> torch.Tensor:
    """Per element, the largest |result - exact| that rounding in ``order`` can produce (float64).

    ``dtype`` is the dtype the reduction computes in (default: the
    contributions'); ``op``, ``averaging`` and ``accumulate`` as in
    :func:`ddplab.numerics.reduce`, whose result this bounds; ``options``
    are the order's. The depth d is taken per element from the order's
    pieces (the two NCCL trees may differ). ``abs_total`` (Σ|x_r|) and
    ``exact_value`` (|S| or |S/W|, float64) may be passed when already known.
    """
    c = as_contributions(contributions)
    data_dtype = parse_dtype(c.dtype)
    dtype = data_dtype if dtype is None else parse_dtype(dtype)
    acc = dtype if accumulate is None else parse_dtype(accumulate)
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if op == "sum" and averaging is not None:
        raise ValueError("averaging applies to op='avg' only")
    opts = order_options(order, c.world_size, **options)
    if op == "avg":
        averaging = averaging or default_averaging(order)
        if averaging not in AVERAGING:
            raise ValueError(f"unknown averaging {averaging!r}; choose one of {', '.join(AVERAGING)}")
    w = c.world_size
    fmt, fmt_acc = float_format(dtype), float_format(acc)
    u, u_a = fmt.u, fmt_acc.u
    eta, eta_a = fmt.smallest_subnormal, fmt_acc.smallest_subnormal
    needs_value = order == "exact" or op == "avg" or acc != dtype
    if needs_value and exact_value is None:
        from ddplab.numerics.exact import exact_parts

        exact_value = exact_parts(c, op)[0].abs()
    if order == "exact":
        return u * exact_value + eta / 2   # one correct rounding
    total = abs_sum(c) if abs_total is None else abs_total
    element_size = torch.empty((), dtype=dtype).element_size()
    depth = _depth_per_element(order, c.numel, w, element_size, opts)
    # Roundings a contribution suffers before its first addition.
    leaf = int(float_format(data_dtype).p > fmt_acc.p)
    scaled = averaging in ("divide_first", "multiply_reciprocal", "multiply_float32_reciprocal")
    if averaging == "divide_first":
        leaf += 1
    elif averaging in ("multiply_reciprocal", "multiply_float32_reciprocal"):
        leaf += 2                          # fl(1/W), then the product; float32's extra rounding < u of a half type
    bound = _gamma_tensor(depth + leaf, u_a) * total
    if scaled:
        bound = bound / w + w * eta_a      # each scaled contribution may underflow by η/2
    if averaging == "sum_then_divide":
        bound = (1 + u_a) * bound / w + u_a * exact_value + eta_a / 2
    if acc != dtype:
        bound = bound + u * (exact_value + bound) + eta / 2
    return bound


def pair_bound(contributions, order_a: str, order_b: str, dtype=None, *, op: str = "sum",
               averaging: str | None = None, accumulate=None, options_a: dict | None = None,
               options_b: dict | None = None) -> torch.Tensor:
    """Per element, how far results of ``order_a`` and ``order_b`` may differ by rounding alone.

    The sum of the two :func:`rounding_bound` s: (γ_dA + γ_dB)·Σ|x_r| for
    plain sums (each result is within its own bound of the exact value).
    """
    c = as_contributions(contributions)
    total = abs_sum(c)
    kw = dict(op=op, averaging=averaging, accumulate=accumulate, abs_total=total)
    return (rounding_bound(c, order_a, dtype, **kw, **(options_a or {}))
            + rounding_bound(c, order_b, dtype, **kw, **(options_b or {})))


class Classification(NamedTuple):
    """``label`` is "rounding" when every error is within its bound, else "not rounding"; ``ratio`` = max |error|/bound."""

    label: str
    ratio: float


def classify(error, bound) -> Classification:
    """Compare errors with their bounds elementwise: ``(label, ratio)``.

    ``ratio`` is the largest |error| / bound (0/0 counts as 0, x/0 and NaN
    errors as inf); the label is "rounding" when it is at most 1 and "not
    rounding" beyond.

    Example::

        >>> classify(torch.tensor([1e-7, 0.0]), torch.tensor([2e-7, 0.0]))
        Classification(label='rounding', ratio=0.5)
    """
    error = torch.as_tensor(error, dtype=torch.float64).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64)
    error, bound = torch.broadcast_tensors(error, bound)
    if error.numel() == 0:
        return Classification(ROUNDING, 0.0)
    ratio = torch.where(error == 0, torch.zeros_like(error), error / bound)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
    worst = float(ratio.max())
    return Classification(ROUNDING if worst <= 1.0 else NOT_ROUNDING, worst)
