"""No import circle in the package: every module's imports (at the top and inside functions, but not the
``TYPE_CHECKING`` ones, which never run) form a graph without cycles, so each stage can be read, tested
and replaced on its own (source -> plan -> compute -> write, with leaves such as ``filenames``, ``schemes``,
``engine_rules`` under them).

Counting the ``TYPE_CHECKING`` imports as well (a type named across modules ties them for a reader as an import
does), there is no circle either: the vocabulary the stages share (the plan's data, the keep rules, the recipe's
and mapping's records, the options) sits in modules that import nothing of the package above them.

The kernels (``kernels/src``, installed as ``kimi_convert.kernels``) import nothing of the application: they take a
resolved device, so they can be read, tested and reused without it. No private name (``_x``) crosses a module:
what another module needs is public and says why in its docstring."""

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


KERNELS = Path(__file__).parents[1] / "kernels" / "src"


def _runtime_imports(tree: ast.AST, typing: bool = False):
    """ImportFrom nodes of the package (relative, or ``from kimi_convert...``) outside ``if TYPE_CHECKING:``
    blocks (``typing``: those inside them too)."""
    skip: set[int] = set()
    for n in ast.walk(tree):
        if not typing and isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip.update(id(x) for x in ast.walk(n))
    return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in skip
            and (n.level or (n.module or "").split(".")[0] == "kimi_convert")]


def _graph(typing: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        here = m.split(".") if m else []
        if path.name != "__init__.py":
            here = here[:-1]
        for n in _runtime_imports(ast.parse(path.read_text()), typing):
            base = here[: len(here) - (n.level - 1)] if n.level > 1 else here
            target = ".".join([*base, *([n.module] if n.module else [])]) if n.level \
                else n.module.removeprefix("kimi_convert").lstrip(".")
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


def test_no_circle_counting_type_checking_imports():
    assert _cycles(_graph(typing=True)) == []


def test_the_typed_graph_sees_a_type_checking_import(tmp_path, monkeypatch):
    """A circle closed only by an ``if TYPE_CHECKING:`` import: invisible at run time, seen with ``typing``."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _cycles(_graph()) == [] and _cycles(_graph(typing=True)) == [["a", "b"]]



def _package_modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name (``kimi_convert...``): the application and
    the kernels."""
    out = {".".join(["kimi_convert", *([m] if m else [])]): p for m, p in _modules().items()}
    for p in KERNELS.rglob("*.py"):
        parts = list(p.relative_to(KERNELS).with_suffix("").parts)
        out[".".join(["kimi_convert", "kernels", *parts[: -1 if parts[-1] == "__init__" else None]])] = p
    return out


def _imported(name: str, path: Path, tree: ast.AST):
    """(line, module imported, names taken from it) of each import of ``tree`` (module ``name`` at ``path``),
    relative ones resolved to dotted names."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):  # ``import a.b as c`` binds c to the module a.b
            for a in n.names:
                yield n.lineno, a.name, ()
                if a.asname:
                    base, _, leaf = a.name.rpartition(".")
                    yield n.lineno, base, ((leaf, a.asname),)
        elif isinstance(n, ast.ImportFrom):
            base = ".".join([*here[: len(here) - (n.level - 1)], *([n.module] if n.module else [])]) if n.level \
                else n.module or ""
            yield n.lineno, base, tuple((a.name, a.asname) for a in n.names)


def _private_crossings(mods: dict[str, Path]) -> list[str]:
    """``from X import _name`` and ``X._name`` where X is another module of the package (a name starting with
    one underscore; dunders are Python's)."""
    out = []
    for name, path in sorted(mods.items()):
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}  # a local name bound to a module of the package
        for line, mod, names in _imported(name, path, tree):
            for n, asname in names:
                if n.startswith("_") and not n.startswith("__") and mod in mods:
                    out.append(f"{path.name}:{line}: from {mod} import {n}")
                if f"{mod}.{n}" in mods:
                    aliases[asname or n] = f"{mod}.{n}"
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") \
                    and isinstance(n.value, ast.Name) and n.value.id in aliases:
                out.append(f"{path.name}:{n.lineno}: {aliases[n.value.id]}.{n.attr}")
    return out


def test_no_private_name_crosses_a_module():
    assert _private_crossings(_package_modules()) == []


def test_the_private_check_sees_both_spellings(tmp_path):
    (tmp_path / "a.py").write_text("def _x(): pass\n")
    (tmp_path / "b.py").write_text("from .a import _x\nfrom . import a\na._x()\nimport kimi_convert.a as k\n"
                                   "k._x()\n__all__ = []\n")
    mods = {"kimi_convert.a": tmp_path / "a.py", "kimi_convert.b": tmp_path / "b.py"}
    assert _private_crossings(mods) == ["b.py:1: from kimi_convert.a import _x", "b.py:3: kimi_convert.a._x",
                                        "b.py:5: kimi_convert.a._x"]


def _kernel_imports_of_the_application(files) -> list[str]:
    """Imports in the kernels of anything of ``kimi_convert`` outside ``kimi_convert.kernels`` (a relative import
    climbing out of the kernels' package counts too)."""
    out = []
    for path in files:
        parts = path.relative_to(KERNELS).with_suffix("").parts if path.is_relative_to(KERNELS) else (path.stem,)
        name = ".".join(["kimi_convert", "kernels", *parts[: -1 if parts[-1] == "__init__" else None]])
        for line, mod, _ in _imported(name, path, ast.parse(path.read_text())):
            if mod.split(".")[0] == "kimi_convert" and not (mod + ".").startswith("kimi_convert.kernels."):
                out.append(f"{path.name}:{line}: {mod}")
    return out


def test_kernels_import_nothing_of_the_application():
    assert _kernel_imports_of_the_application(sorted(KERNELS.rglob("*.py"))) == []


def test_the_kernel_check_sees_an_application_import(tmp_path):
    (tmp_path / "k.py").write_text("from kimi_convert.devices import cpus\nfrom .. import errors\n"
                                   "from . import clib\nimport os\n")
    assert _kernel_imports_of_the_application([tmp_path / "k.py"]) == [
        "k.py:1: kimi_convert.devices", "k.py:2: kimi_convert"]


#: The vocabulary the stages share, each module importing nothing of the package but ``schemes`` (the scheme
#: names), itself a leaf: what the plan's data names, so the plan ties no stage to another. A leaf that is a
#: package (``schemes``: one module per scheme) imports its own modules only, and they nothing outside it.
LEAVES = {"vocabulary": {"schemes"}, "options": set(), "schemes": set()}


def test_the_vocabulary_is_a_leaf():
    graph = _graph(typing=True)
    inside = lambda leaf, t: t.startswith(leaf + ".")  # noqa: E731
    assert {m: {t for t in graph[m] if not inside(m, t)} for m in LEAVES} == LEAVES
    for leaf in LEAVES:
        for sub in (m for m in graph if inside(leaf, m)):
            assert all(t == leaf or inside(leaf, t) for t in graph[sub]), (sub, graph[sub])


def test_the_plan_loads_no_command_line_library():
    """``plan/model.py`` records an ``Options``; the plan stays a pure function of its inputs, loading neither
    click (``clioptions`` makes the flags) nor torch."""
    import subprocess
    import sys

    code = "import sys, kimi_convert.plan; print(sorted({'click', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
