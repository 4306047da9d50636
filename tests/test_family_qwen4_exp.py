"""Qwen3.8-Flash-Next without an engine: the tiny preset is laid out as the release (Qwen3.5's nested layout with
hyper-connections in place of the layer norms, the QSA indexer on full-attention layers, the PLE n-gram table
in row blocks, the MTP head), and ``inspect`` reads its MoE values.

The expected values are the release's own (docs/families.md, "Qwen3.8-Flash-Next", cites them), written here by
hand, not produced by the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import read_tensors, run, weight_map, write_synth

# Qwen/Qwen3.8-Flash-Next's text_config: the values that are not sizes
RELEASE_TEXT = {
    "model_type": "qwen4_exp_text", "hc_count": 4, "head_dim": 256, "full_attention_interval": 4,
    "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048, "indexer_compress_ratio": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "ple_layer_ids": [2],
    "ple_conv_kernel_size": 4, "ngram_size": 3, "make_ngram_vocab_size_divisible_by": 128, "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False, "output_gate_type": "sigmoid", "eos_token_id": 248044,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "max_position_embeddings": 262144,
    "partial_rotary_factor": 0.25, "mamba_ssm_dtype": "float32",
}
HYPER = {f"{b}_hyper_connection.{p}.weight" for b in ("attn", "mlp")
         for p in ("hc_norm", "input_mix_weight_down", "input_mix_weight_up", "block_inject_weight")}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_synth("tiny-qwen4-exp", tmp_path_factory.mktemp("qwen4-exp") / "q4")


def test_config_is_the_releases(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen4ExpForConditionalGeneration"] and cfg["model_type"] == "qwen4_exp"
    text = cfg["text_config"]
    assert {k: text[k] for k in RELEASE_TEXT} == RELEASE_TEXT
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["ple_embed_dim"] == text["hidden_size"]
    assert cfg["vision_config"]["deepstack_visual_indexes"] == []  # vLLM reads it


def test_tensors_are_the_releases(ckpt):
    names = set(weight_map(ckpt))
    lm = "model.language_model"
    layer = lambda i: {n[len(f"{lm}.layers.{i}."):] for n in names if n.startswith(f"{lm}.layers.{i}.")}  # noqa: E731
    assert layer(0) >= HYPER and layer(3) >= HYPER  # hyper-connections in place of the layer norms:
    assert not {"input_layernorm.weight", "post_attention_layernorm.weight"} & (layer(0) | layer(3))
    assert {"self_attn.indexer.index_qk_proj.weight", "self_attn.indexer.q_layernorm.weight",
            "self_attn.indexer.k_layernorm.weight"} <= layer(3)
    ple = {n for n in layer(1) if n.startswith("ple.")}
    table = "ple.ple_embedding.ngram_embedding"
    assert ple == {f"{table}.shard_0.weight", f"{table}.shard_1.weight", "ple.key_proj.weight",
                   "ple.value_proj.weight", "ple.norm_key.weight", "ple.norm_query.weight", "ple.norm_conv.weight",
                   "ple.conv1d.weight"}
    assert not any(n.startswith("ple.") for n in layer(0) | layer(2))  # ple_layer_ids [2]: layer 1 only
    assert {f"{lm}.hyper_connection_mixer.{p}.weight" for p in ("hc_norm", "input_mix_weight_down",
                                                                "input_mix_weight_up")} <= names
    assert {"mtp.fc_embedding.weight", "mtp.fc_hidden.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.layers.0.self_attn.indexer.index_qk_proj.weight"} <= names
    shard = read_tensors(ckpt)[f"{lm}.layers.1.{table}.shard_0.weight"]
    # 4 heads (ngram 3, 2 a gram) of primes 5 + 7 + 11 + 13 = 36, padded to 128 rows; 2 blocks; 256 / 4 wide
    assert list(shard.shape) == [64, 64]


def test_inspect_gives_the_moe_values(ckpt):
    r = run("inspect", ckpt, "--json")
    assert r.code == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["num_experts"], d["top_k"], d["moe_intermediate_size"], d["hidden_size"]) == (8, 2, 128, 256)
    assert d["layer_kinds"] == {"linear_attention": [0, 1, 2], "full_attention": [3]}
    assert d["moe_layers"] == [0, 1, 2, 3]


#: Qwen/Qwen3.8-Flash-Next's text_config, its MoE and layer keys (docs/families.md, "Qwen3.8-Flash-Next")
RELEASE_MOE = {"model_type": "qwen4_exp_text", "hidden_size": 2560, "num_hidden_layers": 48,
               "full_attention_interval": 4, "num_experts": 512, "num_experts_per_tok": 10,
               "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640,
               "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]}


def test_inspect_gives_the_releases_moe_values_without_weights(tmp_path):
    """vLLM's benchmark_moe.py (71acd375) has no Qwen4Exp branch and its default one reads num_local_experts, which
    Qwen4ExpTextConfig lacks; inspect reads the experts as for Qwen3.5 (num_experts, moe_intermediate_size) from
    the nested text_config: the release's 512 experts of 640, top-10, hidden 2560, every layer MoE."""
    cfg = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
           "text_config": RELEASE_MOE}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run("inspect", tmp_path)
    assert r.code == 0, r.stderr
    assert "benchmark_moe    E=512 topk=10 moe_intermediate_size=640 hidden_size=2560" in r.stdout, r.stdout
    d = json.loads(run("inspect", tmp_path, "--json").stdout)
    assert d["moe_layers"] == list(range(48))
    assert d["layer_kinds"]["full_attention"] == list(range(3, 48, 4))  # every fourth layer


