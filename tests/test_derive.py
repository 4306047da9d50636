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

from helpers import all_presets, one_line_error, run, run_process
from kimi_convert.checkpoint import open_checkpoint
from kimi_convert.derive import from_answers, from_views, load_answers, load_draft_answers, merge
from kimi_convert.derive.lookup import finish
from kimi_convert.derive.table import glob, template
from kimi_convert.enginecheck import EngineUnavailable, find_python
from kimi_convert.mapping import find_mapping
from kimi_convert.options import Options
from kimi_convert.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = ROOT / "tests" / "derived"
RECORDED = sorted(p.name.removesuffix(".answers.json") for p in ANSWERS.glob("*.answers.json"))


def _hand_table(preset: str) -> bool:
    """Whether a hand table (mappings/*.toml) names the architecture of ``preset``'s recorded config."""
    from kimi_convert.mapping import UnknownArchitecture

    try:
        find_mapping(json.loads((ANSWERS / f"{preset}.answers.json").read_text())["config"], by_model_type=False)
    except UnknownArchitecture:
        return False
    return True


#: Those of a synth preset whose architecture has a hand table; the others are held to their shipped derived table
#: (test_a_shipped_derived_table_is_its_recorded_answers)
WITH_HAND_TABLE = [p for p in RECORDED if p in all_presets() and _hand_table(p)]
WITHOUT_HAND_TABLE = [p for p in RECORDED if not _hand_table(p)]


