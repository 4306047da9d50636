"""Step 5 (Step5ForCausalLM) without an engine: the tests' preset is laid out as the release's text model (config.json
with the keys vLLM's Step5Config and model read, a sparse_config section, per-layer lists over the decoder layers,
the names vLLM's loader consumes, BF16 weights with the norms, the router bias and ssmax_s in F32, the routed experts
as three 3-D banks per MoE layer). vLLM 0.33 is its one engine (SGLang 0.5.23 registers no Step5 class).

The expected names are written here by hand from vLLM 0.33's loader, not produced by the code under test:
vllm/models/step5/nvidia/model.py Step5Model.load_weights (_STEP5_WEIGHT_SHARDS: q_proj / k_proj / v_proj / g_proj
into qkv_proj or qkvg_proj and g_proj, on full-attention layers with the sparse indexer's sparse_indexer_q / _k / _z
into qkv_indexer_proj; gate_proj / up_proj into gate_up_proj; its expert_params_mapping, the packed 3D format
``.moe.gate_proj.weight`` / ``.moe.up_proj.weight`` / ``.moe.down_proj.weight`` indexed by expert, and any other
``.moe.experts.`` name refused), Step5ForCausalLM.hf_to_vllm_mapper (STEP5_SHARE_EXPERT_MAPPER: ``.share_expert.`` ->
``.moe.share_expert.``), Step5Attention (sparse_indexer_w, ssmax_s, sparse_indexer_q_norm, the LayerNorm
sparse_indexer_k_norm with its bias, q_norm / k_norm), Step5MoE (GateLinear moe.gate, router_bias), Step5DecoderLayer
(the MoE layers from moe_layers_enum), Step5Model (model.embed_tokens, model.norm), ParallelLMHead lm_head.
Evidence for the layout: docs/families.md ("Step 5").

The shipped table (mappings/derived/step5.toml, derived from vLLM 0.33 in session 41) writes the routed experts as
stacked 3-D NVFP4 banks ([stacked]) and keeps the DSA projection's members BF16 (vLLM refuses to build
qkv_indexer_proj quantized; the derivation's build ignored it), in every layer: no config key a table reads tells the
full-attention layers apart.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file, engine_file_or_skip, read_tensors, run, weight_map, write_synth

# Step-5-Preview's text config: the values that are not sizes (sizes: the preset's). No config.json of the release is
# among the public sources; these are the values vLLM 0.33's Step5 code requires or reads and the public port of the
# preview checkpoint sets (tests/presets/step5.toml's header names each source).
RELEASE = {
    "architectures": ["Step5ForCausalLM"], "model_type": "step5",
    "head_dim": 192, "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16", "norm_dtype": "float32",
    "norm_expert_weight": True, "moe_router_activation": "sigmoid", "moe_router_scaling_factor": 3.0,
    "use_moe_router_bias": True, "need_fp32_gate": True, "att_impl_type": "GQA", "use_head_wise_attn_gate": True,
    "zero_centered": True, "fp32_residual_connection": True, "sliding_window": 512, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": [1, 2],
}
SPARSE = {
    "enabled": True, "proxy_dim": 256, "sparse_indexer_rope_dim": 32, "sparse_indexer_use_rope": True,
    "sparse_indexer_num_heads": 16, "sparse_indexer_num_k_heads": 1, "num_provider_groups": 4,
    "sparse_indexer_q_norm_type": "rmsnorm", "sparse_indexer_k_norm_type": "layernorm",
    "sparse_indexer_csa_z_norm_type": "none", "sparse_indexer_softmax_variant": "ssmax",
    "sparse_indexer_ssmax_s_granularity": "q_head", "topk": 512, "region_block_size": 8,
    "compression_method": "csa_block_compress", "attention_impl": "sparse_gqa",
    "apply_to_layer_types": ["full_attention"],
}

ATTN = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight", "self_attn.g_proj.weight",
        *(f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o"))}
INDEXER = {*(f"self_attn.sparse_indexer_{p}.weight" for p in ("q", "k", "z", "w", "q_norm", "k_norm")),
           "self_attn.sparse_indexer_k_norm.bias", "self_attn.ssmax_s"}
DENSE = {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
MOE = ({"moe.gate.weight", "moe.router_bias"} | {f"moe.{p}_proj.weight" for p in ("gate", "up", "down")}
       | {f"share_expert.{p}_proj.weight" for p in ("gate", "up", "down")})
# F32: the decoder's norms (the indexer's own norms are BF16, as vLLM builds them), the router bias, ssmax_s
F32 = ("layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight", "model.norm.weight", "router_bias",
       "ssmax_s")

MODEL = "models/step5/nvidia/model.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-step5", tmp_path_factory.mktemp("step5") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["sparse_config"] == SPARSE  # vLLM refuses a checkpoint without this section (dense-only)
    assert cfg["num_hidden_layers"] == 6 and cfg["moe_num_experts"] == 8 and cfg["num_nextn_predict_layers"] == 0
    assert cfg["moe_layers_enum"] == "3,4"  # a comma-separated string: vLLM's _parse_step5_layer_indices splits it
    # full attention every fourth layer (i % 4 == 3), sliding-window elsewhere
    assert cfg["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2
    assert cfg["partial_rotary_factors"] == [1.0] * 6
    # Step5's DSA kernels: 4, 8 or 16 query heads a KV group, one provider group a KV group, 2 or 4 indexer heads a
    # provider (model.py _validate_step5_dsa_parallel_geometry, config.py get_step5_sparse_config)
    assert cfg["num_attention_heads"] // cfg["num_attention_groups"] == 4
    assert SPARSE["num_provider_groups"] == cfg["num_attention_groups"]
    assert SPARSE["sparse_indexer_num_heads"] // SPARSE["num_provider_groups"] == 4
    # the config class's own keys, none of Step-3.5's (vLLM's Step5Config takes num_attention_groups, moe_top_k, ...)
    assert not {"num_key_value_heads", "num_experts_per_tok", "auto_map", "attention_other_setting"} & set(cfg)


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in (0, 1, 2, 5) for n in ATTN | DENSE}
    want |= {f"model.layers.3.{n}" for n in ATTN | INDEXER | MOE}  # full attention: the sparse indexer beside it
    want |= {f"model.layers.4.{n}" for n in ATTN | MOE}
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, kv, e, inter, proxy, ih = 256, 192, 16, 4, 8, 128, 256, 16
    for layer in (0, 3, 4):
        pre = f"model.layers.{layer}.self_attn"
        assert t[f"{pre}.q_proj.weight"].shape == (heads * hd, h)
        assert t[f"{pre}.k_proj.weight"].shape == t[f"{pre}.v_proj.weight"].shape == (kv * hd, h)
        assert t[f"{pre}.g_proj.weight"].shape == (heads, h)  # one gate a head
        assert t[f"{pre}.o_proj.weight"].shape == (h, heads * hd)
        assert t[f"{pre}.q_norm.weight"].shape == t[f"{pre}.k_norm.weight"].shape == (hd,)
    pre = "model.layers.3.self_attn"
    assert t[f"{pre}.sparse_indexer_q.weight"].shape == (ih * proxy, h)
    assert t[f"{pre}.sparse_indexer_k.weight"].shape == t[f"{pre}.sparse_indexer_z.weight"].shape == (proxy, h)
    assert t[f"{pre}.sparse_indexer_w.weight"].shape == (ih, h)
    assert t[f"{pre}.sparse_indexer_k_norm.bias"].shape == t[f"{pre}.sparse_indexer_q_norm.weight"].shape == (proxy,)
    assert t[f"{pre}.ssmax_s"].shape == (heads,)
    assert t["model.layers.5.mlp.gate_proj.weight"].shape == (512, h)  # the dense last layer
    # the routed experts as 3-D banks [E, out, in], the only form vLLM's Step5 loader reads
    assert t["model.layers.3.moe.gate_proj.weight"].shape == (e, inter, h)
    assert t["model.layers.3.moe.up_proj.weight"].shape == (e, inter, h)
    assert t["model.layers.3.moe.down_proj.weight"].shape == (e, h, inter)
    assert t["model.layers.3.moe.gate.weight"].shape == (e, h)
    assert t["model.layers.4.share_expert.down_proj.weight"].shape == (h, 128)
    f32 = {k for k in t if k.endswith(F32)}
    assert {t[k].dtype for k in f32} == {torch.float32} and "model.layers.3.moe.router_bias" in f32
    assert {v.dtype for k, v in t.items() if k not in f32} == {torch.bfloat16}


# not config.json keys: the KV-transfer config's attributes (model.py _verify_step5_dsa_kv_transfer_compatibility
# names that object ``config`` too); and two the model reads directly that the config class defaults to None and the
# model guards (``getattr(config, "attention_other_setting", None) and ...``, ``config.swiglu_limits or []``)
NOT_CONFIG = {"is_kv_transfer_instance", "kv_connector", "kv_connector_extra_config"}
CLASS_DEFAULTED = {"attention_other_setting", "swiglu_limits"}


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` vLLM's Step5 model file reads directly (no getattr default, no hasattr guard) is in
    config.json, and each of those the config class defaults is one it leaves None."""
    path, cls = engine_file("vllm", MODEL), engine_file("vllm", "transformers_utils/configs/step5.py")
    if path is None or cls is None:
        pytest.skip("no vllm environment under ~/.cache/kimi-convert/engines")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"moe_num_experts", "num_attention_groups", "use_moe_router_bias", "need_fp32_gate"} <= read
    assert sorted(k for k in read - NOT_CONFIG - CLASS_DEFAULTED if k not in cfg) == []
    for key in CLASS_DEFAULTED:
        assert re.search(rf"\b{key}: [^=\n]+ = None,", cls.read_text()), key


