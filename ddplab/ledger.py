"""A name-aware ledger of the collectives a rank issues, cross-checked across ranks.

Collectives pair tensors by *issue order*: the n-th all_reduce of rank 0 is
combined with the n-th all_reduce of rank 1, whatever each one meant by it.
If rank 0 reduces ``[a, b]`` while rank 1 reduces ``[b, a]`` and ``a`` and
``b`` have the same shape, both ranks silently get ``a0 + b1`` and
``b0 + a1`` (case 04's report). ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
fingerprints op type, sequence number, tensor count, dtypes, devices and
shapes, so it misses this, and it also misses SUM on one rank against MAX on
another (measured on torch 2.13, gloo; tests/test_ledger.py).

:class:`CollectiveLedger` is a context manager that, inside one rank, wraps
``torch.distributed``'s collective functions (``all_reduce``, ``reduce``,
``broadcast``, ``all_gather`` and ``all_gather_single``/``_into_tensor``,
``reduce_scatter`` and ``_single``/``_tensor``, ``all_to_all(_single)``,
``gather``, ``scatter``, ``barrier``) and writes one entry per call: the
sequence number within its process group, the op, the reduce op, the root,
the tensor's *label*, shape and dtype. Labels come from an explicit
``label=`` argument to the wrapped call, from :meth:`CollectiveLedger.name`,
or from the ``names`` given to the ledger (a module: its parameters, their
``.grad`` and its buffers; or a ``{name: tensor}`` mapping), matched by
identity or by ``data_ptr``. :meth:`CollectiveLedger.check` (also run on
exit) all_gathers the new entries of every rank and compares them sequence
number by sequence number: different labels, reduce ops, ops, roots, shapes
or dtypes, and ranks that issued a different number of collectives, are
problems; :class:`LedgerReport` holds them, the per-rank entries and the
pairing table of which tensor on rank i was combined with which on rank j.

Collectives issued by C++ (DDP's default reducer) do not pass through Python
and are not seen; those of Python communication hooks are.

Example::

    >>> with CollectiveLedger(model) as ledger:
    ...     for p in params_in_my_order:
    ...         dist.all_reduce(p.grad)
    >>> ledger.report.ok, ledger.report.problems[:1]
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from ddplab import records as _records

__all__ = [
    "COLLECTIVES",
    "LedgerEntry",
    "LedgerProblem",
    "LedgerReport",
    "CollectiveLedger",
    "CollectiveMismatchError",
    "find_problems",
]

#: Wrapped functions: name -> (argument holding the labelled tensor, reduce-op argument, root argument).
COLLECTIVES: dict[str, tuple[str | None, str | None, str | None]] = {
    "all_reduce": ("tensor", "op", None),
    "reduce": ("tensor", "op", "dst"),
    "broadcast": ("tensor", None, "src"),
    "all_gather": ("tensor", None, None),
    "all_gather_single": ("input_tensor", None, None),
    "all_gather_into_tensor": ("input_tensor", None, None),
    "reduce_scatter": ("output", "op", None),
    "reduce_scatter_single": ("input", "op", None),
    "reduce_scatter_tensor": ("input", "op", None),
    "all_to_all_single": ("input", None, None),
    "all_to_all": ("input_tensor_list", None, None),
    "gather": ("tensor", None, "dst"),
    "scatter": ("tensor", None, "src"),
    "barrier": (None, None, None),
}

#: Fields of two paired entries that must agree, in the order problems are named.
CHECKED_FIELDS = ("op", "reduce_op", "root", "shape", "dtype", "label")


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One collective as one rank issued it."""

    group: tuple[int, ...]  # global ranks of the process group
    seq: int  # 0, 1, 2, ... per process group on this rank
    rank: int  # global rank that issued it
    op: str
    reduce_op: str | None
    root: int | None
    label: str | None
    shape: tuple[int, ...] | None
    dtype: str | None
    group_name: str = "0"  # torch's name of the group (the default group is "0")


