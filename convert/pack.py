"""``pack``: plan, then convert the shards (``pipeline``: read, compute and write overlapped, in one
or several worker processes), then configs, index and manifest.

Crash safety: each shard is written under a ``.partial`` name, flushed, renamed, hashed and recorded
in the resume journal; configs, index and manifest come last, the manifest very last, and the
journal is removed after it. ``resume=True`` re-checks the recorded shards against their hashes and
writes only the rest, so the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import configs, devices, faults, filenames, journal, pipeline, write
from . import manifest as manifest_mod
from .atomic import write_json_atomic
from .checkpoint import INDEX_NAME, Checkpoint, open_checkpoint
from .derive.lookup import mapping_for
from .devices import Device
from .errors import ConvertError
from .hashing import sha256_file
from .journal import Journal, ShardRecord
from .options import Options
from .plan import Plan, Shard, Unit, fp8_block_size, make_plan
from .plan.serialize import plan_dict, plan_hash
from .progress import Progress, human_bytes
from .readers import readahead
from .sources import Source, open_source, provenance

if TYPE_CHECKING:
    from .hub.live import LiveUpload, UploadTarget
    from .rayhub import Arrived
    from .sources.hubfetch import Downloads


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
    remote: object  # hub.RemoteCheck
    sent: int
    card_written: bool


@dataclass(frozen=True)
class PackStats:
    """How the conversion ran (``kimi-convert pack --stats FILE`` writes it as JSON)."""

    workers: int
    streams: int  # pipelines in all
    convert_s: float  # from the start of the workers to their end (configs and manifest excluded)
    backend_s: float  # the slowest worker's time to load torch and start its device (overlapped with reading)
    hashed_from_pipeline: int  # input bytes whose file sha256 came from the pipeline's own reads
    hash_reread: int  # input bytes the file hashes read themselves (ahead of a stream waiting for torch, headers,
    #                   ranges other streams convert, ranges too far out of order to hold)
    stages_s: dict[str, float]  # seconds per stage, summed over streams (stages of a stream overlap)
    in_flight_peak: int  # the most source and output bytes a worker held at once
    in_flight_limit: int  # a worker's budget for them
    device: str = ""  # what the workers computed on (``auto``: a GPU or the CPUs by kind of work, measured)
    device_choices: list[dict] = field(default_factory=list)  # auto: per kind of work, the choice and the
    #                   seconds per GB each candidate took on the run's first units of it (each worker's)
    pinned_bytes: int = 0  # read buffers page-locked for the GPU (summed over workers)
    pin_s: float = 0.0  # seconds spent page-locking them
    calibration: list[dict] = field(default_factory=list)  # auto: each worker's calibration thread (the GPU's
    #                   start-up seconds, units computed and their seconds, offers declined, the streams' copying)
    stream_wall_s: list[float] = field(default_factory=list)  # each stream's seconds, start to end
    stream_timelines: list[dict] = field(default_factory=list)  # each stream's counters in time (pipeline.timeline)
    input_hash_wait_s: float = 0.0  # after the streams ended, waiting for the input file hashes (sequential chains)
    early_units: int = 0  # units computed without torch while it loaded, or for --device cpu (compute_early)
    setup_s: float = 0.0  # from pack's call to the workers' start (the plan, the journal, the output folder)
    finish_s: float = 0.0  # after the workers' end: configs, side files, index, manifest (and the upload's commit)
    downloads: dict | None = None  # a Hub input: what was downloaded, reused, the scratch peak (hubfetch)


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


def pack(
    input_source: Source | str | os.PathLike,
    output_dir: str | os.PathLike,
    opts: Options,
    *,
    device: Device | str = "auto",
    workers: int | None = None,
    streams: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    command: str | None = None,
    ray: str | None = None,
    upload: UploadTarget | None = None,
    scratch: str | os.PathLike | None = None,
    max_scratch: int | None = None,
    say: Callable[[str], None] = print,
) -> PackResult:
    """Any number of workers or streams gives the same bytes. ``workers``: processes, each on its own
    device (default: one per visible GPU for ``auto``/``cuda``, else one); ``streams``: pipelines per
    worker, on threads, each on consecutive shards (default: one per 4 CPUs of the worker, at most 4).
    ``ray``: spread the shards over a Ray cluster instead (``raycluster``; its address, "" for the
    local one), whose tasks replace workers and streams. ``input_source``: a ``Source``, or a folder
    (``sources.open_source``); everything below reads the input through it. ``upload``: send each shard
    to the Hub as it is final (``hub.live``); its checks (id, token, the Hub's answer) come first.
    A Hub input (``hf://``): its weight files are downloaded just in time into ``scratch`` (default: beside
    the output), at most ``max_scratch`` bytes at once (``sources.hubfetch``); one worker, one stream. With
    ``ray`` as well, each task downloads its own job's inputs (and uploads its own shards): ``rayhub``."""
    called = time.perf_counter()
    source, output_dir = open_source(input_source), Path(output_dir)
    write.check_output_dir(source.local_path(), output_dir)
    from_hub = provenance(source) is not None
    if from_hub:
        scratch_dir = _hub_input_checks(output_dir, scratch, workers, streams)
        if ray is None:
            workers, streams = 1, 1
        if command is None or isinstance(input_source, str):  # the resume reads the same commit
            command = (command or f"kimi-convert pack {input_source} {output_dir} --resume").replace(
                str(input_source), source.name, 1)
    elif scratch is not None or max_scratch is not None:
        raise ConvertError(f"--{'scratch' if scratch is not None else 'max-scratch'} applies to a Hub input "
                           "(hf://OWNER/REPO) only")
    hub = None
    if upload is not None:  # before the plan: a Hub that cannot be reached costs no work
        from .hub.live import LiveUpload

        hub = LiveUpload(upload, say)
    cluster = None
    if ray is not None:  # --ray (convert/raycluster.py): connected first, so an unreachable cluster costs no work
        from . import raycluster

        cluster = raycluster.connect(ray or None, device)
    cpus = devices.cpus()  # the one CPU count: every worker's share of it is passed on as an argument
    ahead = startup_readahead()
    needs_torch = pipeline.TorchNeed()
    if cluster is None:  # the devices found (the CUDA driver's start: 0.7 s on the H200 machine) and torch loaded
        threading.Thread(target=_warm_up, args=(device, workers, cpus, needs_torch), daemon=True,  # while we plan
                         name="kimi-convert-warm-up").start()
    plan = None
    try:
        ckpt, plan = load_plan(source, opts)
    finally:  # (a failed plan: the warm-up thread ends)
        needs_torch.decide(plan)
    devices_ = devices.worker_devices(device, workers) if cluster is None else []
    command = command or f"kimi-convert pack {source.name} {output_dir} --resume"
    ray_hub = from_hub and cluster is not None  # each Ray task downloads its inputs (rayhub)
    # the bound checked before the output exists (a resume: below, against what is left)
    early = _scratch_plan(source, plan.units, max_scratch) if from_hub and not resume and not ray_hub else None
    if ray_hub and not resume:  # each task's bound, against its job
        _task_bounds(source, split_jobs(ckpt, plan, plan.shards, cluster.placement.slots, output_dir,
                                        hash_inputs=False), max_scratch)
    output_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_output(output_dir)  # before the journal is read: a concurrent pack is told so, not --resume
    try:
        j = _open_journal(source, output_dir, plan, overwrite, resume, command, hub is not None)
        if j is None:
            up = _publish(hub, output_dir, {}, set()) if hub else None
            return PackResult(plan, output_dir, plan.bytes_in, plan.bytes_out, already_complete=True, upload=up)
        resumed = _verify_finished(output_dir, plan, j, hub)
        todo = [s for s in plan.shards if s.file not in j.shards]
        n_streams = streams or pipeline.default_streams(cpus, len(devices_))
        slots = cluster.placement.slots if cluster else len(devices_) * n_streams
        local_output = ray_hub and hub is not None and not hub.target.keep_output  # the shards stay on the nodes
        if not local_output:
            _check_space(output_dir, todo, None if hub is None or hub.target.keep_output else slots)
        downloads: Downloads | None = None
        stop = threading.Event()  # the pipeline's; a Hub input's downloads stop with it
        job_source = ckpt.source
        if ray_hub:  # pickled to the tasks without the token (it travels as HF_TOKEN: rayhub.task_env)
            job_source = dataclasses.replace(source, token=None)
        elif from_hub:
            from .sources.hubfetch import Downloads, FetchedHub

            sp, bound = early if early is not None and not j.shards else _scratch_plan(
                source, [u for u in plan.units if u.shard not in j.shards], max_scratch)
            _check_scratch_space(scratch_dir, output_dir, todo, sp, bound)
            downloads = Downloads(source, scratch_dir, bound, sp, stop, say)
            downloads.start()
            job_source = FetchedHub(source, downloads)
        jlock = threading.Lock()  # the pipeline's threads and the uploader's both record in the journal
        if hub is not None:
            def on_uploaded(file: str, sha: str) -> None:
                with jlock:
                    j.uploaded[file] = sha
                    j.save(output_dir)
            hub.start(output_dir, on_uploaded)
            for s in plan.shards:  # finished by an earlier run, not on the Hub yet
                if s.file in j.shards and s.file not in j.uploaded:
                    hub.submit(s.file, j.shards[s.file].size, j.shards[s.file].sha256, admitted=False)
        # the disk starts on the first groups while torch and the GPU start up (nothing is imported yet)
        # (on a thread: queueing that much readahead can block until the disk has taken it)
        if cluster is None and not from_hub:  # (with --ray, the nodes read; a Hub input: the downloads)
            threading.Thread(target=_startup_readahead, daemon=True, name="kimi-convert-readahead",
                             args=(source, [p for u in plan.units if u.shard not in j.shards for p in u.parts],
                                   ahead, devices_, needs_torch)).start()
        jobs = split_jobs(ckpt, plan, todo, slots, output_dir, source=job_source, hash_inputs=not from_hub)
        for job in jobs:  # what the start-up readahead brings into the page cache, the file hashes read at once
            job.eager = 0 if from_hub else ahead // max(1, len(jobs))
        per_worker = [jobs[k::len(devices_)] for k in range(len(devices_))]  # each worker's streams
        per_worker = [w for w in per_worker if w] or [jobs]
        if cluster is not None:  # --ray: a task per job
            per_worker = [[job] for job in jobs]
        done_bytes = sum(u.nbytes_in for u in plan.units if u.shard in j.shards)
        bar = Progress("pack", progress, total=plan.bytes_in, initial=done_bytes)

        def on_shard(file: str, rec: ShardRecord, arrived: Arrived | None = None) -> None:
            """``arrived``: what a Hub-input Ray task sends with the record (its records file; uploaded by it)."""
            if arrived is not None and arrived.records is not None:
                _place_records(output_dir, file, rec, arrived.records)
            sent = arrived is not None and arrived.uploaded
            with jlock:
                j.shards[file] = rec
                if sent:  # by the task: this run's upload as well (the summary counts it)
                    j.uploaded[file] = rec.sha256
                    hub.sent.append(file)
                j.save(output_dir)
            if hub is not None and not sent:  # outside the lock: it waits while the uploader (which takes it) is behind
                hub.submit(file, rec.size, rec.sha256)

        t = time.perf_counter()
        try:
            if ray_hub:
                results = _run_hub_tasks(cluster, jobs, on_shard, bar.update, source, output_dir, hub, upload,
                                         scratch, max_scratch, local_output)
            elif cluster is not None:
                results = cluster.run(jobs, on_shard, bar.update)
            elif len(per_worker) == 1:
                wait = {"admit": hub.admit} if hub is not None else {}  # --no-keep-output's disk bound
                results = pipeline.run_jobs(per_worker[0], devices_[0], on_shard, bar.update, threads=cpus,
                                            stop=stop, **wait)
            else:
                from . import workers as workers_mod

                results = workers_mod.run(per_worker, devices_[: len(per_worker)], on_shard, bar.update, cpus=cpus)
        except BaseException as e:
            if downloads is not None:  # verified downloads stay in the scratch folder for a resume
                with contextlib.suppress(BaseException):
                    downloads.close(ok=False)
                e = downloads.first_error(e)
            if hub is not None:
                hub.abandon()  # what was sent is journaled; a resume sends the rest
            if isinstance(e, ConvertError):  # bad input found mid-run: no half-written shard left
                _drop_partials(output_dir)  # (a resume rewrites them)
                raise e from None
            raise
        finally:
            bar.close()
        if downloads is not None:
            downloads.close(ok=True)
        if hub is not None:
            hub.close()  # every shard on the Hub (or the uploader's error, as one line)
        convert_s = time.perf_counter() - t
        input_hashes = {f: h for r in results for f, h in r.input_hashes.items()}
        if from_hub:  # verified against the Hub's LFS sha256 by the downloads (those of done shards: the Hub's)
            input_hashes = {f: source.files[f].sha256 for f, _ in plan.inputs} | (
                downloads.hashes() if downloads is not None else input_hashes)
        _finish(ckpt, plan, output_dir, j, input_hashes, keep_journal=hub is not None, origin=provenance(source))
        up = None
        if hub is not None:
            up = _publish(hub, output_dir, {s.file: (j.shards[s.file].size, j.shards[s.file].sha256)
                                                  for s in plan.shards}, set(j.uploaded))
            (output_dir / journal.NAME).unlink()
        recs = list(j.shards.values())
        stats = PackStats(workers=len(per_worker), streams=len(jobs), convert_s=convert_s,
                          backend_s=max((r.backend_s for r in results), default=0.0),
                          hashed_from_pipeline=sum(r.from_pipeline for r in results),
                          hash_reread=sum(r.reread for r in results),
                          stages_s={k: round(sum(r.stages.get(k, 0.0) for r in results), 3)
                                    for k in sorted({k for r in results for k in r.stages})},
                          in_flight_peak=max((r.in_flight_peak for r in results), default=0),
                          in_flight_limit=max((r.in_flight_limit for r in results), default=0),
                          stream_wall_s=[r.wall_s for r in results],
                          stream_timelines=[r.timeline for r in results],
                          input_hash_wait_s=max((r.hash_wait_s for r in results), default=0.0),
                          early_units=sum(r.early_units for r in results),
                          setup_s=round(t - called, 3), finish_s=round(time.perf_counter() - t - convert_s, 3),
                          downloads=(dataclasses.asdict(downloads.stats) if downloads is not None
                                     else _task_downloads(results) if ray_hub else None),
                          **_device_stats(results))
        return PackResult(plan, output_dir, plan.bytes_in, plan.bytes_out, resumed_shards=resumed, stats=stats,
                          cast_blocks=sum(r.cast_blocks for r in recs),
                          cast_lossless=sum(r.cast_lossless for r in recs), upload=up)
    finally:
        unlock_output(output_dir, lock)


def _startup_readahead(source: Source, parts: list, budget: int, devs: list[Device], need: pipeline.TorchNeed) -> None:
    """The start-up readahead, where the streams will wait for torch: a GPU's (torch and CUDA start meanwhile), or
    the CPUs' where a unit needs torch. Where the C kernels take every unit (``--device cpu`` and ``auto``: its GPU is
    measured in a probe process) the streams read at once, and the readahead's requests only queue ahead of their
    reads: the first read of a 2.4 GB pack waited 1.2 s behind them on 2 cores (docs/compressed-tensors.md,
    "Session 17")."""
    if devs and all(d.kind in ("cpu", "auto") for d in devs) and not need.wait():
        return
    readahead(source, parts, budget)


def _warm_up(device: Device | str, workers: int | None, cpus: int, need: pipeline.TorchNeed) -> None:
    """pack's warm-up thread: the worker devices resolved (their errors are the main thread's, after the plan),
    then, where this process computes (one worker), ``pipeline.warm_up``."""
    try:
        ds = devices.worker_devices(device, workers)
    except ConvertError:
        return
    if len(ds) == 1:
        pipeline.warm_up(ds[0], cpus, need)


def _device_stats(results: list[pipeline.JobResult]) -> dict:
    """The device fields of PackStats from the streams' results (a worker's streams share its device,
    its choices and its buffers, so each worker counts once)."""
    workers: dict[tuple, pipeline.JobResult] = {}
    for r in results:
        workers.setdefault((r.device, r.pinned_bytes, r.pin_s, repr(r.choices)), r)
    one = list(workers.values())
    choices = []
    for r in one:
        choices += [c for c in r.choices if c not in choices]
    return {"device": ", ".join(sorted({r.device for r in one if r.device})), "device_choices": choices,
            "pinned_bytes": sum(r.pinned_bytes for r in one), "pin_s": round(sum(r.pin_s for r in one), 3),
            "calibration": [r.calibration for r in one if r.calibration]}


def startup_readahead() -> int:
    """$KIMI_CONVERT_STARTUP_READAHEAD, else an eighth of the available memory, at most 4 GiB."""
    env = os.environ.get("KIMI_CONVERT_STARTUP_READAHEAD")
    if env:
        if not env.isdigit():
            raise ConvertError(f"KIMI_CONVERT_STARTUP_READAHEAD={env!r}: expected a number of bytes")
        return int(env)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 512 << 20
    return min(4 << 30, avail // 8)


def split_jobs(ckpt: Checkpoint, plan: Plan, todo: list[Shard], n: int, output_dir: Path,
               source: Source | None = None, hash_inputs: bool = True) -> list[pipeline.Job]:
    """The shards to write cut into at most ``n`` runs of consecutive shards of about equal input
    bytes (consecutive: a worker then reads whole stretches of input files), and each input file
    given to the worker that reads most of it, which hashes it from its own reads. ``source``: what the
    jobs read (default the checkpoint's); ``hash_inputs`` False: no input file hashed (a Hub input's
    downloads verify and hash each file as it arrives)."""
    units_of: dict[str, list[Unit]] = {s.file: [] for s in plan.shards}
    for u in plan.units:
        units_of[u.shard].append(u)
    weight = [sum(u.nbytes_in for u in units_of[s.file]) for s in todo]
    n = max(1, min(n, len(todo)))
    total, acc, k = sum(weight), 0, 0
    parts: list[list[Shard]] = [[] for _ in range(n)]
    for s, w in zip(todo, weight, strict=True):
        if parts[k] and k < n - 1 and acc + w / 2 > total * (k + 1) / n:
            k += 1
        parts[k].append(s)
        acc += w
    parts = [p for p in parts if p] or [[]]
    reads = [dict.fromkeys(ckpt.files, 0) for _ in parts]
    for i, p in enumerate(parts):
        for s in p:
            for u in units_of[s.file]:
                for t in u.parts:
                    reads[i][t.file] += t.nbytes
    owner: dict[str, int] = {}
    load = [0] * len(parts)
    for f, size in plan.inputs:
        best = max(range(len(parts)), key=lambda i: (reads[i][f], -load[i]))
        owner[f] = best
        load[best] += size - reads[best][f]
    order = {f: i for i, f in enumerate(ckpt.files)}
    block = fp8_block_size(ckpt.config)
    return [
        pipeline.Job(source or ckpt.source, output_dir, p, [u for s in p for u in units_of[s.file]], order,
                     {f: size for f, size in plan.inputs if owner[f] == i and hash_inputs}, block)
        for i, p in enumerate(parts)
    ]


def _open_journal(source: Source, output_dir: Path, plan: Plan, overwrite: bool, resume: bool,
                  command: str, uploading: bool = False) -> Journal | None:
    """The journal to continue, or a fresh one; None when a resumed output is already complete."""
    plan_sha = plan_hash(plan_dict(plan))
    stamps = journal.input_stamps(source, [f for f, _ in plan.inputs])
    existing = Journal.load(output_dir)
    if resume and existing is not None:
        if existing.plan_sha256 != plan_sha or existing.inputs != stamps:
            what = ("input files changed" if existing.inputs != stamps
                    else "the plan (input headers, mapping or options) differs")
            raise ConvertError(f"{output_dir}: cannot resume: {what} since the interrupted run; "
                               "rerun it with the same options, or start again with --overwrite")
        return existing
    if resume and (output_dir / filenames.MANIFEST).exists():
        _check_complete(output_dir, shards_may_be_gone=uploading)
        return None
    if existing is not None and not overwrite:
        raise ConvertError(f"{output_dir}: holds an unfinished pack ({len(existing.shards)} shards done); "
                           f"resume it with: {existing.command}")
    if not (resume or overwrite) and any(p.name != journal.LOCK for p in output_dir.iterdir()):
        raise ConvertError(f"{output_dir}: not empty; pass --overwrite to replace a previous output")
    if resume and not write.own_files_only(output_dir, plan.side_files):
        raise ConvertError(f"{output_dir}: nothing to resume (no journal) and the folder holds other files; "
                           "pass --overwrite to start again")
    write.clear_previous(output_dir, plan.side_files)
    for p in output_dir.rglob("*" + write.PARTIAL):  # side files' are in sub-folders
        p.unlink()
    j = Journal(plan_sha, command, stamps)
    j.save(output_dir)
    return j


def _hub_input_checks(output_dir: Path, scratch: str | os.PathLike | None, workers: int | None,
                      streams: int | None) -> Path:
    """A Hub input packs on one stream (its reads then follow the download order, which is what keeps the
    scratch bound from stalling: ``sources.hubfetch``): in this process, or one a Ray task (``rayhub``). The
    scratch folder (default: beside the output, ``.OUTPUT.hub-scratch``; with --ray, on each node) must not be
    inside the output, which is uploaded and checked as a whole."""
    for flag, n in (("--workers", workers), ("--streams", streams)):
        if n is not None and n > 1:
            raise ConvertError(f"{flag} {n}: a Hub input packs with one worker and one stream (the network, "
                               "not the conversion, is its bound)")
    out = output_dir.absolute()
    where = Path(scratch).absolute() if scratch is not None else out.parent / f".{out.name}.hub-scratch"
    if where == out or where.is_relative_to(out) or out.is_relative_to(where):
        raise ConvertError(f"--scratch {where}: must be outside the output folder {out} (and not contain it)")
    if where.exists() and not where.is_dir():
        raise ConvertError(f"--scratch {where}: is a file, expected a folder")
    return where


def _task_bounds(source, jobs: list[pipeline.Job], max_scratch: int | None) -> list[int]:
    """--ray with a Hub input: each task's scratch bound (``--max-scratch`` per task, default a few of its
    job's files), checked against its job before any task starts: one line, as for a local pack."""
    return [_scratch_plan(source, job.units, max_scratch)[1] for job in jobs]


def _run_hub_tasks(cluster, jobs: list[pipeline.Job], on_shard: Callable[..., None], on_progress: Callable[[int], None],
                   source, output_dir: Path, hub: LiveUpload | None, upload: UploadTarget | None,
                   scratch: str | os.PathLike | None, max_scratch: int | None,
                   local_output: bool) -> list[pipeline.JobResult]:
    """A Ray task per job that downloads its inputs and (with --upload) uploads its shards (``rayhub``); where
    its shards go to OUTPUT, the probe file that lets each task check it sees this OUTPUT."""
    import secrets

    from . import rayhub

    probe = "" if local_output else rayhub.write_probe(output_dir)
    root = str(Path(scratch).absolute()) if scratch is not None else None
    target = dataclasses.replace(upload, token=None) if upload is not None else None
    run = secrets.token_hex(4)  # a task's re-run shares its folder, a resumed pack's tasks never an orphan's
    tasks = [rayhub.HubTask(bound, root, f"{job.shards[0].file.removesuffix('.safetensors') if job.shards else 'none'}"
                                         f".{run}", target, local_output, probe)
             for job, bound in zip(jobs, _task_bounds(source, jobs, max_scratch), strict=True)]
    try:
        return cluster.run(jobs, on_shard, on_progress, hub=tasks,
                           env=rayhub.task_env(hub.api.token if hub is not None else source.token))
    finally:
        rayhub.remove_probe(output_dir)


def _task_downloads(results: list[pipeline.JobResult]) -> dict:
    """--stats ``downloads`` of a Hub input's Ray tasks: the sums (the peak and the bound: the largest task's),
    and each task's figures with its node and folders."""
    tasks = [r.downloads for r in results if r.downloads]
    total = {k: sum(t[k] for t in tasks) for k in ("downloaded", "reused", "bytes", "resumed_bytes", "waited_s")}
    return {**total, "peak_scratch": max((t["peak_scratch"] for t in tasks), default=0),
            "bound": max((t["bound"] for t in tasks), default=0),
            "files": [f for t in tasks for f in t["files"]], "tasks": tasks}


def _place_records(output_dir: Path, shard: str, rec: ShardRecord, data: bytes) -> None:
    """A Ray task's records file, written where the manifest and the commit read it, once checked against the
    record (it crossed the network)."""
    import hashlib

    from .atomic import write_atomic

    if len(data) != rec.records_size or hashlib.sha256(data).hexdigest() != rec.records_sha256:
        raise ConvertError(f"{shard}: the records file a Ray task sent does not match its record (a bug)")
    path = output_dir / filenames.records_name(shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, fault="records")


def _scratch_plan(source, units: list[Unit], max_scratch: int | None):
    """What the downloads fetch and the bound they keep (``--max-scratch``, default a few files), checked."""
    from .sources.hubfetch import scratch_plan

    sp = scratch_plan(units, source.files, source.name)
    bound = max_scratch or sp.default_bound()
    sp.check(bound, source.name, human_bytes)
    return sp, bound


def _check_scratch_space(scratch: Path, output_dir: Path, todo: list[Shard], sp, bound: int) -> None:
    """The scratch folder's disk holds the bound (or everything still to download, if less); on the output's
    disk, with the shards still to write."""
    need = min(bound, sum(n.size for n in sp.needs))
    probe = scratch if scratch.exists() else scratch.parent
    if not probe.exists():
        raise ConvertError(f"--scratch {scratch}: its parent folder does not exist")
    if os.stat(probe).st_dev == os.stat(output_dir).st_dev:
        need += sum(s.size for s in todo)
    free = shutil.disk_usage(probe).free
    if need > free:
        raise ConvertError(f"{scratch}: the downloads need up to {human_bytes(need)} at once (with the output "
                           f"where it shares the disk), {human_bytes(free)} free; lower --max-scratch or free space")


def _drop_partials(output_dir: Path) -> None:
    """Remove the ``.partial`` files of shards and records a failed run left (their space reserved, their data
    unfinished): the shards it finished stay, journaled, and nothing else in the folder looks written."""
    for p in output_dir.rglob("*" + write.PARTIAL):
        with contextlib.suppress(OSError):
            p.unlink()


def _check_complete(output_dir: Path, shards_may_be_gone: bool = False) -> None:
    """A resumed run that finds a finished output checks its files against the manifest (with --upload,
    the shards --no-keep-output removed are checked on the Hub instead, by the remote check)."""
    man = manifest_mod.load_manifest(output_dir)
    for f in [*man.get("outputs", []), *man.get("records", []), *man.get("files", [])]:
        path = output_dir / f["file"]
        if shards_may_be_gone and f in man.get("outputs", []) and not path.exists():
            continue
        if not path.is_file() or path.stat().st_size != f["size"] or sha256_file(path) != f["sha256"]:
            raise ConvertError(f"{path}: does not match manifest.json; start again with --overwrite")


def _verify_finished(output_dir: Path, plan: Plan, j: Journal, hub: LiveUpload | None = None) -> int:
    """Keep the journaled shards whose file and records file still hash to the recorded values, or (with
    --upload) whose records file does and whose upload the Hub's LFS confirms by sha256; forget the rest."""
    planned = {s.file for s in plan.shards}
    claimed = {f: (j.shards[f].size, sha) for f, sha in j.uploaded.items()
               if f in planned and f in j.shards and j.shards[f].sha256 == sha}
    on_hub = hub.present(claimed) if hub is not None else set()
    j.uploaded = {f: sha for f, sha in j.uploaded.items() if f in on_hub}
    kept = 0
    for name, rec in list(j.shards.items()):
        if name in planned and ((name in on_hub and journal.records_intact(output_dir, name, rec))
                                or journal.intact(output_dir, name, rec)):
            kept += 1
            if name in on_hub and hub is not None and not hub.target.keep_output:
                (output_dir / name).unlink(missing_ok=True)  # killed between the upload and the delete
        else:
            del j.shards[name]
            j.uploaded.pop(name, None)
    j.save(output_dir)
    return kept


def _check_space(output_dir: Path, todo: list[Shard], in_flight: int | None = None) -> None:
    """``in_flight``: with --no-keep-output, the shards being written at once (each stream's), to which the
    uploader's queue adds its own: the disk needs the largest of those only."""
    sizes = sorted((s.size for s in todo), reverse=True)
    if in_flight is not None:
        from .hub.live import QUEUE

        sizes = sizes[: in_flight + QUEUE + 1]
    need = sum(sizes)
    free = shutil.disk_usage(output_dir).free
    if need > free:
        raise ConvertError(f"{output_dir}: needs {human_bytes(need)} for {len(todo)} shard(s), "
                           f"{human_bytes(free)} free")


def lock_output(output_dir: Path) -> int:
    """An exclusive ``flock`` on ``OUTPUT/.kimi-convert-pack.lock`` (holding this process's pid), held until the
    descriptor closes: at the end of pack (which removes the file), or by the kernel when the process dies, so
    a killed pack leaves no stale lock (its file is taken over by the next pack). A second pack into the same
    folder is refused at once, naming the holder's pid, instead of being told to --resume what is still being
    written. Returns the descriptor; a filesystem without flock (some network mounts) gets no lock, as before."""
    import fcntl

    path = output_dir / journal.LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f"another pack (pid {holder})" if holder.isdigit() else "another pack"
            raise ConvertError(f"{output_dir}: {who} is writing this output now; wait for it to end (or stop it), "
                               "then run pack again") from None
        except OSError:
            return fd
        try:  # the file locked must still be the one at the path (a finishing pack removes it, then unlocks)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_output(output_dir: Path, fd: int) -> None:
    """Release :func:`lock_output`'s lock and remove its file (still held, so no other pack has it): a finished
    output keeps only what its manifest lists. Only a killed pack leaves the file, for the next to take over."""
    with contextlib.suppress(FileNotFoundError):
        (output_dir / journal.LOCK).unlink()
    os.close(fd)


def _finish(ckpt: Checkpoint, plan: Plan, output_dir: Path, j: Journal,
            input_hashes: dict[str, str], keep_journal: bool = False, origin: dict | None = None) -> None:
    """Configs, side files and index, then the manifest, then the journal goes. Side files are
    copied again by a resumed run (they are cheap), so its manifest is an uninterrupted run's. The
    module records are already on disk, one file per shard (written as each shard finished):
    manifest.json lists them with their sha256."""
    cfgs = configs.config_files(ckpt.config, plan)
    for name, content in cfgs.items():
        write_json_atomic(output_dir / name, content)
    side = write.copy_side_files(ckpt.source, output_dir, plan.side_files, plan.side_folders)
    write_json_atomic(output_dir / INDEX_NAME, configs.index_json(plan))
    own = [write.record(output_dir, f) for f in (*cfgs, INDEX_NAME)]
    recs = {s.file: j.shards[s.file] for s in plan.shards}
    man = manifest_mod.build(
        plan,
        j.plan_sha256,  # the hash of plan_dict(plan): a journal is only continued for the same plan
        input_hashes,
        {f: (r.size, r.sha256) for f, r in recs.items()},
        {f: manifest_mod.RecordsFile(manifest_mod.records_name(f), r.records_size, r.records_sha256, r.modules)
         for f, r in recs.items()},
        [r.to_dict() for r in [*own, *side]],
        [r.to_dict() for r in side],
        origin,
    )
    write_json_atomic(output_dir / filenames.MANIFEST, man, compact_lists=("engine_groups",))
    if not keep_journal:  # --upload: kept until the commit is in (a resume then commits)
        (output_dir / journal.NAME).unlink()


def _publish(hub: LiveUpload, output_dir: Path, shards: dict[str, tuple[int, str]],
             on_hub: set[str]) -> Uploaded:
    """The model card (as ``upload`` writes it, where the output has none), the commit, the remote check.
    ``shards``: file -> size, sha256 (default: the manifest's); ``on_hub``: those preuploaded."""
    from .hub import check_remote, model_card
    from .manifest import iter_modules

    man = manifest_mod.load_manifest(output_dir)
    shards = shards or {f["file"]: (f["size"], f["sha256"]) for f in man["outputs"]}
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
