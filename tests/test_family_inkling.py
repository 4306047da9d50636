"""Inkling (InklingForConditionalGeneration: thinkingmachines/Inkling-Small, thinkingmachines/Inkling) without an
engine: the tests' preset is laid out as the release (config.json with the release's keys: model_type
inkling_mm_model, the text model under text_config, the towers' and the MTP head's configs; the release's own tensor
names, the routed and shared experts as 3-D banks with gate and up rows interleaved, every tensor BF16).

The expected names are written here by hand from the engines' loaders, not produced by the code under test:
vLLM 0.33 models/inkling/nvidia/model.py (_TmlForCausalLMBase.hf_to_vllm_mapper: model.llm.* -> model.*, attn.wq_du /
wk_dv / wv_dv / wr_du stacked into attn.qkvr, mlp.w13_dn / w2_md -> gate_up_proj / down_proj;
InklingForConditionalGeneration: model.visual. / model.audio.; _load_inkling_weights hands mlp.experts.* and
mlp.shared_experts.* to nvidia/moe.py InklingMoE.load_expert_weight: w13_weight / w2_weight banks, shared_w13_weight /
shared_w2_weight; drops model.mtp.*), nvidia/mtp.py _load_inkling_mtp_weights (model.mtp.layers.{d}.hidden_norm /
embed_norm / input_proj / transformer_block.*), common/towers.py HMLPPatchEncoder / InklingAudio; SGLang 0.5.23
models/inkling.py InklingForConditionalGeneration.load_weights (the same names: ATTENTION_PARAMS_MAPPING,
.mlp.w13_dn / .w2_md, .experts.w13_weight / w2_weight, .shared_experts.shared_w13_weight / shared_w2_weight) and
InklingForConditionalGenerationMTP.load_weights. Public evidence for the layout: docs/families.md ("Inkling").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, weight_map, write_synth

# thinkingmachines/Inkling-Small config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {"architectures": ["InklingForConditionalGeneration"], "model_type": "inkling_mm_model",
           "eos_token_id": 200006}
RELEASE_TEXT = {
    "model_max_length": 1048576, "torch_dtype": "bfloat16", "head_dim": 128, "d_rel": 16, "rel_extent": 1024,
    "q_bias": False, "o_bias": False, "log_scaling_n_floor": 128000, "log_scaling_alpha": 0.1, "rms_norm_eps": 1e-06,
    "use_embed_norm": True, "dense_mlp_idx": 2, "use_sconv": True, "sconv_kernel_size": 4,
    "logits_mup_width_multiplier": 16.0, "final_logit_softcapping": None, "swa_head_dim": 128,
    "sliding_window_size": 512, "n_shared_experts": 2, "shared_expert_sink": True, "route_scale": 8.0,
    "use_gate_bias": True, "gate_activation": "sigmoid", "norm_after_topk": True, "use_global_scale": True,
}
RELEASE_AUDIO = {"n_mel_bins": 80, "mel_vocab_size": 16, "bias": False, "dmel_min_value": -7.0,
                 "dmel_max_value": 2.0, "use_audio_norm": True, "audio_mode": "dmel"}
RELEASE_VISION = {"vision_encoder_type": "hmlp", "patch_size": 40, "temporal_patch_size": 2, "n_channels": 3,
                  "n_layers": 4, "use_vision_norm": True}

H, HD, HEADS, D_REL, DENSE, INTER, E, S = 256, 128, 4, 16, 512, 128, 8, 2  # tiny-inkling's sizes
KV, SWA_KV = 1, 2  # a global layer's KV heads, a local one's (Inkling's 8 / 16)
LOCAL = (0, 2)  # layers 1 and 3 global

ATTN = {"attn_norm.weight", "attn.wq_du.weight", "attn.wk_dv.weight", "attn.wv_dv.weight", "attn.wr_du.weight",
        "attn.wo_ud.weight", "attn.q_norm.weight", "attn.k_norm.weight", "attn.rel_logits_proj.proj",
        "attn.k_sconv.weight", "attn.v_sconv.weight", "attn_sconv.weight", "mlp_norm.weight", "mlp_sconv.weight"}
DENSE_MLP = {"mlp.w13_dn.weight", "mlp.w2_md.weight", "mlp.global_scale"}
MOE = {"mlp.gate.weight", "mlp.gate.bias", "mlp.gate.global_scale", "mlp.experts.w13_weight", "mlp.experts.w2_weight",
       "mlp.shared_experts.shared_w13_weight", "mlp.shared_experts.shared_w2_weight"}
MTP = {"hidden_norm.weight", "embed_norm.weight", "input_proj.weight",
       *(f"transformer_block.{n}" for n in ATTN | DENSE_MLP)}
TOWERS = {"model.visual.layers.linear_0.weight", "model.visual.layers.norm_0.weight",
          "model.visual.layers.linear_1.weight", "model.visual.layers.norm_1.weight",
          "model.visual.layers.linear_2.weight", "model.visual.layers.norm_2.weight",
          "model.visual.layers.linear_3.weight", "model.visual.final_norm.weight",
          "model.audio.encoder.weight", "model.audio.final_norm.weight"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-inkling", tmp_path_factory.mktemp("inkling") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert "auto_map" not in cfg  # both engines register inkling_mm_model themselves: no remote code
    text = cfg["text_config"]
    assert {k: text[k] for k in RELEASE_TEXT} == RELEASE_TEXT
    assert {k: cfg["audio_config"][k] for k in RELEASE_AUDIO} == RELEASE_AUDIO
    assert {k: cfg["vision_config"][k] for k in RELEASE_VISION} == RELEASE_VISION
    assert cfg["audio_config"]["decoder_dmodel"] == cfg["vision_config"]["decoder_dmodel"] == text["hidden_size"] == H
    assert (text["num_hidden_layers"], text["n_routed_experts"], text["num_experts_per_tok"]) == (4, E, 2)
    assert (text["dense_intermediate_size"], text["intermediate_size"]) == (DENSE, INTER)  # intermediate_size: experts
    assert text["local_layer_ids"] == list(LOCAL)
    assert text["vocab_size"] == 1024 and text["unpadded_vocab_size"] == 1000  # padded, then the real vocabulary
    assert cfg["mtp_config"] == {"num_nextn_predict_layers": 1, "local_layer_ids": [0]}
    # the release's own spelling: no transformers-5 keys (moe_intermediate_size, conv_kernel_size, num_experts...),
    # no padded_vocab_size / inference_moe_w13_interleaved (both engines' config classes default them)
    assert not {"moe_intermediate_size", "conv_kernel_size", "num_experts", "padded_vocab_size",
                "inference_moe_w13_interleaved", "num_nextn_predict_layers"} & set(text)


def test_local_layer_ids_follow_the_releases_pattern():
    """Inkling-Small's local_layer_ids are every layer but each sixth ((i + 1) % 6 == 0 global: 5, 11, ..., 41): the
    family's expression (the tiny preset sets its own, since under 6 layers the pattern has no global layer)."""
    import tomllib

    from helpers import TEST_PRESETS

    spec = tomllib.loads((TEST_PRESETS / "inkling.toml").read_text())
    expr = spec["config"]["text_config"]["local_layer_ids"]
    assert expr == "= [i for i in range(num_hidden_layers) if (i + 1) % 6 != 0]"
    local = [i for i in range(42) if (i + 1) % 6 != 0]
    assert [i for i in range(42) if i not in local] == [5, 11, 17, 23, 29, 35, 41] and len(local) == 35


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    want = {"model.llm.embed.weight", "model.llm.embed_norm.weight", "model.llm.norm.weight",
            "model.llm.unembed.weight"}
    want |= {f"model.llm.layers.{i}.{n}" for i in range(4) for n in ATTN | (DENSE_MLP if i < 2 else MOE)}
    want |= TOWERS | {f"model.mtp.layers.0.{n}" for n in MTP}
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    p = "model.llm.layers"
    for i in range(4):  # a local layer's K / V from the swa_* geometry (InklingDecoderLayer: is_local)
        kv = SWA_KV if i in LOCAL else KV
        assert t[f"{p}.{i}.attn.wq_du.weight"].shape == (HEADS * HD, H)
        assert t[f"{p}.{i}.attn.wk_dv.weight"].shape == t[f"{p}.{i}.attn.wv_dv.weight"].shape == (kv * HD, H)
        assert t[f"{p}.{i}.attn.wr_du.weight"].shape == (HEADS * D_REL, H)
        assert t[f"{p}.{i}.attn.wo_ud.weight"].shape == (H, HEADS * HD)
        # RelLogitsProj(d_rel, extent): the window on a local layer, rel_extent on a global one
        assert t[f"{p}.{i}.attn.rel_logits_proj.proj"].shape == (D_REL, 512 if i in LOCAL else 1024)
        assert t[f"{p}.{i}.attn.k_sconv.weight"].shape == (kv * HD, 1, 4)  # InklingShortConv: (dim, 1, W)
        assert t[f"{p}.{i}.attn_sconv.weight"].shape == t[f"{p}.{i}.mlp_sconv.weight"].shape == (H, 1, 4)
    assert t[f"{p}.0.mlp.w13_dn.weight"].shape == (2 * DENSE, H)  # gate and up rows interleaved
    assert t[f"{p}.0.mlp.w2_md.weight"].shape == (H, DENSE)
    assert t[f"{p}.0.mlp.global_scale"].shape == (1,)
    assert t[f"{p}.2.mlp.gate.weight"].shape == (E + S, H)  # the router scores the shared sink experts too
    assert t[f"{p}.2.mlp.gate.bias"].shape == (E,)
    assert t[f"{p}.2.mlp.experts.w13_weight"].shape == (E, 2 * INTER, H)  # one bank a layer, rows interleaved
    assert t[f"{p}.2.mlp.experts.w2_weight"].shape == (E, H, INTER)
    assert t[f"{p}.3.mlp.shared_experts.shared_w13_weight"].shape == (S, 2 * INTER, H)
    assert t[f"{p}.3.mlp.shared_experts.shared_w2_weight"].shape == (S, H, INTER)
    assert t["model.llm.embed.weight"].shape == t["model.llm.unembed.weight"].shape == (1024, H)
    # vLLM towers.py plan_out_scales(2, 40, 4, 3): (1,1,1,3) -> (1,5,5,128) -> (1,10,10,320) -> (1,40,40,4800) ->
    # (2,40,40,9600), each linear's input its start width times the fold
    assert [t[f"model.visual.layers.linear_{i}.weight"].shape for i in range(4)] == [
        (128, 75), (320, 512), (4800, 5120), (H, 9600)]
    assert t["model.audio.encoder.weight"].shape == (80 * 16, H)
    m = "model.mtp.layers.0"
    assert t[f"{m}.input_proj.weight"].shape == (H, 2 * H)
    assert t[f"{m}.transformer_block.mlp.w13_dn.weight"].shape == (2 * DENSE, H)  # a dense block (force_dense_mlp)
    assert t[f"{m}.transformer_block.attn.rel_logits_proj.proj"].shape == (D_REL, 512)  # depth 0 local
    assert t[f"{m}.transformer_block.attn.wk_dv.weight"].shape == (SWA_KV * HD, H)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


