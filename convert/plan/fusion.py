"""Fusion: which modules each group instance takes."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..errors import ConvertError
from ..mapping import ENGINES, Group, Mapping
from ..options import LAYOUTS, Options
from .decide import DecideContext, decide_module
from .discover import Modules
from .model import COPY, KEEP, Op, SourceTensor

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
    if isinstance(modules, Modules) and modules.children is not None:
        return modules.children
    children: dict[str, dict[str, str]] = defaultdict(dict)
    for mod, params in modules.items():
        if "weight" in params and "." in mod:
            parent, _, leaf = mod.rpartition(".")
            children[parent][leaf] = mod
    out = (children, sorted(children))
    if isinstance(modules, Modules):
        modules.children = out
    return out


def disk_groups(m: Mapping, opts: Options) -> list[Group]:
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


def not_on_disk_notes(m: Mapping, opts: Options, fusions: list[Fused]) -> list[str]:
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


def loadable_on_disk(disk: list[Fused], ctx: DecideContext, notes: list[str]) -> list[Fused]:
    """Only the fused modules the layout's engine loads fused on disk in the scheme decided for them (the
    mapping's [layout.ENGINE] formats, found with verify-manifest --engine); the others stay unfused."""
    allowed = ctx.m.layouts.get(ctx.opts.layout)
    if allowed is None:
        return disk
    probe = DecideContext(ctx.m, ctx.recipe, ctx.opts, ctx.patterns, defaultdict(int), ctx.expert_rx, ctx.modules)
    out, said = [], set()
    for f in disk:
        try:
            kind = decide_module(f.name, list(f.members), f.group, probe).kind
        except ConvertError:
            out.append(f)  # the real decision below says what is wrong
            continue
        why = None
        if kind not in allowed[0]:
            why = allowed[1]
        if why is None:
            out.append(f)
        elif (f.group.name, kind) not in said:
            said.add((f.group.name, kind))
            notes.append(f"{f.group.name} ({kind}) written unfused with --layout {ctx.opts.layout}: {why}")
    return out


def packed_groups(m: Mapping) -> dict[str, list[Group]]:
    """Per engine, the packed modules it builds for a quantized model."""
    return {e: [g for g in m.groups if e in g.engines and not g.unquantized_only] for e in ENGINES}


def check_members(fusions: list[Fused], modules: dict[str, dict[str, SourceTensor]], m: Mapping,
                  config: dict, kinds: dict[str, str] | None = None) -> None:
    """Every packed module an engine builds (or the layout writes fused) must be buildable from its members,
    whatever the layout: the engines fuse stored-apart members at load (w13, ``fused_qkv_a_g_proj``,
    ``in_proj_qkvgfab``), and a member of another K, another dtype or encoding, or (where the mapping says
    what the engine allots it) another row count leaves the fused parameter unfilled or makes the loader
    raise. Checked once, on the members' weights, before any work; one line naming the module and members.
    The row checks are read from the mapping (``rows``, ``same_rows``). ``kinds``: each module's decided
    kind (None: the shapes only, before the decisions); the dtypes must agree where the members are kept
    (the engine loads their bytes; a decoded MXFP4 or FP8 source is BF16), quantized members being written
    in one scheme anyway."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for f in fusions:
        if (f.name, f.members) in seen:
            continue
        seen.add((f.name, f.members))
        srcs = [modules[mod]["weight"] for mod in f.members if "weight" in modules.get(mod, {})]
        if len(srcs) != len(f.members):
            continue  # a member without a weight: resolve_fusions only groups modules with one
        first = srcs[0]
        short = {src.name: leaf for src, leaf in zip(srcs, f.group.members, strict=True)}
        kept = kinds is not None and all(kinds.get(mod) in (KEEP, COPY, None) for mod in f.members)
        for s in srcs[1:]:
            if kept and _loaded_dtype(s) != _loaded_dtype(first):
                raise ConvertError(
                    f"module {f.name}: members {short[first.name]} ({_fmt(first)}) and {short[s.name]} ({_fmt(s)}): "
                    "dtypes differ, and the engines load both into one parameter")
            if f.group.op == Op.STACK and s.shape != first.shape:
                raise ConvertError(f"module {f.name}: members {short[first.name]} {list(first.shape)} and "
                                   f"{short[s.name]} {list(s.shape)}: stacked members need one shape")
            if f.group.op == Op.CAT and s.shape[1:] != first.shape[1:]:
                raise ConvertError(
                    f"module {f.name}: members {short[first.name]} {list(first.shape)} and {short[s.name]} "
                    f"{list(s.shape)}: input dimension (K) differs, and the engines fuse them along the rows")
            if f.group.same_rows and s.shape[:1] != first.shape[:1]:
                raise ConvertError(
                    f"module {f.name}: members {short[first.name]} {list(first.shape)} and {short[s.name]} "
                    f"{list(s.shape)}: row counts differ, where the engine's fused parameter has equal halves")
        for member, expr in f.group.rows:
            src = modules[f.members[f.group.members.index(member)]]["weight"]
            want = _config_rows(expr, m, config, f"module {f.name}: member {member} {src.name}")
            if src.shape and src.shape[0] != want:
                raise ConvertError(f"module {f.name}: member {member} {src.name} has {src.shape[0]} rows; the config "
                                   f"says {expr} = {want}, the rows the engine allots it")


def _fmt(s: SourceTensor) -> str:
    return s.dtype if s.encoding == "dense" else f"{s.encoding}, decoded to BF16"


def _loaded_dtype(s: SourceTensor) -> str:
    """The dtype the engine reads for a kept member: its own, or BF16 for a decoded MXFP4 / FP8 source."""
    return s.dtype if s.encoding == "dense" else "BF16"


def _config_rows(expr: str, m: Mapping, config: dict, what: str) -> int:
    """The sum of the config values ``expr`` names (``a + b``). One absent or not an integer is refused: the
    engine sizes the member's parameter from it (a table's ``rows`` naming a key no config has would otherwise
    check nothing)."""
    total = 0
    for key in expr.split("+"):
        v = m.config_value(config, key.strip())
        if type(v) is not int:
            got = "absent" if v is None else f"{type(v).__name__} {v!r}"
            raise ConvertError(f"config.json: {key.strip()} is {got}, expected an integer: mapping {m.name} "
                               f"({m.path}) sizes {what} from it (rows = {expr!r})")
        total += v
    return total


def fuse_shape(f: Fused, srcs: list[SourceTensor], suffix: str) -> tuple[int, ...]:
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
