"""Dataclass fields that carry their help, group and allowed values, and one check driven by the annotations.

A field is declared once: `name: Literal["a", "b"] = setting("a", help=..., group=...)`. Its type annotation
says what values it takes (`int`, `float`, `str`, `bool`, `list[str]`, `dict`, `Literal[...]` for a fixed set,
`| None` where None is allowed), `bound` how far a number may go, and the metadata what it means. Everything
that shows or checks the field (RunConfig's validation, the CLI's flags, the panel's dropdowns) reads it from
here (`field_specs`), so no list of choices or help text is written twice.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Bound = Literal["positive", "non-negative"]


def setting(default: Any = dataclasses.MISSING, *, help: str, group: str, bound: Bound | None = None,
            choices: tuple[Any, ...] | None = None, cli: bool = True,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """`dataclasses.field` with its help text (other fields named in `backticks`), its group, the `bound` of a
    number, and whether the CLI builds a flag for it (`cli=False`: it has none, or a hand-written one).
    `choices`: the values of an `int` field that callers compute (a `Literal` annotation would make every caller
    narrow its int for mypy); a `str` field's choices are its `Literal` annotation."""
    metadata = {"help": help, "group": group, "bound": bound, "choices": choices, "cli": cli}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass(frozen=True)
class FieldSpec:
    """One field as its annotation and metadata describe it."""

    name: str
    kind: type                      # int, float, str, bool, list or dict (the Literal's values' type)
    optional: bool                  # None is allowed
    choices: tuple[Any, ...] | None  # a Literal's values (or setting's choices), in their order
    item: type | None               # a list's item type
    plain_default: Any              # dataclasses.MISSING where a factory makes it
    factory: Callable[[], Any] | None
    help: str
    group: str
    bound: Bound | None
    cli: bool

    @property
    def default(self) -> Any:
        """The field's default (a fresh one where a factory makes it: never shared, so never changed by a user)."""
        return self.factory() if self.factory is not None else self.plain_default

    def describe(self, refer: Callable[[str], str] = str) -> str:
        """The help text, each `field` reference written by `refer` (the CLI writes its flag)."""
        return re.sub(r"`(\w+)`", lambda m: refer(m[1]), self.help)

    def problem(self, value: Any) -> str | None:
        """Why `value` does not fit this field's annotation and bound ("must be ..., got ..."), or None."""
        if value is None and self.optional:
            return None
        if not self._fits(value):
            return f"must be {self._wanted()}, got {value!r}"
        return None

    def _fits(self, value: Any) -> bool:
        if self.choices is not None:  # True == 1: a Literal's values match in type too
            return any(value == c and type(value) is type(c) for c in self.choices)
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind in (int, float):
            number = isinstance(value, int if self.kind is int else (int, float)) and not isinstance(value, bool)
            if not number:
                return False
            if self.kind is float and not math.isfinite(value):
                return False
            if self.bound == "positive":
                return value > 0
            return value >= 0 if self.bound == "non-negative" else True
        if self.kind is list:
            return isinstance(value, list) and (self.item is None or all(isinstance(v, self.item) for v in value))
        return isinstance(value, self.kind)

    def _wanted(self) -> str:
        if self.choices is not None:
            text = f"one of {self.choices}"
        elif self.kind is bool:
            text = "True or False"
        elif self.kind is int:
            text = f"a {self.bound} integer" if self.bound else "an integer"
        elif self.kind is float:  # finite too: nan and inf are refused
            text = f"a {self.bound} number" if self.bound else "a finite number"
        elif self.kind is list:
            text = "a list of strings" if self.item is str else "a list"
        elif self.kind is str:
            text = "a string"
        elif self.kind is dict:
            text = "a dict (a JSON object)"
        else:
            text = f"a {self.kind.__name__}"
        return text + (" or None" if self.optional else "")


def _spec(f: dataclasses.Field, hint: Any) -> FieldSpec:
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        assert len(rest) == 1, f"{f.name}: one type or Literal, and None"
        hint = rest[0]
    choices = tuple(typing.get_args(hint)) if typing.get_origin(hint) is Literal else f.metadata["choices"]
    origin = typing.get_origin(hint)
    kind = type(choices[0]) if choices else (origin or hint)
    item = typing.get_args(hint)[0] if kind is list and typing.get_args(hint) else None
    assert "help" in f.metadata and "group" in f.metadata, f"{f.name}: declare it with fields.setting()"
    factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
    return FieldSpec(name=f.name, kind=kind, optional=optional, choices=choices, item=item, plain_default=f.default,
                     factory=factory,
                     help=f.metadata["help"], group=f.metadata["group"], bound=f.metadata["bound"],
                     cli=f.metadata["cli"])


def field_specs(cls: type) -> dict[str, FieldSpec]:
    """Every field of dataclass `cls`, in declaration order, its annotation resolved (RunConfig's: config.FIELDS)."""
    hints = typing.get_type_hints(cls)
    return {f.name: _spec(f, hints[f.name]) for f in dataclasses.fields(cls)}


def first_problem(obj: Any, specs: dict[str, FieldSpec]) -> tuple[str, str] | None:
    """(field, message) for the first field of `obj` whose value does not fit its spec, or None."""
    for name, spec in specs.items():
        message = spec.problem(getattr(obj, name))
        if message is not None:
            return name, message
    return None
