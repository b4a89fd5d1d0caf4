"""Models compiled with ``torch.compile``: what ddplab's capture and replay do about them.

A model may be compiled before DDP wraps it (``torch.compile(model)`` in
``Setup.model``), in place (``model.compile()``), or after (``DDP(compile=True)``
or a ``Custom`` wrap that returns ``torch.compile(DistributedDataParallel(m))``).
Three rules keep the comparison of such a model faithful:

* ddplab's own hooks never enter a compiled graph: inside a region dynamo
  traces they do nothing (:func:`outside_compile`), so the user's graph is
  compiled exactly as without ddplab -- no graph break, no recompilation, no
  trace of ddplab's digest code (which AOTAutograd could not replay). A
  compiled region therefore records no per-module forward digests.
* parameters are matched by their name without ``torch.compile``'s
  ``_orig_mod.`` segments (:func:`plain_name`), so a compiled model and an
  eager one name the same parameters alike.
* the replay re-executes the rank's compiled module on the same inputs
  (inductor on the CPU is deterministic for a fixed thread count, which the
  replay sets) after :func:`fresh_compiler` forgets what this process compiled
  before, as the rank started without it. Where the replay's bits still differ
  from the rank's -- the rank's graph was split otherwise (DDP's optimizer
  splits it at bucket boundaries), or shapes made it dynamic in one process
  and not the other -- it cannot tell a fault from another kernel:
  :func:`unverified_local` turns that local-gradient difference into
  ``replay_unverified`` ("local gradient unverified: compiled"), never a bug,
  and the other evidence judges that phase (the float64 promise, the band; for a
  ``Custom`` step the symmetric twin and the float64 run, which it always gets).

The single-process references run eagerly (:func:`eager`): they measure the
rounding of one process, whose size compiling does not change, and a
compilation there would only cost time.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch

__all__ = ["ORIG_MOD", "plain_name", "is_compiled", "compile_options", "compiles", "compile_wrapped",
           "as_ranks_ran",
           "outside_compile", "eager", "fresh_compiler",
           "COMPILED_REASON", "unverified_local"]

#: The segment ``torch.compile`` puts before the names of the module it wraps.
ORIG_MOD = "_orig_mod."

#: Why a local gradient of a compiled model is left to the other evidence.
COMPILED_REASON = ("compiled: the replay's compiled kernels gave other bits than the rank's on the same "
                   "inputs (another graph split or dynamic shapes), so a fault cannot be told from "
                   "another kernel; the other evidence judges this phase")


def plain_name(name: str) -> str:
    """``name`` without ``torch.compile``'s ``_orig_mod.`` segments (``_orig_mod.0.weight`` -> ``0.weight``)."""
    return name.replace(ORIG_MOD, "") if ORIG_MOD in name else name


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or one of its submodules runs through ``torch.compile``
    (an ``OptimizedModule``, or ``module.compile()`` in place)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())


def compile_options(config) -> dict | None:
    """The ``torch.compile`` keyword arguments a configuration compiles its wrapped model with, or None."""
    value = getattr(config, "compile", False)
    if value is False or value is None:
        return None
    return {} if value is True else dict(value)


def compiles(setup, config) -> bool:
    """Whether ``config``'s ranks run a compiled model (compiled by the setup or by the configuration)."""
    return compile_options(config) is not None or setup.inspect(is_compiled)


def compile_wrapped(wrapped: torch.nn.Module, config) -> torch.nn.Module:
    """A rank's wrapped model (DDP's) compiled as ``config`` says; unchanged when it does not compile."""
    options = compile_options(config)
    return wrapped if options is None else torch.compile(wrapped, **options)


def as_ranks_ran(model: torch.nn.Module, config) -> torch.nn.Module:
    """The bare ``model`` as a rank of ``config`` ran it, for the replay: unchanged when it does not
    compile; for DDP,
    ``torch.compile(DistributedDataParallel(model))`` built inside the (stand-in) process group
    open here, with a comm hook that leaves each bucket as it is, so that the gradients ``model``
    holds after a backward are its local ones -- dynamo compiles DDP otherwise than the bare model."""
    import torch.distributed as dist

    options = compile_options(config)
    if options is None:
        return model
    if hasattr(config, "ddp_kwargs") and dist.is_available() and dist.is_initialized():
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, **config.ddp_kwargs())
        ddp.register_comm_hook(None, _bucket_as_it_is)
        return torch.compile(ddp, **options)
    return torch.compile(model, **options)


def _bucket_as_it_is(state, bucket):
    # No annotations: DDP compares them with dist.GradBucket as objects.
    """A comm hook that reduces nothing: the bucket keeps this rank's local gradient."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def outside_compile(fn: Callable) -> Callable:
    """``fn`` as a hook that runs only outside compiled regions and is never traced by dynamo.

    While dynamo traces a region the hook returns None at once (dynamo reads
    ``torch.compiler.is_compiling()`` as True and traces nothing else of it); in
    eager code it calls ``fn``, which dynamo is told never to compile.
    """
    inner = torch._dynamo.disable(fn, recursive=True)

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if torch.compiler.is_compiling():
            return None
        return inner(*args, **kwargs)

    return hook


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run every compiled function and module eagerly inside the block (``force_eager``)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def fresh_compiler() -> None:
    """Forget every graph this process compiled and every shape it saw (dynamo's caches and its
    automatic-dynamic history): a rank compiled its model from nothing, and so must the replay.
    Inductor's on-disk cache stays, so the same graph is not compiled twice."""
    torch._dynamo.reset()


def unverified_local(records: list[dict]) -> list[dict]:
    """The replay records of a compiled model, with every (step, rank) whose local gradient differs
    from the replay's turned into one ``replay_unverified`` record (:data:`COMPILED_REASON`).

    Equal local gradients stay verified; the reduction and the update are replayed as for any model.
    """
    from ddplab.records import record

    differs = {(r["step"], r["rank"]) for r in records
               if r["metric"] == "replay_differing" and r.get("phase") == "local_gradient" and r["value"] > 0}
    out, said = [], set()
    for r in records:
        key = (r.get("step"), r.get("rank"))
        if key in differs and r.get("phase") == "local_gradient":
            if key not in said:
                said.add(key)
                out.append(record("replay_unverified", 1, step=key[0], rank=key[1], phase="local_gradient",
                                  reason=COMPILED_REASON, config=r["config"]))
            continue
        out.append(r)
    return out
