"""A command's resident memory over time: its RSS read from /proc every second until it exits (issue 43: whether a
pack's memory is flat over its run, not only its peak, which ``/usr/bin/time -f %M`` gives).

    python benchmarks/rss_sample.py OUT.csv -- COMMAND...

Writes ``seconds,rss_bytes`` a line to OUT.csv and prints the exit status, the samples and the sampled peak.
"""

from __future__ import annotations

import subprocess
import sys
import time


def rss(pid: int, field: str = "VmRSS") -> int | None:
    """``field`` of /proc/PID/status in bytes (``RssAnon``: the anonymous part, what a process cannot hand back to
    the page cache); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__)
    out, cmd = sys.argv[1], sys.argv[3:]
    child = subprocess.Popen(cmd)
    t0, rows = time.monotonic(), []
    while child.poll() is None:
        if (r := rss(child.pid)) is not None:
            rows.append((round(time.monotonic() - t0, 1), r))
        time.sleep(1)
    with open(out, "w") as f:
        f.writelines(f"{t},{r}\n" for t, r in rows)
    peak = max((r for _, r in rows), default=0)
    print(f"exit {child.returncode}, {len(rows)} samples, sampled peak {peak / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
