"""Sarvam 30B (SarvamMoEForCausalLM) and Sarvam 105B (SarvamMLAForCausalLM) without an engine: the tests' presets are
laid out as the releases (config.json with the release's keys and its remote config class, the names both engines'
loaders consume, BF16 but the router's F32 bias).

The expected names are written here by hand from the engines' loaders, not produced by the code under test:
- sarvam-30b: vLLM 0.33 sarvam.py SarvamMoEForCausalLM (a BailingMoeForCausalLM: bailing_moe.py BailingMoeModel with
  AutoWeightsLoader and hf_to_vllm_mapper), SGLang 0.5.23 sarvam_moe.py SarvamMoEForCausalLM (a
  BailingMoEForCausalLM: bailing_moe.py load_weights);
- sarvam-105b: vLLM 0.33 sarvam.py SarvamMLAForCausalLM / SarvamMLAModel (AutoWeightsLoader, hf_to_vllm_mapper,
  SarvamMLAAttention with q_lora_rank None, SarvamMLAMoE's gate.e_score_correction_bias), SGLang 0.5.23 sarvam_moe.py
  SarvamMLAForCausalLM.load_weights (stacked / expert mappings, ".mlp.gate.e_score_correction_bias" renamed to its
  ".mlp.e_score_correction_bias").
Public evidence for the layouts: docs/families.md ("Sarvam").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, weight_map, write_synth

# sarvamai/sarvam-30b config.json: the values that are not sizes (sizes: the preset's)
RELEASE_MOE = {
    "architectures": ["SarvamMoEForCausalLM"], "model_type": "sarvam_moe",
    "auto_map": {"AutoConfig": "configuration_sarvam_moe.SarvamMoEConfig",
                 "AutoModel": "modeling_sarvam_moe.SarvamMoEModel",
                 "AutoModelForCausalLM": "modeling_sarvam_moe.SarvamMoEForCausalLM"},
    "first_k_dense_replace": 1, "head_dim": 64, "use_qk_norm": True, "use_rmsnorm": True, "use_bias": False,
    "use_qkv_bias": False, "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "tie_word_embeddings": False, "rope_theta": 8000000.0, "rope_scaling": None, "hidden_act": "silu",
}

# sarvamai/sarvam-105b config.json: the values that are not sizes
RELEASE_MLA = {
    "architectures": ["SarvamMLAForCausalLM"], "model_type": "sarvam_mla",
    "auto_map": {"AutoConfig": "configuration_sarvam_moe.SarvamMLAConfig",
                 "AutoModel": "modeling_sarvam_moe.SarvamMLAModel",
                 "AutoModelForCausalLM": "modeling_sarvam_moe.SarvamMLAForCausalLM"},
    "first_k_dense_replace": 1, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "moe_router_enable_expert_bias": True, "routed_scaling_factor": 2.5, "num_shared_experts": 1,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "rope_type": "deepseek_yarn"},
}

MOE_ATTN = {"input_layernorm.weight", "attention.query_key_value.weight", "attention.query_layernorm.weight",
            "attention.key_layernorm.weight", "attention.dense.weight", "post_attention_layernorm.weight"}
MLA_ATTN = {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
            "post_attention_layernorm.weight"}
DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
SHARED = {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
          "mlp.shared_experts.down_proj.weight"}


def moe(experts: int, bias: str) -> set[str]:
    return ({"mlp.gate.weight", f"mlp.gate.{bias}"} | SHARED
            | {f"mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return write_synth("tiny-sarvam-moe", tmp_path_factory.mktemp("sarvam") / "src")


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory) -> Path:
    return write_synth("tiny-sarvam-mla", tmp_path_factory.mktemp("sarvam-mla") / "src")


def test_config_is_the_releases(tiny_moe, tiny_mla):
    cfg = json.loads((tiny_moe / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE_MOE} == RELEASE_MOE
    assert cfg["num_hidden_layers"] == 2 and cfg["num_experts"] == 8 and cfg["max_window_layers"] == 2
    assert (tiny_moe / "configuration_sarvam_moe.py").is_file()  # the class auto_map names, shipped alongside
    cfg = json.loads((tiny_mla / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE_MLA} == RELEASE_MLA
    assert cfg["num_hidden_layers"] == 2 and cfg["num_experts"] == 8
    # no query LoRA and no grouped routing keys in the release's config (both engines default n_group / topk_group)
    assert not {"q_lora_rank", "n_group", "topk_group", "moe_shared_expert_intermediate_size"} & set(cfg)
    assert (tiny_mla / "configuration_sarvam_moe.py").is_file()


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny_moe, tiny_mla):
    want = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in MOE_ATTN | DENSE}
    want |= {f"model.layers.1.{n}" for n in MOE_ATTN | moe(8, "expert_bias")}
    assert set(weight_map(tiny_moe)) == want
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in MLA_ATTN | DENSE}
    want |= {f"model.layers.1.{n}" for n in MLA_ATTN | moe(8, "e_score_correction_bias")}
    assert set(weight_map(tiny_mla)) == want


def test_shapes_and_dtypes_are_the_releases(tiny_moe, tiny_mla):
    import torch

    t = read_tensors(tiny_moe)
    h, hd, heads, kv = 256, 64, 4, 2
    assert t["model.layers.0.attention.query_key_value.weight"].shape == ((heads + 2 * kv) * hd, h)
    assert t["model.layers.0.attention.dense.weight"].shape == (h, heads * hd)
    assert t["model.layers.0.attention.query_layernorm.weight"].shape == (hd,)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (768, h)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (128, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.1.mlp.gate.expert_bias"].dtype == torch.float32  # the engines' own F32 parameter
    assert {v.dtype for k, v in t.items() if not k.endswith("expert_bias")} == {torch.bfloat16}

    t = read_tensors(tiny_mla)
    heads, nope, rope, v, rank = 2, 128, 64, 128, 128
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (heads * (nope + rope), h)
    assert t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (rank + rope, h)
    assert t["model.layers.0.self_attn.kv_a_layernorm.weight"].shape == (rank,)
    assert t["model.layers.0.self_attn.kv_b_proj.weight"].shape == (heads * (nope + v), rank)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (h, heads * v)
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (128, h)
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert {v.dtype for k, v in t.items() if not k.endswith("e_score_correction_bias")} == {torch.bfloat16}


# not config.json keys: methods and attributes transformers' PretrainedConfig gives every config
DERIVED = {"get_text_config", "rope_parameters", "to_dict", "architectures"}
# the Ming multimodal config's keys SGLang's bailing_moe.py also reads (image / audio gates): not the text release's
MING = {"image_patch_token", "audio_patch_token", "image_start_token", "video_start_token", "audio_start_token",
        "llm_config", "mlp_only_layers", "vision_config"}
FILES = {("sarvam-moe", "vllm"): "model_executor/models/bailing_moe.py",
         ("sarvam-moe", "sglang"): "srt/models/bailing_moe.py",
         ("sarvam-mla", "vllm"): "model_executor/models/sarvam.py",
         ("sarvam-mla", "sglang"): "srt/models/sarvam_moe.py"}


@pytest.mark.parametrize("family, engine", sorted(FILES))
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny_moe, tiny_mla, family, engine):
    """Each ``config.X`` the engine's model file reads directly (no getattr default, no hasattr guard) is in
    config.json (sarvam-30b is read by the engines' Bailing classes, sarvam-105b by their Sarvam MLA classes)."""
    path = engine_file_or_skip(engine, FILES[family, engine])
    cfg = json.loads(((tiny_moe if family == "sarvam-moe" else tiny_mla) / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"num_experts_per_tok", "hidden_size"} <= read  # the reading found the file's keys
    missing = sorted(k for k in read - DERIVED - MING if k not in cfg)
    assert missing == []
