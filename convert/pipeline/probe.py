"""``--device auto`` with a GPU, where every unit of the plan can be computed without torch: the GPU is measured in a
process of its own (the *probe*), and this one imports torch only if the GPU wins a kind of work.

Why: measured in this process, the GPU cost the streams what they never gained back where the CPUs won: ``import
torch``, the GPU's start and the calibration's GPU units ran on a thread holding the interpreter's lock the streams
need, for seconds, and ``auto`` was slower than ``cpu`` with every kind of work decided for the CPUs (the figures:
benchmarks/RESULTS.md, "The figures behind the pipeline's constants"). In a process of its own they hold no lock of
this one's.

How, kind of work by kind of work (``choose.work_kind``), as the calibration in this process does (``choose``):
- the streams compute every unit with the C kernels (``compute_early``), the undecided kinds' timed;
- a unit of an undecided kind is given, when the probe is idle (a stream never waits for it), to the probe: its
  sources and plan entry, pickled down a pipe; the probe computes it on the GPU (``Runner``, its one backend),
  times it there (the pipe's copies are not the GPU's cost) and answers its outputs' digests and notes, which must
  be the CPUs' (a kernel bug fails the run, as in this process);
- the Chooser decides with the same warm-up, samples and margin. A kind decided for the GPU is computed from then
  on by a runner made in this process, on a thread (torch imported, the GPU started and the read buffers
  page-locked there), the CPUs computing that kind's units until it is made.
A probe that cannot start or dies leaves every kind on the CPUs (its last line of stderr in ``--stats``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..compute_early import flat_bytes
from ..hashing import new_digest
from .choose import Calibrator, CandidateLost, Chooser, work_kind

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from ..compute_early import EarlyCompute, UnitResult
    from ..devices import Device
    from ..plan import Unit
    from ..readers import BufferPool, Loaded
    from ..tuning import Tuning


def child_device(gpu: Device) -> str:
    """The ``--device`` the probe computes on: auto's GPU (the tests put the torch code on the CPU in its place)."""
    return f"cuda:{gpu.index or 0}"


def chunks_of(res: UnitResult) -> dict[str, list]:
    """A unit's outputs: each tensor's chunks, by name."""
    return {k: o.chunks for k, o in res.outputs.items()}


def output_digests(outputs: dict[str, list]) -> dict[str, str]:
    """Each output tensor's digest (``hashing.TENSOR_DIGEST``, its chunks back to back, ``chunks_of``): what the
    probe answers, to be the CPUs'."""
    out = {}
    for name, chunks in outputs.items():
        h = new_digest()
        for c in chunks:
            h.update(c if isinstance(c, bytes) else flat_bytes(c))
        out[name] = h.hexdigest()
    return out


@dataclass(frozen=True)
class Answer:
    """The probe's result for one unit: its seconds on the GPU, its outputs' digests, its notes."""

    seconds: float
    digests: dict[str, str]
    notes: dict


class Probe:
    """The probe process: spawned at once (``python -m kimi_convert.pipeline.probe DEVICE THREADS BM BN``, the
    checkpoint's FP8 tile), ready once it has imported torch and started the GPU (:meth:`ready`); one unit at a time
    (:meth:`compute`). ``exit_s``: how long a probe that ended is waited for, for its exit status."""

    def __init__(self, device: str, threads: int, block: tuple[int, int], exit_s: float):
        self.device, self.exit_s = device, exit_s
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - open for the probe's life, closed by close()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torch's own CPU threads: none of the streams' CPUs
        self._proc = subprocess.Popen([sys.executable, "-m", "kimi_convert.pipeline.probe", device, str(threads),
                                       *map(str, block)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env)
        self._stopped = False

    def ready(self) -> None:
        """Wait until the probe can compute (raises CandidateLost where it cannot: no GPU after all)."""
        msg = self._receive()
        if "error" in msg:
            raise CandidateLost(f"the probe could not start {self.device}: {msg['error']}")

    def compute(self, request: bytes) -> Answer:
        """``request``: a pickled ``(unit, buffers)``. A kernel's error is raised as RuntimeError."""
        try:
            self._proc.stdin.write(request)
            self._proc.stdin.flush()
        except OSError:
            raise CandidateLost(self._lost()) from None
        msg = self._receive()
        if "error" in msg:
            raise RuntimeError(f"--device auto: {self.device} failed on a unit: {msg['error']}")
        return Answer(msg["seconds"], msg["digests"], msg["notes"])

    def _receive(self) -> dict:
        try:
            return pickle.load(self._proc.stdout)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):
            raise CandidateLost(self._lost()) from None

    def _lost(self) -> str:
        """Why the probe is gone: its exit status and the last line it wrote on stderr."""
        if self._stopped:
            return f"the pack was done before the probe on {self.device} answered"
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(self.exit_s)
        self._err.seek(0)
        lines = [x for x in self._err.read().decode(errors="replace").splitlines() if x.strip()]
        return f"the probe on {self.device} ended (exit {self._proc.returncode})" + (f": {lines[-1]}" if lines else "")

    def stop(self) -> None:
        """End the probe now, whatever it is doing (importing torch, computing a unit): the pack is done and never
        waits for it. A thread waiting on its answer gets CandidateLost."""
        self._stopped = True
        with contextlib.suppress(OSError):
            self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        """Once no thread reads from the probe: its pipes and stderr file closed (the probe stopped first)."""
        self.stop()
        for f in (self._proc.stdin, self._proc.stdout, self._err):
            with contextlib.suppress(OSError):
                f.close()


