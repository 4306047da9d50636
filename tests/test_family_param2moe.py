"""Param-2 MoE (Param2MoEForCausalLM, BharatGen's bharatgenai/Param2-17B-A2.4B-Thinking) without an engine: the
tests' preset is laid out as the release (config.json with the release's keys, its auto_map and the remote config
class it names, the names vLLM's loader consumes, every tensor BF16 but the router bias, tied embeddings: no lm_head).
SGLang 0.5.23 does not register the architecture: vLLM is its one engine.

The expected names are written here by hand from vLLM 0.33 model_executor/models/param2moe.py, not produced by the code
under test: Param2MoEModel.hf_to_vllm_mapper (model.word_embeddings -> embed_tokens; attention.query_key_value ->
self_attn.qkv_proj, loaded whole into QKVParallelLinear; attention.dense -> o_proj; attention.query_layernorm /
key_layernorm -> q_layernorm / k_layernorm; mlp.gate.expert_bias -> mlp.gate.e_score_correction_bias; mlp.gate_proj /
up_proj and shared_experts.gate_proj / up_proj stacked into gate_up_proj), Param2MoEDecoderLayer (a Param2MoEMLP below
first_k_dense_replace, else a Param2MoEMoEBlock: GateLinear mlp.gate with e_score_correction_bias, Param2MoEMLP
mlp.shared_experts moe_shared_expert_intermediate_size wide, FusedMoEFactory mlp.experts loaded per expert by
RoutedExperts.load_weights: mlp.experts.N.gate_proj / up_proj / down_proj), model.norm, and lm_head tied to
embed_tokens (tie_word_embeddings). Public evidence for the layout: docs/families.md ("Param-2 MoE").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import (
    config_keys_read,
    engine_file_or_skip,
    plan_kinds,
    read_tensors,
    weight_map,
    write_synth,
)

REPO = Path(__file__).resolve().parent.parent

# bharatgenai/Param2-17B-A2.4B-Thinking config.json, as BharatGen's converter writes it (Bharatgen-Tech/nemo_to_hf
# nemo2hf.py gen_config, its model.yaml and tokenizer): the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["Param2MoEForCausalLM"], "model_type": "param2moe",
    "auto_map": {"AutoConfig": "configuration_param2moe.Param2MoEConfig",
                 "AutoModel": "modeling_param2moe.Param2MoEModel",
                 "AutoModelForCausalLM": "modeling_param2moe.Param2MoEForCausalLM"},
    "attention_dropout": 0.0, "eos_token_id": 3, "pad_token_id": 0, "first_k_dense_replace": 1, "hidden_act": "silu",
    "max_position_embeddings": 32768, "norm_topk_prob": True, "rope_theta": 500000, "rope_scaling": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.52.3", "use_bias": False,
    "use_rmsnorm": True, "rms_norm_eps": 1e-06, "num_shared_experts": 2, "use_cache": True, "use_qkv_bias": False,
    "embedding_dropout": 0.0, "output_dropout": 0.0, "partial_rotary_factor": 1.0, "router_dtype": "fp32",
    "moe_router_enable_expert_bias": True, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
    "use_qk_norm": True, "score_function": "sigmoid",
}

ATTN = {"input_layernorm.weight", "post_attention_layernorm.weight", "attention.query_key_value.weight",
        "attention.query_layernorm.weight", "attention.key_layernorm.weight", "attention.dense.weight"}
DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
SHARED = {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
          "mlp.shared_experts.down_proj.weight"}


def moe(experts: int) -> set[str]:
    return ({"mlp.gate.weight", "mlp.gate.expert_bias"} | SHARED
            | {f"mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-param2moe", tmp_path_factory.mktemp("param2moe") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 2 and cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["head_dim"] == cfg["hidden_size"] // cfg["num_attention_heads"] == 64  # as the release's 2048 / 32
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA (8 of 32 in the release)
    # the release's width of its two shared experts: moe_intermediate_size * num_shared_experts (2048 * 2 = 4096)
    assert cfg["moe_shared_expert_intermediate_size"] == cfg["moe_intermediate_size"] * cfg["num_shared_experts"]
    # Bailing / Sarvam key names (num_experts, num_shared_experts), none of DeepSeek's or transformers 5.25's; no MTP
    assert not {"n_routed_experts", "n_shared_experts", "num_nextn_predict_layers", "quantization_config",
                "rope_parameters"} & set(cfg)
    assert (tiny / "configuration_param2moe.py").is_file()  # the class auto_map names, shipped alongside
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == cfg["eos_token_id"]


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.word_embeddings.weight", "model.norm.weight"}  # no lm_head: tied to the embeddings
    want |= {f"model.layers.0.{n}" for n in ATTN | DENSE}
    want |= {f"model.layers.1.{n}" for n in ATTN | moe(8)}
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, kv = 256, 64, 4, 2
    pre = "model.layers.1.attention"
    assert t[f"{pre}.query_key_value.weight"].shape == ((heads + 2 * kv) * hd, h)  # [Q | K | V]
    assert t[f"{pre}.dense.weight"].shape == (h, heads * hd)
    assert t[f"{pre}.query_layernorm.weight"].shape == (hd,) == t[f"{pre}.key_layernorm.weight"].shape
    assert t["model.word_embeddings.weight"].shape == (1000, h)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (768, h)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.experts.7.up_proj.weight"].shape == (128, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (2 * 128, h)  # two shared experts
    assert t["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (h, 2 * 128)
    # Megatron's router bias is a float32 buffer; every other tensor BF16 (the router weight too)
    assert t["model.layers.1.mlp.gate.expert_bias"].dtype == torch.float32
    assert {v.dtype for n, v in t.items() if not n.endswith("expert_bias")} == {torch.bfloat16}


def _vllm() -> str:
    path = engine_file_or_skip("vllm", "model_executor/models/param2moe.py")
    return path.read_text()


def test_vllm_maps_every_stored_name():
    """Each stored name the mapper renames, spelled as the release stores it (Param2MoEModel.hf_to_vllm_mapper)."""
    text = _vllm()
    mapper = text.split("hf_to_vllm_mapper = WeightsMapper(", 1)[1].split("def __init__", 1)[0]
    for old, new in ((r"word_embeddings\.", r"embed_tokens\."),
                     (r"\.attention\.query_key_value\.", r"\.self_attn\.qkv_proj\."),
                     (r"\.attention\.dense\.", r"\.self_attn\.o_proj\."),
                     (r"\.attention\.query_layernorm\.", r"\.self_attn\.q_layernorm\."),
                     (r"\.attention\.key_layernorm\.", r"\.self_attn\.k_layernorm\."),
                     (r"\.mlp\.gate\.expert_bias", r"\.mlp\.gate\.e_score_correction_bias")):
        assert re.search(rf'"{old}":\s*"{new}"', mapper), old
    assert '".shared_experts.gate_proj": (".shared_experts.gate_up_proj", 0)' in mapper
    assert '".mlp.up_proj": (".mlp.gate_up_proj", 1)' in mapper


def test_vllm_ties_lm_head_and_wants_the_router_bias():
    text = _vllm()
    assert "self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)" in text
    assert 'if getattr(config, "moe_router_enable_expert_bias", True):' in text
    assert "self.gate.e_score_correction_bias = nn.Parameter(" in text


# not config.json keys: what transformers' PretrainedConfig gives every config
DERIVED = {"rope_parameters", "architectures", "get_text_config", "to_dict"}


def test_config_holds_every_key_the_engine_reads(tiny):
    """Each ``config.X`` vLLM's param2moe.py reads directly (no getattr default, no hasattr guard) is in config.json;
    so is each key it reads with a getattr default (the release sets them all: none falls back)."""
    cfg = json.loads((tiny / "config.json").read_text())
    text = _vllm()
    read = config_keys_read(text)
    assert {"num_experts", "moe_intermediate_size", "num_key_value_heads", "head_dim", "rope_theta"} <= read
    assert sorted(k for k in read - DERIVED if k not in cfg) == []
    defaulted = set(re.findall(r'getattr\(\s*config,\s*"(\w+)"', text))
    assert {"first_k_dense_replace", "num_shared_experts", "routed_scaling_factor", "score_function"} <= defaulted
    assert sorted(defaulted - set(cfg)) == []


def test_sglang_does_not_register_it():
    """SGLang 0.5.23 has no Param-2 MoE model (its row has one engine)."""
    models = engine_file_or_skip("sglang", "srt/models/deepseek_v2.py")
    assert not [p for p in models.parent.glob("*.py") if "Param2MoE" in p.read_text(errors="ignore")]


def test_plan_with_the_shipped_table(tiny):
    """Where a derived table ships for "param2moe", plan resolves every module of the release's layout with it: the
    fused query_key_value, the attention output, the dense MLP, the shared experts and each routed expert NVFP4; the
    router kept."""
    if not (REPO / "mappings" / "derived" / "param2moe.toml").is_file():
        pytest.skip("no derived table ships for param2moe (docs/derived-architectures.md: its row)")
    from kimi_convert.plan import KEEP, NVFP4

    kinds = plan_kinds(tiny)
    for i in (0, 1):
        assert kinds[f"model.layers.{i}.attention.query_key_value"] == NVFP4
        assert kinds[f"model.layers.{i}.attention.dense"] == NVFP4
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert kinds[f"model.layers.0.mlp.{p}"] == NVFP4
        assert kinds[f"model.layers.1.mlp.shared_experts.{p}"] == NVFP4
    experts = {n: k for n, k in kinds.items() if n.startswith("model.layers.1.mlp.experts.")}
    assert len(experts) == 8 * 3 and set(experts.values()) == {NVFP4}
    assert kinds["model.layers.1.mlp.gate"] == KEEP
    assert "lm_head" not in kinds  # tied: nothing stored
