"""Progress bars that work in JupyterLab, in batch reports and in a terminal.

In a live notebook ``tqdm.auto`` draws a widget. In batch runs --
``DDPLAB_BATCH=1``, which ``ddplab report`` sets -- nothing is drawn in the
notebook (a text bar goes to stderr, which a report would show as an error
block); instead each bar appends its state as one JSON line to the file named
by ``DDPLAB_PROGRESS_FILE``, from which ``ddplab report`` prints one updating
line per case (:func:`read_progress`). ``TQDM_DISABLE=1`` silences every bar.
"""
from __future__ import annotations

import json
import os
import sys
import time

__all__ = ["in_batch", "progress_bar", "note", "FileProgress", "read_progress", "PROGRESS_FILE_ENV"]

#: The environment variable naming the batch progress file.
PROGRESS_FILE_ENV = "DDPLAB_PROGRESS_FILE"
#: At most one line per bar this often (seconds), plus the first and the last.
FILE_INTERVAL = 1.0


def in_batch() -> bool:
    """True when running a batch job (papermill under ``ddplab report``)."""
    return os.environ.get("DDPLAB_BATCH", "") not in ("", "0")


class FileProgress:
    """The part of tqdm's interface the launcher uses, written as JSON lines to a file.

    Each line: ``{"desc", "n", "total", "t"}`` (t: seconds since the epoch).
    A bar with no file (batch run outside ``ddplab report``) records nothing.
    """

    def __init__(self, total: int, desc: str = "", path: str | None = None):
        self.total, self.desc, self.n = int(total), desc, 0
        self._path = path
        self._last = 0.0
        self._write(force=True)

    def _write(self, force: bool = False) -> None:
        now = time.time()
        if self._path is None or (not force and now - self._last < FILE_INTERVAL):
            return
        self._last = now
        line = json.dumps({"desc": self.desc, "n": self.n, "total": self.total, "t": now})
        try:
            with open(self._path, "a") as fh:
                fh.write(line + "\n")
        except OSError:
            self._path = None   # progress is a courtesy: never fail a run over it

    def update(self, n: int = 1) -> None:
        self.n += n
        self._write(force=self.n >= self.total)

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        """Accepted for tqdm compatibility; the file records steps only."""

    def close(self) -> None:
        self._write(force=True)


def progress_bar(total: int, desc: str = ""):
    """A progress bar for ``total`` steps that suits where it runs (see the module docstring)."""
    disable = os.environ.get("TQDM_DISABLE", "") not in ("", "0")
    if in_batch():
        return FileProgress(total, desc, None if disable else os.environ.get(PROGRESS_FILE_ENV))
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=disable)


def note(text: str) -> None:
    """A line shown with the progress bars, where they are drawn: on stderr beside a text bar or a
    notebook's widgets; nowhere in a batch run (stderr reads as an error there) or with ``TQDM_DISABLE=1``."""
    if in_batch() or os.environ.get("TQDM_DISABLE", "") not in ("", "0"):
        return
    print(text, file=sys.stderr, flush=True)


def read_progress(path: str | os.PathLike) -> dict[str, dict]:
    """The latest state of every bar in a progress file: ``{desc: {"n", "total", "t"}}``, in start order."""
    bars: dict[str, dict] = {}
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    state = json.loads(line)
                except json.JSONDecodeError:
                    continue   # a line being written right now
                bars[state["desc"]] = state
    except OSError:
        return {}
    return bars
