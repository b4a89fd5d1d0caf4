"""The batch's front pages: reports/index.html and each case's Markdown summary.

The index lists every case with its status (:class:`~ddplab.glossary.NotebookStatus`),
its verdict's kind and one-line headline (the whole verdict is on the case's
page), run time and links; the summary is what gets pasted into an issue
thread: the verdict table with the key figure beside it as a PNG. Every text
from data is escaped (HTML here, :mod:`ddplab.markup` in the Markdown).
"""
from __future__ import annotations

import dataclasses
import datetime
import html
import json
import os
import pathlib

from ddplab import markup
from ddplab.artifacts import atomic_write_files
from ddplab.environment import environment_markdown
from ddplab.glossary import NotebookStatus
from ddplab.verdict import Verdict

__all__ = ["CaseOutcome", "summary_markdown", "index_html", "write_index"]


@dataclasses.dataclass
class CaseOutcome:
    """One case of a batch: how it ended and where its files are (relative to the index)."""

    name: str
    title: str
    reproduces: str | None
    status: NotebookStatus
    seconds: float
    verdict: Verdict | None
    report: str
    summary: str
    notebook: str
    key_figure: str | None = None
    error: str = ""

    def __post_init__(self):
        self.status = NotebookStatus.parse(self.status)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["verdict"] = self.verdict.to_dict() if self.verdict else None
        return data


def _reproduced(report_id: str | None):
    """The reproduced report ``report_id`` names, or None (a case of one's own, or an unknown id)."""
    if not report_id:
        return None
    from ddplab.reproduced import report

    try:
        return report(report_id)
    except ValueError:
        return None


def summary_markdown(outcome: CaseOutcome, *, params: dict, given: dict | None = None,
                     environment: dict | None, figure_name: str | None, command: str) -> str:
    """The Markdown to paste into an issue thread: short first, the full evidence folded.

    Verdict and headline, the scope line, a table of the key numbers, the key
    figure and the command that reproduces the run lead; every finding with
    its evidence, the parameters (as they ran; ``given`` where a value was
    set otherwise) and the environment follow in ``<details>``.
    """
    lines = [f"### ddplab: {markup.text(outcome.title)}", ""]
    if outcome.status != NotebookStatus.OK:
        lines += [f"**Status: {outcome.status}** — {markup.text(outcome.error)}", ""]
    verdict = outcome.verdict
    if verdict is not None:
        lines.append(verdict.header_markdown())
        if verdict.key_numbers:
            lines.append(verdict.key_numbers_markdown())
    else:
        lines.append("_No verdict: the run ended before the verdict was computed._\n")
    if figure_name:
        lines += [f"![key figure]({figure_name})", ""]
    reproduced = _reproduced(outcome.reproduces)
    lines += [f"Reproduce: {markup.code_span(command)} (run time {outcome.seconds:.1f} s). "
              + (f"Reproduces {markup.text(reproduced.citation())}." if reproduced else ""), ""]
    if verdict is not None:
        held = sum(f.holds is True for f in verdict.findings)
        lines += [f"<details><summary>All {len(verdict.findings)} findings ({held} hold)</summary>",
                  "", verdict.findings_markdown(), "</details>", ""]
    lines += ["<details><summary>Parameters and environment</summary>", "",
              markup.parameters_table(params, given)]
    if environment:
        lines.append(environment_markdown(environment))
    lines += ["</details>", ""]
    return "\n".join(lines)


_CSS = """
body { font-family: -apple-system, 'Segoe UI', Roboto, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; width: 100%; }
th, td { border-bottom: 1px solid #ddd; padding: 6px 10px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; }
.status { padding: 2px 8px; border-radius: 4px; color: #fff; font-weight: bold; white-space: nowrap; }
img.thumb { max-width: 260px; border: 1px solid #ddd; }
.muted { color: #777; font-size: 90%; }
"""


def _row(o: CaseOutcome) -> str:
    """One case of the index: name, status, the verdict's kind and first sentence, time, links."""
    e = html.escape
    if o.verdict is not None:
        verdict = (f"<b>{e(o.verdict.kind)}</b>: {e(o.verdict.headline_line)} "
                   f"<a href='{e(o.report)}#Verdict' class='muted'>more</a>")
    else:
        verdict = "<span class='muted'>no verdict</span>"
    if o.error and o.status != NotebookStatus.OK:
        verdict += f"<br><span class='muted'>{e(o.error.strip().splitlines()[0])}</span>"
    reproduced = _reproduced(o.reproduces)
    case = f"<b>{e(o.title)}</b><br><span class='muted'>{e(o.name)}</span>"
    if reproduced is not None:
        case += f"<br><span class='muted'>reproduces “{e(reproduced.title)}” ({e(reproduced.where)})</span>"
    thumb = (f"<img class='thumb' src='{e(o.key_figure)}' alt='key figure of {e(o.name)}'>"
             if o.key_figure else "")
    return (f"<tr><td>{case}</td><td>{markup.status_badge(o.status, prefix='')}</td>"
            f"<td>{verdict}</td><td>{o.seconds:.1f} s</td>"
            f"<td><a href='{e(o.report)}'>report</a><br><a href='{e(o.summary)}'>summary.md</a><br>"
            f"<a href='{e(o.notebook)}'>notebook</a></td><td>{thumb}</td></tr>")


def index_html(outcomes: list[CaseOutcome], *, total_seconds: float, title: str = "ddplab reports") -> str:
    """A self-contained index page (inline CSS, relative links, no script)."""
    rows = "".join(_row(o) for o in outcomes)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    failed = sum(o.status != NotebookStatus.OK for o in outcomes)
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}{markup.status_css(prefix='')}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>{len(outcomes)} case(s), {failed} not ok, total {total_seconds:.1f} s — {when}</p>"
            "<table><thead><tr><th>case</th><th>status</th><th>verdict</th><th>time</th>"
            f"<th>files</th><th>key figure</th></tr></thead><tbody>{rows}</tbody></table>"
            "</body></html>")


def write_index(out_dir: str | os.PathLike, outcomes: list[CaseOutcome], *, total_seconds: float) -> pathlib.Path:
    """Write index.html and index.json into ``out_dir``; return the HTML path."""
    out_dir = pathlib.Path(out_dir)
    path = out_dir / "index.html"
    # Both or neither: the page and its data never describe different batches.
    atomic_write_files({
        path: index_html(outcomes, total_seconds=total_seconds).encode("utf-8"),
        out_dir / "index.json": json.dumps({"total_seconds": total_seconds,
                                            "cases": [o.to_dict() for o in outcomes]}, indent=2).encode("utf-8")})
    return path
