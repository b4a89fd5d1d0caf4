"""Distances in units in the last place: how many representable numbers lie between two results.

Reinterpreting a float's bits as a sign-magnitude integer and mapping
negative values to minus their magnitude puts every float16, bfloat16,
float32 and float64 value on one ordered integer line on which consecutive
floats are consecutive integers and +0 and -0 are both 0. The ulp distance is
a difference on that line: signed, exact, and correct across zero and sign
changes (the distance from -tiny to +tiny is 2, not "huge"). A NaN is not a
point on that line: two NaNs are 0 ulps apart whatever their sign and payload
bits (torch's ``inf + -inf`` and the reference's NaN differ in their bits but
are the same result), and a NaN against a number is as far as it gets.

Example::

    >>> a = torch.tensor([1.0, -0.0, 2.0 ** -149], dtype=torch.float32)
    >>> b = torch.tensor([1.0 + 2.0 ** -23, 0.0, -(2.0 ** -149)], dtype=torch.float32)
    >>> ulp_distance(a, b).tolist()
    [-1, 0, 2]
"""
from __future__ import annotations

import torch

from ddplab.numerics.fpformat import float_format, parse_dtype

__all__ = ["ordered_int", "ulp_distance", "ulp"]

_INT64_MAX = (1 << 63) - 1


def ordered_int(x: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that order and adjacency are preserved and ±0 map to 0.

    NaNs map beyond ±infinity (their sign and payload decide where); use
    :func:`ulp_distance`, not differences of these, to compare results
    that may hold NaNs.
    """
    fmt = float_format(x.dtype)
    bits = x.contiguous().view(fmt.int_dtype).to(torch.int64)
    magnitude = bits & ((1 << (fmt.bits - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Return ``a - b`` in ulps of their common dtype: an int64 tensor, signed, ±0 equal.

    ``a`` and ``b`` must share a dtype (one of the four float types) and
    broadcast. Two NaNs are 0 apart (any sign, any payload); a NaN against
    a number is ±(2^63 - 1), positive when ``a`` is the NaN. For float64 the
    distance also saturates at ±(2^63 - 1), reached only between values near
    opposite ends of the range.

    Example::

        >>> nan = torch.tensor([float("inf")]) + torch.tensor([float("-inf")])   # torch's NaN bits
        >>> ulp_distance(nan, torch.tensor([float("nan")])).item(), ulp_distance(nan, torch.ones(1)).item()
        (0, 9223372036854775807)
    """
    if a.dtype != b.dtype:
        raise ValueError(f"ulp_distance needs one dtype, got {a.dtype} and {b.dtype}")
    oa, ob = torch.broadcast_tensors(ordered_int(a), ordered_int(b))
    diff = oa - ob
    if float_format(a.dtype).bits == 64:
        # Signed overflow of oa - ob happens iff oa and ob differ in sign and diff's sign differs from oa's.
        overflow = ((oa ^ ob) & (oa ^ diff)) < 0
        if bool(overflow.any()):
            saturated = torch.where(oa < 0, torch.full_like(diff, -_INT64_MAX), torch.full_like(diff, _INT64_MAX))
            diff = torch.where(overflow, saturated, diff)
    na, nb = torch.broadcast_tensors(torch.isnan(a), torch.isnan(b))
    if bool(na.any()) or bool(nb.any()):
        far = torch.where(na, torch.full_like(diff, _INT64_MAX), torch.full_like(diff, -_INT64_MAX))
        diff = torch.where(na & nb, torch.zeros_like(diff), torch.where(na | nb, far, diff))
    return diff


def ulp(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """Spacing of ``dtype`` (default: x's dtype) at each x, as float64: 2^(max(e, emin) - p + 1).

    ``e`` is the binade of x (2^e <= |x| < 2^(e+1)), so ``ulp(x)`` is the
    distance from ``|x|`` to the next larger representable magnitude; at 0
    it is the smallest subnormal. Infinite x gives inf, NaN gives NaN.

    Example::

        >>> ulp(torch.tensor([1.0, 0.0, 65504.0]), torch.float16).tolist()
        [0.0009765625, 5.960464477539063e-08, 32.0]
    """
    fmt = float_format(x.dtype if dtype is None else parse_dtype(dtype))
    xd = x.to(torch.float64)
    _, ex = torch.frexp(xd.abs())          # |x| = m * 2^ex, 0.5 <= m < 1 (ex = 0 for 0)
    binade = torch.where(xd == 0, torch.full_like(ex, fmt.emin), ex - 1).clamp(min=fmt.emin)
    spacing = torch.ldexp(torch.ones_like(xd), (binade - fmt.p + 1).to(torch.float64))
    spacing = torch.where(torch.isinf(xd), torch.full_like(xd, float("inf")), spacing)
    return torch.where(torch.isnan(xd), xd, spacing)
