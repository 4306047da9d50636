"""No import circle in the package: every module's imports (at the top and inside functions, but not the
``TYPE_CHECKING`` ones, which never run) form a graph without cycles, so each stage can be read, tested
and replaced on its own (source -> plan -> compute -> write, with leaves such as ``filenames``, ``schemes``,
``engine_rules`` under them).

Counting the ``TYPE_CHECKING`` imports as well (a type named across modules ties them for a reader as an import
does), the package still has the circles ``TYPED_CIRCLES`` lists (issue 40, item 4: the vocabulary without a leaf);
no other may appear, and one that is broken must leave the list, so the list only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "convert"


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


#: The circles counting ``TYPE_CHECKING`` imports (and those inside functions), each as its sorted modules.
TYPED_CIRCLES = [
    ["checkpoint", "formats", "formats.compressed_tensors", "formats.modelopt", "keep", "mapping", "plan.decide",
     "plan.discover", "plan.fusion", "plan.model", "recipe", "sidefiles"],
    ["verify.config_checks", "verify.offline"],
]


def _runtime_imports(tree: ast.AST, typing: bool = False):
    """ImportFrom nodes outside ``if TYPE_CHECKING:`` blocks (``typing``: those inside them too)."""
    skip: set[int] = set()
    for n in ast.walk(tree):
        if not typing and isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip.update(id(x) for x in ast.walk(n))
    return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level and id(n) not in skip]


def _graph(typing: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        here = m.split(".") if m else []
        if path.name != "__init__.py":
            here = here[:-1]
        for n in _runtime_imports(ast.parse(path.read_text()), typing):
            base = here[: len(here) - (n.level - 1)] if n.level > 1 else here
            target = ".".join([*base, *([n.module] if n.module else [])])
            subs = {f"{target}.{a.name}".lstrip(".") for a in n.names} & mods.keys()
            # ``from . import x``: the submodule x (its package is already imported); else the module named
            for t in subs or ({target} & mods.keys()):
                if t != m:
                    graph[m].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_the_check_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_no_new_circle_counting_type_checking_imports():
    assert sorted(_cycles(_graph(typing=True))) == sorted(TYPED_CIRCLES)


def test_the_typed_graph_sees_a_type_checking_import(tmp_path, monkeypatch):
    """A circle closed only by an ``if TYPE_CHECKING:`` import: invisible at run time, seen with ``typing``."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _cycles(_graph()) == [] and _cycles(_graph(typing=True)) == [["a", "b"]]

