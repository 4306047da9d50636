"""Kept in high precision: the one name (``KeepRule``) and the one place (``kept``) for every reason a
linear module stays in its source precision (BF16; an MXFP4 or FP8 source decoded).

The sources, asked in this order; the first that keeps a module decides, and the plan's reason names it:

1. the mapping's group with ``quantize = false`` (the engines build that packed module unquantized):
   ``mapping NAME: GROUP: REASON``;
2. the mapping's ``keep`` (what the engines build unquantized, whatever the user asks), for any member:
   ``mapping NAME: keep 'PATTERN': REASON``;
3. the exclusion rules, decided per source shard: the mapping's ``exclude`` (its default exclusion
   recipe; ``--no-default-excludes`` drops it), ``--exclude``, and ``--exclude-from`` files (an
   ``hf_quant_config.json``'s exclude list among them), in that order: ``excluded by ORIGIN 'PATTERN':
   REASON``. A module fused from shards is kept only when every shard is; some shards only is an
   error, or with ``--keep-partial`` keeps it whole;
4. the recipe, when no rule of it matches: ``recipe NAME: no rule matches: kept``;
5. the mapping's ``restrict`` (an engine loads the module only in some schemes), when the recipe's
   scheme is not one of them: ``kept for the engines: mapping NAME: FORMAT asked by recipe R, but REASON``
   (the plan then keeps every member of that engine's packed module: ``plan/layout.py``);
6. the recipe's first matching rule, when its scheme is ``keep``: ``recipe NAME: REASON``.

Every pattern is read by ``globs.match`` and checked by ``globs.check`` where it is parsed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import globs
from .errors import ConvertError
from .schemes import SchemeName
from .vocabulary import KEPT_FOR_ENGINE, KeepRule, Recipe, RecipeRule

if TYPE_CHECKING:
    from .mapping import Group, Mapping

@dataclass(frozen=True)
class Kept:
    """A module kept in high precision, and the plan's reason (naming the source)."""

    reason: str


def first(keep_rules: Sequence[KeepRule], module: str, text_prefix: str) -> KeepRule | None:
    return next((k for k in keep_rules if globs.match(k.text, module, text_prefix)), None)


def kept(name: str, members: Sequence[str], group: Group | None, rule: RecipeRule | None, m: Mapping,
         recipe: Recipe, exclusions: Sequence[KeepRule], keep_partial: bool,
         used: dict[KeepRule, int]) -> Kept | None:
    """Whether module ``name`` (fused on disk from ``members`` by ``group``, else ``members == [name]``)
    stays in high precision, asking the sources in the order above; None: the recipe's ``rule`` (its
    first rule for ``members[0]``) quantizes it. ``used`` counts each exclusion rule's shards (a rule that
    decided nothing is warned about)."""
    if group is not None and not group.quantize:
        return Kept(f"mapping {m.name}: {group.name}: {group.reason}")
    for mod in members:
        k = first(m.keep, mod, m.text_prefix)
        if k is not None:
            return Kept(f"{k.origin} {k.text!r}: {k.reason}")
    excluded = _excluded(name, members, exclusions, m.text_prefix, keep_partial, used)
    if excluded is not None:
        return excluded
    if rule is None:
        return Kept(f"recipe {recipe.name}: no rule matches: kept")
    r = first(m.restrict, members[0], m.text_prefix)
    if r is not None and r.schemes is not None and rule.scheme.value not in r.schemes:
        return Kept(f"{KEPT_FOR_ENGINE}mapping {m.name}: {rule.scheme.value} asked by recipe {recipe.name}, "
                    f"but {r.reason}")
    if rule.scheme is SchemeName.KEEP:
        return Kept(f"recipe {recipe.name}: {rule.reason or rule.describe()}")
    return None


def _excluded(name: str, members: Sequence[str], exclusions: Sequence[KeepRule], text_prefix: str,
              keep_partial: bool, used: dict[KeepRule, int]) -> Kept | None:
    """Source 3, per source shard: every shard excluded keeps the module; some only is an error (or,
    with --keep-partial, keeps it whole)."""
    hits = {mod: first(exclusions, mod, text_prefix) for mod in members}
    for k in hits.values():
        if k is not None:
            used[k] += 1
    excluded = [mod for mod, k in hits.items() if k is not None]
    if not excluded:
        return None
    why = "; ".join(dict.fromkeys(k.describe() for k in hits.values() if k is not None))
    if len(excluded) == len(members):
        return Kept(f"excluded by {why}")
    if keep_partial:
        return Kept(f"--keep-partial: shards {', '.join(excluded)} excluded by {why}")
    not_excluded = [mod for mod in members if mod not in excluded]
    raise ConvertError(
        f"module {name}: only some shards are excluded: excluded {', '.join(excluded)}; "
        f"not excluded {', '.join(not_excluded)}; exclude all of them, or pass --keep-partial to keep "
        f"the whole module in high precision"
    )
