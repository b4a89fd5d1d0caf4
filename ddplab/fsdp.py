"""FSDP2 reduce-scatter instrumentation inside real ranks: audit, emulated order, float32 reduction.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduces each parameter
group's gradients with one reduce-scatter per backward, and
``FSDPModule.set_custom_reduce_scatter(comm)`` (torch 2.13) replaces the
object it calls: ``comm(output_tensor, input_tensor, group, op)`` receives
this rank's flat input (the group's gradients, padded, cast to
``reduce_dtype`` and already divided by FSDP's pre-divide factor) and must
leave this rank's shard in ``output_tensor``; FSDP post-divides and casts
it back to the parameters' dtype afterwards. What FSDP chooses as ``op``
and the factors is :func:`ddplab.numerics.fsdp_reduction`. Three comms, one
question each:

* :class:`AuditReduceScatter` -- "is what the backend computed rounding,
  or a bug?" It performs the normal reduce-scatter and measures this
  rank's shard against the exact result of the same contributions (the
  mean for AVG, the sum for SUM), in the dtype the collective really runs
  in, with the referee's labels (:func:`ddplab.numerics.measure`).
* :class:`OrderReduceScatter` -- "what would another backend have
  computed?" It replaces the collective by an emulated order, so a CPU run
  computes what NCCL's ring would have.
* :class:`Float32ReduceScatter` -- "would a float32 reduction have helped?"
  It reduces in float32 whatever ``reduce_dtype`` says and rounds the shard
  to ``reduce_dtype`` once.

Attach one to every parameter group of an already built model with one call:
:func:`attach_audit`, :func:`attach_order`, :func:`attach_float32`.

Steps: one state is shared by all groups of a model; ``step`` counts the
backwards that reduce-scattered, from 0. Every group reduces once per such
backward, so a group reducing a second time starts the next step.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ddplab import records as _records
from ddplab.comm_hooks import BACKEND_ORDER, _rank_threads
from ddplab.numerics import accuracy as _accuracy
from ddplab.numerics import float_format
from ddplab.numerics import orders as _orders
from ddplab.numerics.reduce_scatter import REDUCE_SCATTER_ORDERS, reduce_scatter

__all__ = [
    "fsdp_groups",
    "reduce_scatter_args",
    "reduce_op_name",
    "FSDPState",
    "FSDPAlarm",
    "AuditReduceScatter",
    "OrderReduceScatter",
    "Float32ReduceScatter",
    "attach_audit",
    "attach_order",
    "attach_float32",
]

#: The callable a comm performs the live collective with: ``fn(output, input, group, op)``.
LiveReduceScatter = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup, Any], Any]


def _live_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op) -> None:
    """What FSDP2's default comm does: one ``reduce_scatter_single``, waited for."""
    dist.reduce_scatter_single(output, input, op=op, group=group)


def reduce_scatter_args(op, order: str) -> dict:
    """The :func:`ddplab.numerics.reduce_scatter` arguments of a ReduceOp FSDP passes, in ``order``.

    AVG averages as ``order``'s backend does (gloo: SUM, then divide by W;
    NCCL: multiply each contribution by fl(1/W)); PREMUL_SUM(f) multiplies
    each contribution by f; SUM sums.
    """
    kind = getattr(op, "op", op)            # PREMUL_SUM arrives as a ReduceOp carrying .factor
    if kind == dist.ReduceOp.AVG:
        return {"op": "avg", "averaging": None if order == "exact" else _orders.default_averaging(order)}
    if kind == dist.ReduceOp.SUM:
        return {"op": "sum"}
    if kind == dist.ReduceOp.PREMUL_SUM:
        return {"op": "sum", "premul": float(op.factor)}
    raise ValueError(f"FSDP2 reduces gradients with AVG, SUM or PREMUL_SUM, not {op}")


def reduce_op_name(op) -> str:
    """"avg", "sum" or "premul_sum" for the ReduceOp FSDP passes (its label in the records)."""
    kind = getattr(op, "op", op)
    names = {dist.ReduceOp.AVG: "avg", dist.ReduceOp.SUM: "sum", dist.ReduceOp.PREMUL_SUM: "premul_sum"}
    return names.get(kind, str(kind))


