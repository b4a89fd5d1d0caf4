"""Verify recorded collectives: every output equals, bit for bit, the emulation from every rank's inputs.

:func:`verify` takes the records of every rank (what each rank's
``Recorder.records()`` returned, e.g. ``ddplab.launch(...).returns``), pairs
each collective across its group's ranks by the group's issue order
(``sequence``), emulates it (:mod:`ddplab.collectives.emulation`) and
compares each rank's recorded outputs with the emulation, bit for bit. A DDP
comm hook's result (:class:`~ddplab.collectives.record.HookResult`) must be
the output of the last collective the hook issued, converted to the result's
dtype (what ``allreduce_hook`` and the fp16/bf16 compression hooks return);
one that is not the same size has no such check (PowerSGD's).
Point-to-point ops are recorded but not verified.

The result is typed (:class:`CollectiveVerification`: mismatches, the first
one, what could not be verified and why, the dtypes each step reduced in) and
tidy (``records``: :func:`ddplab.records.record` rows with ``step``, ``rank``
and the labels ``op``, ``group``, ``group_name``, ``dtype``, ``collective``,
``index``, ``reduce_op``, ``stage``).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from ddplab.collectives.emulation import Unverifiable, emulate
from ddplab.collectives.ops import POINT_TO_POINT, REDUCTIONS
from ddplab.collectives.record import CollectiveRecord, HookResult
from ddplab.numerics import SUPPORTED_DTYPES, ulp_distance
from ddplab.numerics.accuracy import same_memory
from ddplab.records import record

__all__ = ["CollectiveMismatch", "Unverified", "CollectiveVerification", "verify"]

#: ``stage`` of a finding: the collective's output, the comm hook's result, or ranks that disagree on the call.
STAGES = ("output", "comm_hook_result", "issue")


@dataclasses.dataclass(frozen=True)
class CollectiveMismatch:
    """One rank's output (or comm hook result) that differs from the emulation of the collective."""

    step: int | None
    rank: int
    op: str
    group: tuple[int, ...] | None
    group_name: str
    dtype: str | None
    collective: int | None           # position in the group's issue order
    index: int                       # the rank's issue index
    stage: str
    elements_differing: int | None   # None for stage "issue"
    numel: int | None
    max_ulp: int | None              # None for non-float dtypes and stage "issue"
    bucket: int | None = None


@dataclasses.dataclass(frozen=True)
class Unverified:
    """A collective (or hook result) that was recorded but could not be checked, and why."""

    step: int | None
    ranks: tuple[int, ...]
    op: str
    group_name: str
    collective: int | None
    stage: str
    reason: str


