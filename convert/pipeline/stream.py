"""The stream: one run of consecutive shards through a reader, a compute, a writer and a finisher
thread, overlapped; ``run_jobs`` runs a worker's streams (the package docstring says how)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import faults, write
from ..hashing import FileHasher, SerialHasher, Stopped
from ..journal import ShardRecord
from ..manifest import write_records
from ..plan import Shard, Unit
from ..readers import Loaded, PreadReader
from .budgets import Shared, default_hash_threads, pc_cost, return_freed_memory
from .slicing import Piece, PieceKind, deal, pieces

if TYPE_CHECKING:
    import numpy as np

    from ..compute import Chunk
    from ..devices import Device
    from ..sources import Source
    from .runner import Runner

READ_AHEAD = 3  # pieces read ahead of the compute, within the in-flight budget
WRITE_DEPTH = 2  # computed pieces waiting for the writer
#: Bytes at the start of each stream whose file hashes do not wait for the pipeline (see Stream).
EAGER_HASH = 1 << 30


@dataclass
class Job:
    """What one stream converts: consecutive shards of the plan, and the input files it hashes."""

    source: Source  # the input (pickled to worker processes and Ray tasks: a source holds nothing open)
    output_dir: Path
    shards: list[Shard]
    units: list[Unit]  # the units of those shards, in plan order
    file_order: dict[str, int]
    hash_files: dict[str, int]  # input file -> size: the files whose sha256 this stream computes
    block: tuple[int, int]
    #: (k, n): this stream computes the units ``slicing.deal`` gives stream k of n, which share these shards
    #: (``pack.split_jobs``: an input of fewer shards than streams); (0, 1): every unit of its shards.
    share: tuple[int, int] = (0, 1)

    def own_units(self) -> list[Unit]:
        k, n = self.share
        return self.units if n == 1 else [u for u, i in zip(self.units, deal(self.units, n), strict=True) if i == k]


@dataclass
class JobResult:
    input_hashes: dict[str, str]
    from_pipeline: int  # input bytes the file hashes took from the pipeline's reads
    reread: int  # input bytes read a second time for them
    backend_s: float = 0.0  # its worker's time to load torch and start the device, overlapped with reading
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage (threads of one stream)
    in_flight_peak: int = 0  # its worker's most bytes in flight at once
    in_flight_limit: int = 0  # its worker's budget
    device: str = ""  # what its worker computed on: cpu, cuda, auto (then ``choices``), ...
    choices: list[dict] = field(default_factory=list)  # auto: its worker's decision per kind of work
    pinned_bytes: int = 0  # its worker's read buffers page-locked for the GPU
    pin_s: float = 0.0  # and the seconds that took
    calibration: dict = field(default_factory=dict)  # auto: its worker's calibration thread (Runner.calibration)
    wall_s: float = 0.0  # the stream's own seconds, start to end (the slowest one is the worker's wall)
    hash_wait_s: float = 0.0  # its worker's seconds, after its streams ended, waiting for the input file hashes


@dataclass
class _ShardState:
    writer: write.ShardWriter
    file_hash: FileHasher
    tensors: dict[str, Future] = field(default_factory=dict)
    sources: dict[str, Future] = field(default_factory=dict)
    notes: dict[str, dict] = field(default_factory=dict)


def disjoint(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges that overlap no other (each once). A file hash takes every byte once, in file order,
    from the pipeline's reads where it can: reads that overlap (gpt-oss: a bank's scales read whole for its
    ``k_max`` beside each expert's own rows of them) are left to the hash, which reads those bytes itself."""
    rs = sorted(set(ranges))
    overlapping: set[int] = set()
    reach, reacher = -1, -1  # the furthest end so far, and whose
    for i, (a, b) in enumerate(rs):
        if a < reach and b > a:
            overlapping.update((i, reacher))
        if b > reach:
            reach, reacher = b, i
    return [r for i, r in enumerate(rs) if i not in overlapping]


def _write_ranges(mine: list[Piece], shards: dict[str, Shard]) -> dict[str, list[tuple[int, int]]]:
    """Per shard, the byte ranges the writer hands to the shard's file hash: the header, each
    computed tensor whole, each pass-through slice."""
    out = {f: [(0, len(s.header))] for f, s in shards.items()}
    for pc in mine:
        placed = {p.tensor.name: p for p in shards[pc.unit.shard].placed}
        if pc.kind is PieceKind.COPY:
            start = placed[pc.unit.items[0].outputs[0].name].start + pc.copy_at
            out[pc.unit.shard].append((start, start + pc.nbytes))
        else:
            out[pc.unit.shard] += [(placed[t.name].start, placed[t.name].end) for it in pc.unit.items
                                   for t in it.outputs]
    return out