def fsdp_groups(model: torch.nn.Module) -> list[tuple[str, FSDPModule, list[str]]]:
    """Every FSDP2 parameter group of ``model``: ``(module name, FSDP module, parameter names)``.

    The root module is named ``"<root>"``. Raises ValueError when ``model``
    holds no ``fully_shard`` module.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        for group in state._fsdp_param_groups:
            params = [names.get(id(fp.sharded_param), "?") for fp in group.fsdp_params]
            out.append((fqn or "<root>", module, params))
    if not out:
        raise ValueError("the model holds no fully_shard (FSDP2) module; call fully_shard first")
    return out


class FSDPAlarm(RuntimeError):
    """A reduce-scatter's shard is farther from the exact result than rounding can explain."""

    def __reduce__(self):  # picklable, so it crosses process boundaries intact
        return (type(self), self.args)


class FSDPState:
    """What the comms of one model share: the step count, labels, alarms, and pending measurements.

    ``labels`` are added to every record the comms emit. Full measurements
    run in one background thread while the backward goes on, and are
    finished (records emitted, alarms noted or raised) on the training thread
    at the end of the backward that started them, or by :meth:`flush`.
    """

    def __init__(self, labels: Mapping[str, Any] | None = None):
        self.step = 0
        #: The comms attached, one per parameter group, in :func:`fsdp_groups` order.
        self.comms: list[ReduceScatter] = []
        self._reduced: set[int] = set()
        self.labels = dict(labels or {})
        for key, value in self.labels.items():
            _records._check_label(key, value)
        self.alarms: list[dict] = []
        self._pending: list[tuple[concurrent.futures.Future, Callable[[Any], None]]] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._flush_queued = False

    def advance(self, group_index: int) -> int:
        """The step this group's reduce-scatter belongs to (a repeat starts the next step)."""
        if group_index in self._reduced:
            self.step += 1
            self._reduced.clear()
        self._reduced.add(group_index)
        return self.step

    def defer(self, work: Callable[[], Any], finish: Callable[[Any], None]) -> None:
        """Run ``work()`` in the measuring thread; call ``finish(its result)`` here at the backward's end.

        Why a thread: a measurement inline would hold back the next collective
        for every rank; beside the backward it costs only CPU time.
        """
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                   thread_name_prefix="ddplab-fsdp-audit")
        threads = torch.get_num_threads()

        def run():
            torch.set_num_threads(threads)    # a new thread starts with the process default, not the rank's
            return work()

        self._pending.append((self._executor.submit(run), finish))
        if self._flush_queued:
            return
        try:
            # Runs after FSDP's own end-of-backward callback (queued at the root's pre-backward),
            # so the root group's reduce-scatter is finished with the others.
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self._flush_queued = True
        except RuntimeError:                  # called outside a backward: finish now
            self.flush()

    def flush(self) -> None:
        """Finish every pending measurement: emit its records, note its alarms; re-raise the first error."""
        self._flush_queued = False
        pending, self._pending = self._pending, []
        error = None
        for future, finish in pending:
            try:
                finish(future.result())
            except Exception as exc:          # finish them all, then report the first
                error = error or exc
        if error is not None:
            raise error


class _Comm(ReduceScatter):
    """A ReduceScatter for one parameter group: allocation as FSDP's default, the group's identity."""

    def __init__(self, state: FSDPState, group_index: int = 0, group_name: str = "", params: list[str] = ()):
        self.state = state
        self.group_index = group_index
        self.group_name = group_name
        self.params = ",".join(params)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _labels(self, group: dist.ProcessGroup, op, dtype: torch.dtype) -> dict:
        return dict(group=self.group_name, params=self.params, collective="reduce_scatter",
                    reduce_op=reduce_op_name(op), reduce_dtype=float_format(dtype).name, **self.state.labels)


