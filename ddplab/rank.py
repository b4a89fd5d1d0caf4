"""Setting up one rank, independent of how its process was created.

The notebook launcher (:mod:`ddplab.launcher`) and torchrun (:mod:`ddplab.torchrun`)
both end in :func:`setup_rank`: initialize the default process group, pick the
rank's device, and publish a :class:`RankContext` that worker functions,
hooks and :func:`ddplab.records.emit` read. Keeping this apart from process
creation is what lets the same worker function run from a notebook cell and
across machines.
"""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

__all__ = [
    "BACKENDS",
    "RankContext",
    "check_backend",
    "current_context",
    "setup_rank",
    "teardown_rank",
    "context_from_env",
]

BACKENDS = ("gloo", "nccl")

_context: "RankContext | None" = None


@dataclasses.dataclass(frozen=True)
class RankContext:
    """Where this process stands in the job: rank, sizes, backend and device."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    launcher: str = "ddplab"


def check_backend(backend: str, local_world_size: int) -> None:
    """Raise ValueError unless ``backend`` can run ``local_world_size`` ranks here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError("backend 'nccl' needs CUDA GPUs and this machine has none; use backend='gloo'")
        if gpus < local_world_size:
            raise ValueError(
                f"backend 'nccl' runs one rank per GPU: {local_world_size} ranks on this "
                f"machine but only {gpus} GPU(s)"
            )


def current_context() -> RankContext | None:
    """The running rank's context, or None outside a rank."""
    return _context


def setup_rank(rank: int, world_size: int, backend: str = "gloo", *,
               store: dist.Store | None = None, init_method: str | None = None,
               local_rank: int | None = None, local_world_size: int | None = None,
               timeout: float = 300.0, launcher: str = "ddplab") -> RankContext:
    """Initialize the default process group for this rank and return its context.

    Give either a ``store`` (the launcher's per-launch TCPStore) or an
    ``init_method`` (``"env://"`` under torchrun). ``timeout`` (seconds) bounds
    every collective, so a peer that vanished surfaces as an error, not a hang.
    """
    global _context
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=timeout))
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method or "env://"
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    _context = RankContext(rank=rank, world_size=world_size, local_rank=local_rank,
                           local_world_size=local_world_size, backend=backend,
                           device=device, launcher=launcher)
    return _context


def teardown_rank() -> None:
    """Destroy the process group (if any) and forget the context."""
    global _context
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _context = None


def context_from_env(backend: str = "gloo", timeout: float = 300.0) -> RankContext:
    """Set up a rank from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"not started by torchrun: {', '.join(missing)} not set")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    check_backend(backend, local_world_size)
    return setup_rank(rank, world_size, backend, init_method="env://", local_rank=local_rank,
                      local_world_size=local_world_size, timeout=timeout, launcher="torchrun")
