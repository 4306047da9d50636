"""Plan stage: a pure function of the headers, the config, the mapping table and the rules.

It reads no tensor data. It decides every output tensor, its sources in order, the fuse op, NVFP4
or kept (and the rule why), and the shard and byte offset it lands at, so that ``pack`` can write
each shard's header before any data and the manifest is this plan plus hashes. Every inconsistency
(a fused group with a missing member, members that cannot be fused, a module whose shards are only
partly excluded, a weight whose K is not a multiple of 16) fails here, before any work.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import NamedTuple

from . import rules
from .checkpoint import Checkpoint, gc_paused
from .errors import ConvertError
from .mapping import ENGINES, Group, Mapping, template_regex
from .options import DEFAULT_MAX_SHARD, LAYOUTS, Options  # noqa: F401 - re-exported: plan.Options
from .recipe import FP8_BLOCK, Format, Recipe, find_recipe
from .safetensors_format import DTYPES, TensorInfo, encode_header, size_of
from .sidefiles import Skipped

GROUP_SIZE = 16
MXFP4_GROUP = 32


class Kind(StrEnum):
    """What an item becomes: a recipe format (``recipe.Format``, same values) or a copied tensor."""

    NVFP4 = Format.NVFP4.value
    FP8_BLOCK = Format.FP8_BLOCK.value
    KEEP = Format.KEEP.value  # a linear layer kept in high precision
    COPY = "copy"  # not a linear layer: copied as stored


class Op(StrEnum):
    """How an item's sources make its tensor."""

    NONE = "none"  # one source
    CAT = "cat"  # concatenated on dim 0
    STACK = "stack"  # stacked on a new dim 0


class Encoding(StrEnum):
    """How a logical source tensor is stored."""

    DENSE = "dense"
    MXFP4 = "mxfp4"
    FP8_BLOCK = "fp8_block"


NVFP4, FP8, KEEP, COPY = Kind.NVFP4, Kind.FP8_BLOCK, Kind.KEEP, Kind.COPY
QUANTIZED = (NVFP4, FP8)
KEPT_FOR_ENGINE = "kept for the engines: "


class SourceTensor(NamedTuple):  # a tuple: one per stored module (250,000 in the released K3)
    """One logical source tensor: stored dense, or as MXFP4 / FP8 parts that decode to it."""

    module: str
    name: str  # logical name, e.g. "...experts.0.w1.weight"
    encoding: Encoding
    dtype: str  # stored dtype of the values ("MXFP4" for mxfp4)
    shape: tuple[int, ...]  # logical shape
    parts: tuple[TensorInfo, ...]  # stored tensors this source consumes (values first)

    @property
    def file(self) -> str:
        return self.parts[0].file

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


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
    input_scale: float | None = None  # nvfp4: the constant activation scale written with it

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
        return sum(s.nbytes for it in self.items for s in it.sources)

    @property
    def parts(self) -> list[TensorInfo]:
        """Every stored input tensor the unit reads."""
        return [p for it in self.items for s in it.sources for p in s.parts]


class Placed(NamedTuple):  # a tuple: one per output tensor
    tensor: OutTensor
    start: int  # absolute offset in the shard file
    end: int


@dataclass(frozen=True, slots=True)
class Shard:
    file: str
    placed: tuple[Placed, ...]
    header: bytes  # the 8-byte length and the JSON, padded so data starts 16-byte aligned

    @property
    def size(self) -> int:
        return self.placed[-1].end if self.placed else len(self.header)


@dataclass(frozen=True)
class Plan:
    mapping: Mapping
    recipe: Recipe
    options: Options
    patterns: tuple[rules.Pattern, ...]
    units: tuple[Unit, ...]
    shards: tuple[Shard, ...]
    exclude_modules: tuple[str, ...]
    warnings: tuple[str, ...]
    side_files: tuple[str, ...]
    inputs: tuple[tuple[str, int], ...]  # (file, size)
    layer_kinds: dict[int, str] = field(default_factory=dict)
    engine_groups: tuple[EngineGroup, ...] = ()
    notes: tuple[str, ...] = ()  # decisions worth saying (e.g. a condition decided from the tensors)
    side_folders: tuple[str, ...] = ()  # empty input folders, recreated (sidefiles.scan)
    skipped_files: tuple[Skipped, ...] = ()  # input files neither read nor copied, with the reason

    @property
    def items(self) -> list[Item]:
        return [it for u in self.units for it in u.items]

    @property
    def bytes_in(self) -> int:
        return sum(p.end - p.start for u in self.units for it in u.items for s in it.sources for p in s.parts)

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


#: SourceTensor formats a checkpoint's ``quantization_config`` may declare: the formats this tool reads
#: (K3's MXFP4 experts in compressed-tensors, DeepSeek's 128x128 block FP8). Anything else is an
#: already-converted checkpoint, which converting again would only degrade.
SOURCE_FORMATS = {"compressed-tensors": {"mxfp4-pack-quantized"}, "fp8": {"e4m3"}}
_ORIGINAL = "convert the original (BF16, MXFP4 or block-FP8) checkpoint instead"


