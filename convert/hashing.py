"""Digests of streams that arrive out of thread order, computed on a shared pool.

The pipeline hashes every byte it reads or writes (each input file and each source tensor, each
output tensor and each output file), and hashlib and blake3 release the GIL on large buffers, so
hashing runs beside reading, computing and writing. A tensor's digest is ``TENSOR_DIGEST`` and a file's
``FILE_DIGEST`` (both BLAKE3: four times sha256's speed on one core); sha256 (``HUB_DIGEST``) only where the Hub
names a file by it: a Hub input's LFS oid, and an output file's once uploaded, computed by the upload
(``sha256_checked``; docs/output-format.md, "Digests").
A digest is sequential, though: the pieces of one
stream must be fed in order even when several pool threads run. ``SerialHasher`` keeps that order
for one stream; ``FileHasher`` builds a whole file's digest from the byte ranges the pipeline reads or
writes anyway, reading from the file itself only what the pipeline does not hand it (an input's header,
ranges another worker converts, ranges that came too far out of order to hold): an input file through
its ``Source``, an output file (a local path) directly.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import blake3

from .sources.local import LocalFile

if TYPE_CHECKING:
    import numpy as np

    from .sources import Source, SourceFile

CHUNK = 16 << 20

#: The digest of each tensor in the records a pack writes (``tensors[]`` and ``sources[].parts[]``, under a
#: key of this name; manifest.json's ``tensor_digest`` names it).
TENSOR_DIGEST = "blake3"
#: Every file's digest the pipeline computes: a local input's, and every output file's (docs/output-format.md,
#: "Digests").
FILE_DIGEST = "blake3"
#: The Hub's name of an LFS file: a Hub input's (its downloads verified against it), and an output file's once
#: uploaded (computed by the upload, recorded beside its BLAKE3: ``manifest.with_hub_digests``).
HUB_DIGEST = "sha256"
#: The digests a manifest may use, files' and tensors': sha256 for every one before format_version 4, for files
#: before 5.
DIGESTS: dict[str, Callable[[], Digest]] = {"sha256": hashlib.sha256, "blake3": blake3.blake3}


def labelled(name: str, hexdigest: str) -> str:
    """A file's digest as the journal and the pipeline pass it around: ``"blake3:<hex>"``: two digests of one file
    by different algorithms never compare equal, and a manifest entry gets its key from it (``unlabel``)."""
    return f"{name}:{hexdigest}"


def unlabel(digest: str) -> tuple[str, str]:
    """``labelled``'s inverse: (algorithm, hex)."""
    name, _, hexdigest = digest.partition(":")
    return name, hexdigest


def bytes_digest(data: bytes, name: str = FILE_DIGEST) -> str:
    """``data``'s digest of algorithm ``name``, ``labelled`` (a records file's, hashed from the bytes written)."""
    return labelled(name, DIGESTS[name](data).hexdigest())


class Digest(Protocol):
    def update(self, data, /) -> object: ...
    def hexdigest(self) -> str: ...


class _Bytes:
    """A digest fed any C-contiguous buffer as its bytes (blake3 takes only byte-format buffers; an output
    tensor's chunk may be a float16 array)."""

    __slots__ = ("_h",)

    def __init__(self, h: Digest):
        self._h = h

    def update(self, data) -> None:
        self._h.update(as_bytes(data))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def as_bytes(data):
    """``data``'s bytes without a copy: itself where it is bytes-like, else a flat byte view of the buffer."""
    if isinstance(data, bytes | bytearray):
        return data
    mv = memoryview(data)
    if mv.format in ("B", "b", "c") and mv.ndim == 1:
        return mv
    try:
        return mv.cast("B")
    except (TypeError, ValueError):  # a format memoryview cannot cast (an explicit byte order): numpy can
        import numpy as np

        return np.asarray(data).reshape(-1).view(np.uint8)


