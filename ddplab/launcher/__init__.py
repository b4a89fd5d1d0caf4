"""Launch W torch.distributed ranks from a notebook cell and collect what they did.

:func:`launch` runs ``fn(*args, **kwargs)`` on every rank with the default
process group initialized, and returns a :class:`LaunchResult`: per-rank
return values, captured stdout/stderr, wall time and the tidy table of every
record the ranks emitted (streamed while they run).

The package, by idea:

* :mod:`~ddplab.launcher.results` -- :class:`LaunchResult`, the errors, and
  :class:`RankFailure` (one rank's failure as the parent saw it);
* :mod:`~ddplab.launcher.limits` -- the machine's rank cap and every
  argument check, public for callers that plan several launches
  (:func:`check_world_size`, :func:`check_timeout`);
* :mod:`~ddplab.launcher.rank_side` -- what runs in a rank process;
* :mod:`~ddplab.launcher.forkserver` -- the forkserver, the registry of
  ranks it started, and stopping ranks with all they started;
* :mod:`~ddplab.launcher.diagnosis` -- pure functions: which failure is the
  root cause, and which rank keeps out of the collective the others wait in;
* :mod:`~ddplab.launcher.lifecycle` -- :class:`Launch` from start to teardown.

Why the machinery:

* Ranks are started from a *forkserver* that preloads torch: repeat
  launches cost tens of milliseconds, and a parent that already ran torch
  ops is never forked (a locked OpenMP/MKL state would hang the child).
* ``fn`` is pickled by value (cloudpickle), so functions and lambdas defined
  in a notebook or ``__main__`` work.
* Each launch gets its own TCPStore on an OS-chosen port, so concurrent
  launches never share a rendezvous. The store is unauthenticated, so it
  listens on 127.0.0.1 only (multi-machine runs go through torchrun).
* Ranks do not re-run the parent's ``__main__`` (multiprocessing's default):
  launching works from ``python -``, ``python -c`` and scripts without an
  ``if __name__ == "__main__":`` guard.
* Each rank leads its own process group, so stopping a launch also stops
  what a rank started, even after the rank itself exited. On Linux each
  rank and the forkserver are also child subreapers: a daemon a rank
  starts (``setsid()``, double fork) stays below the rank, or below the
  forkserver once the rank is gone, and is stopped too.
* The parent waits on one pipe per rank and on the process sentinels at once:
  an exception, a death by signal or a hang is seen the moment it happens,
  every rank is stopped, and records emitted before the failure are kept on
  the exception (``err.result.records``).

Example::

    >>> import torch, torch.distributed as dist
    >>> def total(x):
    ...     t = torch.tensor([float(x + dist.get_rank())])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> launch(total, world_size=4, args=(1,)).returns
    [10.0, 10.0, 10.0, 10.0]
"""
from __future__ import annotations

from ddplab.launcher.diagnosis import Frame, RankPlace, root_cause
from ddplab.launcher.forkserver import _RankProcess  # noqa: F401 - tests patch its start here
from ddplab.launcher.lifecycle import Launch, launch, observe, stop_all
from ddplab.launcher.limits import (DEFAULT_TIMEOUT, MAX_TIMEOUT, MAX_WORLD_SIZE_ENV, check_timeout,
                                    check_world_size, world_size_limit)
from ddplab.launcher.results import (FailureKind, LaunchError, LaunchResult, LaunchStopped,
                                     LaunchTimeout, RankDied, RankFailed, RankFailure)

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_TIMEOUT",
    "MAX_WORLD_SIZE_ENV",
    "launch",
    "Launch",
    "LaunchResult",
    "LaunchError",
    "RankFailed",
    "RankDied",
    "LaunchTimeout",
    "LaunchStopped",
    "RankFailure",
    "FailureKind",
    "Frame",
    "RankPlace",
    "root_cause",
    "check_timeout",
    "check_world_size",
    "observe",
    "stop_all",
    "world_size_limit",
]
