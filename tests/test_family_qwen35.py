"""Qwen3.5 MoE (mappings/qwen3_5_moe.toml, presets/qwen3_5_moe.toml): the plan and inspect on the tiny preset."""

from __future__ import annotations

import json

from helpers import run, synth_preset, write_synth


def test_inspect_gives_benchmark_moe_values(tmp_path):
    """vLLM's benchmark_moe.py reads text_config's num_experts, num_experts_per_tok, moe_intermediate_size."""
    r = run("inspect", write_synth("tiny-qwen3-5-moe", tmp_path / "q"))
    assert r.code == 0, r.stderr
    assert "E=8 topk=2 moe_intermediate_size=128 hidden_size=256" in r.stdout
    assert "linear_attention 3 [0-2], full_attention 1 [3]" in r.stdout


def test_pack_keeps_what_the_engines_build_unquantized(tmp_path):
    r = run("pack", write_synth("tiny-qwen3-5-moe", tmp_path / "q"), tmp_path / "o", "-q", "--device", "cpu")
    assert r.code == 0, r.stderr
    ex = json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    for name in ("model.language_model.layers.0.mlp.shared_expert_gate", "model.language_model.layers.0.mlp.gate",
                 "model.language_model.layers.0.linear_attn.in_proj_b", "model.visual.blocks.0.attn.qkv", "mtp.fc"):
        assert name in ex, name
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv" not in ex
    assert not any(".mlp.experts." in n for n in ex if not n.startswith("mtp."))
    # the MTP block kept as the source stores it (SGLang's Qwen3_5ForCausalLMMTP builds it unquantized under a
    # ModelOpt NVFP4 config: qwen3_5_mtp.py _mtp_quant_config), its packed modules named as the drafts ask for them
    for name in ("mtp.layers.0.mlp.experts", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.self_attn.qkv_proj",
                 "mtp.layers.0.mlp.shared_expert.gate_up_proj"):
        assert name in ex, name


def _modules(p) -> list[str]:
    from kimi_convert import synth

    return sorted({n.rpartition(".")[0] for n, _, _ in synth.tensor_specs(p)})


def test_mtp_entries_warn_only_where_the_input_stores_an_mtp_block():
    """bench-qwen3-5-moe stores no MTP block (nextn 0): the table's mtp.* entries are not reported; on the
    tiny preset, which stores one, a misspelt mtp entry still is."""
    import dataclasses

    from kimi_convert import synth
    from kimi_convert.mapping import find_mapping

    bench, tiny = synth_preset("bench-qwen3-5-moe"), synth_preset("tiny-qwen3-5-moe")
    assert synth.config(bench)["text_config"]["mtp_num_hidden_layers"] == 0
    assert synth.config(tiny)["text_config"]["mtp_num_hidden_layers"] == 1
    m = find_mapping(synth.config(tiny))
    assert m.optional_blocks == ("mtp.",)
    assert m.unmatched(_modules(bench)) == []
    assert m.unmatched(_modules(tiny)) == []
    strict = dataclasses.replace(m, optional_blocks=(), mtp=None)  # (its [mtp] block prefix is optional too)
    assert any("mtp.layers.{layer}.self_attn" in w for w in strict.unmatched(_modules(bench)))
    typo = dataclasses.replace(m, expert_sets=(*m.expert_sets, "mtp.layers.{layer}.mlp.expertz"))
    assert typo.unmatched(_modules(tiny)) == [
        f"mapping qwen3_5_moe ({m.path}): expert_sets 'mtp.layers.{{layer}}.mlp.expertz' "
        "matches no module of the input"]
