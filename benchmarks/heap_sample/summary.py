"""Sums up a ``heap_sample`` CSV (see sitecustomize.py here): the peaks, the largest samples' parts, and per 100 s
the peaks of RssAnon, glibc's heaps and their free bytes, and the file hashes' holds.

    python benchmarks/heap_sample/summary.py PREFIX.PID [--until S]"""

import argparse
import csv

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--until", type=float, default=float("inf"), help="only the samples before S seconds")
a = ap.parse_args()
with open(a.csv) as f:
    rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
rows = [r for r in rows if 20 < r["t"] < a.until]  # (the first 20 s: the plan, in its own process)
top = max(rows, key=lambda r: r["rss_anon"])
print(f"{len(rows)} samples to {rows[-1]['t']:.0f} s; RssAnon peak {top['rss_anon']:.0f} MiB at {top['t']:.0f} s "
      f"(+ RssFile {top['rss_file']:.0f}); peaks: pooled {max(r['pooled'] for r in rows):.0f}, held "
      f"{max(r['held'] for r in rows):.0f}, heaps {max(r['arena'] for r in rows):.0f} of which free "
      f"{max(r['fordblks'] for r in rows):.0f}")
print("| from s | RssAnon peak MiB | heaps (arena) peak | of which free (fordblks) | held by file hashes |")
print("|---|---|---|---|---|")
for start in range(0, int(rows[-1]["t"]) + 1, 100):
    seg = [r for r in rows if start <= r["t"] < start + 100]
    if seg:
        print(f"| {start} | {max(r['rss_anon'] for r in seg):.0f} | {max(r['arena'] for r in seg):.0f} | "
              f"{max(r['fordblks'] for r in seg):.0f} | {max(r['held'] for r in seg):.0f} |")
