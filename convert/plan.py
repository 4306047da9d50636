"""Plan stage: a pure function of the headers, the config, the mapping table and the rules.

It reads no tensor data. It decides every output tensor, its sources in order, the fuse op, NVFP4
or kept (and the rule why), and the shard and byte offset it lands at, so that ``pack`` can write
each shard's header before any data and the manifest is this plan plus hashes. Every inconsistency
(a fused group with a missing member, members that cannot be fused, a module whose shards are only
partly excluded, a weight whose K is not a multiple of 16) fails here, before any work.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

from . import rules
from .errors import ConvertError
from .mapping import Group, Mapping, template_regex
from .source import DTYPES, Checkpoint, TensorInfo

GROUP_SIZE = 16
MXFP4_GROUP = 32
DEFAULT_MAX_SHARD = 5 * 1000**3


@dataclass(frozen=True)
class Source:
    """One logical source tensor: stored dense, or as MXFP4 / FP8 parts that decode to it."""

    module: str
    name: str  # logical name, e.g. "...experts.0.w1.weight"
    encoding: str  # "dense", "mxfp4" or "fp8_block"
    dtype: str  # stored dtype of the values ("MXFP4" for mxfp4)
    shape: tuple[int, ...]  # logical shape
    parts: tuple[TensorInfo, ...]  # stored tensors this source consumes (values first)

    @property
    def file(self) -> str:
        return self.parts[0].file

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Item:
    """One output module (or loose tensor) and the sources it is built from."""

    name: str  # output module name (or tensor name for a copy)
    kind: str  # "nvfp4", "keep" (a linear layer kept in high precision) or "copy"
    op: str  # "none", "cat" (dim 0) or "stack"
    group: str | None  # the mapping group that fused it
    sources: tuple[Source, ...]
    outputs: tuple[OutTensor, ...]
    rule: str  # why NVFP4 or kept

    def row_ranges(self) -> list[tuple[int, int]]:
        """Rows (dim 0) of the fused tensor each source occupies, in order."""
        out, pos = [], 0
        for s in self.sources:
            n = 1 if self.op == "stack" else (s.shape[0] if s.shape else 1)
            out.append((pos, pos + n))
            pos += n
        return out


@dataclass(frozen=True)
class Unit:
    """Items computed together: one item, or stored-apart modules sharing one global scale."""

    items: tuple[Item, ...]
    shared_scale: str | None
    shard: str = ""

    @property
    def nbytes_out(self) -> int:
        return sum(t.nbytes for it in self.items for t in it.outputs)

    @property
    def nbytes_in(self) -> int:
        return sum(s.nbytes for it in self.items for s in it.sources)

    @property
    def parts(self) -> list[TensorInfo]:
        """Every stored input tensor the unit reads."""
        return [p for it in self.items for s in it.sources for p in s.parts]


@dataclass(frozen=True)
class Placed:
    tensor: OutTensor
    start: int  # absolute offset in the shard file
    end: int


@dataclass(frozen=True)
class Shard:
    file: str
    placed: tuple[Placed, ...]
    header: bytes  # the 8-byte length and the JSON, padded so data starts 16-byte aligned

    @property
    def size(self) -> int:
        return self.placed[-1].end if self.placed else len(self.header)


@dataclass(frozen=True)
class Options:
    exclude: tuple[str, ...] = ()
    exclude_from: tuple[str, ...] = ()
    default_excludes: bool = True
    keep_partial: bool = False
    max_shard_size: int = DEFAULT_MAX_SHARD
    fuse: tuple[str, ...] = ()
    no_fuse: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "exclude": list(self.exclude),
            "exclude_from": list(self.exclude_from),
            "default_excludes": self.default_excludes,
            "keep_partial": self.keep_partial,
            "max_shard_size": self.max_shard_size,
            "fuse": list(self.fuse),
            "no_fuse": list(self.no_fuse),
        }


@dataclass(frozen=True)
class Plan:
    mapping: Mapping
    options: Options
    patterns: tuple[rules.Pattern, ...]
    units: tuple[Unit, ...]
    shards: tuple[Shard, ...]
    exclude_modules: tuple[str, ...]
    warnings: tuple[str, ...]
    side_files: tuple[str, ...]
    inputs: tuple[tuple[str, int], ...]  # (file, size)
    layer_kinds: dict[int, str] = field(default_factory=dict)

    @property
    def items(self) -> list[Item]:
        return [it for u in self.units for it in u.items]

    @property
    def bytes_in(self) -> int:
        return sum(u.nbytes_in for u in self.units)

    @property
    def bytes_out(self) -> int:
        return sum(s.size for s in self.shards)

    def shard_of(self) -> dict[str, str]:
        return {p.tensor.name: s.file for s in self.shards for p in s.placed}


# ---------------------------------------------------------------------------------------------
# Sources: which stored tensors form one logical tensor


def _module_of(name: str) -> tuple[str, str]:
    mod, _, suffix = name.rpartition(".")
    return mod, suffix


def discover_sources(ckpt: Checkpoint) -> dict[str, dict[str, Source]]:
    """module -> {suffix: Source}; MXFP4 and FP8 block-scaled weights become one logical weight."""
    t = ckpt.tensors
    consumed: set[str] = set()
    out: dict[str, dict[str, Source]] = defaultdict(dict)
    block = fp8_block_size(ckpt.config)
    for name in t:
        mod, suffix = _module_of(name)
        if suffix == "weight_global_scale" or (suffix == "weight_packed" and f"{mod}.weight_global_scale" in t):
            raise ConvertError(f"{t[name].file}: tensor {name}: {mod} is already NVFP4; nothing to convert")
        if suffix == "weight_packed":
            out[mod]["weight"] = _mxfp4_source(mod, t)
            consumed.update(p.name for p in out[mod]["weight"].parts)
        elif suffix == "weight" and t[name].dtype == "F8_E4M3":
            if f"{mod}.weight_scale_inv" not in t:
                raise ConvertError(f"{t[name].file}: tensor {name}: FP8 weight without its {mod}.weight_scale_inv")
            out[mod]["weight"] = _fp8_source(mod, t, block)
            consumed.update(p.name for p in out[mod]["weight"].parts)
    for name, info in t.items():
        if name in consumed:
            continue
        mod, suffix = _module_of(name)
        if suffix in ("weight_scale", "weight_scale_inv") and f"{mod}.weight" not in t:
            raise ConvertError(f"{info.file}: tensor {name}: scale without its weight {mod}.weight(_packed)")
        out[mod][suffix] = Source(mod, name, "dense", info.dtype, info.shape, (info,))
    return out


def _mxfp4_source(mod: str, t: dict[str, TensorInfo]) -> Source:
    packed = t[f"{mod}.weight_packed"]
    scale = t.get(f"{mod}.weight_scale")
    where = f"{packed.file}: tensor {packed.name}"
    if scale is None:
        raise ConvertError(f"{where}: MXFP4 weight without its {mod}.weight_scale")
    if packed.dtype != "U8" or len(packed.shape) != 2:
        raise ConvertError(f"{where}: MXFP4 packed weight must be U8 [N, K/2], is {packed.dtype}{list(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    want = [n, math.ceil(k / MXFP4_GROUP)]
    if scale.dtype != "U8" or list(scale.shape) != want or k % MXFP4_GROUP:
        raise ConvertError(
            f"{scale.file}: tensor {scale.name}: MXFP4 scale must be U8 {want} for a [{n}, {k}] weight "
            f"(K a multiple of {MXFP4_GROUP}), is {scale.dtype}{list(scale.shape)}"
        )
    return Source(mod, f"{mod}.weight", "mxfp4", "MXFP4", (n, k), (packed, scale))


def fp8_block_size(config: dict) -> tuple[int, int]:
    q = config.get("quantization_config") or {}
    b = q.get("weight_block_size", [128, 128]) if isinstance(q, dict) else [128, 128]
    if not (isinstance(b, list) and len(b) == 2 and all(type(v) is int and v > 0 for v in b)):
        raise ConvertError(f"config.json: quantization_config.weight_block_size {b!r} is not [rows, cols]")
    return b[0], b[1]


def _fp8_source(mod: str, t: dict[str, TensorInfo], block: tuple[int, int]) -> Source:
    w, s = t[f"{mod}.weight"], t[f"{mod}.weight_scale_inv"]
    if len(w.shape) != 2:
        raise ConvertError(f"{w.file}: tensor {w.name}: FP8 block-scaled weight must be 2-D, is {list(w.shape)}")
    want = [math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])]
    if s.dtype not in ("F32", "BF16") or list(s.shape) != want:
        raise ConvertError(
            f"{s.file}: tensor {s.name}: FP8 scale must be F32 {want} for {list(w.shape)} with blocks "
            f"{list(block)}, is {s.dtype}{list(s.shape)}"
        )
    return Source(mod, w.name, "fp8_block", "F8_E4M3", w.shape, (w, s))


# ---------------------------------------------------------------------------------------------
# Fusion: which modules each group instance takes


@dataclass(frozen=True)
class Fused:
    group: Group
    parent: str
    members: tuple[str, ...]  # full module names in member order

    @property
    def name(self) -> str:
        return f"{self.parent}.{self.group.name}"


def _group_applies(g: Group, short_parent: str, kinds: dict[int, str], m: Mapping, config: dict) -> bool:
    for rx in g.parent_regexes():
        hit = rx.fullmatch(short_parent)
        if hit is None:
            continue
        if g.layer_type is not None:
            layer = hit.groupdict().get("layer")
            if layer is None or kinds.get(int(layer)) != g.layer_type:
                return False
        return all(m.config_value(config, k) == v for k, v in g.when)
    return False


def resolve_fusions(
    modules: dict[str, dict[str, Source]], m: Mapping, config: dict, opts: Options
) -> list[Fused]:
    """Per parent module, the largest complete applicable group first; a partial group fails."""
    known = {g.name for g in m.groups}
    for n in (*opts.fuse, *opts.no_fuse):
        if n not in known:
            raise ConvertError(f"--fuse/--no-fuse: {m.name} has no group {n!r} (known: {', '.join(sorted(known))})")
    groups = [
        g for g in m.groups if (g.enabled or g.name in opts.fuse) and g.name not in opts.no_fuse
    ]
    kinds = m.layer_kinds(config)
    children: dict[str, dict[str, str]] = defaultdict(dict)
    for mod, params in modules.items():
        if "weight" in params and "." in mod:
            parent, leaf = mod.rsplit(".", 1)
            children[parent][leaf] = mod
    chosen: list[Fused] = []
    for parent in sorted(children):
        leaves = children[parent]
        short = m.strip(parent)
        complete = []
        for order, g in enumerate(groups):
            if not _group_applies(g, short, kinds, m, config):
                continue
            present = [x for x in g.members if x in leaves]
            if not present:
                continue
            if len(present) != len(g.members):
                missing = [x for x in g.members if x not in leaves]
                raise ConvertError(
                    f"module {parent}.{g.name}: fused group is missing {', '.join(missing)} "
                    f"(has {', '.join(present)}); the {g.name} group applies to this layer"
                )
            complete.append((-len(g.members), order, g))
        taken: set[str] = set()
        for _, _, g in sorted(complete, key=lambda c: (c[0], c[1])):
            if taken.isdisjoint(g.members):
                taken.update(g.members)
                chosen.append(Fused(g, parent, tuple(leaves[x] for x in g.members)))
    return chosen


def _fuse_shape(f: Fused, srcs: list[Source], suffix: str) -> tuple[int, ...]:
    first = srcs[0]
    for s in srcs[1:]:
        if (s.encoding, s.dtype) != (first.encoding, first.dtype):
            raise ConvertError(
                f"module {f.name}: cannot fuse {s.name} ({s.dtype}) with {first.name} ({first.dtype}): dtypes differ"
            )
        if f.group.op == "stack" and s.shape != first.shape:
            raise ConvertError(
                f"module {f.name}: cannot stack {s.name} {list(s.shape)} with {first.name} {list(first.shape)}"
            )
        if f.group.op == "cat" and (len(s.shape) != len(first.shape) or s.shape[1:] != first.shape[1:]):
            raise ConvertError(
                f"module {f.name}: cannot concatenate {s.name} {list(s.shape)} with {first.name} "
                f"{list(first.shape)} along dim 0"
            )
    if not first.shape:
        raise ConvertError(f"module {f.name}: cannot fuse scalar {suffix} tensors")
    if f.group.op == "stack":
        return (len(srcs), *first.shape)
    return (sum(s.shape[0] for s in srcs), *first.shape[1:])


# ---------------------------------------------------------------------------------------------
# Exclusion: decided per source shard


@dataclass
class _Decision:
    kind: str
    rule: str


def _decide(
    name: str, members: list[str], group: Group | None, m: Mapping, patterns: list[rules.Pattern],
    used: dict[rules.Pattern, int], opts: Options,
) -> _Decision:
    if group is not None and not group.quantize:
        return _Decision("keep", f"mapping {m.name}: {group.name}: {group.reason}")
    for mod in members:
        k = m.keep_rule(mod)
        if k is not None:
            return _Decision("keep", f"mapping {m.name}: keep {k.pattern!r}: {k.reason}")
    hits = {mod: rules.first_match(patterns, mod, m.text_prefix) for mod in members}
    for p in hits.values():
        if p is not None:
            used[p] += 1
    excluded = [mod for mod, p in hits.items() if p is not None]
    if not excluded:
        return _Decision("nvfp4", "quantized: no exclusion rule matches")
    why = "; ".join(dict.fromkeys(p.describe() for p in hits.values() if p is not None))
    if len(excluded) == len(members):
        return _Decision("keep", f"excluded by {why}")
    kept = [mod for mod in members if mod not in excluded]
    if opts.keep_partial:
        return _Decision("keep", f"--keep-partial: shards {', '.join(excluded)} excluded by {why}")
    raise ConvertError(
        f"module {name}: only some shards are excluded: excluded {', '.join(excluded)}; "
        f"not excluded {', '.join(kept)}; exclude all of them, or pass --keep-partial to keep "
        f"the whole module in high precision"
    )


# ---------------------------------------------------------------------------------------------
# Items, units, shards


def _weight_item(name: str, srcs: list[Source], op: str, group: Group | None, shape: tuple[int, ...],
                 dec: _Decision) -> Item:
    if dec.kind == "nvfp4":
        where = f"module {name}: weight {list(shape)}"
        if group is None and len(shape) != 2:
            raise ConvertError(f"{where} selected for NVFP4 is not 2-D; exclude it (--exclude '{name}')")
        if shape[-1] % GROUP_SIZE:
            raise ConvertError(
                f"{where} selected for NVFP4 but K={shape[-1]} is not a multiple of {GROUP_SIZE}; "
                f"exclude it (--exclude '{name}')"
            )
        lead = shape[:-1]
        outs = (
            OutTensor(f"{name}.weight", "U8", (*lead, shape[-1] // 2)),
            OutTensor(f"{name}.weight_scale", "F8_E4M3", (*lead, shape[-1] // GROUP_SIZE)),
            OutTensor(f"{name}.weight_scale_2", "F32", ()),
        )
    else:
        dtype = "BF16" if srcs[0].encoding != "dense" else srcs[0].dtype
        outs = (OutTensor(f"{name}.weight", dtype, shape),)
    return Item(name, dec.kind, op, group.name if group else None, tuple(srcs), outs, dec.rule)


def _copy_item(out_name: str, srcs: list[Source], op: str, group: Group | None, shape, rule: str) -> Item:
    dtype = srcs[0].dtype
    if srcs[0].encoding != "dense":
        raise ConvertError(f"tensor {srcs[0].name}: {srcs[0].encoding} tensor of a module that is not a linear layer")
    return Item(out_name, "copy", op, group.name if group else None, tuple(srcs),
                (OutTensor(out_name, dtype, shape),), rule)


def build_items(ckpt: Checkpoint, m: Mapping, opts: Options, patterns: list[rules.Pattern],
                used: dict[rules.Pattern, int]) -> list[Item]:
    modules = discover_sources(ckpt)
    fused = resolve_fusions(modules, m, ckpt.config, opts)
    in_group = {mod: f for f in fused for mod in f.members}
    items: list[Item] = []
    for f in fused:
        suffixes = [set(modules[mod]) for mod in f.members]
        if any(s != suffixes[0] for s in suffixes):
            raise ConvertError(
                f"module {f.name}: members have different tensors: "
                + "; ".join(f"{mod}: {', '.join(sorted(s))}" for mod, s in zip(f.members, suffixes, strict=True))
            )
        for suffix in sorted(suffixes[0]):
            srcs = [modules[mod][suffix] for mod in f.members]
            shape = _fuse_shape(f, srcs, suffix)
            if suffix == "weight":
                dec = _decide(f.name, list(f.members), f.group, m, patterns, used, opts)
                items.append(_weight_item(f.name, srcs, f.group.op, f.group, shape, dec))
            else:
                items.append(_copy_item(f"{f.name}.{suffix}", srcs, f.group.op, f.group, shape,
                                        f"fused {suffix} of {f.group.name}"))
    for mod in sorted(modules):
        if mod in in_group:
            continue
        for suffix, src in sorted(modules[mod].items()):
            if suffix == "weight" and m.is_linear(mod):
                dec = _decide(mod, [mod], None, m, patterns, used, opts)
                items.append(_weight_item(mod, [src], "none", None, src.shape, dec))
            else:
                items.append(_copy_item(src.name, [src], "none", None, src.shape, "not a linear weight: copied"))
    return items


def _expert_sets(items: list[Item], m: Mapping) -> dict[str, list[int]]:
    """Indices of the linear items under each MoE ``experts`` module (``...experts.{e}.{w}``)."""
    rxs = [re.compile(template_regex(t).pattern + r"\.\d+\.[^.]+") for t in m.expert_sets]
    sets: dict[str, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        if it.kind in ("nvfp4", "keep") and any(rx.fullmatch(m.strip(it.name)) for rx in rxs):
            sets[it.name.rsplit(".", 2)[0]].append(i)
    return sets


def _check_expert_sets(items: list[Item], m: Mapping, opts: Options) -> list[Item]:
    """Engines quantize one MoE layer's experts all-or-nothing: a mix fails (or, with --keep-partial, keeps all)."""
    out = list(items)
    for parent, idx in _expert_sets(items, m).items():
        kinds = {items[i].kind for i in idx}
        if len(kinds) == 1:
            continue
        kept = [items[i].name for i in idx if items[i].kind == "keep"]
        if not opts.keep_partial:
            raise ConvertError(
                f"module {parent}: the engines quantize a layer's experts all-or-nothing, but "
                f"{len(kept)} of {len(idx)} are excluded (first: {kept[0]}); exclude all, or pass --keep-partial"
            )
        for i in idx:
            it = items[i]
            if it.kind == "nvfp4":
                dec = _Decision("keep", f"--keep-partial: other experts of {parent} are excluded")
                out[i] = _weight_item(it.name, list(it.sources), it.op, None, it.sources[0].shape, dec)
    return out


