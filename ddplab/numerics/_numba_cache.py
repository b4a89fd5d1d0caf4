"""Where ddplab's numba kernels are cached on disk, so that each process does not compile them again.

Every rank process and every notebook kernel imports :mod:`ddplab.numerics`;
compiling its kernels takes tens of seconds on two cores, loading them from
numba's on-disk cache a fraction of a second. :func:`njit` is ``numba.njit``
with that cache, made correct and robust for this package:

* numba tells a stale cache entry only by the kernel's own source file, but
  ddplab's kernels inline helpers from other modules (``exact`` uses
  ``_bignum`` and ``_rounding``). So the cache lives in a directory named
  after a hash of every numerics module that defines kernels: a change to any
  of them starts a fresh cache instead of loading old code.
* That directory is the first writable one of: ``$NUMBA_CACHE_DIR``,
  ``__pycache__`` next to the sources (numba's own default), the user's cache
  directory (``~/.cache/ddplab``), a private per-user directory under the
  system temporary directory. A read-only install with a read-only home still
  caches; if nothing is writable, kernels compile without a cache.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile

import numba

__all__ = ["CACHE_PATH", "njit"]

_HERE = pathlib.Path(__file__).resolve().parent


def _sources_key() -> str:
    """A hash of the numerics modules that define kernels (their names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(_HERE.glob("*.py")):
        text = path.read_bytes()
        if b"njit" in text:
            digest.update(path.name.encode() + b"\0" + text + b"\0")
    return digest.hexdigest()[:16]


def _user_cache_dir() -> str:
    try:
        from numba.misc.appdirs import AppDirs
        return AppDirs(appname="ddplab", appauthor=False).user_cache_dir
    except ImportError:   # numba's copy of appdirs moved: the XDG default
        return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddplab")


def _writable(path: str) -> bool:
    """What numba checks before it caches somewhere: the directory exists and takes a file."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def _private_temp_dir() -> str | None:
    uid = os.getuid() if hasattr(os, "getuid") else None
    root = os.path.join(tempfile.gettempdir(), f"ddplab-numba-cache-{uid if uid is not None else 'user'}")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        if uid is not None and os.stat(root).st_uid != uid:   # someone else's: do not load code from it
            return None
    except OSError:
        return None
    return root


def _cache_path() -> str | None:
    key = f"numba-{_sources_key()}"
    candidates = []
    if numba.config.CACHE_DIR:
        candidates.append(os.path.join(numba.config.CACHE_DIR, f"ddplab-{key}"))
    candidates += [str(_HERE / "__pycache__" / key), os.path.join(_user_cache_dir(), key)]
    temp = _private_temp_dir()
    if temp is not None:
        candidates.append(os.path.join(temp, key))
    return next((path for path in candidates if _writable(path)), None)


#: The directory ddplab's kernels are cached in, or None: compile in every process.
CACHE_PATH: str | None = _cache_path()


def njit(*args, **options):
    """``numba.njit`` cached in :data:`CACHE_PATH`; use as ``@njit`` or ``@njit(parallel=True)``.

    numba picks a kernel's cache directory when the decorator runs, from
    ``numba.config.CACHE_DIR``: it is set to :data:`CACHE_PATH` just for that
    moment, so other packages' kernels in the process keep numba's defaults.
    """
    def decorate(fn):
        if CACHE_PATH is None:
            return numba.njit(**options)(fn)
        saved = numba.config.CACHE_DIR
        numba.config.CACHE_DIR = CACHE_PATH
        try:
            return numba.njit(cache=True, **options)(fn)
        finally:
            numba.config.CACHE_DIR = saved

    if args and callable(args[0]) and not options and len(args) == 1:
        return decorate(args[0])
    if args:
        raise TypeError("njit takes the function or keyword options only (no signatures)")
    return decorate
