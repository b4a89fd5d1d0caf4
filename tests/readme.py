"""The README's sections and code examples, for the tests that run them verbatim."""
from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def readme_section(title: str) -> str:
    """The text of the README's ``## title`` section, up to the next ``## `` heading."""
    return README.read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def python_block(text: str) -> str:
    """The first ```python block of ``text``."""
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def python_blocks(text: str) -> list[str]:
    """Every ```python block of ``text``, in order."""
    return re.findall(r"```python\n(.*?)```", text, re.S)


def python_block_with(text: str, marker: str) -> str:
    """The ```python block of ``text`` that contains ``marker`` (exactly one must)."""
    found = [block for block in python_blocks(text) if marker in block]
    if len(found) != 1:
        raise LookupError(f"{len(found)} python blocks contain {marker!r}")
    return found[0]
