"""Launch W torch.distributed ranks from a notebook cell and collect what they did.

:func:`launch` runs ``fn(*args, **kwargs)`` on every rank with the default
process group initialized, and returns a :class:`LaunchResult`: per-rank
return values, captured stdout/stderr, wall time and the tidy table of every
record the ranks emitted (streamed while they run).

Why the machinery:

* Ranks are started from a *forkserver* that preloads torch. A plain ``fork``
  of a parent that already ran torch ops copies a locked OpenMP/MKL state and
  the child hangs in its first matmul; ``spawn`` is safe but re-imports torch
  on every launch (seconds). The forkserver imports torch once per notebook
  kernel, so repeat launches cost tens of milliseconds.
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
  forkserver once the rank is gone, and is stopped too. The forkserver is
  ddplab's own, not multiprocessing's shared one, so everything below it
  that is not a running rank is a leftover of a rank.
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

import contextlib
import dataclasses
import datetime
import faulthandler
import inspect
import io
import math
import multiprocessing
import multiprocessing.connection as mpc
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any, Callable

import cloudpickle

from ddplab import records as _records
from ddplab.formatting import visible_controls
from ddplab.rank import check_backend

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
    "observe",
    "stop_all",
    "world_size_limit",
]

#: Seconds before a launch is declared hung; far below gloo's 30-minute default.
DEFAULT_TIMEOUT = 300.0
#: The longest timeout accepted (30 days): gloo and the store keep timeouts as
#: integer milliseconds, and longer is no timeout at all in practice.
MAX_TIMEOUT = 30 * 24 * 3600.0
#: Ranks per CPU core a launch may start: each rank is a process with its own
#: torch; far beyond this a launch only time-slices (and a typo like 10_000
#: would fork that many processes).
MAX_RANKS_PER_CPU = 32
#: File descriptors each rank costs the parent (result pipe, lifeline, the
#: exit-status pipe and its duplicate, a store connection) and a reserve for
#: everything else, for the limit the open-file limit sets.
FDS_PER_RANK = 5
FD_RESERVE = 256
#: Environment variable that overrides :func:`world_size_limit`.
MAX_WORLD_SIZE_ENV = "DDPLAB_MAX_WORLD_SIZE"
#: Grace given to a rank between SIGTERM and SIGKILL when stopping a launch.
STOP_GRACE = 1.0
#: After a first failure, how long to keep listening before naming the cause:
#: a rank killed by a signal makes its peers fail in their next collective, and
#: their errors can reach the parent before the death is seen.
FAILURE_GRACE = 0.4
#: Modules the forkserver imports once, so that every rank starts warm. DDP's
#: constructor and torch.optim import torch._dynamo lazily: about 1 s per rank
#: on an idle core (up to 7 s under load) on every launch, unless preloaded.
FORKSERVER_PRELOAD = ["ddplab.launcher", "torch._dynamo", "torch.nn.parallel", "torch.optim"]
#: Imported first in the forkserver: makes it a subreaper (:mod:`ddplab._rank_server`).
SERVER_SETUP = "ddplab._rank_server"
#: How many lines of a stuck rank's Python stack go into a timeout message.
STACK_LINES = 30


# --------------------------------------------------------------------------- process-wide hooks

#: Launches running in this process (the explorer's Stop button stops them all).
_active: "weakref.WeakSet[Launch]" = weakref.WeakSet()
_active_lock = threading.Lock()
#: Callables ``fn(launch, record)`` that see every record of every launch here.
_observers: list[Callable] = []


@contextlib.contextmanager
def observe(fn: Callable[["Launch", dict], None]):
    """Call ``fn(launch, record)`` for every record any launch in this process
    receives inside the block (progress for callers that launch indirectly)."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