def new_digest(name: str = TENSOR_DIGEST) -> Digest:
    """A fresh digest of algorithm ``name`` (one of ``DIGESTS``) that takes any contiguous buffer."""
    return _Bytes(DIGESTS[name]())


class SerialHasher:
    """One digest (``digest``: a name in ``DIGESTS``) fed from any thread, updated in feed order on ``pool``.

    Each ``feed`` returns a future that is done once those bytes are hashed, so the caller knows when
    it may reuse or drop the buffer. At most one pool thread works on a stream at a time (no thread
    ever blocks waiting for its turn)."""

    def __init__(self, pool: Executor, on_idle: Callable[[], None] | None = None, digest: str = TENSOR_DIGEST):
        """``on_idle``: called on the pool thread each time the queue runs dry (it may feed more)."""
        self._pool = pool
        self._on_idle = on_idle
        self._h = new_digest(digest)
        self._lock = threading.Lock()
        self._queue: deque[tuple[object, Future]] = deque()
        self._running = False
        self._error: BaseException | None = None  # a failed feed fails every later one
        self.busy_s = 0.0  # seconds spent hashing (--stats: how near a file's one chain is to its stream's wall)
        self.cpu_s = 0.0  # of which on a CPU (the rest: waiting for one, or for the interpreter's lock)
        self.read_s = 0.0  # of busy_s, the seconds in feeds that read the bytes themselves (a file's gaps)
        self.hashed = 0  # bytes hashed so far (--stats' timeline)

    def feed(self, data) -> Future:
        """Hash ``data`` (a buffer, or a callable that feeds the hash itself) after what came before."""
        fut: Future = Future()
        with self._lock:
            self._queue.append((data, fut))
            if self._running:
                return fut
            self._running = True
        self._pool.submit(self._drain)
        return fut

    def hexdigest(self) -> Future:
        """A future of the digest of everything fed so far."""
        return self.feed(None)

    def _update(self, data) -> None:
        self._h.update(data)
        self.hashed += memoryview(data).nbytes

    def wake(self) -> None:
        """Run ``on_idle`` on the pool now if the stream is idle (what it may feed itself has changed)."""
        with self._lock:
            if self._running or self._on_idle is None:
                return
            self._running = True
        self._pool.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    break
                data, fut = self._queue.popleft()
            try:
                if self._error is not None:
                    raise self._error
                if data is None:
                    fut.set_result(self._h.hexdigest())
                    continue
                t, c = time.perf_counter(), time.thread_time()
                if callable(data):
                    data(self._update)
                    self.read_s += time.perf_counter() - t
                else:
                    self._update(data)
                self.busy_s += time.perf_counter() - t
                self.cpu_s += time.thread_time() - c
                fut.set_result(None)
            except BaseException as e:  # handed to whoever waits on the future
                self._error = e
                fut.set_exception(e)
        if self._on_idle is not None and self._error is None:
            self._on_idle()


