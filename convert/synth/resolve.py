"""A family and one of its variants (plus ``--layers/--experts/--shards``) made into a preset: its config
with every expression evaluated, and the name lookup that shapes, sets and conditions evaluate against.

A config value written as a string starting with ``=`` is an expression over other config keys (the
release's derived fields: ``kda_layers`` from the layer count, ``layer_types``, ...), so that an override
of the layer or expert count changes everything derived from it, as the release's own config would.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from .expr import Expr, ExprError, parse
from .spec import Family, Sharding, SpecError, Variant


class _Missing(LookupError):
    pass


class _Labelled(ExprError):
    """An error already naming the config key or ``let`` name whose expression failed."""


def _get(tree: dict, path: str):
    node = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise _Missing(path)
        node = node[part]
    return node


def _set(tree: dict, path: str, value) -> None:
    *head, last = path.split(".")
    node = _get(tree, ".".join(head)) if head else tree
    node[last] = value


def _has(tree: dict, path: str) -> bool:
    try:
        _get(tree, path)
    except _Missing:
        return False
    return True


@dataclass
class Values:
    """Config keys (bare names looked up in the family's scope tables, then the top level) and the
    family's ``let`` names; expressions evaluated once, on first use, cycles refused."""

    family: Family
    raw: dict
    done: dict = field(default_factory=dict)
    busy: set = field(default_factory=set)
    fixed: dict = field(default_factory=dict)  # id(expr) -> (expr, value) for those no loop variable reaches
    reaches: dict = field(default_factory=dict)  # (id(expr), loop variables) -> whether they reach it

    def path(self, name: str) -> str:
        for scope in (*self.family.scope, ""):
            p = f"{scope}.{name}" if scope else name
            if _has(self.raw, p):
                return p
        raise _Missing(name)

    def __call__(self, name: str):
        if name in self.family.let:
            return self._eval(f"let.{name}", self.family.let[name])
        if name in self.family.sets:
            return self._eval(f"sets.{name}", self.family.sets[name])
        p = self.path(name)
        value = _get(self.raw, p)
        return self._config_value(p, value)

    def _config_value(self, p: str, value):
        if isinstance(value, str) and value.startswith("="):
            return self._eval(p, parse(value[1:]))
        if isinstance(value, dict):
            return {k: self._config_value(f"{p}.{k}", v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._config_value(f"{p}.{i}", v) for i, v in enumerate(value)]
        return value

    def _eval(self, key: str, e: Expr):
        if key in self.done:
            return self.done[key]
        if key in self.busy:
            raise ExprError(f"{key} depends on itself")
        self.busy.add(key)
        try:
            self.done[key] = e(self.lookup)
        except _Labelled:
            raise
        except ExprError as err:
            raise _Labelled(f"{key} = {e.text!r}: {err}") from None
        finally:
            self.busy.discard(key)
        return self.done[key]

    def reads(self, e: Expr, loop: frozenset) -> frozenset:
        """The ``loop`` variables ``e`` reads, itself or through ``let`` values (empty: none)."""
        key = (id(e), loop)
        if key not in self.reaches:
            self.reaches[key] = frozenset()  # a let cycle is reported where it is evaluated
            let = self.family.let
            self.reaches[key] = frozenset().union(
                *((n,) if n in loop else self.reads(let[n], loop) if n in let else () for n in e.names))
        return self.reaches[key]

    def lookup(self, name: str):
        try:
            return self(name)
        except _Missing:
            raise ExprError(f"unknown key {name!r}") from None

    def config(self) -> dict:
        """The config.json to write, every expression evaluated."""
        return {k: self._config_value(k, v) for k, v in self.raw.items()}


@functools.lru_cache(maxsize=256)
def _shared(keys: frozenset) -> frozenset:
    """The first key set equal to ``keys`` (its hash computed once)."""
    return keys


class Loop(dict):
    """One pass's loop variables and names, with their key set made once (and shared between passes: its
    hash is then computed once), which :meth:`Preset.eval` caches on."""

    __slots__ = ("keyset", "lookup")

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.keyset = _shared(frozenset(self))
        self.lookup: Callable | None = None  # the name lookup through these variables, made on first use


@dataclass(frozen=True)
class Preset:
    """A variant ready to write: its family, resolved values and sharding."""

    name: str
    family: Family
    description: str
    shards: int
    sharding: Sharding
    values: Values

    @property
    def sparse(self) -> bool:
        return self.sharding.sparse

    def get(self, name: str):
        """A config key (bare names through the family's scope), ``let`` or ``sets`` value."""
        try:
            return self.values.lookup(name)
        except ExprError as err:
            raise SpecError(self.family.path, str(err)) from None

    def config(self) -> dict:
        try:
            return self.values.config()
        except ExprError as err:
            raise SpecError(f"{self.family.path}: config", str(err)) from None

    def eval(self, e: Expr, where: str, local: dict | None = None):
        """``e`` with loop variables ``local`` over the preset's values; an error names ``where``. An
        expression no loop variable reaches is evaluated once (k3-full-sparse emits 250k tensors)."""
        loop = local.keyset if isinstance(local, Loop) else frozenset(local or ())
        if loop and self.values.reads(e, loop):
            if not isinstance(local, Loop):
                return self._run(e, where, _with_local(self.values, local, loop))
            if local.lookup is None:
                local.lookup = _with_local(self.values, local, loop)
            return self._run(e, where, local.lookup)
        hit = self.values.fixed.get(id(e))
        if hit is None or hit[0] is not e:
            hit = self.values.fixed[id(e)] = (e, self._run(e, where, self.values.lookup))
        return hit[1]

    def _run(self, e: Expr, where: str, lookup: Callable):
        try:
            return e(lookup)
        except ExprError as err:
            raise SpecError(where, f"{e.text!r}: {err}") from None
        except RecursionError:
            raise SpecError(where, f"{e.text!r}: nested too deep") from None


def _with_local(values: Values, local: dict, loop: frozenset) -> Callable:
    """Loop variables first; a ``let`` value that reads a loop variable is evaluated for this pass (the
    others are evaluated once and cached)."""
    let = values.family.let

    def lookup(name: str):
        if name in local:
            return local[name]
        if name in let and values.reads(let[name], loop):
            return let[name](lookup)
        return values.lookup(name)
    return lookup


def _flatten(over: dict, raw: dict, family: Family, prefix: str = "") -> list[tuple[str, object]]:
    """A variant's config table as (path, value): a table replaces key by key where the family's config
    holds a table there; a bare first-level key is looked up in the family's scope tables first."""
    out = []
    for k, v in over.items():
        p = f"{prefix}.{k}" if prefix else next((f"{s}.{k}" for s in family.scope if _has(raw, f"{s}.{k}")), k)
        if not _has(raw, p):
            raise KeyError(p)
        if isinstance(v, dict) and isinstance(_get(raw, p), dict):
            out.extend(_flatten(v, raw, family, p))
        else:
            out.append((p, v))
    return out


def make_preset(family: Family, v: Variant, layers: int | None = None, experts: int | None = None,
                shards: int | None = None) -> Preset:
    raw = copy.deepcopy(family.config)
    try:
        sets = _flatten(v.config, raw, family)
    except KeyError as e:
        raise SpecError(f"{v.where}: config", f"unknown key {e.args[0]!r} (not in the family's [config])") from None
    for p, value in sets:
        _set(raw, p, value)
    values = Values(family, raw)
    for key, given in ((family.layers_key, layers), (family.experts_key, experts)):
        if given is not None:
            try:
                _set(raw, values.path(key), given)
            except _Missing:
                raise SpecError(f"{family.path}: family", f"unknown key {key!r} (not in [config])") from None
    return Preset(v.name, family, v.description, shards or v.shards, v.sharding, values)
