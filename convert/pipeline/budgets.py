"""Budgets: what a worker's streams share (the hashing threads, the buffers) and the bytes they may
hold in flight, so memory is bounded by the budget, whatever the checkpoint's size; and the default
counts of streams and hashing threads for a share of the CPUs."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..errors import ConvertError
from ..hashing import HoldBudget, Stopped
from ..readers import BufferPool
from .slicing import Piece, PieceKind

if TYPE_CHECKING:
    import numpy as np

    from ..compute_early import EarlyCompute, UnitResult
    from ..devices import Device
    from ..plan import Unit
    from ..readers import Loaded
    from .probe import GpuProbe
    from .runner import Runner

#: The in-flight budget of a worker: at least this (IN_FLIGHT_PER_CPU a CPU of its share below 4 CPUs),
#: and at least two of its largest pieces.
MIN_IN_FLIGHT = 512 << 20
#: On a small share (2 CPUs: one stream) the compute, not the read-ahead, is the bound: 256 MB there
#: took the same CPU seconds as 512 MB and 0.63 GB of PSS instead of 0.83 GB (docs/history/RESULTS-history.md,
#: issue 14 item 4, 2 cores).
IN_FLIGHT_PER_CPU = 128 << 20


#: glibc's mallopt parameter M_MMAP_THRESHOLD, and the value a converting process sets
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20


def return_freed_memory() -> bool:
    """Have glibc give a freed tensor's memory back to the system at once (allocations of 1 MB and more
    mapped on their own). Left to itself glibc raises that threshold to the largest block freed (up to
    32 MB): a converter's tensors (an expert's 11 MB) then come from per-thread heaps that keep what is
    freed, and the process grows with its threads (peak RSS of pack: 676 -> 532 MB on 2 cores, 1.57 ->
    1.15 GB on 16; the price is page faults, 4-6 s more system CPU on 4.8 GB, with a wall time no worse;
    docs/history/RESULTS-history.md, session 6). False where the C library has no mallopt (not glibc)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def in_flight_floor(threads: int) -> int:
    """The smallest in-flight budget of a worker with ``threads`` CPUs (two of its largest pieces always fit:
    ``Shared``)."""
    return min(MIN_IN_FLIGHT, IN_FLIGHT_PER_CPU * max(1, threads))


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
        self.units = [pc.unit for ps in streams for pc in ps if pc.kind is PieceKind.COMPUTE]
        self.hash_pool = ThreadPoolExecutor(hash_threads, thread_name_prefix="kimi-convert-hash")
        sizes = sorted((pc_cost(pc) for ps in streams for pc in ps), reverse=True)
        self.in_flight = ByteBudget(max(in_flight_floor(threads), sum(sizes[:2])), stop,
                                    reserve=sizes[0] if sizes else 0)
        self.hold = HoldBudget(min(128 << 20, self.in_flight.limit // 4))
        self.buffers = BufferPool(limit=self.in_flight.limit)
        self._runner: Runner | None = None
        self._lock = threading.Lock()
        self.backend_s = 0.0
        #: The C kernels without torch (``compute_early``): --device cpu and auto (set by ``run_jobs``)
        self.early: EarlyCompute | None = None
        #: auto where the C kernels take every unit: the GPU measured in a probe process (``probe``); the runner is
        #: then made only where the GPU wins a kind of work, with the GPU alone
        self.probe: GpuProbe | None = None
        #: stop_measuring has been called: no probe is started after it (an Event: it wakes a probe's start that waits)
        self._measured = threading.Event()
        self._probe_due = False  # the GPU is to be measured in a probe (measure_soon), not yet started
        #: auto's probe not started, and why (--stats' calibration)
        self.probe_skipped: dict = {}
        #: Called before a stream opens a shard (``wait``: the stream has none open, so waiting cannot hold
        #: up a shard it must finish): ``pack --upload --no-keep-output`` waits there while the Hub is behind.
        self.admit: Callable[[bool, threading.Event], None] | None = None

    def runner(self, device: Device, block: tuple[int, int]) -> Runner:
        """Made on first use (this imports torch, and starts CUDA for a GPU), once for all streams:
        ``auto`` (a GPU and the CPUs) gets both backends, the CPU first, and measures which is faster."""
        with self._lock:
            if self._runner is None:
                t = time.perf_counter()
                from . import runner

                if self.probe is not None:  # the kinds the GPU won; the CPUs' are compute_early's
                    from ..devices import Device as Dev

                    device = Dev("cuda", self.probe.gpu.index)
                try:
                    backends = runner.candidates(device, self.threads)
                except ValueError as e:  # e.g. a CPU-only torch asked for cuda
                    raise ConvertError(str(e)) from None
                self._runner = runner.Runner(backends, self.buffers, block, self.units)
                self.backend_s = time.perf_counter() - t
            return self._runner

    def runner_made(self) -> Runner | None:
        """The runner, if a stream made it (one that only copies never does)."""
        return self._runner

    def make_runner_soon(self, device: Device, block: tuple[int, int], wait: bool = False) -> None:
        """``auto``: the runner made on a thread of its own, while the streams compute their first units without
        torch (``early_takes``); a failure there is the first stream's own again, when it makes the runner (with a
        probe: the CPUs go on computing every unit). ``wait``: made on this thread (the tests' tiny inputs)."""
        def make() -> None:
            with contextlib.suppress(Exception):
                self.runner(device, block)

        if wait:
            make()
        else:
            threading.Thread(target=make, daemon=True, name="kimi-convert-runner").start()

    def measure_soon(self, device: Device, block: tuple[int, int], jobs: list) -> None:
        """``auto``: how the GPU is measured, decided on a thread of its own (a released checkpoint's plan has 100,000+
        units: half a second to look at, off the streams' start; until then they compute what ``compute_early``
        takes, as with the runner not yet made): in a probe process where ``compute_early`` takes every unit
        (``probe``), started ``probe.START_AFTER_S`` into the streams (a pack over by then never starts it), else by
        the runner in this process, made now. ``probe.WAITS`` (the tests): decided here, the probe started at once."""
        from . import probe as probe_mod
        from .choose import decisive_kinds

        def decide() -> None:
            units = [u for j in jobs for u in j.units]
            if not all(self.early.takes(u) for u in units):
                self.make_runner_soon(device, block)
                return
            decisive = decisive_kinds(units)
            self._probe_due = True
            if not probe_mod.WAITS and self._measured.wait(probe_mod.START_AFTER_S):
                return  # (stop_measuring says so in probe_skipped)
            with self._lock:
                if not self._measured.is_set():
                    self.probe = probe_mod.GpuProbe(device, self.threads, block, decisive, on_gpu=lambda: (
                        self.make_runner_soon(device, block, wait=probe_mod.WAITS)))

        if probe_mod.WAITS:
            decide()
        else:
            threading.Thread(target=decide, daemon=True, name="kimi-convert-measure").start()

    def stop_measuring(self) -> GpuProbe | None:
        """The run is over: no probe is started from now on; the one started, if any (to close)."""
        with self._lock:
            self._measured.set()
            if self.probe is None and self._probe_due:
                from .probe import START_AFTER_S

                self.probe_skipped = {"probe": False, "skipped": f"the pack ended within {START_AFTER_S} s of its "
                                      "start (probe.START_AFTER_S): the GPU not measured, every unit on the CPUs"}
            return self.probe

    def early_takes(self, unit: Unit, device: Device) -> bool:
        """Whether a stream computes ``unit`` without torch (``compute_early``): with --device cpu whatever that
        module takes; with auto only until the runner is made (then the runner measures the CPUs against the GPU
        and chooses, which the calibration tests need for every unit: ``runner.CALIBRATION_WAITS``)."""
        if self.early is None or not self.early.takes(unit):
            return False
        if device.kind == "cpu":
            return True
        if self.probe is not None:  # all but the kinds the GPU won, once their runner is made
            return self._runner is None or not self.probe.on_gpu(unit)
        from . import runner

        return self._runner is None and not runner.CALIBRATION_WAITS

    def early_compute(self, unit: Unit, loaded: Loaded) -> tuple[UnitResult, np.ndarray | None]:
        """``unit`` computed by the C kernels (``early_takes``); with a probe, timed and offered to it."""
        if self.probe is not None:
            return self.probe.compute(unit, loaded, self.early, self.buffers)
        return self.early.compute(unit, loaded, self.buffers)

    def close(self, wait: bool = True) -> None:
        self.hash_pool.shutdown(wait=wait, cancel_futures=not wait)
        self.buffers.unpin_all()


def pc_cost(pc: Piece) -> int:
    """A piece's bytes in flight: its sources, plus its outputs when computed (a pass-through slice
    is written from its own buffer)."""
    return pc.nbytes + (pc.unit.nbytes_out if pc.kind is PieceKind.COMPUTE else 0)


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
