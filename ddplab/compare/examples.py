"""Setups and configurations shipped with ddplab: one correct, and bugs users really write.

:func:`digits_setup` trains a small network on the embedded digits data
(:func:`ddplab.datasets.digits`), ``batch_size`` images per global batch,
with SGD and momentum. :func:`correct` compares it with every built-in
configuration; each :func:`planted` example is a bug from a real report,
with the kind of finding the comparison must name:

* ``summed_loss`` -- the loss sums over the batch instead of averaging. One
  process sums over B samples, each DDP rank over B/W and DDP averages the
  ranks: the gradient is the reference's divided by W (factor 1/W).
* ``no_division_by_k`` -- an accumulation loop under ``no_sync`` that
  forgets to divide each micro-batch loss by k: factor k.
* ``zero_grad_in_loop`` -- ``optimizer.zero_grad()`` inside the
  accumulation loop: only the last micro-batch's gradient survives (missing
  contributions: micro-batches 0..k-2 of every rank).
* ``skip_own_gradient`` -- gradients averaged by hand with ``all_gather``,
  summing the other ranks' gradients from index 1 on ("skip myself") onto
  zeros: rank 0's contribution is missing on every rank.
* ``no_allreduce`` -- a hand-written loop with the bare model and no
  gradient synchronization: each rank steps on its own share (desync).
* ``per_rank_batchnorm`` -- a network with BatchNorm under DDP: each rank
  normalizes with the statistics of its own share, one process with those
  of the whole batch.

Precisions and layers users choose, correct (:func:`sync_batchnorm`: the
same BatchNorm network with its layers converted to ddplab's SyncBatchNorm;
:func:`compression`: DDP with torch's fp16/bf16 compression hooks, run on
gloo as ddplab's stand-ins).

Every function here is defined at module level, so setups pickle by
reference and every rank rebuilds the same thing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddplab.compare.configurations import (DDP, FSDP2, Accumulate, Configuration, Custom, Fabric,
                                           StepContext)
from ddplab.compare.setup import Setup

__all__ = ["MODELS", "BATCHNORM_MODELS", "OPTIMIZERS", "Example", "Expected", "digits_setup", "correct", "planted",
           "planted_example", "PLANTED", "SETUP_BUGS", "summed_loss_setup", "batchnorm_setup",
           "planted_configurations", "sync_batchnorm", "compression", "compression_configurations",
           "sync_batchnorm_configurations", "accumulate_correctly", "accumulate_without_division",
           "zero_grad_in_loop", "average_by_hand_skipping_own", "no_allreduce",
           "accumulate_with_sync_every_micro_batch", "average_by_hand", "autocast_bfloat16", "ddp_with_own_hook", "own_fp16_hook", "own_bf16_hook",
           "plain_step", "compiled_ddp", "correct_custom_steps"]

#: Networks :func:`digits_setup` builds whose every built-in configuration is correct.
MODELS = ("mlp", "deep", "cnn")
#: Networks with BatchNorm (``bn``: the MLP with a BatchNorm1d after its first layer): correct under
#: DDP only with SyncBatchNorm, since per-rank BatchNorm normalizes each share by its own statistics.
BATCHNORM_MODELS = ("bn",)


# --------------------------------------------------------------------------- the correct setup


def _build(model: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    if model == "deep":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(),
                             nn.Linear(32, 10))
    if model == "bn":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 10))
    if model == "cnn":
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
                             nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    raise ValueError(f"model must be one of {', '.join(MODELS + BATCHNORM_MODELS)}, got {model!r}")


def _batches(seed: int, steps: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from ddplab.datasets import digits

    data = digits(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data), generator=gen)
    if steps * batch_size > len(order):
        raise ValueError(f"{steps} steps of {batch_size} need {steps * batch_size} images; "
                         f"the digits have {len(order)}")
    return [(data.images[idx], data.labels[idx])
            for idx in order[:steps * batch_size].split(batch_size)]


#: Optimizers :func:`digits_setup` builds.
OPTIMIZERS = ("sgd", "adam")


def _optimizer(params, kind: str, lr: float, momentum: float):
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def digits_setup(seed: int = 0, *, model: str = "mlp", steps: int = 6, batch_size: int = 48,
                 optimizer: str = "sgd", lr: float | None = None, momentum: float = 0.9,
                 reduction: str = "mean") -> Setup:
    """The digits classifier: ``model`` ("mlp", "deep", "cnn" or "bn") seeded with ``seed``,
    ``steps`` global batches of ``batch_size`` images in an order drawn from
    ``seed``, cross-entropy (``reduction`` "mean" or, as a planted bug, "sum"),
    ``optimizer`` "sgd" (with ``momentum``; ``lr`` 0.1 by default) or "adam"
    (``lr`` 0.01 by default)."""
    if model not in MODELS + BATCHNORM_MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS + BATCHNORM_MODELS)}, got {model!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if lr is None:
        lr = 0.01 if optimizer == "adam" else 0.1
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return Setup(model=functools.partial(_build, model, seed),
                 batches=functools.partial(_batches, seed, steps, batch_size),
                 loss=functools.partial(F.cross_entropy, reduction=reduction),
                 optimizer=functools.partial(_optimizer, kind=optimizer, lr=lr, momentum=momentum),
                 name=f"digits {model} {optimizer} seed={seed}" + (" (summed loss)" if reduction == "sum" else ""))


# --------------------------------------------------------------------------- training steps users write


def accumulate_correctly(ctx: StepContext):
    """Gradient accumulation as documented: no_sync for k-1 micro-batches, each loss / k."""
    ctx.optimizer.zero_grad()
    total = 0.0
    for i, micro in enumerate(ctx.micro_batches):
        sync = i == ctx.k - 1
        with contextlib.nullcontext() if sync else ctx.model.no_sync():
            loss = ctx.forward_loss(micro) / ctx.k
            loss.backward()
        total += loss.item()
    ctx.optimizer.step()
    return total


def accumulate_with_sync_every_micro_batch(ctx: StepContext):
    """Correct, if slower: accumulation without ``no_sync``, so DDP all-reduces after every micro-batch."""
    ctx.optimizer.zero_grad()
    total = 0.0
    for micro in ctx.micro_batches:
        loss = ctx.forward_loss(micro) / ctx.k
        loss.backward()
        total += loss.item()
    ctx.optimizer.step()
    return total


def average_by_hand(ctx: StepContext):
    """Correct: the bare model (``wrap=None``), each gradient all-reduced by hand and divided by W."""
    ctx.optimizer.zero_grad()
    loss = ctx.forward_loss(ctx.shard)
    loss.backward()
    for p in ctx.model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(ctx.world_size)
    ctx.optimizer.step()
    return loss.item()


def autocast_bfloat16(ctx: StepContext):
    """Correct: the forward pass under ``torch.autocast("cpu", dtype=torch.bfloat16)``."""
    ctx.optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ctx.forward_loss(ctx.shard)
    loss.backward()
    ctx.optimizer.step()
    return loss.item()


def _compress(dtype, bucket):
    """A hand-written compression hook, as users write it: cast, divide, all-reduce, cast back."""
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size())
    work = dist.all_reduce(compressed, async_op=True)

    def decompress(fut):
        out = bucket.buffer()
        out.copy_(fut.value()[0])
        return out

    return work.get_future().then(decompress)


def own_fp16_hook(state, bucket):
    """The user's own float16 compression hook."""
    return _compress(torch.float16, bucket)