def stop_all() -> int:
    """Stop every launch running in this process; return how many were asked."""
    with _active_lock:
        running = list(_active)
    for runner in running:
        runner.stop()
    return len(running)


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class LaunchResult:
    """What a launch produced. Partial (``returns`` has ``None``) on failure."""

    world_size: int
    backend: str
    returns: list
    stdout: list[str]
    stderr: list[str]
    wall_time: float
    exitcodes: list[int | None]
    record_list: list[dict] = dataclasses.field(default_factory=list, repr=False)

    @property
    def ordered_records(self) -> list[dict]:
        """The records in rank order, each rank's in the order it emitted them.

        Deterministic, unlike arrival order (``record_list``), so two runs --
        or this launch and a torchrun job -- compare row for row.
        """
        return sorted(self.record_list, key=lambda r: -1 if r.get("rank") is None else r["rank"])

    @property
    def records(self):
        """Every record the ranks emitted, as the tidy DataFrame (in :attr:`ordered_records` order)."""
        return _records.to_frame(self.ordered_records)

    def __repr__(self) -> str:
        return (f"LaunchResult(world_size={self.world_size}, backend={self.backend!r}, "
                f"wall_time={self.wall_time:.2f}s, records={len(self.record_list)})")


class LaunchError(RuntimeError):
    """A launch did not complete; ``result`` holds what was recorded until then."""

    def __init__(self, message: str, result: LaunchResult):
        super().__init__(message)
        self.result = result

    @property
    def records(self):
        return self.result.records


class RankFailed(LaunchError):
    """A rank raised; ``rank``, ``exc_type`` and ``remote_traceback`` say where and why."""

    def __init__(self, message, result, rank: int, exc_type: str, remote_traceback: str):
        super().__init__(message, result)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


class RankDied(LaunchError):
    """A rank's process ended without a result (killed by a signal, or os._exit)."""

    def __init__(self, message, result, rank: int, exitcode: int | None):
        super().__init__(message, result)
        self.rank = rank
        self.exitcode = exitcode


class LaunchTimeout(LaunchError):
    """The launch ran past its timeout: some ranks never returned."""

    def __init__(self, message, result, returned: list[int], pending: list[int],
                 last_records: dict[int, dict | None], stacks: dict[int, str]):
        super().__init__(message, result)
        self.returned = returned
        self.pending = pending
        self.last_records = last_records
        self.stacks = stacks


class LaunchStopped(LaunchError):
    """The launch was stopped on request (:meth:`Launch.stop`)."""


# --------------------------------------------------------------------------- child side


def _exception_text(exc: BaseException) -> str:
    """``str(exc)``, never raising: ``sys.exit()`` and an exception whose
    ``__str__`` raises still say what happened."""
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r})"
    try:
        return str(exc)
    except Exception as err:  # noqa: BLE001 - the message is what failed
        return f"<its __str__ raised {type(err).__name__}>"


def _load_payload(payload: bytes):
    """``(fn, args, kwargs)`` as the parent pickled them, or a clear error.

    cloudpickle sends functions of ``__main__`` and of notebooks by value,
    but functions of importable modules by reference: the rank must import
    that module by name.
    """
    try:
        return cloudpickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - re-raised with the reason
        raise RuntimeError(
            f"fn or its arguments could not be rebuilt in the rank ({type(exc).__name__}: "
            f"{_exception_text(exc)}). Objects from importable modules travel by reference and "
            f"the rank imports them by name: put the module on sys.path, or call "
            f"cloudpickle.register_pickle_by_value(module) before launching to send it by value"
        ) from exc


#: The kernel's "this task is exiting" flag in /proc/<pid>/stat (set before
#: the task's sockets close, so a peer that sees a closed connection sees it).
_PF_EXITING = 0x4


def _dead_peers(pids: list[int]) -> list[int]:
    """Ranks (indices into ``pids``) whose process is exiting or gone."""
    dead = []
    for rank, pid in enumerate(pids):
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            if fields[0] in (b"Z", b"X") or int(fields[6]) & _PF_EXITING:
                dead.append(rank)
        except FileNotFoundError:
            dead.append(rank)
        except (OSError, IndexError, ValueError):
            pass  # no /proc here: nothing known
    return dead


