"""How a worker's streams compute a unit: on its one backend, or (``--device auto`` with a GPU) on the
GPU or the CPUs, whichever ``choose.Chooser`` measured faster for that kind of work.

On a GPU, what costs is moving the bytes, not the kernels (a kernel runs at the GPU memory's speed, the host's
copies at a small fraction of it), so a GPU unit is run so that its copies overlap and go at DMA speed:
- each stream computes on a CUDA stream of its own (threads on torch's default stream wait for each
  other's copies and synchronizations);
- the sources are copied from the pipeline's pooled read buffers, page-locked (``BufferPool.pin_with``),
  asynchronously;
- the results are copied back asynchronously into one page-locked pool buffer a unit (``compute.HostSink``),
  with a single synchronization at the end, not one blocking copy a tensor into fresh pageable memory.
The sink's buffer is counted in the worker's in-flight budget (a piece's cost includes its outputs) and
goes back to the pool once the writer has written and hashed it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

from ..compute_early import flat_bytes
from .choose import Calibrator, Choice, Chooser, decisive_kinds, work_kind

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from kimi_convert.kernels import Backend
    from kimi_convert.kernels.outputs import Arena

    from ..compute import UnitResult
    from ..devices import Device
    from ..plan import Unit
    from ..readers import BufferPool, Loaded
    from ..tuning import Tuning

Computed = tuple["UnitResult", "np.ndarray | None"]  # the result, and the pool buffer lent for its outputs


def candidates(device: Device, threads: int) -> dict[str, Backend]:
    """The backends a worker computes on, by name: one, or for ``auto`` (a GPU and the CPUs) the CPU's C
    kernels first, then the GPU's Triton kernels (made without touching CUDA: the GPU starts on auto's
    calibration thread, not in a stream; ``devices.worker_devices`` has seen a CUDA torch and at most one GPU listed,
    or the driver's count of them), or the CPU's alone where the driver then sees none."""
    import torch

    from kimi_convert.devices import Device as Dev
    from kimi_convert.devices import get_backend, gpu_count
    from kimi_convert.kernels import Backend

    if device.kind == "auto" and not gpu_count():  # (devices.worker_devices left it to confirm here)
        return {"cpu": get_backend(Dev("cpu"), threads)}
    if device.kind == "auto":
        return {"cpu": get_backend(Dev("cpu"), threads), "cuda": Backend("triton", torch.device("cuda", device.index),
                                                                         threads)}
    return {"cuda" if device.kind == "cuda" else device.kind: get_backend(device, threads)}


class Runner:
    """Computes units for a worker's streams on ``backends`` (name -> backend; several: auto, the CPU
    first). Thread-safe; each calling thread gets its own CUDA stream."""

    def __init__(self, backends: dict[str, Backend], pool: BufferPool, block: tuple[int, int],
                 units: list[Unit] = (), tuning: Tuning | None = None):
        """``units``: the worker's units to compute (auto: the kinds of work that can be decided); ``tuning``: auto's
        samples, margin and (the tests) whether the streams wait for the calibration thread."""
        from ..compute_early import EarlyCompute
        from ..tuning import Tuning

        tuning = tuning or Tuning()

        self.backends, self.pool, self.block = backends, pool, block
        cpu = backends.get("cpu")
        #: the CPU backend's units that ``compute_early`` takes are its (the same bytes in less time than through
        #: torch: benchmarks/RESULTS.md, "The figures behind the pipeline's constants")
        self.early = EarlyCompute(cpu.threads if cpu is not None else 1, block)
        self.chooser = (Chooser(backends, tuning.samples, on_decided=self._decided, margin=tuning.gpu_margin)
                        if len(backends) > 1 else None)
        self._local = threading.local()
        self._decisive = decisive_kinds(units, tuning.samples)
        gpu = [b for b in backends.values() if b.device.type == "cuda"]
        self._gpu = gpu[0] if gpu else None
        self.calibrator = Calibrator(self.chooser, start=self._start_others,
                                     wait=tuning.calibration_waits) if self.chooser else None
        self.copy_s = 0.0  # seconds the streams spent copying units for the calibration thread
        self._lock = threading.Lock()
        if self.chooser is None and self._gpu is not None:  # --device cuda: every unit's on the GPU
            pool.pin_with(*_pinning(self._gpu.device))

    def _start_others(self) -> None:
        """auto, on the calibration thread: start the GPU (its CUDA context), so that its first unit's time
        is its kernels' compiling, not the driver's start-up too."""
        if self._gpu is not None:
            import torch

            torch.cuda.init()
            torch.empty(1, device=self._gpu.device).zero_()
            torch.cuda.synchronize(self._gpu.device)

    def _decided(self, choice: Choice) -> None:
        """auto: the read buffers are page-locked only once a kind of work went to the GPU (locking costs the
        reader time, which the CPUs never gain back: docs/history/RESULTS-history.md, issue 26 item 9)."""
        if self._gpu is not None and self.backends[choice.chosen] is self._gpu and not self.pool.pinning:
            self.pool.pin_with(*_pinning(self._gpu.device))

    @property
    def name(self) -> str:
        return "auto" if self.chooser else next(iter(self.backends))

    def choices(self) -> list[Choice]:
        return self.chooser.choices() if self.chooser else []

    def calibration(self) -> dict:
        """auto: what the calibration thread did (for --stats): the GPU's start-up seconds, the units it
        computed and their seconds, the offers it declined (busy), the streams' seconds copying units for it."""
        if self.calibrator is None:
            return {}
        return {**self.calibrator.stats, "busy_s": round(self.calibrator.stats["busy_s"], 3),
                "copy_s": round(self.copy_s, 3), **({"broken": self.calibrator.broken} if self.calibrator.broken
                                                     else {})}

    def close(self, check: bool = True) -> None:
        """Stop the calibration thread (auto), then (``check``) raise what it found."""
        if self.calibrator is not None:
            self.calibrator.close()
            if check:
                self.calibrator.check()

    def compute(self, unit: Unit, loaded: Loaded) -> Computed:
        if self.chooser is None:
            return self._on(next(iter(self.backends.values())), unit, loaded)
        self.calibrator.check()
        kind = work_kind(unit)
        first = next(iter(self.backends.values()))
        if kind is None:  # nothing to compute: the CPU "computes" it (views of the read buffers)
            return self._on(first, unit, loaded)
        if (b := self.chooser.decided(kind)) is not None:
            return self._on(b, unit, loaded)
        # undecided: the CPUs compute it here, timed; the calibration thread may compute a copy on the others
        t = time.perf_counter()
        done = self._on(first, unit, loaded)
        self.chooser.record(kind, next(iter(self.backends)), time.perf_counter() - t, unit.nbytes_in)
        if kind in self._decisive and self.calibrator.take(kind):
            self._offer(kind, unit, loaded, done)
        return done

    def _offer(self, kind: str, unit: Unit, loaded: Loaded, done: Computed) -> None:
        """Give the calibration thread (reserved by ``take``) copies of ``unit``'s sources and of the CPU's result:
        the stream's own buffers go back to the pool as soon as its writer is done with them. Whatever fails
        here gives the reservation back (a stream waiting for the thread would wait forever)."""
        t = time.perf_counter()
        buf = None
        try:
            buf, copies, expected = self._copies(loaded, done[0])
            notes = done[0].notes
            with self._lock:
                self.copy_s += time.perf_counter() - t
        except BaseException:
            if buf is not None:
                self.pool.put(buf)
            self.calibrator.cancel()
            raise
        self.calibrator.give(kind, unit.nbytes_in, lambda b: self._on(b, unit, copies),
                             lambda r: _holds(r, expected, notes), discard=self.release,
                             release=lambda: self.pool.put(buf))

    def _copies(self, loaded: Loaded, res: UnitResult) -> tuple[np.ndarray, Loaded, dict[str, list[np.ndarray]]]:
        """One pool buffer (reused pages: no faults) holding copies of the sources and of ``res``'s outputs; the
        sources as a ``Loaded`` of views into it, the outputs as views by tensor name."""
        from ..readers import Loaded

        outs = {k: [flat_bytes(c) for c in o.chunks] for k, o in res.outputs.items()}
        buf = self.pool.get(sum(v.nbytes for v in loaded.buffers.values())
                            + sum(c.nbytes for cs in outs.values() for c in cs))
        off = 0

        def put(a: np.ndarray) -> np.ndarray:
            nonlocal off
            view = buf[off : off + a.nbytes]
            view[...] = flat_bytes(a)
            off += a.nbytes
            return view

        copies = Loaded({k: put(v).view(v.dtype).reshape(v.shape) for k, v in loaded.buffers.items()})
        return buf, copies, {k: [put(c) for c in cs] for k, cs in outs.items()}

    def release(self, done: Computed, reuse: bool = True) -> None:
        """Give a result's sink buffer back to the pool (the writer calls it once it is written and hashed;
        ``reuse=False`` where the shard's file hash still holds some of its bytes, to hash them in file order)."""
        if done[1] is not None:
            self.pool.put(done[1], reuse=reuse)

    def _sink_buffer(self, unit: Unit):
        from ..compute_early import sink_bytes

        return self.pool.get(sink_bytes(unit))

    def _on(self, b: Backend, unit: Unit, loaded: Loaded, buf: np.ndarray | None = None) -> Computed:
        """``unit`` computed on ``b`` into a pool buffer lent for its outputs (``buf``, or one taken here):
        on the CPUs the C kernels write into it (``kernels.outputs``: reused memory, where fresh outputs fault
        every page in: 2 M faults on 4.8 GB), on a GPU the results are read back into it (``compute.HostSink``)."""
        from kimi_convert.kernels.outputs import Arena

        from ..compute import HostSink, compute_unit

        if b.device.type != "cuda":
            if b.name == "cpu" and self.early.takes(unit):  # the C kernels without torch's steps around them
                return self.early.compute(unit, loaded, self.pool)
            if work_kind(unit) is None:
                return compute_unit(unit, loaded, b, self.block), None
            return self._lent(Arena(self._sink_buffer(unit)), lambda: compute_unit(unit, loaded, b, self.block))
        import torch

        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(b.device)
        sink = HostSink(self._sink_buffer(unit) if buf is None else buf)

        def run() -> UnitResult:
            with torch.cuda.stream(stream):
                res = compute_unit(unit, loaded, b, self.block)
                sink.finish()
            return res
        # on failure no copy may still write into the buffer once it is back
        return self._lent(sink, run, on_failure=stream.synchronize)

    def _lent(self, arena: Arena, run: Callable[[], UnitResult], on_failure: Callable[[], object] = lambda: None
              ) -> Computed:
        """``run()`` with ``arena`` lent to this thread; the buffer goes back to the pool at once where the unit
        failed or took nothing from it (the torch code ran: no C compiler, a NaN; nothing read back)."""
        from kimi_convert.kernels.outputs import reset_arena, use_arena

        token = use_arena(arena)
        try:
            res = run()
        except BaseException:
            with contextlib.suppress(Exception):
                on_failure()
            self.pool.put(arena.buf)
            raise
        finally:
            reset_arena(token)
        if arena.used == 0:
            self.pool.put(arena.buf)
            return res, None
        return res, arena.buf


