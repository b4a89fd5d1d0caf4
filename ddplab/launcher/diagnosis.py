"""Why a launch failed, read from what the parent collected: pure functions, no process.

* :func:`root_cause`: which rank's failure caused the others.
* :func:`failure_message`: the text of the error raised for it.
* :func:`last_dump` / :func:`place_of`: a rank's stack from the faulthandler
  dump the parent asks for at a timeout, and whether the rank waits in a
  collective there (:func:`in_collective`).
* :func:`not_in_collective`: the ranks that keep out of the collective the
  others wait in -- the ones that hang the launch.
* :class:`Hang`: all of a timeout's findings, and its message.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal

from ddplab.formatting import visible_controls
from ddplab.launcher.rank_side import PARENT_GONE_EXIT, rank_main
from ddplab.launcher.results import FailureKind, RankFailure

__all__ = ["STACK_LINES", "WAIT_PLACES", "Frame", "ThreadStack", "RankPlace", "Hang", "tail",
           "stack_from_dump", "last_dump", "main_thread", "in_collective", "place_of",
           "not_in_collective", "death_text", "failure_text", "root_cause", "failure_message"]

#: How many lines of a stuck rank's Python stack go into a timeout message.
STACK_LINES = 30
#: Where the innermost torch frames of a rank lie while it waits for its peers
#: (paths inside the torch package): a collective, barrier or store call, or
#: FSDP's hooks (torch.distributed); DDP's forward (its module); backward,
#: where DDP's and FSDP's gradient reductions are waited for (autograd's engine).
WAIT_PLACES = ("torch/distributed/", "torch/nn/parallel/distributed.py", "torch/autograd/")
#: Frames a wait passes through on its way into torch: ddplab's collective recorder (a kernel at
#: the c10d dispatcher that waits for each collective) and the lock it waits on.
PASS_THROUGH = ("ddplab/collectives/", "threading.py")
#: The rank's entry frame, which marks its main thread in a dump.
_ENTRY = (os.path.basename(rank_main.__code__.co_filename), rank_main.__name__)
_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):$")
_FRAME_LINE = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
#: Lines a faulthandler dump holds besides headers and frames.
_DUMP_FILLER = ("", "  ...", "  <no Python frame>")


# --------------------------------------------------------------------------- text tails


def tail(text: str, lines: int) -> str:
    """The last ``lines`` lines of ``text``, split at newlines only (splitlines() would also
    split at, and drop, the carriage returns and separators a rank printed)."""
    return "\n".join(text.rstrip("\n").split("\n")[-lines:])


def stack_from_dump(stderr_text: str) -> str:
    """The faulthandler dump in a rank's stderr (its stack at the timeout), as text to show."""
    marker = stderr_text.rfind("Thread 0x")
    first = stderr_text.find("Thread 0x") if marker >= 0 else -1
    if first < 0:
        marker = stderr_text.rfind("Stack (most recent call first)")
        return tail(stderr_text[marker:], STACK_LINES) if marker >= 0 else ""
    return tail(stderr_text[first:], STACK_LINES * 4)


# --------------------------------------------------------------------------- stacks


