"""The specification replay: ddplab's own one-process execution of what the wrapper promises, bit for bit.

On gloo/CPU a distributed step is bit-reproducible in one process. For
every step of a DDP, Accumulate or Fabric run, each rank's step is executed
again here from that rank's own state before the step (its parameters, its
optimizer state, its RNG state, its buffers, its thread count) and compared
with what the rank captured, phase by phase, bit for bit:

* ``local_gradient`` -- forward and backward on the rank's share (k
  micro-batches, each loss divided by k, accumulated as autograd does; its
  own batches with ``Setup.rank_batches``) give the bucket inputs the rank
  handed its comm hook. Accumulation without ``no_sync`` reduces after every
  micro-batch: each reduction's input is replayed from the rank's reduced
  gradient of the one before;
* ``reduction`` -- the emulated reduction of every rank's *own* bucket
  inputs (gloo's ring after DDP's ``1/W`` multiply, or the emulation of the
  comm hook the configuration uses) gives each rank's bucket output;
* ``update`` -- the rank's (last) reduced buckets, cut back into gradients
  and passed through the setup's ``before_step``, give the gradient the rank
  handed ``optimizer.step()`` (``quantity="grad"``), and the user's
  optimizer, loaded with the rank's state, stepping on that gradient gives
  the parameters after the step (``quantity="param"``). A sharded optimizer
  (:mod:`ddplab.compare.sharded_optimizers`) updates the rank's own shard,
  and every other parameter must equal its owner's (the broadcast).

The user's loss and optimizer run under a stand-in process group of the
rank's size and rank (:mod:`ddplab.compare.stand_in`), as they ran there; the
model's forward and ``before_step`` run without one: no rank may change
them. A compiled model runs compiled as on the rank (:mod:`ddplab.compare.compiled`).

Each phase starts from the rank's own values (not the replay's), so a fault
is found in the phase where it happens and every step is judged on its own.
A difference of any size -- one ulp in one element -- is a bug: it is not
what the wrapper promises. A difference in the local gradient also names
the module: the first forward call whose output digest differs from the
replay's (with every earlier output equal, its input was the same), or else
the module owning the first parameter, from the output backwards, whose
gradient differs.

Records (one tidy row each): ``replay_differing`` (elements whose bits
differ, per step, rank, phase, quantity and parameter; ``max_ulp`` and
``max_relative`` labels where any do), ``replay_unverified`` (a phase the
replay could not re-execute, with ``reason``) and ``replay_module`` at the
first local-gradient difference.

What has no replay (:func:`unavailable`): a :class:`Custom` step (ddplab
does not know what it promises), a model whose modules issue their own
collectives in forward (SyncBatchNorm: one rank's forward depends on the
others'), and FSDP2's local gradients with micro-batches. The reduction of
a comm hook ddplab cannot emulate is ``unverified``; the other phases are
still replayed.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch

from ddplab.compare import compiled as _compiled
from ddplab.compare import data as _data
from ddplab.compare import sharded_optimizers as _sharded
from ddplab.compare import stand_in as _stand_in
from ddplab.compare.captures import StepRecords, common_steps
from ddplab.compare.configurations import DDP, FSDP2, Configuration, Custom, Fabric
from ddplab.compare.runners import ForwardDigests, leaves_gradients_alone
from ddplab.compare.setup import Setup, apply_before_step, cast_batch, named_trainable, structure_question
from ddplab.numerics.accuracy import same_memory
from ddplab.records import record

__all__ = ["PHASES", "register_reduction", "reduction_emulation", "Reductions", "unavailable", "replay_records",
           "compare_bits", "first_difference"]

#: Where a difference from the replay happens, in the order a step runs.
PHASES = ("local_gradient", "reduction", "update")

#: comm hook -> emulation ``fn(contributions (W, n)) -> result (n,)`` registered by users.
_REGISTERED: dict[Callable, Callable[[torch.Tensor], torch.Tensor]] = {}


def register_reduction(hook: Callable, emulation: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """State what a comm hook promises: ``emulation(contributions)`` is, bit for bit, the bucket
    the hook leaves from the W ranks' bucket inputs ``contributions`` (shape ``(W, n)``).

    Example::

        >>> from ddplab.numerics import reduce
        >>> register_reduction(my_hook, lambda c: reduce(c, "gloo_ring", op="avg", averaging="post_divide"))
    """
    if not callable(hook) or not callable(emulation):
        raise ValueError("register_reduction takes a comm hook and a callable contributions -> result")
    _REGISTERED[hook] = emulation


def _ddp_default(contributions: torch.Tensor) -> torch.Tensor:
    from ddplab.numerics.orders import DDP_AVERAGING, reduce
    return reduce(contributions, "gloo_ring", op="avg", averaging=DDP_AVERAGING)


class Reductions:
    """DDP's own reduction (:func:`reduction_emulation` of no hook) of each bucket of the step being judged,
    emulated once for the sources that check it: the bucket audit asks first (:meth:`of`), the replay
    takes it (:meth:`take`). Keyed by the contributions' tensors; :meth:`clear` once the step is judged."""

    def __init__(self):
        self._step: int | None = None
        self._items: dict[tuple, torch.Tensor] = {}

    def of(self, step: int, contributions: list[torch.Tensor], together) -> torch.Tensor:
        """The reduction of ``contributions`` (``together``: them as one ``(W, n)`` tensor or
        :class:`~ddplab.numerics.contributions.Contributions`), kept for :meth:`take`."""
        if step != self._step:
            self._step, self._items = step, {}
        key = tuple(map(id, contributions))
        if key not in self._items:
            self._items[key] = _ddp_default(together)
        return self._items[key]

    def peek(self, step: int, contributions: list[torch.Tensor]) -> torch.Tensor | None:
        """What :meth:`of` emulated for these contributions at ``step`` (kept), or None."""
        return self._items.get(tuple(map(id, contributions))) if step == self._step else None

    def take(self, step: int, contributions: list[torch.Tensor]) -> torch.Tensor | None:
        """What :meth:`of` emulated for these contributions at ``step`` (then forgotten), or None."""
        return self._items.pop(tuple(map(id, contributions)), None) if step == self._step else None

    def clear(self) -> None:
        """The step is judged: nothing of it is kept (what the replay did not take, a hook's buckets)."""
        self._step, self._items = None, {}


