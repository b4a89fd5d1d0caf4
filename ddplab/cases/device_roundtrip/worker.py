"""Case 03, inside a rank: train the report's model per configuration, round trip it, measure sync.

Every configuration (framework × round trip × variant, :func:`plan_configurations`)
trains a fresh ToyModel from the same weights on the same per-rank batches
and records, per step and rank: the loss, the cross-rank gradient check, the
report's own check, the buckets DDP's reducer reduced, the weight distance
to rank 0 and what the detached-reducer guard said (the case's docstring
lists the records).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ddplab.fabric import ddp_of, fabric_available, make_fabric
from ddplab.records import emit, labels

__all__ = ["ROUNDTRIPS", "FRAMEWORKS", "AS_REPORTED", "REWRAPPED", "VARIANTS", "ToyModel",
           "rank_batches", "device_skip_reason", "plan_backend", "plan_configurations",
           "apply_roundtrip", "rewrap_model", "report_check", "BucketCounter", "counting_hook",
           "train_configuration", "worker"]

#: ``none``: the control; ``dtype``: ``.double()`` then ``.float()`` (any machine);
#: ``device``: ``.cpu()`` then ``.cuda()``, the report's trigger (one GPU per rank).
ROUNDTRIPS = ("none", "dtype", "device")
FRAMEWORKS = ("ddp", "fabric")
#: The report's run, and the fix: wrap again after the round trip.
AS_REPORTED = "as reported"
REWRAPPED = "re-wrapped"
VARIANTS = (AS_REPORTED, REWRAPPED)

#: The report's optimizer and batch: SGD(lr=0.001), torch.randn(20, 10) inputs, (20, 5) targets.
LR = 0.001
BATCH = 20
#: Rank r's batches come from a generator seeded ``seed * DATA_SEED_STRIDE + r + 1``:
#: a different stream per rank, the same one for every configuration.
DATA_SEED_STRIDE = 1_000_003


class ToyModel(nn.Module):
    """The report's model: ``Linear(10, 10)``, ReLU, ``Linear(10, 5)``."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def rank_batches(seed: int, rank: int, steps: int,
                 device: "torch.device | str" = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s ``(inputs, targets)`` for every step: ``randn(20, 10)``, ``randn(20, 5)``.

    Drawn from a generator of its own (seed ``seed * DATA_SEED_STRIDE + rank + 1``),
    so ranks differ, as in the report, and every configuration sees the same batches.
    """
    gen = torch.Generator().manual_seed(seed * DATA_SEED_STRIDE + rank + 1)
    out = []
    for _ in range(steps):
        x = torch.randn(BATCH, 10, generator=gen)
        y = torch.randn(BATCH, 5, generator=gen)
        out.append((x.to(device), y.to(device)))
    return out


# --------------------------------------------------------------------------- what can run here


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_skip_reason(world_size: int, gpus: int) -> str | None:
    """Why the ``device`` round trip cannot run with ``gpus`` CUDA devices, or None.

    The report moves each rank's model to the CPU and back to *its* GPU, so
    every rank needs one (``gpus >= world_size``).
    """
    if gpus >= world_size:
        return None
    have = "no CUDA GPU on this machine" if gpus == 0 else \
        f"{world_size} ranks but only {gpus} CUDA GPU(s)"
    return (f"the report's .cpu() then .cuda() round trip needs one CUDA GPU per rank ({have}); "
            f"the dtype round trip (.double() then .float()) exercises the same mechanism on the CPU")


def plan_backend(params: dict, gpus: int | None = None) -> str:
    """``nccl`` (every configuration on ``cuda:rank``) when the ``device`` round trip is asked
    for and every rank has a GPU, else ``gloo`` on the CPU."""
    gpus = _gpus() if gpus is None else gpus
    wants_device = "device" in params["roundtrip"]
    return "nccl" if wants_device and device_skip_reason(params["world_size"], gpus) is None else "gloo"


def plan_configurations(params: dict, *, on_cuda: bool, gpus: int,
                        fabric: tuple[bool, str]) -> tuple[list[tuple[str, str, str]], list[dict]]:
    """What runs and what is skipped, in order: ``(configurations, skipped)``.

    ``configurations``: ``(framework, roundtrip, variant)``; a round trip runs
    as reported and re-wrapped, ``none`` only as reported. ``skipped``: a dict
    per pair that cannot run (``framework``, ``roundtrip``, ``reason``, and
    ``cause`` ``"no cuda"`` for ``device`` off CUDA or ``"no lightning"``).
    """
    configurations, skipped = [], []
    fabric_ok, fabric_why = fabric
    for framework in params["framework"]:
        for roundtrip in params["roundtrip"]:
            reason = cause = None
            if framework == "fabric" and not fabric_ok:
                reason, cause = fabric_why, "no lightning"
            elif roundtrip == "device" and not on_cuda:
                reason, cause = device_skip_reason(params["world_size"], gpus), "no cuda"
            if reason is not None:
                skipped.append(dict(framework=framework, roundtrip=roundtrip, cause=cause,
                                    reason=reason))
                continue
            variants = (AS_REPORTED,) if roundtrip == "none" else VARIANTS
            configurations.extend((framework, roundtrip, v) for v in variants)
    return configurations, skipped


# --------------------------------------------------------------------------- wrapping, moving, re-wrapping


def _wrap(framework: str, model: nn.Module, optimizer, device: torch.device, fabric):
    """The report's wrapping: ``DDP(model.to(device), device_ids=...)`` or ``fabric.setup``."""
    from torch.nn.parallel import DistributedDataParallel

    if framework == "fabric":
        return fabric.setup(model, optimizer)
    model.to(device)
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids), optimizer


