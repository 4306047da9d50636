"""keep.kept: every source of "kept in high precision", in its order, each reason naming its source
(the strings the plan prints and the manifest records)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from kimi_convert import keep, keep_rules
from kimi_convert.errors import ConvertError
from kimi_convert.mapping import parse_mapping
from kimi_convert.recipe import parse_recipe, rule_for

MAPPING = parse_mapping('''
name = "toy"
architectures = ["Toy"]
text_prefix = "lm."

[[keep]]
pattern = "*_conv1d"
reason = "engines build it unquantized"

[[restrict]]
pattern = "model.layers.*.attn.o_proj"
formats = ["keep", "fp8-block"]
reason = "the engine loads o_proj in BF16 or block FP8 only"

[[exclude]]
pattern = "head"
reason = "the output head"

[[group]]
name = "qkv_conv1d"
members = ["q_conv1d", "k_conv1d"]
parents = ["model.layers.{layer}.attn"]
quantize = false
reason = "a conv weight"
''', "toy.toml")

RECIPE = parse_recipe('''
name = "toy-recipe"
quant_method = "modelopt"
quant_algo = "W4A16_NVFP4"

[[rule]]
modules = ["model.layers.*.attn.keep_proj"]
format = "keep"
reason = "this recipe keeps it"

[[rule]]
modules = ["model.layers.*.attn.*_proj", "model.layers.*.mlp.*"]
format = "nvfp4"
reason = "NVFP4"
''', "toy-recipe.toml")


def _kept(members, group=None, exclusions=None, keep_partial=False, used=None):
    rule = rule_for(RECIPE, members[0], MAPPING.text_prefix, False)
    exclusions = list(MAPPING.exclude) if exclusions is None else exclusions
    k = keep.kept(members[0], members, group, rule, MAPPING, RECIPE, exclusions, keep_partial,
                  defaultdict(int) if used is None else used)
    return None if k is None else k.reason


def test_each_source_names_itself():
    group = MAPPING.groups[0]
    assert _kept(["lm.model.layers.0.attn.q_conv1d", "lm.model.layers.0.attn.k_conv1d"], group) \
        == "mapping toy: qkv_conv1d: a conv weight"
    assert _kept(["lm.model.layers.0.attn.q_conv1d"]) == \
        "mapping toy: keep '*_conv1d': engines build it unquantized"
    assert _kept(["lm.head"]) == "excluded by default (toy) 'head': the output head"
    assert _kept(["lm.model.layers.0.mlp.up"], exclusions=keep_rules.from_cli(("*.mlp.up",))) == \
        "excluded by --exclude '*.mlp.up'"
    assert _kept(["lm.model.norm_x"]) == "recipe toy-recipe: no rule matches: kept"
    assert _kept(["lm.model.layers.0.attn.o_proj"]) == ("kept for the engines: mapping toy: nvfp4 asked by recipe "
                                                        "toy-recipe, but the engine loads o_proj in BF16 or block "
                                                        "FP8 only")
    assert _kept(["lm.model.layers.0.attn.keep_proj"]) == "recipe toy-recipe: this recipe keeps it"
    assert _kept(["lm.model.layers.0.attn.q_proj"]) is None  # the recipe quantizes it


def test_order_mapping_keep_before_exclusions_before_recipe():
    used = defaultdict(int)
    excl = keep_rules.from_cli(("*_conv1d", "*.attn.o_proj"))
    assert _kept(["lm.model.layers.0.attn.q_conv1d"], exclusions=excl, used=used).startswith("mapping toy: keep")
    assert _kept(["lm.model.layers.0.attn.o_proj"], exclusions=excl, used=used) == \
        "excluded by --exclude '*.attn.o_proj'"  # before the restrict
    assert dict(used) == {excl[1]: 1}  # the mapping's keep decided first: the first rule counted nothing


def test_partial_exclusion_fails_or_keeps_whole():
    members = ["lm.model.layers.0.attn.q_proj", "lm.model.layers.0.attn.k_proj"]
    excl = keep_rules.from_cli(("*.attn.q_proj",))
    with pytest.raises(ConvertError, match=r"^module lm.model.layers.0.attn.q_proj: only some shards are excluded: "
                                           r"excluded lm.model.layers.0.attn.q_proj; not excluded "
                                           r"lm.model.layers.0.attn.k_proj; .*--keep-partial"):
        _kept(members, exclusions=excl)
    assert _kept(members, exclusions=excl, keep_partial=True) == \
        "--keep-partial: shards lm.model.layers.0.attn.q_proj excluded by --exclude '*.attn.q_proj'"


def test_mapping_keeps_are_keep_rules_naming_their_table():
    assert [(k.text, k.origin) for k in MAPPING.keep] == [("*_conv1d", "mapping toy: keep")]
    assert MAPPING.restrict[0].schemes == ("keep", "fp8-block")
    assert MAPPING.exclude[0] == keep.KeepRule("head", "default (toy)", "the output head")


@pytest.mark.parametrize("entry, where", [
    ('[[keep]]\npattern = "a b"', r"^toy\.toml: keep\[0\]: pattern 'a b' contains white space"),
    ('linear = ["x", "y.[a"]', r"^toy\.toml: linear\[1\]: pattern 'y\.\[a' has an unbalanced '\['"),
    ('[[restrict]]\npattern = ""\nformats = ["keep"]', r"^toy\.toml: restrict\[0\]: empty pattern"),
])
def test_a_bad_table_pattern_is_one_line_naming_its_entry(entry, where):
    with pytest.raises(ConvertError, match=where):
        parse_mapping(f'name = "toy"\narchitectures = ["Toy"]\n{entry}\n', "toy.toml")


def test_a_bad_recipe_pattern_names_its_rule():
    with pytest.raises(ConvertError, match=r"^r\.toml: rule\[0\]: modules\[1\]: pattern 'a b' contains white space"):
        parse_recipe('name = "r"\n[[rule]]\nmodules = ["x", "a b"]\nformat = "keep"\n', "r.toml")
