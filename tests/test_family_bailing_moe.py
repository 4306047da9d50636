"""Ling 1.x / Ring-lite (BailingMoeForCausalLM) without an engine: the tests' preset is laid out as the release
(Ling-lite-1.5's config.json with its keys and its remote config class, the names both engines' loaders consume,
every tensor BF16).

The expected names are written here by hand from the engines' loaders, not produced by the code under test: vLLM 0.33
bailing_moe.py (BailingMoeModel: word_embeddings, layers, norm; BailingMoeBlock: input_layernorm, attention,
post_attention_layernorm, a BailingMoE mlp at every layer_idx >= first_k_dense_replace; BailingAttention: the fused
QKVParallelLinear query_key_value and dense, query_layernorm / key_layernorm only with use_qk_norm; BailingMoE:
GateLinear gate (expert_bias only with moe_router_enable_expert_bias), FusedMoE experts, BailingMLP shared_experts
moe_intermediate_size * num_shared_experts wide without moe_shared_expert_intermediate_size; hf_to_vllm_mapper
stacks gate/up into gate_up_proj; ParallelLMHead lm_head) and SGLang 0.5.23 bailing_moe.py
(BailingMoEForCausalLM.load_weights: stacked_params_mapping gate/up, FusedMoE.make_expert_params_mapping, the rest
by name), and the release's modeling_bailing_moe.py (inclusionAI/Ling models/). Public evidence for the layout:
docs/families.md ("Ling 1.x").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import (
    MODEL_DIRS,
    config_keys_read,
    engine_file_or_skip,
    plan_kinds,
    read_tensors,
    weight_map,
    write_synth,
)

# inclusionAI/Ling-lite-1.5 config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["BailingMoeForCausalLM"], "model_type": "bailing_moe",
    "auto_map": {"AutoConfig": "configuration_bailing_moe.BailingMoeConfig",
                 "AutoModel": "modeling_bailing_moe.BailingMoeModel",
                 "AutoModelForCausalLM": "modeling_bailing_moe.BailingMoeForCausalLM"},
    "first_k_dense_replace": 0, "hidden_act": "silu", "norm_topk_prob": True, "num_shared_experts": 2,
    "use_bias": False, "use_qkv_bias": False, "norm_head": False, "norm_softmax": False, "tie_word_embeddings": False,
    "rope_theta": 600000, "rope_scaling": None, "rms_norm_eps": 1e-06, "embedding_dropout": 0.0,
    "output_dropout": 0.0, "attention_dropout": 0.0, "eos_token_id": 126081, "pad_token_id": 126081,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "pretraining_tp": 1,
}

# every layer (the release has no dense layer: first_k_dense_replace 0), no QK norm, no router bias
LAYER = {"input_layernorm.weight", "attention.query_key_value.weight", "attention.dense.weight",
         "post_attention_layernorm.weight", "mlp.gate.weight", "mlp.shared_experts.gate_proj.weight",
         "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"}


def experts(n: int) -> set[str]:
    return {f"mlp.experts.{e}.{p}_proj.weight" for e in range(n) for p in ("gate", "up", "down")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-bailing-moe", tmp_path_factory.mktemp("ling1") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 2 and cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA, as released (4 KV heads of 16)
    # none of Ling 2.0's keys: no head_dim (the config class takes hidden / heads), no QK norm, full rotary, softmax
    # routing with no expert bias nor groups, shared experts moe_intermediate_size wide, no MTP layer
    assert not {"head_dim", "use_qk_norm", "use_rmsnorm", "partial_rotary_factor", "score_function",
                "moe_router_enable_expert_bias", "router_dtype", "n_group", "topk_group", "routed_scaling_factor",
                "moe_shared_expert_intermediate_size", "num_nextn_predict_layers"} & set(cfg)
    assert (tiny / "configuration_bailing_moe.py").is_file()  # the class auto_map names, shipped alongside


def test_config_class_gives_what_the_engines_read(tiny):
    """The shipped config class, as the release's, sets head_dim = hidden / heads (both engines read config.head_dim
    with no default) and keeps rope_theta, from which transformers builds rope_parameters."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("configuration_bailing_moe", tiny / "configuration_bailing_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.BailingMoeConfig(**json.loads((tiny / "config.json").read_text()))
    assert cfg.head_dim == 128 and cfg.rope_theta == 600000
    assert cfg.num_shared_experts == 2 and cfg.use_bias is False and cfg.first_k_dense_replace == 0


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    want = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in range(2) for n in LAYER | experts(8)}  # both layers MoE
    assert set(weight_map(tiny)) == want


