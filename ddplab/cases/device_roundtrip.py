"""Case 03 — "moving a DDP model to CPU and back silently stops gradient sync" (seed 003).

The report wraps the ToyModel (``Linear(10, 10)``, ReLU, ``Linear(10, 5)``)
with Lightning Fabric (``strategy="ddp"``) or plain DDP, moves the *wrapped*
model to the CPU and back to the GPU, runs one step on different data per
rank and finds, with an ``all_gather`` of the gradients and
``torch.allclose``, that the gradients differ across ranks: no error, no
warning, each rank trains alone. A maintainer traced it to DDP, not Fabric.

Why (measured and explained in :mod:`ddplab.probes`): DDP's reducer puts its
autograd hooks on each parameter's gradient accumulator (``AccumulateGrad``
node) when the model is wrapped. ``.cpu()``, ``.cuda()``, ``.double()`` and
``.float()`` assign ``param.data``; torch then drops the parameter's cached
accumulator when the dtype or device changes, and the next forward creates
a new one *without* the reducer's hook. The round trip restores the dtype and
device but not the hooks, so no bucket is ever reduced again. ``.double()``
then ``.float()`` does the same on a CPU, which is how this case reproduces
the report without GPUs; the report's own ``.cpu()``/``.cuda()`` trigger runs
when every rank has a GPU and is otherwise skipped with a note.

One launch of ``world_size`` ranks trains, one after the other, a fresh
ToyModel per *configuration*: framework (``ddp``, ``fabric``) × round trip
(``none``, ``dtype``, ``device``) × variant (``as reported``; for a round
trip also ``re-wrapped``: the fix, DDP on the unwrapped module via
:func:`ddplab.probes.rewrap`, or ``fabric.setup`` again). Every configuration
sees the same initial weights (``seed``) and the same batches (rank *r*
draws ``torch.randn(20, 10)`` inputs and ``torch.randn(20, 5)`` targets from
its own generator), trains ``steps`` SGD steps (lr 0.001, MSE), and does the
round trip before step ``roundtrip_step``.

Records per configuration (labels ``framework``, ``roundtrip``, ``variant``,
``config``), per step and rank:

``loss``
    this rank's local MSE before the update;
``grad_bitwise_equal``, ``grad_max_abs_diff`` (label ``param``)
    :func:`ddplab.probes.grads_in_sync`: this rank's gradient against rank 0's;
``report_allclose`` (label ``param``)
    the report's own check: ``all_gather`` the gradient, ``torch.allclose``
    against every rank's (1 passes, 0 would have raised in the report);
``buckets_reduced``
    gradient buckets DDP's reducer handed to the communication hook in this
    backward (a counting wrapper around
    :func:`ddplab.comm_hooks.ddp_default_hook`, bitwise DDP's own reduction);
``weight_distance``, ``weight_max_abs_diff``
    ``||w_r - w_0||_2`` and ``max |w_r - w_0|`` over all parameters after the update;
``detector_alarm`` (labels ``when``, ``params``, ``message``)
    the detached-reducer guard (:class:`ddplab.probes.ReducerGuard`) raised:
    the step, what it said; the guard is then closed so training goes on
    (the guard's own ``reducer_detached_params`` record is kept too);

and once per configuration: ``roundtrip_applied`` (labels ``dtype_before``,
``dtype_after``, ``device_before``, ``device_after``), ``detector_alarms``
(how many times the guard raised), ``steps_completed``, ``training_warnings``
(Python warnings raised while training; label ``messages``). Rank 0 emits
``configuration_skipped`` (labels ``cause``: ``no cuda`` or ``no lightning``,
and ``reason``) for what cannot run here, and ``fabric_version``. The parent
adds ``launch_seconds``.

Fabric runs inside ddplab's ranks: :func:`existing_group_environment` is a
Lightning cluster environment that adopts the process group ddplab already
initialized (Fabric's launcher then starts no process, and its
``_init_dist_connection`` returns early on an initialized group).

Example::

    >>> from ddplab.cases import device_roundtrip as case
    >>> params = case.check_params({})
    >>> records = case.run(params)
    >>> case.verdict(records, params).headline
"""
from __future__ import annotations

import functools
import math
import time
import warnings

import torch
import torch.nn as nn

from ddplab import records as _records
from ddplab.parameters import Parameter, ParameterSet
from ddplab.verdict import Finding, Verdict

__all__ = [
    "NAME", "TITLE", "SEED", "NOTEBOOK", "PARAMETERS", "QUICK", "ROUNDTRIPS", "FRAMEWORKS",
    "VARIANTS", "ToyModel", "check_params", "fabric_available", "device_skip_reason",
    "plan_backend", "plan_configurations", "rank_batches", "existing_group_environment",
    "make_fabric", "ddp_of", "apply_roundtrip", "rewrap_model", "report_check",
    "BucketCounter", "counting_hook", "train_configuration", "worker", "run",
    "summary_table", "alarms_table", "alarms_markdown", "skipped_markdown", "verdict",
    "timeline_figure", "grad_diff_figure", "weight_distance_figure", "loss_gap_table",
    "loss_gap_figure", "loss_figure", "figures",
]

NAME = "device_roundtrip"
TITLE = "Device round trip: moving a wrapped DDP model away and back silently stops gradient sync"
SEED = "003_3c9d08665ed4c542.txt"
NOTEBOOK = "03_device_roundtrip.ipynb"

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
#: Seconds before the launch is declared hung (importing Lightning takes several on 2 busy cores).
LAUNCH_TIMEOUT = 240.0


PARAMETERS = ParameterSet([
    Parameter("world_size", 2, "number of ranks (processes); the report used 2 GPUs",
              kind="int", minimum=2, maximum=8),
    Parameter("roundtrip", list(ROUNDTRIPS),
              "round trips after wrapping: none (control), dtype (.double() then .float(), "
              "runs on CPU), device (.cpu() then .cuda(), the report's, needs a GPU per rank)",
              kind="list[str]", choices=ROUNDTRIPS),
    Parameter("framework", list(FRAMEWORKS),
              "ddp (torch DistributedDataParallel) and/or fabric (Lightning Fabric with its ddp strategy)",
              kind="list[str]", choices=FRAMEWORKS),
    Parameter("steps", 20, "SGD steps per configuration", kind="int", minimum=1, maximum=1000),
    Parameter("roundtrip_step", 5, "the round trip happens before this step "
              "(0: right after wrapping, as in the report)", kind="int", minimum=0),
    Parameter("seed", 0, "seed of the shared initial weights and of each rank's data",
              kind="int", minimum=0, maximum=2**31 - 1),
])