@dataclasses.dataclass(frozen=True)
class LedgerProblem:
    """Ranks disagree about collective ``seq`` of ``group``.

    ``kind`` is the first differing field of :data:`CHECKED_FIELDS`, with a
    differing ``label`` called ``pairing`` (different tensors were combined
    into one result), or ``count`` when some
    ranks issued this collective and others did not. ``values`` maps each
    rank to its value of that field.
    """

    group: tuple[int, ...]
    seq: int
    kind: str
    values: dict[int, Any]
    group_name: str = "0"

    def __str__(self) -> str:
        shown = ", ".join(f"rank {r}: {v!r}" for r, v in sorted(self.values.items()))
        what = {"pairing": "combined different tensors", "reduce_op": "used different reduce ops",
                "count": "did not all issue it"}.get(self.kind, f"differ in {self.kind}")
        return f"collective #{self.seq} (group {list(self.group)}): ranks {what} ({shown})"


class CollectiveMismatchError(RuntimeError):
    """Ranks issued inconsistent collectives; ``problems`` lists them."""

    def __init__(self, problems: list[LedgerProblem]):
        super().__init__("ranks issued inconsistent collectives:\n"
                         + "\n".join(f"  {p}" for p in problems[:20]))
        self.problems = problems

    def __reduce__(self):  # picklable, so it crosses process boundaries intact
        return (type(self), (self.problems,))


@dataclasses.dataclass
class LedgerReport:
    """Every rank's entries, merged, and the problems found (same on all ranks)."""

    entries: list[LedgerEntry]
    problems: list[LedgerProblem]

    @property
    def ok(self) -> bool:
        return not self.problems

    def frame(self):
        """One row per (collective, rank): what each rank issued, and any problem."""
        import pandas as pd

        flagged = {(p.group_name, p.seq): p.kind for p in self.problems}
        rows = [dict(dataclasses.asdict(e), problem=flagged.get((e.group_name, e.seq)))
                for e in self.entries]
        return pd.DataFrame(rows, columns=[f.name for f in dataclasses.fields(LedgerEntry)] + ["problem"])

    def pairing(self):
        """Which tensor on rank i was combined with which on rank j.

        One row per collective and pair of ranks ``i < j``: ``label_i``,
        ``label_j``, their reduce ops, and ``consistent`` (all checked
        fields agree).
        """
        import pandas as pd

        by_key: dict[tuple, dict[int, LedgerEntry]] = {}
        for e in self.entries:
            by_key.setdefault((e.group_name, e.seq), {})[e.rank] = e
        rows = []
        for (_, seq), per_rank in sorted(by_key.items()):
            ranks = sorted(per_rank)
            group = per_rank[ranks[0]].group
            for a_i, i in enumerate(ranks):
                for j in ranks[a_i + 1:]:
                    a, b = per_rank[i], per_rank[j]
                    rows.append(dict(group=group, seq=seq, op=a.op, rank_i=i, label_i=a.label,
                                     reduce_op_i=a.reduce_op, rank_j=j, label_j=b.label,
                                     reduce_op_j=b.reduce_op,
                                     consistent=all(getattr(a, f) == getattr(b, f)
                                                    for f in CHECKED_FIELDS)))
        return pd.DataFrame(rows, columns=["group", "seq", "op", "rank_i", "label_i", "reduce_op_i",
                                           "rank_j", "label_j", "reduce_op_j", "consistent"])

    def records(self, rank: int | None = None, **labels: Any) -> list[dict]:
        """Tidy records: metric ``collective_mismatch`` (0 or 1) per collective and rank."""
        flagged = {(p.group_name, p.seq): p.kind for p in self.problems}
        out = []
        for e in self.entries:
            if rank is not None and e.rank != rank:
                continue
            kind = flagged.get((e.group_name, e.seq))
            out.append(_records.record(
                "collective_mismatch", int(kind is not None), rank=e.rank, seq=e.seq, op=e.op,
                tensor=e.label, reduce_op=e.reduce_op, shape=None if e.shape is None else str(list(e.shape)),
                dtype=e.dtype, problem=kind, **labels))
        return out


def _op_name(op: Any) -> str:
    return getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]


def _group_ranks(group) -> tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _group_name(group) -> str:
    # Two groups over the same ranks keep separate sequences: key by torch's group name.
    pg = dist.group.WORLD if group is None else group
    return str(getattr(pg, "group_name", None) or _group_ranks(group))


