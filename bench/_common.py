"""What every benchmark here needs: interleaved timings, robust ratios, the machine's load, peak memory.

The machine is shared, so an absolute time says little: a benchmark times a
candidate and its baseline next to each other, many rounds over, and reports

* the median over rounds of the ratio of each adjacent pair (candidate /
  baseline timed back to back, in alternating order so that neither always
  goes first), with the smallest and largest pair ratio;
* the ratio of the best timings (interference from other processes only
  ever adds time, so the minima are the least disturbed estimate);
* the load average while it ran, printed next to the figure: a ratio
  measured at load 8 on 2 cores is not the same claim as one at load 0.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping

import psutil

__all__ = ["timed", "Ratio", "interleaved", "ratio_table", "load_average", "machine_line",
           "PeakRSS", "run_python"]


def timed(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def load_average() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages (runnable processes; compare with the CPU count)."""
    return os.getloadavg()


def machine_line() -> str:
    """One line: CPUs, torch threads and the load right now."""
    import torch

    one, five, fifteen = load_average()
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, {psutil.cpu_count()} CPUs, "
            f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)")


@dataclasses.dataclass
class Ratio:
    """Timings of a candidate and of its baseline, pair i taken back to back."""

    times: list[float] = dataclasses.field(default_factory=list)
    baseline: list[float] = dataclasses.field(default_factory=list)
    loads: list[float] = dataclasses.field(default_factory=list)   # 1-minute load average per pair

    def add(self, t: float, base: float) -> None:
        self.times.append(t)
        self.baseline.append(base)
        self.loads.append(load_average()[0])

    @property
    def pairs(self) -> list[float]:
        return [t / b for t, b in zip(self.times, self.baseline)]

    @property
    def median(self) -> float:
        """Median over the adjacent pairs of candidate / baseline: the figure a target is judged by."""
        return statistics.median(self.pairs)

    @property
    def best(self) -> float:
        """Best candidate time over best baseline time."""
        return min(self.times) / min(self.baseline)

    @property
    def load(self) -> float:
        """Median 1-minute load average while the pairs were timed."""
        return statistics.median(self.loads)


def interleaved(candidates: Mapping[str, Callable[[], object]], baseline: Callable[[], object],
                rounds: int) -> dict[str, Ratio]:
    """Time every candidate next to its own run of ``baseline``, ``rounds`` times over.

    Each round visits the candidates in a rotated order; within a pair the
    baseline goes first in even rounds and second in odd ones.
    """
    names = list(candidates)
    out = {name: Ratio() for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if r % 2 == 0:
                base = timed(baseline)
                t = timed(candidates[name])
            else:
                t = timed(candidates[name])
                base = timed(baseline)
            out[name].add(t, base)
    return out


def ratio_table(ratios: Mapping[str, Ratio], targets: Mapping[str, float | None], *,
                baseline_name: str = "baseline", unit: float = 1.0, unit_name: str = "s") -> str:
    """The table every benchmark prints: medians, pair-ratio median with its range, best/best, load, verdict."""
    lines = [f"{'':26s}{'median ' + unit_name:>11s}{baseline_name + ' ' + unit_name:>14s}"
             f"{'ratio':>8s}{'min..max':>13s}{'best/best':>10s}{'load':>6s}{'target':>8s}  verdict"]
    for name, r in ratios.items():
        target = targets.get(name)
        if target is None:
            verdict, shown = "", ""
        else:
            verdict = "meets target" if r.median <= target else "MISSES target"
            shown = f"{target:g}x"
        lines.append(f"{name:26s}{statistics.median(r.times) / unit:11.3f}{statistics.median(r.baseline) / unit:14.3f}"
                     f"{r.median:8.3f}{min(r.pairs):6.2f}..{max(r.pairs):<5.2f}{r.best:10.3f}{r.load:6.1f}"
                     f"{shown:>8s}  {verdict}")
    return "\n".join(lines)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakRSS:
    """Peak resident memory of this process inside the ``with`` block, above what it held at the start.

    On Linux the kernel's own high-water mark is reset on entry
    (``/proc/self/clear_refs``) and read on exit, so no short peak is missed;
    elsewhere a thread samples the resident size every few milliseconds.
    Memory the process already holds and reuses (freed tensors kept by the
    allocator) does not count as growth.
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = _rss()
        self._kernel = False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._kernel = _peak_rss_kib() is not None
        except OSError:
            pass
        if not self._kernel:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        if self._kernel:
            self.peak = max(self.start, _peak_rss_kib() * 1024)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def run_python(code: str, env: Mapping[str, str] | None = None, timeout: float = 900) -> dict:
    """Run ``code`` in a fresh interpreter (this one's ``sys.path``); return the JSON its last line prints."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"subprocess failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])

