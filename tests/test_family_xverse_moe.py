"""XVERSE-MoE (XverseMoeForCausalLM) without an engine: the tests' preset is laid out as the release (config.json with
the release's keys and its remote config class, the names SGLang's loader consumes, every tensor BF16). vLLM 0.33
does not register the architecture: SGLang is its one engine.

The expected names are written here by hand from SGLang 0.5.23 xverse_moe.py, not produced by the code under test:
XverseMoeForCausalLM.load_weights (stacked q/k/v into qkv_proj and gate/up into gate_up_proj), XverseModel
(model.embed_tokens, model.norm), XverseDecoderLayer (self_attn, input_layernorm, post_attention_layernorm; a MoE
mlp wherever num_experts is set), XverseMoE (per-expert XverseMLP modules mlp.experts.N.*, ReplicatedLinear
mlp.router, XverseMLP mlp.shared_experts intermediate_size * num_shared_experts wide), ParallelLMHead lm_head.
Public evidence for the layout: docs/families.md ("XVERSE-MoE").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, weight_map, write_synth

# xverse/XVERSE-MoE-A4.2B config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["XverseMoeForCausalLM"], "model_type": "xverse",
    "auto_map": {"AutoConfig": "configuration_xverse.XverseConfig",
                 "AutoModelForCausalLM": "modeling_xverse.XverseForCausalLM"},
    "num_shared_experts": 2, "hidden_act": "silu", "tie_word_embeddings": False, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
}

LAYER = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.router.weight",
         "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
         "mlp.shared_experts.down_proj.weight"}


def experts(n: int) -> set[str]:
    return {f"mlp.experts.{e}.{p}_proj.weight" for e in range(n) for p in ("gate", "up", "down")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-xverse-moe", tmp_path_factory.mktemp("xverse-moe") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 2 and cfg["num_experts"] == 8 and cfg["moe_top_k"] == 2
    # XVERSE's own key names (moe_top_k, num_experts, num_shared_experts; the expert width is intermediate_size),
    # none of DeepSeek's, no GQA key (SGLang defaults num_key_value_heads to num_attention_heads), no dense layers
    assert not {"num_experts_per_tok", "n_routed_experts", "moe_intermediate_size", "num_key_value_heads",
                "first_k_dense_replace", "decoder_sparse_step", "num_nextn_predict_layers"} & set(cfg)
    assert (tiny / "configuration_xverse.py").is_file()  # the class auto_map names, shipped alongside


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in range(2) for n in LAYER | experts(8)}  # every layer MoE
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, inter = 320, 80, 4, 128  # head_dim 80, as XVERSE-MoE-A4.2B's 2560 / 32
    for p in ("q", "k", "v"):  # MHA
        assert t[f"model.layers.0.self_attn.{p}_proj.weight"].shape == (heads * hd, h)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert t["model.layers.1.mlp.router.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (inter, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, inter)
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (2 * inter, h)  # two shared experts
    assert t["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (h, 2 * inter)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


# not config.json keys: attributes transformers' PretrainedConfig gives every config (pad_token_id: the XVERSE class
# passes it to PretrainedConfig)
DERIVED = {"pad_token_id"}


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` SGLang's xverse_moe.py reads directly (no getattr default, no hasattr guard) is in
    config.json."""
    path = engine_file_or_skip("sglang", "srt/models/xverse_moe.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"moe_top_k", "num_experts", "num_shared_experts", "intermediate_size"} <= read
    assert sorted(k for k in read - DERIVED if k not in cfg) == []


def test_vllm_does_not_register_it():
    """vLLM 0.33's registry has no XverseMoeForCausalLM (its row has one engine)."""
    path = engine_file_or_skip("vllm", "model_executor/models/registry.py")
    assert '"XverseMoeForCausalLM"' not in path.read_text()
