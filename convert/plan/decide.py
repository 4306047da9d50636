"""Decisions: quantized or kept, and why (exclusion decided per source shard)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from .. import rules
from ..errors import ConvertError
from ..mapping import Group, Mapping
from ..options import Options
from ..recipe import Recipe
from .model import KEEP, KEPT_FOR_ENGINE, Kind, SourceTensor

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
            self.template_rx = (list(self.m.expert_regexes())
                                if index_blind_rules(self.m, self.recipe, self.patterns) else [])
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


def index_blind_rules(m: Mapping, recipe: Recipe, patterns: list[rules.Pattern]) -> bool:
    """Whether no glob in force (the mapping's, the recipe's, the exclusion rules) can tell two expert
    indices apart: then what is decided for one routed expert holds for every expert of its layer."""
    globs = [*m.linear, *m.not_linear, *(r.pattern for r in m.keep), *(r.pattern for r in m.restrict),
             *(g for r in recipe.rules for g in r.modules), *(p.text for p in patterns)]
    return all(map(_index_blind, globs))


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
