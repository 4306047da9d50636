"""One worker's conversion: read -> compute -> write, the three stages overlapped.

- A reader thread ``pread``s the sources of the next pieces into pooled buffers (``Tuning.read_ahead`` pieces,
  or ``Tuning.read_ahead_bytes`` ahead of the compute on 4 CPUs or more), asks the kernel to start reading the piece
  after, and hands each buffer to the hashers: each source tensor's digest (BLAKE3, ``hashing.TENSOR_DIGEST``),
  and its file's digest (``hashing.FileHasher``), come from these same bytes, not a second read.
- A compute thread runs the kernels (a pass-through slice needs nothing).
- A writer thread ``pwrite``s the results at their planned offsets and hashes them (each tensor's digest, and
  the shard's own digest, from the bytes written); a finisher thread flushes and renames each completed shard
  while the next is written, and reports it (``on_shard``) for the journal.

A worker runs several such streams on consecutive runs of its shards, in threads: a file's digest
is sequential (one core's speed), so one stream could not hash as fast as a disk reads.
Streams start reading and hashing before torch has loaded (about a second, more on some machines);
the backend is made once the first pieces are in flight.

A piece is a unit (a fused module, an expert's w1/w3), or a slice of at most ``Tuning.slice_bytes`` of a
pass-through tensor, so a huge embedding streams through like the rest, or a run of a stacked bank's experts
of about that size. A piece is read only once
its bytes (and its outputs' estimated bytes) fit the worker's in-flight budget, shared by its
streams, and gives them back once written and hashed: memory is bounded by that budget plus the
file hashers' hold budget, whatever the checkpoint's size.

The package's modules, in the order a piece meets them: ``slicing`` (units into pieces), ``budgets``
(what a worker's streams may hold), ``dispatch`` (how a unit is computed: ``runner``, ``choose``, ``probe``),
``stream`` (the threads of one stream, ``run_jobs``). Every figure that tunes them is a field of one
``tuning.Tuning``, which ``pack`` builds once and passes down.
"""

from .budgets import ByteBudget, Memory, cpu_share, default_hash_threads, default_streams, pc_cost
from .slicing import Piece, PieceKind, Read, is_pass_through, pieces
from .stream import Job, JobResult, Shared, Stream, TorchNeed, run_jobs, warm_up

__all__ = ["ByteBudget", "Job", "JobResult", "Memory", "Piece", "PieceKind", "Read", "Shared", "Stream", "TorchNeed",
           "cpu_share", "default_hash_threads", "default_streams", "is_pass_through", "pc_cost", "pieces", "run_jobs",
           "warm_up"]
