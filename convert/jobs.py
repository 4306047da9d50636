"""The executor's jobs: the shards still to write cut into waves of consecutive shards, and each wave into runs
of consecutive shards (``split_jobs``), one a slot of the executor. Both cuts are made from the shards' summaries
(``Plan.shard_loads``: what each shard's units read, counted from the outline), and a wave's jobs take only that
wave's part of the plan (``Plan.parts_of``): a banked plan's is made from the outline when the wave starts and
dropped when it ends, so a pack holds one wave's part of the plan at a time, not the whole of it (issue 43: the
released K3's module-by-module plan was most of the pack's memory). A plan made module by module (another layout,
an irregular input) runs as one wave, as before. Waves and runs change no output byte: a shard is written the same
by whichever job, in whichever wave, writes it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from . import pipeline
from .checkpoint import Checkpoint
from .plan import Plan, ShardLoad, ShardSize, fp8_block_size
from .sources import Source


@dataclass
class Waves:
    """The jobs wave by wave: the first made at once (the start-up readahead and the file hashes' lead are its),
    each later one made when the one before has run and dropped once it has run."""

    first: list[pipeline.Job]
    later: Iterator[list[pipeline.Job]]

    @classmethod
    def of(cls, waves: Iterator[list[pipeline.Job]]) -> Waves:
        return cls(next(waves), waves)

    def run(self, run_one) -> list[pipeline.JobResult]:
        """``run_one(jobs)`` for each wave in turn (the executor's ``run``), the results together."""
        results: list[pipeline.JobResult] = []
        jobs: list[pipeline.Job] | None = self.first
        self.first = []  # (the executor's figures read the first wave's count before the run)
        while jobs is not None:
            results += run_one(jobs)
            jobs = None  # the wave that ran is dropped before the next one's part of the plan is made
            jobs = next(self.later, None)
        return results


def jobs_by_wave(ckpt: Checkpoint, plan: Plan, todo: list[ShardSize], slots: int, output_dir: Path,
                 wave_units: int, source: Source | None = None, hash_inputs: bool = True,
                 known: Collection[str] = (), direct_read: int = 0) -> Iterator[list[pipeline.Job]]:
    """Each wave's jobs, made when asked for (see ``cut_waves``); each input file hashed by the wave that reads
    most of it, but those whose digest is ``known`` (an earlier run's, journaled); ``direct_read``: each job's
    (``Job.direct_read``)."""
    loads = plan.shard_loads
    waves = cut_waves(todo, loads, slots, wave_units) if plan.expansion is not None else [todo]
    inputs = [f for f, _ in plan.inputs if f not in known]
    for wave, hashed in zip(waves, hash_owners(inputs, waves, loads), strict=True):
        yield split_jobs(ckpt, plan, wave, slots, output_dir, source=source, hash_inputs=hash_inputs, hashed=hashed,
                         direct_read=direct_read)


def cut_waves(todo: list[ShardSize], loads: dict[str, ShardLoad], slots: int, wave_units: int
              ) -> list[list[ShardSize]]:
    """Consecutive shards, a wave of at most ``wave_units`` units unless that leaves one of the executor's
    ``slots`` without a shard (then more); one empty wave where nothing is left to write (its jobs still hash
    the input files)."""
    waves: list[list[ShardSize]] = [[]]
    units = 0
    for s in todo:
        n = loads[s.file].units
        if len(waves[-1]) >= slots and units + n > wave_units:
            waves.append([])
            units = 0
        waves[-1].append(s)
        units += n
    return waves


def hash_owners(inputs: list[str], waves: list[list[ShardSize]], loads: dict[str, ShardLoad]) -> list[set[str]]:
    """Each input file given to the wave that reads most of it (the first, where none reads it)."""
    owned: list[set[str]] = [set() for _ in waves]
    for f in inputs:
        best = max(range(len(waves)), key=lambda i: (sum(loads[s.file].reads.get(f, 0) for s in waves[i]), -i))
        owned[best].add(f)
    return owned


def split_jobs(ckpt: Checkpoint, plan: Plan, todo: list, n: int, output_dir: Path, source: Source | None = None,
               hash_inputs: bool = True, hashed: Collection[str] | None = None, direct_read: int = 0
               ) -> list[pipeline.Job]:
    """The shards to write (``Shard`` or ``ShardSize``) cut into at most ``n`` runs of consecutive shards of about
    equal input bytes (consecutive: a worker then reads whole stretches of input files), and each input file
    given to the worker that reads most of it, which hashes it from its own reads. ``source``: what the jobs read
    (default the checkpoint's); ``hash_inputs`` False: no input file hashed (a Hub input's downloads verify and
    hash each file as it arrives); ``hashed``: the input files these jobs hash (default all: one wave)."""
    loads = plan.shard_loads
    runs = _consecutive_runs(todo, [loads[s.file].bytes_in for s in todo], n)
    reads = [{f: sum(loads[s.file].reads.get(f, 0) for s in run) for f in ckpt.files} for run in runs]
    owner: dict[str, int] = {}
    load = [0] * len(runs)
    for f, size in plan.inputs:
        if hashed is not None and f not in hashed:
            continue
        best = max(range(len(runs)), key=lambda i: (reads[i][f], -load[i]))
        owner[f] = best
        load[best] += size - reads[best][f]
    made = {p.shard.file: p for p in plan.parts_of({s.file for s in todo})}
    order = {f: i for i, f in enumerate(ckpt.files)}
    block = fp8_block_size(ckpt.config)
    return [
        pipeline.Job(source or ckpt.source, output_dir, [made[s.file].shard for s in run],
                     [u for s in run for u in made[s.file].units], order,
                     {f: size for f, size in plan.inputs if owner.get(f) == i and hash_inputs}, block,
                     direct_read=direct_read)
        for i, run in enumerate(runs)
    ]


def _consecutive_runs(todo: list, weight: list[int], n: int) -> list[list]:
    """``todo`` cut into at most ``n`` consecutive runs of about equal weight (one empty run for nothing)."""
    n = max(1, min(n, len(todo)))
    total, acc, k = sum(weight), 0, 0
    runs: list[list] = [[] for _ in range(n)]
    for s, w in zip(todo, weight, strict=True):
        if runs[k] and k < n - 1 and acc + w / 2 > total * (k + 1) / n:
            k += 1
        runs[k].append(s)
        acc += w
    return [r for r in runs if r] or [[]]
