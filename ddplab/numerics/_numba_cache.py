"""Where numba keeps ddplab's compiled kernels on disk, so each process does not compile them again.

Every rank process and every notebook kernel imports :mod:`ddplab.numerics`;
compiling its kernels takes seconds to tens of seconds on two cores, loading
them from numba's on-disk cache a fraction of a second. numba looks for a
writable place itself: ``NUMBA_CACHE_DIR`` if set, else ``__pycache__`` next
to the source, else the user's cache directory (``~/.cache/numba``). When none
is writable (a read-only install run with a read-only home), ``@njit(cache=True)``
would raise at import; then :data:`CACHE` falls back to a per-user directory
under the system temporary directory, and if even that fails, to compiling
without a cache.

numba checks only the cached function's own source file for changes, so the
kernels keep every jitted helper they call in their own module (or in one
that changes together with them).
"""
from __future__ import annotations

import os
import tempfile

import numba

__all__ = ["CACHE"]


def _probe():   # never called: numba only decides where its cache would live
    return 0


def _cache_available() -> bool:
    try:
        numba.njit(cache=True)(_probe)
    except RuntimeError:      # "cannot cache function ...: no locator available"
        return False
    return True


def _private_temp_dir() -> str | None:
    uid = os.getuid() if hasattr(os, "getuid") else None
    path = os.path.join(tempfile.gettempdir(), f"ddplab-numba-cache-{uid if uid is not None else 'user'}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if uid is not None and os.stat(path).st_uid != uid:   # someone else's: do not load code from it
            return None
    except OSError:
        return None
    return path


def _cache_setting() -> bool:
    if _cache_available():
        return True
    if not numba.config.CACHE_DIR:
        path = _private_temp_dir()
        if path is not None:
            numba.config.CACHE_DIR = path
            if _cache_available():
                return True
            numba.config.CACHE_DIR = ""
    return False


#: What ddplab's kernels pass as ``cache=``: True unless no cache directory can be written.
CACHE: bool = _cache_setting()