class GpuProbe:
    """A worker's calibration against a GPU in a probe process (the module's docstring): shared by its streams.
    ``decisive``: the kinds of work to measure (``choose.decisive_kinds``). ``on_gpu()`` is called once, on the first
    kind decided for the GPU (the worker then makes its GPU runner). ``tuning``: the samples and margin, the probe's
    exit wait and (the tests) whether a stream waits for the probe."""

    def __init__(self, gpu: Device, threads: int, block: tuple[int, int], decisive: set[str], tuning: Tuning,
                 on_gpu: Callable[[], None]):
        self.gpu, self.decisive, self._on_gpu = gpu, decisive, on_gpu
        self.chooser = Chooser({"cpu": "cpu", "cuda": "cuda"}, tuning.samples, on_decided=self._decided,
                               margin=tuning.gpu_margin)
        self.process = Probe(child_device(gpu), threads, block, tuning.probe_exit_s) if decisive else None
        self.calibrator = Calibrator(self.chooser, start=self.process.ready if self.process else lambda: None,
                                     wait=tuning.probe_waits)
        self._gpu_called = False
        self._lock = threading.Lock()

    def on_gpu(self, unit: Unit) -> bool:
        """Whether ``unit``'s kind of work was decided for the GPU."""
        kind = work_kind(unit)
        return kind is not None and self.chooser.decided(kind) == "cuda"

    def compute(self, unit: Unit, loaded: Loaded, early: EarlyCompute, pool: BufferPool
                ) -> tuple[UnitResult, np.ndarray | None]:
        """``unit`` computed by the C kernels; timed where its kind is undecided, and offered to the probe."""
        self.calibrator.check()
        kind = work_kind(unit)
        if kind is None or self.chooser.decided(kind) is not None:
            return early.compute(unit, loaded, pool)
        t = time.perf_counter()
        done = early.compute(unit, loaded, pool)
        self.chooser.record(kind, "cpu", time.perf_counter() - t, unit.nbytes_in)
        if self.process is not None and kind in self.decisive and self.calibrator.take(kind):
            self._offer(kind, unit, loaded, done[0])
        return done

    def _offer(self, kind: str, unit: Unit, loaded: Loaded, res: UnitResult) -> None:
        """Give the probe (reserved by ``take``) a pickled copy of ``unit``'s sources: the stream's buffers go back
        to the pool as soon as its writer is done with them. A failure here gives the reservation back."""
        try:
            request = pickle.dumps((unit, dict(loaded.buffers)), protocol=pickle.HIGHEST_PROTOCOL)
            # the outputs copied (their digests taken on the calibration thread: a copy is several times faster
            # than a hash, and this is the stream's time)
            outputs = {k: [flat_bytes(c).tobytes() for c in cs] for k, cs in chunks_of(res).items()}
            notes = res.notes
        except BaseException:
            self.calibrator.cancel()
            raise
        self.calibrator.give(kind, unit.nbytes_in, lambda name: self.process.compute(request),
                             lambda a: a.digests == output_digests(outputs) and a.notes == notes,
                             timed=lambda a: a.seconds)

    def _decided(self, choice) -> None:
        with self._lock:  # (the streams and the calibration thread both record: either may decide)
            first = choice.chosen == "cuda" and not self._gpu_called
            self._gpu_called = self._gpu_called or first
        if first:
            self._on_gpu()

    def choices(self):
        return self.chooser.choices()

    def stats(self) -> dict:
        """For --stats: the probe's start-up seconds (``start_s``), the units it computed and their seconds (its own
        timing), the offers declined (busy), why it could not be used."""
        c = self.calibrator
        return {**c.stats, "busy_s": round(c.stats["busy_s"], 3), "probe": True,
                **({"broken": c.broken} if c.broken else {})}

    def close(self, check: bool = True) -> None:
        """Stop the calibration thread and the probe, then (``check``) raise what the calibration found."""
        if self.process is not None:
            self.process.stop()  # first: the calibration thread may be waiting for it
        try:
            self.calibrator.close()
        finally:
            if self.process is not None:
                self.process.close()
        if check:
            self.calibrator.check()


# -- the probe process ------------------------------------------------------------------------------------------------

def _serve(device: str, threads: int, block: tuple[int, int], inp, out) -> int:
    """The probe's loop: start the device, say ready, then answer one pickled unit at a time until stdin closes."""
    def send(msg: dict) -> None:
        pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()

    try:
        import torch

        from kimi_convert.devices import get_backend, resolve_device

        from ..readers import BufferPool, Loaded
        from .runner import Runner

        backend = get_backend(resolve_device(device), threads)
        if backend.device.type == "cuda":
            torch.cuda.init()
            torch.empty(1, device=backend.device).zero_()
            torch.cuda.synchronize(backend.device)
        runner = Runner({backend.name: backend}, BufferPool(limit=1 << 34), block)
    except Exception as e:  # any failure to start is the answer: the CPUs compute everything
        send({"error": f"{type(e).__name__}: {e}"})
        return 1
    send({"ready": True})
    while True:
        try:
            unit, buffers = pickle.load(inp)
        except EOFError:
            return 0
        try:
            t = time.perf_counter()
            done = runner.compute(unit, Loaded(buffers))
            seconds = time.perf_counter() - t
            msg = {"seconds": seconds, "digests": output_digests(chunks_of(done[0])), "notes": done[0].notes}
            runner.release(done)
        except Exception as e:  # reported to the pack, which fails the run with it
            msg = {"error": f"{type(e).__name__}: {e}"}
        send(msg)


def main(argv: list[str]) -> int:
    """``python -m kimi_convert.pipeline.probe DEVICE THREADS BM BN``: the protocol on the stdout it was given,
    whatever else is printed (torch's, Triton's warnings) on stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return _serve(argv[0], int(argv[1]), (int(argv[2]), int(argv[3])), sys.stdin.buffer, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
