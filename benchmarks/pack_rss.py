"""Peak resident memory of `kimi-convert pack` as the checkpoint grows (issue 6: flat within 20% over
4x, under 2 GB while the largest fused tensor is under 256 MB).

    python benchmarks/pack_rss.py [--preset bench-kimi-linear] [--layers 2 4 8] [--device cpu|cuda]
                                  [--workers 1] [--workdir DIR]

Writes each checkpoint once (reused later), packs it in a child process and reports the child's peak
RSS (wait4; with --workers > 1, the largest process) next to the largest fused tensor of the plan.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def largest_fused(src: Path) -> tuple[str, int]:
    """The largest unit of the plan (a fused module, or an expert's w1/w3) by input bytes."""
    from kimi_convert.pack import load_plan
    from kimi_convert.plan import Options

    _, plan = load_plan(src, Options())
    u = max(plan.units, key=lambda u: u.nbytes_in)
    return (u.shared_scale or u.items[0].name), u.nbytes_in


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench-kimi-linear")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--max-shard-size", default="500MB",
                    help="output shard size (workers split the shards: several are needed to use several)")
    ap.add_argument("--workdir", default="/tmp/kimi-convert-bench")
    a = ap.parse_args()
    work = Path(a.workdir)
    rows, fit = [], []
    print(f"{a.preset}, device {a.device}, workers {a.workers}, {len(os.sched_getaffinity(0))} CPUs\n")
    print("| layers | input | output | wall s | peak RSS | RSS / input | largest unit (input bytes) |")
    print("|---|---|---|---|---|---|---|")
    for layers in a.layers:
        src, out = work / f"{a.preset}-L{layers}", work / f"{a.preset}-L{layers}-out"
        if not (src / "config.json").exists():
            shutil.rmtree(src, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "kimi_convert.cli", "synth", a.preset, str(src), "--layers",
                            str(layers)], check=True, stdout=subprocess.DEVNULL)
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(out), "-q",
                                  "--device", a.device, "--workers", str(a.workers),
                                  "--max-shard-size", a.max_shard_size], stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(child.pid, 0)  # this child and its workers, not the synth
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status):
            sys.exit(f"pack failed with exit code {os.waitstatus_to_exitcode(status)}")
        rss = usage.ru_maxrss * 1024  # Linux: KiB
        size_in, size_out = folder_bytes(src), folder_bytes(out)
        name, big = largest_fused(src)
        rows.append(rss)
        fit.append((size_in / 1e9, wall))
        print(f"| {layers} | {size_in / 1e9:.2f} GB | {size_out / 1e9:.2f} GB | {wall:.1f} | {rss / 1e9:.2f} GB | "
              f"{rss / size_in:.2f} | {big / 1e6:.0f} MB ({name}) |", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    print(f"\npeak RSS, largest / smallest: {max(rows) / min(rows):.2f}")
    if len(fit) > 1:  # wall = a + b * GB: a is what does not grow with the input (start-up, finish)
        a, b = linear_fit(fit)
        print(f"wall s = {a:.2f} + {b:.3f} * input GB (least squares): fixed {a:.2f} s, marginal {1 / b:.2f} GB/s")


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


if __name__ == "__main__":
    main()