def reduction_emulation(hook: Callable | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The bit-exact emulation of ``hook``'s reduction on gloo (None: DDP's own), or None if unknown."""
    if hook is None:
        return _ddp_default
    if hook in _REGISTERED:
        return _REGISTERED[hook]
    from ddplab import comm_hooks
    hook = comm_hooks.gloo_equivalent(hook)[0]  # what ran on gloo in its place
    known = dict(getattr(comm_hooks, "REPLAY_EMULATIONS", {}))
    known.setdefault(comm_hooks.ddp_default_hook, _ddp_default)
    return known.get(hook)


@structure_question
def _collective_modules(model: torch.nn.Module) -> list[str]:
    """The modules of ``model`` that issue collectives in forward (SyncBatchNorm, or marked so)."""
    return [name or "(model)" for name, m in model.named_modules()
            if isinstance(m, torch.nn.SyncBatchNorm) or getattr(m, "collective_in_forward", False)]


def unavailable(setup: Setup, config: Configuration) -> str | None:
    """Why ``config`` has no specification replay, or None when it has one."""
    if isinstance(config, Custom):
        return ("a Custom step may issue its own collectives and ddplab does not know what it "
                "promises")
    collective = setup.inspect(_collective_modules)
    if getattr(config, "sync_batchnorm", False):
        collective = collective or ["BatchNorm layers (as SyncBatchNorm)"]
    if collective:
        return (f"the model's {', '.join(collective[:3])} issue their own collectives in forward, so "
                f"one rank's step depends on the others' (no one-rank replay)")
    if isinstance(config, FSDP2) and config.k > 1:
        return "FSDP2 with micro-batches accumulates unsharded gradients ddplab does not replay"
    if not isinstance(config, (DDP, Fabric, FSDP2)):
        return f"no replay for {type(config).__name__}"
    return None


# --------------------------------------------------------------------------- bits


def compare_bits(live: torch.Tensor, replay: torch.Tensor) -> dict:
    """Elements whose bits differ, the largest ulp distance and the largest relative difference."""
    from ddplab.numerics import ulp_distance
    from ddplab.numerics.accuracy import identical, same_bits

    live, replay = live.reshape(-1), replay.reshape(-1).to(live.dtype)
    if identical(live, replay):   # the common case, in one pass over the bytes
        return dict(differing=0, max_ulp=0.0, max_relative=0.0, first=-1, identical=True)
    same = same_bits(live, replay)
    differing = int((~same).sum())
    if not differing:
        return dict(differing=0, max_ulp=0.0, max_relative=0.0, first=-1)
    ulps = ulp_distance(live, replay).abs().to(torch.float64)
    diff = (live.double() - replay.double()).abs()
    scale = replay.double().abs().clamp_min(torch.finfo(torch.float64).tiny)
    rel = torch.where(same, torch.zeros_like(diff), diff / scale)
    return dict(differing=differing, max_ulp=float(ulps.max()), max_relative=float(rel.max()),
                first=int((~same).nonzero()[0, 0]))


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Run with the rank's torch thread count: a kernel's result can depend on it."""
    before = torch.get_num_threads()
    if count and count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _model_at(setup: Setup, params: dict, buffers: dict | None = None,
              model: torch.nn.Module | None = None, holds_params: bool = False) -> torch.nn.Module:
    """A model holding ``params`` (by trainable name) and ``buffers``: built anew, or ``model`` reset to
    them (built anew too where ``buffers`` does not name every buffer: a reset one would keep a value).
    ``holds_params``: ``model`` holds ``params`` already (nothing wrote them since they were set), so
    only its buffers and gradients are reset."""
    if model is None or any(name not in (buffers or {}) for name, _ in model.named_buffers()):
        model, holds_params = setup.build_model(), False
    with torch.no_grad():
        for name, p in named_trainable(model):
            if not holds_params:
                p.copy_(params[name])
            p.grad = None
        for name, b in model.named_buffers():
            if buffers and name in buffers:
                b.copy_(buffers[name])
    return model


