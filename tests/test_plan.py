"""The plan: a pure function of headers, config, mapping and rules. No tensor data is read."""

from __future__ import annotations

import pytest
import torch

from helpers import copy_ckpt, edit_config, replace_tensor, rewrite_tensors, run
from kimi_convert.errors import ConvertError
from kimi_convert.mapping import builtin_by_name
from kimi_convert.pack import load_plan
from kimi_convert.plan import Options


def plan_of(folder, **kw):
    """The plan with SGLang's fused-on-disk layout and weight-only NVFP4 (the fusion machinery under
    test); tests of the default layout and recipes pass ``layout`` / ``recipe``."""
    kw = {"layout": "sglang", "recipe": "nvfp4-w4a16", **kw}
    return load_plan(folder, Options(**kw))[1]


def by_name(plan):
    return {it.name: it for it in plan.items}


def test_k3_plan_has_each_group_that_applies(tiny_k3):
    # vLLM's layout: its packed modules fused where its loader takes them
    p = plan_of(tiny_k3, layout="vllm")
    assert {it.group for it in p.items if it.group} == {"gate_up_proj", "fused_qkv_a_g_proj"}
    items = by_name(p)
    f = items["language_model.model.layers.0.mlp.gate_up_proj"]
    assert [s.module.rsplit(".", 1)[1] for s in f.sources] == ["gate_proj", "up_proj"]
    n = f.sources[0].shape[0]
    assert f.op == "cat" and f.kind == "nvfp4" and f.row_ranges() == [(0, n), (n, 2 * n)]
    assert items["language_model.model.layers.1.block_sparse_moe.shared_experts.gate_up_proj"].kind == "nvfp4"
    assert any(n.startswith("in_proj_qkvgfab written unfused") for n in p.notes)  # K3's is padded
    assert any(n.startswith("conv1d written unfused") for n in p.notes)
    # SGLang's layout, with the KDA projections kept BF16 (fused on disk) by excluding them
    p = plan_of(tiny_k3, exclude=("*.self_attn.[qkvg]_proj", "*.self_attn.[fb]_*_proj", "*.self_attn.b_proj"))
    f = by_name(p)["language_model.model.layers.0.self_attn.fused_qkvg_proj"]
    assert [s.module.rsplit(".", 1)[1] for s in f.sources] == ["q_proj", "k_proj", "v_proj", "g_proj"]
    p_ = f.sources[0].shape[0]  # P = num_heads * head_dim
    assert f.kind == "keep" and f.row_ranges() == [(0, p_), (p_, 2 * p_), (2 * p_, 3 * p_), (3 * p_, 4 * p_)]
    assert "language_model.model.layers.0.self_attn.qkv_conv1d" in by_name(p)


def test_mla_q_proj_never_fused_with_kda(tiny_kl):
    p = plan_of(tiny_kl)
    items = by_name(p)
    mla_q = items["model.layers.3.self_attn.q_proj"]  # layer 4 (1-based) is MLA, as in the release
    assert mla_q.group is None and mla_q.kind == "nvfp4"
    for it in p.items:
        if it.group:
            assert not it.name.startswith("model.layers.3.self_attn"), it.name
    assert not [g for g in plan_of(tiny_kl, layout="source").engine_groups if ".layers.3.self_attn." in g.name]


def test_kimi_linear_groups(tiny_kl):
    """SGLang builds fused_qkvbfg_a_proj and fused_fg_b_proj only for an unquantized model, and cannot load
    an NVFP4 module fused on disk: its layout fuses only the conv; vLLM's fuses in_proj_qkvgfab."""
    p = plan_of(tiny_kl)
    items = by_name(p)
    for name in ("fused_qkvbfg_a_proj", "fused_fg_b_proj", "qkv_proj"):
        assert f"model.layers.0.self_attn.{name}" not in items
    assert items["model.layers.0.self_attn.qkv_conv1d"].kind == "keep"
    assert any(n.startswith("qkv_proj (nvfp4) written unfused with --layout sglang") for n in p.notes)
    v = by_name(plan_of(tiny_kl, layout="vllm"))["model.layers.0.self_attn.in_proj_qkvgfab"]
    assert [s.module.rsplit(".", 1)[1] for s in v.sources] == ["q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"]
    assert v.kind == "nvfp4"
    src = plan_of(tiny_kl, layout="source")
    unit = next(u for u in src.units if any(it.name == "model.layers.0.self_attn.b_proj" for it in u.items))
    assert {it.name.rsplit(".", 1)[1] for it in unit.items} == {"q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"}


def test_fused_sources_can_span_files(tiny_k3):
    p = plan_of(tiny_k3)
    assert any(len({s.file for s in it.sources}) > 1 for it in p.items if it.group)


