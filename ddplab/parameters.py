"""Case parameters: names, defaults, help, and validation before any work starts.

Every case declares a :class:`ParameterSet`. The notebook's papermill
``parameters`` cell mirrors it (a test keeps the two equal), ``ddplab report``
and ``python -m ddplab run`` validate overrides against it before a kernel or
a rank starts, and the explorer builds its widgets from it. A parameter's
``role`` (:data:`ROLES`) is what generic code reads it as -- the ranks a
launch starts, its backend, its steps -- so that no generic code depends on
what a case calls its parameters.

Values arriving as strings are parsed, because papermill's ``-p`` passes a
list such as ``[2, 4]`` as the *string* ``"[2, 4]"`` (YAML and ``2,4`` both
work). A bad value raises ``ValueError`` naming the parameter and what it
accepts.

Example::

    >>> ps = ParameterSet([Parameter("world_sizes", [2, 4], "ranks per run", kind="list[int]", minimum=1)])
    >>> ps.validate({"world_sizes": "[2, 3]"})
    {'world_sizes': [2, 3]}
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

import yaml

__all__ = ["Parameter", "ParameterSet", "KINDS", "ROLES"]

#: The value kinds a parameter may declare.
KINDS = ("int", "float", "str", "bool", "list[int]", "list[str]", "list[float]", "path")

#: What generic code may read a parameter as (its ``role``), with the kinds that role accepts.
ROLES = {
    # How many ranks a launch starts; a list: one launch per size. A torchrun job's size sets it.
    "world_size": ("int", "list[int]"),
    # The process group's backend (gloo, nccl).
    "backend": ("str",),
    # How many steps a launch reports, for progress bars.
    "steps": ("int",),
}

_SCALAR = {"int": int, "float": float, "str": str, "bool": bool, "path": str}


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One case parameter.

    ``choices`` restricts str values (or list items); ``minimum``/``maximum``
    bound numbers (or list items); ``check`` is an extra predicate returning an
    error text or None. ``nullable`` allows None (e.g. an optional path).
    ``role`` (a key of :data:`ROLES`) is what generic code reads it as.
    """

    name: str
    default: Any
    help: str
    kind: str = "str"
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None
    role: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"parameter {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"parameter {self.name!r}: role must be one of {', '.join(ROLES)}, "
                             f"got {self.role!r}")
        if self.role is not None and self.kind not in ROLES[self.role]:
            raise ValueError(f"parameter {self.name!r}: role {self.role!r} needs kind "
                             f"{' or '.join(ROLES[self.role])}, got {self.kind!r}")

    def accepts(self) -> str:
        """What this parameter accepts, in words (for error messages and help)."""
        what = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                "path": "a path", "list[int]": "a list of integers",
                "list[str]": "a list of strings", "list[float]": "a list of numbers"}[self.kind]
        parts = [what]
        if self.choices:
            parts.append("from " + ", ".join(map(str, self.choices)))
        if self.minimum is not None:
            parts.append(f">= {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"<= {self.maximum:g}")
        if self.nullable:
            parts.append("or None")
        return " ".join(parts)

    def _fail(self, value, why: str = "") -> ValueError:
        why = f" ({why})" if why else ""
        return ValueError(f"parameter {self.name!r}: got {value!r}{why}; it accepts {self.accepts()}")

    def _scalar(self, kind: str, value):
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            raise self._fail(value)
        if kind in ("int", "float"):
            number = int if kind == "int" else float
            if isinstance(value, bool):  # bool is an int to Python, never to a user
                raise self._fail(value)
            if isinstance(value, str):
                try:
                    value = number(value.strip())
                except ValueError:
                    raise self._fail(value) from None
            if kind == "int" and isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, (int, float)) or (kind == "int" and not isinstance(value, int)):
                raise self._fail(value)
            value = number(value)
        else:  # str, path
            if not isinstance(value, str):
                raise self._fail(value)
        if self.choices is not None and value not in self.choices:
            raise self._fail(value)
        if self.minimum is not None and value < self.minimum:
            raise self._fail(value)
        if self.maximum is not None and value > self.maximum:
            raise self._fail(value)
        return value

    def coerce(self, value: Any) -> Any:
        """Parse and check ``value``; return it in canonical form or raise ValueError."""
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")
                             and self.kind != "str"):
            if self.nullable:
                return None
            raise self._fail(value)
        original = value
        if self.kind.startswith("list["):
            item_kind = self.kind[5:-1]
            if isinstance(value, str):
                text = value.strip()
                if text.startswith("["):
                    try:
                        value = yaml.safe_load(text)
                    except yaml.YAMLError as exc:
                        raise self._fail(value, f"not a list: {exc.problem}") from None
                else:
                    value = [v.strip() for v in text.split(",") if v.strip()]
            if isinstance(value, tuple):
                value = list(value)
            if not isinstance(value, list):
                value = [value]  # a single item is a one-item list
            if not value:
                raise self._fail(value, "empty list")
            out = []
            for item in value:
                try:
                    out.append(self._scalar(item_kind, item))
                except ValueError:
                    raise self._fail(original, f"item {item!r}") from None
            if len(set(map(repr, out))) != len(out):
                raise self._fail(value, "duplicate items")
            result = out
        else:
            result = self._scalar(self.kind, value)
        if self.check is not None:
            problem = self.check(result)
            if problem:
                raise self._fail(value, problem)
        return result


class ParameterSet:
    """An ordered set of :class:`Parameter` with validation of overrides."""

    def __init__(self, parameters: Iterable[Parameter]):
        self.parameters = {p.name: p for p in parameters}
        self.roles: dict[str, Parameter] = {}
        for p in self.parameters.values():
            if p.role in self.roles:
                raise ValueError(f"parameters {self.roles[p.role].name!r} and {p.name!r} both have "
                                 f"the role {p.role!r}; a role belongs to one parameter")
            if p.role is not None:
                self.roles[p.role] = p

    def __iter__(self):
        return iter(self.parameters.values())

    def __contains__(self, name: str) -> bool:
        return name in self.parameters

    def __getitem__(self, name: str) -> Parameter:
        return self.parameters[name]

    def names(self) -> list[str]:
        return list(self.parameters)

    def with_role(self, role: str) -> Parameter | None:
        """The parameter that plays ``role`` (a key of :data:`ROLES`), or None."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        return self.roles.get(role)

    def role_value(self, params: Mapping[str, Any], role: str, default: Any = None) -> Any:
        """The value in ``params`` of the parameter playing ``role``; ``default`` without one."""
        p = self.with_role(role)
        return params[p.name] if p is not None and p.name in params else default

    def defaults(self) -> dict:
        return {name: p.default for name, p in self.parameters.items()}

    def check_names(self, names: Iterable[str]) -> None:
        """Raise ValueError for a name this set does not declare (papermill only warns)."""
        unknown = [n for n in names if n not in self.parameters]
        if unknown:
            raise ValueError(f"unknown parameter(s) {', '.join(map(repr, unknown))}; "
                             f"this case accepts: {', '.join(self.parameters)}")

    def validate(self, overrides: Mapping[str, Any] | None = None, **more: Any) -> dict:
        """Defaults updated by ``overrides``, every value parsed and checked."""
        given = {**(overrides or {}), **more}
        self.check_names(given)
        values = self.defaults()
        values.update(given)
        return {name: self.parameters[name].coerce(value) for name, value in values.items()}

    def help(self) -> str:
        """One line per parameter: name, default, help and what it accepts."""
        return "\n".join(f"{p.name} = {p.default!r}  # {p.help} [{p.accepts()}]" for p in self)
