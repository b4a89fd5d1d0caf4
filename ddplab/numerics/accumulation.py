"""Gradient accumulation then the all-reduce: the order DDP follows under ``no_sync()``.

With k micro-batches per step, rank r's parameter gradient is built by
autograd's ``AccumulateGrad``: the first micro-batch's gradient is stored as
is, every later one is added in place, in the parameter's dtype::

    L_r = ((g_r1 + g_r2) + g_r3) + ... + g_rk          (k - 1 roundings)

Only the last backward (outside ``no_sync()``) reduces, and DDP reduces the
accumulated L_r like any gradient: multiplied by 1/W, then summed across
ranks in the backend's order. The composed order is therefore a sequential
sum of depth k - 1 per rank followed by the reduction, and the exact value
it approximates is the sum of all W·k micro-gradients (divided by W for the
mean). A micro-gradient passes through at most (k - 1) + d additions, plus
the averaging's roundings, so

    |result - exact| <= γ_{k-1+d+s} · Σ_{r,j} |g_rj|   (roughly; see :func:`ddplab.numerics.reduction_bounds`)

where d is the order's depth and s the scaling's roundings. Bit for bit
wherever the reduction's order is (:data:`~ddplab.numerics.orders.BIT_EXACT_ORDERS`):
the local sums are computed with torch's own in-place adds, as AccumulateGrad does.

Example::

    >>> g = torch.randn(4, 3, 1000)          # W=4 ranks, k=3 micro-batches each
    >>> mean = reduce_accumulated(g, "gloo_ring")   # what DDP on gloo computes
    >>> accumulated_depth("gloo_ring", 4, 3)
    5
"""
from __future__ import annotations

import torch

from ddplab.numerics.bounds import PROBABILISTIC_CONFIDENCE, ReductionBounds, abs_sum, reduction_bounds
from ddplab.numerics.contributions import as_contributions
from ddplab.numerics.fpformat import parse_dtype
from ddplab.numerics.orders import DDP_AVERAGING, order_depth, reduce

__all__ = ["as_micro_contributions", "local_sums", "reduce_accumulated", "accumulated_depth",
           "accumulated_bounds", "accumulated_bound", "accumulated_exact_parts"]


def as_micro_contributions(x) -> torch.Tensor:
    """Return ``x`` as a ``[W, k, N]`` tensor: rank r's k micro-batch gradients ``x[r, j]``.

    Accepts such a tensor or a sequence of W ``[k, N]`` tensors; raises
    ValueError for anything else.
    """
    if isinstance(x, (list, tuple)):
        if not x or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in x):
            raise ValueError("micro contributions must be W tensors of shape [k, N], one per rank")
        if len({tuple(t.shape) for t in x}) != 1 or len({t.dtype for t in x}) != 1:
            raise ValueError("every rank needs the same k, N and dtype")
        x = torch.stack(list(x))
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"micro contributions must be a [W, k, N] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"need W >= 1 ranks and k >= 1 micro-batches, got shape {tuple(x.shape)}")
    parse_dtype(x.dtype)
    return x.detach().cpu()


def local_sums(x) -> torch.Tensor:
    """Each rank's accumulated gradient ``[W, N]``: g_r1, then ``+= g_rj`` in place, in the dtype (AccumulateGrad)."""
    x = as_micro_contributions(x)
    total = x[:, 0].clone()
    for j in range(1, x.shape[1]):
        total.add_(x[:, j])
    return total


def reduce_accumulated(x, order: str = "gloo_ring", *, op: str = "avg", averaging: str | None = DDP_AVERAGING,
                       accumulate=None, reduce_dtype=None, **options) -> torch.Tensor:
    """Emulate k local accumulations per rank, then the reduction: the result DDP gives after ``no_sync()``.

    ``x`` is ``[W, k, N]`` (see :func:`as_micro_contributions`); the rest is
    :func:`ddplab.numerics.reduce`'s, with DDP's defaults: the mean, each
    accumulated gradient multiplied by 1/W first. Returns N elements in x's dtype.
    """
    if op == "sum" and averaging == DDP_AVERAGING:
        averaging = None
    return reduce(local_sums(x), order, op=op, averaging=averaging, accumulate=accumulate,
                  reduce_dtype=reduce_dtype, **options)


def accumulated_depth(order: str, world_size: int, steps: int, **options) -> int:
    """Additions on a micro-gradient's longest path: k - 1 local ones plus the order's depth d."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    return steps - 1 + order_depth(order, world_size, **options)


def accumulated_exact_parts(x, op: str = "avg") -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(hi, lo)`` of the exact S = Σ_{r,j} g_rj, or S/W for ``op="avg"`` (W ranks, not W·k)."""
    from ddplab.numerics.exact import exact_parts

    x = as_micro_contributions(x)
    w, k, n = x.shape
    flat = x.reshape(w * k, n)
    return exact_parts(flat, op, divisor=w) if op == "avg" else exact_parts(flat, op)


def accumulated_bounds(x, order: str = "gloo_ring", *, op: str = "avg", averaging: str | None = DDP_AVERAGING,
                       accumulate=None, reduce_dtype=None, result_dtype=None,
                       abs_total: torch.Tensor | None = None, exact_value: torch.Tensor | None = None,
                       confidence: float = PROBABILISTIC_CONFIDENCE, **options) -> ReductionBounds:
    """:func:`ddplab.numerics.reduction_bounds` of the composed order (rigorous, probabilistic, peak)."""
    x = as_micro_contributions(x)
    w, k, n = x.shape
    if op == "sum" and averaging == DDP_AVERAGING:
        averaging = None
    if abs_total is None:
        abs_total = abs_sum(x.reshape(w * k, n))
    if exact_value is None:
        exact_value = accumulated_exact_parts(x, op)[0].abs()
    return reduction_bounds(as_contributions(local_sums(x)), order, op=op, averaging=averaging,
                            accumulate=accumulate, reduce_dtype=reduce_dtype, result_dtype=result_dtype,
                            local_steps=k, abs_total=abs_total, exact_value=exact_value,
                            confidence=confidence, **options)


def accumulated_bound(x, order: str = "gloo_ring", **kwargs) -> torch.Tensor:
    """The rigorous bound of :func:`reduce_accumulated`'s result, per element (float64)."""
    return accumulated_bounds(x, order, **kwargs).rigorous
