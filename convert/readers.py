"""Reading stored tensor data through the input's ``Source``: memory-mapped views (``MappedReader``, verify) or
byte ranges read into pooled buffers (``PreadReader``, ``BufferPool``, ``Loaded``, ``readahead``: the pipeline)."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .errors import ConvertError
from .safetensors_format import DTYPES, TensorInfo
from .sources import Source, SourceFile, open_source
from .sources.local import ALIGN

if TYPE_CHECKING:  # torch is imported where tensors are made: planning needs only the headers, and
    import numpy as np  # pack starts reading the input while torch loads (about a second)
    import torch


class TensorSource(Protocol):
    """What the compute stage reads stored tensors from: a memory map, or buffers read for it."""

    def tensor(self, t: TensorInfo) -> torch.Tensor: ...

    def raw(self, t: TensorInfo) -> memoryview | np.ndarray: ...


def _typed(buf: np.ndarray, t: TensorInfo) -> torch.Tensor:
    import torch

    dt = DTYPES[t.dtype].torch
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=dt)
    return torch.from_numpy(buf).view(dt).view(t.shape)


class MappedReader:
    """Zero-copy, read-only views of stored tensors over one memory map per shard (verify, the numeric check).

    Pages a finished group touched are dropped from the process (``release``), so resident memory
    follows the group being converted, not the part of the checkpoint read so far.

    A memory map needs a file on this machine: the one use of ``Source.local_path``. A source without one
    (a test's in-memory source; the Hub before a download) is read whole through the source instead.
    """

    def __init__(self, source: Source | str | os.PathLike):
        self.source = open_source(source)
        self._maps: dict[str, mmap.mmap | bytes] = {}
        self._lock = threading.Lock()  # the compute thread and the writer thread both map files

    def _map(self, rel: str) -> mmap.mmap | bytes:
        with self._lock:
            m = self._maps.get(rel)
            if m is None:
                path = self.source.local_path(rel)
                if path is not None:
                    with open(path, "rb") as f:
                        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                else:
                    with self.source.open(rel) as f:
                        m = f.read_range(0, f.size)
                self._maps[rel] = m
            return m

    def raw(self, t: TensorInfo) -> memoryview:
        return memoryview(self._map(t.file))[t.start : t.end]

    def tensor(self, t: TensorInfo) -> torch.Tensor:
        import torch

        dt = DTYPES[t.dtype].torch
        if t.nbytes == 0:
            return torch.empty(t.shape, dtype=dt)
        with warnings.catch_warnings():
            # The map is read-only on purpose; torch warns that it cannot write through it.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map(t.file), dtype=dt, count=t.nbytes // DTYPES[t.dtype].itemsize,
                                    offset=t.start)
        return flat.view(t.shape)

    def _advise(self, t: TensorInfo, advice: int | None) -> None:
        m = self._map(t.file) if advice is not None else None
        if not isinstance(m, mmap.mmap):
            return
        page = mmap.PAGESIZE
        lo = t.start - t.start % page
        hi = min(len(m), -(-t.end // page) * page)
        if hi > lo:
            m.madvise(advice, lo, hi - lo)

    def release(self, t: TensorInfo) -> None:
        """Drop ``t``'s pages from this process (they stay in the page cache)."""
        if t.file in self._maps:
            self._advise(t, getattr(mmap, "MADV_DONTNEED", None))

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError, AttributeError):  # a view is still alive: it closes when collected
                m.close()
        self._maps.clear()



class ByteRange(Protocol):
    """Bytes [lo, hi) of a stored tensor (``pipeline.slicing.Read``)."""

    part: TensorInfo
    lo: int
    hi: int


def span_bytes(span: Sequence[ByteRange]) -> int:
    """The bytes of a span's ranges (``Piece.spans``): one read's length."""
    return sum(r.hi - r.lo for r in span)


