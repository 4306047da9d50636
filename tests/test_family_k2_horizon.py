"""K2 Horizon MoVA (K2HorizonForCausalLM, MBZUAI-IFM's IFM/K2-Horizon-MoVA-36B-A4B) without an engine: the tests'
preset is laid out as the release (config.json with the release's keys and its remote config class, the names both
engines' loaders consume, every tensor BF16).

The expected names are written here by hand from the engines' loaders, not produced by the code under test: vLLM
0.33 k2_horizon.py (K2HorizonDecoderLayer: a layer of mlp_only_layers gets K2HorizonAttention, q_proj / k_proj /
v_proj stacked into qkv_proj, and K2HorizonMLP; every other layer K2HorizonMoVAAttention, q_proj / k_proj into
qk_proj, v_router, one v_experts.N linear per value expert, and K2HorizonSparseMoeBlock: GateLinear mlp.gate with its
bias, FusedMoE experts.N.gate_proj / up_proj / down_proj, K2HorizonMLP shared_experts; both attentions the softplus
gate_proj and o_proj; K2HorizonModel.load_weights) and SGLang 0.5.23 xllm.py (K2HorizonForCausalLM, an
XllmForCausalLM: XllmGatedAttention with v_proj on the dense prefix, XllmMoVAAttention with v_router and
RoutedValueExperts filled from v_experts.N.weight, XllmMoEGate mlp.gate weight and bias, XllmMLP shared_experts;
XllmForCausalLM.load_weights). Public evidence for the layout: docs/families.md ("K2 Horizon").
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
PRESET = REPO / "tests" / "presets" / "k2_horizon.toml"

# IFM/K2-Horizon-MoVA-36B-A4B config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["K2HorizonForCausalLM"], "model_type": "k2_horizon",
    "auto_map": {"AutoConfig": "configuration_k2_horizon.K2HorizonConfig",
                 "AutoModel": "modeling_k2_horizon.K2HorizonModel",
                 "AutoModelForCausalLM": "modeling_k2_horizon.K2HorizonForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "attention_gate_func": "softplus", "bos_token_id": 0,
    "decoder_sparse_step": 1, "dtype": "bfloat16", "eos_token_id": 1, "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "layernorm_num_groups": 2, "max_position_embeddings": 524288, "moe_gate_bias": True,
    "norm_topk_prob": True, "num_shared_experts": 1, "output_router_logits": False, "pad_token_id": None,
    "query_key_norm": False, "rms_norm_eps": 1e-06, "rope_head_dim": 128,
    "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"}, "router_aux_loss_coef": 0.001,
    "router_scaling_factor": 2.5, "router_score_func": "sigmoid", "sliding_window": None,
    "tie_word_embeddings": False, "transformers_version": "5.13.0", "use_cache": True, "use_sliding_window": False,
}

LAYERS, EXPERTS, VALUES = 3, 8, 8
NORMS = {"input_layernorm.weight", "post_attention_layernorm.weight"}
ATTN = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
        "self_attn.gate_proj.weight"}  # the softplus output gate (attention_gate_func)
DENSE = NORMS | ATTN | {"self_attn.v_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                        "mlp.down_proj.weight"}
MOVA = (NORMS | ATTN | {"self_attn.v_router.weight", "self_attn.v_router.bias", "mlp.gate.weight", "mlp.gate.bias",
                        "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                        "mlp.shared_experts.down_proj.weight"}
        | {f"self_attn.v_experts.{v}.weight" for v in range(VALUES)}
        | {f"mlp.experts.{e}.{p}_proj.weight" for e in range(EXPERTS) for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-k2-horizon", tmp_path_factory.mktemp("k2-horizon") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert (cfg["num_hidden_layers"], cfg["mlp_only_layers"], cfg["num_experts"], cfg["num_experts_per_tok"],
            cfg["mova_num_experts"], cfg["mova_num_experts_per_tok"]) == (LAYERS, [0], EXPERTS, 2, VALUES, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]) == (4, 2, 256)
    # the release stores no router-GEMM provenance (SGLang asks a deployment for it: the next test), no quantization
    assert not {"xllm_source_router_gemm_partitions", "quantization_config", "torch_dtype"} & set(cfg)
    assert (tiny / "configuration_k2_horizon.py").is_file()  # the class auto_map names, shipped alongside


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in DENSE}  # mlp_only_layers [0]: dense attention and MLP
    want |= {f"model.layers.{i}.{n}" for i in range(1, LAYERS) for n in MOVA}  # MoVA attention + MoE
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, kv, inter, moe = 256, 128, 4, 2, 512, 128
    for i in range(LAYERS):
        assert t[f"model.layers.{i}.self_attn.q_proj.weight"].shape == (heads * hd, h)
        assert t[f"model.layers.{i}.self_attn.k_proj.weight"].shape == (kv * hd, h)
        assert t[f"model.layers.{i}.self_attn.gate_proj.weight"].shape == (heads * hd, h)  # per channel
        assert t[f"model.layers.{i}.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert t["model.layers.0.self_attn.v_proj.weight"].shape == (kv * hd, h)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (inter, h)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (h, inter)
    assert t["model.layers.1.self_attn.v_router.weight"].shape == (VALUES, h)
    assert t["model.layers.1.self_attn.v_router.bias"].shape == (VALUES,)
    assert t[f"model.layers.2.self_attn.v_experts.{VALUES - 1}.weight"].shape == (kv * hd, h)  # a value head each
    assert t["model.layers.1.mlp.gate.weight"].shape == (EXPERTS, h)
    assert t["model.layers.1.mlp.gate.bias"].shape == (EXPERTS,)
    assert t[f"model.layers.1.mlp.experts.{EXPERTS - 1}.up_proj.weight"].shape == (moe, h)
    assert t["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (h, moe)
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (moe, h)  # one shared expert
    assert t["lm_head.weight"].shape == (1024, h)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


def test_the_release_sizes_give_the_releases_tensor_count(tmp_path):
    """At the release's own sizes (the preset's [config], no variant changes) the layout has the 16998 names of the
    bf16 release's index (a public CPU reference's expected_names, held to that index): 3 dense layers, 45 MoVA + MoE
    layers of 64 value experts and 100 routed experts."""
    from kimi_convert.synth import load_preset, tensor_specs

    spec = tmp_path / "k2_horizon.toml"
    spec.write_text(PRESET.read_text() + '\n[presets.release-sizes]\ndescription = "the release\'s sizes"\n')
    names = [n for n, _, _ in tensor_specs(load_preset(f"{spec}:release-sizes"))]
    assert len(names) == len(set(names)) == 16998
    assert sum(".self_attn.v_experts." in n for n in names) == 45 * 64
    assert sum(".mlp.experts." in n for n in names) == 45 * 100 * 3
    assert sum(n.endswith(".self_attn.v_proj.weight") for n in names) == 3


# not config.json keys. vLLM: none. SGLang: what K2HorizonForCausalLM's _normalize_k2_horizon_config sets from the
# release's spelling before XllmForCausalLM reads it (mova_num_experts -> num_values, mova_num_experts_per_tok ->
# num_values_per_tok, len(mlp_only_layers) -> num_dense_layers)
DERIVED = {"vllm": set(), "sglang": {"num_values", "num_values_per_tok", "num_dense_layers"}}
FILES = {"vllm": "model_executor/models/k2_horizon.py", "sglang": "srt/models/xllm.py"}


@pytest.mark.parametrize("engine", sorted(FILES))
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine):
    """Each ``config.X`` the engine's model file reads directly (no getattr default, no hasattr guard) is in
    config.json, or set from it by the engine's own K2 Horizon adapter."""
    path = engine_file_or_skip(engine, FILES[engine])
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_key_value_heads"} <= read
    assert sorted(k for k in read - DERIVED[engine] if k not in cfg) == []


