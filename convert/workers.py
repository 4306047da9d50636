"""Several worker processes, one per GPU (or a share of the CPUs each), each running the pipeline
on its own consecutive output shards.

Processes rather than threads: each GPU is driven by its own host process, so the Python work of
one (launching kernels, hashing, writing) never waits on another's GIL. The parent owns the resume
journal and the progress bar: a worker reports each finished shard's record and its progress on a
queue, and at the end the hashes of the input files it was given. Workers are started with
``spawn`` (CUDA cannot be used in a forked child) and with SIGINT ignored: Ctrl-C reaches the whole
process group, and the parent alone decides to stop them, so no worker prints a traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import traceback
from collections.abc import Callable

from .devices import Device
from .errors import ConvertError
from .journal import ShardRecord
from .pipeline import Job, JobResult, cpu_share, run_jobs
from .tuning import Tuning


def die_with(parent: int) -> None:
    """A worker must not outlive its parent: a killed pack would leave it writing into files that a
    resumed pack writes too. Linux: the kernel sends SIGKILL when the parent dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def _main(index: int, jobs: list[Job], device: Device, threads: int, q, parent: int, tuning: Tuning) -> None:
    die_with(parent)
    pending = 0

    def progress(n: int) -> None:
        nonlocal pending
        pending += n
        if pending >= tuning.progress_step:
            q.put(("progress", index, pending))
            pending = 0

    try:
        res = run_jobs(jobs, device, lambda f, rec: q.put(("shard", index, (f, rec))), progress, threads=threads,
                       tuning=tuning)
        q.put(("progress", index, pending))
        q.put(("done", index, res))
    except ConvertError as e:
        q.put(("error", index, str(e)))
    except BaseException:  # a bug: the parent shows it, with where it happened
        q.put(("crash", index, traceback.format_exc()))


def run(jobs: list[list[Job]], devices: list[Device], on_shard: Callable[[str, ShardRecord], None],
        on_progress: Callable[[int], None], *, cpus: int, tuning: Tuning | None = None) -> list[JobResult]:
    """Worker ``i`` runs the streams ``jobs[i]`` on ``devices[i]`` with an equal share of ``cpus``
    (``devices.cpus()``, handed to it as an argument) and ``tuning`` (pack's, pickled to it); returns every stream's
    result."""
    tuning = tuning or Tuning()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    threads = cpu_share(cpus, len(jobs))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec by the workers
    try:
        procs = [ctx.Process(target=_main, args=(i, job, devices[i], threads, q, os.getpid(), tuning),
                             name=f"kimi-convert-worker-{i}") for i, job in enumerate(jobs)]
        for p in procs:
            p.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    results: dict[int, list[JobResult]] = {}

    def handle(kind: str, i: int, payload) -> None:
        if kind == "progress":
            on_progress(payload)
        elif kind == "shard":
            on_shard(*payload)
        elif kind == "done":
            results[i] = payload
        elif kind == "error":
            raise ConvertError(payload)
        else:
            raise RuntimeError(f"worker {i} ({devices[i]}) failed:\n{payload}")

    try:
        while len(results) < len(jobs):
            try:
                handle(*q.get(timeout=0.5))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in results and p.exitcode is not None]
                if dead:
                    _drain(q, handle)
                    for i in dead:
                        if i not in results:
                            raise ConvertError(f"worker {i} ({devices[i]}) ended without finishing (exit code "
                                               f"{procs[i].exitcode}); the finished shards are kept, rerun with "
                                               "--resume") from None
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        # the shards workers finished before they stopped are still worth journaling
        _drain(q, lambda kind, i, payload: on_shard(*payload) if kind == "shard" else None)
        raise
    for p in procs:
        p.join()
    return [r for i in range(len(jobs)) for r in results[i]]


def _drain(q, handle: Callable) -> None:
    """Handle what is left on the queue (the workers have stopped or are stopping)."""
    while True:
        try:
            msg = q.get(timeout=0.1)
        except (queue.Empty, OSError, EOFError, ValueError):
            return
        handle(*msg)