class FileHasher:
    """A file's digest from the ranges the pipeline reads, in file order, plus the gaps between them.

    ``expected`` are the (start, end) ranges the pipeline will ``offer`` (each exactly once). The
    cursor hashes offered bytes as soon as everything before them is hashed; a range offered ahead
    of the cursor is held while the hold budget allows, else dropped and later read again from the
    file; bytes nobody offers (the header, tensors this worker does not convert) are read from the
    file when the cursor reaches them. The digest is the file's whatever the order of offers.

    ``small``: once the hold budget has had to drop an offer, an expected range of at most this many bytes that
    the cursor reaches before that offer is read from the file, not waited for. Safetensors stores a file's tensors
    by dtype width, so a unit's small tensors can sit apart from its large ones (a compressed-tensors INT4 release's
    I64 ``weight_shape`` before its I32 codes and BF16 scales, an FP8 release's F32 ``weight_scale_inv`` before its
    weights). Read unit by unit, such a file kept a cursor that waited for every small tensor at the small ones' run
    until the last unit was read, and each large range offered before that was held or, past the hold budget,
    dropped and read again (a third of `bench-kimi-k25@8`'s input, benchmarks/RESULTS.md). Reading a small range
    twice costs its size, so it is done only where the alternative, large ranges read twice, has begun; the
    pipeline's own offer of it is then ignored. 0 (an output shard, whose bytes exist only once written) waits for
    every range.

    ``may_take(start)``: whether the hash may read the expected range at ``start`` from the file itself
    when it would otherwise wait for it (its queue ran dry there, nothing offered yet): a file digest is one
    sequential chain, the slowest stage of one large input file (one core's speed), and a pipeline stalled
    behind it (torch loading, a GPU starting) must not stall the chain too. The pipeline's later read of a
    range taken so comes from the page cache (one disk read either way); the caller bounds how far ahead
    of its own reads (what the page cache holds for it).
    """

    def __init__(self, path: str | os.PathLike, size: int, expected: list[tuple[int, int]], pool: Executor,
                 budget: HoldBudget, stop: threading.Event | None = None, *, source: Source | None = None,
                 may_take: Callable[[int], bool] | None = None, small: int = 0, own: frozenset[int] = frozenset(),
                 digest: str = FILE_DIGEST):
        """``path``: a local file (an output shard being written), or with ``source`` the name of an input
        file in it (read through the source: the gaps the pipeline does not read). ``digest``: the algorithm."""
        self.path, self.source = path, source
        self.size = size
        self.digest = digest
        self._hasher = SerialHasher(pool, None if may_take is None else self._on_idle, digest)
        self._may_take = may_take
        self._small = small
        self._own = own  # expected ranges (their starts) the chain reads itself: chain_reads
        self._dropped_to = 0  # the end of the furthest offer the hold budget could not take
        self._lock = threading.Lock()
        self._ends = {a: b for a, b in expected if b > a}
        self._starts = sorted(self._ends)  # still to be offered, or held
        self._held: dict[int, tuple[list, dict[int, int]]] = {}  # start -> (its chunks, the buffers they keep)
        self._cursor = 0
        self._budget = budget
        self._stop = stop or threading.Event()
        self.from_pipeline = 0  # bytes hashed from the pipeline's own reads
        self.reread = 0  # bytes read from the file again for the hash
        self._done: Future | None = None
        with self._lock:
            self._advance()  # the header, and anything before the first range the pipeline reads

    @property
    def busy_s(self) -> float:
        """Seconds the chain spent hashing (and reading what the pipeline did not hand it)."""
        return self._hasher.busy_s

    @property
    def cpu_s(self) -> float:
        """Of ``busy_s``, the seconds the chain's thread ran on a CPU."""
        return self._hasher.cpu_s

    @property
    def hashed(self) -> int:
        """Bytes of the file hashed so far."""
        return self._hasher.hashed

    @property
    def read_s(self) -> float:
        """Of ``busy_s``, the seconds spent on the ranges the chain read from the file itself (reading and hashing)."""
        return self._hasher.read_s

    def offer(self, start: int, chunks: list) -> tuple[Future | None, bool]:
        """Bytes [start, start + their length) of the file, as read or written by the pipeline (one
        or more buffers back to back). Returns the future of their hashing if they are hashed now
        (the buffers must live until it is done), and whether they are held for later (the buffers
        must not be reused)."""
        n = sum(memoryview(c).nbytes for c in chunks)
        with self._lock:
            if self._ends.get(start) != start + n:
                return None, False  # not expected (any more): the cursor reads these bytes from the file
            if start != self._cursor:
                if self._budget.take(kept := owners(chunks)):
                    self._held[start] = chunks, kept
                    return None, True
                if self._budget.take(kept := {id(copy := _copy(chunks)): n}):
                    self._held[start] = [copy], kept  # (the pipeline's buffer stays free to reuse)
                    return None, False
                self._forget(start)  # read again when the cursor gets there
                self._dropped_to = max(self._dropped_to, start + n)
                self._advance()  # the cursor may wait at a small range before it: read now, not waited for
                return None, False
            self._forget(start)
            fut = self._feed(chunks, n, pipeline=True)
            self._advance()
            return fut, False

    def finish(self) -> Future:
        """Hash whatever is left (nothing more will be offered); a future of the hex digest (``labelled`` with
        ``self.digest`` by the caller)."""
        with self._lock:
            for s in list(self._starts):
                if s not in self._held:
                    self._forget(s)
            self._advance()
            if self._done is None:
                self._done = self._hasher.hexdigest()
            return self._done

    def wake(self) -> None:
        """``may_take`` may answer otherwise now: an idle chain looks again at the range it waits for."""
        self._hasher.wake()

    def _on_idle(self) -> None:
        """The hash ran dry: take the range it waits for from the file, where ``may_take`` allows."""
        with self._lock:
            c = self._cursor
            if self._done is not None or c not in self._ends or c in self._held or not self._may_take(c):
                return
            end = self._ends[c]
            self._forget(c)  # offered later: not expected any more, the buffer is not kept
            self._feed(_reader(self.path, c, end, self._stop, self.source), end - c, pipeline=False)
            self._advance()

    def _forget(self, start: int) -> None:
        del self._ends[start]
        self._starts.pop(bisect.bisect_left(self._starts, start))

    def _feed(self, data, n: int, pipeline: bool) -> Future:
        """``data``: a list of buffers, or a callable that reads from the file."""
        self._cursor += n
        if pipeline:
            self.from_pipeline += n
        else:
            self.reread += n
        futs = [self._hasher.feed(c) for c in data] if isinstance(data, list) else [self._hasher.feed(data)]
        return futs[-1] if futs else self._hasher.feed(b"")

    def _advance(self) -> None:
        """Move the cursor over held ranges and gaps until it reaches a range still to come."""
        while self._cursor < self.size:
            c = self._cursor
            if c in self._held:
                chunks, kept = self._held.pop(c)
                n = self._ends[c] - c
                self._budget.give(kept)
                self._forget(c)
                self._feed(chunks, n, pipeline=True)
                continue
            if c in self._ends and not self._reads_itself(c):
                return  # the pipeline reads it next
            nxt = self._read_until(c)
            self._feed(_reader(self.path, c, nxt, self._stop, self.source), nxt - c, pipeline=False)

    def _read_until(self, c: int) -> int:
        """Where the chain's own read from ``c`` ends: the next range it waits for or holds, past the gaps and the
        small ranges before it (forgotten: their offers are ignored)."""
        i = bisect.bisect_left(self._starts, c)
        while i < len(self._starts):
            s = self._starts[i]
            if s in self._held or not self._reads_itself(s):
                return s
            self._forget(s)
        return self.size

    def _reads_itself(self, start: int) -> bool:
        """Whether the cursor reads the expected range at ``start`` itself: one ``chain_reads`` chose, or a small one
        before a dropped offer."""
        return start in self._own or (self._ends[start] - start <= self._small and start < self._dropped_to)


