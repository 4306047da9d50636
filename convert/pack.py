"""``pack``: the data flow of the README, step by step: open the source -> plan -> claim the output folder ->
run the units -> finish -> publish. Each step's machinery lives where its concern does: the source's staging
(``sources.staging``: a Hub input's downloads), the output folder (``outfolder``: lock, journal, resume, space,
the finish and its crash safety), the executor (``executors``: this process, worker processes or Ray tasks),
the pipeline that runs a job's units (``pipeline``), the upload (``upload.live``), the figures (``packstats``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import devices, faults, filenames, pipeline, planprocess, write
from . import manifest as manifest_mod
from .checkpoint import Checkpoint, open_checkpoint
from .derive.lookup import mapping_for
from .devices import Device
from .errors import ConvertError
from .executors import Executor, RayTasks, WorkerProcesses
from .hashing import HUB_DIGEST
from .jobs import Waves, jobs_by_wave, split_jobs
from .journal import ShardRecord
from .options import Options
from .outfolder import OutputFolder
from .packstats import PackStats
from .plan import Plan, make_plan
from .progress import Progress
from .readers import readahead
from .sources import Source, open_source, provenance
from .sources.staging import Staging, staging_for
from .tuning import Tuning

if TYPE_CHECKING:
    from .raycluster import Arrived
    from .upload.live import LiveUpload, UploadTarget

__all__ = ["PackResult", "PackStats", "Uploaded", "load_plan", "pack", "split_jobs"]


@dataclass(frozen=True)
class PackResult:
    plan: Plan
    output_dir: Path
    bytes_in: int
    bytes_out: int
    resumed_shards: int = 0  # shards a resumed run found finished and verified
    already_complete: bool = False
    stats: PackStats | None = None
    cast_blocks: int = 0  # MXFP4 blocks cast to NVFP4
    cast_lossless: int = 0  # of which exact (NVIDIA's count)
    upload: Uploaded | None = None  # --upload: what the Hub got


@dataclass(frozen=True)
class Uploaded:
    """``pack --upload``: the commit, the remote check, and how many shards this run sent itself."""

    commit_url: str
    remote: object  # upload.publish.RemoteCheck
    sent: int
    card_written: bool


def load_plan(source: Source | str | os.PathLike, opts: Options, banked: bool = False) -> tuple[Checkpoint, Plan]:
    """The checkpoint of ``source`` (a ``Source``, or a folder: ``sources.open_source``) and its plan.
    ``opts.mapping``: the table (default: chosen from config.json); ``opts.strict``: a plan warning
    (a mapping entry or exclusion pattern that names nothing, a mapping for another architecture) is
    an error, before any work. ``banked``: see make_plan (for a caller that needs the outline only)."""
    ckpt = open_checkpoint(source)
    m = mapping_for(ckpt, opts.mapping)
    try:
        plan = make_plan(ckpt, m, opts, banked=banked)
    except ConvertError as e:
        unfit = m.fits(ckpt.config)
        raise (ConvertError(f"{e} (note: {unfit})") if unfit else e) from None
    if opts.strict and plan.warnings:
        more = f" (and {len(plan.warnings) - 1} more warning(s))" if len(plan.warnings) > 1 else ""
        raise ConvertError(f"{plan.warnings[0]}{more}; --strict makes warnings errors")
    return ckpt, plan


def pack(input_source: Source | str | os.PathLike, output_dir: str | os.PathLike, opts: Options, *,
         device: Device | str = "auto", workers: int | None = None, streams: int | None = None,
         overwrite: bool = False, resume: bool = False, progress: bool = True, command: str | None = None,
         ray: str | None = None, upload: UploadTarget | None = None, scratch: str | os.PathLike | None = None,
         max_scratch: int | None = None, say: Callable[[str], None] = print, tuning: Tuning | None = None
         ) -> PackResult:
    """Any number of workers or streams gives the same bytes. ``workers``: processes, each on its own
    device (default: one per visible GPU for ``auto``/``cuda``, else one); ``streams``: pipelines per
    worker, on threads, each on consecutive shards (default: one per 4 CPUs of the worker, at most 4).
    ``ray``: spread the shards over a Ray cluster instead (``raycluster``; its address, "" for the
    local one), whose tasks replace workers and streams. ``input_source``: a ``Source``, or a folder
    (``sources.open_source``); everything below reads the input through it. ``upload``: send each shard
    to the Hub as it is final (``upload.live``); its checks (id, token, the Hub's answer) come first.
    A Hub input (``hf://``): its weight files are downloaded just in time into ``scratch`` (default: beside
    the output), at most ``max_scratch`` bytes at once; one worker, one stream; with ``ray``, each task
    downloads its own job's inputs (``sources.hubstage``). ``tuning``: the pipeline's, the upload's and the
    downloads' figures (default: ``Tuning.from_env()``; a test passes its own)."""
    called = time.perf_counter()
    tuning = tuning or _tuning_from_env()
    source, output_dir = open_source(input_source), Path(output_dir)  # open the source
    write.check_output_dir(source.local_path(), output_dir)
    staging = staging_for(source, output_dir, scratch, max_scratch, ray is not None, say, tuning.download_threads)
    workers, streams = staging.limits(workers, streams)
    command = staging.command(command, input_source, output_dir)
    hub = _connect_upload(upload, say, tuning)  # before the plan: a Hub that cannot be reached costs no work
    cluster = _connect_ray(ray, device)  # likewise an unreachable cluster
    start = _StartUp.begin(cluster is None, device, workers, tuning)  # torch and the devices start while we plan
    ckpt, plan = start.plan(source, opts)  # plan
    command = command or f"kimi-convert pack {source.name} {output_dir} --resume"
    executor = _executor(cluster, staging, hub, output_dir, device, workers, streams, start)
    staging.check_plan(plan.iter_units(), resume, lambda: (j.units for jobs in jobs_by_wave(  # a wave at a time
        ckpt, plan, list(plan.shard_sizes()), executor.slots, output_dir, start.tuning.wave_units,
        hash_inputs=False) for j in jobs))
    with OutputFolder.claim(output_dir) as out:  # claim the output folder
        if not out.open(source, plan, overwrite, resume, command, hub is not None):
            up = _publish(hub, output_dir, {}, set()) if hub else None
            return PackResult(plan, output_dir, plan.bytes_in, plan.bytes_out, already_complete=True, upload=up)
        resumed = out.keep_finished(plan, hub)
        waves = _prepare(ckpt, plan, out, staging, executor, hub, start)
        n_workers, n_streams = executor.workers(waves.first), len(waves.first)  # (each wave's: the first's)
        t = time.perf_counter()
        results = _run_units(executor, waves, out, staging, hub, Progress(
            "pack", progress, total=plan.bytes_in, initial=out.done_bytes(plan)))  # run the units
        convert_s = time.perf_counter() - t
        read = dict(out.journal.input_digests)  # every wave's, journaled as it ended (an earlier run's too)
        out.finish(ckpt, plan, staging.input_hashes(plan.inputs, read), keep_journal=hub is not None,
                   origin=provenance(source), uploaded=dict(out.journal.uploaded) if hub else None)  # finish
        up = _publish_run(hub, out, plan) if hub is not None else None  # publish
        stats = PackStats.of(results, workers=n_workers, streams=n_streams, convert_s=convert_s, setup_s=t - called,
                             finish_s=time.perf_counter() - t - convert_s, downloads=staging.stats(results))
        recs = list(out.journal.shards.values())
        return PackResult(plan, output_dir, plan.bytes_in, plan.bytes_out, resumed_shards=resumed, stats=stats,
                          cast_blocks=sum(r.cast_blocks for r in recs),
                          cast_lossless=sum(r.cast_lossless for r in recs), upload=up)


def _tuning_from_env() -> Tuning:
    """The defaults with the ``KIMI_CONVERT_*`` variables that set a field (``tuning.ENV``); a bad value is one line."""
    try:
        return Tuning.from_env()
    except ValueError as e:
        raise ConvertError(str(e)) from None


def _connect_upload(upload: UploadTarget | None, say: Callable[[str], None], tuning: Tuning) -> LiveUpload | None:
    if upload is None:
        return None
    from .upload.live import LiveUpload

    return LiveUpload(upload, say, tuning=tuning)


def _connect_ray(ray: str | None, device: Device | str):
    """--ray (``raycluster``): connected before the plan, so an unreachable cluster costs no work."""
    if ray is None:
        return None
    from . import raycluster

    return raycluster.connect(ray or None, device)


@dataclass
class _StartUp:
    """What starts while the plan is made: where this process computes (``local``: no ``--ray``), the devices
    found (the CUDA driver's start) and torch loaded on a thread (``_warm_up``); ``ahead``: the start-up
    readahead's bytes; ``need``: whether a unit needs torch (decided by the plan); ``stop``: the pipeline's (a Hub
    input's downloads stop with it); ``tuning``: the pipeline's figures, passed down to it."""

    local: bool
    cpus: int  # the one CPU count: every worker's share of it is passed on as an argument
    ahead: int
    need: pipeline.TorchNeed
    stop: threading.Event
    tuning: Tuning

    @classmethod
    def begin(cls, local: bool, device: Device | str, workers: int | None, tuning: Tuning) -> _StartUp:
        s = cls(local, devices.cpus(), tuning.startup_bytes(), pipeline.TorchNeed(), threading.Event(), tuning)
        if local:
            threading.Thread(target=_warm_up, args=(device, workers, s.cpus, s.need), daemon=True,
                             name="kimi-convert-warm-up").start()
        return s

    def plan(self, source: Source, opts: Options) -> tuple[Checkpoint, Plan]:
        plan = None
        try:
            if planprocess.worth_it(source, self.tuning.plan_apart):  # (a large input: its holes left there)
                ckpt, plan = planprocess.load_plan_apart(source, opts, load_plan)
            else:  # each wave's part of the plan made when it runs
                ckpt, plan = load_plan(source, opts, banked=True)
        finally:  # (a failed plan: the warm-up thread ends)
            self.need.decide(plan)
        return ckpt, plan


def _executor(cluster, staging: Staging, hub: LiveUpload | None, output_dir: Path, device: Device | str,
              workers: int | None, streams: int | None, start: _StartUp) -> Executor:
    """Ray tasks with --ray, else a worker a device (this process for one); a Hub input's Ray tasks keep their
    shards on their nodes where they upload them and OUTPUT keeps none (--upload --no-keep-output)."""
    if cluster is not None:
        local_output = staging.per_task and hub is not None and not hub.target.keep_output
        return RayTasks(cluster, staging, output_dir, hub.target if hub is not None else None,
                        hub.api.token if hub is not None else None, local_output, start.tuning)
    devs = devices.worker_devices(device, workers)
    return WorkerProcesses(devs, streams or pipeline.default_streams(start.cpus, len(devs)), start.cpus, start.stop,
                           hub.admit if hub is not None else None, tuning=start.tuning)


def _prepare(ckpt: Checkpoint, plan: Plan, out: OutputFolder, staging: Staging, executor: Executor,
             hub: LiveUpload | None, start: _StartUp) -> Waves:
    """The shards still to write checked against the disk, the source staged, the upload started, the jobs cut
    wave by wave (the first wave's now), and the disk started on the first wave while torch and the GPU start up."""
    todo = out.todo(plan)
    if not executor.local_output:
        out.check_space(todo, None if hub is None or hub.target.keep_output else executor.slots,
                        start.tuning.upload_queue)
    done = out.journal.shards
    source = staging.start((u for u in plan.iter_units() if u.shard not in done), todo, out.path, start.stop,
                           bool(done))
    if hub is not None:
        hub.start(out.path, out.record_upload)
        for s in plan.shard_sizes():  # finished by an earlier run, not on the Hub yet
            if s.file in done and s.file not in out.journal.uploaded:
                hub.submit(s.file, done[s.file].size, done[s.file].digest, admitted=False)
    ahead = start.local and staging.reads_ahead and _streams_wait(executor.devices, start.need)
    direct = start.tuning.direct_read if staging.reads_ahead and not ahead else 0  # (ahead: the cache is theirs)
    waves = Waves.of(jobs_by_wave(ckpt, plan, todo, executor.slots, out.path, start.tuning.wave_units,
                                  source=source, hash_inputs=staging.hashes_inputs,
                                  known=set(out.journal.input_digests), direct_read=direct))
    if ahead:  # (on a thread: queueing that much can block until the disk took it)
        threading.Thread(target=readahead, daemon=True, name="kimi-convert-readahead",
                         args=(ckpt.source, [p for j in waves.first for u in j.units for p in u.parts],
                               start.ahead)).start()
    for job in waves.first:  # what the start-up readahead brings into the page cache, the file hashes read at once
        job.eager = start.ahead // max(1, len(waves.first)) if staging.hashes_inputs else 0
    return waves


def _run_units(executor: Executor, waves: Waves, out: OutputFolder, staging: Staging,
               hub: LiveUpload | None, bar: Progress) -> list[pipeline.JobResult]:
    """The executor runs the jobs, wave after wave; each shard journaled as it is final, then uploaded. On a
    failure the staging and the upload stop (what was sent is journaled; a resume sends the rest), and bad input
    found mid-run leaves no half-written shard (a resume rewrites them)."""
    def on_shard(file: str, rec: ShardRecord, arrived: Arrived | None = None) -> None:
        """``arrived``: what a Hub-input Ray task sends with the record (its records file; uploaded by it)."""
        if arrived is not None and arrived.records is not None:
            out.place_records(file, rec, arrived.records)
        sent = arrived.uploaded if arrived is not None else None  # the task's upload: the shard's sha256
        out.record(file, rec, uploaded=sent)
        if sent:  # by the task: this run's upload as well (the summary counts it)
            hub.sent.append(file)
        elif hub is not None:  # outside the lock: it waits while the uploader (which takes it) is behind
            hub.submit(file, rec.size, rec.digest)

    def run_wave(jobs: list[pipeline.Job]) -> list[pipeline.JobResult]:
        done = executor.run(jobs, on_shard, bar.update)
        out.record_inputs({f: h for r in done for f, h in r.input_hashes.items()})
        return done

    try:
        results = waves.run(run_wave)
    except BaseException as e:
        e = staging.failed(e)
        if hub is not None:
            hub.abandon()
        if isinstance(e, ConvertError):
            out.drop_partials()
            raise e from None
        raise
    finally:
        bar.close()
    staging.close(ok=True)
    if hub is not None:
        hub.close()  # every shard on the Hub (or the uploader's error, as one line)
    return results


def _streams_wait(devs: list[Device], need: pipeline.TorchNeed) -> bool:
    """Whether the streams will wait for torch, so that a start-up readahead (``readers.readahead``) fills the page
    cache for them meanwhile: a GPU's (torch and CUDA start), or the CPUs' where a unit needs torch. Where the C
    kernels take every unit (``--device cpu`` and ``auto``: its GPU is measured in a probe process) the streams read
    at once, and the readahead's requests only queued ahead of their reads, and the streams' first read waited behind
    them (benchmarks/RESULTS.md, "The figures behind the pipeline's constants"); there the streams read past the page
    cache instead (``Tuning.direct_read``)."""
    return not (devs and all(d.kind in ("cpu", "auto") for d in devs)) or need.wait()


def _warm_up(device: Device | str, workers: int | None, cpus: int, need: pipeline.TorchNeed) -> None:
    """pack's warm-up thread: the worker devices resolved (their errors are the main thread's, after the plan),
    then, where this process computes (one worker), ``pipeline.warm_up``."""
    try:
        ds = devices.worker_devices(device, workers)
    except ConvertError:
        return
    if len(ds) == 1:
        pipeline.warm_up(ds[0], cpus, need)


def _publish_run(hub: LiveUpload, out: OutputFolder, plan: Plan) -> Uploaded:
    """The run's shards committed (their journaled sizes, and the sha256 the uploads computed, this run's or an
    earlier one's: every shard is on the Hub by now), then the journal goes."""
    j = out.journal
    up = _publish(hub, out.path, {s.file: (j.shards[s.file].size, j.uploaded[s.file]) for s in plan.shard_sizes()},
                  set(j.uploaded))
    out.remove_journal()
    return up


def _publish(hub: LiveUpload, output_dir: Path, shards: dict[str, tuple[int, str]],
             on_hub: set[str]) -> Uploaded:
    """The model card (as ``upload`` writes it, where the output has none), the commit, the remote check.
    ``shards``: file -> size, sha256 (default, an output already complete: the manifest's, which gains each file's
    sha256 where it records only BLAKE3 (packed without --upload), as ``upload`` writes it); ``on_hub``: those
    preuploaded."""
    from .manifest import iter_modules
    from .upload.card import model_card
    from .upload.publish import check_remote

    man = manifest_mod.load_manifest(output_dir)
    if not shards:
        sha = manifest_mod.hub_sha256(output_dir, man, {})
        if any(HUB_DIGEST not in e for e in man["outputs"]):
            man = manifest_mod.with_hub_digests(man, sha)
            manifest_mod.write_manifest(output_dir, man)
        shards = {f["file"]: (f["size"], sha[f["file"]]) for f in man["outputs"]}
    if not on_hub:
        on_hub = hub.present(shards)
    missing = [f for f in shards if f not in on_hub and not (output_dir / f).is_file()]
    if missing:
        raise ConvertError(f"{output_dir / missing[0]}: neither here nor on the Hub ({hub.target.repo_id}); "
                           "start again with --overwrite")
    card = output_dir / "README.md"
    wrote = not card.exists()
    if wrote:
        card.write_text(model_card(man, _config(output_dir), hub.target.base_model,
                                   (m for _, m in iter_modules(output_dir, man))), encoding="utf-8")
    info = hub.commit(output_dir, shards, on_hub,
                      f"Upload NVFP4 checkpoint (kimi-convert {man['tool']['version']})")
    faults.point("commit")
    t = hub.target
    again = (f"the upload is committed; check it again with: kimi-convert verify-manifest {output_dir} --remote "
             f"{t.repo_id}" + (f" --revision {t.revision}" if t.revision else ""))
    remote = check_remote(hub.api, t.repo_id, t.revision, output_dir, man, hub.say, hint=again)
    return Uploaded(str(getattr(info, "commit_url", "")), remote, len(hub.sent), wrote)


def _config(output_dir: Path) -> dict:
    from .jsonfile import read_json

    return read_json(output_dir / filenames.CONFIG, f"{output_dir}/{filenames.CONFIG}")
