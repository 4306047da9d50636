"""What a preset stores: its tensors in order (templates expanded over layers and experts), each one's
stored parts, and how they are cut into shards. Pure: no torch, no values (``values.py`` makes those).

The order is the release's (the spec lists the templates so), and it decides the bytes: the index
lists the parts in this order and the shard cuts fall on it; within a shard, safetensors orders the data
itself (by dtype, then name).
"""

from __future__ import annotations

import functools
import itertools
import math
import string
from collections.abc import Iterator
from dataclasses import dataclass, field

from .resolve import Loop, Preset
from .spec import Block, Group, SpecError, Tensor

ITEMSIZE = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}
FP8_BLOCK = 128  # DeepSeek-style 128x128 weight_scale_inv tiles
MX_GROUP = 32  # values an E8M0 scale covers
INT4_GROUP = 32  # values a BF16 scale of compressed-tensors INT4 covers (Kimi K2.5's group_size)


@dataclass(frozen=True, slots=True)
class Part:
    """One stored tensor: name, safetensors dtype, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * ITEMSIZE[self.dtype])


@dataclass(frozen=True, slots=True)
class Logical:
    """One emitted template: a tensor as the release describes it (an FP8 weight with its scale, an MXFP4
    weight with its packed codes and scales are one), and where it came from."""

    name: str
    shape: tuple[int, ...]
    storage: str
    where: str
    block: int
    layer: int | None = None  # the value of a `layer` loop, for cuts by layer
    joined: bool = False  # an expert's entry after its first: a byte cut never falls before it
    wide: tuple[int, ...] = ()  # mxfp4: the experts (pack: 0) with one block scaled by 2^-24
    zero_from: int | None = None
    apart: bool = False  # fp8-block: the scale goes to the last shard
    below: int | None = None  # expert-ids: the expert count every value stays below
    parts: tuple[Part, ...] = field(default=(), compare=False)


@functools.lru_cache(maxsize=1024)
def _template(template: str) -> tuple[tuple[str, str | None, str, str | None], ...]:
    return tuple(string.Formatter().parse(template))


def fill(template: str, names: dict, where: str) -> str:
    """``template`` with its ``{field}`` / ``{field:spec}`` from ``names`` (plain names only: a spec
    file cannot reach attributes or items through a format string)."""
    out = []
    try:
        for text, fname, spec, conv in _template(template):
            out.append(text)
            if fname is None:
                continue
            if conv or not fname.isidentifier() or fname not in names or "{" in (spec or ""):
                raise SpecError(where, f"name field {{{fname}}}: not one of {', '.join(sorted(names))}")
            out.append(format(names[fname], spec or ""))
    except ValueError as e:
        raise SpecError(where, f"name template {template!r}: {e}") from None
    return "".join(out)


def _parts(t: Tensor, name: str, shape: tuple[int, ...]) -> tuple[Part, ...]:
    """The stored parts of ``name`` (the storage's own names, or the template's ``stored`` names)."""
    parts = _storage_parts(name, shape, t.storage, t.where, bool(t.stored))
    if t.code_dtype == "i8":
        parts = (Part(parts[0].name, "I8", parts[0].shape), *parts[1:])
    if t.scale_dtype == "e8m0":
        parts = (parts[0], Part(parts[1].name, "F8_E8M0", parts[1].shape))
    if not t.stored:
        return parts
    if len(t.stored) != len(parts):
        raise SpecError(f"{t.where}: stored", f"{t.storage} stores {len(parts)} tensors, stored names {len(t.stored)}")
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return tuple(Part(fill(s, {"name": name, "base": base}, f"{t.where}: stored"), p.dtype, p.shape)
                 for s, p in zip(t.stored, parts, strict=True))


def _storage_parts(name: str, shape: tuple[int, ...], storage: str, where: str, renamed: bool) -> tuple[Part, ...]:
    if storage in ("bf16", "f32"):
        return (Part(name, storage.upper(), shape),)
    if storage == "expert-ids":
        return (Part(name, "I64", shape),)
    if storage == "mxfp4-bank":
        if len(shape) != 3 or shape[2] % MX_GROUP:
            raise SpecError(where, f"mxfp4-bank takes [experts, N, K] with K a multiple of 32, got {list(shape)}")
        e, n, k = shape
        return (Part(f"{name}_blocks", "U8", (e, n, k // MX_GROUP, 16)),
                Part(f"{name}_scales", "U8", (e, n, k // MX_GROUP)))
    if not (renamed or name.endswith(".weight")) or len(shape) != 2:
        raise SpecError(where, f"{storage} stores a 2-D '*.weight' (or names its parts: stored), "
                               f"got {name} {list(shape)}")
    base, (n, k) = name.removesuffix(".weight"), shape
    if storage == "fp8-block":
        scale = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        return Part(name, "F8_E4M3", shape), Part(f"{base}.weight_scale_inv", "F32", scale)
    if k % MX_GROUP:
        raise SpecError(where, f"{storage} needs K a multiple of 32, got {list(shape)}")
    if storage == "int4-pack":  # compressed-tensors pack-quantized: 8 codes an int32, BF16 scales, [N, K]
        return (Part(f"{base}.weight_packed", "I32", (n, k // 8)),
                Part(f"{base}.weight_scale", "BF16", (n, k // INT4_GROUP)), Part(f"{base}.weight_shape", "I64", (2,)))
    return Part(f"{base}.weight_packed", "U8", (n, k // 2)), Part(f"{base}.weight_scale", "U8", (n, k // MX_GROUP))


def _int(v, where: str, what: str, least: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise SpecError(where, f"{what} must be an integer >= {least}, got {v!r}")
    return v


def _ints(v, where: str, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise SpecError(where, f"{what} must be a list of integers, got {v!r}")
    return v


@dataclass
class _Walk:
    """The expansion of one preset's blocks. What a template computes from values no loop variable it
    reads changes is computed once per those variables' values (an expert's shape once per layer, not
    for each of 896 experts)."""

    p: Preset
    block: int = 0
    var: str = "layer"
    done: dict = field(default_factory=dict)

    def holds(self, entry: Tensor | Group, local: Loop) -> bool:
        if entry.when is not None:
            ok = self.p.eval(entry.when, f"{entry.where}: when", local)
            if not isinstance(ok, bool | int):
                raise SpecError(f"{entry.where}: when", f"gives {ok!r}, not true/false")
            if not ok:
                return False
        if entry.layers is not None:
            if self.var not in local:
                raise SpecError(f"{entry.where}: layers", "layers applies inside a looped block only")
            chosen = _ints(self.p.eval(entry.layers, f"{entry.where}: layers", local), entry.where, "layers")
            return local[self.var] in chosen
        return True

    def _sized(self, t: Tensor, local: Loop) -> tuple[tuple[int, ...], int | None, bool]:
        """``t``'s shape, zero_from and scale_apart (kept per the values of the loop variables they read)."""
        read = self.done.get((id(t), local.keyset))
        if read is None:
            exprs = [e for e in (*((t.shape,) if not isinstance(t.shape, tuple) else t.shape), t.zero_from,
                                 t.scale_apart) if e is not None]
            read = sorted(frozenset().union(*(self.p.values.reads(e, local.keyset) for e in exprs)))
            self.done[id(t), local.keyset] = read
        key = (id(t), *(local[v] for v in read))
        if key not in self.done:
            where = f"{t.where}: shape"
            shape_v = self.p.eval(t.shape, where, local) if not isinstance(t.shape, tuple) else [
                self.p.eval(e, where, local) for e in t.shape]
            shape = tuple(_int(d, where, "each dimension", 1) for d in _ints(shape_v, t.where, "shape"))
            zero = None if t.zero_from is None else _int(
                self.p.eval(t.zero_from, f"{t.where}: zero_from", local), t.where, "zero_from")
            apart = bool(t.scale_apart is not None and self.p.eval(t.scale_apart, f"{t.where}: scale_apart", local))
            self.done[key] = shape, zero, apart
        return self.done[key]

    def tensor(self, t: Tensor, local: Loop, joined: bool) -> Logical:
        shape, zero, apart = self._sized(t, local)
        name = fill(t.name, local, t.where)
        wide: tuple[int, ...] = ()
        if t.wide is not None:
            where = f"{t.where}: wide"
            if t.storage == "mxfp4-bank" or "expert" not in local:  # expert x of the bank (or expert 0)
                experts = range(shape[0]) if t.storage == "mxfp4-bank" else [0]
                wide = tuple(x for x in experts if self.p.eval(t.wide, where, Loop(local, expert=x)))
            else:
                wide = (local["expert"],) if self.p.eval(t.wide, where, local) else ()
        layer = local.get("layer") if self.var == "layer" else None
        below = self.expert_count(t, shape) if t.storage == "expert-ids" else None
        return Logical(name, shape, t.storage, t.where, self.block, layer, joined, wide, zero, apart, below,
                       _parts(t, name, shape))

    def expert_count(self, t: Tensor, shape: tuple[int, ...]) -> int:
        """The family's expert count, which an ``expert-ids`` table's values stay below (k distinct a row)."""
        below = _int(self.p.get(self.p.family.experts_key), t.where, "the expert count", 1)
        if len(shape) != 2 or shape[1] > below:
            raise SpecError(t.where, f"expert-ids takes [rows, k], k distinct experts of {below}, got {list(shape)}")
        return below

    def entries(self, entries, local: Loop, first: list[bool] | None = None) -> Iterator[Logical]:
        """``first``: inside an expert, whether its first tensor is still to come (the others are
        ``joined``: a byte cut never falls before them)."""
        for entry in entries:
            if not self.holds(entry, local):
                continue
            if isinstance(entry, Tensor):
                yield self.tensor(entry, local, first is not None and not first[0])
                if first is not None:
                    first[0] = False
            elif entry.experts is None:
                yield from self.entries(entry.entries, local, first)
            else:
                n = _int(self.p.eval(entry.experts, f"{entry.where}: experts", local), entry.where, "experts")
                for x in range(n):
                    yield from self.entries(entry.entries, Loop(local, expert=x), [True])


