"""MiniMax M3 without an engine: the tiny preset is laid out as the BF16 release (nested config, text model
under ``language_model.``, CLIP vision tower, dense-first layers, sparse-attention MoE layers with the
lightning indexer's projections, MTP modules), and a mapping can tell sparse-attention layers from their
per-layer 0/1 flags (``sparse_attention_freq``).

The expected values are the release's own (docs/families.md, "MiniMax M3", cites them): MiniMaxAI/MiniMax-M3's
config.json and tensor names, written here by hand, not produced by the code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import one_line_error, run, synth_preset, weight_map, write_synth
from kimi_convert.errors import ConvertError
from kimi_convert.mapping import parse_mapping

# MiniMaxAI/MiniMax-M3 config.json, the values that are not sizes (sizes: the preset's).
RELEASE_TOP = {
    "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
    "auto_map": {"AutoConfig": "configuration_minimax_m3_vl.MiniMaxM3VLConfig"}, "image_seq_length": 576,
    "image_token_index": 200025, "video_token_index": 200026, "multimodal_projector_bias": True,
    "num_reward_heads": 0, "process_image_mode": "dynamic_res", "projector_hidden_act": "gelu",
    "torch_dtype": "bfloat16", "transformers_version": "4.52.4", "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
}
RELEASE_TEXT = {
    "architectures": ["MiniMaxM3SparseForCausalLM"], "head_dim": 128, "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-06, "use_gemma_norm": True, "attention_output_gate": False, "rope_theta": 5000000,
    "rotary_dim": 64, "partial_rotary_factor": 0.5, "hidden_act": "swigluoai", "use_qk_norm": True,
    "qk_norm_type": "per_head", "tie_word_embeddings": False, "n_shared_experts": 1, "scoring_func": "sigmoid",
    "use_routing_bias": True, "num_nextn_predict_layers": 1, "swiglu_alpha": 1.702, "swiglu_beta": 1.0,
    "swiglu_limit": 7.0, "routed_scaling_factor": 2.0,
}
RELEASE_SPARSE = {"use_sparse_attention": True, "sparse_index_dim": 128, "sparse_topk_blocks": 16,
                  "sparse_block_size": 128, "sparse_score_type": "max", "sparse_init_block": 0,
                  "sparse_local_block": 1}

ATTN = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight"}
INDEXER = {"self_attn.index_q_proj.weight", "self_attn.index_k_proj.weight", "self_attn.index_q_norm.weight",
           "self_attn.index_k_norm.weight"}
DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
MOE = ({"block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias"}
       | {f"block_sparse_moe.experts.{e}.w{i}.weight" for e in range(8) for i in (1, 2, 3)}
       | {f"block_sparse_moe.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_synth("tiny-minimax-m3", tmp_path_factory.mktemp("minimax-m3") / "m3")


def test_config_is_the_releases(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE_TOP} == RELEASE_TOP
    text = cfg["text_config"]
    assert {k: text[k] for k in RELEASE_TEXT} == RELEASE_TEXT
    assert {k: text["sparse_attention_config"][k] for k in RELEASE_SPARSE} == RELEASE_SPARSE
    # the release's structure at 3 layers: dense first, then sparse-attention MoE layers (the release: 3 + 57)
    assert text["moe_layer_freq"] == [0, 1, 1]
    for key in ("sparse_attention_freq", "sparse_disable_index_value"):
        assert text["sparse_attention_config"][key] == [0, 1, 1]
    # as many index heads as KV heads (the release: 4 and 4)
    assert text["sparse_attention_config"]["sparse_num_index_heads"] == text["num_key_value_heads"]
    assert cfg["vision_config"]["model_type"] == "clip_vision_model"
    assert cfg["vision_config"]["img_token_compression_config"] == {
        "image_token_compression_method": "patch_merge", "spatial_merge_size": 2, "temporal_patch_size": 2}


def test_tensors_are_the_releases(ckpt):
    names = set(weight_map(ckpt))
    lm = "language_model.model"
    for layer, want in ((0, ATTN | DENSE), (1, ATTN | INDEXER | MOE), (2, ATTN | INDEXER | MOE)):
        pre = f"{lm}.layers.{layer}."
        assert {n[len(pre):] for n in names if n.startswith(pre)} == want, layer
    mtp = f"{lm}.mtp.layers.0."
    assert {n[len(mtp):] for n in names if n.startswith(mtp)} == (
        {"enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"}
        | {f"transformer_layer.{n}" for n in ATTN | INDEXER | MOE})
    assert {f"{lm}.embed_tokens.weight", f"{lm}.norm.weight", "language_model.lm_head.weight",
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            "vision_tower.vision_model.encoder.layers.0.self_attn.out_proj.weight",
            "multi_modal_projector.linear_2.weight", "patch_merge_mlp.linear_1.weight"} <= names
    assert not any("post_layernorm" in n for n in names)  # the release ships none


def test_inspect_gives_benchmark_moe_values(ckpt):
    """vLLM's benchmarks/kernels/benchmark_moe.py (main, vllm-project/vllm at 71acd375) has no MiniMax branch:
    MiniMaxM3SparseForConditionalGeneration takes the default one on config.get_text_config(): E =
    num_local_experts, topk = num_experts_per_tok, intermediate_size = intermediate_size (the experts' width)."""
    r = run("inspect", ckpt, "--json")
    assert r.code == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["num_experts"], d["top_k"], d["moe_intermediate_size"], d["hidden_size"]) == (8, 2, 128, 256)
    assert d["moe_layers"] == [1, 2]  # moe_layer_freq [0, 1, 1]: one flag a layer, not a step
    assert d["layer_kinds"] == {"attention": [0], "sparse_attention": [1, 2]}
    assert d["tensor_experts"] == 8 and d["tensor_expert_shape"] == [128, 256] and not d["warnings"]


