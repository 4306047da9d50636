"""One glob semantics for every pattern (convert/globs.py), and proof that moving every table and recipe
onto it changed the meaning of none of their patterns: for every synth preset's module names, each
pattern selects the same modules under the readings the code had before (copied here, and only here)
and under ``globs.match``."""

from __future__ import annotations

import random
import re
from fnmatch import fnmatchcase

import pytest

from helpers import PRESETS_WITHOUT_TABLE, all_presets, synth_preset
from kimi_convert import globs, synth
from kimi_convert.errors import ConvertError
from kimi_convert.mapping import builtin_mappings, parse_mapping
from kimi_convert.recipe import builtin_recipes

# --- the readings before one semantics (kept for this comparison only) ---------------------------------


def _old_rules_matches(pattern: str, module: str, text_prefix: str) -> bool:
    """rules.matches: exclusion patterns (--exclude, files, a mapping's exclude)."""
    if "." not in pattern:
        return any(fnmatchcase(part, pattern) for part in module.split("."))
    names = [module, module + ".weight"]
    if text_prefix and module.startswith(text_prefix):
        short = module[len(text_prefix) :]
        names += [short, short + ".weight"]
    return any(fnmatchcase(n, pattern) for n in names)


def _old_short_or_full(pattern: str, module: str, text_prefix: str) -> bool:
    """Mapping._hit / restriction / keep_rule / unmatched and Recipe.decide: fnmatch on the name with or
    without the text prefix."""
    short = module[len(text_prefix) :] if text_prefix and module.startswith(text_prefix) else module
    return fnmatchcase(short, pattern) or fnmatchcase(module, pattern)


def _modules(name: str) -> tuple[dict, list[str]]:
    """A preset's config and every source module, from its tensor specs (no tensor data made). The
    full-size K3 keeps its 93 layers and every tensor name form with 40 of its 896 experts a layer
    (two-digit indices: the names of experts 40..895 are formed the same way), so the comparison stays a
    few seconds."""
    p = synth_preset(name)
    if p.get(p.family.experts_key) > 40:
        p = synth_preset(name, experts=40)
    cfg = synth.config(p)
    if p.family.config_file == "params.json":  # Mistral's own layout: the config the engines make of it
        from kimi_convert.mistral_checkpoint import config_view

        cfg = config_view(cfg)
    return cfg, sorted({n.rpartition(".")[0] for n, _, _ in synth.tensor_specs(p)})


#: Recipe patterns that mean more under one semantics than under the old whole-name reading, for a table that came
#: after the move: MiniMax M3's derived table has no text prefix and its head is ``language_model.lm_head``; the
#: recipes' dotless ``lm_head`` now matches that name part, the head the recipes mean (the old reading, on the whole
#: name, matched nothing there). table -> pattern -> what it selects now.
NEW_MEANING = {"derived-minimax_m3_vl": {"lm_head": {"language_model.lm_head"}}}


def _table(cfg: dict):
    """The table plan uses for ``cfg`` without --mapping and without the engines: a hand table naming the
    architecture, else the shipped derived one (GLM-5.x, GLM-4.7-Flash, Mistral Large 3: mappings/derived/ with its
    overlay), else a hand table naming the model_type."""
    from kimi_convert.derive.lookup import shipped_table

    return shipped_table(cfg)


CASES = [(name, _table(cfg), modules) for name in all_presets() if name not in PRESETS_WITHOUT_TABLE
         for cfg, modules in [_modules(name)]]


def _selected(read, pattern: str, modules: list[str], prefix: str) -> set[str]:
    return {mod for mod in modules if read(pattern, mod, prefix)}


def _table_patterns(m) -> list[tuple[str, str, object]]:
    old = _old_short_or_full
    return [*(("linear", p, old) for p in m.linear), *(("not_linear", p, old) for p in m.not_linear),
            *(("keep", r.text, old) for r in m.keep), *(("restrict", r.text, old) for r in m.restrict),
            *(("exclude", r.text, _old_rules_matches) for r in m.exclude)]


@pytest.mark.parametrize("preset", [c[0] for c in CASES])
def test_every_table_pattern_means_what_it_meant(preset):
    _, m, modules = next(c for c in CASES if c[0] == preset)
    tested = 0
    for what, pattern, old in _table_patterns(m):
        before = _selected(old, pattern, modules, m.text_prefix)
        now = _selected(globs.match, pattern, modules, m.text_prefix)
        assert now == before, f"{m.path}: {what} {pattern!r}: now also {sorted(now - before)[:3]}, " \
                              f"no longer {sorted(before - now)[:3]}"
        tested += 1
    assert tested >= 2  # every table has a not_linear glob and a keep or an exclusion


#: Derived tables written after the glob change for a model under a prefix they do not declare (Kimi K2.5:
#: language_model.): the recipes' short globs never had the old reading there; globs.match's is checked instead.
#: (Without a text_prefix, a recipe's `model.layers.*...` glob does not reach language_model.model.layers: the
#: derived tables' rules name full names; a recipe rule on such a glob does not apply to them: docs/families.md.)
NEW_UNDER_PREFIX = {"tiny-kimi-k25": "language_model.", "bench-kimi-k25": "language_model."}


