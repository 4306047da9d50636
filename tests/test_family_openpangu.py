"""openPangu-Ultra-MoE-718B (PanguUltraMoEForCausalLM) and openPangu Pro MoE V2 / openPangu-R-72B-2512
(PanguProMoEV2ForCausalLM) without an engine: the tests' presets are laid out as the releases as vLLM 0.33 serves them
(config.json with the keys vLLM's openpangu.py reads and the release's remote config class, the names vLLM's loader
consumes, BF16 but Pro V2's F32 router bias). SGLang 0.5.23 registers neither.

The expected names are written here by hand from the engine's loaders, not produced by the code under test:
- both: vLLM 0.33 openpangu.py OpenPanguModel.load_weights (AutoWeightsLoader with a WeightsMapper: ".mlp.gate_proj" /
  ".mlp.up_proj" / ".shared_experts.gate_proj" / ".shared_experts.up_proj" stacked into gate_up_proj,
  "e_score_correction_bias" renamed to "gate.e_score_correction_bias", ".q_a_proj" / ".kv_a_proj_with_mqa" stacked
  into fused_qkv_a_proj where that parameter exists), OpenPanguDecoderLayer (sandwich_norm: pre_mlp_layernorm,
  post_mlp_layernorm), OpenPanguMoE (gate, experts, shared_experts of moe_intermediate_size x n_shared_experts);
- Ultra: OpenPanguMLAAttention with a q_lora_rank (q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj, o_proj), no router bias (no router_enable_expert_bias), the MTP layer read by
  openpangu_mtp.py OpenPanguMTP.load_weights (_rewrite_spec_layer_name: embed_tokens, enorm, hnorm, eh_proj,
  shared_head; the rest as its mtp_block);
- Pro V2: OpenPanguSinkAttention (param_sink_number > 0: qkv_proj one MergedColumnParallelLinear of the q, k and v
  widths, k_layernorm of nope + rope, param_sink_key, param_sink_value with param_sink_with_value, o_proj).
Public evidence for the layouts: docs/families.md ("openPangu").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, weight_map, write_synth

# openPangu-Ultra-MoE-718B config.json as vLLM reads it: the values that are not sizes (sizes: the preset's)
RELEASE_ULTRA = {
    "architectures": ["PanguUltraMoEForCausalLM"], "model_type": "pangu_ultra_moe",
    "auto_map": {"AutoConfig": "configuration_openpangu_moe.PanguUltraMoEConfig",
                 "AutoModel": "modeling_openpangu_moe.PanguUltraMoEModel",
                 "AutoModelForCausalLM": "modeling_openpangu_moe.PanguUltraMoEForCausalLM"},
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_shared_experts": 1,
    "num_nextn_predict_layers": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "sandwich_norm": True,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 25600000, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
}

# openPangu-R-72B-2512 config.json: the values that are not sizes
RELEASE_PRO_V2 = {
    "architectures": ["PanguProMoEV2ForCausalLM"], "model_type": "PanguProMoE",
    "auto_map": {"AutoConfig": "configuration_pangu_moe.PanguProMoEConfig",
                 "AutoModel": "modeling_pangu_moe.PanguProMoEModel",
                 "AutoModelForCausalLM": "modeling_pangu_moe.PanguProMoEForCausalLM"},
    "qk_nope_dim": 128, "qk_rope_dim": 64, "v_channels": 128, "param_sink_number": 128,
    "param_sink_with_value": True, "n_shared_experts": 2, "router_enable_expert_bias": True,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "sandwich_norm": True, "hidden_act": "silu",
    "tie_word_embeddings": False, "eos_token_id": 45892,
}

SANDWICH = {"input_layernorm.weight", "post_attention_layernorm.weight", "pre_mlp_layernorm.weight",
            "post_mlp_layernorm.weight"}
MLA = SANDWICH | {f"self_attn.{p}.weight" for p in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                     "kv_a_layernorm", "kv_b_proj", "o_proj")}
SINK = SANDWICH | {"self_attn.qkv_proj.weight", "self_attn.k_layernorm.weight", "self_attn.param_sink_key",
                   "self_attn.param_sink_value", "self_attn.o_proj.weight"}
DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
SHARED = {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
          "mlp.shared_experts.down_proj.weight"}
MTP = {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
       "shared_head.head.weight"}


def moe(experts: int) -> set[str]:
    return {"mlp.gate.weight"} | SHARED | {f"mlp.experts.{e}.{p}_proj.weight" for e in range(experts)
                                          for p in ("gate", "up", "down")}


@pytest.fixture(scope="module")
def tiny_ultra(tmp_path_factory) -> Path:
    return write_synth("tiny-openpangu-ultra-moe", tmp_path_factory.mktemp("openpangu-ultra") / "src")


@pytest.fixture(scope="module")
def tiny_pro(tmp_path_factory) -> Path:
    return write_synth("tiny-openpangu-pro-moe-v2", tmp_path_factory.mktemp("openpangu-pro-v2") / "src")


def test_config_is_the_releases(tiny_ultra, tiny_pro):
    cfg = json.loads((tiny_ultra / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE_ULTRA} == RELEASE_ULTRA
    assert cfg["num_hidden_layers"] == 2 and cfg["n_routed_experts"] == 8 and cfg["first_k_dense_replace"] == 1
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    # no router bias: vLLM's OpenPanguMoE makes gate.e_score_correction_bias only with router_enable_expert_bias
    assert "router_enable_expert_bias" not in cfg
    assert (tiny_ultra / "configuration_openpangu_moe.py").is_file()  # the class auto_map names, shipped alongside
    cfg = json.loads((tiny_pro / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE_PRO_V2} == RELEASE_PRO_V2
    assert cfg["num_hidden_layers"] == 2 and cfg["n_routed_experts"] == 8
    # a GQA model with a sink: none of the MLA keys that would turn vLLM's OpenPanguDecoderLayer to MLA (use_mla)
    assert not {"qk_nope_head_dim", "kv_lora_rank", "q_lora_rank", "num_nextn_predict_layers"} & set(cfg)
    assert (tiny_pro / "configuration_pangu_moe.py").is_file()


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny_ultra, tiny_pro):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in MLA | DENSE}
    want |= {f"model.layers.1.{n}" for n in MLA | moe(8)}
    want |= {f"model.layers.2.{n}" for n in MLA | moe(8) | MTP}  # the MTP layer: a MoE decoder layer and its parts
    assert set(weight_map(tiny_ultra)) == want
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in SINK | DENSE}
    want |= {f"model.layers.1.{n}" for n in SINK | moe(8) | {"mlp.e_score_correction_bias"}}
    assert set(weight_map(tiny_pro)) == want


def test_shapes_and_dtypes_are_the_releases(tiny_ultra, tiny_pro):
    import torch

    t = read_tensors(tiny_ultra)
    h, heads, nope, rope, v, q_rank, kv_rank = 256, 2, 128, 64, 128, 128, 128
    assert t["model.layers.0.self_attn.q_a_proj.weight"].shape == (q_rank, h)
    assert t["model.layers.0.self_attn.q_a_layernorm.weight"].shape == (q_rank,)
    assert t["model.layers.0.self_attn.q_b_proj.weight"].shape == (heads * (nope + rope), q_rank)
    assert t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (kv_rank + rope, h)
    assert t["model.layers.0.self_attn.kv_b_proj.weight"].shape == (heads * (nope + v), kv_rank)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (h, heads * v)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (768, h)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (128, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.2.eh_proj.weight"].shape == (h, 2 * h)
    assert t["model.layers.2.shared_head.head.weight"].shape == (1000, h)
    assert {x.dtype for x in t.values()} == {torch.bfloat16}

    t = read_tensors(tiny_pro)
    heads, kv, sinks = 4, 2, 128
    assert t["model.layers.0.self_attn.qkv_proj.weight"].shape == ((heads + kv) * (nope + rope) + kv * v, h)
    assert t["model.layers.0.self_attn.k_layernorm.weight"].shape == (nope + rope,)
    assert t["model.layers.0.self_attn.param_sink_key"].shape == (sinks, kv, nope + rope)
    assert t["model.layers.0.self_attn.param_sink_value"].shape == (sinks, kv, v)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (h, heads * v)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (2 * 128, h)  # n_shared_experts 2
    assert t["model.layers.1.mlp.e_score_correction_bias"].shape == (8,)
    assert t["model.layers.1.mlp.e_score_correction_bias"].dtype == torch.float32  # vLLM's own F32 parameter
    assert {x.dtype for k, x in t.items() if not k.endswith("e_score_correction_bias")} == {torch.bfloat16}


# not config.json keys: attributes transformers' PretrainedConfig gives every config
DERIVED = {"rope_parameters"}
# read only where getattr(config, "is_causal", True) already said False (OpenPanguDecoderLayer's error message)
GUARDED = {"is_causal"}
FILES = ["model_executor/models/openpangu.py", "model_executor/models/openpangu_mtp.py"]


@pytest.mark.parametrize("rel", FILES)
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny_ultra, tiny_pro, rel):
    """Each ``config.X`` vLLM's openPangu model files read directly (no getattr default, no hasattr guard) is in
    both presets' config.json (the MTP file builds only Ultra's draft, whose keys Pro V2 also holds)."""
    path = engine_file_or_skip("vllm", rel)
    read = config_keys_read(path.read_text())
    assert {"n_routed_experts", "hidden_size"} <= read  # the reading found the file's keys
    for src in (tiny_ultra, tiny_pro):
        cfg = json.loads((src / "config.json").read_text())
        assert sorted(k for k in read - DERIVED - GUARDED if k not in cfg) == []
