"""What a comparison's processes ask of the C library's memory: what to give back, and what to keep.

Moving a capture is mostly a question of new memory. A page a process has not touched is faulted
in and zeroed first, and on a VM whose host takes back the pages a process frees that costs far
more than the copy itself (measured here: a 300 MB capture read into new memory in 0.16 s, into
memory read before in 0.02 s). So the parent gives back what a judged step no longer holds
(:func:`release_freed_memory`) and never holds a capture's file pages beside their copy
(:func:`drop_pages`), and the reference process allocates its gradients where the last ones were
freed (:data:`BACKWARD_HEAP`). Each is a no-op where the C library lacks the call (not glibc).
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Callable, Iterator

__all__ = ["release_freed_memory", "drop_pages", "BackwardHeap", "BACKWARD_HEAP"]


def _libc(name: str) -> Callable | None:
    """The C library's function ``name``, or None."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc("malloc_trim")
_madvise = _libc("madvise")
if _madvise is not None:
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def release_freed_memory() -> None:
    """Give the memory of a judged step back to the system (glibc's ``malloc_trim(0)``). glibc serves
    tensors below its mmap threshold (which grows to 32 MiB as large blocks are freed) from its heap
    and keeps what is freed there: without this a 10M-parameter comparison's parent grew ~7 model
    sizes more (measured)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def drop_pages(address: int, length: int) -> None:
    """Unmap the whole pages of ``[address, address + length)`` from this process
    (``madvise(MADV_DONTNEED)``). Only for read-only pages of a private file mapping: they read back
    from the file if touched again."""
    if _madvise is None:
        return
    page = mmap.PAGESIZE
    start, stop = -(-address // page) * page, (address + length) // page * page
    if stop > start:
        _madvise(start, stop - start, getattr(mmap, "MADV_DONTNEED", 4))


class BackwardHeap:
    """Where this process's backward passes allocate. By default glibc maps a block beyond its mmap
    threshold (at most 32 MiB) for it alone and unmaps it when freed, so a reference run's model-sized
    gradients -- new every step: ``zero_grad`` sets them to None -- are new pages every step (most of
    the reference process's system time). Once :meth:`keep` is called (the reference process), inside
    :meth:`__call__`'s block every allocation comes from glibc's heap, which keeps what is freed for
    the next ones: at 50M parameters 3.8 s of system time over 10 steps instead of 10.8, for a peak of
    5.3 GiB instead of 4.8 (what is freed stays; measured)."""

    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    MMAP_MAX_DEFAULT = 65536   # glibc's

    def __init__(self):
        self._mallopt = None

    def keep(self) -> None:
        """From now on, backward passes allocate from the heap, and the heap keeps what is freed."""
        self._mallopt = _libc("mallopt")
        if self._mallopt is not None:
            self._mallopt(self.M_TRIM_THRESHOLD, 2**31 - 1)   # the largest it takes: an int

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self._mallopt is None:
            yield
            return
        self._mallopt(self.M_MMAP_MAX, 0)
        try:
            yield
        finally:
            self._mallopt(self.M_MMAP_MAX, self.MMAP_MAX_DEFAULT)


#: The process's backward heap: kept by the reference process (:func:`ddplab.compare.runners.reference_worker`).
BACKWARD_HEAP = BackwardHeap()
