"""A pack's streams in time, from its `--stats` (`stream_timelines`) or from `ct_profile.py`'s JSON (each variant's):
per interval, the rates at which the stream read, its input file chains hashed and its writer stored, and the
bytes in flight (and, where the timeline has them, the worker's pooled buffers and the bytes its file hashes hold):
which stage is behind, and when (start-up, steady state, the tail), and what the memory holds.

    python benchmarks/timeline.py FILE.json [--every 0.5] [--variant NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def table(tl: dict, every: float) -> list[str]:
    """One line per ``every`` seconds (at least the timeline's own interval)."""
    rows = tl["rows"]
    memory = len(tl["columns"]) > 5  # (timelines before session 28 end at in_flight)
    out = ["    s   read GB  hashed GB  stored GB | read GB/s  hashed GB/s  stored GB/s | in flight MB"
           + (" | pooled MB | held MB" if memory else "")]
    last = None
    for r in rows:
        if last is not None and r[0] - last[0] < every and r is not rows[-1]:
            continue
        t, rd, hs, st, fl = r[:5]
        if last is None:
            rates = "          -            -            -"
        else:
            dt = max(t - last[0], 1e-9)
            gbps = [(now - then) / dt / 1e9 for now, then in zip((rd, hs, st), last[1:4], strict=True)]
            rates = f"{gbps[0]:10.2f} {gbps[1]:12.2f} {gbps[2]:12.2f}"
        more = f" | {r[5] / 1e6:9.0f} | {r[6] / 1e6:7.0f}" if memory else ""
        out.append(f"{t:5.1f} {rd / 1e9:9.2f} {hs / 1e9:10.2f} {st / 1e9:10.2f} | {rates} | {fl / 1e6:12.0f}{more}")
        last = r
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between lines")
    ap.add_argument("--variant", help="ct_profile.py's JSON: this variant only (default: each)")
    a = ap.parse_args()
    data = json.loads(a.json.read_text())
    runs = ([(r["variant"], r["stats"]) for r in data["runs"]] if "runs" in data else [(a.json.name, data)])
    for name, stats in runs:
        if a.variant and name != a.variant:
            continue
        for k, tl in enumerate(stats.get("stream_timelines", [])):
            print(f"{name}, stream {k}:")
            print("\n".join(table(tl, a.every)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
