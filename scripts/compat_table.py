"""Render the README's engine compatibility table from the rows tests/test_engines.py records.

    KIMI_CONVERT_COMPAT_OUT=/tmp/compat.jsonl python -m pytest tests/test_engines.py
    python scripts/compat_table.py /tmp/compat.jsonl
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    seen = {}
    for r in rows:  # the last run of each combination wins
        seen[(r["engine"], r["model"], r["recipe"], r["layout"])] = r
    print("| engine | model | recipe | layout | loads | every parameter filled | skipped | bad casts | "
          "engine-optional unset | read right (numeric check) | max relative error (bound) | exact layers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (engine, model, recipe, layout), r in sorted(seen.items()):
        num = r.get("numerics") or {}
        errs = ", ".join(f"{k} {v['max_rel_err']:.2g} ({v['max_bound']:.2g})" for k, v in sorted(num.items())
                         if k != "dense") or "-"
        exact = sum(v["exact_layers"] for v in num.values())
        layers = sum(v["layers"] for v in num.values())
        right = {True: "yes", False: "**no**: " + "; ".join(
            _short(p) for p in r.get("numerics_problems", [])[:1]), None: "not run"}[r.get("numerics_ok")]
        print(f"| {engine} {r['version']} | {model} | `{recipe}` | `{layout}` | {'yes' if r['loads'] else '**no**'} | "
              f"{'yes' if r['filled'] else '**no**'} | {r['skipped']} | {r['bad_casts']} | {r['optional_unset']} | "
              f"{right} | {errs} | {exact} of {layers} |")


def _short(problem: str) -> str:
    """A numeric failure's layer and error, for a table cell; an engine's refusal of a layer: its message."""
    if "the engine's own processing failed: " in problem:
        where, msg = problem.split(": ", 1)[1].split(": the engine's own processing failed: ", 1)
        return f"`{where.rsplit('.', 1)[-1]}` refused: {msg[:200]}"
    layer = problem.split(": ", 2)[1].split(" rows")[0].rsplit(".", 2)[-2]
    err = problem.split("relative error up to ")[-1].split(" (")[0] if "relative error" in problem else problem[-60:]
    return f"`{layer}` {err}"

if __name__ == "__main__":
    main(sys.argv[1])
