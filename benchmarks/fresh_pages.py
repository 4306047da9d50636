"""What a fresh page of anonymous memory costs here (issue 38, session 36): each run maps ``--gb`` of anonymous memory
(huge pages asked for, as the pipeline's buffers are), touches one byte a page, and reports the system CPU seconds
and the rate; then touches the same pages again (no fault: the floor of the touch itself).

    python benchmarks/fresh_pages.py [--gb 1] [--runs 3] [--pause 0]

Each run is a process of its own (a fresh process's pages are what a pack gets); ``--pause`` seconds between runs let
the kernel hand freed memory back first (a VM's free page reporting). One line of JSON per run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

CHILD = """
import mmap, os, sys, time, json
import numpy as np
n = int(float(sys.argv[1]) * (1 << 30))
m = mmap.mmap(-1, n)
m.madvise(mmap.MADV_HUGEPAGE)
a = np.frombuffer(m, np.uint8)
r0, t0 = os.times(), time.perf_counter()
a[::4096] = 1
r1, t1 = os.times(), time.perf_counter()
a[::4096] = 2
t2 = time.perf_counter()
print(json.dumps({"gb": n / 1e9, "first_touch_s": round(t1 - t0, 3), "sys_s": round(r1.system - r0.system, 3),
                  "gb_per_s": round(n / 1e9 / (t1 - t0), 2), "second_touch_s": round(t2 - t1, 4)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pause", type=float, default=0.0)
    a = ap.parse_args()
    for _ in range(a.runs):
        time.sleep(a.pause)
        r = subprocess.run([sys.executable, "-c", CHILD, str(a.gb)], capture_output=True, text=True, check=True)
        print(r.stdout.strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
