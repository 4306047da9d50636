"""pack against the disk floor on the same disk (issue 6), in one run.

    python benchmarks/pack_throughput.py [--preset bench-kimi-linear] [--layers 4] [--device cpu|cuda]
        [--workers 1 2] [--quantize-alone] [--cold input|all|warm] [--workdir DIR] [--input DIR] [--mapping FILE]

``--input`` takes a checkpoint written elsewhere (a test-only preset's generator) instead of ``synth --preset``;
``--mapping`` is passed to every pack (a draft table for an architecture with none shipped).

1. disk floor: read every input file once, then write and fsync a file of the output's size (each the fastest of
   through the page cache and past it, O_DIRECT, as pack reads and writes, and a read also through a memory map's
   pages read in, ``mapped_floor``);
2. with --quantize-alone: the time the kernels alone take on the checkpoint's NVFP4 modules, their
   sources already in memory (no reading, hashing or writing); and the CPU floor: one core's BLAKE3 rate over the
   input and output bytes twice (each file's digest and each tensor's), plus that, spread over the CPUs (hashes are
   CPU work the disk cannot hide);
3. ``kimi-convert pack`` end to end (process start included), once per --workers value: wall time,
   the conversion's own time and torch's start-up (from ``pack --stats``), peak RSS (wait4) and
   the bytes the process read from storage (rusage inblock).

--cold input (the default) evicts the input files' pages before each timed step, so the input comes
from the disk while Python and torch stay cached; --cold all (or --drop-caches; root only) empties the
whole page cache; --cold warm leaves the input in the page cache (the disk is not the bound).
Results are printed as Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 16 << 20


COLD = "warm"  # set by --cold: "input" (evict the input's pages) or "all" (drop the whole page cache)
SRC: Path | None = None
#: every disk_floor measured in this run: (seconds by way of reading, seconds by way of writing)
WAYS: list[tuple[dict[str, float], dict[str, float]]] = []


def drop_caches(enabled: bool = True) -> str:
    """Make the next step read the input from the disk: evict the input files' pages (any user:
    torch and Python stay cached, as on a machine that converts often), or drop every page (root)."""
    if COLD == "warm" or not enabled:
        return "warm page cache"
    os.sync()
    if COLD == "input":
        for p in files(SRC):
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "input files evicted from the page cache before each step"
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "whole page cache dropped before each step (Python and torch too)"
    except OSError as e:
        return f"page cache NOT dropped ({e.strerror})"


def files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


def disk_floor_overlapped(src: Path, out_bytes: int, scratch: Path, drop: bool, readers: int = 4,
                          files_out: int = 4) -> dict:
    """The disk's bound when reading and writing overlap, as a pipeline can: the input read by ``readers``
    threads (pread, which drops the GIL), the output's bytes written into ``files_out`` files and fsync'd by as
    many threads, all at once; and each side alone with the same threads. disk_floor's sum assumes the two cannot
    overlap; whether they can is the disk's (and its driver's) to say."""
    import concurrent.futures as cf

    srcs = files(src)
    block = b"\0" * CHUNK

    def read_one(p: Path) -> None:
        fd = os.open(p, os.O_RDONLY)
        try:
            off = 0
            while n := len(os.pread(fd, CHUNK, off)):
                off += n
        finally:
            os.close(fd)

    def write_one(i: int) -> None:
        path = scratch.with_name(f"{scratch.name}.{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left, off = out_bytes // files_out + (i < out_bytes % files_out), 0
            while left > 0:
                n = os.pwrite(fd, block[: min(CHUNK, left)], off)
                left, off = left - n, off + n
            os.fsync(fd)
        finally:
            os.close(fd)
            path.unlink()

    def timed(read: bool, write: bool) -> float:
        drop_caches(drop)
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(readers) as rx, cf.ThreadPoolExecutor(files_out) as wx:
            jobs = ([wx.submit(write_one, i) for i in range(files_out)] if write else []) + \
                   ([rx.submit(read_one, p) for p in srcs] if read else [])
            for j in jobs:
                j.result()
        return time.perf_counter() - t

    return {"readers": readers, "writers": files_out, "read_s": timed(True, False), "write_s": timed(False, True),
            "both_s": timed(True, True)}


def disk_floor(src: Path, out_bytes: int, scratch: Path, drop: bool) -> tuple[float, float]:
    """Seconds to read every input file once, and to write and fsync the output's bytes, each the faster of through
    the page cache and past it (O_DIRECT, as pack reads and writes where the file system allows: the floor is the
    disk's best, not one way of reading or writing); a read also the fastest of those and a memory map's pages read in
    (``mapped_floor``)."""
    reads = {}
    for way in (False, True):
        drop_caches(drop)
        got = read_floor(src, direct=way)
        if got is not None:
            reads["direct" if way else "cached"] = got
    drop_caches(drop)
    if (got := mapped_floor(src)) is not None:
        reads["mapped"] = got
    print("disk floor reads (s): " + ", ".join(f"{k} {v:.2f}" for k, v in reads.items()), file=sys.stderr)
    read_s = min(reads.values())
    drop_caches(drop)
    writes = {"cached": write_floor(scratch, out_bytes, direct=False)}
    direct = write_floor(scratch, out_bytes, direct=True)
    if direct is not None:
        writes["direct"] = direct
    print("disk floor writes (s): " + ", ".join(f"{k} {v:.2f}" for k, v in writes.items()), file=sys.stderr)
    WAYS.append((reads, writes))
    return read_s, min(writes.values())


def floor_without_map(ways: tuple[dict[str, float], dict[str, float]]) -> float:
    """A disk floor measured by ``disk_floor`` as sessions 24-34 measured it: its read the faster of cached and
    direct (no memory map), for comparing with their figures."""
    reads, writes = ways
    return min(v for k, v in reads.items() if k != "mapped") + min(writes.values())


def read_floor(src: Path, direct: bool) -> float | None:
    """Seconds to read every input file once in CHUNK reads (``direct``: O_DIRECT into an aligned buffer, as pack
    reads where its streams read at once; None where the file system refuses it)."""
    import mmap

    buf = memoryview(mmap.mmap(-1, CHUNK))  # page-aligned
    t = time.perf_counter()
    for p in files(src):
        try:
            fd = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except OSError:
            return None
        try:
            at = 0
            while n := os.preadv(fd, [buf], at):
                at += n
        except OSError:
            return None
        finally:
            os.close(fd)
    return time.perf_counter() - t


def mapped_floor(src: Path) -> float | None:
    """Seconds to read every input file once into the page cache through a memory map of it, CHUNK at a time
    (``MADV_SEQUENTIAL``, then ``MADV_POPULATE_READ``: the kernel's readahead as large as it goes, no copy, no buffer
    of ours zeroed). On this VM's disk it read `bench-kimi-k25`'s 2.1 GB 1.2-2.7x as fast as the other two ways
    (benchmarks/RESULTS.md, issue 38's session 35 section). None where the kernel cannot (before Linux 5.14)."""
    import mmap

    t = time.perf_counter()
    for p in files(src):
        size = p.stat().st_size
        if not size:
            continue
        with open(p, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
            m.madvise(mmap.MADV_SEQUENTIAL)
            for at in range(0, size, CHUNK):
                try:
                    m.madvise(getattr(mmap, "MADV_POPULATE_READ", 22), at, min(CHUNK, size - at))
                except OSError:
                    return None
    took = time.perf_counter() - t
    _reset_peak_rss()
    return took


def _reset_peak_rss() -> None:
    """This process's peak resident set back to what it holds now (``/proc/self/clear_refs``): a pack started after
    ``mapped_floor`` otherwise reports the mapped files' pages as its own peak (exec keeps the parent's high-water mark
    where it is higher: 1.36 GB for `bench-kimi-k25`'s 1.0 GB pack)."""
    try:
        Path("/proc/self/clear_refs").write_text("5\n")
    except OSError as e:
        print(f"peak RSS not reset ({e.strerror}): the packs' peak RSS may count the mapped floor's pages",
              file=sys.stderr)


def write_floor(scratch: Path, out_bytes: int, direct: bool) -> float | None:
    """Seconds to write ``out_bytes`` in CHUNK writes and fsync them (``direct``: O_DIRECT from an aligned buffer, the
    last partial block through the page cache; None where the file system refuses it)."""
    import mmap

    buf = mmap.mmap(-1, CHUNK)  # page-aligned, zeros
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(scratch, flags | (os.O_DIRECT if direct else 0))
    except OSError:
        return None
    t = time.perf_counter()
    try:
        done, whole = 0, out_bytes // 4096 * 4096 if direct else out_bytes
        while done < whole:
            done += os.pwrite(fd, memoryview(buf)[: min(CHUNK, whole - done)], done)
        if done < out_bytes:
            tail = os.open(scratch, os.O_WRONLY)
            try:
                os.pwrite(tail, bytes(out_bytes - done), done)
            finally:
                os.close(tail)
        os.fsync(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
        scratch.unlink()
    return time.perf_counter() - t


def quantize_alone(src: Path, device: str, mapping: str | None = None, torch_only: bool = False) -> tuple[float, int]:
    """Seconds the compute stage takes on every NVFP4 unit, sources preloaded (one unit at a time): on the CPUs
    the units ``compute_early`` takes by its C kernels, as pack computes them (``torch_only``: every unit by the
    torch code, ``compute.compute_unit``), the others by the torch code."""
    import torch

    from kimi_convert import compute_early
    from kimi_convert.compute import compute_unit
    from kimi_convert.devices import get_backend
    from kimi_convert.pack import load_plan
    from kimi_convert.plan import Options, fp8_block_size
    from kimi_convert.readers import BufferPool, Loaded, PreadReader

    ckpt, plan = load_plan(src, Options(mapping=mapping))
    backend = get_backend(device)
    block = fp8_block_size(ckpt.config)
    reader = PreadReader(src)
    early = compute_early.EarlyCompute(len(os.sched_getaffinity(0)), block)
    pool = BufferPool(limit=1 << 30)
    total, nbytes = 0.0, 0
    for u in plan.units:
        if not any(it.kind == "nvfp4" for it in u.items):
            continue
        bufs = {p.name: reader.read(p) for p in u.parts}
        if backend.device.type == "cuda":  # from pinned memory, as pack does once the GPU is up
            bufs = {k: torch.from_numpy(b).pin_memory().numpy() for k, b in bufs.items()}
        loaded = Loaded(bufs)
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        if device == "cpu" and not torch_only and early.takes(u):
            _, buf = early.compute(u, loaded, pool)
            total += time.perf_counter() - t
            if buf is not None:
                pool.put(buf)
        else:
            compute_unit(u, loaded, backend, block)  # results come back to host memory, as pack needs them
            total += time.perf_counter() - t
        nbytes += u.nbytes_in
    reader.close()
    return total, nbytes


def hash_rate(digest, nbytes: int = 1 << 28, reps: int = 3) -> float:
    """One core's rate of ``digest`` (a constructor taking the bytes) on this machine, bytes/s, the best of ``reps``:
    pack hashes every input and output byte twice, its file's sha256 chain (the Hub's LFS id) and its tensor's
    BLAKE3 (the manifest's records), so the hashes are CPU work no disk speed hides."""
    buf = os.urandom(nbytes)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        digest(buf).digest()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def compile_bytecode() -> None:
    """Write the package's bytecode before anything is timed, as ``pip install`` does and as any run does unless
    ``PYTHONDONTWRITEBYTECODE`` is set (this project's development machine sets it): without it each pack compiles its
    modules again, about 0.1-0.2 s of a 2-core pack's start (benchmarks/RESULTS.md, issue 38's session 40 section)."""
    import kimi_convert
    import kimi_convert.kernels

    dirs = {*kimi_convert.__path__, *kimi_convert.kernels.__path__}
    subprocess.run([sys.executable, "-m", "compileall", "-q", *sorted(dirs)], check=True, stdout=subprocess.DEVNULL)


def run_pack(src: Path, out: Path, device: str, workers: int, drop: bool, max_shard: str,
             streams: int | None, extra: list[str]) -> tuple[float, int, int, dict, float, float]:
    shutil.rmtree(out, ignore_errors=True)
    stats = out.with_name("stats.json")
    drop_caches(drop)
    t = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(out), "-q",
                              "--device", device, "--workers", str(workers), "--stats", str(stats),
                              "--max-shard-size", max_shard] + (["--streams", str(streams)] if streams else []) + extra,
                             stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status):
        sys.exit("pack failed")
    # wait4 gives the pack process's usage together with its reaped children (the workers):
    # ru_maxrss is the largest single process, ru_inblock the sum of their reads from storage; user and system
    # CPU seconds (on two cores the figure to hold against the CPU floor).
    return (wall, usage.ru_maxrss * 1024, usage.ru_inblock * 512, json.loads(stats.read_text()),
            usage.ru_utime, usage.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench-kimi-linear")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--experts", type=int, help="routed experts a MoE layer (synth --experts; default: the preset's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, nargs="+", default=[1])
    ap.add_argument("--streams", type=int, help="pipelines per worker (default: pack's)")
    ap.add_argument("--quantize-alone", action="store_true")
    ap.add_argument("--torch-compute", action="store_true",
                    help="quantize alone: every unit by the torch code (default: the C kernels where pack uses them)")
    ap.add_argument("--max-shard-size", default="500MB",
                    help="output shard size (workers split the shards: several are needed to use several)")
    ap.add_argument("--workdir", default="/tmp/kimi-convert-throughput")
    ap.add_argument("--cold", choices=["warm", "input", "all"], default="input",
                    help="before each timed step: nothing, evict the input's pages, or drop the whole page cache")
    ap.add_argument("--drop-caches", action="store_true", help="the same as --cold all")
    ap.add_argument("--repeat", type=int, default=1, help="pack runs per --workers value (the median is shown)")
    ap.add_argument("--input", help="a checkpoint to pack instead of the synth preset's")
    ap.add_argument("--mapping", help="a mapping table passed to every pack")
    a = ap.parse_args()
    extra = ["--mapping", a.mapping] if a.mapping else []
    global COLD, SRC
    COLD = "all" if a.drop_caches else a.cold
    work = Path(a.workdir)
    src, out = work / f"{a.preset}-L{a.layers or 'd'}-E{a.experts or 'd'}", work / "out"
    if a.input:
        src, a.preset = Path(a.input), Path(a.input).name
    elif not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        cmd = [sys.executable, "-m", "kimi_convert.cli", "synth", a.preset, str(src)]
        cmd += ["--layers", str(a.layers)] if a.layers else []
        subprocess.run(cmd + (["--experts", str(a.experts)] if a.experts else []), check=True)
    SRC = src
    compile_bytecode()
    size_in = sum(p.stat().st_size for p in files(src))
    # one untimed pack gives the output size and warms the kernels' caches (C build, Triton JIT)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(out), "-q", "--device",
                    a.device, "--workers", "1",
                    "--max-shard-size", a.max_shard_size, *extra], check=True, stdout=subprocess.DEVNULL)
    size_out = sum(p.stat().st_size for p in files(out))
    shutil.rmtree(out)
    cache = drop_caches()
    read_s, write_s = disk_floor(src, size_out, work / "floor.bin", True)
    floor = read_s + write_s
    print(f"{a.preset} (layers {a.layers or 'default'}, experts {a.experts or 'default'}), {size_in / 1e9:.2f} GB in, "
          f"{size_out / 1e9:.2f} GB out, "
          f"device {a.device}, {cache}, {len(os.sched_getaffinity(0))} CPUs")
    print(f"\ndisk floor: read {read_s:.2f} s ({size_in / read_s / 1e9:.2f} GB/s) + write {write_s:.2f} s "
          f"({size_out / write_s / 1e9:.2f} GB/s) = **{floor:.2f} s**")
    bound, what = floor, "disk floor"
    if a.quantize_alone:
        q, qbytes = quantize_alone(src, a.device, a.mapping, a.torch_compute)
        print(f"quantize alone ({a.device}): {q:.2f} s for {qbytes / 1e9:.2f} GB of NVFP4 sources "
              f"({qbytes / q / 1e9:.2f} GB/s)")
        bound, what = floor + q, "disk floor + quantize alone"
        import blake3

        cpus, rate3 = len(os.sched_getaffinity(0)), hash_rate(blake3.blake3)
        hash_s = (size_in + size_out) / rate3  # each file's digest (FILE_DIGEST) and each tensor's: BLAKE3 both
        cpu_floor = (2 * hash_s + q) / cpus
        print(f"CPU floor: BLAKE3 of the input and output files {hash_s:.2f} s and of their tensors {hash_s:.2f} s "
              f"({rate3 / 1e9:.2f} GB/s a core) + quantize alone {q:.2f} s, over {cpus} CPUs = **{cpu_floor:.2f} s** "
              f"(pack / disk floor cannot go below {max(floor, cpu_floor) / floor:.2f}x here)")
    print(f"\n| workers x streams | pack s, median (all runs) | pack / ({what} = {bound:.2f} s) | converting s "
          "| torch + device start s (overlapped) | CPU s (user + sys) "
          "| peak RSS (largest process) | read from storage |")
    print("|---|---|---|---|---|---|---|---|")
    stages, floors, walls = [], [floor], []
    for w in a.workers:
        runs = []
        for _ in range(a.repeat):  # the disk's floor measured again after each pack: a shared disk's rate drifts
            runs.append(run_pack(src, out, a.device, w, True, a.max_shard_size, a.streams, extra))
            floors.append(sum(disk_floor(src, size_out, work / "floor.bin", True)))
        walls += [r[0] for r in runs]
        runs.sort(key=lambda r: r[0])
        wall, rss, read, st, user, sys_s = runs[len(runs) // 2]
        every = ", ".join(f"{r[0]:.2f}" for r in runs)
        print(f"| {st['workers']} x {st['streams'] // st['workers']} | {wall:.2f} ({every}) | {wall / bound:.2f}x | "
              f"{st['convert_s']:.2f} | {st['backend_s']:.2f} | {user:.2f} + {sys_s:.2f} | {rss / 1e9:.2f} GB "
              f"| {read / 1e9:.2f} GB |", flush=True)
        stages.append((w, st["stages_s"]))
    med, old = statistics.median(floors), statistics.median(floor_without_map(w) for w in WAYS[-len(floors):])
    print(f"\ndisk floor, median of {len(floors)} measured before and between the packs: **{med:.2f} s** (each: "
          + ", ".join(f"{f:.2f}" for f in floors) + f"); pack median / that: **{statistics.median(walls) / med:.2f}x** "
          f"(against the floor read without the memory map, sessions 24-34's: {old:.2f} s, "
          f"{statistics.median(walls) / old:.2f}x)")
    for w, st in stages:  # where the median run's streams spent their time (summed over streams)
        print(f"\nworkers {w}, seconds per stage summed over streams: "
              + ", ".join(f"{k} {v:.2f}" for k, v in st.items()))
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
