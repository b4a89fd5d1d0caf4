"""Compiled evaluation of summation programs: one pass over memory, at most one parallel region per call.

:mod:`ddplab.numerics._programs` describes a reduction order as pieces, each
an element range and a postfix program over ranks. Here a program becomes a
list of fused operations on *slots* (its stack)::

    LOAD_ROW  r d    slot[d]  = x_r
    ADD_ROW   r d    slot[d] += x_r        (a push directly followed by ADD)
    ADD_SLOT  - d    slot[d] += slot[d+1]

and numba kernels run them: over column tiles that stay in cache (a tensor,
or a generated column block: :func:`eval_columns`), or rank by rank into
full-length slots (a row callable: :func:`stream_row`). Every operation
rounds exactly as torch's in-place op in the compute dtype does:

* float32 and float64 compute natively; an int64 sum wraps like torch's;
* float16 and bfloat16 compute in float32 and round to the format after
  every operation, which is what torch's CPU kernels do (one float32
  operation on two p-bit values is exact or correctly rounded, and float32
  has more than 2p+2 bits, so the second rounding equals a direct one);
* half-precision data is read and written as its 16-bit patterns; a float64
  result goes to float16/bfloat16 through float32, as ``Tensor.copy_`` does.

NaN results are NaN, but their sign and payload bits may differ from torch's
(torch's own vectorized and scalar conversions disagree there).

:func:`eval_columns` is one parallel region for a whole tensor; the
streaming kernels are serial (a row costs more to generate than to add).
Under load from other processes that is what keeps the cost near the memory
floor: a stream of small torch ops pays a thread-team synchronization for
each one, and a descheduled thread stalls every one of them.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ddplab.numerics._numba_cache import njit


__all__ = ["LOAD_ROW", "ADD_ROW", "ADD_SLOT", "op_count", "compile_program", "eval_columns", "stream_row",
           "finish_parts", "needed_ranks"]

LOAD_ROW, ADD_ROW, ADD_SLOT = 0, 1, 2

# Rounding / bit-pattern codes: 0 none (native float32, float64, int64), 1 float16, 2 bfloat16.
NATIVE, FLOAT16, BFLOAT16 = 0, 1, 2
# Scaling of each contribution as it enters the sum.
NO_SCALE, DIVIDE, MULTIPLY = 0, 1, 2

_F16_MIN_NORMAL_BITS = 0x38800000   # float32 bits of 2^-14
_F16_OVERFLOW_BITS = 0x477FF000     # float32 bits of 65520: rounds to inf
_TWO_M24 = 5.960464477539063e-08    # 2^-24, the float16 subnormal spacing


def op_count(program) -> int:
    """How many ops :func:`compile_program` makes of ``program``: each push followed by ADD fuses with it."""
    prog = np.asarray(program, dtype=np.int64)
    return int(prog.size - np.count_nonzero((prog[:-1] >= 0) & (prog[1:] == -1)))


def compile_program(program, ranks: int) -> np.ndarray:
    """The ``[ops, 3]`` int32 array ``(kind, rank, slot)`` of a postfix program.

    Raises ValueError for a program that is malformed or reads a rank outside
    ``[0, ranks)``: the kernels index memory with these numbers.
    """
    prog = np.asarray(program, dtype=np.int64)
    n = prog.size
    if n and prog[0] >= 0 and n % 2 == 1 and (prog[1::2] >= 0).all() and (prog[2::2] == -1).all():
        # A chain ((x_a + x_b) + x_c) + ...: every rank after the first is added into slot 0.
        ops = np.zeros((n // 2 + 1, 3), np.int32)
        ops[0, 0] = LOAD_ROW
        ops[1:, 0] = ADD_ROW
        ops[0, 1] = prog[0]
        ops[1:, 1] = prog[1::2]
    else:
        rows = []
        depth, i = 0, 0
        while i < n:
            op = int(prog[i])
            if op >= 0 and i + 1 < n and prog[i + 1] == -1:
                if depth < 1:
                    raise ValueError(f"malformed program {tuple(program)}: ADD needs two operands")
                rows.append((ADD_ROW, op, depth - 1))
                i += 2
            elif op >= 0:
                rows.append((LOAD_ROW, op, depth))
                depth += 1
                i += 1
            elif op == -1:
                if depth < 2:
                    raise ValueError(f"malformed program {tuple(program)}: ADD needs two operands")
                rows.append((ADD_SLOT, -1, depth - 2))
                depth -= 1
                i += 1
            else:
                raise ValueError(f"malformed program {tuple(program)}: unknown op {op}")
        if depth != 1:
            raise ValueError(f"malformed program {tuple(program)}: leaves {depth} values")
        ops = np.array(rows, np.int32).reshape(-1, 3)
    row_ranks = ops[ops[:, 0] != ADD_SLOT, 1]
    if row_ranks.size and (row_ranks.min() < 0 or row_ranks.max() >= ranks):
        raise ValueError(f"program {tuple(program)} reads a rank outside [0, {ranks})")
    return ops


# --------------------------------------------------------------------------- float16 / bfloat16


@njit
def _f16_value(h):
    """The float32 value of the float16 bit pattern ``h`` (exact)."""
    h = np.int64(h)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = np.float32(m) * np.float32(_TWO_M24)
        return -v if h & 0x8000 else v
    bits = ((h & 0x8000) << 16) | (m << 13) | ((0xFF if e == 31 else e + 112) << 23)
    return np.uint32(bits).view(np.float32)


@njit
def _bf16_value(h):
    """The float32 value of the bfloat16 bit pattern ``h`` (exact: its upper half)."""
    return np.uint32((np.int64(h) & 0xFFFF) << 16).view(np.float32)


@njit
def _round_f16(v):
    """float32 ``v`` rounded to float16 (nearest, ties to even, subnormals, overflow to inf), as a float32."""
    w = np.int64(np.float32(v).view(np.uint32))
    sign = w & 0x80000000
    a = w & 0x7FFFFFFF
    if a >= 0x7F800000:
        return np.float32(v)
    if a >= _F16_OVERFLOW_BITS:
        return np.uint32(sign | 0x7F800000).view(np.float32)
    if a >= _F16_MIN_NORMAL_BITS:
        # Round away the 13 low significand bits, ties to even; a carry moves into the exponent.
        r = (a + 0xFFF + ((a >> 13) & 1)) & 0x7FFFE000
        return np.uint32(sign | r).view(np.float32)
    # Subnormal range: a multiple of 2^-24; the scaled value is exact in float64, rint ties to even.
    q = np.float32(np.rint(np.float64(abs(v)) * 16777216.0) * _TWO_M24)
    return -q if sign else q


@njit
def _round_bf16(v):
    """float32 ``v`` rounded to bfloat16 (nearest, ties to even), as a float32."""
    w = np.int64(np.float32(v).view(np.uint32))
    if (w & 0x7FFFFFFF) > 0x7F800000:
        return np.float32(v)
    return np.uint32((w + 0x7FFF + ((w >> 16) & 1)) & 0xFFFF0000).view(np.float32)


@njit
def _f16_bits(v):
    """The float16 bit pattern nearest to float32 ``v`` (NaN stays a quiet NaN)."""
    w = np.int64(np.float32(v).view(np.uint32))
    sign = (w >> 16) & 0x8000
    a = w & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00 | ((a >> 13) & 0x3FF)
    if a >= _F16_OVERFLOW_BITS:
        return sign | 0x7C00
    if a >= _F16_MIN_NORMAL_BITS:
        return sign | ((a + 0xFFF + ((a >> 13) & 1) - 0x38000000) >> 13)
    return sign | np.int64(np.rint(np.float64(abs(v)) * 16777216.0))


@njit
def _bf16_bits(v):
    """The bfloat16 bit pattern nearest to float32 ``v`` (NaN stays a quiet NaN)."""
    w = np.int64(np.float32(v).view(np.uint32))
    if (w & 0x7FFFFFFF) > 0x7F800000:
        return ((w >> 16) | 0x40) & 0xFFFF
    return ((w + 0x7FFF + ((w >> 16) & 1)) >> 16) & 0xFFFF


@njit
def _rounded(v, fmt):
    """``v`` rounded to the compute format ``fmt`` (identity for NATIVE)."""
    if fmt == FLOAT16:
        return _round_f16(v)
    if fmt == BFLOAT16:
        return _round_bf16(v)
    return v


@njit
def _entry(x, data_fmt, fmt, scale, scale_value):
    """One stored contribution as it enters the sum: converted to the compute format, then scaled."""
    if data_fmt == FLOAT16:
        v = _rounded(_f16_value(x), fmt)
    elif data_fmt == BFLOAT16:
        v = _rounded(_bf16_value(x), fmt)
    else:
        v = x
    if scale == DIVIDE:
        v = _rounded(v / scale_value, fmt)
    elif scale == MULTIPLY:
        v = _rounded(v * scale_value, fmt)
    return v


# --------------------------------------------------------------------------- operations on one range


@njit
def _row_op(kind, row, src, slot, dst, m, data_fmt, fmt, scale, scale_value):
    """LOAD_ROW or ADD_ROW of ``row[src:src+m]`` into ``slot[dst:dst+m]``."""
    a = slot[dst:dst + m]
    x = row[src:src + m]
    if data_fmt == NATIVE and fmt == NATIVE:
        # Nothing to round by hand: loops without a call per element (they vectorize), the same
        # operations as :func:`_entry` in the same order (DDP's own averaging multiplies here).
        if scale == MULTIPLY:
            if kind == LOAD_ROW:
                for j in range(m):
                    a[j] = x[j] * scale_value
            else:
                for j in range(m):
                    a[j] += x[j] * scale_value
        elif scale == DIVIDE:
            if kind == LOAD_ROW:
                for j in range(m):
                    a[j] = x[j] / scale_value
            else:
                for j in range(m):
                    a[j] += x[j] / scale_value
        elif kind == LOAD_ROW:
            for j in range(m):
                a[j] = x[j]
        else:
            for j in range(m):
                a[j] += x[j]
    elif kind == LOAD_ROW:
        for j in range(m):
            a[j] = _entry(x[j], data_fmt, fmt, scale, scale_value)
    else:
        for j in range(m):
            a[j] = _rounded(a[j] + _entry(x[j], data_fmt, fmt, scale, scale_value), fmt)


@njit
def _slot_op(slot, above, off, m, fmt):
    """ADD_SLOT: ``slot[off:off+m] += above[off:off+m]``."""
    a = slot[off:off + m]
    b = above[off:off + m]
    if fmt == NATIVE:
        for j in range(m):
            a[j] += b[j]
    else:
        for j in range(m):
            a[j] = _rounded(a[j] + b[j], fmt)


@njit
def _finish(slot, off, m, out, out_off, post_divide, fmt, out_fmt):
    """Divide by ``post_divide`` (unless 0) in the compute format, then store in the output's format."""
    a = slot[off:off + m]
    o = out[out_off:out_off + m]
    if post_divide != 0:
        for j in range(m):
            a[j] = _rounded(a[j] / post_divide, fmt)
    if out_fmt == FLOAT16:
        for j in range(m):
            o[j] = _f16_bits(np.float32(a[j]))      # float64 goes through float32, as torch converts
    elif out_fmt == BFLOAT16:
        for j in range(m):
            o[j] = _bf16_bits(np.float32(a[j]))
    else:
        for j in range(m):
            o[j] = a[j]