def test_sglang_asks_a_deployment_for_the_router_provenance_the_release_does_not_store(tiny):
    """SGLang 0.5.23 xllm.py _normalize_k2_horizon_config refuses a MoVA config without
    xllm_source_router_gemm_partitions (the model card's SGLang recipe passes it with --json-model-override-args);
    the release's config.json has no such key, so SGLang's fixture check fails on the release as stored."""
    path = engine_file_or_skip("sglang", FILES["sglang"])
    text = path.read_text()
    assert "K2Horizon MoVA requires explicit source router GEMM provenance" in text
    assert '_XLLM_SOURCE_ROUTER_PARTITIONS_CONFIG_KEY = "xllm_source_router_gemm_partitions"' in text
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["mova_num_experts"] > 0 and "xllm_source_router_gemm_partitions" not in cfg


def test_sglang_serves_mova_only_unquantized():
    """SGLang 0.5.23 builds no quantized K2 Horizon MoVA model: _validate_mova_config takes only compressed-tensors,
    and every MoVA attention (_XllmMoVAAttentionBase, the dense prefix's XllmGatedAttention too) refuses any quant
    config: no NVFP4 output of this tool (ModelOpt or compressed-tensors) loads there."""
    path = engine_file_or_skip("sglang", FILES["sglang"])
    text = path.read_text()
    assert "Native xLLM/K2 Horizon serving supports only " in text
    assert "K2 Horizon MoVA supports unquantized bf16/fp16 weights only" in text


