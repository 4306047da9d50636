"""Mapping tables derived from the engines' own model classes (``kimi-convert mapping derive``, convert/derive/).

The engines' answers for each tiny preset are recorded in ``tests/derived/PRESET.answers.json`` (written by
``scripts/derive_compare.py --ask`` from vLLM 0.33.0 and SGLang 0.5.23: where each offered weight landed, how each
module was built). From them, without the engines:

* the derived table (with its overlay) plans every preset like its hand table, under every recipe and layout the
  hand table offers: same formats, fusions, global-scale groups, exclude list and shards (``derive_compare``);
* the table's rules read the engines' facts: Qwen3 MoE's ``qkv_proj`` in q, k, v row order in both engines, the
  experts' ``w13`` a scale group although SGLang stacks up before gate, the router kept because SGLang builds it
  unquantized (and the reason says so), the embedding not a linear layer.

With the engines present (``engine``), ``mapping derive`` asks them again and must give the recorded answers' table:
the runner's ``--derive`` contract and the pinned engines agree with what is recorded.
"""

from __future__ import annotations

import importlib.util
import json
import tomllib
from pathlib import Path

import pytest

from helpers import one_line_error, run, run_process
from kimi_convert.checkpoint import open_checkpoint
from kimi_convert.derive import from_views, load_answers, merge
from kimi_convert.derive.lookup import finish
from kimi_convert.derive.table import glob, template
from kimi_convert.enginecheck import EngineUnavailable, find_python
from kimi_convert.mapping import find_mapping
from kimi_convert.options import Options
from kimi_convert.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = ROOT / "tests" / "derived"
RECORDED = sorted(p.name.removesuffix(".answers.json") for p in ANSWERS.glob("*.answers.json"))


