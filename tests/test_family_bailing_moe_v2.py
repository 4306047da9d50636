"""Ling 2.0 / Ring 2.0 (BailingMoeV2ForCausalLM) without an engine: the tests' preset is laid out as the release
(config.json with the release's keys and its remote config class, the names both engines' loaders consume, BF16 but
the router's F32 expert_bias), and the MTP variant stores the release's MTP layer as model.layers.{N}.

The expected names are written here by hand from the engines' loaders (vLLM 0.33 bailing_moe.py
BailingMoeModel / BailingMoeForCausalLM with AutoWeightsLoader and hf_to_vllm_mapper; SGLang 0.5.23 bailing_moe.py
BailingMoEForCausalLM.load_weights) and the release's modeling code (docs/families.md, "Ling 2.0"), not produced
by the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import MODEL_DIRS, config_keys_read, engine_file_or_skip, read_tensors, weight_map, write_synth

# inclusionAI/Ling-mini-2.0 config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["BailingMoeV2ForCausalLM"], "model_type": "bailing_moe_v2",
    "auto_map": {"AutoConfig": "configuration_bailing_moe_v2.BailingMoeV2Config",
                 "AutoModel": "modeling_bailing_moe_v2.BailingMoeV2Model",
                 "AutoModelForCausalLM": "modeling_bailing_moe_v2.BailingMoeV2ForCausalLM"},
    "first_k_dense_replace": 1, "head_dim": 128, "use_qk_norm": True, "use_rmsnorm": True, "use_bias": False,
    "use_qkv_bias": False, "partial_rotary_factor": 0.5, "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "router_dtype": "fp32", "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "num_shared_experts": 1, "tie_word_embeddings": False, "rope_theta": 600000,
}

ATTN = {"input_layernorm.weight", "attention.query_key_value.weight", "attention.query_layernorm.weight",
        "attention.key_layernorm.weight", "attention.dense.weight", "post_attention_layernorm.weight"}
DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
SHARED = {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
          "mlp.shared_experts.down_proj.weight"}


def moe(experts: int) -> set[str]:
    return ({"mlp.gate.weight", "mlp.gate.expert_bias"} | SHARED
            | {f"mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-bailing-moe-v2", tmp_path_factory.mktemp("ling") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 2 and cfg["num_experts"] == 8 and cfg["num_nextn_predict_layers"] == 0
    assert cfg["num_experts"] % cfg["n_group"] == 0 and cfg["topk_group"] <= cfg["n_group"]
    assert (tiny / "configuration_bailing_moe_v2.py").is_file()  # the class auto_map names, shipped alongside


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    names = set(weight_map(tiny))
    want = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.0.{n}" for n in ATTN | DENSE}
    want |= {f"model.layers.1.{n}" for n in ATTN | moe(8)}
    assert names == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, kv = 256, 128, 4, 2
    assert t["model.layers.0.attention.query_key_value.weight"].shape == ((heads + 2 * kv) * hd, h)
    assert t["model.layers.0.attention.dense.weight"].shape == (h, heads * hd)
    assert t["model.layers.0.attention.query_layernorm.weight"].shape == (hd,)
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, h)
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (128, h)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.1.mlp.gate.expert_bias"].dtype == torch.float32  # the engines' own F32 parameter
    assert {v.dtype for k, v in t.items() if not k.endswith("expert_bias")} == {torch.bfloat16}


def test_the_mtp_variant_stores_the_releases_mtp_layer(tmp_path):
    out = write_synth("tiny-bailing-moe-v2-mtp", tmp_path / "src")
    mtp = {n.removeprefix("model.layers.2.") for n in weight_map(out) if n.startswith("model.layers.2.")}
    assert mtp == ATTN | moe(8) | {"enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"}
    assert read_tensors(out)["model.layers.2.eh_proj.weight"].shape == (256, 512)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine):
    """Each ``config.X`` the engine's model file reads directly (no getattr default, no hasattr guard) is in
    config.json."""
    path = engine_file_or_skip(engine, f"{MODEL_DIRS[engine]}/bailing_moe.py")
    cfg = json.loads((tiny / "config.json").read_text())
    text = path.read_text()
    read = config_keys_read(text)
    # not config.json keys: methods and attributes transformers' PretrainedConfig gives every config
    derived = {"get_text_config", "rope_parameters", "to_dict", "architectures"}
    # the Ming multimodal config's keys SGLang's file also reads (image / audio gates): not the text release's
    ming = {"image_patch_token", "audio_patch_token", "image_start_token", "video_start_token",
            "audio_start_token", "llm_config", "mlp_only_layers", "vision_config"}
    assert {"num_experts", "first_k_dense_replace", "hidden_size"} <= read  # the reading found the file's keys
    missing = sorted(k for k in read - derived - ming if k not in cfg)
    assert missing == []



@pytest.mark.parametrize("trust", [False, True])
def test_the_engine_check_passes_trust_remote_code_to_the_runner(tiny, monkeypatch, trust):
    """verify-manifest / mapping derive --trust-remote-code reach the engine's runner as its flag (and only then)."""
    import kimi_convert.enginecheck as ec
    from kimi_convert.errors import ConvertError

    seen = []
    monkeypatch.setattr(ec, "resolve", lambda *a, **k: ec.Probe(python="python", version="0", site_packages=[]))
    monkeypatch.setattr(ec, "runner_env", lambda pr: {})
    monkeypatch.setattr(ec, "run_runner", lambda py, runner, argv, *a, **k: seen.append(argv) or 1)
    rep = ec.check(tiny, "vllm", trust_remote_code=trust)
    assert rep.error["type"] == "RunnerCrashed"  # the stubbed runner wrote no result
    with pytest.raises(ConvertError):
        ec.run_derive(tiny, "sglang", "build", trust_remote_code=trust)
    assert [("--trust-remote-code" in argv) for argv in seen] == [trust, trust]
