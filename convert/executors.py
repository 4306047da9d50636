"""Where ``pack``'s jobs run, behind one interface (``Executor``): in this process (``InProcess``: one worker,
its streams on threads), in worker processes (``WorkerProcesses``: one a device, ``workers``), or as Ray tasks
(``RayTasks``: one a job, ``raycluster``). Each takes the jobs (``jobs.split_jobs`` cut them into ``slots``
runs of consecutive shards), calls ``on_shard(file, record[, arrived])`` as each shard is final and
``on_progress(bytes)`` as input is consumed, and returns the streams' results; any number of them gives the
same bytes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from . import pipeline
from .devices import Device
from .tuning import Tuning

if TYPE_CHECKING:
    from .raycluster import Cluster
    from .sources.staging import Staging

OnShard = Callable[..., None]
OnProgress = Callable[[int], None]


class Executor(Protocol):
    slots: int  # the jobs it runs at once: the shards are cut into this many runs
    local_output: bool  # the shards stay where the jobs run (OUTPUT keeps none: no space needed there)

    def workers(self, jobs: list[pipeline.Job]) -> int: ...

    def run(self, jobs: list[pipeline.Job], on_shard: OnShard, on_progress: OnProgress) -> list[pipeline.JobResult]:
        ...


@dataclass
class InProcess:
    """One worker, this process: each job a stream (a thread). ``stop``: the pipeline's (a Hub input's downloads
    stop with it); ``admit``: --no-keep-output's disk bound (the uploader's); ``tuning``: pack's."""

    device: Device
    slots: int
    cpus: int
    stop: threading.Event
    admit: Callable[[bool, threading.Event], None] | None = None
    local_output: bool = False
    tuning: Tuning | None = None

    def workers(self, jobs: list[pipeline.Job]) -> int:
        return 1

    def run(self, jobs: list[pipeline.Job], on_shard: OnShard, on_progress: OnProgress) -> list[pipeline.JobResult]:
        wait = {"admit": self.admit} if self.admit is not None else {}
        return pipeline.run_jobs(jobs, self.device, on_shard, on_progress, threads=self.cpus, stop=self.stop,
                                 tuning=self.tuning, **wait)


@dataclass
class WorkerProcesses:
    """A process per device (``workers``), each with its share of the jobs as streams and of the CPUs; where the
    jobs make one group only, this process runs it (``InProcess``)."""

    devices: list[Device]
    streams: int
    cpus: int
    stop: threading.Event
    admit: Callable[[bool, threading.Event], None] | None = None
    local_output: bool = False
    tuning: Tuning | None = None

    @property
    def slots(self) -> int:
        return len(self.devices) * self.streams

    def groups(self, jobs: list[pipeline.Job]) -> list[list[pipeline.Job]]:
        per_worker = [jobs[k::len(self.devices)] for k in range(len(self.devices))]
        return [w for w in per_worker if w] or [jobs]

    def workers(self, jobs: list[pipeline.Job]) -> int:
        return len(self.groups(jobs))

    def run(self, jobs: list[pipeline.Job], on_shard: OnShard, on_progress: OnProgress) -> list[pipeline.JobResult]:
        groups = self.groups(jobs)
        if len(groups) == 1:
            return InProcess(self.devices[0], self.streams, self.cpus, self.stop, self.admit, tuning=self.tuning).run(
                groups[0], on_shard, on_progress)
        from . import workers

        return workers.run(groups, self.devices[: len(groups)], on_shard, on_progress, cpus=self.cpus,
                           tuning=self.tuning)


@dataclass
class RayTasks:
    """A Ray task per job (``raycluster``); the source's staging gives each task what it needs to fetch its own
    inputs (a Hub input: ``hubstage.HubTask``) and their environment."""

    cluster: Cluster
    staging: Staging
    output_dir: Path
    upload: object = None  # upload.live.UploadTarget
    token: str | None = None  # the upload's
    local_output: bool = False  # the shards stay on the nodes (a Hub input with --upload --no-keep-output)
    tuning: Tuning | None = None  # pack's

    @property
    def slots(self) -> int:
        return self.cluster.placement.slots

    def workers(self, jobs: list[pipeline.Job]) -> int:
        return len(jobs)

    def run(self, jobs: list[pipeline.Job], on_shard: OnShard, on_progress: OnProgress) -> list[pipeline.JobResult]:
        with self.staging.tasks(jobs, self.output_dir, self.upload, self.token, self.local_output) as (tasks, env):
            return self.cluster.run(jobs, on_shard, on_progress, hub=tasks, env=env, tuning=self.tuning)