def own_bf16_hook(state, bucket):
    """The user's own bfloat16 compression hook."""
    return _compress(torch.bfloat16, bucket)


def ddp_with_own_hook(hook, model: nn.Module) -> nn.Module:
    """``wrap`` for a Custom step: DDP with the user's own comm hook registered."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, hook)
    return ddp


def compiled_ddp(model: nn.Module) -> nn.Module:
    """``wrap`` for a Custom step: DDP compiled with ``torch.compile`` at its defaults (inductor)."""
    from torch.nn.parallel import DistributedDataParallel

    return torch.compile(DistributedDataParallel(model))


def plain_step(ctx: StepContext):
    """One forward and backward on the rank's share, one optimizer step (whatever the wrap reduces)."""
    ctx.optimizer.zero_grad()
    loss = ctx.forward_loss(ctx.shard)
    loss.backward()
    ctx.optimizer.step()
    return loss.item()


def correct_custom_steps(world_size: int = 2) -> list[Configuration]:
    """Custom steps written the ways users write correct ones: each must read rounding, exact or
    approximation, never bug."""
    return [Custom(world_size, k=2, train_step=accumulate_correctly),
            Custom(world_size, k=2, train_step=accumulate_with_sync_every_micro_batch),
            Custom(world_size, train_step=average_by_hand, wrap=None),
            Custom(world_size, train_step=autocast_bfloat16),
            Custom(world_size, train_step=plain_step, wrap=functools.partial(ddp_with_own_hook, own_fp16_hook),
                   name=f"own fp16 hook W={world_size}"),
            Custom(world_size, train_step=plain_step, wrap=functools.partial(ddp_with_own_hook, own_bf16_hook),
                   name=f"own bf16 hook W={world_size}")]


