"""Quiet faults on a device mesh, of every size: where each must be found (evidence, axis, step, rank).

:func:`plant` returns a :class:`MeshFault` on the tiny LM
(:func:`ddplab.compare.mesh_examples.token_setup`). Kinds and what their
``magnitude`` means (a relative size, or ``"ulp"``: one element one unit in
the last place; ranks test ``dist.get_rank()``, so the single-process
reference computes what is promised):

* ``tp_replica`` -- FSDP2 × TP with the sequence-parallel plan: rank 1's
  (``dp=0, tp=1``) local gradient of ``attn.norm.weight``, replicated along
  ``tp``, changed after the reduction (``Setup.before_step``);
* ``replicate_replica`` -- HSDP: rank 2's (``replicate=1, shard=0``) local
  gradient shard of ``head.weight`` changed after the reduction;
* ``loss_scale`` -- HSDP: rank 1's (``replicate=0, shard=1``) loss scaled by
  ``1 + magnitude`` (``"ulp"``: by 1 + eps), before any reduction: the
  replicas agree, the symmetric twin does not;
* ``token_imbalance`` -- FSDP2 × TP with the loss divided by each share's own
  count of valid tokens; every target valid except ``magnitude`` (an int)
  padded ones in the first sequence: the shares' counts differ by that many;
* ``partial_sums`` -- HSDP with ``reduce_dtype=bfloat16``,
  ``set_requires_all_reduce(False)`` and ``magnitude`` (an int) micro-batches.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ddplab.compare.configurations import Configuration
from ddplab.compare.faults import _on_rank, _perturb, _scaled
from ddplab.compare.mesh_examples import PAD, _policy, per_valid_token_loss, sequence_parallel_plan, token_setup
from ddplab.compare.meshes import FSDP2TP, HSDP
from ddplab.compare.setup import Setup

__all__ = ["KINDS", "MAGNITUDES", "MeshFault", "plant"]

#: Fault kind -> the sizes the sensitivity benchmark sweeps.
MAGNITUDES = {"tp_replica": (1e-2, 1e-4, 1e-6, "ulp"), "replicate_replica": (1e-2, 1e-4, 1e-6, "ulp"),
              "loss_scale": (1e-2, 1e-4, 1e-6, "ulp"), "token_imbalance": (32, 8, 1),
              "partial_sums": (8, 4, 3, 2)}
KINDS = tuple(MAGNITUDES)


@dataclasses.dataclass
class MeshFault:
    """A setup and a mesh configuration with one planted fault, and where it must be found."""

    kind: str
    magnitude: float | int | str
    setup: Setup
    config: Configuration
    evidence: str
    axis: str
    step: int
    rank: int


def _local_grad(model, name: str) -> torch.Tensor:
    grad = model.get_parameter(name).grad
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _nudge(model, name: str, magnitude, rank: int) -> None:
    """``before_step``: on ``rank``, the local gradient of ``name`` changed by ``magnitude``."""
    if _on_rank(rank):
        local = _local_grad(model, name)
        with torch.no_grad():
            local.copy_(_perturb(local, magnitude))


class _RankScaledLoss:
    """The setup's loss, scaled by ``1 + magnitude`` on ``rank``."""

    def __init__(self, loss, magnitude, rank: int):
        self.loss, self.magnitude, self.rank = loss, magnitude, rank

    def __call__(self, output, target):
        value = self.loss(output, target)
        return _scaled(value, self.magnitude) if _on_rank(self.rank) else value


def _imbalanced(batches, padded: int) -> list:
    """Every target valid except ``padded`` at the end of the first sequence of each batch."""
    out = []
    for tokens, targets in batches():
        targets = torch.cat([tokens[:, 1:], targets[:, -1:].clamp_min(0)], dim=1)
        targets[0, targets.shape[1] - padded:] = PAD
        out.append((tokens, targets))
    return out


def _check(kind: str, magnitude) -> None:
    if kind not in MAGNITUDES:
        raise ValueError(f"unknown mesh fault {kind!r}; known: {', '.join(KINDS)}")
    if kind in ("token_imbalance", "partial_sums"):
        if isinstance(magnitude, bool) or not isinstance(magnitude, int) or magnitude < (1 if kind == "token_imbalance"
                                                                                       else 2):
            raise ValueError(f"{kind}: magnitude must be an int (padded tokens >= 1, micro-batches >= 2), "
                             f"got {magnitude!r}")
    elif not (magnitude == "ulp" or isinstance(magnitude, (int, float)) and magnitude > 0):
        raise ValueError(f"magnitude must be a positive number or 'ulp', got {magnitude!r}")


def plant(kind: str, magnitude, *, seed: int = 0, steps: int = 2) -> MeshFault:
    """The tiny LM with fault ``kind`` of ``magnitude`` (see the module docstring)."""
    _check(kind, magnitude)
    setup = token_setup(seed, steps=steps)
    if kind == "tp_replica":
        setup = dataclasses.replace(setup, before_step=functools.partial(
            _nudge, name="attn.norm.weight", magnitude=magnitude, rank=1))
        return MeshFault(kind, magnitude, setup, FSDP2TP(plan=sequence_parallel_plan, name=f"{kind} {magnitude}"),
                         "mesh_replicas", "tp", 0, 1)
    if kind == "replicate_replica":
        setup = dataclasses.replace(setup, before_step=functools.partial(
            _nudge, name="head.weight", magnitude=magnitude, rank=2))
        return MeshFault(kind, magnitude, setup, HSDP(name=f"{kind} {magnitude}"), "mesh_replicas", "replicate", 0, 2)
    if kind == "loss_scale":
        setup = dataclasses.replace(setup, loss=_RankScaledLoss(setup.loss, magnitude, rank=1))
        return MeshFault(kind, magnitude, setup, HSDP(name=f"{kind} {magnitude}"), "twin", "shard", 0, 1)
    if kind == "token_imbalance":
        setup = dataclasses.replace(setup, loss=per_valid_token_loss,
                                    batches=functools.partial(_imbalanced, setup.batches, magnitude))
        return MeshFault(kind, magnitude, setup, FSDP2TP(name=f"{kind} {magnitude}"), "float64", "dp", 0, -1)
    config = HSDP(k=magnitude, mp_policy=_policy(reduce_dtype=torch.bfloat16), name=f"{kind} k={magnitude}")
    setup = token_setup(seed, steps=steps, batch_size=8 * magnitude)  # 4 shares x k micro-batches of 2
    return MeshFault(kind, magnitude, setup, config, "partial_sums", "replicate", 0, 0)
