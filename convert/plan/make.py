"""make_plan: the stages put together."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import partial

from .. import globs, mtp, schemes
from ..checkpoint import Checkpoint
from ..errors import ConvertError
from ..gcpause import gc_paused
from ..mapping import Mapping
from ..options import Options
from ..recipe import Recipe, find_recipe, with_format
from ..vocabulary import KeepRule
from .banks import bank_outline, find_banks
from .consistency import check_config_tensors
from .decide import DecideContext
from .discover import check_convertible, discover_sources
from .expand import Expansion, expandable
from .fusion import (
    Fused,
    check_members,
    disk_groups,
    loadable_on_disk,
    not_on_disk_notes,
    packed_groups,
    resolve_fusions,
)
from .layout import build_items, check_engine_layers, make_units, shards_as_source, shards_by_size, stored_copies
from .model import EngineGroup, Item, Kind, Outline, PerModule, Plan, Shard, SourceTensor, Unit
from .names import collect_patterns, exclude_list


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


@dataclass(frozen=True, slots=True)
class _Staged:
    """What the stages make of one set of headers (the whole input, or its banks' first experts)."""

    items: list[Item]
    units: list[Unit]
    shards: list[Shard]
    engine_groups: tuple[EngineGroup, ...]
    warnings: list[str]
    notes: list[str]


@gc_paused()
def make_plan(ckpt: Checkpoint, m: Mapping, opts: Options, patterns: list[KeepRule] | None = None,
              recipe: Recipe | None = None, *, banked: bool = False) -> Plan:
    """``patterns`` and ``recipe`` replace the collected rules and the named recipe (verify-manifest
    re-plans with the recorded ones). ``banked``: plan each bank of alike routed experts once (banks.py)
    and make the module-by-module plan only when asked for (``plan`` prints the outline alone); the
    same plan either way."""
    check_convertible(ckpt)
    check_config_tensors(ckpt, m)
    if m.mtp is not None:  # the MTP layers the config announces are the ones stored (convert/mtp.py)
        mtp.check_layers(list(ckpt.tensors), lambda path: m.config_value(ckpt.config, path), m.mtp)
    mtp_at, mtp_layers = m.mtp_prefixes(ckpt.config, ckpt.tensors), m.mtp_layers(ckpt.config, ckpt.tensors)
    recipe = with_format(recipe or find_recipe(opts.recipe, m.name), opts.format)
    _check_input_scale(recipe, opts)
    patterns = collect_patterns(m, opts) if patterns is None else patterns
    found = find_banks(ckpt, m, recipe, opts, patterns) if banked else None
    if found is not None:
        reduced, banks = found
        st = _stages(reduced, m, opts, patterns, recipe, mtp_at)
        outline = bank_outline(st.units, st.engine_groups, banks, ckpt)
        if outline is not None:
            x = (Expansion(outline.units, outline.engine_groups, banks, tuple(ckpt.files))
                 if expandable(outline.engine_groups, banks) else None)
            return _plan(ckpt, m, opts, patterns, recipe, st,
                         exclude_list(st.items, m, recipe, banks.members, mtp_at, tied_head(ckpt, m),
                                      st.engine_groups, mtp_layers),
                         partial(_per_module, ckpt, m, opts, patterns, recipe, mtp_at), partial(_given, outline), x)
    st = _stages(ckpt, m, opts, patterns, recipe, mtp_at)
    per = PerModule(tuple(st.units), tuple(st.shards), st.engine_groups)
    return _plan(ckpt, m, opts, patterns, recipe, st, exclude_list(st.items, m, recipe, None, mtp_at,
                                                                   tied_head(ckpt, m), st.engine_groups, mtp_layers),
                 partial(_given, per), _outline)


# (module-level functions bound by ``partial``, not closures: a plan is pickled, from the process that made it
# (``planchild``) or to a worker)
def _per_module(ckpt: Checkpoint, m: Mapping, opts: Options, patterns: list[KeepRule], recipe: Recipe,
                mtp_at: tuple[str, ...]) -> PerModule:
    """A banked plan's module-by-module plan, made when asked for."""
    with gc_paused():
        full = _stages(ckpt, m, opts, patterns, recipe, mtp_at)
    return PerModule(tuple(full.units), tuple(full.shards), full.engine_groups)


def _given(value, *_):
    """``value``, whatever asked (a plan's ``per_module`` or ``outline_of`` made already)."""
    return value


def tied_head(ckpt: Checkpoint, m: Mapping) -> str | None:
    """The output head to name in the exclude list although the checkpoint stores none: a table's ``[lm_head]
    exclude_tied`` where the config ties the head to the embedding (Ernie 4.5 MoE: vLLM 0.33 builds the tied
    ``lm_head`` with ModelOpt's linear method unless excluded, and its tie fills the weight alone)."""
    head = m.lm_head
    if head is None or not head.exclude_tied or f"{m.text_prefix}{head.module}.weight" in ckpt.tensors:
        return None
    tie = m.config_value(ckpt.config, head.tie)
    if tie is None and m.text_config:
        tie = ckpt.config.get(head.tie)
    return f"{m.text_prefix}{head.module}" if tie is True else None


def _check_quantizes_something(items: list[Item], recipe: Recipe, opts: Options) -> None:
    """A plan that quantizes nothing would write a quantized checkpoint's config over BF16 weights: an output
    that says it is NVFP4 and is not, which no engine has a reason to load. Refused, naming why."""
    if any(schemes.quantized(it.kind) for it in items):
        return
    kept = [it for it in items if it.kind == Kind.KEEP]
    by = f"; --exclude {', '.join(opts.exclude)}" if opts.exclude else ""
    raise ConvertError(f"recipe {recipe.name!r} ({recipe.path or 'built-in'}{by}) quantizes no module of the input: "
                       f"every linear module is kept (e.g. {kept[0].name if kept else 'none'}: "
                       f"{kept[0].rule if kept else 'no linear module'}); nothing to convert")


def _check_input_scale(recipe: Recipe, opts: Options) -> None:
    """``--input-scale`` replaces the recipe's constant activation scales; a recipe with none (weight-only, or
    made weight-only by ``--format compressed-tensors``) would drop it without a word."""
    if opts.input_scale is not None and not any(r.input_scale is not None for r in recipe.rules):
        made = f" in --format {opts.format}" if opts.format else ""
        raise ConvertError(f"--input-scale {opts.input_scale:g}: recipe {recipe.name!r}{made} is weight-only "
                           f"({recipe.quant_algo}): it writes no activation scale to replace")


def _plan(ckpt: Checkpoint, m: Mapping, opts: Options, patterns: list[KeepRule], recipe: Recipe, st: _Staged,
          exclude: list[str], per_module, outline_of, expansion: Expansion | None = None) -> Plan:
    return Plan(
        mapping=m,
        recipe=recipe,
        options=opts,
        patterns=tuple(patterns),
        exclude_modules=tuple(exclude),
        warnings=tuple(st.warnings),
        side_files=tuple(ckpt.side_files),
        inputs=tuple((f, ckpt.file_sizes[f]) for f in ckpt.files),
        per_module=per_module,
        outline_of=outline_of,
        layer_kinds=m.layer_kinds(ckpt.config),
        notes=tuple(dict.fromkeys(st.notes)),
        side_folders=tuple(ckpt.side_folders),
        skipped_files=tuple(ckpt.skipped_files),
        expansion=expansion,
    )


def _outline(plan: Plan) -> Outline:
    """The outline of a plan made module by module: every module its own entry."""
    items = plan.items
    return Outline(plan.units, plan.engine_groups, {}, {k: sum(it.kind == k for it in items) for k in Kind},
                   plan.bytes_in, plan.bytes_out, len(plan.shards), plan.shard_sizes())


def _stages(ckpt: Checkpoint, m: Mapping, opts: Options, patterns: list[KeepRule], recipe: Recipe,
            mtp_at: tuple[str, ...]) -> _Staged:
    """``mtp_at``: the MTP layers' prefixes, read once by ``make_plan`` off the whole checkpoint."""
    ctx = DecideContext(m, recipe, opts, patterns, defaultdict(int), list(m.expert_regexes()), mtp_prefixes=mtp_at)
    notes: list[str] = []
    modules = discover_sources(ckpt)
    ctx.modules = modules
    resolve_fusions(modules, m, ckpt.config, list(m.groups))  # any group the config says applies must be whole
    disk = loadable_on_disk(resolve_fusions(modules, m, ckpt.config, disk_groups(m, opts), opts.layout, notes),
                             ctx, notes)
    fused_on_disk = {mod for f in disk for mod in f.members}
    fusions = [f for e, gs in packed_groups(m).items()
               for f in resolve_fusions(modules, m, ckpt.config, gs, e, notes)
               if fused_on_disk.isdisjoint(f.members)]
    notes += not_on_disk_notes(m, opts, fusions)
    # the engines' packed modules buildable from their members, under every layout: shapes before any
    # per-module decision, then the dtypes of the members the decisions keep
    check_members([*disk, *fusions], modules, m, ckpt.config)
    items = build_items(ckpt, modules, disk, ctx)
    _check_quantizes_something(items, recipe, opts)
    check_members([*disk, *fusions], modules, m, ckpt.config, {it.name: it.kind for it in items})
    check_engine_layers(items, fusions, m, opts)
    if ctx.recipe.keep_stored:
        items = stored_copies(items)
    units = make_units(items, fusions, ckpt)
    if opts.layout == "source":
        units, shards = shards_as_source(units, ckpt)
    else:
        units, shards = shards_by_size(units, opts.max_shard_size)
    warnings = [*m.notices(), *m.unmatched(modules)]
    if (unfit := m.fits(ckpt.config)) is not None:
        warnings.insert(0, unfit)
    more, already = _unused_patterns([p for p in dict.fromkeys(patterns) if not ctx.used[p]], items, modules, m)
    warnings += more
    if already:
        notes.append(f"{len(already)} exclusion pattern(s) name modules kept anyway (by the mapping, the recipe "
                     f"or an earlier pattern): {', '.join(repr(p.text) for p in already[:5])}"
                     + (" ..." if len(already) > 5 else ""))
    return _Staged(items, units, shards, _engine_records(fusions, modules), warnings, notes)


def _unused_patterns(unused: list[KeepRule], items: list[Item], modules: dict[str, dict[str, SourceTensor]],
                    m: Mapping) -> tuple[list[str], list[KeepRule]]:
    """Warnings for patterns that decided nothing, and the patterns that were not needed.

    A pattern naming a module that something else already keeps (the mapping, the recipe, an earlier
    pattern: re-using an output's own exclude list does this for every name) is no mistake: it is
    reported once, as a plan note. Only a pattern that names nothing in the input, or names a fused
    module instead of its source shards, gets a warning."""
    warnings, already = [], []
    nothing: dict[str, list[str]] = defaultdict(list)  # origin -> patterns: one line per file
    names = set(modules)
    for p in unused:
        fused = [it.name for it in items if it.group and globs.match(p.text, it.name, m.text_prefix)]
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
    return any(globs.match(pattern, mod, text_prefix) for mod in modules)