def _rank_main(payload: bytes, rank: int, world_size: int, backend: str, port: int,
               conn, lifeline, out_path: str, err_path: str, threads: int,
               environ: dict, sys_path: list, cwd: str, collective_timeout: float) -> None:
    """Entry point of a rank process (runs in a child of the forkserver)."""
    # Lead a process group of our own: whatever this rank starts shares it,
    # so the parent can stop all of it, even once this rank has exited.
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    # And adopt orphans (Linux): a daemon that left the group by setsid() and
    # whose own parent exited stays among this rank's descendants.
    from ddplab.process_tree import become_subreaper

    become_subreaper()
    # Capture at the file-descriptor level so C++ output (gloo, NCCL) lands too.
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    # The parent asks for every thread's stack with SIGUSR1 when diagnosing a hang.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # The forkserver was started with the parent's environment of back then;
    # ranks must see the parent's environment of now (NCCL_ALGO set in a cell).
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass

    peers: list[int] = []  # every rank's pid, once all have started

    def _watch_parent() -> None:
        # The parent writes the ranks' pids once, then nothing: EOF means it is
        # gone, and an orphaned rank must not wait in a collective for 30
        # minutes -- nor leave behind what it started.
        try:
            while True:
                peers[:] = lifeline.recv()
        except (EOFError, OSError):
            pass
        from ddplab.process_tree import descendants

        # A subreaper's descendants include the daemons that left its group.
        for child in descendants(os.getpid()):
            with contextlib.suppress(Exception):
                child.kill()
        if os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(70)

    threading.Thread(target=_watch_parent, name="ddplab-lifeline", daemon=True).start()

    send_lock = threading.Lock()

    def _send(msg) -> None:
        # Comm hooks may emit from autograd threads; one message at a time.
        with send_lock:
            conn.send(msg)

    _records.set_sink(lambda rec: _send(("record", rec)))
    code = 0
    try:
        import torch
        import torch.distributed as dist
        from ddplab.rank import setup_rank, teardown_rank

        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=collective_timeout))
        setup_rank(rank, world_size, backend, store=store, timeout=collective_timeout)
        fn, args, kwargs = _load_payload(payload)
        value = fn(*args, **kwargs)
        try:
            blob = cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - reported to the parent verbatim
            raise TypeError(f"rank {rank}'s return value could not be pickled: "
                            f"{_exception_text(exc)}") from exc
        _send(("result", blob))
        teardown_rank()
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        failed_at = time.time()
        # Peers already dead by now failed first: this error may be their consequence.
        dead = [r for r in _dead_peers(list(peers)) if r != rank]
        code = 1
        try:
            tb = traceback.format_exc()
        except Exception:  # noqa: BLE001 - a traceback that cannot be formatted
            tb = f"{type(exc).__name__} (its traceback could not be formatted)"
        try:
            _send(("error", {"type": type(exc).__name__, "message": _exception_text(exc),
                             "traceback": tb, "time": failed_at, "dead_peers": dead}))
        except Exception:  # noqa: BLE001 - the pipe may be gone with the parent
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            # Release what multiprocessing registered (semaphores of locks made
            # in the rank, e.g. tqdm's), else the shared resource tracker warns
            # about "leaked semaphore objects" when the notebook exits.
            multiprocessing.util._run_finalizers(0)
        finally:
            # Skip interpreter teardown: stray threads (gloo, user code) must
            # not keep a finished rank alive.
            os._exit(code)


# --------------------------------------------------------------------------- parent side


def _context():
    return multiprocessing.get_context("forkserver")


#: ddplab's own forkserver: the parent of every rank and of nothing else, so
#: that its children that are not running ranks are leftovers (see
#: :meth:`Launch._kill_strays`). multiprocessing's shared one also starts the
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


