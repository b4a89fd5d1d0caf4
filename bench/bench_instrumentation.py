"""Steps per second of a small CNN under ddplab's comm hooks, against plain DDP.

W ranks (gloo) train the same small CNN with one DDP model per configuration:

* ``plain``       no hook (DDP's C++ reducer)
* ``default``     :func:`ddplab.comm_hooks.ddp_default_hook` (the same math, in Python)
* ``audit_1``     :func:`ddplab.comm_hooks.audit_hook`, every step audited
* ``audit_10``    the audit hook, every 10th step audited
* ``reproducible`` :func:`ddplab.comm_hooks.reproducible_hook` (int64 fixed point)

Configurations are interleaved: each round runs a block of ``--steps``
optimizer steps of every configuration in turn (a barrier before and after
each block), so machine noise hits all of them alike. Each block of
``audit_10`` holds exactly one audited step when ``--steps`` is a multiple of
10. Rank 0 prints the median time per step and, through ``_common``'s table,
the median over rounds of the per-round ratio against ``plain`` (and
``reproducible`` against ``default``), the ratio of best blocks and the load
average while it ran. Asserts nothing: colleagues share the machine and
timings are noisy.

Targets (issue "Instrumentation"): audit every step <= 1.5x plain, every 10th
step <= 1.05x, reproducible <= 3x the default hook.

    python bench/bench_instrumentation.py [--rounds 7] [--steps 10] [--world-size 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from _common import Ratio, machine_line, ratio_table
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import comm_hooks as ch
from ddplab import launch

CONFIGS = ("plain", "default", "audit_1", "audit_10", "reproducible")
TARGETS = {("audit_1", "plain"): 1.5, ("audit_10", "plain"): 1.05, ("reproducible", "default"): 3.0}


def small_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 12 * 12, 10))


def _model(config: str) -> DDP:
    ddp = DDP(small_cnn())
    if config == "default":
        ddp.register_comm_hook(None, ch.ddp_default_hook)
    elif config == "audit_1":
        ddp.register_comm_hook(ch.AuditState(audit_every=1, names=ddp), ch.audit_hook)
    elif config == "audit_10":
        ddp.register_comm_hook(ch.AuditState(audit_every=10, names=ddp), ch.audit_hook)
    elif config == "reproducible":
        ddp.register_comm_hook(ch.ReproducibleState(), ch.reproducible_hook)
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

    for config in CONFIGS:  # warm-up: imports, numba's cache, DDP's bucket rebuild
        block(config, steps)
    times = {c: [] for c in CONFIGS}
    loads = []
    for r in range(rounds):
        # Rotate the starting configuration so none is always first after a barrier.
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for config in order:
            times[config].append(block(config, steps))
        loads.append(os.getloadavg()[0])
    return {"times": times, "loads": loads, "params": sum(p.numel() for p in models["plain"].parameters()),
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps per block (a multiple of 10)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    args = parser.parse_args()
    if args.steps % 10:
        parser.error("--steps must be a multiple of 10 (one audited step per audit_10 block)")

    print(machine_line())
    res = launch(bench_worker, world_size=args.world_size, args=(args.rounds, args.steps, args.batch),
                 timeout=1800)
    out = res.returns[0]
    times = out["times"]
    print(f"small CNN ({out['params']} parameters), W={args.world_size} gloo, batch {args.batch}/rank, "
          f"{args.rounds} interleaved rounds of {args.steps} steps, {out['threads']} thread(s)/rank")
    print(f"{'config':<14}{'ms/step median':>16}{'best':>8}{'steps/s':>10}")
    for config in CONFIGS:
        med = statistics.median(times[config])
        print(f"{config:<14}{med * 1e3:>16.2f}{min(times[config]) * 1e3:>8.2f}{1 / med:>10.1f}")
    print()
    pairs = list(TARGETS) + [("default", "plain")]
    ratios = {f"{a} / {b}": Ratio(times[a], times[b], out["loads"]) for a, b in pairs}
    targets = {f"{a} / {b}": t for (a, b), t in TARGETS.items()}
    print(ratio_table(ratios, targets, baseline_name="base", unit=1e-3, unit_name="ms"))
    print("ratio: median over rounds of the two configurations' blocks in that round; best/best: fastest")
    print("blocks; load: median 1-minute load average per round. default / plain: the cost of a Python hook.")


if __name__ == "__main__":
    main()
