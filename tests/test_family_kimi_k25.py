"""Kimi K2.5 / K2.6 (``KimiK25ForConditionalGeneration``): packed with the shipped derived table alone, no hand
table, no overlay. The routed experts arrive INT4 (``encodings/int4_pack.py``, held to compressed-tensors in
tests/test_int4_pack.py) and leave NVFP4; every vision block stays BF16 at any tower depth."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import copy_ckpt, edit_config, plan_kinds, rewrite_tensors, write_synth
from kimi_convert.derive.lookup import shipped_for
from kimi_convert.plan import KEEP, NVFP4


@pytest.fixture(scope="module")
def tiny_k25(tmp_path_factory) -> Path:
    return write_synth("tiny-kimi-k25", tmp_path_factory.mktemp("k25") / "src")


def test_the_shipped_table_makes_the_int4_experts_nvfp4_and_keeps_the_rest_the_engines_build_unquantized(tiny_k25):
    kinds = plan_kinds(tiny_k25)
    experts = {n: k for n, k in kinds.items() if ".experts." in n}
    assert len(experts) == 8 * 3 and set(experts.values()) == {NVFP4}
    assert kinds["language_model.model.layers.1.mlp.gate"] == KEEP
    vision = {n: k for n, k in kinds.items() if n.startswith(("vision_tower.", "mm_projector."))}
    assert NVFP4 not in vision.values() and vision["vision_tower.encoder.blocks.1.wqkv"] == KEEP
    assert kinds["mm_projector.proj.0"] == KEEP and kinds["mm_projector.proj.2"] == KEEP


def test_every_vision_block_is_kept_beyond_the_blocks_the_table_was_derived_on(tiny_k25, tmp_path):
    """The derived keep rules name the tower's blocks by glob (``vision_tower.encoder.blocks.*``), so a block beyond
    the fixture's two is kept as well (the release has 27)."""
    src = copy_ckpt(tiny_k25, tmp_path / "deep")
    block = "vision_tower.encoder.blocks."

    def add_block(t: dict) -> None:
        for name in [n for n in t if n.startswith(f"{block}1.")]:
            t[name.replace(f"{block}1.", f"{block}2.")] = t[name].clone()
    rewrite_tensors(src, add_block)
    edit_config(src, lambda c: c["vision_config"].update(num_hidden_layers=3, vt_num_hidden_layers=3))
    kinds = plan_kinds(src)
    assert kinds[f"{block}2.wqkv"] == KEEP and kinds[f"{block}2.mlp.fc0"] == KEEP


def test_plan_finds_the_shipped_derived_table_for_the_release_config(tiny_k25):
    """K2.5's config finds mappings/derived/kimi_k25.toml (the table its recorded answers give: tests/test_derive.py)
    with no engine environment."""
    import json

    assert shipped_for(json.loads((tiny_k25 / "config.json").read_text())).name == "derived-kimi_k25"
