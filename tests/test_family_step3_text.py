"""Step-3's text model (Step3TextForCausalLM) without an engine: the tests' preset is the text part of the release
(stepfun-ai/step3) laid out as vLLM serves it (config.json with the text config's keys, model_type "step3_text", the
names vLLM's loader consumes, BF16, the routed experts as three 3-D banks per MoE layer).

The expected names are written here by hand from vLLM 0.33's model_executor/models/step3_text.py
(Step3TextModel.load_weights: qkv_params_mapping .q_proj / .k_proj / .v_proj into the ReplicatedLinear qkv_proj,
stacked_params_mapping .gate_proj / .up_proj -> .gate_up_proj for the dense and shared MLPs, expert_params_mapping
.moe.gate_proj.weight / .moe.up_proj.weight -> w13_weight and .moe.down_proj.weight -> w2_weight, each indexed
loaded_weight[expert_id]; Step3TextAttention's inter_norm and wq; FusedMoEBlock's gate), not produced by the code under
test. SGLang 0.5.23 does not register the architecture. Evidence: docs/families.md ("Step-3 text").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, weight_map, write_synth

# stepfun-ai/step3 text_config: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["Step3TextForCausalLM"], "model_type": "step3_text", "num_attention_groups": 1,
    "head_dim": 256, "moe_top_k": 3, "rope_theta": 500000, "rope_scaling": None, "rms_norm_eps": 1e-05,
    "norm_expert_weight": False, "torch_dtype": "bfloat16",
}

ATTN = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.inter_norm.weight",
        "self_attn.wq.weight", *(f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o"))}
DENSE = {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
MOE = ({"moe.gate.weight"} | {f"moe.{p}_proj.weight" for p in ("gate", "up", "down")}
       | {f"share_expert.{p}_proj.weight" for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-step3-text", tmp_path_factory.mktemp("step3_text") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 3 and cfg["moe_num_experts"] == 8
    assert cfg["moe_layers_enum"] == "1"  # a comma-separated string: vLLM's decoder layer splits it
    assert "auto_map" not in cfg  # vLLM's own Step3TextConfig reads it


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in (0, 2) for n in ATTN | DENSE}  # dense first and last layers
    want |= {f"model.layers.1.{n}" for n in ATTN | MOE}
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, sq, e, inter = 256, 256, 4, 128, 8, 128
    pre = "model.layers.1"
    assert t[f"{pre}.self_attn.q_proj.weight"].shape == (sq, h)  # the shared low-rank query
    assert t[f"{pre}.self_attn.inter_norm.weight"].shape == (sq,)
    assert t[f"{pre}.self_attn.wq.weight"].shape == (heads * hd, sq)
    assert t[f"{pre}.self_attn.k_proj.weight"].shape == t[f"{pre}.self_attn.v_proj.weight"].shape == (hd, h)  # 1 KV
    assert t[f"{pre}.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert t[f"{pre}.moe.gate.weight"].shape == (e, h)
    # the routed experts as 3-D banks [E, out, in]
    assert t[f"{pre}.moe.gate_proj.weight"].shape == t[f"{pre}.moe.up_proj.weight"].shape == (e, inter, h)
    assert t[f"{pre}.moe.down_proj.weight"].shape == (e, h, inter)
    assert t[f"{pre}.share_expert.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (512, h)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` vLLM's step3_text.py reads directly (no getattr default, no hasattr guard) is in
    config.json."""
    path = engine_file_or_skip("vllm", "model_executor/models/step3_text.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    # not config.json keys: what vLLM's Step3TextConfig derives (rope_parameters from rope_theta / rope_scaling) and
    # PretrainedConfig gives every config (tie_word_embeddings; the model's lm_head is its own tensor either way)
    derived = {"rope_parameters", "tie_word_embeddings"}
    assert {"moe_num_experts", "share_q_dim", "hidden_size"} <= read  # the reading found the file's keys
    missing = sorted(k for k in read - derived if k not in cfg)
    assert missing == []