def _units(items: list[Item], m: Mapping, ckpt: Checkpoint) -> list[Unit]:
    order = {f: i for i, f in enumerate(ckpt.files)}

    def pos(it: Item) -> tuple:
        return min((order[p.file], p.start) for s in it.sources for p in s.parts)

    by_name = {it.name: it for it in items}
    grouped: set[str] = set()
    units: list[Unit] = []
    for sg in m.scale_groups:
        rxs = [template_regex(p) for p in sg.parents]
        for it in items:
            parent, _, leaf = it.name.rpartition(".")
            if leaf != sg.members[0] or it.kind != "nvfp4" or not any(rx.fullmatch(m.strip(parent)) for rx in rxs):
                continue
            mates = [by_name.get(f"{parent}.{x}") for x in sg.members]
            if all(x is not None and x.kind == "nvfp4" for x in mates):
                units.append(Unit(tuple(mates), f"{parent}.{sg.name}"))
                grouped.update(x.name for x in mates)
    units += [Unit((it,), None) for it in items if it.name not in grouped]
    return sorted(units, key=lambda u: min(pos(it) for it in u.items))


def _layout(units: list[Unit], max_size: int) -> tuple[list[Unit], list[Shard]]:
    bins: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        if bins[-1] and size + u.nbytes_out > max_size:
            bins.append([])
            size = 0
        bins[-1].append(u)
        size += u.nbytes_out
    n = len(bins)
    placed_units, shards = [], []
    for i, b in enumerate(bins, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        placed_units += [Unit(u.items, u.shared_scale, name) for u in b]
        shards.append(_shard(name, [[t for it in u.items for t in it.outputs] for u in b]))
    return placed_units, shards


def _itemsize(t: OutTensor) -> int:
    return DTYPES[t.dtype].itemsize


def _in_write_order(units: list[list[OutTensor]]) -> list[OutTensor] | None:
    """The tensors in the order the pipeline produces them (unit by unit, wider dtypes first in a
    unit), if that keeps every tensor aligned to its item size; else None.

    In this order the shard is written front to back, so its sha256 is computed from the bytes as
    they are written, with no second read of the file."""
    out, pos = [], 0
    for ts in units:
        for t in sorted(ts, key=lambda t: -_itemsize(t)):
            if pos % _itemsize(t):
                return None
            out.append(t)
            pos += t.nbytes
    return out


def _shard(name: str, units: list[list[OutTensor]]) -> Shard:
    """Header first, then the tensors in write order when that keeps them aligned, else wider dtypes
    first (as safetensors does) so that every tensor is aligned to its item size."""
    ordered = _in_write_order(units) or sorted((t for ts in units for t in ts), key=lambda t: -_itemsize(t))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offs, pos = [], 0
    for t in ordered:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        offs.append((pos, pos + t.nbytes))
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 16)
    head = len(text).to_bytes(8, "little") + text
    base = len(head)
    placed = tuple(Placed(t, base + a, base + b) for t, (a, b) in zip(ordered, offs, strict=True))
    return Shard(name, placed, head)


