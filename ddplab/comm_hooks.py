"""DDP communication hooks that measure, emulate or replace the gradient reduction.

Register one with ``ddp_model.register_comm_hook(state, hook)``. DDP calls
the hook once per gradient bucket with a :class:`torch.distributed.GradBucket`
holding this rank's *local* (unaveraged) gradients, flattened; the hook
returns a future of the averaged bucket. Three hooks, one question each:

* :func:`audit_hook` -- "is what the backend computed rounding, or a bug?"
  It performs the normal reduction and, on audited steps, also gathers every
  rank's contribution and measures the live result against the correctly
  rounded mean (ulps, absolute error, multiples of the rounding bound).
* :func:`order_hook` -- "what would another backend have computed?" It
  replaces the backend's reduction by an emulated order (gloo ring, NCCL ring
  or tree, sequential, exact), computed identically on every rank.
* :func:`reproducible_hook` -- "can the answer stop depending on the order?"
  An int64 fixed-point reduction whose result is bitwise the same for any
  backend, reduction order and placement of ranks.

:func:`ddp_default_hook` is what DDP does without a hook, bit for bit: the
C++ reducer *multiplies* each gradient by ``1/W`` (``mul_out`` with the
reciprocal as a scalar, rounded once to the dtype) before an allreduce SUM.
torch's Python ``allreduce_hook`` *divides* by W instead; the two agree for
W a power of two and differ in the last bit of many elements otherwise
(measured on torch 2.13 CPU/gloo, W=3: 860 of the 2040 gradient elements of
a ``Linear(50, 40)``).

Steps: every state counts the iterations it reduced (backwards outside
``no_sync()``), from 0. DDP reduces buckets in index order and
``bucket.is_last()`` marks an iteration's last bucket, after which the count
advances; all buckets of one backward see the same step. Collectives are only ever issued from the hook itself (never from a
future's callback), so every rank issues them in the same order.
"""
# No "from __future__ import annotations": DDP's register_comm_hook compares
# the hook's annotations with dist.GradBucket and Future[Tensor] as objects.
import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from ddplab import records as _records
from ddplab.numerics import accuracy as _accuracy
from ddplab.numerics import fixed_point as _fixed_point
from ddplab.numerics import orders as _orders
from ddplab.probes import all_gather_flat

__all__ = [
    "ddp_default_hook",
    "AuditState",
    "AuditAlarm",
    "audit_hook",
    "OrderState",
    "order_hook",
    "ReproducibleState",
    "reproducible_hook",
]

#: The order whose rounding bound judges a live result, per backend (both ring depths are W-1).
BACKEND_ORDER = {"gloo": "gloo_ring", "nccl": "nccl_ring"}
#: DDP's reducer averages by multiplying with 1/W before the SUM (float32's 1/W,
#: in float32, for half-precision buckets: torch's mul_ by a Python float).
DDP_AVERAGING = "multiply_float32_reciprocal"

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else dist.group.WORLD


@contextlib.contextmanager
def _rank_threads() -> Iterator[None]:
    """Run the numerics on this rank's thread budget, and leave torch's as it was.

    The numerics' numba loops default to every core, which W ranks on one
    machine oversubscribe (their OpenMP threads spin while others wait);
    they get torch's thread count instead. numba's OpenMP layer also shares
    torch's runtime and leaves the calling thread's torch thread count at
    numba's: restored here, or torch's later kernels would split their
    reductions differently and a hooked run would stop being bitwise the
    same as an unhooked one.
    """
    import numba

    threads = torch.get_num_threads()
    numba_threads = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(numba_threads)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _first_tensor(value) -> torch.Tensor:
    # Hooks return Future[Tensor]; some return Future[list[Tensor]].
    return value[0] if isinstance(value, (list, tuple)) else value


# --------------------------------------------------------------------------- DDP's own reduction