@dataclasses.dataclass(frozen=True)
class CollectiveVerification:
    """Everything :func:`verify` found; ``exact`` when no output differs from its emulation."""

    checked: int                                 # (collective, rank) outputs and hook results compared
    mismatches: tuple[CollectiveMismatch, ...]
    unverified: tuple[Unverified, ...]
    dtypes_by_step: dict                         # step -> dtypes its reductions ran in
    records: tuple[dict, ...]

    @property
    def exact(self) -> bool:
        return not self.mismatches

    @property
    def first_mismatch(self) -> CollectiveMismatch | None:
        """The earliest finding: by step, then the rank's issue index, then rank."""
        return self.mismatches[0] if self.mismatches else None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its width, flattened (bitwise equality, NaN payloads included)."""
    t = t.reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.dtype.is_floating_point:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return t.contiguous().view(ints[t.element_size()])
    return t


def _compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[int, int, int | None]:
    """``(numel, elements differing, max |ulp|)`` of recorded outputs against expected ones.

    The ulp distance is None for dtypes other than the four float types and
    when a shape or dtype itself differs.
    """
    numel = differing = 0
    worst = 0 if all(g.dtype in SUPPORTED_DTYPES for g in got) else None
    for g, w in zip(got, want, strict=True):
        numel += g.numel()
        if g.shape != w.shape or g.dtype != w.dtype:
            differing += g.numel()
            worst = None
            continue
        gb, wb = _bits(g), _bits(w)
        if same_memory(gb, wb) or torch.equal(gb, wb):   # the common case, no element mask
            continue
        neq = gb != wb
        n = int(neq.sum())
        differing += n
        if n and worst is not None:
            worst = max(worst, int(ulp_distance(g.reshape(-1)[neq], w.reshape(-1)[neq]).abs().max()))
    return numel, differing, worst


def _group_label(ranks) -> str:
    return "?" if ranks is None else ",".join(map(str, ranks))


class _Findings:
    """Accumulates mismatches, unverified collectives and tidy records."""

    def __init__(self):
        self.checked = 0
        self.mismatches: list[CollectiveMismatch] = []
        self.unverified: list[Unverified] = []
        self.rows: list[dict] = []

    def labels(self, rec: CollectiveRecord, stage: str) -> dict:
        return dict(op=rec.op, group=_group_label(rec.group_ranks), group_name=rec.group,
                    dtype=rec.dtype, collective=rec.sequence, index=rec.index, reduce_op=rec.reduce_op,
                    stage=stage)

    def skip(self, recs: list, reason: str, stage: str = "output") -> None:
        first = recs[0]
        op = first.op if isinstance(first, CollectiveRecord) else "comm_hook"
        group = first.group if isinstance(first, CollectiveRecord) else ""
        seq = first.sequence if isinstance(first, CollectiveRecord) else None
        self.unverified.append(Unverified(first.step, tuple(sorted(r.rank for r in recs)), op, group,
                                          seq, stage, reason))
        for r in recs:
            labels = self.labels(r, stage) if isinstance(r, CollectiveRecord) else dict(stage=stage)
            self.rows.append(record("collective_unverified", 1, step=r.step, rank=r.rank,
                                    bucket=getattr(r, "bucket", None), **labels))

    def compared(self, rec: CollectiveRecord, got, want, stage: str = "output", *, step=None,
                 rank=None, bucket=None, result: tuple | None = None) -> tuple:
        """Record ``got`` against ``want`` (``result``: their :func:`_compare`, made already); returns it."""
        numel, differing, worst = result = result if result is not None else _compare(got, want)
        self.checked += 1
        step = rec.step if step is None else step
        rank = rec.rank if rank is None else rank
        bucket = rec.bucket if bucket is None else bucket
        labels = self.labels(rec, stage)
        self.rows.append(record("collective_elements_differing", differing, step=step, rank=rank,
                                bucket=bucket, **labels))
        if worst is not None:
            self.rows.append(record("collective_max_ulp", worst, step=step, rank=rank, bucket=bucket, **labels))
        if differing:
            self.mismatches.append(CollectiveMismatch(step, rank, rec.op, rec.group_ranks, rec.group, rec.dtype,
                                                      rec.sequence, rec.index, stage, differing, numel, worst,
                                                      bucket))
        return result


def _flatten(records) -> list:
    flat = []
    for item in records:
        if isinstance(item, (CollectiveRecord, HookResult)):
            flat.append(item)
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            flat.extend(_flatten(item))
        else:
            raise TypeError(f"verify takes CollectiveRecord/HookResult records (or lists of them per rank), "
                            f"got {type(item).__name__}")
    seen = set()
    for r in flat:
        if (r.rank, r.index) in seen:
            raise ValueError(f"rank {r.rank}'s record {r.index} appears twice")
        seen.add((r.rank, r.index))
    return flat


def _issue_disagreement(recs: list[CollectiveRecord]) -> str | None:
    for field in ("op", "dtype", "reduce_op", "root"):
        values = {getattr(r, field) for r in recs}
        if len(values) > 1:
            return f"ranks disagree on {field}: {sorted(map(str, values))}"
    return None


def _verify_collective(recs: list[CollectiveRecord], out: _Findings, known: dict) -> None:
    """Check every rank's outputs of one collective (its records from each member of the group)
    against the emulation of their inputs, or what ``known`` holds for it."""
    first = recs[0]
    members = first.group_ranks
    if members is None or sorted(r.rank for r in recs) != sorted(members):
        have = sorted(r.rank for r in recs)
        out.skip(recs, f"records of group ranks {members} needed, have ranks {have}")
        return
    errors = [f"rank {r.rank}: {r.error}" for r in recs if r.error]
    if errors:
        out.skip(recs, "; ".join(errors))
        return
    if not all(r.complete for r in recs):
        out.skip(recs, "the collective had not completed when the records were taken")
        return
    disagreement = _issue_disagreement(recs)
    if disagreement:
        for r in recs:
            out.mismatches.append(CollectiveMismatch(r.step, r.rank, r.op, r.group_ranks, r.group, r.dtype,
                                                     r.sequence, r.index, "issue", None, None, None, r.bucket))
        out.skip(recs, disagreement, stage="issue")
        return
    by_group_rank = sorted(recs, key=lambda r: r.group_rank)
    want = known.get((first.group, first.sequence))
    inputs = [] if want is not None else [r.inputs() for r in by_group_rank]
    outputs = [r.outputs() for r in by_group_rank]
    if any(t is None for t in inputs + outputs):
        out.skip(recs, "the tensors were not kept")
        return
    if want is None:
        try:
            want = emulate(first.op, inputs, [r.output_shapes for r in by_group_rank], reduce_op=first.reduce_op,
                           root=first.root, extra=[r.extra for r in by_group_rank])
        except Unverifiable as exc:
            out.skip(recs, str(exc))
            return
    done: list[tuple[list, list, tuple]] = []
    for r, got, expected in zip(by_group_rank, outputs, want):
        # A rank whose outputs and expected outputs are views of another's (read back as rank 0's, the
        # same emulation) compares as that one did, without a second pass over the same bytes.
        again = next((result for g, w, result in done if _same_views(g, got) and _same_views(w, expected)), None)
        done.append((got, expected, out.compared(r, got, expected, result=again)))


def _same_views(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(same_memory(x, y) for x, y in zip(a, b))


def _verify_hook(hook: HookResult, own: dict[tuple[int, int], CollectiveRecord], out: _Findings) -> None:
    """A hook's result must be its last collective's output, converted to the result's dtype."""
    stage = "comm_hook_result"
    if hook.error or not hook.collectives:
        out.skip([hook], hook.error or "the hook issued no collective", stage)
        return
    coll = own.get((hook.rank, hook.collectives[-1]))
    result = hook.result()
    outputs = None if coll is None else coll.outputs()
    if result is None or outputs is None:
        out.skip([hook], "the tensors were not kept", stage)
        return
    flat = (outputs[0].reshape(-1) if len(outputs) == 1 else    # one output: no copy of it
            torch.cat([t.reshape(-1) for t in outputs]) if outputs else torch.empty(0))
    if flat.numel() != result.numel():
        out.skip([hook], f"the result ({result.numel()} elements) is not its collective's output "
                         f"({flat.numel()} elements)", stage)
        return
    out.compared(coll, [result.reshape(-1)], [flat.to(result.dtype)], stage, step=hook.step,
                 bucket=hook.bucket)