def apply_roundtrip(model: nn.Module, roundtrip: str, device: torch.device, fabric=None) -> None:
    """Move the *wrapped* ``model`` away and back, in place, as users do.

    ``dtype``: ``model.double()`` then ``model.float()``; ``device``:
    ``model.cpu()`` then ``model.cuda(device)`` (DDP) or
    ``fabric.to_device(model)`` (Fabric, the report's call). Each reassigns
    ``param.data``, which detaches DDP's reducer (see :mod:`ddplab.probes`).
    """
    if roundtrip == "dtype":
        model.double()
        model.float()
    elif roundtrip == "device":
        if device.type != "cuda":
            raise ValueError("the device round trip needs the model on a CUDA device")
        model.cpu()
        if fabric is not None:
            fabric.to_device(model)
        else:
            model.cuda(device)
    elif roundtrip != "none":
        raise ValueError(f"unknown round trip {roundtrip!r}; choose one of {', '.join(ROUNDTRIPS)}")


def rewrap_model(framework: str, model: nn.Module, optimizer, fabric=None):
    """The fix: wrap the moved module again; returns ``(model, optimizer)``.

    DDP: :func:`ddplab.probes.rewrap` (a new DDP with the same settings and
    comm hooks). Fabric: ``fabric.setup`` again on the unwrapped module and
    optimizer, as the maintainers suggest. The new reducer hooks the
    parameters' current gradient accumulators; the Parameter objects stay,
    so the optimizer keeps updating them.
    """
    from ddplab.probes import rewrap

    if framework == "fabric":
        return fabric.setup(model.module, optimizer.optimizer)
    return rewrap(model), optimizer


# --------------------------------------------------------------------------- measurements


def report_check(ddp: nn.Module, world_size: int, step: int) -> list[bool]:
    """The report's ``_check_gradients_between_workers``, recording instead of raising.

    Per parameter with a gradient: ``all_gather`` it and ``torch.allclose``
    it against every rank's. Emits ``report_allclose`` (1 passes, 0 is where
    the report raised) and returns the results.
    """
    import torch.distributed as dist

    results = []
    for name, p in ddp.module.named_parameters():
        if p.grad is None:
            continue
        grad_list = [torch.zeros_like(p.grad) for _ in range(world_size)]
        dist.all_gather(grad_list, p.grad, async_op=False)
        ok = all(torch.allclose(p.grad, g) for g in grad_list)
        emit("report_allclose", int(ok), step=step, param=name)
        results.append(ok)
    return results


def _weight_distance(ddp: nn.Module, step: int) -> None:
    """Emit ``||w_r - w_0||_2`` and ``max |w_r - w_0|`` over every parameter (a collective)."""
    import torch.distributed as dist

    from ddplab.probes import all_gather_flat

    flat = torch.cat([p.detach().reshape(-1).double() for p in ddp.module.parameters()])
    gathered = all_gather_flat(flat)
    diff = (gathered[dist.get_rank()] - gathered[0]).cpu()
    emit("weight_distance", float(diff.norm()), step=step)
    emit("weight_max_abs_diff", float(diff.abs().max()), step=step)


class BucketCounter:
    """State of :func:`counting_hook`: how many buckets the reducer has reduced so far."""

    def __init__(self, process_group=None):
        self.process_group = process_group
        self.buckets = 0


def counting_hook(state, bucket):  # unannotated: DDP compares annotations as objects
    """Count the bucket, then reduce it exactly as DDP does (:func:`ddplab.comm_hooks.ddp_default_hook`).

    The reducer calls its comm hook only for buckets whose gradients its
    autograd hooks saw, so the count says whether the reducer is still attached.
    """
    from ddplab.comm_hooks import ddp_default_hook

    state.buckets += 1
    return ddp_default_hook(state.process_group, bucket)


