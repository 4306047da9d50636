"""ZAYA1 (ZayaForCausalLM) without an engine: the tests' preset is laid out as the release in Zyphra's Megatron-style
layout (Zyphra/ZAYA1-8B-legacy's config.json, model_type "zaya" with no auto_map; CCA attention and MoE as separate
half-layers; the names SGLang's loader consumes; every tensor BF16). vLLM 0.33 does not register the architecture:
SGLang is its one engine.

The expected names are written here by hand from SGLang 0.5.23 zaya.py, not produced by the code under test:
ZayaModel (model.embed_tokens, model.layers, model.final_norm, model.res_scale: ResidualScaling(config,
num_hidden_layers)), _layer_class (even layers ZayaDecoderATTLayer, odd ZayaDecoderMLPLayer), ResidualScaling
(hidden_states_scale / _bias, residual_scale / _bias but on layer 0), ZayaAttention / CCA (self_attn.qkv.linear_q,
linear_k, val_proj1, val_proj2, conv_qk.0 / conv_qk.1 Conv1d, temp; self_attn.o_proj), ZayaRouter (down_proj,
rmsnorm_eda, router_states_scale, router_mlp.0 / .2 / .4, the balancing_biases buffer), ZayaForCausalLM.load_weights
(_EXPERT_RE: zaya_block.experts.local_experts.E.linear_fc1 / linear_fc2 .weight; lm_head tied, not stored). Public
evidence for the layout: docs/families.md ("ZAYA1").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, run, weight_map, write_synth

# Zyphra/ZAYA1-8B-legacy config.json (revision 1bef1fb587fc4bcb78f318f49ff2ef2b2510f073, as SGLang's own
# test/registered/unit/configs/test_zaya_config.py copies it): every value that is not a size
RELEASE = {
    "architectures": ["ZayaForCausalLM"], "model_type": "zaya",
    "activation_func": "swiglu", "activation_func_fp8_input_store": False, "add_bias_linear": False,
    "attention_bias": False, "attention_dropout": 0.0, "bias_activation_fusion": True, "bos_token_id": 2,
    "cca": True, "dtype": "bfloat16", "eos_token_id": 106, "gated_linear_unit": True, "lm_head_bias": False,
    "mamba_cache_dtype": "float32", "max_position_embeddings": 131072, "moe_router_topk": 1, "norm_epsilon": 1e-05,
    "normalization": "RMSNorm", "num_attention_heads": 8, "num_key_value_heads": 2, "num_query_groups": 2,
    "pad_token_id": 0, "partial_rotary_factor": 0.5, "residual_in_fp32": True, "rope_scaling": False,
    "rope_theta": 5000000, "scale_residual_merge": True, "sliding_window": None, "use_cache": True,
    "zaya_use_eda": True, "zaya_use_mod": True,
}

RES = {"res_scale.hidden_states_scale", "res_scale.hidden_states_bias"}
RESIDUAL = {"res_scale.residual_scale", "res_scale.residual_bias"}
ATTN = {"input_norm.weight", "self_attn.o_proj.weight", "self_attn.qkv.linear_q.weight",
        "self_attn.qkv.linear_k.weight", "self_attn.qkv.val_proj1.weight", "self_attn.qkv.val_proj2.weight",
        "self_attn.qkv.conv_qk.0.weight", "self_attn.qkv.conv_qk.0.bias", "self_attn.qkv.conv_qk.1.weight",
        "self_attn.qkv.conv_qk.1.bias", "self_attn.qkv.temp"}
ROUTER = {f"zaya_block.router.{n}" for n in ("down_proj.weight", "down_proj.bias", "rmsnorm_eda.weight",
                                             "router_mlp.0.weight", "router_mlp.0.bias", "router_mlp.2.weight",
                                             "router_mlp.2.bias", "router_mlp.4.weight", "balancing_biases")}
# SGLang 0.5.23 zaya.py ZayaForCausalLM._EXPERT_RE, copied by hand
EXPERT_RE = r"^(.*\.zaya_block\.experts)\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$"


def experts(n: int) -> set[str]:
    return {f"zaya_block.experts.local_experts.{e}.linear_fc{k}.weight" for e in range(n) for k in (1, 2)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-zaya", tmp_path_factory.mktemp("zaya") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert "tie_word_embeddings" not in cfg  # as released: the config class's default (True) ties the head
    # half-layers: 2 attention + 2 MoE; the head dim under both spellings (kv_channels, head_dim)
    assert cfg["num_hidden_layers"] == 4 and cfg["num_experts"] == 8 and cfg["head_dim"] == cfg["kv_channels"] == 32
    assert cfg["ffn_hidden_size"] == 2 * 128  # gate + up of one expert (SGLang: intermediate = ffn_hidden_size // 2)
    # the legacy schema, none of transformers 5's native ZAYA keys (SGLang 0.5.23's ZayaConfig reads the legacy ones),
    # and no auto_map: the release ran on Zyphra's transformers fork, SGLang registers its own config class
    assert not {"auto_map", "layer_types", "moe_intermediate_size", "num_experts_per_tok", "router_hidden_size",
                "rms_norm_eps", "rope_parameters", "hidden_act"} & set(cfg)
    assert not (tiny / "configuration_zaya.py").exists()


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.final_norm.weight"}  # no lm_head: tie_word_embeddings
    want |= {f"model.res_scale.{n}" for n in ("hidden_states_scale", "hidden_states_bias", "residual_scale",
                                              "residual_bias")}
    want |= {f"model.layers.0.{n}" for n in ATTN | RES}  # layer 0: no residual stream to scale
    want |= {f"model.layers.2.{n}" for n in ATTN | RES | RESIDUAL}
    want |= {f"model.layers.1.{n}" for n in {"input_norm.weight"} | RES | RESIDUAL | ROUTER | experts(8)}
    # the first MoE layer stores no router_states_scale (EDA: there is no earlier MoE layer's state to scale)
    want |= {f"model.layers.3.{n}" for n in {"input_norm.weight", "zaya_block.router.router_states_scale"}
             | RES | RESIDUAL | ROUTER | experts(8)}
    assert set(weight_map(tiny)) == want


def test_every_expert_tensor_is_one_the_loader_splits(tiny):
    """SGLang's load_weights reads an expert only through its _EXPERT_RE (fc1 split in halves into w13's w1 / w3,
    fc2 into w2): every expert tensor matches it, and the engine file holds that pattern."""
    names = [n for n in weight_map(tiny) if ".local_experts." in n]
    assert len(names) == 2 * 2 * 8 and all(re.match(EXPERT_RE, n) for n in names)
    text = engine_file_or_skip("sglang", "srt/models/zaya.py").read_text()
    assert EXPERT_RE in text
    assert 'shard_id="w1"' in text and 'shard_id="w3"' in text and "loaded_weight[:half]" in text


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, q, kv, inter, r, e = 256, 32, 8, 2, 128, 64, 8
    conv = (q + kv) * hd  # CCA convolves q and k together
    assert t["model.layers.0.self_attn.qkv.linear_q.weight"].shape == (q * hd, h)
    assert t["model.layers.0.self_attn.qkv.linear_k.weight"].shape == (kv * hd, h)
    assert t["model.layers.2.self_attn.qkv.val_proj1.weight"].shape == (kv * hd // 2, h)
    assert t["model.layers.2.self_attn.qkv.val_proj2.weight"].shape == (kv * hd // 2, h)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (h, q * hd)
    assert t["model.layers.0.self_attn.qkv.conv_qk.0.weight"].shape == (conv, 1, 2)  # depthwise, kernel cca_time0
    assert t["model.layers.0.self_attn.qkv.conv_qk.1.weight"].shape == (conv, hd, 2)  # q + kv groups, cca_time1
    assert t["model.layers.0.self_attn.qkv.conv_qk.1.bias"].shape == (conv,)
    assert t["model.layers.0.self_attn.qkv.temp"].shape == (kv,)
    assert t["model.layers.1.zaya_block.router.down_proj.weight"].shape == (r, h)
    assert t["model.layers.1.zaya_block.router.router_mlp.2.weight"].shape == (r, r)
    assert t["model.layers.1.zaya_block.router.router_mlp.4.weight"].shape == (e + 1, r)  # MOD: the skip expert
    assert t["model.layers.1.zaya_block.router.balancing_biases"].shape == (e + 1,)
    assert t["model.layers.3.zaya_block.router.router_states_scale"].shape == (r,)
    assert t["model.layers.1.zaya_block.experts.local_experts.7.linear_fc1.weight"].shape == (2 * inter, h)
    assert t["model.layers.3.zaya_block.experts.local_experts.7.linear_fc2.weight"].shape == (h, inter)
    assert t["model.embed_tokens.weight"].shape == (512, h)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}  # the release's balancing_biases are BF16 too


def test_sglang_builds_the_router_state_scale_the_first_moe_layer_never_reads():
    """SGLang 0.5.23 builds router_states_scale on every MoE layer when zaya_use_eda, and reads it only with a previous
    MoE layer's router state, which ZayaModel.forward never has at the first: the release's first MoE layer stores
    none, and the parameter stays as built (the engine check must allow it: docs/families.md, "ZAYA1")."""
    text = engine_file_or_skip("sglang", "srt/models/zaya.py").read_text()
    assert "self.router_states_scale = nn.Parameter(torch.ones(self.mlp_expansion))" in text
    assert "and prev_router_hidden_states is not None" in text
    assert "prev_router_hidden_states: Optional[torch.Tensor] = None\n        for i in range(" in text


# not config.json keys: SGLang 0.5.23's ZayaConfig (srt/configs/zaya.py) gives them defaults the release relies on:
# cca_time0 / cca_time1 = 2 (the conv_qk kernels: the release's conv_qk.{0,1}.weight last dim), tie_word_embeddings =
# True (the release stores no lm_head.weight; Zyphra's fork's ZayaConfig defaults it to True as well)
DERIVED = {"cca_time0", "cca_time1", "tie_word_embeddings"}


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` SGLang's zaya.py reads directly (no getattr default, no hasattr guard) is in config.json."""
    path = engine_file_or_skip("sglang", "srt/models/zaya.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"num_query_groups", "ffn_hidden_size", "zaya_mlp_expansion", "num_experts", "zaya_use_mod"} <= read
    assert sorted(k for k in read - DERIVED if k not in cfg) == []


def test_vllm_does_not_register_it():
    """vLLM 0.33's registry has no ZayaForCausalLM (its row has one engine)."""
    path = engine_file_or_skip("vllm", "model_executor/models/registry.py")
    assert '"ZayaForCausalLM"' not in path.read_text()


def test_the_overlay_keeps_the_experts_and_names_their_bank(tiny, tmp_path):
    """The hand overlay (mappings/overlays/zaya.toml) over the table the derivation gives (written here by hand: SGLang
    0.5.23 shows no packed module and keeps nothing; the embedding is not a linear layer): the routed experts are kept
    BF16 (SGLang's loader reads no expert scale) and the exclude list names each bank as SGLang matches it
    (model.layers.N.zaya_block.experts for ModelOpt, its .0.gate_proj / .0.up_proj / .0.down_proj for
    compressed-tensors); attention and router linear layers are NVFP4."""
    import tomli_w

    from kimi_convert.derive import merge
    from kimi_convert.derive.lookup import overlay_for

    derived = {"name": "derived-zaya", "description": "derived from SGLang 0.5.23",
               "architectures": ["ZayaForCausalLM"], "model_types": ["zaya"], "not_linear": ["model.embed_tokens"]}
    path, overlay = overlay_for("derived-zaya")
    assert Path(path).name == "zaya.toml"
    table = tmp_path / "zaya.toml"
    table.write_text(tomli_w.dumps(merge(derived, overlay)))
    r = run("plan", tiny, "--mapping", table, "--json")
    assert r.code == 0, r.stderr
    plan = json.loads(r.stdout)
    kinds = {m["name"]: m["kind"] for m in plan["modules"]}
    exclude = set(plan["exclude_modules"])
    # the bank as ModelOpt's is_layer_excluded matches it, and the three names compressed-tensors' get_moe_scheme probes
    for n in (1, 3):
        bank = f"model.layers.{n}.zaya_block.experts"
        assert {bank, f"{bank}.0.gate_proj", f"{bank}.0.up_proj", f"{bank}.0.down_proj"} <= exclude
    fc = [n for n in kinds if ".local_experts." in n]
    assert len(fc) == 32 and {kinds[n] for n in fc} == {"keep"}
    for n in ("model.layers.0.self_attn.qkv.linear_q", "model.layers.2.self_attn.o_proj",
              "model.layers.2.self_attn.qkv.val_proj2", "model.layers.1.zaya_block.router.router_mlp.4"):
        assert kinds[n] == "nvfp4", n
    assert plan["totals"]["nvfp4"] == 18 and plan["totals"]["kept"] == 32
