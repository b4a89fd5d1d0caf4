"""A stand-in process group: what a rank's own code reads of ``torch.distributed``, in a process with none.

The parent process re-executes ranks' steps (the replay), fits gradients of
batch pieces (localization) and tries the setup before anything launches. User
code that reads the process group -- a loss that divides by
``dist.get_world_size()``, a ``ZeroRedundancyOptimizer`` that partitions the
parameters by rank -- must see there what it saw where it ran.
:func:`process_group` makes torch's default group, for the duration of a block,
one of ``world_size`` ranks answering ``rank`` (torch's ``fake`` backend: its
collectives complete without communicating and leave their tensors as they
are). :func:`reads_process_group` says whether the setup's loss gives other
bits under a stand-in of W ranks than under one of one rank:
then the float64 promise, computed in the reference's one-rank launch, is not
what the ranks promise, and the comparison leaves that question to the float64
run of the user's own code on W ranks.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["process_group", "reads_process_group"]

#: (rank, world_size) of the stand-ins open in this process, innermost last.
_OPEN: list[tuple[int, int]] = []


def _init(rank: int, world_size: int) -> None:
    # torch registers its fake backend when this module is imported.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    hook = sys.excepthook  # init_process_group prefixes every later traceback with "[rank0]"
    try:
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    finally:
        sys.excepthook = hook


@contextlib.contextmanager
def process_group(rank: int, world_size: int) -> Iterator[bool]:
    """Inside the block, ``dist.get_rank()`` is ``rank`` and ``dist.get_world_size()`` is ``world_size``.

    Yields True. Where this process has a process group of its own (a rank, the
    reference's launch) nothing changes and it yields False. Stand-ins nest: the
    inner one replaces the outer for its block.
    """
    if not dist.is_available() or (dist.is_initialized() and not _OPEN):
        yield False
        return
    if _OPEN and _OPEN[-1] == (rank, world_size):  # the same stand-in: keep it (DDP holds its group)
        yield True
        return
    if _OPEN:
        dist.destroy_process_group()
    _init(rank, world_size)
    _OPEN.append((rank, world_size))
    try:
        yield True
    finally:
        _OPEN.pop()
        dist.destroy_process_group()
        if _OPEN:
            _init(*_OPEN[-1])


def reads_process_group(setup, world_size: int) -> bool:
    """Whether the setup's loss, on the model's output for batch 0 at the initial weights, gives other
    bits on some rank of ``world_size`` than in one process (a loss that reads ``dist.get_world_size()``)."""
    import cloudpickle

    from ddplab.compare.compiled import eager
    from ddplab.compare.setup import global_batches

    # On a copy, as the ranks get it: a loss that keeps state (a call counter) must reach the ranks
    # and the replay as the user left it, whenever this probe runs.
    setup = cloudpickle.loads(cloudpickle.dumps(setup))
    batch = global_batches(setup, 1)[0]
    rng = torch.get_rng_state()
    try:
        with process_group(0, 1), eager(), torch.no_grad():
            out = setup.build_model()(*batch[:-1])
    finally:
        torch.set_rng_state(rng)

    def loss(rank: int, world: int) -> torch.Tensor:
        with process_group(rank, world), torch.no_grad():
            return setup.loss(out, batch[-1]).detach()

    alone = loss(0, 1)
    return any(not torch.equal(loss(r, world_size), alone) for r in range(world_size))
