"""Banks: a MoE layer's routed experts stored alike, planned once.

The released K3 has 896 experts in each of 92 layers: 247,296 expert modules, a million output tensors.
Where a layer's experts are stored alike (the same tensors under each, with the same dtypes and shapes,
in the same file, in the same order in it) and no rule in force can tell two expert indices apart (the
"index blind" test of decide.py, which makes the decisions per expert template), every expert of the
bank gets what its first expert gets, but for its index and its byte offsets. ``find_banks`` finds the
banks and leaves the first expert of each standing for its bank; the stages plan that reduced input;
``bank_outline`` counts each bank in full and sizes each output shard (header included) by arithmetic
over the bank's offsets. Anything irregular (an expert with another dtype, shape, tensor or file, a
layer whose experts are not stored in one order, a rule naming an expert index, another layout than
the source's) is left out of the banks and planned module by module.
"""

from __future__ import annotations

import itertools
import re
from array import array
from collections import defaultdict
from dataclasses import dataclass, replace
from operator import itemgetter, lt

from ..checkpoint import Checkpoint
from ..mapping import Mapping, template_regex
from ..options import Options
from ..recipe import Recipe
from ..safetensors_format import DTYPES, HEADER_HEAD, TensorInfo, entry_text_len, padded_len, size_of
from ..vocabulary import KeepRule
from .decide import index_blind_rules
from .model import EngineGroup, Kind, Outline, ShardSize, Unit

_DTYPE_SHAPE_FILE = itemgetter(2, 3, 1)  # of a TensorInfo


@dataclass(frozen=True, slots=True)
class Bank:
    """A layer's experts stored alike: ``prefix.{e}.rest`` for each e of ``indices`` and each rest."""

    prefix: str  # the experts module, e.g. "language_model.model.layers.1.block_sparse_moe.experts"
    indices: tuple[str, ...]  # as written in the names, in storage order: the first stands for the bank
    starts: dict[str, array]  # rest ("w1.weight_packed") -> the tensor's start in its file, per expert (int64:
    # the released K3's half a million starts, held for the pack's hours, as one array a column, not as Python ints)

    @property
    def lead(self) -> str:
        return f"{self.prefix}.{self.indices[0]}"


@dataclass(frozen=True, slots=True)
class Banks:
    by_lead: dict[str, Bank]  # "prefix.first index" -> its bank

    def of(self, module: str) -> Bank | None:
        """The bank whose first expert ``module`` (``prefix.e.leaf``) is under, if any."""
        return self.by_lead.get(module.rpartition(".")[0])

    def members(self, module: str) -> list[str]:
        """``module`` for every expert of its bank (itself alone if it leads none)."""
        bank = self.of(module)
        if bank is None:
            return [module]
        leaf = module[len(bank.lead) + 1:]
        return [f"{bank.prefix}.{e}.{leaf}" for e in bank.indices]


def find_banks(ckpt: Checkpoint, m: Mapping, recipe: Recipe, opts: Options, patterns: list[KeepRule]
               ) -> tuple[Checkpoint, Banks] | None:
    """The input with each bank reduced to its first expert, and the banks; None where nothing is banked."""
    if opts.layout != "source" or not m.expert_sets or not index_blind_rules(m, recipe, patterns):
        return None
    if any(re.search(r"(^|\.)[0-9]+(\.|$)", t) for g in m.groups for t in g.parents):
        return None  # a group named for one expert (or layer) by number: left to the module-by-module plan
    experts, others = _experts(ckpt, m)
    if not experts:
        return None
    by_lead: dict[str, Bank] = {}
    kept: list[TensorInfo] = []
    for prefix, per_index in experts.items():
        # experts alike: the same tensors in the same header order (the name after the index), dtypes,
        # shapes and files (a key per expert, compared as a whole: 82,432 keys, not 500,000 comparisons)
        alike: dict[tuple, list[str]] = defaultdict(list)
        for e, infos in per_index.items():
            cut = len(prefix) + len(e) + 2
            alike[tuple([t[0][cut:] for t in infos]), tuple(map(_DTYPE_SHAPE_FILE, infos))].append(e)
        for (rests, specs), indices in alike.items():
            regular = len({s[2] for s in specs}) == 1 and all(r.count(".") == 1 for r in rests)  # leaf.suffix, 1 file
            bank = _bank(prefix, indices, per_index) if regular and len(indices) > 1 else None
            if bank is None:
                kept += [t for e in indices for t in per_index[e]]
            else:
                by_lead[bank.lead] = bank
                kept += per_index[bank.indices[0]]
    if not by_lead:
        return None
    tensors = dict(others)
    tensors.update((t.name, t) for t in kept)
    return replace(ckpt, tensors=tensors), Banks(by_lead)