def accumulate_without_division(ctx: StepContext):
    """Planted bug: the accumulation loop forgets to divide each micro-batch loss by k."""
    ctx.optimizer.zero_grad()
    total = 0.0
    for i, micro in enumerate(ctx.micro_batches):
        with contextlib.nullcontext() if i == ctx.k - 1 else ctx.model.no_sync():
            loss = ctx.forward_loss(micro)          # should be / ctx.k
            loss.backward()
        total += loss.item() / ctx.k
    ctx.optimizer.step()
    return total


def zero_grad_in_loop(ctx: StepContext):
    """Planted bug: ``zero_grad()`` inside the accumulation loop wipes the earlier micro-batches."""
    total = 0.0
    for i, micro in enumerate(ctx.micro_batches):
        ctx.optimizer.zero_grad()                   # belongs before the loop
        with contextlib.nullcontext() if i == ctx.k - 1 else ctx.model.no_sync():
            loss = ctx.forward_loss(micro) / ctx.k
            loss.backward()
        total += loss.item()
    ctx.optimizer.step()
    return total


def average_by_hand_skipping_own(ctx: StepContext):
    """Planted bug: a hand-written gradient average over ``all_gather`` that
    adds the gathered gradients from index 1 on ("skip my own") onto zeros,
    so rank 0's contribution never enters, on any rank."""
    ctx.optimizer.zero_grad()
    loss = ctx.forward_loss(ctx.shard)
    loss.backward()
    world = ctx.world_size
    for p in ctx.model.parameters():
        gathered = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(gathered, p.grad)
        total = torch.zeros_like(p.grad)
        for g in gathered[1:]:                      # meant to skip this rank's own, added below; never is
            total += g
        p.grad.copy_(total / world)
    ctx.optimizer.step()
    return loss.item()


def no_allreduce(ctx: StepContext):
    """Planted bug: the bare model and no gradient synchronization: every rank trains alone."""
    ctx.optimizer.zero_grad()
    loss = ctx.forward_loss(ctx.shard)
    loss.backward()
    ctx.optimizer.step()
    return loss.item()


# --------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class Expected:
    """What the comparison must conclude about one configuration.

    ``verdict``: "exact" (bit-equal to the replay), "rounding" or "bug"; ``finding``: the localization's kind
    ("factor", "missing_contribution", "desync"); ``factor``: the constant
    factor for a factor finding; ``missing``: the missing pieces as
    ``(rank, micro_batch)`` pairs for a missing-contribution finding.
    """

    verdict: str
    finding: str | None = None
    factor: float | None = None
    missing: tuple[tuple[int, int], ...] | None = None