# --------------------------------------------------------------------------- kernels


@njit(parallel=True)
def eval_columns(x, col0, starts, stops, progs, groups, ops, prog_off, nslots, tile, compute_like,
                 data_fmt, fmt, scale, scale_value, post_divide, out_fmt, out):
    """Evaluate parts ``[starts[p], stops[p])`` (each at most ``tile`` long) over the columns of ``x``.

    ``x`` is ``[W, b]`` holding elements ``col0 .. col0 + b``; part p runs
    program ``progs[p]`` (its ops are ``ops[prog_off[k]:prog_off[k + 1]]``) in
    slots of ``compute_like.dtype`` and writes ``out[starts[p]:stops[p]]``.
    ``groups`` splits the parts into contiguous runs of about equal size, one
    parallel task each.
    """
    for g in prange(groups.size - 1):
        slots = np.empty((nslots, tile), compute_like.dtype)
        for p in range(groups[g], groups[g + 1]):
            s = starts[p]
            m = stops[p] - s
            k = progs[p]
            for o in range(prog_off[k], prog_off[k + 1]):
                kind = ops[o, 0]
                d = ops[o, 2]
                if kind == ADD_SLOT:
                    _slot_op(slots[d], slots[d + 1], 0, m, fmt)
                else:
                    _row_op(kind, x[ops[o, 1]], s - col0, slots[d], 0, m, data_fmt, fmt, scale, scale_value)
            _finish(slots[0], 0, m, out, s, post_divide, fmt, out_fmt)