class PreadReader:
    """Reads byte ranges of stored tensors into buffers (``SourceFile.readinto``: ``pread`` for a local
    folder): the pipeline's reader.

    Explicit reads rather than memory-map faults: one large read on a reader thread overlaps the
    compute of the previous group and yields the very buffers the hashers need. The buffers are
    numpy arrays, so reading and hashing start before torch has loaded. Each file is opened once,
    through the source, and kept open until ``close``.

    ``direct``: a read of at least this many bytes goes past the page cache (``SourceFile.readinto_direct``;
    0: none, ``Tuning.direct_read``), into a buffer the caller places at the file offset's phase (``align``)."""

    def __init__(self, source: Source | str | os.PathLike, direct: int = 0,
                 twice: Collection[tuple[str, int]] = frozenset()):
        """``twice``: the ranges (file, offset) read twice, by the pipeline and by a file's digest chain
        (``hashing.ChainReads``): a span holding one goes through the page cache whatever its size, where the
        other read finds it (read past the cache, DeepSeek V4's re-read a quarter of its input from the disk:
        benchmarks/RESULTS.md, issue 38's session 35 section)."""
        self.source = open_source(source)
        self.direct = direct
        self.twice = twice
        self._files: dict[str, SourceFile] = {}
        self._lock = threading.Lock()

    @property
    def align(self) -> int:
        """What a read's buffer address should equal the file offset modulo: the disk's bytes then land in it
        directly (``sources.local.ALIGN``); 1 where every read goes through the page cache."""
        return ALIGN if self.direct else 1

    def _file(self, rel: str) -> SourceFile:
        with self._lock:
            f = self._files.get(rel)
            if f is None:
                f = self._files[rel] = self.source.open(rel)
            return f

    def read(self, t: TensorInfo, lo: int = 0, hi: int | None = None, into: np.ndarray | None = None) -> np.ndarray:
        """Bytes [lo, hi) of ``t`` (relative to its start), into ``into`` or a new uint8 array."""
        import numpy as np

        hi = t.nbytes if hi is None else hi
        buf = np.empty(hi - lo, dtype=np.uint8) if into is None else into
        self.read_span([_Range(t, lo, hi)], buf)
        return buf

    def read_span(self, span: Sequence[ByteRange], into: np.ndarray) -> None:
        """``span``'s ranges, one after the other in one file (``Piece.spans``), read into ``into`` as one read,
        through the page cache. A file that ends early: one line naming the tensor cut."""
        first = span[0]
        pos = first.part.start + first.lo
        self._read(span, pos, memoryview(into), False, pos + len(into))

    def room(self, spans: Sequence[Sequence[ByteRange]]) -> int:
        """The bytes beyond the spans' own that ``read_spans`` needs in the buffer: a span read past the page cache
        is read in whole blocks (``align``), the blocks around its first and last bytes included."""
        return (2 * self.align) * len(spans) + self.align

    def place(self, spans: Sequence[Sequence[ByteRange]], addr: int) -> list[int]:
        """Where in a buffer at address ``addr`` ``read_spans`` reads each span: one past the page cache at the file
        offset's phase, after whole blocks of its own (the block its first byte is in starts no earlier than the
        end of the previous span's last block: its whole-block read touches no other span's bytes)."""
        places, at = [], 0
        for span in spans:
            pos, n = span[0].part.start + span[0].lo, span_bytes(span)
            if self.past_cache(span):
                at += (-(addr + at)) % self.align + pos % self.align
                places.append(at)
                at += n + (-(addr + at + n)) % self.align
            else:
                places.append(at)
                at += n
        return places

    def read_spans(self, base: np.ndarray, spans: Sequence[Sequence[ByteRange]], places: Sequence[int]) -> None:
        """Each span of a piece into ``base`` at its place (``place``, with ``room`` to spare). One of ``direct``
        bytes or more is read past the page cache in whole blocks, one read, its first and last blocks' other bytes
        read into the room around it: before, its unaligned edges were read apart through a staging buffer, a disk's
        round trip each (773 reads of `bench-glm4-moe-lite`'s 1392, 2.0 s of its 3.8 s of reads on 2 cores;
        benchmarks/RESULTS.md, issue 38's session 32 section)."""
        for span, at in zip(spans, places, strict=True):
            pos, n = span[0].part.start + span[0].lo, span_bytes(span)
            if not self.past_cache(span):
                self.read_span(span, base[at : at + n])
                continue
            lo, hi = pos - pos % self.align, pos + n + (-(pos + n)) % self.align
            self._read(span, lo, memoryview(base)[at - (pos - lo) : at - (pos - lo) + (hi - lo)], True, pos + n)

    def _read(self, span: Sequence[ByteRange], pos: int, view: memoryview, direct: bool, need: int) -> None:
        """Bytes at ``pos`` of ``span``'s file into ``view``, at least up to the file offset ``need`` (a block past
        the file's end is read short; a file that ends before ``need``: one line naming the tensor cut)."""
        first = span[0]
        f = self._file(first.part.file)
        read = f.readinto_direct if direct else f.readinto
        while pos < need:
            n = read(pos, view)
            if n == 0:
                cut = next((r.part for r in span if r.part.start + r.hi > pos), first.part)
                raise ConvertError(f"{cut.file}: tensor {cut.name}: file ends before the tensor's data (truncated?)")
            view, pos = view[n:], pos + n

    def will_need(self, t: TensorInfo, lo: int = 0, hi: int | None = None) -> None:
        """Start reading a later range now (a local file: asynchronous readahead into the page cache)."""
        hi = t.nbytes if hi is None else hi
        if hi > lo:
            self._file(t.file).will_need(t.start + lo, hi - lo)

    def will_need_span(self, span: Sequence[ByteRange]) -> None:
        """``will_need`` for a span that will be read through the page cache; none for one read past it (the hint
        would read its bytes twice)."""
        if not self.past_cache(span):
            self.will_need(span[0].part, span[0].lo, span[0].lo + span_bytes(span))

    def past_cache(self, span: Sequence[ByteRange]) -> bool:
        """Whether ``span``'s read goes past the page cache: ``direct`` bytes or more, and none of it read ``twice``."""
        return bool(self.direct) and span_bytes(span) >= self.direct \
            and not any((r.part.file, r.part.start + r.lo) in self.twice for r in span)

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


