"""Whether the disk reads and writes at once faster than in turn, as the pack does them (issue 38, session 36): the
input's files read past the page cache (``O_DIRECT``) in ranges of ``--chunk`` bytes, ``--depth`` at once, and 1.2 GB
written past it in 8 MB writes two deep (``write.DirectStage``); each alone, then both together.

    python benchmarks/direct_read_write.py IN/*.safetensors [--write-gb 1.2]

One line per (chunk, depth): the seconds of each alone, their sum, and of both together (the disk floor of
``pack_throughput.py`` is the sum: right where together takes about as long).
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

WRITE = 8 << 20


def evict(files: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def touched(n: int) -> mmap.mmap:
    m = mmap.mmap(-1, n)
    for i in range(0, n, 4096):
        m[i] = 1
    return m


def read_all(files: list[str], chunk: int, depth: int, buf: memoryview) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(depth) as ex:
        for f in files:
            fd, n = os.open(f, os.O_RDONLY | os.O_DIRECT), os.path.getsize(f)
            offs = list(range(0, n, chunk))

            def one(i: int, fd: int = fd, n: int = n, offs: list[int] = offs) -> int:
                k = -(-min(chunk, n - offs[i]) // 4096) * 4096
                slot = (i % depth) * chunk
                return os.preadv(fd, [buf[slot : slot + k]], offs[i])

            list(ex.map(one, range(len(offs))))
            os.close(fd)
    return time.perf_counter() - t


def write_all(path: str, nbytes: int, bufs: list[mmap.mmap]) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    t, off, prev = time.perf_counter(), 0, None
    with ThreadPoolExecutor(1) as ex:
        while off < nbytes:
            fut = ex.submit(os.pwrite, fd, bufs[(off // WRITE) % 2], off)
            off += WRITE
            if prev is not None:
                prev.result()
            prev = fut
        if prev is not None:
            prev.result()
    os.fsync(fd)
    os.close(fd)
    os.unlink(path)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--write-gb", type=float, default=1.2)
    ap.add_argument("--out", default="direct_read_write.bin", help="the file written (on the disk measured)")
    a = ap.parse_args()
    nbytes = int(a.write_gb * 1e9) // WRITE * WRITE
    rbuf, wbufs = memoryview(touched(256 << 20)), [touched(WRITE) for _ in range(2)]
    for chunk, depth in ((16 << 20, 1), (64 << 20, 1), (16 << 20, 2), (16 << 20, 4)):
        evict(a.files)
        r = read_all(a.files, chunk, depth, rbuf)
        w = write_all(a.out, nbytes, wbufs)
        evict(a.files)
        th = threading.Thread(target=write_all, args=(a.out, nbytes, wbufs))
        t = time.perf_counter()
        th.start()
        read_all(a.files, chunk, depth, rbuf)
        th.join()
        both = time.perf_counter() - t
        gb = sum(os.path.getsize(f) for f in a.files) / 1e9
        print(f"read {chunk >> 20} MB x{depth}: alone {r:.2f} s ({gb / r:.2f} GB/s); write alone {w:.2f} s "
              f"({nbytes / 1e9 / w:.2f} GB/s); in turn {r + w:.2f} s; together {both:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