def test_tensor_order_is_the_releases_module_order(tiny):
    """save_pretrained's order: BailingMoeDecoderLayer registers attention, then mlp (experts, gate, shared_experts),
    then the two norms."""
    names = [n.removeprefix("model.layers.0.") for n in weight_map(tiny) if n.startswith("model.layers.0.")]
    assert names[:2] == ["attention.query_key_value.weight", "attention.dense.weight"]
    assert names[2:2 + 24] == [f"mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")]
    assert names[26:] == ["mlp.gate.weight", "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                          "mlp.shared_experts.down_proj.weight", "input_layernorm.weight",
                          "post_attention_layernorm.weight"]


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, kv, inter = 256, 128, 2, 1, 128  # head_dim hidden / heads = 128, as Ling-lite's 2048 / 16
    assert t["model.layers.0.attention.query_key_value.weight"].shape == ((heads + 2 * kv) * hd, h)
    assert t["model.layers.0.attention.dense.weight"].shape == (h, heads * hd)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (inter, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, inter)
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (2 * inter, h)  # two shared experts
    assert t["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (h, 2 * inter)
    assert t["model.word_embeddings.weight"].shape == t["lm_head.weight"].shape == (1000, h)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


# not config.json keys: methods and attributes transformers' PretrainedConfig or the release's config class gives
# every config (head_dim: BailingMoeConfig sets hidden_size // num_attention_heads)
DERIVED = {"get_text_config", "rope_parameters", "to_dict", "architectures", "head_dim"}
# the Ming multimodal config's keys SGLang's file also reads (image / audio gates): not the text release's
MING = {"image_patch_token", "audio_patch_token", "image_start_token", "video_start_token", "audio_start_token",
        "llm_config", "mlp_only_layers", "vision_config"}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine):
    """Each ``config.X`` the engine's model file reads directly (no getattr default, no hasattr guard) is in
    config.json."""
    path = engine_file_or_skip(engine, f"{MODEL_DIRS[engine]}/bailing_moe.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"num_experts", "first_k_dense_replace", "num_shared_experts", "embedding_dropout"} <= read
    assert sorted(k for k in read - DERIVED - MING if k not in cfg) == []


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_both_engines_register_the_architecture_in_bailing_moe_py(engine):
    """vLLM's registry maps BailingMoeForCausalLM to bailing_moe.py; SGLang's bailing_moe.py lists it in EntryClass
    beside BailingMoEForCausalLM, the class it subclasses with no body (the same loader: an alias)."""
    if engine == "vllm":
        path = engine_file_or_skip("vllm", "model_executor/models/registry.py")
        assert '"BailingMoeForCausalLM": ("bailing_moe", "BailingMoeForCausalLM")' in path.read_text()
    else:
        path = engine_file_or_skip("sglang", "srt/models/bailing_moe.py")
        text = path.read_text()
        assert "class BailingMoeForCausalLM(BailingMoEForCausalLM):\n    pass\n" in text
        assert "EntryClass = [BailingMoEForCausalLM, BailingMoeForCausalLM, BailingMoeV2ForCausalLM]" in text


def test_plan_takes_the_shipped_table_and_its_overlay_without_engines(tiny, monkeypatch, tmp_path):
    """With no engine environment, plan finds the shipped derived table (mappings/derived/bailing_moe.toml) and
    merges its overlay: routed experts, shared experts and attention.dense NVFP4; the router (GateLinear, built
    unquantized by vLLM), lm_head and the fused-on-disk query_key_value (overlays/bailing_moe.toml: SGLang fills one
    slot of three of its NVFP4 weight_scale_2) kept BF16; the shared experts' gate / up share one global scale
    (the engines' gate_up_proj), each routed expert's too (w13)."""
    from kimi_convert.derive.lookup import shipped_for
    from kimi_convert.plan import KEEP, NVFP4

    monkeypatch.setenv("KIMI_CONVERT_ENGINE_ENVS", str(tmp_path / "none"))  # no engine environment
    table = shipped_for(json.loads((tiny / "config.json").read_text()))
    assert table is not None and table.name == "derived-bailing_moe"
    kinds = plan_kinds(tiny)
    experts = {n: k for n, k in kinds.items() if ".mlp.experts." in n}
    assert len(experts) == 2 * 8 * 3 and set(experts.values()) == {NVFP4}
    for i in range(2):
        pre = f"model.layers.{i}"
        assert kinds[f"{pre}.attention.query_key_value"] == KEEP
        assert kinds[f"{pre}.attention.dense"] == NVFP4
        assert kinds[f"{pre}.mlp.gate"] == KEEP
        for p in ("gate", "up", "down"):
            assert kinds[f"{pre}.mlp.shared_experts.{p}_proj"] == NVFP4
    assert kinds["lm_head"] == KEEP
    groups = {g.name: g for g in table.groups}
    assert groups["gate_up_proj"].members == ("gate_proj", "up_proj")


def test_the_norm_head_variant_stores_the_same_tensors(tiny, tmp_path):
    """Ling-lite (0220 / 0415) and Ling-plus ship norm_head true (Ling-lite-1.5 false): the config key alone differs,
    the stored lm_head is the same tensor (the release's compute_logit normalizes it at run time)."""
    import torch

    out = write_synth("tiny-bailing-moe-norm-head", tmp_path / "src")
    cfg, base = (json.loads((f / "config.json").read_text()) for f in (out, tiny))
    assert cfg["norm_head"] is True and {k: v for k, v in cfg.items() if k != "norm_head"} == {
        k: v for k, v in base.items() if k != "norm_head"}
    assert weight_map(out) == weight_map(tiny)
    assert torch.equal(read_tensors(out)["lm_head.weight"], read_tensors(tiny)["lm_head.weight"])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_both_engines_normalize_lm_head_as_they_load_it_under_norm_head(engine):
    """Under norm_head each engine divides lm_head's columns by their L2 norm as it loads the weight (vLLM
    BailingMoeForCausalLM._normalize_lm_head, SGLang BailingMoEForCausalLM.load_weights): a kept lm_head is read
    as the release's run-time normalization gives it, not as stored (docs/families.md, "Ling 1.x")."""
    path = engine_file_or_skip(engine, f"{MODEL_DIRS[engine]}/bailing_moe.py")
    text = path.read_text()
    assert "norm_head" in text and "F.normalize(loaded_weight, dim=0, p=2, eps=1e-7)" in text