class _Emitter:
    def __init__(self, config: Configuration):
        self.labels = dict(config=config.label)
        self.out: list[dict] = []

    def bits(self, step: int, rank: int, phase: str, quantity: str, param: str, live, replay,
             known: dict | None = None) -> dict:
        """Record how ``live`` differs from ``replay`` (``known``: that comparison, made already)."""
        c = known if known is not None else compare_bits(live, replay)
        extra = {}
        if c["differing"]:
            extra = dict(max_ulp=c["max_ulp"], max_relative=c["max_relative"], element=c["first"])
        self.out.append(record("replay_differing", c["differing"], step=step, rank=rank, phase=phase,
                               quantity=quantity, param=param, **self.labels, **extra))
        return c

    def unverified(self, step: int, rank: int, phase: str, reason: str) -> None:
        self.out.append(record("replay_unverified", 1, step=step, rank=rank, phase=phase, reason=reason,
                               **self.labels))


# --------------------------------------------------------------------------- the phases


def _with_round(cap: dict, round_: int) -> dict:
    """``cap`` with only the buckets of its ``round_``-th reduction (-1: the last)."""
    rounds = sorted({b.get("round", 0) for b in cap.get("buckets", [])}) or [0]
    keep = rounds[round_] if -len(rounds) <= round_ < len(rounds) else None
    return dict(cap, buckets=[b for b in cap.get("buckets", []) if b.get("round", 0) == keep])


def _syncs_every_micro_batch(config: Configuration) -> bool:
    return config.k > 1 and getattr(config, "no_sync", True) is False


def _rank_loss(setup: Setup, out, target, rank: int, world: int) -> torch.Tensor:
    """The setup's loss as the rank ran it: under a stand-in process group of its size and rank
    (a loss that divides by the world size). The model's forward and the rest of the step are the
    specification's, which no rank may change."""
    with _stand_in.process_group(rank, world):
        return setup.loss(out, target)


