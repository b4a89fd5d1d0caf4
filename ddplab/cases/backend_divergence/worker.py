"""Case 01, inside a rank: every run of the launch trained in lockstep, each reduction audited.

As the report: the same seeded initialization for every run and rank,
``DistributedSampler(shuffle=False)`` with ``drop_last``, deterministic
algorithms, DDP's defaults (``broadcast_buffers=True``), SGD; the logged loss
is all-reduced (SUM), then divided by W on rank 0. Each step, every run does
its forward, backward (DDP reduces; the audit hook measures) and update in
turn, on the same batch: nothing but the reduction differs between runs.
"""
from __future__ import annotations

import hashlib
import time

import torch

from ddplab import records as _records
from ddplab.cases.backend_divergence.runs import LIVE_BOUND_ORDER, REFERENCE, RunSpec, plan_runs

__all__ = ["DTYPES", "worker"]

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _digest(model) -> int:
    """52 bits of the parameters' fingerprint: exact as a float64 record value.

    Parameters only: BatchNorm's running statistics are rank 0's own (DDP
    broadcasts them from rank 0), so they follow whichever shard rank 0
    trains and legitimately differ between placements; training never reads them.
    """
    from ddplab.probes import fingerprint

    joined = "".join(f"{name}:{p.sha256}" for name, p in fingerprint(model).items()
                     if p.kind == "parameter")
    return int(hashlib.sha256(joined.encode()).hexdigest()[:13], 16)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _register_hook(ddp, spec: RunSpec, params: dict, group) -> None:
    """Make ``spec.order`` the reduction of ``ddp``, wrapped in the audit hook.

    The audit hook returns its inner hook's result unchanged (for live runs,
    DDP's own reduction bit for bit), so auditing changes no run; the referee
    judges each result against the order that computed it. Not audited: a
    silent run (``emit=False``), and the exact reference, whose audit would
    measure the exact reduction against itself (an eighth of the audit's time).
    """
    from ddplab import comm_hooks as ch

    inner, state, bound = None, None, LIVE_BOUND_ORDER.get(spec.order)  # None: the backend's ring
    if spec.hook == "order":
        inner, state, bound = ch.order_hook, ch.OrderState(group, order=spec.order), spec.order
    elif spec.hook == "reproducible":
        # Judged by what it aims at, one correct rounding; in float64, int64 fixed
        # point keeps too few bits below an element's largest contribution for that.
        inner, state, bound = ch.reproducible_hook, ch.ReproducibleState(group), "exact"
    if not spec.emit or spec.order == REFERENCE:
        if inner is not None:
            ddp.register_comm_hook(state, inner)
        return
    audit = ch.AuditState(group, audit_every=params["audit_every"], names=ddp, inner=inner,
                          inner_state=state, order=bound,
                          labels=dict(run=spec.name, placement=spec.placement))
    ddp.register_comm_hook(audit, ch.audit_hook)


class _Trainer:
    """One run: a fresh model from the shared seed, wrapped in DDP with its hook."""

    def __init__(self, spec: RunSpec, params: dict, device, dataset, gloo_group=None):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from ddplab.models import build_model

        self.spec = spec
        model = build_model(params["model"], dataset.num_classes, dataset.in_channels,
                            DTYPES[params["dtype"]], norm=params["norm"], seed=params["seed"])
        kwargs = dict(bucket_cap_mb=params["bucket_cap_mb"])
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        if spec.order == "gloo" and gloo_group is not None:
            # On GPUs live gloo runs over a gloo group, as the report's --backend gloo did.
            kwargs["process_group"] = gloo_group
        self.ddp = DDP(model.to(device), **kwargs)
        _register_hook(self.ddp, spec, params, kwargs.get("process_group"))
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=params["lr"])
        self.params = list(self.ddp.parameters())
        self.labels = dict(run=spec.name, order=spec.order, hook=spec.hook, placement=spec.placement)

    def step(self, step: int, x, y, rank: int, world_size: int, shard: int) -> None:
        """Forward, backward (DDP reduces, the audit measures), update; emit losses and grad norm."""
        import torch.distributed as dist
        import torch.nn.functional as F

        with _records.labels(**self.labels):
            self.optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(self.ddp(x), y)
            loss.backward()
            grad_norm = torch.linalg.vector_norm(_flat(p.grad for p in self.params).double())
            self.optimizer.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged, op=dist.ReduceOp.SUM)
            if self.spec.emit:
                _records.emit("local_loss", loss.item(), step=step, shard=shard)
                if rank == 0:
                    _records.emit("loss", (logged / world_size).item(), step=step)
                    _records.emit("grad_norm", grad_norm.item(), step=step)