def test_sparse_config_names_what_vllms_reader_takes(tiny):
    """Every sparse_config key is a Step5SparseConfig field vLLM's get_step5_sparse_config reads (or the section's
    ``enabled`` / the checkpoint's ``num_provider_groups`` name for index_tp_size), none of the names it refuses."""
    path = engine_file_or_skip("vllm", "models/step5/nvidia/config.py")
    text = path.read_text()
    body = text.split("class Step5SparseConfig:", 1)[1].split("\n\n\n", 1)[0]
    fields = set(re.findall(r"^    (\w+): [\w\[\], .]+ = ", body, re.M))
    assert {"proxy_dim", "index_tp_size", "topk", "apply_to_layer_types"} <= fields
    assert '"num_provider_groups"' in text and "The checkpoint schema calls this field num_provider_groups" in text
    cfg = json.loads((tiny / "config.json").read_text())["sparse_config"]
    assert sorted(set(cfg) - fields - {"enabled", "num_provider_groups"}) == []
    assert "softmax_variant" not in cfg  # refused: "use sparse_indexer_softmax_variant"


def test_vllm_reads_the_routed_experts_only_as_banks():
    """vLLM's Step5 loader takes the 3-D banks and refuses any per-expert ``.moe.experts.`` name: an NVFP4 output
    must keep the banks (weight, weight_scale, weight_scale_2, input_scale, each indexed by expert), not the per-expert
    modules the tool writes for Step-3.5 (docs/families.md, "Step 5")."""
    path = engine_file_or_skip("vllm", MODEL)
    text = path.read_text()
    for proj, param in (("gate", "w13"), ("up", "w13"), ("down", "w2")):
        assert re.search(rf'f"\.moe\.experts\.routed_experts\.{{base_layer}}{param}_weight",\s*'
                         rf'"\.moe\.{proj}_proj\.weight"', text), proj
    assert re.search(r'"Unsupported Step5 MoE checkpoint tensor \{name!r\}: only "\s*"the packed 3D expert format is '
                     r'supported\."', text)
    assert "Step5 DSA layers fuse qkv with the sparse indexer into one" in text  # qkv_indexer_proj stays BF16


