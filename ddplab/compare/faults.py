"""Quiet faults of any size, planted on one rank: what the replay referee must catch and place.

Each :func:`plant` returns an :class:`~ddplab.compare.examples.Example`-like
:class:`PlantedFault`: the digits setup (or a configuration) with one fault
on rank ``rank`` only (ranks test ``dist.get_rank()``; the replay runs in a
process without a process group, so it computes what is promised), and
where it must be found: the step, the rank and the phase.

Kinds (``magnitude`` is the relative size; ``"ulp"`` changes one element by
one unit in the last place):

* ``local_gradient`` -- one layer's local gradient scaled by ``1 + magnitude`` (a tensor hook);
* ``reduced_gradient`` -- rank 1's reduced gradient of one layer scaled in
  ``before_step`` (the ranks then disagree);
* ``optimizer`` -- rank 1's learning rate is ``lr * (1 + magnitude)``;
* ``skipped_micro_batch`` / ``duplicated_micro_batch`` -- under
  accumulation, rank 1's first micro-batch loss counts 0 or 2 times (in the
  setup's loss, which the replay runs as the rank did: the twin places it);
* ``low_precision_bucket`` -- every bucket is rounded to bfloat16 before
  the reduction, by a hook that promises DDP's own average (registered
  with :func:`ddplab.compare.replay.register_reduction`).

For FSDP2 (``fsdp=True``), ``forward_output`` scales one layer's output on
rank 1, and ``optimizer`` changes rank 1's learning rate (its shard's update).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from ddplab.compare.configurations import DDP, FSDP2, Accumulate, Configuration, Custom
from ddplab.compare.examples import _build, _optimizer, digits_setup
from ddplab.compare.replay import register_reduction, reduction_emulation
from ddplab.compare.setup import Setup

__all__ = ["KINDS", "FSDP_KINDS", "CUSTOM_KINDS", "MAGNITUDES", "PlantedFault", "plant", "plant_custom", "own_code_demo",
           "ulp_after_allreduce_hook", "wrap_with_ulp_hook",
           "faulty_step"]

KINDS = ("local_gradient", "reduced_gradient", "optimizer", "skipped_micro_batch",
         "duplicated_micro_batch", "low_precision_bucket")
FSDP_KINDS = ("forward_output", "optimizer")
#: Relative sizes the sensitivity benchmark sweeps, down to one ulp.
MAGNITUDES = (1e-2, 1e-4, 1e-6, "ulp")
#: The layer faults are planted in (the digits MLP's first Linear).
LAYER = "1"


@dataclasses.dataclass
class PlantedFault:
    """A setup and configuration with one planted fault, and where it must be found."""

    kind: str
    magnitude: float | str
    setup: Setup
    config: Configuration
    step: int
    rank: int
    phase: str

    def placed(self, verdict) -> bool:
        """Does ``verdict`` call this fault a bug and place it: the evidence ``phase`` names decided, at the
        fault's step and rank (a replay phase: the replay or the replicas, at that phase too; the float64
        run names no rank)?"""
        v = verdict.values
        if verdict.kind != "bug":
            return False
        if self.phase == "float64":
            return verdict.evidence == "float64" and v.get("float64_step") == self.step
        if self.phase == "replicas":
            return verdict.evidence == "replicas" and (v.get("desync_step"), v.get("desync_rank")) == \
                (self.step, self.rank)
        if self.phase == "twin":
            return verdict.evidence == "twin" and (v.get("twin_step"), v.get("twin_rank")) == (self.step, self.rank)
        return verdict.evidence in ("replicas", "replay") and \
            (v.get("replay_step"), v.get("replay_rank"), v.get("replay_phase")) == (self.step, self.rank, self.phase)


def _on_rank(rank: int) -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == rank


def _perturb(t: torch.Tensor, magnitude) -> torch.Tensor:
    if magnitude == "ulp":
        # One element one ulp up; t + (bumped - t) is bumped exactly (Sterbenz), and the
        # gradient still flows through t.
        with torch.no_grad():
            bumped = t.detach().clone()
            flat = bumped.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=t.dtype))
        return t + (bumped - t.detach())
    return t * (1 + magnitude)


def _model_with_grad_fault(seed: int, magnitude, rank: int) -> nn.Module:
    model = _build("mlp", seed)
    if _on_rank(rank):
        getattr(model, LAYER).weight.register_hook(lambda g: _perturb(g, magnitude))
    return model


class _Scaled(nn.Module):
    def __init__(self, inner: nn.Module, magnitude, rank: int):
        super().__init__()
        self.inner, self.magnitude, self.rank = inner, magnitude, rank

    def forward(self, x):
        out = self.inner(x)
        return _perturb(out, self.magnitude) if _on_rank(self.rank) else out


def _model_with_forward_fault(seed: int, magnitude, rank: int) -> nn.Module:
    model = _build("mlp", seed)
    model[int(LAYER)] = _Scaled(model[int(LAYER)], magnitude, rank)
    return model


def _scale_reduced(model: nn.Module, magnitude, rank: int) -> None:
    if _on_rank(rank):
        p = dict(model.named_parameters())
        name = next(n for n in p if n.endswith(f"{LAYER}.weight"))
        p[name].grad.copy_(_perturb(p[name].grad, magnitude))


def _faulty_optimizer(params, magnitude, rank: int, lr: float = 0.05, momentum: float = 0.9):
    if _on_rank(rank):
        lr = float(torch.nextafter(torch.tensor(lr), torch.tensor(1.0))) if magnitude == "ulp" else \
            lr * (1 + magnitude)
    return _optimizer(params, "sgd", lr, momentum)


class _CountedLoss:
    """cross_entropy whose first call of every step on ``rank`` is weighted ``weight`` (k calls a step)."""

    def __init__(self, k: int, weight: float, rank: int):
        self.k, self.weight, self.rank, self.calls = k, weight, rank, 0

    def __call__(self, output, target):
        loss = nn.functional.cross_entropy(output, target)
        if _on_rank(self.rank):
            first = self.calls % self.k == 0
            self.calls += 1
            if first:
                return loss * self.weight
        return loss


def bf16_bucket_hook(process_group, bucket):
    """DDP's own average of the bucket after rounding it to bfloat16 (a planted reduction fault)."""
    from ddplab.comm_hooks import ddp_default_hook

    buffer = bucket.buffer()
    buffer.copy_(buffer.to(torch.bfloat16).to(buffer.dtype))
    return ddp_default_hook(process_group, bucket)