def test_vllm_loads_the_value_experts_itself_and_the_overlay_keeps_them():
    """vLLM 0.33 K2HorizonModel.load_weights loads self_attn.v_experts.* in a branch of its own (chunked by KV heads
    on a shape mismatch, which NVFP4's 0-d weight_scale_2 cannot be) and compute_mova_v_sparse runs their `.weight`
    through the unquantized fused_mova_impl: the hand overlay keeps every value expert BF16, and no other module."""
    import tomllib

    from kimi_convert.globs import match

    path = engine_file("vllm", FILES["vllm"])
    if path is not None:
        text = path.read_text()
        assert 'if ".self_attn.v_experts." in name:' in text
        assert "torch.stack(\n            [expert.weight for expert in self.v_experts], dim=0" in text
    keeps = [k["pattern"] for k in tomllib.loads((REPO / "mappings/overlays/k2_horizon.toml").read_text())["keep"]]
    assert keeps == ["model.layers.*.self_attn.v_experts.*"]
    assert match(keeps[0], "model.layers.47.self_attn.v_experts.63")
    for other in ("model.layers.3.self_attn.v_router", "model.layers.3.self_attn.k_proj",
                  "model.layers.3.mlp.experts.0.gate_proj"):
        assert not match(keeps[0], other)


def test_plan_with_the_shipped_table(tiny):
    """Where a derived table ships for "k2_horizon", plan resolves every module of the release's layout with it and
    the overlay: the linear layers NVFP4, the value experts kept BF16, norms, embeddings, lm_head and the router
    biases kept."""
    if not (REPO / "mappings" / "derived" / "k2_horizon.toml").is_file():
        pytest.skip("no derived table ships for k2_horizon (docs/derived-architectures.md: its row)")
    kinds = plan_kinds(tiny)
    for m in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.q_proj",
              "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.shared_experts.down_proj"):
        assert kinds[m] == "nvfp4", m
    assert all(kinds[f"model.layers.1.mlp.experts.{e}.{p}_proj"] == "nvfp4" for e in range(EXPERTS)
               for p in ("gate", "up", "down"))
    assert all(kinds[f"model.layers.{i}.self_attn.v_experts.{v}"] != "nvfp4" for i in (1, 2) for v in range(VALUES))
    assert kinds["lm_head"] != "nvfp4"
