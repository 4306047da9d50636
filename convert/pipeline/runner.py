"""How a worker's streams compute a unit: on its one backend, or (``--device auto`` with a GPU) on the
GPU or the CPUs, whichever ``choose.Chooser`` measured faster for that kind of work.

On a GPU, what costs is moving the bytes, not the kernels (the MXFP4 cast runs at 1.6 TB/s on the H200,
the host's copies at 7-50 GB/s), so a GPU unit is run so that its copies overlap and go at DMA speed:
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
import os
import threading
from collections import Counter
from typing import TYPE_CHECKING

from .choose import GPU_MARGIN, SAMPLES, Choice, Chooser, work_kind

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from kimi_convert.kernels import Backend
    from kimi_convert.kernels.outputs import Arena

    from ..compute import UnitResult
    from ..devices import Device
    from ..plan import Unit
    from ..readers import BufferPool, Loaded

#: ``0``: leave the read buffers pageable on a GPU (to measure what page-locking them gains; same bytes)
PIN_ENV = "KIMI_CONVERT_PIN_BUFFERS"
#: ``0``: CPU kernels allocate fresh outputs instead of writing into a lent pool buffer (to measure what it gains)
ARENA_ENV = "KIMI_CONVERT_OUTPUT_ARENA"
Computed = tuple["UnitResult", "np.ndarray | None"]  # the result, and the pool buffer lent for its outputs


def candidates(device: Device, threads: int) -> dict[str, Backend]:
    """The backends a worker computes on, by name: one, or for ``auto`` (a GPU and the CPUs) the CPU's C
    kernels first, then the GPU's Triton kernels."""
    from kimi_convert.devices import Device as Dev
    from kimi_convert.kernels import get_backend

    if device.kind == "auto":
        return {"cpu": get_backend(Dev("cpu"), threads), "cuda": get_backend(device, threads)}
    return {"cuda" if device.kind == "cuda" else device.kind: get_backend(device, threads)}


class Runner:
    """Computes units for a worker's streams on ``backends`` (name -> backend; several: auto, the CPU
    first). Thread-safe; each calling thread gets its own CUDA stream."""

    def __init__(self, backends: dict[str, Backend], pool: BufferPool, block: tuple[int, int],
                 units: list[Unit] = ()):
        """``units``: the worker's units to compute (auto: the kinds of work that will be decided)."""
        self.backends, self.pool, self.block = backends, pool, block
        self.chooser = Chooser(backends, on_decided=self._decided, margin=GPU_MARGIN) if len(backends) > 1 else None
        self._local = threading.local()
        counts = Counter(k for u in units if (k := work_kind(u)) is not None)
        # kinds with units enough to be decided (a warm-up and the samples); the others run on every candidate
        self._decisive = {k for k, n in counts.items() if n > SAMPLES}
        gpu = [b for b in backends.values() if b.device.type == "cuda"]
        self._gpu = gpu[0] if gpu else None
        if gpu and os.environ.get(PIN_ENV, "1") != "0":
            pool.pin_with(*_pinning(gpu[0].device))

    def _decided(self, _: Choice) -> None:
        """auto: once every kind of work that can be decided is, and none went to the GPU, the read buffers
        need not be page-locked (locking costs the reader time: benchmarks/RESULTS.md)."""
        choices = self.chooser.choices()
        if self._decisive <= {c.kind for c in choices} and all(self.backends[c.chosen] is not self._gpu
                                                              for c in choices):
            self.pool.pin_with(None, None)

    @property
    def name(self) -> str:
        return "auto" if self.chooser else next(iter(self.backends))

    def choices(self) -> list[Choice]:
        return self.chooser.choices() if self.chooser else []

    def compute(self, unit: Unit, loaded: Loaded) -> Computed:
        if self.chooser is None:
            return self._on(next(iter(self.backends.values())), unit, loaded)
        kind = work_kind(unit)
        if kind is None:  # nothing to compute: the CPU "computes" it (views of the read buffers)
            return self._on(self.backends["cpu"], unit, loaded)
        if (b := self.chooser.decided(kind)) is not None:
            return self._on(b, unit, loaded)
        if self.pool.pinning and self.pool.pinned_bytes and not all(self.pool.pinned(v)
                                                                     for v in loaded.buffers.values()):
            # read before page-locking began (the first pieces, while torch loaded): timing the GPU on these
            # pageable copies would not be its steady state; the CPU computes them, untimed (where locking
            # fails from the start, nothing is locked and the GPU is timed on pageable buffers)
            return self._on(self.backends["cpu"], unit, loaded)
        # calibrating: the GPU's host buffer is taken (and page-locked) before its time is taken
        buf, used = self._sink_buffer(unit) if self._gpu is not None else None, []

        def on(b: Backend) -> Computed:
            if b is self._gpu:
                used.append(b)
                return self._on(b, unit, loaded, buf)
            return self._on(b, unit, loaded)

        try:
            return self.chooser.run(kind, unit.nbytes_in, on, _same, discard=self.release)
        finally:
            if buf is not None and not used:
                self.pool.put(buf)

    def release(self, done: Computed, reuse: bool = True) -> None:
        """Give a result's sink buffer back to the pool (the writer calls it once it is written and hashed;
        ``reuse=False`` where the shard's file hash still holds some of its bytes, to hash them in file order)."""
        if done[1] is not None:
            self.pool.put(done[1], reuse=reuse)

    def _sink_buffer(self, unit: Unit):
        # the outputs' bytes, plus each read-back's alignment (64 bytes) and a page of slack
        return self.pool.get(unit.nbytes_out + 4096 + 64 * sum(len(it.sources) * len(it.outputs) for it in unit.items))

    def _on(self, b: Backend, unit: Unit, loaded: Loaded, buf: np.ndarray | None = None) -> Computed:
        """``unit`` computed on ``b`` into a pool buffer lent for its outputs (``buf``, or one taken here):
        on the CPUs the C kernels write into it (``kernels.outputs``: reused memory, where fresh outputs fault
        every page in: 2 M faults on 4.8 GB), on a GPU the results are read back into it (``compute.HostSink``)."""
        from kimi_convert.kernels.outputs import Arena

        from ..compute import HostSink, compute_unit

        if b.device.type != "cuda":
            if work_kind(unit) is None or os.environ.get(ARENA_ENV, "1") == "0":
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


def _same(a: Computed, b: Computed) -> bool:
    """Whether two devices' results hold the same bytes and notes."""
    ra, rb = a[0], b[0]
    if ra.outputs.keys() != rb.outputs.keys() or ra.notes != rb.notes:
        return False
    return all(b"".join(bytes(c) for c in ra.outputs[k].chunks) == b"".join(bytes(c) for c in rb.outputs[k].chunks)
               for k in ra.outputs)


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
