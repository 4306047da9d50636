"""MiniCPM-MoE-8x2B (MiniCPMForCausalLM with num_experts set) without an engine: the tests' preset is laid out as the
release (config.json with the release's keys and its remote config class, MiniCPM's muP scalings as config values,
tied embeddings with no lm_head stored, the names vLLM's loader consumes, every tensor BF16).

The expected names are written here by hand from the engines' loaders, not produced by the code under test: vLLM 0.33
minicpm.py MiniCPMModel.load_weights (stacked_params_mapping q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj;
expert_params_mapping "experts.{e}.w1/w3.weight" -> MiniCPMMoE.ws, "experts.{e}.w2.weight" -> w2s; the router
mlp.gate a GateLinear) with MiniCPMForCausalLM's lm_head tied to embed_tokens. SGLang 0.5.23 minicpm.py builds only
the dense MLP (MiniCPMDecoderLayer: mlp = MiniCPMMLP whatever num_experts is) and its load_weights maps the experts to
a "ws" / "w2s" it never creates: it cannot load the release (test below). Public evidence for the layout:
docs/families.md ("MiniCPM-MoE").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, weight_map, write_synth

# openbmb/MiniCPM-MoE-8x2B config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm",
    "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMConfig",
                 "AutoModel": "modeling_minicpm.MiniCPMModel",
                 "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM",
                 "AutoModelForSeq2SeqLM": "modeling_minicpm.MiniCPMForCausalLM",
                 "AutoModelForSequenceClassification": "modeling_minicpm.MiniCPMForSequenceClassification"},
    "num_experts": 8, "num_experts_per_tok": 2, "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4,
    "tie_word_embeddings": True, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_scaling": None,
    "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}

ATTN = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight"}


def moe(experts: int) -> set[str]:
    return {"mlp.gate.weight"} | {f"mlp.experts.{e}.w{i}.weight" for e in range(experts) for i in (1, 2, 3)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-minicpm-moe", tmp_path_factory.mktemp("minicpm-moe") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == cfg["num_attention_heads"]  # MHA
    assert "rope_theta" not in cfg  # the class default 10000
    assert (tiny / "configuration_minicpm.py").is_file()  # the class auto_map names, shipped alongside


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    names = set(weight_map(tiny))
    want = {"model.embed_tokens.weight", "model.norm.weight"}  # tied: no lm_head.weight stored
    want |= {f"model.layers.{i}.{n}" for i in range(2) for n in ATTN | moe(8)}
    assert names == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, heads, inter = 256, 4, 256
    hd = h // heads  # MiniCPMAttention: head_dim = hidden_size // num_heads (64 as released: 2304 / 36)
    assert t["model.embed_tokens.weight"].shape == (1000, h)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (heads * hd, h)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (heads * hd, h)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    # MiniCPMMoE.weight_loader: w1 -> ws[e, :I], w3 -> ws[e, I:], w2 -> w2s[e] ([H, I])
    assert t["model.layers.1.mlp.experts.7.w1.weight"].shape == (inter, h)
    assert t["model.layers.1.mlp.experts.7.w3.weight"].shape == (inter, h)
    assert t["model.layers.1.mlp.experts.7.w2.weight"].shape == (h, inter)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


def test_config_holds_every_key_vllm_reads_without_a_default(tiny):
    """Each ``config.X`` vLLM's minicpm.py reads directly (no getattr default, no hasattr guard) is in config.json or
    is an attribute transformers' PretrainedConfig (or the release's class) gives every config."""
    path = engine_file_or_skip("vllm", "model_executor/models/minicpm.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    derived = {"rope_parameters"}  # built by transformers from rope_theta / rope_scaling (the class sets them)
    assert {"num_experts_per_tok", "scale_emb", "dim_model_base", "scale_depth"} <= read  # found the file's keys
    assert sorted(k for k in read - derived if k not in cfg) == []


def test_sglang_builds_no_experts_for_minicpm(tiny):
    """SGLang 0.5.23's MiniCPMForCausalLM (an alias of MiniCPMSALAForCausalLM) builds a dense MiniCPMMLP in every
    layer whatever num_experts is, while its load_weights maps experts.{e}.w1/w2/w3 to "ws" / "w2s" parameters no
    module creates: the release cannot load there (the breadth row's SGLang message, a KeyError on mlp.ws)."""
    path = engine_file_or_skip("sglang", "srt/models/minicpm.py")
    text = path.read_text()
    assert "class MiniCPMForCausalLM(MiniCPMSALAForCausalLM)" in text
    assert "MiniCPMMoE" not in text and "self.ws" not in text  # no expert module, no ws parameter
    assert "self.mlp = MiniCPMMLP(" in text and '"ws" if weight_name in ["w1", "w3"] else "w2s"' in text
