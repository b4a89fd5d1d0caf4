"""Execute one notebook with papermill, in a subprocess, under a wall-clock timeout.

Papermill's own ``--execution-timeout`` is per cell, and a per-cell timeout or
a dead kernel leaves *no* error banner in the output notebook (papermill 2.7).
So the outcome is judged from the exit code, our own clock and the cells'
papermill status -- never from the notebook's look. Papermill saves the
output notebook after every cell, so a killed run still leaves the cells
that finished, and the one that was running is named in the outcome.

A :class:`StopRequest` (set by SIGINT, SIGTERM or SIGHUP while
:meth:`StopRequest.catching` is active) ends the run the same way: the whole
process tree is killed and the outcome is "interrupted". Each run gets a
temporary folder of its own as ``TMPDIR``, removed afterwards, so a killed
kernel leaves none of its temporary files (the launcher's rank outputs,
multiprocessing's ``pymp-*``) behind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import yaml

from ddplab.glossary import NotebookStatus
from ddplab.process_tree import descendants, kill_all, kill_tree

__all__ = ["ExecutionOutcome", "StopRequest", "execute_notebook", "skip_iri_checker", "STOP_SIGNALS"]

#: Signals that stop a run cleanly while :meth:`StopRequest.catching` is active.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Longest temporary folder a run's own folder goes in. The kernel's
#: forkserver listens on ``<folder>/pymp-*/listener-*``: the run's folder
#: name (19 bytes) and that (32) leave 56 of an AF_UNIX path's 107 bytes.
MAX_TMP_BASE = 56


def _scratch_dir() -> str:
    """A new temporary folder for one run, short enough for the kernel's sockets."""
    base = tempfile.gettempdir()
    if len(base) > MAX_TMP_BASE:
        base = next((d for d in ("/tmp", "/var/tmp") if os.access(d, os.W_OK)), base)
    return tempfile.mkdtemp(prefix="ddplab-nb-", dir=base)


def skip_iri_checker() -> None:
    """Keep jsonschema from loading its optional IRI checker in this process.

    jsonschema imports ``rfc3987_syntax`` when it is installed (JupyterLab's
    jupyter-events brings it), and that module builds a Lark grammar at
    import: 1.5-2 s of every process that imports nbformat, papermill or
    nbconvert. No notebook schema uses the "iri" format, so ddplab's own
    processes -- its command line and the papermill runner -- do without it.
    Call before nbformat is imported; a process that already has it keeps it.
    """
    sys.modules.setdefault("rfc3987_syntax", None)


#: papermill's command line, in a process that skips the IRI checker (2 s per notebook);
#: skip_iri_checker spelled out, as importing ddplab there would import torch.
_PAPERMILL_MAIN = ("import sys; sys.modules.setdefault('rfc3987_syntax', None); "
                   "from papermill.cli import papermill; papermill(prog_name='papermill')")

#: Seconds between two looks at a running notebook.
POLL_INTERVAL = 0.5
_CELL_LOG = re.compile(r"Executing Cell (\d+)")
#: Characters of each log line quoted in an error.
_LOG_LINE_CHARS = 300


@dataclasses.dataclass
class ExecutionOutcome:
    """How a notebook execution ended.

    ``failing_cell`` is the index (in the output notebook) of the cell that
    raised or was running when the run was stopped; ``error`` a short text.
    """

    status: NotebookStatus
    seconds: float
    returncode: int | None
    failing_cell: int | None = None
    error: str = ""
    log_path: str | None = None

    def __post_init__(self):
        self.status = NotebookStatus.parse(self.status)

    @property
    def ok(self) -> bool:
        return self.status == NotebookStatus.OK