def _local(setup: Setup, config: Configuration, model: torch.nn.Module, micro: list, cap: dict, rank: int):
    """The rank's forward/backward on its micro-batches, from its RNG state: the local gradient of
    each reduction (one; k when every micro-batch synchronizes, each starting from the rank's own
    reduced gradient of the one before) and the forward digests. For a compiled configuration the
    passes run through the module as the rank compiled it (for DDP's, inside a stand-in group)."""
    digests = ForwardDigests(model)
    named = named_trainable(model)
    every = _syncs_every_micro_batch(config)
    k = len(micro)
    rounds = []
    with (_stand_in.process_group(rank, config.world_size) if _compiled.compile_options(config) is not None
          else contextlib.nullcontext()):
        ran = _compiled.as_ranks_ran(model, config)
        own = (lambda t: t.detach()) if ran is model else (lambda t: t.detach().clone())
        torch.set_rng_state(cap["rng"])
        for m, piece in enumerate(micro):
            if every and m:  # DDP left the reduced gradient of the micro-batch before in .grad
                reduced = _reduced_grads(_with_round(cap, m - 1), dict(named))   # fresh: the model's own
                for name, p in named:
                    p.grad = reduced[name]
            loss = _rank_loss(setup, ran(*piece[:-1]), piece[-1], rank, config.world_size)
            if k > 1:
                loss = loss / k
            loss.backward()
            if every or m == k - 1:
                # The model's own gradients: a later micro-batch starts from new tensors, and nothing else
                # writes them -- unless a wrap runs the passes (compiled DDP may keep them in its buckets).
                rounds.append({n: own(p.grad) if p.grad is not None else torch.zeros_like(p) for n, p in named})
    digests.remove()
    return rounds, digests.calls


def _reduced_grads(cap: dict, like: dict, into: dict | None = None, borrow: bool = False) -> dict:
    """The gradients the rank's reduced buckets give (DDP copies each bucket back), zero elsewhere:
    tensors for a model to own -- ``into``'s where it has one of the shape and dtype (written over),
    fresh ones otherwise -- or, with ``borrow``, the buckets' own slices wherever they have the dtype
    (for a model that only reads them)."""
    into = into or {}

    def owned(name: str, value: torch.Tensor | None) -> torch.Tensor:
        if borrow and value is not None and value.dtype == like[name].dtype:
            return value
        spare = into.get(name)
        if spare is not None and spare.shape == like[name].shape and spare.dtype == like[name].dtype:
            return spare.copy_(value) if value is not None else spare.zero_()
        return value.clone() if value is not None else torch.zeros_like(like[name])

    grads = {}
    for bucket in cap["buckets"]:
        for name, start, stop in _bucket_params(bucket, like):
            grads[name] = bucket["result"][start:stop].view_as(like[name])
    return {n: owned(n, grads.get(n)) for n in like}


def _local_fsdp(setup: Setup, config: FSDP2, model: torch.nn.Module, micro: list, cap: dict, rank: int):
    """FSDP2's compute: the full parameters cast to ``param_dtype``, inputs cast, one backward;
    the gradient of each cast parameter is what FSDP2 reduce-scatters (in its ``reduce_dtype``)."""
    param_dtype, _ = config.dtypes()
    named = named_trainable(model)
    low = {n: p.detach().to(param_dtype or p.dtype).requires_grad_() for n, p in named}
    digests = ForwardDigests(model)
    torch.set_rng_state(cap["rng"])
    inputs = cast_batch(micro[0], param_dtype, target=False)
    out = torch.func.functional_call(model, low, inputs[:-1])
    _rank_loss(setup, out, inputs[-1], rank, config.world_size).backward()
    digests.remove()
    return [{n: t.grad.detach().clone() for n, t in low.items()}], digests.calls


def _first_module(live_calls: list, replay_calls: list, differing_params: list[str]) -> tuple[str, str]:
    """The module a local-gradient difference starts in, and how it was found."""
    for (name, live), (_, replay) in zip(live_calls, replay_calls):
        if live != replay:
            return name, "forward_output"
    if len(live_calls) != len(replay_calls):
        return "(model)", "forward_calls"
    if differing_params:  # backward runs from the output: the last parameter differing comes first
        last = differing_params[-1]
        return (last.rsplit(".", 1)[0] if "." in last else "(model)"), "parameter_gradient"
    return "(model)", "parameter_gradient"


def _bucket_params(bucket: dict, grads: dict) -> list[tuple[str, int, int]]:
    """``(name, start, stop)`` of each parameter's slice of a bucket's flat buffer."""
    out, start = [], 0
    for name in bucket.get("names") or bucket["params"].split(","):
        n = grads[name].numel()
        out.append((name, start, start + n))
        start += n
    return out