def _assigned(path: Path) -> set[str]:
    return set(re.findall(r"\bself\.([a-z_][a-z0-9_]*)\s*=", path.read_text()))


@pytest.mark.parametrize("engine, files, configs", [
    ("vllm", ["models/inkling/nvidia/model.py", "models/inkling/nvidia/moe.py", "models/inkling/nvidia/attention.py",
              "models/inkling/nvidia/mtp.py"], "models/inkling/configs.py"),
    ("sglang", ["srt/models/inkling.py", "srt/models/inkling_common/attn.py", "srt/models/inkling_common/moe.py"],
     "srt/configs/inkling.py"),
])
def test_config_holds_every_key_the_engine_reads(tiny, engine, files, configs):
    """Each ``config.X`` the engine's Inkling code reads is a text_config key of config.json or an attribute its own
    InklingModelConfig sets (a default, or a value it derives: padded_vocab_size, num_experts...)."""
    cfg = json.loads((tiny / "config.json").read_text())
    own = _assigned(engine_file_or_skip(engine, configs))
    read = set().union(*(config_keys_read(engine_file_or_skip(engine, f).read_text()) for f in files))
    assert {"local_layer_ids", "dense_mlp_idx", "n_routed_experts", "sconv_kernel_size"} <= read
    assert sorted(k for k in read if k not in cfg["text_config"] and k not in own and k not in cfg) == []
    # and every text_config key of the release is one the engine's config class takes (none silently dropped)
    assert sorted(k for k in RELEASE_TEXT if k not in own | {"model_max_length", "torch_dtype"}) == []