def test_nvidia_exclude_style_keeps_qkv_conv1d(tiny_k3, tmp_path):
    f = tmp_path / "nvidia.txt"
    f.write_text("\n".join(f"language_model.model.layers.{i}.self_attn.{x}_conv1d"
                           for i in (0, 1, 3) for x in "qkv") + "\n")
    p = plan_of(tiny_k3, exclude_from=(str(f),))
    items = by_name(p)
    conv = items["language_model.model.layers.0.self_attn.qkv_conv1d"]
    assert conv.kind == "keep"
    for name in ("qkv_conv1d", "q_conv1d", "k_conv1d", "v_conv1d"):
        assert f"language_model.model.layers.0.self_attn.{name}" in p.exclude_modules
    # even with no user pattern at all, conv1d is never NVFP4 and is always listed
    p0 = plan_of(tiny_k3, default_excludes=False)
    assert "language_model.model.layers.2.self_attn.qkv_conv1d" in p0.exclude_modules


def test_substring_pattern_never_matches_fused_name(tiny_k3):
    # 'v_conv1d' is a substring of 'qkv_conv1d'; as a pattern it names only v_conv1d shards
    # (conv1d is kept anyway); 'v_proj' names only v_proj shards, so fused_qkvg_proj is partial.
    with pytest.raises(ConvertError) as e:
        plan_of(tiny_k3, exclude=("v_proj",))
    msg = str(e.value)
    assert "fused_qkvg_proj" in msg and "excluded language_model.model.layers.0.self_attn.v_proj" in msg
    assert "not excluded" in msg and "q_proj" in msg and "g_proj" in msg


def test_partial_exclusion_fails_naming_shards(tiny_k3):
    with pytest.raises(ConvertError, match=r"module language_model\.model\.layers\.0\.self_attn\.fused_qkvg_proj: "
                                          r"only some shards are excluded: excluded .*v_proj; not excluded .*q_proj"):
        plan_of(tiny_k3, exclude=("language_model.model.layers.0.self_attn.v_proj",))


def test_keep_partial_keeps_whole_module(tiny_k3):
    p = plan_of(tiny_k3, exclude=("*.layers.0.self_attn.v_proj",), keep_partial=True)
    it = by_name(p)["language_model.model.layers.0.self_attn.fused_qkvg_proj"]
    assert it.kind == "keep" and "--keep-partial" in it.rule
    assert "language_model.model.layers.0.self_attn.q_proj" in p.exclude_modules


def test_all_shards_excluded_keeps_module(tiny_k3):
    p = plan_of(tiny_k3, exclude=("*.layers.1.self_attn.[qkvg]_proj",))
    it = by_name(p)["language_model.model.layers.1.self_attn.fused_qkvg_proj"]
    assert it.kind == "keep" and it.outputs[0].dtype == "BF16"
    assert "--exclude" in it.rule


def test_pattern_matching_nothing_is_reported(tiny_k3):
    p = plan_of(tiny_k3, exclude=("*.qkv_conv1d", "no.such.module"))
    assert any("'no.such.module'" in w and "matches no" in w for w in p.warnings)
    assert any("'*.qkv_conv1d'" in w and "fused module" in w for w in p.warnings)


def test_patterns_with_and_without_prefix(tiny_k3):
    a = plan_of(tiny_k3, exclude=("model.layers.1.self_attn.o_proj",))
    b = plan_of(tiny_k3, exclude=("language_model.model.layers.1.self_attn.o_proj.weight",))
    for p in (a, b):
        assert by_name(p)["language_model.model.layers.1.self_attn.o_proj"].kind == "keep"
        assert by_name(p)["language_model.model.layers.0.self_attn.o_proj"].kind == "nvfp4"


def test_experts_are_all_or_nothing_per_layer(tiny_k3):
    with pytest.raises(ConvertError, match="all-or-nothing"):
        plan_of(tiny_k3, exclude=("*.layers.1.block_sparse_moe.experts.0.*",))
    p = plan_of(tiny_k3, exclude=("*.layers.1.block_sparse_moe.experts.*",))
    assert "language_model.model.layers.1.block_sparse_moe.experts" in p.exclude_modules
    kept = [it for it in p.items if ".layers.1.block_sparse_moe.experts." in it.name and it.kind == "keep"]
    assert len(kept) == 24 and all(it.outputs[0].dtype == "BF16" for it in kept)


def test_w1_w3_share_a_scale_unit(tiny_k3):
    p = plan_of(tiny_k3)
    shared = [u for u in p.units if u.shared_scale and u.shared_scale.endswith(".w13")]
    assert len(shared) == 3 * 8
    assert all([it.name.rsplit(".", 1)[1] for it in u.items] == ["w1", "w3"] for u in shared)


def test_missing_member_fails(tiny_k3, tmp_path):
    ck = copy_ckpt(tiny_k3, tmp_path / "c")
    rewrite_tensors(ck, lambda t: t.pop("language_model.model.layers.1.self_attn.g_proj.weight", None))
    with pytest.raises(ConvertError, match=r"layers\.1\.self_attn\.fused_qkvg_proj: fused group is missing g_proj"):
        plan_of(ck)


