"""FSDP2 reduce-scatter: the audit's cost in a real step, and the emulation against its floors.

Part 1 (W ranks, gloo, a small model under ``fully_shard``): steps with the
audit attached to every parameter group (:func:`ddplab.fsdp.attach_audit`)
against plain FSDP2 steps. The two models alternate step by step inside one
launch (a barrier between steps), so interference from other processes hits
both alike; the median over adjacent (plain, audited) pairs of the time
ratio is printed. Target: <= 1.5x.

Part 2 (W=8 x N=25M float32): :func:`ddplab.numerics.reduce_scatter` in
gloo's and NCCL's order against the memory floor ``stacked.sum(0)``, each
timed right after the floor on the same data, interleaved; median ratio of
adjacent pairs. Target: <= 2x.

Part 3 (W=1024 virtual ranks x 1M float32 through a row callable): seconds
and peak resident-memory growth of the emulated reduce-scatters. Target:
<= 60 s each and O(N) memory (a few times the 4 MB of one row, never W*N).

The load average is printed before and after each part: the machine is shared.

    python bench/bench_fsdp.py [--quick] [--rounds 7] [--world-size 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import psutil
import torch

from ddplab.numerics import as_contributions, reduce_scatter


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {psutil.cpu_count()} CPUs"


class PeakRSS:
    """Sample this process's resident set size in a thread; report the peak above the start."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.proc = psutil.Process()

    def __enter__(self):
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


# --------------------------------------------------------------------------- part 1: audit in FSDP2


def _fsdp_model(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _audit_steps(rounds: int) -> list[tuple[float, float]]:
    """On every rank: (plain, audited) seconds per adjacent pair of steps; rank 0's are printed."""
    import torch.distributed as dist

    from ddplab.fsdp import attach_audit

    plain, audited = _fsdp_model(), _fsdp_model()
    attach_audit(audited)
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, audited)}
    g = torch.Generator().manual_seed(dist.get_rank())

    def step(model):
        x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        opts[model].zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opts[model].step()
        dist.barrier()
        return time.perf_counter() - t0

    pairs = []
    for _ in range(2):
        step(plain), step(audited)         # warm up both (the audit's first call loads its numba kernels)
    for k in range(rounds):
        # Alternate which goes first, so drift favours neither.
        if k % 2:
            a = step(audited)
            p = step(plain)
        else:
            p = step(plain)
            a = step(audited)
        pairs.append((p, a))
    return pairs


def bench_audit(world_size: int, rounds: int) -> None:
    from ddplab import launch

    print(f"== FSDP2 step, W={world_size} gloo ranks, 3 Linear layers each fully_shard-ed + root: "
          f"audit of every reduce-scatter vs plain, {rounds} adjacent pairs")
    print("  " + _load())
    pairs = launch(_audit_steps, world_size=world_size, args=(rounds,), timeout=600).returns[0]
    ratios = [a / p for p, a in pairs]
    print(f"  plain median {statistics.median(p for p, _ in pairs) * 1e3:8.1f} ms/step, "
          f"audited median {statistics.median(a for _, a in pairs) * 1e3:8.1f} ms/step")
    print(f"  audit / plain: median of adjacent pairs {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}); target <= 1.5x")
    print("  " + _load())


# --------------------------------------------------------------------------- part 2: memory floor


def bench_floor(world_size: int, numel: int, rounds: int) -> None:
    print(f"\n== emulated reduce-scatter, W={world_size} x N={numel:,} float32 "
          f"({world_size * numel * 4 / 2**20:,.0f} MiB): ratio to the floor stacked.sum(0), {rounds} adjacent pairs")
    print("  " + _load())
    stacked = torch.randn(world_size, numel, generator=torch.Generator().manual_seed(0))
    candidates = {"gloo_ring": lambda: reduce_scatter(stacked, "gloo_ring"),
                  "nccl_ring": lambda: reduce_scatter(stacked, "nccl_ring")}
    small = stacked[:, :world_size * 1000].contiguous()
    for order in candidates:
        reduce_scatter(small, order)
    floor = lambda: stacked.sum(0)   # noqa: E731
    floor()
    ratios = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            f = _timed(floor)
            ratios[name].append(_timed(fn) / f)
    for name, r in ratios.items():
        print(f"  {name:12s} median ratio {statistics.median(r):5.2f}x (min {min(r):.2f}, max {max(r):.2f}); "
              "target <= 2x")
    print("  " + _load())


# --------------------------------------------------------------------------- part 3: 1024 virtual ranks


def bench_virtual_ranks(world_size: int, numel: int) -> None:
    numel = -(-numel // world_size) * world_size     # a reduce-scatter needs N a multiple of W
    print(f"\n== W={world_size} virtual ranks x N={numel:,} float32 through a row callable "
          f"(W*N would be {world_size * numel * 4 / 2**30:.1f} GiB)")
    print("  " + _load())

    def rank_row(rank: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    c = as_contributions(rank_row, world_size=world_size, numel=numel, dtype=torch.float32)
    warm = as_contributions(lambda r: rank_row(r)[:4000], world_size=4, numel=4000, dtype=torch.float32)
    for order in ("gloo_ring", "nccl_ring"):
        reduce_scatter(warm, order)
    for order in ("gloo_ring", "nccl_ring"):
        with PeakRSS() as mem:
            seconds = _timed(lambda: reduce_scatter(c, order))
        print(f"  {order:12s} {seconds:7.2f} s (target <= 60 s), peak RSS growth {mem.growth / 2**20:7.1f} MiB "
              f"= {mem.growth / (numel * 4):.1f} x one row (never W x)")
    print("  " + _load())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (N=2.5M; W=128 virtual ranks)")
    parser.add_argument("--rounds", type=int, default=7, help="adjacent pairs per comparison (>= 3)")
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks for the FSDP2 step")
    parser.add_argument("--parts", default="123", help="which parts to run, e.g. 13")
    args = parser.parse_args()
    rounds = max(3, args.rounds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    # The callable part runs first, while the process is small, so RSS growth is its own.
    if "3" in args.parts:
        bench_virtual_ranks(128 if args.quick else 1024, 1_000_000)
    if "2" in args.parts:
        bench_floor(8, 2_500_000 if args.quick else 25_000_000, rounds)
    if "1" in args.parts:
        print()
        bench_audit(args.world_size, 3 * rounds)


if __name__ == "__main__":
    main()