#: Seconds: the control and the CPU round trip, both frameworks, a few steps.
QUICK = {"roundtrip": ["none", "dtype"], "steps": 6, "roundtrip_step": 2}


# --------------------------------------------------------------------------- parameters


def check_params(params: dict) -> dict:
    """Validate ``params`` and the rule that ties them together; return them parsed.

    On top of :data:`PARAMETERS`, the round trip must happen during training
    (``roundtrip_step < steps``). Raises ValueError naming the parameter.
    """
    params = PARAMETERS.validate(params)
    if params["roundtrip_step"] >= params["steps"]:
        raise ValueError(f"parameter 'roundtrip_step': {params['roundtrip_step']} is not before the "
                         f"last of the {params['steps']} steps; it accepts 0 to {params['steps'] - 1}")
    return params


# --------------------------------------------------------------------------- the report's model and data


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
                 device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
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


def fabric_available() -> tuple[bool, str]:
    """``(True, version)`` when Lightning Fabric imports, else ``(False, why)``."""
    try:
        import lightning
        from lightning.fabric import Fabric  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "skip Fabric", said why
        return False, f"lightning is not importable ({type(exc).__name__}: {exc})"
    return True, lightning.__version__


def device_skip_reason(world_size: int, gpus: int) -> str | None:
    """Why the ``device`` round trip cannot run with ``gpus`` CUDA devices, or None.

    The report's round trip moves each rank's model to the CPU and back to
    *its* GPU, so every rank needs one (``gpus >= world_size``).
    """
    if gpus >= world_size:
        return None
    have = "no CUDA GPU on this machine" if gpus == 0 else \
        f"{world_size} ranks but only {gpus} CUDA GPU(s)"
    return (f"the report's .cpu() then .cuda() round trip needs one CUDA GPU per rank ({have}); "
            f"the dtype round trip (.double() then .float()) exercises the same mechanism on the CPU")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_backend(params: dict, gpus: int | None = None) -> str:
    """The launch's backend: ``nccl`` (every configuration on ``cuda:rank``) when the
    ``device`` round trip is asked for and every rank has a GPU, else ``gloo`` on the CPU."""
    gpus = _gpus() if gpus is None else gpus
    wants_device = "device" in params["roundtrip"]
    return "nccl" if wants_device and device_skip_reason(params["world_size"], gpus) is None else "gloo"


def plan_configurations(params: dict, *, on_cuda: bool, gpus: int,
                        fabric: tuple[bool, str]) -> tuple[list[tuple[str, str, str]], list[dict]]:
    """What runs and what is skipped, in order.

    Returns ``(configurations, skipped)``: ``(framework, roundtrip, variant)``
    triples (a round trip runs as reported and re-wrapped; ``none`` only as
    reported) and ``{"framework", "roundtrip", "reason"}`` for each skipped
    pair, with ``cause`` ``"no cuda"`` (``device`` off CUDA) or ``"no lightning"``
    (``fabric`` where Lightning does not import).
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


# --------------------------------------------------------------------------- Fabric inside ddplab's ranks


@functools.lru_cache(maxsize=None)
def _existing_group_environment_class():
    from lightning.fabric.plugins.environments import ClusterEnvironment

    class ExistingGroupEnvironment(ClusterEnvironment):
        """A Lightning cluster environment for processes whose process group already exists.

        Ranks and sizes are read from ``torch.distributed`` (and ddplab's
        rank context for the local rank); nothing is set.
        ``creates_processes_externally`` tells Fabric's launcher not to start
        processes, and Fabric's ``_init_dist_connection`` returns early
        because the default group is initialized, so Fabric uses ddplab's group.
        """

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "127.0.0.1"  # never used: the group exists

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            import torch.distributed as dist
            return dist.is_available() and dist.is_initialized()

        def world_size(self) -> int:
            import torch.distributed as dist
            return dist.get_world_size()

        def set_world_size(self, size: int) -> None:
            pass  # the group decides

        def global_rank(self) -> int:
            import torch.distributed as dist
            return dist.get_rank()

        def set_global_rank(self, rank: int) -> None:
            pass

        def local_rank(self) -> int:
            from ddplab.rank import current_context
            ctx = current_context()
            return ctx.local_rank if ctx is not None else self.global_rank()

        def node_rank(self) -> int:
            from ddplab.rank import current_context
            ctx = current_context()
            local = ctx.local_world_size if ctx is not None else self.world_size()
            return self.global_rank() // local

    return ExistingGroupEnvironment


def existing_group_environment():
    """A Lightning ``ClusterEnvironment`` that adopts the already-initialized process group."""
    return _existing_group_environment_class()()


def make_fabric(device: torch.device):
    """A launched ``Fabric(strategy="ddp")`` on this rank's device, inside ddplab's process group.

    ``devices`` is the number of ranks on this machine and ``num_nodes`` the
    number of machines, as Fabric expects; the environment
    (:func:`existing_group_environment`) makes ``fabric.launch()`` start no
    process and initialize no group.
    """
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from ddplab.rank import current_context

    ctx = current_context()
    local = ctx.local_world_size if ctx is not None else dist.get_world_size()
    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=local,
                    num_nodes=dist.get_world_size() // local, strategy="ddp",
                    plugins=[existing_group_environment()])
    fabric.launch()
    if fabric.world_size != dist.get_world_size() or fabric.global_rank != dist.get_rank():
        raise RuntimeError(f"Fabric sees rank {fabric.global_rank} of {fabric.world_size}, "
                           f"torch.distributed rank {dist.get_rank()} of {dist.get_world_size()}")
    return fabric


# --------------------------------------------------------------------------- wrapping, moving, re-wrapping


def ddp_of(model: nn.Module):
    """The ``DistributedDataParallel`` inside ``model`` (a DDP model or Fabric's wrapper)."""
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_forward_module", model)  # Fabric's _FabricModule
    if not isinstance(inner, DistributedDataParallel):
        raise ValueError(f"expected a DDP model or a Fabric module around one, got {type(model).__name__}")
    return inner


def _wrap(framework: str, model: nn.Module, optimizer, device: torch.device, fabric):
    """The report's wrapping: ``DDP(model.to(device), device_ids=...)`` or ``fabric.setup``."""
    from torch.nn.parallel import DistributedDataParallel

    if framework == "fabric":
        return fabric.setup(model, optimizer)
    model.to(device)
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids), optimizer


