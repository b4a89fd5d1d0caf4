"""TeX math in Markdown → MathML, so that published reports show formulas offline.

The stock report templates typeset ``$…$`` with MathJax from a CDN; ddplab's
reports carry no script and fetch nothing, so the formulas are converted
once, when the report is written, into MathML, which browsers render natively.
``$…$`` is inline, ``$$…$$`` a displayed block; code spans and fenced code
are left alone, and ``\\$`` is a literal dollar.

Example::

    >>> tex_to_mathml(r"norm $\\sqrt{4K}$ here")[:52]
    'norm <math xmlns="http://www.w3.org/1998/Math/MathML'
"""
from __future__ import annotations

import html
import re

__all__ = ["tex_to_mathml"]

# Code (fenced blocks, then inline spans) is protected before math is looked for.
_CODE = re.compile(r"(```.*?```|~~~.*?~~~|`[^`\n]*`)", re.S)
_DISPLAY = re.compile(r"\$\$(.+?)\$\$", re.S)
_INLINE = re.compile(r"(?<![\\$])\$(?!\s)([^$\n]+?)(?<![\s\\])\$(?!\d)")


# latex2mathml copies \text{...} into <mtext> as it is: markup there would be live HTML. A
# conversion is kept only when every tag is MathML's and no attribute is an event handler or link.
_MATHML_TAGS = frozenset("math semantics annotation mrow mi mo mn ms mtext mspace mfrac msqrt mroot "
                         "msub msup msubsup munder mover munderover mmultiscripts mprescripts none "
                         "mtable mtr mtd mstyle mpadded mphantom menclose merror mfenced".split())
_TAG = re.compile(r"<\s*/?\s*([A-Za-z][\w:-]*)([^>]*)>")
_UNSAFE_ATTRIBUTE = re.compile(r"\b(on\w+|href|src|style)\s*=", re.I)


def _safe_mathml(mathml: str) -> bool:
    return all(tag.lower() in _MATHML_TAGS and not _UNSAFE_ATTRIBUTE.search(attributes)
               for tag, attributes in _TAG.findall(mathml))


def _convert(tex: str, display: str) -> str:
    from latex2mathml.converter import convert

    try:
        mathml = convert(tex.strip(), display=display)
    except Exception:  # noqa: BLE001 - a formula the converter cannot read stays as written
        mathml = None
    if mathml is None or not _safe_mathml(mathml):
        return f"<code>{html.escape(tex)}</code>"
    return mathml


def _math(text: str) -> str:
    text = _DISPLAY.sub(lambda m: _convert(m.group(1), "block"), text)
    return _INLINE.sub(lambda m: _convert(m.group(1), "inline"), text)


def tex_to_mathml(markdown: str) -> str:
    """``markdown`` with every ``$…$`` / ``$$…$$`` formula outside code replaced by MathML."""
    parts = _CODE.split(markdown)
    # split() with one group: even indices are prose, odd ones the code it protected.
    return "".join(part if i % 2 else _math(part) for i, part in enumerate(parts))
