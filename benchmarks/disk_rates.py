"""The disk's read rate from a cold page cache as the pipeline's reader reads: consecutive ranges of
``--piece`` bytes, each split into T concurrent ``preadv``s (``readers.PreadReader`` with ``READ_THREADS`` = T),
for each T asked; then the same with a writer beside it (the pack writes its output on the same disk while it
reads: ``--write`` bytes written and started back with ``sync_file_range``, as ``write.ShardWriter`` does).

    python benchmarks/disk_rates.py --input DIR [--threads 1 2 4 8] [--piece 64MB] [--write 3GB] [--json FILE]

One line of JSON per measurement: threads, with or without the writer, GB/s read (and written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_speed import evict  # noqa: E402

from kimi_convert.clioptions import SIZE  # noqa: E402 - the CLI's sizes (64MB, 2GiB, ...)


def _read_part(fd: int, pos: int, view: memoryview) -> None:
    while view:
        n = os.preadv(fd, [view], pos)
        if n == 0:
            return
        view, pos = view[n:], pos + n


def cold_read(files: list[Path], threads: int, piece: int) -> float:
    """GB/s of one pass over ``files`` in ``piece``-byte ranges, each read as ``threads`` concurrent parts."""
    evict(files[0].parent)
    buf = memoryview(bytearray(piece))
    n, t = 0, time.perf_counter()
    with ThreadPoolExecutor(max(1, threads - 1)) as pool:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            size = os.fstat(fd).st_size
            for pos in range(0, size, piece):
                m = min(piece, size - pos)
                step = -(-m // threads)
                futs = [pool.submit(_read_part, fd, pos + a, buf[a : min(m, a + step)]) for a in range(step, m, step)]
                _read_part(fd, pos, buf[:step])
                for f in futs:
                    f.result()
                n += m
            os.close(fd)
    return n / 1e9 / (time.perf_counter() - t)


def writer(path: Path, nbytes: int, stop: threading.Event, done: list[float]) -> None:
    """Write ``nbytes`` (or until ``stop``) in 16 MB writes, each 64 MB started back to the disk."""
    import ctypes

    sfr = ctypes.CDLL(None, use_errno=True).sync_file_range
    block = os.urandom(16 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t, n, flushed = time.perf_counter(), 0, 0
    while n < nbytes and not stop.is_set():
        n += os.write(fd, block)
        if n - flushed >= 64 << 20:
            sfr(fd, ctypes.c_longlong(flushed), ctypes.c_longlong(n - flushed), 2)  # SYNC_FILE_RANGE_WRITE
            flushed = n
    os.fsync(fd)
    os.close(fd)
    done.append(n / 1e9 / (time.perf_counter() - t))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", type=Path, required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--piece", default="64MB")
    ap.add_argument("--write", default="3GB")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    files = sorted(a.input.glob("*.safetensors"))
    piece, wbytes = SIZE.convert(a.piece, None, None), SIZE.convert(a.write, None, None)
    rows = []
    for with_writer in (False, True):
        for threads in a.threads:
            row = {"threads": threads, "piece": piece, "writer": with_writer}
            if with_writer:
                with tempfile.TemporaryDirectory(dir=a.input.parent) as work:
                    stop, done = threading.Event(), []
                    w = threading.Thread(target=writer, args=(Path(work) / "out", wbytes, stop, done))
                    w.start()
                    row["read_gbps"] = round(cold_read(files, threads, piece), 3)
                    stop.set()
                    w.join()
                    row["write_gbps"] = round(done[0], 3)
            else:
                row["read_gbps"] = round(cold_read(files, threads, piece), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