def apply_roundtrip(model: nn.Module, roundtrip: str, device: torch.device, fabric=None) -> None:
    """Move the *wrapped* ``model`` away and back, as users do (in place).

    ``dtype``: ``model.double()`` then ``model.float()``; ``device``:
    ``model.cpu()`` then ``model.cuda(device)`` (DDP) or
    ``fabric.to_device(model)`` (Fabric, the report's call). Each step
    reassigns ``param.data``, which detaches DDP's reducer (see :mod:`ddplab.probes`).
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

    DDP: :func:`ddplab.probes.rewrap` (a new DDP, same settings and comm
    hooks, on the unwrapped module). Fabric: ``fabric.setup`` again on the
    unwrapped module and optimizer (what the maintainers suggest). Either
    way the new reducer hooks the parameters' current gradient accumulators.
    The Parameter objects stay, so the optimizer keeps updating them.
    """
    from ddplab.probes import rewrap

    if framework == "fabric":
        return fabric.setup(model.module, optimizer.optimizer)
    return rewrap(model), optimizer


# --------------------------------------------------------------------------- measurements inside a rank


def report_check(ddp: nn.Module, world_size: int, step: int) -> list[bool]:
    """The report's ``_check_gradients_between_workers``, recording instead of raising.

    For every parameter with a gradient: ``all_gather`` it and check
    ``torch.allclose(v.grad, grad)`` against every rank's. Emits
    ``report_allclose`` (1 passes, 0 is where the report raised) per
    parameter and returns the results.
    """
    import torch.distributed as dist

    results = []
    for name, p in ddp.module.named_parameters():
        if p.grad is None:
            continue
        grad_list = [torch.zeros_like(p.grad) for _ in range(world_size)]
        dist.all_gather(grad_list, p.grad, async_op=False)
        ok = all(torch.allclose(p.grad, g) for g in grad_list)
        _records.emit("report_allclose", int(ok), step=step, param=name)
        results.append(ok)
    return results


def _weight_distance(ddp: nn.Module, step: int) -> None:
    """Emit ``||w_r - w_0||_2`` and ``max |w_r - w_0|`` over every parameter (a collective)."""
    from ddplab.probes import all_gather_flat
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1).double() for p in ddp.module.parameters()])
    gathered = all_gather_flat(flat)
    diff = (gathered[dist.get_rank()] - gathered[0]).cpu()
    _records.emit("weight_distance", float(diff.norm()), step=step)
    _records.emit("weight_max_abs_diff", float(diff.abs().max()), step=step)


class BucketCounter:
    """State for :func:`counting_hook`: how many buckets the reducer reduced so far."""

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
    """The detached-reducer guard, in a mode that records instead of stopping training.

    :class:`ddplab.probes.ReducerGuard` raises :class:`DetachedReducerError`
    from DDP's forward pre-hook (before the forward runs) or at the end of a
    backward (its cross-rank check). Each raise is recorded as
    ``detector_alarm`` and the guard is closed, so the experiment goes on
    unguarded; a forward that was refused is run again.
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
        _records.emit("detector_alarm", len(err.params), step=step, when=when,
                      params=",".join(err.params), message=str(err))
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
            # Raised from a callback at the very end of backward: the
            # gradients are complete, so the step goes on with them.
            self._record(err, step, "after backward")


def _describe_params(module: nn.Module) -> tuple[str, str]:
    p = next(module.parameters())
    return str(p.dtype).replace("torch.", ""), str(p.device)


def train_configuration(params: dict, framework: str, roundtrip: str, variant: str,
                        device: torch.device, fabric=None) -> None:
    """Train one fresh ToyModel for ``params["steps"]`` steps and record it (see the module docstring).

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
                _records.emit("roundtrip_applied", 1, step=step, dtype_before=dtype_before,
                              dtype_after=dtype_after, device_before=device_before,
                              device_after=device_after)
                if variant == REWRAPPED:
                    model, optimizer = rewrap_model(framework, model, optimizer, fabric)
                    if framework == "fabric":  # a fresh DDP from fabric.setup: hook it too
                        ddp_of(model).register_comm_hook(counter, counting_hook)
                    detector.attach(ddp_of(model))
            ddp = ddp_of(model)
            output = detector.forward(model, x, step)
            optimizer.zero_grad()
            loss = loss_fn(output, y)
            before = counter.buckets
            detector.backward(lambda: backward(loss), step)
            _records.emit("loss", loss.detach().item(), step=step)
            _records.emit("buckets_reduced", counter.buckets - before, step=step)
            grads_in_sync(ddp, step=step)
            report_check(ddp, world, step)
            optimizer.step()
            _weight_distance(ddp, step)
            completed += 1
    detector.close()
    _records.emit("detector_alarms", detector.alarms)
    _records.emit("steps_completed", completed)
    messages = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    _records.emit("training_warnings", len(caught), messages=" | ".join(messages)[:2000])


