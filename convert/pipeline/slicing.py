"""Slicing: the plan's units cut into the pieces a stream reads, computes and writes one at a time
(a unit, or a slice of at most ``Tuning.slice_bytes`` of a pass-through tensor, so a huge embedding streams
through like the rest), each with the source reads it needs, in the order the input files lie."""

from __future__ import annotations

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
    COMPUTE = "compute"  # a whole unit, computed


@dataclass(frozen=True)
class Piece:
    unit: Unit
    reads: tuple[Read, ...]
    kind: PieceKind
    copy_at: int  # COPY: the slice's byte offset in the output tensor (0 for COMPUTE)
    last: bool  # the unit's last piece

    @property
    def nbytes(self) -> int:
        return sum(r.hi - r.lo for r in self.reads)

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
            reads = sorted((Read(p, 0, p.nbytes) for p in u.parts), key=lambda r: (file_order[r.part.file],
                                                                                      r.part.start))
            out.append(Piece(u, tuple(reads), PieceKind.COMPUTE, 0, True))
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
