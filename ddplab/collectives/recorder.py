"""Record every collective this rank issues, in issue order, with the step the caller labels.

Inside a rank (e.g. one started by :func:`ddplab.launch`)::

    with ddplab.collectives.recording() as rec:
        model = DDP(net)                       # its broadcast and allgather are recorded too
        for step in range(3):
            rec.set_step(step)
            loss_fn(model(x)).backward()       # the reducer's all-reduces
            opt.step()
        return rec.records()                   # to the parent: verify(result.returns)

Inputs are copied when a collective is issued (unless the caller holds their
bits already: :meth:`Recorder.inputs_held_as`); the collective is then
waited for and its outputs copied before its caller gets the Work back (see
:meth:`Recorder.on_result`). With ``spill_dir`` each
step's tensors go to ``spill_dir/rank<r>/step<s>.<part>.pt`` when the next
step is set, and only digests stay in memory. With ``keep_tensors=False`` only
the digests, shapes and dtypes are kept (a run whose collectives are compared
by digest only, such as :mod:`ddplab.compare`'s symmetric twin). With
``digests=False`` the tensors are kept and no digest is taken (empty ones
stand in): hashing every collective's bytes costs a rank about as much as
copying them, and a caller that verifies the tensors never reads it.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d

from ddplab.collectives.ops import POINT_TO_POINT, OpSpec
from ddplab.collectives.record import CollectiveRecord, HookResult, tensor_digest
from ddplab.collectives.verification import _bits   # bitwise equality, as verification compares

__all__ = ["Recorder", "recording", "active_recorder", "set_step"]

_active: "Recorder | None" = None


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format)


#: How many of the last records :meth:`Recorder.held_copy` looks through (a hook's collectives are its last).
_HELD_RECENT = 4


def _reduce_op(obj) -> str:
    """The name ("sum", "avg", "max", ...) of a boxed ReduceOp."""
    return dist.ReduceOp.RedOpType(obj.op()).name.lower()


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Recorder:
    """This rank's record of collectives and DDP comm-hook results (see the module docstring)."""

    def __init__(self, *, spill_dir: str | os.PathLike | None = None, wait_timeout: float = 300.0,
                 keep_tensors: bool = True, digests: bool = True):
        if not (keep_tensors or digests):
            raise ValueError("a recording keeps the tensors, their digests, or both: keep_tensors=False "
                             "needs digests=True")
        if spill_dir is not None and not digests:
            raise ValueError("a spilling recording holds only the digests in memory: it needs digests=True")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.keep_tensors = keep_tensors
        self.digests = digests
        self.spill_dir = None if spill_dir is None else os.fspath(spill_dir)
        self.wait_timeout = wait_timeout
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._records: list[CollectiveRecord | HookResult] = []
        self._next_index = 0
        self._sequence: dict[str, int] = {}
        self._group_ranks: dict[str, tuple[int, ...] | None] = {}
        self._pending = 0
        self._step: int | None = None
        self._spill_parts = 0
        self._hook_scope = threading.local()
        self._labels: dict = {}

    @contextlib.contextmanager
    def labelled(self, **labels) -> Iterator[None]:
        """Collectives issued inside the block carry ``labels`` in their ``extra`` (inner blocks override),
        e.g. the parameters whose gradient a reduction carries."""
        previous = self._labels
        self._labels = {**previous, **labels}
        try:
            yield
        finally:
            self._labels = previous

    # ------------------------------------------------------------------ the caller's side

    @property
    def step(self) -> int | None:
        return self._step

    def set_step(self, step: int) -> None:
        """Label the collectives issued from now on with ``step``; spill earlier steps when spilling."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        with self._lock:
            self._step = step
        if self.spill_dir is not None:
            self._spill(keep_step=step)

    def records(self) -> list[CollectiveRecord | HookResult]:
        """Every record so far in issue order, once every collective issued has completed."""
        self.wait()
        if self.spill_dir is not None:
            self._spill(keep_step=None)
        with self._lock:
            return list(self._records)

    def take(self) -> list[CollectiveRecord | HookResult]:
        """Every record so far, as :meth:`records`, and forget them: a step's records leave the rank
        with its capture, so memory does not grow with the number of steps."""
        self.wait()
        with self._lock:
            out, self._records = self._records, []
        return out

    def wait(self) -> None:
        """Block until every recorded collective and hook result has completed (``wait_timeout`` s)."""
        with self._settled:
            if not self._settled.wait_for(lambda: self._pending == 0, timeout=self.wait_timeout):
                raise TimeoutError(f"{self._pending} recorded collective(s) did not complete in "
                                   f"{self.wait_timeout:g} s")

    # ------------------------------------------------------------------ indices and groups

    def _group(self, pg) -> tuple[str, tuple[int, ...] | None]:
        name = pg.group_name
        if name not in self._group_ranks:
            try:
                self._group_ranks[name] = tuple(dist.get_process_group_ranks(pg))
            except Exception:  # noqa: BLE001 - a group torch's registry does not know
                self._group_ranks[name] = None
        return name, self._group_ranks[name]

    def _enter(self, rec, group: str | None = None, point_to_point: bool = False) -> None:
        """Give ``rec`` its issue index (and its place in its group's order) and keep it."""
        with self._lock:
            rec.index = self._next_index
            self._next_index += 1
            rec.step = self._step
            if group is not None and not point_to_point:
                rec.sequence = self._sequence.get(group, 0)
                self._sequence[group] = rec.sequence + 1
            self._records.append(rec)
            self._pending += 1

    def _settle(self) -> None:
        with self._settled:
            self._pending -= 1
            self._settled.notify_all()

    # ------------------------------------------------------------------ collectives (called by the kernels)

    def on_issue(self, spec: OpSpec, args: tuple) -> CollectiveRecord:
        """Before the collective runs: its group, op and inputs. Never raises."""
        rec = CollectiveRecord(rank=self.rank, index=-1, op=spec.op, c10d_op=spec.c10d_op)
        group = None
        try:
            pg = c10d.ProcessGroup.unbox(args[spec.group_arg])
            group, rec.group_ranks = self._group(pg)
            rec.group, rec.group_rank = group, pg.rank()
            if spec.reduce_arg is not None:
                rec.reduce_op = _reduce_op(args[spec.reduce_arg])
            if spec.root_arg is not None:
                rec.root = int(args[spec.root_arg])
            if spec.extra is not None:
                rec.extra.update(spec.extra(args))
            rec.extra.update(self._labels)
            # Digests read the inputs in place: the collective has not run yet.
            live = [t.detach() for t in spec.inputs(args)]
            outputs = spec.outputs(args)
            rec.input_shapes = tuple(tuple(t.shape) for t in live)
            rec.output_shapes = tuple(tuple(t.shape) for t in outputs)
            sample = (live or outputs)
            rec.dtype = str(sample[0].dtype).removeprefix("torch.") if sample else None
            rec.input_digests = self._digests(live)
            rec.tensors = {"inputs": [self._kept_input(t, rec) for t in live]} if self.keep_tensors else None
        except Exception as exc:  # noqa: BLE001 - the collective must run on every rank regardless
            rec.error = f"not recorded at issue: {_error_text(exc)}"
        scope = getattr(self._hook_scope, "current", None)
        if scope is not None:
            rec.bucket = scope.bucket
        self._enter(rec, group, point_to_point=spec.op in POINT_TO_POINT)
        if scope is not None:
            scope.collectives += (rec.index,)
        return rec

    def on_result(self, rec: CollectiveRecord, spec: OpSpec, args: tuple, result):
        """After the kernel returned: copy the outputs once the collective completed; return ``result``.

        A collective is waited for here, before its caller gets its Work back,
        and its outputs copied: whatever the caller does next (DDP's reducer
        copies the next step's gradients into the bucket as soon as the
        future's waiters wake, which is before the future's callbacks run;
        FSDP2 divides its reduce-scatter output in place) comes after the
        copy. The cost is the overlap of communication with computation; the
        arithmetic is unchanged. Point-to-point ops are not waited for (two
        ranks that each receive before they send would hang) and their
        outputs are not copied (gloo's send/recv Works have no future to
        observe them by). Never raises.
        """
        if spec.op in POINT_TO_POINT:
            self._outputs(rec, [])
            return result
        outputs = spec.outputs(args)
        try:
            work = c10d.Work.unbox(spec.work(result))
            work.wait()
        except Exception as exc:  # noqa: BLE001 - the collective failed; the caller's own wait says why
            self._outputs(rec, outputs, exc)
            return result
        self._outputs(rec, outputs)
        return result

    def _kept_input(self, t: torch.Tensor, rec: CollectiveRecord):
        """What the record keeps of input ``t``: the caller's stand-in for its bits
        (:meth:`inputs_held_as`), or a copy."""
        held_as = getattr(self._hook_scope, "held_as", None)
        stand_in = held_as(t, rec) if held_as is not None else None
        return stand_in if stand_in is not None else _copy(t)

    @contextlib.contextmanager
    def inputs_held_as(self, stand_in) -> Iterator[None]:
        """Inside the block (this thread), an input for which ``stand_in(tensor, record)`` returns an
        object is kept as that object instead of a copy: the caller holds the bits already in another
        form (DDP's all-reduce input is the bucket it copied, times 1/W), and the object's ``value()``
        gives them back. ``stand_in`` runs before the collective, while the input holds them; it
        returns None for an input it does not hold. A spilling recording copies regardless: its files
        are read back as tensors only."""
        if self.spill_dir is not None or not self.keep_tensors:
            yield
            return
        previous = getattr(self._hook_scope, "held_as", None)
        self._hook_scope.held_as = stand_in
        try:
            yield
        finally:
            self._hook_scope.held_as = previous

    def _outputs(self, rec: CollectiveRecord, outputs: list[torch.Tensor],
                 failure: BaseException | None = None) -> None:
        try:
            if failure is not None:
                rec.error = rec.error or f"collective failed: {_error_text(failure)}"
                return
            copies = [_copy(t) if self.keep_tensors else t.detach() for t in outputs]
            rec.output_digests = self._digests(copies)
            if rec.tensors is not None:
                rec.tensors["outputs"] = copies
        except Exception as exc:  # noqa: BLE001 - a record that cannot be completed says why
            rec.error = rec.error or f"outputs not recorded: {_error_text(exc)}"
        finally:
            self._settle()

    def _digests(self, tensors: list[torch.Tensor]) -> tuple[str, ...]:
        return tuple(tensor_digest(t) for t in tensors) if self.digests else ()

    # ------------------------------------------------------------------ DDP comm hooks (ddplab.collectives.comm_hooks)

    @contextlib.contextmanager
    def hook_call(self, bucket: int) -> Iterator[HookResult]:
        """Open a :class:`HookResult` for ``bucket``; collectives issued inside the block link to it."""
        rec = HookResult(rank=self.rank, index=-1, bucket=bucket)
        self._enter(rec)
        previous = getattr(self._hook_scope, "current", None)
        self._hook_scope.current = rec
        try:
            yield rec
        except BaseException as exc:
            self.hook_failed(rec, exc)
            raise
        finally:
            self._hook_scope.current = previous

    def held_copy(self, t: torch.Tensor) -> torch.Tensor | None:
        """The copy this recording holds of ``t``'s bits, or None: an output of one of its last few
        collectives with ``t``'s dtype, shape and bits. A hook hands the reduced tensor back (DDP's own
        does), and whoever keeps it too keeps that copy rather than one more of the same bytes."""
        if not self.keep_tensors or t.layout != torch.strided or t.is_complex():
            return None
        with self._lock:
            recent = [r for r in self._records[-_HELD_RECENT:] if isinstance(r, CollectiveRecord)]
        for r in reversed(recent):
            for out in ((r.tensors or {}).get("outputs") or []):
                if out.dtype == t.dtype and out.shape == t.shape and torch.equal(_bits(out), _bits(t)):
                    return out
        return None

    def hook_result(self, rec: HookResult, value: torch.Tensor) -> None:
        try:
            copy = value.detach()
            if self.keep_tensors:
                held = self.held_copy(value)
                copy = held if held is not None else _copy(value)
            rec.dtype = str(copy.dtype).removeprefix("torch.")
            rec.shape = tuple(copy.shape)
            rec.digest = tensor_digest(copy) if self.digests else ""
            rec.tensors = {"result": [copy]} if self.keep_tensors else None
        except Exception as exc:  # noqa: BLE001 - DDP must get its value regardless
            rec.error = f"not recorded: {_error_text(exc)}"
        finally:
            self._settle()

    def hook_failed(self, rec: HookResult, exc: BaseException) -> None:
        rec.error = f"comm hook failed: {_error_text(exc)}"
        self._settle()

    # ------------------------------------------------------------------ spilling

    def _spill(self, keep_step: int | None) -> None:
        """Move the tensors of complete records of other steps than ``keep_step`` to one file per step."""
        with self._lock:
            movable = [r for r in self._records if r.tensors is not None and r.complete
                       and (keep_step is None or r.step != keep_step)]
            self._spill_parts += 1
            part = self._spill_parts
        by_step: dict = {}
        for r in movable:
            by_step.setdefault(r.step, []).append(r)
        folder = os.path.join(self.spill_dir, f"rank{self.rank}")
        os.makedirs(folder, exist_ok=True)
        for step, recs in by_step.items():
            path = os.path.join(folder, f"step{'none' if step is None else step}.{part}.pt")
            torch.save({r.index: r.tensors for r in recs}, path)
            for r in recs:
                r.spill, r.tensors = path, None


def active_recorder() -> Recorder | None:
    """The recorder of the enclosing :func:`recording` block in this process, or None."""
    return _active


def set_step(step: int) -> None:
    """Label what the active recorder records from now on with ``step`` (RuntimeError without one)."""
    if _active is None:
        raise RuntimeError("no collectives recording is active in this process; enter recording() first")
    _active.set_step(step)


@contextlib.contextmanager
def recording(*, spill_dir: str | os.PathLike | None = None, wait_timeout: float = 300.0,
              keep_tensors: bool = True, digests: bool = True) -> Iterator[Recorder]:
    """Record every CPU collective of this process, and DDP comm hooks' results, inside the block.

    One recording per process at a time. On exit torch's kernels and DDP's
    ``register_comm_hook`` are restored and the collectives still in flight
    are awaited; the yielded :class:`Recorder` keeps its records.
    """
    global _active
    from ddplab.collectives.comm_hooks import recording_comm_hooks
    from ddplab.collectives.interception import intercept

    if _active is not None:
        raise RuntimeError("a collectives recording is already active in this process")
    recorder = Recorder(spill_dir=spill_dir, wait_timeout=wait_timeout, keep_tensors=keep_tensors,
                        digests=digests)
    lib = intercept(recorder.on_issue, recorder.on_result)
    _active = recorder
    try:
        with recording_comm_hooks(recorder):
            yield recorder
    finally:
        _active = None
        lib._destroy()
    recorder.wait()