def tensors(p: Preset) -> Iterator[Logical]:
    """Every tensor the preset stores, in the release's order."""
    for bi, block in enumerate(p.family.blocks):
        walk = _Walk(p, bi, block.var)
        if block.loop is None:
            yield from walk.entries(block.entries, _names(p, block, {}))
            continue
        loop = _ints(p.eval(block.loop, f"{block.where}: loop"), block.where, "loop")
        for v in loop:
            yield from walk.entries(block.entries, _names(p, block, {block.var: v}))


def _names(p: Preset, block: Block, local: dict) -> Loop:
    """The block's loop variable and its ``names``, each filled with the loop variable (``{layer}``) and the
    ``[let]`` values it names, which may read the loop variable: DeepSeek V4's MTP layer counts on from the last
    decoder layer (its attention ratio is ``compress_ratios[layer]``) but is named ``mtp.{layer - layers}``."""
    fields = dict(local)
    for k, template in block.names:
        for _, f, _, _ in _template(template):
            if f is not None and f not in fields and f in p.family.let:
                where = f"{block.where}: names.{k}"
                fields[f] = _int(p.eval(p.family.let[f], where, local), where, f"{{{f}}}")
    return Loop(local, **{k: fill(t, fields, f"{block.where}: names.{k}") for k, t in block.names})


