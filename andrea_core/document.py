"""Validating a document read from a run file, one home: a JSON object (the lock, the pivot journal, a
line of target.jsonl, forks.jsonl or guard.jsonl) checked against a declared table of fields before
anything reads it. Whoever can write into a run directory chooses these documents: each field's type,
nullability, bounds, choices and shape are declared once (`Field`), and `check` refuses the first
field that is not as declared with one DocumentError naming it and its value (bounded, escaped).

Fields not in the table are left alone (a newer writer's additions); the caller keeps only what it
knows. A config (run.yaml, a policy) is checked `closed`: a key not in its table is refused, naming it
(a typo must not train a week on the default). A field may hold a nested document (`fields`), checked
the same way under dotted names (`train.guard.window`), and may `convert` a value before it is checked
(YAML's `1e4` is a float where a whole number was meant); check writes converted values back. A bool
is never a number here unless bool is among a field's types (JSON `true` is not 1), and a number is
finite unless the field says otherwise (`finite=False`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from andrea_core.untrusted import shown


class DocumentError(ValueError):
    """A field of a document read from a run file that is not what its writer writes."""


@dataclass(frozen=True)
class Field:
    """One field: `types` it may have; `null`: may be null; `required`: must be present (absent and
    optional is as null, if `null`); `low`..`high`: a number's bounds, or a text's or list's length;
    `choices`: the values allowed; `pattern`: what a text must fullmatch; `printable`: text with no
    control or invisible character; `items`: every list item's field; `test`: a last predicate of the
    value; `says`: the one message for any fault of it (`"{name} {value} {says}"`); `kind`: the types'
    name in messages; `fields`: the table of the nested document it holds (a mapping); `convert`: maps
    a present value before the checks (returns it unchanged when nothing is to be converted)."""

    types: tuple[type, ...]
    null: bool = False
    required: bool = True
    low: float = -math.inf
    high: float = math.inf
    choices: tuple = ()
    pattern: re.Pattern | None = None
    printable: bool = False
    finite: bool = True
    items: Field | None = None
    test: Callable[[Any], bool] | None = None
    says: str | None = None
    kind: str | None = None
    fields: Schema | None = None
    convert: Callable[[Any], Any] | None = None


Schema = Mapping[str, "Field"]


def value_shown(value: Any) -> str:
    """A bad value as an error shows it: its repr (quotes, escapes), one bounded line."""
    return shown(repr(value))


def check(doc: Any, schema: Schema, *, closed: bool = False, where: str = "") -> dict[str, Any]:
    """`doc` (a parsed JSON or YAML object) after every field of `schema` is checked; DocumentError at
    the first that is not as declared (or "not a JSON object"). `closed`: a key not in `schema` is
    refused too (and in every nested document). `where`: the dotted name of `doc` in messages."""
    if not isinstance(doc, dict):
        if where:
            raise DocumentError(f"{where}: expected a mapping, got {type(doc).__name__}")
        raise DocumentError("not a JSON object")
    if closed and (unknown := sorted(str(k) for k in doc if k not in schema)):
        allowed = ", ".join(schema)
        head = f"{where}: " if where else ""
        raise DocumentError(f"{head}unknown field(s) {', '.join(map(shown, unknown))} (allowed: {allowed})")
    for name, spec in schema.items():
        dotted = f"{where}.{name}" if where else name
        if name not in doc:
            if spec.required:
                raise DocumentError(f"{dotted} is missing")
            continue
        doc[name] = _checked(dotted, doc[name], spec, closed)
    return doc


def check_field(name: str, value: Any, spec: Field) -> Any:
    """`value` (converted, if `spec` converts) if it is as `spec` declares, else DocumentError naming
    `name` and the value."""
    return _checked(name, value, spec, False)


def _checked(name: str, value: Any, spec: Field, closed: bool) -> Any:
    if spec.convert is not None and value is not None:
        value = spec.convert(value)
    why = _fault(name, value, spec)
    if why is not None:
        raise DocumentError(f"{name} {value_shown(value)} {spec.says}" if spec.says else why)
    if spec.fields is not None and value is not None:
        return check(value, spec.fields, closed=closed, where=name)
    if spec.items is not None and isinstance(value, list):
        return [_checked(f"{name}[{i}]", item, spec.items, closed) for i, item in enumerate(value)]
    return value


def _fault(name: str, value: Any, spec: Field) -> str | None:
    if value is None:
        return None if spec.null else f"{name} is null"
    types = spec.types
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        kind = (spec.kind or "/".join(t.__name__ for t in types)) + (" or null" if spec.null else "")
        return f"{name}: expected {kind}, got {type(value).__name__} {value_shown(value)}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bounded = math.isfinite(spec.low) or math.isfinite(spec.high)
        if spec.finite and not math.isfinite(value) and not bounded:
            return f"{name} {value!r} is not finite"
        if math.isnan(value) and not spec.finite:
            pass  # NaN is allowed where non-finite numbers are (it has no place between bounds)
        elif not (spec.low <= value <= spec.high and (math.isfinite(value) or not spec.finite)):
            return f"{name} {value!r} is outside {_bound(spec.low)}..{_bound(spec.high)}"
    elif isinstance(value, str):
        if not spec.low <= len(value) <= spec.high or (spec.printable and not value.isprintable()):
            what = "printable text" if spec.printable else "text"
            return f"{name} {value_shown(value)}: not {what} of at most {spec.high:g} characters"
        if spec.pattern is not None and not spec.pattern.fullmatch(value):
            return f"{name} {value_shown(value)} is not in the form {spec.pattern.pattern!r}"
    elif isinstance(value, list):
        if len(value) > spec.high:
            return f"{name}: {len(value)} items, more than {spec.high:g}"
        if len(value) < spec.low:
            return f"{name}: {len(value)} items, fewer than {spec.low:g}"
    if spec.choices and value not in spec.choices:
        return f"{name} {value_shown(value)} is not one of {', '.join(map(str, spec.choices))}"
    if spec.test is not None and not spec.test(value):
        return f"{name} {value_shown(value)} is not allowed"
    return None


def _bound(x: float) -> str:
    """A bound as a message shows it: a whole one in full (2147483647, not 2.14748e+09)."""
    return str(int(x)) if math.isfinite(x) and x == int(x) else f"{x:g}"
