"""GLM-5.3-Flash without an engine: the tiny preset is laid out as the BF16 release (nested config, text tower under
``model.language_model.``, vision tower under ``model.visual.``, three KDA layers then one DSA layer, hyper-connection
parameters on every decoder layer but the MTP layer, dense first layers, one MTP layer after the decoder layers), and
``inspect`` reads its 0-based ``kda_layers``.

The expected values are the release's own (docs/families.md, "GLM-5.3-Flash", cites them): zai-org/GLM-5.3-Flash's
config.json values as public loaders transcribe them, and the checkpoint names transformers 5.20's
Glm5NextForConditionalGeneration and both engines' loaders read, written here by hand, not produced by the code
under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run, weight_map, write_synth
from kimi_convert.modelinfo import from_config

REPO = Path(__file__).resolve().parent.parent

RELEASE_TOP = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
               "image_token_id": 154854, "video_token_id": 154855, "tie_word_embeddings": False}
RELEASE_TEXT = {
    "model_type": "glm5_next_text", "qk_rope_head_dim": 0, "qk_nope_head_dim": 256, "v_head_dim": 256,
    "kv_lora_rank": 512, "mla_use_nope": True, "mhc": True, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "index_head_dim": 128, "index_kpool": 16, "index_topk": 2048, "index_kpool_compress": True,
    "index_kpool_always_select_tail": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "routed_scaling_factor": 2.5, "n_shared_experts": 1, "num_nextn_predict_layers": 1, "swiglu_limit": 10.0,
    "max_position_embeddings": 1048576,
}

HC = {f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")}
NORMS = {"input_layernorm.weight", "post_attention_layernorm.weight"}
KDA = {f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj",
                                         "g_b_proj", "o_proj", "o_norm", "q_conv1d", "k_conv1d", "v_conv1d")} | {
    "self_attn.A_log", "self_attn.dt_bias"}
MLA = {f"self_attn.{p}.weight" for p in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                         "kv_a_layernorm", "kv_b_proj", "o_proj")} | {
    f"self_attn.indexer.{p}" for p in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                                       "weights_proj.weight", "index_kpool_compress_ape",
                                       "index_kpool_compress_gate")}
DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
MOE = ({"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}
       | {f"mlp.experts.{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")}
       | {f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")})
MTP_OWN = {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_synth("tiny-glm5-next", tmp_path_factory.mktemp("glm5-next") / "g53")


def test_config_is_the_releases(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE_TOP} == RELEASE_TOP
    text = cfg["text_config"]
    assert {k: text[k] for k in RELEASE_TEXT} == RELEASE_TEXT
    # the release's pattern at 4 layers: three KDA layers, then a DSA layer (the release: layers 3, 7, ..., 43)
    assert text["layer_types"] == ["linear_attention"] * 3 + ["deepseek_sparse_attention"]
    assert text["linear_attn_config"]["kda_layers"] == [0, 1, 2]
    assert text["linear_attn_config"]["full_attn_layers"] == [3]
    assert text["linear_attn_config"]["num_heads"] == text["num_attention_heads"]
    assert text["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    assert cfg["vision_config"]["model_type"] == "glm5_next_vision"
    assert cfg["vision_config"]["out_hidden_size"] == text["hidden_size"]


def test_tensors_are_the_releases(ckpt):
    names = set(weight_map(ckpt))
    lm = "model.language_model"
    for layer, want in ((0, HC | NORMS | KDA | DENSE), (1, HC | NORMS | KDA | MOE), (3, HC | NORMS | MLA | MOE),
                        (4, NORMS | MLA | MOE | MTP_OWN)):
        pre = f"{lm}.layers.{layer}."
        assert {n[len(pre):] for n in names if n.startswith(pre)} == want, layer
    assert {f"{lm}.embed_tokens.weight", f"{lm}.norm.weight", "lm_head.weight", "model.visual.patch_embed.proj.weight",
            "model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.gate_proj.weight",
            "model.visual.downsample.weight", "model.visual.post_layernorm.weight"} <= names
    assert not any(n.startswith(f"{lm}.layers.4.") and "embed_tokens" in n for n in names)


def test_inspect_gives_benchmark_moe_values(ckpt):
    """vLLM's benchmarks/kernels/benchmark_moe.py (main, vllm-project/vllm at 71acd375) has no Glm5Next branch; its
    DeepSeek / GLM branch takes E = n_routed_experts, topk = num_experts_per_tok, intermediate_size =
    moe_intermediate_size (the default branch would read intermediate_size, the dense layers' width)."""
    r = run("inspect", ckpt, "--json")
    assert r.code == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["num_experts"], d["top_k"], d["moe_intermediate_size"], d["hidden_size"]) == (8, 2, 128, 256)
    assert d["moe_layers"] == [1, 2, 3]
    assert d["layer_kinds"] == {"kda": [0, 1, 2], "mla": [3]}  # 0-based, unlike K3's lists
    assert d["tensor_experts"] == 8 and d["tensor_expert_shape"] == [128, 256] and not d["warnings"]


def test_release_values_without_weights():
    """The released config (45 layers: every fourth a DSA layer, the first three dense): 288 experts, top 8."""
    n = 45
    info = from_config({"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
                        "text_config": {"hidden_size": 4096, "num_hidden_layers": n, "n_routed_experts": 288,
                                        "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                                        "intermediate_size": 12288, "first_k_dense_replace": 3,
                                        "linear_attn_config": {
                                            "kda_layers": [i for i in range(n) if i % 4 != 3],
                                            "full_attn_layers": [i for i in range(n) if i % 4 == 3]}}})
    assert (info.num_experts, info.top_k, info.moe_intermediate_size, info.hidden_size) == (288, 8, 2048, 4096)
    assert len(info.layer_kinds["kda"]) == 34 and info.layer_kinds["mla"][:2] == [3, 7] and info.moe_layers[0] == 3


def test_the_derived_table_reads_the_engines_answers():
    """The table the recorded answers of vLLM 0.33.0 and SGLang 0.5.23 give (the shipped
    mappings/derived/glm5_next.toml: tests/test_derive.py) keeps what vLLM builds unquantized, the vision blocks
    numbered. Two rules were fixed for it: a group whose parents include one outside the numbered layers (the vision
    merger's gate_up_proj) stopped the layer-type rule with a ValueError, and the vision blocks were not numbered (a
    keep for block 0 only)."""
    from kimi_convert.derive import from_views, load_answers, load_draft_answers

    answers = REPO / "tests" / "derived" / "tiny-glm5-next.answers.json"
    views, config, shapes = load_answers(answers)
    d = from_views(views, config, shapes, load_draft_answers(answers))
    keeps = {k["pattern"] for k in d.table["keep"]}
    assert {"model.visual.blocks.*.attn.qkv", "model.visual.merger.proj", "model.language_model.layers.*.mlp.gate",
            "model.language_model.layers.*.self_attn.q_proj"} <= keeps  # vLLM builds all of these unquantized
    assert not any(".0." in k for k in keeps)
    (w13,) = d.table["scale_group"]
    assert w13["parents"] == ["model.language_model.layers.{layer}.mlp.experts.{expert}"]
