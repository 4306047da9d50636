"""DeepSeek-MoE 16B (DeepseekForCausalLM) without an engine: the tests' preset is laid out as the release (config.json
with the release's keys and its remote config class, the names both engines' loaders consume, every tensor BF16).

The expected names are written here by hand from the engines' loaders, not produced by the code under test:
- vLLM 0.33 deepseek_v2.py: DeepseekForCausalLM is a DeepseekV2ForCausalLM; for model_type "deepseek"
  DeepseekV2DecoderLayer takes DeepseekAttention (qkv_proj from the checkpoint's q_proj / k_proj / v_proj:
  DeepseekV2Model.load_weights' mha_params_mapping), gate_up_proj from gate_proj / up_proj, the routed experts through
  fused_moe_make_expert_params_mapping (mlp.experts.N.gate_proj / up_proj / down_proj), DeepseekV2MoE's GateLinear
  mlp.gate.weight (no e_score_correction_bias: topk_method is not "noaux_tc"), mlp.shared_experts (DeepseekV2MLP);
- SGLang 0.5.23 deepseek.py DeepseekForCausalLM.load_weights (stacked q/k/v and gate/up, per-expert DeepseekMLP
  modules mlp.experts.N.*, ReplicatedLinear mlp.gate, DeepseekMLP mlp.shared_experts).
Public evidence for the layout: docs/families.md ("DeepSeek-MoE").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, weight_map, write_synth

# deepseek-ai/deepseek-moe-16b-base config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek",
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekConfig",
                 "AutoModel": "modeling_deepseek.DeepseekModel",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM"},
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_shared_experts": 2, "norm_topk_prob": False,
    "scoring_func": "softmax", "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "rope_theta": 10000, "rope_scaling": None, "max_position_embeddings": 4096, "rms_norm_eps": 1e-06,
    "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
}

ATTN = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight"}
DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
SHARED = {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
          "mlp.shared_experts.down_proj.weight"}


def moe(experts: int) -> set[str]:
    return ({"mlp.gate.weight"} | SHARED
            | {f"mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-deepseek-moe", tmp_path_factory.mktemp("deepseek-moe") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 2 and cfg["n_routed_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"]  # MHA, as released (16 of 16)
    # no MLA keys (vLLM picks DeepseekAttention by model_type "deepseek"), no router-bias method
    assert not {"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "topk_method",
                "num_nextn_predict_layers"} & set(cfg)
    assert (tiny / "configuration_deepseek.py").is_file()  # the class auto_map names, shipped alongside


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in ATTN | DENSE}
    want |= {f"model.layers.1.{n}" for n in ATTN | moe(8)}
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads = 256, 128, 2  # head_dim hidden / heads = 128, as the release's 2048 / 16
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (heads * hd, h)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (heads * hd, h)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (768, h)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.experts.7.up_proj.weight"].shape == (128, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (2 * 128, h)  # two shared experts
    assert t["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (h, 2 * 128)
    assert t["lm_head.weight"].shape == (1000, h)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


def _vllm_deepseek_v1_text(text: str) -> str:
    """The parts of vLLM's deepseek_v2.py a model_type "deepseek" checkpoint runs: everything but the MLA attention
    classes and V3.2's indexer (DeepseekV2DecoderLayer takes DeepseekAttention for it)."""
    cut = re.compile(r"^class (DeepseekV2Attention|DeepseekV32IndexerCache|Indexer|DeepSeekV2FusedQkvAProjLinear|"
                     r"DeepseekV2MLAAttention)\b.*?(?=^class |\Z)", re.S | re.M)
    return cut.sub("", text)


# not config.json keys: methods and attributes transformers' PretrainedConfig gives every config (the release's
# config.json holds no pad_token_id: its DeepseekConfig passes pad_token_id=None to PretrainedConfig)
DERIVED = {"get_text_config", "rope_parameters", "to_dict", "architectures", "pad_token_id"}
FILES = {"vllm": "model_executor/models/deepseek_v2.py", "sglang": "srt/models/deepseek.py"}


@pytest.mark.parametrize("engine", sorted(FILES))
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine):
    """Each ``config.X`` the engine's model file reads directly (no getattr default, no hasattr guard) is in
    config.json (vLLM: the deepseek_v2.py parts a model_type "deepseek" checkpoint runs)."""
    path = engine_file_or_skip(engine, FILES[engine])
    cfg = json.loads((tiny / "config.json").read_text())
    text = path.read_text()
    read = config_keys_read(_vllm_deepseek_v1_text(text) if engine == "vllm" else text)
    assert {"num_experts_per_tok", "hidden_size", "n_routed_experts", "moe_intermediate_size"} <= read
    missing = sorted(k for k in read - DERIVED if k not in cfg)
    assert missing == []
