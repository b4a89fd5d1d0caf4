"""Optimizers whose state lives in shards, one per rank: captured per shard, replayed per shard.

``torch.distributed.optim.ZeroRedundancyOptimizer`` partitions the parameters
over the ranks: each rank keeps the state of its own parameters in a local
optimizer (``zero.optim``), steps only those, and then broadcasts them to the
others. Its ``state_dict()`` is a collective that needs
``consolidate_state_dict()`` first, so ddplab never calls it: each rank's
capture holds its own shard (:func:`capture_state`: the local optimizer's
state per parameter name, and which parameters the rank owns).

The replay (:mod:`ddplab.compare.replay`) builds the setup's optimizer under a
stand-in process group of the rank's size and rank
(:mod:`ddplab.compare.stand_in`), so that it partitions the parameters as the
rank did, loads the rank's shard into it (:func:`restore_state`) and steps:
the parameters the rank owns must come out bit for bit as the rank's
(:func:`owned`). The broadcast that follows is checked like any collective:
every rank must hold, bit for bit, what the owner of each parameter holds
(:func:`broadcast_records`).
"""
from __future__ import annotations

import sys

import torch

__all__ = ["local_optimizer", "capture_state", "restore_state", "owned", "broadcast_records"]


def local_optimizer(optimizer) -> torch.optim.Optimizer | None:
    """The optimizer holding this rank's shard of ``optimizer``'s state (ZeRO's ``optim``), or None
    when ``optimizer`` holds all of its state itself."""
    # A ZeroRedundancyOptimizer exists only once its module was imported. Importing it here would cost
    # every rank of every launch a quarter second (torch.distributed.optim compiles TorchScript).
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    return optimizer.optim if zero is not None and isinstance(optimizer, zero) else None


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def capture_state(optimizer, named: list) -> dict | None:
    """This rank's shard of a sharded optimizer's state, without any collective: ``owned`` (the names
    of the parameters it updates) and ``state`` (name -> the local optimizer's state, cloned);
    None for an optimizer that is not sharded."""
    local = local_optimizer(optimizer)
    if local is None:
        return None
    names = {id(p): n for n, p in named}
    mine = [p for group in local.param_groups for p in group["params"]]
    return dict(sharded=type(optimizer).__name__, owned=[names[id(p)] for p in mine if id(p) in names],
                state={names[id(p)]: {key: _clone(v) for key, v in local.state[p].items()}
                       for p in mine if id(p) in names and p in local.state})


def owned(captured: dict | None) -> set[str] | None:
    """The names of the parameters a sharded capture's rank updates; None: it updates all of them."""
    if not captured or "sharded" not in captured:
        return None
    return set(captured["owned"])


def restore_state(optimizer, named: list, captured: dict) -> bool:
    """Load a rank's captured shard into ``optimizer`` (built as the rank built it). Returns False,
    doing nothing, when either is not sharded; raises ValueError when the partitions differ."""
    local = local_optimizer(optimizer)
    if local is None or "sharded" not in captured:
        return False
    by_id = {id(p): n for n, p in named}
    mine = [by_id[id(p)] for group in local.param_groups for p in group["params"] if id(p) in by_id]
    if sorted(mine) != sorted(captured["owned"]):
        raise ValueError(f"the replay's {captured['sharded']} gives this rank {sorted(mine)}, the rank "
                         f"owned {sorted(captured['owned'])}")
    params = dict(named)
    for name, entry in captured["state"].items():
        local.state[params[name]] = {key: _clone(v) for key, v in entry.items()}
    return True


def broadcast_records(emit, step: int, caps: list[dict]) -> None:
    """The broadcast of the updated shards: every rank's parameter, bit for bit against its owner's.

    ``emit(step, rank, param, live, expected)`` records one comparison; ``caps[r]`` is rank r's
    capture of ``step`` (its ``optimizer`` entry says what it owns). Nothing for unsharded optimizers.
    """
    owner = {}
    for rank, cap in enumerate(caps):
        for name in owned(cap.get("optimizer")) or ():
            owner[name] = rank
    if not owner:
        return
    for rank, cap in enumerate(caps):
        for name, live in cap["params"].items():
            if name in owner and owner[name] != rank:
                emit(step, rank, name, live, caps[owner[name]]["params"][name])
