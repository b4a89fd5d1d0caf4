"""Run numba's parallel kernels inside torch's thread budget, and leave that budget as it was.

numba's OpenMP threading layer shares torch's OpenMP runtime: a parallel
region started by numba resets the calling thread's OpenMP thread count to
numba's, so afterwards ``torch.get_num_threads()`` would report (and torch's
kernels use) a different number of threads. That changes how torch splits
its reductions, so a run that merely *measured* something would stop being
bitwise the same as one that did not. And a rank that was given one thread
must not have its numerics spread over every core.
"""
from __future__ import annotations

import functools

import numba
import torch

__all__ = ["within_torch_threads"]


def within_torch_threads(fn):
    """Decorate ``fn`` so its numba kernels use torch's thread count and torch's count survives."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        torch_threads = torch.get_num_threads()
        numba_threads = numba.get_num_threads()
        numba.set_num_threads(max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS)))
        try:
            return fn(*args, **kwargs)
        finally:
            numba.set_num_threads(numba_threads)
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)

    return wrapper
