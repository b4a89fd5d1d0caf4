"""Set-up of ddplab's forkserver, imported by it (its first preload) and nowhere else.

The forkserver is the parent of every rank. As a child subreaper
(:func:`ddplab.process_tree.become_subreaper`, Linux) it adopts what a rank
leaves behind when the rank exits -- a daemon that called ``setsid()`` --
instead of letting init adopt it, so the launcher still finds it below the
forkserver (:func:`ddplab.process_tree.strays`) and stops it. The
forkserver reaps the orphans it adopted, and multiprocessing warns about
each such "unexpected pid": expected here, so not shown. When the
forkserver exits (its parent is gone), what it still adopted is killed.
"""
from __future__ import annotations

import atexit
import os
import warnings

from ddplab.process_tree import become_subreaper, descendants, kill_all

#: This module is imported in the forkserver: its pid, for the exit handler.
_SERVER_PID = os.getpid()


def _kill_adopted() -> None:
    # Ranks and whatever the ranks forked inherit this handler; only the
    # forkserver itself acts on it.
    if os.getpid() == _SERVER_PID:
        kill_all(descendants(_SERVER_PID), timeout=1)


if become_subreaper():
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    atexit.register(_kill_adopted)
