"""Benchmark the numerics against the memory-bound floor, side by side, on a shared machine.

Part 1 (W=1024 virtual ranks x N=1M float32 through a row callable,
:mod:`ddplab.numerics.contributions`): seconds, rows generated and peak
resident-memory growth of the emulated rings and the exact sum, each next to
generating every rank's row once (the floor for generated data; the rings
need two passes over the ranks, chunk c starting at rank c-1). Targets: the
rings <= 30 s; memory O(N), a small multiple of one row's N*4 bytes, never W*N.

Part 2 (ResNet-50 size: W=8 ranks x N=25M float32): the emulated gloo ring,
the emulated NCCL ring and the exact sum, each timed next to the floor
``stacked.sum(0)`` on the same data over many interleaved rounds (see
``_common``: median of adjacent-pair ratios, best/best, load average).
Targets: <= 2x the floor for the emulated orders, <= 4x for the exact sum.
The previous engine (one in-place torch op per program step and 1 MiB
column block, ``run_torch``) is timed alongside for comparison.

Part 3 (numba's on-disk cache): the first calls in a fresh process, with an
empty cache directory (everything compiles) and again with the filled one.

    python bench/bench_numerics.py [--quick] [--rounds 11] [--skip-cache]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import textwrap

import torch
from _common import interleaved, load_average, machine_line, ratio_table, run_python

from ddplab.numerics import as_contributions, exact_sum, reduce, reduction_pieces
from ddplab.numerics._programs import Arithmetic, run_torch


_VIRTUAL_RANKS = textwrap.dedent("""
    import json, sys, time
    import torch
    sys.path.insert(0, {bench_dir!r})
    from _common import PeakRSS, load_average, timed
    from ddplab.numerics import as_contributions, exact_sum, reduce

    W, N, which, floor_first = {world_size}, {numel}, {which!r}, {floor_first}
    calls = [0]

    def rank_row(rank):
        calls[0] += 1
        return torch.randn(N, generator=torch.Generator().manual_seed(rank))

    def generate_all():   # every row once, each dropped at once: the floor for generated data
        for r in range(W):
            rank_row(r)

    def candidate(c):
        return exact_sum(c) if which == "exact_sum" else reduce(c, which)

    candidate(as_contributions(rank_row, world_size=4, numel=N, dtype=torch.float32))   # compile/warm
    contributions = as_contributions(rank_row, world_size=W, numel=N, dtype=torch.float32)
    def wall_and_cpu(fn):
        cpu = time.process_time()
        return timed(fn), time.process_time() - cpu

    floor = wall_and_cpu(generate_all) if floor_first else None
    calls[0] = 0
    with PeakRSS() as mem:
        seconds = wall_and_cpu(lambda: candidate(contributions))
    rows = calls[0]
    floor = wall_and_cpu(generate_all) if floor is None else floor
    print(json.dumps({{"seconds": seconds, "rows": rows, "floor": floor, "growth": mem.growth,
                      "load": load_average()[0]}}))
