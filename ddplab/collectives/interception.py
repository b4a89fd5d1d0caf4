"""Catch every collective of this process where all of them pass: the c10d dispatcher ops.

Why here and not in a ProcessGroup or Backend subclass (torch 2.13, read in
its sources and checked on live gloo ranks):

* ``c10d::Backend`` has no pybind trampoline: a Python subclass cannot
  override what C++ calls on it.
* A Python ``dist.ProcessGroup`` subclass registered with
  ``Backend.register_backend`` (as torch's ``threaded`` test group is) does
  host DDP and FSDP2: its ``PyProcessGroup`` trampoline forwards the C++
  reducer's ``allreduce`` to Python. But the trampoline covers only some
  virtuals (allreduce, allreduce_coalesced, allgather, broadcast,
  reduce_scatter, the coalesced single-tensor ones, all_to_all_single,
  barrier, send, recv). C++ callers of the others (``all_gather_single``,
  ``reduce_scatter_single``, ``reduce``, ``gather``, ``scatter``,
  ``alltoall``) fall through to the base class, which dispatches
  ``c10d::_allgather_base_`` etc. to the group's registered CPU backend:
  with none, DTensor's redistribution and ``_functional_collectives``'
  all-gather fail ("No backend type associated with device type cpu"); with
  gloo registered there, they run unrecorded. It also needs the default
  group re-created, since ddplab's launcher accepts only gloo and nccl.
* Every base-class collective method calls a ``c10d::<op>`` dispatcher op
  (``ProcessGroup.hpp``), and the op's CPU kernel (``Ops.cpp``) calls the
  backend. A Python kernel registered for the op at ``BackendSelect`` (a
  key every call passes: it is in the default thread-local include set,
  inference mode included, and no c10d op has a kernel there) sees each call
  just before the CPU kernel, records it, and hands it on with
  ``OpOverload.redispatch`` to the keys below: torch's own CPU kernel runs,
  whoever issued the collective, on whichever group, with no group
  re-created. Destroying the library removes the wrapper.

Why redispatch and not a replacement CPU kernel that calls the original
(``torch.library.get_kernel(...).call_boxed``): ``call_boxed`` keeps the GIL
while gloo enqueues the work, and enqueueing takes the group's work-queue
mutex, which a gloo worker thread holds while it destroys a finished Work;
when that Work held the last reference to a tensor Python had let go of, the
destructor needs the GIL. Both ranks then hang (seen on live gloo within a
few hundred collectives). ``redispatch`` releases the GIL around the kernel,
as a plain ``dist.*`` call does.

Only CPU tensors (gloo) are recorded; other backends pass through unrecorded.
"""
from __future__ import annotations

from typing import Callable

import torch

from ddplab.collectives.ops import OP_SPECS, OpSpec

__all__ = ["intercept"]

#: ``on_issue(spec, args) -> token`` before the collective runs; ``on_result(token, spec, args, result)``
#: after the kernel ran, returning what the wrapper hands back (the kernel's result).
OnIssue = Callable[[OpSpec, tuple], object]
OnResult = Callable[[object, OpSpec, tuple, object], object]


def _wrapper(spec: OpSpec, on_issue: OnIssue, on_result: OnResult):
    op = getattr(torch.ops.c10d, spec.c10d_op).default
    below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
    cpu = torch._C.DispatchKey.CPU

    def kernel(keyset, *args):
        keyset = keyset & below
        if keyset.highestPriorityTypeId() != cpu:
            return op.redispatch(keyset, *args)
        token = on_issue(spec, args)
        return on_result(token, spec, args, op.redispatch(keyset, *args))

    kernel.__name__ = f"recorded_{spec.c10d_op}"
    return kernel


def intercept(on_issue: OnIssue, on_result: OnResult) -> torch.library.Library:
    """Route every c10d op of :data:`OP_SPECS` on CPU through the two callbacks; return the library.

    The callbacks must not raise (a collective that one rank skips hangs the
    others). Call ``lib._destroy()`` to remove the wrappers.
    """
    import torch.distributed  # noqa: F401 - registers the c10d ops

    lib = torch.library.Library("c10d", "IMPL")
    try:
        for name, spec in OP_SPECS.items():
            lib.impl(name, _wrapper(spec, on_issue, on_result), "BackendSelect", with_keyset=True)
    except BaseException:
        lib._destroy()
        raise
    return lib
