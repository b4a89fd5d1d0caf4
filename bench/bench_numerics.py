"""Benchmark the numerics against the memory-bound floor, side by side.

Part 1 (ResNet-50 size: W=8 ranks x N=25M float32): the emulated gloo ring,
the emulated NCCL ring and the exact reference, each timed right after the
floor ``stacked.sum(0)`` on the same data, interleaved over several rounds.
The machine is shared, so only ratios of neighbouring timings mean anything;
the medians are printed. Targets: <= 2x the floor for the emulated orders,
<= 4x for the exact reference.

Part 2 (W=1024 virtual ranks x 1M float32 through a row callable): time and
peak resident-memory growth of the emulated rings and the exact sum, each
timed right after generating every rank's row once (the floor for
generated data). Target: <= 60 s, memory O(N), i.e. a small multiple of the
4 MB one rank's row takes, never W*N.

    python bench/bench_numerics.py [--quick] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import psutil
import torch

from ddplab.numerics import as_contributions, exact_sum, reduce


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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


def bench_floor_ratios(world_size: int, numel: int, rounds: int) -> None:
    print(f"== W={world_size} x N={numel:,} float32 ({world_size * numel * 4 / 2**20:,.0f} MiB): "
          f"ratio to the floor stacked.sum(0), {rounds} interleaved rounds")
    gen = torch.Generator().manual_seed(0)
    stacked = torch.randn(world_size, numel, generator=gen)
    candidates = {
        "gloo_ring (emulated)": lambda: reduce(stacked, "gloo_ring"),
        "nccl_ring (emulated)": lambda: reduce(stacked, "nccl_ring"),
        "exact_sum": lambda: exact_sum(stacked),
    }
    small = stacked[:, :10_000].contiguous()   # compile/warm every path first
    reduce(small, "gloo_ring"), reduce(small, "nccl_ring"), exact_sum(small)
    floor = lambda: stacked.sum(0)   # noqa: E731
    floor()
    times = {name: [] for name in candidates}
    floors = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            floors[name].append(_timed(floor))
            times[name].append(_timed(fn))
    print(f"{'':24s}{'median s':>10s}{'floor s':>10s}{'ratio':>8s}{'target':>8s}")
    targets = {"exact_sum": 4.0}
    for name in candidates:
        ratios = [t / f for t, f in zip(times[name], floors[name])]
        target = targets.get(name, 2.0)
        print(f"{name:24s}{statistics.median(times[name]):10.3f}{statistics.median(floors[name]):10.3f}"
              f"{statistics.median(ratios):8.2f}{target:7.0f}x")


def bench_virtual_ranks(world_size: int, numel: int) -> None:
    print(f"\n== W={world_size} virtual ranks x N={numel:,} float32 through a row callable "
          f"(W*N would be {world_size * numel * 4 / 2**30:.1f} GiB)")

    def rank_row(rank: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    contributions = as_contributions(rank_row, world_size=world_size, numel=numel, dtype=torch.float32)
    row_bytes = numel * 4
    small = as_contributions(rank_row, world_size=4, numel=numel, dtype=torch.float32)
    reduce(small, "gloo_ring"), reduce(small, "nccl_ring"), exact_sum(small)   # compile/warm first
    generate = lambda: [rank_row(r) for r in range(world_size)]   # noqa: E731
    print(f"{'':24s}{'seconds':>10s}{'generate s':>12s}{'ratio':>8s}{'peak RSS growth':>18s}{'x N*4 bytes':>13s}")
    for name, fn in (("gloo_ring (emulated)", lambda: reduce(contributions, "gloo_ring")),
                     ("nccl_ring (emulated)", lambda: reduce(contributions, "nccl_ring")),
                     ("exact_sum", lambda: exact_sum(contributions))):
        floor = _timed(generate)   # generating every row once, timed next to each candidate
        with PeakRSS() as mem:
            seconds = _timed(fn)
        print(f"{name:24s}{seconds:10.2f}{floor:12.2f}{seconds / floor:8.2f}{mem.growth / 2**20:15.1f} MiB"
              f"{mem.growth / row_bytes:13.1f}")
    print("targets: <= 60 s each; memory O(N): a few times N*4 bytes, never W*N*4. The ring needs two")
    print("passes over the ranks (chunk c starts at rank c-1), so about twice the generation time.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (N=2.5M; W=128 virtual ranks)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 3)")
    args = parser.parse_args()
    rounds = max(3, args.rounds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {psutil.cpu_count()} CPUs")
    # The callable part runs first, while the process is small, so RSS growth is its own.
    bench_virtual_ranks(128 if args.quick else 1024, 1_000_000)
    print()
    bench_floor_ratios(8, 2_500_000 if args.quick else 25_000_000, rounds)


if __name__ == "__main__":
    main()
