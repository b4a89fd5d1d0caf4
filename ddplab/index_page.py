"""The batch's front pages: reports/index.html and each case's Markdown summary.

The index lists every case with its status (ok / failed / timed out / kernel
died / interrupted), verdict, run time and links; the summary is what gets pasted into an
issue thread: the verdict table with the key figure beside it as a PNG.
"""
from __future__ import annotations

import dataclasses
import datetime
import html
import json
import os
import pathlib

from ddplab.artifacts import atomic_write_files
from ddplab.environment import environment_markdown
from ddplab.notebook import parameters_markdown
from ddplab.verdict import Verdict

__all__ = ["CaseOutcome", "summary_markdown", "index_html", "write_index"]


@dataclasses.dataclass
class CaseOutcome:
    """One case of a batch: how it ended and where its files are (relative to the index)."""

    name: str
    title: str
    reproduces: str | None
    status: str
    seconds: float
    verdict: Verdict | None
    report: str
    summary: str
    notebook: str
    key_figure: str | None = None
    error: str = ""

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["verdict"] = self.verdict.to_dict() if self.verdict else None
        return data


def _reproduced_line(report_id: str | None) -> str:
    if not report_id:
        return ""
    from ddplab.reproduced import report

    try:
        return f"Reproduces {report(report_id).citation()}."
    except ValueError:
        return ""


def summary_markdown(outcome: CaseOutcome, *, params: dict, environment: dict | None,
                     figure_name: str | None, command: str) -> str:
    """The Markdown to paste into an issue thread: short first, the full evidence folded.

    Verdict and headline, the scope line, a table of the key numbers, the key
    figure and the command that reproduces the run lead; every finding with
    its evidence, the parameters and the environment follow in ``<details>``.
    """
    lines = [f"### ddplab: {outcome.title}", ""]
    if outcome.status != "ok":
        lines += [f"**Status: {outcome.status}** — {outcome.error}", ""]
    verdict = outcome.verdict
    if verdict is not None:
        lines += [f"**Verdict: {verdict.kind}.** {verdict.headline}", ""]
        if verdict.scope:
            lines += [f"*Scope:* {verdict.scope}", ""]
        if verdict.key_numbers:
            lines.append(verdict.key_numbers_markdown())
    else:
        lines.append("_No verdict: the run ended before the verdict was computed._\n")
    if figure_name:
        lines += [f"![key figure]({figure_name})", ""]
    lines += [f"Reproduce: `{command}` (run time {outcome.seconds:.1f} s). "
              + _reproduced_line(outcome.reproduces), ""]
    if verdict is not None:
        held = sum(f.holds is True for f in verdict.findings)
        lines += [f"<details><summary>All {len(verdict.findings)} findings ({held} hold)</summary>",
                  "", verdict.findings_markdown(), "</details>", ""]
    lines += ["<details><summary>Parameters and environment</summary>", "",
              parameters_markdown(params)]
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
.ok { background: #2e7d32; } .failed, .kernel-died { background: #c62828; } .timed-out { background: #ef6c00; }
.interrupted { background: #616161; }
img.thumb { max-width: 260px; border: 1px solid #ddd; }
.muted { color: #777; font-size: 90%; }
"""


def index_html(outcomes: list[CaseOutcome], *, total_seconds: float, title: str = "ddplab reports") -> str:
    """A self-contained index page (inline CSS, relative links, no script)."""
    rows = []
    for o in outcomes:
        css = o.status.replace(" ", "-")
        verdict = (f"<b>{html.escape(o.verdict.kind)}</b>: {html.escape(o.verdict.headline)}"
                   if o.verdict else "<span class='muted'>no verdict</span>")
        if o.error and o.status != "ok":
            verdict += f"<br><span class='muted'>{html.escape(o.error)}</span>"
        thumb = (f"<img class='thumb' src='{html.escape(o.key_figure)}' alt='key figure of {html.escape(o.name)}'>"
                 if o.key_figure else "")
        rows.append(
            f"<tr><td><b>{html.escape(o.title)}</b><br><span class='muted'>{html.escape(o.name)}"
            f"{' — reproduces ' + html.escape(o.reproduces) if o.reproduces else ''}</span></td>"
            f"<td><span class='status {css}'>{html.escape(o.status)}</span></td>"
            f"<td>{verdict}</td><td>{o.seconds:.1f} s</td>"
            f"<td><a href='{html.escape(o.report)}'>report</a><br>"
            f"<a href='{html.escape(o.summary)}'>summary.md</a><br>"
            f"<a href='{html.escape(o.notebook)}'>notebook</a></td><td>{thumb}</td></tr>")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    failed = sum(o.status != "ok" for o in outcomes)
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>{len(outcomes)} case(s), {failed} not ok, total {total_seconds:.1f} s — {when}</p>"
            "<table><thead><tr><th>case</th><th>status</th><th>verdict</th><th>time</th>"
            f"<th>files</th><th>key figure</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
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
