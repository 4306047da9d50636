"""The conversion's tuning: every figure that trades memory, threads or waiting for speed, in one frozen object that
``pack`` builds once (:meth:`Tuning.from_env`) and passes down to where each is used; a test passes its own.

None of them changes an output byte (``tests/test_same_bytes.py``, and the tests that shrink them). Each field says
why it has its value; the measurements behind them are in ``benchmarks/RESULTS.md`` ("The figures behind the
pipeline's constants"). The environment variables read here (``ENV``) are listed with the others a user may set in
``docs/commands.md`` ("Environment variables"). Imports nothing of the package."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: The variables ``Tuning.from_env`` reads: name -> (field, what its value must be)
ENV = {"KIMI_CONVERT_STARTUP_READAHEAD": ("startup_readahead", "a number of bytes"),
       "KIMI_CONVERT_UPLOAD_QUEUE": ("upload_queue", "a number of shards"),
       "KIMI_CONVERT_DOWNLOAD_THREADS": ("download_threads", "a number of threads"),
       "KIMI_CONVERT_MAX_COMMIT_FILES": ("max_commit_files", "a number of files"),
       "KIMI_CONVERT_DIRECT_WRITE": ("direct_write", "a number of bytes (0: through the page cache)"),
       "KIMI_CONVERT_DIRECT_READ": ("direct_read", "a number of bytes (0: through the page cache)"),
       "KIMI_CONVERT_WAVE_UNITS": ("wave_units", "a number of units"),
       "KIMI_CONVERT_PLAN_APART": ("plan_apart", "a number of bytes"),
       "KIMI_CONVERT_HEAP_ARENAS": ("heap_arenas", "a number of heaps (0: glibc's default)"),
       "KIMI_CONVERT_HASH_READS_SMALL": ("hash_reads_small", "a number of bytes (0: every range waited for)")}


@dataclass(frozen=True)
class Tuning:
    #: A pass-through tensor is cut into slices of at most this many bytes, so a huge embedding streams through
    #: like the rest (a slice is one piece of the in-flight budget); a stacked expert bank into runs of whole experts
    #: of at most this many source bytes (one expert at least).
    slice_bytes: int = 64 << 20
    #: Pieces a stream reads ahead of its compute at least, within the in-flight budget.
    read_ahead: int = 3
    #: Bytes a stream reads ahead of its compute beyond those pieces (at most a quarter of the in-flight budget):
    #: the input file's sha256 chain hashes the pieces as they are read and the writer waits for those hashes; a
    #: few small pieces left the chain too little slack, so the chain, the disk and the writer waited on each other
    #: in turn. 0: ``read_ahead`` pieces only.
    read_ahead_bytes: int = 128 << 20
    #: ... on a worker with at least this many CPUs: on fewer the compute is the bound, and reading ahead into more
    #: buffers costs the CPU it needs.
    read_ahead_bytes_cpus: int = 4
    #: A banked plan's shards are run in waves of consecutive shards of about this many units (at least a shard for
    #: each of the executor's slots), each wave's part of the plan made when it starts and dropped when it ends:
    #: the released K3's whole module-by-module plan held at once was most of the pack's memory (issue 43). About two
    #: of the release's shards: a 16,384-unit wave's jobs held 60 MB more, for no speed (RESULTS, "Session 26").
    wave_units: int = 4096
    #: An input whose index is at least this many bytes is planned in a child process (``planprocess``): the
    #: table's parse and the plan's walks leave their holes there, not in the process that runs for hours (the
    #: released K3's 59 MB index: 258 MB resident after the plan here, 94 MB planned apart, RESULTS "Session 27");
    #: a child's start and the pickle's way back (1.3 s there) cost a small input more than they save (about 70,000
    #: tensors an 8 MB index).
    plan_apart: int = 8 << 20
    #: Computed pieces waiting for the writer.
    write_depth: int = 2
    #: Bytes ahead of a stream's reads its file hashes may read themselves while the stream waits for torch and the
    #: device: a file's sha256 is one sequential chain, which so runs on while torch loads.
    eager_hash: int = 1 << 30
    #: A worker's in-flight budget: at least this (``in_flight_per_cpu`` a CPU of its share below 4 CPUs), and at
    #: least two of its largest pieces.
    min_in_flight: int = 512 << 20
    #: On a small share of CPUs the compute, not the read-ahead, is the bound: a smaller budget there costs no CPU
    #: time and holds less memory.
    in_flight_per_cpu: int = 128 << 20
    #: The most bytes the file hashes hold to hash them in file order (at most a quarter of the in-flight budget).
    hold_bytes: int = 128 << 20
    #: An input file's sha256 chain reads a tensor this small itself once an offer past it was dropped, instead of
    #: waiting for the stream's offer (``hashing.FileHasher``'s ``small``): a release stored by dtype width keeps each
    #: unit's small tensors apart from its large ones (``KIMI_CONVERT_HASH_READS_SMALL``; 0: every range waited for).
    #: 64 KiB takes shapes and FP8 block scales, not an INT4 or MXFP4 expert's group scales (benchmarks/RESULTS.md,
    #: issue 38's session 31 and 32 sections).
    hash_reads_small: int = 64 << 10
    #: Allocations of this size and more are mapped on their own and given back to the system when freed (glibc's
    #: M_MMAP_THRESHOLD, which glibc otherwise raises up to 32 MB: a converter's tensors then come from per-thread
    #: heaps that keep what is freed, and the process grows with its threads).
    mmap_threshold: int = 1 << 20
    #: glibc heaps the threads' small allocations share (M_ARENA_MAX; 0: glibc's default, eight a CPU, in practice one
    #: a thread): each heap keeps its own freed pages, so the released K3's run grew its heaps over the hours
    #: (benchmarks/RESULTS.md, "The released K3 end to end", session 30).
    heap_arenas: int = 2
    #: Bytes a shard writer lets accumulate in the page cache before it asks the kernel to start writing them back
    #: (``write.start_writeback``), so that the shard's closing fsync finds little left to write.
    writeback_every: int = 64 << 20
    #: A shard writer's staging buffer for the bytes it writes past the page cache (``write.DirectStage``, where the
    #: file system allows it); 0: every byte through the page cache. A buffer is written at once when full: large
    #: enough that the disk sees few, long writes; one per shard being written (``KIMI_CONVERT_DIRECT_WRITE``: 0 where a
    #: file system takes direct writes slowly).
    direct_write: int = 8 << 20
    #: A stream's read of at least this many bytes (a span of a piece's reads that lie one after the other in one
    #: file) goes past the page cache (``O_DIRECT``, where the file system allows it: ``PreadReader.read_spans``), the
    #: disk's bytes landing in the pooled buffer itself; smaller reads, and every read of a pack whose streams wait for
    #: torch (the start-up readahead fills the page cache for them), go through the cache. On two cores a byte read
    #: through the page cache costs a newly allocated cache page and a copy (benchmarks/RESULTS.md, "Issue 38: the
    #: input read past the page cache");
    #: a small read past it costs the disk's round trip without the kernel's readahead. 0: every read through the page
    #: cache (``KIMI_CONVERT_DIRECT_READ``).
    direct_read: int = 1 << 20
    #: A worker process reports its progress at most every this many bytes (a queue message each time).
    progress_step: int = 64 << 20
    #: --device auto: timed units per kind of work and candidate, after the warm-up one.
    samples: int = 2
    #: --device auto: how many times faster than the CPUs the GPU's timed units must be for a kind of work to go to
    #: it. A unit timed alone does not show what the GPU costs in steady state (page-locking every read buffer, one
    #: GPU shared by the worker's streams, its copies against the reader's); where the GPU is the better device it
    #: wins by far more.
    gpu_margin: float = 1.5
    #: --device auto: seconds into the streams before the probe process is started: a probe needs seconds to import
    #: torch and start the GPU before it measures anything, so a pack shorter than that never gains from it, yet its
    #: memory counts.
    probe_after_s: float = 3.0
    #: Seconds a probe that ended is waited for, for its exit status (a probe still running at the end of the pack
    #: is killed at once: the pack never waits on it).
    probe_exit_s: float = 1.0
    #: The start-up readahead's bytes (``KIMI_CONVERT_STARTUP_READAHEAD``); None: an eighth of the available memory,
    #: at most 4 GiB (:meth:`startup_bytes`).
    startup_readahead: int | None = None
    #: A Hub input's downloads in flight at once (each one sequential stream, within ``--max-scratch``): two hide
    #: each file's request round trips behind the other's bytes (``KIMI_CONVERT_DOWNLOAD_THREADS``; docs/hub-input.md
    #: measures one against two).
    download_threads: int = 2
    #: ``pack --upload --no-keep-output``: the shards that may be on the local disk besides the one being sent
    #: (written, being written, or waiting for the uploader): a stream waits before opening another
    #: (``KIMI_CONVERT_UPLOAD_QUEUE``).
    upload_queue: int = 2
    #: ``pack --upload``: shards sent at once: two hide each shard's round trips (preupload, LFS batch) behind the
    #: other's bytes; more would only split the same uplink (each large shard's own multipart upload is the library's).
    upload_threads: int = 2
    #: ``pack --upload``: files per commit (``KIMI_CONVERT_MAX_COMMIT_FILES``; the tests lower it). The Hub takes
    #: commits of many files, but a very large one can time out server-side; above this the shards and records files
    #: go in commits of their own, the rest (configs, card, manifest) in the last one, so the repository only looks
    #: finished once the manifest is in.
    max_commit_files: int = 1000
    #: For the tests, whose inputs are too few units to decide otherwise: auto's streams wait for the calibration
    #: thread (``pipeline.runner``), so that every unit of an undecided kind is computed on every candidate.
    calibration_waits: bool = False
    #: For the tests likewise: auto's probe process (``pipeline.probe``) is set up before the streams start and a
    #: stream waits for it; a kind won by the GPU gets its runner before the stream goes on.
    probe_waits: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Tuning:
        """The defaults, with the variables of ``ENV`` where set (ValueError: one that is not a whole number)."""
        fields = {}
        for name, (field, what) in ENV.items():
            env = environ.get(name, "").strip()
            if not env:
                continue
            if not env.isdigit():
                raise ValueError(f"{name}={env!r}: expected {what}")
            fields[field] = int(env)
        return cls(**fields)

    def startup_bytes(self) -> int:
        """The start-up readahead's bytes: ``startup_readahead``, else an eighth of the available memory, at most
        4 GiB (the page cache it fills must not push out what the streams read next)."""
        if self.startup_readahead is not None:
            return self.startup_readahead
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 512 << 20
        return min(4 << 30, avail // 8)

    def in_flight_floor(self, threads: int) -> int:
        """The smallest in-flight budget of a worker with ``threads`` CPUs (two of its largest pieces always fit)."""
        return min(self.min_in_flight, self.in_flight_per_cpu * max(1, threads))
