"""Per-rank data: each rank's own batches beside the global batches the reference trains on.

By default rank r of W trains the r-th of W equal, contiguous shares of each
global batch (:func:`ddplab.compare.setup.split`). Real training feeds each
rank from its own loader, often through a ``DistributedSampler`` that pads the
dataset (repeating samples) or drops its tail. ``Setup.rank_batches(rank,
world_size, step)`` gives that rank's batch of that step directly; the
reference still trains ``Setup.batches``, what one process would train on.

* :func:`rank_share` / :func:`rank_micro_batches` -- what a rank trains at a
  step (its batch cut into ``k`` micro-batches), used alike by the ranks, the
  twin, the float64 runs, the promise and the replay;
* :func:`reference_parts` -- how one process weights a step whose shares are
  uneven: DDP averages the ranks' means, so where the ranks hold exactly the
  global batch's samples in shares of unequal size, the reference averages
  the per-share mean losses too (the mean of per-rank means); even shares
  are one mean over the whole batch;
* :func:`sample_records` -- every sample, identified by its bytes, counted in
  the ranks' batches against the global batch of the same step: a sample
  that ranks train more often than the global batch holds it (a sampler's
  padding) is a *duplicated contribution*, one they train less often a
  *missing contribution*. Each is named by where it first appears in the
  global batches (``step 0 sample 3``), with the ranks that hold it.

Records: ``data_checked`` (per step: the global batch's size, ``shares`` the
ranks' batch sizes, ``uneven``) and ``data_difference`` (per sample and step:
``kind``, ``sample``, ``sample_step``, ``sample_index``, ``ranks``; the value is
how many times more (+) or fewer (−) the ranks train it than one process).
"""
from __future__ import annotations

import collections
import hashlib

import torch

from ddplab.compare.setup import SetupError, cast_batch, split
from ddplab.records import record

__all__ = ["rank_share", "rank_micro_batches", "batch_pieces", "reference_parts", "sample_keys",
           "check_rank_batches", "sample_records", "shares_world"]


def rank_share(setup, batch: tuple, step: int, rank: int, world: int, dtype: torch.dtype | None = None) -> tuple:
    """What ``rank`` of ``world`` trains at ``step``: ``setup.rank_batches(rank, world, step)`` (cast to
    ``dtype``), or else the rank-th of ``world`` equal shares of the global ``batch`` (as given)."""
    if getattr(setup, "rank_batches", None) is None:
        return split(batch, world)[rank]
    return cast_batch(tuple(setup.rank_batches(rank, world, step)), dtype)


def rank_micro_batches(setup, batch: tuple, step: int, rank: int, world: int, k: int,
                       dtype: torch.dtype | None = None) -> list[tuple]:
    """The ``k`` micro-batches ``rank`` trains at ``step`` (its share cut into k equal pieces)."""
    return split(rank_share(setup, batch, step, rank, world, dtype), k)


def batch_pieces(setup, batch: tuple, step: int, world: int, k: int, dtype: torch.dtype | None = None) -> list[tuple]:
    """Every rank's micro-batches at ``step``, rank by rank: piece ``r*k + m`` is rank r's m-th."""
    return [piece for rank in range(world) for piece in rank_micro_batches(setup, batch, step, rank, world, k, dtype)]


def sample_keys(batch: tuple) -> list[str]:
    """One digest per sample of ``batch`` (its bytes in every tensor): equal iff the samples are."""
    n = batch[0].shape[0]
    parts = [t.detach().cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy() if t.numel() else None
             for t in batch]
    keys = []
    for i in range(n):
        h = hashlib.blake2b(digest_size=16)
        for part in parts:
            if part is not None:
                h.update(part[i].tobytes())
        keys.append(h.hexdigest())
    return keys


def reference_parts(setup, batch: tuple, step: int, world: int, dtype: torch.dtype | None = None) -> list[tuple]:
    """The parts one process averages the loss over at ``step``: the ranks' shares where they are
    uneven and hold exactly the global batch's samples (DDP's mean of per-rank means), else the
    whole ``batch`` (one mean: equal shares give the same mean)."""
    if getattr(setup, "rank_batches", None) is None or world < 2:
        return [batch]
    shares = [rank_share(setup, batch, step, rank, world, dtype) for rank in range(world)]
    if len({share[0].shape[0] for share in shares}) == 1:
        return [batch]
    held = collections.Counter(key for share in shares for key in sample_keys(share))
    return shares if held == collections.Counter(sample_keys(batch)) else [batch]


