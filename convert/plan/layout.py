"""Items, units, shards: the output modules, what is computed together, and where each tensor lands."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import replace

from .. import formats, schemes
from ..checkpoint import Checkpoint
from ..errors import ConvertError
from ..mapping import Group, Mapping, stacked_experts_module
from ..options import Options
from ..safetensors_format import DTYPES, encode_header, size_of
from .decide import DecideContext, Decision, decide_apart, decide_module, is_linear_once
from .fusion import Fused, fuse_shape
from .model import (
    COPY,
    KEEP,
    KEPT_FOR_ENGINE,
    NVFP4,
    Encoding,
    Item,
    Kind,
    Op,
    OutTensor,
    Placed,
    Shard,
    SourceTensor,
    Unit,
)
from .operations import agreed, of_item

# ---------------------------------------------------------------------------------------------
# Items, units, shards


def _outputs(name: str, kind: Kind, shape: tuple[int, ...], src_dtype: str, input_scale: float | None,
             output_format: str | None, experts: int = 0) -> tuple[OutTensor, ...]:
    """The output tensors of a linear module, as its output format spells them (convert/formats/); a kept
    module is its ``weight`` in every format (``output_format`` None)."""
    if kind == KEEP:
        return (OutTensor(f"{name}.weight", src_dtype, shape),)
    specs = formats.tensor_specs(output_format, kind, shape, src_dtype, input_scale is not None, experts)
    return tuple(OutTensor(name + suffix, dtype, shp) for suffix, dtype, shp in specs)


def _weight_item(name: str, srcs: list[SourceTensor], op: Op, group: Group | None, shape: tuple[int, ...],
                 dec: Decision, output_format: str | None, experts: int = 0) -> Item:
    """``experts``: a stacked expert bank's count (its weight's first dimension), quantized one expert at a time."""
    if schemes.quantized(dec.kind):
        why = schemes.get(dec.kind).shape_error(shape, group is not None, op == Op.STACK, experts)
        if why is not None:
            raise ConvertError(f"module {name}: weight {list(shape)} selected for {schemes.get(dec.kind).TITLE} "
                               f"{why}; exclude it (--exclude '{name}')")
    dtype = "BF16" if srcs[0].encoding != Encoding.DENSE else srcs[0].dtype
    outs = _outputs(name, dec.kind, shape, dtype, dec.input_scale, output_format, experts)
    fmt = output_format if dec.kind != KEEP else None
    pinned = schemes.quantized(dec.kind) and schemes.get(dec.kind).INPUT_SCALE
    rule = f"{dec.rule}; a stacked bank of {experts} experts, one global scale each" if experts else dec.rule
    return Item(name, dec.kind, op, group.name if group else None, tuple(srcs), outs, rule,
                of_item(dec.kind, fmt, srcs, experts), dec.input_scale if pinned else None, fmt, experts)


def stacked_experts(mod: str, src: SourceTensor, m: Mapping) -> int:
    """A stacked expert bank's expert count (0 for any other module): its weight's first dimension, which the config
    check (``plan.consistency``, before any item) has held to [E, N, K] with E the config's count."""
    return src.shape[0] if m.stacked_bank(mod) else 0


def _copy_item(out_name: str, srcs: list[SourceTensor], op: Op, group: Group | None, shape, rule: str) -> Item:
    dtype = srcs[0].dtype
    if srcs[0].encoding != Encoding.DENSE:
        raise ConvertError(f"tensor {srcs[0].name}: {srcs[0].encoding} tensor of a module that is not a linear layer")
    return Item(out_name, COPY, op, group.name if group else None, tuple(srcs),
                (OutTensor(out_name, dtype, shape),), rule, of_item(COPY, None, srcs))


