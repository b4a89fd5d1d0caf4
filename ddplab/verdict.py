"""Verdicts: conclusions computed from the measurements, never typed in.

A case's verdict rule reads the tidy records and returns a :class:`Verdict`:
its kind ("rounding", "bug", "undetermined", ...), a summary sentence, the
*scope* (which computation the evidence covers and which it does not) and a
list of :class:`Finding` s. Each finding is a claim, whether the
measurements support it, and its numbers as data (``values``); the evidence
text is rendered from a template on demand (:func:`ddplab.formatting.render`),
so every surface -- notebook, HTML report, ``summary.md``, ``verdict.json``,
the index -- prints the same words, and tests assert on ``values``.

Example::

    >>> f = Finding("within_bound", "Every bucket is within the rounding bound", True,
    ...             "largest error {ratio} of the bound over {buckets} buckets",
    ...             {"ratio": 0.5297, "buckets": 385})
    >>> f.evidence
    'largest error 0.5297 of the bound over 385 buckets'
"""
from __future__ import annotations

import dataclasses
import html
import json
import math
import re
from typing import Any, Iterable

from ddplab import markup
from ddplab.formatting import render, render_field
from ddplab.glossary import VerdictKind

__all__ = ["Finding", "Verdict", "VERDICT_MIME", "KINDS", "verdicts_from_notebook"]

#: The MIME type under which a notebook's verdict cell also stores the verdict as JSON.
VERDICT_MIME = "application/vnd.ddplab.verdict+json"

#: Verdict kinds: what the measurements establish about the reported behaviour
#: (:class:`ddplab.glossary.VerdictKind`, where each is defined).
KINDS = tuple(VerdictKind)
#: How every page introduces a verdict and its scope.
HEADER_LABEL = "Verdict ({kind}):"
SCOPE_LABEL = "Scope:"


@dataclasses.dataclass
class Finding:
    """One claim checked against the measurements.

    ``key`` is a short stable id; ``claim`` says what is asserted (a template
    too, for claims that quote a number); ``holds`` is the computed answer,
    or None when these measurements cannot say (e.g. a world size that was not
    run); ``template`` is the evidence sentence with ``{value}`` fields;
    ``values`` the numbers (JSON-able scalars, strings or lists).
    """

    key: str
    claim: str
    holds: bool | None
    template: str = ""
    values: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.holds = None if self.holds is None else bool(self.holds)
        self.values = dict(self.values)
        # Render once now: a template naming a missing value fails where it is built.
        self.evidence, self.claim_text  # noqa: B018

    @property
    def evidence(self) -> str:
        """The evidence sentence, rendered from ``template`` and ``values``."""
        return render(self.template, self.values)

    @property
    def claim_text(self) -> str:
        return render(self.claim, self.values)

    def to_dict(self) -> dict:
        return {"key": self.key, "claim": self.claim_text, "holds": self.holds,
                "evidence": self.evidence, "values": _json_safe(self.values),
                "claim_template": self.claim, "template": self.template}

    @classmethod
    def from_dict(cls, data: dict) -> "Finding":
        return cls(key=data["key"], claim=data.get("claim_template", data["claim"]),
                   holds=data["holds"], template=data.get("template", data.get("evidence", "")),
                   values=_from_json_safe(data.get("values", {})))