class ShardTable:
    """A worker's output shards, shared by its streams. A shard is one stream's unless ``pack.split_jobs``
    dealt its units over several (an input of fewer shards than streams): then the first to reach it opens
    it, each writes its own units into it, every range written feeds its one file hash, and the stream that
    stores its last unit finishes it. Thread-safe."""

    def __init__(self, jobs: list[Job], mine: list[list[Piece]]):
        self.shard_of = {s.file: s for j in jobs for s in j.shards}
        self.units_of: dict[str, list[Unit]] = {}  # every unit of each shard, in plan order
        for j in jobs:
            theirs: dict[str, list[Unit]] = {s.file: [] for s in j.shards if s.file not in self.units_of}
            for u in j.units:
                if u.shard in theirs:
                    theirs[u.shard].append(u)
            self.units_of.update(theirs)
        self.written = _write_ranges([pc for ps in mine for pc in ps], self.shard_of)
        self._left = {f: len(us) for f, us in self.units_of.items()}
        self._opened: dict[str, Future] = {}
        self._lock = threading.Lock()

    def open(self, file: str, make: Callable[[Shard, list[tuple[int, int]]], _ShardState]) -> _ShardState:
        """The shard's state, made by ``make`` (which may wait: ``Shared.admit``) by the first stream to ask;
        the others wait for it."""
        with self._lock:
            fut = self._opened.get(file)
            first = fut is None
            if first:
                fut = self._opened[file] = Future()
        if not first:
            return fut.result()
        try:
            st = make(self.shard_of[file], self.written[file])
        except BaseException as e:
            fut.set_exception(e)
            raise
        fut.set_result(st)
        return st

    def unit_stored(self, file: str) -> bool:
        """One more of the shard's units written and hashed; True for the last one (its stream finishes it)."""
        with self._lock:
            self._left[file] -= 1
            return self._left[file] == 0

    def abort(self) -> None:
        """Close every shard still open (a failed or stopped pack leaves their ``.partial`` files)."""
        with self._lock:
            opened = list(self._opened.values())
        for fut in opened:
            if fut.done() and fut.exception() is None:
                fut.result().writer.abort()


def input_hashes(jobs: list[Job], mine: list[list[Piece]], shared: Shared) -> dict[str, FileHasher]:
    """The file hashes of a worker's jobs' ``hash_files``, each fed by every stream that reads the file (its
    other bytes the hash reads itself). The first ``EAGER_HASH`` bytes of each stream's reads (shared out
    when the streams share their shards) are left to the hashes themselves, at once: a file's sha256 is a
    sequential chain, and this starts it while torch loads, from the page cache the start-up readahead fills
    (one disk read either way)."""
    sizes = {f: n for j in jobs for f, n in j.hash_files.items()}
    expected: dict[str, list[tuple[int, int]]] = {f: [] for f in sizes}
    for j, ps in zip(jobs, mine, strict=True):
        eager = EAGER_HASH // j.share[1]
        for pc in ps:
            for r in pc.reads:
                if eager > 0:
                    eager -= r.hi - r.lo
                elif r.part.file in expected:
                    expected[r.part.file].append(r.file_range)
    source = {f: j.source for j in jobs for f in j.hash_files}
    return {f: FileHasher(f, size, disjoint(expected[f]), shared.hash_pool, shared.hold, shared.stop,
                          source=source[f]) for f, size in sizes.items()}