def _compare_module():
    spec = importlib.util.spec_from_file_location("derive_compare", ROOT / "scripts" / "derive_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _derived(preset: str):
    views, config, shapes = load_answers(ANSWERS / f"{preset}.answers.json")
    return from_views(views, config, shapes)


def test_templates_number_layers_and_experts_only():
    assert template("model.layers.12.mlp.experts.7.w1") == "model.layers.{layer}.mlp.experts.{expert}.w1"
    assert template("mtp.layers.0.mlp.experts.3.gate_proj") == "mtp.layers.{layer}.mlp.experts.{expert}.gate_proj"
    assert template("model.layers.3.mlp.shared_experts.up_proj") == "model.layers.{layer}.mlp.shared_experts.up_proj"
    assert glob("language_model.model.layers.4.self_attn.q_proj") == "language_model.model.layers.*.self_attn.q_proj"


def test_the_qwen3_moe_table_reads_the_engines_facts():
    d = _derived("tiny-qwen3-moe")
    t = d.table
    (qkv,) = [g for g in t["group"] if g["name"] == "qkv_proj"]
    assert qkv["members"] == ["q_proj", "k_proj", "v_proj"] and "engines" not in qkv  # both engines
    assert "QKVParallelLinear" in qkv["reason"] and "vllm/model_executor/layers/linear.py" in qkv["reason"]
    (w13,) = t["scale_group"]
    assert sorted(w13["members"]) == ["gate_proj", "up_proj"]
    assert w13["parents"] == ["model.layers.{layer}.mlp.experts.{expert}"]
    assert t["expert_sets"] == ["model.layers.{layer}.mlp.experts"]
    (gate,) = [k for k in t["keep"] if k["pattern"] == "model.layers.*.mlp.gate"]
    assert gate["reason"].startswith("SGLang 0.5.23: sglang/srt/models/qwen3_moe.py")
    assert "UnquantizedLinearMethod" in gate["reason"]
    assert t["not_linear"] == ["model.embed_tokens"]
    assert not any(k["pattern"].endswith(("norm", "layernorm")) for k in t["keep"])  # 1-D weights: no rule


@pytest.mark.parametrize("preset", RECORDED)
def test_a_derived_table_plans_like_the_hand_table(preset, tmp_path):
    cmp = _compare_module()
    src = tmp_path / preset
    assert run("synth", preset, src).code == 0
    ckpt = open_checkpoint(src)
    derived = finish(_derived(preset).text, f"derived:{preset}")
    hand = find_mapping(ckpt.config)
    layouts = ["source", *(k for k in ("vllm", "sglang") if hand.layouts.get(k, ((), ""))[0])]
    for recipe in cmp.RECIPES.get(preset, cmp.DEFAULT_RECIPES):
        for layout in layouts:
            opts = Options(recipe=recipe, layout=layout)
            a, b = cmp.normalized(make_plan(ckpt, hand, opts)), cmp.normalized(make_plan(ckpt, derived, opts))
            assert a == b, (recipe, layout, cmp.differences(a, b))


def test_the_comparison_sees_a_table_that_differs(tmp_path):
    """The comparison above can fail: a derived table that loses the router's keep plans differently."""
    cmp = _compare_module()
    src = tmp_path / "q"
    assert run("synth", "tiny-qwen3-moe", src).code == 0
    ckpt = open_checkpoint(src)
    t = dict(_derived("tiny-qwen3-moe").table)
    t["keep"] = [k for k in t["keep"] if k["pattern"] != "model.layers.*.mlp.gate"]
    import tomli_w

    broken = finish(tomli_w.dumps(t), "broken")
    a = cmp.normalized(make_plan(ckpt, find_mapping(ckpt.config), Options()))
    b = cmp.normalized(make_plan(ckpt, broken, Options()))
    assert a != b and any("mlp.gate" in line for line in cmp.differences(a, b))


def test_an_overlay_appends_rules_and_replaces_a_group():
    derived = {"name": "derived-x", "keep": [{"pattern": "a", "reason": "r"}], "not_linear": ["e"],
               "group": [{"name": "qkv", "members": ["q", "k", "v"], "parents": ["p"]}]}
    overlay = {"keep": [{"pattern": "b", "reason": "check X failed"}], "not_linear": ["e", "f"],
               "group": [{"name": "qkv", "members": ["q", "k"], "parents": ["p"]}], "description": "d"}
    m = merge(derived, overlay)
    assert [k["pattern"] for k in m["keep"]] == ["a", "b"]
    assert m["not_linear"] == ["e", "f"]
    assert m["group"] == [{"name": "qkv", "members": ["q", "k"], "parents": ["p"]}]
    assert m["description"] == "d" and m["name"] == "derived-x"


def _unknown_architecture(tmp_path: Path) -> Path:
    src = tmp_path / "unknown"
    assert run("synth", "tiny-qwen3-moe", src).code == 0
    cfg = json.loads((src / "config.json").read_text())
    # registered in both engines, no table shipped for it (docs/derived-architectures.md: no fixture yet)
    cfg["architectures"], cfg["model_type"] = ["BailingMoeV2ForCausalLM"], "bailing_moe_v2"
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_an_unknown_architecture_without_the_engines_says_how_to_get_a_table(tmp_path):
    src = _unknown_architecture(tmp_path)
    empty = tmp_path / "no-engines"
    empty.mkdir()
    env = {"KIMI_CONVERT_ENGINE_ENVS": str(empty), "KIMI_CONVERT_VLLM_PYTHON": "", "KIMI_CONVERT_SGLANG_PYTHON": ""}
    line = one_line_error(run("plan", src, env=env))
    assert "BailingMoeV2ForCausalLM" in line and "--mapping" in line and "scripts/engine-envs.sh" in line


def _engines_absent() -> str | None:
    try:
        for e in ("vllm", "sglang"):
            find_python(e)
    except EngineUnavailable as e:
        return str(e)
    return None


@pytest.mark.engine
@pytest.mark.xdist_group("engine")
@pytest.mark.skipif(bool(_engines_absent()), reason=f"engine environments absent: {_engines_absent()}")
def test_mapping_derive_asks_the_engines_and_matches_the_recorded_answers(tmp_path):
    src = tmp_path / "tq"
    assert run("synth", "tiny-qwen3-moe", src).code == 0
    out, answers = tmp_path / "derived.toml", tmp_path / "answers.json"
    r = run_process("mapping", "derive", src, "-o", out, "--answers", answers, timeout=1800)
    assert r.code == 0, r.stderr
    assert tomllib.loads(out.read_text()) == _derived("tiny-qwen3-moe").table
    # and plan takes it as a table: same plan as the hand table
    cmp = _compare_module()
    ckpt = open_checkpoint(src)
    a = cmp.normalized(make_plan(ckpt, find_mapping(ckpt.config), Options()))
    b = cmp.normalized(make_plan(ckpt, finish(out.read_text(), str(out)), Options()))
    assert a == b
