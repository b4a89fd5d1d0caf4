"""Process checks the launcher and report tests share."""
from __future__ import annotations

import subprocess
import time

import psutil


def still_alive(pids, within: float = 3.0) -> list[int]:
    """The pids neither gone nor a zombie after polling for up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def all_gone(pids, within: float = 3.0) -> bool:
    """True once every pid is gone or a zombie, polling for ``within`` seconds."""
    return not still_alive(pids, within)


def start_reading_pids(args, count: int, **popen):
    """Start ``args`` (stdout a text pipe) and read lines until it printed ``count`` "PID <n>" lines.

    Returns ``(process, pids)``; a process that ends first fails the test with its stderr.
    """
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    pids: list[int] = []
    while len(pids) < count:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if line.startswith("PID"):
            pids.append(int(line.split()[1]))
    return proc, pids