class BufferPool:
    """Read buffers, reused: a new buffer costs a page fault and a zeroed page per 4 KB on first
    touch (measured: more system time than the read itself).

    ``get`` returns the smallest free buffer that fits (if at most about twice the size asked for);
    ``put`` takes it back, and free buffers are dropped (the largest first) while free and in-use
    buffers, and the bytes ``outside()`` says are held apart from the pool, together exceed ``limit`` bytes
    (the worker's file hashes keep views of buffers given back unused, to hash them in file order: without
    counting them, a pool full of free buffers and the hashes' holds together held the budget and a quarter
    more; benchmarks/RESULTS.md, "Session 28").

    For a GPU, ``pin_with`` page-locks the pool's own buffers (``cudaHostRegister``: they copy to and
    from the GPU by DMA, about 7x faster than pageable memory) as they are handed out, and unlocks each
    before the pool lets it go: the locked memory is the pool's, bounded by ``limit`` (torch's
    page-locked allocator, tried before, keeps every block it ever made)."""

    def __init__(self, limit: int, outside: Callable[[], int] = lambda: 0):
        self.limit = limit
        self._outside = outside
        self._free: list[np.ndarray] = []
        self._in_use = 0
        self._lock = threading.Lock()
        self._pin: Callable[[np.ndarray], bool] | None = None
        self._unpin: Callable[[np.ndarray], None] | None = None
        self._pinned: dict[int, np.ndarray] = {}  # id -> buffer, for the buffers page-locked now
        self.pin_s = 0.0  # seconds spent page-locking
        self.pinned_bytes = 0  # bytes page-locked, over the run

    def pin_with(self, pin: Callable[[np.ndarray], bool] | None, unpin: Callable[[np.ndarray], None] | None) -> None:
        """Page-lock buffers from now on with ``pin`` (False: it could not; not retried for that buffer),
        released with ``unpin``; ``None``: stop: the free buffers are unlocked now, those in use (a copy
        may still be reading one) as they come back."""
        with self._lock:
            if pin is not None:
                self._unpin = unpin
            self._pin = pin
            free = [b for b in self._free if id(b) in self._pinned] if pin is None else []
        self._release(free)

    @property
    def pinning(self) -> bool:
        """Whether buffers are being page-locked now."""
        return self._pin is not None

    def pinned(self, view: np.ndarray) -> bool:
        """Whether ``view`` lies in a page-locked buffer of this pool."""
        while view is not None and id(view) not in self._pinned:
            view = getattr(view, "base", None)
        return view is not None

    def unpin_all(self) -> None:
        """Unlock every buffer (the end of a run: no copy is in flight)."""
        with self._lock:
            bufs = list(self._pinned.values())
        self._release(bufs)

    @property
    def pooled(self) -> int:
        """The bytes of the pool's buffers, free and in use (``pack --stats``' timelines)."""
        with self._lock:
            return self._bytes()

    def _bytes(self) -> int:
        """(With the lock held.) The pool's buffers' bytes, free and in use."""
        return self._in_use + sum(b.nbytes for b in self._free)

    def clear(self) -> None:
        """Let every free buffer go (the end of a wave): the next wave's pool starts empty, and this one's up to
        ``limit`` bytes are freed now, not when a full collection reaches whatever still refers to the pool."""
        with self._lock:
            bufs, self._free = self._free, []
        self._release(bufs)

    def get(self, n: int) -> np.ndarray:
        import numpy as np

        with self._lock:
            buf = None
            for i, b in enumerate(self._free):  # sorted by size: the first that fits is the smallest
                if n <= b.nbytes <= 2 * n + (1 << 20):  # not a large buffer for a small read
                    buf = self._free.pop(i)
                    break
            if buf is not None and self._pin is not None and not _mapped(buf):
                buf = None  # made before page-locking began: replaced by a buffer of its own pages
            if buf is None:
                buf = _mapped_empty(_size_class(n)) if self._pin is not None else np.empty(max(n, 1), dtype=np.uint8)
            self._in_use += buf.nbytes
            dropped = self._trim()
            pin = self._pin if id(buf) not in self._pinned and _mapped(buf) else None
        self._release(dropped)
        if pin is not None:  # outside the lock: locking a large buffer takes milliseconds
            t = time.perf_counter()
            if pin(buf):
                with self._lock:
                    self._pinned[id(buf)] = buf
                    self.pinned_bytes += buf.nbytes
            self.pin_s += time.perf_counter() - t
        return buf

    def put(self, buf: np.ndarray, reuse: bool = True) -> None:
        """Give ``buf`` back (``reuse=False``: it stays referenced elsewhere, only count it out)."""
        with self._lock:
            self._in_use -= buf.nbytes
            if reuse:
                self._free.append(buf)
                self._free.sort(key=lambda b: b.nbytes)
            # not reused, or locked after locking stopped: unlocked (a buffer kept is kept pageable)
            dropped = self._trim() + ([] if reuse and self._pin is not None else [buf])
        self._release(dropped)

    def _trim(self) -> list[np.ndarray]:
        """Drop free buffers over the limit (with the lock held); returns them, to unlock. Page-locked
        buffers may take twice the limit: with the in-flight budget full, a pool held to it would drop
        every buffer given back, and locking a new one costs more than the read into it (benchmarks/RESULTS.md,
        "The figures behind the pipeline's constants")."""
        limit = self.limit * (2 if self._pin is not None else 1) - self._outside()
        dropped = []
        while self._free and self._bytes() > limit:
            dropped.append(self._free.pop())
        return dropped

    def _release(self, bufs: list[np.ndarray]) -> None:
        """Unlock the page-locked ones among buffers the pool lets go (before their memory can be freed)."""
        with self._lock:
            locked = [b for b in bufs if self._pinned.pop(id(b), None) is not None]
            unpin = self._unpin
        for b in locked:
            if unpin is not None:
                unpin(b)


