"""What the reduction emulator refuses, before any work: runs it cannot do in O(N) memory and bounded time.

An emulated reduction of W contributions of N elements costs

* **time**: W·N additions (every contribution enters every element once), plus
  for row callables the generation of W rows of N elements;
* **memory**: O(N) for the result and the running sums, plus its *summation
  programs*: one per distinct order of the ranks, of 2W − 1 steps each. A
  fixed order (sequential, reverse, pairwise) has one program and NCCL's tree
  two, but a ring has one per chunk owner: up to W programs, W·(2W − 1) steps,
  O(W²) memory.

So the emulator refuses a reduction of more than :data:`MAX_ADDITIONS`
additions (W·N = 2^30: 1024 ranks of 2^20 elements take about 20 s on 2 cores
with generated rows) and one whose programs need more than
:data:`MAX_PROGRAM_STEPS` steps (2^22: a ring of at most 1448 ranks, about
100 MiB of programs), with both figures and the limit in the message. At
W = N = 65 536 a ring's programs alone would take 8.6·10^9 steps (more than
100 GiB), and any order 4.3·10^9 additions.

Example::

    >>> check_additions(1024, 1 << 20, "reduce")
    >>> check_program_steps(65536, 65536, "gloo_ring")
    Traceback (most recent call last):
    ...
    ValueError: gloo_ring over W=65536 ranks needs 65536 summation programs of 131071 steps (8.59e+09 steps); the emulator holds at most 4194304 (4.19e+06; a ring of at most 1448 ranks), so that its memory stays O(N): use fewer ranks or a fixed order (sequential, reverse, pairwise) or nccl_tree
"""
from __future__ import annotations

import math

__all__ = ["MAX_ADDITIONS", "MAX_PROGRAM_STEPS", "check_additions", "check_program_steps"]

#: The most additions (W·N) one emulated reduction may take: bounded time.
MAX_ADDITIONS = 1 << 30
#: The most steps all summation programs of one emulated reduction may hold: O(N) memory, not O(W²).
MAX_PROGRAM_STEPS = 1 << 22


def _largest_ring() -> int:
    """The most ranks whose W programs of 2W − 1 steps fit :data:`MAX_PROGRAM_STEPS`."""
    return int((1 + math.sqrt(1 + 8 * MAX_PROGRAM_STEPS)) / 4)


def check_additions(world_size: int, numel: int, what: str) -> None:
    """ValueError when reducing ``world_size`` contributions of ``numel`` elements passes
    :data:`MAX_ADDITIONS`, naming ``what`` and both figures."""
    additions = world_size * numel
    if additions > MAX_ADDITIONS:
        raise ValueError(f"{what} of W={world_size} contributions of N={numel} elements takes W·N = "
                         f"{additions:.3g} additions; the emulator does at most {MAX_ADDITIONS} "
                         f"({MAX_ADDITIONS:.3g}: 1024 ranks of 2^20 elements, about 20 s on 2 cores): "
                         f"use fewer ranks or fewer elements (a slice of the tensor)")


def check_program_steps(programs: int, world_size: int, order: str) -> None:
    """ValueError when ``programs`` summation programs over ``world_size`` ranks (2W − 1 steps
    each) pass :data:`MAX_PROGRAM_STEPS`; called before any program is built."""
    steps = programs * (2 * world_size - 1)
    if steps > MAX_PROGRAM_STEPS:
        raise ValueError(f"{order} over W={world_size} ranks needs {programs} summation programs of "
                         f"{2 * world_size - 1} steps ({steps:.3g} steps); the emulator holds at most "
                         f"{MAX_PROGRAM_STEPS} ({MAX_PROGRAM_STEPS:.3g}; a ring of at most "
                         f"{_largest_ring()} ranks), so that its memory stays O(N): use fewer ranks or a "
                         f"fixed order (sequential, reverse, pairwise) or nccl_tree")
