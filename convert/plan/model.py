"""The plan's data: kinds, sources, items, units, shards and the plan itself."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ..encodings import Encoding as Encoding  # how a source stores a weight: the source encodings' data
from ..encodings import SourceTensor
from ..encodings.mxfp4 import GROUP as MXFP4_GROUP  # noqa: F401 (re-exported)
from ..safetensors_format import DTYPES, TensorInfo, encode_header
from ..schemes import SCHEMES, SchemeName
from ..vocabulary import KEPT_FOR_ENGINE as KEPT_FOR_ENGINE  # the reason's mark of a module kept for the engines
from ..vocabulary import KeepRule, Recipe, Skipped

if TYPE_CHECKING:
    from ..mapping import Mapping
    from ..options import Options


#: What an item becomes: a recipe's scheme (``schemes.SchemeName``, member by member: each registered scheme, and
#: ``KEEP``, a linear layer kept in high precision) or ``COPY`` (not a linear layer: copied as stored).
Kind = StrEnum("Kind", [*((f.name, f.value) for f in SchemeName), ("COPY", "copy")], module=__name__)


#: How an item is computed, decided once when the plan is made (``plan.operations``) and read by every backend
#: (``convert/steps.py``) and by ``--device auto``'s kinds of work (``pipeline.choose.work_kind``): ``COPY`` (its
#: stored bytes as they are), ``DECODE`` (kept in high precision, decoded to BF16: an MXFP4 or FP8 source, or a
#: view), and each scheme's own (its ``OPERATIONS``: ``QUANTIZE`` and ``CAST`` of NVFP4, ``FP8_BLOCK``).
Operation = StrEnum("Operation", [("COPY", "copy"), ("DECODE", "decode"),
                                  *((n, v) for s in SCHEMES.values() for n, v in s.OPERATIONS.items())],
                    module=__name__)


class Op(StrEnum):
    """How an item's sources make its tensor."""

    NONE = "none"  # one source
    CAT = "cat"  # concatenated on dim 0
    STACK = "stack"  # stacked on a new dim 0


NVFP4, FP8, KEEP, COPY = Kind.NVFP4, Kind.FP8_BLOCK, Kind.KEEP, Kind.COPY
QUANTIZED = tuple(Kind(name) for name in SCHEMES)  # every registered quantization scheme (convert/schemes)


class OutTensor(NamedTuple):  # a tuple: one per output tensor (a million in the released K3)
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True, slots=True)
class Item:
    """One output module (or loose tensor) and the sources it is built from."""

    name: str  # output module name (or tensor name for a copy)
    kind: Kind
    op: Op
    group: str | None  # the mapping group that fused it on disk
    sources: tuple[SourceTensor, ...]
    outputs: tuple[OutTensor, ...]
    rule: str  # why quantized or kept
    operation: Operation  # how it is computed (decided with the plan: ``plan.operations``)
    input_scale: float | None = None  # nvfp4: the constant activation scale written with it
    output_format: str | None = None  # quantized: how its tensors are spelled (convert/formats/)
    experts: int = 0  # a stacked expert bank's experts (its weight [experts, N, K], one global scale each); 0: none

    def row_ranges(self) -> list[tuple[int, int]]:
        """Rows (dim 0) of the fused tensor each source occupies, in order."""
        out, pos = [], 0
        for s in self.sources:
            n = 1 if self.op == Op.STACK else (s.shape[0] if s.shape else 1)
            out.append((pos, pos + n))
            pos += n
        return out