@pytest.mark.parametrize("preset", [c[0] for c in CASES])
def test_every_recipe_pattern_means_what_it_meant(preset):
    _, m, modules = next(c for c in CASES if c[0] == preset)
    patterns = {g for r in builtin_recipes() for rule in r.rules for g in rule.modules}
    assert {"lm_head", "*", "model.layers.*.self_attn.o_proj"} <= patterns
    if preset in NEW_UNDER_PREFIX:
        prefix = NEW_UNDER_PREFIX[preset]
        assert _selected(globs.match, "lm_head", modules, m.text_prefix) == {f"{prefix}lm_head"}
        assert _selected(globs.match, "*", modules, m.text_prefix) == set(modules)
        return
    for pattern in sorted(patterns):
        before = NEW_MEANING.get(m.name, {}).get(pattern) or _selected(_old_short_or_full, pattern, modules,
                                                                     m.text_prefix)
        assert _selected(globs.match, pattern, modules, m.text_prefix) == before, pattern


def test_every_table_has_a_preset():
    """The comparison above covers every built-in table (a new table needs a preset to be checked)."""
    assert {m.name for m in builtin_mappings()} == {c[1].name for c in CASES if not c[1].name.startswith("derived-")}


# --- the semantics -------------------------------------------------------------------------------------


def test_dotless_pattern_matches_whole_name_parts():
    mod = "language_model.model.layers.3.self_attn.qkv_conv1d"
    assert not globs.match("v_conv1d", mod, "language_model.")
    assert globs.match("qkv_conv1d", mod, "language_model.")
    assert globs.match("*_conv1d", mod, "language_model.")
    assert globs.match("lm_head", "language_model.lm_head", "language_model.")
    assert not globs.match("lm_hea", "language_model.lm_head", "language_model.")


def test_dotted_pattern_with_and_without_prefix_and_weight():
    mod = "language_model.model.layers.3.mlp.gate"
    for pattern in ("model.layers.*.mlp.gate", "language_model.model.layers.3.mlp.gate",
                    "model.layers.3.mlp.gate.weight", "*.mlp.gate"):
        assert globs.match(pattern, mod, "language_model."), pattern
    assert not globs.match("model.layers.*.mlp.gate", mod, "")  # no prefix to strip: the full name only
    assert not globs.match("model.layers.3.mlp.gate.bias", mod, "language_model.")
    assert not globs.match("layers.*.mlp.gate", mod, "language_model.")  # a glob is anchored at both ends


@pytest.mark.parametrize("text, why", [("", "empty pattern"), ("  ", "empty pattern"),
                                       ("a b", "contains white space"), ("x.[ab", "unbalanced '['")])
def test_check_names_where(text, why):
    with pytest.raises(ConvertError, match=r"^mappings/x\.toml: keep\[2\]: .*" + re.escape(why)):
        globs.check(text, "mappings/x.toml: keep[2]")
    assert globs.check("  lm_head ", "--exclude") == "lm_head"


@pytest.mark.parametrize("glob, blind", [("*", True), ("*_conv1d", True), ("w1", True), ("*.w13", True),
                                         ("1*", False), ("*.experts.1?.*", False), ("*.[0-3].*", False),
                                         ("*.layers.1.*", False), ("[a-z]*", True)])
def test_index_blind(glob, blind):
    assert globs.index_blind(glob) is blind


def test_the_readings_differ_where_the_comparison_looks():
    """The comparison above can fail: the part-wise reading of a dotless glob, and the ``.weight`` name of a
    dotted one, select modules the old fnmatch of a mapping or recipe did not."""
    for pattern, module in (("lm_head", "mtp.lm_head.proj"), ("vision_tower.*", "vision_tower")):
        assert globs.match(pattern, module, "") and not _old_short_or_full(pattern, module, "")


def test_match_is_the_exclusion_reading_on_random_globs():
    """globs.match (one compiled regex a pattern, tried on ``NAME.weight``) is rules.matches' reading (fnmatch
    on four names, or on each part), on random globs and names that stress ``*`` across dots and ``.weight``."""
    rng = random.Random(0)
    tokens = ["a", "b", ".", "*", "?", "[ab]", "[!a]", "weight", "t", "1", ".weight"]
    parts = ["a", "b", "ab", "weight", "t", "1", "ba"]
    for _ in range(20_000):
        pattern = "".join(rng.choice(tokens) for _ in range(rng.randint(1, 6)))
        prefix = rng.choice(["", "a.", "ab."])
        module = prefix + ".".join(rng.choice(parts) for _ in range(rng.randint(1, 4)))
        assert globs.match(pattern, module, prefix) == _old_rules_matches(pattern, module, prefix), \
            (pattern, module, prefix)


def test_unmatched_scans_every_expert_for_a_glob_that_tells_indices_apart():
    """Mapping.unmatched tries an index-blind glob on one expert a layer, any other glob on every module."""
    _, m, modules = next(c for c in CASES if c[0] == "tiny-k3")  # 8 experts a layer
    extra = ('[[keep]]\npattern = "model.layers.*.block_sparse_moe.experts.7.w1"\nreason = "r"\n'
             '[[keep]]\npattern = "model.layers.*.block_sparse_moe.experts.9.w1"\nreason = "r"\n')
    t = parse_mapping(m.source + extra, "k3.toml")
    out = [w for w in t.unmatched(modules) if "experts." in w]
    assert out == [f"mapping {t.name} (k3.toml): keep 'model.layers.*.block_sparse_moe.experts.9.w1' matches no "
                   "module of the input"]
    assert t.unmatched(modules) == m.unmatched(modules) + out
