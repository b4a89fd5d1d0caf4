"""Scalar building blocks for exact arithmetic, compiled with numba.

* :func:`two_sum` and :func:`two_prod` are the error-free transformations
  (Knuth's TwoSum; Dekker's TwoProduct with Veltkamp's split): ``a + b = s + e``
  and ``a * b = p + e`` exactly, barring overflow (and underflow for the product).
* :func:`round_scaled` correctly rounds ``(hi + lo) * 2^scale`` to a format of
  precision ``p`` and normal exponents ``[emin, emax]`` (round to nearest, ties
  to even, gradual underflow, overflow to infinity), where ``hi`` is the
  float64 nearest to ``hi + lo``. Only the sign of ``lo`` matters, and only
  when ``hi`` sits exactly on a midpoint of the target format.

Why that suffices: every midpoint between two neighbours of a format with
``p <= 52`` (and its overflow threshold) is itself a float64. Rounding to
nearest is monotone, so if the float64 nearest to V is not a midpoint, V and
it lie on the same side of every midpoint and round alike; if it is one, the
sign of the remainder says on which side V lies.
"""
from __future__ import annotations

import math

import numpy as np

from ddplab.numerics._numba_cache import njit

__all__ = ["two_sum", "two_prod", "round_scaled", "format_args"]

_SPLITTER = 134217729.0  # 2^27 + 1: Veltkamp's split of a float64 into two 26-bit halves


def format_args(fmt) -> tuple[int, int, int]:
    """``(p, emin, emax)`` of a :class:`~ddplab.numerics.fpformat.FloatFormat`, as the kernels take them."""
    return fmt.p, fmt.emin, fmt.emax


@njit(inline="always")
def two_sum(a, b):
    """Return (s, e) with s = fl(a + b) and a + b = s + e exactly (no branch, any order of |a|, |b|)."""
    s = a + b
    bp = s - a
    e = (a - (s - bp)) + (b - bp)
    return s, e


@njit(inline="always")
def two_prod(a, b):
    """Return (p, e) with p = fl(a * b) and a * b = p + e exactly (|a|, |b| < 2^996, no underflow)."""
    p = a * b
    c = _SPLITTER * a
    ah = c - (c - a)
    al = a - ah
    c = _SPLITTER * b
    bh = c - (c - b)
    bl = b - bh
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    return p, e


@njit
def round_scaled(hi, lo, scale, p, emin, emax):
    """Correctly round V = (hi + lo) * 2^scale to precision p, exponents [emin, emax].

    Requires hi = RN64(hi + lo) (e.g. ``two_sum`` output); returns a float64
    holding the rounded value exactly, or a signed infinity on overflow.
    NaN and infinite ``hi`` are returned unchanged; zero keeps its sign.
    """
    if not abs(hi) < np.inf:
        return hi
    if hi == 0.0:
        return hi
    a = abs(hi)
    m, ex = math.frexp(a)  # a = m * 2^ex with 0.5 <= m < 1
    e_v = ex - 1 + scale   # binade of V: 2^e_v <= |V| < 2^(e_v+1) (up to a power-of-two hi)
    if e_v > emax:
        return math.copysign(np.inf, hi)
    qexp = max(e_v, emin) - p + 1     # the target's spacing there: 2^qexp
    r = math.ldexp(a, scale - qexp)   # |V| / 2^qexp up to lo; exact (a power-of-two scaling)
    n = np.floor(r)
    f = r - n
    toward_larger = lo if hi > 0.0 else -lo
    if f > 0.5 or (f == 0.5 and (toward_larger > 0.0 or (toward_larger == 0.0 and n - 2.0 * np.floor(0.5 * n) == 1.0))):
        n += 1.0
    if e_v == emax and n >= math.ldexp(1.0, p):
        return math.copysign(np.inf, hi)
    # n * 2^qexp is representable (that is what rounding made it), so ldexp is exact,
    # float64 subnormals included.
    return math.copysign(math.ldexp(n, qexp), hi)