# It promises DDP's own average: the replay holds it to that.
register_reduction(bf16_bucket_hook, reduction_emulation(None))


def plant(kind: str, magnitude=1e-6, *, seed: int = 0, steps: int = 3, world_size: int = 2, rank: int = 1,
          fsdp: bool = False) -> PlantedFault:
    """The digits setup with fault ``kind`` of ``magnitude`` on ``rank`` (see the module docstring)."""
    kinds = FSDP_KINDS if fsdp else KINDS
    if kind not in kinds:
        raise ValueError(f"unknown fault {kind!r}; known{' for FSDP2' if fsdp else ''}: {', '.join(kinds)}")
    if not (magnitude == "ulp" or isinstance(magnitude, (int, float)) and magnitude > 0):
        raise ValueError(f"magnitude must be a positive number or 'ulp', got {magnitude!r}")
    setup = digits_setup(seed, steps=steps)
    config: Configuration = FSDP2(world_size, param_dtype=torch.bfloat16) if fsdp else DDP(world_size)
    phase = "local_gradient"
    if kind == "local_gradient":
        setup = dataclasses.replace(setup, model=functools.partial(_model_with_grad_fault, seed, magnitude, rank))
    elif kind == "forward_output":
        setup = dataclasses.replace(setup, model=functools.partial(_model_with_forward_fault, seed, magnitude,
                                                                   rank))
    elif kind == "reduced_gradient":
        setup = dataclasses.replace(setup, before_step=functools.partial(_scale_reduced, magnitude=magnitude,
                                                                         rank=rank))
        phase = "update"
    elif kind == "optimizer":
        setup = dataclasses.replace(setup, optimizer=functools.partial(_faulty_optimizer, magnitude=magnitude,
                                                                       rank=rank))
        phase = "update"
    elif kind in ("skipped_micro_batch", "duplicated_micro_batch"):
        weight = 0.0 if kind == "skipped_micro_batch" else 2.0
        setup = dataclasses.replace(setup, loss=_CountedLoss(2, weight, rank))
        config = Accumulate(world_size, k=2)
        # The fault lives in the setup's loss, which the replay runs as the rank ran it: the twin (every
        # rank on rank 0's data) sees rank 1 depart at its first all-reduce.
        phase = "twin"
    elif kind == "low_precision_bucket":
        config = DDP(world_size, comm_hook=bf16_bucket_hook)
        phase, rank = "reduction", 0  # every rank reduces the rounded buckets: rank 0 is the first
    return PlantedFault(kind, magnitude, setup, config, step=0, rank=rank, phase=phase)


# --------------------------------------------------------------------------- faults in the user's own step

#: Faults written inside a Custom step, the way users write training loops: on rank 1 only, except
#: the ``every_rank_*`` ones, which every rank commits alike (only the float64 run can see those).
CUSTOM_KINDS = ("loss_term", "local_gradient", "skipped_micro_batch", "duplicated_micro_batch",
                "wrong_divide", "optimizer", "every_rank_scale", "every_rank_factor")


def _scaled(value: torch.Tensor, magnitude) -> torch.Tensor:
    """``value`` times ``1 + magnitude``; "ulp": times the next number after 1 (1 + eps of its dtype),
    so that what flows back from it is scaled too (a one-ulp shift of a loss's value changes no gradient)."""
    if magnitude == "ulp":
        return value * (1 + torch.finfo(value.dtype).eps)
    return value * (1 + magnitude)


