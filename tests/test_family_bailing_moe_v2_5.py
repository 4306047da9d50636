"""Ling 2.5 / Ring 2.5 / Ling 2.6 (BailingMoeV2_5ForCausalLM) without an engine: the tests' preset is laid out as the
release (config.json with the release's keys, model_type bailing_hybrid and its remote config class; Lightning
linear-attention layers and an MLA layer in every group of layer_group_size; the names both engines' loaders consume;
BF16 but the router's F32 expert_bias), and the MTP variant stores the release's MTP layer as model.layers.{N}.

The expected names are written here by hand from the engines' loaders (vLLM 0.33 bailing_moe_linear.py
BailingMoeV25Model.load_weights / normalize_name and bailing_linear_attn.py BailingMoELinearAttention; SGLang 0.5.23
bailing_moe_linear.py BailingMoELinearForCausalLM.load_weights) and the release's modeling code
(modeling_bailing_moe_v2_5.py; docs/families.md, "Ling 2.5 / Ring 2.5"), not produced by the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_family_bailing_moe_v2 import DENSE, moe  # the MLP and MoE parts are Ling 2.0's, name for name

from helpers import config_keys_read, engine_file, read_tensors, weight_map, write_synth

# the release's config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["BailingMoeV2_5ForCausalLM"], "model_type": "bailing_hybrid",
    "auto_map": {"AutoConfig": "configuration_bailing_moe_v2_5.BailingMoeV2_5Config",
                 "AutoModel": "modeling_bailing_moe_v2_5.BailingMoeV2_5Model",
                 "AutoModelForCausalLM": "modeling_bailing_moe_v2_5.BailingMoeV2_5ForCausalLM"},
    "first_k_dense_replace": 1, "layer_group_size": 8, "group_norm_size": 4, "head_dim": 128, "use_qk_norm": True,
    "use_bias": False, "use_qkv_bias": False, "linear_silu": False, "partial_rotary_factor": 0.5,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
    "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "router_dtype": "fp32",
    "routed_scaling_factor": 2.5, "num_shared_experts": 1, "tie_word_embeddings": False,
}

LINEAR = {"attention.query_key_value.weight", "attention.query_layernorm.weight", "attention.key_layernorm.weight",
          "attention.dense.weight", "attention.g_proj.weight", "attention.g_norm.weight"}
MLA = {"attention.q_a_proj.weight", "attention.q_a_layernorm.weight", "attention.q_b_proj.weight",
       "attention.kv_a_proj_with_mqa.weight", "attention.kv_a_layernorm.weight", "attention.kv_b_proj.weight",
       "attention.dense.weight"}
NORMS = {"input_layernorm.weight", "post_attention_layernorm.weight"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-bailing-moe-v2-5", tmp_path_factory.mktemp("ling25") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 8 and cfg["num_experts"] == 8 and cfg["num_nextn_predict_layers"] == 0
    assert cfg["num_hidden_layers"] % cfg["layer_group_size"] == 0  # SGLang's BailingMoELinearModel asserts it
    assert cfg["num_experts"] % cfg["n_group"] == 0 and cfg["topk_group"] <= cfg["n_group"]
    assert cfg["q_lora_rank"] is not None  # the release's MLA has a query LoRA (q_a_proj / q_b_proj)
    # no norm_topk_prob: both engines default it to true (SGLang: "the Ling-2.5/2.6 configs carry no norm_topk_prob")
    assert "norm_topk_prob" not in cfg
    assert (tiny / "configuration_bailing_moe_v2_5.py").is_file()  # the class auto_map names, shipped alongside


def test_layer_kinds_follow_the_engines_rule(tiny):
    """Linear attention where (layer + 1) % layer_group_size != 0 (vLLM / SGLang is_linear_layer), MLA elsewhere."""
    names = set(weight_map(tiny))
    for layer in range(8):
        got = {n.removeprefix(f"model.layers.{layer}.") for n in names if n.startswith(f"model.layers.{layer}.")}
        attn = MLA if (layer + 1) % 8 == 0 else LINEAR
        mlp = DENSE if layer == 0 else moe(8)
        assert got == NORMS | attn | mlp, layer


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    names = set(weight_map(tiny))
    want = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in NORMS | LINEAR | DENSE}
    want |= {f"model.layers.{i}.{n}" for i in range(1, 7) for n in NORMS | LINEAR | moe(8)}
    want |= {f"model.layers.7.{n}" for n in NORMS | MLA | moe(8)}
    assert names == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, q_lora, kv_lora, nope, rope, v = 256, 128, 4, 128, 128, 128, 64, 128
    # linear attention: as many K / V heads as query heads (the engines' QKVParallelLinear(heads, heads))
    assert t["model.layers.0.attention.query_key_value.weight"].shape == (3 * heads * hd, h)
    assert t["model.layers.0.attention.query_layernorm.weight"].shape == (hd,)
    assert t["model.layers.0.attention.g_proj.weight"].shape == (heads * hd, h)
    assert t["model.layers.0.attention.g_norm.weight"].shape == (heads * hd,)
    assert t["model.layers.0.attention.dense.weight"].shape == (h, heads * hd)
    # MLA
    assert t["model.layers.7.attention.q_a_proj.weight"].shape == (q_lora, h)
    assert t["model.layers.7.attention.q_b_proj.weight"].shape == (heads * (nope + rope), q_lora)
    assert t["model.layers.7.attention.kv_a_proj_with_mqa.weight"].shape == (kv_lora + rope, h)
    assert t["model.layers.7.attention.kv_a_layernorm.weight"].shape == (kv_lora,)
    assert t["model.layers.7.attention.kv_b_proj.weight"].shape == (heads * (nope + v), kv_lora)
    assert t["model.layers.7.attention.dense.weight"].shape == (h, heads * v)
    # MoE
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (128, h)
    assert t["model.layers.7.mlp.experts.7.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.1.mlp.gate.expert_bias"].dtype == torch.float32  # the engines' own F32 parameter
    assert {v.dtype for k, v in t.items() if not k.endswith("expert_bias")} == {torch.bfloat16}


def test_the_mtp_variant_stores_the_releases_mtp_layer(tmp_path):
    out = write_synth("tiny-bailing-moe-v2-5-mtp", tmp_path / "src")
    mtp = {n.removeprefix("model.layers.8.") for n in weight_map(out) if n.startswith("model.layers.8.")}
    assert mtp == NORMS | MLA | moe(8) | {"enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"}
    assert read_tensors(out)["model.layers.8.eh_proj.weight"].shape == (256, 512)


ENGINE_FILES = {"vllm": ["vllm/model_executor/models/bailing_moe_linear.py",
                         "vllm/model_executor/layers/mamba/linear/bailing_linear_attn.py",
                         "vllm/model_executor/layers/mamba/linear/base.py"],
                "sglang": ["sglang/srt/models/bailing_moe_linear.py"]}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine):
    """Each ``config.X`` the engine's model files read directly (no getattr default, no hasattr guard) is in
    config.json."""
    paths = [engine_file(engine, rel.split("/", 1)[1]) for rel in ENGINE_FILES[engine]]
    if any(p is None for p in paths):
        pytest.skip(f"no {engine} environment under ~/.cache/kimi-convert/engines")
    cfg = json.loads((tiny / "config.json").read_text())
    text = "\n".join(p.read_text() for p in paths)
    read = config_keys_read(text)
    # not config.json keys: methods and attributes transformers' PretrainedConfig gives every config, and what the
    # engines set on their per-layer copy (layer_config.attention_type)
    derived = {"get_text_config", "rope_parameters", "to_dict", "architectures", "attention_type"}
    # SGLang's file: the quantization config's block size and the EPLB / FP8 block-quant paths (moe_layer_freq)
    sglang_other = {"weight_block_size", "moe_layer_freq"}
    assert {"num_experts", "max_position_embeddings", "hidden_size"} <= read  # the reading found the files' keys
    missing = sorted(k for k in read - derived - sglang_other if k not in cfg)
    assert missing == []
