"""How a worker's streams compute a unit (``Dispatch``): with the C kernels without torch (``compute_early``), timed
and offered to auto's probe process (``probe``), or by the worker's one runner (``runner``: torch's backends). Three
parts, one job each: ``RunnerOnce`` makes the runner once for all streams, ``GpuMeasuring`` decides how ``--device
auto`` measures the GPU, ``Dispatch`` picks the way for each unit."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

from ..errors import ConvertError

if TYPE_CHECKING:
    import numpy as np

    from ..compute_early import EarlyCompute, UnitResult
    from ..devices import Device
    from ..plan import Unit
    from ..readers import BufferPool, Loaded
    from ..tuning import Tuning
    from .probe import GpuProbe
    from .runner import Runner


class RunnerOnce:
    """The worker's runner, made on first use (this imports torch, and starts CUDA for a GPU), once for all streams:
    ``auto`` (a GPU and the CPUs) gets both backends, the CPU first, and measures which is faster."""

    def __init__(self, threads: int, buffers: BufferPool, units: list[Unit], tuning: Tuning):
        self.threads, self.buffers, self.units, self.tuning = threads, buffers, units, tuning
        self._runner: Runner | None = None
        self._lock = threading.Lock()
        self.backend_s = 0.0  # seconds to load torch and start the device

    def get(self, device: Device, block: tuple[int, int]) -> Runner:
        with self._lock:
            if self._runner is None:
                t = time.perf_counter()
                from . import runner

                try:
                    backends = runner.candidates(device, self.threads)
                except ValueError as e:  # e.g. a CPU-only torch asked for cuda
                    raise ConvertError(str(e)) from None
                self._runner = runner.Runner(backends, self.buffers, block, self.units, self.tuning)
                self.backend_s = time.perf_counter() - t
            return self._runner

    def made(self) -> Runner | None:
        """The runner, if a stream made it (one that only copies never does)."""
        return self._runner

    def make_soon(self, device: Device, block: tuple[int, int], wait: bool = False) -> None:
        """``auto``: the runner made on a thread of its own, while the streams compute their first units without
        torch (``Dispatch.early_takes``); a failure there is the first stream's own again, when it makes the runner
        (with a probe: the CPUs go on computing every unit). ``wait``: made on this thread (the tests' tiny inputs)."""
        def make() -> None:
            with contextlib.suppress(Exception):
                self.get(device, block)

        if wait:
            make()
        else:
            threading.Thread(target=make, daemon=True, name="kimi-convert-runner").start()


class GpuMeasuring:
    """``--device auto``: how the GPU is measured, decided on a thread of its own (a released checkpoint's plan has
    100,000+ units, too many to look at on the streams' start; until then they compute what ``compute_early`` takes,
    as with the runner not yet made): in a probe process where ``compute_early`` takes every unit (``probe``), started
    ``tuning.probe_after_s`` into the streams (a pack over by then never starts it), else by the runner in this
    process, made now. ``tuning.probe_waits`` (the tests): decided at once, the probe started at once."""

    def __init__(self, early: EarlyCompute, runners: RunnerOnce, threads: int, tuning: Tuning):
        self.early, self.runners, self.threads, self.tuning = early, runners, threads, tuning
        #: auto where the C kernels take every unit: the GPU measured in a probe process; the runner is then made
        #: only where the GPU wins a kind of work, with the GPU alone
        self.probe: GpuProbe | None = None
        #: stop has been called: no probe is started after it (an Event: it wakes a probe's start that waits)
        self._measured = threading.Event()
        self._probe_due = False  # the GPU is to be measured in a probe, not yet started
        self.skipped: dict = {}  # auto's probe not started, and why (--stats' calibration)
        self._lock = threading.Lock()

    def start(self, device: Device, block: tuple[int, int], jobs: list) -> None:
        if self.tuning.probe_waits:
            self._decide(device, block, jobs)
        else:
            threading.Thread(target=self._decide, args=(device, block, jobs), daemon=True,
                             name="kimi-convert-measure").start()

    def _decide(self, device: Device, block: tuple[int, int], jobs: list) -> None:
        from . import probe as probe_mod
        from .choose import decisive_kinds

        units = [u for j in jobs for u in j.units]
        if not all(self.early.takes(u) for u in units):
            self.runners.make_soon(device, block)
            return
        decisive = decisive_kinds(units, self.tuning.samples)
        self._probe_due = True
        if not self.tuning.probe_waits and self._measured.wait(self.tuning.probe_after_s):
            return  # (stop says so in skipped)
        with self._lock:
            if not self._measured.is_set():
                self.probe = probe_mod.GpuProbe(device, self.threads, block, decisive, self.tuning, on_gpu=lambda: (
                    self.runners.make_soon(self.gpu(device), block, wait=self.tuning.probe_waits)))

    def gpu(self, device: Device) -> Device:
        """The device a runner is made for: with a probe, the GPU alone (the kinds the GPU won; the CPUs' are
        ``compute_early``'s), else ``device``."""
        if self.probe is None:
            return device
        from ..devices import Device as Dev

        return Dev("cuda", self.probe.gpu.index)

    def stop(self) -> GpuProbe | None:
        """The run is over: no probe is started from now on; the one started, if any (to close)."""
        with self._lock:
            self._measured.set()
            if self.probe is None and self._probe_due:
                after = self.tuning.probe_after_s
                self.skipped = {"probe": False, "skipped": f"the pack ended within {after} s of its start "
                                "(Tuning.probe_after_s): the GPU not measured, every unit on the CPUs"}
            return self.probe


class Dispatch:
    """Which way a stream computes a unit. ``early``: the C kernels without torch (--device cpu and auto);
    ``measuring``: auto's."""

    def __init__(self, runners: RunnerOnce, early: EarlyCompute | None = None,
                 measuring: GpuMeasuring | None = None):
        self.runners, self.early, self.measuring = runners, early, measuring

    @property
    def probe(self) -> GpuProbe | None:
        return self.measuring.probe if self.measuring is not None else None

    def early_takes(self, unit: Unit, device: Device) -> bool:
        """Whether a stream computes ``unit`` without torch (``compute_early``): with --device cpu whatever that
        module takes; with auto only until the runner is made (then the runner measures the CPUs against the GPU
        and chooses, which the calibration tests need for every unit: ``Tuning.calibration_waits``)."""
        if self.early is None or not self.early.takes(unit):
            return False
        if device.kind == "cpu":
            return True
        made = self.runners.made()
        if (probe := self.probe) is not None:  # all but the kinds the GPU won, once their runner is made
            return made is None or not probe.on_gpu(unit)
        return made is None and not self.runners.tuning.calibration_waits

    def early_compute(self, unit: Unit, loaded: Loaded) -> tuple[UnitResult, np.ndarray | None]:
        """``unit`` computed by the C kernels (``early_takes``); with a probe, timed and offered to it."""
        buffers = self.runners.buffers
        if (probe := self.probe) is not None:
            return probe.compute(unit, loaded, self.early, buffers)
        return self.early.compute(unit, loaded, buffers)

    def runner(self, device: Device, block: tuple[int, int]) -> Runner:
        """The runner for a unit the C kernels do not compute here (made on first use)."""
        return self.runners.get(self.measuring.gpu(device) if self.measuring is not None else device, block)
