"""Grok-2 (Grok1ForCausalLM, xai-org/grok-2) without an engine: the tests' preset is laid out as SGLang serves the
release (config.json with the release's keys and model_type "git", the names SGLang's loader consumes, BF16, each
routed expert whole in Mixtral's w1 / w2 / w3 naming).

The expected names are written here by hand from SGLang 0.5.23's srt/models/grok.py (Grok1ForCausalLM.load_weights:
stacked_params_mapping q_proj / k_proj / v_proj -> qkv_proj and gate_proj / up_proj -> gate_up_proj,
FusedMoE.make_expert_params_mapping with ckpt_gate_proj_name "w1", ckpt_down_proj_name "w2", ckpt_up_proj_name "w3";
Grok1DecoderLayer's pre_attn_norm / post_attn_norm / pre_moe_norm / post_moe_norm, block_sparse_moe.gate and, with
residual_moe, mlp), not produced by the code under test. vLLM 0.33 does not register the architecture (removed in
0.24.0). Public evidence for the layout: docs/families.md ("Grok").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, weight_map, write_synth

# xai-org/grok-2 config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["Grok1ForCausalLM"], "model_type": "git", "torch_dtype": "bfloat16",
    "embedding_multiplier_scale": 90.50966799187809, "output_multiplier_scale": 0.5, "num_experts_per_tok": 2,
    "num_local_experts": 8, "residual_moe": True, "head_dim": 128, "rms_norm_eps": 1e-05,
    "final_logit_softcapping": 50, "attn_logit_softcapping": 30.0, "router_logit_softcapping": 30.0,
    "rope_theta": 208533496, "attn_temperature_len": 1024, "sliding_window_size": -1, "global_attn_every_n": 1,
    "rope_type": "original", "scaling_factor": 16.0, "extrapolation_factor": 1.0, "attn_factor": 1.0,
    "beta_fast": 8, "beta_slow": 1,
}

LAYER = ({"pre_attn_norm.weight", "post_attn_norm.weight", "pre_moe_norm.weight", "post_moe_norm.weight",
          "block_sparse_moe.gate.weight"}
         | {f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")}
         | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
         | {f"block_sparse_moe.experts.{e}.w{i}.weight" for e in range(8) for i in (1, 2, 3)})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-grok1", tmp_path_factory.mktemp("grok1") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 2 and cfg["num_local_experts"] == 8
    # the context as released: original_max_position_embeddings x scaling_factor
    assert cfg["max_position_embeddings"] == cfg["original_max_position_embeddings"] * 16
    assert "auto_map" not in cfg  # transformers' GitConfig reads it: no remote code


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in (0, 1) for n in LAYER}
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, kv, e, inter, dense = 256, 128, 4, 2, 8, 128, 512
    pre = "model.layers.1"
    assert t[f"{pre}.self_attn.q_proj.weight"].shape == (heads * hd, h)
    assert t[f"{pre}.self_attn.k_proj.weight"].shape == t[f"{pre}.self_attn.v_proj.weight"].shape == (kv * hd, h)
    assert t[f"{pre}.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert t[f"{pre}.block_sparse_moe.gate.weight"].shape == (e, h)
    assert t[f"{pre}.block_sparse_moe.experts.7.w1.weight"].shape == (inter, h)  # gate
    assert t[f"{pre}.block_sparse_moe.experts.7.w3.weight"].shape == (inter, h)  # up
    assert t[f"{pre}.block_sparse_moe.experts.7.w2.weight"].shape == (h, inter)  # down
    assert t[f"{pre}.mlp.gate_proj.weight"].shape == (dense, h)  # the residual MLP beside the experts
    assert t[f"{pre}.mlp.down_proj.weight"].shape == (h, dense)
    assert t[f"{pre}.pre_moe_norm.weight"].shape == (h,)
    assert t["lm_head.weight"].shape == t["model.embed_tokens.weight"].shape == (1000, h)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` / ``model_config.X`` SGLang's grok.py reads directly (no getattr default, no hasattr guard)
    is in config.json."""
    path = engine_file_or_skip("sglang", "srt/models/grok.py")
    cfg = json.loads((tiny / "config.json").read_text())
    text = path.read_text()
    read = config_keys_read(text, "cfg|config|model_config")
    # not config.json keys: what GitConfig gives every config (pad_token_id defaults to 0)
    derived = {"pad_token_id"}
    assert {"num_local_experts", "num_experts_per_tok", "hidden_size"} <= read  # the reading found the file's keys
    missing = sorted(k for k in read - derived if k not in cfg)
    assert missing == []
