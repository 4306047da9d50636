"""pack against the disk floor on the same disk: time to read the input once and write a file of the
output's size, then `kimi-convert pack` end to end (wall time and peak RSS of the process).

    python benchmarks/pack_throughput.py --preset bench-kimi-linear [--layers 2] [--device cpu|cuda]
                                         [--workdir DIR] [--drop-caches]

--drop-caches (root only) empties the page cache before each timed step, so reads come from the disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 16 << 20


def drop_caches(enabled: bool) -> str:
    if not enabled:
        return "warm page cache"
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "page cache dropped"
    except OSError as e:
        return f"page cache NOT dropped ({e.strerror})"


def disk_floor(src: Path, out_bytes: int, scratch: Path) -> tuple[float, float]:
    t = time.perf_counter()
    for p in sorted(src.iterdir()):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.read(CHUNK):
                    pass
    read_s = time.perf_counter() - t
    block = b"\0" * CHUNK
    t = time.perf_counter()
    with open(scratch, "wb", buffering=0) as f:
        left = out_bytes
        while left > 0:
            left -= f.write(block[: min(CHUNK, left)])
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    scratch.unlink()
    return read_s, write_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench-kimi-linear")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", default="/tmp/kimi-convert-throughput")
    ap.add_argument("--drop-caches", action="store_true")
    a = ap.parse_args()
    work = Path(a.workdir)
    src, out = work / f"{a.preset}-L{a.layers or 'd'}", work / "out"
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        cmd = [sys.executable, "-m", "kimi_convert.cli", "synth", a.preset, str(src)]
        subprocess.run(cmd + (["--layers", str(a.layers)] if a.layers else []), check=True)
    size_in = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    # one untimed pack gives the output size (and warms the kernels' caches)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(out), "-q", "--device", a.device],
                   check=True, stdout=subprocess.DEVNULL)
    size_out = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    shutil.rmtree(out)
    cache = drop_caches(a.drop_caches)
    read_s, write_s = disk_floor(src, size_out, work / "floor.bin")
    drop_caches(a.drop_caches)
    t = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(out), "-q",
                              "--device", a.device], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    pack_s = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status):
        sys.exit("pack failed")
    floor = read_s + write_s
    print(f"{a.preset} (layers {a.layers or 'default'}), {size_in / 1e9:.2f} GB in, {size_out / 1e9:.2f} GB out, "
          f"device {a.device}, {cache}, {os.cpu_count()} CPUs")
    print("| disk read s | disk write s | disk floor s | pack s (wall, incl. start-up) | pack / floor | peak RSS |")
    print("|---|---|---|---|---|---|")
    print(f"| {read_s:.2f} | {write_s:.2f} | {floor:.2f} | {pack_s:.2f} | {pack_s / floor:.2f}x | "
          f"{usage.ru_maxrss * 1024 / 1e9:.2f} GB |")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
