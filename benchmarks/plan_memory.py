"""What the input's table and the pack's plan leave resident at the released K3's scale (issue 43): the anonymous
memory (RssAnon) a process holds after ``open_checkpoint`` and after the pack's banked plan, each in a fresh child,
after a garbage collection. This, not the plan's transient peak (``plan_scale.py``), is what a pack carries through
its two hours beside its buffers.

    python benchmarks/plan_memory.py [--dir DIR] [--src CHECKOUT ...]

DIR: ``kimi-convert synth k3-full-sparse DIR`` (497,220 tensors in 96 sparse shards). ``--src``: other checkouts'
code (``git worktree add /tmp/before COMMIT``), run the same way, one row each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import gc, json, os, sys, time
from pathlib import Path
from rss_sample import rss
def anon():
    return rss(os.getpid(), "RssAnon")
import kimi_convert, kimi_convert.cli  # the pack's imports first: they are not the table's
from kimi_convert.checkpoint import open_checkpoint
from kimi_convert.pack import load_plan
from kimi_convert.plan import Options
what, src = sys.argv[1], Path(sys.argv[2])
a0, t = anon(), time.perf_counter()
if what == "open":
    kept = open_checkpoint(src)
elif what == "apart":  # pack's way for a large input (planprocess): made in a child, sent back
    try:
        from kimi_convert import planprocess
    except ImportError:  # code from before it
        print("null")
        sys.exit()
    from kimi_convert.sources import open_source
    kept = planprocess.load_plan_apart(open_source(src), Options(), load_plan)
else:
    kept = load_plan(src, Options(), banked=True)
gc.collect()
seconds, added = round(time.perf_counter() - t, 2), anon() - a0
table = (kept if what == "open" else kept[0]).tensors
own = 0  # the table's own objects: sys.getsizeof over everything it reaches (types and functions aside)
if what == "open":
    seen, stack = set(), [table]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, type) or callable(o) and not hasattr(o, "__len__"):
            continue
        seen.add(id(o))
        own += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
print(json.dumps({"code": kimi_convert.__file__, "seconds": seconds, "anon_added": added, "tensors": len(table),
                  "table_bytes": own}))
"""


def measure(what: str, src: Path, pythonpath: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pythonpath, str(Path(__file__).parent)])))
    out = subprocess.run([sys.executable, "-c", CHILD, what, str(src)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kimi-convert-bench/k3-full-sparse"))
    ap.add_argument("--src", nargs="*", default=[], help="other checkouts, one row each")
    a = ap.parse_args()
    if not (a.dir / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "kimi_convert.cli", "synth", "k3-full-sparse", str(a.dir)], check=True)
    sys.path.insert(0, str(Path(__file__).parent))
    from plan_scale import package_from

    print("| code | open_checkpoint: resident after | its table's own objects | s | banked plan: resident after | s | "
          "planned in a child, as pack (where the code has it) | s | tensors |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for k, src in enumerate([None, *a.src]):
            path = str(package_from(Path(src), Path(tmp) / str(k))) if src else None
            o, p = measure("open", a.dir, path), measure("plan", a.dir, path)
            c = measure("apart", a.dir, path)
            apart = f"{c['anon_added'] / 1e6:.0f} MB | {c['seconds']}" if c else "- | -"
            print(f"| {src or 'this checkout'} | {o['anon_added'] / 1e6:.0f} MB | {o['table_bytes'] / 1e6:.0f} MB | "
                  f"{o['seconds']} | {p['anon_added'] / 1e6:.0f} MB | {p['seconds']} | {apart} | {o['tensors']} |")


if __name__ == "__main__":
    main()
