"""One output shard's part of the plan, made from the outline when asked (issue 43).

The outline plans each bank of alike routed experts once, for its first expert (``banks.py``). The
module-by-module plan of the released K3 (2.2 M records, a million output tensors and their placements)
held at once is most of a pack's memory; an output shard's part of it is a 96th. Here a shard's units are
the outline's units of that shard with each bank's unit repeated for every expert of the bank: its names
with the expert's index, its parts' byte offsets the bank's (``Bank.starts``), everything else (the
decision, the rule, the operation, the output tensors' dtypes and shapes) the first expert's, because
the decisions are index blind where a bank is found. The units come in the order ``layout.make_units``
gives them (input position), and the shard's placements are ``layout._shard``'s, the same function on
the same tensors: the same records and bytes as the module-by-module plan, made later and one shard at a
time (``tests/test_banks.py`` compares every shard's part with the whole plan's).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from ..safetensors_format import TensorInfo
from .banks import Bank, Banks
from .layout import shard_of_units
from .model import EngineGroup, Item, OutTensor, ShardPart, SourceTensor, Unit


@dataclass(frozen=True, slots=True)
class _Rename:
    """One expert of a bank: the bank's first expert's names and offsets turned into this expert's."""

    old: str  # "prefix.first."
    new: str  # "prefix.e."
    starts: dict[str, int]  # the part's name after the prefix and index -> this expert's start in the file

    @staticmethod
    def of(bank: Bank, k: int) -> _Rename:
        return _Rename(f"{bank.lead}.", f"{bank.prefix}.{bank.indices[k]}.",
                       {rest: col[k] for rest, col in bank.starts.items()})

    def name(self, s: str) -> str:
        return self.new + s[len(self.old):] if s.startswith(self.old) else s.replace(self.old, self.new)

    def part(self, p: TensorInfo) -> TensorInfo:
        start = self.starts[p.name[len(self.old):]]
        return TensorInfo(self.name(p.name), p.file, p.dtype, p.shape, start, start + p.end - p.start)

    def source(self, s: SourceTensor) -> SourceTensor:
        return SourceTensor(self.name(s.module), self.name(s.name), s.encoding, s.dtype, s.shape,
                            tuple(map(self.part, s.parts)), s.view)

    def item(self, it: Item) -> Item:
        outs = tuple(OutTensor(self.name(t.name), t.dtype, t.shape) for t in it.outputs)
        return Item(self.name(it.name), it.kind, it.op, it.group, tuple(map(self.source, it.sources)), outs,
                    it.rule.replace(self.old, self.new), it.operation, it.input_scale, it.output_format)

    def unit(self, u: Unit) -> Unit:
        scale = u.shared_scale.replace(self.old, self.new) if u.shared_scale else u.shared_scale
        return Unit(tuple(map(self.item, u.items)), scale, u.shard)


@dataclass(frozen=True)
class Expansion:
    """The outline's units (each bank's first expert standing for it) and the banks, expanded shard by shard."""

    units: tuple[Unit, ...]  # the outline's, in plan order, each with its shard
    engine_groups: tuple[EngineGroup, ...]  # the outline's
    banks: Banks
    files: tuple[str, ...]  # the input files, in order: the output shards' order (layout "source")

    def parts(self, only: set[str] | None = None) -> Iterator[ShardPart]:
        """Every output shard's part (``only``: of these shards), one at a time, in the plan's order."""
        by_shard: dict[str, list[Unit]] = defaultdict(list)
        for u in self.units:
            if only is None or u.shard in only:
                by_shard[u.shard].append(u)
        for f in self.files:
            if f in by_shard:
                yield self.part(f, by_shard[f])

    def part(self, file: str, units: list[Unit]) -> ShardPart:
        """One shard's part: its outline units with each bank's repeated for its experts, in input position
        (``layout.make_units``' order; a tie, which only a shared stored part makes, in the outline's order)."""
        order = {f: i for i, f in enumerate(self.files)}
        renames: dict[str, list[_Rename]] = {}  # a bank's lead -> its other experts' renames (once a shard)
        rows: list[tuple[tuple[int, int], int, Unit]] = []
        for i, u in enumerate(units):
            bank = self.banks.of(u.items[0].sources[0].module)
            if bank is not None and bank.lead not in renames:
                renames[bank.lead] = [_Rename.of(bank, k) for k in range(1, len(bank.indices))]
            made = [u] if bank is None else [u, *(r.unit(u) for r in renames[bank.lead])]
            rows += [(_position(x, order), i, x) for x in made]
        rows.sort(key=lambda r: r[:2])
        ordered = [r[2] for r in rows]
        return ShardPart(tuple(ordered), shard_of_units(file, ordered))

    def all_engine_groups(self) -> tuple[EngineGroup, ...]:
        """The engine packed modules, each bank's repeated for its experts, in ``make._engine_records``' order."""
        return tuple(g for g, _ in self.engine_group_scales())

    def engine_group_scales(self) -> list[tuple[EngineGroup, str | None]]:
        """``all_engine_groups`` with the global scale each one's first member shares (None where apart): an
        expert's the first expert's, renamed, as its unit's is (``_Rename.unit``)."""
        scale_of = {it.name: u.shared_scale for u in self.units if u.shared_scale for it in u.items}
        out: list[tuple[EngineGroup, str | None]] = []
        for g in self.engine_groups:
            bank, scale = self.banks.of(g.members[0]), scale_of.get(g.members[0])
            if bank is None:
                out.append((g, scale))
                continue
            for k in range(len(bank.indices)):
                r = _Rename.of(bank, k)
                out.append((EngineGroup(r.name(g.name), g.engines, tuple(map(r.name, g.members)), g.rows),
                            scale.replace(r.old, r.new) if scale else scale))
        out.sort(key=lambda gs: (gs[0].name, gs[0].members))
        return out


def expandable(engine_groups: tuple[EngineGroup, ...], banks: Banks) -> bool:
    """Whether each engine packed module lies within one bank's first expert or outside every bank (then
    it is repeated, or kept, whole); a module mixing them is left to the module-by-module plan."""
    for g in engine_groups:
        found = {id(banks.of(m)) for m in g.members}
        if len(found) > 1:
            return False
    return True


def _position(u: Unit, order: dict[str, int]) -> tuple[int, int]:
    """``layout.make_units``' sort key: where the unit's first item's first stored byte lies in the input."""
    return min((order[p.file], p.start) for s in u.items[0].sources for p in s.parts)
