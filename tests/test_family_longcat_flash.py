"""LongCat-Flash (LongcatFlashForCausalLM: meituan-longcat/LongCat-Flash-Chat, -Thinking) without an engine: the tests'
preset is laid out as the release (config.json with the release's keys and its remote config class, the names both
engines' loaders consume, BF16 with the router in F32, the MTP layer under ``model.mtp.``).

The expected names are written here by hand from the engines' loaders, not produced by the code under test:
vLLM 0.33 longcat_flash.py (FlashDecoderLayer: self_attn / input_layernorm / post_attention_layernorm as two-entry
ModuleLists, mlps.{0,1} FlashMLP, mlp LongcatMoe with router.classifier / router.e_score_correction_bias over
n_routed_experts + zero_expert_num rows; FlashModel.load_weights: q_a_proj + kv_a_proj_with_mqa into
fused_qkv_a_proj, gate_proj + up_proj into gate_up_proj outside the MoE, experts by get_expert_mapping over
n_routed_experts, names starting ``mtp.`` skipped), SGLang 0.5.23 longcat_flash.py (the same modules;
LongcatFlashForCausalLM.load_weights skips names holding ``mtp``), and the MTP layer's names from vLLM
longcat_flash_mtp.py LongCatFlashMTP.load_weights ``new_to_old_names_mapping`` and SGLang longcat_flash_nextn.py
LongcatFlashForCausalLMNextN.load_weights ``weight_names_mapping``. Public evidence: docs/families.md ("LongCat-Flash").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import config_keys_read, engine_file, engine_file_or_skip, read_tensors, weight_map, write_synth

# meituan-longcat/LongCat-Flash-Chat config.json (as huggingface.co/mlx-community/LongCat-Flash-Chat-bf16 copies it):
# the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash",
    "auto_map": {"AutoConfig": "configuration_longcat_flash.LongcatFlashConfig",
                 "AutoModel": "modeling_longcat_flash.LongcatFlashModel",
                 "AutoModelForCausalLM": "modeling_longcat_flash.LongcatFlashForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "attention_method": "MLA", "bos_token_id": 1,
    "eos_token_id": 2, "max_position_embeddings": 131072, "mla_scale_kv_lora": True, "mla_scale_q_lora": True,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-05,
    "rope_theta": 10000000.0, "routed_scaling_factor": 6.0, "use_cache": True, "zero_expert_type": "identity",
}
# the release's size keys (the preset reduces their values)
SIZES = {"expert_ffn_hidden_size", "ffn_hidden_size", "hidden_size", "kv_lora_rank", "moe_topk", "n_routed_experts",
         "num_attention_heads", "num_layers", "q_lora_rank", "vocab_size", "zero_expert_num"}

H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V, FFN, EXPERT, E, Z = 256, 2, 128, 128, 128, 64, 128, 512, 128, 8, 4

MLA = {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
       "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
DENSE = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
LAYER = ({f"{norm}.{i}.weight" for norm in ("input_layernorm", "post_attention_layernorm") for i in (0, 1)}
         | {f"self_attn.{i}.{n}" for i in (0, 1) for n in MLA}
         | {f"mlps.{i}.{n}" for i in (0, 1) for n in DENSE}
         | {"mlp.router.classifier.weight", "mlp.router.e_score_correction_bias"})
# the MTP layer, as both engines' draft loaders name it (the FP8 release's weight_scale_inv aside)
MTP = ({"model.mtp.embed_tokens.weight", "model.mtp.norm.weight", "model.mtp.layers.0.eh_proj.weight",
        "model.mtp.layers.0.enorm.m.weight", "model.mtp.layers.0.hnorm.m.weight",
        "model.mtp.layers.0.input_layernorm.weight", "model.mtp.layers.0.post_attention_layernorm.weight"}
       | {f"model.mtp.layers.0.self_attn.{n}" for n in MLA}
       | {f"model.mtp.layers.0.transformer_layer.mlp.{n}" for n in DENSE})


def experts(n: int) -> set[str]:
    return {f"mlp.experts.{e}.{p}_proj.weight" for e in range(n) for p in ("gate", "up", "down")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-longcat-flash", tmp_path_factory.mktemp("longcat-flash") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert set(cfg) == set(RELEASE) | SIZES  # the release's keys, no other
    assert (cfg["num_layers"], cfg["n_routed_experts"], cfg["zero_expert_num"], cfg["moe_topk"]) == (2, E, Z, 2)
    # LongCat's own key names; none of DeepSeek's or transformers' (num_hidden_layers would be read by SGLang's
    # LongcatFlashConfig before num_layers, and is 2 * num_layers in transformers' class), no MTP count (both
    # engines' classes default num_nextn_predict_layers to 1), no rope_scaling, no dtype key
    assert not {"num_hidden_layers", "intermediate_size", "moe_intermediate_size", "num_experts_per_tok",
                "num_nextn_predict_layers", "first_k_dense_replace", "rope_scaling", "rope_parameters",
                "torch_dtype", "dtype", "num_key_value_heads", "router_bias"} & set(cfg)
    assert (tiny / "configuration_longcat_flash.py").is_file()  # the class auto_map names, shipped alongside


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | MTP
    want |= {f"model.layers.{i}.{n}" for i in range(2) for n in LAYER | experts(E)}  # every layer alike
    assert set(weight_map(tiny)) == want


def test_zero_experts_have_router_rows_and_no_weights(tiny):
    """The router scores n_routed_experts + zero_expert_num experts (vLLM LongcatRouter, SGLang LongcatFlashRouter);
    the zero (identity) experts compute nothing and store nothing: both loaders map experts 0..n_routed_experts-1
    only (vLLM get_expert_mapping, SGLang FusedMoE.make_expert_params_mapping, num_experts=n_routed_experts)."""
    zero_experts_hold(tiny, E, Z, H)


def zero_experts_hold(tiny: Path, e: int, z: int, h: int) -> None:
    """The router's rows count the zero experts; the checkpoint stores none of their weights (the Lite's test too)."""
    names = set(weight_map(tiny))
    assert not any(f".mlp.experts.{x}." in n for n in names for x in range(e, e + z))
    t = read_tensors(tiny)
    assert t["model.layers.1.mlp.router.classifier.weight"].shape == (e + z, h)
    assert t["model.layers.1.mlp.router.e_score_correction_bias"].shape == (e + z,)


def test_shapes_and_dtypes_are_the_releases(tiny):
    t = shapes_hold(tiny, (H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V, FFN, EXPERT))
    assert {v.dtype for n, v in t.items() if ".mlp.router." not in n} == {torch.bfloat16}


def shapes_hold(tiny: Path, sizes: tuple[int, ...]) -> dict:
    """LongCat-Flash's layer shapes at ``sizes`` (hidden, heads, q / kv LoRA ranks, nope / rope / v head dims, dense
    and expert widths) and its router in float32, as both engines build it (the Lite's test too): the tensors."""
    h, heads, q_lora, kv_lora, nope, rope, v, ffn, expert = sizes
    t = read_tensors(tiny)
    for a in ("model.layers.0.self_attn.1", "model.mtp.layers.0.self_attn"):
        assert t[f"{a}.q_a_proj.weight"].shape == (q_lora, h)
        assert t[f"{a}.q_b_proj.weight"].shape == (heads * (nope + rope), q_lora)
        assert t[f"{a}.kv_a_proj_with_mqa.weight"].shape == (kv_lora + rope, h)
        assert t[f"{a}.kv_b_proj.weight"].shape == (heads * (nope + v), kv_lora)
        assert t[f"{a}.o_proj.weight"].shape == (h, heads * v)
    for m in ("model.layers.1.mlps.0", "model.mtp.layers.0.transformer_layer.mlp"):  # ffn_hidden_size wide
        assert t[f"{m}.gate_proj.weight"].shape == (ffn, h)
        assert t[f"{m}.down_proj.weight"].shape == (h, ffn)
    assert t["model.layers.1.mlp.experts.7.up_proj.weight"].shape == (expert, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, expert)
    assert t["model.mtp.layers.0.eh_proj.weight"].shape == (h, 2 * h)
    assert {t[n].dtype for n in t if ".mlp.router." in n} == {torch.float32}
    return t


def _mapped_mtp_names(text: str, table: str) -> set[str]:
    """The checkpoint names (keys) of an engine's MTP name table (a dict literal named ``table``), less the FP8
    release's ``weight_scale_inv``."""
    body = text[text.index(f"{table} = {{"):]
    body = body[:body.index("\n        }")]
    return {n for n in re.findall(r'"(model\.mtp\.[\w.]+)"\s*:', body) if not n.endswith("weight_scale_inv")}


@pytest.mark.parametrize("engine,rel,table", [
    ("vllm", "model_executor/models/longcat_flash_mtp.py", "new_to_old_names_mapping"),
    ("sglang", "srt/models/longcat_flash_nextn.py", "weight_names_mapping"),
])
def test_mtp_names_are_the_drafts(tiny, engine, rel, table):
    """The MTP layer's names are exactly those each engine's draft loader renames (its own table of the release's
    names), and the main models skip them (vLLM FlashModel.load_weights ``name.startswith("mtp.")`` after
    AutoWeightsLoader strips ``model.``; SGLang LongcatFlashForCausalLM.load_weights ``"mtp" in name``)."""
    path = engine_file_or_skip(engine, rel)
    assert _mapped_mtp_names(path.read_text(), table) == MTP
    assert {n for n in weight_map(tiny) if n.startswith("model.mtp.")} == MTP


# keys read as config.X that are not config.json keys, by engine: attributes its config class derives from the
# release's keys or defaults itself. vLLM reads config.json through transformers' LongcatFlashConfig
# (transformers_utils/config.py, model_type longcat_flash): attribute_map intermediate_size -> ffn_hidden_size,
# moe_intermediate_size -> expert_ffn_hidden_size, hidden_act "silu". SGLang through its own
# (srt/configs/longcat_flash.py): num_hidden_layers from num_layers, intermediate_size from ffn_hidden_size,
# moe_intermediate_size from expert_ffn_hidden_size, hidden_act "silu", rounter_params_dtype "float32", router_bias
# False, rope_parameters (transformers' alias of rope_scaling), use_ngram_embedding False (no ngram_* key; its
# ngram_embedding_* then unread).
DERIVED = {
    "vllm": {"intermediate_size", "moe_intermediate_size", "hidden_act"},
    "sglang": {"num_hidden_layers", "intermediate_size", "moe_intermediate_size", "hidden_act",
               "rounter_params_dtype", "router_bias", "rope_parameters", "use_ngram_embedding", "ngram_embedding_k",
               "ngram_embedding_m", "ngram_embedding_n"},
}


@pytest.mark.parametrize("engine,rel", [("vllm", "model_executor/models/longcat_flash.py"),
                                        ("vllm", "model_executor/models/longcat_flash_mtp.py"),
                                        ("sglang", "srt/models/longcat_flash.py"),
                                        ("sglang", "srt/models/longcat_flash_nextn.py")])
def test_config_holds_every_key_the_engines_read_without_a_default(tiny, engine, rel):
    """Each ``config.X`` the engine's LongCat files read directly (no getattr default) is in config.json or is one
    its config class derives (DERIVED)."""
    path = engine_file_or_skip(engine, rel)
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert sorted(k for k in read - DERIVED[engine] if k not in cfg) == []


def test_sglang_reads_rope_parameters_its_config_class_leaves_none(tiny):
    """SGLang 0.5.23 cannot build the release (docs/families.md, "LongCat-Flash"): LongcatFlashDecoderLayer asks
    ``"rope_theta" in getattr(config, "rope_parameters", {})``, and its LongcatFlashConfig sets
    ``self.rope_scaling = rope_scaling`` (None: the release has no rope_scaling), which under transformers 5 is
    rope_parameters: the ``in`` is asked of None (TypeError) before any weight is read."""
    model, conf = engine_file("sglang", "srt/models/longcat_flash.py"), engine_file("sglang", "srt/configs/"
                                                                                            "longcat_flash.py")
    if model is None or conf is None:
        pytest.skip("no sglang environment under ~/.cache/kimi-convert/engines")
    assert '"rope_theta" in getattr(config, "rope_parameters", {})' in model.read_text()
    assert "self.rope_scaling = rope_scaling" in conf.read_text()
    assert not {"rope_scaling", "rope_parameters"} & set(json.loads((tiny / "config.json").read_text()))