@dataclasses.dataclass
class Verdict:
    """The conclusion of a case run.

    ``summary`` is the headline's template, rendered with ``values``
    (:attr:`headline`); ``scope`` is one line saying what computation the
    evidence covers and what it does not; ``key_numbers`` maps a short label
    to a name in ``values`` (``name`` or ``name:spec``, as in a template
    field): the few numbers an issue thread needs first.
    """

    case: str
    kind: VerdictKind
    summary: str
    findings: list[Finding]
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    scope: str = ""
    key_numbers: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.kind = VerdictKind.parse(self.kind)
        missing = [k for k in self.key_numbers.values() if k.partition(":")[0] not in self.values]
        if missing:
            raise KeyError(f"verdict of {self.case!r}: key_numbers name values it lacks: {missing}")
        self.headline  # noqa: B018 - a template with a missing value fails here

    @property
    def headline(self) -> str:
        return render(self.summary, self.values)

    @property
    def headline_line(self) -> str:
        """The headline's first sentence: what a one-line listing (the index) shows.

        Cut in the template, outside its ``{fields}``, where a sentence ends
        (``.``, ``!`` or ``?`` before a capital), so a number's decimal point never cuts it.
        """
        return render(_first_sentence(self.summary), self.values)

    def finding(self, key: str) -> Finding:
        for f in self.findings:
            if f.key == key:
                return f
        raise KeyError(f"verdict of {self.case!r} has no finding {key!r}; "
                       f"it has {[f.key for f in self.findings]}")

    def holds(self, key: str) -> bool | None:
        return self.finding(key).holds

    @property
    def all_hold(self) -> bool:
        """Every finding that was measured holds."""
        return all(f.holds is not False for f in self.findings)

    def key_table(self) -> list[tuple[str, str]]:
        """``(label, formatted value)`` for each key number, in order."""
        out = []
        for label, field in self.key_numbers.items():
            name, _, spec = field.partition(":")
            out.append((label, render_field(self.values[name], spec or None)))
        return out

    # -- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"case": self.case, "kind": self.kind.value, "headline": self.headline,
                "summary": self.summary, "scope": self.scope, "values": _json_safe(self.values),
                "key_numbers": self.key_numbers,
                "findings": [f.to_dict() for f in self.findings]}

    @classmethod
    def from_dict(cls, data: dict) -> "Verdict":
        return cls(case=data["case"], kind=data["kind"],
                   summary=data.get("summary", data.get("headline", "")),
                   findings=[Finding.from_dict(f) for f in data["findings"]],
                   values=_from_json_safe(data.get("values", {})), scope=data.get("scope", ""),
                   key_numbers=data.get("key_numbers", {}))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def to_records(self) -> list[dict]:
        """The findings as tidy records (metric ``finding_holds``, value 0/1, NaN when not measured)."""
        from ddplab.records import record
        return [record("finding_holds", float("nan") if f.holds is None else int(f.holds),
                       finding=f.key, case=self.case) for f in self.findings]

    # -- rendering: the one place findings become text -------------------------------------

    def header_markdown(self) -> str:
        """``**Verdict (kind):** headline`` and the scope line: how every page opens a verdict."""
        scope = f"*{SCOPE_LABEL}* {markup.text(self.scope)}\n" if self.scope else ""
        return f"**{HEADER_LABEL.format(kind=self.kind)}** {markup.text(self.headline)}\n\n{scope}"

    def findings_markdown(self) -> str:
        return markup.table(["", "finding", "evidence"],
                            [[_mark(f.holds), markup.text(f.claim_text), markup.text(f.evidence)]
                             for f in self.findings])

    def key_numbers_markdown(self) -> str:
        if not self.key_numbers:
            return ""
        return markup.table(["key number", "value"],
                            [[markup.text(label), markup.text(value)] for label, value in self.key_table()])

    def to_markdown(self) -> str:
        return self.header_markdown() + "\n" + self.findings_markdown()

    def to_text(self) -> str:
        """The verdict as plain text (a terminal, a log): header, scope, one line per finding."""
        lines = [f"{HEADER_LABEL.format(kind=self.kind)} {self.headline}"]
        if self.scope:
            lines.append(f"{SCOPE_LABEL} {self.scope}")
        lines += [f"  {_mark(f.holds)}: {f.claim_text} -- {f.evidence}" for f in self.findings]
        return "\n".join(lines)

    def to_html(self) -> str:
        rows = "".join(
            f"<tr><td>{_mark(f.holds)}</td><td>{html.escape(f.claim_text)}</td>"
            f"<td>{html.escape(f.evidence)}</td></tr>" for f in self.findings)
        scope = (f"<p class='ddplab-scope'><i>{SCOPE_LABEL}</i> {html.escape(self.scope)}</p>"
                 if self.scope else "")
        return (f"<div class='ddplab-verdict'><p><b>{html.escape(HEADER_LABEL.format(kind=self.kind))}</b> "
                f"{html.escape(self.headline)}</p>{scope}<table><thead><tr><th></th><th>finding</th>"
                f"<th>evidence</th></tr></thead><tbody>{rows}</tbody></table></div>")

    def _repr_mimebundle_(self, include=None, exclude=None):
        # The JSON copy lets batch tools read the verdict without parsing HTML.
        return {"text/markdown": self.to_markdown(), "text/html": self.to_html(),
                "text/plain": self.to_text(), VERDICT_MIME: self.to_dict()}


def _json_safe(value):
    """``value`` as strict JSON: NaN and ±inf become ``{"float": "nan" | "inf" | "-inf"}``.

    Jupyter refuses non-finite floats in a message, and other tools reading
    verdict.json should not need Python's JSON extensions.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _from_json_safe(value):
    if isinstance(value, dict):
        if set(value) == {"float"}:
            return float(value["float"])
        return {k: _from_json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json_safe(v) for v in value]
    return value


_SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z])")


def _first_sentence(template: str) -> str:
    depth = 0
    for i, ch in enumerate(template):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0 and _SENTENCE_END.match(template, i):
            return template[:i + 1]
    return template


def _mark(holds: bool | None) -> str:
    # Plain dingbats with a word: emoji fonts are missing on many machines (and headless browsers).
    if holds is None:
        return "– not measured"
    return "✔ holds" if holds else "✘ does not hold"


def verdicts_from_notebook(cells: Iterable[dict]) -> list[Verdict]:
    """Every verdict a (executed) notebook displayed, from its JSON MIME copies."""
    found = []
    for cell in cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if VERDICT_MIME in data:
                found.append(Verdict.from_dict(data[VERDICT_MIME]))
    return found
