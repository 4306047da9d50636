"""The small expression language of preset specs, evaluated without ``eval``.

A spec's shapes, layer sets, conditions and derived config values are expressions over config keys
(``hidden_size``, ``linear_attn_config.num_heads``) and loop variables (``layer``, ``expert``). A spec is
data a user may pass on the command line, so it must not run code: the expression is parsed with
``ast`` and only a whitelist of node types is walked (names, dotted names, int / str / bool / None
constants, ``+ - * // %`` on integers, comparisons, ``and`` / ``or`` / ``not``, ``x if c else y``,
list literals and comprehensions, ``x[i]``, and the calls ``range``, ``len``, ``min``, ``max``).
Anything else (attribute access beyond a dotted config key, other calls, lambdas, ``**``, slices, ...)
is refused with the node it met. Ranges and lists are capped so that a spec cannot exhaust memory.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass

#: the most items a range or list may hold (k3-full-sparse's loops are a few thousand long)
MAX_ITEMS = 1 << 20

_BINOPS: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                 ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_COMPARE: dict[type, Callable] = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
                                  ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
                                  ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


class ExprError(ValueError):
    """An expression the language refuses, or one that fails on its values (the message says which)."""


def _range(*args: int) -> list[int]:
    if not 1 <= len(args) <= 2 or not all(_is_int(a) for a in args):
        raise ExprError("range takes one or two integers")
    r = range(*args)
    if len(r) > MAX_ITEMS:
        raise ExprError(f"range of {len(r)} items (at most {MAX_ITEMS})")
    return list(r)


def _len(x) -> int:
    if not isinstance(x, list | dict | str):
        raise ExprError(f"len of {type(x).__name__}")
    return len(x)


def _minmax(f: Callable) -> Callable:
    def call(*args):
        if not args or not all(_is_int(a) for a in args):
            raise ExprError(f"{f.__name__} takes integers")
        return f(args)
    return call


_CALLS: dict[str, Callable] = {"range": _range, "len": _len, "min": _minmax(min), "max": _minmax(max)}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def dotted(node: ast.expr) -> str | None:
    """``a.b.c`` as the string "a.b.c", or None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


@dataclass(frozen=True)
class Expr:
    """A parsed expression and its source text (parsed once, evaluated per layer / expert)."""

    text: str
    tree: ast.Expression

    def __call__(self, lookup: Callable[[str], object]) -> object:
        return _Eval(lookup).run(self.tree.body, {})

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """The dotted names the expression reads (comprehension variables included)."""
        out = set()
        for node in ast.walk(self.tree):
            name = dotted(node) if isinstance(node, ast.Name | ast.Attribute) else None
            if name is not None:
                out.add(name)
        return frozenset(out)


