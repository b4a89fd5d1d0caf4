"""One launch from start to teardown: :class:`Launch`, :func:`launch`, and the process-wide hooks.

The parent hosts a loopback-only rendezvous store, starts the ranks from
the forkserver, then waits on one pipe per rank and on the process
sentinels at once: an exception, a death by signal or a hang is seen the
moment it happens, every rank is stopped, and records emitted before the
failure are kept on the exception (``err.result.records``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing.connection as mpc
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

from ddplab.launcher import diagnosis, forkserver
from ddplab.launcher.forkserver import _RankProcess
from ddplab.launcher.limits import DEFAULT_TIMEOUT, check_launch
from ddplab.launcher.rank_side import exception_text, rank_main
from ddplab.launcher.results import (FailureKind, LaunchResult, LaunchStopped, LaunchTimeout,
                                     RankDied, RankFailed, RankFailure)

__all__ = ["FAILURE_GRACE", "Launch", "launch", "observe", "stop_all"]

#: After a first failure, how long to keep listening before naming the cause:
#: a rank killed by a signal makes its peers fail in their next collective, and
#: their errors can reach the parent before the death is seen.
FAILURE_GRACE = 0.4


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


# --------------------------------------------------------------------------- helpers


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


def _read_outputs(folder: str | None, world_size: int) -> tuple[list[str], list[str], set[int]]:
    """Each rank's captured stdout and stderr, and the ranks that got as far as creating them."""
    outs, errs, started = [], [], set()
    for rank in range(world_size):
        for dest, ext in ((outs, "out"), (errs, "err")):
            path = os.path.join(folder, f"rank{rank}.{ext}") if folder else ""
            try:
                # newline="": a rank's "\r" stays "\r" (the text as the rank wrote it).
                with open(path, errors="replace", newline="") as fh:
                    dest.append(fh.read())
                started.add(rank)
            except OSError:
                dest.append("")
    return outs, errs, started


def _ask_for_stacks(procs: list) -> None:
    """Have each live rank write every thread's stack to its stderr (SIGUSR1), and give it time to."""
    for proc in procs:
        if proc.is_alive() and proc.pid:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.3)


