"""A.X K1 (AXK1ForCausalLM, SK Telecom's skt/A.X-K1) without an engine: the tests' preset is laid out as the release
(config.json with the release's keys, its auto_map included, the names vLLM's loader consumes, every tensor BF16, the
MTP layer after the last decoder layer). SGLang 0.5.23 does not register the architecture: vLLM is its one
engine.

The expected names are written here by hand from vLLM 0.33 model_executor/models/AXK1.py, not produced by the code
under test: AXK1Model (model.embed_tokens, model.norm; make_layers over num_hidden_layers), AXK1DecoderLayer
(input_layernorm, post_attention_layernorm and post_mlp_layernorm on EVERY layer; an AXK1MoE mlp where
_get_mlp_layer_types says "sparse", else an AXK1MLP), AXK1MLAAttention / AXK1Attention (q_a_proj and
kv_a_proj_with_mqa, stacked into fused_qkv_a_proj by AXK1Model.load_weights' mla_params_mapping, q_a_layernorm,
q_b_proj, kv_a_layernorm, kv_b_proj, o_proj), AXK1MoE (GateLinear mlp.gate with e_score_correction_bias for
topk_method "noaux_tc", routed experts through fused_moe_make_expert_params_mapping: mlp.experts.N.gate_proj /
up_proj / down_proj, AXK1MLP mlp.shared_experts moe_intermediate_size * n_shared_experts wide), ParallelLMHead lm_head;
load_weights drops the MTP layer model.layers.{num_hidden_layers}.* (get_spec_layer_idx_from_weight_name).
Public evidence for the layout: docs/families.md ("A.X K1").
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

# skt/A.X-K1 config.json: the values that are not sizes (sizes: the preset's); the release's config class defaults
# (README, the Hub config as read publicly; docs/families.md "A.X K1")
RELEASE = {
    "architectures": ["AXK1ForCausalLM"], "model_type": "axk1",
    "auto_map": {"AutoConfig": "configuration_axk1.AXK1Config", "AutoModel": "modeling_axk1.AXK1Model",
                 "AutoModelForCausalLM": "modeling_axk1.AXK1ForCausalLM"},
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_shared_experts": 1, "norm_topk_prob": True,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0},
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "bos_token_id": 163691, "eos_token_id": 163691,
    "torch_dtype": "bfloat16",
}

ATTN = {"input_layernorm.weight", "post_attention_layernorm.weight", "post_mlp_layernorm.weight",
        "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight"}
DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
SHARED = {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
          "mlp.shared_experts.down_proj.weight"}
# the MTP layer's own parts (DeepSeek V3's layout), beside a full MoE decoder layer
MTP = {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
       "shared_head.head.weight"}


def moe(experts: int) -> set[str]:
    return ({"mlp.gate.weight", "mlp.gate.e_score_correction_bias"} | SHARED
            | {f"mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-axk1", tmp_path_factory.mktemp("axk1") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 2 and cfg["n_routed_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"]  # 64 of 64 in the release (MLA)
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0 and cfg["topk_group"] <= cfg["n_group"]
    assert "mlp_layer_types" not in cfg  # the release's legacy keys: transformers 5.20 derives the list from them
    # the release's configuration_axk1.py is not written: transformers 5.20 registers "axk1" (its AXK1Config, which
    # vLLM's AXK1.py imports, reads this config.json), so no engine step runs its code
    assert not (tiny / "configuration_axk1.py").exists()


def test_transformers_reads_the_layer_types_vllm_builds(tiny):
    """vLLM's _get_mlp_layer_types reads mlp_layer_types where the config has it (transformers 5.20's AXK1Config
    derives it from first_k_dense_replace / moe_layer_freq): a dense layer 0, then MoE."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "AXK1Config"):
        pytest.skip("this transformers has no AXK1Config (5.20 has)")
    cfg = json.loads((tiny / "config.json").read_text())
    c = transformers.AXK1Config(**{k: v for k, v in cfg.items() if k not in ("auto_map", "model_type")})
    assert c.mlp_layer_types == ["dense", "sparse"]
    assert c.num_nextn_predict_layers == 1  # kept as given: vLLM's get_spec_layer_idx_from_weight_name reads it


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in ATTN | DENSE}
    want |= {f"model.layers.1.{n}" for n in ATTN | moe(8)}
    want |= {f"model.layers.2.{n}" for n in ATTN | moe(8) | MTP}  # the MTP layer (num_hidden_layers 2)
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, heads, q_lora, kv_lora, nope, rope, v = 256, 2, 128, 128, 128, 64, 128
    pre = "model.layers.1.self_attn"
    assert t[f"{pre}.q_a_proj.weight"].shape == (q_lora, h)
    assert t[f"{pre}.q_b_proj.weight"].shape == (heads * (nope + rope), q_lora)
    assert t[f"{pre}.kv_a_proj_with_mqa.weight"].shape == (kv_lora + rope, h)
    assert t[f"{pre}.kv_b_proj.weight"].shape == (heads * (nope + v), kv_lora)
    assert t[f"{pre}.o_proj.weight"].shape == (h, heads * v)
    assert t["model.layers.0.post_mlp_layernorm.weight"].shape == (h,)  # the dense layer's too
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (768, h)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.experts.7.up_proj.weight"].shape == (128, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (128, h)  # one shared expert
    assert t["model.layers.2.eh_proj.weight"].shape == (h, 2 * h)
    assert t["lm_head.weight"].shape == (1000, h)
    bias = {n for n in t if n.endswith("e_score_correction_bias")}
    assert bias == {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)}  # MoE layer, MTP layer
    assert {t[n].dtype for n in bias} == {torch.float32}
    assert {v.dtype for n, v in t.items() if n not in bias} == {torch.bfloat16}


