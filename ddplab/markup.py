"""Text from data, made safe to render: Markdown that shows every character literally.

Reports render Markdown with raw HTML allowed (nbconvert, GitHub), and the
text they show comes from data: an error read from a run folder, a
parameter value, a path, a case's title. :func:`text` makes any such string
inert -- HTML's ``< > &`` and every character Markdown or the TeX converter
would read (`` ` * _ [ ] | $ \\`` ...) become character references, which
every Markdown renderer shows as the character itself -- so
``<script>`` reads as ``<script>`` and a backtick cannot end a code span.
The blocks every page shows are built here, once: :func:`table`, the
parameters table (:func:`parameters_table`) and the status badge
(:func:`status_badge`).

Example::

    >>> text("a `b` <i>")
    'a &#96;b&#96; &lt;i&gt;'
    >>> code("x|y")
    '<code>x&#124;y</code>'
"""
from __future__ import annotations

import html
from typing import Any, Iterable, Mapping

from ddplab.glossary import NotebookStatus

__all__ = ["text", "code", "code_span", "code_block", "table", "parameters_table", "status_badge", "STATUS_COLOURS",
           "status_css"]

#: Characters that HTML, Markdown inside a line (code, emphasis, links, table cells, escapes,
#: strikethrough) or the TeX converter ($) could read as syntax. Text stays on one line, so the
#: markers that work only at a line's start (#, -, +, 1.) need nothing.
_SYNTAX = "\\`*_[]<>&|$~"
_REFERENCES = {ord(c): f"&#{ord(c)};" for c in _SYNTAX}
_REFERENCES.update({ord("<"): "&lt;", ord(">"): "&gt;", ord("&"): "&amp;"})
# A line break would end a table row or a paragraph: data text stays on its line.
_REFERENCES.update({ord("\n"): " ", ord("\r"): " "})

#: The badge colour of each notebook status (on the index and at the top of each report).
STATUS_COLOURS = {NotebookStatus.OK: "#2e7d32", NotebookStatus.FAILED: "#c62828",
                  NotebookStatus.KERNEL_DIED: "#c62828", NotebookStatus.TIMED_OUT: "#ef6c00",
                  NotebookStatus.INTERRUPTED: "#616161"}


def text(value: Any) -> str:
    """``str(value)`` as inline Markdown that renders as exactly those characters, on one line."""
    return str(value).translate(_REFERENCES)


def code(value: Any) -> str:
    """``value`` in a ``<code>`` element, every character shown literally (``|`` too, in a table)."""
    return f"<code>{text(value)}</code>"


def _longest_backtick_run(source: str) -> int:
    run = longest = 0
    for ch in source:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return longest


def code_span(source: Any) -> str:
    """``source`` as an inline code span, shown verbatim (a command to copy): its fence is longer
    than any run of backticks inside, so nothing in it can end the span. Not for table cells
    (a ``|`` would still split the cell there): use :func:`code`."""
    source = str(source).replace("\n", " ")
    fence = "`" * (_longest_backtick_run(source) + 1)
    pad = " " if source.startswith("`") or source.endswith("`") else ""
    return f"{fence}{pad}{source}{pad}{fence}"


def code_block(source: str, language: str = "") -> str:
    """A fenced code block holding ``source`` verbatim: the fence is longer than any run of
    backticks inside it, so nothing in ``source`` can close it."""
    fence = "`" * max(3, _longest_backtick_run(source) + 1)
    return f"{fence}{language}\n{source.rstrip()}\n{fence}\n"


def table(columns: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    """A Markdown table; headers and cells must already be safe (:func:`text`, :func:`code`)."""
    columns = list(columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def parameters_table(params: Mapping[str, Any], given: Mapping[str, Any] | None = None) -> str:
    """The parameters a run used, one row each, values as code (their ``repr``).

    ``params`` are the effective values (what ran); where ``given`` holds a
    different value for a name (a sentinel such as ``steps = 0``, "every
    batch"), the cell says what was given too.
    """
    rows = []
    for name, value in params.items():
        cell = code(repr(value))
        if given is not None and name in given and given[name] != value:
            cell += f" (given {code(repr(given[name]))})"
        rows.append([text(name), cell])
    return table(["parameter", "value"], rows)


def status_css(prefix: str = "ddplab-") -> str:
    """The CSS rules that colour :func:`status_badge`, one per status."""
    return "\n".join(f".{prefix}status-{word.css} {{ background: {colour}; }}"
                     for word, colour in STATUS_COLOURS.items())


def status_badge(status: NotebookStatus, prefix: str = "ddplab-") -> str:
    """The coloured status word, as inline HTML (the word is one of :class:`NotebookStatus`)."""
    status = NotebookStatus.parse(status)
    return f'<span class="{prefix}status {prefix}status-{status.css}">{html.escape(status.value)}</span>'
