"""MiMo-V2-Flash (MiMoV2FlashForCausalLM) without an engine: the tests' preset is laid out as the release (config.json
with the release's keys and its remote config class, DeepSeek-style FP8 128x128 blocks with fp32 weight_scale_inv,
the names both engines' loaders consume, the release's 3 MTP layers under model.mtp.layers.{i}).

The expected names are written here by hand from the engines' loaders, not produced by the code under test:
- vLLM 0.33 mimo_v2.py: MiMoV2Model.load_weights stacks q_proj / k_proj / v_proj into qkv_proj and gate_proj /
  up_proj into gate_up_proj, the routed experts through fused_moe_make_expert_params_mapping
  (mlp.experts.N.gate_proj / up_proj / down_proj), MiMoV2MoE's GateLinear mlp.gate.weight with its
  e_score_correction_bias; MiMoV2Attention's attention_sink_bias where add_swa_attention_sink_bias (sliding layers:
  hybrid_layer_pattern 1); it skips every name holding "mtp", which mimo_v2_mtp.py MiMoV2MTP.load_weights loads
  (model.mtp.layers.{i}.enorm / hnorm / eh_proj / input_layernorm / self_attn.* / pre_mlp_layernorm / mlp.* /
  final_layernorm);
- SGLang 0.5.23 mimo_v2.py MiMoV2ForCausalLM.load_weights (the same stacking, DeepEPMoE.make_expert_params_mapping,
  MoEGate mlp.gate.weight / e_score_correction_bias, attention_sink_bias; names holding "mtp" skipped: "MiMoV2MTP
  loads these weights in the draft model runner"), mimo_v2_nextn.py MiMoV2MTP.map_model_name_to_mtp_param_name.
Public evidence for the layout: /tmp/s39/mimo_v2_flash-families.md (docs/families.md, "MiMo-V2-Flash").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import (
    config_keys_read,
    engine_file,
    engine_file_or_skip,
    plan_kinds,
    read_tensors,
    weight_map,
    write_synth,
)

# XiaomiMiMo/MiMo-V2-Flash config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash",
    "auto_map": {"AutoConfig": "configuration_mimo_v2_flash.MiMoV2FlashConfig",
                 "AutoModel": "modeling_mimo_v2_flash.MiMoV2FlashModel",
                 "AutoModelForCausalLM": "modeling_mimo_v2_flash.MiMoV2FlashForCausalLM"},
    "head_dim": 192, "v_head_dim": 128, "swa_head_dim": 192, "swa_v_head_dim": 128,
    "num_key_value_heads": 4, "swa_num_key_value_heads": 8,
    "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False, "attention_value_scale": 0.707,
    "sliding_window": 128, "sliding_window_size": 128, "attention_chunk_size": 128,
    "rope_theta": 5000000, "swa_rope_theta": 10000, "partial_rotary_factor": 0.334,
    "layernorm_epsilon": 1e-05, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "n_shared_experts": None, "routed_scaling_factor": None, "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

FP8 = ("weight", "weight_scale_inv")  # DeepSeek-style 128x128 block FP8: e4m3 weight, one fp32 scale a tile


def fp8(*modules: str) -> set[str]:
    return {f"{m}.{p}" for m in modules for p in FP8}


def attention(sink: bool) -> set[str]:
    out = fp8("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") | {"self_attn.o_proj.weight"}
    return out | ({"self_attn.attention_sink_bias"} if sink else set())


DENSE = fp8("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = {"input_layernorm.weight", "post_attention_layernorm.weight"}


def moe(experts: int) -> set[str]:
    return {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"} | fp8(
        *(f"mlp.experts.{e}.{p}_proj" for e in range(experts) for p in ("gate", "up", "down")))


MTP = ({"enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight", "pre_mlp_layernorm.weight",
        "final_layernorm.weight"} | attention(sink=True) | DENSE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-mimo-v2-flash", tmp_path_factory.mktemp("mimo-v2-flash") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert {k: cfg["quantization_config"][k] for k in QUANT} == QUANT
    # o_proj is kept BF16 in every decoder layer (the MTP layers' are not named: vLLM builds them unquantized)
    assert cfg["quantization_config"]["ignored_layers"] == [f"model.layers.{i}.self_attn.o_proj" for i in range(6)]
    assert cfg["num_hidden_layers"] == 6 and cfg["n_routed_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    # one flag a layer: 0 full / 1 sliding (both engines: pattern[layer_id] == 1 is the sliding layer), 0 dense / 1 MoE
    assert cfg["hybrid_layer_pattern"] == [0, 1, 1, 1, 1, 0] and cfg["moe_layer_freq"] == [0, 1, 1, 1, 1, 1]
    # the release's own key names: layernorm_epsilon, no rope_parameters (the remote config class builds none), no
    # DeepSeek first_k_dense_replace, no MTP count
    assert not {"rms_norm_eps", "rope_parameters", "rope_scaling", "layer_types", "first_k_dense_replace",
                "num_nextn_predict_layers", "attention_projection_layout"} & set(cfg)
    code = (tiny / "configuration_mimo_v2_flash.py").read_text()  # the class auto_map names, shipped alongside
    assert "class MiMoV2FlashConfig(PretrainedConfig)" in code and "rope_parameters" not in code


def test_the_release_pattern_at_full_depth(tmp_path):
    """The family's rule at the release's 48 layers: full attention at layer 0 and every 6th layer (9 of 48; the
    layers transformers' MiMoV2FlashConfig names), layer 0 the one dense layer."""
    cfg = json.loads((write_synth("tiny-mimo-v2-flash", tmp_path / "x", layers=48, experts=2) / "config.json")
                     .read_text())
    assert [i for i, f in enumerate(cfg["hybrid_layer_pattern"]) if f == 0] == [0, 5, 11, 17, 23, 29, 35, 41, 47]
    assert cfg["moe_layer_freq"] == [0] + [1] * 47


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in NORMS | attention(sink=False) | DENSE}  # full + dense
    want |= {f"model.layers.{i}.{n}" for i in range(1, 5) for n in NORMS | attention(sink=True) | moe(8)}  # sliding
    want |= {f"model.layers.5.{n}" for n in NORMS | attention(sink=False) | moe(8)}  # full + MoE
    want |= {f"model.mtp.layers.{i}.{n}" for i in range(3) for n in MTP}  # the release's 3 MTP layers
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, heads, qk, v = 256, 16, 192, 128
    full_kv, swa_kv = 4, 8
    for pre, kv in (("model.layers.0", full_kv), ("model.layers.1", swa_kv), ("model.mtp.layers.2", swa_kv)):
        assert t[f"{pre}.self_attn.q_proj.weight"].shape == (heads * qk, h)
        assert t[f"{pre}.self_attn.k_proj.weight"].shape == (kv * qk, h)
        assert t[f"{pre}.self_attn.v_proj.weight"].shape == (kv * v, h)  # V heads narrower than Q/K
        assert t[f"{pre}.self_attn.k_proj.weight_scale_inv"].shape == (-(-kv * qk // 128), 2)
        assert t[f"{pre}.self_attn.o_proj.weight"].shape == (h, heads * v)
        assert t[f"{pre}.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.self_attn.attention_sink_bias"].shape == (heads,)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight_scale_inv"].shape == (2, 1)
    assert t["model.mtp.layers.0.eh_proj.weight"].shape == (h, 2 * h)
    assert t["model.mtp.layers.0.mlp.gate_proj.weight"].shape == (512, h)  # the dense intermediate_size
    for name, x in t.items():
        if name.endswith("_proj.weight") and not name.endswith(("o_proj.weight", "eh_proj.weight")):
            assert x.dtype == torch.float8_e4m3fn, name
        elif name.endswith("weight_scale_inv") or ".mlp.gate." in name:
            assert x.dtype == torch.float32, name  # tile scales; router and its bias in moe_router_dtype float32
        else:
            assert x.dtype == torch.bfloat16, name


# not config.json keys: SGLang's ModelConfig sets encoder_only on the config it builds (configs/model_config.py:
# ``self.hf_config.encoder_only = encoder_only``); ``config.__class__`` is the class, not a key
DERIVED = {"encoder_only", "__class__"}
FILES = {"vllm": ("model_executor/models/mimo_v2.py", "model_executor/models/mimo_v2_mtp.py"),
         "sglang": ("srt/models/mimo_v2.py", "srt/models/mimo_v2_nextn.py")}


@pytest.mark.parametrize("engine", sorted(FILES))
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine):
    """Each ``config.X`` the engine's main-model and MTP files read directly (no getattr default, no hasattr guard)
    is in config.json."""
    paths = [engine_file(engine, rel) for rel in FILES[engine]]
    if None in paths:
        pytest.skip(f"no {engine} environment under ~/.cache/kimi-convert/engines")
    cfg = json.loads((tiny / "config.json").read_text())
    read = set().union(*(config_keys_read(p.read_text()) for p in paths))
    assert {"hybrid_layer_pattern", "swa_num_key_value_heads", "swa_head_dim", "layernorm_epsilon",
            "n_routed_experts", "moe_intermediate_size", "sliding_window_size"} <= read
    assert sorted(k for k in read - DERIVED if k not in cfg) == []


@pytest.mark.parametrize("engine", sorted(FILES))
def test_main_models_leave_the_mtp_layers_to_the_draft(engine):
    """Both main models skip every name holding "mtp" (their draft loads it); the drafts read the layers'
    model.mtp.layers.{i} names."""
    paths = [engine_file(engine, rel) for rel in FILES[engine]]
    if None in paths:
        pytest.skip(f"no {engine} environment under ~/.cache/kimi-convert/engines")
    main, draft = (p.read_text() for p in paths)
    assert re.search(r'if "mtp" in name:\s*\n(?:.*\n){0,8}?\s*continue', main)
    assert "model.mtp" in draft and "pre_mlp_layernorm" in draft and "eh_proj" in draft


def test_mimo_v2_is_another_layout():
    """MiMoV2ForCausalLM (MiMo-V2.5 / V2.6, model_type mimo_v2), registered by the same files, stores the attention
    as one fused qkv_proj pre-sharded at num_key_value_heads chunks (attention_projection_layout "fused_qkv"): vLLM's
    subclass maps qkv_proj to itself; MiMoV2FlashForCausalLM takes q_proj / k_proj / v_proj."""
    path = engine_file_or_skip("vllm", "model_executor/models/mimo_v2.py")
    text = path.read_text()
    flash = re.search(r"class MiMoV2FlashForCausalLM\b.*?packed_modules_mapping = (\{.*?\})", text, re.S).group(1)
    pro = re.search(r"class MiMoV2ForCausalLM\(MiMoV2FlashForCausalLM\).*?packed_modules_mapping = (\{.*?\})",
                    text, re.S).group(1)
    assert '"qkv_proj": ["q_proj", "k_proj", "v_proj"]' in flash
    assert '"qkv_proj": ["qkv_proj"]' in pro
    sg = engine_file("sglang", "srt/models/mimo_v2.py")
    if sg is not None:  # SGLang: the Flash name kept loadable as a plain subclass of MiMoV2ForCausalLM
        assert re.search(r"class MiMoV2FlashForCausalLM\(MiMoV2ForCausalLM\):\s*\n\s*pass", sg.read_text())


def test_plan_with_the_shipped_table(tiny):
    """Where a derived table ships for "mimo_v2_flash", plan resolves every module of the release's layout with it
    (no engine): the FP8 linear layers and the routed experts NVFP4 (decoded from their 128x128 blocks), the router
    kept, the MTP layers' eh_proj and o_proj kept BF16 (vLLM's draft builds both unquantized)."""
    if not (Path(__file__).resolve().parent.parent / "mappings" / "derived" / "mimo_v2_flash.toml").is_file():
        pytest.skip("no derived table ships for mimo_v2_flash (docs/derived-architectures.md: its row)")
    kinds = plan_kinds(tiny)
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.0.mlp.up_proj",
                   "model.layers.1.self_attn.o_proj"):
        assert kinds[module] == "nvfp4", module
    assert any(k.startswith("model.layers.1.mlp.experts") and v == "nvfp4" for k, v in kinds.items())
    router = kinds.get("model.layers.1.mlp.gate") or kinds.get("model.layers.1.mlp.gate.weight")
    assert router is not None and router != "nvfp4"
    for module in ("model.mtp.layers.0.eh_proj", "model.mtp.layers.0.self_attn.o_proj"):
        assert kinds[module] != "nvfp4", module