class StopRequest:
    """A request to stop, made by a signal handler (or by code), polled by the runner.

    The handler only records the signal: it runs between any two bytecodes,
    and stopping the tree and writing the outcome must happen at a point
    the runner chooses (a lock taken in a handler can deadlock).
    """

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask to stop (the first request's signal is the one reported)."""
        if self.signum is None:
            self.signum = signum

    @contextlib.contextmanager
    def catching(self, signals: tuple = STOP_SIGNALS):
        """Turn ``signals`` into stop requests inside the block (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {}
        try:
            for sig in signals:
                previous[sig] = signal.signal(sig, lambda signum, frame: self.request(signum))
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill papermill, its kernel and everything the kernel started (ranks)."""
    kill_tree(proc.pid)
    proc.wait(timeout=10)


def _cell_status(nb_path: pathlib.Path) -> tuple[int | None, int | None, str]:
    """(first failed cell, first running cell, error text) from papermill's metadata."""
    try:
        nb = json.loads(nb_path.read_text())
    except (OSError, ValueError):
        return None, None, ""
    failed = running = None
    error = ""
    for i, cell in enumerate(nb.get("cells", [])):
        status = cell.get("metadata", {}).get("papermill", {}).get("status")
        if status == "failed" and failed is None:
            failed = i
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    error = f"{out.get('ename')}: {out.get('evalue')}"
        elif status == "running" and running is None:
            running = i
    return failed, running, error


def execute_notebook(notebook: str | os.PathLike, output: str | os.PathLike, *,
                     parameters: dict, timeout: float, cwd: str | os.PathLike | None = None,
                     kernel_name: str = "python3", env: dict | None = None,
                     log_path: str | os.PathLike | None = None,
                     on_poll: Callable[[float, int | None], None] | None = None,
                     stop: StopRequest | None = None) -> ExecutionOutcome:
    """Run ``notebook`` into ``output`` with ``parameters``; stop it after ``timeout`` s.

    ``on_poll(elapsed, cell)`` is called about every :data:`POLL_INTERVAL`
    seconds with the index of the cell papermill is executing (for progress).
    Once ``stop`` is requested the run is killed and ends "interrupted".

    ``kernel_name`` stays "python3", not the "ddplab" the notebooks name:
    ipykernel provides "python3" whether or not a spec was registered, and
    its command is plain ``python``, which jupyter_client replaces by the
    interpreter running papermill -- this one. So a report runs where
    ``make setup`` never registered "ddplab"; that spec is for JupyterLab.
    """
    output = pathlib.Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    log_path = pathlib.Path(log_path or output.with_suffix(".log"))
    params_path = output.with_suffix(".params.yaml")
    params_path.write_text(yaml.safe_dump(parameters, sort_keys=False))
    cmd = [sys.executable, "-c", _PAPERMILL_MAIN, str(notebook), str(output), "-f", str(params_path),
           "-k", kernel_name, "--log-output", "--no-progress-bar", "--log-level", "INFO",
           "--autosave-cell-every", "5"]
    if cwd is not None:
        cmd += ["--cwd", str(cwd)]
    scratch = _scratch_dir()
    full_env = {**os.environ, **(env or {}), "TMPDIR": scratch}
    stop = stop or StopRequest()
    t0 = time.perf_counter()
    try:
        stopped, returncode, cell = _wait(cmd, full_env, log_path, timeout, t0, on_poll, stop)
    finally:
        params_path.unlink(missing_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - t0
    if stopped is not None:  # interrupted or timed out: the cell that was running is named
        _, running, _ = _cell_status(output)
        error = (f"stopped by {stop.signal_name} after {seconds:.0f} s" if stopped == NotebookStatus.INTERRUPTED
                 else f"stopped after {timeout:g} s (per-notebook timeout)")
        return ExecutionOutcome(stopped, seconds, returncode,
                                failing_cell=running if running is not None else cell,
                                error=error, log_path=str(log_path))
    failed, running, error = _cell_status(output)
    log_text = log_path.read_text(errors="replace")
    if returncode == 0 and failed is None:
        return ExecutionOutcome(NotebookStatus.OK, seconds, 0, log_path=str(log_path))
    if failed is not None:
        return ExecutionOutcome(NotebookStatus.FAILED, seconds, returncode, failing_cell=failed,
                                error=error or "a cell raised", log_path=str(log_path))
    if "Kernel died" in log_text or "DeadKernelError" in log_text or returncode == 138:
        return ExecutionOutcome(NotebookStatus.KERNEL_DIED, seconds, returncode, failing_cell=running,
                                error="the kernel died while executing", log_path=str(log_path))
    # The log's last lines say why; a line of the notebook's own output can be megabytes long.
    tail = "\n".join(line[:_LOG_LINE_CHARS] for line in log_text.strip().splitlines()[-5:])
    return ExecutionOutcome(NotebookStatus.FAILED, seconds, returncode, failing_cell=running,
                            error=f"papermill exited with {returncode}: {tail}",
                            log_path=str(log_path))


def _wait(cmd: list[str], env: dict, log_path: pathlib.Path, timeout: float, t0: float,
          on_poll, stop: StopRequest) -> tuple[NotebookStatus | None, int | None, int | None]:
    """Run ``cmd``; return (None when it exited by itself, else the status it was stopped
    with: timed out or interrupted; return code; last cell seen in the log)."""
    cell = None
    family: list = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                elapsed = time.perf_counter() - t0
                if stop.requested or elapsed > timeout:
                    break
                # Remembered in case papermill dies first (a signal to the whole
                # terminal group): its kernel is then no longer found from it.
                family = descendants(proc.pid) or family
                if on_poll is not None:
                    cell = _last_cell(log_path) or cell
                    on_poll(elapsed, cell)
                time.sleep(POLL_INTERVAL)
            else:
                if not stop.requested:
                    return None, proc.returncode, cell
            _kill_tree(proc)
            kill_all(family)
        except BaseException:
            _kill_tree(proc)
            raise
    return (NotebookStatus.INTERRUPTED if stop.requested else NotebookStatus.TIMED_OUT), proc.returncode, cell


def _last_cell(log_path: pathlib.Path) -> int | None:
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 8192))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return None
    found = _CELL_LOG.findall(tail)
    return int(found[-1]) - 1 if found else None
