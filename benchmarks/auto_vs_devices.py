"""Issue 26 item 9: ``pack --device auto`` against ``--device cpu`` and ``--device cuda`` on one input, the
runs interleaved (cpu, cuda, auto, ... rotated each round) so that the machine's drift falls on every device
alike, the input's pages evicted before each run (as ``compare_speed.py --cold input``). Prints each run, then
per configuration the median wall seconds and auto's ratio to the faster single device (target: <= 1.05).

    python benchmarks/auto_vs_devices.py --input /tmp/kc/in --work /tmp/kc --rounds 3 --json out.json

``--configs`` names what runs: a device (``cpu``, ``cuda``, ``auto``), or a name given by
``--define NAME=DEVICE[,VAR=VALUE...]``: that device with those environment variables (e.g. ``PYTHONPATH=DIR`` to
run another tree's code). Each run's ``--stats`` (stage
seconds, each stream's wall, page-locking, auto's calibration thread) is kept in the JSON. ``--check-equal``:
at the end, every configuration's last output must hold the same bytes, file by file (sha256 of each).
"""

from __future__ import annotations

import argparse
import hashlib
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


def run(config: str, inp: Path, out: Path, recipe: str, defined: dict[str, tuple[str, dict]]) -> dict:
    """One pack of ``inp`` into ``out`` (removed first; the input's pages evicted), timed from outside."""
    device, env_add = defined.get(config) or (config, {})
    env = {**os.environ, **env_add}
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
    keep = ("convert_s", "backend_s", "pin_s", "pinned_bytes", "stages_s", "stream_wall_s", "calibration")
    return {"config": config, "wall_s": round(wall, 3), "device_choices": st.get("device_choices", []),
            **{k: st[k] for k in keep if k in st}}


def _define(text: str) -> tuple[str, tuple[str, dict]]:
    """``NAME=DEVICE[,VAR=VALUE...]`` (from --define)."""
    name, _, rest = text.partition("=")
    device, *pairs = rest.split(",")
    return name, (device, dict(pair.split("=", 1) for pair in pairs))


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file's sha256, by its path in ``folder``."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
            out[str(p.relative_to(folder))] = h.hexdigest()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--recipe", default="nvidia-k3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=["cpu", "cuda", "auto"])
    ap.add_argument("--define", action="append", default=[], metavar="NAME=DEVICE[,VAR=VALUE...]")
    ap.add_argument("--check-equal", action="store_true", help="the configurations' outputs must be byte-equal")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    defined = dict(_define(d) for d in a.define)
    a.work.mkdir(parents=True, exist_ok=True)
    runs = []
    for k in range(a.rounds):
        order = a.configs[k % len(a.configs):] + a.configs[:k % len(a.configs)]
        for c in order:
            res = run(c, a.input, a.work / f"out-{c.replace(':', '-')}", a.recipe, defined)
            runs.append(res)
            print(f"round {k} {c}: {res['wall_s']:.2f} s (convert {res.get('convert_s', 0):.2f} s, streams "
                  f"{res.get('stream_wall_s')}, pin {res.get('pin_s')} s)" + (
                      f"; chose {res['device_choices']}" if res["device_choices"] else "")
                  + (f"; calibration {res['calibration']}" if res.get("calibration") else ""), flush=True)
    med = {c: statistics.median(r["wall_s"] for r in runs if r["config"] == c) for c in a.configs}
    singles = [med[c] for c in ("cpu", "cuda") if c in med]
    summary = {"median_wall_s": med, "runs": runs}
    for c in med:
        line = f"{c}: median {med[c]:.2f} s"
        if "auto" in c and singles:
            summary[f"{c}_over_best_single"] = round(med[c] / min(singles), 4)
            line += f", {med[c] / min(singles):.3f}x the faster single device ({min(singles):.2f} s)"
        print(line)
    if a.check_equal:
        digests = {c: tree_digest(a.work / f"out-{c.replace(':', '-')}") for c in a.configs}
        first = a.configs[0]
        for c in a.configs[1:]:
            diff = sorted(f for f in digests[first].keys() | digests[c].keys()
                          if digests[first].get(f) != digests[c].get(f))
            summary.setdefault("equal", {})[f"{first}=={c}"] = not diff
            print(f"bytes {first} == {c}: {'yes' if not diff else 'NO, differ: ' + ', '.join(diff[:5])} "
                  f"({len(digests[c])} files)")
    if a.json:
        a.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