def test_engines_register_it():
    """vLLM 0.33 registers both entry classes (models/inkling/__init__.py); SGLang 0.5.23 the release's class and
    its MTP draft only (EntryClass), so InklingForCausalLM is vLLM's alone."""
    reg = engine_file_or_skip("vllm", "model_executor/models/registry.py").read_text()
    assert '"InklingForCausalLM"' in reg and '"InklingForConditionalGeneration"' in reg and '"InklingMTPModel"' in reg
    entry = re.search(r"EntryClass = \[(.*)\]", engine_file_or_skip("sglang", "srt/models/inkling.py").read_text())
    assert entry is not None
    assert entry.group(1).replace(" ", "").split(",") == ["InklingForConditionalGeneration",
                                                          "InklingForConditionalGenerationMTP"]


def test_engines_read_the_expert_banks_only_as_banks():
    """vLLM's InklingMoE.load_expert_weight takes the name after ``experts.`` as a RoutedExperts parameter
    (getattr(experts, key): w13_weight, w13_weight_scale, ...): a per-expert name reaches none. SGLang reads
    per-expert ``experts.{j}.gate_proj / up_proj / down_proj`` only in BF16, for online RL updates
    (_PER_EXPERT_WEIGHT_RE, _load_per_expert_param: "disk checkpoints contain fused w13/w2 weights"), its NVFP4 aux
    tensors only as banks
    (``_weight.scale`` / ``scale2`` / ``input_amax``)."""
    moe = engine_file_or_skip("vllm", "models/inkling/nvidia/moe.py").read_text()
    assert "param = getattr(experts, key)" in moe
    sg = engine_file_or_skip("sglang", "srt/models/inkling.py").read_text()
    assert '("scale2", "scale", "input_amax", "original_shape")' in sg
    assert "disk checkpoints\n# contain fused w13/w2 weights" in sg
