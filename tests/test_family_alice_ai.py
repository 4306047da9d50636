"""AliceAI (AliceAIForCausalLM, yandex/AliceAI-Foundation-80B-A3B-Base) without an engine: the tests' preset is laid
out as the release (config.json with the release's keys and its remote config class, the names vLLM's loader
consumes, the routed experts as 3-D banks, the MTP block under mtp., every tensor BF16). SGLang 0.5.23 does not
register the architecture: vLLM 0.33 is its one engine.

The expected names are written here by hand from vLLM 0.33 alice_ai.py, not produced by the code under test:
AliceAIModel.hf_to_vllm_mapper (linear_attn.q_proj / k_proj / v_proj / b_proj / f_a_proj stacked into
in_proj_qkvgfab, linear_attn.a_log_bias renamed A_log, self_attn.q_proj / k_proj / v_proj into qkv_proj,
shared_expert.gate_proj / up_proj into gate_up_proj), _load_split_kda_conv_weights (linear_attn.q_conv1d / k_conv1d /
v_conv1d into conv1d), KimiGatedDeltaNetAttention (f_b_proj, g_a_proj, g_b_proj, dt_bias, o_norm, o_proj),
Qwen3NextAttention (o_proj, q_norm, k_norm), AliceAISparseMoeBlock (mlp.gate, its e_score_correction_bias,
shared_expert, shared_expert_gate; the routed experts through fused_moe/routed_experts.py RoutedExperts.load_weights,
whose fused mapping reads experts.gate_up_proj chunk(2, dim=1) and experts.down_proj), AliceAIDecoderBlock
(input_layernorm, post_attention_layernorm, attn_res_proj / attn_res_norm_weight on layers > 0, mlp_res_proj /
mlp_res_norm_weight), AliceAIModel (embed_tokens, norm, attnres_final.res_proj / res_norm_weight), ParallelLMHead
lm_head; AliceAIForCausalLM.hf_to_vllm_mapper maps "mtp." to None (the MTP block is stored, not read).
Public evidence for the layout: /tmp/s39/alice_ai-families.md (docs/families.md "AliceAI").
"""

from __future__ import annotations

import json
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

# yandex/AliceAI-Foundation-80B-A3B-Base config.json: the values that are not sizes (sizes: the preset's); the release
# contract of vLLM PR #57963's AliceAIConfig and the model card
RELEASE = {
    "architectures": ["AliceAIForCausalLM"], "model_type": "alice_ai",
    "auto_map": {"AutoConfig": "configuration_alice_ai.AliceAIConfig",
                 "AutoModelForCausalLM": "modeling_alice_ai.AliceAIForCausalLM"},
    "router_score_function": "sigmoid", "router_bias_correction": True, "kda_allow_negative_eigenvalues": False,
    "block_attn_res_block_size": 4, "mtp_num_hidden_layers": 1, "number_of_conv_states": 3,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "full_attention_interval": 4, "head_dim": 256,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "max_position_embeddings": 262144,
    "hidden_act": "silu", "norm_topk_prob": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

COMMON = {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp_res_proj.weight", "mlp_res_norm_weight",
          "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
          "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
          "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"}
RESIDUAL = {"attn_res_proj.weight", "attn_res_norm_weight"}  # layers > 0 only (AliceAIDecoderBlock)
KDA = {f"linear_attn.{n}" for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight",
                                    "f_a_proj.weight", "f_b_proj.weight", "g_a_proj.weight", "g_b_proj.weight",
                                    "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "a_log_bias", "dt_bias",
                                    "o_norm.weight", "o_proj.weight")}
