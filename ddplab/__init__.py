"""ddplab: reproduce data-parallel training reports on a CPU, measure them
against an exact reference, and tell rounding from bugs."""
from ddplab.launcher import (Launch, LaunchError, LaunchResult, LaunchStopped, LaunchTimeout,
                             RankDied, RankFailed, launch)
from ddplab.records import RECORD_COLUMNS, collect, emit, record, to_frame

__version__ = "0.1.0"

__all__ = [
    "RECORD_COLUMNS", "collect", "emit", "record", "to_frame",
    "launch", "Launch", "LaunchResult", "LaunchError", "RankFailed", "RankDied",
    "LaunchTimeout", "LaunchStopped", "__version__",
]