@njit
def stream_row(row, rank, starts, stops, progs, pc, ops, prog_off, slots,
               data_fmt, fmt, scale, scale_value):
    """Advance every part waiting for ``rank`` by its row operation and the slot additions after it.

    ``pc[p]`` is the index in ``ops`` of part p's next row operation (its
    program's end when done); ``slots`` is ``[nslots, N]``. Serial: one call
    per generated row, which costs more to make than this does to add.
    """
    for p in range(starts.size):
        i = pc[p]
        end = prog_off[progs[p] + 1]
        if i >= end or ops[i, 1] != rank:
            continue
        s = starts[p]
        m = stops[p] - s
        _row_op(ops[i, 0], row, s, slots[ops[i, 2]], s, m, data_fmt, fmt, scale, scale_value)
        i += 1
        while i < end and ops[i, 0] == ADD_SLOT:
            d = ops[i, 2]
            _slot_op(slots[d], slots[d + 1], s, m, fmt)
            i += 1
        pc[p] = i


@njit
def needed_ranks(pc, progs, ops, prog_off, world_size):
    """Which ranks some part still waits for."""
    need = np.zeros(world_size, np.bool_)
    for p in range(pc.size):
        if pc[p] < prog_off[progs[p] + 1]:
            need[ops[pc[p], 1]] = True
    return need


@njit
def finish_parts(slot, starts, stops, post_divide, fmt, out_fmt, out):
    """Finish every part's result in ``slot`` (full length) into ``out``."""
    for p in range(starts.size):
        _finish(slot, starts[p], stops[p] - starts[p], out, starts[p], post_divide, fmt, out_fmt)