def _replay_local(em: _Emitter, setup, config, step, rank, cap, model, micro, modules_seen) -> dict:
    """The local phase of one rank on ``model`` (at the rank's weights and buffers before the step);
    returns the replay's local gradients."""
    with _threads(cap.get("threads")):
        if isinstance(config, FSDP2):
            rounds, calls = _local_fsdp(setup, config, model, micro, cap, rank)
        else:
            rounds, calls = _local(setup, config, model, micro, cap, rank)
    grads = rounds[-1]
    differing = []
    if isinstance(config, FSDP2):
        # FSDP2's reduce-scatter input is not kept per parameter; its forward is compared by
        # digest and the reduction bit for bit by the ranks' audit.
        em.unverified(step, rank, "local_gradient", "FSDP2 keeps no per-parameter reduce-scatter input; "
                      "forward outputs compared by digest, the reduce-scatter by the ranks' audit")
    else:
        for bucket in cap.get("buckets", []):
            replayed = rounds[min(bucket.get("round", 0), len(rounds) - 1)]  # its reduction's local gradient
            for name, start, stop in _bucket_params(bucket, grads):
                c = em.bits(step, rank, "local_gradient", "grad", name, bucket["local"][start:stop],
                            replayed[name])
                if c["differing"]:
                    differing.append(name)
    live_calls = cap.get("forward", [])
    forward_differing = sum(a != b for a, b in zip(live_calls, calls)) + abs(len(live_calls) - len(calls))
    em.out.append(record("replay_differing", forward_differing, step=step, rank=rank, phase="local_gradient",
                         quantity="forward", param="(forward outputs)", **em.labels))
    forward_differs = forward_differing > 0
    if (differing or forward_differs) and not modules_seen:
        order = [n for n, _ in named_trainable(model)]
        differing.sort(key=order.index)
        module, how = _first_module(live_calls, calls, differing)
        em.out.append(record("replay_module", 1, step=step, rank=rank, phase="local_gradient",
                             module=module, found_by=how, **em.labels))
        modules_seen.append(module)
    return grads


def _replay_reduction(em: _Emitter, config, step, caps: list[dict], emulation, shared: Reductions | None) -> None:
    by_rank = [{b["index"]: b for b in cap.get("buckets", [])} for cap in caps]
    indices = sorted(by_rank[0])
    for index in indices:
        if not all(index in other for other in by_rank):
            for rank in range(len(caps)):
                em.unverified(step, rank, "reduction", f"bucket {index} missing on some rank")
            continue
        local = [other[index]["local"] for other in by_rank]
        expected = shared.take(step, local) if shared is not None and emulation is _ddp_default else None
        if expected is None:
            expected = emulation(torch.stack(local))
        first: dict[str, dict] = {}
        for rank, other in enumerate(by_rank):
            bucket = other[index]
            # A rank whose reduced bucket reads back as rank 0's (the same bits: DDP's promise) compares
            # as rank 0's did, without a second pass over it.
            again = rank > 0 and same_memory(bucket["result"], by_rank[0][index]["result"])
            for name, start, stop in _bucket_params(bucket, caps[rank]["params"]):
                c = em.bits(step, rank, "reduction", "grad", name, bucket["result"][start:stop],
                            expected[start:stop], known=first.get(name) if again else None)
                if rank == 0:
                    first[name] = c


