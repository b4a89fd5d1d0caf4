"""Executed notebook -> self-contained HTML that opens offline.

The stock nbconvert templates fetch require.js, MathJax and the widget
manager from CDNs; ddplab's template (``templates/ddplab_report``) drops
them, so a report is one file: inline CSS, base64 PNG figures, formulas as
MathML (:mod:`ddplab.math_markup`), no script.
Each report starts with what an issue thread needs to trust the result:
status, verdict, the parameters used and the environment.
"""
from __future__ import annotations

import copy
import pathlib

import nbformat

from ddplab.environment import environment_markdown
from ddplab.math_markup import tex_to_mathml
from ddplab.notebook import parameters_markdown
from ddplab.verdict import Verdict

__all__ = ["TEMPLATE_DIR", "header_markdown", "notebook_to_html"]

TEMPLATE_DIR = pathlib.Path(__file__).resolve().parent / "templates"
TEMPLATE_NAME = "ddplab_report"


def header_markdown(*, title: str, status: str, seconds: float | None, verdict: Verdict | None,
                    params: dict | None, environment: dict | None,
                    failing_cell: int | None = None, error: str = "",
                    failing_source: str | None = None) -> str:
    """The block every report starts with (Markdown, rendered by nbconvert)."""
    css = "ddplab-status-" + status.replace(" ", "-")
    took = f" — run time {seconds:.1f} s" if seconds is not None else ""
    parts = [f"# {title}", f'<span class="ddplab-status {css}">{status}</span>{took}', ""]
    if status != "ok":
        where = f" in cell {failing_cell}" if failing_cell is not None else ""
        parts.append(f"**The run did not complete{where}:** {error or status}. "
                     "The cells below show everything up to that point, including the traceback.")
        if failing_source:
            parts.append("\n```python\n" + failing_source.strip() + "\n```\n")
    parts.append("## Verdict\n")
    if verdict is not None:
        parts.append(f"**Verdict ({verdict.kind}):** {verdict.headline}\n")
        if verdict.scope:
            parts.append(f"*Scope:* {verdict.scope}\n")
        parts.append(verdict.key_numbers_markdown())
        parts.append(verdict.findings_markdown())
    else:
        parts.append("_No verdict: the run ended before the verdict was computed._\n")
    if params:
        parts.append("## Parameters\n\n" + parameters_markdown(params))
    if environment:
        parts.append("## Environment\n\n" + environment_markdown(environment))
    return "\n".join(parts)


def notebook_to_html(nb: nbformat.NotebookNode, *, header: str | None = None,
                     no_input: bool = False) -> str:
    """Render ``nb`` (not modified) with ``header`` as a first Markdown cell.

    ``no_input`` hides code cells' source but keeps their outputs and
    tracebacks, so a failing report still shows what failed.
    """
    from nbconvert import HTMLExporter

    nb = copy.deepcopy(nb)
    if header:
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(header))
    # Widget state would make the template reference the CDN widget manager.
    nb.metadata.pop("widgets", None)
    # No MathJax offline: formulas become MathML, which the browser renders itself.
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = tex_to_mathml(cell.source)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/markdown" in data:
                data["text/markdown"] = tex_to_mathml(data["text/markdown"])
    exporter = HTMLExporter(template_name=TEMPLATE_NAME,
                            extra_template_basedirs=[str(TEMPLATE_DIR)])
    exporter.exclude_input = no_input
    exporter.exclude_input_prompt = no_input
    body, _ = exporter.from_notebook_node(nb)
    return body
