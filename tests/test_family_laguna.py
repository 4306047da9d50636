"""Laguna (LagunaForCausalLM, Poolside's Laguna-S-2.1 / XS.2 / XS-2.1 / M.1) without an engine: the tests' preset is
laid out as the BF16 release (config.json with the release's keys, its auto_map and the remote config class it
names, the names both engines' loaders consume, every tensor BF16).

The expected names are written here by hand from the engines' loaders, not produced by the code under test:
- vLLM 0.33 laguna.py: LagunaModel.hf_to_vllm_mapper stacks q_proj / k_proj / v_proj into qkv_proj; LagunaAttention
  builds g_proj (ColumnParallelLinear, total_num_heads wide for gating "per-head"), q_norm, k_norm, o_proj;
  LagunaMLP keeps gate_proj / up_proj / down_proj apart (dense layer and shared_expert); LagunaMoE builds GateLinear
  mlp.gate and FusedMoEFactory mlp.experts, loaded per expert through RoutedExperts.load_weights
  (mlp.experts.N.gate_proj / up_proj / down_proj); ParallelLMHead lm_head (untied);
- SGLang 0.5.23 laguna.py LagunaForCausalLM.load_weights: stacked q/k/v into qkv_proj and gate/up into gate_up_proj
  (dense layer and mlp.shared_expert), FusedMoE.make_expert_params_mapping (mlp.experts.N.*), LagunaMoEGate
  mlp.gate.weight, and the router bias remapped from mlp.experts.e_score_correction_bias to
  mlp.gate.e_score_correction_bias.
The router bias is stored as mlp.experts.e_score_correction_bias (transformers 5.20 conversion_mapping.py "laguna",
SGLang's load_weights and vLLM's LagunaMoE comment all name it so); vLLM 0.33's RoutedExperts.load_weights maps no
checkpoint name onto its parameter (mlp.experts.routed_experts.e_score_correction_bias). Public evidence for the
layout: docs/families.md ("Laguna").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import (
    config_keys_read,
    engine_file,
    engine_file_or_skip,
    plan_kinds,
    read_tensors,
    weight_map,
    write_synth,
)

REPO = Path(__file__).resolve().parent.parent

# poolside/Laguna-S-2.1 config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["LagunaForCausalLM"], "model_type": "laguna",
    "auto_map": {"AutoConfig": "configuration_laguna.LagunaConfig",
                 "AutoModelForCausalLM": "modeling_laguna.LagunaForCausalLM"},
    "head_dim": 128, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "norm_topk_prob": True, "moe_routed_scaling_factor": 2.5, "moe_router_logit_softcapping": 0.0,
    "moe_apply_router_weight_on_input": False, "output_router_logits": False, "router_aux_loss_coef": 0.0,
    "decoder_sparse_step": 1, "mlp_only_layers": [0], "sliding_window": 512, "gating": "per-head",
    "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 128.0,
                           "original_max_position_embeddings": 8192, "beta_slow": 1.0, "beta_fast": 32.0,
                           "attention_factor": 1.4852030263919618, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
    "bos_token_id": 2, "eos_token_id": [2, 24], "pad_token_id": 9, "use_cache": True,
}

LAYERS = 4
ATTN = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.g_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight"}
DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
SHARED = {"mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
          "mlp.shared_expert.down_proj.weight"}


def moe(experts: int) -> set[str]:
    return ({"mlp.gate.weight", "mlp.experts.e_score_correction_bias"} | SHARED
            | {f"mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-laguna", tmp_path_factory.mktemp("laguna") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == LAYERS and cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    # the release's per-layer schedules: full attention every 4th layer from 0 (48 query heads, 72 on the sliding
    # layers: 4 / 6 here over 2 KV heads), layer 0 the one dense MLP, per-head gating everywhere
    assert cfg["layer_types"] == ["full_attention"] + ["sliding_attention"] * 3
    assert cfg["num_attention_heads_per_layer"] == [4, 6, 6, 6] and cfg["num_key_value_heads"] == 2
    assert cfg["mlp_layer_types"] == ["dense"] + ["sparse"] * 3
    assert cfg["gating_types"] == ["per_head"] * LAYERS
    # Laguna's own key names, none of DeepSeek's or Qwen-MoE's, no MTP layer, no attention sinks
    assert not {"n_routed_experts", "first_k_dense_replace", "routed_scaling_factor", "num_nextn_predict_layers",
                "rope_theta", "rope_scaling", "swa_attention_sink_enabled", "quantization_config"} & set(cfg)
    assert not (tiny / "configuration_laguna.py").exists()  # not remote: both engines register "laguna" themselves


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in ATTN | DENSE}  # the dense first layer
    want |= {f"model.layers.{i}.{n}" for i in range(1, LAYERS) for n in ATTN | moe(8)}
    assert set(weight_map(tiny)) == want


def test_router_bias_is_stored_under_the_experts(tiny):
    """The release's name for the selection bias, mlp.experts.e_score_correction_bias, not transformers' module path
    mlp.gate.e_score_correction_bias; the shared expert singular (transformers renames both on load)."""
    names = set(weight_map(tiny))
    assert {f"model.layers.{i}.mlp.experts.e_score_correction_bias" for i in range(1, LAYERS)} <= names
    assert not any(".mlp.gate.e_score_correction_bias" in n or ".shared_experts." in n for n in names)


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, kv, inter, dense = 256, 128, 2, 128, 1024
    for layer, heads in ((0, 4), (1, 6)):  # a full-attention layer, a sliding one
        pre = f"model.layers.{layer}.self_attn"
        assert t[f"{pre}.q_proj.weight"].shape == (heads * hd, h)
        assert t[f"{pre}.k_proj.weight"].shape == (kv * hd, h)
        assert t[f"{pre}.v_proj.weight"].shape == (kv * hd, h)
        assert t[f"{pre}.o_proj.weight"].shape == (h, heads * hd)
        assert t[f"{pre}.g_proj.weight"].shape == (heads, h)  # gating "per-head": one gate a head
        assert t[f"{pre}.q_norm.weight"].shape == (hd,) and t[f"{pre}.k_norm.weight"].shape == (hd,)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (dense, h)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (h, dense)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.experts.e_score_correction_bias"].shape == (8,)
    assert t["model.layers.1.mlp.experts.7.up_proj.weight"].shape == (inter, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, inter)
    assert t["model.layers.1.mlp.shared_expert.gate_proj.weight"].shape == (inter, h)
    assert t["model.layers.1.mlp.shared_expert.down_proj.weight"].shape == (h, inter)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}  # the router and its bias too


# not config.json keys: what SGLang's own LagunaConfig (sglang/srt/configs/laguna.py) derives from rope_parameters
# and its defaults
SGLANG_DERIVED = {"full_rope_scaling", "swa_rope_scaling", "swa_rope_theta", "swa_partial_rotary_factor",
                  "rope_theta", "partial_rotary_factor", "moe_router_score_func"}


@pytest.mark.parametrize("engine,rel,derived", [("vllm", "model_executor/models/laguna.py", set()),
                                                ("sglang", "srt/models/laguna.py", SGLANG_DERIVED)])
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine, rel, derived):
    """Each ``config.X`` the engine's laguna.py reads directly (no getattr default, no hasattr guard) is in
    config.json."""
    path = engine_file_or_skip(engine, rel)
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"gating", "layer_types", "num_experts", "shared_expert_intermediate_size", "sliding_window"} <= read
    assert sorted(k for k in read - derived if k not in cfg) == []


def test_sglang_remaps_the_releases_bias_name():
    """SGLang's loader reads the bias under the release's name (onto LagunaMoEGate); vLLM's laguna.py has no such
    remap (its bias parameter lives on FusedMoEFactory's RoutedExperts, whose load_weights maps expert weights only)."""
    sg, vl = engine_file("sglang", "srt/models/laguna.py"), engine_file("vllm", "model_executor/models/laguna.py")
    if sg is None or vl is None:
        pytest.skip("no engine environments under ~/.cache/kimi-convert/engines")
    assert 'name.endswith("mlp.experts.e_score_correction_bias")' in sg.read_text()
    assert "e_score_correction_bias" not in vl.read_text().split("def load_weights", 1)[1]


def test_plan_with_the_shipped_table(tiny):
    """Where a derived table ships for "laguna", plan resolves every module of the release's layout with it: the
    linear layers NVFP4, the router, norms, embeddings, lm_head and the router bias kept."""
    if not (REPO / "mappings" / "derived" / "laguna.toml").is_file():
        pytest.skip("no derived table ships for laguna (docs/derived-architectures.md: its row)")
    kinds = plan_kinds(tiny)
    assert kinds["model.layers.1.self_attn.o_proj"] == "nvfp4"
    router = kinds.get("model.layers.1.mlp.gate") or kinds.get("model.layers.1.mlp.gate.weight")
    assert router is not None and router != "nvfp4"
