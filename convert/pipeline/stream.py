"""The stream: one run of consecutive shards through a reader, a compute, a writer and a finisher
thread, overlapped; ``run_jobs`` runs a worker's streams (the package docstring says how)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import faults, write
from ..hashing import TENSOR_DIGEST, ChainReads, FileHasher, SerialHasher, Stopped, chain_reads, labelled
from ..journal import ShardRecord
from ..manifest import write_records
from ..plan import Shard, Unit
from ..readers import Loaded, PreadReader
from ..tuning import Tuning
from .budgets import Memory, default_hash_threads, limit_heaps, pc_cost, return_freed_memory, trim_freed_memory
from .dispatch import Dispatch, GpuMeasuring, RunnerOnce
from .slicing import Piece, PieceKind, merge_notes, pieces
from .timeline import Timeline

if TYPE_CHECKING:
    import numpy as np

    from ..compute import Chunk
    from ..devices import Device
    from ..sources import Source
    from .runner import Runner


@dataclass
class Shared:
    """What a worker's streams share, each part with its own job: the stop signal, the CPUs and the tuning, the
    hashing threads, the memory bounds (``budgets.Memory``), the way a unit is computed (``dispatch.Dispatch``),
    and ``admit``, called before a stream opens a shard (``wait``: the stream has none open, so waiting cannot hold
    up a shard it must finish): ``pack --upload --no-keep-output`` waits there while the Hub is behind."""

    stop: threading.Event
    threads: int
    tuning: Tuning
    hash_pool: ThreadPoolExecutor
    memory: Memory
    compute: Dispatch
    admit: Callable[[bool, threading.Event], None] | None = None

    def close(self, wait: bool = True) -> None:
        self.hash_pool.shutdown(wait=wait, cancel_futures=not wait)
        self.memory.close()


@dataclass
class Job:
    """What one stream converts: consecutive shards of the plan, and the input files it hashes."""

    source: Source  # the input (pickled to worker processes and Ray tasks: a source holds nothing open)
    output_dir: Path
    shards: list[Shard]
    units: list[Unit]  # the units of those shards, in plan order
    file_order: dict[str, int]
    hash_files: dict[str, int]  # input file -> size: the files whose digest (``FILE_DIGEST``) this stream computes
    block: tuple[int, int]
    #: Bytes ahead of its reads its file hashes may read themselves, if more than ``Tuning.eager_hash`` (pack: its share
    #: of the start-up readahead, which brings them into the page cache)
    eager: int = 0
    #: Reads of at least this many bytes past the page cache (``Tuning.direct_read``, where pack found it worth it)
    direct_read: int = 0


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
    timeline: dict = field(default_factory=dict)  # its counters sampled in time (pipeline.timeline)
    wall_s: float = 0.0  # the stream's own seconds, start to end (the slowest one is the worker's wall)
    hash_wait_s: float = 0.0  # its seconds, once its shards were written, waiting for its input files' hashes
    early_units: int = 0  # its units computed without torch (``compute_early``)
    downloads: dict | None = None  # a Hub input's Ray task: its downloads' figures (raycluster.run_hub_task)


@dataclass
class _ShardState:
    writer: write.ShardWriter
    file_hash: FileHasher
    units_left: int
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


def offer_order(ranges: list[tuple[int, int]], expected: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A file's ``expected`` ranges (``disjoint(ranges)``) in the order the stream reads ``ranges``: each at its
    first read."""
    keep = set(expected)
    return [r for r in dict.fromkeys(ranges) if r in keep]


def _write_ranges(mine: list[Piece], shards: dict[str, Shard]) -> dict[str, list[tuple[int, int]]]:
    """Per shard, the byte ranges the writer hands to the shard's file hash: the header, each
    computed tensor whole, each pass-through slice."""
    out = {f: [(0, s.header_len)] for f, s in shards.items()}
    where = {f: {p.tensor.name: p for p in s.placed} for f, s in shards.items()}  # once a shard, not a piece
    for pc in mine:
        placed = where[pc.unit.shard]
        if pc.kind is PieceKind.COPY:
            start = placed[pc.unit.items[0].outputs[0].name].start + pc.copy_at
            out[pc.unit.shard].append((start, start + pc.nbytes))
        else:  # each output whole, or an expert run's share of it (its outputs narrowed to the run)
            for it in pc.unit.items:
                for t in it.outputs:
                    p = placed[t.name]
                    start = p.start + pc.at(p.end - p.start)
                    out[pc.unit.shard].append((start, start + t.nbytes))
    return out


