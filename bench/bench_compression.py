"""What ddplab's CPU stand-ins cost next to torch's own: compression hooks and SyncBatchNorm on gloo.

W ranks (gloo) train a small CNN under DDP in five configurations:

* ``torch_fp16``   torch's ``fp16_compress_hook`` (the baseline: it runs on gloo)
* ``ddplab_fp16``  :func:`ddplab.comm_hooks.fp16_compress_hook` (the same math)
* ``ddplab_bf16``  :func:`ddplab.comm_hooks.bf16_compress_hook` (torch's refuses gloo, so
  torch's fp16 hook is its baseline)
* ``batchnorm``    the CNN with BatchNorm2d, per rank (no hook)
* ``syncbn``       the same CNN with :class:`ddplab.sync_batchnorm.SyncBatchNorm` (an all_gather
  per layer in forward, an all_reduce in backward)

As ``bench_instrumentation.py``: interleaved blocks of ``--steps`` steps (a barrier around
each), the starting configuration rotated per round; rank 0 prints the median over rounds
of each round's ratio, the range, best/best and the load average. Asserts nothing.

Target: ddplab's fp16 hook <= 1.1x torch's.

    python bench/bench_compression.py [--rounds 9] [--steps 10] [--world-size 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from _common import Ratio, machine_line, ratio_table
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import comm_hooks as ch
from ddplab import launch
from ddplab.sync_batchnorm import convert_sync_batchnorm

CONFIGS = ("torch_fp16", "ddplab_fp16", "ddplab_bf16", "batchnorm", "syncbn")
PAIRS = {("ddplab_fp16", "torch_fp16"): 1.1, ("ddplab_bf16", "torch_fp16"): None, ("syncbn", "batchnorm"): None}


def small_cnn(batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = (lambda c: torch.nn.BatchNorm2d(c)) if batchnorm else (lambda c: torch.nn.Identity())
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3), norm(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3), norm(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 12 * 12, 10))


def _model(config: str) -> DDP:
    if config == "batchnorm":
        return DDP(small_cnn(batchnorm=True))
    if config == "syncbn":
        return DDP(convert_sync_batchnorm(small_cnn(batchnorm=True)))
    ddp = DDP(small_cnn())
    hook = {"torch_fp16": default_hooks.fp16_compress_hook, "ddplab_fp16": ch.fp16_compress_hook,
            "ddplab_bf16": ch.bf16_compress_hook}[config]
    ddp.register_comm_hook(None, hook)
    return ddp


def bench_worker(rounds: int, steps: int, batch: int) -> dict:
    models = {c: _model(c) for c in CONFIGS}
    opts = {c: torch.optim.SGD(m.parameters(), lr=0.01) for c, m in models.items()}
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def block(config: str, n: int) -> float:
        model, opt = models[config], opts[config]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        dist.barrier()
        return (time.perf_counter() - t0) / n

    for config in CONFIGS:  # warm-up: DDP's bucket rebuild, first-call allocations
        block(config, steps)
    times = {c: [] for c in CONFIGS}
    loads = []
    for r in range(rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for config in order:
            times[config].append(block(config, steps))
        loads.append(os.getloadavg()[0])
    return {"times": times, "loads": loads, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    args = parser.parse_args()

    print(machine_line())
    res = launch(bench_worker, world_size=args.world_size, args=(args.rounds, args.steps, args.batch),
                 timeout=1800)
    out = res.returns[0]
    times = out["times"]
    print(f"small CNN, W={args.world_size} gloo, batch {args.batch}/rank, {args.rounds} interleaved rounds "
          f"of {args.steps} steps, {out['threads']} thread(s)/rank")
    print(f"{'config':<14}{'ms/step median':>16}{'best':>8}")
    for config in CONFIGS:
        print(f"{config:<14}{statistics.median(times[config]) * 1e3:>16.2f}{min(times[config]) * 1e3:>8.2f}")
    print()
    ratios = {f"{a} / {b}": Ratio(times[a], times[b], out["loads"]) for a, b in PAIRS}
    targets = {f"{a} / {b}": t for (a, b), t in PAIRS.items()}
    print(ratio_table(ratios, targets, baseline_name="base", unit=1e-3, unit_name="ms"))
    print("ratio: median over rounds of the two configurations' blocks in that round; best/best: fastest")
    print("blocks; load: median 1-minute load average per round.")


if __name__ == "__main__":
    main()
