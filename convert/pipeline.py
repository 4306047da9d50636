"""One worker's conversion: read -> compute -> write, the three stages overlapped.

- A reader thread ``pread``s the sources of the next pieces into pooled buffers, asks the kernel to
  start reading the piece after, and hands each buffer to the hashers: each source tensor's sha256,
  and its file's sha256 (``hashing.FileHasher``), come from these same bytes, not a second read.
- A compute thread runs the kernels (a pass-through slice needs nothing).
- A writer thread ``pwrite``s the results at their planned offsets and hashes them (the shard's own
  sha256 too, from the bytes written); a finisher thread flushes and renames each completed shard
  while the next is written, and reports it (``on_shard``) for the journal.

A worker runs several such streams on consecutive runs of its shards, in threads: a file's sha256
is sequential (about 1-2 GB/s a core), so one stream could not hash as fast as a disk reads.
Streams start reading and hashing before torch has loaded (about a second, more on some machines);
the backend is made once the first pieces are in flight.

A piece is a unit (a fused module, an expert's w1/w3), or a slice of at most ``SLICE`` bytes of a
pass-through tensor, so a huge embedding streams through like the rest. A piece is read only once
its bytes (and its outputs' estimated bytes) fit the worker's in-flight budget, shared by its
streams, and gives them back once written and hashed: memory is bounded by that budget plus the
file hashers' hold budget, whatever the checkpoint's size.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from . import faults, write
from .errors import ConvertError
from .hashing import FileHasher, HoldBudget, SerialHasher, Stopped
from .journal import ShardRecord
from .plan import COPY, KEEP, Encoding, Shard, Unit
from .readers import BufferPool, Loaded, PreadReader
from .safetensors_format import TensorInfo

if TYPE_CHECKING:
    import numpy as np

    from kimi_convert.kernels import Backend

    from .compute import Chunk
    from .devices import Device

SLICE = 64 << 20
READ_AHEAD = 3  # pieces read ahead of the compute, within the in-flight budget
WRITE_DEPTH = 2  # computed pieces waiting for the writer
#: Bytes at the start of each stream whose file hashes do not wait for the pipeline (see _Stream).
EAGER_HASH = 1 << 30
#: The in-flight budget of a worker: at least this, and at least two of its largest pieces.
MIN_IN_FLIGHT = 512 << 20


@dataclass(frozen=True)
class Read:
    part: TensorInfo
    lo: int  # byte range within the stored tensor
    hi: int

    @property
    def file_range(self) -> tuple[int, int]:
        return self.part.start + self.lo, self.part.start + self.hi


class PieceKind(StrEnum):
    COPY = "copy"  # a slice of a pass-through unit: its stored bytes are the output bytes
    COMPUTE = "compute"  # a whole unit, computed


@dataclass(frozen=True)
class Piece:
    unit: Unit
    reads: tuple[Read, ...]
    kind: PieceKind
    copy_at: int  # COPY: the slice's byte offset in the output tensor (0 for COMPUTE)
    last: bool  # the unit's last piece

    @property
    def nbytes(self) -> int:
        return sum(r.hi - r.lo for r in self.reads)


def is_pass_through(unit: Unit) -> bool:
    """Output bytes = the concatenated stored bytes of its sources (nothing to compute)."""
    return len(unit.items) == 1 and unit.items[0].kind in (KEEP, COPY) and all(
        s.encoding == Encoding.DENSE for s in unit.items[0].sources)


def pieces(units: list[Unit], file_order: dict[str, int], slice_bytes: int | None = None) -> list[Piece]:
    """The units cut into pieces: pass-through units in slices, the others whole (their reads in
    file order, so that file hashes mostly advance without holding anything)."""
    slice_bytes = slice_bytes or SLICE
    out = []
    for u in units:
        if not is_pass_through(u):
            reads = sorted((Read(p, 0, p.nbytes) for p in u.parts), key=lambda r: (file_order[r.part.file],
                                                                                      r.part.start))
            out.append(Piece(u, tuple(reads), PieceKind.COMPUTE, 0, True))
            continue
        cur: list[Read] = []
        size = at = 0
        for p in u.parts:  # every part gets a read, an empty one too (its hash is recorded)
            take = 0
            while True:
                n = min(p.nbytes - take, slice_bytes - size)
                cur.append(Read(p, take, take + n))
                size, take = size + n, take + n
                if size == slice_bytes:
                    out.append(Piece(u, tuple(cur), PieceKind.COPY, at, False))
                    at, cur, size = at + size, [], 0
                if take >= p.nbytes:
                    break
        if cur:
            out.append(Piece(u, tuple(cur), PieceKind.COPY, at, False))
        out[-1] = Piece(u, out[-1].reads, PieceKind.COPY, out[-1].copy_at, True)
    return out


@dataclass
class Job:
    """What one stream converts: consecutive shards of the plan, and the input files it hashes."""

    input_dir: Path
    output_dir: Path
    shards: list[Shard]
    units: list[Unit]  # the units of those shards, in plan order
    file_order: dict[str, int]
    hash_files: dict[str, int]  # input file -> size: the files whose sha256 this stream computes
    block: tuple[int, int]


@dataclass
class JobResult:
    input_hashes: dict[str, str]
    from_pipeline: int  # input bytes the file hashes took from the pipeline's reads
    reread: int  # input bytes read a second time for them
    backend_s: float = 0.0  # its worker's time to load torch and start the device, overlapped with reading
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage (threads of one stream)
    in_flight_peak: int = 0  # its worker's most bytes in flight at once
    in_flight_limit: int = 0  # its worker's budget


@dataclass
class _ShardState:
    writer: write.ShardWriter
    file_hash: FileHasher
    units_left: int
    tensors: dict[str, Future] = field(default_factory=dict)
    sources: dict[str, Future] = field(default_factory=dict)
    notes: dict[str, dict] = field(default_factory=dict)


class ByteBudget:
    """Bytes a worker's streams may hold in flight (read, not yet written and hashed).

    A read ahead of what its stream needs next leaves ``reserve`` bytes free, which only a stream's
    next piece may take: otherwise streams that read ahead could hold the whole budget while another
    stream's compute waits for its first piece. A request larger than the whole budget is granted
    when nothing else is held, so a huge piece still passes (alone)."""

    def __init__(self, limit: int, stop: threading.Event, reserve: int = 0):
        self.limit = limit
        self.reserve = min(reserve, limit // 2)
        self.held = 0
        self.peak = 0  # the most ever held
        self._cond = threading.Condition()
        self._stop = stop

    def take(self, n: int, urgent: Callable[[], bool] = lambda: True) -> None:
        """Wait until ``n`` bytes fit; ``urgent()`` says whether they are the stream's next piece."""
        with self._cond:
            while self.held and self.held + n + (0 if urgent() else self.reserve) > self.limit:
                if self._stop.is_set():
                    raise Stopped("pack")
                self._cond.wait(0.05)
            self.held += n
            self.peak = max(self.peak, self.held)

    def give(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()


class Shared:
    """What a worker's streams share: the hashing threads, the buffers, the memory budgets."""

    def __init__(self, streams: list[list[Piece]], threads: int, hash_threads: int, stop: threading.Event):
        self.stop, self.threads = stop, threads
        self.hash_pool = ThreadPoolExecutor(hash_threads, thread_name_prefix="kimi-convert-hash")
        sizes = sorted((pc_cost(pc) for ps in streams for pc in ps), reverse=True)
        self.in_flight = ByteBudget(max(MIN_IN_FLIGHT, sum(sizes[:2])), stop, reserve=sizes[0] if sizes else 0)
        self.hold = HoldBudget(min(128 << 20, self.in_flight.limit // 4))
        self.buffers = BufferPool(limit=self.in_flight.limit)
        self._backend: Backend | None = None
        self._lock = threading.Lock()
        self.backend_s = 0.0

    def backend(self, device: Device) -> Backend:
        """Made on first use (this imports torch, and starts CUDA for a GPU), once for all streams."""
        with self._lock:
            if self._backend is None:
                t = time.perf_counter()
                from kimi_convert.kernels import get_backend

                try:
                    self._backend = get_backend(device, self.threads)
                except ValueError as e:  # e.g. a CPU-only torch asked for cuda
                    raise ConvertError(str(e)) from None
                self.backend_s = time.perf_counter() - t
            return self._backend

    def close(self, wait: bool = True) -> None:
        self.hash_pool.shutdown(wait=wait, cancel_futures=not wait)


def pc_cost(pc: Piece) -> int:
    """A piece's bytes in flight: its sources, plus its outputs when computed (a pass-through slice
    is written from its own buffer)."""
    return pc.nbytes + (pc.unit.nbytes_out if pc.kind is PieceKind.COMPUTE else 0)


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


class _Stream:
    def __init__(self, job: Job, mine: list[Piece], shared: Shared, device: Device,
                 on_shard: Callable[[str, ShardRecord], None], on_progress: Callable[[int], None]):
        self.job, self.pieces, self.shared, self.device = job, mine, shared, device
        self.on_shard, self.on_progress, self.stop = on_shard, on_progress, shared.stop
        self.hash_pool = shared.hash_pool
        self.reader = PreadReader(job.input_dir)
        self.next_compute = 0  # the piece the compute thread needs next
        # The first EAGER_HASH bytes of the stream's reads are hashed for their files by the hashers
        # themselves, at once: a file's sha256 is a sequential chain, and this starts it while torch
        # loads, from the page cache the start-up readahead fills (one disk read either way).
        expected: dict[str, list[tuple[int, int]]] = {f: [] for f in job.hash_files}
        eager = EAGER_HASH
        for pc in self.pieces:
            for r in pc.reads:
                if eager > 0:
                    eager -= r.hi - r.lo
                elif r.part.file in expected:
                    expected[r.part.file].append(r.file_range)
        self.files = {f: FileHasher(job.input_dir / f, size, expected[f], self.hash_pool, shared.hold, self.stop)
                      for f, size in job.hash_files.items()}
        self.shard_of = {s.file: s for s in job.shards}
        self.written = _write_ranges(self.pieces, self.shard_of)
        self.source_hashers: dict[str, SerialHasher] = {}
        self.units_per_shard = {s.file: 0 for s in job.shards}
        for u in job.units:
            self.units_per_shard[u.shard] += 1
        self.open: dict[str, _ShardState] = {}
        self.out_hashers: dict[str, SerialHasher] = {}
        self.backend: Backend | None = None
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
    def compute(self, pc: Piece, loaded: Loaded) -> tuple[dict[str, list[Chunk]], dict[str, dict]]:
        if pc.kind is PieceKind.COPY:
            name = pc.unit.items[0].outputs[0].name
            return {name: list(loaded.buffers.values())}, {}
        t = time.perf_counter()
        if self.backend is None:
            self.backend = self.shared.backend(self.device)
            t = self._clock("compute: wait for torch and the device", t)
        from .compute import compute_unit

        res = compute_unit(pc.unit, loaded, self.backend, self.job.block)
        self._clock("compute: kernels and copies", t)
        return {n: o.chunks for n, o in res.outputs.items()}, res.notes

    # -- write stage (writer thread) --------------------------------------------------------------
    def store(self, pc: Piece, outputs: dict[str, list[Chunk]], notes: dict[str, dict], feeds: list[Future],
              digests: dict[str, Future], base: np.ndarray | None, finisher: ThreadPoolExecutor,
              finishing: list[Future]) -> None:
        try:
            self._store(pc, outputs, notes, feeds, digests, base, finisher, finishing)
        finally:
            self.shared.in_flight.give(pc_cost(pc))

    def _store(self, pc: Piece, outputs: dict[str, list[Chunk]], notes: dict[str, dict], feeds: list[Future],
               digests: dict[str, Future], base: np.ndarray | None, finisher: ThreadPoolExecutor,
               finishing: list[Future]) -> None:
        if self.stop.is_set():
            raise Stopped("pack")
        file = pc.unit.shard
        st = self.open.get(file)
        if st is None:
            shard = self.shard_of[file]
            w = write.ShardWriter(self.job.output_dir, shard)
            st = self.open[file] = _ShardState(w, FileHasher(w.tmp, shard.size, self.written[file], self.hash_pool,
                                                             self.shared.hold, self.stop), self.units_per_shard[file])
            st.file_hash.offer(0, [shard.header])
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
        if pc.last:
            st.units_left -= 1
            if st.units_left == 0:
                del self.open[file]
                finishing.append(finisher.submit(self.finish_shard, file, st))

    def finish_shard(self, file: str, st: _ShardState) -> None:
        t = time.perf_counter()
        sha = st.file_hash.finish().result()  # before the rename: a re-read, if any, reads the .partial
        t = self._clock("finish: shard sha256", t)
        st.writer.finish()
        self._clock("finish: fsync and rename", t)
        faults.point("shard")
        rec = ShardRecord(size=self.shard_of[file].size, sha256=sha,
                          tensors={k: f.result() for k, f in st.tensors.items()},
                          sources={k: f.result() for k, f in st.sources.items()}, notes=st.notes)
        self.on_shard(file, rec)

    def run(self) -> JobResult:
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
                outputs, notes = self.compute(pc, loaded)
                del loaded
                writing.append(writes.submit(self.store, pc, outputs, notes, feeds, digests, base, finisher,
                                             finishing))
                del outputs, base
                t = time.perf_counter()
                while len(writing) > WRITE_DEPTH or (writing and writing[0].done()):
                    writing.popleft().result()
                self._clock("compute: wait for the writer", t)
                _raise_failed(finishing)
            while writing:
                writing.popleft().result()
            for f in list(finishing):
                f.result()
            hashes = {f: h.finish() for f, h in self.files.items()}
            done = {f: fut.result() for f, fut in hashes.items()}
        except BaseException:
            self.stop.set()
            faults.release()
            for ex in (reads, writes, finisher):
                ex.shutdown(wait=True, cancel_futures=True)
            for st in self.open.values():
                st.writer.abort()
            self.reader.close()
            raise
        for ex in (reads, writes, finisher):
            ex.shutdown()
        self.reader.close()
        return JobResult(done, sum(h.from_pipeline for h in self.files.values()),
                         sum(h.reread for h in self.files.values()), stages=dict(self.seconds))


def _raise_failed(futs: list[Future]) -> None:
    for f in futs:
        if f.done() and f.exception() is not None:
            f.result()


def run_jobs(jobs: list[Job], device: Device, on_shard: Callable[[str, ShardRecord], None],
             on_progress: Callable[[int], None] = lambda n: None, *, threads: int,
             stop: threading.Event | None = None) -> list[JobResult]:
    """Convert each job's shards on its own stream (threads of this process), calling ``on_shard``
    as each shard is complete; the first failure stops every stream. ``threads``: the CPUs this
    worker may use (its C kernel's threads, and the bound on its hashing threads)."""
    stop = stop or threading.Event()
    mine = [pieces(j.units, j.file_order) for j in jobs]
    shared = Shared(mine, threads, default_hash_threads(len(jobs), threads), stop)
    lock = threading.Lock()

    def report(f: str, rec: ShardRecord) -> None:
        with lock:
            on_shard(f, rec)

    streams = [_Stream(j, ps, shared, device, report, on_progress) for j, ps in zip(jobs, mine, strict=True)]
    pool = ThreadPoolExecutor(len(streams), thread_name_prefix="kimi-convert-stream")
    futs = [pool.submit(s.run) for s in streams]
    try:
        results = [f.result() for f in futs]
    except BaseException:  # a stream failed, or Ctrl-C reached this thread: every stream stops
        stop.set()
        faults.release()
        raise
    finally:
        pool.shutdown(wait=True)
        shared.close(wait=not stop.is_set())
    for r in results:
        r.backend_s = shared.backend_s
        r.in_flight_peak, r.in_flight_limit = shared.in_flight.peak, shared.in_flight.limit
    return results


def warm_up(device: Device, threads: int) -> None:
    """Import torch and the kernels (and start CUDA) ahead of need, on a thread: this takes one to
    several seconds, which then overlap planning and the first reads. A failure here is ignored:
    the backend is made again where it is needed, and fails there with its own message."""
    try:
        import torch

        from kimi_convert.kernels import get_backend

        from . import compute  # noqa: F401 - imported for its side effect: loaded now, not later

        backend = get_backend(device, threads)
        w = torch.ones((16, 32), dtype=torch.bfloat16)  # starts CUDA and loads the compiled kernels
        backend.quantize(backend.to_device(w), backend.amax(backend.to_device(w)))
    except Exception:
        pass


def default_hash_threads(streams: int, share: int) -> int:
    """Hashing threads of one worker: two a stream and two more, within its share of the CPUs
    (a file's sha256 and a tensor's run one thread each; hashlib releases the GIL)."""
    return max(2, min(2 * streams + 2, share))


def cpu_share(cpus: int, workers: int) -> int:
    """Each worker's share of ``cpus`` (``devices.cpus()``): for its C kernel and its hashing threads."""
    return max(1, cpus // max(1, workers))


def default_streams(cpus: int, workers: int = 1) -> int:
    """Streams of one worker: one per 4 of its CPUs, 1 to 4."""
    return max(1, min(4, cpu_share(cpus, workers) // 4))