TABLE = """
name = "t"
description = "t"
architectures = ["MiniMaxM3SparseForConditionalGeneration"]
model_types = ["minimax_m3_vl"]
text_config = "text_config"
text_prefix = "language_model."
[layer_types.sparse_attention_freq]
config = "sparse_attention_config.sparse_attention_freq"
per_layer = true
"""


def test_a_layer_type_is_read_from_per_layer_flags():
    """``per_layer``: entry i of the config's list says whether layer i is of the type (MiniMax M3's
    ``sparse_attention_freq``, one 0/1 flag a layer), where a plain layer type reads a list of layer numbers."""
    m = parse_mapping(TABLE, "t.toml")
    cfg = {"text_config": {"sparse_attention_config": {"sparse_attention_freq": [0, 0, 1, 0, 1]}}}
    assert m.layer_kinds(cfg) == {2: "sparse_attention_freq", 4: "sparse_attention_freq"}
    cfg["text_config"]["sparse_attention_config"]["sparse_attention_freq"] = [False, True]
    assert m.layer_kinds(cfg) == {1: "sparse_attention_freq"}
    # the same list read as layer numbers names layers 0, 0, 1, 0, 1
    plain = parse_mapping(TABLE.replace("per_layer = true", ""), "t.toml")
    assert plain.layer_kinds({"text_config": {"sparse_attention_config": {"sparse_attention_freq": [1, 3]}}}) == {
        1: "sparse_attention_freq", 3: "sparse_attention_freq"}


def test_per_layer_flags_malformed_are_one_line():
    m = parse_mapping(TABLE, "t.toml")
    for bad in ([0, "x"], [0, 2], 3):
        with pytest.raises(ConvertError, match=r"^config.json: text_config\.sparse_attention_config\."
                                               r"sparse_attention_freq must be a list of 0/1 flags, one a layer$"):
            m.layer_kinds({"text_config": {"sparse_attention_config": {"sparse_attention_freq": bad}}})
    with pytest.raises(ConvertError, match="per_layer"):
        parse_mapping(TABLE.replace("per_layer = true", 'per_layer = "yes"'), "t.toml")


REPO = Path(__file__).resolve().parent.parent


def _shipped():
    """The derived table as plan finds it (mappings/derived/minimax_m3_vl.toml with its overlay), and the table the
    recorded answers of vLLM 0.33.0 / SGLang 0.5.23 give (``mapping derive tiny-minimax-m3 --answers``)."""
    from kimi_convert.derive import from_views, load_answers, load_draft_answers

    answers = REPO / "tests" / "derived" / "tiny-minimax-m3.answers.json"
    return from_views(*load_answers(answers), load_draft_answers(answers))


