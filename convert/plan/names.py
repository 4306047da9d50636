"""The exclude list, the runtime aliases of a module name, the exclusion patterns."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase

from .. import keep_rules, mtp
from ..engine_rules import aliases, sglang_exact
from ..mapping import Mapping, stacked_experts_module
from ..options import Options
from ..recipe import Recipe
from ..vocabulary import KeepRule
from .layout import expert_sets
from .model import COPY, KEEP, EngineGroup, Item


def exclude_list(items: list[Item], m: Mapping, recipe: Recipe,
                 members: Callable[[str], Iterable[str]] | None = None,
                 mtp_prefixes: tuple[str, ...] = (), tied_head: str | None = None,
                 groups: Iterable[EngineGroup] = (), mtp_layers: tuple[dict[str, str], ...] = ()) -> list[str]:
    """The recipe's own list (if it has one) plus every kept linear module it does not already name,
    each fused module's shards, and whole MoE expert sets; and, for the MTP layers, each kept module under the
    prefix each engine's draft model asks its quant method with (``mtp.draft_aliases``). ``members``: the modules
    an item's module stands for (a bank's first expert: every expert of the bank, banks.py); ``tied_head``: an
    output head the checkpoint does not store that the engines would build quantized (``plan.make.tied_head``);
    ``groups``: the engines' packed modules (an MTP layer's whose members are all kept is named itself, below);
    ``mtp_layers``: ``Mapping.mtp_layers``, what the ``[mtp]`` templates' ``{i}`` / ``{n}`` stand for."""
    names: set[str] = set()
    linear: set[str] = set()
    for it in items:
        if it.experts and it.kind in (KEEP, COPY):  # a stacked bank kept: the engine asks for its experts module
            names.add(stacked_experts_module(it.name))
        if it.kind == COPY:
            continue
        mods = set(members(it.name) if members else (it.name,))
        if it.group is not None:
            mods.update(s.module for s in it.sources)
        linear.update(mods)
        if it.kind == KEEP:
            names.update(mods)
    names.update(p for p, idx in expert_sets(items, m).items() if all(items[i].kind == KEEP for i in idx))
    if tied_head is not None:
        names.add(tied_head)
    spelled: dict[str, set[str]] = {}  # the engines' own names -> the names they spell (wq_a and wkv: wqkv_a)
    for n in names:
        for s in m.engine_spellings(n):
            spelled.setdefault(s, set()).add(n)
    names.update(spelled)
    if m.mtp is not None and mtp_prefixes:
        drafts = set(mtp.draft_aliases(names, linear, m.mtp, mtp_prefixes, mtp_layers))
        names.update(drafts)
        if recipe.output_format == "modelopt":  # a kept MTP MLA projection must not exclude every layer's in SGLang
            names = {sglang_exact(n) if n in drafts or n.startswith(mtp_prefixes) else n for n in names}
            names.update(_starred_groups(names, groups))
    if recipe.exclude_modules is None:
        return sorted(names)
    listed = [a for p in recipe.exclude_modules for a in aliases(p, recipe.aliases)]
    # the recipe's list is text for the engines, not a selector of this tool (globs.py): read as fnmatch does; an
    # engine's spelling of a name the list covers is not added (the list is the vendor's as it writes it: NVIDIA's
    # DeepSeek V4 list names the head "head", which its engines' own rules take for lm_head)
    extra = sorted(n for n in names if not any(fnmatchcase(x, p) for x in {n, *spelled.get(n, ())}
                                               for p in recipe.exclude_modules))
    return list(dict.fromkeys([*listed, *extra]))


def _starred_groups(names: set[str], groups: Iterable[EngineGroup]) -> list[str]:
    """The packed modules whose members are all written ``NAME*`` (``sglang_exact``): vLLM's ``is_layer_skipped``
    asks for a packed module's shards by exact name, which ``NAME*`` is not, so the packed module is named itself
    (fnmatch then matches it exactly; its leaf, ``fused_qkv_a_proj``..., is no SGLang fused tail)."""
    return [sglang_exact(g.name) for g in groups
            if all(f"{mod}*" in names for mod in g.members) and f"{g.name}*" not in names]


def collect_patterns(m: Mapping, opts: Options) -> list[KeepRule]:
    """The exclusion rules in force (keep.py's source 3), in order: the mapping's default exclusions,
    --exclude, --exclude-from files."""
    patterns: list[KeepRule] = []
    if opts.default_excludes:
        patterns += m.exclude
    patterns += keep_rules.from_cli(opts.exclude)
    for f in opts.exclude_from:
        patterns += keep_rules.from_file(f)
    return patterns
