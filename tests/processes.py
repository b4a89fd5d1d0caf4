"""Process checks the launcher tests share."""
from __future__ import annotations

import time

import psutil


def all_gone(pids, within: float = 3.0) -> bool:
    """True once every pid is gone or a zombie, polling for ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False