def _loopback_store(world_size: int, timeout: float):
    """A master TCPStore that accepts connections on 127.0.0.1 only.

    Given only a port, TCPStore binds every interface (``::``, else
    ``0.0.0.0``) and serves keys to anyone who connects: no authentication.
    Handed a socket already bound to loopback (``master_listen_fd``), it
    listens on that socket and nowhere else. The store owns the descriptor
    from then on and closes it with itself.
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout),
                         master_listen_fd=sock.detach())


def world_size_limit() -> tuple[int, str]:
    """The most ranks one launch may start on this machine, and why.

    :data:`MAX_RANKS_PER_CPU` per CPU core, fewer where the open-file limit
    cannot hold them; the environment variable :data:`MAX_WORLD_SIZE_ENV`
    overrides both.
    """
    override = os.environ.get(MAX_WORLD_SIZE_ENV)
    if override is not None:
        try:
            value = int(override)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{MAX_WORLD_SIZE_ENV} must be a positive integer, got {override!r}")
        return value, f"set by {MAX_WORLD_SIZE_ENV}"
    cpus = os.cpu_count() or 1
    limit, why = MAX_RANKS_PER_CPU * cpus, f"{MAX_RANKS_PER_CPU} per CPU core x {cpus} core(s)"
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = -1
    except (ImportError, OSError, ValueError):
        soft = -1
    if soft > 0:
        by_files = max(1, (soft - FD_RESERVE) // FDS_PER_RANK)
        if by_files < limit:
            limit, why = by_files, f"the open-file limit (ulimit -n) of {soft}"
    return limit, why


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_call(fn, args, kwargs: dict) -> None:
    """Raise ValueError if ``fn(*args, **kwargs)`` cannot bind, where ``fn``'s signature can be read.

    Without this a keyword ``fn`` does not take fails in every rank, seconds
    later, after the store, the processes and the process group were set up.
    The signature is the one ``inspect.signature`` reads (a ``functools.wraps``
    decorator shows the wrapped function's); builtins without one (``max``)
    are not checked here: the ranks report what they raise.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", None) or repr(fn)
        raise ValueError(f"{name}{signature} cannot be called with these arguments: {exc}") from None


def _validate(fn, world_size, backend, timeout, args, kwargs, threads_per_rank, env,
              on_record, progress) -> dict[str, str]:
    """Raise ValueError for any bad argument (before a process starts); return ``env`` as strings."""
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    limit, why = world_size_limit()
    if world_size > limit:
        raise ValueError(
            f"world_size={world_size} is more than this machine runs: at most {limit} ranks "
            f"({why}). Every rank is a process with its own torch; beyond that a launch only "
            f"thrashes or runs out of file descriptors. Set {MAX_WORLD_SIZE_ENV}=N to allow more")
    check_backend(backend, world_size)
    if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_TIMEOUT):
        raise ValueError(f"timeout must be a positive number of seconds, finite and at most "
                         f"{MAX_TIMEOUT:g} (30 days), got {timeout!r}")
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ValueError(f"kwargs must be a dict, got {type(kwargs).__name__}")
        bad = [k for k in kwargs if not isinstance(k, str)]
        if bad:
            raise ValueError(f"kwargs keys must be strings (they become keyword arguments), got {bad[0]!r}")
    _check_call(fn, args, kwargs or {})
    if threads_per_rank is not None and (not _is_int(threads_per_rank) or threads_per_rank < 1):
        raise ValueError(f"threads_per_rank must be an int >= 1 or None (the cores divided among "
                         f"the ranks), got {threads_per_rank!r}")
    if on_record is not None and not callable(on_record):
        raise ValueError(f"on_record must be callable or None, got {type(on_record).__name__}")
    if progress is not None and (not _is_int(progress) or progress < 1):
        raise ValueError(f"progress must be the expected number of steps (int >= 1), got {progress!r}")
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise ValueError(f"env must be a dict of environment variables, got {type(env).__name__}")
    checked = {}
    for name, value in env.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ValueError(f"env: {name!r} is not an environment variable name "
                             f"(a non-empty string without '=' or NUL)")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"env[{name!r}] must be a string (or a number), got {value!r}")
        value = str(value)
        if "\0" in value:
            raise ValueError(f"env[{name!r}] contains a NUL character")
        checked[name] = value
    return checked


@contextlib.contextmanager
def _sigint_deferred():
    """Hold Ctrl-C (SIGINT) until the block ends, then deliver it.

    Killing the ranks must not be cut short by an impatient second Ctrl-C:
    a rank that handles SIGTERM would then outlive the launch. Only the
    main thread can receive KeyboardInterrupt, so elsewhere nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored, default or set outside Python: nothing to hold
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        previous(*held[0])


def _tail(text: str, lines: int) -> str:
    """The last ``lines`` lines of ``text``, split at newlines only (splitlines() would also
    split at, and drop, the carriage returns and separators a rank printed)."""
    return "\n".join(text.rstrip("\n").split("\n")[-lines:])


def _stack_from_dump(stderr_text: str) -> str:
    """The last faulthandler dump in a rank's stderr (its stack at the timeout)."""
    marker = stderr_text.rfind("Thread 0x")
    first = stderr_text.find("Thread 0x") if marker >= 0 else -1
    if first < 0:
        marker = stderr_text.rfind("Stack (most recent call first)")
        return _tail(stderr_text[marker:], STACK_LINES) if marker >= 0 else ""
    return _tail(stderr_text[first:], STACK_LINES * 4)