@dataclass(frozen=True, slots=True)
class Unit:
    """Items computed together: one item, or stored-apart modules sharing one global scale."""

    items: tuple[Item, ...]
    shared_scale: str | None  # the engine fusion group(s) whose members share one global scale
    shard: str = ""

    @property
    def nbytes_out(self) -> int:
        return sum(t.nbytes for it in self.items for t in it.outputs)

    @property
    def nbytes_in(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def parts(self) -> list[TensorInfo]:
        """Every stored input tensor the unit reads, once (sources that are views of the same parts, gate
        and up of one gpt-oss expert, share them)."""
        return list(dict.fromkeys(p for it in self.items for s in it.sources for p in s.parts))


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """One packed module an engine builds from stored-apart members: recorded in the plan and manifest,
    and the reason its quantized members share one global scale (``fusion`` finds them)."""

    name: str  # full name of the engine's packed module
    engines: tuple[str, ...]
    members: tuple[str, ...]  # source modules in the engine's order
    rows: tuple[tuple[int, int], ...]  # each member's rows in the engine's fused weight


class Placed(NamedTuple):  # a tuple: one per output tensor
    tensor: OutTensor
    start: int  # absolute offset in the shard file
    end: int


@dataclass(frozen=True, slots=True)
class Shard:
    file: str
    placed: tuple[Placed, ...]
    header_len: int  # the header's bytes: where the data starts

    @property
    def header(self) -> bytes:
        """The 8-byte length and the JSON, padded so data starts 16-byte aligned: encoded from ``placed`` when
        asked (once a shard, by its writer, whose bytes the file's hash takes), not held, because the released K3's 96
        headers are 140 MiB of its plan (benchmarks/RESULTS.md, issue 43)."""
        base = self.header_len
        raw = encode_header([p.tensor for p in self.placed], [p.start - base for p in self.placed],
                            [p.end - base for p in self.placed])
        assert len(raw) == base, self.file  # the layout's own encoding, the same function and arguments
        return raw

    @property
    def size(self) -> int:
        return self.placed[-1].end if self.placed else self.header_len


@dataclass(frozen=True, slots=True)
class ShardPart:
    """One output shard's part of the plan: its units, in plan order, and its placements."""

    units: tuple[Unit, ...]
    shard: Shard


@dataclass(frozen=True, slots=True)
class ShardSize:
    """An output shard as the outline counts it, without its placements."""

    file: str
    size: int
    tensors: int


@dataclass(frozen=True, slots=True)
class ShardLoad:
    """What one output shard's units read, counted from the outline (a bank's unit once for each of its
    experts): the executor cuts its jobs and waves by it without the shard's part of the plan."""

    units: int
    reads: dict[str, int]  # input file -> the bytes the shard's units read from it

    @property
    def bytes_in(self) -> int:
        return sum(self.reads.values())


@dataclass(frozen=True, slots=True)
class PerModule:
    """The plan module by module: every unit, every shard with its header, every engine packed module."""

    units: tuple[Unit, ...]
    shards: tuple[Shard, ...]
    engine_groups: tuple[EngineGroup, ...]


@dataclass(frozen=True, slots=True)
class Outline:
    """The plan with each bank of routed experts as one entry (what ``plan`` prints): a layer's experts
    stored alike (same tensors, dtypes, shapes, file; decided alike because no rule in force can tell
    their indices apart) are planned once, for the first of them, which stands for the bank."""

    units: tuple[Unit, ...]  # a bank's units are its first expert's
    engine_groups: tuple[EngineGroup, ...]
    banks: dict[str, tuple[int, ...]]  # a bank's first expert ("...experts.3") -> the bank's expert indices
    kinds: dict[Kind, int]  # modules (tensors, for copies) of each kind, banks counted in full
    bytes_in: int
    bytes_out: int
    shards: int
    shard_sizes: tuple[ShardSize, ...] = ()  # each output shard, in order

    def experts(self, prefix: str, index: str) -> tuple[int, ...]:
        """The expert indices that ``prefix.index`` stands for (itself alone unless it leads a bank)."""
        return self.banks.get(f"{prefix}.{index}") or (int(index),)


class Expanding(Protocol):
    """What makes a banked plan's shard parts from its outline (``plan.expand.Expansion``)."""

    def parts(self, only: set[str] | None = None) -> Iterator[ShardPart]: ...

    def all_engine_groups(self) -> tuple[EngineGroup, ...]: ...

    def engine_group_scales(self) -> list[tuple[EngineGroup, str | None]]: ...


@dataclass(frozen=True)
class Plan:
    """The plan. ``per_module`` makes the module-by-module plan (units, shards, engine packed modules)
    on first use: ``plan`` without --json prints the ``outline`` alone (banks of experts), and never makes
    the released K3's million per-expert objects. ``expansion`` (a banked plan): each output shard's part
    made from the outline when asked (``shard_parts``), so that what goes through the plan shard by shard
    (``plan --json``, the plan's hash) never holds the whole of it (issue 43)."""

    mapping: Mapping
    recipe: Recipe
    options: Options
    patterns: tuple[KeepRule, ...]  # the exclusion rules in force, recorded in the manifest
    exclude_modules: tuple[str, ...]
    warnings: tuple[str, ...]
    side_files: tuple[str, ...]
    inputs: tuple[tuple[str, int], ...]  # (file, size)
    per_module: Callable[[], PerModule] = field(repr=False, compare=False)
    outline_of: Callable[[Plan], Outline] = field(repr=False, compare=False)
    layer_kinds: dict[int, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # decisions worth saying (e.g. a condition decided from the tensors)
    side_folders: tuple[str, ...] = ()  # empty input folders, recreated (sidefiles.scan)
    skipped_files: tuple[Skipped, ...] = ()  # input files neither read nor copied, with the reason
    expansion: Expanding | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def _modules(self) -> PerModule:
        return self.per_module()

    def _expanding(self) -> Expanding | None:
        """The expansion, unless the module-by-module plan is made already (then it is cut, not made again)."""
        return None if "_modules" in self.__dict__ else self.expansion

    def shard_parts(self) -> Iterator[ShardPart]:
        """Each output shard's part of the plan, one at a time, in the plan's order (its units are ``units``
        in order, shard after shard)."""
        if (x := self._expanding()) is not None:
            yield from x.parts()
            return
        units_of: dict[str, list[Unit]] = {s.file: [] for s in self.shards}
        for u in self.units:
            units_of[u.shard].append(u)
        for s in self.shards:
            yield ShardPart(tuple(units_of[s.file]), s)

    def iter_units(self) -> Iterator[Unit]:
        """``units`` one shard's part at a time."""
        for part in self.shard_parts():
            yield from part.units

    def iter_items(self) -> Iterator[Item]:
        return (it for u in self.iter_units() for it in u.items)

    def every_engine_group(self) -> tuple[EngineGroup, ...]:
        """``engine_groups``, expanded from the outline's where the module-by-module plan is not made (each time:
        the release's 82,849 are not held for the run)."""
        x = self._expanding()
        return x.all_engine_groups() if x is not None else self.engine_groups

    def parts_of(self, files: Collection[str]) -> list[ShardPart]:
        """The parts of these output shards, in plan order: expanded from the outline where the plan is banked
        (the rest of the plan never made), else cut from the module-by-module plan."""
        if (x := self._expanding()) is not None:
            return list(x.parts(set(files)))
        return [p for p in self.shard_parts() if p.shard.file in files]

    @functools.cached_property
    def shard_loads(self) -> dict[str, ShardLoad]:
        """Each output shard's units and input bytes by file, from the outline."""
        o = self.outline
        units: dict[str, int] = {s.file: 0 for s in self.shard_sizes()}
        reads: dict[str, dict[str, int]] = {f: {} for f in units}
        for u in o.units:
            n = len(o.banks.get(u.items[0].sources[0].module.rpartition(".")[0], (0,)))
            units[u.shard] += n
            into = reads[u.shard]
            for p in u.parts:
                into[p.file] = into.get(p.file, 0) + n * p.nbytes
        return {f: ShardLoad(units[f], reads[f]) for f in units}

    def engine_group_scales(self) -> list[tuple[EngineGroup, str | None]]:
        """Each engine packed module with the global scale its first member shares (None where apart)."""
        if (x := self._expanding()) is not None:
            return x.engine_group_scales()
        scale_of = {it.name: u.shared_scale for u in self.units if u.shared_scale for it in u.items}
        return [(g, scale_of.get(g.members[0])) for g in self.engine_groups]

    def shard_sizes(self) -> tuple[ShardSize, ...]:
        """Each output shard's file, size and tensors, from the outline where it counts them."""
        if self.expansion is not None and self.outline.shard_sizes:
            return self.outline.shard_sizes
        return tuple(ShardSize(s.file, s.size, len(s.placed)) for s in self.shards)

    @functools.cached_property
    def outline(self) -> Outline:
        return self.outline_of(self)

    @property
    def units(self) -> tuple[Unit, ...]:
        return self._modules.units

    @property
    def shards(self) -> tuple[Shard, ...]:
        return self._modules.shards

    @property
    def engine_groups(self) -> tuple[EngineGroup, ...]:
        return self._modules.engine_groups

    @property
    def items(self) -> list[Item]:
        return [it for u in self.units for it in u.items]

    @property
    def bytes_in(self) -> int:
        if self._expanding() is not None:
            return self.outline.bytes_in
        return sum(p.end - p.start for u in self.units for p in u.parts)

    @property
    def bytes_out(self) -> int:
        if self._expanding() is not None:
            return self.outline.bytes_out
        return sum(s.size for s in self.shards)

    def shard_of(self) -> dict[str, str]:
        return {p.tensor.name: s.file for s in self.shards for p in s.placed}
