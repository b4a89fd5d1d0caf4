"""The case registry: the built-in cases, and any case given by a dotted path.

A case is a :class:`~ddplab.cases.base.Case` instance that its module
exposes as ``CASE``. The notebook helper, ``ddplab report``, the explorer
and ``python -m ddplab run`` find cases only through :func:`get_case`, so a
case that lives outside ddplab works everywhere a built-in one does::

    ddplab report mypackage.mycase
    torchrun --nproc-per-node 2 -m ddplab run mypackage.mycase --out runs/mine

``get_case("mypackage.mycase")`` imports the module and returns its
``CASE``; ``"mypackage.mycase:OTHER"`` names another attribute.
"""
from __future__ import annotations

import importlib
import re

from ddplab.cases.base import Case, LaunchPlan

__all__ = ["BUILTIN", "Case", "LaunchPlan", "get_case", "case_names", "builtin_cases", "check_case_name"]

#: What a case name may be: it names the case's folder in reports/ and its URL
#: in the index, so one path component that is neither hidden nor ".."
_CASE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
#: ``package.module`` or ``package.module:ATTRIBUTE``, Python identifiers only.
_MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?")


def check_case_name(name) -> str:
    """``name`` if it can name a case's report folder, else ValueError (no ``/``, ``..``, hidden name)."""
    if not isinstance(name, str) or not _CASE_NAME.fullmatch(name):
        raise ValueError(f"case name {name!r} cannot name a report folder: use letters, digits, "
                         f"'_', '-' and '.', not starting with '.' (no '/' or '..')")
    return name

#: Built-in case name -> module. Order is the report order.
BUILTIN = {
    "backend_divergence": "ddplab.cases.backend_divergence",
    "half_precision": "ddplab.cases.half_precision",
    "device_roundtrip": "ddplab.cases.device_roundtrip",
    "allreduce_correctness": "ddplab.cases.allreduce_correctness",
    "your_training": "ddplab.cases.your_training",
}

_loaded: dict[str, Case] = {}


def case_names() -> list[str]:
    """The built-in cases, in report order."""
    return list(BUILTIN)


def builtin_cases() -> list[Case]:
    return [get_case(name) for name in BUILTIN]


def get_case(name: "str | Case") -> Case:
    """The case called ``name``: a built-in name, or ``package.module[:ATTRIBUTE]``.

    Raises ValueError naming the known cases when ``name`` is neither, and
    saying what is wrong when the module cannot be imported or holds no Case.
    """
    if isinstance(name, Case):
        return name
    if not isinstance(name, str) or not name:
        raise ValueError(f"a case is a name or a dotted module path, got {name!r}")
    if name in _loaded:
        return _loaded[name]
    if name in BUILTIN:
        module_name, attribute = BUILTIN[name], "CASE"
    elif "." in name or ":" in name:
        if not _MODULE_PATH.fullmatch(name):
            raise ValueError(f"case {name!r} is neither a built-in case ({', '.join(BUILTIN)}) nor a "
                             "module path such as mypackage.mycase[:ATTRIBUTE]")
        module_name, _, attribute = name.partition(":")
        attribute = attribute or "CASE"
    else:
        raise ValueError(f"unknown case {name!r}; built-in cases: {', '.join(BUILTIN)} "
                         "(or give a module path such as mypackage.mycase)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"case {name!r}: cannot import {module_name!r}: {exc}") from None
    case = getattr(module, attribute, None)
    if isinstance(case, type) and issubclass(case, Case):
        case = case()
    if not isinstance(case, Case):
        raise ValueError(f"case {name!r}: module {module_name!r} has no {attribute} "
                         f"(an instance of ddplab.cases.Case), found {type(case).__name__}")
    if not case.name:
        raise ValueError(f"case {name!r}: its Case sets no name")
    try:
        check_case_name(case.name)
    except ValueError as exc:
        raise ValueError(f"case {name!r}: {exc}") from None
    _loaded[name] = case
    return case
