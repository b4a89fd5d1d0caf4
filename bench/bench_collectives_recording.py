"""Recording every collective: its cost in a small DDP run on gloo, and the verification's.

W gloo ranks train a small MLP under DDP. Blocks of ``--steps`` training
steps alternate, inside one launch, between plain DDP and DDP inside
``ddplab.collectives.recording()`` (one ``set_step`` per step, the records
taken at the end of the block), in memory and spilling to files; a barrier
precedes every block, and which of a pair goes first alternates. Printed: the
median over adjacent (plain, recorded) pairs of the time ratio, with its
range and the load average (the machine is shared), and the time
``verify`` takes in the parent for one recorded block of every rank.

    python bench/bench_collectives_recording.py [--rounds 9] [--steps 5] [--world-size 2]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from ddplab import collectives, launch


def _model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                              torch.nn.ReLU(), torch.nn.Linear(512, 10))
    return torch.nn.parallel.DistributedDataParallel(net)


def _blocks(rounds: int, steps: int, spill_root: str) -> dict:
    """On every rank: seconds of each block, per kind, in adjacent pairs; the last records of each kind."""
    import torch.distributed as dist

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())

    def train(rec=None):
        for s in range(steps):
            if rec is not None:
                rec.set_step(s)
            x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    def block(kind: str, k: int):
        dist.barrier()
        t0 = time.perf_counter()
        records = None
        if kind == "plain":
            train()
        else:
            spill = f"{spill_root}/{k}" if kind == "spill" else None
            with collectives.recording(spill_dir=spill) as rec:
                train(rec)
            records = rec.records()
        dist.barrier()
        return time.perf_counter() - t0, records

    for kind in ("plain", "memory", "spill"):
        block(kind, -1)                       # warm up every path
    out = {"memory": [], "spill": []}
    last = {}
    for k in range(rounds):
        for kind in ("memory", "spill"):
            if k % 2:
                t, last[kind] = block(kind, k)
                p, _ = block("plain", k)
            else:
                p, _ = block("plain", k)
                t, last[kind] = block(kind, k)
            out[kind].append((p, t))
    return {"pairs": out, "records": last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    import os

    print(f"== DDP, W={args.world_size} gloo ranks, MLP 256-512-512-10, batch 64: blocks of {args.steps} steps, "
          f"recorded vs plain, {args.rounds} adjacent pairs; load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as spill_root:
        returns = launch(_blocks, world_size=args.world_size, args=(args.rounds, args.steps, spill_root),
                         timeout=1800).returns
        for kind, pairs in returns[0]["pairs"].items():
            ratios = [t / p for p, t in pairs]
            print(f"  {kind:7s} plain {statistics.median(p for p, _ in pairs) * 1e3 / args.steps:7.1f} ms/step, "
                  f"recorded {statistics.median(t for _, t in pairs) * 1e3 / args.steps:7.1f} ms/step; "
                  f"ratio median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})")
            t0 = time.perf_counter()
            result = collectives.verify([r["records"][kind] for r in returns])
            print(f"          verify of one block ({result.checked} outputs compared, exact={result.exact}): "
                  f"{time.perf_counter() - t0:.2f} s")
    print(f"  load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