class _Detector:
    """The detached-reducer guard in a mode that records instead of stopping training.

    :class:`ddplab.probes.ReducerGuard` raises ``DetachedReducerError`` from
    DDP's forward pre-hook or at the end of a backward. Each raise is
    recorded as ``detector_alarm`` and the guard is closed, so training goes
    on unguarded; a refused forward is run again.
    """

    def __init__(self, ddp):
        from ddplab.probes import guard_reducer

        self.guard = guard_reducer(ddp)
        self.alarms = 0

    def attach(self, ddp) -> None:
        """Watch a new wrapper (after a re-wrap) instead of the old one."""
        from ddplab.probes import guard_reducer

        self.close()
        self.guard = guard_reducer(ddp)

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None

    def _record(self, err, step: int, when: str) -> None:
        self.alarms += 1
        emit("detector_alarm", len(err.params), step=step, when=when, params=",".join(err.params),
             message=str(err))
        self.close()

    def forward(self, model, x, step: int):
        from ddplab.probes import DetachedReducerError

        try:
            return model(x)
        except DetachedReducerError as err:
            self._record(err, step, "before forward")
            return model(x)

    def backward(self, backward, step: int) -> None:
        from ddplab.probes import DetachedReducerError

        try:
            backward()
        except DetachedReducerError as err:
            # Raised at the very end of backward: the gradients are complete, the step goes on.
            self._record(err, step, "after backward")


def _describe_params(module: nn.Module) -> tuple[str, str]:
    """``(dtype, device)`` of the module's first parameter, as recorded."""
    p = next(module.parameters())
    return str(p.dtype).replace("torch.", ""), str(p.device)


def train_configuration(params: dict, framework: str, roundtrip: str, variant: str,
                        device: torch.device, fabric=None) -> None:
    """Train one fresh ToyModel for ``params["steps"]`` steps and record it.

    A collective sequence: every rank runs it with the same arguments.
    """
    import torch.distributed as dist

    from ddplab.probes import grads_in_sync

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = rank_batches(params["seed"], rank, params["steps"], device)
    torch.manual_seed(params["seed"])
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = _wrap(framework, model, optimizer, device, fabric)
    counter = BucketCounter()
    ddp_of(model).register_comm_hook(counter, counting_hook)
    detector = _Detector(ddp_of(model))
    loss_fn = nn.MSELoss()
    backward = fabric.backward if framework == "fabric" else (lambda loss: loss.backward())
    completed = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(batches):
            if roundtrip != "none" and step == params["roundtrip_step"]:
                dtype_before, device_before = _describe_params(ddp_of(model).module)
                apply_roundtrip(model, roundtrip, device, fabric)
                dtype_after, device_after = _describe_params(ddp_of(model).module)
                emit("roundtrip_applied", 1, step=step, dtype_before=dtype_before,
                     dtype_after=dtype_after, device_before=device_before, device_after=device_after)
                if variant == REWRAPPED:
                    model, optimizer = rewrap_model(framework, model, optimizer, fabric)
                    if framework == "fabric":  # fabric.setup built a fresh DDP: count its buckets too
                        ddp_of(model).register_comm_hook(counter, counting_hook)
                    detector.attach(ddp_of(model))
            ddp = ddp_of(model)
            output = detector.forward(model, x, step)
            optimizer.zero_grad()
            loss = loss_fn(output, y)
            reduced = counter.buckets
            detector.backward(lambda: backward(loss), step)
            emit("loss", loss.detach().item(), step=step)
            emit("buckets_reduced", counter.buckets - reduced, step=step)
            grads_in_sync(ddp, step=step)
            report_check(ddp, world, step)
            optimizer.step()
            _weight_distance(ddp, step)
            completed += 1
    detector.close()
    emit("detector_alarms", detector.alarms)
    emit("steps_completed", completed)
    messages = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    emit("training_warnings", len(caught), messages=" | ".join(messages)[:2000])


def worker(params: dict) -> None:
    """What every rank runs: each configuration in turn, labelled ``framework``, ``roundtrip``,
    ``variant`` and ``config``.

    The device is the rank's (``cuda:local_rank`` under nccl, else the CPU);
    Fabric is made once, only when a Fabric configuration runs. Rank 0
    records what is skipped here and why, and Lightning's version.
    """
    import torch.distributed as dist

    from ddplab.rank import current_context

    ctx = current_context()
    device = ctx.device if ctx is not None else torch.device("cpu")
    fabric_state = fabric_available() if "fabric" in params["framework"] else (False, "not asked for")
    configurations, skipped = plan_configurations(params, on_cuda=device.type == "cuda",
                                                  gpus=_gpus(), fabric=fabric_state)
    if dist.get_rank() == 0:
        for skip in skipped:
            emit("configuration_skipped", 1, **skip)
        fabric_ok, fabric_version = fabric_state
        if fabric_ok:
            emit("fabric_version", 1, version=fabric_version)
    fabric = make_fabric(device) if any(f == "fabric" for f, _, _ in configurations) else None
    for framework, roundtrip, variant in configurations:
        with labels(framework=framework, roundtrip=roundtrip, variant=variant,
                    config=f"{framework} · {roundtrip} · {variant}"):
            train_configuration(params, framework, roundtrip, variant, device,
                                fabric if framework == "fabric" else None)