""")


def bench_virtual_ranks(world_size: int, numel: int) -> None:
    """Each candidate in a fresh process, so that its peak memory growth is its own."""
    print(f"== W={world_size} virtual ranks x N={numel:,} float32 through a row callable "
          f"(W*N would be {world_size * numel * 4 / 2**30:.1f} GiB), each in a fresh process")
    print(f"{'':24s}{'seconds':>9s}{'cpu s':>7s}{'rows':>6s}{'generate s':>12s}{'cpu s':>7s}{'ratio':>7s}"
          f"{'load':>6s}{'peak RSS growth':>17s}{'x N*4':>7s}{'target':>8s}  verdict")
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    for i, (name, which, target) in enumerate((("gloo_ring (emulated)", "gloo_ring", 30.0),
                                               ("nccl_ring (emulated)", "nccl_ring", 30.0),
                                               ("exact_sum", "exact_sum", None))):
        r = run_python(_VIRTUAL_RANKS.format(bench_dir=bench_dir, world_size=world_size, numel=numel,
                                             which=which, floor_first=i % 2 == 0))
        (wall, cpu), (floor_wall, floor_cpu) = r["seconds"], r["floor"]
        verdict = "" if target is None else ("meets target" if wall <= target else "MISSES target")
        print(f"{name:24s}{wall:9.2f}{cpu:7.2f}{r['rows']:6d}{floor_wall:12.2f}{floor_cpu:7.2f}{wall / floor_wall:7.2f}"
              f"{r['load']:6.1f}{r['growth'] / 2**20:13.1f} MiB{r['growth'] / (numel * 4):7.1f}"
              f"{'' if target is None else f'{target:g} s':>8s}  {verdict}")
    print(f"rows: calls of the row callable; generate s: making all {world_size} rows once, timed next to it;")
    print("cpu s: this process's CPU time, which other processes' load stretches far less than wall time;")
    print("peak RSS growth: the process's high-water mark during the call, above its size before it (it")
    print("includes the O(W^2) programs: W ring programs of W ranks each).")


def bench_floor_ratios(world_size: int, numel: int, rounds: int) -> None:
    print(f"== W={world_size} x N={numel:,} float32 ({world_size * numel * 4 / 2**20:,.0f} MiB): "
          f"ratio to the floor stacked.sum(0), {rounds} interleaved rounds")
    stacked = torch.randn(world_size, numel, generator=torch.Generator().manual_seed(0))
    c = as_contributions(stacked)
    gloo_pieces = reduction_pieces("gloo_ring", numel, world_size, 4)
    candidates = {
        "gloo_ring (emulated)": lambda: reduce(stacked, "gloo_ring"),
        "nccl_ring (emulated)": lambda: reduce(stacked, "nccl_ring"),
        "exact_sum": lambda: exact_sum(stacked),
        "gloo_ring, torch ops": lambda: run_torch(c, gloo_pieces, Arithmetic(torch.float32, torch.float32)),
    }
    small = stacked[:, :10_000].contiguous()   # compile/warm every path first
    reduce(small, "gloo_ring"), reduce(small, "nccl_ring"), exact_sum(small)
    floor = lambda: stacked.sum(0)   # noqa: E731
    floor()
    ratios = interleaved(candidates, floor, rounds)
    targets = {"gloo_ring (emulated)": 2.0, "nccl_ring (emulated)": 2.0, "exact_sum": 4.0}
    print(ratio_table(ratios, targets, baseline_name="floor"))
    print("ratio: median over rounds of candidate / floor timed back to back; best/best: fastest over fastest;")
    print("load: median 1-minute load average meanwhile. 'gloo_ring, torch ops' is the previous engine.")


_FIRST_CALLS = textwrap.dedent("""
    import json, time
    t0 = time.perf_counter()
    import torch
    from ddplab.numerics import exact_parts, exact_sum, reduce
    t1 = time.perf_counter()
    x = torch.randn(4, 1000)
    reduce(x, "gloo_ring"); reduce(x, "nccl_ring", op="avg")
    t2 = time.perf_counter()
    exact_sum(x); exact_parts(x)
    t3 = time.perf_counter()
    reduce(x.half(), "gloo_ring"); exact_sum(x.half())
    t4 = time.perf_counter()
    print(json.dumps({"import": t1 - t0, "reduce": t2 - t1, "exact": t3 - t2, "float16": t4 - t3}))
""")


def bench_numba_cache() -> None:
    print("== numba's on-disk cache: first calls in a fresh process (float32 reduce and exact sum, then float16)")
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {"NUMBA_CACHE_DIR": cache_dir}
        cold = run_python(_FIRST_CALLS, env)
        warm = run_python(_FIRST_CALLS, env)
    keys = ("import", "reduce", "exact", "float16")
    print(f"{'':30s}" + "".join(f"{k + ' s':>11s}" for k in keys) + f"{'total s':>10s}")
    for label, r in (("empty cache (compiles)", cold), ("filled cache (loads)", warm)):
        print(f"{label:30s}" + "".join(f"{r[k]:11.2f}" for k in keys) + f"{sum(r.values()):10.2f}")
    saved = sum(cold.values()) - sum(warm.values())
    print(f"saving per fresh process (each rank, each notebook kernel): {saved:.1f} s "
          f"({sum(cold.values()) / sum(warm.values()):.0f}x faster), load average {load_average()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (N=2.5M; W=128 virtual ranks)")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (>= 3)")
    parser.add_argument("--skip-cache", action="store_true", help="skip the fresh-process numba cache check")
    args = parser.parse_args()
    print(machine_line())
    bench_virtual_ranks(128 if args.quick else 1024, 1_000_000)
    print()
    bench_floor_ratios(8, 2_500_000 if args.quick else 25_000_000, max(3, args.rounds))
    if not args.skip_cache:
        print()
        bench_numba_cache()
    print()
    print(machine_line())


if __name__ == "__main__":
    main()