def _shard_contributions(input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``[W, n]``: every rank's elements of this rank's shard (one all_to_all, N elements each way).

    With ``async_op=True`` returns ``(contributions, work)``, valid once ``work`` completes.
    """
    world = dist.get_world_size(group)
    out = torch.empty_like(input)
    work = dist.all_to_all_single(out, input.contiguous(), group=group, async_op=async_op)
    contributions = out.view(world, input.numel() // world)
    return (contributions, work) if async_op else contributions


# --------------------------------------------------------------------------- audit


class AuditReduceScatter(_Comm):
    """Reduce-scatter as usual and measure this rank's shard against the exact result.

    On audited steps (0, k, 2k, ... for ``audit_every=k``) it first
    all_to_all-s every rank's part of this rank's shard (the contributions
    ``[W, n]``; N elements of traffic per rank, as the reduce-scatter
    itself), then runs the live collective (``live``, default FSDP's own
    ``reduce_scatter_single``; it must not write its input) and

    * every rank emits ``matches_order``: the fraction of its shard's
      elements bitwise equal to what ``order`` computes from the
      contributions (gloo's order for a gloo group: 1.0 unless something
      other than rounding happened), labelled with ``verdict`` and
      ``evidence`` when that comparison decides alone (a bit-exact order,
      every bit equal: "rounding", "bitwise");
    * the referee's records (:func:`ddplab.numerics.error_records`: ulps,
      absolute and RMS error, multiples of the rigorous and of the
      probabilistic bound, ``verdict`` and ``evidence``), with the emulated
      shard as ``expected`` and ``bitwise=True`` when ``order`` is the
      backend's own, bit-exact order (``bitwise=True`` also for an order
      ``live`` itself emulates, e.g. :class:`OrderReduceScatter`'s), come
      from one rank per group and step in rotation (``reason="rotation"``),
      from every rank whose shard differs from the order's
      (``reason="differs_from_order"``) and, without a bit-exact order,
      from every rank (``reason="no_bitwise_order"``); ``every_rank=True``
      measures every shard in full (``reason="every_rank"``).

    The full measurements run in a background thread beside the rest of the
    backward; their records arrive, and their alarms are noted, at the end
    of that backward (``state.flush()`` finishes pending ones at any time).

    Why not every rank in full by default: a shard equal bit for bit to a
    bit-exact order is rounding, and that comparison is cheap; the full
    measurement (exact reference, bounds) is most of the audit's cost, so
    one shard per collective carries the numbers and any other shard that
    departs from the order is measured by its own rank.

    Every record carries ``step``, ``rank``, ``bucket`` (the group's index),
    and the labels ``group`` (the FSDP module's name), ``params``,
    ``collective``, ``reduce_op`` ("avg", "sum", "premul_sum"),
    ``reduce_dtype``, ``order`` plus the state's labels. A verdict of "not
    rounding" is also kept in ``state.alarms`` (and raised as
    :class:`FSDPAlarm` with ``raise_on_alarm``).
    """

    def __init__(self, state: FSDPState, group_index: int = 0, group_name: str = "", params: list[str] = (),
                 *, audit_every: int = 1, order: str | None = None, live: LiveReduceScatter | None = None,
                 bitwise: bool | None = None, every_rank: bool = False, raise_on_alarm: bool = False):
        if isinstance(audit_every, bool) or not isinstance(audit_every, int) or audit_every < 1:
            raise ValueError(f"audit_every must be an int >= 1, got {audit_every!r}")
        if order is not None and order not in REDUCE_SCATTER_ORDERS:
            raise ValueError(f"unknown reduce-scatter order {order!r}; choose one of "
                             f"{', '.join(REDUCE_SCATTER_ORDERS)}")
        if live is not None and not callable(live):
            raise ValueError(f"live must be a callable (output, input, group, op), got {type(live).__name__}")
        super().__init__(state, group_index, group_name, params)
        self.audit_every = audit_every
        self.order = order
        self.live = live or _live_reduce_scatter
        self.bitwise = bitwise
        self.every_rank = every_rank
        self.raise_on_alarm = raise_on_alarm

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        step = self.state.advance(self.group_index)
        if step % self.audit_every:
            self.live(output_tensor, input_tensor, group, op)
            return None
        # The all_to_all runs beside the live collective (gloo serves a group with two
        # threads), so the audit adds little wall time for it; both only read the input.
        contributions, work = _shard_contributions(input_tensor, group, async_op=True)
        self.live(output_tensor, input_tensor, group, op)
        work.wait()
        self._measure(output_tensor, contributions, group, op, step)
        return None

    def _measure(self, shard: torch.Tensor, contributions: torch.Tensor, group: dist.ProcessGroup, op,
                 step: int) -> None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        backend_order = BACKEND_ORDER.get(dist.get_backend(group), "sequential")
        order = self.order or backend_order
        args = reduce_scatter_args(op, order)
        mine = shard.detach().cpu().clone()    # FSDP divides its output in place after this call
        contributions = contributions.cpu()
        labels = self._labels(group, op, mine.dtype)
        # The backend's own order is emulated bit for bit; NCCL's live order only as a model.
        bitwise = (order == backend_order and order in _orders.BIT_EXACT_ORDERS) if self.bitwise is None \
            else self.bitwise
        rotation = (step + self.group_index) % world == rank

        def work() -> list[dict]:
            with _rank_threads():
                return self._records(mine, contributions, order, args, bitwise, rotation, step, rank, labels)

        self.state.defer(work, lambda recs: self._finish(recs, step, rank))

    def _records(self, mine, contributions, order, args, bitwise, rotation, step, rank, labels) -> list[dict]:
        """``matches_order``, then the referee's records when this shard is to be measured in full."""
        expected = reduce_scatter(contributions, order, shard=rank, shard_only=True, **args)
        matches = float((_bits(mine) == _bits(expected)).to(torch.float64).mean()) if mine.numel() else 1.0
        decided = dict(verdict="rounding", evidence="bitwise") if bitwise and matches == 1.0 else {}
        recs = [_records.record("matches_order", matches, step=step, bucket=self.group_index, rank=rank,
                                order=order, **decided, **labels)]
        if self.every_rank:
            reason = "every_rank"
        elif not bitwise:
            reason = "no_bitwise_order"
        elif matches < 1.0:
            reason = "differs_from_order"
        elif rotation:
            reason = "rotation"
        else:
            return recs
        if "premul" in args:
            # PREMUL_SUM's products RN(x * f) are what the ring adds: measure the additions
            # on them (the products' own rounding, < u each, is outside this measurement).
            scale = torch.tensor(args["premul"], dtype=torch.float64).to(contributions.dtype)
            contributions = contributions * scale
            labels = dict(labels, measured_on="premultiplied contributions")
        return recs + _accuracy.error_records(
            mine, contributions, order, op=args["op"], averaging=args.get("averaging"), expected=expected,
            bitwise=bitwise, step=step, rank=rank, bucket=self.group_index, reason=reason, **labels)

    def _finish(self, recs: list[dict], step: int, rank: int) -> None:
        for rec in recs:
            fields = {k: v for k, v in rec.items() if k not in _records.RECORD_COLUMNS}
            _records.emit(rec["metric"], rec["value"], step=step, bucket=self.group_index, rank=rank, **fields)
        full = recs[1:]
        if full and full[0]["verdict"] == "not rounding":
            ratio = next((r["value"] for r in full if r["metric"] == "max_bound_ratio"), float("nan"))
            alarm = dict(step=step, group=self.group_name, rank=rank, max_bound_ratio=ratio,
                         evidence=full[0]["evidence"])
            self.state.alarms.append(alarm)
            if self.raise_on_alarm:
                raise FSDPAlarm(f"step {step}, group {self.group_name!r}, rank {rank}: the reduce-scattered "
                                f"gradient shard is not what rounding gives ({alarm['evidence']} evidence, "
                                f"{ratio:.3g}x the rounding bound)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(float_format(t.dtype).int_dtype)


# --------------------------------------------------------------------------- emulated order


class OrderReduceScatter(_Comm):
    """Reduce-scatter in an emulated order instead of the backend's.

    all_to_all-s every rank's part of this rank's shard and reduces it with
    :func:`ddplab.numerics.reduce_scatter` in ``order`` (AVG as that order's
    backend averages, e.g. ncclAvg's multiplication by fl(1/W) for
    ``nccl_ring``; ``averaging`` overrides it), ``accumulate`` and the
    order's ``options``. Each rank computes only its own shard, as the real
    collective does. Traffic equals the reduce-scatter's; the arithmetic runs on the CPU.
    """

    def __init__(self, state: FSDPState, group_index: int = 0, group_name: str = "", params: list[str] = (),
                 *, order: str = "nccl_ring", averaging: str | None = None, accumulate=None, **options):
        probe = torch.zeros(2, 2)
        reduce_scatter(probe, order, **options)     # an unknown order or option raises ValueError here
        if averaging is not None and averaging not in _orders.AVERAGING:
            raise ValueError(f"unknown averaging {averaging!r}; choose one of {', '.join(_orders.AVERAGING)}")
        super().__init__(state, group_index, group_name, params)
        self.order = order
        self.averaging = averaging
        self.accumulate = accumulate
        self.options = options

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        self.state.advance(self.group_index)
        contributions = _shard_contributions(input_tensor, group)
        args = reduce_scatter_args(op, self.order)
        if self.averaging is not None and args["op"] == "avg":
            args["averaging"] = self.averaging
        with _rank_threads():
            shard = reduce_scatter(contributions.cpu(), self.order, shard=dist.get_rank(group), shard_only=True,
                                       accumulate=self.accumulate, **args, **self.options)
        output_tensor.copy_(shard)
        return None


# --------------------------------------------------------------------------- float32


class Float32ReduceScatter(_Comm):
    """Reduce-scatter in float32 whatever ``reduce_dtype`` is, then round the shard once.

    The input (in ``reduce_dtype``) is converted to float32 exactly, the live
    collective runs in float32 with FSDP's op, and the float32 shard is
    rounded to the output's dtype. For float32 and float64 inputs it is the
    plain collective.
    """

    def __init__(self, state: FSDPState, group_index: int = 0, group_name: str = "", params: list[str] = (),
                 *, live: LiveReduceScatter | None = None):
        super().__init__(state, group_index, group_name, params)
        self.live = live or _live_reduce_scatter

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        self.state.advance(self.group_index)
        if input_tensor.dtype in (torch.float32, torch.float64):
            self.live(output_tensor, input_tensor, group, op)
            return None
        wide_out = torch.empty(output_tensor.shape, dtype=torch.float32, device=output_tensor.device)
        self.live(wide_out, input_tensor.to(torch.float32), group, op)
        output_tensor.copy_(wide_out)
        return None


# --------------------------------------------------------------------------- attaching


def _attach(model: torch.nn.Module, make: Callable[[int, str, list[str]], _Comm], state: FSDPState) -> FSDPState:
    make(0, "", [])         # bad arguments raise ValueError before any module changes
    for index, (name, module, params) in enumerate(fsdp_groups(model)):
        comm = make(index, name, params)
        module.set_custom_reduce_scatter(comm)
        state.comms.append(comm)
    return state


def attach_audit(model: torch.nn.Module, *, audit_every: int = 1, order: str | None = None,
                 live: LiveReduceScatter | None = None, bitwise: bool | None = None, every_rank: bool = False,
                 raise_on_alarm: bool = False, labels: Mapping[str, Any] | None = None) -> FSDPState:
    """Audit every reduce-scatter of every parameter group of an FSDP2 model; return the shared state.

    One call on a model already wrapped with ``fully_shard`` (any nesting):
    each FSDP module gets an :class:`AuditReduceScatter` through
    ``set_custom_reduce_scatter``. Training is unchanged (the live
    collective still computes the gradients); the records stream to the
    launcher like any other. ``order`` is the order the shards are expected
    to follow (default the backend's: gloo's ring for gloo, NCCL's ring for
    NCCL); ``live`` replaces the collective (a fault to plant, another comm);
    ``every_rank=True`` measures every shard in full, not one per collective
    (see :class:`AuditReduceScatter`).

    Example::
        >>> model = fully_shard(build())          # after fully_shard on the layers
        >>> state = attach_audit(model, audit_every=10, labels={"run": "bf16"})
        >>> ...train...; state.alarms             # [] when every shard was rounding
    """
    state = FSDPState(labels)
    return _attach(model, lambda i, n, p: AuditReduceScatter(
        state, i, n, p, audit_every=audit_every, order=order, live=live, bitwise=bitwise,
        every_rank=every_rank, raise_on_alarm=raise_on_alarm), state)


def attach_order(model: torch.nn.Module, order: str = "nccl_ring", *, averaging: str | None = None,
                 accumulate=None, **options) -> FSDPState:
    """Replace every parameter group's reduce-scatter by the emulated ``order``; return the shared state.

    Example::
        >>> attach_order(model, "nccl_ring")      # a gloo run computes what NCCL's ring would
    """
    state = FSDPState()
    return _attach(model, lambda i, n, p: OrderReduceScatter(
        state, i, n, p, order=order, averaging=averaging, accumulate=accumulate, **options), state)


def attach_float32(model: torch.nn.Module) -> FSDPState:
    """Reduce every parameter group's gradients in float32, whatever ``reduce_dtype`` says.

    Example::
        >>> attach_float32(model)                 # MixedPrecisionPolicy(reduce_dtype=bf16), reduced in float32
    """
    state = FSDPState()
    return _attach(model, lambda i, n, p: Float32ReduceScatter(state, i, n, p), state)