def parse(text: str) -> Expr:
    """The expression ``text``, checked against the whitelist before it is ever evaluated."""
    if not isinstance(text, str):
        raise ExprError(f"expected an expression string, got {type(text).__name__}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"{text!r}: not an expression ({e.msg})") from None
    for node in ast.walk(tree):
        _check_node(node, text)
    return Expr(text, tree)


_ALLOWED = (ast.Expression, ast.Name, ast.Load, ast.Store, ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp,
            ast.Compare, ast.IfExp, ast.List, ast.ListComp, ast.comprehension, ast.Subscript, ast.Call,
            ast.Attribute, ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, *_BINOPS, *_COMPARE)


def _check_node(node: ast.AST, text: str) -> None:
    if not isinstance(node, _ALLOWED):
        raise ExprError(f"{text!r}: {type(node).__name__} is not allowed in a spec expression")
    if isinstance(node, ast.Constant) and not (node.value is None or isinstance(node.value, int | str | float)):
        raise ExprError(f"{text!r}: constant {node.value!r} is not allowed")
    if isinstance(node, ast.Attribute) and dotted(node) is None:
        raise ExprError(f"{text!r}: attribute access is allowed on config keys only (a.b.c)")
    if isinstance(node, ast.Name | ast.Attribute) and any(p.startswith("_") for p in (dotted(node) or "").split(".")):
        raise ExprError(f"{text!r}: names starting with '_' are not allowed")
    if isinstance(node, ast.Call) and (not isinstance(node.func, ast.Name) or node.func.id not in _CALLS
                                       or node.keywords):
        raise ExprError(f"{text!r}: only range, len, min and max may be called (no keywords)")
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
        raise ExprError(f"{text!r}: slices are not allowed")
    if isinstance(node, ast.comprehension) and (not isinstance(node.target, ast.Name) or node.is_async):
        raise ExprError(f"{text!r}: a comprehension binds one plain name")


class _Eval:
    """The walk over a checked tree: config names through ``lookup``, comprehension variables locally."""

    def __init__(self, lookup: Callable[[str], object]) -> None:
        self.lookup = lookup

    def run(self, node: ast.expr, local: dict[str, object]) -> object:
        method = getattr(self, f"_{type(node).__name__}")
        return method(node, local)

    def _Constant(self, node: ast.Constant, local: dict) -> object:
        return node.value

    def _Name(self, node: ast.Name, local: dict) -> object:
        return local[node.id] if node.id in local else self.lookup(node.id)

    def _Attribute(self, node: ast.Attribute, local: dict) -> object:
        return self.lookup(dotted(node))

    def _BinOp(self, node: ast.BinOp, local: dict) -> object:
        a, b = self.run(node.left, local), self.run(node.right, local)
        if not (_is_int(a) and _is_int(b)):
            raise ExprError(f"{type(node.op).__name__} takes integers, got {a!r} and {b!r}")
        if isinstance(node.op, ast.FloorDiv | ast.Mod) and b == 0:
            raise ExprError("division by zero")
        return _BINOPS[type(node.op)](a, b)

    def _UnaryOp(self, node: ast.UnaryOp, local: dict) -> object:
        v = self.run(node.operand, local)
        if isinstance(node.op, ast.Not):
            return not v
        if not _is_int(v):
            raise ExprError(f"unary {type(node.op).__name__} takes an integer, got {v!r}")
        return -v if isinstance(node.op, ast.USub) else v

    def _BoolOp(self, node: ast.BoolOp, local: dict) -> object:
        v: object = None
        for value in node.values:
            v = self.run(value, local)
            if isinstance(node.op, ast.And) != bool(v):
                return v
        return v

    def _Compare(self, node: ast.Compare, local: dict) -> object:
        left = self.run(node.left, local)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = self.run(right_node, local)
            try:
                ok = _COMPARE[type(op)](left, right)
            except TypeError as e:
                raise ExprError(f"cannot compare {left!r} and {right!r}") from e
            if not ok:
                return False
            left = right
        return True

    def _IfExp(self, node: ast.IfExp, local: dict) -> object:
        return self.run(node.body if self.run(node.test, local) else node.orelse, local)

    def _List(self, node: ast.List, local: dict) -> object:
        return [self.run(e, local) for e in node.elts]

    def _Subscript(self, node: ast.Subscript, local: dict) -> object:
        seq, i = self.run(node.value, local), self.run(node.slice, local)
        if not isinstance(seq, list) or not _is_int(i):
            raise ExprError(f"x[i] takes a list and an integer, got {type(seq).__name__} and {i!r}")
        if not -len(seq) <= i < len(seq):
            raise ExprError(f"index {i} out of a list of {len(seq)}")
        return seq[i]

    def _Call(self, node: ast.Call, local: dict) -> object:
        return _CALLS[node.func.id](*(self.run(a, local) for a in node.args))

    def _ListComp(self, node: ast.ListComp, local: dict) -> object:
        out: list = []
        self._comp(node, list(node.generators), dict(local), out)
        return out

    def _comp(self, node: ast.ListComp, gens: list[ast.comprehension], local: dict, out: list) -> None:
        if not gens:
            out.append(self.run(node.elt, local))
            if len(out) > MAX_ITEMS:
                raise ExprError(f"a list of more than {MAX_ITEMS} items")
            return
        gen, rest = gens[0], gens[1:]
        items = self.run(gen.iter, local)
        if not isinstance(items, list):
            raise ExprError(f"a comprehension iterates over a list, got {type(items).__name__}")
        for item in items:
            local[gen.target.id] = item
            if all(self.run(cond, local) for cond in gen.ifs):
                self._comp(node, rest, local, out)
