"""DDP communication hooks that measure, emulate or replace the gradient reduction.

Register one with ``ddp_model.register_comm_hook(state, hook)``. DDP calls
the hook once per gradient bucket with a :class:`torch.distributed.GradBucket`
holding this rank's *local* (unaveraged) gradients, flattened; the hook
returns a future of the averaged bucket. Three hooks, one question each:

* :func:`audit_hook` -- "is what the backend computed rounding, or a bug?"
  It performs the normal reduction and, on audited steps, also gathers every
  rank's contribution and hands the live result to ddplab's referee
  (:func:`ddplab.numerics.measure`): bit for bit against the emulated order
  where that order is bit-exact, else against the rounding bound, and
  against the correctly rounded mean in ulps and absolute error.
* :func:`order_hook` -- "what would another backend have computed?" It
  replaces the backend's reduction by an emulated order (gloo ring, NCCL ring
  or tree, sequential, exact), computed identically on every rank.
* :func:`reproducible_hook` -- "can the answer stop depending on the order?"
  An int64 fixed-point reduction whose result is bitwise the same for any
  backend, reduction order and placement of ranks.

Stand-ins for torch's ``default_hooks``, the same math, runnable on gloo/CPU:
:func:`fp16_compress_hook`, :func:`bf16_compress_hook` (torch's refuses any
backend but NCCL by its name) and :func:`allreduce_hook`.
:func:`gloo_equivalent` maps torch's hooks to them; :data:`REPLAY_EMULATIONS`
gives, per ddplab hook whose live gloo result ddplab reproduces bit for bit,
the function of every rank's bucket that computes it
(:mod:`ddplab.numerics.compression`).

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
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as _torch_hooks

from ddplab import records as _records
from ddplab.numerics import accuracy as _accuracy
from ddplab.numerics import bounds as _bounds
from ddplab.numerics import compression as _compression
from ddplab.numerics import fixed_point as _fixed_point
from ddplab.numerics import orders as _orders
from ddplab.numerics.fpformat import parse_dtype
from ddplab.probes import all_gather_flat

__all__ = [
    "ddp_default_hook",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "COMPRESSION_DTYPE",
    "REPLAY_EMULATIONS",
    "gloo_equivalent",
    "AuditState",
    "AuditAlarm",
    "audit_hook",
    "OrderState",
    "order_hook",
    "ReproducibleState",
    "reproducible_hook",
]

#: The order that models a live result, per backend (both ring depths are W-1).
BACKEND_ORDER = {"gloo": "gloo_ring", "nccl": "nccl_ring"}
#: Backends whose live order ddplab emulates bit for bit (gloo's ring, checked
#: against live gloo); NCCL's chunking depends on protocol and channels.
BIT_EXACT_BACKENDS = ("gloo",)
#: DDP's reducer averages by multiplying with 1/W before the SUM (float32's 1/W,
#: in float32, for half-precision buckets: torch's mul_ by a Python float).
DDP_AVERAGING = _orders.DDP_AVERAGING

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


# --------------------------------------------------------------------------- torch's default hooks, on gloo


def _compress_fut(dtype: torch.dtype, process_group: dist.ProcessGroup | None,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``_compress_hook``: cast the bucket to ``dtype``, divide by W there, SUM, copy back."""
    group = _group(process_group)
    buffer = bucket.buffer()
    # Cast first, then divide in the low precision (torch: buffer.to(dtype).div_(world_size)):
    # two roundings to dtype, in that order, before the SUM rounds in dtype too.
    compressed = buffer.to(dtype).div_(group.size())

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        # Into the bucket itself, as torch does (no second full-size buffer; pytorch#45968).
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def allreduce_hook(process_group: dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``allreduce_hook``: divide the bucket by W, then allreduce SUM.

    ``mean = sum_r fl(x_r / W)``, summed in the backend's order. Not bitwise
    DDP without a hook for W not a power of two (see :func:`ddp_default_hook`).

    Example::
        >>> ddp_model.register_comm_hook(None, allreduce_hook)
    """
    group = _group(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def fp16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``fp16_compress_hook``: ``c_r = fl16(fl16(x_r) / W)``, SUM in float16, back into the bucket.

    The same operations in the same order as torch's hook, so live results
    are bitwise equal; ddplab knows this function, so
    :data:`REPLAY_EMULATIONS` can reproduce what it leaves
    (:func:`ddplab.numerics.emulate_compressed_allreduce`).

    Example::
        >>> ddp_model.register_comm_hook(None, fp16_compress_hook)
    """
    return _compress_fut(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook``, runnable on gloo: ``c_r = flbf16(flbf16(x_r) / W)``, SUM in bfloat16.

    torch's own hook is refused by DDP without CUDA and NCCL 2.10+ ("BF16 all
    reduce communication hook required CUDA 11+ and NCCL 2.10+"); gloo
    reduces bfloat16 on the CPU, so this one runs there.

    Example::
        >>> ddp_model.register_comm_hook(None, bf16_compress_hook)   # gloo, CPU
    """
    return _compress_fut(torch.bfloat16, process_group, bucket)


# DDP's register_comm_hook refuses a hook by its *name* ("bf16_compress_hook") unless CUDA
# and NCCL 2.10+ are present; the refusal guards NCCL's bfloat16 support, which gloo does
# not need. So this function goes by another name.
bf16_compress_hook.__name__ = "gloo_bf16_compress_hook"   # __qualname__ kept: pickle finds it by that

#: The dtype each compression hook reduces in (torch's and ddplab's).
COMPRESSION_DTYPE: dict[Callable, torch.dtype] = {
    fp16_compress_hook: torch.float16, _torch_hooks.fp16_compress_hook: torch.float16,
    bf16_compress_hook: torch.bfloat16, _torch_hooks.bf16_compress_hook: torch.bfloat16,
}


def _allreduce_divide_first(contributions: torch.Tensor) -> torch.Tensor:
    return _orders.reduce(contributions, "gloo_ring", op="avg", averaging="divide_first")


def _fp16_compressed(contributions: torch.Tensor) -> torch.Tensor:
    return _compression.emulate_compressed_allreduce(contributions, torch.float16)


def _bf16_compressed(contributions: torch.Tensor) -> torch.Tensor:
    return _compression.emulate_compressed_allreduce(contributions, torch.bfloat16)


#: ddplab hook -> ``f(contributions [W, N]) -> [N]``: the bucket the hook leaves on gloo, bit for
#: bit, from every rank's bucket before the hook (checked against live gloo in the tests).
REPLAY_EMULATIONS: dict[Callable, Callable[[torch.Tensor], torch.Tensor]] = {
    ddp_default_hook: _compression.emulate_ddp_allreduce,
    allreduce_hook: _allreduce_divide_first,
    fp16_compress_hook: _fp16_compressed,
    bf16_compress_hook: _bf16_compressed,
}

_GLOO_EQUIVALENTS = {
    _torch_hooks.fp16_compress_hook: (
        fp16_compress_hook,
        "torch's fp16_compress_hook ran as ddplab.comm_hooks.fp16_compress_hook, the same math "
        "(cast to float16, divide by W, SUM in float16, cast back), which ddplab replays bit for bit"),
    _torch_hooks.bf16_compress_hook: (
        bf16_compress_hook,
        "torch's bf16_compress_hook refuses gloo; ddplab.comm_hooks.bf16_compress_hook, the same math "
        "(cast to bfloat16, divide by W, SUM in bfloat16, cast back), ran instead"),
    _torch_hooks.allreduce_hook: (
        allreduce_hook,
        "torch's allreduce_hook ran as ddplab.comm_hooks.allreduce_hook, the same math "
        "(divide by W, then SUM), which ddplab replays bit for bit"),
}


def gloo_equivalent(hook: Callable | None) -> tuple[Callable | None, str | None]:
    """The hook to register on gloo in place of ``hook``, and a note saying so (None: ``hook`` itself).

    torch's ``fp16_compress_hook``, ``bf16_compress_hook`` and
    ``allreduce_hook`` map to ddplab's hooks of the same math (bf16's because
    torch's refuses gloo, all three so that :data:`REPLAY_EMULATIONS` knows
    what ran); any other hook maps to itself.

    Example::
        >>> gloo_equivalent(default_hooks.bf16_compress_hook)[0] is bf16_compress_hook
        True
        >>> gloo_equivalent(audit_hook) == (audit_hook, None)
        True
    """
    try:
        return _GLOO_EQUIVALENTS.get(hook, (hook, None))
    except TypeError:       # an unhashable callable object: none of torch's functions
        return hook, None


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


def _inner_reduction(inner: Hook | None, inner_state: Any) -> dict:
    """How a known inner hook reduces: the options of :func:`ddplab.numerics.reduce` it amounts to.

    ``emulated`` is True when the hook computes the order with ddplab's own
    emulation (so that order is bit-exact for its result), False when it
    computes something else than any order (the fixed-point hook), None when
    it goes through the backend's allreduce.
    """
    if inner is None or inner is ddp_default_hook:
        return dict(averaging=DDP_AVERAGING, emulated=None)
    if inner in (_torch_hooks.allreduce_hook, allreduce_hook):
        return dict(averaging="divide_first", emulated=None)
    if inner in COMPRESSION_DTYPE:   # cast, divide by W, SUM in float16/bfloat16, cast back
        return dict(averaging="divide_first", reduce_dtype=COMPRESSION_DTYPE[inner], emulated=None)
    if inner is order_hook and isinstance(inner_state, OrderState):
        return dict(order=inner_state.order, averaging=inner_state.averaging,
                    accumulate=inner_state.accumulate, reduce_dtype=inner_state.reduce_dtype,
                    options=dict(inner_state._user_options), emulated=True)
    if inner is reproducible_hook:
        # Aims at one correct rounding of the mean; bit for bit only as often as int64 holds it.
        return dict(order="exact", averaging=None, emulated=False)
    # Any other hook: assumed to wrap DDP's own reduction (as fault-injecting wrappers do).
    return dict(averaging=DDP_AVERAGING, emulated=None)


class AuditState(_StepState):
    """State for :func:`audit_hook`.

    ``audit_every``: audit steps 0, k, 2k, ... only (other steps cost what
    the live reduction costs). ``names``: the DDP model, its module or a
    ``{name: parameter}`` mapping, to name each bucket's parameters.
    ``inner`` / ``inner_state``: the hook that performs the live reduction
    (default :func:`ddp_default_hook`), so any hook -- fp16 compression,
    :func:`order_hook`, :func:`reproducible_hook` -- can be audited.

    How the live result was computed, which decides its model and bound:
    ``order``, ``averaging``, ``reduce_dtype`` (the dtype the reduction runs
    in when the hook casts the bucket, e.g. float16 for torch's
    ``fp16_compress_hook``), ``accumulate`` and ``options`` (the order's).
    Left as None they are inferred from the inner hook: DDP's own reduction
    (the backend's ring, multiply by 1/W), torch's ``allreduce_hook``
    (divide by W first), torch's ``fp16_compress_hook`` and
    ``bf16_compress_hook`` (divide first, in float16/bfloat16),
    :func:`order_hook` (its state's order and options), :func:`reproducible_hook`
    (the exact mean); any other hook is assumed to wrap DDP's reduction.
    ``bitwise``: whether the live result must equal the emulated order bit
    for bit (default: when an :func:`order_hook` computed that order, or
    when the order is the live backend's and ddplab emulates it bit for bit
    -- gloo's ring; never for live NCCL); pass False for a hook that
    computes something no order does.

    ``raise_on_alarm`` makes a "not rounding" bucket raise
    :class:`AuditAlarm` in the future's callback, which DDP's ``backward()``
    re-raises as a RuntimeError quoting it; every alarm is kept in
    ``alarms`` either way. ``labels`` are added to every record.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, audit_every: int = 1,
                 names=None, inner: Hook | None = None, inner_state: Any = None,
                 order: str | None = None, averaging: str | None = None, reduce_dtype=None,
                 accumulate=None, bitwise: bool | None = None, options: Mapping[str, Any] | None = None,
                 raise_on_alarm: bool = False, labels: Mapping[str, Any] | None = None):
        if isinstance(audit_every, bool) or not isinstance(audit_every, int) or audit_every < 1:
            raise ValueError(f"audit_every must be an int >= 1, got {audit_every!r}")
        if order is not None:
            _orders.order_options(order)
        if averaging is not None and averaging not in _orders.AVERAGING:
            raise ValueError(f"unknown averaging {averaging!r}; choose one of {', '.join(_orders.AVERAGING)}")
        if inner is not None and not callable(inner):
            raise ValueError(f"inner must be a comm hook (state, bucket) -> Future, got {type(inner).__name__}")
        if bitwise is not None and not isinstance(bitwise, bool):
            raise ValueError(f"bitwise must be True, False or None, got {bitwise!r}")
        known = _inner_reduction(inner, inner_state)
        order = order if order is not None else known.get("order")
        if averaging is None:
            averaging = known.get("averaging")
        reduce_dtype = reduce_dtype if reduce_dtype is not None else known.get("reduce_dtype")
        accumulate = accumulate if accumulate is not None else known.get("accumulate")
        options = dict(options) if options is not None else dict(known.get("options", {}))
        # Everything reduce() would reject, before any process group is needed.
        for dtype in (reduce_dtype, accumulate):
            if dtype is not None:
                parse_dtype(dtype)
        if order is not None:
            _orders.check_reduction(order, op="avg", averaging=None if order == "exact" else averaging,
                                    accumulate=accumulate, reduce_dtype=reduce_dtype, **options)
        super().__init__(process_group)
        self.audit_every = audit_every
        self.names = _param_names(names)
        self.inner = inner
        self.inner_state = inner_state
        backend = dist.get_backend(process_group)
        if order is None:
            order = BACKEND_ORDER.get(backend, "sequential")
        spec = _orders.check_reduction(order, self.world_size, op="avg",
                                       averaging=None if order == "exact" else averaging,
                                       accumulate=accumulate, reduce_dtype=reduce_dtype, **options)
        self.order = order
        self.averaging = None if order == "exact" else spec["averaging"]
        self.reduce_dtype = spec["reduce_dtype"]
        self.accumulate = spec["accumulate"]
        self.options = options
        if bitwise is None:
            if known["emulated"] is not None:
                bitwise = known["emulated"] and known.get("order") == order
            else:
                bitwise = backend in BIT_EXACT_BACKENDS and BACKEND_ORDER.get(backend) == order
        self.bitwise = bitwise
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

    def _reduction(self) -> dict:
        """The keyword arguments of reduce()/measure() that describe the live reduction."""
        return dict(op="avg", averaging=self.averaging, accumulate=self.accumulate,
                    reduce_dtype=self.reduce_dtype)


def _alarm_message(step: int, index: int, params: str, state: AuditState, m: dict) -> str:
    where = f"step {step}, bucket {index} ({params}): the reduced gradient"
    if m["evidence"] == "bitwise":
        return (f"{where} differs from the emulated {state.order} order in {m['differs_count']} of "
                f"{m['numel']} elements (first at {m['first_differs']}; "
                f"{m['max_bound_ratio']:.3g}x the rounding bound): not rounding")
    return f"{where} is {m['max_bound_ratio']:.3g}x the rounding bound away from the exact mean: not rounding"


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
            # The result the order gives, the same on every rank: where that order is
            # bit-exact, a live result equal to it bit for bit is that order's rounding
            # and anything else is not.
            expected = _orders.reduce(contributions, state.order, **state._reduction(), **state.options)
            matches = _accuracy.same_bits(mine, expected)
            differs = not bool(matches.all())
            _records.emit("matches_order", float(matches.to(torch.float64).mean()), step=step,
                          bucket=index, rank=rank, order=state.order, bit_exact=state.bitwise, **labels)
            if not (auditor or differs):
                return result
            # The exact reference is computed on the CPU (float64 + exact fallback).
            m = _accuracy.measure(mine, contributions, state.order, expected=expected, bitwise=state.bitwise,
                                  **state._reduction(), **state.options)
            recs = _accuracy.records_of(m, mine, contributions, state.order, step=step, rank=rank,
                                        bucket=index, reason="rotation" if auditor else "differs_from_order",
                                        **state._reduction(), **labels)
        for rec in recs:
            fields = {k: v for k, v in rec.items() if k not in _records.RECORD_COLUMNS}
            _records.emit(rec["metric"], rec["value"], step=step, bucket=index, rank=rank, **fields)
        if m["classification"] == _bounds.NOT_ROUNDING:
            state.alarms.append(dict(step=step, bucket=index, params=params, verdict=m["classification"],
                                     evidence=m["evidence"], max_bound_ratio=m["max_bound_ratio"],
                                     frac_matches_order=m["frac_matches_order"],
                                     differs_count=m["differs_count"], first_differs=m["first_differs"]))
            if state.raise_on_alarm:
                raise AuditAlarm(_alarm_message(step, index, params, state, m))
        return result

    return torch.futures.collect_all([work.get_future(), live]).then(audit)


def audit_hook(state: AuditState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce as usual and, on audited steps, referee the result against the emulated order and the exact mean.

    Returns the live reduction's result unchanged (with the default inner
    hook, bitwise what DDP computes without a hook). On steps divisible by
    ``state.audit_every`` it also all_gathers every rank's bucket and

    * every rank emits ``matches_order``: the fraction of its result's
      elements bitwise equal to what ``state.order`` computes from the
      gathered contributions (1.0 on gloo with the default order), labelled
      ``bit_exact`` (whether that order is bit-exact for this result);
    * one rank per bucket, in rotation, and every rank whose result differs
      from the order's anywhere, measure their full result with
      :func:`ddplab.numerics.measure` and emit its
      :data:`~ddplab.numerics.accuracy.METRICS` with labels
      ``hook="audit"``, ``params`` (the bucket's parameter names),
      ``order``, ``op``, ``dtype``, ``world_size``, ``reason``
      (``rotation`` or ``differs_from_order``), ``verdict`` and
      ``evidence``. Where the order is bit-exact (``state.bitwise``) a result
      that differs from it in any bit is "not rounding"; otherwise the
      verdict is the rounding bound's (γ_d·Σ|x_r| with d the order's depth,
      the casts of ``reduce_dtype`` included), or "undetermined" where that
      bound is infinite.

    A "not rounding" verdict is an alarm (``state.alarms``; raised with
    ``raise_on_alarm``). Why not every rank in full: a result equal bit for
    bit to the order's is measured once for all ranks holding it, and a rank
    holding anything else -- a fault on that rank alone -- still measures
    its own. The measurement (W times cheaper this way) is most of an
    audited step's cost; the rest is one all_gather of the bucket (W times
    its size). Steps that are not audited cost nothing extra.

    Example::
        >>> state = AuditState(audit_every=10, names=ddp_model)
        >>> ddp_model.register_comm_hook(state, audit_hook)
        >>> # torch's compression hook, audited in float16 (inferred from the hook):
        >>> ddp_model.register_comm_hook(AuditState(inner=fp16_compress_hook), audit_hook)
    """
    step = state._advance(bucket)
    if step % state.audit_every:
        return state._live(bucket)
    return _audit_fut(state, bucket, step)


# --------------------------------------------------------------------------- emulated order


class OrderState(_StepState):
    """State for :func:`order_hook`: the emulated ``order`` and everything :func:`ddplab.numerics.reduce` takes.

    ``averaging`` defaults to DDP's (multiply by fl(1/W), then sum), so
    ``order="gloo_ring"`` reproduces DDP on gloo bit for bit; ``accumulate``
    computes in a wider dtype, ``reduce_dtype`` in another one (cast, reduce,
    cast back, as compression hooks do); ``options`` are the order's own
    (:func:`ddplab.numerics.orders.order_options`, e.g. ``channels`` for
    ``nccl_ring``). Unknown orders, options or dtypes raise ValueError here,
    before any step.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, order: str = "gloo_ring", *,
                 averaging: str = DDP_AVERAGING, accumulate=None, reduce_dtype=None, **options: Any):
        spec = _orders.check_reduction(order, op="avg", averaging=None if order == "exact" else averaging,
                                       accumulate=accumulate, reduce_dtype=reduce_dtype, **options)
        super().__init__(process_group)
        # Options that depend on W (ranks_per_node, ring) are checked now that W is known.
        self.options = _orders.order_options(order, self.world_size, **options)
        self.order = order
        self.averaging = None if order == "exact" else spec["averaging"]
        self.accumulate = spec["accumulate"]
        self.reduce_dtype = spec["reduce_dtype"]
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
        >>> ddp_model.register_comm_hook(OrderState(order="nccl_tree", accumulate=torch.float32), order_hook)
    """
    state._advance(bucket)
    buffer = bucket.buffer()
    gathered, work = all_gather_flat(buffer, group=_group(state.process_group), async_op=True)

    def reduce_in_order(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()
        with _rank_threads():
            out = _orders.reduce(gathered.cpu(), state.order, op="avg", averaging=state.averaging,
                                 accumulate=state.accumulate, reduce_dtype=state.reduce_dtype,
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