def verify(records, known: dict | None = None) -> CollectiveVerification:
    """Verify every recorded collective and comm-hook result of every rank (see the module docstring).

    ``known``: ``(group, sequence) -> outputs`` (per group rank, a list of tensors) of collectives the
    caller already emulated bit for bit from the same inputs; those are compared with them, and their
    inputs are not read."""
    known = known or {}
    flat = _flatten(records)
    collectives = [r for r in flat if isinstance(r, CollectiveRecord)]
    paired: dict[tuple, list[CollectiveRecord]] = {}
    for r in collectives:
        if r.op not in POINT_TO_POINT:
            paired.setdefault((r.group, r.sequence), []).append(r)
    out = _Findings()
    for recs in sorted(paired.values(), key=lambda rs: min((_step_key(r.step), r.index) for r in rs)):
        _verify_collective(recs, out, known)
    for r in collectives:
        if r.op in POINT_TO_POINT:
            out.skip([r], "point-to-point ops are recorded, not verified: a receive is not waited for, "
                          "so its output is not copied")
    own = {(r.rank, r.index): r for r in collectives}
    for hook in (r for r in flat if isinstance(r, HookResult)):
        _verify_hook(hook, own, out)
    dtypes: dict = {}
    for r in collectives:
        if r.op in REDUCTIONS and r.dtype is not None:
            dtypes.setdefault(r.step, set()).add(r.dtype)
    mismatches = sorted(out.mismatches, key=lambda m: (_step_key(m.step), m.index, m.rank))
    return CollectiveVerification(out.checked, tuple(mismatches), tuple(out.unverified),
                                  {s: tuple(sorted(d)) for s, d in dtypes.items()}, tuple(out.rows))


def _step_key(step: int | None) -> int:
    return -1 if step is None else step
