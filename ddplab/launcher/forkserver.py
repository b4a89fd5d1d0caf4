"""ddplab's forkserver, the registry of the ranks it started, and stopping ranks with all they started.

Ranks are started from a *forkserver* that preloads torch. A plain ``fork``
of a parent that already ran torch ops copies a locked OpenMP/MKL state and
the child hangs in its first matmul; ``spawn`` is safe but re-imports torch
on every launch (seconds). The forkserver imports torch once per notebook
kernel, so repeat launches cost tens of milliseconds.

The forkserver is ddplab's own, not multiprocessing's shared one, and a
child subreaper (:mod:`ddplab._rank_server`): everything below it that is
not a running rank is a leftover of a rank (:func:`kill_strays`).
"""
from __future__ import annotations

import io
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.spawn
import multiprocessing.util
import os
import threading
import time

__all__ = ["FORKSERVER_PRELOAD", "SERVER_SETUP", "STOP_GRACE", "context", "stop_gently",
           "kill_ranks", "kill_strays"]

#: Modules the forkserver imports once, so that every rank starts warm. DDP's
#: constructor and torch.optim import torch._dynamo lazily: about 1 s per rank
#: on an idle core (up to 7 s under load) on every launch, unless preloaded.
#: ddplab.compare's workers (with numba, through the collectives' emulation)
#: cost each rank of a comparison's five launches another quarter second; the
#: recorder's interception and the comm hooks (torch's, with PowerSGD) 20 ms more.
FORKSERVER_PRELOAD = ["ddplab.launcher", "torch._dynamo", "torch.nn.parallel", "torch.optim", "ddplab.compare",
                      "ddplab.collectives.interception", "ddplab.collectives.comm_hooks", "ddplab.comm_hooks"]
#: Imported first in the forkserver: makes it a subreaper (:mod:`ddplab._rank_server`).
SERVER_SETUP = "ddplab._rank_server"
#: Grace given to a rank between SIGTERM and SIGKILL when stopping a launch.
STOP_GRACE = 1.0


def context():
    """The multiprocessing context the ranks' pipes come from."""
    return multiprocessing.get_context("forkserver")


#: ddplab's own forkserver: the parent of every rank and of nothing else, so
#: that its children that are not running ranks are leftovers (see
#: :func:`kill_strays`). multiprocessing's shared one also starts the
#: user's processes (the default start method from Python 3.14) and keeps the
#: user's preload list.
_FORKSERVER = multiprocessing.forkserver.ForkServer()
_FORKSERVER.set_forkserver_preload([SERVER_SETUP, *FORKSERVER_PRELOAD])
#: The pids of ranks started and not yet reaped, across launches; changed and
#: read under ``_spawn_lock``, which is also held while a rank is being forked.
_rank_pids: set[int] = set()
_spawn_lock = threading.Lock()


class _RankPopen(multiprocessing.popen_forkserver.Popen):
    """The forkserver's Popen, minus the re-run of the parent's ``__main__``.

    multiprocessing tells each child to re-run the parent's main script (or
    re-import its main module) so that pickled references into it resolve.
    A rank needs none of that -- ``fn`` travels by value -- and the re-run
    breaks launches from ``python -`` (there is no file to run) and from
    scripts without an ``if __name__ == "__main__":`` guard (every rank would
    launch again). The steps are the standard library's ``_launch``
    (unchanged from 3.10 to 3.14); only the preparation data differ.
    """

    def _launch(self, process_obj):
        from multiprocessing.context import reduction, set_spawning_popen

        prep_data = multiprocessing.spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_name", None)
        prep_data.pop("init_main_from_path", None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        # From the fork to its pid in _rank_pids, a new rank is a child of the
        # forkserver that nobody knows: no stray sweep may run meanwhile.
        with _spawn_lock:
            self.sentinel, w = _FORKSERVER.connect_to_new_process(self._fds)
            # The child watches a duplicate of the data pipe's write end to see the parent go.
            parent_w = os.dup(w)
            self.finalizer = multiprocessing.util.Finalize(
                self, multiprocessing.util.close_fds, (parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = multiprocessing.forkserver.read_signed(self.sentinel)
            _rank_pids.add(self.pid)


class _RankProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver process started by :class:`_RankPopen`."""

    @staticmethod
    def _Popen(process_obj):
        return _RankPopen(process_obj)


def stop_gently(procs: list, finishing: bool) -> list:
    """SIGTERM the live ranks and wait up to :data:`STOP_GRACE`; return their descendants.

    ``finishing``: every rank already sent its result and is ending on its
    own, so it gets half a second before the SIGTERM.
    """
    from ddplab.process_tree import descendants

    alive = [p for p in procs if p.exitcode is None]
    # Ranks may have children of their own (DataLoader workers); once a rank
    # is gone they are re-parented and no longer found from it.
    family = [child for p in alive for child in descendants(p.pid)]
    if alive:
        deadline = time.perf_counter() + (0.5 if finishing else 0.0)
        for p in alive:
            p.join(max(0.0, deadline - time.perf_counter()))
        for p in alive:
            if p.exitcode is None:
                p.terminate()
        deadline = time.perf_counter() + STOP_GRACE
        for p in alive:
            p.join(max(0.0, deadline - time.perf_counter()))
    return family


def kill_ranks(procs: list, family: list) -> None:
    """SIGKILL every rank, its process group and ``family``; reap the ranks; then :func:`kill_strays`."""
    import psutil

    from ddplab.process_tree import kill_all, kill_group

    for p in procs:
        # Once the rank is reaped its pid is free: if a process holds it
        # now, it is a stranger (the group of a pid still in use as a
        # group id cannot be reused, so the group would be empty anyway).
        if p.exitcode is None or not psutil.pid_exists(p.pid):
            kill_group(p.pid)
        if p.exitcode is None:
            p.kill()
    kill_all(family, timeout=5)
    for p in procs:
        p.join(5)
    with _spawn_lock:
        _rank_pids.difference_update(p.pid for p in procs if p.exitcode is not None)
    kill_strays()


def kill_strays() -> None:
    """Kill what the forkserver adopted: the leftovers of ranks that are gone.

    A rank's daemon outlives the rank once the rank exits (returned,
    raised, died); as a subreaper the forkserver adopts it. Only leftovers
    reach the forkserver (a running rank adopts its own orphans), so this
    is safe while other launches run; their dead ranks' leftovers go too.
    """
    from ddplab.process_tree import kill_all, strays

    server = _FORKSERVER._forkserver_pid
    if server is None:
        return
    with _spawn_lock:
        found = strays(server, keep=_rank_pids)
    kill_all(found, timeout=5)
