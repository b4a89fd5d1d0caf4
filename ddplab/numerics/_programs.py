"""Summation programs and the engine that runs them over contributions.

A reduction order is, per range of elements, a *program*: a postfix
expression over ranks, where an integer ``r >= 0`` pushes rank r's value and
:data:`ADD` pops two values and pushes their sum, rounded in the compute
dtype. ``(2, 1, ADD, 0, ADD)`` is ``(x2 + x1) + x0``. A :class:`Piece` binds a
program to the element range ``[start, stop)`` it governs (a gloo ring chunk,
an NCCL channel, ...).

The engine evaluates pieces with in-place torch adds, so every addition is
one correctly rounded operation in the dtype, as in gloo and NCCL (torch's
CPU float16/bfloat16 add computes in float32 and rounds once, which equals
rounding the exact sum because float32 has more than 2p+2 bits). Tensors and
slice callables are processed in column blocks that stay in cache; row
callables are streamed rank by rank into full-length accumulators, each row
generated as few times as the programs allow.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ddplab.numerics.contributions import Contributions

__all__ = ["ADD", "Piece", "Arithmetic", "chain_program", "tree_program", "program_depth",
           "program_ranks", "check_program", "merge_pieces", "run"]

ADD = -1

# Column block per in-cache step: large enough that each torch op amortizes its
# dispatch and parallelizes, small enough that the accumulators stay in L2.
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
    prog = [ranks[0]]
    for r in ranks[1:]:
        prog += [r, ADD]
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


def _scale_(t: torch.Tensor, arith: Arithmetic) -> None:
    if arith.scale == "div":
        t.div_(arith.scale_value)
    elif arith.scale == "mul":
        t.mul_(arith.scale_value)


def run(contributions: Contributions, pieces: Sequence[Piece], arith: Arithmetic) -> torch.Tensor:
    """Evaluate the pieces' programs over the contributions; return the [N] result in ``arith.dtype``."""
    if contributions.streams_rows:
        return _run_streaming(contributions, pieces, arith)
    return _run_blocked(contributions, pieces, arith)


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


def _pass_order(pieces: Sequence[Piece], world_size: int) -> list[int]:
    """The rank order in which to generate rows so that every program finishes in the fewest passes.

    A program needs one pass plus one per place where it reads a rank that
    comes earlier in the pass order than the rank before it.
    """
    seqs = {program_ranks(p.program) for p in pieces}
    candidates = [list(range(world_size)), list(range(world_size - 1, -1, -1)), list(program_ranks(pieces[0].program))]

    def passes(order):
        pos = np.empty(world_size, np.int64)
        pos[np.asarray(order)] = np.arange(world_size)
        return max(1 + int((np.diff(pos[np.asarray(s)]) < 0).sum()) for s in seqs)

    return min(candidates, key=passes)


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


def _run_streaming(c: Contributions, pieces: Sequence[Piece], arith: Arithmetic) -> torch.Tensor:
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
    order = _pass_order(pieces, c.world_size)
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