def _replay_update(em: _Emitter, setup, config, step, rank, cap, model, optim_before, spare: dict) -> None:
    """The update phase of one rank on ``model`` (at the rank's weights and buffers before the step);
    ``spare``: gradient tensors nothing reads any more, written over rather than allocating new ones."""
    named = named_trainable(model)
    with _threads(cap.get("threads")):
        with _stand_in.process_group(0, 1):
            one_process = setup.optimizer(model.parameters())
        promised = [{k: v for k, v in g.items() if k != "params"} for g in one_process.param_groups]
        # Where nothing writes the gradients (no before_step; a torch optimizer only reads them) the
        # replay's are the rank's reduced buckets themselves, not a copy of them.
        borrow = setup.before_step is None and leaves_gradients_alone(one_process)
        del one_process
        if cap.get("buckets"):
            # What the rank's last reduced buckets give its step: DDP copies each bucket back into
            # the gradients, then the setup's before_step (clipping) runs.
            grads = _reduced_grads(_with_round(cap, -1), dict(named), into=spare, borrow=borrow)
            for name, p in named:
                p.grad = grads.pop(name)
            apply_before_step(setup, model)
            held = {name for name, p in named if name in cap["grads"] and p.grad is not None and em.bits(
                step, rank, "update", "grad", name, cap["grads"][name], p.grad).get("identical")
                and (p.grad.dtype, p.grad.shape) == (cap["grads"][name].dtype, cap["grads"][name].shape)}
        else:
            held = set()
        # The optimizer on the rank's own gradient, from the rank's own state -- but with the
        # hyperparameters the setup gives one process (load_state_dict would take the rank's own,
        # and a rank whose learning rate differs would then be replayed with it). It is built as
        # the rank built it (a sharded one partitions by the stand-in's rank) and loads the rank's
        # own state (a sharded one: its own shard).
        with _stand_in.process_group(rank, config.world_size):
            optimizer = setup.optimizer(model.parameters())
            if optim_before is not None and not _sharded.restore_state(optimizer, named, optim_before):
                optimizer.load_state_dict(optim_before)
            for group, hyper in zip(optimizer.param_groups, promised):
                group.update(hyper)
            for name, p in named:   # into the gradient the model holds: one model size, not two
                live = cap["grads"].get(name)
                if live is None:
                    p.grad = None
                elif name in held:
                    continue   # it holds the rank's bits already (compared above)
                elif borrow:
                    p.grad = live   # read, never written: the rank's own (a borrowed bucket is never written)
                elif p.grad is not None and p.grad.shape == live.shape and p.grad.dtype == live.dtype:
                    p.grad.copy_(live)
                else:
                    p.grad = live.clone()
            optimizer.step()
    mine = _sharded.owned(cap.get("optimizer"))  # a sharded optimizer updates the rank's own shard
    for name, p in named:
        if mine is not None and name not in mine:
            continue  # another rank's: checked against its owner's (the broadcast)
        live, replay = cap["params"][name], p.detach()
        if isinstance(config, FSDP2) and live.ndim:
            # Each rank updates only its own shard (dim-0 chunks); the full tensor it captured
            # holds the others' too, so only its own rows are its update.
            rows = _shard_rows(live.shape[0], config.world_size, rank)
            live, replay = live[rows], replay[rows]
        em.bits(step, rank, "update", "param", name, live, replay)