def build_items(ckpt: Checkpoint, modules: dict[str, dict[str, SourceTensor]], disk: list[Fused], ctx: DecideContext
                ) -> list[Item]:
    in_group = {mod: f for f in disk for mod in f.members}
    items: list[Item] = []
    for f in disk:
        suffixes = [set(modules[mod]) for mod in f.members]
        if any(s != suffixes[0] for s in suffixes):
            raise ConvertError(
                f"module {f.name}: members have different tensors: "
                + "; ".join(f"{mod}: {', '.join(sorted(s))}" for mod, s in zip(f.members, suffixes, strict=True))
            )
        for suffix in sorted(suffixes[0]):
            srcs = [modules[mod][suffix] for mod in f.members]
            shape = fuse_shape(f, srcs, suffix)
            if suffix == "weight":
                dec = decide_module(f.name, list(f.members), f.group, ctx)
                items.append(_weight_item(f.name, srcs, Op(f.group.op), f.group, shape, dec, ctx.recipe.output_format))
            else:
                items.append(_copy_item(f"{f.name}.{suffix}", srcs, Op(f.group.op), f.group, shape,
                                        f"fused {suffix} of {f.group.name}"))
    for mod in sorted(modules):
        if mod in in_group:
            continue
        params = modules[mod]
        key = ctx.template(mod) if "weight" in params else None
        for suffix, src in sorted(params.items()) if len(params) > 1 else params.items():
            if suffix == "weight" and is_linear_once(mod, src.shape, ctx, key):
                dec = decide_apart(mod, ctx, key)
                items.append(_weight_item(mod, [src], Op.NONE, None, src.shape, dec, ctx.recipe.output_format,
                                          stacked_experts(mod, src, ctx.m)))
            elif (n := stacked_copy(src, ctx.m)) is not None:
                items.append(replace(_copy_item(src.name, [src], Op.NONE, None, src.shape, n[1]), experts=n[0]))
            else:
                items.append(_copy_item(src.name, [src], Op.NONE, None, src.shape, "not a linear weight: copied"))
    check_stacked(items)
    return items


def stacked_copy(src: SourceTensor, m: Mapping) -> tuple[int, str] | None:
    """A stacked bank stored without ``.weight`` (``[stacked]`` names the tensor itself): its expert count (held to
    the config's by ``plan.consistency``) and why it is copied as stored, which only a ``keep = true`` table allows
    (the tool quantizes stacked banks stored as ``X.weight``); None for any other tensor."""
    if m.stacked is None or m.stacked_tensor_bank(src.name) != src.name:
        return None
    if not m.stacked.keep:
        raise ConvertError(f"{src.file}: tensor {src.name}: a stacked expert bank stored without .weight is written "
                           f"only as stored: mapping {m.name} needs [stacked] keep = true")
    return src.shape[0], f"mapping {m.name}: stacked: {m.stacked.reason}; copied as stored, its experts module excluded"


def check_stacked(items: list[Item]) -> None:
    """The stacked banks an engine builds into one fused-MoE module (``stacked_experts_module``) are decided alike:
    its quant method is asked once, for the module, so one bank kept and another quantized is refused, naming
    both."""
    first: dict[str, Item] = {}
    for it in items:
        if not it.experts:
            continue
        mod = stacked_experts_module(it.name)
        other = first.setdefault(mod, it)
        if (other.kind == NVFP4) != (it.kind == NVFP4):
            raise ConvertError(f"module {it.name}: {it.kind}, but {other.name} is {other.kind}: the engines build "
                               f"{mod} from both banks as one module (one scheme); keep all of its banks or none "
                               f"(--exclude '{mod.rsplit('.', 1)[0]}.*')")


def stored_copies(items: list[Item]) -> list[Item]:
    """A recipe's ``keep_stored``: each kept module whose source is encoded (FP8 with its scales, MXFP4) becomes
    copies of its stored tensors, each under its own name (the weight and its scale, as the source stores them),
    instead of one weight decoded to BF16. A module fused on disk cannot stay as stored: refused."""
    out: list[Item] = []
    for it in items:
        if it.kind != KEEP or all(s.encoding == Encoding.DENSE for s in it.sources):
            out.append(it)
            continue
        if it.op != Op.NONE or any(s.view for s in it.sources):
            raise ConvertError(f"module {it.name}: kept as stored ({it.sources[0].encoding}), but it is fused on "
                               "disk or a view of a stored tensor; pass --layout source")
        for s in it.sources:
            for p in s.parts:
                src = SourceTensor(s.module, p.name, Encoding.DENSE, p.dtype, p.shape, (p,))
                out.append(Item(p.name, COPY, Op.NONE, None, (src,), (OutTensor(p.name, p.dtype, p.shape),),
                                f"{it.rule}; kept as stored ({s.encoding})", of_item(COPY, None, [src])))
    return out


