"""Summation programs and the engine that runs them over contributions.

A reduction order is, per range of elements, a *program*: a postfix
expression over ranks, where an integer ``r >= 0`` pushes rank r's value and
:data:`ADD` pops two values and pushes their sum, rounded in the compute
dtype. ``(2, 1, ADD, 0, ADD)`` is ``(x2 + x1) + x0``. A :class:`Piece` binds a
program to the element range ``[start, stop)`` it governs (a gloo ring chunk,
an NCCL channel, a reduce-scatter shard, ...).

Every addition is one correctly rounded operation in the compute dtype, as in
gloo and NCCL. :func:`run` evaluates any pieces list with compiled kernels
(:mod:`ddplab.numerics._program_kernels`): tensors and slice callables in
column tiles that stay in cache, all pieces in one parallel pass over memory;
row callables rank by rank into full-length accumulators, each row generated
as few times as the programs allow. Dtype combinations the kernels do not
cover (other integer types, for instance) fall back to :func:`run_torch`, the
same evaluation as in-place torch ops, which also serves as the reference the
kernels are tested against.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import NamedTuple, Sequence

import numpy as np
import numba
import torch

from ddplab.numerics import _program_kernels as K
from ddplab.numerics._parallel import within_torch_threads
from ddplab.numerics.contributions import Contributions

__all__ = ["ADD", "Piece", "Arithmetic", "chain_program", "tree_program", "program_depth",
           "program_ranks", "check_program", "merge_pieces", "run", "run_torch"]

ADD = -1

# Compiled engine: elements per tile, the unit a program runs over while its slots stay in cache
# (64 KiB per float32 slot; chains use one slot, trees about log2 W).
_TILE = 16384
# Bytes of generated [W, block] columns per kernel call for slice callables. Under glibc's mmap
# threshold (32 MiB at most), so that each block reuses the last one's memory instead of faulting in
# fresh pages: DDP's 25M-element bucket at W=2 in 112 ms instead of 177 ms (measured, one process).
_SLICE_BLOCK_BYTES = 8 << 20
# torch engine: column block per in-cache step; large enough that each torch op amortizes
# its dispatch, small enough that the accumulators stay in L2.
_BLOCK_BYTES = 1 << 20


class Piece(NamedTuple):
    """Elements ``[start, stop)`` are reduced by ``program``."""

    start: int
    stop: int
    program: tuple


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """Where rounding happens: the result dtype, the dtype every operation rounds to, and scaling.

    ``scale`` is ``None``, ``"div"`` (each contribution divided by
    ``scale_value`` before it enters the sum) or ``"mul"`` (multiplied by
    ``scale_value``, already a value of the compute dtype); ``post_divide``
    divides the finished sum. All of it happens in ``compute``; the result is
    rounded to ``dtype`` once at the end.
    """

    dtype: torch.dtype
    compute: torch.dtype
    scale: str | None = None
    scale_value: float | int | None = None
    post_divide: int | None = None


def chain_program(ranks: Sequence[int]) -> tuple:
    """``((x_a + x_b) + x_c) + ...`` for ranks ``a, b, c, ...`` in that order."""
    ranks = [int(r) for r in ranks]
    prog = [ADD] * (2 * len(ranks) - 1)
    prog[0] = ranks[0]
    prog[1::2] = ranks[1:]
    return tuple(prog)


def tree_program(tree) -> tuple:
    """Postfix program of a binary tree given as nested pairs: ``((0, 1), 2)`` is ``(x0 + x1) + x2``."""
    if isinstance(tree, (int, np.integer)):
        return (int(tree),)
    left, right = tree
    return tree_program(left) + tree_program(right) + (ADD,)


def program_ranks(program: Sequence[int]) -> tuple:
    """The ranks a program reads, in the order it reads them."""
    return tuple(op for op in program if op >= 0)


def program_depth(program: Sequence[int]) -> int:
    """The largest number of additions any one addend passes through (the d of gamma_d)."""
    stack = []
    for op in program:
        if op >= 0:
            stack.append(0)
        else:
            b, a = stack.pop(), stack.pop()
            stack.append(max(a, b) + 1)
    return stack[0]


def _stack_depth(program: Sequence[int]) -> int:
    # Slots the engine needs: a push directly followed by ADD is fused into an in-place add.
    depth = peak = 0
    i = 0
    while i < len(program):
        if program[i] >= 0 and i + 1 < len(program) and program[i + 1] == ADD:
            i += 2
        elif program[i] >= 0:
            depth += 1
            peak = max(peak, depth)
            i += 1
        else:
            depth -= 1
            i += 1
    return peak


def check_program(program: Sequence[int], world_size: int) -> None:
    """Raise ValueError unless the program reads each of the W ranks once and leaves one value."""
    depth = 0
    for op in program:
        if op >= 0:
            depth += 1
        elif op == ADD:
            if depth < 2:
                raise ValueError(f"malformed program {program}: ADD needs two operands")
            depth -= 1
        else:
            raise ValueError(f"malformed program {program}: unknown op {op}")
    if depth != 1:
        raise ValueError(f"malformed program {program}: leaves {depth} values")
    if sorted(program_ranks(program)) != list(range(world_size)):
        raise ValueError(f"program {program} must read each of ranks 0..{world_size - 1} exactly once")


def merge_pieces(pieces: Sequence[Piece]) -> list[Piece]:
    """Sort pieces, drop empty ones and join neighbours that share a program."""
    merged: list[Piece] = []
    for p in sorted((p for p in pieces if p.stop > p.start), key=lambda p: p.start):
        if merged and merged[-1].stop == p.start and merged[-1].program == p.program:
            merged[-1] = Piece(merged[-1].start, p.stop, p.program)
        else:
            merged.append(p)
    return merged


def _checked_pieces(pieces: Sequence[Piece], n: int) -> list[Piece]:
    """The non-empty pieces in order (see :func:`merge_pieces`); ValueError for one outside ``[0, n)``
    or for two that overlap (which program would an element follow?)."""
    pieces = merge_pieces(pieces)
    for i, p in enumerate(pieces):
        if p.start < 0 or p.stop > n:
            raise ValueError(f"piece [{p.start}, {p.stop}) outside the {n} elements")
        if i and p.start < pieces[i - 1].stop:
            raise ValueError(f"pieces [{pieces[i - 1].start}, {pieces[i - 1].stop}) and [{p.start}, {p.stop}) overlap")
    return pieces


def run(contributions: Contributions, pieces: Sequence[Piece], arith: Arithmetic) -> torch.Tensor:
    """Evaluate the pieces' programs over the contributions; return the [N] result in ``arith.dtype``.

    Pieces may come in any order; elements no piece covers are left
    uninitialized. Raises ValueError for a piece outside ``[0, N)``, pieces
    that overlap, or a program that is malformed or reads a rank outside ``[0, W)``.
    """
    pieces = _checked_pieces(pieces, contributions.numel)
    if not pieces:
        return torch.empty(contributions.numel, dtype=arith.dtype)
    spec = _KernelArithmetic.of(contributions.dtype, arith)
    if spec is None:
        return run_torch(contributions, pieces, arith)
    table = _ProgramTable(pieces, contributions.world_size)
    if contributions.streams_rows:
        return _run_rows(contributions, table, spec)
    return _run_columns(contributions, table, spec)


def run_torch(contributions: Contributions, pieces: Sequence[Piece], arith: Arithmetic) -> torch.Tensor:
    """:func:`run` with in-place torch ops, one per program step and column block (the reference)."""
    pieces = _checked_pieces(pieces, contributions.numel)
    if not pieces:
        return torch.empty(contributions.numel, dtype=arith.dtype)
    table = _ProgramTable(pieces, contributions.world_size)   # validates the programs
    if contributions.streams_rows:
        return _run_streaming(contributions, pieces, arith, table.pass_order())
    return _run_blocked(contributions, pieces, arith)


# --------------------------------------------------------------------------- compiled engine

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FORMAT = {torch.float16: K.FLOAT16, torch.bfloat16: K.BFLOAT16}


@dataclasses.dataclass(frozen=True)
class _KernelArithmetic:
    """An :class:`Arithmetic` as the kernels take it: format codes and typed scalars."""

    out_dtype: torch.dtype
    compute_like: np.ndarray     # empty array of the slots' dtype: float32 (also for the half formats), float64, int64
    data_fmt: int
    fmt: int
    out_fmt: int
    scale: int
    scale_value: object
    post_divide: object

    @classmethod
    def of(cls, data: torch.dtype, arith: Arithmetic) -> "_KernelArithmetic | None":
        """The kernels' view of ``arith`` on ``data``, or None where they do not reproduce torch's ops."""
        compute, out = arith.compute, arith.dtype
        if compute == torch.int64:
            if data != torch.int64 or out != torch.int64 or arith.scale or arith.post_divide is not None:
                return None
            kind = np.int64
        elif compute in _FLOATS and data in _FLOATS and out in _FLOATS:
            # Data must enter the compute format exactly or as one rounding of a float32 value.
            if data == torch.float64 and compute != torch.float64:
                return None
            if data == torch.float32 and compute not in (torch.float32, torch.float64):
                return None
            kind = np.float64 if compute == torch.float64 else np.float32
        else:
            return None
        scale, scale_value = K.NO_SCALE, kind(0)
        if arith.scale is not None:
            scale = {"div": K.DIVIDE, "mul": K.MULTIPLY}.get(arith.scale)
            scale_value = kind(arith.scale_value)
            if scale is None or float(scale_value) != arith.scale_value:
                return None
        post = kind(0) if arith.post_divide is None else kind(arith.post_divide)
        if arith.post_divide is not None and (arith.post_divide == 0 or float(post) != arith.post_divide):
            return None
        return cls(out, np.empty(0, kind), _FORMAT.get(data, K.NATIVE), _FORMAT.get(compute, K.NATIVE),
                   _FORMAT.get(out, K.NATIVE), scale, scale_value, post)


class _ProgramTable:
    """The pieces as arrays: ``starts``, ``stops``, ``progs`` (index of the piece's program), and the
    programs' compiled ops, program k being ``ops[prog_off[k]:prog_off[k + 1]]``."""

    def __init__(self, pieces: Sequence[Piece], world_size: int):
        ids: dict[tuple, int] = {}
        programs = []
        progs = np.empty(len(pieces), np.int64)
        for i, p in enumerate(pieces):
            k = ids.get(p.program)
            if k is None:
                k = ids[p.program] = len(programs)
                programs.append(p.program)
            progs[i] = k
        self.world_size = world_size
        self.starts = np.fromiter((p.start for p in pieces), np.int64, len(pieces))
        self.stops = np.fromiter((p.stop for p in pieces), np.int64, len(pieces))
        self.progs = progs
        # Filled in place: W ring programs of W ranks each are O(W^2) ops, not worth holding twice.
        self.prog_off = np.zeros(len(programs) + 1, np.int64)
        self.prog_off[1:] = np.cumsum([K.op_count(program) for program in programs])
        self.ops = np.empty((int(self.prog_off[-1]), 3), np.int32)
        for k, program in enumerate(programs):
            self.ops[self.prog_off[k]:self.prog_off[k + 1]] = K.compile_program(program, world_size)
        self.nslots = 1 + int(self.ops[:, 2].max())

    def parts(self, lo: int, hi: int, size: int, groups: int):
        """The pieces clipped to ``[lo, hi)`` and cut into parts of at most ``size`` elements,
        plus bounds splitting the parts into ``groups`` runs of about equal total length."""
        first = int(np.searchsorted(self.stops, lo, side="right"))
        last = int(np.searchsorted(self.starts, hi, side="left"))
        starts = np.maximum(self.starts[first:last], lo)
        stops = np.minimum(self.stops[first:last], hi)
        progs = self.progs[first:last]
        counts = -(-(stops - starts) // size)
        idx = np.repeat(np.arange(starts.size), counts)
        within = np.arange(idx.size) - np.repeat(np.cumsum(counts) - counts, counts)
        part_starts = starts[idx] + within * size
        part_stops = np.minimum(part_starts + size, stops[idx])
        cum = np.cumsum(part_stops - part_starts)
        total = int(cum[-1]) if cum.size else 0
        cuts = np.searchsorted(cum, np.arange(1, groups) * (total / groups), side="left") + 1
        bounds = np.concatenate([[0], np.minimum(cuts, idx.size), [idx.size]]).astype(np.int64)
        return part_starts, part_stops, progs[idx], bounds

    def pass_order(self) -> list[int]:
        """The rank order in which to generate rows so that every program finishes in the fewest passes.

        A program needs one pass plus one per place where it reads a rank that
        comes earlier in the pass order than the rank before it.
        """
        w = self.world_size
        is_row = self.ops[:, 0] != K.ADD_SLOT
        prog_of = np.repeat(np.arange(self.prog_off.size - 1), np.diff(self.prog_off))[is_row]
        ranks = self.ops[is_row, 1]
        same = prog_of[1:] == prog_of[:-1]
        first = ranks[prog_of == self.progs[0]]
        candidates = [list(range(w)), list(range(w - 1, -1, -1)), [int(r) for r in first]]

        def passes(order):
            pos = np.empty(w, np.int64)
            pos[np.asarray(order)] = np.arange(w)
            back = (np.diff(pos[ranks]) < 0) & same
            return 1 + int(np.bincount(prog_of[1:][back], minlength=1).max())

        return min(candidates, key=passes)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor; float16/bfloat16 as their 16-bit patterns."""
    t = t.detach()
    if t.dtype in _FORMAT:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


@within_torch_threads
def _run_columns(c: Contributions, table: _ProgramTable, spec: _KernelArithmetic) -> torch.Tensor:
    n = c.numel
    out = torch.empty(n, dtype=spec.out_dtype)
    out_np = _as_numpy(out)
    groups = numba.get_num_threads()
    item = torch.empty((), dtype=c.dtype).element_size()
    block = n if c.kind == "tensor" else max(_TILE, _SLICE_BLOCK_BYTES // (c.world_size * item))
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        starts, stops, progs, bounds = table.parts(lo, hi, _TILE, groups)
        if starts.size == 0:
            continue
        x = _as_numpy(c.columns(lo, hi).contiguous())
        K.eval_columns(x, lo, starts, stops, progs, bounds, table.ops, table.prog_off, table.nslots, _TILE,
                       spec.compute_like, spec.data_fmt, spec.fmt, spec.scale, spec.scale_value,
                       spec.post_divide, spec.out_fmt, out_np)
    return out


@within_torch_threads
def _run_rows(c: Contributions, table: _ProgramTable, spec: _KernelArithmetic) -> torch.Tensor:
    out = torch.empty(c.numel, dtype=spec.out_dtype)
    slots = np.empty((table.nslots, c.numel), spec.compute_like.dtype)
    pc = table.prog_off[table.progs].copy()
    order = table.pass_order()
    args = (table.starts, table.stops, table.progs, pc, table.ops, table.prog_off)
    need = K.needed_ranks(pc, table.progs, table.ops, table.prog_off, c.world_size)
    while need.any():
        for r in order:
            if need[r]:
                row = _as_numpy(c.row(r).contiguous())
                K.stream_row(row, r, *args, slots, spec.data_fmt, spec.fmt, spec.scale, spec.scale_value)
                need = K.needed_ranks(pc, table.progs, table.ops, table.prog_off, c.world_size)
    K.finish_parts(slots[0], table.starts, table.stops, spec.post_divide, spec.fmt, spec.out_fmt,
                   _as_numpy(out))
    return out


# --------------------------------------------------------------------------- torch engine


def _scale_(t: torch.Tensor, arith: Arithmetic) -> None:
    if arith.scale == "div":
        t.div_(arith.scale_value)
    elif arith.scale == "mul":
        t.mul_(arith.scale_value)


def _finish(acc: torch.Tensor, out: torch.Tensor, arith: Arithmetic) -> None:
    if arith.post_divide is not None:
        acc.div_(arith.post_divide)
    if acc.data_ptr() != out.data_ptr():
        out.copy_(acc)


def _run_blocked(c: Contributions, pieces: Sequence[Piece], arith: Arithmetic) -> torch.Tensor:
    n = c.numel
    out = torch.empty(n, dtype=arith.dtype)
    if n == 0:
        return out
    direct = arith.compute == arith.dtype   # accumulate straight into the output
    block = max(4096, _BLOCK_BYTES // torch.empty((), dtype=arith.compute).element_size())
    depth = max(_stack_depth(p.program) for p in pieces)
    slots = [torch.empty(block, dtype=arith.compute) for _ in range(depth)]
    tmp = torch.empty(block, dtype=arith.compute) if arith.scale else None
    first = 0
    for start in range(0, n, block):
        stop = min(n, start + block)
        cols = c.columns(start, stop)
        while pieces[first].stop <= start:
            first += 1
        k = first
        while k < len(pieces) and pieces[k].start < stop:
            a, b = max(start, pieces[k].start), min(stop, pieces[k].stop)
            _eval_block(pieces[k].program, cols, a - start, b - start, out[a:b], slots, tmp, arith, direct)
            k += 1
    return out


def _eval_block(program, cols, lo, hi, out_view, slots, tmp, arith, direct) -> None:
    n = hi - lo

    def slot(d):
        return out_view if (d == 0 and direct) else slots[d][:n]

    d = 0
    i = 0
    while i < len(program):
        op = program[i]
        if op >= 0:
            src = cols[op, lo:hi]
            if i + 1 < len(program) and program[i + 1] == ADD:
                target = slot(d - 1)
                if arith.scale:
                    t = tmp[:n]
                    t.copy_(src)
                    _scale_(t, arith)
                    target.add_(t)
                else:
                    target.add_(src)
                i += 2
            else:
                target = slot(d)
                target.copy_(src)
                _scale_(target, arith)
                d += 1
                i += 1
        else:
            slot(d - 2).add_(slot(d - 1))
            d -= 1
            i += 1
    _finish(slot(0), out_view, arith)


def _advance(program, pc, depth):
    """Operations from the push at ``pc`` up to (not including) the next push."""
    ops = []
    if pc + 1 < len(program) and program[pc + 1] == ADD:
        ops.append(("add_row", depth - 1))
        pc += 2
    else:
        ops.append(("load_row", depth))
        depth += 1
        pc += 1
    while pc < len(program) and program[pc] == ADD:
        ops.append(("add_slot", depth - 2))
        depth -= 1
        pc += 1
    return tuple(ops), pc, depth


def _merged_ranges(ranges):
    out = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return out


def _run_streaming(c: Contributions, pieces: Sequence[Piece], arith: Arithmetic, order: list[int]) -> torch.Tensor:
    n = c.numel
    out = torch.empty(n, dtype=arith.dtype)
    if n == 0:
        return out
    direct = arith.compute == arith.dtype
    depth = max(_stack_depth(p.program) for p in pieces)
    bufs = [out if (d == 0 and direct) else torch.empty(n, dtype=arith.compute) for d in range(depth)]
    tmp = torch.empty(n, dtype=arith.compute) if arith.scale else None
    pc = [0] * len(pieces)
    dep = [0] * len(pieces)
    waiting: dict[int, list[int]] = defaultdict(list)
    for k, p in enumerate(pieces):
        waiting[p.program[0]].append(k)
    while waiting:
        for r in order:
            ready = waiting.pop(r, None)
            if not ready:
                continue
            row = c.row(r)
            groups: dict[tuple, list] = defaultdict(list)
            for k in ready:
                prog = pieces[k].program
                ops, pc[k], dep[k] = _advance(prog, pc[k], dep[k])
                groups[ops].append((pieces[k].start, pieces[k].stop))
                if pc[k] < len(prog):
                    waiting[prog[pc[k]]].append(k)
            # Pieces at the same step of the same kind of program share one op per contiguous run.
            for ops, ranges in groups.items():
                for a, b in _merged_ranges(ranges):
                    _apply(ops, row[a:b], bufs, a, b, tmp, arith)
    _finish(bufs[0], out, arith)
    return out


def _apply(ops, row, bufs, a, b, tmp, arith) -> None:
    for kind, d in ops:
        if kind == "add_row":
            if arith.scale:
                t = tmp[a:b]
                t.copy_(row)
                _scale_(t, arith)
                bufs[d][a:b].add_(t)
            else:
                bufs[d][a:b].add_(row)
        elif kind == "load_row":
            bufs[d][a:b].copy_(row)
            _scale_(bufs[d][a:b], arith)
        else:
            bufs[d][a:b].add_(bufs[d + 1][a:b])
