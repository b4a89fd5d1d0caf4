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
           "atomic_write_text", "atomic_write_bytes", "atomic_write_files", "local_path_scrubber",
           "scrub_notebook"]


@dataclasses.dataclass
class CaseResults:
    records: "object"          # pandas.DataFrame in the tidy record shape
    verdict: Verdict | None
    params: dict
    environment: dict


def _umask() -> int:
    """The process's umask, read without changing it (Linux), else by the set-and-restore dance."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _stage(path: pathlib.Path, data: bytes) -> str:
    """Write ``data`` to a new temporary file beside ``path``; return its name (removed on failure).

    The file gets the mode any new file gets (0666 less the umask): reports
    are meant to be shared, and mkstemp's private 0600 would hide them.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return tmp


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename (never half-written)."""
    atomic_write_files({path: data})


def atomic_write_files(files: dict) -> None:
    """Write every ``{path: bytes}`` or none of them.

    All are written to temporary names first; only once every one is
    written are they renamed into place. A rename needs no space, so a full
    disk (or any failed write) leaves every earlier file as it was, whole,
    and no temporary file behind.
    """
    staged: list[tuple[str, pathlib.Path]] = []
    try:
        for path, data in files.items():
            path = pathlib.Path(path)
            staged.append((_stage(path, data), path))
    except BaseException:
        for tmp, _ in staged:
            os.unlink(tmp)
        raise
    for tmp, path in staged:
        os.replace(tmp, path)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    atomic_write_bytes(path, text.encode("utf-8"))


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


def local_path_scrubber(*extra: str | os.PathLike):
    """A function that replaces this machine's paths in published text by neutral names.

    Reports go to issue threads: tracebacks and logs keep their file names
    and lines, but not where this machine keeps them. Replaced, longest
    first: the Python environment (``<python>``), ddplab's folder
    (``<ddplab>``), ``extra`` folders (by their names), the working
    directory (``.``), the temporary directory (``<tmp>``) and the home
    directory (``~``).
    """
    import sys

    import ddplab

    places = {str(pathlib.Path(sys.prefix).resolve()): "<python>",
              str(pathlib.Path(sys.base_prefix).resolve()): "<python>",
              str(pathlib.Path(ddplab.__file__).resolve().parent.parent): "<ddplab>",
              os.getcwd(): ".",
              str(pathlib.Path(tempfile.gettempdir()).resolve()): "<tmp>",
              str(pathlib.Path.home()): "~"}
    for folder in extra:
        places[str(pathlib.Path(folder).resolve())] = f"<{pathlib.Path(folder).name}>"
    # Longest first, so that a path inside another is replaced by its most specific name.
    ordered = sorted(((p, name) for p, name in places.items() if len(p) > 1),
                     key=lambda item: -len(item[0]))

    def scrub(text: str) -> str:
        for path, name in ordered:
            text = text.replace(path, name)
        return text

    return scrub


def scrub_notebook(nb, scrub) -> None:
    """Apply ``scrub`` to a notebook's sources and text outputs, in place (images untouched:
    base64 can hold any short path by chance)."""
    for cell in nb.cells:
        cell.source = scrub(cell.source)
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = scrub(out["text"])
            if "traceback" in out:
                out["traceback"] = [scrub(line) for line in out["traceback"]]
            if "evalue" in out:
                out["evalue"] = scrub(out["evalue"])
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/") and isinstance(value, str):
                    out["data"][mime] = scrub(value)
