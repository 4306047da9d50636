"""The synthetic presets are laid out as the releases and the engines' K3 / Kimi Linear models are.

The expected tensor set is rebuilt here from config.json alone, the way the engines build their
parameters (vLLM 0.33 models/kimi_k3/nvidia/model.py + kda.py + mla.py + kimi_k25_vit.py, SGLang 0.5.23
models/kimi_k3.py + kimi_k3_vl.py + kimi_linear.py; see presets/kimi_k3.toml and docs/families.md for file:line), so a
synthetic checkpoint whose names, shapes or dtypes drift from what the engines load fails here.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import synth_preset, write_synth
from kimi_convert.synth import byte_cuts, config, tensor_specs, tensors
from kimi_convert.synth.layout import Logical, Part

F32, BF16, U8 = "F32", "BF16", "U8"


def _index(ck: Path) -> dict[str, str]:
    return json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]


def _headers(ck: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for f in sorted(ck.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():  # noqa: SIM118 (safe_open is not iterable)
                sl = sf.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def expected_tensors(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every checkpoint tensor the engines' K3 / Kimi Linear models take, with dtype and shape, from the
    config alone (checkpoint names, before the engines' own renames)."""
    k3 = cfg["model_type"] == "kimi_k3"
    t = cfg["text_config"] if k3 else cfg
    lm = "language_model." if k3 else ""
    lac = t["linear_attn_config"]
    H, L, V = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    heads, hd, K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = heads * hd
    full_rank = bool(lac.get("use_full_rank_gate", False))
    nh, nope, rope, vh = t["num_attention_heads"], t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    kv_lora, q_lora = t["kv_lora_rank"], t.get("q_lora_rank")
    E, inter, shared = t["num_experts"], t["moe_intermediate_size"], t.get("num_shared_experts", 0)
    hx = t.get("routed_expert_hidden_size") or H
    res = t.get("attn_res_block_size") is not None
    mxfp4 = "quantization_config" in t
    out: dict[str, tuple[str, tuple[int, ...]]] = {}

    def add(name, shape, dtype=BF16):
        out[name] = (dtype, tuple(shape))

    add(f"{lm}model.embed_tokens.weight", (V, H))
    add(f"{lm}model.norm.weight", (H,))
    add(f"{lm}lm_head.weight", (V, H))
    if res:
        add(f"{lm}model.output_attn_res_norm.weight", (H,))
        add(f"{lm}model.output_attn_res_proj.weight", (1, H))
    for i in range(L):
        p = f"{lm}model.layers.{i}"
        add(f"{p}.input_layernorm.weight", (H,))
        add(f"{p}.post_attention_layernorm.weight", (H,))
        if res:
            for r in ("self_attention", "mlp"):
                add(f"{p}.{r}_res_norm.weight", (H,))
                add(f"{p}.{r}_res_proj.weight", (1, H))
        a = f"{p}.self_attn"
        if (i + 1) in lac["kda_layers"]:
            for x in "qkv":
                add(f"{a}.{x}_proj.weight", (P, H))
                add(f"{a}.{x}_conv1d.weight", (P, 1, K), F32)
            add(f"{a}.f_a_proj.weight", (hd, H))
            add(f"{a}.f_b_proj.weight", (P, hd))
            add(f"{a}.b_proj.weight", (heads, H))
            add(f"{a}.dt_bias", (P,), F32)
            add(f"{a}.o_norm.weight", (hd,), F32 if k3 else BF16)
            add(f"{a}.o_proj.weight", (H, P))
            if full_rank:
                add(f"{a}.g_proj.weight", (P, H))
                add(f"{a}.A_log", (hd,), F32)
            else:
                add(f"{a}.g_a_proj.weight", (hd, H))
                add(f"{a}.g_b_proj.weight", (P, hd))
                add(f"{a}.A_log", (1, 1, heads, 1), F32)
        else:
            assert (i + 1) in lac["full_attn_layers"]
            if q_lora:
                add(f"{a}.q_a_proj.weight", (q_lora, H))
                add(f"{a}.q_a_layernorm.weight", (q_lora,))
                add(f"{a}.q_b_proj.weight", (nh * (nope + rope), q_lora))
            else:
                add(f"{a}.q_proj.weight", (nh * (nope + rope), H))
            add(f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, H))
            add(f"{a}.kv_a_layernorm.weight", (kv_lora,))
            add(f"{a}.kv_b_proj.weight", (nh * (nope + vh), kv_lora))
            add(f"{a}.o_proj.weight", (H, nh * vh))
            if t.get("mla_use_output_gate"):
                add(f"{a}.g_proj.weight", (nh * vh, H))
        if i < t.get("first_k_dense_replace", 0):
            m, n = f"{p}.mlp", t["intermediate_size"]
            add(f"{m}.gate_proj.weight", (n, H))
            add(f"{m}.up_proj.weight", (n, H))
            add(f"{m}.down_proj.weight", (H, n))
            continue
        m = f"{p}.block_sparse_moe"
        add(f"{m}.gate.weight", (E, H))
        add(f"{m}.gate.e_score_correction_bias", (E,), F32)
        if shared:
            add(f"{m}.shared_experts.gate_proj.weight", (inter * shared, H))
            add(f"{m}.shared_experts.up_proj.weight", (inter * shared, H))
            add(f"{m}.shared_experts.down_proj.weight", (H, inter * shared))
        if t.get("routed_expert_hidden_size") is not None:
            add(f"{m}.routed_expert_down_proj.weight", (hx, H))
            add(f"{m}.routed_expert_up_proj.weight", (H, hx))
            if t.get("latent_moe_use_norm"):
                add(f"{m}.routed_expert_norm.weight", (hx,))
        for e in range(E):
            for w, (n, k) in (("w1", (inter, hx)), ("w3", (inter, hx)), ("w2", (hx, inter))):
                if mxfp4:
                    add(f"{m}.experts.{e}.{w}.weight_packed", (n, k // 2), U8)
                    add(f"{m}.experts.{e}.{w}.weight_scale", (n, k // 32), U8)
                else:
                    add(f"{m}.experts.{e}.{w}.weight", (n, k))
    if k3:
        v = cfg["vision_config"]
        vt, qkv, vi = v["vt_hidden_size"], v["qkv_hidden_size"], v["vt_intermediate_size"]
        ps, (mh, mw) = v["patch_size"], v["merge_kernel_size"]
        merged = v["mm_hidden_size"] * mh * mw
        add("vision_tower.patch_embed.proj.weight", (vt, 3, ps, ps))
        add("vision_tower.patch_embed.pos_emb.weight", (v["init_pos_emb_height"], v["init_pos_emb_width"], vt))
        for j in range(v["vt_num_hidden_layers"]):
            b = f"vision_tower.encoder.blocks.{j}"
            add(f"{b}.norm0.weight", (vt,))
            add(f"{b}.norm1.weight", (vt,))
            add(f"{b}.wqkv.weight", (3 * qkv, vt))
            add(f"{b}.wo.weight", (vt, qkv))
            add(f"{b}.mlp.fc0.weight", (vi, vt))
            add(f"{b}.mlp.fc1.weight", (vt, vi))
        add("vision_tower.encoder.final_layernorm.weight", (vt,))
        add("mm_projector.proj.0.weight", (merged, merged))
        add("mm_projector.proj.2.weight", (v["text_hidden_size"], merged))
        add("mm_projector.post_norm.weight", (v["text_hidden_size"],))
    return out


def _specs(name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor_specs as stored: an MXFP4 weight becomes weight_packed + weight_scale."""
    names = {torch.bfloat16: BF16, torch.float32: F32}
    out = {}
    for tensor, shape, dtype in tensor_specs(synth_preset(name)):
        if dtype == torch.uint8:
            base, (n, k) = tensor[: -len(".weight")], shape
            out[f"{base}.weight_packed"] = (U8, (n, k // 2))
            out[f"{base}.weight_scale"] = (U8, (n, k // 32))
        else:
            out[tensor] = (names[dtype], tuple(shape))
    return out


def _diff(got: dict, want: dict) -> str:
    missing = sorted(set(want) - set(got))[:8]
    extra = sorted(set(got) - set(want))[:8]
    wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])[:8]
    return f"missing {missing}, unexpected {extra}, wrong dtype/shape {[(k, got[k], want[k]) for k in wrong]}"


# --- config.json where the engines read it -------------------------------------------------------------


def test_k3_config_is_laid_out_as_the_release(tiny_k3):
    cfg = json.loads((tiny_k3 / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    t = cfg["text_config"]
    assert t["model_type"] == "kimi_linear"
    lac = t["linear_attn_config"]
    # both engines read linear_attn_config["use_full_rank_gate"]; nothing at the top of text_config
    assert lac["use_full_rank_gate"] is True and lac["gate_lower_bound"] == -5.0
    assert "use_full_rank_gate" not in t and "use_full_rank_gate" not in cfg
    for key, value in {"mla_use_nope": True, "mla_use_output_gate": True, "latent_moe_use_norm": True,
                       "hidden_act": "situ", "topk_method": "noaux_tc"}.items():
        assert t[key] == value, key
    assert isinstance(t["attn_res_block_size"], int) and t["attn_res_block_size"] > 0
    assert t["routed_expert_hidden_size"] < t["hidden_size"]
    assert "num_experts_per_token" in t and "num_experts_per_tok" not in t
    # release: the compressed-tensors MXFP4 config lives in text_config only
    q = t["quantization_config"]
    assert "quantization_config" not in cfg
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["type"], w["scale_dtype"]) == (4, 32, "float", "torch.uint8")


def test_layer_lists_are_one_based_and_follow_the_release_pattern(tiny_k3, tiny_kl):
    for ck in (tiny_k3, tiny_kl):
        cfg = json.loads((ck / "config.json").read_text())
        t = cfg.get("text_config", cfg)
        lac, n = t["linear_attn_config"], t["num_hidden_layers"]
        assert sorted(lac["kda_layers"] + lac["full_attn_layers"]) == list(range(1, n + 1))
        # MLA every fourth layer and the last (K3: 4..92, 93; Kimi-Linear-48B: 4..24, 27)
        assert lac["full_attn_layers"] == [i for i in range(1, n + 1) if i % 4 == 0 or i == n]
        assert lac["num_heads"] <= lac["head_dim"] or "use_full_rank_gate" not in lac  # A_log [head_dim]


def test_k3_vision_config_has_what_the_vision_tower_reads(tiny_k3):
    cfg = json.loads((tiny_k3 / "config.json").read_text())
    v = cfg["vision_config"]
    assert v["mm_projector_type"] == "patchmergerv2" and v["merge_type"] == "sd2_tpool"
    assert v["norm_type"] == "rmsnorm" and v["pos_emb_type"] == "divided_fixed"
    assert v["patch_embed_proj_bias"] is False and v["attn_bias"] is False and v["linear_bias"] is False
    assert v["merge_kernel_size"] == [2, 2] and v["patch_size"] == 14
    assert v["text_hidden_size"] == cfg["text_config"]["hidden_size"]
    assert v["mm_hidden_size"] == v["vt_hidden_size"]
    # Rope2DPosEmbRepeated asserts (qkv_hidden_size // heads) % 4 == 0 in both engines
    head = v["qkv_hidden_size"] // v["vt_num_attention_heads"]
    assert head * v["vt_num_attention_heads"] == v["qkv_hidden_size"] and head % 4 == 0
    assert v["qkv_hidden_size"] != v["vt_hidden_size"]  # as in the release (1536 vs 1024): shapes tell them apart


def test_kimi_linear_config_is_flat_with_the_low_rank_gate(tiny_kl):
    cfg = json.loads((tiny_kl / "config.json").read_text())
    assert "text_config" not in cfg and cfg["model_type"] == "kimi_linear"
    assert "use_full_rank_gate" not in cfg["linear_attn_config"] and "use_full_rank_gate" not in cfg
    assert cfg["mla_use_nope"] is True and cfg["q_lora_rank"] is None
    assert cfg["hidden_act"] == "silu"  # SGLang's Kimi Linear MoE refuses anything else
    for k3_only in ("attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm", "vision_config",
                    "quantization_config"):
        assert k3_only not in cfg, k3_only


# --- tensors: names, shapes, dtypes --------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_k3", "tiny_kl"])
def test_checkpoint_holds_exactly_what_the_engines_build(fixture, request):
    ck = request.getfixturevalue(fixture)
    cfg = json.loads((ck / "config.json").read_text())
    got, want = _headers(ck), expected_tensors(cfg)
    assert got == want, _diff(got, want)
    assert set(_index(ck)) == set(got)


@pytest.mark.parametrize("name", ["bench-k3", "bench-k3-shards", "bench-kimi-linear", "k3-full-sparse"])
def test_bench_presets_match_their_config(name):
    got, want = _specs(name), expected_tensors(config(synth_preset(name)))
    assert got == want, _diff(got, want)


def test_representative_k3_names(tiny_k3):
    names = set(_index(tiny_k3))
    lm = "language_model.model"
    for n in (f"{lm}.layers.0.self_attn.g_proj.weight", f"{lm}.layers.0.self_attn.q_conv1d.weight",
              f"{lm}.layers.3.self_attn.q_a_proj.weight", f"{lm}.layers.3.self_attn.kv_a_proj_with_mqa.weight",
              f"{lm}.layers.3.self_attn.g_proj.weight",  # MLA output gate
              f"{lm}.layers.1.block_sparse_moe.routed_expert_norm.weight",
              f"{lm}.layers.1.block_sparse_moe.experts.0.w1.weight_packed",
              f"{lm}.layers.1.block_sparse_moe.experts.0.w1.weight_scale",
              f"{lm}.layers.2.self_attention_res_proj.weight", f"{lm}.layers.2.mlp_res_norm.weight",
              f"{lm}.output_attn_res_norm.weight", f"{lm}.output_attn_res_proj.weight",
              "vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.blocks.0.wqkv.weight",
              "mm_projector.proj.0.weight", "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"):
        assert n in names, n
    for wrong in ("mm_projector.pre_norm.weight", "vision_tower.patch_embed.proj.bias",
                  "vision_tower.encoder.blocks.0.wqkv.bias", "vision_tower.encoder.blocks.0.norm0.bias",
                  f"{lm}.layers.0.self_attn.g_a_proj.weight", f"{lm}.layers.3.self_attn.q_proj.weight"):
        assert wrong not in names, wrong


def test_k3_a_log_is_head_dim_long_and_zero_past_the_heads(tiny_k3):
    cfg = json.loads((tiny_k3 / "config.json").read_text())
    lac = cfg["text_config"]["linear_attn_config"]
    name = "language_model.model.layers.0.self_attn.A_log"
    f = tiny_k3 / _index(tiny_k3)[name]
    with safe_open(str(f), "pt") as sf:
        a = sf.get_tensor(name)
    assert a.shape == (lac["head_dim"],) and a.dtype == torch.float32
    assert torch.count_nonzero(a[lac["num_heads"]:]) == 0 and torch.count_nonzero(a[: lac["num_heads"]]) > 0


@pytest.mark.parametrize("preset_name", ["tiny-k3", "tiny-kimi-linear", "bench-k3", "bench-k3-shards",
                                         "bench-kimi-linear"])
def test_every_linear_k_is_a_multiple_of_16(preset_name):
    for name, (dtype, shape) in _specs(preset_name).items():
        if dtype == BF16 and len(shape) == 2 and name.endswith(".weight") and "embed_tokens" not in name:
            assert shape[1] % 16 == 0, (name, shape)
        if name.endswith(".weight_packed"):
            assert (2 * shape[1]) % 32 == 0, (name, shape)


@pytest.mark.parametrize("fixture", ["tiny_k3", "tiny_kl"])
def test_some_fused_group_spans_two_shard_files(fixture, request):
    idx = _index(request.getfixturevalue(fixture))
    groups = {".self_attn.k_proj.weight": ("q_proj", "k_proj", "v_proj"), ".up_proj.weight": ("gate_proj", "up_proj")}
    spans = []
    for n in idx:
        for tail, members in groups.items():
            if n.endswith(tail):
                base = n[: -len(tail.split(".")[-2]) - len(".weight")]
                if len({idx[f"{base}{m}.weight"] for m in members}) > 1:
                    spans.append(base)
    assert spans, "no engine fusion group takes its members from two shard files"


def test_tiny_presets_stay_tiny(tiny_k3, tiny_kl):
    for ck in (tiny_k3, tiny_kl):
        # tiny-k3 is ~10.5 MB: the engines' MXFP4 MoE kernels need experts of at least 128 x 256
        assert sum(f.stat().st_size for f in ck.glob("*.safetensors")) < 12_000_000


@pytest.mark.parametrize("preset_name", ["tiny-k3", "bench-k3", "bench-k3-shards"])
def test_k3_block_fp8_modules_have_k_a_multiple_of_128(preset_name):
    """NVIDIA's K3 recipe stores these attention projections as 128x128 block FP8; vLLM's
    validate_fp8_block_shape refuses a K that is not a multiple of the block (the release's K are 7168,
    128, 1536, 512, 12288)."""
    fp8 = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "g_proj")
    seen = set()
    for name, (_, shape) in _specs(preset_name).items():
        mod = name.rsplit(".", 2)[-2]
        if ".self_attn." in name and mod in fp8:
            seen.add(mod)
            assert shape[1] % 128 == 0, (name, shape)
    assert seen == set(fp8)


def _shard_bytes(specs: list[Logical], shards: int) -> list[int]:
    cuts = byte_cuts(specs, shards)
    assert cuts[0] == 0 and cuts[-1] == len(specs) and cuts == sorted(set(cuts))
    return [sum(part.nbytes for t in specs[a:b] for part in t.parts) for a, b in itertools.pairwise(cuts)]


def test_bench_k3_shards_has_24_shards_of_about_equal_bytes():
    """The NVIDIA-converter benchmark's input: many shards, none much larger or smaller than the mean, so
    that a converter working shard by shard can spread them over its jobs."""
    p = synth_preset("bench-k3-shards")
    sizes = _shard_bytes(list(tensors(p)), p.shards)
    mean = sum(sizes) / len(sizes)
    assert len(sizes) == 24 and 4.5e9 < sum(sizes) < 5.2e9
    assert 0.5 * mean < min(sizes) and max(sizes) < 1.5 * mean, sizes


def test_byte_cuts_keep_each_expert_in_one_shard():
    """NVIDIA's converter refuses an expert whose w1 and w3 are in two shards (they share scale_2)."""
    specs = list(tensors(synth_preset("bench-k3-shards")))
    cuts = set(byte_cuts(specs, 24))
    shard, where = 0, {}
    for i, t in enumerate(specs):
        shard += i in cuts
        if ".experts." in t.name:
            where.setdefault(t.name.rsplit(".", 2)[0], set()).add(shard)
    assert len(where) == 2 * 96 and all(len(s) == 1 for s in where.values())


def test_byte_cuts_after_a_large_tensor_leave_no_tiny_shard():
    def bf16(name: str, n: int) -> Logical:
        return Logical(name, (n,), "bf16", "test", 0, parts=(Part(name, "BF16", (n,)),))

    big = [bf16("big.weight", 1000)]
    small = [bf16(f"s{i}.weight", 100) for i in range(10)]
    # 4000 bytes into 4: "big" holds half of them, so it is one shard and the rest two of 1000 bytes
    assert _shard_bytes(big + small, 4) == [2000, 1000, 1000]


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-deepseek-fp8"])
def test_synth_jobs_write_the_same_bytes(tmp_path, preset):
    """Shards written at once (threads) give the files one at a time gives, index included (the
    FP8 preset, whose last shard takes scales the others defer)."""
    a, b = write_synth(preset, tmp_path / "one"), write_synth(preset, tmp_path / "three", jobs=3)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert len([f for f in files if f.suffix == ".safetensors"]) > 1
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_synth_shards_override(tmp_path):
    """--shards N: the preset's tensors, the same values, in N files (the index says which)."""
    from safetensors.torch import load_file

    a, b = write_synth("tiny-k3", tmp_path / "preset"), write_synth("tiny-k3", tmp_path / "two", shards=2)
    fa, fb = sorted(a.glob("*.safetensors")), sorted(b.glob("*.safetensors"))
    assert len(fb) == 2 and len(fa) > 2
    ta = {k: v for f in fa for k, v in load_file(f).items()}
    tb = {k: v for f in fb for k, v in load_file(f).items()}
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    index = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"]
    assert {index[k] for k in tb} == {f.name for f in fb}
