"""Ling 3.0 (BailingMoeV3ForCausalLM) without an engine: the tests' preset is laid out as the release (config.json with
the release's keys, model_type bailing_hybrid as Ling 2.5's and its remote config class; Kimi Delta Attention layers
and an MLA layer in every group of layer_group_size; the names both engines' loaders consume; BF16 but the fp32
auxiliaries), the MTP variant stores the release's MTP layer as model.layers.{N}, and the breadth run names Ling
3.0's derived table apart from Ling 2.5's (both say model_type bailing_hybrid).

The expected names are written here by hand from the engines' loaders (vLLM 0.33 bailing_moe_v3.py
BailingMoeV3ForCausalLM.load_weights, BailingMoeV3KimiDeltaAttention, BailingMoeV3MLAAttention, BailingMoeV3MoE;
SGLang 0.5.23 bailing_moe_v3.py BailingMoeV3ForCausalLM.load_weights and kimi_linear.py KimiDeltaAttention), the
release's names as transformers 5.25 converts them (models/bailing_hybrid, conversion_mapping.py "bailing_hybrid")
and mlx-lm's bailing_moe_v3.py (docs/families.md, "Ling 3.0"), not produced by the code under test.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tomllib
from pathlib import Path

import pytest
from test_family_bailing_moe_v2 import DENSE, moe  # the MLP and MoE parts are Ling 2.0's, name for name

from helpers import config_keys_read, engine_file, read_tensors, weight_map, write_synth

ROOT = Path(__file__).resolve().parent.parent

# the release's config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid",
    "auto_map": {"AutoConfig": "configuration_bailing_moe_v3.BailingMoeV3Config",
                 "AutoModel": "modeling_bailing_moe_v3.BailingMoeV3Model",
                 "AutoModelForCausalLM": "modeling_bailing_moe_v3.BailingMoeV3ForCausalLM"},
    "first_k_dense_replace": 2, "layer_group_size": 6, "head_dim": 128, "short_conv_kernel_size": 4,
    "no_kda_lora": True, "use_kda_lora": False, "kda_safe_gate": True, "kda_lower_bound": -5.0,
    "gated_attention_proj_granularity_type": "head_wise", "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "qk_head_dim": 192, "rotary_dim": 64, "v_head_dim": 128, "rope_interleave": True,
    "rope_theta": 6000000, "partial_rotary_factor": 0.5, "rope_scaling": None, "use_mla_nope": False,
    "mtp_use_kda": False, "score_function": "sigmoid", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "moe_router_enable_expert_bias": True, "router_dtype": "fp32",
    "routed_scaling_factor": 2.5, "num_shared_experts": 1, "tie_word_embeddings": False, "use_bias": False,
    "use_qkv_bias": False, "use_qk_norm": True, "group_norm_size": 1, "linear_silu": True,
    "eos_token_id": 156895, "pad_token_id": 156892,
}

KDA = {f"attention.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "b_proj", "o_proj",
                                          "q_conv1d", "k_conv1d", "v_conv1d", "o_norm")} | {"attention.A_log",
                                                                                          "attention.dt_bias"}
MLA = {f"attention.{n}.weight" for n in ("q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
                                          "dense")}
NORMS = {"input_layernorm.weight", "post_attention_layernorm.weight"}
#: stored F32 (the rest BF16): transformers 5.25 BailingHybridPreTrainedModel._keep_in_fp32_modules_strict
#: (gate.weight, conv1d, dt_bias, A_log, e_score_correction_bias = the release's expert_bias); both engines' own
#: parameters are F32 (vLLM GateLinear params_dtype float32, SGLang BailingMoEGate router_dtype fp32)
F32 = ("mlp.gate.weight", "mlp.gate.expert_bias", "_conv1d.weight", ".A_log", ".dt_bias")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-bailing-moe-v3", tmp_path_factory.mktemp("ling3") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 6 and cfg["num_experts"] == 8 and cfg["num_nextn_predict_layers"] == 0
    assert cfg["num_hidden_layers"] % cfg["layer_group_size"] == 0  # SGLang's BailingMoELinearModel asserts it
    assert cfg["num_experts"] % cfg["n_group"] == 0 and cfg["topk_group"] <= cfg["n_group"]
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    # vLLM reads it with no default (BailingMoeV3MoE: moe_shared_expert_intermediate_size * num_shared_experts)
    assert cfg["moe_shared_expert_intermediate_size"] == cfg["moe_intermediate_size"]
    assert len(cfg["expert_swiglu_limit_list"]) == len(cfg["share_expert_swiglu_limit_list"]) == 6
    assert (tiny / "configuration_bailing_moe_v3.py").is_file()  # the class auto_map names, shipped alongside


def test_layer_kinds_follow_the_engines_rule(tiny):
    """KDA where (layer + 1) % layer_group_size != 0 (vLLM _is_kda_layer / SGLang is_linear_layer), MLA elsewhere;
    dense MLP below first_k_dense_replace."""
    names = set(weight_map(tiny))
    for layer in range(6):
        got = {n.removeprefix(f"model.layers.{layer}.") for n in names if n.startswith(f"model.layers.{layer}.")}
        attn = MLA if (layer + 1) % 6 == 0 else KDA
        mlp = DENSE if layer < 2 else moe(8)
        assert got == NORMS | attn | mlp, layer


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    names = set(weight_map(tiny))
    want = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in range(2) for n in NORMS | KDA | DENSE}
    want |= {f"model.layers.{i}.{n}" for i in range(2, 5) for n in NORMS | KDA | moe(8)}
    want |= {f"model.layers.5.{n}" for n in NORMS | MLA | moe(8)}
    assert names == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, kv_lora, nope, rope, v, conv = 256, 128, 4, 128, 128, 64, 128, 4
    kda = heads * hd
    # KDA: full-rank gates (no_kda_lora), depthwise convolutions [C, 1, K] (vLLM's ColumnParallelLinear(K, C)
    # unsqueezed to [C, 1, K]; SGLang's qkv_conv1d likewise), A_log one per head (SGLang's loader indexes it 1-D)
    for p in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
        assert t[f"model.layers.0.attention.{p}.weight"].shape == (kda, h)
    for p in ("q_conv1d", "k_conv1d", "v_conv1d"):
        assert t[f"model.layers.0.attention.{p}.weight"].shape == (kda, 1, conv)
    assert t["model.layers.0.attention.b_proj.weight"].shape == (heads, h)
    assert t["model.layers.0.attention.A_log"].shape == (heads,)
    assert t["model.layers.0.attention.dt_bias"].shape == (kda,)
    assert t["model.layers.0.attention.o_norm.weight"].shape == (hd,)
    assert t["model.layers.0.attention.o_proj.weight"].shape == (h, kda)
    # MLA with no query LoRA and a head-wise output gate
    assert t["model.layers.5.attention.q_proj.weight"].shape == (heads * (nope + rope), h)
    assert t["model.layers.5.attention.kv_a_proj_with_mqa.weight"].shape == (kv_lora + rope, h)
    assert t["model.layers.5.attention.kv_a_layernorm.weight"].shape == (kv_lora,)
    assert t["model.layers.5.attention.kv_b_proj.weight"].shape == (heads * (nope + v), kv_lora)
    assert t["model.layers.5.attention.g_proj.weight"].shape == (heads, h)
    assert t["model.layers.5.attention.dense.weight"].shape == (h, heads * v)
    # MoE
    assert t["model.layers.2.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.2.mlp.gate.expert_bias"].shape == (8,)
    assert t["model.layers.2.mlp.shared_experts.gate_proj.weight"].shape == (128, h)
    assert t["model.layers.5.mlp.experts.7.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (768, h)
    f32 = {k for k in t if any(k.endswith(s) or (s.startswith("_") and s in k) for s in F32)}
    assert {t[k].dtype for k in f32} == {torch.float32} and len(f32) == 5 * 5 + 4 * 2
    assert {v.dtype for k, v in t.items() if k not in f32} == {torch.bfloat16}


def test_the_mtp_variant_stores_the_releases_mtp_layer(tmp_path):
    out = write_synth("tiny-bailing-moe-v3-mtp", tmp_path / "src")
    mtp = {n.removeprefix("model.layers.6.") for n in weight_map(out) if n.startswith("model.layers.6.")}
    # mtp_use_kda false: an MLA attention (vLLM bailing_moe_v3_mtp.py BailingMoeV3MTPLayer); no shared_head stored
    assert mtp == NORMS | MLA | moe(8) | {"enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"}
    assert read_tensors(out)["model.layers.6.eh_proj.weight"].shape == (256, 512)


ENGINE_FILES = {"vllm": ["model_executor/models/bailing_moe_v3.py"], "sglang": ["srt/models/bailing_moe_v3.py"]}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine):
    """Each ``config.X`` the engine's model file reads directly (no getattr default, no hasattr guard) is in
    config.json (vLLM's moe_shared_expert_intermediate_size among them)."""
    paths = [engine_file(engine, rel) for rel in ENGINE_FILES[engine]]
    if any(p is None for p in paths):
        pytest.skip(f"no {engine} environment under ~/.cache/kimi-convert/engines")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read("\n".join(p.read_text() for p in paths))
    # not config.json keys: what transformers' PretrainedConfig gives every config, and what SGLang sets on its
    # per-layer copy (layer_config.attention_type)
    derived = {"rope_parameters", "attention_type"}
    assert {"num_experts", "short_conv_kernel_size", "hidden_size"} <= read  # the reading found the file's keys
    assert sorted(k for k in read - derived if k not in cfg) == []


def _breadth(monkeypatch):
    spec = importlib.util.spec_from_file_location("derive_breadth", ROOT / "scripts" / "derive_breadth.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_the_breadth_run_names_ling_3s_table_apart_from_ling_2_5s(monkeypatch, tmp_path, tiny):
    """Ling 3.0 and Ling 2.5 both say model_type bailing_hybrid: Ling 3.0's derived table is named
    derived-bailing_moe_v3 (``derive.table_name``, from ``TABLE_NAMES``; its answers carry the name, so the table
    rebuilds from them), shipped as mappings/derived/bailing_moe_v3.toml with its own overlay's name, and ship()
    never overwrites a table shipped for another architecture."""
    from kimi_convert.checkpoint import open_checkpoint
    from kimi_convert.derive import TABLE_NAMES, from_answers, table_name

    db = _breadth(monkeypatch)
    assert TABLE_NAMES["BailingMoeV3ForCausalLM"] == "bailing_moe_v3"
    assert "BailingMoeV2_5ForCausalLM" not in TABLE_NAMES  # Ling 2.5's table keeps its model_type's name
    assert table_name(open_checkpoint(tiny)) == "bailing_moe_v3"
    ling25 = write_synth("tiny-bailing-moe-v2-5", tmp_path / "ling25")
    assert table_name(open_checkpoint(ling25)) is None
    work = tmp_path / "work"
    work.mkdir()
    answers = ROOT / "tests" / "derived" / "breadth" / "BailingMoeV3ForCausalLM.answers.json"
    if not answers.is_file():
        pytest.skip("Ling 3.0's table is not shipped")
    assert json.loads(answers.read_text())["name"] == "bailing_moe_v3"
    (work / "answers.json").write_text(answers.read_text())
    (work / "derived.toml").write_text(from_answers(work / "answers.json").text)
    table = tomllib.loads((work / "derived.toml").read_text())
    assert table["name"] == "derived-bailing_moe_v3" and table["model_types"] == []
    assert table["architectures"] == ["BailingMoeV3ForCausalLM"]
    assert (work / "derived.toml").read_text() == (ROOT / "mappings" / "derived" / "bailing_moe_v3.toml").read_text()
    # ship(): the destination is the table's name; a table of another architecture there is left alone
    monkeypatch.setattr(db, "REPO", tmp_path / "repo")
    (tmp_path / "repo" / "mappings" / "derived").mkdir(parents=True)
    rec = {"arch": "BailingMoeV3ForCausalLM", "vllm": "x", "sglang": "y", "fixture": {"model_type": "bailing_hybrid"},
           "output_check": {"vllm": {"read_right": True}, "sglang": {"read_right": True}}}
    assert db.ship(rec, work) == "mappings/derived/bailing_moe_v3.toml"
    other = tmp_path / "repo" / "mappings" / "derived" / "bailing_moe_v3.toml"
    other.write_text('name = "derived-bailing_moe_v3"\narchitectures = ["BailingMoeV2_5ForCausalLM"]\n')
    assert db.ship(rec, work) is None and "BailingMoeV2_5ForCausalLM" in other.read_text()


PERIOD_TABLE = """
name = "t"
description = "t"
architectures = ["BailingMoeV3ForCausalLM"]
[layer_types.layer_group_size_rest]
config = "layer_group_size"
period = "rest"
[layer_types.layer_group_size_last]
config = "layer_group_size"
period = "last"
"""


def test_a_layer_type_is_read_from_a_group_size():
    """``period``: the config's entry is a group size N (Ling 3.0's ``layer_group_size``), layer i of type ``last``
    where (i + 1) % N == 0 (its MLA layers: vLLM 0.33 bailing_moe_v3.py ``_is_kda_layer``, SGLang 0.5.23
    ``is_linear_layer``) and ``rest`` elsewhere (its KDA layers), over the config's ``num_hidden_layers``; a size
    that is no positive integer, or layers not counted, is one line naming the key."""
    from kimi_convert.errors import ConvertError
    from kimi_convert.mapping import parse_mapping

    m = parse_mapping(PERIOD_TABLE, "t.toml")
    kinds = m.layer_kinds({"layer_group_size": 6, "num_hidden_layers": 14})
    assert [i for i, k in sorted(kinds.items()) if k == "layer_group_size_last"] == [5, 11]
    assert [i for i, k in sorted(kinds.items()) if k == "layer_group_size_rest"] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10,
                                                                                     12, 13]
    for bad in (0, "6", [6]):
        with pytest.raises(ConvertError, match=r"^config.json: layer_group_size must be a positive integer"):
            m.layer_kinds({"layer_group_size": bad, "num_hidden_layers": 14})
    with pytest.raises(ConvertError, match=r"^config.json: num_hidden_layers must be an integer"):
        m.layer_kinds({"layer_group_size": 6})
    with pytest.raises(ConvertError, match="period"):
        parse_mapping(PERIOD_TABLE.replace('period = "rest"', 'period = "first"'), "t.toml")


def test_the_derivation_finds_the_kda_groups_layer_type_from_the_group_size():
    """The shipped table scopes the KDA groups (vLLM's qkvb_proj, SGLang's fused_qkvbfg_proj) to every layer but
    each layer_group_size-th, as both engines build them: the MLA layer's q_proj, a name KDA's q_proj shares, is
    then no member of a KDA group (before the ``period`` layer type, pack stopped: "module
    model.layers.5.attention.qkvb_proj: fused group is missing k_proj, v_proj, b_proj (has q_proj)")."""
    from kimi_convert.derive.table import _layer_types

    table = tomllib.loads((ROOT / "mappings" / "derived" / "bailing_moe_v3.toml").read_text())
    assert table["layer_types"] == {"layer_group_size_rest": {"config": "layer_group_size", "period": "rest"}}
    kda = {g["name"] for g in table["group"] if g.get("layer_type") == "layer_group_size_rest"}
    assert kda == {"qkvb_proj", "fused_qkvbfg_proj"}
    group = {"name": "g", "members": ["q_proj", "k_proj"], "parents": ["model.layers.{layer}.attention"],
             "_layers": [0, 1, 2, 3, 4, 6, 7]}
    mods = {f"model.layers.{i}.attention.{p}" for i in range(8) for p in ("q_proj", "k_proj") if i != 5}
    mods.add("model.layers.5.attention.q_proj")  # the MLA layer's
    assert _layer_types([group], {"layer_group_size": 6, "num_hidden_layers": 8}, mods) == {
        "layer_group_size_rest": {"config": "layer_group_size", "period": "rest"}}
    assert group["layer_type"] == "layer_group_size_rest"
