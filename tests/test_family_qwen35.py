"""Qwen3.5 MoE (mappings/qwen3_5_moe.toml, convert/synth_qwen35.py): the plan and inspect on the tiny preset."""

from __future__ import annotations

import json

from helpers import run


def test_inspect_gives_benchmark_moe_values(tmp_path):
    """vLLM's benchmark_moe.py reads text_config's num_experts, num_experts_per_tok, moe_intermediate_size."""
    assert run("synth", "tiny-qwen3-5-moe", tmp_path / "q").code == 0
    r = run("inspect", tmp_path / "q")
    assert r.code == 0, r.stderr
    assert "E=8 topk=2 moe_intermediate_size=128 hidden_size=256" in r.stdout
    assert "linear_attention 3 [0-2], full_attention 1 [3]" in r.stdout


def test_pack_keeps_what_the_engines_build_unquantized(tmp_path):
    assert run("synth", "tiny-qwen3-5-moe", tmp_path / "q").code == 0
    r = run("pack", tmp_path / "q", tmp_path / "o", "-q", "--device", "cpu")
    assert r.code == 0, r.stderr
    ex = json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    for name in ("model.language_model.layers.0.mlp.shared_expert_gate", "model.language_model.layers.0.mlp.gate",
                 "model.language_model.layers.0.linear_attn.in_proj_b", "model.visual.blocks.0.attn.qkv", "mtp.fc"):
        assert name in ex, name
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv" not in ex
    assert not any(".mlp.experts." in n for n in ex)
