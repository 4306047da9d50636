"""What a pack's process holds when its streams start (issue 43): ``pack`` run as the tool runs it (the plan made, in a
child where the input is large, the output folder opened, the first wave's jobs cut), stopped right before its units
run; its anonymous memory (RssAnon, after a collection: what it carries for the whole run beside its buffers) and
VmRSS. One fresh process per input, so each starts from the same imports. No tensor data is read.

    python benchmarks/pack_start_memory.py DIR [DIR ...]

DIR: e.g. ``kimi-convert synth k3-full-sparse DIR`` (the released K3's 497,220 tensors) and a slice of its first
shards (``benchmarks/whole_release.py --shards 2`` leaves one beside its input), the bound's base.
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
import gc, json, os, sys, tempfile, time
from rss_sample import rss
import kimi_convert.pack as P
from kimi_convert.options import Options
from kimi_convert.outfolder import OutputFolder

class Started(Exception):
    pass

def stop(executor, waves, *a, **k):
    time.sleep(2)  # (the warm-up thread settles)
    gc.collect()
    print(json.dumps({"anon": rss(os.getpid(), "RssAnon"), "rss": rss(os.getpid(), "VmRSS")}), flush=True)
    raise Started

if __name__ == "__main__":
    P._run_units = stop
    OutputFolder.check_space = lambda *a, **k: None  # (nothing is written: the release's 1.6 TB need not fit)
    with tempfile.TemporaryDirectory() as out:
        try:
            P.pack(sys.argv[1], out, Options(), device="cpu", progress=False)
        except Started:
            pass
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", type=Path, nargs="+")
    a = ap.parse_args()
    print("| input | tensors' index | RssAnon at the streams' start | VmRSS |")
    print("|---|---|---|---|")
    here = str(Path(__file__).parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory() as tmp:
        child = Path(tmp) / "pack_start_child.py"  # (a file, not -c: the plan's spawned child imports this main)
        child.write_text(CHILD)
        for d in a.dirs:
            got = subprocess.run([sys.executable, str(child), str(d)], capture_output=True, text=True, env=env)
            if got.returncode != 0:
                sys.exit(f"{d}: {got.stderr.strip().splitlines()[-1] if got.stderr.strip() else got.returncode}")
            r = json.loads(got.stdout.strip().splitlines()[-1])
            index = d / "model.safetensors.index.json"
            size = f"{index.stat().st_size / 1e6:.1f} MB" if index.exists() else "-"
            print(f"| {d} | {size} | {r['anon'] / 2**20:.0f} MiB | {r['rss'] / 2**20:.0f} MiB |")

if __name__ == "__main__":
    main()
