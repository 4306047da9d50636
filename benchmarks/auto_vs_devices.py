"""Issue 26 item 9: ``pack --device auto`` against ``--device cpu`` and ``--device cuda`` on one input, the
runs interleaved (cpu, cuda, auto, ... rotated each round) so that the machine's drift falls on every device
alike, the input's pages evicted before each run (as ``compare_speed.py --cold input``). Prints each run, then
per configuration the median wall seconds and auto's ratio to the faster single device (target: <= 1.05).

    python benchmarks/auto_vs_devices.py --input /tmp/kc/in --work /tmp/kc --rounds 3 --json out.json

``--configs`` names what runs: a device (``cpu``, ``cuda``, ``auto``) or ``auto:MARGIN`` (auto with
``KIMI_CONVERT_AUTO_GPU_MARGIN=MARGIN``; ``auto:1`` is the plain comparison of the code before issue 26).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare_speed import evict


def run(config: str, inp: Path, out: Path, recipe: str) -> dict:
    device, _, margin = config.partition(":")
    env = {**os.environ, **({"KIMI_CONVERT_AUTO_GPU_MARGIN": margin} if margin else {})}
    shutil.rmtree(out, ignore_errors=True)
    evict(inp)
    stats = out.with_suffix(".stats.json")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kimi_convert.cli", "pack", str(inp), str(out), "--recipe", recipe,
                        "--device", device, "-q", "--stats", str(stats)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"{config}: exit {r.returncode}: {r.stderr.strip()[-500:]}")
    st = json.loads(stats.read_text())
    return {"config": config, "wall_s": round(wall, 3), "device_choices": st.get("device_choices", []),
            "pinned_bytes": st.get("pinned_bytes", 0), "convert_s": st.get("convert_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--recipe", default="nvidia-k3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=["cpu", "cuda", "auto"])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    runs = []
    for k in range(a.rounds):
        order = a.configs[k % len(a.configs):] + a.configs[:k % len(a.configs)]
        for c in order:
            res = run(c, a.input, a.work / f"out-{c.replace(':', '-')}", a.recipe)
            runs.append(res)
            print(f"round {k} {c}: {res['wall_s']:.2f} s" + (f"; chose {res['device_choices']}"
                                                              if res["device_choices"] else ""), flush=True)
    med = {c: statistics.median(r["wall_s"] for r in runs if r["config"] == c) for c in a.configs}
    singles = [med[c] for c in ("cpu", "cuda") if c in med]
    summary = {"median_wall_s": med, "runs": runs}
    for c in med:
        line = f"{c}: median {med[c]:.2f} s"
        if c.startswith("auto") and singles:
            summary[f"{c}_over_best_single"] = round(med[c] / min(singles), 4)
            line += f", {med[c] / min(singles):.3f}x the faster single device ({min(singles):.2f} s)"
        print(line)
    if a.json:
        a.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
