"""Stopping a process together with everything it started.

Ranks start DataLoader workers, papermill starts a kernel that starts ranks:
stopping only the top process would leave the rest running. Collect the
whole tree first (children are re-parented once their parent dies), then kill.
A process that leads its own process group (each rank does) can also be
stopped by group, which still reaches its children after it has exited.
"""
from __future__ import annotations

import os
import signal

import psutil

__all__ = ["descendants", "kill_all", "kill_group", "kill_tree"]


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (empty when ``pid`` is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_all(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    """SIGKILL each process and wait up to ``timeout`` s for all of them."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def kill_tree(pid: int, timeout: float = 10.0) -> None:
    """Kill ``pid`` and all its descendants."""
    try:
        root = [psutil.Process(pid)]
    except psutil.Error:
        root = []
    kill_all(descendants(pid) + root, timeout)


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to every process in process group ``pgid``; False if there is none."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True
