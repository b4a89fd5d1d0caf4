"""Execute one notebook with papermill, in a subprocess, under a wall-clock timeout.

Papermill's own ``--execution-timeout`` is per cell, and a per-cell timeout or
a dead kernel leaves *no* error banner in the output notebook (papermill 2.7).
So the outcome is judged from the exit code, our own clock and the cells'
papermill status -- never from the notebook's look. Papermill saves the
output notebook after every cell, so a killed run still leaves the cells
that finished, and the one that was running is named in the outcome.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Callable

import yaml

from ddplab.process_tree import kill_tree

__all__ = ["ExecutionOutcome", "execute_notebook", "STATUSES"]

#: What an execution can end as.
STATUSES = ("ok", "failed", "timed out", "kernel died")
#: Seconds between two looks at a running notebook.
POLL_INTERVAL = 0.5
_CELL_LOG = re.compile(r"Executing Cell (\d+)")


@dataclasses.dataclass
class ExecutionOutcome:
    """How a notebook execution ended.

    ``failing_cell`` is the index (in the output notebook) of the cell that
    raised or was running when the run was stopped; ``error`` a short text.
    """

    status: str
    seconds: float
    returncode: int | None
    failing_cell: int | None = None
    error: str = ""
    log_path: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


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
                     on_poll: Callable[[float, int | None], None] | None = None) -> ExecutionOutcome:
    """Run ``notebook`` into ``output`` with ``parameters``; stop it after ``timeout`` s.

    ``on_poll(elapsed, cell)`` is called about every :data:`POLL_INTERVAL`
    seconds with the index of the cell papermill is executing (for progress).
    """
    output = pathlib.Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    log_path = pathlib.Path(log_path or output.with_suffix(".log"))
    params_path = output.with_suffix(".params.yaml")
    params_path.write_text(yaml.safe_dump(parameters, sort_keys=False))
    cmd = [sys.executable, "-m", "papermill", str(notebook), str(output), "-f", str(params_path),
           "-k", kernel_name, "--log-output", "--no-progress-bar", "--log-level", "INFO",
           "--autosave-cell-every", "5"]
    if cwd is not None:
        cmd += ["--cwd", str(cwd)]
    full_env = {**os.environ, **(env or {})}
    t0 = time.perf_counter()
    try:
        timed_out, returncode, cell = _wait(cmd, full_env, log_path, timeout, t0, on_poll)
    finally:
        params_path.unlink(missing_ok=True)
    if timed_out:
        _, running, _ = _cell_status(output)
        return ExecutionOutcome("timed out", time.perf_counter() - t0, returncode,
                                failing_cell=running if running is not None else cell,
                                error=f"stopped after {timeout:g} s (per-notebook timeout)",
                                log_path=str(log_path))
    seconds = time.perf_counter() - t0
    failed, running, error = _cell_status(output)
    log_text = log_path.read_text(errors="replace")
    if returncode == 0 and failed is None:
        return ExecutionOutcome("ok", seconds, 0, log_path=str(log_path))
    if failed is not None:
        return ExecutionOutcome("failed", seconds, returncode, failing_cell=failed,
                                error=error or "a cell raised", log_path=str(log_path))
    if "Kernel died" in log_text or "DeadKernelError" in log_text or returncode == 138:
        return ExecutionOutcome("kernel died", seconds, returncode, failing_cell=running,
                                error="the kernel died while executing", log_path=str(log_path))
    tail = "\n".join(log_text.strip().splitlines()[-5:])
    return ExecutionOutcome("failed", seconds, returncode, failing_cell=running,
                            error=f"papermill exited with {returncode}: {tail}",
                            log_path=str(log_path))


def _wait(cmd: list[str], env: dict, log_path: pathlib.Path, timeout: float, t0: float,
          on_poll) -> tuple[bool, int | None, int | None]:
    """Run ``cmd``; return (timed out?, return code, last cell seen in the log)."""
    cell = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                elapsed = time.perf_counter() - t0
                if elapsed > timeout:
                    _kill_tree(proc)
                    return True, proc.returncode, cell
                if on_poll is not None:
                    cell = _last_cell(log_path) or cell
                    on_poll(elapsed, cell)
                time.sleep(POLL_INTERVAL)
        except BaseException:
            _kill_tree(proc)
            raise
    return False, proc.returncode, cell


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