def test_the_derived_table_reads_the_engines_fusions():
    """The table the recorded answers give (the shipped mappings/derived/minimax_m3_vl.toml: tests/test_derive.py)."""
    t = _shipped().table
    # vLLM's five-shard qkv_proj on the sparse-attention layers only, told by a per-layer 0/1 list; SGLang's
    # index_qkv_proj beside its own q/k/v qkv_proj; both engines' q/k/v qkv_proj on the dense-attention layer
    groups = {(g["name"], tuple(g.get("engines", ()))): g for g in t["group"]}
    five = groups[("qkv_proj", ("vllm",))]
    assert five["members"] == ["q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj"]
    assert t["layer_types"][five["layer_type"]]["per_layer"] is True
    assert groups[("index_qkv_proj", ("sglang",))]["members"] == ["index_q_proj", "index_k_proj"]
    assert groups[("qkv_proj", ())]["members"] == ["q_proj", "k_proj", "v_proj"]
    # the routed experts' w13 (w1, w3) and the shared expert SGLang fuses into the bank (gate, up): two scale
    # groups, named apart; moe_layer_freq read as one flag a layer
    assert sorted((s["name"], tuple(s["members"])) for s in t["scale_group"]) == [
        ("w13", ("w1", "w3")), ("w13_2", ("gate_proj", "up_proj"))]
    assert t["moe"]["flags"] == "moe_layer_freq" and "every" not in t["moe"]
    # the MTP modules' block, not the whole text model under language_model.
    assert t["mtp"]["prefix"] == "language_model.model.mtp." and t["mtp"]["count"] == ["num_mtp_modules"]


def test_the_default_plan_keeps_the_indexer_and_the_sparse_layers_qkv(ckpt):
    """The overlay's rule: vLLM's MinimaxM3QKVParallelLinearWithIndexer takes no NVFP4 index_q/index_k (its
    per-tensor scale knows shards q, k, v only), so they and the q/k/v fused with them stay BF16 on the
    sparse-attention layers 1 and 2, and on the MTP layer (vLLM's MiniMaxM3MTP builds it force_sparse_attn);
    the rest of the MTP layer is NVFP4 (the draft reads it so), named as the draft asks (lm_head,
    model.layers.0.self_attn.qkv_proj), which both engines' exclusion rules also read as the main model's layer 0
    attention: its q/k/v are kept with the MTP layer's (issue 39; docs/families.md, "MiniMax M3's drafts")."""
    r = run("plan", ckpt, "--json")
    assert r.code == 0, r.stderr
    plan = json.loads(r.stdout)
    mods = {m["name"]: m for m in plan["modules"]}
    att = "language_model.model.layers.{}.self_attn.{}"
    mtp_att = "language_model.model.mtp.layers.0.transformer_layer.self_attn.{}"
    for layer in (1, 2):
        for p in ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj"):
            assert mods[att.format(layer, p)]["kind"] == "keep", (layer, p)
        assert mods[att.format(layer, "o_proj")]["kind"] == "nvfp4"
    assert mods["language_model.model.layers.1.block_sparse_moe.gate"]["kind"] == "keep"
    for p in ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj"):
        assert mods[mtp_att.format(p)]["kind"] == "keep", p
        assert "MiniMaxM3MTP" in mods[mtp_att.format(p)]["rule"]
    for name in ("language_model.model.mtp.layers.0.eh_proj", mtp_att.format("o_proj"),
                 "language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.shared_experts.down_proj",
                 "language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.experts.0.w1"):
        assert mods[name]["kind"] == "nvfp4", name
    assert mods["language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.gate"]["kind"] == "keep"
    assert [n for n in plan["exclude_modules"] if n.startswith(("model.", "lm_head"))] == [
        "lm_head", "model.layers.0.self_attn.qkv_proj"]
    for p in ("q_proj", "k_proj", "v_proj"):  # layer 0 (dense attention): kept with the MTP layer's, o_proj not
        assert mods[att.format(0, p)]["kind"] == "keep" and mtp_att.format(p) in mods[att.format(0, p)]["rule"]
    assert mods[att.format(0, "o_proj")]["kind"] == "nvfp4"


@pytest.mark.parametrize(("flags", "says"), [
    ([1, 1, 1], "num_local_experts 8 makes layer 0 a MoE layer, but language_model.model.layers.0 holds no routed "
                "experts"),
    ([0, 0, 1], "moe_layer_freq [0, 0, 1] makes layer 1 dense, but language_model.model.layers.1."
                "block_sparse_moe.experts holds 8 routed experts"),
    ([0, 2, 1], "moe_layer_freq is [0, 2, 1], expected a list of 0/1 flags, one a layer"),
])
def test_moe_layer_flags_held_against_the_tensors(ckpt, tmp_path, flags, says):
    """[moe] flags: MiniMax M3's moe_layer_freq, one 0/1 flag a layer, says which layers hold routed experts."""
    bad = tmp_path / "m3"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["moe_layer_freq"] = flags
    (bad / "config.json").write_text(json.dumps(cfg))
    assert says in one_line_error(run("plan", bad))


