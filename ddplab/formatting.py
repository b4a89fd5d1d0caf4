"""Numbers into words: the one number formatter and the template renderer.

Findings and verdicts keep their numbers as data and say them through a
template, so the notebook, the HTML report, ``summary.md``, ``verdict.json``
and the index all print the same text, and tests assert on the numbers.

A template is ordinary text with ``{name}`` or ``{name:spec}`` fields filled
from a ``values`` dict. Without a spec a value goes through :func:`fmt`; a
spec is Python's format spec, plus ``r`` (every digit: ``repr`` of the
float, for values that must be quoted exactly, e.g. a float16 norm).

Example::

    >>> render("{n} of {total} changed; ratio {ratio}, norm {norm:r}",
    ...        {"n": 0, "total": 14, "ratio": 0.52973, "norm": 5.65625})
    '0 of 14 changed; ratio 0.5297, norm 5.65625'

Text that comes from a rank (an exception's message, its stderr) goes
through :func:`visible_controls` before ddplab prints it.
"""
from __future__ import annotations

import math
import numbers
import re
from typing import Any, Mapping

__all__ = ["fmt", "render", "render_field", "template_fields", "visible_controls"]

#: Significant digits of a float printed without a spec.
DIGITS = 4

_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([^{}]*))?\}")
#: Control characters a terminal acts on: C0 but newline and tab, DEL, and C1
#: (U+009B is a one-character CSI to some terminals, like ESC [).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible_controls(text: str) -> str:
    """``text`` with every control character but newline and tab written as its escape.

    ``"\\x1b[2J"`` comes out as the printable ``\\x1b[2J``, NUL as
    ``\\x00``, a carriage return as ``\\x0d``: printed in a terminal, an
    escape sequence from a rank would be executed (clear the screen, retitle
    the window, hide the lines before it); in a log it corrupts the line.
    Newlines and tabs stay, so tracebacks keep their shape. Only for text
    shown to a person: stored records keep the original characters.
    """
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def fmt(x: Any, digits: int = DIGITS) -> str:
    """One way to print a number: integers whole, floats to ``digits`` significant digits.

    NaN prints as "n/a" (not measured), infinities as "∞"/"−∞", booleans as
    "yes"/"no", lists item by item joined with ", ", anything else with str().
    Floats between 1e-3 and 1e6 print plainly (``0.5297``, ``13.08``);
    outside that range in scientific form (``3.1e-07``).
    """
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (list, tuple)):
        return ", ".join(fmt(v, digits) for v in x)
    if isinstance(x, numbers.Integral):
        return str(int(x))
    if isinstance(x, numbers.Real):
        x = float(x)
        if math.isnan(x):
            return "n/a"
        if math.isinf(x):
            return "∞" if x > 0 else "−∞"
        if x == 0:
            return "0"
        if x.is_integer() and abs(x) < 1e6:
            return str(int(x))
        if 1e-3 <= abs(x) < 1e6:
            return f"{x:.{digits}g}"
        mantissa, exponent = f"{x:.{max(1, digits - 2)}e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exponent)}"
    return str(x)


def _field(value: Any, spec: str | None) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(_field(v, spec) for v in value)
    if not spec:
        return fmt(value)
    if spec == "r":
        return repr(float(value)) if isinstance(value, numbers.Real) and not isinstance(value, bool) else str(value)
    if isinstance(value, str):
        return value
    return format(value, spec)


def render_field(value: Any, spec: str | None = None) -> str:
    """One value as a template field with ``spec`` prints it (lists item by item)."""
    return _field(value, spec)


def template_fields(template: str) -> list[str]:
    """The value names ``template`` refers to, in order of appearance."""
    return [m.group(1) for m in _FIELD.finditer(template)]


def render(template: str, values: Mapping[str, Any]) -> str:
    """``template`` with every ``{name}`` / ``{name:spec}`` replaced by its value.

    A field naming a value that is not in ``values`` raises KeyError naming
    it (a template and its data must agree; that is a bug, not a message).
    Literal braces are not supported: templates are prose.
    """
    def sub(match: re.Match) -> str:
        name, spec = match.group(1), match.group(2)
        if name not in values:
            raise KeyError(f"template field {name!r} has no value (values: {sorted(values)})")
        return _field(values[name], spec)

    return _FIELD.sub(sub, template)
