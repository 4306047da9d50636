"""How a ``pack`` ran (``kimi-convert pack --stats FILE`` writes it as JSON): ``PackStats``, built in one place
(``PackStats.of``) from the streams' results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .pipeline import JobResult


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

    @classmethod
    def of(cls, results: list[JobResult], *, workers: int, convert_s: float, setup_s: float, finish_s: float,
           downloads: dict | None, streams: int | None = None) -> PackStats:
        """The figures of ``results`` (a stream each, of each wave) summed, or their maximum where they overlap in
        time. ``streams``: the streams at once (default: one a result, a single wave)."""
        return cls(workers=workers, streams=len(results) if streams is None else streams, convert_s=convert_s,
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
                   setup_s=round(setup_s, 3), finish_s=round(finish_s, 3), downloads=downloads,
                   **_device_stats(results))


def _device_stats(results: list[JobResult]) -> dict:
    """The device fields of PackStats from the streams' results (a worker's streams share its device,
    its choices and its buffers, so each worker counts once)."""
    workers: dict[tuple, JobResult] = {}
    for r in results:
        workers.setdefault((r.device, r.pinned_bytes, r.pin_s, repr(r.choices)), r)
    one = list(workers.values())
    choices = []
    for r in one:
        choices += [c for c in r.choices if c not in choices]
    return {"device": ", ".join(sorted({r.device for r in one if r.device})), "device_choices": choices,
            "pinned_bytes": sum(r.pinned_bytes for r in one), "pin_s": round(sum(r.pin_s for r in one), 3),
            "calibration": [r.calibration for r in one if r.calibration]}