def _shard_rows(rows: int, world: int, rank: int) -> slice:
    """The dim-0 rows FSDP2 gives ``rank`` of ``world``: chunks of ceil(rows / world)."""
    chunk = -(-rows // world)
    return slice(min(rank * chunk, rows), min((rank + 1) * chunk, rows))


def replay_records(setup: Setup, config: Configuration, ranks: list[list[dict]], batches: list,
                   shared: Reductions | None = None) -> StepRecords:
    """Replay every captured step of ``config`` (``ranks[r][step]``: rank r's captures) and compare.

    Yields each step's records of the module docstring; nothing when the
    configuration has no replay (:func:`unavailable`). ``shared``: DDP's reductions a source before
    it emulated this step.
    """
    if unavailable(setup, config) is not None:
        return
    em = _Emitter(config)
    emulation = reduction_emulation(getattr(config, "comm_hook", None)) if not isinstance(config, FSDP2) else None
    compiled = _compiled.compiles(setup, config)   # asked first: answering may build a model of its own
    model = setup.build_model()
    initial = {n: p.detach().clone() for n, p in named_trainable(model)}   # where step 0 starts
    modules_seen: list[str] = []
    if compiled:
        _compiled.fresh_compiler()  # the rank compiled from nothing
        model = None   # a compiled wrap may hook the parameters of the model it ran: each phase builds anew
    rng = torch.get_rng_state()
    try:
        for step in common_steps(*ranks):
            _replay_step(em, setup, config, ranks, batches, step, initial, modules_seen, emulation, shared, model)
            initial = None   # every later step starts from the one before: a model size less held
            mine, em.out = em.out, []   # one step's records at a time
            yield _compiled.unverified_local(mine) if compiled else mine
    finally:
        torch.set_rng_state(rng)


def _replay_step(em, setup: Setup, config: Configuration, ranks, batches: list, step: int, initial: dict,
                 modules_seen: list, emulation, shared: Reductions | None, model: torch.nn.Module | None) -> None:
    """Step ``step`` of :func:`replay_records`, every rank, its records into ``em``. Each phase of each
    rank runs on ``model`` reset to the rank's state before the step -- building one costs seconds
    for a large model -- or, where it is None (a compiled wrap), on a model built anew."""
    world, k = config.world_size, config.k
    pieces = _data.batch_pieces(setup, batches[step], step, world, k)
    caps = [ranks[r][step] for r in range(world)]
    # The reductions first: the emulation a source before this one kept is then dropped before the
    # ranks' phases hold a model and its gradients.
    _replay_reductions(em, config, step, caps, emulation, shared)
    for rank in range(world):
        before = initial if step == 0 else ranks[rank][step - 1]["params"]
        optim_before = None if step == 0 else ranks[rank][step - 1].get("optimizer")
        micro = pieces[rank * k:(rank + 1) * k]
        # DDP broadcasts rank 0's buffers at the start of every forward.
        source = caps[rank] if isinstance(config, FSDP2) else caps[0]
        local = _model_at(setup, before, source.get("buffers"), model)
        versions = [(p, p._version) for _, p in named_trainable(local)]
        _replay_local(em, setup, config, step, rank, caps[rank], local, micro, modules_seen)
        # The local gradients are compared: their tensors take the update's.
        spare = {n: p.grad for n, p in named_trainable(local) if p.grad is not None}
        # The update needs the weights and buffers before the step again. A forward and backward that
        # wrote no parameter in place (their version counters say so) left the weights there already.
        after = [p for _, p in named_trainable(local)]
        kept = local is model and len(after) == len(versions) and all(
            p is q and version == q._version for (p, version), q in zip(versions, after))
        update = _model_at(setup, before, caps[rank].get("buffers"), model, holds_params=kept)
        _replay_update(em, setup, config, step, rank, caps[rank], update, optim_before, spare)
        for _, p in named_trainable(update):
            p.grad = None   # nothing of the step is held while the sources after this one run
        del local, update, spare
    _sharded.broadcast_records(lambda s, r, name, live, owner: em.bits(s, r, "update", "param", name,
                                                                       live, owner), step, caps)


def _replay_reductions(em, config: Configuration, step: int, caps: list[dict], emulation,
                       shared: Reductions | None) -> None:
    """The reduction phase of every rank at ``step``: each bucket's result against the emulation."""
    world = config.world_size
    if isinstance(config, FSDP2):
        return  # the ranks' audit measured every reduce-scatter bit for bit
    if emulation is None:
        hook = getattr(config.comm_hook, "__name__", "the comm hook")
        for rank in range(world):
            em.unverified(step, rank, "reduction", f"ddplab has no bit-exact emulation of {hook} "
                          "(ddplab.compare.replay.register_reduction states one)")
    else:  # every reduction of the step (k when every micro-batch synchronizes)
        for round_ in range(len({b.get("round", 0) for b in caps[0].get("buckets", [])})):
            _replay_reduction(em, config, step, [_with_round(cap, round_) for cap in caps], emulation, shared)


def first_difference(frame, config: str) -> dict | None:
    """The first (step, phase, rank, parameter) whose bits differ from the replay, as values."""
    if "metric" not in frame.columns:
        return None
    rows = frame[(frame["metric"] == "replay_differing") & (frame["config"] == config) & (frame["value"] > 0)]
    if rows.empty:
        return None
    order = {p: i for i, p in enumerate(PHASES)}
    rows = rows.assign(_phase=rows["phase"].map(order), _q=(rows["quantity"] == "param").astype(int))
    row = rows.sort_values(["step", "_phase", "_q", "rank"], kind="stable").iloc[0]
    module_rows = frame[(frame["metric"] == "replay_module") & (frame["config"] == config)]
    module, found_by = None, None
    if not module_rows.empty and row["phase"] == "local_gradient":
        module, found_by = str(module_rows.iloc[0]["module"]), str(module_rows.iloc[0]["found_by"])
    def number(key):
        value = row.get(key, math.nan) if hasattr(row, "get") else math.nan
        return math.nan if value is None else float(value)

    values = dict(step=int(row["step"]), rank=int(row["rank"]), phase=str(row["phase"]),
                  quantity=str(row["quantity"]), param=str(row["param"]), differing=int(row["value"]),
                  max_ulp=number("max_ulp"), max_relative=number("max_relative"),
                  module=module or "", found_by=found_by or "")
    return values