def worker(params: dict) -> None:
    """What every rank runs: each configuration in turn (:func:`plan_configurations`).

    The device is the rank's (``cuda:local_rank`` under nccl, else the CPU);
    Fabric is created once, only when a Fabric configuration runs.
    """
    import torch.distributed as dist

    from ddplab.rank import current_context

    params = check_params(params)
    ctx = current_context()
    device = ctx.device if ctx is not None else torch.device("cpu")
    fabric_state = fabric_available() if "fabric" in params["framework"] else (False, "not asked for")
    configurations, skipped = plan_configurations(params, on_cuda=device.type == "cuda",
                                                  gpus=_gpus(), fabric=fabric_state)
    if dist.get_rank() == 0:
        for skip in skipped:
            _records.emit("configuration_skipped", 1, **skip)
        if fabric_state[0]:
            _records.emit("fabric_version", 1, version=fabric_state[1])
    fabric = None
    if any(f == "fabric" for f, _, _ in configurations):
        fabric = make_fabric(device)
    for framework, roundtrip, variant in configurations:
        config = f"{framework} · {roundtrip} · {variant}"
        with _records.labels(framework=framework, roundtrip=roundtrip, variant=variant,
                             config=config):
            train_configuration(params, framework, roundtrip, variant, device,
                                fabric if framework == "fabric" else None)


def run(params: dict, progress: bool = True):
    """Validate ``params``, launch the ranks once, return the tidy records.

    ``progress`` is accepted for the case protocol; a run takes seconds and shows no bar.
    """
    from ddplab.launcher import launch

    params = check_params(params)
    backend = plan_backend(params)
    t0 = time.perf_counter()
    result = launch(worker, world_size=params["world_size"], backend=backend, args=(params,),
                    timeout=LAUNCH_TIMEOUT)
    recs = list(result.ordered_records)
    recs.append(_records.record("launch_seconds", time.perf_counter() - t0, backend=backend,
                                world_size=params["world_size"]))
    ordered = sorted(recs, key=lambda r: -1 if r.get("rank") is None else r["rank"])
    return _records.to_frame(ordered)


# --------------------------------------------------------------------------- tables


CONFIG_KEYS = ["framework", "roundtrip", "variant"]


_rows = _records.where  # the rows of one metric with given labels, possibly none


def _configs(records) -> list[tuple[str, str, str]]:
    done = _rows(records, "steps_completed")
    if not len(done):
        return []
    order = {k: i for i, k in enumerate(ROUNDTRIPS)}
    keys = {tuple(r) for r in done[CONFIG_KEYS].itertuples(index=False)}
    return sorted(keys, key=lambda k: (FRAMEWORKS.index(k[0]), order[k[1]], VARIANTS.index(k[2])))


def _of(frame, config):
    mask = True
    for key, val in zip(CONFIG_KEYS, config):
        mask = mask & (frame[key] == val)
    return frame[mask]


def _per_step(rows, how: str = "min"):
    """``value`` per step over ranks and parameters (``min`` or ``max``), as {step: value}."""
    if not len(rows):
        return {}
    agg = rows.groupby("step")["value"].agg(how)
    return {int(s): float(v) for s, v in agg.items()}


def _config_facts(records, config, roundtrip_step: int) -> dict:
    """Everything the verdict and the tables need about one configuration."""
    equal = _per_step(_of(_rows(records, "grad_bitwise_equal"), config), "min")
    diff = _per_step(_of(_rows(records, "grad_max_abs_diff"), config), "max")
    allclose = _per_step(_of(_rows(records, "report_allclose"), config), "min")
    dist_ = _per_step(_of(_rows(records, "weight_distance"), config), "max")
    buckets = _per_step(_of(_rows(records, "buckets_reduced"), config), "min")
    loss = _of(_rows(records, "loss"), config)
    alarms = _of(_rows(records, "detector_alarm"), config)
    warn = _of(_rows(records, "training_warnings"), config)
    completed = _of(_rows(records, "steps_completed"), config)
    applied = _of(_rows(records, "roundtrip_applied"), config)
    steps = sorted(equal)
    out_of_sync = [s for s in steps if equal[s] < 1]
    rt = roundtrip_step if config[1] != "none" else None
    before = [s for s in steps if rt is None or s < rt]
    after = [s for s in steps if rt is not None and s >= rt]
    final_losses = loss[loss["step"] == loss["step"].max()] if len(loss) else loss
    return dict(
        config=config, steps=steps, roundtrip_step=rt,
        out_of_sync=out_of_sync,
        in_sync_before=all(equal[s] == 1 for s in before),
        out_of_sync_after=bool(after) and all(equal[s] < 1 for s in after),
        max_grad_diff=max(diff.values()) if diff else math.nan,
        report_fails=[s for s in sorted(allclose) if allclose[s] < 1],
        distance=dist_,
        final_distance=dist_[max(dist_)] if dist_ else math.nan,
        distance_before=max((dist_[s] for s in before if s in dist_), default=0.0),
        buckets_before=sorted({int(buckets[s]) for s in before if s in buckets}),
        buckets_after=sorted({int(buckets[s]) for s in after if s in buckets}),
        alarm_steps=sorted({int(s) for s in alarms["step"].dropna()}),
        alarm_ranks=sorted({int(r) for r in alarms["rank"].dropna()}),
        alarm_when=sorted(set(alarms["when"].dropna())) if "when" in alarms else [],
        alarm_params=sorted(set(alarms["params"].dropna())) if "params" in alarms else [],
        alarm_messages=sorted(set(alarms["message"].dropna())) if "message" in alarms else [],
        warnings=int(warn["value"].sum()) if len(warn) else 0,
        warning_messages=sorted({m for m in warn.get("messages", []) if m}) if len(warn) else [],
        completed=int(completed["value"].min()) if len(completed) else 0,
        final_losses={int(r): float(v) for r, v in zip(final_losses["rank"], final_losses["value"])},
        restored=(bool(len(applied)) and bool((applied["dtype_before"] == applied["dtype_after"]).all())
                  and bool((applied["device_before"] == applied["device_after"]).all())),
    )


def _roundtrip_step(records, params: dict | None) -> int:
    if params is not None and "roundtrip_step" in params:
        return int(params["roundtrip_step"])
    applied = _rows(records, "roundtrip_applied")
    return int(applied["step"].min()) if len(applied) else 0