def shares_world(configurations) -> int:
    """The world size whose per-rank shares weight the reference: the configurations' one W (1 when
    they have several: :func:`check_rank_batches` then refuses uneven shares)."""
    worlds = {c.world_size for c in configurations}
    return worlds.pop() if len(worlds) == 1 else 1


def _check_one(setup, s: int, rank: int, world: int, k: int, like: list, label: str) -> int:
    what = f"setup.rank_batches({rank}, {world}, {s})"
    try:
        batch = setup.rank_batches(rank, world, s)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is named
        raise SetupError(f"{what} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
        raise SetupError(f"{what} must return a batch (inputs..., target) of tensors like setup.batches', "
                         f"got {type(batch).__name__}")
    shapes = [(tuple(t.shape[1:]), t.dtype) for t in batch]
    if shapes != like:
        raise SetupError(f"{what} has per-sample shapes/dtypes {shapes}, the global batches have {like}")
    size = batch[0].shape[0]
    if size < 1 or any(t.shape[0] != size for t in batch):
        raise SetupError(f"{what} must hold at least one sample, with one batch size in every tensor")
    if size % k:
        raise SetupError(f"{what} has {size} samples, which {label!r} cannot cut into {k} equal micro-batches")
    return size


def check_rank_batches(setup, steps: int, configurations) -> None:
    """Refuse, before anything runs, per-rank batches that do not fit: a call that raises, another
    per-sample shape or dtype than the global batches', an empty batch, one that does not cut into
    a configuration's k micro-batches, or uneven shares under configurations of several W (DDP's
    weighting of uneven shares depends on W, which the reference must know)."""
    if getattr(setup, "rank_batches", None) is None:
        return
    if not callable(setup.rank_batches):
        raise SetupError(f"setup.rank_batches must be None or a callable (rank, world_size, step) -> batch, "
                         f"got {type(setup.rank_batches).__name__}")
    from ddplab.compare.setup import global_batches

    like = [(tuple(t.shape[1:]), t.dtype) for t in global_batches(setup, 1)[0]]
    uneven = []
    for config in configurations:
        for s in range(steps):
            sizes = {_check_one(setup, s, rank, config.world_size, config.k, like, config.label)
                     for rank in range(config.world_size)}
            if len(sizes) > 1:
                uneven.append(s)
    if uneven and len({c.world_size for c in configurations}) > 1:
        raise SetupError(f"setup.rank_batches gives uneven shares (step {uneven[0]}), which DDP weights by the "
                         "world size: compare configurations of one world size at a time")


def _names(batches: list) -> dict[str, tuple[int, int]]:
    """Sample key -> (step, index) of its first appearance in the global batches."""
    names: dict[str, tuple[int, int]] = {}
    for step, batch in enumerate(batches):
        for index, key in enumerate(sample_keys(batch)):
            names.setdefault(key, (step, index))
    return names


def sample_records(setup, config, batches: list) -> list[dict]:
    """Every step's samples in the ranks' batches counted against its global batch (module docstring);
    empty when the setup gives no per-rank batches."""
    if getattr(setup, "rank_batches", None) is None:
        return []
    world = config.world_size
    names = _names(batches)
    labels = dict(config=config.label)
    out = []
    for step, batch in enumerate(batches):
        wanted = collections.Counter(sample_keys(batch))
        held: dict[str, list[int]] = {}
        sizes = []
        for rank in range(world):
            keys = sample_keys(rank_share(setup, batch, step, rank, world))
            sizes.append(len(keys))
            for key in keys:
                held.setdefault(key, []).append(rank)
        out.append(record("data_checked", batch[0].shape[0], step=step, shares=",".join(map(str, sizes)),
                          uneven=len(set(sizes)) > 1, **labels))
        order = list(dict.fromkeys(list(wanted) + list(held)))
        for key in order:
            extra = len(held.get(key, [])) - wanted[key]
            if not extra:
                continue
            sample_step, index = names.get(key, (-1, -1))
            sample = f"step {sample_step} sample {index}" if sample_step >= 0 else "a sample of no global batch"
            out.append(record("data_difference", extra, step=step, sample=sample, sample_step=sample_step,
                              sample_index=index, ranks=",".join(map(str, held.get(key, []))),
                              kind="duplicated_contribution" if extra > 0 else "missing_contribution", **labels))
    return out