class Stream:
    def __init__(self, job: Job, mine: list[Piece], shared: Shared, device: Device,
                 on_shard: Callable[[str, ShardRecord], None], on_progress: Callable[[int], None],
                 files: dict[str, FileHasher], table: ShardTable):
        """``files``: the worker's input file hashes (``input_hashes``), fed from this stream's reads;
        ``table``: the worker's output shards."""
        self.job, self.pieces, self.shared, self.device = job, mine, shared, device
        self.on_shard, self.on_progress, self.stop = on_shard, on_progress, shared.stop
        self.hash_pool = shared.hash_pool
        self.reader = PreadReader(job.source)
        self.next_compute = 0  # the piece the compute thread needs next
        self.files, self.table = files, table
        self.source_hashers: dict[str, SerialHasher] = {}
        self.open: dict[str, _ShardState] = {}  # the shards this stream is writing its units into
        self._mine_left: dict[str, int] = defaultdict(int)  # this stream's units still to store, per shard
        for pc in mine:
            self._mine_left[pc.unit.shard] += pc.last
        self.out_hashers: dict[str, SerialHasher] = {}
        self.runner: Runner | None = None
        self.seconds: dict[str, float] = defaultdict(float)  # time each stage spent, for --stats

    def _clock(self, key: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[key] += now - since
        return now

    # -- read stage (reader thread) ---------------------------------------------------------------
    def load(self, i: int) -> tuple[Loaded, list[Future], dict[str, Future], np.ndarray | None]:
        """Read piece ``i`` into one pooled buffer, start the hashes of its bytes, and ask the kernel
        to start reading piece ``i + 1``. Returns the buffer too, unless a file hash holds it."""
        pc = self.pieces[i]
        t = time.perf_counter()
        self.shared.in_flight.take(pc_cost(pc), urgent=lambda: self.next_compute >= i)
        t = self._clock("read: wait for the memory budget", t)
        if self.stop.is_set():
            raise Stopped("pack")
        if i + 1 < len(self.pieces):
            for r in self.pieces[i + 1].reads:
                self.reader.will_need(r.part, r.lo, r.hi)
        base = self.shared.buffers.get(pc.nbytes)
        bufs, feeds, digests, held, off = {}, [], {}, False, 0
        for r in pc.reads:
            buf = self.reader.read(r.part, r.lo, r.hi, into=base[off : off + r.hi - r.lo])
            off += r.hi - r.lo
            bufs[f"{r.part.name}@{r.lo}" if pc.kind is PieceKind.COPY else r.part.name] = buf
            h = self.source_hashers.setdefault(r.part.name, SerialHasher(self.hash_pool))
            feeds.append(h.feed(buf))
            if r.hi == r.part.nbytes:
                digests[r.part.name] = h.hexdigest()
                del self.source_hashers[r.part.name]
            if (fh := self.files.get(r.part.file)) is not None:
                fut, kept = fh.offer(r.part.start + r.lo, [buf])
                feeds += [fut] if fut is not None else []
                held = held or kept
        self._clock("read: pread and start hashing", t)
        if held:  # a file hash keeps a view of it: never reused, only counted out
            self.shared.buffers.put(base, reuse=False)
        return Loaded(bufs), feeds, digests, None if held else base

    # -- compute stage (the stream's own thread) --------------------------------------------------
    def compute(self, pc: Piece, loaded: Loaded) -> tuple[dict[str, list[Chunk]], dict[str, dict],
                                                          Callable[[bool], None]]:
        """The piece's outputs, notes, and what to call once they are written (gives the buffer lent for the
        unit's outputs back to the pool; False: not for reuse, the file hash holds some of its bytes)."""
        if pc.kind is PieceKind.COPY:
            name = pc.unit.items[0].outputs[0].name
            return {name: list(loaded.buffers.values())}, {}, _nothing
        t = time.perf_counter()
        if self.runner is None:
            self.runner = self.shared.runner(self.device, self.job.block)
            t = self._clock("compute: wait for torch and the device", t)
        done = self.runner.compute(pc.unit, loaded)
        self._clock("compute: kernels and copies", t)
        res, runner = done[0], self.runner
        return {n: o.chunks for n, o in res.outputs.items()}, res.notes, lambda reuse: runner.release(done, reuse)

    # -- write stage (writer thread) --------------------------------------------------------------
    def store(self, pc: Piece, outputs: dict[str, list[Chunk]], notes: dict[str, dict],
              release: Callable[[bool], None], feeds: list[Future], digests: dict[str, Future], base: np.ndarray | None,
              finisher: ThreadPoolExecutor, finishing: list[Future]) -> None:
        held = True  # failed part-way: the file hash may hold any of the bytes
        try:
            held = self._store(pc, outputs, notes, feeds, digests, base, finisher, finishing)
        finally:
            release(not held)
            self.shared.in_flight.give(pc_cost(pc))

    def _store(self, pc: Piece, outputs: dict[str, list[Chunk]], notes: dict[str, dict], feeds: list[Future],
               digests: dict[str, Future], base: np.ndarray | None, finisher: ThreadPoolExecutor,
               finishing: list[Future]) -> bool:
        """Whether the shard's file hash kept some of the piece's chunks (to hash them in file order later)."""
        if self.stop.is_set():
            raise Stopped("pack")
        file = pc.unit.shard
        st = self.open.get(file)
        if st is None:
            st = self.open[file] = self.table.open(file, self._make_shard)
        st.sources.update(digests)
        st.notes.update(notes)
        single = pc.kind is PieceKind.COPY and len(pc.unit.parts) == 1
        held = False
        for name, chunks in sorted(outputs.items(), key=lambda kv: st.writer.placed[kv[0]].start):
            t = time.perf_counter()
            st.writer.write(name, chunks, pc.copy_at)
            self._clock("write: pwrite", t)
            fut, kept = st.file_hash.offer(st.writer.placed[name].start + pc.copy_at, chunks)
            feeds += [fut] if fut is not None else []
            held = held or kept
            if single:  # a one-tensor pass-through: its bytes are the source's, hashed once
                if pc.last:
                    st.tensors[name] = digests[pc.unit.parts[0].name]
                continue
            h = self.out_hashers.setdefault(name, SerialHasher(self.hash_pool))
            feeds += [h.feed(c) for c in chunks]
            if pc.last:
                st.tensors[name] = h.hexdigest()
                del self.out_hashers[name]
        t = time.perf_counter()
        for f in feeds:
            f.result()  # the buffers may go once hashed
        self._clock("write: wait for the hashes", t)
        if base is not None:
            self.shared.buffers.put(base, reuse=not (held and pc.kind is PieceKind.COPY))
        self.on_progress(pc.nbytes)
        if pc.last and self.table.unit_stored(file):
            finishing.append(finisher.submit(self.finish_shard, file, st))
        if pc.last and self._last_of_mine(pc):
            del self.open[file]
        return held

    def _make_shard(self, shard: Shard, written: list[tuple[int, int]]) -> _ShardState:
        """A shard opened: its file created (after ``Shared.admit``: ``wait`` when this stream has no other shard
        open, so waiting cannot hold one up), its header written and offered to its file hash."""
        if self.shared.admit is not None:
            self.shared.admit(not self.open, self.stop)
        w = write.ShardWriter(self.job.output_dir, shard)
        st = _ShardState(w, FileHasher(w.tmp, shard.size, written, self.hash_pool, self.shared.hold, self.stop))
        st.file_hash.offer(0, [shard.header])
        return st

    def _last_of_mine(self, pc: Piece) -> bool:
        """Whether ``pc`` ends this stream's last unit in its shard."""
        later = self._mine_left.get(pc.unit.shard, 0) - 1
        self._mine_left[pc.unit.shard] = later
        return later == 0

    def finish_shard(self, file: str, st: _ShardState) -> None:
        t = time.perf_counter()
        sha = st.file_hash.finish().result()  # before the rename: a re-read, if any, reads the .partial
        t = self._clock("finish: shard sha256", t)
        settle = getattr(self.job.source, "settle", None)  # a source read before its bytes are verified (a Hub
        if settle is not None:  # input's downloads): the shard is finished only from verified inputs
            settle(sorted({p.file for u in self.table.units_of[file] for p in u.parts}))
            t = self._clock("finish: wait for the inputs' verification", t)
        st.writer.finish()
        t = self._clock("finish: fsync and rename", t)
        faults.point("shard")
        records = write_records(self.job.output_dir, file, self.table.units_of[file],
                                {k: f.result() for k, f in st.tensors.items()},
                                {k: f.result() for k, f in st.sources.items()}, st.notes)
        self._clock("finish: manifest records", t)
        cast = [n for n in st.notes.values() if n.get("method") == "mxfp4-cast"]
        rec = ShardRecord(size=self.table.shard_of[file].size, sha256=sha, records_size=records.size,
                          records_sha256=records.sha256, modules=records.modules,
                          cast_blocks=sum(n["blocks"] for n in cast),
                          cast_lossless=sum(n["lossless_blocks"] for n in cast))
        self.on_shard(file, rec)

    def run(self) -> JobResult:
        start = time.perf_counter()
        reads = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-read")
        writes = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-write")
        finisher = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-finish")
        finishing: list[Future] = []
        loading: deque[Future] = deque()
        writing: deque[Future] = deque()
        try:
            for i in range(min(READ_AHEAD, len(self.pieces))):
                loading.append(reads.submit(self.load, i))
            for i, pc in enumerate(self.pieces):
                t = time.perf_counter()
                self.next_compute = i
                loaded, feeds, digests, base = loading.popleft().result()
                self._clock("compute: wait for the reader", t)
                if i + READ_AHEAD < len(self.pieces):
                    loading.append(reads.submit(self.load, i + READ_AHEAD))
                outputs, notes, release = self.compute(pc, loaded)
                del loaded
                writing.append(writes.submit(self.store, pc, outputs, notes, release, feeds, digests, base,
                                             finisher, finishing))
                del outputs, base, release
                t = time.perf_counter()
                while len(writing) > WRITE_DEPTH or (writing and writing[0].done()):
                    writing.popleft().result()
                self._clock("compute: wait for the writer", t)
                _raise_failed(finishing)
            while writing:
                writing.popleft().result()
            for f in list(finishing):
                f.result()
        except BaseException:
            self.stop.set()
            faults.release()
            for ex in (reads, writes, finisher):
                ex.shutdown(wait=True, cancel_futures=True)
            self.table.abort()
            self.reader.close()
            raise
        for ex in (reads, writes, finisher):
            ex.shutdown()
        self.reader.close()
        # the input hashes: filled in by run_jobs once every stream has fed them
        return JobResult({}, 0, 0, stages=dict(self.seconds), wall_s=round(time.perf_counter() - start, 3))


def _nothing(reuse: bool = True) -> None:
    pass


def _raise_failed(futs: list[Future]) -> None:
    for f in futs:
        if f.done() and f.exception() is not None:
            f.result()


def run_jobs(jobs: list[Job], device: Device, on_shard: Callable[[str, ShardRecord], None],
             on_progress: Callable[[int], None] = lambda n: None, *, threads: int,
             stop: threading.Event | None = None,
             admit: Callable[[bool, threading.Event], None] | None = None) -> list[JobResult]:
    """Convert each job's shards on its own stream (threads of this process), calling ``on_shard``
    as each shard is complete; the first failure stops every stream. ``threads``: the CPUs this
    worker may use (its C kernel's threads, and the bound on its hashing threads)."""
    stop = stop or threading.Event()
    return_freed_memory()
    mine = [pieces(j.own_units(), j.file_order) for j in jobs]
    shared = Shared(mine, threads, default_hash_threads(len(jobs), threads), stop)
    shared.admit = admit
    lock = threading.Lock()

    def report(f: str, rec: ShardRecord) -> None:
        with lock:
            on_shard(f, rec)

    files, table = input_hashes(jobs, mine, shared), ShardTable(jobs, mine)
    streams = [Stream(j, ps, shared, device, report, on_progress, files, table)
               for j, ps in zip(jobs, mine, strict=True)]
    pool = ThreadPoolExecutor(len(streams), thread_name_prefix="kimi-convert-stream")
    futs = [pool.submit(s.run) for s in streams]
    ok = False
    try:
        results = [f.result() for f in futs]
        t = time.perf_counter()
        digests = {f: h.finish() for f, h in files.items()}
        for r, j in zip(results, jobs, strict=True):  # each file's hash reported by the job that owns it
            r.input_hashes = {f: digests[f].result() for f in j.hash_files}
        hash_wait = round(time.perf_counter() - t, 3)
        for r, j in zip(results, jobs, strict=True):
            r.hash_wait_s = hash_wait
            r.from_pipeline = sum(files[f].from_pipeline for f in j.hash_files)
            r.reread = sum(files[f].reread for f in j.hash_files)
        ok = True
    except BaseException:  # a stream failed, or Ctrl-C reached this thread: every stream stops
        stop.set()
        faults.release()
        table.abort()
        raise
    finally:
        pool.shutdown(wait=True)
        try:
            if (made := shared.runner_made()) is not None:
                made.close(check=ok)  # auto's calibration thread; raises what it found (different bytes)
        finally:
            shared.close(wait=not stop.is_set())
    runner = shared.runner_made()
    for r in results:
        r.backend_s = shared.backend_s
        r.in_flight_peak, r.in_flight_limit = shared.in_flight.peak, shared.in_flight.limit
        r.device = runner.name if runner else str(device)
        r.choices = [dataclasses.asdict(c) for c in runner.choices()] if runner else []
        r.pinned_bytes, r.pin_s = shared.buffers.pinned_bytes, round(shared.buffers.pin_s, 3)
        r.calibration = runner.calibration() if runner else {}
    return results


def warm_up(device: Device, threads: int) -> None:
    """Import torch and the kernels (and start CUDA) ahead of need, on a thread: this takes one to
    several seconds, which then overlap planning and the first reads. A failure here is ignored:
    the backend is made again where it is needed, and fails there with its own message."""
    try:
        import torch

        from kimi_convert.kernels import get_backend

        from .. import compute  # noqa: F401 - imported for its side effect: loaded now, not later
        from ..devices import Device as Dev

        # auto: the CPUs only, as for --device cpu (the GPU starts on the calibration thread, off the streams'
        # way: issue 26 item 9)
        for d in [Dev("cpu")] if device.kind == "auto" else [device]:
            backend = get_backend(d, threads)
            w = torch.ones((16, 32), dtype=torch.bfloat16)  # starts CUDA and loads the compiled kernels
            backend.quantize(backend.to_device(w), backend.amax(backend.to_device(w)))
    except Exception:
        pass
