"""SDAR MoE (SDARMoeForCausalLM: JetLM/SDAR-30B-A3B-Chat, -Chat-b32, -Sci) without an engine: the tests' preset is
laid out as the release (config.json with the release's keys and its remote config class, the names SGLang's loader
consumes, every tensor BF16, one file per layer). vLLM 0.33 does not register the architecture: SGLang is its one
engine.

The expected names are written here by hand from SGLang 0.5.23 sdar_moe.py, not produced by the code under test:
SDARMoeForCausalLM.load_weights (stacked q/k/v into qkv_proj; the routed experts through
FusedMoE.make_expert_params_mapping, gate_proj / down_proj / up_proj; everything else by name), SDARMoeModel
(model.embed_tokens, model.norm), SDARMoeBlock (self_attn, input_layernorm, post_attention_layernorm; every layer an
SDARMoeSparseMoeBlock: no dense layer), SDARMoeAttention (QKVParallelLinear qkv_proj, RowParallelLinear o_proj,
RMSNorm q_norm / k_norm over head_dim), SDARMoeSparseMoeBlock (ReplicatedLinear mlp.gate, no bias; experts; no
shared expert), ParallelLMHead lm_head (untied). Public evidence for the layout: docs/families.md ("SDAR MoE").
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

# JetLM/SDAR-30B-A3B-Chat config.json (github.com/Xenearkr/DARE models/SDAR-30B-A3B-Chat/config.json, the Hub
# repo's copy): the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe",
    "auto_map": {"AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
                 "AutoModel": "modeling_sdar_moe.SDARMoeModel",
                 "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 32768, "norm_topk_prob": True,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
}

LAYER = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
         "post_attention_layernorm.weight", "mlp.gate.weight"}


def experts(n: int) -> set[str]:
    return {f"mlp.experts.{e}.{p}_proj.weight" for e in range(n) for p in ("gate", "up", "down")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-sdar-moe", tmp_path_factory.mktemp("sdar-moe") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 2 and cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["max_window_layers"] == cfg["num_hidden_layers"]  # the release's 48 of 48
    # head_dim is its own key: wider than hidden / heads (the release's 128 over 2048 / 32), as here (128 over 256 / 4)
    assert cfg["head_dim"] * cfg["num_attention_heads"] == 2 * cfg["hidden_size"]
    # Qwen3-MoE's keys; no shared expert, no dense-first layers, no MTP, no block-diffusion key in config.json (the
    # dense SDAR-4B / 8B configs carry block_size / mask_token_id; SGLang hard-codes them for this architecture)
    assert not {"shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                "num_nextn_predict_layers", "block_size", "mask_token_id"} & set(cfg)
    assert (tiny / "configuration_sdar_moe.py").is_file()  # the class auto_map names, shipped alongside


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in range(2) for n in LAYER | experts(8)}  # every layer MoE
    assert set(weight_map(tiny)) == want


def test_order_and_files_are_the_releases(tiny):
    """Per layer, as the release's index lists it: every expert's up_proj then gate_proj (expert by expert), then
    every expert's down_proj, the router, the attention, the norms; one file per layer, layer-L-ep-0-of-1 (the
    release's others.safetensors, embeddings / norm / lm_head, is the last layer's file here)."""
    wm = weight_map(tiny)
    names = list(wm)
    pre = "model.layers.0."
    want0 = ([f"{pre}mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("up", "gate")]
             + [f"{pre}mlp.experts.{e}.down_proj.weight" for e in range(8)]
             + [pre + n for n in ("mlp.gate.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                                  "self_attn.k_norm.weight", "input_layernorm.weight",
                                  "post_attention_layernorm.weight")])
    assert names[:len(want0)] == want0
    assert names[-3:] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for name, file in wm.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 1
        assert file == f"layer-{layer}-ep-0-of-1.safetensors"


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, kv, inter = 256, 128, 4, 2, 128
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (heads * hd, h)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (kv * hd, h)  # GQA
    assert t["model.layers.0.self_attn.v_proj.weight"].shape == (kv * hd, h)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert t["model.layers.0.self_attn.q_norm.weight"].shape == (hd,)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (inter, h)
    assert t["model.layers.1.mlp.experts.7.up_proj.weight"].shape == (inter, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, inter)
    assert t["lm_head.weight"].shape == (1000, h)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}  # the release: total_size = 2 bytes a parameter


# not config.json keys: attributes transformers' PretrainedConfig gives every config
DERIVED: set[str] = set()


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` SGLang's sdar_moe.py reads directly (no getattr default, no hasattr guard) is in
    config.json."""
    path = engine_file_or_skip("sglang", "srt/models/sdar_moe.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size"} <= read
    assert sorted(k for k in read - DERIVED if k not in cfg) == []


def test_sglang_hard_codes_the_block_diffusion_parameters():
    """The release's config.json holds no block size or mask token: SGLang's DllmConfig.from_server_args takes
    block 4 and mask id 151669 for SDARMoeForCausalLM (the model card's JetEngine example: block_length 4,
    mask_token_id 151669)."""
    path = engine_file_or_skip("sglang", "srt/dllm/config.py")
    assert '"SDARMoeForCausalLM": {"block_size": 4, "mask_id": 151669}' in path.read_text()


def test_vllm_does_not_register_it():
    """vLLM 0.33's registry has no SDARMoeForCausalLM (its row has one engine)."""
    path = engine_file_or_skip("vllm", "model_executor/models/registry.py")
    assert "SDARMoe" not in path.read_text()


def test_plan_with_the_shipped_table(tiny, monkeypatch, tmp_path):
    """Where a derived table ships for "sdar_moe", plan resolves every module of the release's layout with it and no
    engine: q/k/v/o and every routed expert NVFP4, the router (ReplicatedLinear built with quant_config None) and
    lm_head kept; q/k/v share one global scale (SGLang's qkv_proj), each expert's gate / up another (w13)."""
    if not (REPO / "mappings" / "derived" / "sdar_moe.toml").is_file():
        pytest.skip("no derived table ships for sdar_moe (docs/derived-architectures.md: its row)")
    from kimi_convert.derive.lookup import shipped_for
    from kimi_convert.plan import KEEP, NVFP4

    monkeypatch.setenv("KIMI_CONVERT_ENGINE_ENVS", str(tmp_path / "none"))  # no engine environment
    table = shipped_for(json.loads((tiny / "config.json").read_text()))
    assert table is not None and table.name == "derived-sdar_moe"
    kinds = plan_kinds(tiny)
    for i in range(2):
        pre = f"model.layers.{i}"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert kinds[f"{pre}.self_attn.{p}"] == NVFP4
        assert kinds[f"{pre}.mlp.gate"] == KEEP
    experts_ = {n: k for n, k in kinds.items() if ".mlp.experts." in n}
    assert len(experts_) == 2 * 8 * 3 and set(experts_.values()) == {NVFP4}
    assert kinds["lm_head"] == KEEP
    groups = {g.name: g.members for g in table.groups}
    assert groups["qkv_proj"] == ("q_proj", "k_proj", "v_proj")
