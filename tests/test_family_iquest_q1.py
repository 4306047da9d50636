"""IQuest-Q1 (IQuestQ1ForCausalLM) without an engine: the tests' preset is laid out as the release (config.json with
IQuestQ1Config's keys and the release's values, no auto_map; the names SGLang's loader consumes; every tensor BF16,
the routed experts as two 3-D banks per layer). vLLM 0.33 does not register the architecture: SGLang is its one
engine.

The expected names are written here by hand from SGLang 0.5.23 srt/models/iquest_q1.py, not produced by the code
under test: load_iquest_q1_weights (q/k/v stacked into qkv_proj, layer 0's gate/up into gate_up_proj,
``mlp.router.weight`` renamed ``mlp.gate.weight``, the banks ``mlp.experts.fc`` [E, 2I, H] split into w1 = rows :I and
w3 = rows I: of each expert and ``mlp.experts.proj`` [E, H, I] into w2, every other name a parameter of the model
or "Unexpected IQuest Q1 weight"), IQuestQ1DecoderLayer (attention_norm, attn_out_norm, feed_forward_norm, and
ffn_out_norm in layer 0 only; a dense IQuestQ1DenseMLP in mlp_only_layers, else IQuestQ1MoEBlock), IQuestQ1Attention
(q_norm / k_norm [head_dim], sink_k [num_key_value_heads, head_dim] where enable_sink_attention), IQuestQ1Model
(model.embed_tokens, model.norm), ParallelLMHead lm_head. Public evidence for the layout: the preset's header.

The shipped table (mappings/derived/iquest_q1.toml, derived from SGLang 0.5.23 in session 41, with the hand overlay
mappings/overlays/iquest_q1.toml) keeps the two banks BF16 as stored ([stacked] keep = true: SGLang 0.5.23 reads no
quantized bank, any scale name raising "Unexpected IQuest Q1 weight") with each MoE layer's experts module in the
exclude list, and writes everything else the engine quantizes NVFP4 (the router kept: a ReplicatedLinear built with
quant_config=None).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file, engine_file_or_skip, read_tensors, run, weight_map, write_synth

# IQuestLab/IQuest-Q1 config.json (SGLang 0.5.23 configs/iquest_q1.py IQuestQ1Config, whose defaults are the
# release's): the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["IQuestQ1ForCausalLM"], "model_type": "iquest_q1", "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 524288, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "rope_theta": 1000000.0,
    "rotary_dim": 32, "swa_rope_theta": 10000.0, "sliding_window": 4096, "use_hybrid_layers": True,
    "use_sliding_window": True, "first_layers_types": ["full_attention"],
    "hybrid_layers_types_block": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
    "last_layers_types": ["full_attention"] * 3, "mlp_only_layers": [0], "no_rope_layers": [],
    "moe_router_dtype": "fp32", "enable_sink_attention": True, "enable_lm_head_fp32": True,
    "first_layer_attn_out_scale": 1.0, "first_layer_ffn_out_scale": 1.0, "attn_out_scale": 1.0,
    "ffn_out_scale": 0.53881590608, "softmax_scale": None, "logit_scale": 1.0, "torch_dtype": "bfloat16",
}

LAYERS, EXPERTS, H, INTER, DENSE, HEADS, KV, HD, VOCAB = 8, 8, 256, 128, 512, 4, 2, 128, 1024

LAYER = {"attention_norm.weight", "attn_out_norm.weight", "feed_forward_norm.weight",
         "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.sink_k"}
DENSE_LAYER = {"ffn_out_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
MOE_LAYER = {"mlp.router.weight", "mlp.experts.fc", "mlp.experts.proj"}


def layer_types(cfg: dict) -> list[str]:
    """IQuestQ1Config.__init__'s layer_types, written out here."""
    return (cfg["first_layers_types"] + cfg["hybrid_layers_types_block"] * cfg["num_hybrid_layers_block"]
            + cfg["last_layers_types"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-iquest-q1", tmp_path_factory.mktemp("iquest-q1") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert "auto_map" not in cfg  # SGLang's own IQuestQ1Config reads it: no remote code
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (LAYERS, EXPERTS, 2)
    # IQuestQ1Config refuses a num_hidden_layers other than its layer pattern's length ("IQuest Q1 layer type
    # pattern has length ..."): the tiny preset keeps one hybrid block, so its sliding layers too
    types = layer_types(cfg)
    assert len(types) == cfg["num_hidden_layers"]
    assert types == ["full_attention", "full_attention"] + ["sliding_attention"] * 3 + ["full_attention"] * 3
    # the release's: 1 + 21 x 4 + 3 = 88 layers, 63 of them sliding (SGLang's test on IQuestQ1Config())
    full = layer_types({**cfg, "num_hybrid_layers_block": 21})
    assert (len(full), full.count("sliding_attention")) == (88, 63)
    assert cfg["rotary_dim"] / cfg["head_dim"] == 0.25  # partial_rotary_factor, as the release's 32 of 128
    # none of the other MoE families' key names; the legacy native MTP layers are not counted
    assert not {"moe_intermediate_size", "n_routed_experts", "first_k_dense_replace", "num_nextn_predict_layers",
                "layer_types", "auto_map"} & set(cfg)
    assert cfg["num_mtp_layers"] == 0


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in range(LAYERS) for n in LAYER}
    want |= {f"model.layers.0.{n}" for n in DENSE_LAYER}  # mlp_only_layers [0]
    want |= {f"model.layers.{i}.{n}" for i in range(1, LAYERS) for n in MOE_LAYER}
    names = set(weight_map(tiny))
    assert names == want
    # no per-expert name and no MTP layer: SGLang 0.5.23's loader takes the routed experts only as the two banks,
    # and the main model drops "mtp_layers." names (the release's draft is its own checkpoint in mtp/)
    assert not [n for n in names if ".experts." in n and n.split(".experts.")[1] not in ("fc", "proj")]
    assert not [n for n in names if n.startswith(("mtp_layers.", "mtp."))]


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    pre = "model.layers"
    assert t[f"{pre}.0.self_attn.q_proj.weight"].shape == (HEADS * HD, H)
    for p in ("k", "v"):  # GQA
        assert t[f"{pre}.0.self_attn.{p}_proj.weight"].shape == (KV * HD, H)
    assert t[f"{pre}.0.self_attn.o_proj.weight"].shape == (H, HEADS * HD)
    assert t[f"{pre}.3.self_attn.q_norm.weight"].shape == (HD,)
    assert t[f"{pre}.3.self_attn.sink_k"].shape == (KV, HD)  # SGLang's sink_k parameter [num_kv_heads, head_dim]
    assert t[f"{pre}.0.mlp.gate_proj.weight"].shape == (DENSE, H)
    assert t[f"{pre}.0.mlp.down_proj.weight"].shape == (H, DENSE)
    assert t[f"{pre}.1.mlp.router.weight"].shape == (EXPERTS, H)
    # the banks: each expert's gate rows then its up rows (loaded_weight[e][:I] -> w1, [I:] -> w3), then w2
    assert t[f"{pre}.1.mlp.experts.fc"].shape == (EXPERTS, 2 * INTER, H)
    assert t[f"{pre}.7.mlp.experts.proj"].shape == (EXPERTS, H, INTER)
    assert t["model.embed_tokens.weight"].shape == t["lm_head.weight"].shape == (VOCAB, H)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


# not config.json keys: attributes IQuestQ1Config computes from it (layer_types from the layer type lists,
# rope_parameters from rope_theta / rope_scaling / rotary_dim)
DERIVED = {"layer_types", "rope_parameters"}


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` SGLang's iquest_q1.py reads directly (no getattr default, no hasattr guard) is in
    config.json, or is computed by IQuestQ1Config from keys that are."""
    path = engine_file_or_skip("sglang", "srt/models/iquest_q1.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"dense_intermediate_size", "intermediate_size", "num_experts", "num_experts_per_tok", "mlp_only_layers",
            "enable_sink_attention", "swa_rope_theta", "first_layer_ffn_out_scale", "ffn_out_scale"} <= read
    assert sorted(k for k in read - DERIVED if k not in cfg) == []
    config_class = engine_file("sglang", "srt/configs/iquest_q1.py")
    assert config_class is not None
    text = config_class.read_text()
    # the constraints IQuestQ1Config enforces, which the preset keeps
    assert 'moe_router_dtype != "fp32"' in text and "enable_lm_head_fp32 is not True" in text
    assert "layer_types = (" in text and 'kwargs.pop("layer_types", None)' in text


def test_the_loader_reads_experts_only_as_the_releases_banks():
    """SGLang 0.5.23's loader maps ``experts.fc`` / ``experts.proj`` and nothing else to the expert bank: a per-expert
    name (``experts.N.gate_proj.weight``) reaches no parameter and is refused ("Unexpected IQuest Q1 weight")."""
    path = engine_file_or_skip("sglang", "srt/models/iquest_q1.py")
    text = path.read_text()
    assert 'name.endswith("experts.fc")' in text and 'name.endswith("experts.proj")' in text
    assert '"experts.fc", "experts.w13_weight"' in text and '"experts.proj", "experts.w2_weight"' in text
    assert "get_expert_mapping" not in text and "make_expert_params_mapping" not in text
    assert 'raise ValueError(f"Unexpected IQuest Q1 weight: {name}")' in text
    assert 'name.startswith("mtp_layers.")' in text  # the legacy native MTP weights, dropped


def test_vllm_does_not_register_it():
    """vLLM 0.33's registry has no IQuestQ1ForCausalLM (its row has one engine)."""
    path = engine_file_or_skip("vllm", "model_executor/models/registry.py")
    assert '"IQuestQ1ForCausalLM"' not in path.read_text()


def test_inspect_counts_its_unsplit_banks_and_its_dense_layer(tiny):
    """inspect: layer 0 dense (mlp_only_layers), the experts counted from the 3-D banks experts.fc / experts.proj that
    no source encoding splits (SGLang reads them only as BF16 banks), and said so."""
    r = run("inspect", tiny)
    assert r.code == 0, r.stderr
    assert "MoE layers       7 [1-7]" in r.stdout and "tensors          8 experts per layer\n" in r.stdout, r.stdout
    assert "routed experts stored as 3-D banks no source encoding splits (model.layers.1.mlp.experts.fc" in r.stdout


def test_the_shipped_table_keeps_the_banks_bf16_and_quantizes_the_rest(tiny, tmp_path):
    """``plan`` finds the shipped derived table (and its overlay): each bank copied as stored ([E, 2I, H] and
    [E, H, I], its experts counted), each MoE layer's ``mlp.experts`` (and compressed-tensors' probe names under it)
    and router in the exclude list (the FusedMoE then built unquantized), the attention's qkv_proj and layer 0's
    gate_up_proj NVFP4 under one global scale each, o_proj NVFP4, the head kept. ``pack`` writes the banks byte for
    byte and the output verifies, in both formats."""
    import torch

    r = run("plan", tiny, "--json")
    assert r.code == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["mapping"]["file"] == "mappings/derived/iquest_q1.toml"
    mods = {m["name"]: m for m in plan["modules"]}
    for layer in range(1, LAYERS):
        for leaf, shape in {"fc": [EXPERTS, 2 * INTER, H], "proj": [EXPERTS, H, INTER]}.items():
            m = mods[f"model.layers.{layer}.mlp.experts.{leaf}"]
            assert (m["kind"], m["experts"], m["sources"][0]["shape"]) == ("copy", EXPERTS, shape), m["name"]
            assert "load_iquest_q1_weights" in m["rule"] and "Unexpected IQuest Q1 weight" in m["rule"]
        assert mods[f"model.layers.{layer}.mlp.router"]["kind"] == "keep"
    # the experts module (ModelOpt: SGLang's is_layer_excluded matches it whole) and the three names
    # compressed-tensors' get_moe_scheme probes (PREFIX.0.gate_proj / up_proj / down_proj: the overlay's
    # [engine_names]), so that both formats build the FusedMoE unquantized
    experts = ("experts", "experts.0.down_proj", "experts.0.gate_proj", "experts.0.up_proj", "router")
    assert plan["exclude_modules"] == sorted(
        ["lm_head"] + [f"model.layers.{i}.mlp.{m}" for i in range(1, LAYERS) for m in experts])
    for layer in range(LAYERS):
        for p in "qkv":
            m = mods[f"model.layers.{layer}.self_attn.{p}_proj"]
            assert (m["kind"], m["quantization"]["shared_scale"]) == (
                "nvfp4", f"model.layers.{layer}.self_attn.qkv_proj")
        assert mods[f"model.layers.{layer}.self_attn.o_proj"]["kind"] == "nvfp4"
    assert {mods[f"model.layers.0.mlp.{p}_proj"]["quantization"]["shared_scale"] for p in ("gate", "up")} == {
        "model.layers.0.mlp.gate_up_proj"}
    assert mods["lm_head"]["kind"] == "keep"
    out = tmp_path / "out"
    r = run("pack", tiny, out, "-q")
    assert r.code == 0, r.stderr
    a, b = read_tensors(tiny), read_tensors(out)
    banks = [n for n in a if n.endswith((".mlp.experts.fc", ".mlp.experts.proj"))]
    assert len(banks) == 2 * (LAYERS - 1)
    assert all(b[n].dtype == torch.bfloat16 and torch.equal(a[n], b[n]) for n in banks)
    assert b["model.layers.1.self_attn.o_proj.weight"].dtype == torch.uint8
    assert run("verify-manifest", out, "--input", tiny).code == 0
    ct = tmp_path / "ct"
    r = run("pack", tiny, ct, "--format", "compressed-tensors", "-q")
    assert r.code == 0, r.stderr
    c = read_tensors(ct)
    assert all(torch.equal(a[n], c[n]) for n in banks)
    ignore = json.loads((ct / "config.json").read_text())["quantization_config"]["ignore"]
    assert {f"model.layers.1.mlp.experts.0.{p}_proj" for p in ("gate", "up", "down")} <= set(ignore)
    assert run("verify-manifest", ct, "--input", tiny).code == 0
