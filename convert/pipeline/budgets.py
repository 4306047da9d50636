"""Budgets: the bytes a worker's streams may hold in flight (read, not yet written and hashed), so memory is bounded
by the budget whatever the checkpoint's size, and the buffers and hold budget sized from it (``Memory``); the default
counts of streams and hashing threads for a share of the CPUs."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from ..hashing import HoldBudget, Stopped
from ..readers import BufferPool
from ..tuning import Tuning
from .slicing import Piece, PieceKind

#: glibc's mallopt parameters M_MMAP_THRESHOLD and M_ARENA_MAX
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def return_freed_memory(threshold: int) -> bool:
    """Have glibc give a freed tensor's memory back to the system at once (allocations of ``threshold`` bytes and more
    mapped on their own: ``Tuning.mmap_threshold`` says why; the price is page faults, system CPU time, with a wall
    time no worse). False where the C library has no mallopt (not glibc)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def limit_heaps(arenas: int) -> bool:
    """Have glibc serve every thread's small allocations from at most ``arenas`` heaps (``M_ARENA_MAX``; 0: glibc's
    own limit, eight a CPU). A pipeline's fifteen threads otherwise each get a heap of their own, each keeping its
    own free pages between the blocks still in use: ``Tuning.heap_arenas`` says what that cost. Set as the
    streams start: the heaps of threads started earlier stay, and the streams' threads share those. False where
    the C library has no mallopt (not glibc)."""
    if arenas <= 0:
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def trim_freed_memory() -> bool:
    """Give back to the system the memory glibc's heaps keep after their threads freed it (``malloc_trim``): the
    allocations under ``Tuning.mmap_threshold`` come from per-thread heaps, whose free pages between blocks still in
    use stay resident; over the released K3's run they grew by about 3 MB a shard (benchmarks/RESULTS.md,
    "Session 29"). Called as each output shard is finished. False where it gave nothing back or the C library has no
    malloc_trim (not glibc)."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


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


class Memory:
    """What bounds a worker's memory: the bytes its streams may hold in flight (``in_flight``: at least the tuning's
    floor for its CPUs, and two of its largest pieces, the largest held back for a stream's next piece), the read
    buffers pooled within that budget (``buffers``), and the bytes the file hashes may hold to hash them in file order
    (``hold``), which the pool counts against the same budget."""

    def __init__(self, streams: list[list[Piece]], threads: int, stop: threading.Event, tuning: Tuning):
        sizes = sorted((pc_cost(pc) for ps in streams for pc in ps), reverse=True)
        self.in_flight = ByteBudget(max(tuning.in_flight_floor(threads), sum(sizes[:2])), stop,
                                    reserve=sizes[0] if sizes else 0)
        self.hold = HoldBudget(min(tuning.hold_bytes, self.in_flight.limit // 4))
        self.buffers = BufferPool(limit=self.in_flight.limit, outside=lambda: self.hold.held)

    def close(self) -> None:
        """The end of a run (a wave): the buffers unlocked and let go (issue 43: two waves' pools at once)."""
        self.buffers.unpin_all()
        self.buffers.clear()


def pc_cost(pc: Piece) -> int:
    """A piece's bytes in flight: its sources, plus its outputs when computed (a pass-through slice
    is written from its own buffer)."""
    return pc.nbytes + (pc.unit.nbytes_out if pc.kind is PieceKind.COMPUTE else 0)


def default_hash_threads(streams: int, share: int) -> int:
    """Hashing threads of one worker: two a stream and two more, within its share of the CPUs
    (a file's digest and a tensor's run one thread each; hashlib and blake3 release the GIL)."""
    return max(2, min(2 * streams + 2, share))


def cpu_share(cpus: int, workers: int) -> int:
    """Each worker's share of ``cpus`` (``devices.cpus()``): for its C kernel and its hashing threads."""
    return max(1, cpus // max(1, workers))


def default_streams(cpus: int, workers: int = 1) -> int:
    """Streams of one worker: one per 4 of its CPUs, 1 to 4."""
    return max(1, min(4, cpu_share(cpus, workers) // 4))
