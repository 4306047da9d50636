"""``--device auto`` with a GPU: the GPU or the CPUs, whichever is faster, measured on the run's own work.

Which one wins depends on the recipe, not on the hardware alone: NVIDIA's MXFP4 -> NVFP4 cast is a few
integer operations a byte, so a GPU must first move every byte over PCIe and back, where 16 CPUs cast in
place; a BF16 weight quantized to NVFP4 or block FP8 is arithmetic the GPU does far faster. So each *kind
of work* (``work_kind``: the unit's operations, and its size within a factor of 4, since a launch costs
the same for 1 MB as for 100 MB) is calibrated on its own: its first units are computed on every
candidate, in the pipeline as it runs (so under the run's own load: hashing, reading, the other streams),
the first on each candidate only to warm up (Triton compiles its kernels then), the next ``SAMPLES`` timed.
The candidate with the lower median seconds per byte then computes every later unit of that kind. The
bytes are the same on every device by design (the tests and the GPU equality scripts hold each kernel to
the torch code); the calibration checks it again on the units it computes twice, and fails loudly if not.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .. import encodings
from ..plan import FP8, NVFP4, Encoding, Unit

#: Timed units per kind of work and candidate, after the warm-up one.
SAMPLES = 2
#: How many times faster than the CPUs the GPU's timed units must be for a kind of work to go to it. A unit
#: timed alone does not show what the GPU costs in steady state: the page-locking of every read buffer, one
#: GPU shared by all the worker's streams and their copies against the reader's (on the H200 machine the cast
#: was timed 1.29x faster on the GPU, 0.52 against 0.67 s/GB, and the pack then ran 10.95 s against the
#: CPUs' 8.59; benchmarks/RESULTS.md, issue 26). Where the GPU is the better device it wins by far more
#: (NVFP4 from BF16: 10-40x). ``KIMI_CONVERT_AUTO_GPU_MARGIN`` overrides it (1: the plain comparison).
GPU_MARGIN = float(os.environ.get("KIMI_CONVERT_AUTO_GPU_MARGIN", "1.5") or 1.5)
R = TypeVar("R")
B = TypeVar("B")


def work_kind(unit: Unit) -> str | None:
    """What computing ``unit`` takes, as a key for the calibration: its operations (``mxfp4-cast``,
    ``nvfp4``, ``nvfp4-from-mxfp4``, ``fp8-block``, ``decode``...) and its input size class (a factor of 4:
    ``@16MB`` holds 4-16 MB). None when it needs no kernel (bytes kept as they are)."""
    ops = set()
    for it in unit.items:
        coded = any(s.encoding != Encoding.DENSE for s in it.sources)
        if it.kind == NVFP4:
            cast = all(encodings.holds_mxfp4(s) for s in it.sources)  # as compute_unit decides
            ops.add("mxfp4-cast" if cast else "nvfp4" + (f"-from-{it.sources[0].encoding}" if coded else ""))
        elif it.kind == FP8:
            ops.add("fp8-block" + (f"-from-{it.sources[0].encoding}" if coded else ""))
        elif coded:
            ops.add(f"decode-{it.sources[0].encoding}")
    if not ops:
        return None
    size = 1 << 20
    while size < unit.nbytes_in:
        size *= 4
    return "+".join(sorted(ops)) + f"@{_mb(size)}"


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
    candidate must be that many times faster than the first to be chosen (:data:`GPU_MARGIN`)."""
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


class Chooser(Generic[B, R]):
    """The calibration, shared by a worker's streams (thread-safe). ``candidates``: name -> backend, the
    CPU first; ``run(kind, nbytes, compute, same)`` computes one unit: on the chosen backend once its kind is
    decided, else on every candidate (timing each; ``same(a, b)`` must hold between their results)."""

    def __init__(self, candidates: dict[str, B], samples: int = SAMPLES,
                 clock: Callable[[], float] = time.perf_counter,
                 on_decided: Callable[[Choice], None] = lambda c: None, margin: float = 1.0):
        self.candidates, self.samples, self.clock, self.on_decided = candidates, samples, clock, on_decided
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

    def run(self, kind: str, nbytes: int, compute: Callable[[B], R], same: Callable[[R, R], bool],
            discard: Callable[[R], None] = lambda r: None) -> R:
        """``compute``'s result for one unit of ``kind`` (``nbytes`` of input); ``discard`` gets the
        results of a calibration that are not returned (the first candidate's is)."""
        if (b := self.decided(kind)) is not None:
            return compute(b)
        results: dict[str, R] = {}
        try:
            for name, b in self.candidates.items():
                t = self.clock()
                results[name] = compute(b)
                self._record(kind, name, self.clock() - t, nbytes)
            first, *others = results
            for o in others:
                if not same(results[first], results[o]):
                    raise RuntimeError(f"--device auto: {first} and {o} computed different bytes for {kind} "
                                       "(a kernel bug: run with --device cpu or --device cuda, and report it)")
        except BaseException:
            for r in results.values():
                discard(r)
            raise
        for o in others:
            discard(results[o])
        return results[first]

    def _record(self, kind: str, name: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            k = self._kinds.setdefault(kind, _Kind())
            if name not in k.warm:  # the first unit of a kind warms its kernels up (Triton compiles them)
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