class CollectiveLedger:
    """Record this rank's collectives inside a ``with`` block and cross-check them.

    ``names``: a module (its parameters, their gradients as ``name.grad``
    and its buffers are labelled), a ``{name: tensor}`` mapping, or ``None``.
    ``group``: the process group used for the cross-check (default: world).
    On exit, unless the block raised, :meth:`check` runs (a collective:
    every rank must leave the block) and the report is kept in ``report``;
    ``strict=True`` raises :class:`CollectiveMismatchError` on a problem.
    ``emit=True`` emits one ``collective_mismatch`` record per collective
    of this rank at each check.

    Inside the block the wrapped functions also take ``label="name"``.
    """

    def __init__(self, names: torch.nn.Module | Mapping[str, torch.Tensor] | None = None, *,
                 group: dist.ProcessGroup | None = None, strict: bool = False, emit: bool = True):
        if names is not None and not isinstance(names, (torch.nn.Module, Mapping)):
            raise ValueError(f"names must be a module, a {{name: tensor}} mapping or None, "
                             f"got {type(names).__name__}")
        self._sources = [] if names is None else [names]
        self._explicit: list[tuple[torch.Tensor, str]] = []
        self.group = group
        self.strict = strict
        self.emit = emit
        self.entries: list[LedgerEntry] = []
        self.report: LedgerReport | None = None
        self._lock = threading.Lock()
        self._seq: dict[str, int] = {}
        self._local = threading.local()
        self._saved: dict[tuple[Any, str], Callable] = {}
        self._sent = 0
        self._merged: dict[tuple[str, int], dict[int, LedgerEntry]] = {}
        self._counts: dict[str, dict[int, int]] = {}

    # -- labels -----------------------------------------------------------------------

    def name(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Label ``tensor`` for later collectives; returns it (for chaining)."""
        if not isinstance(label, str) or not label:
            raise ValueError(f"label must be a non-empty string, got {label!r}")
        self._explicit.append((tensor, label))
        return tensor

    def _candidates(self) -> Iterable[tuple[str, torch.Tensor]]:
        for t, label in reversed(self._explicit):
            yield label, t
        for src in self._sources:
            if isinstance(src, torch.nn.Module):
                for n, p in src.named_parameters():
                    yield n, p
                    if p.grad is not None:
                        yield f"{n}.grad", p.grad
                yield from src.named_buffers()
            else:
                yield from src.items()

    def label_of(self, tensor: Any) -> str | None:
        """The label this ledger gives ``tensor`` (identity first, then data_ptr)."""
        if not isinstance(tensor, torch.Tensor):
            if isinstance(tensor, (list, tuple)) and tensor:
                labels = [self.label_of(t) for t in tensor]
                return None if all(x is None for x in labels) else ",".join(str(x) for x in labels)
            return None
        candidates = list(self._candidates())
        for label, t in candidates:
            if t is tensor:
                return label
        ptr = tensor.data_ptr()
        for label, t in candidates:
            # Same memory, same extent: p.data, p.detach() and the like.
            if t.data_ptr() == ptr and t.numel() == tensor.numel() and t.dtype == tensor.dtype:
                return label
        return None

    # -- recording --------------------------------------------------------------------

    def _wrap(self, fname: str, original: Callable) -> Callable:
        tensor_arg, op_arg, root_arg = COLLECTIVES[fname]
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, label: str | None = None, **kwargs):
            depth = getattr(self._local, "depth", 0)
            # Record only the outermost collective: deprecated names call the
            # new ones, and *_object helpers call all_gather internally.
            if depth == 0 and not getattr(self._local, "suspended", False):
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                self._record(fname, bound.arguments, tensor_arg, op_arg, root_arg, label)
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        wrapper.__ddplab_ledger__ = True
        return wrapper

    def _record(self, fname, arguments, tensor_arg, op_arg, root_arg, label) -> None:
        tensor = arguments.get(tensor_arg) if tensor_arg else None
        if label is None and tensor is not None:
            label = self.label_of(tensor)
        first = tensor[0] if isinstance(tensor, (list, tuple)) and tensor else tensor
        shape = tuple(first.shape) if isinstance(first, torch.Tensor) else None
        dtype = str(first.dtype).replace("torch.", "") if isinstance(first, torch.Tensor) else None
        reduce_op = _op_name(arguments[op_arg]) if op_arg and arguments.get(op_arg) is not None else None
        root = None
        if root_arg:
            root = arguments.get(root_arg)
            group_root = arguments.get("group_" + root_arg)
            if root is None and group_root is not None:
                root = _group_ranks(arguments.get("group"))[group_root]
        group = _group_ranks(arguments.get("group"))
        name = _group_name(arguments.get("group"))
        with self._lock:
            seq = self._seq.get(name, 0)
            self._seq[name] = seq + 1
            self.entries.append(LedgerEntry(group=group, seq=seq, rank=dist.get_rank(), op=fname,
                                            reduce_op=reduce_op, root=root, label=label,
                                            shape=shape, dtype=dtype, group_name=name))

    # -- install / uninstall ----------------------------------------------------------

    def __enter__(self) -> "CollectiveLedger":
        if not dist.is_initialized():
            raise RuntimeError("CollectiveLedger needs an initialized process group")
        if self._saved:
            raise RuntimeError("this CollectiveLedger is already active")
        for fname in COLLECTIVES:
            for module in (dist, _c10d):
                original = getattr(module, fname, None)
                if original is None:
                    continue
                if getattr(original, "__ddplab_ledger__", False):
                    raise RuntimeError("another CollectiveLedger is already active in this process")
                self._saved[(module, fname)] = original
        # Both modules hold the same function objects: wrap each once.
        wrapped: dict[int, Callable] = {}
        for (module, fname), original in self._saved.items():
            if id(original) not in wrapped:
                wrapped[id(original)] = self._wrap(fname, original)
            setattr(module, fname, wrapped[id(original)])
        return self

    def _uninstall(self) -> None:
        for (module, fname), original in self._saved.items():
            setattr(module, fname, original)
        self._saved = {}

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.check()
        finally:
            self._uninstall()

    # -- cross-check ------------------------------------------------------------------

    def check(self) -> LedgerReport:
        """Gather the entries issued since the last check from every rank and compare.

        A collective over ``group``: call it at the same point on every rank.
        Returns (and keeps in ``report``) the :class:`LedgerReport` of every
        entry so far; raises :class:`CollectiveMismatchError` if ``strict``.
        """
        with self._lock:
            new = self.entries[self._sent:]
            self._sent = len(self.entries)
            counts = dict(self._seq)
        gathered: list = [None] * dist.get_world_size(self.group)
        self._local.suspended = True
        try:
            dist.all_gather_object(gathered, (dist.get_rank(), new, counts), group=self.group)
        finally:
            self._local.suspended = False
        for rank, entries, rank_counts in gathered:
            for e in entries:
                self._merged.setdefault((e.group_name, e.seq), {})[rank] = e
            for group, n in rank_counts.items():
                self._counts.setdefault(group, {})[rank] = n
        entries = [e for key in sorted(self._merged) for _, e in sorted(self._merged[key].items())]
        report = LedgerReport(entries=entries, problems=find_problems(entries, self._counts))
        self.report = report
        if self.emit:
            me = dist.get_rank()
            for rec in report.records(rank=me):
                _records.emit(rec.pop("metric"), rec.pop("value"), rank=rec.pop("rank"),
                              step=rec.pop("step"), bucket=rec.pop("bucket"), **rec)
        if self.strict and report.problems:
            raise CollectiveMismatchError(report.problems)
        return report


def find_problems(entries: Iterable[LedgerEntry],
                  counts: Mapping[str, Mapping[int, int]]) -> list[LedgerProblem]:
    """Compare the ranks' entries collective by collective; return the disagreements.

    ``counts[group_name][rank]`` is how many collectives ``rank`` had issued
    on that group when it reported. A collective some members did not issue
    is a ``count`` problem; otherwise the first field of
    :data:`CHECKED_FIELDS` whose values differ names the problem (an
    unlabelled tensor pairs with any label).
    """
    merged: dict[tuple[str, int], dict[int, LedgerEntry]] = {}
    for e in entries:
        merged.setdefault((e.group_name, e.seq), {})[e.rank] = e
    reported = {r for per in counts.values() for r in per}
    problems = []
    for (name, seq), per_rank in sorted(merged.items()):
        group = next(iter(per_rank.values())).group
        members = [r for r in group if r in reported or r in per_rank]
        missing = [r for r in members if r not in per_rank]
        if missing:
            values = {r: (per_rank[r].op if r in per_rank else None) for r in members}
            problems.append(LedgerProblem(group, seq, "count", values, name))
            continue
        for field in CHECKED_FIELDS:
            values = {r: getattr(per_rank[r], field) for r in members}
            if len(set(values.values())) > 1:
                if field == "label" and any(v is None for v in values.values()):
                    continue  # an unlabelled tensor pairs with anything
                problems.append(LedgerProblem(group, seq, "pairing" if field == "label" else field,
                                              values, name))
                break
    return problems
