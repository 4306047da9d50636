"""``--device auto`` with a GPU: the GPU or the CPUs, whichever is faster, measured on the run's own work.

Which one wins depends on the recipe, not on the hardware alone: NVIDIA's MXFP4 -> NVFP4 cast is a few
integer operations a byte, so a GPU must first move every byte over PCIe and back, where 16 CPUs cast in
place; a BF16 weight quantized to NVFP4 or block FP8 is arithmetic the GPU does far faster. So each *kind
of work* (``work_kind``: the unit's operations, and its size within a factor of 4, since a launch costs
the same for 1 MB as for 100 MB) is calibrated on its own: its first units are computed on every
candidate, in the pipeline as it runs (so under the run's own load: hashing, reading, the other streams),
the first on each candidate only to warm up (Triton compiles its kernels then), the next ``Tuning.samples`` timed.
The candidate with the lower median seconds per byte then computes every later unit of that kind. The
bytes are the same on every device by design (the tests and the GPU equality scripts hold each kernel to
the torch code); the calibration checks it again on the units it computes twice, and fails loudly if not.

Until a kind is decided its units are the CPUs' (the first candidate's), computed in their streams as with
``--device cpu``; the GPU computes copies of some of them on a thread of its own (:class:`Calibrator`), so
that having a GPU costs the streams nothing they would wait for: not its start-up, not its kernels' compiling,
not its slower first units (issue 26 item 9).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..plan import Encoding, Operation, Unit

R = TypeVar("R")
B = TypeVar("B")


class CandidateLost(RuntimeError):
    """A candidate other than the first is gone (it could not start, or its process ended): every kind of work
    stays on the first, and the run goes on (unlike different bytes, or a kernel's error, which fail it)."""


def work_kind(unit: Unit) -> str | None:
    """What computing ``unit`` takes, as a key for the calibration: its operations (``mxfp4-cast``,
    ``nvfp4``, ``nvfp4-from-mxfp4``, ``fp8-block``, ``decode``...) and its input size class (a factor of 4:
    ``@16MB`` holds 4-16 MB). None when it needs no kernel (bytes kept as they are)."""
    ops = set()
    for it in unit.items:
        op = it.operation  # the plan's (``plan.operations``)
        coded = any(s.encoding != Encoding.DENSE for s in it.sources)
        if op in (Operation.COPY, Operation.DECODE):
            if coded:
                ops.add(f"decode-{it.sources[0].encoding}")
        elif op is Operation.CAST:
            ops.add(op.value)
        else:  # a scheme's own step: its name (the operation's value)
            ops.add(op.value + (f"-from-{it.sources[0].encoding}" if coded else ""))
    if not ops:
        return None
    size = 1 << 20
    while size < unit.nbytes_in:
        size *= 4
    return "+".join(sorted(ops)) + f"@{_mb(size)}"


def decisive_kinds(units: Iterable[Unit], samples: int) -> set[str]:
    """The kinds of work with units enough to be decided (a warm-up and ``samples``); the others stay on the CPUs."""
    counts = Counter(k for u in units if (k := work_kind(u)) is not None)
    return {k for k, n in counts.items() if n > samples}


def _mb(n: int) -> str:
    return f"{n >> 30}GB" if n >= 1 << 30 else f"{n >> 20}MB"


@dataclass(frozen=True)
class Choice:
    """The decision for one kind of work: ``chosen`` and each candidate's median seconds per GB."""

    kind: str
    chosen: str
    s_per_gb: dict[str, float]
    samples: int  # timed units per candidate

    def describe(self) -> str:
        rates = ", ".join(f"{b} {s:.3f}" for b, s in self.s_per_gb.items())
        return f"{self.kind}: {self.chosen} (s/GB: {rates}; {self.samples} units each)"


def choose(kind: str, timings: dict[str, list[tuple[float, int]]], margin: float = 1.0) -> Choice:
    """The candidate with the lowest median seconds per byte over its ``(seconds, bytes)`` samples; a tie
    goes to the first candidate (the order given: the CPU, which leaves the GPU free). ``margin``: another
    candidate must be that many times faster than the first to be chosen (``Tuning.gpu_margin``)."""
    rate = {b: statistics.median(s / max(n, 1) for s, n in ts) for b, ts in timings.items()}
    first = next(iter(rate))
    scaled = {b: r if b == first else r * margin for b, r in rate.items()}
    best = min(scaled, key=lambda b: (scaled[b], list(scaled).index(b)))
    return Choice(kind, best, {b: round(r * 1e9, 4) for b, r in rate.items()}, min(len(t) for t in timings.values()))


@dataclass
class _Kind:
    warm: set[str] = field(default_factory=set)
    timings: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    choice: Choice | None = None


class Chooser(Generic[B]):
    """The decisions, shared by a worker's streams and its calibration thread (thread-safe). ``candidates``:
    name -> backend, the CPU first. The timings come in by :meth:`record`, one unit at a time, from wherever
    the unit was computed (the CPU's in its stream, the others' on :class:`Calibrator`'s thread)."""

    def __init__(self, candidates: dict[str, B], samples: int,
                 on_decided: Callable[[Choice], None] = lambda c: None, margin: float = 1.0):
        self.candidates, self.samples, self.on_decided = candidates, samples, on_decided
        self.margin = margin
        self._kinds: dict[str, _Kind] = {}
        self._lock = threading.Lock()

    def decided(self, kind: str) -> B | None:
        with self._lock:
            k = self._kinds.get(kind)
            return self.candidates[k.choice.chosen] if k and k.choice else None

    def choices(self) -> list[Choice]:
        with self._lock:
            return [k.choice for k in self._kinds.values() if k.choice is not None]

    def wants(self, kind: str, name: str) -> bool:
        """Whether a unit of ``kind`` computed on ``name`` would still count: the kind is undecided and
        ``name`` has not had its warm-up and its samples yet."""
        with self._lock:
            k = self._kinds.get(kind)
            if k is None:
                return True
            return k.choice is None and (name not in k.warm or len(k.timings.get(name, ())) < self.samples)

    def record(self, kind: str, name: str, seconds: float, nbytes: int) -> None:
        """One unit of ``kind`` (``nbytes`` of input) took ``seconds`` on ``name``; decides the kind once every
        candidate has its samples (the first unit a candidate computes of a kind is its warm-up: Triton compiles
        its kernels then)."""
        with self._lock:
            k = self._kinds.setdefault(kind, _Kind())
            if name not in k.warm:
                k.warm.add(name)
                return
            if k.choice is not None:
                return
            k.timings.setdefault(name, []).append((seconds, nbytes))
            if len(k.timings) == len(self.candidates) and all(len(t) >= self.samples for t in k.timings.values()):
                k.choice = choose(kind, {c: k.timings[c] for c in self.candidates}, self.margin)
                choice = k.choice
            else:
                return
        self.on_decided(choice)


@dataclass
class _Job:
    kind: str
    nbytes: int
    work: Callable  # backend -> result
    same: Callable  # result -> bool: the first candidate's bytes
    discard: Callable  # result -> None
    release: Callable  # () -> None: the job's copies may go (computed or not)
    timed: Callable  # result -> its seconds as the candidate measured them (None: the seconds this thread waited)
    done: threading.Event = field(default_factory=threading.Event)

    def drop(self) -> None:
        """The job is over (computed or never to be): its copies go, a stream waiting for it goes on."""
        try:
            self.release()
        finally:
            self.done.set()


class Calibrator(Generic[B, R]):
    """The other candidates' side of the calibration, on a thread of its own, off the streams' critical path.

    Why: timed in the stream, a GPU unit held its stream as long as the GPU took, start-up and kernel
    compilation included, many times the CPUs' time for the same unit: auto ran slower than ``--device cpu`` with
    every kind decided for the CPUs (benchmarks/RESULTS.md, "The figures behind the pipeline's constants").
    Now the stream computes an undecided kind's unit on the first candidate (the CPUs) and goes on with
    that result; ``offer`` gives this thread a copy of the unit (when it is idle: a stream never waits for
    it) to compute on the others, timed and checked against the first's bytes here.

    ``start()``: run first on the thread (the GPU's start-up: the CUDA context); if it raises, the other
    candidates are never used and every kind stays on the first (auto = the CPUs). ``wait``: a stream
    waits for the thread, every unit of an undecided kind is calibrated (the tests, on tiny inputs)."""

    def __init__(self, chooser: Chooser, start: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter, wait: bool = False):
        self.chooser, self.clock, self.wait = chooser, clock, wait
        self.first, *self.others = chooser.candidates
        self._start = start
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._busy = False  # a stream has taken the thread (its job may still be being copied)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.failed: BaseException | None = None  # raised in the streams by check()
        self.broken: str = ""  # why the other candidates could not start
        self.stats = {"start_s": 0.0, "units": 0, "busy_s": 0.0, "declined": 0}

    def take(self, kind: str) -> bool:
        """Reserve the thread for one unit of ``kind``; then :meth:`give` must follow. False (the stream goes
        on at once) where no other candidate wants the kind, the thread is busy or could not start."""
        if not any(self.chooser.wants(kind, o) for o in self.others):
            return False
        with self._cond:
            if self._thread is None and not self._closed:  # started on first need: no kind, no GPU start-up
                self._thread = threading.Thread(target=self._loop, daemon=True, name="kimi-convert-calibrate")
                self._thread.start()
            while self.wait and self._busy and not (self._closed or self.broken):
                self._cond.wait(0.05)
            if self._busy or self._closed or self.broken:
                self.stats["declined"] += 1
                return False
            self._busy = True
            return True

    def give(self, kind: str, nbytes: int, work: Callable[[B], R], same: Callable[[R], bool],
             discard: Callable[[R], None] = lambda r: None, release: Callable[[], None] = lambda: None,
             timed: Callable[[R], float | None] = lambda r: None) -> None:
        """The unit reserved by :meth:`take`: ``work(backend)`` computes it (on copies the thread keeps until it
        calls ``release()``), ``same(result)`` tells whether it holds the first candidate's bytes,
        ``discard(result)`` frees a result, ``timed(result)`` is its seconds where the candidate timed it itself
        (a probe process: the pipe's copies are not its cost)."""
        job = _Job(kind, nbytes, work, same, discard, release, timed)
        with self._cond:
            if self._closed or self.broken:
                job.drop()
                self._busy = False
                return
            self._job = job
            self._cond.notify_all()
        if self.wait:
            job.done.wait()

    def cancel(self) -> None:
        """Give back a reservation without a job (the stream could not copy the unit)."""
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def check(self) -> None:
        """Raise what the thread found (different bytes, a kernel's error), in the stream that calls it."""
        if self.failed is not None:
            raise self.failed

    def close(self) -> None:
        """Stop the thread: a unit it is computing is finished, a unit waiting for it is dropped."""
        with self._cond:
            self._closed = True
            job, self._job = self._job, None
            self._cond.notify_all()
            thread = self._thread
        if job is not None:
            job.drop()
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        t = self.clock()
        try:
            self._start()
        except Exception as e:  # no GPU after all: the CPUs compute everything
            self._break(e)
            return
        finally:
            self.stats["start_s"] = round(self.clock() - t, 3)
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                job, self._job = self._job, None
            if job is None:
                return
            lost = None
            try:
                self._calibrate(job)
            except CandidateLost as e:
                lost = e
            except BaseException as e:
                self.failed = self.failed or e
            finally:
                job.drop()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            if lost is not None:
                self._break(lost)
                return

    def _break(self, e: Exception) -> None:
        """The other candidates cannot be used (``e``): a job waiting is dropped, every later offer declined."""
        with self._cond:
            self.broken = f"{type(e).__name__}: {e}"
            job, self._job = self._job, None
            self._busy = False
            self._cond.notify_all()
        if job is not None:
            job.drop()

    def _calibrate(self, job: _Job) -> None:
        """Compute ``job`` on each other candidate, timed; record the time once its bytes are checked."""
        for name in self.others:
            t = self.clock()
            res = job.work(self.chooser.candidates[name])
            seconds = self.clock() - t
            if (own := job.timed(res)) is not None:
                seconds = own
            self.stats["busy_s"] += seconds
            self.stats["units"] += 1
            try:
                if not job.same(res):
                    raise RuntimeError(f"--device auto: {self.first} and {name} computed different bytes for "
                                       f"{job.kind} (a kernel bug: run with --device cpu or --device cuda, "
                                       "and report it)")
            finally:
                job.discard(res)
            self.chooser.record(job.kind, name, seconds, job.nbytes)
