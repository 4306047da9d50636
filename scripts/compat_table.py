"""Render the README's engine compatibility table from the rows tests/test_engines.py records.

    KIMI_CONVERT_COMPAT_OUT=/tmp/compat.jsonl python -m pytest tests/test_engines.py
    python scripts/compat_table.py /tmp/compat.jsonl

With ``--merge README.md`` the rows of a partial run (``pytest -k ...``) replace the README table's rows of the same
engine, model, recipe and layout and are added where new; every other row of the table is kept as it is (rows no run
of this suite makes, such as another tool's checkpoints, stay), and the README is rewritten in place.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = ("| engine | model | recipe | layout | loads | every parameter filled | skipped | bad casts | "
          "engine-optional unset | read right (numeric check) | max relative error (bound) | exact layers |")


def rows(path: str) -> dict[tuple[str, str, str, str], str]:
    """Each recorded combination's rendered row (the last run of each combination wins)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    seen = {}
    for r in records:
        seen[(r["engine"], r["model"], r["recipe"], r["layout"])] = r
    return {key: _row(r) for key, r in seen.items()}


def _row(r: dict) -> str:
    num = r.get("numerics") or {}
    errs = ", ".join(f"{k} {v['max_rel_err']:.2g} ({v['max_bound']:.2g})" for k, v in sorted(num.items())
                     if k != "dense") or "-"
    exact = sum(v["exact_layers"] for v in num.values())
    layers = sum(v["layers"] for v in num.values())
    right = {True: "yes", False: "**no**: " + "; ".join(
        _short(p) for p in r.get("numerics_problems", [])[:1]), None: "not run"}[r.get("numerics_ok")]
    return (f"| {r['engine']} {r['version']} | {r['model']} | `{r['recipe']}` | `{r['layout']}` | "
            f"{'yes' if r['loads'] else '**no**'} | {'yes' if r['filled'] else '**no**'} | {r['skipped']} | "
            f"{r['bad_casts']} | {r['optional_unset']} | {right} | {errs} | {exact} of {layers} |")


def table(rendered: dict[tuple[str, str, str, str], str]) -> list[str]:
    return [HEADER, "|---|---|---|---|---|---|---|---|---|---|---|---|"] + [rendered[k] for k in sorted(rendered)]


def _key(line: str) -> tuple[str, str, str, str]:
    """A rendered row's (engine, model, recipe, layout), as :func:`rows` keys it."""
    cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
    return cells[0].split(" ")[0], cells[1], cells[2].strip("`"), cells[3].strip("`")


def merge(readme: Path, rendered: dict[tuple[str, str, str, str], str]) -> None:
    """Rewrite ``readme``'s table with ``rendered`` over its rows (see the module docstring)."""
    lines = readme.read_text().split("\n")
    start = lines.index(HEADER)
    end = start + 2
    while end < len(lines) and lines[end].startswith("| "):
        end += 1
    kept = {_key(line): line for line in lines[start + 2:end]}
    lines[start:end] = table({**kept, **rendered})
    readme.write_text("\n".join(lines))


def _short(problem: str) -> str:
    """A numeric failure's layer and error, for a table cell; an engine's refusal of a layer: its message."""
    if "the engine's own processing failed: " in problem:
        where, msg = problem.split(": ", 1)[1].split(": the engine's own processing failed: ", 1)
        return f"`{where.rsplit('.', 1)[-1]}` refused: {msg[:200]}"
    layer = problem.split(": ", 2)[1].split(" rows")[0].rsplit(".", 2)[-2]
    err = problem.split("relative error up to ")[-1].split(" (")[0] if "relative error" in problem else problem[-60:]
    return f"`{layer}` {err}"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] == "--merge":
        merge(Path(sys.argv[3]), rows(sys.argv[1]))
    elif len(sys.argv) == 2:
        print("\n".join(table(rows(sys.argv[1]))))
    else:
        sys.exit("usage: compat_table.py ROWS.jsonl [--merge README.md]")
