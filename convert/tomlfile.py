"""The one reader of the TOML files a user may hand the tool (``--mapping FILE``, ``--recipe FILE``) and the
schema every such file is checked against at load, before any of it is used.

A user's table can be anything under a ``.toml`` name: a FIFO (reading waits for a writer, forever), a
file in another encoding, a string where a table is due, an integer where a string is. Each of these used to
surface wherever the value was first used, as a Python traceback or a hang. So a table is read here once
(``jsonfile.open_regular``'s rule: a regular file, never waited on; bounded; UTF-8) and its whole tree is
checked against a declarative :class:`Spec` (the types of every key, the allowed keys of every table, the
placeholders of every name template, the names of every format), each fault one line naming the file, the
key and what was expected. The built-in tables pass through the same schema (tests/test_table_schema.py).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ConvertError
from .jsonfile import read_bytes

#: Largest table read: the built-in tables are a few KB.
MAX_TOML_BYTES = 1 << 22


def read_toml_text(path: str | os.PathLike, shown: str) -> str:
    """The text of a user's TOML file: a regular file (a FIFO or device is refused, never waited on), at most
    :data:`MAX_TOML_BYTES`, UTF-8; every fault one line naming ``shown``."""
    data = read_bytes(path, shown, MAX_TOML_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConvertError(f"{shown}: not UTF-8 text (byte {e.start}); a table is a UTF-8 TOML file") from None


def loads(text: str, shown: str) -> dict:
    """``tomllib.loads`` with its error as one line naming the file."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConvertError(f"{shown}: {e}") from None


@dataclass(frozen=True)
class Spec:
    """What one value must be: ``kinds`` the Python types accepted (bool is never an int here), ``expected``
    how the error says it; a table's ``fields`` (allowed keys, each its spec) and ``required`` keys; a map's
    (any keys) ``values``; a list's ``items``; ``check`` a last test returning why the value is wrong, or None."""

    kinds: tuple[type, ...]
    expected: str
    fields: dict[str, Spec] | None = None
    required: frozenset[str] = frozenset()
    values: Spec | None = None
    items: Spec | None = None
    check: Callable[[object], str | None] | None = field(default=None, compare=False)


def _kind_name(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "a table"}
    return names.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validate(value: object, spec: Spec, file: str, key: str = "") -> None:
    """Refuse the first place where ``value`` breaks ``spec``: ``FILE: KEY: expected WHAT, got ...``."""
    where = f"{file}: {key}" if key else file
    if not isinstance(value, spec.kinds) or (isinstance(value, bool) and bool not in spec.kinds):
        raise ConvertError(f"{where}: expected {spec.expected}, got {_kind_name(value)} {_shown(value)}")
    if spec.fields is not None and isinstance(value, dict):
        extra = sorted(set(value) - set(spec.fields))
        if extra:
            raise ConvertError(f"{where}: unknown key(s) {', '.join(extra)} "
                               f"(allowed: {', '.join(sorted(spec.fields))})")
        for k in sorted(spec.required - set(value)):
            raise ConvertError(f"{where}: missing key {k!r} ({spec.fields[k].expected})")
        for k, v in value.items():
            validate(v, spec.fields[k], file, f"{key}.{k}" if key else k)
    if spec.values is not None and isinstance(value, dict):
        for k, v in value.items():
            validate(v, spec.values, file, f"{key}.{k}" if key else k)
    if spec.items is not None and isinstance(value, list):
        for i, v in enumerate(value):
            validate(v, spec.items, file, f"{key}[{i}]")
    if spec.check is not None and (why := spec.check(value)) is not None:
        raise ConvertError(f"{where}: {why}")


# The building blocks of the mapping and recipe schemas.
STR = Spec((str,), "a string")
BOOL = Spec((bool,), "true or false")
INT = Spec((int,), "an integer")
NUMBER = Spec((int, float), "a number")
SCALAR = Spec((bool, int, float, str), "a string, number or boolean")


def table(fields: dict[str, Spec], required: tuple[str, ...] = (), expected: str = "a table") -> Spec:
    return Spec((dict,), expected, fields=fields, required=frozenset(required))


def array_of(item: Spec, expected: str) -> Spec:
    return Spec((list,), expected, items=item)


def map_of(value: Spec, expected: str) -> Spec:
    return Spec((dict,), expected, values=value)


def one_of(names: tuple[str, ...], what: str) -> Spec:
    """A string among ``names``."""
    def check(v: object) -> str | None:
        return None if v in names else f"unknown {what} {v!r} (known: {', '.join(names)})"
    return Spec((str,), f"one of {', '.join(names)}", check=check)


def strs(item: Spec = STR) -> Spec:
    """A list of strings, or one string (the tables' shorthand for a list of one)."""
    def check(v: object) -> str | None:
        if isinstance(v, list):
            for i, x in enumerate(v):
                if not isinstance(x, str):
                    return f"[{i}]: expected {item.expected}, got {_kind_name(x)} {_shown(x)}"
                if item.check is not None and (why := item.check(x)) is not None:
                    return f"[{i}]: {why}"
        elif item.check is not None:
            return item.check(v)
        return None
    return Spec((list, str), f"a list of {item.expected.removeprefix('a ').removeprefix('an ')}s", check=check)


def template(placeholders: tuple[str, ...]) -> Spec:
    """A module name template: every ``{name}`` one of ``placeholders``, and no stray brace."""
    def check(v: object) -> str | None:
        text = str(v)
        for m in re.finditer(r"\{([^{}]*)\}", text):
            if m.group(1) not in placeholders:
                return (f"unknown placeholder {{{m.group(1)}}} in {text!r} "
                        f"(known: {', '.join('{' + p + '}' for p in placeholders)})")
        if re.sub(r"\{[^{}]*\}", "", text).count("{") or re.sub(r"\{[^{}]*\}", "", text).count("}"):
            return f"unbalanced brace in {text!r}"
        return None
    return Spec((str,), "a module name template", check=check)
