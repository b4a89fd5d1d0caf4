"""Shared fixtures: a warm forkserver and a check that no process is left behind."""
from __future__ import annotations

import os
import tempfile
import time

import psutil
import pytest

os.environ.setdefault("TQDM_DISABLE", "1")
# One inductor cache for the whole suite, its processes and ranks alike (set before the forkserver
# starts, so every rank inherits it): a graph compiled once is loaded, not compiled, after that.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "ddplab-tests-inductor"))


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE}


@pytest.fixture(scope="session")
def warm_launcher():
    """Start the forkserver once, so that process counts compare like with like."""
    import torch.distributed as dist

    from ddplab.launcher import launch

    launch(lambda: dist.get_world_size(), world_size=1)
    return launch


@pytest.fixture
def no_leftovers(warm_launcher):
    """Fail the test if it leaves any descendant process behind."""
    before = _descendants()
    yield warm_launcher
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra = _descendants() - before
        if not extra:
            return
        time.sleep(0.1)
    names = {pid: psutil.Process(pid).cmdline() for pid in extra if psutil.pid_exists(pid)}
    pytest.fail(f"processes left behind: {names}")
