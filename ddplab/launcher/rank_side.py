"""The rank's side of a launch: what runs in each rank process, from its start to ``os._exit``.

:func:`rank_main` is the target the parent starts (in a child of the
forkserver). It leads its own process group, captures its output at the
file-descriptor level, takes the parent's environment of now, watches the
parent, runs ``fn`` in the process group and sends back the result, the
records and, on failure, a :class:`~ddplab.launcher.results.RankFailure`.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import traceback

import cloudpickle

from ddplab import records as _records
from ddplab.launcher.results import FailureKind, RankFailure

__all__ = ["rank_main", "load_payload", "exception_text", "dead_peers", "PARENT_GONE_EXIT"]

#: The exit code of a rank that ended itself because its parent went away.
PARENT_GONE_EXIT = 70
#: The kernel's "this task is exiting" flag in /proc/<pid>/stat (set before
#: the task's sockets close, so a peer that sees a closed connection sees it).
_PF_EXITING = 0x4


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, never raising: ``sys.exit()`` and an exception whose
    ``__str__`` raises still say what happened."""
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r})"
    try:
        return str(exc)
    except Exception as err:  # noqa: BLE001 - the message is what failed
        return f"<its __str__ raised {type(err).__name__}>"


def load_payload(payload: bytes):
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
            f"{exception_text(exc)}). Objects from importable modules travel by reference and "
            f"the rank imports them by name: put the module on sys.path, or call "
            f"cloudpickle.register_pickle_by_value(module) before launching to send it by value"
        ) from exc


def dead_peers(pids: list[int]) -> list[int]:
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


def _lead_own_group() -> None:
    """Lead a process group, and adopt orphans (Linux), so the parent can stop all this rank starts.

    Whatever this rank starts shares the group, even once this rank has
    exited; a daemon that left the group by ``setsid()`` and whose own
    parent exited stays among this rank's descendants.
    """
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    from ddplab.process_tree import become_subreaper

    become_subreaper()


def _capture_output(out_path: str, err_path: str) -> None:
    """Send fds 1 and 2 to the files (so C++ output of gloo and NCCL lands too), line-buffered."""
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    # The parent asks for every thread's stack with SIGUSR1 when diagnosing a hang.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def _adopt_parent_state(environ: dict, sys_path: list, cwd: str) -> None:
    """Take the parent's environment, path and folder of now.

    The forkserver was started with the parent's environment of back then;
    ranks must see the parent's environment of now (NCCL_ALGO set in a cell).
    """
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass


def _watch_parent(lifeline, peers: list[int]) -> None:
    """Fill ``peers`` from the lifeline; when it closes, kill all this rank started and exit.

    The parent writes the ranks' pids once, then nothing: EOF means it is
    gone, and an orphaned rank must not wait in a collective for 30
    minutes -- nor leave behind what it started.
    """
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
    os._exit(PARENT_GONE_EXIT)


def _run(payload: bytes, rank: int, world_size: int, backend: str, port: int, threads: int,
         collective_timeout: float, send) -> None:
    """Join the process group, run ``fn`` and send its pickled value; raise what fails."""
    import torch
    import torch.distributed as dist
    from ddplab.rank import setup_rank, teardown_rank

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=collective_timeout))
    setup_rank(rank, world_size, backend, store=store, timeout=collective_timeout)
    fn, args, kwargs = load_payload(payload)
    value = fn(*args, **kwargs)
    try:
        blob = cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001 - reported to the parent verbatim
        raise TypeError(f"rank {rank}'s return value could not be pickled: "
                        f"{exception_text(exc)}") from exc
    send(("result", blob))
    teardown_rank()


def _report_failure(exc: BaseException, rank: int, peers: list[int], send) -> None:
    """Send the parent a :class:`RankFailure` for ``exc``, naming the peers already dead."""
    failed_at = time.time()
    # Peers already dead by now failed first: this error may be their consequence.
    dead = tuple(r for r in dead_peers(list(peers)) if r != rank)
    try:
        tb = traceback.format_exc()
    except Exception:  # noqa: BLE001 - a traceback that cannot be formatted
        tb = f"{type(exc).__name__} (its traceback could not be formatted)"
    try:
        send(("error", RankFailure(FailureKind.ERROR, rank, failed_at, exc_type=type(exc).__name__,
                                   message=exception_text(exc), traceback=tb, dead_peers=dead)))
    except Exception:  # noqa: BLE001 - the pipe may be gone with the parent
        pass


def _exit(code: int) -> None:
    """Flush, release multiprocessing's resources, and end the process without interpreter teardown."""
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


def rank_main(payload: bytes, rank: int, world_size: int, backend: str, port: int,
              conn, lifeline, out_path: str, err_path: str, threads: int,
              environ: dict, sys_path: list, cwd: str, collective_timeout: float) -> None:
    """Entry point of a rank process (runs in a child of the forkserver); never returns."""
    _lead_own_group()
    _capture_output(out_path, err_path)
    _adopt_parent_state(environ, sys_path, cwd)
    peers: list[int] = []  # every rank's pid, once all have started
    threading.Thread(target=_watch_parent, args=(lifeline, peers), name="ddplab-lifeline",
                     daemon=True).start()
    send_lock = threading.Lock()

    def send(msg) -> None:
        # Comm hooks may emit from autograd threads; one message at a time.
        with send_lock:
            conn.send(msg)

    _records.set_sink(lambda rec: send(("record", rec)))
    code = 0
    try:
        _run(payload, rank, world_size, backend, port, threads, collective_timeout, send)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        code = 1
        _report_failure(exc, rank, peers, send)
    finally:
        _exit(code)
