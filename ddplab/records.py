"""The one record shape every ddplab measurement uses, and where records go.

A record is a flat dict: ``step, rank, bucket, metric, value`` plus any labels
(``order``, ``world_size``, ``dtype``, ``param``, ...). ``metric`` names what
was measured and ``value`` is a real number; everything descriptive is a
label. Lists of records become one tidy (long-form) pandas DataFrame whose
first columns are always :data:`RECORD_COLUMNS`, so that plots, verdicts and
reports all read the same table.

Inside a rank, :func:`emit` sends a record to the current *sink*: the
launcher's pipe to the notebook, a JSON-lines file under torchrun, or a list
given to :func:`collect`. With no sink installed, records accumulate in a
process-local buffer that :func:`drain` empties, so nothing is silently lost.

Example::

    >>> with collect() as recs:
    ...     emit("loss", 0.25, step=3, order="gloo")
    >>> to_frame(recs)[["step", "metric", "value", "order"]].values.tolist()
    [[3, 'loss', 0.25, 'gloo']]
"""
from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any, Callable, Iterable, Iterator

__all__ = [
    "RECORD_COLUMNS",
    "record",
    "emit",
    "send",
    "collect",
    "drain",
    "set_sink",
    "set_labels",
    "labels",
    "to_frame",
    "canonical",
    "where",
    "value_of",
    "label_values",
]

RECORD_COLUMNS = ("step", "rank", "bucket", "metric", "value")
_INDEX_COLUMNS = ("step", "rank", "bucket")

Sink = Callable[[dict], None]

_sink: Sink | None = None
_buffer: list[dict] = []
_labels: dict[str, Any] = {}


def _check_label(key: str, val: Any) -> None:
    if not isinstance(key, str) or not key.isidentifier():
        raise ValueError(f"record label names must be identifiers, got {key!r}")
    if val is not None and not isinstance(val, (str, bool, numbers.Real)):
        raise TypeError(
            f"record label {key!r} must be a str, number, bool or None, "
            f"got {type(val).__name__}"
        )


def record(metric: str, value: Any, *, step: int | None = None, rank: int | None = None,
           bucket: int | None = None, **labels: Any) -> dict:
    """Build one record; ``value`` must be a real number (bools count as 0/1)."""
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric must be a non-empty string, got {metric!r}")
    if hasattr(value, "item") and callable(value.item):  # 0-d tensors, numpy scalars
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"record value for {metric!r} must be a real number, got {type(value).__name__}")
    for name, idx in (("step", step), ("rank", rank), ("bucket", bucket)):
        if idx is not None and not isinstance(idx, numbers.Integral):
            raise TypeError(f"{name} must be an int or None, got {type(idx).__name__}")
    rec = {"step": None if step is None else int(step),
           "rank": None if rank is None else int(rank),
           "bucket": None if bucket is None else int(bucket),
           "metric": metric,
           "value": float(value)}
    for key, val in labels.items():
        if key in rec:
            raise ValueError(f"label {key!r} clashes with a record column")
        _check_label(key, val)
        rec[key] = val
    return rec


def _current_rank() -> int | None:
    # Imported lazily: records must stay importable without torch.distributed set up.
    from ddplab.rank import current_context
    ctx = current_context()
    return None if ctx is None else ctx.rank


def emit(metric: str, value: Any, *, step: int | None = None, bucket: int | None = None,
         rank: int | None = None, **labels: Any) -> dict:
    """Record ``value`` for ``metric`` from this rank and send it to the sink.

    The rank is taken from the running ddplab/torchrun context unless given.
    Labels set with :func:`set_labels` are added unless overridden here.
    """
    merged = {**_labels, **labels}
    rec = record(metric, value, step=step, rank=_current_rank() if rank is None else rank,
                 bucket=bucket, **merged)
    send(rec)
    return rec


