"""Record what a DDP comm hook hands the reducer: the value DDP averages into the gradients.

A comm hook's collectives are recorded like any other; what the hook makes of
their outputs (a cast back from float16, a division, or a fault) is not a
collective. While :func:`ddplab.collectives.recording` is active,
``DistributedDataParallel.register_comm_hook`` wraps the hook it is given:
each call opens a :class:`~ddplab.collectives.record.HookResult` for the
bucket, the collectives the hook issues during the call link to it, and the
value of the hook's future is copied when it completes (after every callback
the hook chained). Hooks registered before the recording began, and torch's
built-in C++ hooks (``_register_builtin_comm_hook``), are not wrapped; their
collectives are still recorded.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

from torch.nn.parallel import DistributedDataParallel

__all__ = ["wrap_comm_hook", "recording_comm_hooks"]


def wrap_comm_hook(recorder, hook: Callable) -> Callable:
    """``hook`` with its result recorded by ``recorder``; same signature (DDP inspects it)."""
    if not callable(hook):
        raise TypeError(f"a comm hook must be callable, got {type(hook).__name__}")

    @functools.wraps(hook)
    def recorded(state, bucket):
        with recorder.hook_call(bucket.index()) as rec:
            fut = hook(state, bucket)

        def capture(f):
            try:
                value = f.value()
            except BaseException as exc:
                recorder.hook_failed(rec, exc)
                raise
            recorder.hook_result(rec, value)
            return value

        return fut.then(capture)

    return recorded


@contextlib.contextmanager
def recording_comm_hooks(recorder) -> Iterator[None]:
    """Inside the block, hooks registered with ``DistributedDataParallel.register_comm_hook`` are recorded."""
    original = DistributedDataParallel.register_comm_hook

    @functools.wraps(original)
    def register_comm_hook(self, state, hook):
        return original(self, state, wrap_comm_hook(recorder, hook))

    DistributedDataParallel.register_comm_hook = register_comm_hook
    try:
        yield
    finally:
        DistributedDataParallel.register_comm_hook = original