REPO = Path(__file__).resolve().parent.parent


def test_the_derived_table_holds_what_the_exploration_table_needed_by_hand():
    """The table the recorded answers of vLLM 0.33.0 / SGLang 0.5.23 give (``mapping derive tiny-qwen4-exp
    --answers``; the shipped mappings/derived/qwen4_exp.toml: tests/test_derive.py) holds what the exploration table
    needed by hand."""
    from kimi_convert.derive import from_views, load_answers, load_draft_answers

    answers = REPO / "tests" / "derived" / "tiny-qwen4-exp.answers.json"
    d = from_views(*load_answers(answers), load_draft_answers(answers))
    t = d.table
    keep = {k["pattern"]: k["reason"] for k in t["keep"]}
    lm = "model.language_model"
    # vLLM builds the QSA qkv_proj (q, k, v and indexer.index_qk_proj) and the hyper-connections unquantized
    for p in ("q_proj", "k_proj", "v_proj", "indexer.index_qk_proj"):
        assert "Qwen4ExpQSAQKVIndexerLinear with UnquantizedLinearMethod" in keep[f"{lm}.layers.*.self_attn.{p}"]
    for hc in ("attn", "mlp"):
        for p in ("input_mix_weight_down", "input_mix_weight_up", "block_inject_weight"):
            assert "hyperconnection.py GatedResidual" in keep[f"{lm}.layers.*.{hc}_hyper_connection.{p}"]
    # the n-gram table's row blocks: one embedding, however many blocks the release has (split_ngram_parts 128)
    assert f"{lm}.layers.*.ple.ple_embedding.ngram_embedding.*" in t["not_linear"]
    assert not any(g["name"] == "ngram_embedding" for g in t["group"])
    # the vision tower, every block of it (the release has 27)
    assert "model.visual.blocks.*.attn.qkv" in keep
    kv = next(g for g in t["group"] if g["name"] == "kv_proj")
    assert kv["members"] == ["key_proj", "value_proj"] and kv["engines"] == ["vllm"]


def test_the_default_plan_keeps_what_the_engines_build_unquantized(ckpt):
    r = run("plan", ckpt, "--json")
    assert r.code == 0, r.stderr
    mods = {m["name"]: m for m in json.loads(r.stdout)["modules"]}
    lm = "model.language_model.layers"
    for p in ("q_proj", "k_proj", "v_proj", "indexer.index_qk_proj"):
        assert mods[f"{lm}.3.self_attn.{p}"]["kind"] == "keep", p
    assert mods[f"{lm}.3.self_attn.o_proj"]["kind"] == "nvfp4"
    assert mods[f"{lm}.0.attn_hyper_connection.block_inject_weight"]["kind"] == "keep"
    assert mods[f"{lm}.1.ple.ple_embedding.ngram_embedding.shard_1.weight"]["kind"] == "copy"  # not linear
    assert {mods[f"{lm}.1.ple.{p}"]["kind"] for p in ("key_proj", "value_proj")} == {"nvfp4"}
    assert mods[f"{lm}.0.linear_attn.in_proj_qkv"]["kind"] == "nvfp4"