FULL = {f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-alice-ai", tmp_path_factory.mktemp("alice-ai") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 4 and cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    # three KDA layers, then the gated full-attention one (the release's 12 x (3 + 1))
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    # KDA: as many value heads as key heads of the same width (vLLM's _make_kimi_kda_config refuses otherwise)
    assert cfg["linear_num_key_heads"] == cfg["linear_num_value_heads"] == 2
    # Qwen3-Next's own key names, none of DeepSeek's
    assert not {"n_routed_experts", "first_k_dense_replace", "num_nextn_predict_layers", "scoring_func"} & set(cfg)
    assert (tiny / "configuration_alice_ai.py").is_file()  # the class auto_map names, shipped alongside


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "model.attnres_final.res_proj.weight",
            "model.attnres_final.res_norm_weight", "lm_head.weight"}
    for i in range(4):
        layer = COMMON | (RESIDUAL if i else set()) | (FULL if i == 3 else KDA)
        want |= {f"model.layers.{i}.{n}" for n in layer}
    # the MTP block (Qwen3-Next's names): a gated full-attention MoE layer without attention residuals
    mtp = {"input_layernorm.weight", "post_attention_layernorm.weight"} | FULL | (COMMON - {
        "input_layernorm.weight", "post_attention_layernorm.weight", "mlp_res_proj.weight", "mlp_res_norm_weight"})
    want |= {f"mtp.layers.0.{n}" for n in mtp}
    want |= {f"mtp.{n}.weight" for n in ("fc", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")}
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, kv, e, inter = 256, 256, 2, 1, 8, 128
    kda_heads, kda_dim = 2, 128
    p = kda_heads * kda_dim
    a = "model.layers.0.linear_attn"
    for n in ("q", "k", "v"):
        assert t[f"{a}.{n}_proj.weight"].shape == (p, h)
        assert t[f"{a}.{n}_conv1d.weight"].shape == (p, 1, 4)  # [C, 1, K], as fla's KDA stores it
    assert t[f"{a}.b_proj.weight"].shape == (kda_heads, h)
    assert t[f"{a}.f_a_proj.weight"].shape == t[f"{a}.g_a_proj.weight"].shape == (kda_dim, h)
    assert t[f"{a}.f_b_proj.weight"].shape == t[f"{a}.g_b_proj.weight"].shape == (p, kda_dim)
    assert t[f"{a}.a_log_bias"].shape == (kda_heads,)
    assert t[f"{a}.dt_bias"].shape == (p,)
    assert t[f"{a}.o_norm.weight"].shape == (kda_dim,)
    assert t[f"{a}.o_proj.weight"].shape == (h, p)
    s = "model.layers.3.self_attn"
    assert t[f"{s}.q_proj.weight"].shape == (2 * heads * hd, h)  # query and its output gate (attn_output_gate)
    assert t[f"{s}.k_proj.weight"].shape == t[f"{s}.v_proj.weight"].shape == (kv * hd, h)
    assert t[f"{s}.o_proj.weight"].shape == (h, heads * hd)
    m = "model.layers.1.mlp"
    assert t[f"{m}.experts.gate_up_proj"].shape == (e, 2 * inter, h)  # gate rows, then up rows
    assert t[f"{m}.experts.down_proj"].shape == (e, h, inter)
    assert t[f"{m}.gate.weight"].shape == (e, h) and t[f"{m}.gate.e_score_correction_bias"].shape == (e,)
    assert t[f"{m}.shared_expert_gate.weight"].shape == (1, h)
    assert t["model.layers.1.attn_res_proj.weight"].shape == t["model.attnres_final.res_proj.weight"].shape == (1, h)
    assert t["mtp.fc.weight"].shape == (h, 2 * h)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}  # the Hub's metadata: every parameter BF16


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` vLLM's alice_ai.py reads directly (no getattr default, no hasattr guard) is in config.json,
    and the values its AliceAIForCausalLMConfig (model_executor/models/config.py) requires are the release's."""
    path = engine_file_or_skip("vllm", "model_executor/models/alice_ai.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"layer_types", "linear_num_key_heads", "linear_conv_kernel_dim", "shared_expert_intermediate_size"} <= read
    assert sorted(k for k in read if k not in cfg) == []
    hook = engine_file_or_skip("vllm", "model_executor/models/config.py").read_text()
    for needs in ("kda_allow_negative_eigenvalues=false", "router_score_function='sigmoid'",
                  "router_bias_correction=true"):
        assert f"AliceAI requires {needs}" in hook
    assert cfg["kda_allow_negative_eigenvalues"] is False and cfg["router_score_function"] == "sigmoid"
    assert cfg["router_bias_correction"] is True


def test_vllm_reads_the_banks_and_drops_the_mtp_block():
    """vLLM 0.33 reads a fused experts.gate_up_proj [E, 2I, H] as gate rows then up rows and experts.down_proj whole
    (RoutedExperts.build_expert_params_mapping's fused entries), and its main model maps "mtp." to None."""
    moe = engine_file_or_skip("vllm", "model_executor/layers/fused_moe/routed_experts.py")
    model = engine_file_or_skip("vllm", "model_executor/models/alice_ai.py")
    text = moe.read_text()
    assert 'gate_up = "gate_up_proj"' in text and "fused_weight.chunk(2, dim=1)[expert_id]" in text
    assert 'WeightsMapper(orig_to_new_prefix={"mtp.": None})' in model.read_text()


def test_sglang_does_not_register_it():
    """SGLang 0.5.23 has no AliceAI model (its row has one engine)."""
    models = engine_file_or_skip("sglang", "srt/models/registry.py")
    assert not any("AliceAI" in f.read_text(errors="ignore") for f in models.parent.glob("*.py"))


def test_plan_with_the_shipped_table(tiny):
    """Where a derived table ships for "alice_ai", plan resolves every module of the release's layout with it: the
    attention, KDA and MoE linear layers NVFP4 (each routed expert split from its bank), the router, the shared expert
    gate, the AttnRes projections, conv1d and lm_head kept, the MTP layer as stored (vLLM 0.33 has no draft for it)."""
    if not (REPO / "mappings" / "derived" / "alice_ai.toml").is_file():
        pytest.skip("no derived table ships for alice_ai (docs/derived-architectures.md: its row)")
    from kimi_convert.plan import KEEP, NVFP4

    kinds = plan_kinds(tiny)
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert kinds[f"model.layers.3.self_attn.{p}"] == NVFP4
    for p in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "o_proj"):
        assert kinds[f"model.layers.0.linear_attn.{p}"] == NVFP4
    experts = {n: k for n, k in kinds.items() if n.startswith("model.layers.1.mlp.experts.")}
    assert len(experts) == 8 * 3 and set(experts.values()) == {NVFP4}
    assert kinds["model.layers.1.mlp.shared_expert.down_proj"] == NVFP4
    for kept in ("model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate", "model.layers.1.attn_res_proj",
                 "model.layers.1.mlp_res_proj", "model.attnres_final.res_proj", "lm_head"):
        assert kinds[kept] == KEEP
    assert kinds["mtp.fc"] == KEEP
