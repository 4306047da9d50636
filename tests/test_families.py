"""Qwen3 MoE and GLM-4.5 MoE without an engine: the presets are laid out as the releases, the plan
decides what each engine needs (packed modules share one global scale, routers and MTP projections
kept), ``pack`` writes it, and ``inspect`` gives vLLM ``benchmark_moe.py``'s values.

The expected values are the releases' own (docs/families.md cites them): Qwen/Qwen3-30B-A3B's and
zai-org/GLM-4.5's config.json and tensor names, written here by hand, not produced by the code under test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from helpers import run, synth_preset, write_synth
from kimi_convert.synth import config

# Qwen/Qwen3-30B-A3B config.json: the values that are not sizes (sizes: the preset's).
QWEN3_RELEASE = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 40960, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "norm_topk_prob": True, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
}
QWEN3_SIZES = {"hidden_size", "intermediate_size", "max_window_layers", "moe_intermediate_size",
               "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers",
               "num_key_value_heads", "vocab_size"}
# zai-org/GLM-4.5 config.json: the values that are not sizes.
GLM_RELEASE = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "partial_rotary_factor": 0.5,
    "initializer_range": 0.02, "max_position_embeddings": 131072, "model_type": "glm4_moe", "norm_topk_prob": True,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.54.0",
    "use_cache": True, "use_qk_norm": True,
}
GLM_SIZES = {"hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "n_routed_experts",
             "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace", "num_hidden_layers",
             "num_key_value_heads", "num_nextn_predict_layers", "vocab_size"}

# One MoE layer's tensor names in the releases' model.safetensors.index.json ({e}: every expert).
QWEN3_LAYER = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
               "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
               "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight",
               "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"}
GLM_MOE_LAYER = (QWEN3_LAYER | {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                                "mlp.gate.e_score_correction_bias", "mlp.shared_experts.gate_proj.weight",
                                "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"})
GLM_MTP_EXTRA = {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {k: write_synth(f"tiny-{k}", root / k) for k in ("qwen3-moe", "glm4-moe")}


def _names(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def _layer_names(names, layer: int) -> set[str]:
    pre = f"model.layers.{layer}."
    return {re.sub(r"experts\.\d+\.", "experts.{e}.", n[len(pre):]) for n in names if n.startswith(pre)}


def _dtypes(folder: Path) -> dict[str, str]:
    out = {}
    for shard in sorted(set(_names(folder).values())):
        with safe_open(str(folder / shard), "pt") as f:
            names = list(f.keys())  # safe_open is not a dict
            out.update({k: str(f.get_slice(k).get_dtype()) for k in names})
    return out


@pytest.mark.parametrize(("key", "release", "sizes"), [("qwen3-moe", QWEN3_RELEASE, QWEN3_SIZES),
                                                       ("glm4-moe", GLM_RELEASE, GLM_SIZES)])
def test_config_is_the_releases(key, release, sizes, ckpts):
    cfg = json.loads((ckpts[key] / "config.json").read_text())
    assert set(cfg) == set(release) | sizes, set(cfg) ^ (set(release) | sizes)
    assert {k: cfg[k] for k in release} == release


def test_qwen3_tensors_are_the_releases(ckpts):
    names = _names(ckpts["qwen3-moe"])
    for layer in (0, 1):
        assert _layer_names(names, layer) == QWEN3_LAYER
    assert {n for n in names if not n.startswith("model.layers.")} == {"model.embed_tokens.weight",
                                                                          "model.norm.weight", "lm_head.weight"}
    assert set(_dtypes(ckpts["qwen3-moe"]).values()) == {"BF16"}
    assert sum(".experts." in n and n.endswith("gate_proj.weight") for n in names) == 2 * 8


def test_glm_tensors_are_the_releases(ckpts):
    names = _names(ckpts["glm4-moe"])
    dense = {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
             "mlp.down_proj.weight"} | {n for n in GLM_MOE_LAYER if n.startswith("self_attn.")}
    assert _layer_names(names, 0) == dense  # first_k_dense_replace 1
    assert _layer_names(names, 1) == _layer_names(names, 2) == GLM_MOE_LAYER
    assert _layer_names(names, 3) == GLM_MOE_LAYER | GLM_MTP_EXTRA  # the MTP layer, num_hidden_layers + 0
    dtypes = _dtypes(ckpts["glm4-moe"])
    assert {n for n, d in dtypes.items() if d != "BF16"} == {f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                                                            for i in (1, 2, 3)}
    assert {dtypes[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in (1, 2, 3)} == {"F32"}


def _plan(folder: Path) -> dict[str, dict]:
    r = run("plan", folder, "--json")
    assert r.code == 0, r.stderr
    return {m["name"]: m for m in json.loads(r.stdout)["modules"]}


def test_qwen3_plan(ckpts):
    mods = _plan(ckpts["qwen3-moe"])
    for layer in (0, 1):
        pre = f"model.layers.{layer}"
        assert mods[f"{pre}.mlp.gate"]["kind"] == "keep"
        assert {mods[f"{pre}.self_attn.{x}_proj"]["quantization"]["shared_scale"] for x in "qkv"} == \
            {f"{pre}.self_attn.qkv_proj"}
        assert mods[f"{pre}.self_attn.o_proj"]["quantization"]["shared_scale"] is None
        for e in range(8):
            ex = f"{pre}.mlp.experts.{e}"
            assert {mods[f"{ex}.{x}_proj"]["quantization"]["shared_scale"] for x in ("gate", "up")} == {f"{ex}.w13"}
            assert all(mods[f"{ex}.{x}_proj"]["quantization"]["input_scale"] == 1.0 for x in ("gate", "up", "down"))
        assert mods[f"{pre}.self_attn.q_norm.weight"]["kind"] == "copy"
    assert mods["lm_head"]["kind"] == "keep"


def test_glm_plan(ckpts):
    mods = _plan(ckpts["glm4-moe"])
    assert {mods[f"model.layers.0.mlp.{x}_proj"]["quantization"]["shared_scale"] for x in ("gate", "up")} == \
        {"model.layers.0.mlp.gate_up_proj"}
    for layer in (1, 2, 3):
        pre = f"model.layers.{layer}"
        assert mods[f"{pre}.mlp.gate"]["kind"] == "keep"
        assert mods[f"{pre}.mlp.gate.e_score_correction_bias"]["kind"] == "copy"
        assert mods[f"{pre}.self_attn.q_proj.bias"]["kind"] == "copy"
    for layer in (1, 2):
        pre = f"model.layers.{layer}"
        assert {mods[f"{pre}.mlp.shared_experts.{x}_proj"]["quantization"]["shared_scale"] for x in ("gate", "up")} \
            == {f"{pre}.mlp.shared_experts.gate_up_proj"}
    assert mods["model.layers.3.eh_proj"]["kind"] == "keep"  # both engines build it as a plain nn.Linear
    # the MTP layer kept whole: SGLang's Glm4MoeForCausalLMNextN builds it unquantized under a ModelOpt NVFP4 config
    for m in ("self_attn.q_proj", "mlp.shared_experts.gate_proj", "mlp.experts.0.gate_proj"):
        assert mods[f"model.layers.3.{m}"]["kind"] == "keep"
        assert "Glm4MoeForCausalLMNextN" in mods[f"model.layers.3.{m}"]["rule"]


def test_qwen3_pack_shares_scales_and_keeps_routers(ckpts, tmp_path):
    out = tmp_path / "out"
    r = run("pack", ckpts["qwen3-moe"], out, "-q", "--device", "cpu")
    assert r.code == 0, r.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "W4A16_NVFP4")
    assert sorted(qc["ignore"]) == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    tensors = {}
    for shard in sorted(set(_names(out).values())):
        with safe_open(str(out / shard), "pt") as f:
            names = list(f.keys())  # safe_open is not a dict
            tensors.update({k: f.get_tensor(k) for k in names})
    with safe_open(str(ckpts["qwen3-moe"] / _names(ckpts["qwen3-moe"])["model.layers.1.mlp.gate.weight"]), "pt") as f:
        assert tensors["model.layers.1.mlp.gate.weight"].equal(f.get_tensor("model.layers.1.mlp.gate.weight"))
    for layer in (0, 1):
        attn = f"model.layers.{layer}.self_attn"
        s2 = {float(tensors[f"{attn}.{x}_proj.weight_scale_2"]) for x in "qkv"}
        assert len(s2) == 1, s2
        for e in range(8):
            ex = f"model.layers.{layer}.mlp.experts.{e}"
            assert tensors[f"{ex}.gate_proj.weight_scale_2"].equal(tensors[f"{ex}.up_proj.weight_scale_2"])
            assert tensors[f"{ex}.down_proj.weight"].dtype.itemsize == 1  # packed E2M1


def test_inspect_gives_benchmark_moe_values(ckpts, tmp_path):
    """vLLM benchmark_moe.py's get_model_params: Qwen3MoeForCausalLM reads num_experts, Glm4MoeForCausalLM
    n_routed_experts (with num_experts_per_tok, moe_intermediate_size, hidden_size)."""
    r = run("inspect", ckpts["qwen3-moe"])
    assert "benchmark_moe    E=8 topk=2 moe_intermediate_size=128 hidden_size=256" in r.stdout, r.stdout
    r = run("inspect", ckpts["glm4-moe"])
    assert "benchmark_moe    E=8 topk=2 moe_intermediate_size=128 hidden_size=256" in r.stdout, r.stdout
    assert "MoE layers       2 [1-2]" in r.stdout
    for preset, want in (("bench-qwen3-moe", "E=128 topk=8 moe_intermediate_size=768 hidden_size=2048"),
                         ("bench-glm4-moe", "E=64 topk=8 moe_intermediate_size=1408 hidden_size=4096")):
        (tmp_path / f"{preset}.json").write_text(json.dumps(config(synth_preset(preset))))
        r = run("inspect", tmp_path / f"{preset}.json")
        assert f"benchmark_moe    {want}" in r.stdout, r.stdout


# The releases' shapes at real width (Qwen3-30B-A3B; GLM-4.5-Air, whose MTP layer is layer num_hidden_layers).
BENCH_SHAPES = {
    "bench-qwen3-moe": {
        "model.layers.1.self_attn.q_proj.weight": (4096, 2048), "model.layers.1.self_attn.k_proj.weight": (512, 2048),
        "model.layers.1.self_attn.o_proj.weight": (2048, 4096), "model.layers.1.self_attn.q_norm.weight": (128,),
        "model.layers.1.mlp.gate.weight": (128, 2048), "model.layers.1.mlp.experts.127.gate_proj.weight": (768, 2048),
        "model.layers.1.mlp.experts.127.down_proj.weight": (2048, 768),
    },
    "bench-glm4-moe": {
        "model.layers.0.mlp.gate_proj.weight": (10944, 4096), "model.layers.1.self_attn.q_proj.weight": (12288, 4096),
        "model.layers.1.self_attn.q_proj.bias": (12288,), "model.layers.1.self_attn.k_proj.weight": (1024, 4096),
        "model.layers.1.self_attn.o_proj.weight": (4096, 12288),
        "model.layers.1.mlp.experts.0.up_proj.weight": (1408, 4096),
        "model.layers.1.mlp.shared_experts.down_proj.weight": (4096, 1408),
        "model.layers.2.eh_proj.weight": (4096, 8192),
    },
}


@pytest.mark.parametrize("preset", list(BENCH_SHAPES))
def test_bench_presets_have_the_releases_shapes(preset):
    from kimi_convert.synth import tensor_specs

    specs = {name: tuple(shape) for name, shape, _ in tensor_specs(synth_preset(preset))}
    assert {n: specs.get(n) for n in BENCH_SHAPES[preset]} == BENCH_SHAPES[preset]
    assert not any("q_norm" in n for n in specs) or preset == "bench-qwen3-moe"  # GLM-4.5-Air: use_qk_norm false


@pytest.mark.parametrize("key", ["qwen3-moe", "glm4-moe"])
def test_layouts(key, ckpts, tmp_path):
    """--layout vllm writes vLLM's packed modules fused (it loads them: tests/test_engines.py); --layout sglang
    writes none (SGLang's load_weights renames by substring, 'v_proj' in 'qkv_proj': a fused module on disk is
    skipped, checked with verify-manifest --engine sglang, docs/families.md)."""
    fused = ("qkv_proj.", "gate_up_proj.")
    for layout, want in (("vllm", True), ("sglang", False)):
        out = tmp_path / layout
        r = run("pack", ckpts[key], out, "-q", "--device", "cpu", "--layout", layout)
        assert r.code == 0, r.stderr
        names = _names(out)
        assert any(f"self_attn.{fused[0]}" in n for n in names) is want
        assert any(f in n for n in names for f in fused) is want
        if key == "glm4-moe" and want:
            assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in names
            assert "model.layers.0.self_attn.qkv_proj.bias" in names


def test_sglang_mtp_rule_is_sglangs(monkeypatch):
    """The SGLang runner's MTP rule is SGLang's inline test (glm4_moe.py Glm4MoeForCausalLM.load_weights): a
    ``model.layers.{i}`` name with i >= num_hidden_layers, only when num_nextn_predict_layers > 0."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "convert" / "enginecheck"))
    import sglang_runner

    rule = sglang_runner.mtp_rule(SimpleNamespace(num_nextn_predict_layers=1, num_hidden_layers=3))
    assert rule("model.layers.3.eh_proj.weight") and rule("model.layers.3.mlp.experts.0.up_proj.weight_scale")
    assert rule("model.layers.2.mlp.gate.weight") is None and rule("model.norm.weight") is None
    assert rule("lm_head.weight") is None
    none = sglang_runner.mtp_rule(SimpleNamespace(num_nextn_predict_layers=0, num_hidden_layers=3))
    assert none("model.layers.3.eh_proj.weight") is None