class Stopped(Exception):
    """The pack is stopping (failing or interrupted): a long read or hash ends early."""


def _open(path: str | os.PathLike, source: Source | None) -> tuple[SourceFile, str]:
    """The file to read for a hash, and how messages name it: ``path`` in ``source``, or a local ``path``."""
    if source is not None:
        return source.open(str(path)), source.shown(str(path))
    return LocalFile.open(path, str(path)), str(path)


@dataclass(frozen=True)
class ChainReads:
    """What ``chain_reads`` decides for one input file (ranges by their start): ``own``, the ranges its digest chain
    reads from the file itself rather than wait for; ``dropped``, the offers it expects past the hold budget, which
    the chain reads again. Each is read twice, once by the pipeline for its unit: ``twice``."""

    own: frozenset[int] = frozenset()
    dropped: frozenset[int] = frozenset()

    @property
    def twice(self) -> frozenset[int]:
        return self.own | self.dropped


def chain_reads(order: list[tuple[int, int]], budget: int) -> ChainReads:
    """The ranges a file's digest chain should read from the file itself rather than wait for, given the order in
    which the pipeline will offer them (``order``: each range once, disjoint) and the hold budget (``FileHasher``),
    and the offers still past the budget then (dropped: the chain reads them again).

    The chain hashes in file order, so a range offered late blocks its cursor, and everything offered meanwhile past
    it must be held, or, past the budget, dropped and read again. Where a unit's bytes lie in two runs of the file
    (a DeepSeek V4 expert's E8M0 scales among all the layer's scales, its weights far after; the attention's weights
    between the two runs, offered after every expert, as units go by their first stored byte) the experts' weights
    went past the budget and a third of the input was read twice (benchmarks/RESULTS.md, issue 38's session 33
    section). Walking the offers in order, each offer that does not fit the budget weighs reading the first j of the
    ranges blocking the cursor before it (their bytes: the chain reads them, the pipeline reads them again for their
    units) against what is dropped until the rest of them are offered, and takes the cheapest j (0: drop the offer).
    Weighed one range at a time, DeepSeek V3.2's last file had its chain read a 558 MB run of BF16 tensors to save
    0.1 GB of drops. The hold budget is counted by the ranges' own bytes (a range that does not fit in place is held
    as a copy). Decided once, from the plan: the digest is the file's whatever the choice."""
    import numpy as np  # (vectorized: a file of thousands of ranges whose offers keep overflowing the budget took
    # seconds of start-up weighed range by range in Python)

    sizes = np.array([b - a for a, b in order], dtype=np.int64)
    later = np.concatenate([np.cumsum(sizes[::-1])[::-1], [0]]).astype(np.int64)  # bytes offered from index i on
    index = {a: i for i, (a, _) in enumerate(order)}
    starts = sorted(index)
    position = {a: p for p, a in enumerate(starts)}
    offer_of = np.array([index[a] for a in starts], dtype=np.int64)  # each range's offer, by file position
    own = np.zeros(len(starts), dtype=bool)
    dropped = np.zeros(len(starts), dtype=bool)
    gone = np.zeros(len(starts), dtype=bool)  # offered (hashed, held, or dropped: read again) or read by the chain
    held: dict[int, int] = {}  # position -> bytes
    total = k = 0  # the bytes held; the cursor: the first position not gone

    def passed(k: int) -> int:
        """The cursor moved over what is gone."""
        nonlocal total
        while k < len(starts) and gone[k]:
            total -= held.pop(k, 0)
            k += 1
        return k

    for i, n in enumerate(sizes.tolist()):
        p = position[order[i][0]]
        gone[p] = True
        k = passed(k)
        if k >= len(starts) or p <= k:
            continue  # hashed at once
        if total + n > budget:  # past the budget: the chain reads ranges blocking it before ``p``, or drops it
            blocking = np.flatnonzero(~gone[k:p]) + k
            chosen = blocking[: _reads_to_take(offer_of[blocking], sizes, later, i, total + n - budget)]
            own[chosen] = gone[chosen] = True
            k = passed(k)
        if k < len(starts) and p > k:
            if total + n <= budget:
                held[p] = n
                total += n
            else:
                dropped[p] = True
    own_at, dropped_at = (frozenset(starts[q] for q in np.flatnonzero(c).tolist()) for c in (own, dropped))
    return ChainReads(own_at, dropped_at)