def _size_class(n: int) -> int:
    """``n`` rounded up to 4 sizes an octave (at most 25% more), so that page-locked buffers of
    pieces of about the same size are interchangeable; whole pages."""
    step = max(4096, 1 << max(0, n.bit_length() - 3))
    return max(4096, -(-n // step) * step)


def _mapped_empty(n: int) -> np.ndarray:
    """A buffer of whole pages of its own (an anonymous mapping): page-locking it cannot overlap another
    buffer's pages, and unmapping it (when the last view goes) frees exactly what was locked."""
    import numpy as np

    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


def _mapped(buf: np.ndarray) -> bool:
    return isinstance(getattr(buf.base, "obj", None), mmap.mmap)


class Loaded:
    """A group's stored tensors, read into buffers (the compute stage's view of a ``PreadReader``)."""

    def __init__(self, buffers: dict[str, np.ndarray]):
        self.buffers = buffers

    def tensor(self, t: TensorInfo) -> torch.Tensor:
        return _typed(self.buffers[t.name], t)

    def raw(self, t: TensorInfo) -> np.ndarray:
        return self.buffers[t.name]


@dataclass(frozen=True)
class _Range:
    part: TensorInfo
    lo: int
    hi: int


def readahead(source: Source, parts: list[TensorInfo], budget: int) -> None:
    """Ask the kernel to start reading the first ``budget`` bytes of ``parts`` into the page cache
    (a hint the kernel may drop under memory pressure; queueing it can block, so callers run it on
    a thread)."""
    reader = PreadReader(source)
    try:
        for t in parts:
            if budget <= 0:
                break
            n = min(t.nbytes, budget)
            reader.will_need(t, 0, n)
            budget -= n
    except OSError:
        pass  # only a hint
    finally:
        reader.close()