def test_unfusable_shapes_fail(tiny_kl, tmp_path):
    ck = copy_ckpt(tiny_kl, tmp_path / "c")
    name = "model.layers.0.self_attn.k_proj.weight"
    replace_tensor(ck, name, torch.zeros(128, 96, dtype=torch.bfloat16))
    for layout in ("vllm", "source"):  # fused on disk or by the engine at load: the one check of the members
        with pytest.raises(ConvertError, match=r"in_proj_qkvgfab: members q_proj \[128, 128\] and "
                                               r"k_proj \[128, 96\]: input dimension \(K\) differs"):
            plan_of(ck, layout=layout)


def test_k_not_multiple_of_16_fails(tiny_k3, tmp_path):
    ck = copy_ckpt(tiny_k3, tmp_path / "c")
    name = "language_model.model.layers.1.self_attn.o_proj.weight"
    replace_tensor(ck, name, torch.zeros(128, 120, dtype=torch.bfloat16))
    with pytest.raises(ConvertError, match=r"o_proj: weight \[128, 120\] selected for NVFP4 but K=120"):
        plan_of(ck)
    # excluding it resolves the error
    assert by_name(plan_of(ck, exclude=("*.layers.1.self_attn.o_proj",)))[name[:-7]].kind == "keep"


def test_index_naming_missing_or_outside_file(tiny_k3, tmp_path):
    import json
    for bad in ("missing.safetensors", "../escape.safetensors", "/etc/passwd"):
        ck = copy_ckpt(tiny_k3, tmp_path / f"c{abs(hash(bad))}")
        idx = json.loads((ck / "model.safetensors.index.json").read_text())
        first = next(iter(idx["weight_map"]))
        idx["weight_map"][first] = bad
        (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
        with pytest.raises(ConvertError, match="outside the input folder|missing file"):
            plan_of(ck)


def test_use_full_rank_gate_false_selects_low_rank_groups(tiny_kl, tmp_path):
    # Said where the engines read it (linear_attn_config), the low-rank groups apply: vLLM's
    # in_proj_qkvgfab without g_proj; a flag at the top of the config is not read.
    ck = copy_ckpt(tiny_kl, tmp_path / "c")
    edit_config(ck, lambda c: c["linear_attn_config"].update(use_full_rank_gate=False))
    p = plan_of(ck, layout="source")
    g = next(g for g in p.engine_groups if g.name == "model.layers.0.self_attn.in_proj_qkvgfab")
    assert [m.rsplit(".", 1)[1] for m in g.members] == ["q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"]
    assert not p.notes
    edit_config(ck, lambda c: (c["linear_attn_config"].pop("use_full_rank_gate"), c.update(use_full_rank_gate=True)))
    assert plan_of(ck, layout="source").notes  # not where the engines look: decided from the tensors


def test_mapping_tables_parse_and_have_the_six_groups():
    m = builtin_by_name("kimi_k3")
    names = {g.name for g in m.groups}
    assert {"gate_up_proj", "qkv_proj", "qkv_conv1d", "fused_qkvg_proj", "fused_qkvbfg_a_proj",
            "fused_fg_b_proj"} <= names
    assert {g.name: g.op for g in m.groups}["fused_fg_b_proj"] == "stack"


def test_plan_cli_prints_totals_and_shards(tiny_k3):
    r = run("plan", tiny_k3)
    assert r.code == 0, r.stderr
    assert "recipe nvidia-k3" in r.stdout and "bytes in" in r.stdout and "model-00001-of-00003" in r.stdout
    assert "in_proj_qkvgfab [vllm]" in r.stdout and "fused_qkvg_proj [sglang]" in r.stdout
    r = run("plan", tiny_k3, "--layout", "sglang", "--recipe", "nvfp4-w4a16")
    assert "fused_qkvg_proj" in r.stdout and "model-00001-of-00001" in r.stdout
    r = run("plan", tiny_k3, "--json")
    import json
    d = json.loads(r.stdout)
    assert d["totals"]["nvfp4"] > 0 and d["exclude_modules"]


def test_input_hf_quant_config_exclude_list_is_usable_with_exclude_from(tiny_k3, tmp_path):
    """NVIDIA's exclude list is re-used by naming the file; it is not read from the input on its own."""
    import json
    hq = tmp_path / "hf_quant_config.json"
    hq.write_text(json.dumps({"quantization": {
        "quant_algo": "NVFP4", "exclude_modules": ["language_model.model.layers.3.self_attn.o_proj", "nothing.here"]}}))
    p = plan_of(tiny_k3, exclude_from=(str(hq),))
    it = by_name(p)["language_model.model.layers.3.self_attn.o_proj"]
    assert it.kind == "keep" and str(hq) in it.rule
    assert any(f"'nothing.here' ({hq})" in w for w in p.warnings)