@dataclasses.dataclass(frozen=True)
class Frame:
    """One Python frame of a dump: file, line and function."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"

    def lies_in(self, place: str) -> bool:
        """Whether the file is ``place`` (a path inside the torch package, "/"-separated) or below it."""
        return f"/{place}" in "/" + self.file.replace("\\", "/")


@dataclasses.dataclass(frozen=True)
class ThreadStack:
    """One thread of a dump; ``current`` marks the thread that wrote it (took the signal)."""

    current: bool
    frames: tuple[Frame, ...]  # most recent call first


def last_dump(stderr_text: str) -> list[ThreadStack]:
    """The threads of the last faulthandler dump in ``stderr_text`` (empty when there is none).

    A dump is a run of thread headers, frame lines and blank lines; any
    other line (the rank's own output) ends it.
    """
    dumps: list[list[ThreadStack]] = []
    threads: list[ThreadStack] | None = None
    for line in stderr_text.split("\n"):
        header = _THREAD_HEADER.match(line)
        frame = _FRAME_LINE.match(line)
        if header:
            if threads is None:
                threads = []
                dumps.append(threads)
            threads.append(ThreadStack(header.group(1) == "Current thread", ()))
        elif threads is not None and frame and threads:
            last = threads[-1]
            new = Frame(frame.group(1), int(frame.group(2)), frame.group(3))
            threads[-1] = dataclasses.replace(last, frames=last.frames + (new,))
        elif line not in _DUMP_FILLER:
            threads = None
    return dumps[-1] if dumps else []


def main_thread(threads: list[ThreadStack]) -> ThreadStack | None:
    """The thread that runs the rank's function: the one with the rank's entry frame.

    A stack deeper than faulthandler's 100 frames loses its outermost ones,
    the entry among them; then the thread that took the signal, which on
    Linux is the main thread unless it blocks the signal.
    """
    for thread in threads:
        if any((os.path.basename(f.file), f.function) == _ENTRY for f in thread.frames):
            return thread
    return next((t for t in threads if t.current), None)


def in_collective(frames: tuple[Frame, ...]) -> bool:
    """Whether a thread stopped at ``frames`` (most recent first) waits for its peers.

    It does when its innermost frames that lie in torch -- the torch call
    the user's code is in -- include a :data:`WAIT_PLACES` frame. A user
    frame below a collective (a comm hook, a module's forward) is the
    user's own work, not a wait. A wait on an async ``Work`` object runs in
    C++ with no torch frame above the caller, and is not seen as one.
    """
    for frame in frames:
        if any(frame.lies_in(place) for place in PASS_THROUGH):
            continue
        if not frame.lies_in("torch/"):
            return False
        if any(frame.lies_in(place) for place in WAIT_PLACES):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where a rank's main thread was at the timeout.

    ``frame`` is its innermost frame; ``waits_in``, when it waits for its
    peers, the innermost frame of the collective (or backward) it waits in.
    """

    frame: Frame
    waits_in: Frame | None = None

    @property
    def in_collective(self) -> bool:
        return self.waits_in is not None


def place_of(stderr_text: str) -> RankPlace | None:
    """Where the last dump in a rank's stderr shows its main thread; None without one."""
    thread = main_thread(last_dump(stderr_text))
    if thread is None or not thread.frames:
        return None
    waits_in = None
    if in_collective(thread.frames):
        waits_in = next(f for f in thread.frames if any(f.lies_in(p) for p in WAIT_PLACES))
    return RankPlace(thread.frames[0], waits_in)


def not_in_collective(places: dict[int, RankPlace | None], returned: list[int]) -> list[int]:
    """The ranks outside the collective the others wait in, sorted; empty when none waits in one.

    ``places`` holds each rank that did not return (None: no dump read);
    ranks that returned are outside any collective, so they count too.
    A rank without a dump is left out: nothing says where it was.
    """
    if not any(p is not None and p.in_collective for p in places.values()):
        return []
    outside = [r for r, p in places.items() if p is not None and not p.in_collective]
    return sorted([*returned, *outside])


@dataclasses.dataclass(frozen=True)
class Hang:
    """What a timeout found: who returned, each stuck rank's last record, stack and place."""

    returned: list[int]
    pending: list[int]
    last_records: dict[int, dict | None]
    stacks: dict[int, str]
    places: dict[int, RankPlace | None]
    not_in_collective: list[int]

    @classmethod
    def from_outputs(cls, returned: list[int], pending: list[int],
                     last_records: dict[int, dict | None], stderr: list[str]) -> "Hang":
        """The findings from each rank's stderr (holding its dump) and last record."""
        places = {r: place_of(stderr[r]) for r in pending}
        return cls(returned, pending, {r: last_records.get(r) for r in pending},
                   {r: stack_from_dump(stderr[r]) for r in pending}, places,
                   not_in_collective(places, returned))

    def message(self, fn_name: str, timeout: float, world_size: int, backend: str) -> str:
        """The timeout's text, control characters escaped."""
        lines = [f"launch of {fn_name!r} timed out after {timeout:g} s "
                 f"(world_size={world_size}, backend={backend!r})",
                 f"returned: {self.returned or 'none'}; did not return: {self.pending}"]
        for r in self.not_in_collective:
            place = self.places.get(r)
            where = f"it is at {place.frame}" if place is not None else "it returned"
            lines.append(f"rank {r} is not in the collective the others wait in: {where}")
        for r in self.pending:
            rec = self.last_records[r]
            if rec is None:
                lines.append(f"rank {r}: emitted no record")
            else:
                shown = {k: v for k, v in rec.items() if v is not None}
                lines.append(f"rank {r}: last record {shown}")
        for r in self.pending:
            if self.stacks[r]:
                lines.append(f"--- rank {r} stack at the timeout ---\n{self.stacks[r]}")
        return visible_controls("\n".join(lines))


# --------------------------------------------------------------------------- failures


def death_text(code: int | None, started: bool = True) -> str:
    """How a rank's process ended, from its exit code ("was killed by SIGKILL", ...)."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == PARENT_GONE_EXIT:
        return "exited because its parent went away"
    if not started:
        # No output file: the process ended before ddplab's rank code ran,
        # and its traceback (if any) went to the forkserver's stderr.
        return (f"exited with code {code} before ddplab's rank code started (nothing was "
                f"captured; look in the stderr of the process that launched)")
    return f"exited with code {code} without returning or raising"


def failure_text(failure: RankFailure, started: bool = True, brief: bool = False) -> str:
    """What a failure was: "raised T: message", "called sys.exit(2)", ...; ``brief``: the message's first line."""
    if failure.kind == FailureKind.DEATH:
        return death_text(failure.exitcode, started)
    message = failure.message
    if brief:
        message = (message.splitlines() or [""])[0][:200]
    if failure.kind == FailureKind.UNPICKLE:
        return (f"returned a value this process cannot unpickle ({failure.exc_type}"
                + (f": {message})" if message else ")"))
    if failure.exc_type == "SystemExit":
        return f"called {message}"
    return f"raised {failure.exc_type}" + (f": {message}" if message else "")


def root_cause(failures: list[RankFailure]) -> tuple[RankFailure, list[RankFailure]]:
    """The failure that caused the others, and the others in time order.

    The cause is the earliest failure in time, whatever its kind: a rank
    that raised (dated by its own clock), died (dated by when its pipe
    closed) or returned a value this process cannot unpickle. Peers fail
    *after* it, in their next collective, or exit when an error handler
    (NCCL's async error handling) tears them down. Clocks alone cannot
    order a death and the error it causes a millisecond later, so an
    error raised when a failed peer was already dead ranks after it.
    """
    if not failures:
        raise ValueError("root_cause needs at least one failure")
    failed = {f.rank for f in failures}
    first = [f for f in failures if not set(f.dead_peers) & (failed - {f.rank})]
    cause = min(first or failures, key=lambda f: f.time)
    others = sorted((f for f in failures if f is not cause), key=lambda f: f.time)
    return cause, others


def failure_message(cause: RankFailure, others: list[RankFailure], world_size: int,
                    started: bool, stderr: str) -> str:
    """The error's text: the cause, its traceback, its stderr's tail, then the consequences.

    The rank's own text is shown with its control characters escaped; the
    error's attributes and ``result.stdout/stderr`` keep it as the rank wrote it.
    """
    rank = cause.rank
    message = f"rank {rank} of {world_size} {failure_text(cause, started)}"
    if cause.kind == FailureKind.ERROR:
        message += f"\n--- remote traceback (rank {rank}) ---\n{cause.traceback.rstrip()}"
    elif cause.kind == FailureKind.UNPICKLE:
        message += (f"\n--- traceback (unpickling rank {rank}'s return value here) ---\n"
                    f"{cause.traceback.rstrip()}")
    err_tail = tail(stderr, 15)
    if err_tail.strip():
        message += f"\n--- rank {rank} stderr (last lines) ---\n{err_tail}"
    if others:
        lines = [f"  rank {f.rank} {failure_text(f, brief=True)}" for f in others]
        message += "\n--- then, as a consequence ---\n" + "\n".join(lines)
    return visible_controls(message)