def test_inspect_gives_the_releases_moe_values_without_weights(tmp_path):
    """MiniMaxAI/MiniMax-M3's text_config (docs/families.md, "MiniMax M3"): 128 experts of 3072, top-4, hidden
    6144; moe_layer_freq and sparse_attention_freq [0]*3 + [1]*57 (3 dense-attention dense layers, then 57)."""
    flags = [0] * 3 + [1] * 57
    cfg = {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
           "text_config": {"hidden_size": 6144, "intermediate_size": 3072, "dense_intermediate_size": 12288,
                           "num_hidden_layers": 60, "num_local_experts": 128, "num_experts_per_tok": 4,
                           "moe_layer_freq": flags, "sparse_attention_config": {"sparse_attention_freq": flags}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run("inspect", tmp_path)
    assert r.code == 0, r.stderr
    assert "benchmark_moe    E=128 topk=4 moe_intermediate_size=3072 hidden_size=6144" in r.stdout, r.stdout
    d = json.loads(run("inspect", tmp_path, "--json").stdout)
    assert d["moe_layers"] == list(range(3, 60))
    assert d["layer_kinds"] == {"attention": [0, 1, 2], "sparse_attention": list(range(3, 60))}


def test_the_bench_preset_is_the_releases_width():
    """bench-minimax-m3 (benchmarks/RESULTS.md): the release's widths at two layers and 16 experts, a few GB."""
    import math

    from helpers import synth_preset
    from kimi_convert import synth

    p = synth_preset("bench-minimax-m3")
    text = synth.config(p)["text_config"]
    assert {k: text[k] for k in ("hidden_size", "intermediate_size", "dense_intermediate_size", "num_attention_heads",
                                 "num_key_value_heads", "head_dim")} == {
        "hidden_size": 6144, "intermediate_size": 3072, "dense_intermediate_size": 12288, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128}
    assert text["sparse_attention_config"]["sparse_num_index_heads"] == 4
    assert text["moe_layer_freq"] == text["sparse_attention_config"]["sparse_attention_freq"] == [0, 1]
    size = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in synth.tensor_specs(p))
    assert 3.0e9 < size < 3.5e9


def test_the_default_output_verifies_under_the_engines_matching_rules(ckpt, tmp_path):
    """verify-manifest without an engine: among its checks, the exclude list under vLLM's and SGLang's own matching
    rules; the MTP modules' kept expert bank is named as the engines match it (the overlay's expert_sets; before:
    'vllm would quantize language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.experts, which is
    written keep')."""
    out = tmp_path / "out"
    r = run("pack", ckpt, out, "-q", "--device", "cpu")
    assert r.code == 0, r.stderr
    r = run("verify-manifest", out, "--input", ckpt)
    assert r.code == 0, r.stdout + r.stderr
    assert "ok    exclude list / quantized_layers under vLLM's and SGLang's matching rules" in r.stdout


def test_a_derived_table_does_not_warn_about_its_mtp_block_where_the_input_stores_none():
    """The shipped derived table names MiniMax M3's MTP modules (``language_model.model.mtp.``, its ``[mtp]`` block
    prefix); bench-minimax-m3 stores none (a release re-saved without them): no entry under the block is reported.
    On the tiny preset, which stores one, a misspelt MTP entry still is."""
    import dataclasses

    from kimi_convert import synth
    from kimi_convert.derive.lookup import shipped_for

    def modules(p) -> list[str]:
        return sorted({n.rpartition(".")[0] for n, _, _ in synth.tensor_specs(p)})

    bench, tiny = synth_preset("bench-minimax-m3"), synth_preset("tiny-minimax-m3")
    assert not any(".mtp." in m for m in modules(bench)) and any(".mtp." in m for m in modules(tiny))
    m = shipped_for(synth.config(tiny))
    assert m.mtp is not None and m.optional_blocks == ()
    assert m.unmatched(modules(bench)) == []
    assert m.unmatched(modules(tiny)) == []
    typo = dataclasses.replace(m, expert_sets=(*m.expert_sets,
                                               "language_model.model.mtp.layers.{layer}.block_sparse_moe.expertz"))
    assert [w.split(": ", 1)[1] for w in typo.unmatched(modules(tiny))] == [
        "expert_sets 'language_model.model.mtp.layers.{layer}.block_sparse_moe.expertz' matches no module of the input"]