def _vllm() -> str:
    path = engine_file_or_skip("vllm", "model_executor/models/AXK1.py")
    return path.read_text()


def test_vllm_builds_the_post_mlp_norm_on_every_layer():
    """The norm the release stores on each layer, the dense one included: AXK1DecoderLayer.__init__ builds it
    unconditionally (its forward applies it after a MoE block only), and the loader names it as stored (no rename)."""
    text = _vllm()
    init = text.split("class AXK1DecoderLayer", 1)[1].split("def _is_layer_sparse", 1)[0]
    assert "self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)" in init
    assert not re.search(r"if[^\n]*:\n\s*self\.post_mlp_layernorm", init)
    assert "if self.is_layer_sparse:\n            hidden_states = self.post_mlp_layernorm(hidden_states)" in text
    assert "post_mlp_layernorm" not in text.split("def load_weights", 1)[1]


def test_vllm_wants_the_router_bias_for_noaux_tc():
    text = _vllm()
    assert 'if getattr(config, "topk_method", "noaux_tc") == "noaux_tc":' in text
    assert "self.gate.e_score_correction_bias = nn.Parameter(" in text


# not config.json keys: attributes transformers' AXK1Config derives (mlp_layer_types, qk_head_dim, rope_parameters) or
# PretrainedConfig gives every config
DERIVED = {"rope_parameters", "pad_token_id", "architectures", "get_text_config", "to_dict"}


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` vLLM's AXK1.py reads directly (no getattr default, no hasattr guard) is in config.json."""
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(_vllm())
    assert {"n_routed_experts", "moe_intermediate_size", "kv_lora_rank", "q_lora_rank", "n_group"} <= read
    assert sorted(k for k in read - DERIVED if k not in cfg) == []


def test_sglang_does_not_register_it():
    """SGLang 0.5.23 has no A.X K1 model (its row has one engine)."""
    models = engine_file_or_skip("sglang", "srt/models/deepseek_v2.py")
    assert not [p for p in models.parent.glob("*.py") if "AXK1" in p.read_text(errors="ignore")]


def test_plan_with_the_shipped_table(tiny):
    """Where a derived table ships for "axk1", plan resolves every module of the release's layout with it: the
    attention and MLP linear layers NVFP4 (the dense layer's, the shared expert's, each routed expert's), the router,
    lm_head and the MTP layer kept."""
    if not (REPO / "mappings" / "derived" / "axk1.toml").is_file():
        pytest.skip("no derived table ships for axk1 (docs/derived-architectures.md: its row)")
    from kimi_convert.plan import KEEP, NVFP4

    kinds = plan_kinds(tiny)
    for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert kinds[f"model.layers.1.self_attn.{p}"] == NVFP4
    assert kinds["model.layers.0.mlp.gate_proj"] == NVFP4
    assert kinds["model.layers.1.mlp.shared_experts.down_proj"] == NVFP4
    experts = {n: k for n, k in kinds.items() if n.startswith("model.layers.1.mlp.experts.")}
    assert len(experts) == 8 * 3 and set(experts.values()) == {NVFP4}
    assert kinds["model.layers.1.mlp.gate"] == KEEP
    assert kinds["lm_head"] == KEEP
    # the MTP layer as stored: vLLM has no draft model for A.X K1 (the table's [mtp.draft]), nothing reads it quantized
    assert kinds["model.layers.2.eh_proj"] == KEEP
    assert kinds["model.layers.2.mlp.experts.0.gate_proj"] == KEEP
