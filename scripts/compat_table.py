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
          "engine-optional unset |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (engine, model, recipe, layout), r in sorted(seen.items()):
        print(f"| {engine} {r['version']} | {model} | `{recipe}` | `{layout}` | {'yes' if r['loads'] else '**no**'} | "
              f"{'yes' if r['filled'] else '**no**'} | {r['skipped']} | {r['bad_casts']} | {r['optional_unset']} |")


if __name__ == "__main__":
    main(sys.argv[1])