def _reads_to_take(offers, sizes, later, i: int, over: int) -> int:
    """How many of the ranges blocking the cursor (``offers``: their offers' indices, in file order) the chain reads
    itself when offer ``i`` is ``over`` bytes past the hold budget (``chain_reads``): reading the first j costs their
    bytes, then what is dropped until the rest are all offered (the offers past the budget, the blocking ranges' own
    offers aside); the cheapest j, the first of equal costs (the fewest reads)."""
    import numpy as np

    cost = np.concatenate([[0], np.cumsum(sizes[offers])])
    last = np.concatenate([np.maximum.accumulate(offers[::-1])[::-1], [i + 1]]).astype(np.int64)
    ranked = np.sort(offers)
    before = np.concatenate([[0], np.cumsum(sizes[ranked])])
    return int(np.argmin(cost + over + later[i + 1] - later[last] - before[np.searchsorted(ranked, last)]))


def _reader(path: str | os.PathLike, lo: int, hi: int, stop: threading.Event, source: Source | None = None):
    """A feed that reads [lo, hi) of the file in chunks (run on the hashing pool)."""

    def run(update) -> None:
        f, shown = _open(path, source)
        with f:
            pos = lo
            while pos < hi:
                if stop.is_set():
                    raise Stopped(shown)
                # the next chunks start coming while this one is hashed (a cold file: the disk and the
                # sha256 overlap instead of taking turns)
                f.will_need(pos + CHUNK, min(2 * CHUNK, max(0, hi - pos - CHUNK)))
                block = f.read_range(pos, min(CHUNK, hi - pos))
                if not block:
                    raise OSError(f"{shown}: file shorter than its header says")
                update(block)
                pos += len(block)

    return run