def test_sglang_does_not_register_it():
    """SGLang 0.5.23 has no Step5 model class (its row has one engine)."""
    path = engine_file_or_skip("sglang", "srt/models/step3p5.py")
    assert not any("Step5" in f.read_text(errors="ignore") for f in path.parent.glob("*.py"))


def test_inspect_counts_its_unsplit_banks_and_says_pack_does_not_split_them(tiny):
    """The experts are stored as 3-D banks no source encoding splits for step5 (vLLM's loader reads them only as
    banks): inspect counts them from the banks and says so, instead of "no expert weights were found"."""
    r = run("inspect", tiny)
    assert r.code == 0, r.stderr
    assert "tensors          8 experts per layer\n" in r.stdout, r.stdout
    assert "routed experts stored as 3-D banks no source encoding splits (model.layers.3.moe." in r.stdout


def test_the_shipped_table_keeps_the_dsa_projection_and_stacks_the_banks(tiny):
    """``plan`` finds the shipped derived table: each routed-expert bank one 3-D NVFP4 module (one global scale per
    expert, gate and up sharing expert e's), the members of layer 3's qkv_indexer_proj kept with every shard in the
    exclude list (vLLM's ``is_layer_skipped`` asks each shard of a packed module by the class's
    ``packed_modules_mapping``: all 7 must be named, else Step5FusedQKVIndexerLinear raises), o_proj and the shared
    expert NVFP4."""
    r = run("plan", tiny, "--json")
    assert r.code == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["mapping"]["file"] == "mappings/derived/step5.toml"
    mods = {m["name"]: m for m in plan["modules"]}
    for layer in (3, 4):
        for leaf, shape in {"gate_proj": [8, 128, 128], "up_proj": [8, 128, 128], "down_proj": [8, 256, 64]}.items():
            m = mods[f"model.layers.{layer}.moe.{leaf}"]
            assert (m["kind"], m["experts"], m["tensors"][0]["shape"]) == ("nvfp4", 8, shape), m["name"]
            assert not any(t["name"].endswith("input_scale") for t in m["tensors"])
        assert {mods[f"model.layers.{layer}.moe.{leaf}"]["quantization"]["shared_scale"]
                for leaf in ("gate_proj", "up_proj")} == {f"model.layers.{layer}.moe.w13"}
    shards = ["q_proj", "k_proj", "v_proj", "g_proj", "sparse_indexer_q", "sparse_indexer_k", "sparse_indexer_z"]
    assert {mods[f"model.layers.3.self_attn.{s}"]["kind"] for s in shards} == {"keep"}
    assert {f"model.layers.3.self_attn.{s}" for s in shards} <= set(plan["exclude_modules"])
    for n in ("model.layers.3.self_attn.o_proj", "model.layers.3.share_expert.down_proj",
              "model.layers.0.mlp.down_proj"):
        assert mods[n]["kind"] == "nvfp4", n