def summary_table(records, params: dict | None = None):
    """One row per configuration: steps in sync, first step out of sync, largest gradient
    difference, the report's check, buckets reduced per backward, weight distance at the end,
    detector alarms and warnings."""
    import pandas as pd

    rt = _roundtrip_step(records, params)
    rows = []
    for config in _configs(records):
        f = _config_facts(records, config, rt)
        rows.append({
            "framework": config[0], "round trip": config[1], "variant": config[2],
            "steps in sync": f"{len(f['steps']) - len(f['out_of_sync'])}/{len(f['steps'])}",
            "first step out of sync": f["out_of_sync"][0] if f["out_of_sync"] else "—",
            "max |g_r − g_0|": f["max_grad_diff"],
            "report's check failed (steps)": len(f["report_fails"]),
            "buckets reduced per backward": _buckets_text(f),
            "weight distance at the end": f["final_distance"],
            "detector alarms (step)": (", ".join(map(str, f["alarm_steps"])) if f["alarm_steps"]
                                       else "none"),
            "warnings": f["warnings"],
        })
    return pd.DataFrame(rows).set_index(["framework", "round trip", "variant"]) if rows else pd.DataFrame()


def _buckets_text(f: dict) -> str:
    before = "/".join(map(str, f["buckets_before"])) or "—"
    if f["roundtrip_step"] is None:
        return before
    after = "/".join(map(str, f["buckets_after"])) or "—"
    return f"{before} before, {after} after the round trip"


def alarms_table(records):
    """Every detector alarm: configuration, rank, step, when, and what the guard said."""
    import pandas as pd

    alarms = _rows(records, "detector_alarm")
    if not len(alarms):
        return pd.DataFrame(columns=["framework", "round trip", "variant", "rank", "step", "when",
                                     "message"])
    table = alarms[CONFIG_KEYS + ["rank", "step", "when", "message"]].rename(
        columns={"roundtrip": "round trip"})
    return table.reset_index(drop=True)


def alarms_markdown(records) -> str:
    """The guard's alarms per configuration (ranks, step, when) and, once, what it said."""
    alarms = _rows(records, "detector_alarm")
    configs = _configs(records)
    lines = []
    silent = [c for c in configs if not len(_of(alarms, c))] if len(alarms) else configs
    for config in configs:
        sub = _of(alarms, config) if len(alarms) else alarms
        if not len(sub):
            continue
        ranks = ", ".join(str(int(r)) for r in sorted(sub["rank"].dropna().unique()))
        steps = ", ".join(str(int(s)) for s in sorted(sub["step"].dropna().unique()))
        when = ", ".join(sorted(sub["when"].dropna().unique()))
        lines.append(f"**{' · '.join(config)}**: the guard fired on rank(s) {ranks} at step {steps} "
                     f"({when}). It said (rank {int(sub['rank'].min())}):\n")
        message = sub.sort_values("rank")["message"].iloc[0]
        lines.append("```\n" + message + "\n```\n")
    if silent:
        lines.append("Silent on: " + ", ".join(f"{' · '.join(c)}" for c in silent) + ".")
    return "\n".join(lines) + "\n"