def count_cuts(specs: list[Logical], shards: int, snap: tuple[str, ...]) -> list[int]:
    """Equal-count shard boundaries, each moved onto the next tensor named ``*snap`` (k_proj, up_proj) so
    that, as in real releases, fused groups take their members from two files."""
    per = -(-len(specs) // shards)
    cuts = [0]
    for b in range(per, len(specs), per):
        while b < len(specs) and not specs[b].name.endswith(snap):
            b += 1
        if cuts[-1] < b < len(specs):
            cuts.append(b)
    return [*cuts, len(specs)]


def byte_cuts(specs: list[Logical], shards: int) -> list[int]:
    """Shard boundaries of about equal bytes: a cut where the running size passes the next multiple of
    total/shards (a tensor larger than that spans several: fewer shards, none tiny), never inside an
    expert (the release keeps an expert's w1, w2, w3 in one file; NVIDIA's converter needs w1 and w3 of
    an expert in one shard, as they share one scale_2)."""
    sizes = [sum(part.nbytes for part in s.parts) for s in specs]
    total, done, cuts, k = sum(sizes), 0, [0], 1
    for i, size in enumerate(sizes):
        if done >= total * k / shards and i > cuts[-1] and not specs[i].joined:
            cuts.append(i)
            while done >= total * k / shards:
                k += 1
        done += size
    return [*cuts, len(specs)]


def layer_groups(p: Preset, specs: list[Logical], shards: int) -> list[list[Logical]]:
    """The release's cut by layer (gpt-oss): layers in ``min(shards, layers)`` runs, what comes before the
    layers in the first shard, what comes after in the last."""
    layers = _int(p.values.lookup(p.family.layers_key), p.family.path, "the layer count", 1)
    n = max(1, min(shards, layers))
    per = -(-layers // n)
    first_loop = min((s.block for s in specs if s.layer is not None), default=0)
    groups: list[list[Logical]] = [[] for _ in range(n)]
    for s in specs:
        g = min(n - 1, s.layer // per) if s.layer is not None else (0 if s.block < first_loop else n - 1)
        groups[g].append(s)
    return groups


@dataclass(frozen=True)
class Shard:
    """One file: its name and the (tensor, parts of it stored here) in the index's order."""

    file: str
    items: tuple[tuple[Logical, tuple[Part, ...]], ...]


def shard_name(p: Preset, index0: int, count: int) -> str:
    names = {"index": index0 + 1, "index0": index0, "count": count, "last": count - 1}
    return fill(p.sharding.name, names, f"{p.family.path}: sharding.name")


def plan_shards(p: Preset) -> list[Shard]:
    """The preset's shards: its tensors cut as the family's sharding says, an FP8 scale marked
    ``scale_apart`` moved to the last shard (ahead of that shard's own tensors)."""
    specs = list(tensors(p))
    if p.sharding.cut == "layers":
        groups = layer_groups(p, specs, p.shards)
    else:
        cuts = byte_cuts(specs, p.shards) if p.sharding.cut == "bytes" else count_cuts(specs, p.shards, p.sharding.snap)
        groups = [specs[a:b] for a, b in itertools.pairwise(cuts)]
    n = len(groups)
    deferred: list[tuple[Logical, tuple[Part, ...]]] = []
    items: list[list] = []
    for s, group in enumerate(groups):
        own = []
        for t in group:
            if t.apart and s < n - 1:
                own.append((t, t.parts[:1]))
                deferred.append((t, t.parts[1:]))
            else:
                own.append((t, t.parts))
        items.append(own)
    items[-1] = deferred + items[-1]
    return [Shard(shard_name(p, s, n), tuple(it)) for s, it in enumerate(items)]
