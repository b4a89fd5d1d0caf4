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

from ddplab import markup
from ddplab.environment import environment_markdown
from ddplab.glossary import NotebookStatus
from ddplab.math_markup import tex_to_mathml
from ddplab.verdict import Verdict

__all__ = ["TEMPLATE_DIR", "header_markdown", "notebook_to_html"]

TEMPLATE_DIR = pathlib.Path(__file__).resolve().parent / "templates"
TEMPLATE_NAME = "ddplab_report"
#: Said where a verdict would be when the run ended before computing one.
NO_VERDICT = "_No verdict: the run ended before the verdict was computed._\n"


def header_markdown(*, title: str, status: NotebookStatus, seconds: float | None, verdict: Verdict | None,
                    params: dict | None, environment: dict | None, given: dict | None = None,
                    failing_cell: int | None = None, error: str = "",
                    failing_source: str | None = None) -> str:
    """The block every report starts with (Markdown, rendered by nbconvert).

    Every text in it that comes from data -- the title, the error, the
    parameters (``params`` as they ran, ``given`` as they were set), the
    environment, the verdict's words -- is shown literally (:mod:`ddplab.markup`).
    """
    status = NotebookStatus.parse(status)
    took = f" — run time {seconds:.1f} s" if seconds is not None else ""
    parts = [f"# {markup.text(title)}", f"{markup.status_badge(status)}{took}", ""]
    if status != NotebookStatus.OK:
        where = f" in cell {failing_cell}" if failing_cell is not None else ""
        parts.append(f"**The run did not complete{where}:** {markup.text(error or status)}. "
                     "The cells below show everything up to that point, including the traceback.")
        if failing_source:
            parts.append("\n" + markup.code_block(failing_source.strip(), "python"))
    parts.append("## Verdict\n")
    if verdict is not None:
        parts += [verdict.header_markdown(), verdict.key_numbers_markdown(), verdict.findings_markdown()]
    else:
        parts.append(NO_VERDICT)
    if params:
        parts.append("## Parameters\n\n" + markup.parameters_table(params, given))
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
    body, _ = exporter.from_notebook_node(nb, resources={"ddplab_status_css": markup.status_css()})
    return body
