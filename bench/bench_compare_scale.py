"""ddplab.compare at model sizes people bring: the parent's peak memory and the scratch on disk.

For MLPs of about 1M, 10M and 50M parameters at W=2 over 2, 5 and 10 steps,
each measurement in a fresh interpreter (so that its peak is its own):

* the parent's peak RSS above its RSS before ``compare.run`` (``ru_maxrss``),
  as a multiple of the model's bytes (float32 parameters); then the same
  comparison run again in that interpreter (``warm``: RSS polled every 2 ms
  above its RSS before, freed memory given back first): what a comparison
  holds once the modules, kernels and caches a first one loads are there,
  the part that grows with the model;
* the largest size the comparison's scratch folder reached (polled every
  0.1 s), as a multiple of the model's bytes;
* beside each, what ``compare.run`` stated it needs at least (``Comparison.footprint``: the
  analysis's memory, the scratch), as a multiple of the model's bytes;
* the comparison's wall time against the bare runs it compares (DDP on 2
  ranks, the single-process reference, its float64 shadow; no capture).

Targets (issue "compare at real model sizes"): peak ≤ 8× the model and
scratch ≤ 4× the model, both flat in steps; time ≤ 3× the bare runs.
Asserts nothing; prints a table with the load average.

    python bench/bench_compare_scale.py [--sizes 1e6 1e7 5e7] [--steps 2 5 10]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import load_average, machine_line

HERE = os.path.dirname(os.path.abspath(__file__))


def width_for(params: float) -> int:
    """The width d of a 2-layer d×d MLP with about ``params`` parameters."""
    return max(8, int((params / 2) ** 0.5))


def build(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


def batches(width: int, steps: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)) for _ in range(steps)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.01)


def setup_for(width: int, steps: int):
    import functools

    from ddplab import compare
    return compare.Setup(model=functools.partial(build, width), batches=batches(width, steps), loss=F.mse_loss,
                         optimizer=sgd, name=f"mlp d={width}")


def _folder_bytes(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(base, name))
            except OSError:
                pass  # renamed or removed between listing and stat
    return total


def measure(width: int, steps: int) -> dict:
    """In this interpreter: compare.run(DDP(2)) on the width-d MLP, with its peak RSS and scratch."""
    import resource
    import threading
    import time

    import psutil

    from ddplab import compare, launch
    from bench_compare import bare_ddp, bare_single

    setup = setup_for(width, steps)
    model_bytes = sum(p.numel() * p.element_size() for p in build(width).parameters())
    scratch_root = tempfile.mkdtemp(prefix="ddplab-scale-")
    tempfile.tempdir = scratch_root          # compare.run's TemporaryDirectory goes here
    t0 = time.perf_counter()
    launch(bare_ddp, world_size=2, args=(setup, steps))
    launch(bare_single, world_size=1, args=(setup, steps, None))
    launch(bare_single, world_size=1, args=(setup, steps, torch.float64))
    bare = time.perf_counter() - t0
    before = psutil.Process().memory_info().rss
    peak_scratch, done = 0, threading.Event()

    def poll():
        nonlocal peak_scratch
        while not done.wait(0.1):
            peak_scratch = max(peak_scratch, _folder_bytes(scratch_root))

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    result = compare.run(setup, compare.DDP(2), progress=False)
    full = time.perf_counter() - t0
    done.set()
    watcher.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # kilobytes on Linux
    need = result.footprint
    warm = _warm_peak(setup)
    return dict(params=sum(p.numel() for p in build(width).parameters()), steps=steps,
                kind=result.kinds["ddp W=2"], peak_x=(peak - before) / model_bytes, warm_x=warm / model_bytes,
                scratch_x=peak_scratch / model_bytes, time_x=full / bare, seconds=full,
                stated_peak_x=need.parent_bytes / model_bytes, stated_scratch_x=need.scratch_bytes / model_bytes)


def _warm_peak(setup) -> int:
    """The bytes of RSS a second ``compare.run(setup, DDP(2))`` in this interpreter reaches above its start."""
    import threading

    import psutil

    from ddplab import compare
    from ddplab.compare.memory import release_freed_memory

    release_freed_memory()
    proc = psutil.Process()
    before, peak, done = proc.memory_info().rss, [0], threading.Event()

    def poll():
        while not done.wait(0.002):
            peak[0] = max(peak[0], proc.memory_info().rss)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    compare.run(setup, compare.DDP(2), progress=False)
    done.set()
    watcher.join()
    return peak[0] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 5e7])
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 5, 10])
    parser.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)   # width steps, in a child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return
    print(machine_line())
    print(f"{'params':>10s}{'steps':>6s}{'verdict':>9s}{'peak (× model)':>16s}{'warm':>6s}{'stated ≥':>10s}"
          f"{'scratch (× model)':>19s}{'stated ≥':>10s}{'time (× bare)':>15s}{'seconds':>9s}")
    for size in args.sizes:
        for steps in args.steps:
            out = subprocess.run([sys.executable, __file__, "--one", str(width_for(size)), str(steps)],
                                 capture_output=True, text=True, cwd=HERE, env=dict(os.environ, TQDM_DISABLE="1"))
            if out.returncode:
                print(f"{size:10.3g}{steps:6d}  failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{row['params']:10.3g}{steps:6d}{row['kind']:>9s}{row['peak_x']:16.1f}{row['warm_x']:6.1f}"
                  f"{row['stated_peak_x']:10.1f}"
                  f"{row['scratch_x']:19.1f}{row['stated_scratch_x']:10.1f}{row['time_x']:15.2f}{row['seconds']:9.1f}",
                  flush=True)
    print(f"load average {load_average()[0]:.2f}; targets: peak ≤ 8×, scratch ≤ 4× (flat in steps), time ≤ 3×")


if __name__ == "__main__":
    main()
