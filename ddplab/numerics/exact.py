"""Correctly rounded elementwise sums and means of W contributions: the reference.

``exact_sum(c)[i]`` is ``RN(x_0[i] + ... + x_{W-1}[i])``: the exact real sum
rounded once, to nearest with ties to even, into the dtype (gradual
underflow, overflow to infinity, IEEE results for NaN/inf inputs; an exact
zero is -0 only when every addend is -0). ``exact_mean`` is ``RN(S / W)`` with
the same single rounding. No summation order can do better, so every
emulated or real reduction is measured against these.

How: per element, the W values are summed in float64 with an error-free
TwoSum. When every rounding error is zero (almost always: float32, float16
and bfloat16 values of similar magnitude add exactly in float64) that sum is
the exact S, and one rounding finishes the job; for the mean, the exact
remainder ``S - q*W`` of ``q = fl(S/W)`` (Dekker's TwoProduct) breaks ties.
The other elements go to an exact fixed-point accumulator
(:mod:`ddplab.numerics._bignum`). Everything is vectorized in numba; no Python
loop runs over elements.

Example::

    >>> x = torch.tensor([[1.0], [2.0 ** -24], [2.0 ** -24]])   # float32: u = 2^-24
    >>> exact_sum(x).item() == 1.0 + 2.0 ** -23                  # 1 + 2u is a float32
    True
    >>> reduce(x, "sequential").item()                           # 1 + u ties to the even 1.0, twice
    1.0
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import prange

from ddplab.numerics import _bignum
from ddplab.numerics._numba_cache import njit
from ddplab.numerics._parallel import within_torch_threads
from ddplab.numerics._rounding import round_scaled, two_prod, two_sum
from ddplab.numerics.contributions import Contributions, as_contributions
from ddplab.numerics.fpformat import float_format, parse_dtype

__all__ = ["exact_sum", "exact_mean", "exact_parts", "round_to_dtype"]

# Elements per numba task: the running sums and error flags stay in L1.
_CHUNK = 1024
# Bytes of [W, block] data converted per step when the input needs converting.
_BLOCK_BYTES = 32 << 20
# Partials kept per element when streaming rank by rank (float64 each).
_STREAM_PARTIALS = 4
# float64 range in which q = S/W and TwoProduct(q, W) cannot over- or underflow.
_MEAN_FAST_MIN = 2.0 ** -960
_MEAN_FAST_MAX = 2.0 ** 990


@njit(inline="always")
def _finish_fast(s, divisor, p, emin, emax):
    """RN of s/divisor in (p, emin, emax) when s is the exact float64 sum; NaN asks for the slow path."""
    if divisor == 1:
        return s if p == 53 else round_scaled(s, 0.0, 0, p, emin, emax)
    if s == 0.0:
        return s / divisor
    a = abs(s)
    if not (_MEAN_FAST_MIN < a < _MEAN_FAST_MAX):
        return np.nan
    q = s / divisor                       # RN64(S/W): IEEE division is correctly rounded
    pr, pe = two_prod(q, float(divisor))
    rem = (s - pr) - pe                   # exact: S - q*W is a small multiple of ulp(q)
    return q if p == 53 else round_scaled(q, rem, 0, p, emin, emax)


@njit(inline="always")
def _parts_fast(s, divisor):
    """(hi, lo) of s/divisor for an exact float64 s; NaN hi asks for the slow path."""
    if divisor == 1 or s == 0.0:
        return s / divisor, 0.0
    a = abs(s)
    if not (_MEAN_FAST_MIN < a < _MEAN_FAST_MAX):
        return np.nan, 0.0
    q = s / divisor
    pr, pe = two_prod(q, float(divisor))
    return q, ((s - pr) - pe) / divisor


@njit(parallel=True)
def _exact_columns(x, divisor, p, emin, emax, parts, out, out_lo):
    """Exact reduction of the columns of x ([W, n], float32 or float64).

    parts=False: out[i] = RN(sum_r x[r, i] / divisor) in (p, emin, emax).
    parts=True:  out[i], out_lo[i] = hi, lo of the same value in float64.
    """
    w = x.shape[0]
    n = x.shape[1]
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        s0 = c * _CHUNK
        s1 = min(n, s0 + _CHUNK)
        m = s1 - s0
        acc = np.empty(m)
        err = np.zeros(m)
        first = x[0, s0:s1]
        for i in range(m):
            acc[i] = first[i]
        for r in range(1, w):
            row = x[r, s0:s1]
            for i in range(m):
                s, e = two_sum(acc[i], np.float64(row[i]))
                acc[i] = s
                err[i] += abs(e)          # NaN (overflow, inf inputs) also sends it to the slow path
        vals = np.empty(w)
        limbs = np.zeros(_bignum.NLIMBS, np.int64)
        if parts:
            for i in range(m):
                hi, lo = _parts_fast(acc[i], divisor)
                if err[i] != 0.0 or hi != hi:
                    for r in range(w):
                        vals[r] = x[r, s0 + i]
                    hi, lo = _bignum.parts_of_values(vals, w, divisor, limbs)
                out[s0 + i] = hi
                out_lo[s0 + i] = lo
        elif divisor == 1 and p == 24:
            # float32: converting the exact float64 sum is the one correct rounding.
            for i in range(m):
                out[s0 + i] = acc[i]
            for i in range(m):
                if err[i] != 0.0:
                    for r in range(w):
                        vals[r] = x[r, s0 + i]
                    out[s0 + i] = _bignum.round_values(vals, w, divisor, p, emin, emax, limbs)
        else:
            for i in range(m):
                v = _finish_fast(acc[i], divisor, p, emin, emax)
                if err[i] != 0.0 or v != v:
                    for r in range(w):
                        vals[r] = x[r, s0 + i]
                    v = _bignum.round_values(vals, w, divisor, p, emin, emax, limbs)
                out[s0 + i] = v


@njit
def _stream_add(partials, count, flags, row):
    """Add one rank's row into each element's nonoverlapping partials (Shewchuk, as math.fsum).

    flags bit 1: a nonzero or +0 value was seen (the sum is not -0);
    bit 2: give up on this element (capacity, overflow, inf/NaN): recompute it.
    Serial: it runs once per generated row, which costs about as much to
    make as this does to add, and a parallel region per row stalls whenever
    another process holds one of the cores.
    """
    cap = partials.shape[0]
    for i in range(row.size):
        x = np.float64(row[i])
        if x == 0.0:
            if math.copysign(1.0, x) > 0.0:
                flags[i] |= 1
            continue
        flags[i] |= 1
        if not abs(x) < np.inf:
            flags[i] |= 2
            continue
        k = 0
        for j in range(count[i]):
            hi, lo = two_sum(x, partials[j, i])
            if not abs(hi) < np.inf:
                flags[i] |= 2
            if lo != 0.0:
                partials[k, i] = lo
                k += 1
            x = hi
        if x != 0.0:
            if k < cap:
                partials[k, i] = x
                k += 1
            else:
                flags[i] |= 2
        count[i] = k


@njit(parallel=True)
def _stream_finish(partials, count, flags, divisor, p, emin, emax, parts, out, out_lo):
    """Round each element's partials (skipping the ones flagged for recomputation)."""
    cap = partials.shape[0]
    n = count.size
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        vals = np.empty(cap)
        limbs = np.zeros(_bignum.NLIMBS, np.int64)
        for i in range(c * _CHUNK, min(n, (c + 1) * _CHUNK)):
            if flags[i] & 2:
                continue
            k = count[i]
            if k == 0:
                zero = 0.0 if flags[i] & 1 else -0.0
                out[i] = zero
                if parts:
                    out_lo[i] = 0.0
                continue
            if k == 1:
                if parts:
                    hi, lo = _parts_fast(partials[0, i], divisor)
                    if hi == hi:
                        out[i] = hi
                        out_lo[i] = lo
                        continue
                else:
                    v = _finish_fast(partials[0, i], divisor, p, emin, emax)
                    if v == v:
                        out[i] = v
                        continue
            for j in range(k):
                vals[j] = partials[j, i]
            if parts:
                hi, lo = _bignum.parts_of_values(vals, k, divisor, limbs)
                out[i] = hi
                out_lo[i] = lo
            else:
                out[i] = _bignum.round_values(vals, k, divisor, p, emin, emax, limbs)