class HoldBudget:
    """Bytes that ``FileHasher`` may hold out of order, shared by a worker's files (bounds memory).

    A held range keeps its whole buffer alive, not only its own bytes: the pipeline reads a piece (several tensors,
    of several files) into one pooled buffer, and a range held from it keeps that buffer from being reused or freed
    until the range is hashed. So the budget counts buffers (``owners``): a buffer's bytes once, while any of its
    ranges is held. Counting the ranges alone, holds of a few MB each kept 0.5 GB of buffers alive beyond the budget
    (``bench-kimi-k25@8``, benchmarks/RESULTS.md)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()
        self._owners: dict[int, list[int]] = {}  # id(buffer) -> [its bytes, ranges of it held]

    def take(self, owners: dict[int, int]) -> bool:
        """Hold ranges of the buffers ``owners`` (id -> bytes), if the buffers not held yet fit."""
        with self._lock:
            new = sum(n for k, n in owners.items() if k not in self._owners)
            if self.held + new > self.limit:
                return False
            for k, n in owners.items():
                self._owners.setdefault(k, [n, 0])[1] += 1
            self.held += new
            return True

    def give(self, owners: dict[int, int]) -> None:
        """The ranges taken with ``owners`` are queued for the chain: a buffer none of whose ranges is held any more
        leaves the budget. (Given back when queued, not when hashed: the stream's own offers queued behind them wait
        for the chain, which bounds that queue, and given back only once hashed MiniMax M3's held ``w3`` ranges
        collided and 0.34 GB of offers were read again: benchmarks/RESULTS.md, issue 38's session 32 section.)"""
        with self._lock:
            for k in owners:
                entry = self._owners[k]
                entry[1] -= 1
                if entry[1] == 0:
                    del self._owners[k]
                    self.held -= entry[0]


def _copy(chunks: list) -> np.ndarray:
    """The bytes of ``chunks`` in a buffer of their own: a range held as a copy keeps only its own bytes
    alive, where holding it in place would keep its whole piece's buffer (``owners``) past the hold budget, and
    dropping it has the file's chain read it again from the disk, waiting for it (Mistral Large 3's expert
    ``w3``, offered with ``w1`` before the ``w2`` stored between them: benchmarks/RESULTS.md, issue 38's session 33
    section). Copied under the file hash's lock: tens of milliseconds, where a drop costs the chain a disk read."""
    import numpy as np

    return np.concatenate([np.frombuffer(c, dtype=np.uint8) for c in chunks])


def owners(chunks: list) -> dict[int, int]:
    """The buffers that ``chunks`` keep alive (id -> bytes): a numpy view's outermost numpy base (the pool's buffer it
    was cut from), else the chunk itself."""
    import numpy as np  # (loaded by then: the pipeline's buffers are numpy arrays)

    got = {}
    for c in chunks:
        root = c
        while isinstance(getattr(root, "base", None), np.ndarray):
            root = root.base
        got[id(root)] = root.nbytes if isinstance(root, np.ndarray) else memoryview(c).nbytes
    return got


def hash_file(path: str | os.PathLike, ranges: dict[str, tuple[int, int]],
              progress: Callable[[int], None] | None = None, stop: threading.Event | None = None, *,
              source: Source | None = None, digest: str = TENSOR_DIGEST, file_digests: Collection[str] = (FILE_DIGEST,)
              ) -> tuple[dict[str, str], int, dict[str, str]]:
    """The file's digests (``file_digests``, each ``labelled``, by algorithm), its size, and ``digest`` of each
    byte range (contiguous, non-overlapping: a shard's tensors), in one sequential read (``upload`` checks a
    file's BLAKE3 and takes the sha256 the Hub names it by from the same bytes); a stop request ends it within one
    chunk. ``path``: a local file, or with ``source`` an input file's name."""
    fhs = {name: new_digest(name) for name in file_digests}
    order = sorted(ranges.items(), key=lambda kv: kv[1])
    th = {name: new_digest(digest) for name in ranges}
    pos, i = 0, 0
    if source is not None:
        f = source.open(str(path))
        shown = source.shown(str(path))

        def blocks():
            at = 0
            while block := f.read_range(at, CHUNK):
                at += len(block)
                yield block
    else:
        f = open(path, "rb")  # noqa: SIM115 - closed by the with below
        shown = str(path)

        def blocks():
            while block := f.read(CHUNK):
                yield block
    with f:
        for block in blocks():
            if stop is not None and stop.is_set():
                raise Stopped(shown)
            for fh in fhs.values():
                fh.update(block)
            end = pos + len(block)
            while i < len(order) and order[i][1][0] < end:
                name, (a, b) = order[i]
                lo, hi = max(a, pos), min(b, end)
                if hi > lo:
                    th[name].update(memoryview(block)[lo - pos : hi - pos])
                if b <= end:
                    i += 1
                else:
                    break
            pos = end
            if progress:
                progress(len(block))
    return {n: labelled(n, h.hexdigest()) for n, h in fhs.items()}, pos, {n: h.hexdigest() for n, h in th.items()}


def file_digest(path: str | os.PathLike, digest: str = FILE_DIGEST, stop: threading.Event | None = None, *,
                source: Source | None = None) -> str:
    """The file's ``digest``, ``labelled``."""
    return hash_file(path, {}, stop=stop, source=source, file_digests=(digest,))[0][digest]


def sha256_checked(path: str | os.PathLike, size: int, digest: str) -> str | None:
    """The file's sha256 (hex: its LFS object id) from one read that also checks its size and its recorded digest
    (``labelled``); None where either differs: an upload sends, and a manifest records, only the bytes it names."""
    got, n, _ = hash_file(path, {}, file_digests={unlabel(digest)[0], HUB_DIGEST})
    return unlabel(got[HUB_DIGEST])[1] if n == size and got[unlabel(digest)[0]] == digest else None


def sha256_file(path: str | os.PathLike, stop: threading.Event | None = None, *, source: Source | None = None) -> str:
    """The file's sha256 (hex): what the Hub names an LFS file by."""
    return unlabel(file_digest(path, HUB_DIGEST, stop, source=source))[1]


def git_blob_sha1(path: str | os.PathLike) -> str:
    """A file's git object id (what the Hub lists for a file that is not in LFS): sha1 of "blob SIZE\\0" and
    the bytes. Here, not in ``upload``, because ``verify`` needs it too and ``upload`` imports ``verify``."""
    h = hashlib.sha1(f"blob {os.stat(path).st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()
