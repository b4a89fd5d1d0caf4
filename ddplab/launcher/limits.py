"""What a launch accepts: the machine's rank cap, timeouts, and every argument, checked before any work.

:func:`check_world_size` and :func:`check_timeout` are public so that a
caller planning several launches (``ddplab.compare``) refuses a bad one
before the first starts.
"""
from __future__ import annotations

import inspect
import math
import os

from ddplab.rank import check_backend

__all__ = ["DEFAULT_TIMEOUT", "MAX_TIMEOUT", "MAX_RANKS_PER_CPU", "MAX_WORLD_SIZE_ENV",
           "world_size_limit", "check_world_size", "check_timeout", "check_call", "check_launch"]

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


def check_world_size(world_size) -> None:
    """Raise ValueError unless ``world_size`` is an int in 1 .. :func:`world_size_limit` (named in the message)."""
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    limit, why = world_size_limit()
    if world_size > limit:
        raise ValueError(
            f"world_size={world_size} is more than this machine runs: at most {limit} ranks "
            f"({why}). Every rank is a process with its own torch; beyond that a launch only "
            f"thrashes or runs out of file descriptors. Set {MAX_WORLD_SIZE_ENV}=N to allow more")


def check_timeout(timeout) -> None:
    """Raise ValueError unless ``timeout`` is a number of seconds in (0, :data:`MAX_TIMEOUT`].

    NaN, infinities and booleans are refused: a NaN deadline never passes,
    and ``True`` is no number of seconds.
    """
    if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_TIMEOUT):
        raise ValueError(f"timeout must be a positive number of seconds, finite and at most "
                         f"{MAX_TIMEOUT:g} (30 days), got {timeout!r}")


def check_call(fn, args, kwargs: dict) -> None:
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


def _check_arguments(fn, args, kwargs) -> None:
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ValueError(f"kwargs must be a dict, got {type(kwargs).__name__}")
        bad = [k for k in kwargs if not isinstance(k, str)]
        if bad:
            raise ValueError(f"kwargs keys must be strings (they become keyword arguments), got {bad[0]!r}")
    check_call(fn, args, kwargs or {})


def _checked_env(env) -> dict[str, str]:
    """``env`` as environment strings, or ValueError naming the bad entry."""
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


def check_launch(fn, world_size, backend, timeout, args, kwargs, threads_per_rank, env,
                 on_record, progress) -> dict[str, str]:
    """Raise ValueError for any bad argument of a launch (before a process starts); return ``env`` as strings."""
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    check_world_size(world_size)
    check_backend(backend, world_size)
    check_timeout(timeout)
    _check_arguments(fn, args, kwargs)
    if threads_per_rank is not None and (not _is_int(threads_per_rank) or threads_per_rank < 1):
        raise ValueError(f"threads_per_rank must be an int >= 1 or None (the cores divided among "
                         f"the ranks), got {threads_per_rank!r}")
    if on_record is not None and not callable(on_record):
        raise ValueError(f"on_record must be callable or None, got {type(on_record).__name__}")
    if progress is not None and (not _is_int(progress) or progress < 1):
        raise ValueError(f"progress must be the expected number of steps (int >= 1), got {progress!r}")
    return _checked_env(env)
