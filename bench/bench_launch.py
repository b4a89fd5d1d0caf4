"""Launch-to-return latency: ddplab.launch vs torch.multiprocessing.spawn.

W ranks each do one all_reduce, after the parent already ran a large matmul
(the situation in a notebook). Repeat launches are timed in one process,
first launches in fresh interpreters; each ddplab launch next to a spawn,
in alternating order (``_common.interleaved``). Prints the median ratio of
the adjacent pairs with its range and the load average; asserts nothing
(machines are noisy).

Targets: the first launch in a process no slower than spawn (ratio <= 1);
repeat launches >= 40x faster than spawn (ratio <= 0.025).

``--setup-launches N`` also measures the distribution of process-group setup
times over N launches of each kind, interleaved, with the load average, and
counts the launches whose setup failed. For ddplab the setup time is from
the rank's process creation to ``fn`` starting (store connection and
``init_process_group``); for spawn, ``init_process_group`` alone. Spawn's
rendezvous port is picked free and released first (the usual idiom), which
races with any other launch on the machine: run nothing else meanwhile.

    python bench/bench_launch.py [--rounds 9] [--world-size 4] [--setup-launches 0]
"""
from __future__ import annotations

import argparse
import os
import socket
import tempfile
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from ddplab import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import interleaved, machine_line, ratio_table  # noqa: E402


def one_allreduce():
    t = torch.ones(1024)
    dist.all_reduce(t)
    return t[0].item()


def _spawn_rank(rank, world_size, port, times_dir=None):
    t0 = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            init_method=f"tcp://127.0.0.1:{port}")
    if times_dir is not None:
        with open(os.path.join(times_dir, f"rank{rank}"), "w") as fh:
            fh.write(repr(time.perf_counter() - t0))
    one_allreduce()
    dist.destroy_process_group()


def setup_seconds():
    """Seconds from this rank's process creation to here (fn starts right after setup)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def ddplab_setup(world_size: int) -> float:
    """The slowest rank's setup time in one ddplab launch."""
    return max(launch(setup_seconds, world_size=world_size).returns)


def spawn_setup(world_size: int) -> float:
    """The slowest rank's init_process_group time in one torch.multiprocessing.spawn."""
    with tempfile.TemporaryDirectory() as times_dir:
        tmp.spawn(_spawn_rank, args=(world_size, _free_port(), times_dir), nprocs=world_size, join=True)
        return max(float(open(os.path.join(times_dir, f"rank{r}")).read()) for r in range(world_size))


def setup_distribution(world_size: int, launches: int) -> None:
    """Print percentiles, stalls (>= 2 s) and failures of setup times, with the load average."""
    load_before = os.getloadavg()
    times = {"ddplab": [], "spawn": []}
    failures = {"ddplab": [], "spawn": []}
    for _ in range(launches):
        for name, measure in (("ddplab", ddplab_setup), ("spawn", spawn_setup)):
            try:
                times[name].append(measure(world_size))
            except Exception as exc:  # noqa: BLE001 - a failed setup is a data point too
                failures[name].append(str(exc).splitlines()[0][:160])
    load_after = os.getloadavg()
    print(f"process-group setup, W={world_size}, {launches} launches each, interleaved; "
          f"load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} "
          f"{load_before[2]:.1f}, after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}")
    for name, values in times.items():
        values = sorted(values)
        if len(values) < 2:
            print(f"  {name:<7} {len(values)} setup(s) measured, failed: {len(failures[name])}/{launches}")
            continue
        q = statistics.quantiles(values, n=20)
        stalls = [v for v in values if v >= 2.0]
        print(f"  {name:<7} median {statistics.median(values) * 1e3:7.1f} ms   p95 {q[-1] * 1e3:7.1f} ms   "
              f"max {values[-1]:6.2f} s   stalls >= 2 s: {len(stalls)}/{len(values)}"
              + (f" ({', '.join(f'{v:.1f}' for v in stalls)} s)" if stalls else "")
              + f"   failed: {len(failures[name])}/{launches}")
        for text in sorted(set(failures[name])):
            print(f"    {failures[name].count(text)} x {text}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_ddplab(world_size: int) -> float:
    t0 = time.perf_counter()
    launch(one_allreduce, world_size=world_size)
    return time.perf_counter() - t0


def time_spawn(world_size: int) -> float:
    t0 = time.perf_counter()
    tmp.spawn(_spawn_rank, args=(world_size, _free_port()), nprocs=world_size, join=True)
    return time.perf_counter() - t0


FIRST_LAUNCH = """
import sys, time, torch
sys.path.insert(0, {bench_dir!r})
import bench_launch as b
if __name__ == "__main__":
    a = torch.randn(2000, 2000); a @ a
    fn = b.time_ddplab if sys.argv[1] == "ddplab" else b.time_spawn
    print(fn(int(sys.argv[2])))
"""


def first_launch(kind: str, world_size: int, script: str) -> float:
    out = subprocess.run([sys.executable, script, kind, str(world_size)], check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9,
                        help="first and repeat launches of each kind (0: skip that part)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--setup-launches", type=int, default=0,
                        help="also measure the setup-time distribution over this many launches of each kind")
    opts = parser.parse_args()
    w = opts.world_size
    if opts.rounds > 0:
        latency(w, opts.rounds)
    if opts.setup_launches > 0:
        a = torch.randn(2000, 2000)
        a @ a
        time_ddplab(w)  # the forkserver starts once per process
        setup_distribution(w, opts.setup_launches)


def latency(w: int, rounds: int) -> None:
    """First and repeat launch latency, ddplab next to spawn: pair-ratio medians and the load."""
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmpdir:
        script = os.path.join(tmpdir, "first_launch.py")
        with open(script, "w") as fh:
            fh.write(FIRST_LAUNCH.format(bench_dir=os.path.dirname(os.path.abspath(__file__))))
        # A fresh interpreter times its own launch; the pair's baseline is spawn's, also fresh.
        first = _pairs("first launch", lambda: first_launch("ddplab", w, script),
                       lambda: first_launch("spawn", w, script), rounds)

    a = torch.randn(2000, 2000)
    a @ a
    time_ddplab(w)  # the forkserver starts once per process
    repeat = _pairs("repeat launch", lambda: time_ddplab(w), lambda: time_spawn(w), rounds)

    print(f"W={w}, one all_reduce per launch, parent ran a 2000x2000 matmul; "
          f"ratio = ddplab / torch.multiprocessing.spawn, median of {rounds} adjacent pairs")
    ratios = {**first, **repeat}
    print(ratio_table(ratios, {"first launch": 1.0, "repeat launch": 1 / 40}, baseline_name="spawn",
                      unit=1e-3, unit_name="ms"))
    for name, r in ratios.items():
        print(f"{name}: ddplab {1 / r.median:.1f}x faster than spawn (pairs {1 / max(r.pairs):.1f}.."
              f"{1 / min(r.pairs):.1f}x)")


def _pairs(name: str, candidate, baseline, rounds: int):
    """``{name: Ratio}`` of the seconds each call returns (its own timing), interleaved with the baseline's."""
    got = {"candidate": [], "baseline": []}

    def keep(fn, key):
        return lambda: got[key].append(fn())

    ratios = interleaved({name: keep(candidate, "candidate")}, keep(baseline, "baseline"), rounds)
    # The latencies the calls measured themselves, not interleaved()'s wall times
    # (which would add a fresh interpreter's start to a first launch).
    ratios[name].times, ratios[name].baseline = got["candidate"], got["baseline"]
    return ratios


if __name__ == "__main__":
    main()