class Launch:
    """One launch of W ranks; :func:`launch` is ``Launch(...).start().wait()``.

    Use the object directly to run in the background (the explorer does):
    ``start()`` returns at once, ``wait()`` blocks for the result, ``stop()``
    (from any thread) ends every rank and makes ``wait()`` raise
    :class:`LaunchStopped`.
    """

    def __init__(self, fn: Callable, world_size: int = 2, backend: str = "gloo", *,
                 args: tuple = (), kwargs: dict | None = None,
                 timeout: float = DEFAULT_TIMEOUT, threads_per_rank: int | None = None,
                 env: dict[str, str] | None = None,
                 on_record: Callable[[dict], None] | None = None,
                 progress: int | None = None, progress_desc: str | None = None):
        env = _validate(fn, world_size, backend, timeout, args, kwargs, threads_per_rank, env,
                        on_record, progress)
        try:
            self._payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"fn and its arguments must be picklable (cloudpickle): {exc}") from exc
        self.fn_name = getattr(fn, "__qualname__", repr(fn))
        self.world_size = world_size
        self.backend = backend
        self.timeout = float(timeout)
        cpus = os.cpu_count() or 1
        self.threads_per_rank = threads_per_rank or max(1, cpus // world_size)
        self.env = env
        self.on_record = on_record
        self.progress = progress
        self.progress_desc = progress_desc or self.fn_name
        self._procs: list = []
        self._conns: list = []
        self._lifelines: list = []
        self._stop_r, self._stop_w = None, None
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._store = None
        self._records: list[dict] = []
        self._returns: list = [None] * world_size
        self._returned: set[int] = set()
        self._closed_at: dict[int, float] = {}
        self._last_record: dict[int, dict] = {}
        self._failures: list[dict] = []
        self._t0 = 0.0
        self._stop_requested = threading.Event()
        self._started_ranks: set[int] = set()
        self._bar = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "Launch":
        """Start every rank and return immediately."""
        ctx = _context()
        self._t0 = time.perf_counter()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="ddplab-launch-")
        # The parent hosts this launch's store on a port the OS picks: no two
        # launches can ever meet at the same rendezvous.
        self._store = _loopback_store(self.world_size + 1, self.timeout + 60)
        port = self._store.port
        self._stop_r, self._stop_w = ctx.Pipe(duplex=False)
        environ = {**os.environ, **self.env}
        try:
            for rank in range(self.world_size):
                recv_end, send_end = ctx.Pipe(duplex=False)
                life_r, life_w = ctx.Pipe(duplex=False)
                out_path = os.path.join(self._tmpdir.name, f"rank{rank}.out")
                err_path = os.path.join(self._tmpdir.name, f"rank{rank}.err")
                proc = _RankProcess(
                    target=_rank_main, name=f"ddplab-rank{rank}",
                    args=(self._payload, rank, self.world_size, self.backend, port,
                          send_end, life_r, out_path, err_path, self.threads_per_rank,
                          environ, list(sys.path), os.getcwd(), self.timeout + 30))
                proc.start()
                # Close our copies of the child's ends so that EOF means "rank gone".
                send_end.close()
                life_r.close()
                self._procs.append(proc)
                self._conns.append(recv_end)
                self._lifelines.append(life_w)
            # Each rank learns its peers' pids, to tell later whether it failed
            # after one of them had died.
            pids = [p.pid for p in self._procs]
            for life_w in self._lifelines:
                try:
                    life_w.send(pids)
                except OSError:
                    pass  # that rank is already gone; the loop will say so
        except BaseException:
            self._shutdown()
            raise
        with _active_lock:
            _active.add(self)
        if self.progress:
            from ddplab.progress import progress_bar
            self._bar = progress_bar(total=self.progress, desc=self.progress_desc)
        return self

    def stop(self) -> None:
        """Ask a running launch to end every rank (safe from any thread)."""
        self._stop_requested.set()
        if self._stop_w is not None:
            try:
                self._stop_w.send(None)
            except OSError:
                pass

    def wait(self) -> LaunchResult:
        """Block until every rank returned; raise a :class:`LaunchError` otherwise."""
        if not self._procs:
            raise RuntimeError("Launch.wait() before start()")
        try:
            self._loop()
        except BaseException:
            self._shutdown()
            raise
        self._shutdown()
        return self._result()

    # -- the event loop ---------------------------------------------------------------

    def _handle(self, rank: int, msg) -> None:
        kind, body = msg
        if kind == "record":
            self._records.append(body)
            self._last_record[rank] = body
            if self.on_record is not None:
                self.on_record(body)
            for fn in list(_observers):
                fn(self, body)
            if self._bar is not None and rank == 0 and body.get("step") is not None:
                self._bar.update(max(0, min(self.progress, body["step"] + 1) - self._bar.n))
                self._bar.set_postfix_str(f"{body['metric']}={body['value']:.6g}", refresh=False)
        elif kind == "result":
            try:
                value = cloudpickle.loads(body)
            except Exception as exc:  # noqa: BLE001 - the rank's value, the launch's failure
                self._failures.append({
                    "kind": "unpickle", "rank": rank, "time": time.time(), "seen": time.perf_counter(),
                    "info": {"type": type(exc).__name__, "message": _exception_text(exc),
                             "traceback": traceback.format_exc()}})
                return
            self._returns[rank] = value
            self._returned.add(rank)
        elif kind == "error":
            self._failures.append({"kind": "error", "rank": rank, "time": body.get("time", time.time()),
                                   "seen": time.perf_counter(), "info": body})

    def _drain(self, rank: int) -> None:
        conn = self._conns[rank]
        try:
            while conn.poll():
                self._handle(rank, conn.recv())
        except (EOFError, OSError):
            pass

    def _loop(self) -> None:
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self._procs)}
        open_conns = set(conn_rank)
        exited: set[int] = set()
        deadline = self._t0 + self.timeout
        while len(self._returned) < self.world_size:
            now = time.perf_counter()
            if self._failures:
                grace_end = self._failures[0]["seen"] + FAILURE_GRACE
                if now >= grace_end or len(exited) == self.world_size:
                    self._raise_failure()
            else:
                grace_end = float("inf")
            waitables = [c for c in self._conns if id(c) in open_conns]
            waitables += [p.sentinel for r, p in enumerate(self._procs) if r not in exited]
            waitables.append(self._stop_r)
            remaining = deadline - now
            if remaining <= 0:
                self._fail_timeout()
            ready = mpc.wait(waitables, timeout=max(0.0, min(remaining, 1.0, grace_end - now)))
            # When a rank dies, its end of the pipe closes at once; the exit status
            # comes later, through the forkserver. The earlier clock dates the death.
            woke_at = time.time()
            if self._stop_requested.is_set():
                self._fail_stopped()
            for obj in ready:
                if obj is self._stop_r:
                    continue
                if isinstance(obj, int):
                    rank = sentinel_rank[obj]
                    exited.add(rank)
                    # Messages sent just before exit may still sit in the pipe.
                    self._drain(rank)
                    open_conns.discard(id(self._conns[rank]))
                    failed = any(f["rank"] == rank for f in self._failures)
                    if rank not in self._returned and not failed:
                        self._failures.append({"kind": "death", "rank": rank,
                                               "time": self._closed_at.get(rank, woke_at),
                                               "seen": time.perf_counter(),
                                               "code": self._procs[rank].exitcode})
                    continue
                rank = conn_rank[id(obj)]
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    open_conns.discard(id(obj))
                    self._closed_at.setdefault(rank, woke_at)
                    continue
                self._handle(rank, msg)

    # -- failures -----------------------------------------------------------------------

    def _partial(self) -> LaunchResult:
        self._shutdown()
        return self._result()

    @staticmethod
    def _death_text(code: int | None, started: bool = True) -> str:
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        if code == 70:
            return "exited because its parent went away"
        if not started:
            # No output file: the process ended before ddplab's rank code ran,
            # and its traceback (if any) went to the forkserver's stderr.
            return (f"exited with code {code} before ddplab's rank code started (nothing was "
                    f"captured; look in the stderr of the process that launched)")
        return f"exited with code {code} without returning or raising"

    @staticmethod
    def _failure_text(failure: dict, started: bool = True, brief: bool = False) -> str:
        """What a failure was: "raised T: message", "called sys.exit(2)", ..."""
        if failure["kind"] == "death":
            return Launch._death_text(failure["code"], started)
        info = failure["info"]
        message = info["message"]
        if brief:
            message = (message.splitlines() or [""])[0][:200]
        if failure["kind"] == "unpickle":
            return (f"returned a value this process cannot unpickle ({info['type']}"
                    + (f": {message})" if message else ")"))
        if info["type"] == "SystemExit":
            return f"called {message}"
        return f"raised {info['type']}" + (f": {message}" if message else "")

    def _raise_failure(self) -> None:
        """Stop everything and raise for the failure that caused the others.

        The cause is the earliest failure in time, whatever its kind: a rank
        that raised (dated by its own clock), died (dated by when its pipe
        closed) or returned a value this process cannot unpickle. Peers fail
        *after* it, in their next collective, or exit when an error handler
        (NCCL's async error handling) tears them down. Clocks alone cannot
        order a death and the error it causes a millisecond later, so an
        error raised when a failed peer was already dead ranks after it.
        """
        failed = {f["rank"] for f in self._failures}
        first = [f for f in self._failures
                 if not set(f.get("info", {}).get("dead_peers", ())) & (failed - {f["rank"]})]
        cause = min(first or self._failures, key=lambda f: f["time"])
        others = [f for f in self._failures if f is not cause]
        result = self._partial()
        rank = cause["rank"]
        started = self._output_started(rank)
        message = f"rank {rank} of {self.world_size} {self._failure_text(cause, started)}"
        if cause["kind"] == "error":
            message += f"\n--- remote traceback (rank {rank}) ---\n{cause['info']['traceback'].rstrip()}"
        elif cause["kind"] == "unpickle":
            message += (f"\n--- traceback (unpickling rank {rank}'s return value here) ---\n"
                        f"{cause['info']['traceback'].rstrip()}")
        err_tail = _tail(result.stderr[rank], 15)
        if err_tail.strip():
            message += f"\n--- rank {rank} stderr (last lines) ---\n{err_tail}"
        if others:
            lines = [f"  rank {f['rank']} {self._failure_text(f, brief=True)}"
                     for f in sorted(others, key=lambda f: f["time"])]
            message += "\n--- then, as a consequence ---\n" + "\n".join(lines)
        # The rank's own text is shown with its control characters escaped; the
        # attributes and result.stdout/stderr keep it as the rank wrote it.
        message = visible_controls(message)
        if cause["kind"] == "death":
            raise RankDied(message, result, rank, cause["code"])
        raise RankFailed(message, result, rank, cause["info"]["type"], cause["info"]["traceback"])

    def _output_started(self, rank: int) -> bool:
        """Whether rank ``rank`` got as far as creating its output files."""
        return rank in self._started_ranks

    def _fail_timeout(self) -> None:
        pending = [r for r in range(self.world_size) if r not in self._returned]
        returned = sorted(self._returned)
        # Ask the stuck ranks where they are before stopping them.
        for r in pending:
            proc = self._procs[r]
            if proc.is_alive() and proc.pid:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(0.3)
        for r in range(self.world_size):
            self._drain(r)
        result = self._partial()
        stacks = {r: _stack_from_dump(result.stderr[r]) for r in pending}
        last = {r: self._last_record.get(r) for r in pending}
        lines = [f"launch of {self.fn_name!r} timed out after {self.timeout:g} s "
                 f"(world_size={self.world_size}, backend={self.backend!r})",
                 f"returned: {returned or 'none'}; did not return: {pending}"]
        for r in pending:
            rec = last[r]
            if rec is None:
                lines.append(f"rank {r}: emitted no record")
            else:
                shown = {k: v for k, v in rec.items() if v is not None}
                lines.append(f"rank {r}: last record {shown}")
        for r in pending:
            if stacks[r]:
                lines.append(f"--- rank {r} stack at the timeout ---\n{stacks[r]}")
        raise LaunchTimeout(visible_controls("\n".join(lines)), result, returned, pending, last, stacks)

    def _fail_stopped(self) -> None:
        result = self._partial()
        raise LaunchStopped(f"launch of {self.fn_name!r} stopped on request", result)

    # -- teardown -----------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Stop every rank and everything it started; idempotent.

        Ranks get SIGTERM and :data:`STOP_GRACE` seconds, then SIGKILL goes to
        each rank's process group -- which still holds the children of a rank
        that already exited -- to the descendants of the live ranks, daemons
        that left the group included (each rank is a subreaper), and to what
        the forkserver adopted from ranks that are gone
        (:meth:`_kill_strays`). A second Ctrl-C skips the grace period, never
        the kill.
        """
        with _active_lock:
            _active.discard(self)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        procs = [p for p in self._procs if p.pid is not None]
        family: list = []
        interrupted = None
        try:
            family = self._stop_gently(procs)
        except KeyboardInterrupt as exc:
            interrupted = exc
        with _sigint_deferred():
            self._kill(procs, family)
            for c in self._lifelines + self._conns:
                c.close()
            self._lifelines = []
            for end in (self._stop_r, self._stop_w):
                if end is not None:
                    end.close()
            self._stop_r = self._stop_w = None
            self._store = None
        if interrupted is not None:
            raise interrupted

    def _stop_gently(self, procs: list) -> list:
        """SIGTERM the live ranks and wait up to STOP_GRACE; return their descendants."""
        from ddplab.process_tree import descendants

        alive = [p for p in procs if p.exitcode is None]
        # Ranks may have children of their own (DataLoader workers); once a rank
        # is gone they are re-parented and no longer found from it.
        family = [child for p in alive for child in descendants(p.pid)]
        if alive:
            # A rank that already sent its result is finishing on its own.
            deadline = time.perf_counter() + (0.5 if len(self._returned) == self.world_size else 0.0)
            for p in alive:
                p.join(max(0.0, deadline - time.perf_counter()))
            for p in alive:
                if p.exitcode is None:
                    p.terminate()
            deadline = time.perf_counter() + STOP_GRACE
            for p in alive:
                p.join(max(0.0, deadline - time.perf_counter()))
        return family

    @staticmethod
    def _kill(procs: list, family: list) -> None:
        """SIGKILL every rank, its process group and ``family``; reap the ranks."""
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
        Launch._kill_strays()

    @staticmethod
    def _kill_strays() -> None:
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

    def _read_outputs(self) -> tuple[list[str], list[str]]:
        outs, errs = [], []
        self._started_ranks = set()
        for rank in range(self.world_size):
            for dest, ext in ((outs, "out"), (errs, "err")):
                path = os.path.join(self._tmpdir.name, f"rank{rank}.{ext}") if self._tmpdir else ""
                try:
                    # newline="": a rank's "\r" stays "\r" (the text as the rank wrote it).
                    with open(path, errors="replace", newline="") as fh:
                        dest.append(fh.read())
                    self._started_ranks.add(rank)
                except OSError:
                    dest.append("")
        return outs, errs

    def _result(self) -> LaunchResult:
        if getattr(self, "_final", None) is not None:
            return self._final
        outs, errs = self._read_outputs()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None
        self._final = LaunchResult(
            world_size=self.world_size, backend=self.backend, returns=list(self._returns),
            stdout=outs, stderr=errs, wall_time=time.perf_counter() - self._t0,
            exitcodes=[p.exitcode for p in self._procs], record_list=self._records)
        return self._final


def launch(fn: Callable, world_size: int = 2, backend: str = "gloo", *, args: tuple = (),
           kwargs: dict | None = None, timeout: float = DEFAULT_TIMEOUT,
           threads_per_rank: int | None = None, env: dict[str, str] | None = None,
           on_record: Callable[[dict], None] | None = None, progress: int | None = None,
           progress_desc: str | None = None) -> LaunchResult:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return a :class:`LaunchResult`.

    torch.distributed is initialized on every rank (``backend`` "gloo" on CPU,
    "nccl" with one GPU per rank) before ``fn`` runs. Records emitted with
    :func:`ddplab.emit` stream back while the ranks run; ``on_record`` sees
    each one as it arrives and ``progress=N`` shows a bar fed by rank 0's
    ``step``. Any failure stops every rank and raises a :class:`LaunchError`
    subclass carrying the records gathered until then; ``timeout`` seconds
    without all ranks returning raises :class:`LaunchTimeout`. ``env`` adds
    environment variables for the ranks (e.g. ``{"NCCL_ALGO": "Tree"}``);
    each rank uses ``threads_per_rank`` intra-op threads (default: the cores
    divided among the ranks). Bad arguments raise ValueError before any
    process starts, ``args``/``kwargs`` that ``fn``'s signature does not
    accept included; ``world_size`` is capped by :func:`world_size_limit`.
    """
    runner = Launch(fn, world_size, backend, args=args, kwargs=kwargs, timeout=timeout,
                    threads_per_rank=threads_per_rank, env=env, on_record=on_record,
                    progress=progress, progress_desc=progress_desc)
    return runner.start().wait()