@dataclasses.dataclass
class Example:
    """A setup, the configurations to compare and what each must be found to be."""

    name: str
    setup: Setup
    configurations: list[Configuration]
    expected: dict[str, Expected]
    story: str = ""


def correct(seed: int = 0, *, model: str = "mlp", world_size: int = 2, k: int = 2,
            fabric: bool = True, fsdp: bool = True, steps: int = 6) -> Example:
    """The correct digits setup against DDP, accumulation, a correct custom
    accumulation loop, Fabric (``fabric``) and FSDP2 in float32 and in bfloat16
    (``fsdp``): every configuration must be found to be rounding."""
    configs: list[Configuration] = [DDP(world_size), Accumulate(world_size, k=k),
                                    Custom(world_size, k=k, train_step=accumulate_correctly)]
    if fabric:
        configs.append(Fabric(world_size))
    if fsdp:
        configs += [FSDP2(world_size), FSDP2(world_size, param_dtype=torch.bfloat16)]
    return Example(name="correct", setup=digits_setup(seed, model=model, steps=steps),
                   configurations=configs,
                   expected={c.label: Expected("exact" if isinstance(c, (DDP, Fabric)) else "rounding")
                             for c in configs},
                   story="A correct setup: every configuration differs from the reference by rounding only.")


def _summed_loss(seed, world_size, k, steps, model):
    config = DDP(world_size)
    return Example(
        name="summed_loss", setup=digits_setup(seed, model=model, steps=steps, reduction="sum"),
        configurations=[config],
        expected={config.label: Expected("bug", "factor", factor=1.0 / world_size)},
        story="cross_entropy(reduction='sum'): DDP averages per-rank sums, so every gradient is "
              "the single process's divided by W.")


def _no_division(seed, world_size, k, steps, model):
    config = Custom(world_size, k=k, train_step=accumulate_without_division)
    return Example(
        name="no_division_by_k", setup=digits_setup(seed, model=model, steps=steps),
        configurations=[config],
        expected={config.label: Expected("bug", "factor", factor=float(k))},
        story="Accumulation under no_sync without dividing each micro-batch loss by k.")


def _zero_grad(seed, world_size, k, steps, model):
    config = Custom(world_size, k=k, train_step=zero_grad_in_loop)
    missing = tuple((r, m) for r in range(world_size) for m in range(k - 1))
    return Example(
        name="zero_grad_in_loop", setup=digits_setup(seed, model=model, steps=steps),
        configurations=[config],
        expected={config.label: Expected("bug", "missing_contribution", missing=missing)},
        story="optimizer.zero_grad() inside the accumulation loop keeps only the last micro-batch.")


def _skip_own(seed, world_size, k, steps, model):
    config = Custom(world_size, train_step=average_by_hand_skipping_own, wrap=None)
    return Example(
        name="skip_own_gradient", setup=digits_setup(seed, model=model, steps=steps),
        configurations=[config],
        expected={config.label: Expected("bug", "missing_contribution", missing=((0, 0),))},
        story="A hand-written all_gather average that never adds rank 0's gradient.")


def _no_allreduce(seed, world_size, k, steps, model):
    config = Custom(world_size, train_step=no_allreduce, wrap=None)
    return Example(
        name="no_allreduce", setup=digits_setup(seed, model=model, steps=steps),
        configurations=[config],
        expected={config.label: Expected("bug", "desync")},
        story="The bare model with no gradient synchronization: each rank trains on its share alone.")


def _per_rank_batchnorm(seed, world_size, k, steps, model):
    config = DDP(world_size)
    return Example(
        name="per_rank_batchnorm", setup=digits_setup(seed, model="bn", steps=steps),
        configurations=[config],
        expected={config.label: Expected("bug", "semantic")},
        story="BatchNorm under DDP normalizes each rank's share by that share's mean and variance; "
              "one process normalizes the whole batch by its own (the fix: SyncBatchNorm).")