# --------------------------------------------------------------------------- the launch


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
        env = check_launch(fn, world_size, backend, timeout, args, kwargs, threads_per_rank, env,
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
        self._failures: list[RankFailure] = []
        self._t0 = 0.0
        self._extended = 0.0     # seconds added to the deadline (:meth:`extend`)
        self._stop_requested = threading.Event()
        self._started_ranks: set[int] = set()
        self._bar = None
        self._final: LaunchResult | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "Launch":
        """Start every rank and return immediately."""
        self._t0 = time.perf_counter()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="ddplab-launch-")
        # The parent hosts this launch's store on a port the OS picks: no two
        # launches can ever meet at the same rendezvous.
        self._store = _loopback_store(self.world_size + 1, self.timeout + 60)
        self._stop_r, self._stop_w = forkserver.context().Pipe(duplex=False)
        environ = {**os.environ, **self.env}
        try:
            for rank in range(self.world_size):
                self._start_rank(rank, self._store.port, environ)
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

    def _start_rank(self, rank: int, port: int, environ: dict[str, str]) -> None:
        ctx = forkserver.context()
        recv_end, send_end = ctx.Pipe(duplex=False)
        life_r, life_w = ctx.Pipe(duplex=False)
        out_path = os.path.join(self._tmpdir.name, f"rank{rank}.out")
        err_path = os.path.join(self._tmpdir.name, f"rank{rank}.err")
        proc = _RankProcess(
            target=rank_main, name=f"ddplab-rank{rank}",
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

    def stop(self) -> None:
        """Ask a running launch to end every rank (safe from any thread)."""
        self._stop_requested.set()
        if self._stop_w is not None:
            try:
                self._stop_w.send(None)
            except OSError:
                pass

    def extend(self, seconds: float) -> None:
        """Move the deadline ``seconds`` later (safe from any thread): time the ranks spent waiting
        for the parent, not hanging (a comparison's ranks wait while it judges their steps)."""
        self._extended += max(0.0, float(seconds))

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

    def _handle(self, rank: int, msg: tuple[str, Any]) -> None:
        kind, body = msg
        if kind == "record":
            self._on_record(rank, body)
        elif kind == "result":
            try:
                value = cloudpickle.loads(body)
            except Exception as exc:  # noqa: BLE001 - the rank's value, the launch's failure
                self._failures.append(RankFailure(
                    FailureKind.UNPICKLE, rank, time.time(), time.perf_counter(),
                    exc_type=type(exc).__name__, message=exception_text(exc),
                    traceback=traceback.format_exc()))
                return
            self._returns[rank] = value
            self._returned.add(rank)
        elif kind == "error":
            self._failures.append(dataclasses.replace(body, seen=time.perf_counter()))

    def _on_record(self, rank: int, record: dict) -> None:
        self._records.append(record)
        self._last_record[rank] = record
        if self.on_record is not None:
            self.on_record(record)
        for fn in list(_observers):
            fn(self, record)
        if self._bar is not None and rank == 0 and record.get("step") is not None:
            self._bar.update(max(0, min(self.progress, record["step"] + 1) - self._bar.n))
            self._bar.set_postfix_str(f"{record['metric']}={record['value']:.6g}", refresh=False)

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
        while len(self._returned) < self.world_size:
            now = time.perf_counter()
            deadline = self._t0 + self.timeout + self._extended
            if self._failures:
                grace_end = self._failures[0].seen + FAILURE_GRACE
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
                raise LaunchStopped(f"launch of {self.fn_name!r} stopped on request", self._partial())
            for obj in ready:
                if obj is self._stop_r:
                    continue
                if isinstance(obj, int):
                    rank = sentinel_rank[obj]
                    exited.add(rank)
                    self._on_exit(rank, woke_at)
                    open_conns.discard(id(self._conns[rank]))
                    continue
                rank = conn_rank[id(obj)]
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    open_conns.discard(id(obj))
                    self._closed_at.setdefault(rank, woke_at)
                    continue
                self._handle(rank, msg)

    def _on_exit(self, rank: int, woke_at: float) -> None:
        """A rank's process ended: read what it sent last; a death unless it returned or failed."""
        # Messages sent just before exit may still sit in the pipe.
        self._drain(rank)
        if rank not in self._returned and not any(f.rank == rank for f in self._failures):
            self._failures.append(RankFailure(
                FailureKind.DEATH, rank, self._closed_at.get(rank, woke_at), time.perf_counter(),
                exitcode=self._procs[rank].exitcode))

    # -- failures -----------------------------------------------------------------------

    def _raise_failure(self) -> None:
        """Stop everything and raise for the failure that caused the others (:func:`diagnosis.root_cause`)."""
        cause, others = diagnosis.root_cause(self._failures)
        result = self._partial()
        rank = cause.rank
        message = diagnosis.failure_message(cause, others, self.world_size,
                                            rank in self._started_ranks, result.stderr[rank])
        if cause.kind == FailureKind.DEATH:
            raise RankDied(message, result, rank, cause.exitcode)
        raise RankFailed(message, result, rank, cause.exc_type, cause.traceback)

    def _fail_timeout(self) -> None:
        pending = [r for r in range(self.world_size) if r not in self._returned]
        _ask_for_stacks([self._procs[r] for r in pending])
        for r in range(self.world_size):
            self._drain(r)
        result = self._partial()
        hang = diagnosis.Hang.from_outputs(sorted(self._returned), pending, self._last_record,
                                           result.stderr)
        raise LaunchTimeout(hang.message(self.fn_name, self.timeout, self.world_size, self.backend),
                            result, hang.returned, hang.pending, hang.last_records, hang.stacks,
                            hang.places, hang.not_in_collective)

    def _partial(self) -> LaunchResult:
        self._shutdown()
        return self._result()

    # -- teardown -----------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Stop every rank and everything it started; idempotent.

        Ranks get SIGTERM and :data:`~ddplab.launcher.forkserver.STOP_GRACE`
        seconds, then SIGKILL goes to each rank's process group -- which still
        holds the children of a rank that already exited -- to the descendants
        of the live ranks, daemons that left the group included (each rank is
        a subreaper), and to what the forkserver adopted from ranks that are
        gone (:func:`~ddplab.launcher.forkserver.kill_strays`). A second
        Ctrl-C skips the grace period, never the kill.
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
            family = forkserver.stop_gently(procs, finishing=len(self._returned) == self.world_size)
        except KeyboardInterrupt as exc:
            interrupted = exc
        with _sigint_deferred():
            forkserver.kill_ranks(procs, family)
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

    def _result(self) -> LaunchResult:
        if self._final is not None:
            return self._final
        outs, errs, self._started_ranks = _read_outputs(
            self._tmpdir.name if self._tmpdir else None, self.world_size)
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