def _holds(done: Computed, expected: dict[str, list[np.ndarray]], notes: dict) -> bool:
    """Whether a result holds the bytes and notes of ``expected`` (the first candidate's, copied)."""
    import numpy as np

    def joined(chunks) -> np.ndarray:
        flat = [flat_bytes(c) for c in chunks]
        return flat[0] if len(flat) == 1 else np.concatenate(flat) if flat else np.empty(0, np.uint8)

    res = done[0]
    return res.outputs.keys() == expected.keys() and res.notes == notes and all(
        np.array_equal(joined(res.outputs[k].chunks), joined(want)) for k, want in expected.items())


def _pinning(device):
    """(pin, unpin) for ``BufferPool.pin_with``: ``cudaHostRegister`` (portable: every context sees it as
    page-locked) through torch's binding of the CUDA runtime; pin answers False where it fails."""
    import torch

    rt = torch.cuda.cudart()
    if not hasattr(rt, "cudaHostRegister"):
        return None, None
    portable = 1  # cudaHostRegisterPortable
    failed = threading.Event()

    def pin(buf) -> bool:
        if failed.is_set():
            return False
        with torch.cuda.device(device):
            if int(rt.cudaHostRegister(buf.ctypes.data, buf.nbytes, portable)) == 0:
                return True
        failed.set()  # pageable from now on (slower copies, same bytes)
        _clear_cuda_error()
        return False

    def unpin(buf) -> None:
        with torch.cuda.device(device):
            rt.cudaHostUnregister(buf.ctypes.data)

    return pin, unpin


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed registration, so that torch's next launch check
    does not report it as its own (torch binds no cudaGetLastError: the loaded libcudart's is called)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        with open("/proc/self/maps") as f:
            path = next((line.split()[-1] for line in f if "libcudart" in line), None)
        if path:
            ctypes.CDLL(path).cudaGetLastError()