#: Planted-bug example name -> builder.
PLANTED = {
    "summed_loss": _summed_loss,
    "no_division_by_k": _no_division,
    "zero_grad_in_loop": _zero_grad,
    "skip_own_gradient": _skip_own,
    "no_allreduce": _no_allreduce,
    "per_rank_batchnorm": _per_rank_batchnorm,
}
#: Planted examples whose bug lives in the setup (its loss, its model), not in a training step:
#: their configurations do not fit the correct setup.
SETUP_BUGS = ("summed_loss", "per_rank_batchnorm")


def planted_example(name: str, seed: int = 0, *, world_size: int = 2, k: int = 4, steps: int = 4,
                    model: str = "mlp") -> Example:
    """The planted-bug example ``name`` (see :data:`PLANTED`)."""
    if name not in PLANTED:
        raise ValueError(f"unknown planted example {name!r}; known: {', '.join(PLANTED)}")
    return PLANTED[name](seed, world_size, k, steps, model)


def summed_loss_setup() -> Setup:
    """The digits setup with the planted summed loss (for ``-p setup ddplab.compare.examples:summed_loss_setup``)."""
    return digits_setup(reduction="sum")


def batchnorm_setup() -> Setup:
    """The digits setup with BatchNorm (for ``-p setup ddplab.compare.examples:batchnorm_setup``):
    configuration ``ddp`` is per-rank BatchNorm (a bug), ``ddp_sync_batchnorm`` its fix."""
    return digits_setup(model="bn")


def planted_configurations(world_size: int = 2, k: int = 4) -> list[Configuration]:
    """Every planted training-step bug as a configuration of the correct digits setup
    (for ``-p configurations "[ddp, ddplab.compare.examples:planted_configurations]"``)."""
    return [c for name in PLANTED if name not in SETUP_BUGS
            for c in planted_example(name, world_size=world_size, k=k).configurations]


def sync_batchnorm_configurations(world_size: int = 2) -> list[Configuration]:
    """DDP with the model's BatchNorm layers converted to ddplab's SyncBatchNorm."""
    return [DDP(world_size, sync_batchnorm=True)]


def sync_batchnorm(seed: int = 0, *, world_size: int = 2, steps: int = 4) -> Example:
    """The ``per_rank_batchnorm`` network with its BatchNorm converted to SyncBatchNorm under DDP:
    every rank normalizes by the whole batch's statistics, as one process does -- rounding."""
    configs = sync_batchnorm_configurations(world_size)
    return Example(name="sync_batchnorm", setup=digits_setup(seed, model="bn", steps=steps),
                   configurations=configs, expected={c.label: Expected("rounding") for c in configs},
                   story="SyncBatchNorm reduces the statistics over the ranks in forward and their "
                         "gradients in backward: the per-rank BatchNorm bug, fixed.")


def compression_configurations(world_size: int = 2) -> list[Configuration]:
    """DDP with torch's ``fp16_compress_hook`` and ``bf16_compress_hook`` (on gloo, ddplab's stand-ins run)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return [DDP(world_size, comm_hook=default_hooks.fp16_compress_hook),
            DDP(world_size, comm_hook=default_hooks.bf16_compress_hook)]


def compression(seed: int = 0, *, world_size: int = 2, steps: int = 4, model: str = "mlp") -> Example:
    """The correct digits setup under DDP with the fp16 and bf16 compression hooks: gradients reduced
    in the precision the user chose, judged by that precision's rounding -- exact (to the replay)."""
    configs = compression_configurations(world_size)
    # The replay emulates the compression bit for bit: "exact", the rounding of the precision chosen.
    return Example(name="compression", setup=digits_setup(seed, model=model, steps=steps),
                   configurations=configs, expected={c.label: Expected("exact") for c in configs},
                   story="Gradients all-reduced in float16 / bfloat16: further from the truth than "
                         "float32's rounding, by the rounding of the precision chosen, and no more.")


def planted(seed: int = 0, **kwargs) -> list[Example]:
    """Every planted-bug example."""
    return [planted_example(name, seed, **kwargs) for name in PLANTED]
