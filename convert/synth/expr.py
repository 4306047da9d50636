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
#: the longest expression text (the presets' longest is about 120 characters) and its deepest nesting
MAX_TEXT, MAX_DEPTH = 2000, 64

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
        return self.fn(lookup, {})

    @functools.cached_property
    def fn(self) -> Fn:
        """The checked tree as closures, built on first use."""
        return _compile(self.tree.body)

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
    if len(text) > MAX_TEXT:
        raise ExprError(f"{text[:40]!r}...: longer than {MAX_TEXT} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"{text!r}: not an expression ({e.msg})") from None
    except (RecursionError, MemoryError):
        raise ExprError(f"{text[:40]!r}...: nested too deep") from None
    for node in ast.walk(tree):
        _check_node(node, text)
    if _depth(tree) > MAX_DEPTH:
        raise ExprError(f"{text[:40]!r}...: nested deeper than {MAX_DEPTH}")
    return Expr(text, tree)


def _depth(tree: ast.AST) -> int:
    """The tree's depth, without recursion (its evaluation recurses once a level)."""
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, d = todo.pop()
        deepest = max(deepest, d)
        todo.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return deepest


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


Fn = Callable[[Callable[[str], object], dict], object]  # (lookup, comprehension variables) -> value


def _compile(node: ast.AST) -> Fn:
    """A checked node as a closure (built once per expression, called per layer and expert: k3-full-sparse
    evaluates some expressions 250k times)."""
    return _COMPILERS[type(node)](node)


def _constant(node: ast.Constant) -> Fn:
    value = node.value
    return lambda lookup, local: value


def _name(node: ast.Name) -> Fn:
    name = node.id
    return lambda lookup, local: local[name] if name in local else lookup(name)


def _attribute(node: ast.Attribute) -> Fn:
    name = dotted(node)
    return lambda lookup, local: lookup(name)


def _binop(node: ast.BinOp) -> Fn:
    left, right, op, what = _compile(node.left), _compile(node.right), _BINOPS[type(node.op)], type(node.op).__name__
    divides = isinstance(node.op, ast.FloorDiv | ast.Mod)

    def run(lookup, local):
        a, b = left(lookup, local), right(lookup, local)
        if not (_is_int(a) and _is_int(b)):
            raise ExprError(f"{what} takes integers, got {a!r} and {b!r}")
        if divides and b == 0:
            raise ExprError("division by zero")
        return op(a, b)
    return run


def _unaryop(node: ast.UnaryOp) -> Fn:
    operand, op = _compile(node.operand), node.op

    def run(lookup, local):
        v = operand(lookup, local)
        if isinstance(op, ast.Not):
            return not v
        if not _is_int(v):
            raise ExprError(f"unary {type(op).__name__} takes an integer, got {v!r}")
        return -v if isinstance(op, ast.USub) else v
    return run


def _boolop(node: ast.BoolOp) -> Fn:
    values, is_and = [_compile(v) for v in node.values], isinstance(node.op, ast.And)

    def run(lookup, local):
        v: object = None
        for value in values:
            v = value(lookup, local)
            if is_and != bool(v):
                return v
        return v
    return run


def _compare(node: ast.Compare) -> Fn:
    first = _compile(node.left)
    rest = [(_COMPARE[type(op)], _compile(r)) for op, r in zip(node.ops, node.comparators, strict=True)]

    def run(lookup, local):
        left = first(lookup, local)
        for op, right_fn in rest:
            right = right_fn(lookup, local)
            try:
                ok = op(left, right)
            except TypeError as e:
                raise ExprError(f"cannot compare {left!r} and {right!r}") from e
            if not ok:
                return False
            left = right
        return True
    return run


def _ifexp(node: ast.IfExp) -> Fn:
    test, body, orelse = _compile(node.test), _compile(node.body), _compile(node.orelse)
    return lambda lookup, local: body(lookup, local) if test(lookup, local) else orelse(lookup, local)


def _list(node: ast.List) -> Fn:
    items = [_compile(e) for e in node.elts]
    return lambda lookup, local: [item(lookup, local) for item in items]


def _subscript(node: ast.Subscript) -> Fn:
    value, index = _compile(node.value), _compile(node.slice)

    def run(lookup, local):
        seq, i = value(lookup, local), index(lookup, local)
        if not isinstance(seq, list) or not _is_int(i):
            raise ExprError(f"x[i] takes a list and an integer, got {type(seq).__name__} and {i!r}")
        if not -len(seq) <= i < len(seq):
            raise ExprError(f"index {i} out of a list of {len(seq)}")
        return seq[i]
    return run


def _call(node: ast.Call) -> Fn:
    fn, args = _CALLS[node.func.id], [_compile(a) for a in node.args]
    return lambda lookup, local: fn(*(a(lookup, local) for a in args))


def _listcomp(node: ast.ListComp) -> Fn:
    elt = _compile(node.elt)
    gens = [(g.target.id, _compile(g.iter), [_compile(c) for c in g.ifs]) for g in node.generators]

    def expand(i: int, lookup, local: dict, out: list) -> None:
        if i == len(gens):
            out.append(elt(lookup, local))
            if len(out) > MAX_ITEMS:
                raise ExprError(f"a list of more than {MAX_ITEMS} items")
            return
        target, source, conds = gens[i]
        items = source(lookup, local)
        if not isinstance(items, list):
            raise ExprError(f"a comprehension iterates over a list, got {type(items).__name__}")
        for item in items:
            local[target] = item
            if all(c(lookup, local) for c in conds):
                expand(i + 1, lookup, local, out)

    def run(lookup, local):
        out: list = []
        expand(0, lookup, dict(local), out)
        return out
    return run


_COMPILERS: dict[type, Callable[[ast.AST], Fn]] = {
    ast.Constant: _constant, ast.Name: _name, ast.Attribute: _attribute, ast.BinOp: _binop,
    ast.UnaryOp: _unaryop, ast.BoolOp: _boolop, ast.Compare: _compare, ast.IfExp: _ifexp, ast.List: _list,
    ast.Subscript: _subscript, ast.Call: _call, ast.ListComp: _listcomp}