def check_convertible(ckpt: Checkpoint) -> None:
    """Refuse an input that is already a converted checkpoint (ours, ModelOpt's, llm-compressor's,
    GPTQ/AWQ...), before any planning: the plan would otherwise treat packed codes as weights and
    fail mid-write, or quietly quantize twice."""
    where = f"{ckpt.folder}"
    marker = ckpt.folder / "manifest.json"
    if marker.is_file():
        made = _json_field(marker, "format")
        if made == "kimi-convert-manifest":
            raise ConvertError(f"{where}: this is an output of kimi-convert (manifest.json): {_ORIGINAL}; "
                               "check this one with `kimi-convert verify-manifest`")
    hq = ckpt.folder / "hf_quant_config.json"
    if hq.is_file():
        algo = (_json_field(hq, "quantization") or {}).get("quant_algo") if hq.stat().st_size < 1 << 26 else None
        raise ConvertError(f"{where}: already quantized by NVIDIA Model Optimizer (hf_quant_config.json, "
                           f"quant_algo {algo or 'unknown'}): {_ORIGINAL}")
    for cfg in (ckpt.config, ckpt.config.get("text_config")):
        q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if isinstance(q, dict):
            _check_quant_config(q, where)
    for name, info in ckpt.tensors.items():
        mod, suffix = _module_of(name)
        quantized = (suffix in ("weight_scale_2", "weight_global_scale", "qweight", "qzeros", "SCB")
                     or (suffix == "weight" and info.dtype in ("U8", "I8", "I32") and f"{mod}.weight_scale" in
                         ckpt.tensors))
        if quantized:
            raise ConvertError(f"{info.file}: tensor {name}: {mod} is already quantized ({info.dtype} "
                               f"{suffix}): {_ORIGINAL}")


def _json_field(path, key: str):
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return obj.get(key) if isinstance(obj, dict) else None


def _check_quant_config(q: dict, where: str) -> None:
    method = q.get("quant_method")
    formats = SOURCE_FORMATS.get(method)
    if formats is None:
        algo = q.get("quant_algo") or q.get("format") or q.get("bits")
        raise ConvertError(f"{where}: config.json: quantization_config says the input is already quantized "
                           f"({method}{f', {algo}' if algo else ''}): {_ORIGINAL}")
    found = {str(g.get("format", q.get("format"))) for g in (q.get("config_groups") or {}).values()
             if isinstance(g, dict)} or {str(q.get("format") or q.get("fmt") or next(iter(formats)))}
    if not found <= formats:
        raise ConvertError(f"{where}: config.json: quantization_config: {method} format "
                           f"{', '.join(sorted(found - formats))} is not a source format this tool reads "
                           f"({', '.join(sorted(formats))}): {_ORIGINAL}")


class _Modules(defaultdict):
    """discover_sources' module map. It also holds, once made, the parents' children that each
    resolve_fusions call (one per engine) would otherwise derive again from 250,000 modules."""

    children: tuple[dict[str, dict[str, str]], list[str]] | None = None


def discover_sources(ckpt: Checkpoint) -> dict[str, dict[str, SourceTensor]]:
    """module -> {suffix: SourceTensor}; MXFP4 and FP8 block-scaled weights become one logical weight."""
    t = ckpt.tensors
    consumed: set[str] = set()
    out: dict[str, dict[str, SourceTensor]] = _Modules(dict)
    block = fp8_block_size(ckpt.config)
    for name in t:
        mod, _, suffix = name.rpartition(".")
        if suffix == "weight_packed":
            src = out[mod]["weight"] = _mxfp4_source(mod, t)
            for p in src.parts:
                consumed.add(p.name)
        elif suffix == "weight" and t[name].dtype == "F8_E4M3":
            if f"{mod}.weight_scale_inv" not in t:
                raise ConvertError(f"{t[name].file}: tensor {name}: FP8 weight without its {mod}.weight_scale_inv")
            out[mod]["weight"] = _fp8_source(mod, t, block)
            consumed.update(p.name for p in out[mod]["weight"].parts)
    for name, info in t.items():
        if name in consumed:
            continue
        mod, _, suffix = name.rpartition(".")
        if suffix in ("weight_scale", "weight_scale_inv") and f"{mod}.weight" not in t:
            raise ConvertError(f"{info.file}: tensor {name}: scale without its weight {mod}.weight(_packed)")
        out[mod][suffix] = SourceTensor(mod, name, Encoding.DENSE, info.dtype, info.shape, (info,))
    return out


def _mxfp4_source(mod: str, t: dict[str, TensorInfo]) -> SourceTensor:
    packed = t[f"{mod}.weight_packed"]
    scale = t.get(f"{mod}.weight_scale")
    if scale is None:
        raise ConvertError(f"{packed.file}: tensor {packed.name}: MXFP4 weight without its {mod}.weight_scale")
    if packed.dtype != "U8" or len(packed.shape) != 2:
        raise ConvertError(f"{packed.file}: tensor {packed.name}: MXFP4 packed weight must be U8 [N, K/2], "
                           f"is {packed.dtype}{list(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    want = [n, math.ceil(k / MXFP4_GROUP)]
    if scale.dtype != "U8" or scale.shape != tuple(want) or k % MXFP4_GROUP:
        raise ConvertError(
            f"{scale.file}: tensor {scale.name}: MXFP4 scale must be U8 {want} for a [{n}, {k}] weight "
            f"(K a multiple of {MXFP4_GROUP}), is {scale.dtype}{list(scale.shape)}"
        )
    return SourceTensor(mod, f"{mod}.weight", Encoding.MXFP4, "MXFP4", (n, k), (packed, scale))


def fp8_block_size(config: dict) -> tuple[int, int]:
    q = config.get("quantization_config") or {}
    b = q.get("weight_block_size", [128, 128]) if isinstance(q, dict) else [128, 128]
    if not (isinstance(b, list) and len(b) == 2 and all(type(v) is int and v > 0 for v in b)):
        raise ConvertError(f"config.json: quantization_config.weight_block_size {b!r} is not [rows, cols]")
    return b[0], b[1]


def _fp8_source(mod: str, t: dict[str, TensorInfo], block: tuple[int, int]) -> SourceTensor:
    w, s = t[f"{mod}.weight"], t[f"{mod}.weight_scale_inv"]
    if len(w.shape) != 2:
        raise ConvertError(f"{w.file}: tensor {w.name}: FP8 block-scaled weight must be 2-D, is {list(w.shape)}")
    want = [math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])]
    if s.dtype not in ("F32", "BF16") or list(s.shape) != want:
        raise ConvertError(
            f"{s.file}: tensor {s.name}: FP8 scale must be F32 {want} for {list(w.shape)} with blocks "
            f"{list(block)}, is {s.dtype}{list(s.shape)}"
        )
    return SourceTensor(mod, w.name, Encoding.FP8_BLOCK, "F8_E4M3", w.shape, (w, s))