def _ddp_mean_fut(process_group: dist.ProcessGroup | None,
                  tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` across ranks exactly as DDP's reducer does; return a future."""
    group = _group(process_group)
    # Multiply by the reciprocal, not divide: that is what the reducer does
    # (mul_out(bucket_view, grad, 1/div_factor)), and it differs from a
    # division unless W is a power of two.
    tensor.mul_(1.0 / group.size())
    return (dist.all_reduce(tensor, group=group, async_op=True)
            .get_future().then(lambda fut: fut.value()[0]))


def ddp_default_hook(process_group: dist.ProcessGroup | None,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket as DDP does without a hook: multiply by 1/W, then allreduce SUM.

    Bitwise the same as registering no hook, for any W (torch's
    ``allreduce_hook`` divides and differs when W is not a power of two).

    Example::
        >>> ddp_model.register_comm_hook(None, ddp_default_hook)
    """
    return _ddp_mean_fut(process_group, bucket.buffer())


# --------------------------------------------------------------------------- shared state


class _StepState:
    """Process group, world size and the step count a hook state shares."""

    def __init__(self, process_group: dist.ProcessGroup | None):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.step = 0

    def _advance(self, bucket: dist.GradBucket) -> int:
        """Return the step this bucket belongs to; advance after the iteration's last bucket."""
        step = self.step
        if bucket.is_last():
            self.step += 1
        return step


def _param_names(names) -> dict[int, str]:
    if names is None:
        return {}
    if isinstance(names, torch.nn.Module):
        module = names.module if isinstance(names, torch.nn.parallel.DistributedDataParallel) else names
        return {id(p): n for n, p in module.named_parameters()}
    if isinstance(names, Mapping):
        return {id(p): n for n, p in names.items()}
    raise ValueError(f"names must be a module, a {{name: parameter}} mapping or None, got {type(names).__name__}")


# --------------------------------------------------------------------------- audit


class AuditAlarm(RuntimeError):
    """A bucket's live result is farther from the exact mean than rounding can explain."""

    def __reduce__(self):  # picklable, so it crosses process boundaries intact
        return (type(self), self.args)


class AuditState(_StepState):
    """State for :func:`audit_hook`.

    ``audit_every``: audit steps 0, k, 2k, ... only (other steps cost what
    the live reduction costs). ``names``: the DDP model, its module or a
    ``{name: parameter}`` mapping, to name each bucket's parameters.
    ``inner`` / ``inner_state``: the hook that performs the live reduction
    (default :func:`ddp_default_hook`), so any hook -- fp16 compression,
    :func:`order_hook`, :func:`reproducible_hook` -- can be audited.
    ``order`` and ``averaging`` say how the live result was computed, which
    sets its rounding bound: by default the backend's ring (depth W-1) and
    DDP's multiply-by-1/W. ``raise_on_alarm`` makes a "not rounding" bucket
    raise :class:`AuditAlarm` in the future's callback, which DDP's
    ``backward()`` re-raises as a RuntimeError quoting it; every alarm is
    kept in ``alarms`` either way. ``labels`` are added to every record.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, audit_every: int = 1,
                 names=None, inner: Hook | None = None, inner_state: Any = None,
                 order: str | None = None, averaging: str | None = DDP_AVERAGING,
                 raise_on_alarm: bool = False, labels: Mapping[str, Any] | None = None):
        if isinstance(audit_every, bool) or not isinstance(audit_every, int) or audit_every < 1:
            raise ValueError(f"audit_every must be an int >= 1, got {audit_every!r}")
        if order is not None:
            _orders.order_options(order)
        if averaging is not None and averaging not in _orders.AVERAGING:
            raise ValueError(f"unknown averaging {averaging!r}; choose one of {', '.join(_orders.AVERAGING)}")
        if inner is not None and not callable(inner):
            raise ValueError(f"inner must be a comm hook (state, bucket) -> Future, got {type(inner).__name__}")
        super().__init__(process_group)
        self.audit_every = audit_every
        self.names = _param_names(names)
        self.inner = inner
        self.inner_state = inner_state
        if order is None:
            order = BACKEND_ORDER.get(dist.get_backend(process_group), "sequential")
        self.order = order
        self.averaging = averaging
        self.raise_on_alarm = raise_on_alarm
        self.labels = dict(labels or {})
        for key, value in self.labels.items():
            _records._check_label(key, value)
        self.alarms: list[dict] = []

    def _live(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self.inner is None:
            return _ddp_mean_fut(self.process_group, bucket.buffer())
        return self.inner(self.inner_state, bucket)

    def _bucket_params(self, bucket: dist.GradBucket) -> str:
        return ",".join(self.names.get(id(p), f"?{list(p.shape)}") for p in bucket.parameters())


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.view(ints) == b.view(ints)


def _audit_fut(state: AuditState, bucket: dist.GradBucket, step: int) -> torch.futures.Future:
    group = _group(state.process_group)
    # Copy this rank's contribution first: the live reduction works in place.
    local = bucket.buffer().detach().clone()
    gathered, work = all_gather_flat(local, group=group, async_op=True)
    live = state._live(bucket)
    index, params, rank = bucket.index(), state._bucket_params(bucket), dist.get_rank()
    # One rank per bucket measures the result in full, in rotation.
    auditor = (step + index) % state.world_size == dist.get_rank(group)
    labels = dict(hook="audit", params=params, **state.labels)

    def audit(fut: torch.futures.Future) -> torch.Tensor:
        for f in fut.value():  # surface a failed collective as that failure
            f.value()
        result = _first_tensor(live.value())
        mine, contributions = result.detach().cpu(), gathered.cpu()
        with _rank_threads():
            # The result the backend's order gives, the same on every rank: a
            # live result equal to it bit for bit is that order's rounding.
            expected = _orders.reduce(contributions, state.order, op="avg",
                                      averaging=None if state.order == "exact" else state.averaging)
            matches = _bitwise_equal(mine, expected)
            differs = not bool(matches.all())
            _records.emit("matches_order", float(matches.to(torch.float64).mean()), step=step,
                          bucket=index, rank=rank, order=state.order, **labels)
            if not (auditor or differs):
                return result
            # The exact reference is computed on the CPU (float64 + exact fallback).
            recs = _accuracy.error_records(
                mine, contributions, state.order, op="avg", averaging=state.averaging, step=step,
                rank=rank, bucket=index, reason="rotation" if auditor else "differs_from_order",
                **labels)
        within = next(r["value"] for r in recs if r["metric"] == "within_bound")
        verdict = "rounding" if within == 1.0 else "not rounding"
        for rec in recs:
            rec["verdict"] = verdict
            fields = {k: v for k, v in rec.items() if k not in _records.RECORD_COLUMNS}
            _records.emit(rec["metric"], rec["value"], step=step, bucket=index, rank=rank, **fields)
        if verdict != "rounding":
            ratio = next(r["value"] for r in recs if r["metric"] == "max_bound_ratio")
            alarm = dict(step=step, bucket=index, params=params, max_bound_ratio=ratio)
            state.alarms.append(alarm)
            if state.raise_on_alarm:
                raise AuditAlarm(f"step {step}, bucket {index} ({params}): the reduced gradient is "
                                 f"{ratio:.3g}x the rounding bound away from the exact mean: not rounding")
        return result

    return torch.futures.collect_all([work.get_future(), live]).then(audit)


def audit_hook(state: AuditState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce as usual and, on audited steps, measure the result against the exact mean.

    Returns the live reduction's result unchanged (with the default inner
    hook, bitwise what DDP computes without a hook). On steps divisible by
    ``state.audit_every`` it also all_gathers every rank's bucket and

    * every rank emits ``matches_order``: the fraction of its result's
      elements bitwise equal to what ``state.order`` computes from the
      gathered contributions (1.0 on gloo with the default order);
    * one rank per bucket, in rotation, and every rank whose result differs
      from the order's anywhere, measure their full result against the
      correctly rounded mean and emit the
      :data:`ddplab.numerics.accuracy.METRICS` (``numel``, ``max_ulp``,
      ``mean_ulp``, ``frac_correctly_rounded``, ``max_abs_error``,
      ``max_rel_error``, ``max_bound_ratio``, ``within_bound``) with labels
      ``hook="audit"``, ``params`` (the bucket's parameter names), ``order``,
      ``op``, ``dtype``, ``world_size``, ``reason`` (``rotation`` or
      ``differs_from_order``) and ``verdict``: "rounding" when every
      element's error is within the order's rounding bound (γ_d·Σ|x_r|
      with d the order's depth), "not rounding" beyond.

    Why not every rank in full: a result equal bit for bit to the order's is
    measured once for all ranks holding it, and a rank holding anything
    else -- a fault on that rank alone -- still measures its own. The
    measurement (W times cheaper this way) is most of an audited step's
    cost; the rest is one all_gather of the bucket (W times its size).
    Steps that are not audited cost nothing extra.

    Example::
        >>> state = AuditState(audit_every=10, names=ddp_model)
        >>> ddp_model.register_comm_hook(state, audit_hook)
    """
    step = state._advance(bucket)
    if step % state.audit_every:
        return state._live(bucket)
    return _audit_fut(state, bucket, step)


# --------------------------------------------------------------------------- emulated order


class OrderState(_StepState):
    """State for :func:`order_hook`: the emulated ``order``, its ``averaging`` and options.

    ``averaging`` defaults to DDP's (multiply by fl(1/W), then sum), so
    ``order="gloo_ring"`` reproduces DDP on gloo bit for bit; ``options`` are
    the order's own (:func:`ddplab.numerics.orders.order_options`, e.g.
    ``channels`` for ``nccl_ring``). Unknown orders or options raise
    ValueError here, before any step.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, order: str = "gloo_ring", *,
                 averaging: str = DDP_AVERAGING, **options: Any):
        _orders.order_options(order, **options)
        if order != "exact" and averaging not in _orders.AVERAGING:
            raise ValueError(f"unknown averaging {averaging!r}; choose one of {', '.join(_orders.AVERAGING)}")
        super().__init__(process_group)
        # Options that depend on W (ranks_per_node, ring) are checked now that W is known.
        self.options = _orders.order_options(order, self.world_size, **options)
        self.order = order
        self.averaging = averaging
        self._user_options = options


def order_hook(state: OrderState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in an emulated reduction order instead of the backend's.

    All-gathers every rank's bucket and reduces the ``[W, N]`` contributions
    with :func:`ddplab.numerics.orders.reduce` -- the same deterministic
    computation on every rank, so all ranks agree -- rounding where the
    emulated backend rounds. A CPU run thereby computes what NCCL's ring or
    tree would have; ``order="exact"`` gives the correctly rounded mean.
    Traffic is W times an allreduce's; the reduction runs on the CPU.

    Example::
        >>> ddp_model.register_comm_hook(OrderState(order="nccl_ring"), order_hook)
    """
    state._advance(bucket)
    buffer = bucket.buffer()
    gathered, work = all_gather_flat(buffer, group=_group(state.process_group), async_op=True)

    def reduce_in_order(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()
        averaging = None if state.order == "exact" else state.averaging
        with _rank_threads():
            out = _orders.reduce(gathered.cpu(), state.order, op="avg", averaging=averaging,
                                 **state._user_options)
        # The gather has completed, so the local input can be overwritten.
        return buffer.copy_(out)

    return work.get_future().then(reduce_in_order)


# --------------------------------------------------------------------------- reproducible


#: An exponent larger than any finite one: marks a block holding inf or NaN on some rank.
_POISON_EXPONENT = 1 << 20


class ReproducibleState(_StepState):
    """State for :func:`reproducible_hook`: the exponent granularity.

    ``block_size=1`` (default) shares one exponent per element across ranks
    (the correctly rounded sum almost always); ``block_size=B`` one per block
    of B elements (fewer exponent bytes); ``block_size=None`` one per
    bucket, where elements far below the bucket's largest lose bits (see
    :mod:`ddplab.numerics.fixed_point`).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, block_size: int | None = 1):
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise ValueError(f"block_size must be an int >= 1 or None, got {block_size!r}")
        super().__init__(process_group)
        self.block_size = block_size


def reproducible_hook(state: ReproducibleState,
                      bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in int64 fixed point: bitwise the same for any order, backend, placement.

    1. E = allreduce-MAX of the ranks' frexp exponents (per element or block);
    2. q_r = round(x_r * 2^k), k = 62 - H - E, W <= 2^H, as int64;
    3. Q = allreduce-SUM of q (integer addition is exact and associative, and
       the choice of k keeps every partial sum below 2^62);
    4. mean = RN(Q * 2^-k) / W.

    The sum is rounded once, so with per-element exponents it is the correctly
    rounded sum of the contributions whenever each lies within
    ``lossless_binades`` = 62 - H - p binades of its element's largest (36
    for float32, 7 for float64, at W=4); for W a power of two the mean is
    then correctly rounded too, otherwise the division by W adds a second
    rounding. Measured against the exact mean with :func:`audit_hook`
    (``order="exact"``), W=4, CNN gradients: float32 correctly rounded in
    every element, per element and with one exponent per bucket; float64
    per element correctly rounded in 99.9-100% of elements (at most 1 ulp
    off, within the one-rounding bound); float64 with one exponent per
    bucket only 89-94% and up to 32 ulps off, beyond that bound (the audit
    says "not rounding": truncation, reproducible but not rounding). Costs
    two collectives and 12 bytes per element (int32 exponents, int64
    values) instead of 4. An inf or NaN on any rank makes its block NaN on
    every rank (the ranks stay in step instead of one raising).

    Example::
        >>> ddp_model.register_comm_hook(ReproducibleState(), reproducible_hook)
    """
    state._advance(bucket)
    group = _group(state.process_group)
    world, block = state.world_size, state.block_size
    buffer = bucket.buffer()
    finite = torch.isfinite(buffer)
    all_finite = bool(finite.all())
    clean = buffer if all_finite else torch.where(finite, buffer, torch.zeros_like(buffer))
    exponent = _fixed_point.exponents(clean, block)
    if not all_finite:
        blocks_bad = _block_any(~finite, block, exponent.numel())
        exponent = torch.where(blocks_bad, torch.full_like(exponent, _POISON_EXPONENT), exponent)
    # Synchronously: the SUM needs E, and issuing it from a callback could
    # interleave with other buckets' collectives differently on each rank.
    dist.all_reduce(exponent, op=dist.ReduceOp.MAX, group=group)
    poisoned = exponent >= _POISON_EXPONENT
    any_poison = bool(poisoned.any())
    if any_poison:
        exponent = torch.where(poisoned, torch.zeros_like(exponent), exponent)
        clean = torch.where(_expand_blocks(poisoned, block, buffer.numel()), torch.zeros_like(clean), clean)
    q = _fixed_point.quantize(clean, exponent, world, block_size=block)
    work = dist.all_reduce(q, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def dequantize(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()
        with _rank_threads():
            total = _fixed_point.dequantize(q.cpu(), exponent.cpu(), world, buffer.dtype,
                                            block_size=block)
        mean = total.to(buffer.device).div_(world)
        if any_poison:
            mean[_expand_blocks(poisoned, block, buffer.numel())] = float("nan")
        return buffer.copy_(mean)

    return work.get_future().then(dequantize)


def _block_any(flags: torch.Tensor, block: int | None, n_blocks: int) -> torch.Tensor:
    if block is None:
        return flags.any().reshape(1)
    if block == 1:
        return flags
    pad = n_blocks * block - flags.numel()
    padded = torch.cat([flags, flags.new_zeros(pad)]) if pad else flags
    return padded.view(n_blocks, block).any(1)


def _expand_blocks(flags: torch.Tensor, block: int | None, numel: int) -> torch.Tensor:
    if block is None:
        return flags.expand(numel)
    if block == 1:
        return flags
    return flags.repeat_interleave(block)[:numel]
