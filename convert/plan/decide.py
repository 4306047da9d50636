"""Decisions: quantized or kept, and why (exclusion decided per source shard)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from .. import globs, keep, mtp
from ..mapping import ENGINES, Group, Mapping
from ..options import Options
from ..recipe import rule_for
from ..schemes import SchemeName
from ..vocabulary import KeepRule, Recipe, RecipeRule
from .model import KEEP, Kind, SourceTensor

# ---------------------------------------------------------------------------------------------
# Exclusion: decided per source shard


@dataclass
class Decision:
    kind: Kind
    rule: str
    input_scale: float | None = None


@dataclass
class DecideContext:
    """What deciding a module's scheme needs: the mapping, the recipe, the rules and their use counts."""

    m: Mapping
    recipe: Recipe
    opts: Options
    patterns: list[KeepRule]  # the exclusion rules in force (keep.py's source 3)
    used: dict[KeepRule, int]
    expert_rx: list[re.Pattern[str]]
    modules: dict[str, dict[str, SourceTensor]] = field(default_factory=dict)
    memo: dict[tuple, tuple] = field(default_factory=dict)  # per expert template: is_linear, decisions
    blind: bool | None = None  # made on first use: whether no rule in force tells expert indices apart
    mtp_prefixes: tuple[str, ...] = ()  # the MTP layers the config announces (mapping's [mtp]: convert/mtp.py)

    def is_expert(self, module: str) -> bool:
        return any(rx.fullmatch(self.m.strip(module)) for rx in self.expert_rx)

    def template(self, module: str) -> str | None:
        """A routed expert module's name with its expert index replaced (``...experts.#.w1``) when no
        glob in force can tell two expert indices apart (what is decided for one expert then holds for
        all); None for any other module, or when some glob can (``--exclude '*.experts.1?.*'``)."""
        if self.blind is None:
            self.blind = index_blind_rules(self.m, self.recipe, self.patterns)
        return self.m.expert_template(module) if self.blind else None


def index_blind_rules(m: Mapping, recipe: Recipe, patterns: list[KeepRule]) -> bool:
    """Whether no glob in force (the mapping's, the recipe's, the exclusion rules) can tell two expert
    indices apart: then what is decided for one routed expert holds for every expert of its layer."""
    texts = [*m.linear, *m.not_linear, *(r.text for r in m.keep), *(r.text for r in m.restrict),
             *(g for r in recipe.rules for g in r.modules), *(p.text for p in patterns)]
    return all(map(globs.index_blind, texts))


def is_linear_once(mod: str, shape: tuple[int, ...], ctx: DecideContext, key: str | None) -> bool:
    """Mapping.is_linear, once per expert template ``key`` (and weight rank)."""
    if key is None:
        return ctx.m.is_linear(mod, shape)
    key = ("linear", key, len(shape) == 2)
    hit = ctx.memo.get(key)
    if hit is None:
        hit = ctx.memo[key] = (ctx.m.is_linear(mod, shape),)
    return hit[0]


def decide_apart(mod: str, ctx: DecideContext, key: str | None) -> Decision:
    """decide_module for a module stored apart; a routed expert's decision is made once per expert template
    ``key`` (the rules' use counts still count every module)."""
    if key is None:
        return decide_module(mod, [mod], None, ctx)
    hit = ctx.memo.get(("decide", key))
    if hit is None:
        used, ctx.used = ctx.used, defaultdict(int)
        try:
            dec = decide_module(mod, [mod], None, ctx)
        finally:
            counted, ctx.used = ctx.used, used
        hit = (dec, tuple(counted.items()))
        if mod not in dec.rule and ctx.m.strip(mod) not in dec.rule:  # a rule that names its module is its own
            ctx.memo["decide", key] = hit
    dec, counted = hit
    for p, n in counted:
        ctx.used[p] += n
    return dec


def decide_module(name: str, members: list[str], group: Group | None, ctx: DecideContext) -> Decision:
    """The scheme of one linear module (or a module fused on disk from ``members``): kept in high
    precision when one of keep.py's sources says so (its reason names the source), else the recipe's
    first matching rule."""
    m = ctx.m
    rule = rule_for(ctx.recipe, members[0], m.text_prefix, ctx.is_expert(members[0]))
    forced = head_rule(members[0], ctx)
    if forced is not None:
        return _quantized(forced[0], forced[1], ctx)
    if m.stacked is not None and m.stacked.keep and m.stacked_bank(name):
        return Decision(KEEP, f"mapping {m.name}: stacked: {m.stacked.reason}; kept, its experts module excluded")
    k = keep.kept(name, members, group, rule, m, ctx.recipe, ctx.patterns, ctx.opts.keep_partial, ctx.used)
    if k is not None:
        return Decision(KEEP, k.reason)
    if m.mtp is not None and ctx.mtp_prefixes:
        why = mtp.decide(members[0], m.mtp, ctx.mtp_prefixes, ctx.recipe.output_format, ctx.opts.quantize_mtp,
                         ctx.modules)
        if why is not None:
            return Decision(KEEP, f"mapping {m.name}: mtp: {why}")
    assert rule is not None  # keep.kept keeps a module no rule matches
    return _quantized(rule, f"recipe {ctx.recipe.name}: {rule.reason or rule.describe()}", ctx)


def _quantized(rule: RecipeRule, why: str, ctx: DecideContext) -> Decision:
    """``rule``'s scheme, with its constant input scale (``--input-scale`` in place of the recipe's, where both
    have one)."""
    scale = rule.input_scale if ctx.opts.input_scale is None or rule.input_scale is None else ctx.opts.input_scale
    return Decision(Kind(rule.scheme), why, scale)


def head_rule(module: str, ctx: DecideContext) -> tuple[RecipeRule, str] | None:
    """The output head's rule where an engine that reads the layout builds the head quantized whatever the exclude
    list says (the table's ``[lm_head] unnamed``: its quant method asked under an empty prefix): the recipe's first
    rule for it that quantizes, and why; None for any other module, or where the exclusion rules in force (the
    mapping's keeps, ``--exclude``) keep it: the user's choice, which that engine then refuses."""
    m, recipe = ctx.m, ctx.recipe
    head = m.lm_head
    if head is None or not head.unnamed or module != f"{m.text_prefix}{head.module}":
        return None
    engines = ENGINES if ctx.opts.layout == "source" else (ctx.opts.layout,)
    built = head.unnamed_in(recipe.output_format, engines)
    if not built or keep.first(m.keep, module, m.text_prefix) or keep.first(ctx.patterns, module, m.text_prefix):
        return None
    rule = next((r for r in recipe.rules if r.scheme is not SchemeName.KEEP
                 and any(globs.match(p, module, m.text_prefix) for p in r.modules)), None)
    r = keep.first(m.restrict, module, m.text_prefix)
    if rule is None or (r is not None and r.schemes is not None and rule.scheme.value not in r.schemes):
        return None
    return rule, (f"mapping {m.name}: lm_head: {' and '.join(built)} build(s) the output head quantized under "
                  f"{recipe.output_format} whatever the exclude list says (its quant method asked with an empty "
                  f"prefix), so it is written as built: recipe {recipe.name}: {rule.reason or rule.describe()}")
