"""Verdicts: conclusions computed from the measurements, never typed in.

A case's verdict rule reads the tidy records and returns a :class:`Verdict`:
a headline and a list of :class:`Finding` objects, each a claim, whether the
measurements support it, and the numbers that say so. Notebooks display it,
reports put it first, tests assert on ``finding.holds``.
"""
from __future__ import annotations

import dataclasses
import html
import json
from typing import Iterable

__all__ = ["Finding", "Verdict", "VERDICT_MIME", "verdicts_from_notebook"]

#: The MIME type under which a notebook's verdict cell also stores the verdict as JSON.
VERDICT_MIME = "application/vnd.ddplab.verdict+json"


@dataclasses.dataclass
class Finding:
    """One claim checked against the measurements.

    ``key`` is a short stable id for tests and the index; ``claim`` says what
    is asserted; ``holds`` is the computed answer -- or None when these
    measurements cannot say (e.g. a world size that was not run);
    ``evidence`` the numbers.
    """

    key: str
    claim: str
    holds: bool | None
    evidence: str

    def __post_init__(self):
        self.holds = None if self.holds is None else bool(self.holds)


@dataclasses.dataclass
class Verdict:
    """The conclusion of a case: ``kind`` (e.g. "rounding", "bug"), a headline, findings."""

    case: str
    kind: str
    headline: str
    findings: list[Finding]

    def finding(self, key: str) -> Finding:
        for f in self.findings:
            if f.key == key:
                return f
        raise KeyError(f"verdict of {self.case!r} has no finding {key!r}; "
                       f"it has {[f.key for f in self.findings]}")

    def holds(self, key: str) -> bool:
        return self.finding(key).holds

    @property
    def all_hold(self) -> bool:
        """Every finding that was measured holds."""
        return all(f.holds is not False for f in self.findings)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Verdict":
        return cls(case=data["case"], kind=data["kind"], headline=data["headline"],
                   findings=[Finding(**f) for f in data["findings"]])

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_records(self) -> list[dict]:
        """The findings as tidy records (metric ``finding_holds``, value 0/1)."""
        from ddplab.records import record
        return [record("finding_holds", float("nan") if f.holds is None else int(f.holds),
                       finding=f.key, case=self.case) for f in self.findings]

    def to_markdown(self) -> str:
        rows = ["| | finding | evidence |", "|---|---|---|"]
        for f in self.findings:
            rows.append(f"| {_mark(f.holds)} | {_md(f.claim)} | {_md(f.evidence)} |")
        return f"**Verdict ({self.kind}):** {self.headline}\n\n" + "\n".join(rows) + "\n"

    def to_html(self) -> str:
        rows = "".join(
            f"<tr><td>{_mark(f.holds)}</td><td>{html.escape(f.claim)}</td>"
            f"<td>{html.escape(f.evidence)}</td></tr>" for f in self.findings)
        return (f"<div class='ddplab-verdict'><p><b>Verdict ({html.escape(self.kind)}):</b> "
                f"{html.escape(self.headline)}</p><table><thead><tr><th></th><th>finding</th>"
                f"<th>evidence</th></tr></thead><tbody>{rows}</tbody></table></div>")

    def _repr_mimebundle_(self, include=None, exclude=None):
        # The JSON copy lets batch tools read the verdict without parsing HTML.
        return {"text/markdown": self.to_markdown(), "text/html": self.to_html(),
                "text/plain": self.to_markdown(), VERDICT_MIME: self.to_dict()}


def _mark(holds: bool | None) -> str:
    # Plain dingbats with a word: emoji fonts are missing on many machines (and headless browsers).
    if holds is None:
        return "– not measured"
    return "✔ holds" if holds else "✘ does not hold"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def verdicts_from_notebook(cells: Iterable[dict]) -> list[Verdict]:
    """Every verdict a (executed) notebook displayed, from its JSON MIME copies."""
    found = []
    for cell in cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if VERDICT_MIME in data:
                found.append(Verdict.from_dict(data[VERDICT_MIME]))
    return found

