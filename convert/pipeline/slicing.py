"""Slicing: the plan's units cut into the pieces a stream reads, computes and writes one at a time
(a unit, or a slice of at most ``Tuning.slice_bytes`` of a pass-through tensor, so a huge embedding streams
through like the rest, or a run of a stacked expert bank's experts, so a [352, 1536, 4096] bank does too),
each with the source reads it needs, in the order the input files lie."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from enum import StrEnum

from .. import encodings
from ..plan import COPY, KEEP, Unit
from ..safetensors_format import TensorInfo


@dataclass(frozen=True)
class Read:
    part: TensorInfo
    lo: int  # byte range within the stored tensor
    hi: int

    @property
    def file_range(self) -> tuple[int, int]:
        return self.part.start + self.lo, self.part.start + self.hi


class PieceKind(StrEnum):
    COPY = "copy"  # a slice of a pass-through unit: its stored bytes are the output bytes
    COMPUTE = "compute"  # a unit, computed: whole, or experts ``Piece.experts`` of its stacked banks


@dataclass(frozen=True)
class Experts:
    """A run of a stacked unit's experts, ``lo`` to ``hi`` of ``of``: a piece's share of every source part and output
    tensor (each [of, ...], the experts' bytes one after the other)."""

    lo: int
    hi: int
    of: int

    def share(self, nbytes: int) -> tuple[int, int]:
        """The run's byte range within a tensor of ``nbytes`` stacked over the ``of`` experts."""
        return self.lo * nbytes // self.of, self.hi * nbytes // self.of


@dataclass(frozen=True)
class Piece:
    unit: Unit  # an expert run's piece: the unit narrowed to those experts (``narrowed``)
    reads: tuple[Read, ...]
    kind: PieceKind
    copy_at: int  # COPY: the slice's byte offset in the output tensor (0 for COMPUTE)
    last: bool  # the unit's last piece
    experts: Experts | None = None  # COMPUTE: the run of the unit's experts it computes (None: the whole unit)

    @property
    def nbytes(self) -> int:
        return sum(r.hi - r.lo for r in self.reads)

    def at(self, nbytes: int) -> int:
        """Where the piece's bytes of an output tensor of ``nbytes`` start in it."""
        return self.experts.share(nbytes)[0] if self.experts is not None else self.copy_at

    @functools.cached_property
    def spans(self) -> tuple[tuple[Read, ...], ...]:
        """The reads in runs that lie one after the other in one file, each run read as one
        (``PreadReader.read_spans``): a layer's small tensors come in one read, not one each."""
        runs: list[list[Read]] = []
        for r in self.reads:
            if runs and (runs[-1][-1].part.file, runs[-1][-1].file_range[1]) == (r.part.file, r.file_range[0]):
                runs[-1].append(r)
            else:
                runs.append([r])
        return tuple(map(tuple, runs))


def is_pass_through(unit: Unit) -> bool:
    """Output bytes = the concatenated stored bytes of its sources (nothing to compute)."""
    return len(unit.items) == 1 and unit.items[0].kind in (KEEP, COPY) and all(
        encodings.as_stored(s) for s in unit.items[0].sources)


def pieces(units: list[Unit], file_order: dict[str, int], slice_bytes: int) -> list[Piece]:
    """The units cut into pieces: pass-through units in slices of at most ``slice_bytes``, the others whole (their
    reads in file order, so that file hashes mostly advance without holding anything)."""
    out = []
    for u in units:
        if not is_pass_through(u):
            runs = expert_runs(u, slice_bytes)
            for run in runs or [None]:
                reads = (Read(p, *(run.share(p.nbytes) if run else (0, p.nbytes))) for p in u.parts)
                reads = sorted(reads, key=lambda r: (file_order[r.part.file], r.part.start))
                out.append(Piece(narrowed(u, run) if run else u, tuple(reads), PieceKind.COMPUTE, 0,
                                 run is None or run.hi == run.of, run))
            continue
        cur: list[Read] = []
        size = at = 0
        for p in u.parts:  # every part gets a read, an empty one too (its hash is recorded)
            take = 0
            while True:
                n = min(p.nbytes - take, slice_bytes - size)
                cur.append(Read(p, take, take + n))
                size, take = size + n, take + n
                if size == slice_bytes:
                    out.append(Piece(u, tuple(cur), PieceKind.COPY, at, False))
                    at, cur, size = at + size, [], 0
                if take >= p.nbytes:
                    break
        if cur:
            out.append(Piece(u, tuple(cur), PieceKind.COPY, at, False))
        out[-1] = Piece(u, out[-1].reads, PieceKind.COPY, out[-1].copy_at, True)
    return out


def expert_runs(u: Unit, slice_bytes: int) -> list[Experts] | None:
    """A stacked unit larger than ``slice_bytes`` cut into runs of whole experts of at most that many source bytes
    (one expert at least), in order; None: the unit is one piece (not stacked, small enough, or a part or output not
    stacked over the experts). Each expert is computed on its own slice alone (one global scale an expert:
    ``schemes.nvfp4._per_expert``), so a run's bytes are the whole unit's bytes of those experts."""
    n = {it.experts for it in u.items}
    if len(n) != 1 or (e := n.pop()) < 2 or u.nbytes_in <= slice_bytes:
        return None
    stacked = [p.shape for p in u.parts] + [o.shape for it in u.items for o in it.outputs]
    if any(not s or s[0] != e for s in stacked) or any(s.view for it in u.items for s in it.sources):
        return None
    per = max(1, slice_bytes * e // u.nbytes_in)
    return [Experts(lo, min(lo + per, e), e) for lo in range(0, e, per)]


def narrowed(u: Unit, run: Experts) -> Unit:
    """``u`` as the stacked unit of experts ``run`` alone: each source part and output tensor its run's share (the
    parts keep their names: the piece's reads are keyed by them)."""
    k = run.hi - run.lo

    def part(p: TensorInfo) -> TensorInfo:
        lo, hi = run.share(p.nbytes)
        return p._replace(shape=(k, *p.shape[1:]), start=p.start + lo, end=p.start + hi)

    items = tuple(dataclasses.replace(
        it, experts=k, outputs=tuple(o._replace(shape=(k, *o.shape[1:])) for o in it.outputs),
        sources=tuple(s._replace(shape=(k, *s.shape[1:]), parts=tuple(map(part, s.parts))) for s in it.sources))
        for it in u.items)
    return dataclasses.replace(u, items=items)


def merge_notes(into: dict[str, dict], notes: dict[str, dict], pc: Piece) -> None:
    """A piece's notes into its shard's: an expert run after the first extends each per-expert list (``amax``) with
    its own experts', in order."""
    if pc.experts is None or pc.experts.lo == 0:
        into.update(notes)
        return
    for name, note in notes.items():
        have = into[name]
        for k, v in note.items():
            have[k] = have[k] + v if isinstance(v, list) else v