def _rekeep(it: Item, why: str) -> Item:
    """The item kept in high precision instead. Only modules stored apart are re-decided (members of an
    engine packed module, a MoE layer's experts); a module fused on disk is decided as a whole."""
    return _weight_item(it.name, list(it.sources), Op.NONE, None, it.sources[0].shape, Decision(KEEP, why), None)


def expert_sets(items: list[Item], m: Mapping) -> dict[str, list[int]]:
    """Indices of the linear items under each MoE ``experts`` module (``...experts.{e}.{w}``)."""
    rxs = m.expert_regexes()
    sets: dict[str, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        if it.kind != COPY:
            short = m.strip(it.name)
            for rx in rxs:
                if rx.fullmatch(short):
                    sets[it.name.rsplit(".", 2)[0]].append(i)
                    break
    return sets


def _same_scheme(items: list[Item], idx: list[int], what: str, opts: Options) -> None:
    """The modules one engine layer is built from must share one quantization scheme (engines pick one
    quant method per layer): a mix fails, or with --keep-partial keeps them all. (The messages' word
    "format" is the plan's reasons' own, kept byte for byte.)"""
    kinds = {items[i].kind for i in idx}
    if len(kinds) <= 1:
        return
    if not opts.keep_partial:
        detail = ", ".join(f"{items[i].name.rsplit('.', 1)[-1]}: {items[i].kind}" for i in idx[:8])
        raise ConvertError(f"{what}: its members must share one format, but they are {detail}"
                           f"{' ...' if len(idx) > 8 else ''}; exclude all of them, or pass --keep-partial")
    for i in idx:
        if items[i].kind != KEEP:
            items[i] = _rekeep(items[i], f"--keep-partial: {what} mixes formats")


def _engine_schemes(items: list[Item], fusions: list[Fused]) -> None:
    """A module kept because an engine cannot load the recipe's scheme there takes every member of
    each engine packed module it belongs to (transitively) along: they must share one scheme."""
    if not any(it.rule.startswith(KEPT_FOR_ENGINE) for it in items):
        return
    index = {it.name: i for i, it in enumerate(items)}
    members = [[index[mod] for mod in f.members if mod in index] for f in fusions]
    changed = True
    while changed:
        changed = False
        for f, idx in zip(fusions, members, strict=True):
            why = next((items[i].rule for i in idx if items[i].rule.startswith(KEPT_FOR_ENGINE)), None)
            if why is None:
                continue
            for i in idx:
                if items[i].kind != KEEP:
                    items[i] = _rekeep(items[i], f"{KEPT_FOR_ENGINE}{f.name} ({f.engine}'s packed module) "
                                                 f"shares one format: {why[len(KEPT_FOR_ENGINE):]}")
                    changed = True


def check_engine_layers(items: list[Item], fusions: list[Fused], m: Mapping, opts: Options) -> None:
    """MoE layers (experts all-or-nothing) and every engine packed module: one quantization scheme each."""
    _engine_schemes(items, fusions)
    for parent, idx in expert_sets(items, m).items():
        _same_scheme(items, idx, f"module {parent} (the engines quantize a layer's experts all-or-nothing)", opts)
    index = {it.name: i for i, it in enumerate(items)}
    for f in fusions:
        idx = [index[mod] for mod in f.members if mod in index]
        _same_scheme(items, idx, f"module {f.name} ({f.engine}'s packed module)", opts)


class _Union:
    """Union-find over module names: the engine fusion groups that share one global scale."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        while self.parent.setdefault(x, x) != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: str, b: str) -> None:
        self.parent[self.find(b)] = self.find(a)


def make_units(items: list[Item], fusions: list[Fused], ckpt: Checkpoint) -> list[Unit]:
    """One unit per set of NVFP4 modules that share a global scale (the union of every engine's
    packed modules over them), one per other item; in input order."""
    order = {f: i for i, f in enumerate(ckpt.files)}
    at = {id(it): min((order[p.file], p.start) for s in it.sources for p in s.parts) for it in items}

    def pos(it: Item) -> tuple:
        return at[id(it)]

    by_name = {it.name: it for it in items}
    uf = _Union()
    shared: list[tuple[str, str]] = []  # (a member, packed module name)
    for f in fusions:
        quant = [mod for mod in f.members if mod in by_name and by_name[mod].kind == NVFP4]
        for mod in quant[1:]:
            uf.join(quant[0], mod)
        if len(quant) > 1:
            shared.append((quant[0], f.name))
    label: dict[str, set[str]] = defaultdict(set)
    for mod, name in shared:
        label[uf.find(mod)].add(name)
    sets: dict[str, list[Item]] = defaultdict(list)
    for it in items:
        if it.name in uf.parent:
            sets[uf.find(it.name)].append(it)
    grouped = {it.name for its in sets.values() for it in its}
    units = [Unit(tuple(sorted(its, key=pos)), " + ".join(sorted(label[root]))) for root, its in sets.items()]
    units += [Unit((it,), None) for it in items if it.name not in grouped]
    units.sort(key=lambda u: at[id(u.items[0])])  # a unit's items are in position order
    return [agreed(u) for u in units]


def shards_as_source(units: list[Unit], ckpt: Checkpoint) -> tuple[list[Unit], list[Shard]]:
    """Each unit in the input file of its first source tensor, under the input file's name."""
    by_file: dict[str, list[Unit]] = defaultdict(list)
    for u in units:
        by_file[u.items[0].sources[0].parts[0].file].append(u)
    placed_units, shards = [], []
    for f in ckpt.files:
        if f not in by_file:
            continue
        placed_units += [Unit(u.items, u.shared_scale, f) for u in by_file[f]]
        shards.append(shard_of_units(f, by_file[f]))
    return placed_units, shards


def shards_by_size(units: list[Unit], max_size: int) -> tuple[list[Unit], list[Shard]]:
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
        shards.append(shard_of_units(name, b))
    return placed_units, shards


def shard_of_units(name: str, units: list[Unit]) -> Shard:
    """The shard ``name`` holding these units' output tensors (the plan's, and ``expand``'s one shard at a time)."""
    return _shard(name, [[t for it in u.items for t in it.outputs] for u in units])


def _itemsize(t: OutTensor) -> int:
    return DTYPES[t.dtype].itemsize


def _in_write_order(units: list[list[OutTensor]]) -> list[OutTensor] | None:
    """The tensors in the order the pipeline produces them (unit by unit, wider dtypes first in a
    unit), if that keeps every tensor aligned to its item size; else None.

    In this order the shard is written front to back, so its sha256 is computed from the bytes as
    they are written, with no second read of the file."""
    out, pos = [], 0
    orders: dict[tuple[str, ...], list[int]] = {}  # dtypes of a unit's tensors -> their write order
    for ts in units:
        if len(ts) > 1:
            dtypes = tuple([t.dtype for t in ts])
            order = orders.get(dtypes)
            if order is None:
                order = orders[dtypes] = sorted(range(len(ts)), key=lambda i: -DTYPES[dtypes[i]].itemsize)
            ts = [ts[i] for i in order]
        for t in ts:
            if pos % DTYPES[t.dtype].itemsize:
                return None
            out.append(t)
            pos += _nbytes(t)
    return out


def _nbytes(t: OutTensor) -> int:
    return size_of(t.dtype, t.shape)


def _shard(name: str, units: list[list[OutTensor]]) -> Shard:
    """Header first, then the tensors in write order when that keeps them aligned, else wider dtypes
    first (as safetensors does) so that every tensor is aligned to its item size."""
    ordered = _in_write_order(units) or sorted((t for ts in units for t in ts), key=lambda t: -_itemsize(t))
    ends = list(itertools.accumulate(map(_nbytes, ordered)))
    starts = [0, *ends[:-1]] if ends else []
    head = encode_header(ordered, starts, ends)
    base = len(head)
    placed = tuple(map(Placed, ordered, [base + a for a in starts], [base + b for b in ends]))
    return Shard(name, placed, base)