def _compare_module():
    spec = importlib.util.spec_from_file_location("derive_compare", ROOT / "scripts" / "derive_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _derived(preset: str):
    """The table of a preset's recorded answers, with its drafts' where recorded (the [mtp] table): in
    PRESET.draft-answers.json where the drafts were asked apart, else in PRESET.answers.json itself (none: {})."""
    drafts = ANSWERS / f"{preset}.draft-answers.json"
    return from_answers(ANSWERS / f"{preset}.answers.json", drafts if drafts.is_file() else None)


@pytest.mark.parametrize("preset", WITHOUT_HAND_TABLE)
def test_a_shipped_derived_table_is_its_recorded_answers(preset):
    """Each architecture without a hand table ships mappings/derived/TABLE.toml (the one naming its architecture),
    and that file is, character for character, the table the rules make of the recorded answers of vLLM 0.33.0 and
    SGLang 0.5.23 (``mapping derive --answers``), rebuilt here without the engines."""
    archs = set(json.loads((ANSWERS / f"{preset}.answers.json").read_text())["config"]["architectures"])
    shipped = [f for f in sorted((ROOT / "mappings" / "derived").glob("*.toml"))
               if archs & set(tomllib.loads(f.read_text()).get("architectures", ()))]
    assert len(shipped) == 1, (preset, archs, shipped)
    assert _derived(preset).text == shipped[0].read_text(), shipped[0].name


def test_templates_number_layers_and_experts_only():
    assert template("model.layers.12.mlp.experts.7.w1") == "model.layers.{layer}.mlp.experts.{expert}.w1"
    assert template("mtp.layers.0.mlp.experts.3.gate_proj") == "mtp.layers.{layer}.mlp.experts.{expert}.gate_proj"
    assert template("model.layers.3.mlp.shared_experts.up_proj") == "model.layers.{layer}.mlp.shared_experts.up_proj"
    assert glob("language_model.model.layers.4.self_attn.q_proj") == "language_model.model.layers.*.self_attn.q_proj"
    # a rule's pattern covers every index of a module list (a vision tower's blocks), not a name's own digits
    assert glob("model.visual.blocks.0.mlp.linear_fc1") == "model.visual.blocks.*.mlp.linear_fc1"
    assert glob("multi_modal_projector.linear_1") == "multi_modal_projector.linear_1"
    assert glob("model.layers.2.mlp.experts.5.w1") == "model.layers.*.mlp.experts.*.w1"
    # a vision tower's blocks too (GLM-5.3-Flash's model.visual.blocks.N: a rule for block 0 alone would miss the rest)
    assert template("model.visual.blocks.3.mlp.up_proj") == "model.visual.blocks.{layer}.mlp.up_proj"
    assert glob("model.visual.blocks.12.attn.qkv") == "model.visual.blocks.*.attn.qkv"


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


#: The MTP layer of a preset where the derived table (with the drafts' [mtp] and its overlay) does not yet plan it
#: like the hand table: none now (GLM-4.5's and DeepSeek V3's plan alike, the MTP layer included: docs/derive.md).
MTP_LAYER: dict[str, str] = {}
#: Presets whose hand table stays for a reason the derivation cannot remove (docs/derive.md, "Which hand tables
#: stay"): held to what the derivation says of them instead (tests below).
NOT_DERIVABLE = {"tiny-gpt-oss", "tiny-k3", "tiny-qwen3-5-moe"}


def _without(plan: dict, prefix: str | None) -> dict:
    """The plan outside the MTP layer: its modules, and the exclude list's names of modules the plan holds (the
    names a draft looks its kept modules up by, ``model.decoder.*``, are the [mtp] table's: test_mtp)."""
    if prefix is None:
        return plan
    names = {m["name"] for m in plan["modules"]}
    out = {"modules": [m for m in plan["modules"] if not m["name"].startswith(prefix)]}
    out["exclude_modules"] = [n for n in plan.get("exclude_modules", []) if not n.startswith(prefix) and n in names]
    return out


@pytest.mark.parametrize("preset", [p for p in WITH_HAND_TABLE if p not in NOT_DERIVABLE])
def test_a_derived_table_plans_like_the_hand_table(preset, tmp_path):
    """Under --layout source (a derived table writes nothing fused on disk: the hand tables' layouts are engine
    checks' findings), every recipe: the same formats, fusions, global-scale sets, exclude list and shards; where
    the preset has an MTP layer, the same outside it."""
    cmp = _compare_module()
    src = tmp_path / preset
    assert run("synth", preset, src).code == 0
    ckpt = open_checkpoint(src)
    derived = finish(_derived(preset).text, f"derived:{preset}")
    hand = find_mapping(ckpt.config)
    for recipe in cmp.RECIPES.get(preset, cmp.DEFAULT_RECIPES):
        opts = Options(recipe=recipe)
        a = _without(cmp.normalized(make_plan(ckpt, hand, opts)), MTP_LAYER.get(preset))
        b = _without(cmp.normalized(make_plan(ckpt, derived, opts)), MTP_LAYER.get(preset))
        assert a == b, (recipe, cmp.differences(a, b))


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
    # an architecture no table names (a made-up one: a real name would one day get its shipped table, as Ling 3.0 did)
    cfg["architectures"], cfg["model_type"] = ["ExampleMoeForCausalLM"], "example_moe"
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_an_unknown_architecture_without_the_engines_says_how_to_get_a_table(tmp_path):
    src = _unknown_architecture(tmp_path)
    empty = tmp_path / "no-engines"
    empty.mkdir()
    env = {"KIMI_CONVERT_ENGINE_ENVS": str(empty), "KIMI_CONVERT_VLLM_PYTHON": "", "KIMI_CONVERT_SGLANG_PYTHON": ""}
    line = one_line_error(run("plan", src, env=env))
    assert "ExampleMoeForCausalLM" in line and "--mapping" in line and "scripts/engine-envs.sh" in line


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


def _names(layers: dict[int, list[str]], experts: int = 0) -> list[tuple[str, tuple[int, ...], str]]:
    out = [("model.embed_tokens.weight", (1000, 8), "bfloat16")]
    for n, parts in layers.items():
        for p in parts:
            if "{e}" in p:
                out += [(f"model.layers.{n}.{p.format(e=e)}.weight", (4, 8), "bfloat16") for e in range(experts)]
            else:
                out.append((f"model.layers.{n}.{p}.weight", (4, 8), "bfloat16"))
    return out


def test_a_reduction_keeps_each_kind_of_layer_once_and_renumbers_the_mtp_layer():
    from kimi_convert.derive import reduce

    dense, moe = ["self_attn.q_proj", "mlp.gate_proj"], ["self_attn.q_proj", "mlp.gate", "mlp.experts.{e}.w1"]
    layers = {0: dense, 1: dense, 2: dense, **{n: moe for n in range(3, 61)}, 61: [*moe, "eh_proj"]}
    config = {"num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "num_experts_per_tok": 8,
              "n_group": 8, "topk_group": 4, "vocab_size": 1000, "num_nextn_predict_layers": 1}
    tensors = _names(layers, experts=256)
    r = reduce.plan(config, [n for n, _, _ in tensors])
    assert (r.layers, r.mtp) == (4, 1)  # dense 0-2 and the first MoE layer; the MTP layer after them
    assert r.experts == 16 and r.experts % 8 == 0  # 8 groups of ceil(8 / 4) = 2: the router's top-8 is possible
    cfg, out = reduce.apply(config, tensors, r)
    assert cfg["num_hidden_layers"] == 4 and cfg["n_routed_experts"] == 16 and cfg["vocab_size"] == 256
    names = {n for n, _, _ in out}
    assert "model.layers.4.eh_proj.weight" in names and "model.layers.5.self_attn.q_proj.weight" not in names
    assert "model.layers.3.mlp.experts.15.w1.weight" in names and "model.layers.3.mlp.experts.16.w1.weight" not in names
    assert dict((n, s) for n, s, _ in out)["model.embed_tokens.weight"] == (256, 8)
    assert config["num_hidden_layers"] == 61  # the source's config is not changed


def test_a_reduction_cuts_one_based_layer_lists_and_per_layer_lists():
    from kimi_convert.derive import reduce

    kda, mla = ["self_attn.q_proj", "self_attn.f_a_proj"], ["self_attn.q_a_proj", "self_attn.kv_b_proj"]
    layers = {n: (mla if (n + 1) % 4 == 0 or n == 92 else kda) for n in range(93)}
    config = {"text_config": {"num_hidden_layers": 93, "vocab_size": 160000, "num_experts": 8,
                              "linear_attn_config": {"kda_layers": [n + 1 for n in range(93) if layers[n] is kda],
                                                     "full_attn_layers": [n + 1 for n in range(93)
                                                                          if layers[n] is mla]},
                              "layer_types": ["x"] * 93}}
    tensors = _names(layers)
    r = reduce.plan(config, [n for n, _, _ in tensors])
    cfg, _ = reduce.apply(config, tensors, r)
    tc = cfg["text_config"]
    assert r.layers == 4 and tc["num_hidden_layers"] == 4
    assert tc["linear_attn_config"] == {"kda_layers": [1, 2, 3], "full_attn_layers": [4]}  # 1-based, kept as such
    assert tc["layer_types"] == ["x"] * 4


@pytest.mark.engine
@pytest.mark.xdist_group("engine")
@pytest.mark.skipif(bool(_engines_absent()), reason=f"engine environments absent: {_engines_absent()}")
def test_a_reduced_stand_in_derives_the_table_of_the_whole(tmp_path, monkeypatch):
    """GLM-4.5 (dense first layer, MoE layers, an MTP layer) derived from 2 of its 3 layers, 2 of its 8 experts and
    256 vocabulary rows gives the table its whole stand-in gave (the recorded answers)."""
    from kimi_convert.derive import derive, standin

    src = tmp_path / "glm"
    assert run("synth", "tiny-glm4-moe", src).code == 0
    monkeypatch.setattr(standin, "REDUCE_ABOVE", 0)
    d = derive(open_checkpoint(src))
    # the [mtp] table too: the reduced stand-in renumbers the MTP layer after the kept layers, and the table is read
    # off against the stand-in's own config (which numbers it so): config paths, which the full config resolves
    assert d.table == _derived("tiny-glm4-moe").table


def _qwen3_answers():
    return load_answers(ANSWERS / "tiny-qwen3-moe.answers.json")


def test_a_tied_head_an_engine_would_quantize_is_excluded(tmp_path):
    """Ernie 4.5 MoE's gap (breadth run): tied embeddings, no lm_head tensor, yet vLLM 0.33's ModelOpt build gives its
    ParallelLMHead a linear method (the recorded Qwen3 MoE answers: ModelOptLinearMethod) and its tie fills the weight
    alone: the derived [lm_head] asks the plan to name the head in the exclude list, and the plan does."""
    import tomli_w

    from helpers import edit_config, rewrite_tensors

    views, config, shapes = _qwen3_answers()
    config = {**config, "tie_word_embeddings": True}
    shapes = {n: s for n, s in shapes.items() if n != "lm_head.weight"}
    t = from_views(views, config, shapes).table
    assert t["lm_head"] == {"tie": "tie_word_embeddings", "module": "lm_head", "exclude_tied": True}
    src = tmp_path / "tied"
    assert run("synth", "tiny-qwen3-moe", src).code == 0
    edit_config(src, lambda c: c.update(tie_word_embeddings=True))
    rewrite_tensors(src, lambda ts: ts.pop("lm_head.weight", None))
    ckpt = open_checkpoint(src)
    assert "lm_head" in make_plan(ckpt, finish(tomli_w.dumps(t), "tied"), Options()).exclude_modules
    untied = {**t, "lm_head": {k: v for k, v in t["lm_head"].items() if k != "exclude_tied"}}
    assert "lm_head" not in make_plan(ckpt, finish(tomli_w.dumps(untied), "t"), Options()).exclude_modules
    # a stored head is a module of its own: no exclude_tied (the recipes keep it by their own rule)
    assert "exclude_tied" not in from_views(*_qwen3_answers()).table["lm_head"]


def _unnamed_head(views, engine: str):
    """The views with ``engine``'s ModelOpt build asking its quant method for the head with an empty prefix, as vLLM
    0.33's exaone_moe.py / afmoe.py and SGLang 0.5.23's hunyuan.py build their ParallelLMHead (no ``prefix=``)."""
    import dataclasses

    out = []
    for v in views:
        if v.engine == engine:
            mods = dict(v.quant_modules["modelopt"])
            mods["lm_head"] = {**mods["lm_head"], "quant_prefix": ""}
            v = dataclasses.replace(v, quant_modules={**v.quant_modules, "modelopt": mods})
        out.append(v)
    return out


def test_a_head_an_engine_builds_unnamed_is_written_as_it_builds_it(tmp_path):
    """ExaoneMoE / AfMoE in vLLM 0.33 (and HunYuan MoE V1 in SGLang 0.5.23) ask ModelOpt's quant method for the head
    with an empty prefix, which no exclude entry reaches (vLLM matches every entry as a substring: "" would exclude
    every layer): vLLM built an NVFP4 head and refused the output's BF16 lm_head.weight. The derived [lm_head] names
    the format and engine, and the plan quantizes the head where that engine reads the layout: under ModelOpt in
    the source layout and that engine's own, not under the other engine's layout, compressed-tensors (whose class
    targets do not reach a ParallelLMHead) or an --exclude naming the head."""
    import tomli_w

    views, config, shapes = _qwen3_answers()
    assert "unnamed" not in from_views(views, config, shapes).table["lm_head"]  # the engines name Qwen3's head
    t = from_views(_unnamed_head(views, "vllm"), config, shapes).table
    assert t["lm_head"]["unnamed"] == {"modelopt": ["vllm"]}
    src = tmp_path / "q"
    assert run("synth", "tiny-qwen3-moe", src).code == 0
    ckpt, table = open_checkpoint(src), finish(tomli_w.dumps(t), "unnamed")

    def head(**kw):
        p = make_plan(ckpt, table, Options(**kw))
        return next(it.kind for it in p.items if it.name == "lm_head"), "lm_head" in p.exclude_modules

    assert head() == ("nvfp4", False) and head(layout="vllm") == ("nvfp4", False)
    assert head(layout="sglang") == ("keep", True)
    assert head(format="compressed-tensors") == ("keep", True)
    assert head(exclude=("lm_head",)) == ("keep", True)
    t = from_views(_unnamed_head(views, "sglang"), config, shapes).table
    ckpt, table = open_checkpoint(src), finish(tomli_w.dumps(t), "unnamed-sglang")
    assert head() == ("nvfp4", False) and head(layout="sglang") == ("nvfp4", False)
    assert head(layout="vllm") == ("keep", True)
    from kimi_convert.errors import ConvertError
    from kimi_convert.mapping import parse_mapping

    bad = tomli_w.dumps({**t, "lm_head": {**t["lm_head"], "unnamed": {"modelopt": ["trt"]}}})
    with pytest.raises(ConvertError, match=r"^x\.toml: lm_head\.unnamed\.modelopt: \[0\]: unknown engine 'trt'"):
        parse_mapping(bad, "x.toml")


def test_a_fused_3d_expert_bank_is_refused_not_derived():
    """GraniteMoe's input_linear [E, 2I, H] fills every expert of the engines' w13 in one tensor, and gpt-oss's plain
    build reads its experts only under the release's 3-D names (its loaders put the per-expert modules the MXFP4
    decoder gives nowhere): a table derived from either missed the bank and both engines refused its output. Now the
    derivation refuses, in one line."""
    from kimi_convert.errors import ConvertError

    with pytest.raises(ConvertError, match=r"experts\.0\.gate_proj\.weight: vLLM 0\.33\.0's loader puts this expert "
                                           r"weight nowhere.*--mapping"):
        from_views(*load_answers(ANSWERS / "tiny-gpt-oss.answers.json"))
    for arch, tensor in (("GraniteMoeForCausalLM", r"block_sparse_moe\.input_linear\.weight \[8, 1024, 256\]"),
                         ("GptOssForCausalLM", r"mlp\.experts\.(gate_up|down)_proj \[8, \d+, \d+\]")):
        # the breadth run's fixtures (transformers' own save: one 3-D tensor a bank), both engines' answers
        with pytest.raises(ConvertError, match=tensor + r" fills every expert of .* in one tensor: a fused 3-D"):
            from_views(*load_answers(ANSWERS / "refused" / f"{arch}.answers.json"))
    views, config, shapes = _qwen3_answers()
    v = views[0]
    bank = next(s for s in v.spans if s["param"].endswith("w13_weight"))
    e = bank["param_shape"][0]
    fused = {**bank, "tensor": "model.layers.0.mlp.input_linear.weight", "at": [0, 0, 0],
             "shape": [e, *bank["param_shape"][1:]]}
    v.spans = [s for s in v.spans if s["param"] != bank["param"]] + [fused]
    with pytest.raises(ConvertError, match=r"input_linear\.weight \[.*\] fills every expert of vLLM 0\.33\.0's "
                                           r".*w13_weight in one tensor: a fused 3-D expert bank"):
        from_views(views, config, shapes)


def test_a_bank_the_loader_writes_expert_by_expert_is_a_stacked_bank():
    """Step-3 text (its breadth answers): vLLM 0.33's Step3TextModel.load_weights writes moe.gate_proj.weight
    [E, I, H] into w13_weight one expert at a time (``loaded_weight[expert_id]``), each expert's [I, H] as stored: no
    refusal, but ``[stacked]`` (the bank modules as globs, the expert count's config path, the loader named), gate and
    up one ``w13`` scale group under the bank's parent, no expert set (no per-expert module); ``[moe]`` holds the
    config's MoE layers against the banks (a layer's banks are its experts: plan.consistency).
    The same bank written whole (one write of [E, I, H]) or cut into halves stays refused (above)."""
    views, config, shapes = load_answers(ANSWERS / "breadth" / "Step3TextForCausalLM.answers.json")
    t = from_views(views, config, shapes).table
    assert t["stacked"]["modules"] == [f"model.layers.*.moe.{p}_proj" for p in ("down", "gate", "up")]
    assert t["stacked"]["experts"] == "moe_num_experts"
    assert "Step3TextForCausalLM.load_weights" in t["stacked"]["reason"] and "one expert at a time" in t["stacked"][
        "reason"]
    assert t["scale_group"] == [{"name": "w13", "members": ["gate_proj", "up_proj"],
                                 "parents": ["model.layers.{layer}.moe"], "same_rows": True}]
    assert "expert_sets" not in t
    assert t["moe"] == {"experts": "moe_num_experts", "members": ["down_proj", "gate_proj", "up_proj"],
                        "layers": "model.layers.{layer}", "num_layers": "num_hidden_layers",
                        "moe_list": "moe_layers_enum"}
    from kimi_convert.errors import ConvertError

    v = views[0]
    bank = next(s for s in v.spans if s["tensor"].endswith("moe.down_proj.weight"))
    others = [s for s in v.spans if s is not bank]
    for changed in ({"writes": 1, "shape": shapes[bank["tensor"]]},  # copied whole
                    {"writes": 16, "shape": [bank["shape"][0] // 2, bank["shape"][1]]}):  # cut into halves
        v.spans = [*others, {**bank, **changed}]
        with pytest.raises(ConvertError, match=r"moe\.down_proj\.weight \[8, 256, 128\] fills every expert of vLLM "
                                               r"0\.33\.0's .*w2_weight in one tensor: a fused 3-D expert bank"):
            from_views(views, config, shapes)


def test_a_bank_stored_without_weight_that_the_loader_writes_expert_by_expert_is_kept():
    """IQuest-Q1 (its breadth answers): SGLang 0.5.23's load_iquest_q1_weights writes ``mlp.experts.fc`` [E, 2I, H],
    stored without ``.weight``, into w13_weight expert by expert in two row parts (``loaded_weight[e][:I]`` to w1,
    ``[I:]`` to w3) and ``mlp.experts.proj`` [E, H, I] into w2_weight expert by expert: no refusal, but ``[stacked]``
    with ``keep = true`` (the tool copies a bank stored without ``.weight`` as stored only), the loader named and the
    row parts said; ``[moe]`` holds the config's MoE layers (``mlp_only_layers``) against the banks' leaves; no scale
    group (the banks are no module's weight). The same bank written whole in one copy, or in parts that are not
    rows of an expert, stays refused; so does a ``.weight`` bank cut into parts (Step-3 text's, above)."""
    views, config, shapes = load_answers(ANSWERS / "breadth" / "IQuestQ1ForCausalLM.answers.json")
    t = from_views(views, config, shapes).table
    st = t["stacked"]
    assert (st["modules"], st["experts"], st["keep"]) == (
        ["model.layers.*.mlp.experts.fc", "model.layers.*.mlp.experts.proj"], "num_experts", True)
    assert "IQuestQ1ForCausalLM.load_weights (sglang.srt.models.iquest_q1)" in st["reason"]
    assert "model.layers.*.mlp.experts.fc -> w13_weight in 2 row parts an expert" in st["reason"]
    assert "stored without .weight" in st["reason"] and "kept BF16" in st["reason"]
    assert t["moe"] == {"experts": "num_experts", "members": ["fc", "proj"], "layers": "model.layers.{layer}",
                        "num_layers": "num_hidden_layers", "dense_list": "mlp_only_layers"}
    assert "scale_group" not in t and "expert_sets" not in t
    assert [g["name"] for g in t["group"]] == ["gate_up_proj", "qkv_proj"]
    assert t["keep"] == [{"pattern": "model.layers.*.mlp.router", "reason": t["keep"][0]["reason"]}]
    step3 = from_views(*load_answers(ANSWERS / "breadth" / "Step3TextForCausalLM.answers.json")).table["stacked"]
    assert "keep" not in step3  # banks stored as X.weight: NVFP4
    from kimi_convert.errors import ConvertError

    v = views[0]
    bank = next(s for s in v.spans if s["tensor"] == "model.layers.1.mlp.experts.fc")
    others = [s for s in v.spans if s is not bank]
    for changed in ({"writes": 1, "shape": shapes[bank["tensor"]]},  # copied whole
                    {"writes": 8, "shape": [256, 128]},  # a transpose's columns, not rows of the expert
                    {"writes": 24, "shape": [128, 256]}):  # three parts of 128 rows are not the expert's 256
        v.spans = [*others, {**bank, **changed}]
        with pytest.raises(ConvertError, match=r"mlp\.experts\.fc \[8, 256, 256\] fills every expert of SGLang "
                                               r"0\.5\.23's .*w13_weight in one tensor: a fused 3-D expert bank"):
            from_views(views, config, shapes)


def test_vllm_asks_a_module_built_under_an_empty_prefix_by_a_name_the_exclude_list_also_holds():
    """vLLM 0.33 builds Step3TextModel(prefix=""), so ModelOpt's is_layer_excluded is asked ``.layers.N.self_attn.
    qkv_proj``, which no entry naming ``model.layers.N.self_attn.q_proj`` reaches: ``[engine_names]`` holds the
    prefix (its dot kept: compressed-tensors matches ignore entries whole) for every source module of such a module.
    SGLang's prefixes are not read so (its ModelOpt entries match whole: HunYuan's ``.self_attn.qkv_proj`` gives no
    rule; its shipped table is unchanged)."""
    views, config, shapes = load_answers(ANSWERS / "breadth" / "Step3TextForCausalLM.answers.json")
    names = from_views(views, config, shapes).table["engine_names"]
    assert names[r"model\.layers\.(\d+)\.self_attn\.q_proj"] == r".layers.\1.self_attn.qkv_proj"
    assert names[r"model\.layers\.(\d+)\.share_expert\.up_proj"] == r".layers.\1.share_expert.gate_up_proj"
    assert not any("moe" in rx for rx in names)  # the router is built unquantized; the banks are 3-D
    hy = from_views(*load_answers(ANSWERS / "breadth" / "HunYuanMoEV1ForCausalLM.answers.json")).table
    assert "engine_names" not in hy


def test_a_module_the_engine_refuses_to_build_quantized_is_built_ignored_and_kept(monkeypatch, tmp_path):
    """vLLM 0.33's Step 5 refuses to build its DSA layers' qkv_indexer_proj quantized ("Step5 DSA layers fuse qkv with
    the sparse indexer into one plain GEMM and cannot be quantized, but model.layers.3.self_attn.qkv_indexer_proj.weight
    resolved to ModelOptLinearMethod"): the build runs again with that module (in every layer holding it) and its
    source modules ignored, and the build records the refusal."""
    import json as json_mod

    import kimi_convert.enginecheck as ec
    from kimi_convert.derive import build_ignoring_refused, refused_module

    msg = ("Step5 DSA layers fuse qkv with the sparse indexer into one plain GEMM and cannot be quantized, but "
           "model.layers.3.self_attn.qkv_indexer_proj.weight resolved to ModelOptLinearMethod.")
    trace = {"modules": {f"model.layers.{i}.self_attn.qkv_indexer_proj": {"kind": "linear"} for i in (3, 7)},
             "spans": [{"tensor": f"model.layers.{i}.self_attn.{p}.weight",
                        "param": f"model.layers.{i}.self_attn.qkv_indexer_proj.weight"}
                       for i in (3, 7) for p in ("q_proj", "sparse_indexer_z")]}
    assert refused_module({"error": {"type": "ValueError", "message": msg}}, trace) == \
        "model.layers.3.self_attn.qkv_indexer_proj"
    assert refused_module({"error": {"type": "ValueError", "message": "no module named here"}}, trace) is None
    folder = tmp_path / "modelopt"
    folder.mkdir()
    (folder / "config.json").write_text(json_mod.dumps({"quantization_config": {"quant_method": "modelopt"}}))
    asked = []

    def fake(model_dir, engine, mode, *a, **k):
        ignore = json_mod.loads((Path(model_dir) / "config.json").read_text())["quantization_config"].get("ignore")
        asked.append(ignore)
        return {"modules": {"x": {}}} if ignore else {"error": {"type": "ValueError", "message": msg}}

    monkeypatch.setattr(ec, "run_derive", fake)
    b = build_ignoring_refused("vllm", "modelopt", folder, trace)
    assert asked[0] is None and asked[1] == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in (3, 7) for p in ("qkv_indexer_proj", "q_proj", "sparse_indexer_z"))
    assert b["refused"] == {"model.layers.{layer}.self_attn.qkv_indexer_proj": f"ValueError: {msg}"}


def test_the_members_of_a_module_never_built_quantized_are_kept_and_form_no_group():
    """Step 5 (its breadth answers): qkv_indexer_proj, refused quantized under both formats, is no group (its members
    never share a global scale; the sliding-window layers hold q/k/v/g without the indexer, which a group would bind
    there); each member is kept, the reason naming the refusal; the routed experts are stacked banks."""
    t = from_answers(ANSWERS / "breadth" / "Step5ForCausalLM.answers.json").table
    assert not any(g["name"] == "qkv_indexer_proj" for g in t["group"])
    keep = {k["pattern"]: k["reason"] for k in t["keep"]}
    for p in ("q_proj", "k_proj", "v_proj", "g_proj", "sparse_indexer_q", "sparse_indexer_k", "sparse_indexer_z"):
        assert "refuses to build" in keep[f"model.layers.*.self_attn.{p}"] and "qkv_indexer_proj" in keep[
            f"model.layers.*.self_attn.{p}"]
    assert t["stacked"]["experts"] == "moe_num_experts" and len(t["stacked"]["modules"]) == 3


def test_the_mtp_layer_rules_come_from_the_drafts():
    """DeepSeek V3's MTP layer, from the drafts' answers: its own embed_tokens is an embedding (vLLM's DeepSeekMTP
    reads it into a VocabParallelEmbedding), and vLLM's draft builds shared_head.head (a ParallelLMHead) unquantized
    under compressed-tensors: kept there, as the hand table keeps it."""
    t = _derived("tiny-deepseek-v3").table
    assert "model.layers.*.embed_tokens" in t["not_linear"]
    (vllm,) = [d for d in t["mtp"]["draft"] if d["engine"] == "vllm"]
    assert "model.layers.{n}.shared_head.head" in vllm["unquantized"]["compressed-tensors"]
    assert "model.layers.{n}.shared_head.head" not in vllm["unquantized"]["modelopt"]  # ModelOptLinearMethod there
    assert "not_linear" not in t["mtp"]


#: Hand tables the derived table replaced (docs/derive.md, "Which hand tables stay"): the shipped derived table, the
#: preset its answers are recorded for, and the last commit that held the hand table.
REPLACED = {"minimax_m2": ("tiny-minimax-m2", "e32571f"), "mistral_large_3": ("tiny-mistral-large-3", "f7e006e")}


@pytest.mark.parametrize("name", sorted(REPLACED))
def test_a_replaced_hand_table_is_its_shipped_derived_table(name, tmp_path):
    """The shipped derived table is what the rules give from the preset's recorded answers, ``plan`` finds it with
    no engine environment, and it plans the preset like the hand table it replaced (taken from git) under every
    recipe: the same formats, fusions, global-scale sets, exclude list and shards (the bytes:
    ``scripts/derive_compare.py --pack`` before the hand table went, docs/derive.md)."""
    import subprocess

    from kimi_convert.derive.lookup import shipped_for
    from kimi_convert.mapping import parse_mapping

    preset, commit = REPLACED[name]
    text = (ROOT / "mappings" / "derived" / f"{name}.toml").read_text()
    assert _derived(preset).text == text
    src = tmp_path / preset
    assert run("synth", preset, src).code == 0
    ckpt = open_checkpoint(src)
    derived = shipped_for(ckpt.config)
    assert derived is not None and derived.name == f"derived-{name}"
    try:
        hand_text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:mappings/{name}.toml"], check=True,
                                   capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history to take the replaced hand table from")
    hand = parse_mapping(hand_text, f"{commit}:mappings/{name}.toml")
    cmp = _compare_module()
    for recipe in cmp.DEFAULT_RECIPES:
        a, b = (cmp.normalized(make_plan(ckpt, m, Options(recipe=recipe))) for m in (hand, derived))
        assert a == b, (recipe, cmp.differences(a, b))


def test_the_drafts_packed_modules_are_groups(tmp_path):
    """Qwen3.5's MTP block (``mtp.layers.N``): the main models drop it, its drafts (vLLM Qwen3_5MoeMTP, SGLang
    Qwen3_5ForCausalLMMTP) pack its q/k/v, the shared expert's gate/up and the experts' w13 as the main layers: the
    derived table groups them, and plans the block like the hand table (one global scale per packed module)."""
    t = _derived("tiny-qwen3-5-moe").table
    (qkv,) = [g for g in t["group"] if g["name"] == "qkv_proj"]
    assert "mtp.layers.{layer}.self_attn" in qkv["parents"]
    (w13,) = t["scale_group"]
    assert sorted(w13["parents"]) == ["model.language_model.layers.{layer}.mlp.experts.{expert}",
                                      "mtp.layers.{layer}.mlp.experts.{expert}"]
    cmp = _compare_module()
    src = tmp_path / "q35"
    assert run("synth", "tiny-qwen3-5-moe", src).code == 0
    ckpt = open_checkpoint(src)
    derived = finish(_derived("tiny-qwen3-5-moe").text, "derived")
    for recipe in cmp.DEFAULT_RECIPES:
        a, b = (cmp.normalized(make_plan(ckpt, m, Options(recipe=recipe))) for m in (find_mapping(ckpt.config),
                                                                                      derived))
        mtp = [[m for m in p["modules"] if m["name"].startswith("mtp.")] for p in (a, b)]
        assert mtp[0] and mtp[0] == mtp[1], recipe


def test_a_module_a_quantized_build_makes_under_another_class_is_read_there():
    """SGLang builds ModelOpt Mixtral as QuantMixtralForCausalLM (one linear layer per expert and member): its
    ModelOpt build has no routed bank where the plain build put the experts. The build's own module of the source's
    name then says how that format builds the weight: an unquantized one keeps it, a quantized one does not, and a
    format that builds neither says nothing."""
    def table(method: str | None) -> dict:
        views, config, shapes = _qwen3_answers()
        sg = next(v for v in views if v.engine == "sglang")
        mods = sg.quant_modules["modelopt"]
        for name in [n for n in mods if n.endswith(".mlp.experts")]:
            del mods[name]
            if method is not None:
                for e in range(config["num_experts"]):
                    for leaf in ("gate_proj", "up_proj", "down_proj"):
                        mods[f"{name}.{e}.{leaf}"] = {"class": "ReplicatedLinear", "kind": "linear",
                                                      "quant_method": method, "parent_class": "QuantMixtralMoE",
                                                      "parent_file": "sglang/srt/models/mixtral_quant.py"}
        return from_views(views, config, shapes).table

    def kept(t: dict) -> set[str]:
        return {k["pattern"] for k in t.get("keep", []) if ".experts." in k["pattern"]}

    assert kept(table(None)) == set()  # absent: nothing said of ModelOpt (the CT build quantizes the bank)
    assert kept(table("ModelOptNvFp4A16LinearMethod")) == set()
    assert kept(table("UnquantizedLinearMethod")) == {f"model.layers.*.mlp.experts.*.{m}"
                                                      for m in ("gate_proj", "up_proj", "down_proj")}


def test_a_format_an_engine_cannot_build_under_says_nothing_of_it():
    """vLLM 0.33 cannot build Kimi K3 under a compressed-tensors config ('_KimiGDNMergedColumnParallelLinear' object
    has no attribute 'weight'): that format's build says nothing (its output cannot load there anyway) and the table's
    header says so; an engine that can build under no format refuses the derivation in one line."""
    from kimi_convert.derive import view_of
    from kimi_convert.errors import ConvertError

    trace = {"version": "0.33.0", "model_class": "vllm.X", "spans": [], "modules": {}}
    err = {"error": {"type": "AttributeError", "message": "no attribute 'weight'\nmore"}}
    v = view_of("vllm", trace, {"modelopt": {"modules": {"a": {}}}, "compressed-tensors": err})
    assert v.build_errors == {"compressed-tensors": "AttributeError: no attribute 'weight'"}
    assert list(v.quant_modules) == ["modelopt"]
    with pytest.raises(ConvertError, match=r"^vllm 0\.33\.0: cannot build the architecture under a modelopt config: "
                                           r"AttributeError: no attribute 'weight'$"):
        view_of("vllm", trace, {"modelopt": err, "compressed-tensors": err})
    views, config, shapes = _qwen3_answers()
    views[0].build_errors = {"compressed-tensors": "AttributeError: no attribute 'weight'"}
    assert "# vLLM 0.33.0: cannot build the model under a compressed-tensors config (AttributeError: no attribute " \
           "'weight'): nothing read of it" in from_views(views, config, shapes).text


def test_a_reduced_stand_ins_mtp_maps_back_to_the_full_size_layers():
    """GLM-4.5's engines' recorded answers renamed as a reduced stand-in's would be (derive/reduce.py: 2 of 3 layers,
    the MTP layer renumbered from 3 to 2) give the whole stand-in's [mtp] table when read against the stand-in's own
    config (what ``derive`` now does), and not when read against the source's (what it did: the drafts' names then
    miss the MTP prefix computed from 3 layers)."""
    import copy
    import re

    from kimi_convert.derive import reduce

    path = ANSWERS / "tiny-glm4-moe.draft-answers.json"
    views, config, shapes = load_answers(path)
    drafts = load_draft_answers(path)
    r = reduce.plan(config, list(shapes))
    assert (r.layers, r.mtp) == (2, 1)
    small_config, small = reduce.apply(config, [(n, tuple(s), "bfloat16") for n, s in shapes.items()], r)
    main = config["num_hidden_layers"]

    def rename(text: str) -> str:
        return re.sub(r"(layers\.)(\d+)(?=\.)",
                      lambda m: m.group(1) + str(r.layers + int(m.group(2)) - main if int(m.group(2)) >= main
                                                 else int(m.group(2))), text)

    def renamed(x):
        if isinstance(x, str):
            return rename(x)
        if isinstance(x, list):
            return [renamed(v) for v in x]
        if isinstance(x, dict):
            return {renamed(k): renamed(v) for k, v in x.items()}
        return x

    def dropped(name: str) -> bool:  # a main layer past the kept prefix
        return any(r.layers <= int(n) < main for n in re.findall(r"layers\.(\d+)\.", name))

    small_views = [copy.deepcopy(v) for v in views]
    for v in small_views:
        v.spans = renamed([s for s in v.spans if not dropped(s["tensor"])])
        v.modules = renamed({k: m for k, m in v.modules.items() if not dropped(k)})
        v.quant_modules = renamed({f: {k: m for k, m in ms.items() if not dropped(k)}
                                   for f, ms in v.quant_modules.items()})
        v.mtp_skipped = renamed(v.mtp_skipped)
    small_drafts = renamed(drafts)
    small_shapes = {n: list(s) for n, s, _ in small}
    whole = from_views(views, config, shapes, drafts).table["mtp"]
    assert from_views(small_views, small_config, small_shapes, small_drafts).table["mtp"] == whole
    assert from_views(small_views, config, small_shapes, small_drafts).table.get("mtp") != whole


def test_ernies_first_moe_layer_key_reads_as_dense_below():
    """Ernie 4.5 MoE's dense first layers: vLLM's Ernie4_5_MoeDecoderLayer makes a layer MoE from
    ``moe_layer_start_index`` on; the derived [moe] holds the layers against it (the breadth fixture's layer 0 is
    dense, and plan refused the pack without it)."""
    views, config, shapes = _qwen3_answers()
    t = from_views(views, {**config, "moe_layer_start_index": 1}, shapes).table
    assert t["moe"]["dense_below"] == "moe_layer_start_index"


def test_afmoes_dense_layer_count_reads_as_dense_below():
    """Afmoe's dense first layers: both engines make a layer MoE from ``num_dense_layers`` on (vLLM afmoe.py
    ``AfmoeDecoderLayer``: ``layer_idx >= config.num_dense_layers``); without the rule plan refused the breadth
    fixture ("num_experts 8 makes layer 0 a MoE layer, but model.layers.0 holds no routed experts")."""
    views, config, shapes = _qwen3_answers()
    t = from_views(views, {**config, "num_dense_layers": 1}, shapes).table
    assert t["moe"]["dense_below"] == "num_dense_layers"
    assert "dense_below" not in from_views(views, config, shapes).table["moe"]


def test_a_scale_group_named_as_a_packed_module_is_named_apart():
    """LFM2 MoE (its breadth answers): vLLM's dense MLP is ``w13`` (``feed_forward.w1`` + ``w3``), the routed bank's
    scale group ``w13`` too; a table's groups and scale groups of one name must differ in engines, so mapping.parse
    refused the derived table ("two groups of one name need different engines or conditions") until the scale group
    was named apart."""
    from kimi_convert.mapping import parse_mapping

    answers = Path(__file__).parent / "derived" / "breadth" / "Lfm2MoeForCausalLM.answers.json"
    d = from_views(*load_answers(answers))
    assert [(g["name"], g["parents"]) for g in d.table["group"] if g["name"].startswith("w13")] == [
        ("w13", ["model.layers.{layer}.feed_forward"])]
    assert [(g["name"], g["members"]) for g in d.table["scale_group"]] == [("w13_2", ["w1", "w3"])]
    assert {g.name for g in parse_mapping(d.text, "lfm2").groups} >= {"w13", "w13_2"}


def test_kimi_k3s_derived_table_with_its_overlay_plans_like_the_hand_table(tmp_path):
    """Kimi K3 (tiny-k3, the engines' answers recorded; vLLM 0.33 cannot build it under compressed-tensors, so that
    format's build says nothing of vLLM): with mappings/overlays/kimi_k3.toml (the hand table's four SGLang
    raw-weight restrictions, engine-check findings) the derived table plans like the hand table under the W4A16
    recipes. The NVIDIA recipe names modules under the hand table's text_prefix, which a derived table lacks: it
    quantizes nothing there (the hand table stays: docs/derive.md)."""
    from kimi_convert.errors import ConvertError

    cmp = _compare_module()
    src = tmp_path / "k3"
    assert run("synth", "tiny-k3", src).code == 0
    ckpt = open_checkpoint(src)
    d = _derived("tiny-k3")
    assert "cannot build the model under a compressed-tensors config" in d.text
    derived, hand = finish(d.text, "derived"), find_mapping(ckpt.config)
    for recipe in ("nvfp4-w4a16", "ct-nvfp4-a16"):
        a, b = (cmp.normalized(make_plan(ckpt, m, Options(recipe=recipe))) for m in (hand, derived))
        assert a == b, (recipe, cmp.differences(a, b))
    with pytest.raises(ConvertError, match="quantizes no module"):
        make_plan(ckpt, derived, Options(recipe="nvidia-k3"))


def _non_gated(views, shapes):
    """The recorded Qwen3 MoE answers with the routed experts made non-gated (Nemotron-H's relu2 experts: ``up_proj``
    alone into the bank's ``w13``, ``down_proj`` into ``w2``): no gate_proj offered, none landed."""
    gate = lambda n: ".experts." in n and ".gate_proj." in n  # noqa: E731
    for v in views:
        v.spans = [s for s in v.spans if not gate(s["tensor"])]
    return views, {n: s for n, s in shapes.items() if not gate(n)}


def test_non_gated_experts_form_an_expert_set():
    """Nemotron-H's gap (breadth run): a non-gated expert puts one module in each bank parameter, so no w13 scale
    group forms, and the expert sets came only from scale groups: the table named none, the recipe's expert rule
    (NVFP4 with input_scale) missed the experts and both engines left w13_input_scale / w2_input_scale unfilled. The
    banks the engines loaded per-expert modules into are the expert sets now, whatever their members."""
    views, config, shapes = _qwen3_answers()
    gated = from_views(views, config, shapes).table
    views, shapes = _non_gated(views, shapes)
    t = from_views(views, config, shapes).table
    assert "scale_group" not in t
    assert t["expert_sets"] == gated["expert_sets"] == ["model.layers.{layer}.mlp.experts"]
    assert t["moe"]["members"] == ["down_proj", "up_proj"]


def test_a_hybrid_pattern_string_says_which_layers_are_moe(tmp_path):
    """Nemotron-H says which layers hold experts by a string of one letter a layer (``hybrid_override_pattern``,
    ``E`` a MoE layer: vLLM 0.33 nemotron_h.py builds layer i by its letter), which no [moe] layer rule read, so a
    table with its expert sets would have plan refuse every non-MoE layer. The derived [moe] finds the config string
    whose one letter marks exactly the layers holding the bank; plan holds the tensors against it."""
    import tomli_w

    from helpers import edit_config, rewrite_tensors
    from kimi_convert.errors import ConvertError

    views, config, shapes = _qwen3_answers()
    config = {k: v for k, v in config.items() if k not in ("decoder_sparse_step", "mlp_only_layers")}
    config["layers_pattern"] = "-E"
    dense0 = lambda n: n.startswith("model.layers.0.mlp.")  # noqa: E731
    t = from_views(views, config, {n: s for n, s in shapes.items() if not dense0(n)}).table
    assert (t["moe"]["pattern"], t["moe"]["pattern_moe"]) == ("layers_pattern", "E")
    assert "pattern" not in from_views(views, config, shapes).table["moe"]  # every layer holds experts: no rule
    src = tmp_path / "hybrid"
    assert run("synth", "tiny-qwen3-moe", src).code == 0

    def to_dense(ts: dict) -> None:  # layer 0's MoE block becomes a dense MLP of one expert's weights
        for n in [n for n in ts if dense0(n)]:
            w = ts.pop(n)
            if ".experts.0." in n:
                ts[n.replace(".experts.0.", ".")] = w

    edit_config(src, lambda c: (c.pop("decoder_sparse_step", None), c.pop("mlp_only_layers", None),
                                c.update(layers_pattern="-E")))
    rewrite_tensors(src, to_dense)
    m = finish(tomli_w.dumps(t), "hybrid")
    make_plan(open_checkpoint(src), m, Options())  # layer 0 dense, layer 1 MoE: as the string says
    edit_config(src, lambda c: c.update(layers_pattern="EE"))
    with pytest.raises(ConvertError, match=r"config\.json: num_experts \d+ makes layer 0 a MoE layer, but "
                                           r"model\.layers\.0.* holds no routed experts"):
        make_plan(open_checkpoint(src), m, Options())
    edit_config(src, lambda c: c.update(layers_pattern="--"))
    with pytest.raises(ConvertError, match=r"config\.json: layers_pattern the string '--' makes layer 1 dense, but "
                                           r"model\.layers\.1\.mlp\.experts holds \d+ routed experts"):
        make_plan(open_checkpoint(src), m, Options())


def test_a_rename_becomes_a_rule_over_every_index():
    """``[engine_names]`` rules from one module's rename (``table._rename_rule``): each index of the source's name is a
    group the engine's name takes in the same order; a rename that does not keep the indices in order names that
    module alone (re.escape'd), so it can never rename another."""
    import re

    from kimi_convert.derive.table import _rename_rule

    rx, new = _rename_rule("layers.1.experts.3.w1", "model.layers.1.mlp.experts.3.gate_proj")
    assert (rx, new) == (r"layers\.(\d+)\.experts\.(\d+)\.w1", r"model.layers.\1.mlp.experts.\2.gate_proj")
    assert re.sub(rx, new, "layers.60.experts.255.w1") == "model.layers.60.mlp.experts.255.gate_proj"
    assert _rename_rule("output", "lm_head") == ("output", "lm_head")
    rx, new = _rename_rule("blocks.2.attn.3.w", "model.layers.3.attn.2.w")  # the indices swapped: this module alone
    assert re.fullmatch(rx, "blocks.2.attn.3.w") and not re.fullmatch(rx, "blocks.4.attn.3.w")
    assert new == "model.layers.3.attn.2.w"


def test_engine_names_may_spell_a_module_both_engines_ways():
    """An ``[engine_names]`` rule holds one name or a list (one engine's spelling and the other's): the plan's exclude
    list gets each (``Mapping.engine_spellings``, in the rules' order, once each); a value that is neither a string nor
    a list of strings is one line naming the key."""
    from kimi_convert.errors import ConvertError
    from kimi_convert.mapping import parse_mapping

    text = r"""name = "t"
[engine_names]
'layers\.(\d+)\.attn\.wq_a' = ['model.layers.\1.self_attn.wqkv_a', 'model.layers.\1.attn.fused_wqa_wkv']
'layers\.(\d+)\.attn\.wkv' = 'model.layers.\1.self_attn.wqkv_a'
'layers\.(\d+)\.attn\.wkv$' = 'model.layers.\1.self_attn.wqkv_a'
"""
    m = parse_mapping(text, "t.toml")
    assert m.engine_spellings("layers.7.attn.wq_a") == ["model.layers.7.self_attn.wqkv_a",
                                                        "model.layers.7.attn.fused_wqa_wkv"]
    assert m.engine_spellings("layers.7.attn.wkv") == ["model.layers.7.self_attn.wqkv_a"]
    assert m.engine_spellings("layers.7.attn.wq_b") == []
    with pytest.raises(ConvertError, match="engine_names"):
        parse_mapping('name = "t"\n[engine_names]\nhead = 3\n', "t.toml")


def test_a_table_cached_by_other_rules_is_derived_again(monkeypatch, tmp_path):
    """The cache's key holds the derivation's own code (``derive.rules_digest``): after an upgrade that changes how the
    runners report or the rules read (session 37's head and [engine_names]), a table cached by the older code is not
    taken; a table cached by this code is, with no engine asked."""
    from kimi_convert import derive
    from kimi_convert.derive import lookup

    src = tmp_path / "tq"
    assert run("synth", "tiny-qwen3-moe", src).code == 0
    ckpt = open_checkpoint(src)
    versions = {"vllm": "0.33.0", "sglang": "0.5.23"}
    assert len(derive.rules_digest()) == 64
    monkeypatch.setenv("KIMI_CONVERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("kimi_convert.enginecheck.resolve", lambda e: type("R", (), {"version": versions[e]}))
    asked = []
    monkeypatch.setattr(derive, "derive", lambda c: asked.append(c) or _derived("tiny-qwen3-moe"))
    monkeypatch.setattr(derive, "rules_digest", lambda: "older")
    old_key = derive.cache_key(ckpt.config, versions)
    lookup.cached_or_derived(ckpt)
    lookup.cached_or_derived(ckpt)
    assert len(asked) == 1  # derived once, then taken from the cache
    monkeypatch.setattr(derive, "rules_digest", lambda: "newer")
    assert derive.cache_key(ckpt.config, versions) != old_key
    lookup.cached_or_derived(ckpt)
    assert len(asked) == 2  # the older rules' table is not taken


def test_an_engine_that_does_not_serve_the_architecture_is_left_out_and_said(monkeypatch, tmp_path):
    """A new architecture one engine serves before the other (Step 5: SGLang 0.5.23 registers no Step5ForCausalLM;
    Beam: SGLang builds it only as W4A4 NVFP4 or FP8) is derived from the engine that serves it: the other engine's
    runner says it registers none of the config's architectures (or every quantized build fails), the derivation
    goes on without it, and the table says so in its header and in ``not_served``, which ``plan`` and ``pack``
    repeat as a warning (``--strict``: an error). With no engine serving it, the derivation fails with each one's
    reason."""
    import kimi_convert.derive as derive
    import kimi_convert.enginecheck as ec
    from helpers import spec
    from kimi_convert.derive import Unserved, view_of
    from kimi_convert.errors import ConvertError

    answers = ROOT / "tests" / "derived" / "breadth" / "Step5ForCausalLM.answers.json"
    (vllm,), _, _ = load_answers(answers)
    src = tmp_path / "src"
    assert run("synth", spec("tiny-step5"), src).code == 0
    calls = []

    def fake_trace(model_dir, engine, mode, *a, **k):
        calls.append((engine, mode))
        return {"registered": False, "version": "0.5.23"}

    monkeypatch.setattr(ec, "run_derive", fake_trace)
    with pytest.raises(Unserved, match=r"sglang 0\.5\.23 registers none of \['Step5ForCausalLM'\]"):
        derive.ask_engine("sglang", {"plain": src, "weights": src / "w.json"})
    assert calls == [("sglang", "trace")]  # no build asked of an engine that does not serve it
    with pytest.raises(Unserved, match="cannot build the architecture under a modelopt config: .*W4A4"):
        view_of("sglang", {"version": "0.5.23", "modules": {}}, {
            f: {"error": {"type": "NotImplementedError", "message": "Beam supports BF16 or ModelOpt W4A4 NVFP4"}}
            for f in ("modelopt", "compressed-tensors")})

    def ask_engine(engine, dirs, trust=False):
        if engine == "sglang":
            raise Unserved("sglang 0.5.23 registers none of ['Step5ForCausalLM']")
        return vllm

    monkeypatch.setattr(derive, "ask_engine", ask_engine)
    d = derive.derive(open_checkpoint(src))
    assert d.table["not_served"] == {"sglang": "sglang 0.5.23 registers none of ['Step5ForCausalLM']"}
    assert "# sglang: left out, it does not serve the architecture quantized" in d.text
    shipped = tomllib.loads((ROOT / "mappings" / "derived" / "step5.toml").read_text())
    assert {k: v for k, v in d.table.items() if k != "not_served"} == shipped  # the rest: vLLM's answers' table
    (tmp_path / "t.toml").write_text(d.text)
    r = run("plan", src, "--mapping", tmp_path / "t.toml")
    assert r.code == 0 and "derived without sglang (sglang 0.5.23 registers none of" in r.stderr, r.stderr
    r = run("plan", src, "--mapping", tmp_path / "t.toml", "--strict")
    assert r.code == 2 and "--strict makes warnings errors" in one_line_error(r)

    monkeypatch.setattr(derive, "ask_engine", lambda e, d, t=False: (_ for _ in ()).throw(Unserved(f"{e}: no")))
    with pytest.raises(ConvertError, match="vllm: no; sglang: no"):
        derive.derive(open_checkpoint(src))
