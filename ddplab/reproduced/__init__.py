"""The reports ddplab reproduces, carried with the package: their text and where they came from.

Each built-in case reproduces one public report; ``<case>.md`` holds its text
as filed (code and logs included) under a small header naming its title and
public source. Notebooks and published reports cite these, never a file
outside the package.

Example::

    >>> report("half_precision").title
    'Wrapping with DDP changes the weights in Half Precision'
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources

__all__ = ["Report", "report", "reports"]


@dataclasses.dataclass(frozen=True)
class Report:
    """A reproduced report: ``id`` (the case's name), ``title``, ``source`` URL (or None), ``where`` and ``text``."""

    id: str
    title: str
    source: str | None
    where: str
    text: str

    def citation(self) -> str:
        """One line for a notebook or a published report: the title and where it was filed."""
        link = f" — {self.source}" if self.source else ""
        return f"“{self.title}” ({self.where}){link}"


def _parse(report_id: str, raw: str) -> Report:
    import yaml

    _, header, text = raw.split("---\n", 2)
    meta = yaml.safe_load(header)
    source = meta.get("source")
    return Report(id=report_id, title=meta["title"], source=None if source in (None, "unknown") else source,
                  where=meta["where"], text=text.strip() + "\n")


@functools.cache
def report(report_id: str) -> Report:
    """The reproduced report ``report_id``; ValueError naming the known ones otherwise."""
    files = importlib.resources.files(__name__)
    path = files / f"{report_id}.md"
    if not path.is_file():
        raise ValueError(f"no reproduced report {report_id!r}; known: {', '.join(reports())}")
    return _parse(report_id, path.read_text(encoding="utf-8"))


def reports() -> list[str]:
    """The ids of every carried report."""
    files = importlib.resources.files(__name__)
    return sorted(p.name[:-3] for p in files.iterdir() if p.name.endswith(".md"))