# ---------------------------------------------------------------------------------------------
# Fusion: which modules each group instance takes


@dataclass(frozen=True, slots=True)
class Fused:
    group: Group
    parent: str
    members: tuple[str, ...]  # full module names in member order
    engine: str = ""  # the engine whose packed module this is ("" when fused on disk)

    @property
    def name(self) -> str:
        return f"{self.parent}.{self.group.name}"


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """One packed module an engine builds from stored-apart members: recorded in the plan and manifest,
    and the reason its quantized members share one global scale."""

    name: str  # full name of the engine's packed module
    engines: tuple[str, ...]
    members: tuple[str, ...]  # source modules in the engine's order
    rows: tuple[tuple[int, int], ...]  # each member's rows in the engine's fused weight


def _applies(g: Group, short_parent: str, kinds: dict[int, str], m: Mapping, config: dict,
             when: bool | str | None = "") -> bool | None:
    """True or False; None when a config condition is absent (the tensors present decide). ``when``:
    _when(g, m, config), if known."""
    for rx in g.parent_regexes():
        hit = rx.fullmatch(short_parent)
        if hit is None:
            continue
        if g.layer_type is not None:
            layer = hit.groupdict().get("layer")
            if layer is None or kinds.get(int(layer)) != g.layer_type:
                return False
        return _when(g, m, config) if when == "" else when
    return False


def _when(g: Group, m: Mapping, config: dict) -> bool | None:
    """The group's config condition: False, True, or None when the config does not say."""
    values = [(m.config_value(config, k), v) for k, v in g.when]
    if any(have is not None and have != want for have, want in values):
        return False
    return None if any(have is None for have, _ in values) else True


def resolve_fusions(modules: dict[str, dict[str, SourceTensor]], m: Mapping, config: dict, groups: list[Group],
                    engine: str = "", notes: list[str] | None = None) -> list[Fused]:
    """Per parent module, the largest complete applicable group first; a partial group fails.

    A group whose config condition is absent from the config applies where all its members are
    present (the tensors decide; ``notes`` says so once per condition)."""
    kinds = m.layer_kinds(config)
    children, parents = _children(modules)
    with_leaf: dict[str, list[int]] = defaultdict(list)  # leaf -> the groups (by order) it is a member of
    for order, g in enumerate(groups):
        for x in dict.fromkeys(g.members):
            with_leaf[x].append(order)
    candidates: dict[tuple[str, ...], list[tuple[int, Group]]] = {}  # leaves -> groups with a member among them
    when = [_when(g, m, config) for g in groups]
    said: set[str] = set()
    chosen: list[Fused] = []
    for parent in parents:
        leaves = children[parent]
        key = tuple(leaves)
        todo = candidates.get(key)
        if todo is None:
            todo = candidates[key] = [(o, groups[o]) for o in sorted({o for x in key for o in with_leaf.get(x, ())})]
        if not todo:
            continue
        short = m.strip(parent)
        complete = []
        for order, g in todo:
            present = [x for x in g.members if x in leaves]
            applies = _applies(g, short, kinds, m, config, when[order])
            if applies is False:
                continue
            if len(present) != len(g.members):
                if applies is None:
                    continue
                missing = [x for x in g.members if x not in leaves]
                raise ConvertError(
                    f"module {parent}.{g.name}: fused group is missing {', '.join(missing)} "
                    f"(has {', '.join(present)}); the {g.name} group applies to this layer"
                )
            if applies is None and notes is not None:
                cond = ", ".join(f"{k} = {v}" for k, v in g.when)
                if cond not in said:
                    said.add(cond)
                    notes.append(f"config.json does not say {cond.split(' = ')[0]}: decided from the tensors "
                                 f"present ({g.name} where {', '.join(g.members)} exist)")
            complete.append((-len(g.members), order, g))
        taken: set[str] = set()
        for _, _, g in sorted(complete, key=lambda c: (c[0], c[1])):
            if taken.isdisjoint(g.members):
                taken.update(g.members)
                chosen.append(Fused(g, parent, tuple(leaves[x] for x in g.members), engine))
    return chosen


