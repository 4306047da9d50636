"""``pack --ray``: the plan's output shards spread over a Ray cluster.

Every node must see the input and output folders at the same absolute paths (a shared filesystem)
and have the same kimi-convert installed. The driver (the ``pack`` process) plans, cuts the shards
to write into runs of consecutive shards (``jobs.split_jobs``), one per task slot of the cluster,
and submits one Ray task per run. A task runs the ordinary pipeline (``pipeline.run_jobs``) on its
node, reading the input and writing its shards straight to the shared output folder; through Ray
it sends back only small things: each finished shard's record (hashes and notes, as the resume
journal keeps them) and, at the end, the digests of the input files it hashed. The driver journals
each shard as its record arrives, and writes configs, index and manifest as a local pack does.
A Hub input (``hf://``) needs no shared input: each task downloads its own job's files, and with
``--upload --no-keep-output`` uploads its own shards, no shared output either (``sources.hubstage`` stages
its inputs, ``run_hub_task`` below converts and uploads).

Placement: where nodes have GPUs, GPU tasks (``--device auto`` or ``cuda``; one to four tasks a
GPU, like a local worker's streams, each with its share of the node's CPUs); else CPU tasks of up
to 4 CPUs each (the C kernel and the hashing threads use them).

Retries: a task whose worker process or node dies is re-run by Ray (``RETRIES`` times). A task is
a generator that yields its shards' records in plan order, then its result: the same items in the
same order on every attempt, so Ray's replay of a retried generator (which passes on only the items
the earlier attempt had not sent) hands the driver every record exactly once. A re-run writes each
shard again from scratch (a ``.partial`` file is truncated, filled and renamed over whatever a dead
attempt left), except the shards the driver has already journaled, which it re-hashes against the
journal and keeps, as ``--resume`` does. Pack output is a function of the plan alone, so a re-run
shard is byte-identical to the first attempt's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import filenames
from .devices import resolve_device
from .errors import ConvertError
from .journal import Journal, ShardRecord, intact
from .pipeline import Job, JobResult, run_jobs

if TYPE_CHECKING:
    from .sources.hubstage import HubTask
    from .tuning import Tuning

#: Times Ray re-runs a task whose worker process or node died.
RETRIES = 3
INSTALL = "pip install 'kimi-convert[ray]'"
#: Seconds to wait for the cluster's address to answer.
PROBE_S = 10
#: Environment variables a task takes from the driver (the settings a local pack's workers inherit).
FORWARDED = "KIMI_CONVERT_"


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConvertError(f"--ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


@dataclass(frozen=True)
class Placement:
    device: str  # what each task's pipeline runs on: "cuda" (the GPU Ray gave it) or a CPU backend
    num_cpus: int  # per task
    num_gpus: float  # per task (a fraction: tasks that share a GPU)
    slots: int  # tasks that run at once on the cluster


def placement(device: str, nodes: list[dict]) -> Placement:
    """The tasks' shape from the alive nodes' resources (``ray.nodes()``) and ``--device``."""
    if device.startswith("cuda:"):
        raise ConvertError(f"--device {device} names a GPU of this machine; with --ray, GPU tasks run with "
                           "--device cuda or auto (Ray gives each task its GPU)")
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    gpu = [r for r in alive if r.get("GPU", 0) >= 1 and r.get("CPU", 0) >= 1]
    if device in ("auto", "cuda") and gpu:
        per_gpu = max(1, min(int(r["CPU"] // r["GPU"]) for r in gpu))
        share = max(1, min(4, per_gpu // 4))  # tasks a GPU, as a local worker's streams: one per 4 of its CPUs
        cpus = max(1, per_gpu // share)
        slots = sum(min(int(r["GPU"]) * share, int(r["CPU"] // cpus)) for r in gpu)
        return Placement("cuda", cpus, int(10_000 / share) / 10_000, slots)
    if device == "cuda":
        raise ConvertError("--device cuda: no node of the Ray cluster has a GPU")
    cpu = [r for r in alive if r.get("CPU", 0) >= 1]
    if not cpu:
        raise ConvertError("the Ray cluster has no node with a CPU to run tasks on")
    cpus = max(1, min(4, min(int(r["CPU"]) for r in cpu)))
    return Placement("cpu" if device == "auto" else device, cpus, 0, sum(int(r["CPU"]) // cpus for r in cpu))


@dataclass
class Cluster:
    """A connection to a Ray cluster and the shape of the tasks to run on it."""

    address: str | None
    placement: Placement
    owned: bool  # this process called ray.init, so it shuts the connection down (a local cluster with it)

    def run(self, jobs: list[Job], on_shard: Callable[..., None], on_progress: Callable[[int], None],
            hub: list[HubTask] | None = None, env: dict[str, str] | None = None,
            tuning: Tuning | None = None) -> list[JobResult]:
        try:
            return run(jobs, self.placement, on_shard, on_progress, hub, env, tuning)
        finally:
            self.close()

    def close(self) -> None:
        if self.owned:
            import_ray().shutdown()
            self.owned = False


def connect(address: str | None, device: str) -> Cluster:
    """Join the cluster at ``address`` (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``; None: the
    cluster ``RAY_ADDRESS`` or ``ray start`` names on this machine, else a new local one)."""
    ray = import_ray()
    owned = not ray.is_initialized()
    where = f"--ray {address}" if address else "--ray"
    if owned:
        try:
            _probe(address)
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, include_dashboard=False)
        except Exception as e:  # ConnectionError, a bad address, a client without ray[client]...
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConvertError(f"{where}: cannot reach the Ray cluster: {reason}") from None
    try:
        return Cluster(address, placement(device, ray.nodes()), owned)
    except BaseException:
        if owned:
            ray.shutdown()
        raise


def _probe(address: str | None) -> None:
    """A TCP connection to the cluster's address first: Ray's own client keeps retrying an
    unreachable address for minutes, printing a warning every few seconds."""
    if address and address.startswith("ray://"):
        target: str | None = address[len("ray://"):]
    else:  # None / auto: RAY_ADDRESS, else the cluster `ray start` recorded on this machine
        from ray._private.services import canonicalize_bootstrap_address

        target = canonicalize_bootstrap_address(address)
    if target is None:  # a new local cluster
        return
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"nothing answers at {target} ({getattr(e, 'strerror', None) or e})") from None


def _shard_runs(job: Job) -> str:
    return f"{job.shards[0].file}..{job.shards[-1].file}" if job.shards else "(no shards)"


def run(jobs: list[Job], p: Placement, on_shard: Callable[..., None], on_progress: Callable[[int], None],
        hub: list[HubTask] | None = None, env: dict[str, str] | None = None,
        tuning: Tuning | None = None) -> list[JobResult]:
    """One Ray task per job; ``on_shard(file, record)`` as each shard's record arrives (a Hub input's task:
    ``on_shard(file, record, Arrived)`` where it sends more), ``on_progress`` with the shard's input
    bytes. ``hub``: each job's ``hubstage.HubTask`` (a Hub input); ``env``: more of the tasks' environment
    (``hubstage.task_env``); ``tuning``: pack's, pickled to each task. Returns the jobs' results in order."""
    ray = import_ray()
    remote = ray.remote(_task)
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)} | (env or {})
    jobs = [dataclasses.replace(j, source=j.source.for_worker(), output_dir=j.output_dir.absolute())
            for j in jobs]
    in_bytes: dict[str, int] = {}
    for j in jobs:
        for u in j.units:
            in_bytes[u.shard] = in_bytes.get(u.shard, 0) + u.nbytes_in
    gens = {}
    for i, job in enumerate(jobs):
        opts = {"num_cpus": p.num_cpus, "max_retries": RETRIES, "retry_exceptions": False,
                "runtime_env": {"env_vars": env}, "name": f"kimi-convert {_shard_runs(job)}"}
        if p.num_gpus:
            opts["num_gpus"] = p.num_gpus
        gens[i] = remote.options(**opts).remote(job, p.device, p.num_cpus, hub[i] if hub else None, tuning)
    results: dict[int, JobResult] = {}
    try:
        while gens:
            ready, _ = ray.wait(list(gens.values()), num_returns=1, timeout=0.5)
            for gen in ready:
                i = next(k for k, g in gens.items() if g is gen)
                try:
                    item = ray.get(next(gen))
                except StopIteration:
                    del gens[i]
                    continue
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, ConvertError):
                        raise ConvertError(str(e.cause)) from None
                    raise RuntimeError(f"the Ray task for shards {_shard_runs(jobs[i])} failed:\n{e}") from None
                except ray.exceptions.RayError as e:
                    reason = (str(e).strip().splitlines() or [""])[0]
                    raise ConvertError(f"the Ray task for shards {_shard_runs(jobs[i])} failed ({type(e).__name__}: "
                                       f"{reason}), {RETRIES} retries included; the finished shards are kept, rerun "
                                       "with --resume") from None
                if item[0] == "shard":
                    on_shard(*item[1:])
                    on_progress(in_bytes.get(item[1], 0))
                else:
                    results[i] = item[1]
    except BaseException:
        for gen in gens.values():  # no task may go on writing into the output once the driver stops
            with contextlib.suppress(Exception):
                ray.cancel(gen, force=True)
        raise
    missing = [_shard_runs(jobs[i]) for i in range(len(jobs)) if i not in results]
    if missing:
        raise RuntimeError(f"Ray task(s) for shards {', '.join(missing)} ended without a result")
    return [results[i] for i in range(len(jobs))]


# -- on the node ----------------------------------------------------------------------------------


def kept_shards(job: Job) -> dict[str, ShardRecord]:
    """The job's shards an earlier attempt of this task finished and the driver journaled, whose
    file and records file still hash to the journaled values (a first attempt finds none, without
    reading the journal)."""
    if not any((job.output_dir / s.file).exists() for s in job.shards):
        return {}
    try:
        j = Journal.load(job.output_dir)
    except ConvertError:
        return {}
    kept = {}
    for s in job.shards if j else []:
        rec = j.shards.get(s.file)
        if rec is not None and rec.size == s.size and intact(job.output_dir, s.file, rec):
            kept[s.file] = rec
    return kept


def _task(job: Job, device: str, threads: int, hub: HubTask | None = None, tuning: Tuning | None = None
          ) -> Iterator[tuple]:
    """One attempt at a job, on a Ray worker: yields ("shard", file, record) for each of its shards (a Hub
    input's task, where it sends more: ("shard", file, record, Arrived)), in plan order, then
    ("done", JobResult). ``hub``: the job reads a Hub input (``run_hub_task``)."""
    kept = kept_shards(job) if hub is None or not hub.local_output else {}
    todo = dataclasses.replace(job, shards=[s for s in job.shards if s.file not in kept],
                               units=[u for u in job.units if u.shard not in kept])
    finished: queue.Queue = queue.Queue()
    out: dict[str, object] = {}

    def emit(f: str, rec: ShardRecord, more: object = None) -> None:
        finished.put((f, (rec,) if more is None else (rec, more)))

    def work() -> None:
        try:
            if hub is not None:
                out["result"] = run_hub_task(todo, device, threads, hub, emit, tuning)
            else:
                out["result"] = run_jobs([todo], resolve_device(device), emit, threads=threads, tuning=tuning)[0]
        except BaseException as e:
            out["error"] = e
        finally:
            finished.put(None)

    worker = threading.Thread(target=work, daemon=True, name="kimi-convert-ray-task")
    worker.start()
    order = [s.file for s in job.shards]
    ready: dict[str, tuple] = {f: (rec,) for f, rec in kept.items()}
    sent = 0
    while True:
        while sent < len(order) and order[sent] in ready:
            yield ("shard", order[sent], *ready.pop(order[sent]))
            sent += 1
        item = finished.get()
        if item is None:
            break
        ready[item[0]] = item[1]
    worker.join()
    if "error" in out:
        raise out["error"]
    if sent != len(order):
        raise RuntimeError(f"shards not finished: {order[sent:]}")
    yield ("done", out["result"])


# -- a Hub input's task: its own downloads (``sources.hubstage``), its own uploads ---------------------------


@dataclass(frozen=True)
class Arrived:
    """What a task sends with a shard's record: its records file (None: written in OUTPUT by the task) and,
    where the task uploaded the shard, its sha256 (the LFS object id: the driver journals it as on the Hub)."""

    records: bytes | None
    uploaded: str | None


def run_hub_task(job: Job, device: str, threads: int, t: HubTask,
                 emit: Callable[[str, ShardRecord, Arrived | None], None], tuning: Tuning | None = None) -> JobResult:
    """One attempt at a Hub-input job on a Ray node: its inputs downloaded into its task folder
    (``hubstage.TaskStaging``), converted, and (with --upload) each shard uploaded before it is emitted; the
    driver keeps the journal, writes configs, index and manifest, and makes the one commit, as a local
    ``pack --upload`` does. Returns the job's result, its input hashes the verified downloads' and its
    ``downloads`` the scratch folder's figures."""
    from .sources.hubstage import TaskStaging
    from .transport import bound_library
    from .tuning import Tuning

    tuning = tuning or Tuning()

    bound_library()  # the library's timeouts, in this process too
    stage = TaskStaging(job.source, t, job.units, job.output_dir, tuning.download_threads)  # type: ignore[arg-type]
    uploader: _TaskUpload | None = None
    try:
        stage.check_space([s.size for s in job.shards], tuning.upload_queue)
        uploader = _uploader(t, stage.out, emit, tuning)
        source = stage.start()
        res = run_jobs([dataclasses.replace(job, source=source, output_dir=stage.out)], resolve_device(device),
                       uploader.on_shard if uploader else lambda f, rec: emit(f, rec, None), threads=threads,
                       stop=stage.stop, tuning=tuning, **({"admit": uploader.live.admit} if uploader else {}))[0]
        stage.close(ok=True)
        if uploader is not None:
            uploader.live.close()  # every shard on the Hub, or the upload's error
    except BaseException as e:
        with contextlib.suppress(BaseException):
            stage.close(ok=False)
        if uploader is not None:
            uploader.live.abandon()
        raise stage.failed(e) from None
    res.input_hashes, res.downloads = stage.finish([s.file for s in job.shards])
    return res


@dataclass
class _TaskUpload:
    """A task's uploader: each shard queued as it is final, emitted to the driver once the Hub has it."""

    live: object  # upload.live.LiveUpload
    out: Path
    local: bool
    emit: Callable[[str, ShardRecord, Arrived | None], None]
    pending: dict[str, tuple[ShardRecord, bytes | None]]

    def on_shard(self, file: str, rec: ShardRecord) -> None:
        records = (self.out / filenames.records_name(file)).read_bytes() if self.local else None
        self.pending[file] = (rec, records)
        self.live.submit(file, rec.size, rec.digest)

    def on_uploaded(self, file: str, sha256: str) -> None:
        rec, records = self.pending.pop(file)
        self.emit(file, rec, Arrived(records, sha256))


def _uploader(t: HubTask, out: Path, emit: Callable, tuning: Tuning) -> _TaskUpload | None:
    """With --upload: the task's ``LiveUpload`` on an ``HfApi`` of the task's environment (no connect)."""
    if t.upload is None:
        return None
    from huggingface_hub import HfApi

    from .sources.hubstage import say_on_node
    from .upload.live import LiveUpload

    up = _TaskUpload(LiveUpload(t.upload, say_on_node, api=HfApi(), tuning=tuning), out, t.local_output, emit, {})
    up.live.start(out, up.on_uploaded)
    return up
