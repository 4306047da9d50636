"""CPU seconds of each of the pack's threads (by name: reader, stream, writer, hashing, the input file's chain, the
C kernels' pool workers), for one in-process `pack` from a cold page cache: which work the CPUs spend the run on.

    python benchmarks/thread_cpu.py --input DIR [--recipe ct-nvfp4-a16] [--device cpu] [--json FILE]

Sampled from /proc/self/task every 50 ms (Linux); a thread's last sample is its total (one that lives under 50 ms
may be missed), less what it had used before the pack began (the main thread's imports). Threads Python did not
start (the C pool's workers, torch's) are counted as "C-worker".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_speed import evict  # noqa: E402


def snapshot(seen: dict[int, tuple[str, float]]) -> None:
    """Each live thread's name and CPU seconds so far, into ``seen``."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            f = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid)) or seen.get(int(tid), ("C-worker", 0.0))[0]
        seen[int(tid)] = (name, (int(f[11]) + int(f[12])) / tick)  # utime + stime


def sample(seen: dict[int, tuple[str, float]], stop: threading.Event) -> None:
    while not stop.is_set():
        snapshot(seen)
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", type=Path, required=True)
    ap.add_argument("--recipe", default="ct-nvfp4-a16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from kimi_convert.pack import pack
    from kimi_convert.plan import Options

    seen: dict[int, tuple[str, float]] = {}
    stop = threading.Event()
    with tempfile.TemporaryDirectory(dir=a.input.parent) as work:
        evict(a.input)
        before: dict[int, tuple[str, float]] = {}
        snapshot(before)  # the threads alive before the pack (the main one: its imports are not the pack's)
        t = threading.Thread(target=sample, args=(seen, stop), daemon=True, name="sampler")
        t.start()
        t0, c0 = time.perf_counter(), time.process_time()
        pack(a.input, Path(work) / "out", Options(recipe=a.recipe), device=a.device, progress=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stop.set()
        t.join()
    by_name: dict[str, float] = collections.defaultdict(float)
    for tid, (name, c) in seen.items():
        by_name[name.rstrip("0123456789_").rstrip("-_")] += c - before.get(tid, ("", 0.0))[1]
    rows = dict(sorted(((k, round(v, 2)) for k, v in by_name.items()), key=lambda kv: -kv[1]))
    print(json.dumps({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "threads_cpu_s": rows}))
    if a.json:
        a.json.write_text(json.dumps({"input": str(a.input), "recipe": a.recipe, "device": a.device,
                                      "wall_s": wall, "cpu_s": cpu, "threads_cpu_s": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
