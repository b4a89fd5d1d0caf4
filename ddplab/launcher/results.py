"""What a launch hands back: its result, the errors it raises, and each rank's failure.

A :class:`RankFailure` is one rank's failure as the parent saw it; the
errors (:class:`RankFailed`, :class:`RankDied`) are raised for the one
:func:`ddplab.launcher.diagnosis.root_cause` picks.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from ddplab import records as _records

if TYPE_CHECKING:
    from ddplab.launcher.diagnosis import RankPlace

__all__ = ["FailureKind", "RankFailure", "LaunchResult", "LaunchError", "RankFailed", "RankDied",
           "LaunchTimeout", "LaunchStopped"]


class FailureKind(str, enum.Enum):
    """How a rank failed."""

    #: The rank raised (``sys.exit`` included); its message and traceback travel.
    ERROR = "error"
    #: The rank's process ended without a result: killed by a signal, ``os._exit``.
    DEATH = "death"
    #: The rank returned a value this process cannot unpickle.
    UNPICKLE = "unpickle"


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """One rank's failure: what happened, and when (its own clock for an error).

    ``time`` is wall-clock seconds, comparable across ranks; ``seen`` is the
    parent's ``perf_counter`` when it learned of it (None until then).
    ``dead_peers`` are the ranks already dead when this one raised: its
    error may be their consequence.
    """

    kind: FailureKind
    rank: int
    time: float
    seen: float | None = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    dead_peers: tuple[int, ...] = ()
    exitcode: int | None = None


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
    """The launch ran past its timeout: some ranks never returned.

    ``places`` says where each rank that did not return was (its main
    thread's innermost frame, and whether it waited in a collective);
    ``not_in_collective`` names the ranks outside the collective the others
    wait in -- the ranks that hang the others (empty when no rank waits in one).
    """

    def __init__(self, message, result, returned: list[int], pending: list[int],
                 last_records: dict[int, dict | None], stacks: dict[int, str],
                 places: dict[int, "RankPlace"] | None = None,
                 not_in_collective: list[int] | None = None):
        super().__init__(message, result)
        self.returned = returned
        self.pending = pending
        self.last_records = last_records
        self.stacks = stacks
        self.places = places or {}
        self.not_in_collective = not_in_collective or []


class LaunchStopped(LaunchError):
    """The launch was stopped on request (:meth:`Launch.stop`)."""
