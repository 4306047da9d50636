"""Issue 38's bench presets of the 2026 releases added in session 22 (`bench-glm5`, `bench-glm4-moe-lite`,
`bench-deepseek-v3-2`, `bench-mistral-large-3`, `bench-qwen4-exp`; benchmarks/RESULTS.md): the release's widths,
a few GB, and what `inspect` and `plan` make of them. Plan only, never a pack: each is synthesized with its data
regions left holes (`sharding.sparse`: real headers, a few hundred KB on disk), which is all `inspect` and `plan`
read."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter

import pytest

from helpers import run, synth_preset


@dataclasses.dataclass(frozen=True)
class Bench:
    """One bench preset's expectations: the release's config values, vLLM benchmark_moe.py's values as `inspect`
    prints them, the main model's MoE layers and the routed experts a layer."""

    widths: dict
    benchmark_moe: str
    moe_layers: str
    experts: int


# The releases' values: docs/families.md ("GLM-5.x", "GLM-4.7-Flash", "DeepSeek V3.2", "Mistral Large 3",
# "Qwen3.8-Flash-Next"); Mistral's in params.json's own names (its layout), Qwen3.8's in text_config.
BENCH = {
    "bench-glm5": Bench(
        {"hidden_size": 6144, "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
         "qk_nope_head_dim": 192, "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128,
         "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
         "num_nextn_predict_layers": 1},
        "E=8 topk=8 moe_intermediate_size=2048 hidden_size=6144", "1 [1]", 8),
    "bench-glm4-moe-lite": Bench(
        {"hidden_size": 2048, "num_attention_heads": 20, "q_lora_rank": 768, "kv_lora_rank": 512,
         "intermediate_size": 10240, "moe_intermediate_size": 1536, "n_routed_experts": 64, "num_experts_per_tok": 4,
         "num_nextn_predict_layers": 1},
        "E=64 topk=4 moe_intermediate_size=1536 hidden_size=2048", "1 [1]", 64),
    "bench-deepseek-v3-2": Bench(
        {"hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
         "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "index_n_heads": 64,
         "index_head_dim": 128, "num_nextn_predict_layers": 1, "quantization_config": {
             "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}},
        "E=16 topk=8 moe_intermediate_size=2048 hidden_size=7168", "1 [1]", 16),
    "bench-mistral-large-3": Bench(
        {"dim": 7168, "n_heads": 128, "head_dim": 192, "q_lora_rank": 1536, "kv_lora_rank": 512, "hidden_dim": 16384,
         "vocab_size": 8192, "moe": {"expert_hidden_dim": 4096, "first_k_dense_replace": 1, "num_expert_groups": 1,
                                     "num_expert_groups_per_tok": 1, "num_experts": 8, "num_experts_per_tok": 4,
                                     "num_shared_experts": 1, "route_every_n": 1, "routed_scale": 1.0}},
        "E=8 topk=4 moe_intermediate_size=4096 hidden_size=7168", "1 [1]", 8),
    "bench-qwen4-exp": Bench(
        {"hidden_size": 2560, "num_attention_heads": 24, "num_key_value_heads": 2, "head_dim": 256,
         "linear_num_key_heads": 16, "linear_num_value_heads": 48, "hc_count": 4, "hc_lowrank": 320,
         "heads_per_ngram": 8, "split_ngram_parts": 128, "moe_intermediate_size": 640,
         "shared_expert_intermediate_size": 640, "num_experts_per_tok": 10, "mtp_num_hidden_layers": 1,
         "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
        "E=32 topk=10 moe_intermediate_size=640 hidden_size=2560", "4 [0-3]", 32),
}


def _config(p) -> dict:
    from kimi_convert.synth import config

    cfg = config(p)
    return cfg.get("text_config", cfg)


@pytest.mark.parametrize("preset", list(BENCH))
def test_the_release_widths_in_a_few_gb(preset):
    from kimi_convert.synth import tensor_specs

    p = synth_preset(preset)
    cfg = _config(p)
    assert {k: cfg[k] for k in BENCH[preset].widths} == BENCH[preset].widths
    size = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in tensor_specs(p))
    assert 2.5e9 < size < 3.5e9, size  # docs/families.md's sizes (2.6-3.3 GB)


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    """Each preset written with real headers and holes for data (plan and inspect read no tensor data)."""
    from kimi_convert.synth import write_synth

    def write(preset: str):
        p = synth_preset(preset)
        out = tmp_path_factory.mktemp(preset)
        write_synth(dataclasses.replace(p, sharding=dataclasses.replace(p.sharding, sparse=True)), out / "src")
        return out / "src"

    return write


@pytest.mark.parametrize("preset", list(BENCH))
def test_inspect_and_plan(preset, headers):
    """`inspect` gives vLLM benchmark_moe.py's values (E, topk, moe_intermediate_size, hidden_size), checked against
    the expert tensors; the default plan quantizes every routed expert of the main model's MoE layers, warns of
    nothing, and (where the release has one) keeps the MTP layer's experts as the default recipe does."""
    src, want = headers(preset), BENCH[preset]
    r = run("inspect", src)
    assert r.code == 0, r.stderr
    assert f"benchmark_moe    {want.benchmark_moe}" in r.stdout, r.stdout
    assert f"MoE layers       {want.moe_layers}" in r.stdout, r.stdout
    assert "warning" not in r.stdout, r.stdout
    r = run("plan", src, "--json")
    assert r.code == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["warnings"] == []
    experts = Counter(m["kind"] for m in plan["modules"]
                      if re.search(r"(^|\.)layers\.\d+\.(mlp\.)?experts\.\d+\.", m["name"]))
    main_moe = int(want.moe_layers.split()[0])
    mtp = 0 if preset == "bench-mistral-large-3" else 1  # Mistral Large 3's release has no MTP layer
    assert (experts["nvfp4"], experts["keep"]) == (3 * want.experts * main_moe, 3 * want.experts * mtp), experts