def send(rec: dict) -> None:
    """Send a record already built (:func:`record`) to the sink, as it is."""
    if _sink is None:
        _buffer.append(rec)
    else:
        _sink(rec)


def set_sink(sink: Sink | None) -> Sink | None:
    """Install ``sink`` (a callable taking one record); return the previous one."""
    global _sink
    previous, _sink = _sink, sink
    return previous


def drain() -> list[dict]:
    """Return and clear the records emitted while no sink was installed."""
    out = list(_buffer)
    _buffer.clear()
    return out


@contextlib.contextmanager
def collect() -> Iterator[list[dict]]:
    """Collect the records emitted inside the block into a list."""
    recs: list[dict] = []
    previous = set_sink(recs.append)
    try:
        yield recs
    finally:
        set_sink(previous)


@contextlib.contextmanager
def labels(**extra: Any) -> Iterator[None]:
    """Add labels (e.g. ``order="gloo"``) to every record emitted inside the block."""
    for key, val in extra.items():
        _check_label(key, val)
    saved = dict(_labels)
    _labels.update(extra)
    try:
        yield
    finally:
        _labels.clear()
        _labels.update(saved)


def set_labels(**extra: Any) -> None:
    """Add labels to every later record of this process (``None`` removes one)."""
    for key, val in extra.items():
        _check_label(key, val)
        if val is None:
            _labels.pop(key, None)
        else:
            _labels[key] = val


def to_frame(records: Iterable[dict]):
    """Turn records into the tidy DataFrame: RECORD_COLUMNS first, labels after.

    ``step``, ``rank`` and ``bucket`` become nullable integers; ``value`` float.
    """
    import pandas as pd

    rows = list(records)
    extra: list[str] = []
    seen = set(RECORD_COLUMNS)
    for row in rows:
        for key in row:
            if key not in seen:
                seen.add(key)
                extra.append(key)
    frame = pd.DataFrame(rows, columns=list(RECORD_COLUMNS) + extra)
    for col in _INDEX_COLUMNS:
        frame[col] = pd.array(frame[col], dtype="Int64")
    frame["value"] = pd.to_numeric(frame["value"], errors="coerce").astype(float)
    frame["metric"] = frame["metric"].astype(object)
    return frame



def canonical(frame):
    """``frame`` with its rows sorted by every column: a deterministic order.

    Records emitted from asynchronous callbacks (DDP comm-hook futures)
    arrive in an order that can change from run to run; two tables are equal
    as measurements when their canonical forms are equal.
    """
    return frame.sort_values(by=list(frame.columns), na_position="first",
                             kind="mergesort").reset_index(drop=True)


def where(frame, metric, **labels):
    """The rows of ``frame`` for ``metric`` (a name or a list) whose labels match.

    A label value may be a list (any of them). A label the table does not
    have matches nothing; the result may be empty (verdict rules ask "was it
    measured?" with ``len(...)``).
    """
    metrics = [metric] if isinstance(metric, str) else list(metric)
    out = frame[frame["metric"].isin(metrics)]
    for key, val in labels.items():
        if key not in out.columns:
            return out.iloc[0:0]
        if isinstance(val, (list, tuple, set)):
            out = out[out[key].isin(list(val))]
        else:
            out = out[out[key] == val]
    return out


def value_of(frame, metric: str, default: float = math.nan, **labels) -> float:
    """The value of the first row of ``metric`` with these labels, ``default`` when there is none."""
    rows = where(frame, metric, **labels)
    return float(rows["value"].iloc[0]) if len(rows) else default


def label_values(frame, label: str, metric=None, **labels) -> list:
    """The distinct non-null values of column ``label`` (in rows of ``metric``/``labels``), sorted."""
    rows = frame if metric is None else where(frame, metric, **labels)
    if label not in rows.columns:
        return []
    values = rows[label].dropna().unique().tolist()
    try:
        return sorted(values)
    except TypeError:
        return sorted(values, key=str)