def skipped_markdown(records) -> str:
    """What did not run here and why (the device round trip off CUDA, Fabric without Lightning)."""
    skipped = _rows(records, "configuration_skipped")
    version = _rows(records, "fabric_version")
    lines = []
    if len(version):
        lines.append(f"Lightning Fabric {version['version'].iloc[0]} ran inside ddplab's process "
                     f"group (an environment that adopts the existing group: no process started, "
                     f"no group initialized by Fabric).")
    if not len(skipped):
        lines.append("Every requested configuration ran.")
        return "\n\n".join(lines) + "\n"
    lines.append("**Not run here:**\n")
    for _, row in skipped.iterrows():
        lines.append(f"- `{row['framework']}` × `{row['roundtrip']}`: {row['reason']}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the verdict


def _name(config) -> str:
    return f"{config[0]}/{config[1]}" + ("" if config[2] == AS_REPORTED else " re-wrapped")


def _fmt(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def verdict(records, params: dict) -> Verdict:
    """The verdict rule, from the records alone.

    kind ``"bug"`` when a round trip made the gradients differ across ranks
    while training went on without an error (DDP's reducer detached),
    ``"no desync"`` otherwise.
    """
    params = check_params(params)
    rt = params["roundtrip_step"]
    facts = {c: _config_facts(records, c, rt) for c in _configs(records)}
    control = [f for c, f in facts.items() if c[1] == "none"]
    broken = [f for c, f in facts.items() if c[1] != "none" and c[2] == AS_REPORTED]
    fixed = [f for c, f in facts.items() if c[2] == REWRAPPED]
    dtype_broken = [f for f in broken if f["config"][1] == "dtype"]
    desynced = [f for f in facts.values() if f["out_of_sync"]]
    findings = []

    def sync_text(f):
        return (f"{_name(f['config'])}: {len(f['steps']) - len(f['out_of_sync'])}/{len(f['steps'])} "
                f"steps bitwise in sync, weight distance at the end {_fmt(f['final_distance'])}")

    def broken_text(f):
        first = f["out_of_sync"][0] if f["out_of_sync"] else None
        before = f"in sync before step {rt}: {f['in_sync_before']}; " if rt else ""
        return (f"{_name(f['config'])}: {before}out of sync "
                f"at {len([s for s in f['out_of_sync'] if s >= rt])} of the {len(f['steps']) - rt} "
                f"steps from step {rt} on" + (f" (first: {first})" if first is not None else "")
                + f"; max |g_r − g_0| = {_fmt(f['max_grad_diff'])}; buckets reduced per backward "
                  f"{_buckets_text(f)}")

    def silent_text(f):
        w = f"{f['warnings']} Python warning(s)"
        if f["warning_messages"]:
            w += f" ({'; '.join(f['warning_messages'])[:300]})"
        return f"{_name(f['config'])}: {f['completed']}/{len(f['steps'])} steps trained, no exception, {w}"

    def drift_text(f):
        return (f"{_name(f['config'])}: weight distance {_fmt(f['distance_before'])} before step "
                f"{rt}, {_fmt(f['final_distance'])} after step {max(f['distance'])}; final local "
                f"losses " + ", ".join(f"rank {r}: {v:.4f}" for r, v in sorted(f["final_losses"].items())))

    if control:
        findings.append(Finding(
            "none_in_sync",
            "Without a round trip every gradient is bitwise equal across ranks at every step",
            holds=all(not f["out_of_sync"] and f["final_distance"] == 0 for f in control),
            evidence="; ".join(map(sync_text, control))))
    if dtype_broken:
        findings.append(Finding(
            "dtype_breaks_sync",
            f"After .double() then .float() on the wrapped model (before step {rt}) the gradients "
            f"differ across ranks at every later step, for every framework run; before it they are equal",
            holds=all(f["in_sync_before"] and f["out_of_sync_after"] for f in dtype_broken),
            evidence="; ".join(map(broken_text, dtype_broken))))
    if desynced:
        findings.append(Finding(
            "silent",
            "Nothing stopped or warned: the desynchronized runs trained every step without an "
            "exception or a warning (only ddplab's guard spoke)",
            holds=all(f["completed"] == params["steps"] and f["warnings"] == 0 for f in desynced),
            evidence="; ".join(map(silent_text, desynced))))
        findings.append(Finding(
            "ranks_train_alone",
            "Each rank then trains alone: the replicas' weights, equal before the round trip, drift apart",
            holds=all(f["distance_before"] == 0 and f["final_distance"] > 0 for f in desynced),
            evidence="; ".join(map(drift_text, desynced))))
        findings.append(Finding(
            "mechanism",
            "The round trip restores every parameter's dtype and device, yet the reducer reduces no "
            "bucket any more: its autograd hooks sit on the parameters' old gradient accumulators "
            "(the guard: 'gradient accumulator was replaced'; see ddplab/probes.py)",
            # With the round trip right after wrapping there is no step before it to compare.
            holds=all(f["restored"] and f["buckets_after"] == [0] and 0 not in f["buckets_before"]
                      and any("accumulator was replaced" in m for m in f["alarm_messages"])
                      for f in desynced),
            evidence="; ".join(f"{_name(f['config'])}: dtype and device restored: {f['restored']}; "
                               f"buckets reduced per backward {_buckets_text(f)}; the guard said "
                               + (_guard_line(f["alarm_messages"][0]) if f["alarm_messages"]
                                  else "nothing") for f in desynced)))
    fix = None
    gaps = loss_gap_table(records)
    if fixed:
        fix = Finding(
            "rewrap_fixes",
            "The fix works: wrapping again after the round trip (probes.rewrap for DDP, fabric.setup "
            "for Fabric) keeps every gradient bitwise equal at every step",
            holds=all(not f["out_of_sync"] and f["final_distance"] == 0
                      and 0 not in f["buckets_after"] for f in fixed),
            evidence="; ".join(f"{sync_text(f)}, buckets reduced per backward {_buckets_text(f)}"
                               + _gap_text(gaps, f["config"]) for f in fixed))
        findings.append(fix)

    alarmed = {f["config"] for f in facts.values() if f["alarm_steps"]}
    desync_set = {f["config"] for f in desynced}
    at_roundtrip = all(f["alarm_steps"] == [rt] and f["alarm_when"] == ["before forward"]
                       and len(f["alarm_ranks"]) == params["world_size"] for f in desynced)
    if facts:
        findings.append(Finding(
            "detector_exact",
            "The detached-reducer guard (probes.ReducerGuard) fired exactly on the configurations "
            "that went out of sync, on every rank, at the first forward after the round trip; it "
            "stayed silent on the others",
            holds=alarmed == desync_set and at_roundtrip,
            evidence=(f"fired on: {', '.join(sorted(map(_name, alarmed))) or 'none'}; out of sync: "
                      f"{', '.join(sorted(map(_name, desync_set))) or 'none'}"
                      + "".join(f"; {_name(f['config'])}: step {', '.join(map(str, f['alarm_steps']))} "
                                f"({', '.join(f['alarm_when'])}) on ranks {f['alarm_ranks']}, "
                                f"parameters {', '.join(f['alarm_params'])}"
                                for f in facts.values() if f["alarm_steps"]))))

        agree, disagree = 0, []
        for f in facts.values():
            for s in f["steps"]:
                if (s in f["report_fails"]) == (s in f["out_of_sync"]):
                    agree += 1
                else:
                    disagree.append(f"{_name(f['config'])} step {s}")
        total = sum(len(f["steps"]) for f in facts.values())
        findings.append(Finding(
            "report_check_agrees",
            "The report's own check (all_gather the gradients, torch.allclose) fails exactly at the "
            "steps where the gradients differ bitwise",
            holds=total > 0 and not disagree,
            evidence=f"{agree} of {total} configuration-steps agree"
                     + (f"; disagree: {', '.join(disagree[:10])}" if disagree else "")))

    skipped = _rows(records, "configuration_skipped")
    device_rows = skipped[skipped["cause"] == "no cuda"] if len(skipped) else skipped
    device_facts = [f for c, f in facts.items() if c[1] == "device"]
    if device_facts:
        dev_broken = [f for f in device_facts if f["config"][2] == AS_REPORTED]
        dev_fixed = [f for f in device_facts if f["config"][2] == REWRAPPED]
        findings.append(Finding(
            "device_roundtrip",
            "The report's own trigger (.cpu() then .cuda()) breaks sync the same way, and "
            "re-wrapping fixes it",
            holds=bool(dev_broken) and all(f["in_sync_before"] and f["out_of_sync_after"] for f in dev_broken)
            and all(not f["out_of_sync"] for f in dev_fixed),
            evidence="; ".join([broken_text(f) for f in dev_broken] + [sync_text(f) for f in dev_fixed])))
    elif len(device_rows):
        findings.append(Finding(
            "device_roundtrip",
            "The report's own trigger (.cpu() then .cuda()) was not run on this machine",
            holds=True,
            evidence="; ".join(sorted(set(device_rows["reason"])))))

    fabric_skipped = skipped[skipped["cause"] == "no lightning"] if len(skipped) else skipped
    if len(fabric_skipped):
        findings.append(Finding(
            "fabric_skipped", "Lightning Fabric was not measured here", holds=True,
            evidence="; ".join(sorted(set(fabric_skipped["reason"])))))

    broke = [f for f in broken if f["out_of_sync"]]
    if broke:
        kind = "bug"
        frameworks = sorted({f["config"][0] for f in broke})
        trips = sorted({f["config"][1] for f in broke})
        worst = max(broke, key=lambda f: f["final_distance"])
        silent = all(f["completed"] == params["steps"] and f["warnings"] == 0 for f in broke)
        if fix is None:
            fixed_text = "not run here"
        else:
            fixed_text = "it kept every gradient in sync" if fix.holds else "NOT confirmed here"
        whose = (" Plain DDP shows it too: a DDP behaviour, not Fabric's." if "ddp" in frameworks
                 else "")
        headline = (f"Silent desynchronization reproduced ({', '.join(frameworks)}; round trip "
                    f"{', '.join(trips)}): after the round trip DDP's reducer reduced "
                    f"{'/'.join(map(str, worst['buckets_after']))} buckets per backward, the "
                    f"gradients differed across ranks at every step (by up to "
                    f"{_fmt(worst['max_grad_diff'])}) and the replicas drifted to a weight distance "
                    f"of {_fmt(worst['final_distance'])} after {params['steps']} steps"
                    + (", with no error or warning." if silent else ".")
                    + " Cause: the reducer's hooks stay on the parameters' old gradient "
                      f"accumulators.{whose} Fix: wrap again after moving; {fixed_text}.")
    else:
        kind = "no desync"
        headline = ("No configuration lost gradient sync: "
                    + "; ".join(map(sync_text, facts.values())))
    if len(device_rows) and not device_facts:
        headline += f" The .cpu()/.cuda() round trip was not run: {device_rows['reason'].iloc[0]}."
    return Verdict(case=NAME, kind=kind, headline=headline, findings=findings)


def _gap_text(gaps, config) -> str:
    """How far this configuration's losses are from its reference run's, in words."""
    sub = _of(gaps, config)
    if not len(sub):
        return ""
    worst = float(sub["gap"].abs().max())
    ref = sub["reference"].iloc[0]
    if worst == 0:
        return f"; every loss bitwise equal to {ref}'s on the same batch"
    return f"; losses differ from {ref}'s by up to {worst:.3g}"


def _guard_line(message: str) -> str:
    """The guard's line about the first parameter (what it saw), from its message."""
    lines = [ln.strip() for ln in message.splitlines() if ln.startswith("  ")]
    return f"'{lines[0]}'" if lines else f"'{message.splitlines()[0]}'"


# --------------------------------------------------------------------------- figures


def _panel_grid(configs):
    """Panels for ``configs``: one row per framework, one column per (round trip, variant).

    Returns ``(nrows, ncols, {config: (row, col)})``.
    """
    rows = list(dict.fromkeys(c[0] for c in configs))
    cols = list(dict.fromkeys(c[1:] for c in configs))
    where = {c: (rows.index(c[0]), cols.index(c[1:])) for c in configs}
    return max(1, len(rows)), max(1, len(cols)), where


def _grid_axes(configs, width: float = 4.2, height: float = 2.6):
    """A figure with :func:`_panel_grid`'s layout; unused panels hidden. ``(fig, {config: ax})``."""
    import matplotlib.pyplot as plt

    nrows, ncols, where = _panel_grid(configs)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False,
                             sharex=True, sharey=True)
    used = set(where.values())
    for r in range(nrows):
        for c in range(ncols):
            if (r, c) not in used and used:
                axes[r, c].set_visible(False)
    return fig, {config: axes[pos] for config, pos in where.items()}, axes


def timeline_figure(records, params: dict):
    """Configuration × step: gradients bitwise equal across ranks (green) or not (red);
    × where the report's check failed, ★ where the guard fired, a line at the round trip."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    from ddplab.plots import theme

    configs = _configs(records)
    rt = _roundtrip_step(records, params)
    facts = [_config_facts(records, c, rt) for c in configs]
    steps = sorted({s for f in facts for s in f["steps"]})
    grid = np.full((len(configs), len(steps)), np.nan)
    for i, f in enumerate(facts):
        for s in f["steps"]:
            grid[i, steps.index(s)] = 0.0 if s in f["out_of_sync"] else 1.0
    with theme():
        fig, ax = plt.subplots(figsize=(min(14, 3.5 + 0.32 * len(steps)), 1.2 + 0.45 * len(configs)))
        ax.imshow(grid, cmap=ListedColormap(["#f4b6b6", "#cfe8cf"]), vmin=0, vmax=1, aspect="auto")
        for i, f in enumerate(facts):
            fails = [steps.index(s) for s in f["report_fails"]]
            if fails:
                ax.scatter(fails, [i] * len(fails), marker="x", color="#8b0000", s=22, lw=1.2,
                           label="report's allclose check fails" if i == min(
                               k for k, g in enumerate(facts) if g["report_fails"]) else None)
            if f["alarm_steps"]:
                # Drawn at the cell's left edge: the guard speaks before that step's forward.
                ax.scatter([steps.index(s) - 0.32 for s in f["alarm_steps"]], [i] * len(f["alarm_steps"]),
                           marker="*", color="#1f3b99", s=110, zorder=3,
                           label="detached-reducer guard fired" if i == min(
                               k for k, g in enumerate(facts) if g["alarm_steps"]) else None)
        if any(c[1] != "none" for c in configs) and rt in steps:
            ax.axvline(steps.index(rt) - 0.5, color="black", lw=1.2, ls="--", label="round trip")
        for edge in range(1, len(configs)):
            ax.axhline(edge - 0.5, color="white", lw=2)
        ax.set_yticks(range(len(configs)), [f"{c[0]} · {c[1]} · {c[2]}" for c in configs])
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
        ax.set_xlabel("step")
        ax.grid(False)
        ax.set_title("Gradients bitwise equal across ranks (green) or not (red)", fontsize=10)
        fig.tight_layout()
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                       ncol=3, frameon=False)
    return fig


def grad_diff_figure(records, params: dict):
    """Per parameter and step: the largest cross-rank gradient difference ``max |g_r - g_0|``
    (symlog axis: 0 means bitwise in sync), one panel per configuration."""
    from matplotlib.ticker import MaxNLocator

    from ddplab.plots import theme

    configs = _configs(records)
    rt = _roundtrip_step(records, params)
    rows = _rows(records, "grad_max_abs_diff")
    with theme():
        fig, panels, axes = _grid_axes(configs)
        for config, ax in panels.items():
            sub = _of(rows, config)
            for j, (param, grp) in enumerate(sub.groupby("param", sort=False)):
                per_step = grp.groupby("step")["value"].max()
                ax.plot(per_step.index.astype(int), per_step.values, marker="o", ms=2.5, lw=1.1,
                        color=f"C{j}", label=param)
            if config[1] != "none":
                ax.axvline(rt - 0.5, color="black", lw=1, ls="--")
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(f"{config[0]} · {config[1]} · {config[2]}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("max |g_r − g_0|")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, -0.04))
        fig.suptitle("Cross-rank gradient difference per parameter (0: in sync; dashed: round trip)",
                     fontsize=10, y=1.01)
        fig.tight_layout()
    return fig


def weight_distance_figure(records, params: dict):
    """``||w_r - w_0||_2`` after each step, one line per configuration (0 while in sync)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from ddplab.plots import theme

    configs = _configs(records)
    rt = _roundtrip_step(records, params)
    rows = _rows(records, "weight_distance")
    with theme():
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
        for j, config in enumerate(configs):
            sub = _of(rows, config).groupby("step")["value"].max()
            ax.plot(sub.index.astype(int), sub.values, marker="o", ms=3, lw=1.3,
                    ls="-" if config[2] == AS_REPORTED else ":", color=f"C{j}",
                    label=f"{config[0]} · {config[1]} · {config[2]}")
        if any(c[1] != "none" for c in configs):
            ax.axvline(rt - 0.5, color="black", lw=1, ls="--", label="round trip")
        ax.set_xlabel("step (after its update)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("weight distance ‖w_r − w_0‖₂")
        ax.set_title("Replicas drift apart once the gradients are no longer averaged", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", frameon=False)
        fig.tight_layout()
    return fig


def loss_figure(records, params: dict):
    """Each rank's local loss per step, one panel per configuration."""
    from matplotlib.ticker import MaxNLocator

    from ddplab.plots import theme

    configs = _configs(records)
    rt = _roundtrip_step(records, params)
    rows = _rows(records, "loss")
    with theme():
        fig, panels, axes = _grid_axes(configs)
        for config, ax in panels.items():
            sub = _of(rows, config)
            for rank, grp in sub.groupby("rank"):
                grp = grp.sort_values("step")
                ax.plot(grp["step"].astype(int), grp["value"], lw=1.2, marker="o", ms=2,
                        label=f"rank {int(rank)}")
            if config[1] != "none":
                ax.axvline(rt - 0.5, color="black", lw=1, ls="--")
            ax.set_title(f"{config[0]} · {config[1]} · {config[2]}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("local MSE loss")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, -0.04))
        fig.suptitle("Per-rank loss (each rank's own data; dashed: round trip)", fontsize=10, y=1.01)
        fig.tight_layout()
    return fig


def loss_gap_table(records):
    """Each rank's loss minus the same rank's loss in the reference run, on the same batch.

    Every configuration starts from the same weights and sees the same
    batches, so the difference is what the round trip changed. The reference
    is the framework's control (``none``), or else its re-wrapped run. Rows:
    ``framework, roundtrip, variant, rank, step, gap`` (configurations with a round trip).
    """
    import pandas as pd

    loss = _rows(records, "loss")
    out = []
    for config in _configs(records):
        if config[1] == "none":
            continue
        for ref in ((config[0], "none", AS_REPORTED), (config[0], config[1], REWRAPPED)):
            if ref != config and ref in _configs(records):
                break
        else:
            continue
        mine = _of(loss, config).set_index(["rank", "step"])["value"]
        theirs = _of(loss, ref).set_index(["rank", "step"])["value"]
        gap = (mine - theirs).dropna()
        for (rank, step), value in gap.items():
            out.append(dict(framework=config[0], roundtrip=config[1], variant=config[2],
                            reference=" · ".join(ref), rank=int(rank), step=int(step), gap=float(value)))
    return pd.DataFrame(out, columns=["framework", "roundtrip", "variant", "reference", "rank",
                                      "step", "gap"])


def loss_gap_figure(records, params: dict):
    """Per rank: loss minus the reference run's loss on the same batch (0 while the run is the
    reference bit for bit), one panel per configuration with a round trip."""
    from matplotlib.ticker import MaxNLocator

    from ddplab.plots import theme

    gaps = loss_gap_table(records)
    rt = _roundtrip_step(records, params)
    configs = [c for c in _configs(records) if c[1] != "none"]
    with theme():
        fig, panels, axes = _grid_axes(configs)
        if gaps.empty:
            axes[0, 0].text(0.5, 0.5, "no round trip with a reference run to compare with",
                            ha="center", va="center", transform=axes[0, 0].transAxes)
        for config, ax in panels.items():
            sub = _of(gaps, config)
            for rank, grp in sub.groupby("rank"):
                grp = grp.sort_values("step")
                ax.plot(grp["step"], grp["gap"], lw=1.2, marker="o", ms=2, label=f"rank {int(rank)}")
            ax.axvline(rt - 0.5, color="black", lw=1, ls="--")
            ax.axhline(0, color="grey", lw=0.8)
            ref = sub["reference"].iloc[0] if len(sub) else "—"
            ax.set_title(f"{' · '.join(config)}\nminus {ref}", fontsize=8)
            ax.set_xlabel("step")
            ax.set_ylabel("loss gap")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        handles, labels = axes.flat[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
                       frameon=False, bbox_to_anchor=(0.5, -0.04))
        fig.suptitle("Each rank's loss minus the in-sync reference's, same batch (dashed: round trip)",
                     fontsize=10, y=1.02)
        fig.tight_layout()
    return fig


def figures(records, params: dict) -> list:
    """The case's figures, most telling first: sync timeline, gradient differences,
    weight distance, loss gap to the in-sync run, per-rank losses."""
    return [timeline_figure(records, params), grad_diff_figure(records, params),
            weight_distance_figure(records, params), loss_gap_figure(records, params),
            loss_figure(records, params)]