def exclude_list(items: list[Item], m: Mapping) -> list[str]:
    """Every kept linear module by its full name, each fused module's shards, and whole MoE expert sets."""
    names: set[str] = set()
    for it in items:
        if it.kind != "keep":
            continue
        names.add(it.name)
        if it.group is not None:
            names.update(s.module for s in it.sources)
    names.update(p for p, idx in _expert_sets(items, m).items() if all(items[i].kind == "keep" for i in idx))
    return sorted(names)


def collect_patterns(ckpt: Checkpoint, m: Mapping, opts: Options) -> list[rules.Pattern]:
    """The exclusion rules in force: the mapping's recipe, --exclude, --exclude-from, the input's own list."""
    patterns: list[rules.Pattern] = []
    if opts.default_excludes:
        patterns += [rules.Pattern(r.pattern, f"default ({m.name})", r.reason) for r in m.exclude]
    patterns += rules.from_cli(opts.exclude)
    for f in opts.exclude_from:
        patterns += rules.from_file(f)
    return patterns + rules.from_quant_config(ckpt.folder)


def make_plan(ckpt: Checkpoint, m: Mapping, opts: Options, patterns: list[rules.Pattern] | None = None) -> Plan:
    """``patterns`` replaces the collected rules (verify-manifest re-plans with the recorded ones)."""
    patterns = collect_patterns(ckpt, m, opts) if patterns is None else patterns
    used: dict[rules.Pattern, int] = defaultdict(int)
    items = _check_expert_sets(build_items(ckpt, m, opts, patterns, used), m, opts)
    units, shards = _layout(_units(items, m, ckpt), opts.max_shard_size)
    warnings = [_unmatched(p, items, m) for p in dict.fromkeys(patterns) if not used[p]]
    return Plan(
        mapping=m,
        options=opts,
        patterns=tuple(patterns),
        units=tuple(units),
        shards=tuple(shards),
        exclude_modules=tuple(exclude_list(items, m)),
        warnings=tuple(warnings),
        side_files=tuple(ckpt.side_files),
        inputs=tuple((f, ckpt.file_sizes[f]) for f in ckpt.files),
        layer_kinds=m.layer_kinds(ckpt.config),
    )


def _unmatched(p: rules.Pattern, items: list[Item], m: Mapping) -> str:
    msg = f"exclusion pattern {p.text!r} ({p.origin}) matches no linear module's source shard"
    fused = [it.name for it in items if it.group and rules.matches(p.text, it.name, m.text_prefix)]
    if fused:
        msg += f"; it names fused module {fused[0]}: exclusion is per source shard, name its shards instead"
    return msg
