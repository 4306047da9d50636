"""No function of the package over 60 lines (the project's style: a function a reader holds at once), counted
from its ``def`` line to its last line, nested functions inside their parent's count. Data tables are exempt by
name in ``TABLES`` (none today)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOTS = [Path(__file__).parents[1] / "convert", Path(__file__).parents[1] / "kernels" / "src"]
LIMIT = 60
#: ``module path:function`` of the data tables a function builds, exempt from the limit.
TABLES: set[str] = set()


def _long_functions(files, limit: int = LIMIT) -> list[str]:
    """``file:function (lines)`` of each function over ``limit`` lines."""
    out = []
    for path in files:
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = n.end_lineno - n.lineno + 1
                if lines > limit and f"{path.name}:{n.name}" not in TABLES:
                    out.append(f"{path.name}:{n.name} ({lines})")
    return out


def test_no_function_over_60_lines():
    assert _long_functions(sorted(p for r in ROOTS for p in r.rglob("*.py"))) == []


def test_the_count_sees_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMIT - 1))
    (tmp_path / "m.py").write_text(f"def short():\n{body}\nasync def long():\n{body}    return 1\n")
    assert _long_functions([tmp_path / "m.py"]) == [f"m.py:long ({LIMIT + 1})"]
