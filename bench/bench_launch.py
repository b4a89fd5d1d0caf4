"""Launch-to-return latency: ddplab.launch vs torch.multiprocessing.spawn.

W ranks each do one all_reduce, after the parent already ran a large matmul
(the situation in a notebook). Repeat launches are measured interleaved A/B
in one process; first launches are measured in fresh interpreters, also
interleaved. Prints medians and ratios; asserts nothing (machines are noisy).

Targets (issue "Foundation"): repeat launches >= 20x faster than spawn; the
first launch in a process no slower than spawn.

    python bench/bench_launch.py [--rounds 5] [--world-size 4]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from ddplab import launch


def one_allreduce():
    t = torch.ones(1024)
    dist.all_reduce(t)
    return t[0].item()


def _spawn_rank(rank, world_size, port):
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            init_method=f"tcp://127.0.0.1:{port}")
    one_allreduce()
    dist.destroy_process_group()


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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    opts = parser.parse_args()
    w = opts.world_size

    import tempfile
    with tempfile.TemporaryDirectory() as tmpdir:
        script = os.path.join(tmpdir, "first_launch.py")
        with open(script, "w") as fh:
            fh.write(FIRST_LAUNCH.format(bench_dir=os.path.dirname(os.path.abspath(__file__))))
        first = {"ddplab": [], "spawn": []}
        for _ in range(opts.rounds):
            for kind in ("ddplab", "spawn"):
                first[kind].append(first_launch(kind, w, script))

    a = torch.randn(2000, 2000)
    a @ a
    time_ddplab(w)  # the forkserver starts once per process
    repeat = {"ddplab": [], "spawn": []}
    for _ in range(opts.rounds):
        repeat["ddplab"].append(time_ddplab(w))
        repeat["spawn"].append(time_spawn(w))

    def row(name, res):
        d, s = statistics.median(res["ddplab"]), statistics.median(res["spawn"])
        print(f"{name:<15} ddplab {d * 1e3:8.1f} ms   spawn {s * 1e3:8.1f} ms   "
              f"spawn/ddplab = {s / d:6.1f}x")

    print(f"W={w}, one all_reduce per launch, parent ran a 2000x2000 matmul; medians")
    row("first launch", first)
    row("repeat launch", repeat)


if __name__ == "__main__":
    main()
