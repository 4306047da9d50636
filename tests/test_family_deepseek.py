"""DeepSeek V3 / R1 and Kimi K2 without an engine: the presets are laid out as the releases (FP8 e4m3 with
128x128 ``weight_scale_inv``, the MTP layer stored as DeepSeek stores it), the plan keeps what the engines
build unquantized, ``pack`` decodes the FP8 source and writes NVFP4, ``inspect`` gives vLLM
``benchmark_moe.py``'s values.

The expected values are the releases' own (docs/families.md cites them): deepseek-ai/DeepSeek-V3's and
moonshotai/Kimi-K2-Instruct's config.json and tensor names, written here by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import read_tensors, run, synth_preset, weight_map, write_synth
from kimi_convert.synth import config, tensor_specs

# The values of the releases' config.json that are not sizes.
COMMON = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "hidden_act": "silu",
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "moe_layer_freq": 1, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
}
DEEPSEEK = {**COMMON, "model_type": "deepseek_v3", "routed_scaling_factor": 2.5, "rope_theta": 10000,
            "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1}
KIMI_K2 = {**COMMON, "model_type": "kimi_k2", "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
           "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0}

# One MoE layer's names in DeepSeek-V3's model.safetensors.index.json ({e}: every expert); every *_proj
# weight has its weight_scale_inv.
PROJ = {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
        "self_attn.o_proj", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
        "mlp.shared_experts.down_proj", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
        "mlp.experts.{e}.down_proj"}
MOE_LAYER = ({f"{p}.weight" for p in PROJ} | {f"{p}.weight_scale_inv" for p in PROJ}
             | {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_a_layernorm.weight",
                "self_attn.kv_a_layernorm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"})
MTP_EXTRA = {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
             "shared_head.head.weight"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {k: write_synth(f"tiny-{k}", root / k) for k in ("deepseek-v3", "kimi-k2")}


def _layer(names, layer: int) -> set[str]:
    pre = f"model.layers.{layer}."
    return {re.sub(r"experts\.\d+\.", "experts.{e}.", n[len(pre):]) for n in names if n.startswith(pre)}


@pytest.mark.parametrize(("key", "release"), [("deepseek-v3", DEEPSEEK), ("kimi-k2", KIMI_K2)])
def test_config_is_the_releases(key, release, ckpts):
    cfg = json.loads((ckpts[key] / "config.json").read_text())
    assert {k: cfg.get(k) for k in release} == release
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0  # grouped top-k: groups of equal size


def test_tensors_are_the_releases(ckpts):
    names = weight_map(ckpts["deepseek-v3"])
    assert _layer(names, 1) == MOE_LAYER
    assert _layer(names, 2) == MOE_LAYER | MTP_EXTRA  # the MTP layer: index num_hidden_layers
    assert "model.layers.0.mlp.gate_proj.weight_scale_inv" in names  # dense first layer (first_k_dense_replace)
    t = read_tensors(ckpts["deepseek-v3"])
    assert t["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)  # [ceil(192/128), 2]
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16
    # each scale lies in its weight's shard, as the release stores it
    assert all(names[n] == names[n.replace("_scale_inv", "")] for n in names if n.endswith("weight_scale_inv"))
    assert not any(n.startswith("model.layers.2.") for n in weight_map(ckpts["kimi-k2"]))  # Kimi K2: no MTP layer


def test_pack_keeps_what_the_engines_build_unquantized(ckpts, tmp_path):
    out = tmp_path / "out"
    r = run("pack", ckpts["deepseek-v3"], out, "-q", "--device", "cpu")
    assert r.code == 0, r.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "W4A16_NVFP4")
    # the MTP layer (2) kept as the source stores it, decoded: SGLang's DeepseekV3ForCausalLMNextN builds it
    # unquantized under a ModelOpt NVFP4 config (deepseek_nextn.py); and named as each draft asks for it: vLLM's
    # DeepSeekMTP builds its head as model.layers.2.head and the MTP block's packed modules under their own names
    # (deepseek_mtp.py SharedHead, no packed mapping), SGLang's NextN its decoder under model.decoder
    ignore = set(qc["ignore"])
    assert {"lm_head", "model.layers.1.mlp.gate", "model.layers.2.eh_proj", "model.layers.2.mlp.gate",
            "model.layers.2.shared_head.head", "model.layers.2.mlp.experts", "model.layers.2.self_attn.o_proj",
            "model.layers.2.head", "model.layers.2.mlp.shared_experts.gate_up_proj", "model.shared_head.head",
            "model.decoder.mlp.experts", "model.decoder.self_attn.o_proj"} <= ignore
    # its MLA projections kept too, each named with a trailing "*": SGLang's ModelOptQuantConfig.is_layer_excluded
    # reads an entry ending in q_a_proj / q_b_proj / kv_a_proj_with_mqa / kv_b_proj as that projection of EVERY
    # layer (modelopt_quant.py, its fused_patterns), which "...kv_b_proj*" is not; both engines' globs still match it
    mla = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    assert {f"model.layers.2.self_attn.{p}*" for p in mla} | {"model.layers.2.self_attn.fused_qkv_a_proj",
                                                             "model.decoder.self_attn.fused_qkv_a_proj_with_mqa",
                                                             "model.decoder.self_attn.kv_b_proj*"} <= ignore
    assert not any(n.rpartition(".")[2] in mla for n in ignore)
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in ignore - {"model.layers.1.mlp.gate"})
    t = read_tensors(out)
    assert not any(n.endswith("weight_scale_inv") for n in t)  # the FP8 source decoded, its scales consumed
    assert t["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.2.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.2.embed_tokens.weight"].dtype == torch.bfloat16
    for layer in (1,):
        for e in range(8):
            ex = f"model.layers.{layer}.mlp.experts.{e}"
            assert t[f"{ex}.gate_proj.weight_scale_2"].equal(t[f"{ex}.up_proj.weight_scale_2"])  # w13
        sh = f"model.layers.{layer}.mlp.shared_experts"
        assert t[f"{sh}.gate_proj.weight_scale_2"].equal(t[f"{sh}.up_proj.weight_scale_2"])  # gate_up_proj
    assert t["model.layers.2.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.2.mlp.experts.0.gate_proj.weight_scale_2" not in t
    assert t["model.layers.0.mlp.gate_proj.weight_scale_2"].equal(t["model.layers.0.mlp.up_proj.weight_scale_2"])


def test_inspect_gives_benchmark_moe_values(ckpts, tmp_path):
    """vLLM benchmark_moe.py's get_model_params for DeepseekV3ForCausalLM: n_routed_experts,
    num_experts_per_tok, moe_intermediate_size, hidden_size."""
    r = run("inspect", ckpts["deepseek-v3"])
    assert "benchmark_moe    E=8 topk=2 moe_intermediate_size=128 hidden_size=256" in r.stdout, r.stdout
    (tmp_path / "bench.json").write_text(json.dumps(config(synth_preset("bench-deepseek-v3"))))
    r = run("inspect", tmp_path / "bench.json")
    assert "benchmark_moe    E=16 topk=8 moe_intermediate_size=2048 hidden_size=7168" in r.stdout, r.stdout


# DeepSeek-V3's shapes at real width (its index and config: hidden 7168, 128 heads, q_lora 1536, kv_lora 512).
BENCH_SHAPES = {
    "model.layers.0.mlp.gate_proj.weight": (18432, 7168), "model.layers.0.mlp.gate_proj.weight_scale_inv": (144, 56),
    "model.layers.1.self_attn.q_a_proj.weight": (1536, 7168), "model.layers.1.self_attn.q_b_proj.weight": (24576, 1536),
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
    "model.layers.1.self_attn.kv_b_proj.weight": (32768, 512), "model.layers.1.self_attn.o_proj.weight": (7168, 16384),
    "model.layers.1.mlp.experts.15.gate_proj.weight": (2048, 7168), "model.layers.1.mlp.gate.weight": (16, 7168),
}


def test_bench_preset_has_the_releases_shapes():
    specs = {name: tuple(shape) for name, shape, _ in tensor_specs(synth_preset("bench-deepseek-v3"))}
    scales = {f"{n[:-len('.weight')]}.weight_scale_inv": (-(-s[0] // 128), -(-s[1] // 128))
              for n, s in specs.items() if len(s) == 2 and n.endswith("_proj.weight")}
    got = {**specs, **scales}
    assert {n: got.get(n) for n in BENCH_SHAPES} == BENCH_SHAPES


def test_mtp_entries_are_optional_not_silenced(ckpts, tmp_path):
    """Kimi K2 stores no MTP layer: the table's MTP keep entries (optional) raise no unmatched-entry warning,
    while a misspelt entry still does."""
    r = run("plan", ckpts["kimi-k2"], "--json")
    assert r.code == 0, r.stderr
    assert json.loads(r.stdout)["warnings"] == []
    table = Path(__file__).resolve().parents[1] / "mappings" / "deepseek_v3.toml"
    bad = tmp_path / "ds.toml"
    bad.write_text(table.read_text() + '\n[[keep]]\npattern = "model.layers.*.eh_prj"\nreason = "typo"\n')
    r = run("plan", ckpts["kimi-k2"], "--json", "--mapping", bad)
    assert r.code == 0, r.stderr
    assert any("eh_prj" in w for w in json.loads(r.stdout)["warnings"]), r.stdout
