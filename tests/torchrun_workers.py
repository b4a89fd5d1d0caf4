"""Worker functions that tests start through ``python -m ddplab run MODULE:FUNC``."""
import torch
import torch.distributed as dist

import ddplab


def allreduce_steps(params):
    """Emit a few all-reduced values per step; the same function runs under ddplab.launch."""
    steps = int(params.get("steps", 3))
    rank = dist.get_rank()
    x = torch.arange(5, dtype=torch.float64) * (rank + 1) / 3
    for step in range(steps):
        dist.all_reduce(x)
        x = x / dist.get_world_size() + 0.1
        ddplab.emit("sum", x.sum().item(), step=step, world_size=dist.get_world_size())
    return None


def fail_on_rank_one(params):
    ddplab.emit("started", 1.0, step=0)
    dist.barrier()
    if dist.get_rank() == 1:
        raise RuntimeError("planted failure under torchrun")
    dist.barrier()