def faulty_step(ctx, kind: str, magnitude, rank: int):
    """One accumulation step (k micro-batches, each loss / k) with fault ``kind`` planted in it."""
    mine = ctx.rank == rank
    ctx.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for m, micro in enumerate(ctx.micro_batches):
        sync = m == ctx.k - 1
        with (ctx.model.no_sync() if not sync and hasattr(ctx.model, "no_sync") else contextlib.nullcontext()):
            loss = ctx.forward_loss(micro)
            divisor = ctx.k
            if kind == "loss_term" and mine:
                loss = _scaled(loss, magnitude)              # an extra term on one rank
            elif kind == "wrong_divide" and mine:
                loss = _scaled(loss, magnitude)               # divides by k·(1+m) on one rank
            elif kind in ("skipped_micro_batch", "duplicated_micro_batch") and mine and m == 0:
                weight = 0.0 if kind == "skipped_micro_batch" else 2.0
                loss = loss * weight if magnitude is None else _scaled(loss, magnitude)
            elif kind == "every_rank_factor":
                loss = loss * ctx.world_size                  # a factor every rank applies
            (loss / divisor).backward()
        total += float(loss.detach())
    if kind == "every_rank_scale":                     # every rank rescales one layer's gradient
        layer = getattr(getattr(ctx.model, "module", ctx.model), LAYER)
        layer.weight.grad.copy_(_scaled(layer.weight.grad, magnitude))
    ctx.apply_before_step()
    if kind == "optimizer" and mine:
        for group in ctx.optimizer.param_groups:
            group["lr"] = float(_scaled(torch.tensor(group["lr"], dtype=torch.float32), magnitude))
    ctx.optimizer.step()
    return total / ctx.k


def plant_custom(kind: str, magnitude=1e-6, *, seed: int = 0, steps: int = 3, world_size: int = 2,
                 rank: int = 1) -> PlantedFault:
    """The digits setup trained by a Custom step (DDP-wrapped, k=2) with fault ``kind`` of ``magnitude``.

    ``magnitude`` None plants the size-less version (a micro-batch skipped or counted twice). Where it
    must be found: ``phase`` names the evidence expected to decide (``twin`` for faults on one rank,
    ``float64`` for faults every rank commits, ``replicas`` where the ranks end up apart).
    """
    if kind not in CUSTOM_KINDS:
        raise ValueError(f"unknown Custom-step fault {kind!r}; known: {', '.join(CUSTOM_KINDS)}")
    if not (magnitude is None or magnitude == "ulp" or isinstance(magnitude, (int, float)) and magnitude > 0):
        raise ValueError(f"magnitude must be a positive number, 'ulp' or None, got {magnitude!r}")
    setup = digits_setup(seed, steps=steps)
    if kind == "local_gradient":
        setup = dataclasses.replace(setup, model=functools.partial(_model_with_grad_fault, seed, magnitude, rank))
    step = functools.partial(faulty_step, kind=kind, magnitude=magnitude, rank=rank)
    functools.update_wrapper(step, faulty_step)
    step.__name__ = f"{kind}_step"
    config = Custom(world_size, k=2, train_step=step)
    phase = {"optimizer": "replicas", "every_rank_scale": "float64", "every_rank_factor": "float64"}.get(kind, "twin")
    return PlantedFault(kind, magnitude, setup, config, step=0, rank=rank, phase=phase)


def own_code_demo(seed: int = 0, steps: int = 2, world_size: int = 2) -> tuple[Setup, list[Configuration]]:
    """One Custom step per verdict of the evidence that needs no specification, on the digits setup:
    a correct step (rounding, earned by the float64 run and the twin), a one-ulp loss term on rank 1
    (bug, by the twin), a layer every rank rescales by 1e-6 (bug, by the float64 run), and a declared
    approximation (a gradient rounded to bfloat16 on purpose by the user's own hook)."""
    from ddplab.compare.examples import accumulate_correctly, ddp_with_own_hook, own_bf16_hook, plain_step

    setup = digits_setup(seed, steps=steps)
    return setup, [
        Custom(world_size, k=2, train_step=accumulate_correctly),
        plant_custom("loss_term", "ulp", seed=seed, steps=steps, world_size=world_size).config,
        plant_custom("every_rank_scale", 1e-6, seed=seed, steps=steps, world_size=world_size).config,
        Custom(world_size, train_step=plain_step, wrap=functools.partial(ddp_with_own_hook, own_bf16_hook),
               approximation="gradients rounded to bfloat16 on purpose", name=f"bf16 on purpose W={world_size}")]


def ulp_after_allreduce_hook(state, bucket):
    """Planted: a hand-written averaging hook whose result is one ulp above what the all-reduce
    returned, on every rank (the replicas agree; only the recorded collectives can tell)."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)

    def bump(fut):
        out = fut.value()[0].clone()
        out.view(-1)[0] = torch.nextafter(out.view(-1)[0], torch.tensor(float("inf"), dtype=out.dtype))
        return out

    return work.get_future().then(bump)


def wrap_with_ulp_hook(model: nn.Module) -> nn.Module:
    """``wrap`` for a Custom step: DDP with :func:`ulp_after_allreduce_hook`."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, ulp_after_allreduce_hook)
    return ddp