def _experts(ckpt: Checkpoint, m: Mapping) -> tuple[dict[str, dict[str, list[TensorInfo]]], dict[str, TensorInfo]]:
    """The tensors under routed experts (experts module -> index -> tensors, in header order), and the others.

    A name ``P.e.leaf.suffix`` is split from the right and P matched once per distinct P (92 in the
    released K3, not 500,000 regex matches); any other name takes the regex."""
    rxs = m.expert_regexes(modules=False)
    sets = [template_regex(t) for t in m.expert_sets]
    tp = m.text_prefix
    experts: dict[str, dict[str, list[TensorInfo]]] = defaultdict(lambda: defaultdict(list))
    others: dict[str, TensorInfo] = {}
    is_set: dict[str, bool] = {}
    for name, info in ckpt.tensors.items():
        cut = name.rsplit(".", 3)
        if len(cut) == 4 and cut[1].isdigit() and cut[1].isascii():
            hit = is_set.get(cut[0])
            if hit is None:
                short = cut[0][len(tp):] if tp and cut[0].startswith(tp) else cut[0]
                hit = is_set[cut[0]] = any(rx.fullmatch(short) for rx in sets)
            if hit:
                experts[cut[0]][cut[1]].append(info)
                continue
        at = len(tp) if tp and name.startswith(tp) else 0
        for rx in rxs:
            found = rx.fullmatch(name, at)
            if found is not None:  # under an expert, but not as leaf.suffix: that expert is not banked
                a, b = found.span("_expert_index")
                experts[name[:a - 1]][name[a:b]].append(info)
                break
        else:
            others[name] = info
    return experts, others


def _bank(prefix: str, indices: list[str], per_index: dict[str, list[TensorInfo]]) -> Bank | None:
    """The experts as a bank if each of their tensors lies in the same order in the file (then each unit
    of the bank comes in that order too); else None."""
    indices = sorted(indices, key=lambda e: per_index[e][0].start)
    rows = [per_index[e] for e in indices]
    cut = len(prefix) + len(indices[0]) + 2
    starts: dict[str, array] = {}
    for j, t in enumerate(rows[0]):
        col = array("q", [r[j].start for r in rows])
        if not all(map(lt, col, col[1:])):
            return None
        starts[t.name[cut:]] = col
    return Bank(prefix, tuple(indices), starts)


