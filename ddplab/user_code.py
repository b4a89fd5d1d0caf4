"""Code ddplab did not write, called from ddplab's own process: bounded in time, its exit an error.

``ddplab report`` checks each case's parameters before any notebook runs,
and for some cases that calls the user's code: ``-p setup mypackage:fn``
imports a module and calls a function, which may build a model and read
data. :func:`call_bounded` runs such a call in a daemon thread and waits
for it at most ``timeout`` seconds:

* a call still running then (an import waiting on a lock, a loop, a read
  from a pipe nobody writes) raises :class:`UserCodeTimeout`; the thread is
  left behind -- Python cannot kill a thread -- and ends with the process,
  which is about to end anyway with the error;
* ``sys.exit()`` in the call (``SystemExit``) raises :class:`UserCodeExit`
  naming the call and the exit code, where it would otherwise end ddplab
  itself, with that code (0 for ``sys.exit()``) and without a word.

Both are ValueErrors: to the command they are bad input, said before any work.

Example::

    >>> call_bounded(sum, [1, 2], timeout=5, what="sum")
    3
    >>> import sys
    >>> call_bounded(sys.exit, 3, timeout=5, what="the setup")
    Traceback (most recent call last):
    ...
    ddplab.user_code.UserCodeExit: the setup called sys.exit(3)
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable

__all__ = ["UserCodeError", "UserCodeTimeout", "UserCodeExit", "call_bounded"]


class UserCodeError(ValueError):
    """User code called by ddplab did not return normally in time."""


class UserCodeTimeout(UserCodeError):
    """The call was still running after its time."""


class UserCodeExit(UserCodeError):
    """The call raised SystemExit (``sys.exit``)."""


def call_bounded(fn: Callable, *args: Any, timeout: float, what: str, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, or :class:`UserCodeTimeout` after ``timeout`` seconds.

    ``what`` names the call in the errors ("case 'x': checking its
    parameters"). An exception ``fn`` raises is raised here as it is,
    except ``SystemExit`` (:class:`UserCodeExit`). ``KeyboardInterrupt``
    reaches the caller while it waits (the wait is in the calling thread).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread as it is
            outcome["error"] = exc

    thread = threading.Thread(target=call, name=f"ddplab-user-code: {what}"[:60], daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise UserCodeTimeout(f"{what} did not return within {timeout:g} s (--timeout); it was "
                              "left running and ends with this process")
    error = outcome.get("error")
    if isinstance(error, SystemExit):
        raise UserCodeExit(f"{what} called sys.exit({error.code!r})") from None
    if error is not None:
        raise error
    return outcome["value"]
