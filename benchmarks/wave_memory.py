"""What one wave's part of the plan holds at the released K3's scale (issue 43): after the banked plan, the
second wave's jobs made (``jobs.jobs_by_wave``, as ``pack`` makes them) and cut into the pipeline's pieces
(``pipeline.pieces``, as ``run_jobs`` does), in a fresh child per wave size; the anonymous memory (RssAnon) each step
adds, after a garbage collection, and the units and pieces it made. No tensor data is read.

    python benchmarks/wave_memory.py [--dir DIR] [--wave-units 16384 2048]

DIR: ``kimi-convert synth k3-full-sparse DIR``.
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
import gc, json, os, sys
from pathlib import Path
from rss_sample import rss
def anon():
    return rss(os.getpid(), "RssAnon")
import kimi_convert.cli
from kimi_convert import pipeline
from kimi_convert.jobs import jobs_by_wave
from kimi_convert.pack import load_plan
from kimi_convert.plan import Options
from kimi_convert.tuning import Tuning
src, wave_units, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
ckpt, plan = load_plan(src, Options(), banked=True)
gc.collect()
a0 = anon()
waves = jobs_by_wave(ckpt, plan, list(plan.shard_sizes()), 1, out, wave_units, hash_inputs=False)
next(waves)  # the first wave holds the release's last shard (embeddings, head): the second is a steady one
jobs = next(waves)
gc.collect()
a1 = anon()
mine = [pipeline.pieces(j.units, j.file_order, Tuning().slice_bytes) for j in jobs]
gc.collect()
a2 = anon()
print(json.dumps({"wave_units": wave_units, "shards": sum(len(j.shards) for j in jobs),
                  "units": sum(len(j.units) for j in jobs), "pieces": sum(map(len, mine)),
                  "jobs_added": a1 - a0, "pieces_added": a2 - a1}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kimi-convert-bench/k3-full-sparse"))
    ap.add_argument("--wave-units", type=int, nargs="+", default=[16384, 2048])
    a = ap.parse_args()
    if not (a.dir / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "kimi_convert.cli", "synth", "k3-full-sparse", str(a.dir)], check=True)
    print("| wave units | shards in the wave | units | pieces | its jobs add | its pieces add |")
    print("|---|---|---|---|---|---|")
    for n in a.wave_units:
        with tempfile.TemporaryDirectory() as out:
            got = subprocess.run([sys.executable, "-c", CHILD, str(a.dir), str(n), out], capture_output=True,
                                 text=True, check=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
                                 ).stdout.strip().splitlines()[-1]
        r = json.loads(got)
        print(f"| {n} | {r['shards']} | {r['units']} | {r['pieces']} | {r['jobs_added'] / 1e6:.0f} MB | "
              f"{r['pieces_added'] / 1e6:.0f} MB |")


if __name__ == "__main__":
    main()
