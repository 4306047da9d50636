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

from helpers import read_tensors, run, weight_map

PRESET = Path(__file__).parent / "presets" / "qwen4_exp.toml"

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
    out = tmp_path_factory.mktemp("qwen4-exp") / "q4"
    r = run("synth", f"{PRESET}:tiny-qwen4-exp", out)
    assert r.code == 0, r.stderr
    return out


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