@njit(parallel=True)
def _round_pairs(hi, lo, p, emin, emax, out):
    for i in prange(hi.size):
        s, e = two_sum(hi[i], lo[i])
        out[i] = s if p == 53 else round_scaled(s, e, 0, p, emin, emax)


def _kernel_input(block: torch.Tensor) -> np.ndarray:
    """A float32/float64 numpy view of a [W, b] block (half types are widened, exactly)."""
    if block.dtype not in (torch.float32, torch.float64):
        block = block.to(torch.float32)
    return block.contiguous().numpy()


def _out_array(n: int, p: int) -> np.ndarray:
    # Every float16/bfloat16/float32 result is exactly a float32, so float32 storage suffices.
    return np.empty(n, np.float64 if p == 53 else np.float32)


@within_torch_threads
def _reduce_exact(c: Contributions, divisor: int, fmt, parts: bool):
    p, emin, emax = (53, -1022, 1023) if parts else (fmt.p, fmt.emin, fmt.emax)
    n = c.numel
    out = np.empty(n, np.float64) if parts else _out_array(n, p)
    out_lo = np.empty(n if parts else 0, np.float64)
    if c.streams_rows:
        _stream_exact(c, divisor, p, emin, emax, parts, out, out_lo)
    elif c.kind == "tensor" and c.dtype in (torch.float32, torch.float64):
        if n:
            _exact_columns(c.materialize().numpy(), divisor, p, emin, emax, parts, out, out_lo)
    else:
        block = max(_CHUNK, _BLOCK_BYTES // (8 * c.world_size))
        for start, stop, cols in c.blocks(block):
            _exact_columns(_kernel_input(cols), divisor, p, emin, emax, parts,
                           out[start:stop], out_lo[start:stop] if parts else out_lo)
    return out, out_lo


def _stream_exact(c: Contributions, divisor, p, emin, emax, parts, out, out_lo) -> None:
    """Rank-by-rank exact reduction for row callables: O(N) memory, each row generated once.

    Elements whose partials overflow the capacity (or see inf/NaN) are
    recomputed from their W values, gathered in a second pass.
    """
    n = c.numel
    partials = np.zeros((_STREAM_PARTIALS, n), np.float64)
    count = np.zeros(n, np.int8)
    flags = np.zeros(n, np.int8)
    for r in range(c.world_size):
        row = c.row(r)
        if row.dtype not in (torch.float32, torch.float64):
            row = row.to(torch.float32)
        _stream_add(partials, count, flags, row.contiguous().numpy())
    _stream_finish(partials, count, flags, divisor, p, emin, emax, parts, out, out_lo)
    redo = np.flatnonzero(flags & 2)
    del partials
    # Gather the flagged elements' columns in batches that keep W*batch values small.
    batch = max(1024, (64 << 20) // (8 * c.world_size))
    for b0 in range(0, redo.size, batch):
        idx = torch.from_numpy(redo[b0:b0 + batch])
        cols = torch.stack([c.row(r).index_select(0, idx).to(torch.float64) for r in range(c.world_size)])
        sub = np.empty(idx.numel(), out.dtype)
        sub_lo = np.empty(idx.numel() if parts else 0, np.float64)
        _exact_columns(cols.numpy(), divisor, p, emin, emax, parts, sub, sub_lo)
        out[idx.numpy()] = sub
        if parts:
            out_lo[idx.numpy()] = sub_lo


def _check_float(c: Contributions) -> None:
    parse_dtype(c.dtype)  # raises ValueError naming the supported dtypes


def exact_sum(contributions, dtype=None) -> torch.Tensor:
    """Return the correctly rounded elementwise sum of the W contributions, in ``dtype``.

    ``dtype`` defaults to the contributions' dtype; any of float16, bfloat16,
    float32, float64 (or their names) may be asked for.

    Example::

        >>> exact_sum(torch.tensor([[1e20, 1.0], [1.0, 2.0], [-1e20, 3.0]], dtype=torch.float64))
        tensor([1., 6.], dtype=torch.float64)
    """
    c = as_contributions(contributions)
    _check_float(c)
    fmt = float_format(c.dtype if dtype is None else dtype)
    out, _ = _reduce_exact(c, 1, fmt, parts=False)
    return torch.from_numpy(out).to(fmt.dtype)


def exact_mean(contributions, dtype=None) -> torch.Tensor:
    """Return the correctly rounded elementwise mean ``RN(S / W)``, in ``dtype``.

    One rounding in total, also when W is not a power of two (the exact
    remainder of the division decides ties and near-ties).
    """
    c = as_contributions(contributions)
    _check_float(c)
    fmt = float_format(c.dtype if dtype is None else dtype)
    out, _ = _reduce_exact(c, c.world_size, fmt, parts=False)
    return torch.from_numpy(out).to(fmt.dtype)


def exact_parts(contributions, op: str = "sum", *, divisor: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return float64 ``(hi, lo)`` with ``hi = RN64(V)`` and ``lo`` ≈ ``V - hi`` (faithful), V = S or S/W.

    The error of any computed result ``y`` is then ``(y - hi) - lo``, accurate
    to float64 rounding of that difference, even when ``y`` is float64.
    ``divisor`` replaces W for ``op="avg"``: the mean of W ranks that each
    accumulated k rows is the sum of the W·k rows divided by W.
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if divisor is not None and (op != "avg" or isinstance(divisor, bool) or not isinstance(divisor, int)
                                or divisor < 1):
        raise ValueError(f"divisor must be a positive int, with op='avg' only; got {divisor!r}")
    c = as_contributions(contributions)
    _check_float(c)
    hi, lo = _reduce_exact(c, 1 if op == "sum" else (divisor or c.world_size), None, parts=True)
    return torch.from_numpy(hi), torch.from_numpy(lo)


@within_torch_threads
def round_to_dtype(hi, lo, dtype) -> torch.Tensor:
    """Correctly round the exact values ``hi + lo`` (float64 tensors of one shape) to ``dtype``.

    Unlike ``(hi + lo).to(dtype)`` this rounds once: torch converts float64 to
    float16 and bfloat16 through float32, a second rounding that can land on
    the wrong side of a tie.

    Example::

        >>> hi = torch.tensor([1.0 + 2.0 ** -11], dtype=torch.float64)   # a float16 tie
        >>> round_to_dtype(hi, torch.tensor([2.0 ** -40], dtype=torch.float64), torch.float16).item()
        1.0009765625
    """
    fmt = float_format(dtype)
    hi = torch.as_tensor(hi, dtype=torch.float64)
    lo = torch.as_tensor(lo, dtype=torch.float64)
    if hi.shape != lo.shape:
        raise ValueError(f"hi and lo must have one shape, got {tuple(hi.shape)} and {tuple(lo.shape)}")
    out = _out_array(hi.numel(), fmt.p)
    _round_pairs(hi.reshape(-1).contiguous().numpy(), lo.reshape(-1).contiguous().numpy(),
                 fmt.p, fmt.emin, fmt.emax, out)
    return torch.from_numpy(out).to(fmt.dtype).reshape(hi.shape)
