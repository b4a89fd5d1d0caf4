"""Exact sums of float64 values as wide fixed-point integers, compiled with numba.

The slow path of :mod:`ddplab.numerics.exact`: used only for the elements
where float64 arithmetic cannot certify the exact sum (exponents too far
apart, near-overflow, infinities). Every finite float64 is an integer multiple
of 2^-1074 below 2^1024, so a fixed-point accumulator with its least
significant bit at 2^-OFFSET holds any sum of up to 2^31 of them exactly.
It is stored as 32-bit limbs in int64 words so that additions never carry
until :func:`bn_normalize`; a division by W leaves a remainder that becomes
the sticky bit of the final rounding.
"""
from __future__ import annotations

import math

import numpy as np

from ddplab.numerics._numba_cache import njit


__all__ = ["NLIMBS", "OFFSET", "round_values", "parts_of_values"]

# 2^-1074 has its lowest significand bit (of the 53-bit integer significand)
# at 2^-1126; 32 more bits keep a guard limb below it, for the division by W.
OFFSET = 1158
NLIMBS = 72
_RADIX = 4294967296  # 2^32
_MASK = 4294967295
_TWO53 = 9007199254740992.0


@njit
def _limb_of(v):
    m, e = math.frexp(v)
    return (e - 53 + OFFSET) >> 5


@njit
def bn_add(limbs, v):
    """Add the finite float64 ``v`` to the accumulator exactly (no carry propagation)."""
    if v == 0.0:
        return
    m, e = math.frexp(v)
    sig = np.int64(m * _TWO53)       # v = sig * 2^(e-53), |sig| < 2^53
    pos = e - 53 + OFFSET            # bit position of sig's lowest bit, >= 32
    mag = sig if sig >= 0 else -sig
    li = pos >> 5
    sh = pos & 31
    low = (mag & _MASK) << sh        # < 2^63
    high = (mag >> 32) << sh         # < 2^52
    c0 = low & _MASK
    c1 = (low >> 32) + (high & _MASK)
    c2 = high >> 32
    if sig >= 0:
        limbs[li] += c0
        limbs[li + 1] += c1
        limbs[li + 2] += c2
    else:
        limbs[li] -= c0
        limbs[li + 1] -= c1
        limbs[li + 2] -= c2


@njit
def _carry(limbs, lo, hi):
    for i in range(lo, hi):
        c = limbs[i] >> 32           # floor division by 2^32, negative limbs included
        limbs[i] -= c * _RADIX
        limbs[i + 1] += c


@njit
def bn_normalize(limbs, lo, hi):
    """Propagate carries in limbs[lo..hi], leave the magnitude there and return the sign (-1, 0, 1)."""
    _carry(limbs, lo, hi)
    if limbs[hi] < 0:
        for i in range(lo, hi + 1):
            limbs[i] = -limbs[i]
        _carry(limbs, lo, hi)
        return -1
    for i in range(lo, hi + 1):
        if limbs[i] != 0:
            return 1
    return 0


@njit
def bn_divide(limbs, lo, hi, d):
    """Divide the (normalized, nonnegative) accumulator by ``d`` < 2^31 in place; return the remainder."""
    rem = np.int64(0)
    for i in range(hi, lo - 1, -1):
        cur = rem * _RADIX + limbs[i]
        q = cur // d
        limbs[i] = q
        rem = cur - q * d
    return rem


@njit
def _top_bit(limbs, lo, hi):
    for i in range(hi, lo - 1, -1):
        v = limbs[i]
        if v != 0:
            n = 0
            while v != 0:
                v >>= 1
                n += 1
            return i * 32 + n - 1
    return -1


@njit
def _bits(limbs, start, nbits):
    # Bits [start, start + nbits) as an integer, nbits <= 54; every bit above
    # them is zero (start + nbits - 1 is the top bit), so no shift overflows.
    li = start >> 5
    sh = start & 31
    acc = limbs[li] >> sh
    got = 32 - sh
    k = li + 1
    while got < nbits:
        acc |= limbs[k] << got
        got += 32
        k += 1
    return acc & ((np.int64(1) << nbits) - 1)


@njit
def _any_bits_below(limbs, lo, q):
    li = q >> 5
    if li >= lo and (limbs[li] & ((np.int64(1) << (q & 31)) - 1)) != 0:
        return True
    for i in range(lo, min(li, limbs.size)):
        if limbs[i] != 0:
            return True
    return False


