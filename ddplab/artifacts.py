"""What a case run leaves on disk: records, verdict, parameters, environment.

A results directory holds ``records.jsonl`` (the tidy records, one JSON
object a line, so ranks and torchrun jobs can append), ``verdict.json``,
``params.json`` and ``environment.json``. Notebooks write one when given a
``results_dir``; ``ddplab report`` builds its index from them and tests
assert on them rather than on printed text.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
from typing import Iterable

from ddplab.records import to_frame
from ddplab.verdict import Verdict

__all__ = ["CaseResults", "save_results", "load_results", "write_jsonl", "read_jsonl",
           "atomic_write_text"]


@dataclasses.dataclass
class CaseResults:
    records: "object"          # pandas.DataFrame in the tidy record shape
    verdict: Verdict | None
    params: dict
    environment: dict


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and a rename (never half-written)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """Write records as JSON lines, atomically."""
    lines = [json.dumps(r, default=_json_default, allow_nan=True) for r in records]
    atomic_write_text(path, "\n".join(lines) + ("\n" if lines else ""))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read JSON-lines records; a truncated last line (a killed writer) is skipped."""
    out = []
    with open(path) as fh:
        lines = fh.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # the writer died mid-line; everything before it is intact
            raise
    return out


def _frame_records(records) -> list[dict]:
    if hasattr(records, "to_dict"):
        frame = records.astype(object).where(records.notna(), None)
        return frame.to_dict(orient="records")
    return list(records)


def save_results(directory: str | os.PathLike, *, records, verdict: Verdict | None,
                 params: dict, environment: dict) -> pathlib.Path:
    """Write a results directory (see the module docstring); return its path."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_jsonl(directory / "records.jsonl", _frame_records(records))
    atomic_write_text(directory / "params.json", json.dumps(params, indent=2, default=_json_default))
    atomic_write_text(directory / "environment.json",
                      json.dumps(environment, indent=2, default=_json_default))
    if verdict is not None:
        atomic_write_text(directory / "verdict.json", verdict.to_json())
    return directory


def load_results(directory: str | os.PathLike) -> CaseResults:
    """Read a results directory written by :func:`save_results`."""
    directory = pathlib.Path(directory)
    if not (directory / "records.jsonl").exists():
        raise FileNotFoundError(f"{directory} holds no records.jsonl: not a ddplab results directory")
    verdict_path = directory / "verdict.json"
    verdict = Verdict.from_dict(json.loads(verdict_path.read_text())) if verdict_path.exists() else None

    def _json(name):
        p = directory / name
        return json.loads(p.read_text()) if p.exists() else {}

    return CaseResults(records=to_frame(read_jsonl(directory / "records.jsonl")),
                       verdict=verdict, params=_json("params.json"),
                       environment=_json("environment.json"))
