"""The ways to read an input from this disk, and what each costs the CPU (issue 38, session 36): why the pack reads
past the page cache although the page cache fills faster here.

    python benchmarks/read_paths.py IN/*.safetensors [--repeat 2]

Each way starts with the files evicted from the page cache; GB/s over the files, and the system CPU seconds:
- ``direct CxD``: ``O_DIRECT`` reads of C MB, D at once (threads), into a buffer touched beforehand (the pack's way);
- ``mapped``: each file mapped, ``MADV_SEQUENTIAL``, ``MADV_POPULATE_READ`` 16 MB at a time (``pack_throughput``'s
  ``mapped_floor``);
- ``willneed+mapped``: the same after ``POSIX_FADV_WILLNEED`` on the whole file (the kernel's readahead for all of it);
- ``copy from cache``: the files already in the page cache, read (copied) into the buffer;
- ``stream``: ``WILLNEED`` 256 MB ahead, 16 MB reads (copies) into the buffer, ``DONTNEED`` behind.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from direct_read_write import evict, read_all  # the direct reads as the pack does them

MB = 1 << 20
POPULATE_READ = 22  # MADV_POPULATE_READ (Linux 5.14)


def mapped(files: list[str], willneed: bool) -> None:
    for f in files:
        fd, n = os.open(f, os.O_RDONLY), os.path.getsize(f)
        if willneed:
            os.posix_fadvise(fd, 0, n, os.POSIX_FADV_WILLNEED)
        with mmap.mmap(fd, n, access=mmap.ACCESS_READ) as m:
            m.madvise(mmap.MADV_SEQUENTIAL)
            for at in range(0, n, 16 * MB):
                m.madvise(POPULATE_READ, at, min(16 * MB, n - at))
        os.close(fd)


def copy(files: list[str], buf: memoryview, ahead: int | None) -> None:
    """Buffered reads into ``buf``; ``ahead``: WILLNEED that far ahead and DONTNEED behind (None: neither)."""
    for f in files:
        fd, n = os.open(f, os.O_RDONLY), os.path.getsize(f)
        off = asked = 0
        while off < n:
            while ahead is not None and asked < min(n, off + ahead):
                os.posix_fadvise(fd, asked, 32 * MB, os.POSIX_FADV_WILLNEED)
                asked += 32 * MB
            got = os.preadv(fd, [buf[: 16 * MB]], off)
            if ahead is not None:
                os.posix_fadvise(fd, off, got, os.POSIX_FADV_DONTNEED)
            off += got
        os.close(fd)


def timed(files: list[str], way: Callable[[], None], cached: bool = False) -> tuple[float, float]:
    evict(files)
    if cached:
        mapped(files, True)
    r0, t = os.times(), time.perf_counter()
    way()
    dt, r1 = time.perf_counter() - t, os.times()
    evict(files)
    return sum(map(os.path.getsize, files)) / 1e9 / dt, r1.system - r0.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    m = mmap.mmap(-1, 512 * MB)
    m.madvise(mmap.MADV_HUGEPAGE)
    for i in range(0, len(m), 4096):
        m[i] = 1
    buf, fs = memoryview(m), a.files
    ways = {"direct 16x1": lambda: read_all(fs, 16 * MB, 1, buf),
            "direct 16x16": lambda: read_all(fs, 16 * MB, 16, buf),
            "direct 4x32": lambda: read_all(fs, 4 * MB, 32, buf), "mapped": lambda: mapped(fs, False),
            "willneed+mapped": lambda: mapped(fs, True)}
    for _ in range(a.repeat):
        got = {k: timed(fs, w) for k, w in ways.items()}
        got["copy from cache"] = timed(fs, lambda: copy(fs, buf, None), cached=True)
        got["stream"] = timed(fs, lambda: copy(fs, buf, 256 * MB))
        print("; ".join(f"{k} {r:.2f} GB/s (sys {s:.2f} s)" for k, (r, s) in got.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
