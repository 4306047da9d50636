"""GLM-5.x and GLM-4.7-Flash without an engine: the presets are laid out as the releases (GLM-5.1's config keys,
GLM-5.2's index sharing, the DSA indexer only on layers that compute their own top-k, the MTP layer as the release
stores it), and the default plan keeps what both engines build unquantized.

The expected values are the releases' own (docs/families.md "GLM-5.x", "GLM-4.7-Flash" cites them), written here
by hand.
"""

from __future__ import annotations

import json

import pytest

from helpers import run, weight_map, write_synth

# zai-org/GLM-5.1's config.json: the values that are not sizes.
GLM51 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "attention_bias": False,
    "dtype": "bfloat16", "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820, "hidden_act": "silu",
    "index_head_dim": 128, "index_topk": 2048, "indexer_rope_interleave": True, "rope_interleave": True,
    "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_head_dim": 256,
    "head_dim": 64, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "num_nextn_predict_layers": 1,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "moe_layer_freq": 1,
}
# zai-org/GLM-4.7-Flash's: the same MLA head dims, its own router scale and rope keys.
GLM47 = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "routed_scaling_factor": 1.8,
    "rope_theta": 1000000.0, "partial_rotary_factor": 1.0, "topk_method": "noaux_tc", "n_shared_experts": 1,
    "num_nextn_predict_layers": 1, "eos_token_id": [154820, 154827, 154829], "tie_word_embeddings": False,
}
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    for preset in ("tiny-glm5", "tiny-glm4-moe-lite"):
        write_synth(preset, root / preset)
    return root


def test_configs_are_the_releases(ckpts):
    for preset, want in (("tiny-glm5", GLM51), ("tiny-glm4-moe-lite", GLM47)):
        cfg = json.loads((ckpts / preset / "config.json").read_text())
        assert {k: cfg.get(k) for k in want} == want, preset
    g5 = json.loads((ckpts / "tiny-glm5" / "config.json").read_text())
    assert (g5["index_topk_freq"], g5["index_skip_topk_offset"]) == (4, 3)  # GLM-5.2's index sharing


def test_indexer_only_where_the_layer_computes_its_top_k(ckpts):
    """GLM-5.2 (freq 4, offset 3): layers 0-2 compute their top-k, layer 3 reuses layer 2's; the MTP layer (4)
    always has an indexer; GLM-4.7-Flash has none."""
    names = set(weight_map(ckpts / "tiny-glm5"))
    for layer, has in ((0, True), (1, True), (2, True), (3, False), (4, True)):
        got = {f"model.layers.{layer}.self_attn.indexer.{t}" in names for t in INDEXER}
        assert got == {has}, layer
    assert not any(".indexer." in n for n in weight_map(ckpts / "tiny-glm4-moe-lite"))


@pytest.mark.parametrize(("preset", "mtp"), [("tiny-glm5", 4), ("tiny-glm4-moe-lite", 2)])
def test_mtp_layer_as_released(ckpts, preset, mtp):
    """The MTP layer: a full MoE layer plus eh_proj, enorm, hnorm, shared_head.norm; no embed_tokens or
    shared_head.head of its own (the draft takes the target's)."""
    names = set(weight_map(ckpts / preset))
    pre = f"model.layers.{mtp}"
    for t in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "mlp.gate.weight",
              "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight", "self_attn.q_a_proj.weight"):
        assert f"{pre}.{t}" in names, t
    assert f"{pre}.embed_tokens.weight" not in names and f"{pre}.shared_head.head.weight" not in names
    assert not any(n.startswith(f"model.layers.{mtp + 1}.") for n in names)


def test_default_plan_keeps_what_the_engines_build_unquantized(ckpts):
    """Without a hand table the shipped derived one is used: the indexer's wk / weights_proj (both engines'
    wk_weights_proj is unquantized) and the router kept, wq_b NVFP4; GLM-4.7-Flash's overlay keeps q_a / kv_a."""
    d = json.loads(run("plan", ckpts / "tiny-glm5", "--json").stdout)
    kinds = {m["name"]: m["kind"] for m in d["modules"]}
    assert kinds["model.layers.1.self_attn.indexer.wk"] == "keep"
    assert kinds["model.layers.1.self_attn.indexer.weights_proj"] == "keep"
    assert kinds["model.layers.1.mlp.gate"] == "keep"
    assert kinds["model.layers.1.self_attn.indexer.wq_b"] == "nvfp4"
    assert kinds["model.layers.1.self_attn.q_a_proj"] == "nvfp4"
    d = json.loads(run("plan", ckpts / "tiny-glm4-moe-lite", "--json").stdout)
    kinds = {m["name"]: m["kind"] for m in d["modules"]}
    assert kinds["model.layers.1.self_attn.q_a_proj"] == "keep"
    assert kinds["model.layers.1.self_attn.kv_a_proj_with_mqa"] == "keep"
    assert kinds["model.layers.1.self_attn.q_b_proj"] == "nvfp4"
