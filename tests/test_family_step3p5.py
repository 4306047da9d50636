"""Step-3.5-Flash (Step3p5ForCausalLM) without an engine: the tests' preset is laid out as the release (config.json
with the release's keys, per-layer lists over the decoder layers, the names both engines' loaders consume, BF16 but
the router's F32 router_bias, the routed experts as three 3-D banks per MoE layer).

The expected names are written here by hand from the engines' loaders (vLLM 0.33 step3p5.py
Step3p5Model.load_weights, its "Old packed 3D format" expert_params_mapping and Step3p5ForCausalLM.hf_to_vllm_mapper
``.share_expert.`` -> ``.moe.share_expert.``; SGLang 0.5.23 step3p5.py Step3p5ForCausalLM.load_weights, whose
match_expert_and_shard_ids reads ``model.layers.N.moe.{gate,up,down}_proj.weight`` and indexes it by expert) and the
release's documentation (docs/families.md, "Step-3.5-Flash"), not produced by the code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import (
    MODEL_DIRS,
    config_keys_read,
    engine_file_or_skip,
    one_line_error,
    read_tensors,
    run,
    weight_map,
    write_synth,
)

# stepfun-ai/Step-3.5-Flash config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5",
    "auto_map": {"AutoConfig": "configuration_step3p5.Step3p5Config",
                 "AutoModelForCausalLM": "modeling_step3p5.Step3p5ForCausalLM"},
    "head_dim": 128, "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16", "norm_expert_weight": True,
    "moe_router_activation": "sigmoid", "moe_router_scaling_factor": 3.0, "use_moe_router_bias": True,
    "need_fp32_gate": True, "att_impl_type": "GQA", "use_head_wise_attn_gate": True, "use_qk_norm": True,
    "zero_centered": True, "sliding_window": 512, "yarn_only_types": ["full_attention"],
    "tie_word_embeddings": False, "eos_token_id": [1, 2, 128007],
}

ATTN = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight", "self_attn.g_proj.weight",
        *(f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o"))}
DENSE = {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
MOE = ({"moe.gate.weight", "moe.router_bias"} | {f"moe.{p}_proj.weight" for p in ("gate", "up", "down")}
       | {f"share_expert.{p}_proj.weight" for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-step3p5", tmp_path_factory.mktemp("step3p5") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 5 and cfg["moe_num_experts"] == 8 and cfg["num_nextn_predict_layers"] == 0
    assert cfg["moe_layers_enum"] == "3,4"  # a comma-separated string: SGLang's _is_moe_layer splits it
    # one full-attention layer, then three sliding-window ones (3:1), each kind with its own RoPE
    assert cfg["layer_types"] == ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
    assert cfg["rope_theta"] == [5000000.0, 10000.0, 10000.0, 10000.0, 5000000.0]
    assert cfg["partial_rotary_factors"] == [0.5, 1.0, 1.0, 1.0, 0.5]
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 2.0
    assert cfg["attention_other_setting"] == {"attention_type": "sliding_attention", "num_attention_heads": 6,
                                              "num_attention_groups": 2, "head_dim": 128}
    assert cfg["swiglu_limits"] == [0.0, 0.0, 0.0, 0.0, 7.0]  # vLLM's fused MoE takes 7.0 only
    assert cfg["swiglu_limits_shared"] == [0.0, 0.0, 0.0, 0.0, 16.0]


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    names = set(weight_map(tiny))
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in (0, 1, 2) for n in ATTN | DENSE}
    want |= {f"model.layers.{i}.{n}" for i in (3, 4) for n in ATTN | MOE}
    assert names == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, full, sliding, kv, e, inter = 256, 128, 4, 6, 2, 8, 128
    for layer, heads in ((0, full), (1, sliding), (3, sliding), (4, full)):  # per-layer head counts
        pre = f"model.layers.{layer}.self_attn"
        assert t[f"{pre}.q_proj.weight"].shape == (heads * hd, h)
        assert t[f"{pre}.g_proj.weight"].shape == (heads, h)  # one gate a head
        assert t[f"{pre}.o_proj.weight"].shape == (h, heads * hd)
        assert t[f"{pre}.k_proj.weight"].shape == t[f"{pre}.v_proj.weight"].shape == (kv * hd, h)
        assert t[f"{pre}.q_norm.weight"].shape == t[f"{pre}.k_norm.weight"].shape == (hd,)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (512, h)
    # the routed experts as 3-D banks [E, out, in]
    assert t["model.layers.3.moe.gate_proj.weight"].shape == (e, inter, h)
    assert t["model.layers.3.moe.up_proj.weight"].shape == (e, inter, h)
    assert t["model.layers.3.moe.down_proj.weight"].shape == (e, h, inter)
    assert t["model.layers.3.moe.gate.weight"].shape == (e, h)
    assert t["model.layers.3.moe.router_bias"].shape == (e,)
    assert t["model.layers.4.share_expert.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.3.moe.router_bias"].dtype == torch.float32  # the engines' own F32 parameter
    assert {v.dtype for k, v in t.items() if not k.endswith("router_bias")} == {torch.bfloat16}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine):
    """Each ``config.X`` the engine's model file reads directly (no getattr default, no hasattr guard) is in
    config.json."""
    path = engine_file_or_skip(engine, f"{MODEL_DIRS[engine]}/step3p5.py")
    cfg = json.loads((tiny / "config.json").read_text())
    text = path.read_text()
    read = config_keys_read(text)
    # not config.json keys: what vLLM's config class (Step3p7TextConfig) derives (per_layer_config, read only where
    # getattr(config, "is_heterogeneous", False) holds)
    derived = {"per_layer_config"}
    assert {"moe_num_experts", "layer_types", "hidden_size"} <= read  # the reading found the file's keys
    missing = sorted(k for k in read - derived if k not in cfg)
    assert missing == []


def test_inspect_reads_its_moe_layers_top_k_and_expert_banks(tiny):
    """benchmark_moe's values: top-k from ``moe_top_k``, the MoE layers from ``moe_layers_enum`` (a comma-separated
    string), the experts counted and measured from the gate bank [E, I, H]."""
    r = run("inspect", tiny)
    assert r.code == 0, r.stderr
    assert "benchmark_moe    E=8 topk=2 moe_intermediate_size=128 hidden_size=256" in r.stdout, r.stdout
    assert "MoE layers       2 [3-4]" in r.stdout and "8 experts per layer, expert gate weight [128, 256]" in r.stdout
    assert "warning" not in r.stdout


def test_plan_splits_the_banks_into_per_expert_nvfp4_modules(tiny):
    """The shipped derived table (vLLM's view: SGLang 0.5.23 does not read the release's config) plans each bank's
    experts as the per-expert modules vLLM's loader reads (moe.experts.E.gate_proj / up_proj / down_proj), gate and
    up of one expert under one global scale, the router kept."""
    r = run("plan", tiny, "--json")
    assert r.code == 0, r.stderr
    mods = {m["name"]: m for m in json.loads(r.stdout)["modules"]}
    for e in range(8):
        for p in ("gate_proj", "up_proj", "down_proj"):
            m = mods[f"model.layers.3.moe.experts.{e}.{p}"]
            assert m["kind"] == "nvfp4", m
            assert [q["name"] for q in m["sources"][0]["parts"]] == [f"model.layers.3.moe.{p}.weight[{e}]"]
    gate, up = (mods[f"model.layers.4.moe.experts.5.{p}"] for p in ("gate_proj", "up_proj"))
    assert gate["quantization"]["shared_scale"] == up["quantization"]["shared_scale"] is not None
    assert mods["model.layers.3.moe.gate"]["kind"] == "keep"
    assert not any(n.startswith(("model.layers.0.moe", "model.layers.2.moe")) for n in mods)


@pytest.mark.parametrize(("enum", "says"), [
    ("2,3,4", "moe_num_experts 8 makes layer 2 a MoE layer, but model.layers.2 holds no routed experts"),
    ("4", "moe_layers_enum the string '4' makes layer 3 dense, but model.layers.3.moe.experts holds 8 routed experts"),
    ("3;4", "moe_layers_enum is the string '3;4', expected the MoE layers' numbers"),
])
def test_moe_layers_enum_held_against_the_tensors(tiny, tmp_path, enum, says):
    """[moe] moe_list: Step-3.5's moe_layers_enum, the MoE layers' numbers in one string, says which layers hold
    routed experts."""
    bad = tmp_path / "s"
    shutil.copytree(tiny, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["moe_layers_enum"] = enum
    (bad / "config.json").write_text(json.dumps(cfg))
    assert says in one_line_error(run("plan", bad))