def _cycle(loader):
    """Batches forever: a new epoch (same order, shuffle=False) when one is used up."""
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise RuntimeError("the data loader yields no batch: batch_size exceeds a rank's shard")


def _emit_distances(trainers, step: int) -> None:
    """Rank 0, after the update: each run's parameters against the exact run's and live gloo's.

    ``param_distance`` / ``param_max_ulp``: 2-norm and largest ulp distance
    from the exact run; ``gloo_distance``: 2-norm from live gloo (the
    report's pair, measured, not inferred); ``param_digest``: equal digests
    mean bitwise equal parameters.
    """
    from ddplab.numerics.ulp import ulp_distance

    flat = {t.spec.name: _flat(t.params) for t in trainers}
    exact = flat[REFERENCE].double()
    gloo = flat["gloo"].double() if "gloo" in flat else None
    for trainer in trainers:
        if not trainer.spec.emit:
            continue
        theta = flat[trainer.spec.name]
        with _records.labels(**trainer.labels):
            _records.emit("param_distance", torch.linalg.vector_norm(theta.double() - exact).item(),
                          step=step)
            _records.emit("param_max_ulp", ulp_distance(theta, flat[REFERENCE]).abs().max().item(),
                          step=step)
            if gloo is not None and trainer.spec.name != "gloo":
                _records.emit("gloo_distance", torch.linalg.vector_norm(theta.double() - gloo).item(),
                              step=step)
            _records.emit("param_digest", _digest(trainer.ddp), step=step)


def worker(params: dict, runs: list[RunSpec] | None = None) -> dict:
    """Train every run of ``runs`` (default: :func:`plan_runs`) in lockstep on this rank.

    Runs under the notebook launcher or torchrun alike; live NCCL orders need
    a launch of their own, so under torchrun set ``NCCL_ALGO`` yourself.
    Returns this rank's seconds of setup and of training.
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from ddplab.datasets import load_dataset
    from ddplab.rank import current_context

    t0 = time.perf_counter()
    ctx = current_context()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = ctx.device if ctx is not None else torch.device("cpu")
    runs = plan_runs(params) if runs is None else runs
    if runs[0].order != REFERENCE:
        raise ValueError(f"the first run must be the {REFERENCE!r} reference, got {runs[0].name!r}")
    # = torch.use_deterministic_algorithms(True) for eager ops (torch's documented
    # alternative interface), without that call's import of torch._inductor:
    # seconds per rank, for a compiler this case never uses.
    torch.set_deterministic_debug_mode("error")
    _records.set_labels(world_size=world_size, dtype=params["dtype"])

    dataset = load_dataset(params["data"], params["data_root"], dtype=DTYPES[params["dtype"]])
    gloo_group = None
    if device.type == "cuda" and any(r.order == "gloo" for r in runs):
        gloo_group = dist.new_group(backend="gloo")
    trainers = [_Trainer(spec, params, device, dataset, gloo_group) for spec in runs]
    shards = {"identity": rank, "reversed": world_size - 1 - rank}
    batches = {}
    for placement in {r.placement for r in runs}:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=shards[placement],
                                     shuffle=False)
        batches[placement] = _cycle(DataLoader(dataset, batch_size=params["batch_size"],
                                               sampler=sampler, drop_last=True, num_workers=0))
    t_setup = time.perf_counter() - t0

    for step in range(params["steps"]):
        data = {p: tuple(t.to(device) for t in next(it)) for p, it in batches.items()}
        for trainer in trainers:
            placement = trainer.spec.placement
            trainer.step(step, *data[placement], rank, world_size, shards[placement])
        if rank == 0:
            _emit_distances(trainers, step)
    return {"setup_seconds": t_setup, "train_seconds": time.perf_counter() - t0 - t_setup}