def bank_outline(units: list[Unit], engine_groups: tuple[EngineGroup, ...], banks: Banks, ckpt: Checkpoint
                 ) -> Outline | None:
    """The outline of the reduced plan, banks counted in full; None where a unit mixes a bank with other
    modules or a shard's tensors would not come in write order (then the plan is made module by module)."""
    kinds = dict.fromkeys(Kind, 0)
    bytes_in = 0
    order = {f: i for i, f in enumerate(ckpt.files)}
    entries: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)  # shard -> (file, start, spec, delta)
    specs: list[_Spec] = []
    for u in units:
        found = {id(banks.of(s.module)): banks.of(s.module) for it in u.items for s in it.sources}
        if len(found) != 1:
            return None
        bank = next(iter(found.values()))
        n = 1 if bank is None else len(bank.indices)
        for it in u.items:
            kinds[it.kind] += n
            bytes_in += n * sum(p.nbytes for s in it.sources for p in s.parts)
        spec = len(specs)
        specs.append(_Spec.of(u))
        parts = [p for it in u.items for s in it.sources for p in s.parts]
        if bank is None:
            entries[u.shard].append((*min((order[p.file], p.start) for p in parts), spec, 0))
            continue
        if len({p.file for p in parts}) != 1:
            return None
        cut = len(bank.lead) + 1
        cols = [bank.starts[p.name[cut:]] for p in parts]
        first = cols[0] if len(cols) == 1 else list(map(min, *cols))
        names = len(specs[spec].sizes)
        deltas = [(len(e) - len(bank.indices[0])) * names for e in bank.indices]
        entries[u.shard] += zip(itertools.repeat(order[parts[0].file]), first, itertools.repeat(spec), deltas,
                                strict=False)
    sizes = {}
    for shard, rows in entries.items():
        size = _shard_size(rows, specs)
        if size is None:
            return None
        sizes[shard] = ShardSize(shard, size, sum(len(specs[r[2]].sizes) for r in rows))
    lead = {k: tuple(int(e) for e in b.indices) for k, b in banks.by_lead.items()}
    ordered = tuple(sizes[f] for f in ckpt.files if f in sizes)  # layout "source": the input files' order
    return Outline(tuple(units), engine_groups, lead, kinds, bytes_in, sum(s.size for s in ordered), len(sizes),
                   ordered)


@dataclass(frozen=True, slots=True)
class _Spec:
    """A unit's output tensors in write order: their sizes, item sizes, and header text but for offsets."""

    sizes: tuple[int, ...]
    itemsizes: tuple[int, ...]
    text: int  # characters of their header entries without the offsets' digits

    @staticmethod
    def of(u: Unit) -> _Spec:
        ts = [t for it in u.items for t in it.outputs]
        if len(ts) > 1:  # layout._in_write_order: wider dtypes first in a unit
            ts = sorted(ts, key=lambda t: -DTYPES[t.dtype].itemsize)
        text = sum(entry_text_len(t.name, t.dtype, t.shape) for t in ts)
        return _Spec(tuple(size_of(t.dtype, t.shape) for t in ts), tuple(DTYPES[t.dtype].itemsize for t in ts), text)


def _shard_size(rows: list[tuple[int, int, int, int]], specs: list[_Spec]) -> int | None:
    """The size of the shard ``layout._shard`` writes for these units (in position order), header included;
    None if its tensors would not be aligned in write order (then _shard sorts them by width instead)."""
    rows.sort()
    order = [r[2] for r in rows]
    steps: dict[tuple[int, int], int] = {}  # (spec, position mod 16) -> position mod 16 after it, -1: misaligned
    pos = 0
    for spec in order:
        nxt = steps.get((spec, pos))
        if nxt is None:
            nxt, s = pos, specs[spec]
            for size, item in zip(s.sizes, s.itemsizes, strict=True):
                if nxt % item:
                    nxt = -1
                    break
                nxt = (nxt + size) % 16
            steps[spec, pos] = nxt
        if nxt < 0:
            return None
        pos = nxt
    ends = list(itertools.accumulate(itertools.chain.from_iterable(specs[i].sizes for i in order)))
    if not ends:
        return None
    digits = sum(map(len, map(str, ends)))
    # the header's text: its head and closing brace, every entry, the offsets' digits (starts: 0 and all ends
    # but the last)
    text = (len(HEADER_HEAD) + 1 + sum(specs[i].text for i in order) + sum(r[3] for r in rows)
            + digits + 1 + digits - len(str(ends[-1])))
    return 8 + padded_len(text) + ends[-1]