@njit
def bn_round(limbs, lo, hi, sticky, p, emin, emax):
    """The magnitude in limbs[lo..hi] (plus ``sticky`` below it) rounded to (p, emin, emax), ties to even."""
    top = _top_bit(limbs, lo, hi)
    if top < 0:
        return 0.0
    e_v = top - OFFSET
    if e_v > emax:
        return np.inf
    qexp = max(e_v, emin) - p + 1
    qpos = qexp + OFFSET
    if qpos - 1 > top:
        return 0.0                   # below half the smallest spacing: rounds to zero
    n = _bits(limbs, qpos, top - qpos + 1) if top >= qpos else np.int64(0)
    rb = (limbs[(qpos - 1) >> 5] >> ((qpos - 1) & 31)) & 1
    if rb == 1 and (sticky or (n & 1) == 1 or _any_bits_below(limbs, lo, qpos - 1)):
        n += 1
    if e_v == emax and n >= (np.int64(1) << p):
        return np.inf
    return math.ldexp(float(n), qexp)


@njit
def _special_sum(vals, n):
    # IEEE semantics for non-finite inputs: NaN wins, +inf and -inf make NaN.
    pinf = False
    ninf = False
    for i in range(n):
        v = vals[i]
        if v != v:
            return np.nan
        if v == np.inf:
            pinf = True
        elif v == -np.inf:
            ninf = True
    if pinf and ninf:
        return np.nan
    return np.inf if pinf else -np.inf


@njit
def _load(vals, n, divisor, limbs):
    """Accumulate vals[:n]; return (sign, lo, hi, sticky) with the magnitude of sum/divisor in limbs."""
    lo = NLIMBS
    hi = 0
    for i in range(n):
        if vals[i] != 0.0:
            li = _limb_of(vals[i])
            lo = min(lo, li)
            hi = max(hi, li)
    if lo > hi:
        return 0, 0, 0, False
    hi = min(hi + 4, NLIMBS - 1)     # room for the 85-bit addend and 31 bits of carries
    # Three limbs below the lowest input bit hold the quotient bits a division
    # by W < 2^31 shifts down, and cover every bit the rounding reads (it looks
    # at most 54 bits below the top bit).
    lo = max(0, lo - 3)
    for i in range(lo, hi + 1):
        limbs[i] = 0
    for i in range(n):
        bn_add(limbs, vals[i])
    sign = bn_normalize(limbs, lo, hi)
    sticky = False
    if sign != 0 and divisor > 1:
        sticky = bn_divide(limbs, lo, hi, divisor) != 0
    return sign, lo, hi, sticky


@njit
def _all_negative_zero(vals, n):
    for i in range(n):
        if not (vals[i] == 0.0 and math.copysign(1.0, vals[i]) < 0.0):
            return False
    return True


@njit
def round_values(vals, n, divisor, p, emin, emax, limbs):
    """Correctly rounded (vals[0] + ... + vals[n-1]) / divisor in the format (p, emin, emax).

    An exact zero is -0 only when every value is -0 (what any IEEE summation
    order gives); a nonzero result that underflows keeps its sign.
    """
    for i in range(n):
        if not abs(vals[i]) < np.inf:
            return _special_sum(vals, n)
    sign, lo, hi, sticky = _load(vals, n, divisor, limbs)
    if sign == 0:
        return -0.0 if _all_negative_zero(vals, n) else 0.0
    return math.copysign(bn_round(limbs, lo, hi, sticky, p, emin, emax), float(sign))


@njit
def parts_of_values(vals, n, divisor, limbs):
    """(hi, lo): hi = RN64(sum/divisor), lo = the float64 nearest to the remainder (faithful)."""
    for i in range(n):
        if not abs(vals[i]) < np.inf:
            return _special_sum(vals, n), 0.0
    sign, lo, hi, sticky = _load(vals, n, divisor, limbs)
    if sign == 0:
        return (-0.0 if _all_negative_zero(vals, n) else 0.0), 0.0
    mag = bn_round(limbs, lo, hi, sticky, 53, -1022, 1023)
    if mag == np.inf:
        return math.copysign(np.inf, float(sign)), 0.0
    bn_add(limbs, -mag)
    rsign = bn_normalize(limbs, lo, hi)
    rest = bn_round(limbs, lo, hi, sticky, 53, -1022, 1023) if rsign != 0 else 0.0
    return math.copysign(mag, float(sign)), float(sign * rsign) * rest
