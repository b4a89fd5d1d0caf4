"""Stopping a process together with everything it started.

Ranks start DataLoader workers, papermill starts a kernel that starts ranks:
stopping only the top process would leave the rest running. Collect the
whole tree first (children are re-parented once their parent dies), then kill.
A process that leads its own process group (each rank does) can also be
stopped by group, which still reaches its children after it has exited.

A child that calls ``setsid()`` (a daemon) leaves the group, and once its
parent exits it is re-parented to init: found neither by group nor from
the tree. On Linux a *child subreaper* (:func:`become_subreaper`) adopts
such orphans instead, so they stay below it: the launcher's ranks and its
forkserver are subreapers, and :func:`strays` finds what the forkserver
adopted. Elsewhere there is no subreaper and daemons can escape.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

import psutil

__all__ = ["become_subreaper", "descendants", "kill_all", "kill_group", "kill_tree", "strays"]


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


#: prctl(2)'s option that makes the calling process a child subreaper (Linux >= 3.4).
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux); False where it cannot.

    Orphans -- a daemon whose parent exited, the children of a process that
    died -- are then re-parented to this process instead of init, so they
    stay among its descendants until it exits. Not inherited by children.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def strays(server_pid: int, keep: set[int]) -> list[psutil.Process]:
    """The children of ``server_pid`` not in ``keep``, with all their descendants.

    For a subreaper that starts processes on request (the launcher's
    forkserver): its children are what it started (``keep``) and the orphans
    it adopted. Zombies are left out (already dead, reaped by the server).
    """
    found = []
    try:
        children = psutil.Process(server_pid).children()
    except psutil.Error:
        return []
    for child in children:
        try:
            if child.pid in keep or child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        found += [child, *descendants(child.pid)]
    return found