class Stream:
    def __init__(self, job: Job, mine: list[Piece], shared: Shared, device: Device,
                 on_shard: Callable[[str, ShardRecord], None], on_progress: Callable[[int], None]):
        self.job, self.pieces, self.shared, self.device = job, mine, shared, device
        self.on_shard, self.on_progress, self.stop = on_shard, on_progress, shared.stop
        self.hash_pool = shared.hash_pool
        self.next_compute = 0  # the piece the compute thread needs next
        # A file hash reads a range the stream reads itself when its chain would otherwise wait for a stream that
        # waits for torch and the device (``hashing.FileHasher``'s ``may_take``), up to ``Tuning.eager_hash`` (or
        # job.eager) bytes ahead of the stream's reads: a file's digest is one sequential chain (the slowest stage of
        # one large input file), which so runs on while torch loads; the start-up readahead brings those bytes into the
        # page cache, where the stream's own reads find them later. While the stream runs, the chain hashes what it
        # reads (reading the same bytes beside it made the chain wait on the disk: benchmarks/RESULTS.md).
        expected: dict[str, list[tuple[int, int]]] = {f: [] for f in job.hash_files}
        at: dict[tuple[str, int], int] = {}  # (file, start) -> the stream's bytes read before that range
        pos = 0
        for pc in self.pieces:
            for r in pc.reads:
                if r.part.file in expected:
                    expected[r.part.file].append(r.file_range)
                    at.setdefault((r.part.file, r.file_range[0]), pos)
                pos += r.hi - r.lo
        self.read_pos = 0  # bytes the stream has read (the reader thread's count)
        self.stored = 0  # bytes of the pieces the writer has stored (their hashes done)
        self.piece_at = list(itertools.accumulate((pc.nbytes for pc in self.pieces), initial=0))
        self.hinted = 0  # the last piece whose reads were hinted to the disk (load)
        lead = max(shared.tuning.eager_hash, job.eager)

        self.stalled = False  # the stream waits for torch and the device (its file hashes may read ahead)

        def may_take(file: str) -> Callable[[int], bool]:
            return lambda start: self.stalled and at[(file, start)] < self.read_pos + lead

        # The input files' digest chains run on a thread of their own, not the shared pool: one chain is the
        # stream's slowest stage on a large input file, and on the pool it would queue behind tensor hashes.
        self.chain_pool = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-file-hash")

        def file_hash(f: str, size: int, ranges: list[tuple[int, int]], reads: ChainReads) -> FileHasher:
            return FileHasher(f, size, ranges, self.chain_pool, shared.memory.hold, self.stop, source=job.source,
                              may_take=may_take(f), small=shared.tuning.hash_reads_small, own=reads.own)

        ranges = {f: disjoint(expected[f]) for f in job.hash_files}
        reads = {f: chain_reads(offer_order(expected[f], ranges[f]), shared.memory.hold.limit) for f in ranges}
        self.files = {f: file_hash(f, size, ranges[f], reads[f]) for f, size in job.hash_files.items()}
        self.reader = PreadReader(job.source, direct=job.direct_read,
                                  twice={(f, a) for f, r in reads.items() for a in r.twice})
        self.shard_of = {s.file: s for s in job.shards}
        self.written = _write_ranges(self.pieces, self.shard_of)
        self.source_hashers: dict[str, SerialHasher] = {}
        self.units_of: dict[str, list[Unit]] = {s.file: [] for s in job.shards}  # in plan order
        for u in job.units:
            self.units_of[u.shard].append(u)
        self.units_per_shard = {f: len(us) for f, us in self.units_of.items()}
        self.open: dict[str, _ShardState] = {}
        self.out_hashers: dict[str, SerialHasher] = {}
        self.runner: Runner | None = None
        self.early_units = 0  # units computed without torch (compute_early)
        self.seconds: dict[str, float] = defaultdict(float)  # time each stage spent, for --stats

    def _clock(self, key: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[key] += now - since
        return now

    def _stall(self, on: bool) -> None:
        """The stream starts or stops waiting for torch and the device: its file hashes may read ahead meanwhile
        (a chain already idle is woken to)."""
        self.stalled = on
        if on:
            for fh in self.files.values():
                fh.wake()

    # -- read stage (reader thread) ---------------------------------------------------------------
    def load(self, i: int) -> tuple[Loaded, list[Future], dict[str, Future], np.ndarray | None]:
        """Read piece ``i`` into one pooled buffer (a read a span of it, ``Piece.spans``), start the hashes of its
        bytes, and ask the kernel to start reading piece ``i + 1``. Returns the buffer too, unless a file hash holds
        it."""
        pc = self.pieces[i]
        t = time.perf_counter()
        self.shared.memory.in_flight.take(pc_cost(pc), urgent=lambda: self.next_compute >= i)
        t = self._clock("read: wait for the memory budget", t)
        if self.stop.is_set():
            raise Stopped("pack")
        first = self.hinted + 1
        while self.hinted + 1 < len(self.pieces) and self.hinted <= i:  # the next piece
            self.hinted += 1
        if self.hinted >= first:  # on the hint thread, in order (a hint can block while the disk's queue is full)
            self.hints.submit(self._hint_quietly, range(first, self.hinted + 1))
        base = self.shared.memory.buffers.get(pc.nbytes + self.reader.room(pc.spans))
        bufs, feeds, digests, held = {}, [], {}, False
        # the piece's reads at once, those past the page cache in whole blocks at the file offset's phase
        places = self.reader.place(pc.spans, base.ctypes.data)
        self.reader.read_spans(base, pc.spans, places)
        for span, off in zip(pc.spans, places, strict=True):
            for r in span:
                buf = base[off : off + r.hi - r.lo]
                off += r.hi - r.lo
                self.read_pos += r.hi - r.lo
                bufs[f"{r.part.name}@{r.lo}" if pc.kind is PieceKind.COPY else r.part.name] = buf
                h = self.source_hashers.setdefault(r.part.name, SerialHasher(self.hash_pool, digest=TENSOR_DIGEST))
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
            self.shared.memory.buffers.put(base, reuse=False)
        return Loaded(bufs), feeds, digests, None if held else base

    def _hint_quietly(self, js: range) -> None:
        """Hint pieces ``js`` to the disk (the hint thread: a hint that fails is only a hint not given)."""
        for j in js:
            if self.stop.is_set():
                return
            with contextlib.suppress(OSError):
                for span in self.pieces[j].spans:
                    self.reader.will_need_span(span)

    # -- compute stage (the stream's own thread) --------------------------------------------------
    def compute(self, pc: Piece, loaded: Loaded) -> tuple[dict[str, list[Chunk]], dict[str, dict],
                                                          Callable[[bool], None]]:
        """The piece's outputs, notes, and what to call once they are written (gives the buffer lent for the
        unit's outputs back to the pool; False: not for reuse, the file hash holds some of its bytes)."""
        if pc.kind is PieceKind.COPY:
            name = pc.unit.items[0].outputs[0].name
            return {name: list(loaded.buffers.values())}, {}, _nothing
        t = time.perf_counter()
        if self.shared.compute.early_takes(pc.unit, self.device):
            res, buf = self.shared.compute.early_compute(pc.unit, loaded)
            self._clock("compute: C kernels without torch", t)
            self.early_units += pc.last  # (a unit cut into runs of experts: once)
            pool = self.shared.memory.buffers
            return ({n: o.chunks for n, o in res.outputs.items()}, res.notes,
                    _nothing if buf is None else lambda reuse: pool.put(buf, reuse=reuse))
        if self.runner is None:
            self._stall(True)
            try:
                self.runner = self.shared.compute.runner(self.device, self.job.block)
            finally:
                self._stall(False)
            t = self._clock("compute: wait for torch and the device", t)
        done = self.runner.compute(pc.unit, loaded)
        self._clock("compute: kernels and copies", t)
        res, runner = done[0], self.runner
        return {n: o.chunks for n, o in res.outputs.items()}, res.notes, lambda reuse: runner.release(done, reuse)

    # -- write stage (writer thread) --------------------------------------------------------------
    def store(self, pc: Piece, outputs: dict[str, list[Chunk]], notes: dict[str, dict],
              release: Callable[[bool], None], feeds: list[Future], digests: dict[str, Future], base: np.ndarray | None,
              finisher: ThreadPoolExecutor, finishing: list[Future], settler: ThreadPoolExecutor,
              settling: deque[Future]) -> None:
        """Write the piece, then hand it to the settler, which gives its buffers and its share of the in-flight
        budget back once its bytes are hashed: the writer goes on to the next piece meanwhile. (Waiting for the
        hashes itself, DeepSeek V3.2's writer, 3.4 GB out, spent 3.4 s of a 7.2 s stream writing nothing:
        benchmarks/RESULTS.md, issue 38's session 33 section.)"""
        held = True  # failed part-way: the file hash may hold any of the bytes
        try:
            held = self._store(pc, outputs, notes, feeds, digests, finisher, finishing)
            settling.append(settler.submit(self.settle, pc, feeds, base, held, release))
        except BaseException:
            release(not held)
            self.shared.memory.in_flight.give(pc_cost(pc))
            raise

    def settle(self, pc: Piece, feeds: list[Future], base: np.ndarray | None, held: bool,
               release: Callable[[bool], None]) -> None:
        """Once the piece's bytes are hashed (input and output), its buffers go back to the pool and its bytes
        leave the in-flight budget (the settler thread, in store order)."""
        try:
            t = time.perf_counter()
            for f in feeds:
                f.result()  # the buffers may go once hashed
            self._clock("settle: wait for the hashes", t)
            if base is not None:
                self.shared.memory.buffers.put(base, reuse=not (held and pc.kind is PieceKind.COPY))
            self.on_progress(pc.nbytes)
            self.stored += pc.nbytes
        finally:
            release(not held)
            self.shared.memory.in_flight.give(pc_cost(pc))

    def _store(self, pc: Piece, outputs: dict[str, list[Chunk]], notes: dict[str, dict], feeds: list[Future],
               digests: dict[str, Future], finisher: ThreadPoolExecutor, finishing: list[Future]) -> bool:
        """Whether the shard's file hash kept some of the piece's chunks (to hash them in file order later); the
        output hashes' futures are added to ``feeds``."""
        if self.stop.is_set():
            raise Stopped("pack")
        file = pc.unit.shard
        st = self.open.get(file)
        if st is None:
            shard = self.shard_of[file]
            if self.shared.admit is not None:
                self.shared.admit(not self.open, self.stop)
            w = write.ShardWriter(self.job.output_dir, shard, self.shared.tuning.writeback_every,
                                  self.shared.tuning.direct_write)
            hasher = FileHasher(w.tmp, shard.size, self.written[file], self.hash_pool, self.shared.memory.hold,
                                self.stop)
            st = self.open[file] = _ShardState(w, hasher, self.units_per_shard[file])
            st.file_hash.offer(0, [w.header])  # the bytes the writer wrote (a shard's header is encoded on demand)
        st.sources.update(digests)
        merge_notes(st.notes, notes, pc)
        single = pc.kind is PieceKind.COPY and len(pc.unit.parts) == 1
        held = False
        for name, chunks in sorted(outputs.items(), key=lambda kv: st.writer.placed[kv[0]].start):
            t = time.perf_counter()
            placed = st.writer.placed[name]
            at = pc.at(placed.end - placed.start)
            st.writer.write(name, chunks, at)
            self._clock("write: pwrite", t)
            fut, kept = st.file_hash.offer(placed.start + at, chunks)
            feeds += [fut] if fut is not None else []
            held = held or kept
            if single:  # a one-tensor pass-through: its bytes are the source's, hashed once
                if pc.last:
                    st.tensors[name] = digests[pc.unit.parts[0].name]
                continue
            h = self.out_hashers.setdefault(name, SerialHasher(self.hash_pool, digest=TENSOR_DIGEST))
            feeds += [h.feed(c) for c in chunks]
            if pc.last:
                st.tensors[name] = h.hexdigest()
                del self.out_hashers[name]
        if pc.last:
            st.units_left -= 1
            if st.units_left == 0:
                del self.open[file]
                finishing.append(finisher.submit(self.finish_shard, file, st))
        return held

    def finish_shard(self, file: str, st: _ShardState) -> None:
        t = time.perf_counter()
        digest = labelled(st.file_hash.digest, st.file_hash.finish().result())  # before the rename: a re-read, if
        t = self._clock("finish: shard digest", t)  # any, reads the .partial
        settle = getattr(self.job.source, "settle", None)  # a source read before its bytes are verified (a Hub
        if settle is not None:  # input's downloads): the shard is finished only from verified inputs
            settle(sorted({p.file for u in self.units_of[file] for p in u.parts}))
            t = self._clock("finish: wait for the inputs' verification", t)
        st.writer.finish()
        t = self._clock("finish: fsync and rename", t)
        faults.point("shard")
        records = write_records(self.job.output_dir, file, self.units_of[file],
                                {k: f.result() for k, f in st.tensors.items()},
                                {k: f.result() for k, f in st.sources.items()}, st.notes)
        self._clock("finish: manifest records", t)
        cast = [n for n in st.notes.values() if n.get("method") == "mxfp4-cast"]
        rec = ShardRecord(size=self.shard_of[file].size, digest=digest, records_size=records.size,
                          records_digest=records.digest, modules=records.modules,
                          cast_blocks=sum(n["blocks"] for n in cast),
                          cast_lossless=sum(n["lossless_blocks"] for n in cast))
        self.on_shard(file, rec)
        trim_freed_memory()  # what the shard's threads freed, given back (a long pack's heaps grew otherwise)

    def run(self) -> JobResult:
        start = time.perf_counter()
        reads = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-read")
        writes = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-write")
        settler = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-settle")
        finisher = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-finish")
        self.hints = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-hints")  # (not the reader's)
        memory = self.shared.memory
        timeline = Timeline(lambda: (self.read_pos, sum(h.hashed for h in self.files.values()), self.stored,
                                     memory.in_flight.held, memory.buffers.pooled, memory.hold.held))
        timeline.start()
        finishing: list[Future] = []
        loading: deque[Future] = deque()
        writing: deque[Future] = deque()
        settling: deque[Future] = deque()
        try:
            queued = 0  # the next piece to hand the reader
            tuning = self.shared.tuning
            ahead = (min(tuning.read_ahead_bytes, self.shared.memory.in_flight.limit // 4)
                     if self.shared.threads >= tuning.read_ahead_bytes_cpus else 0)
            for i, pc in enumerate(self.pieces):
                while queued < len(self.pieces) and (queued <= i + tuning.read_ahead or
                                                     self.piece_at[queued] - self.piece_at[i] < ahead):
                    loading.append(reads.submit(self.load, queued))
                    queued += 1
                t = time.perf_counter()
                self.next_compute = i
                loaded, feeds, digests, base = loading.popleft().result()
                self._clock("compute: wait for the reader", t)
                outputs, notes, release = self.compute(pc, loaded)
                del loaded
                writing.append(writes.submit(self.store, pc, outputs, notes, release, feeds, digests, base,
                                             finisher, finishing, settler, settling))
                del outputs, base, release
                t = time.perf_counter()
                while len(writing) > tuning.write_depth or (writing and writing[0].done()):
                    writing.popleft().result()
                self._clock("compute: wait for the writer", t)
                while settling and settling[0].done():
                    settling.popleft().result()
                _raise_failed(finishing)
            while writing:
                writing.popleft().result()
            while settling:
                settling.popleft().result()
            for f in list(finishing):
                f.result()
            done, hash_wait = self._finish_inputs()
        except BaseException:
            self._abort((reads, writes, settler, finisher))
            timeline.stop()
            raise
        for ex in (reads, writes, settler, finisher, self.hints, self.chain_pool):
            ex.shutdown()
        self.reader.close()
        return JobResult(done, sum(h.from_pipeline for h in self.files.values()),
                         sum(h.reread for h in self.files.values()), stages=dict(self.seconds),
                         wall_s=round(time.perf_counter() - start, 3), hash_wait_s=hash_wait,
                         early_units=self.early_units, timeline=timeline.stop())

    def _finish_inputs(self) -> tuple[dict[str, str], float]:
        """The input files' digests, ``labelled`` (each file's chain finishes once its last bytes are in) and the
        seconds waited for them; the chains' own time goes to the stages' seconds: each chain is sequential, the
        floor of a stream over one large file."""
        t = time.perf_counter()
        hashes = {f: h.finish() for f, h in self.files.items()}
        done = {f: labelled(self.files[f].digest, fut.result()) for f, fut in hashes.items()}
        hash_wait = round(time.perf_counter() - t, 3)
        self.seconds["hash: input file digest chains (busy)"] = sum(h.busy_s for h in self.files.values())
        self.seconds["hash: input file digest chains (on a CPU)"] = sum(h.cpu_s for h in self.files.values())
        self.seconds["hash: input file digest chains (own reads)"] = sum(h.read_s for h in self.files.values())
        if self.files and (wait := self.chain_pool.submit(_runqueue_wait_s).result()) is not None:
            self.seconds["hash: input file digest chains' thread (waiting for a CPU)"] = wait
        return done, hash_wait

    def _abort(self, pools: tuple[ThreadPoolExecutor, ...]) -> None:
        """A failed or interrupted run: every thread told to stop and waited for (a queued piece is dropped), every
        open shard's file closed (its ``.partial`` name never looks finished), the reader closed."""
        self.stop.set()
        faults.release()
        for ex in (*pools, self.hints, self.chain_pool):
            ex.shutdown(wait=True, cancel_futures=True)
        for st in self.open.values():
            st.writer.abort()
        self.reader.close()


def _runqueue_wait_s() -> float | None:
    """Seconds this thread has waited, runnable, for a CPU over its life (Linux's schedstat; None elsewhere), its
    wake-ups from idle spells included: beside a chain's busy and on-CPU seconds, about what is left of its busy
    time is the interpreter's lock (and the chain's own reads of what the pipeline did not hand it)."""
    try:
        run_ns, wait_ns = (int(x) for x in Path("/proc/thread-self/schedstat").read_text().split()[:2])
    except (OSError, ValueError):
        return None
    return wait_ns / 1e9 if run_ns else None  # all zero: the kernel keeps no such counts (schedstats off)


def _nothing(reuse: bool = True) -> None:
    pass


def _raise_failed(futs: list[Future]) -> None:
    for f in futs:
        if f.done() and f.exception() is not None:
            f.result()


def run_jobs(jobs: list[Job], device: Device, on_shard: Callable[[str, ShardRecord], None],
             on_progress: Callable[[int], None] = lambda n: None, *, threads: int,
             stop: threading.Event | None = None,
             admit: Callable[[bool, threading.Event], None] | None = None,
             tuning: Tuning | None = None) -> list[JobResult]:
    """Convert each job's shards on its own stream (threads of this process), calling ``on_shard``
    as each shard is complete; the first failure stops every stream. ``threads``: the CPUs this
    worker may use (its C kernel's threads, and the bound on its hashing threads); ``tuning``: pack's (default:
    ``Tuning()``)."""
    tuning = tuning or Tuning()
    stop = stop or threading.Event()
    return_freed_memory(tuning.mmap_threshold)
    limit_heaps(tuning.heap_arenas)
    mine = [pieces(j.units, j.file_order, tuning.slice_bytes) for j in jobs]
    shared = _shared(jobs, mine, device, threads, stop, admit, tuning)
    lock = threading.Lock()

    def report(f: str, rec: ShardRecord) -> None:
        with lock:
            on_shard(f, rec)

    streams = [Stream(j, ps, shared, device, report, on_progress) for j, ps in zip(jobs, mine, strict=True)]
    pool = ThreadPoolExecutor(len(streams), thread_name_prefix="kimi-convert-stream")
    futs = [pool.submit(s.run) for s in streams]
    ok = False
    try:
        results = [f.result() for f in futs]
        ok = True
    except BaseException:  # a stream failed, or Ctrl-C reached this thread: every stream stops
        stop.set()
        faults.release()
        raise
    finally:
        pool.shutdown(wait=True)
        _close(shared, ok)
    _report(results, shared, device)
    return results


def _shared(jobs: list[Job], mine: list[list[Piece]], device: Device, threads: int, stop: threading.Event,
            admit: Callable[[bool, threading.Event], None] | None, tuning: Tuning) -> Shared:
    """What the streams share; with --device cpu and auto the C kernels without torch, and with auto the GPU's
    measuring started."""
    memory = Memory(mine, threads, stop, tuning)
    runners = RunnerOnce(threads, memory.buffers, [pc.unit for ps in mine for pc in ps
                                                   if pc.kind is PieceKind.COMPUTE], tuning)
    compute = Dispatch(runners)
    if device.kind in ("cpu", "auto"):
        from ..compute_early import EarlyCompute

        block = jobs[0].block if jobs else (128, 128)  # (one checkpoint: every job's tile is the same)
        compute.early = EarlyCompute(threads, block)
        if device.kind == "auto":
            compute.measuring = GpuMeasuring(compute.early, runners, threads, tuning)
            compute.measuring.start(device, block, jobs)
    pool = ThreadPoolExecutor(default_hash_threads(len(jobs), threads), thread_name_prefix="kimi-convert-hash")
    return Shared(stop, threads, tuning, pool, memory, compute, admit)


def _close(shared: Shared, ok: bool) -> None:
    """The probe process and the calibration thread closed (each raises what it found, different bytes, where the
    run went well: ``ok``), then the hashing threads and the buffers."""
    try:
        measuring = shared.compute.measuring
        if measuring is not None and (probe := measuring.stop()) is not None:
            probe.close(check=ok)
    finally:
        try:
            if (made := shared.compute.runners.made()) is not None:
                made.close(check=ok)
        finally:
            shared.close(wait=not shared.stop.is_set())


def _report(results: list[JobResult], shared: Shared, device: Device) -> None:
    """The worker's figures on each of its streams' results: its device and auto's choices, its memory."""
    runners, probe = shared.compute.runners, shared.compute.probe
    runner = runners.made()
    measured = probe or runner  # what chose the devices (auto), if anything did
    skipped = shared.compute.measuring.skipped if shared.compute.measuring is not None else {}
    buffers, in_flight = shared.memory.buffers, shared.memory.in_flight
    for r in results:
        r.backend_s = runners.backend_s
        r.in_flight_peak, r.in_flight_limit = in_flight.peak, in_flight.limit
        r.device = ("auto" if probe or (device.kind == "auto" and runner is None)  # (probe skipped: auto too)
                    else runner.name if runner else str(device))
        r.choices = [dataclasses.asdict(c) for c in measured.choices()] if measured else []
        r.pinned_bytes, r.pin_s = buffers.pinned_bytes, round(buffers.pin_s, 3)
        r.calibration = (probe.stats() if probe else runner.calibration() if runner else dict(skipped))


class TorchNeed:
    """Whether the plan has a unit that needs torch on the CPUs (one ``compute_early`` does not take): the
    warm-up of ``--device cpu`` waits for the plan to say so, and without such a unit never imports torch (seconds of
    a core, and of the interpreter's lock, the streams need)."""

    def __init__(self):
        self._decided = threading.Event()
        self._plan = None

    def decide(self, plan) -> None:
        """``plan``: the pack's plan (None: planning failed; nothing is needed). The units are looked at by the
        thread that waits, not by pack's (a released checkpoint's plan has tens of thousands)."""
        self._plan = plan
        self._decided.set()

    def wait(self) -> bool:
        self._decided.wait()
        if self._plan is None:
            return False
        from ..compute_early import takes

        return not all(takes(u) for u in self._plan.outline.units)  # a bank's first expert stands for it


def warm_up(device: Device, threads: int, need: TorchNeed | None = None) -> None:
    """Import torch and the kernels (and start CUDA) ahead of need, on a thread: this takes one to
    several seconds, which then overlap planning and the first reads. ``--device cpu`` and ``auto``: the C library
    first, then torch only where ``need`` says a unit needs it. A failure here is ignored: the backend is made again
    where it is needed, and fails there with its own message."""
    try:
        if device.kind in ("cpu", "auto"):  # (auto without a unit that needs torch: the GPU is measured in a probe
            from kimi_convert.kernels import clib  # process, pipeline.probe; this one imports torch if it wins)

            clib.load()
            if need is not None and not need.wait():
                return
        import torch

        from kimi_convert.devices import get_backend

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
