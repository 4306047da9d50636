"""Peak resident memory and wall time of `kimi-convert pack` on a synthetic checkpoint.

    python benchmarks/pack_rss.py --preset bench-kimi-linear --layers 2 [--device cpu] [--workdir DIR]

Writes the checkpoint once (reused on later runs), packs it in a child process and reports the
child's peak RSS (wait4: includes the memory-mapped input pages it held) as a Markdown row.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench-kimi-linear")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", default="/tmp/kimi-convert-bench")
    ap.add_argument("--keep", action="store_true", help="keep the output folder")
    a = ap.parse_args()
    work = Path(a.workdir)
    tag = f"{a.preset}-L{a.layers or 'd'}-E{a.experts or 'd'}"
    src, out = work / tag, work / f"{tag}-out"
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        cmd = [sys.executable, "-m", "kimi_convert.cli", "synth", a.preset, str(src)]
        for flag, value in (("--layers", a.layers), ("--experts", a.experts)):
            cmd += [flag, str(value)] if value else []
        subprocess.run(cmd, check=True)
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(out),
                              "--device", a.device, "-q"])
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage (not the synth's)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if child.returncode:
        sys.exit(f"pack failed with exit code {child.returncode}")
    rss = usage.ru_maxrss * 1024  # Linux: KiB
    size_in, size_out = folder_bytes(src), folder_bytes(out)
    print("| preset | input | output | device | wall s | input GB/s | peak RSS | RSS / input |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {tag} | {size_in / 1e9:.2f} GB | {size_out / 1e9:.2f} GB | {a.device} | {wall:.1f} | "
          f"{size_in / wall / 1e9:.3f} | {rss / 1e9:.2f} GB | {rss / size_in:.2f} |")
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