def _children(modules: dict[str, dict[str, SourceTensor]]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """parent -> {leaf: module} of the modules with a weight, and the parents sorted."""
    if isinstance(modules, _Modules) and modules.children is not None:
        return modules.children
    children: dict[str, dict[str, str]] = defaultdict(dict)
    for mod, params in modules.items():
        if "weight" in params and "." in mod:
            parent, _, leaf = mod.rpartition(".")
            children[parent][leaf] = mod
    out = (children, sorted(children))
    if isinstance(modules, _Modules):
        modules.children = out
    return out


def _disk_groups(m: Mapping, opts: Options) -> list[Group]:
    """The groups written fused on disk: none for the source layout; SGLang's for --layout sglang."""
    known = {g.name for g in m.groups}
    for n in (*opts.fuse, *opts.no_fuse):
        if n not in known:
            raise ConvertError(f"--fuse/--no-fuse: {m.name} has no group {n!r} (known: {', '.join(sorted(known))})")
    if opts.layout not in LAYOUTS:
        raise ConvertError(f"--layout {opts.layout!r}: expected one of {', '.join(LAYOUTS)}")
    if opts.layout == "source":
        if opts.fuse:
            raise ConvertError("--fuse writes fused modules: it needs --layout sglang")
        return []
    return [g for g in m.groups if opts.layout in g.engines and g.on_disk and not g.unquantized_only
            and (g.enabled or g.name in opts.fuse) and g.name not in opts.no_fuse]


def _not_on_disk_notes(m: Mapping, opts: Options, fusions: list[Fused]) -> list[str]:
    """Why a packed module of the layout's engine present in this checkpoint is still written unfused."""
    if opts.layout == "source":
        return []
    out = {}
    for f in fusions:
        g = f.group
        if f.engine == opts.layout and (not g.on_disk or g.unquantized_only) and g.name not in out \
                and (g.reason or g.unquantized_only):
            why = g.reason if not g.on_disk else "built only for an unquantized model"
            out[g.name] = f"{g.name} written unfused with --layout {opts.layout}: {why or 'not fused on disk'}"
    return list(out.values())


def _loadable_on_disk(disk: list[Fused], ctx: _Context, notes: list[str]) -> list[Fused]:
    """Only the fused modules the layout's engine loads fused on disk in the format decided for them (the
    mapping's [layout.ENGINE] formats, found with verify-manifest --engine); the others stay unfused."""
    allowed = ctx.m.layouts.get(ctx.opts.layout)
    if allowed is None:
        return disk
    probe = _Context(ctx.m, ctx.recipe, ctx.opts, ctx.patterns, defaultdict(int), ctx.expert_rx, ctx.modules)
    out, said = [], set()
    for f in disk:
        try:
            kind = _decide(f.name, list(f.members), f.group, probe).kind
        except ConvertError:
            out.append(f)  # the real decision below says what is wrong
            continue
        rows = [ctx.modules[mod]["weight"].shape[0] for mod in f.members]
        why = None
        if kind not in allowed[0]:
            why = allowed[1]
        elif kind == FP8 and any(n % FP8_BLOCK for n in rows[:-1]):
            why = f"block FP8 tiles would straddle its members (rows {rows}, tiles of {FP8_BLOCK})"
        if why is None:
            out.append(f)
        elif (f.group.name, kind) not in said:
            said.add((f.group.name, kind))
            notes.append(f"{f.group.name} ({kind}) written unfused with --layout {ctx.opts.layout}: {why}")
    return out


def _engine_groups(m: Mapping) -> dict[str, list[Group]]:
    """Per engine, the packed modules it builds for a quantized model."""
    return {e: [g for g in m.groups if e in g.engines and not g.unquantized_only] for e in ENGINES}


def _fuse_shape(f: Fused, srcs: list[SourceTensor], suffix: str) -> tuple[int, ...]:
    first = srcs[0]
    for s in srcs[1:]:
        if (s.encoding, s.dtype) != (first.encoding, first.dtype):
            raise ConvertError(
                f"module {f.name}: cannot fuse {s.name} ({s.dtype}) with {first.name} ({first.dtype}): dtypes differ"
            )
        if f.group.op == Op.STACK and s.shape != first.shape:
            raise ConvertError(
                f"module {f.name}: cannot stack {s.name} {list(s.shape)} with {first.name} {list(first.shape)}"
            )
        if f.group.op == Op.CAT and (len(s.shape) != len(first.shape) or s.shape[1:] != first.shape[1:]):
            raise ConvertError(
                f"module {f.name}: cannot concatenate {s.name} {list(s.shape)} with {first.name} "
                f"{list(first.shape)} along dim 0"
            )
    if not first.shape:
        raise ConvertError(f"module {f.name}: cannot fuse scalar {suffix} tensors")
    if f.group.op == Op.STACK:
        return (len(srcs), *first.shape)
    return (sum(s.shape[0] for s in srcs), *first.shape[1:])


# ---------------------------------------------------------------------------------------------
# Exclusion: decided per source shard


@dataclass
class _Decision:
    kind: Kind
    rule: str
    input_scale: float | None = None


@dataclass
class _Context:
    """What deciding a module's format needs: the mapping, the recipe, the rules and their use counts."""

    m: Mapping
    recipe: Recipe
    opts: Options
    patterns: list[rules.Pattern]
    used: dict[rules.Pattern, int]
    expert_rx: list[re.Pattern[str]]
    modules: dict[str, dict[str, SourceTensor]] = field(default_factory=dict)
    memo: dict[tuple, tuple] = field(default_factory=dict)  # per expert template: is_linear, decisions
    template_rx: list[re.Pattern[str]] | None = None  # made on first use; [] when rules tell experts apart

    def is_expert(self, module: str) -> bool:
        return any(rx.fullmatch(self.m.strip(module)) for rx in self.expert_rx)

    def template(self, module: str) -> str | None:
        """A routed expert module's name with its expert index replaced (``...experts.#.w1``) when no
        glob in force can tell two expert indices apart (what is decided for one expert then holds for
        all); None for any other module, or when some glob can (``--exclude '*.experts.1?.*'``)."""
        if self.template_rx is None:
            m, rec = self.m, self.recipe
            globs = [*m.linear, *m.not_linear, *(r.pattern for r in m.keep), *(r.pattern for r in m.restrict),
                     *(g for r in rec.rules for g in r.modules), *(p.text for p in self.patterns)]
            self.template_rx = ([re.compile(template_regex(t).pattern + r"\.(?P<_expert_index>[0-9]+)\.[^.]+")
                                 for t in m.expert_sets] if all(map(_index_blind, globs)) else [])
        if not self.template_rx:
            return None
        short = self.m.strip(module)
        for rx in self.template_rx:
            hit = rx.fullmatch(short)
            if hit is not None:
                a, b = hit.span("_expert_index")
                off = len(module) - len(short)
                return f"{module[:off + a]}#{module[off + b:]}"
        return None


def _index_blind(glob: str) -> bool:
    """Whether a glob matches all expert indices alike (an index: ASCII digits between dots). It must
    have no ``?`` and no ``[...]`` class that takes a digit (fnmatch's own parsing), and each run of
    literal digits must touch a literal that is neither a digit nor a dot (``conv1d``, ``w13``): such a
    run cannot lie inside an index. Every other token is a ``*`` or matches only non-digits, so an index
    lies inside what one ``*`` matches, and another index matches the same way."""
    tokens: list[str | None] = []  # literal characters; None for a '*' or a class
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        i += 1
        if c == "?":
            return False
        if c == "[":
            j = i
            if j < n and glob[j] == "!":
                j += 1
            if j < n and glob[j] == "]":
                j += 1
            while j < n and glob[j] != "]":
                j += 1
            if j < n:  # a class (else '[' is a literal)
                if any(fnmatchcase(d, glob[i - 1 : j + 1]) for d in "0123456789"):
                    return False
                tokens.append(None)
                i = j + 1
                continue
        tokens.append(None if c == "*" else c)

    def digit(k: int) -> bool:
        return 0 <= k < len(tokens) and tokens[k] is not None and tokens[k] in "0123456789"

    def stops(k: int) -> bool:  # a literal an index cannot contain or end at
        return 0 <= k < len(tokens) and tokens[k] is not None and not digit(k) and tokens[k] != "."

    for k in range(len(tokens)):
        if digit(k) and not digit(k - 1):
            end = k
            while digit(end):
                end += 1
            if not (stops(k - 1) or stops(end)):
                return False
    return True


def _is_linear(mod: str, shape: tuple[int, ...], ctx: _Context, key: str | None) -> bool:
    """Mapping.is_linear, once per expert template ``key`` (and weight rank)."""
    if key is None:
        return ctx.m.is_linear(mod, shape)
    key = ("linear", key, len(shape) == 2)
    hit = ctx.memo.get(key)
    if hit is None:
        hit = ctx.memo[key] = (ctx.m.is_linear(mod, shape),)
    return hit[0]


def _decide_apart(mod: str, ctx: _Context, key: str | None) -> _Decision:
    """_decide for a module stored apart; a routed expert's decision is made once per expert template
    ``key`` (the rules' use counts still count every module)."""
    if key is None:
        return _decide(mod, [mod], None, ctx)
    hit = ctx.memo.get(("decide", key))
    if hit is None:
        used, ctx.used = ctx.used, defaultdict(int)
        try:
            dec = _decide(mod, [mod], None, ctx)
        finally:
            counted, ctx.used = ctx.used, used
        hit = (dec, tuple(counted.items()))
        if mod not in dec.rule and ctx.m.strip(mod) not in dec.rule:  # a rule that names its module is its own
            ctx.memo["decide", key] = hit
    dec, counted = hit
    for p, n in counted:
        ctx.used[p] += n
    return dec


def _decide(name: str, members: list[str], group: Group | None, ctx: _Context) -> _Decision:
    """The format of one linear module (or a module fused on disk from ``members``): the mapping's
    keeps first (what the engines build unquantized), then the exclusion rules (decided per source
    shard), then the recipe's first matching rule."""
    m = ctx.m
    if group is not None and not group.quantize:
        return _Decision(KEEP, f"mapping {m.name}: {group.name}: {group.reason}")
    for mod in members:
        k = m.keep_rule(mod)
        if k is not None:
            return _Decision(KEEP, f"mapping {m.name}: keep {k.pattern!r}: {k.reason}")
    hits = {mod: rules.first_match(ctx.patterns, mod, m.text_prefix) for mod in members}
    for p in hits.values():
        if p is not None:
            ctx.used[p] += 1
    excluded = [mod for mod, p in hits.items() if p is not None]
    if excluded:
        why = "; ".join(dict.fromkeys(p.describe() for p in hits.values() if p is not None))
        if len(excluded) == len(members):
            return _Decision(KEEP, f"excluded by {why}")
        kept = [mod for mod in members if mod not in excluded]
        if ctx.opts.keep_partial:
            return _Decision(KEEP, f"--keep-partial: shards {', '.join(excluded)} excluded by {why}")
        raise ConvertError(
            f"module {name}: only some shards are excluded: excluded {', '.join(excluded)}; "
            f"not excluded {', '.join(kept)}; exclude all of them, or pass --keep-partial to keep "
            f"the whole module in high precision"
        )
    rule = ctx.recipe.decide(members[0], m.strip(members[0]), ctx.is_expert(members[0]))
    if rule is None:
        return _Decision(KEEP, f"recipe {ctx.recipe.name}: no rule matches: kept")
    scale = rule.input_scale if ctx.opts.input_scale is None or rule.input_scale is None else ctx.opts.input_scale
    why = rule.reason or rule.describe()
    r = m.restriction(members[0])
    if r is not None and rule.format.value not in r.formats:
        return _Decision(KEEP, f"{KEPT_FOR_ENGINE}mapping {m.name}: {rule.format.value} asked by recipe "
                               f"{ctx.recipe.name}, but {r.reason}")
    return _Decision(Kind(rule.format), f"recipe {ctx.recipe.name}: {why}", scale)


# ---------------------------------------------------------------------------------------------
# Items, units, shards


def _outputs(name: str, kind: Kind, shape: tuple[int, ...], src_dtype: str, input_scale: float | None
             ) -> tuple[OutTensor, ...]:
    """The output tensors of a linear module (their shapes made once per kind and shape: a million
    output tensors share a few dozen shape tuples in the released K3)."""
    return tuple(OutTensor(name + suffix, dtype, shp)
                 for suffix, dtype, shp in _output_specs(kind, shape, src_dtype, input_scale is not None))


@functools.lru_cache(maxsize=4096)
def _output_specs(kind: Kind, shape: tuple[int, ...], src_dtype: str, input_scale: bool
                  ) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((t.name, t.dtype, t.shape) for t in _output_tensors("", kind, shape, src_dtype, input_scale or None))


def _output_tensors(name: str, kind: Kind, shape: tuple[int, ...], src_dtype: str, input_scale: float | None
                    ) -> tuple[OutTensor, ...]:
    if kind == NVFP4:
        lead = shape[:-1]
        outs = (
            OutTensor(f"{name}.weight", "U8", (*lead, shape[-1] // 2)),
            OutTensor(f"{name}.weight_scale", "F8_E4M3", (*lead, shape[-1] // GROUP_SIZE)),
            OutTensor(f"{name}.weight_scale_2", "F32", ()),
        )
        return outs + ((OutTensor(f"{name}.input_scale", "F32", ()),) if input_scale is not None else ())
    if kind == FP8:
        n, k = shape
        return (OutTensor(f"{name}.weight", "F8_E4M3", shape),
                OutTensor(f"{name}.weight_scale", "F32", (-(-n // FP8_BLOCK), 1, -(-k // FP8_BLOCK), 1)))
    return (OutTensor(f"{name}.weight", src_dtype, shape),)


def _weight_item(name: str, srcs: list[SourceTensor], op: Op, group: Group | None, shape: tuple[int, ...],
                 dec: _Decision) -> Item:
    where = f"module {name}: weight {list(shape)}"
    if dec.kind == NVFP4:
        if group is None and len(shape) != 2:
            raise ConvertError(f"{where} selected for NVFP4 is not 2-D; exclude it (--exclude '{name}')")
        if shape[-1] % GROUP_SIZE:
            raise ConvertError(
                f"{where} selected for NVFP4 but K={shape[-1]} is not a multiple of {GROUP_SIZE}; "
                f"exclude it (--exclude '{name}')"
            )
    elif dec.kind == FP8:
        if len(shape) != 2 or op == Op.STACK:
            raise ConvertError(f"{where} selected for block FP8 is not 2-D; exclude it (--exclude '{name}')")
        if shape[1] % FP8_BLOCK:
            raise ConvertError(f"{where} selected for block FP8 but K={shape[1]} is not a multiple of {FP8_BLOCK} "
                               f"(the engines refuse it); exclude it (--exclude '{name}')")
        if any(s.shape[0] % FP8_BLOCK for s in srcs[:-1]):
            raise ConvertError(f"{where}: block FP8 fused on disk needs every member but the last to have a multiple "
                               f"of {FP8_BLOCK} rows (tiles must not straddle members); use --layout source")
    dtype = "BF16" if srcs[0].encoding != Encoding.DENSE else srcs[0].dtype
    outs = _outputs(name, dec.kind, shape, dtype, dec.input_scale)
    return Item(name, dec.kind, op, group.name if group else None, tuple(srcs), outs, dec.rule,
                dec.input_scale if dec.kind == NVFP4 else None)


def _copy_item(out_name: str, srcs: list[SourceTensor], op: Op, group: Group | None, shape, rule: str) -> Item:
    dtype = srcs[0].dtype
    if srcs[0].encoding != Encoding.DENSE:
        raise ConvertError(f"tensor {srcs[0].name}: {srcs[0].encoding} tensor of a module that is not a linear layer")
    return Item(out_name, COPY, op, group.name if group else None, tuple(srcs),
                (OutTensor(out_name, dtype, shape),), rule)


def build_items(ckpt: Checkpoint, modules: dict[str, dict[str, SourceTensor]], disk: list[Fused], ctx: _Context
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
            shape = _fuse_shape(f, srcs, suffix)
            if suffix == "weight":
                dec = _decide(f.name, list(f.members), f.group, ctx)
                items.append(_weight_item(f.name, srcs, Op(f.group.op), f.group, shape, dec))
            else:
                items.append(_copy_item(f"{f.name}.{suffix}", srcs, Op(f.group.op), f.group, shape,
                                        f"fused {suffix} of {f.group.name}"))
    for mod in sorted(modules):
        if mod in in_group:
            continue
        params = modules[mod]
        key = ctx.template(mod) if "weight" in params else None
        for suffix, src in sorted(params.items()) if len(params) > 1 else params.items():
            if suffix == "weight" and _is_linear(mod, src.shape, ctx, key):
                dec = _decide_apart(mod, ctx, key)
                items.append(_weight_item(mod, [src], Op.NONE, None, src.shape, dec))
            else:
                items.append(_copy_item(src.name, [src], Op.NONE, None, src.shape, "not a linear weight: copied"))
    return items


def _rekeep(it: Item, why: str) -> Item:
    """The item kept in high precision instead. Only modules stored apart are re-decided (members of an
    engine packed module, a MoE layer's experts); a module fused on disk is decided as a whole."""
    return _weight_item(it.name, list(it.sources), Op.NONE, None, it.sources[0].shape, _Decision(KEEP, why))


def _expert_sets(items: list[Item], m: Mapping) -> dict[str, list[int]]:
    """Indices of the linear items under each MoE ``experts`` module (``...experts.{e}.{w}``)."""
    rxs = expert_regexes(m)
    sets: dict[str, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        if it.kind != COPY:
            short = m.strip(it.name)
            for rx in rxs:
                if rx.fullmatch(short):
                    sets[it.name.rsplit(".", 2)[0]].append(i)
                    break
    return sets


def expert_regexes(m: Mapping) -> list[re.Pattern[str]]:
    """Full-match regexes of routed expert modules (``...experts.{e}.{w}``, without the text prefix)."""
    return [re.compile(template_regex(t).pattern + r"\.\d+\.[^.]+") for t in m.expert_sets]


def _same_format(items: list[Item], idx: list[int], what: str, opts: Options) -> None:
    """The modules one engine layer is built from must share one format (engines pick one quant
    method per layer): a mix fails, or with --keep-partial keeps them all."""
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


def _engine_formats(items: list[Item], fusions: list[Fused]) -> None:
    """A module kept because an engine cannot load the recipe's format there takes every member of
    each engine packed module it belongs to (transitively) along: they must share one format."""
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


def _check_engine_layers(items: list[Item], fusions: list[Fused], m: Mapping, opts: Options) -> None:
    """MoE layers (experts all-or-nothing) and every engine packed module: one format each."""
    _engine_formats(items, fusions)
    for parent, idx in _expert_sets(items, m).items():
        _same_format(items, idx, f"module {parent} (the engines quantize a layer's experts all-or-nothing)", opts)
    index = {it.name: i for i, it in enumerate(items)}
    for f in fusions:
        idx = [index[mod] for mod in f.members if mod in index]
        _same_format(items, idx, f"module {f.name} ({f.engine}'s packed module)", opts)


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


def _units(items: list[Item], fusions: list[Fused], ckpt: Checkpoint) -> list[Unit]:
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
    return sorted(units, key=lambda u: at[id(u.items[0])])  # a unit's items are in position order


def _layout_source(units: list[Unit], ckpt: Checkpoint) -> tuple[list[Unit], list[Shard]]:
    """Each unit in the input file of its first source tensor, under the input file's name."""
    by_file: dict[str, list[Unit]] = defaultdict(list)
    for u in units:
        by_file[u.items[0].sources[0].parts[0].file].append(u)
    placed_units, shards = [], []
    for f in ckpt.files:
        if f not in by_file:
            continue
        placed_units += [Unit(u.items, u.shared_scale, f) for u in by_file[f]]
        shards.append(_shard(f, [[t for it in u.items for t in it.outputs] for u in by_file[f]]))
    return placed_units, shards


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
    return Shard(name, placed, head)


def exclude_list(items: list[Item], m: Mapping, recipe: Recipe) -> list[str]:
    """The recipe's own list (if it has one) plus every kept linear module it does not already name,
    each fused module's shards, and whole MoE expert sets."""
    names: set[str] = set()
    for it in items:
        if it.kind != KEEP:
            continue
        names.add(it.name)
        if it.group is not None:
            names.update(s.module for s in it.sources)
    names.update(p for p, idx in _expert_sets(items, m).items() if all(items[i].kind == KEEP for i in idx))
    if recipe.exclude_modules is None:
        return sorted(names)
    listed = [a for p in recipe.exclude_modules for a in aliases(p, recipe.aliases)]
    extra = sorted(n for n in names if not any(fnmatchcase(n, p) for p in recipe.exclude_modules))
    return list(dict.fromkeys([*listed, *extra]))


def aliases(name: str, on: bool) -> list[str]:
    """Every spelling of a module name the engines' runtime prefixes probe (NVIDIA's converter writes
    them all): the checkpoint name, ``block_sparse_moe`` -> ``mlp`` (SGLang's mapper), and the names
    without ``language_model.model.`` and without ``language_model.``."""
    if not on:
        return [name]
    names = {name}
    if "block_sparse_moe" in name:
        names.add(name.replace("block_sparse_moe", "mlp"))
    for n in list(names):
        if n.startswith("language_model.model."):
            rest = n[len("language_model.model."):]
            names.update({"model." + rest, rest})
        elif n.startswith("language_model."):
            names.add(n[len("language_model."):])
    return sorted(names)


def collect_patterns(m: Mapping, opts: Options) -> list[rules.Pattern]:
    """The exclusion rules in force: the mapping's recipe, --exclude, --exclude-from."""
    patterns: list[rules.Pattern] = []
    if opts.default_excludes:
        patterns += [rules.Pattern(r.pattern, f"default ({m.name})", r.reason) for r in m.exclude]
    patterns += rules.from_cli(opts.exclude)
    for f in opts.exclude_from:
        patterns += rules.from_file(f)
    return patterns


def _engine_records(fusions: list[Fused], modules: dict[str, dict[str, SourceTensor]]) -> tuple[EngineGroup, ...]:
    """One record per packed module name, the engines that build it merged."""
    merged: dict[tuple[str, tuple[str, ...]], list[str]] = defaultdict(list)
    for f in fusions:
        merged[(f.name, f.members)].append(f.engine)
    out = []
    for (name, members), engines in sorted(merged.items()):
        rows, pos = [], 0
        for mod in members:
            n = modules[mod]["weight"].shape[0]
            rows.append((pos, pos + n))
            pos += n
        out.append(EngineGroup(name, tuple(sorted(set(engines))), members, tuple(rows)))
    return tuple(out)


@gc_paused()
def make_plan(ckpt: Checkpoint, m: Mapping, opts: Options, patterns: list[rules.Pattern] | None = None,
              recipe: Recipe | None = None) -> Plan:
    """``patterns`` and ``recipe`` replace the collected rules and the named recipe (verify-manifest
    re-plans with the recorded ones)."""
    check_convertible(ckpt)
    recipe = recipe or find_recipe(opts.recipe, m.name)
    patterns = collect_patterns(m, opts) if patterns is None else patterns
    ctx = _Context(m, recipe, opts, patterns, defaultdict(int), expert_regexes(m))
    notes: list[str] = []
    modules = discover_sources(ckpt)
    ctx.modules = modules
    resolve_fusions(modules, m, ckpt.config, list(m.groups))  # any group the config says applies must be whole
    disk = _loadable_on_disk(resolve_fusions(modules, m, ckpt.config, _disk_groups(m, opts), opts.layout, notes),
                             ctx, notes)
    fused_on_disk = {mod for f in disk for mod in f.members}
    fusions = [f for e, gs in _engine_groups(m).items()
               for f in resolve_fusions(modules, m, ckpt.config, gs, e, notes)
               if fused_on_disk.isdisjoint(f.members)]
    notes += _not_on_disk_notes(m, opts, fusions)
    items = build_items(ckpt, modules, disk, ctx)
    _check_engine_layers(items, fusions, m, opts)
    units = _units(items, fusions, ckpt)
    units, shards = _layout_source(units, ckpt) if opts.layout == "source" else _layout(units, opts.max_shard_size)
    warnings = list(m.unmatched(modules))
    if (unfit := m.fits(ckpt.config)) is not None:
        warnings.insert(0, unfit)
    more, already = _unused_patterns([p for p in dict.fromkeys(patterns) if not ctx.used[p]], items, modules, m)
    warnings += more
    if already:
        notes.append(f"{len(already)} exclusion pattern(s) name modules kept anyway (by the mapping, the recipe "
                     f"or an earlier pattern): {', '.join(repr(p.text) for p in already[:5])}"
                     + (" ..." if len(already) > 5 else ""))
    return Plan(
        mapping=m,
        recipe=recipe,
        options=opts,
        patterns=tuple(patterns),
        units=tuple(units),
        shards=tuple(shards),
        exclude_modules=tuple(exclude_list(items, m, recipe)),
        warnings=tuple(warnings),
        side_files=tuple(ckpt.side_files),
        inputs=tuple((f, ckpt.file_sizes[f]) for f in ckpt.files),
        layer_kinds=m.layer_kinds(ckpt.config),
        engine_groups=_engine_records(fusions, modules),
        notes=tuple(dict.fromkeys(notes)),
        side_folders=tuple(ckpt.side_folders),
        skipped_files=tuple(ckpt.skipped_files),
    )


def _unused_patterns(unused: list[rules.Pattern], items: list[Item], modules: dict[str, dict[str, SourceTensor]],
                    m: Mapping) -> tuple[list[str], list[rules.Pattern]]:
    """Warnings for patterns that decided nothing, and the patterns that were not needed.

    A pattern naming a module that something else already keeps (the mapping, the recipe, an earlier
    pattern: re-using an output's own exclude list does this for every name) is no mistake: it is
    reported once, as a plan note. Only a pattern that names nothing in the input, or names a fused
    module instead of its source shards, gets a warning."""
    warnings, already = [], []
    nothing: dict[str, list[str]] = defaultdict(list)  # origin -> patterns: one line per file
    names = set(modules)
    for p in unused:
        fused = [it.name for it in items if it.group and rules.matches(p.text, it.name, m.text_prefix)]
        if fused:
            warnings.append(f"exclusion pattern {p.text!r} ({p.origin}) names fused module {fused[0]}: exclusion "
                            "is per source shard, name its shards instead")
        elif _names_a_module(p.text, names, m.text_prefix):
            already.append(p)
        else:
            nothing[p.origin].append(repr(p.text))
    for origin, texts in nothing.items():
        what = f"exclusion pattern {texts[0]}" if len(texts) == 1 else f"{len(texts)} exclusion patterns"
        warnings.append(f"{what} ({origin}) match{'es' if len(texts) == 1 else ''} no module of the input"
                        + (f": {', '.join(texts)}" if len(texts) > 1 else ""))
    return warnings, already


def _names_a_module(pattern: str, modules: set[str], text_prefix: str) -> bool:
    if not any(c in pattern for c in "*?[") and "." in pattern:  # a plain name: a lookup, not a scan
        bare = pattern.removesuffix(".weight")
        return bare in modules or text_prefix + bare in modules
    return any(rules.matches(pattern, mod, text_prefix) for mod in modules)
