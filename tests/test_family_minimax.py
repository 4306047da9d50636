"""MiniMax-M2 without an engine: the presets are laid out as the release (FP8 128x128 block weights), the
plan decides what the engines need (q/k/v share one global scale, w1/w3 of an expert one, the router
kept), ``pack`` decodes the FP8 source exactly, and ``inspect`` gives vLLM ``benchmark_moe.py``'s values.

The expected values are the release's own (docs/families.md, "MiniMax-M2", cites them): MiniMaxAI/MiniMax-M2's
config.json and tensor names, written here by hand, not produced by the code under test.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import one_line_error, read_tensors, run, synth_preset, weight_map, write_synth
from kimi_convert.synth import config, tensor_specs

# MiniMaxAI/MiniMax-M2 config.json: the values that are not sizes (sizes: the preset's).
RELEASE = {
    "architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 128, "hidden_act": "silu",
    "auto_map": {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
                 "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM"},
    "max_position_embeddings": 196608, "model_type": "minimax_m2", "mtp_transformer_layers": 1,
    "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
    "transformers_version": "4.46.1", "use_cache": True, "use_mtp": True, "use_qk_norm": True,
    "use_routing_bias": True, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
}
SIZES = {"attn_type_list", "hidden_size", "intermediate_size", "num_attention_heads", "num_experts_per_tok",
         "num_hidden_layers", "num_key_value_heads", "num_local_experts", "vocab_size"}

# One layer's tensor names in the release's index ({e}: every expert); the FP8 ones with weight_scale_inv.
FP8_WEIGHTS = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w2", "block_sparse_moe.experts.{e}.w3"}
LAYER = ({f"{m}.weight" for m in FP8_WEIGHTS} | {f"{m}.weight_scale_inv" for m in FP8_WEIGHTS}
         | {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias"})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_synth("tiny-minimax-m2", tmp_path_factory.mktemp("minimax") / "mm")


def test_config_is_the_releases(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert set(cfg) == set(RELEASE) | SIZES, set(cfg) ^ (set(RELEASE) | SIZES)
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["attn_type_list"] == [1, 1]  # every layer full attention, as released


def test_tensors_are_the_releases(ckpt):
    names = weight_map(ckpt)
    pre = "model.layers.{}."
    for layer in (0, 1):
        p = pre.format(layer)
        assert {re.sub(r"experts\.\d+\.", "experts.{e}.", n[len(p):]) for n in names if n.startswith(p)} == LAYER
    assert {n for n in names if not n.startswith("model.layers.")} == {"model.embed_tokens.weight",
                                                                          "model.norm.weight", "lm_head.weight"}
    t = read_tensors(ckpt)
    fp8 = {n for n, v in t.items() if v.dtype == torch.float8_e4m3fn}
    assert fp8 == {n for n in names if n.endswith("_proj.weight") or re.search(r"\.w[123]\.weight$", n)}
    assert t["model.layers.0.self_attn.q_norm.weight"].shape == (4 * 128,)  # per_layer: the whole projection
    assert t["model.layers.0.self_attn.k_norm.weight"].shape == (2 * 128,)
    assert t["model.layers.1.block_sparse_moe.e_score_correction_bias"].dtype == torch.float32
    assert t["model.layers.1.block_sparse_moe.experts.7.w2.weight_scale_inv"].shape == (2, 2)  # [256, 256] / 128
    assert t["model.layers.1.block_sparse_moe.experts.7.w2.weight_scale_inv"].dtype == torch.float32


def test_plan(ckpt):
    r = run("plan", ckpt, "--json")
    assert r.code == 0, r.stderr
    mods = {m["name"]: m for m in json.loads(r.stdout)["modules"]}
    for layer in (0, 1):
        pre = f"model.layers.{layer}"
        assert mods[f"{pre}.block_sparse_moe.gate"]["kind"] == "keep"
        assert {mods[f"{pre}.self_attn.{x}_proj"]["quantization"]["shared_scale"] for x in "qkv"} == \
            {f"{pre}.self_attn.qkv_proj"}
        for e in range(8):
            ex = f"{pre}.block_sparse_moe.experts.{e}"
            assert {mods[f"{ex}.{w}"]["quantization"]["shared_scale"] for w in ("w1", "w3")} == {f"{ex}.w13"}
            assert mods[f"{ex}.w2"]["quantization"]["shared_scale"] is None
    assert mods["lm_head"]["kind"] == "keep"


def _decoded(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The FP8 block dequantization written out: every 128x128 tile times its weight_scale_inv."""
    return w.float() * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]


def test_pack_decodes_fp8_and_keeps_the_router(ckpt, tmp_path):
    out = tmp_path / "out"
    r = run("pack", ckpt, out, "-q", "--device", "cpu")
    assert r.code == 0, r.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "W4A16_NVFP4")
    assert sorted(qc["ignore"]) == ["lm_head", "model.layers.0.block_sparse_moe.gate",
                                    "model.layers.1.block_sparse_moe.gate"]
    src, got = read_tensors(ckpt), read_tensors(out)
    assert not any(n.endswith("weight_scale_inv") for n in got)  # decoded and consumed, never copied
    assert got["model.layers.1.block_sparse_moe.gate.weight"].equal(src["model.layers.1.block_sparse_moe.gate.weight"])
    assert got["model.layers.1.block_sparse_moe.e_score_correction_bias"].equal(
        src["model.layers.1.block_sparse_moe.e_score_correction_bias"])
    for layer in (0, 1):
        attn = f"model.layers.{layer}.self_attn"
        assert len({float(got[f"{attn}.{x}_proj.weight_scale_2"]) for x in "qkv"}) == 1
        ex = f"model.layers.{layer}.block_sparse_moe.experts.3"
        assert got[f"{ex}.w1.weight_scale_2"].equal(got[f"{ex}.w3.weight_scale_2"])
        # the global scale is the decoded weights' amax / (448 * 6): decoding was exact, not a cast
        amax = max(_decoded(src[f"{ex}.{w}.weight"], src[f"{ex}.{w}.weight_scale_inv"]).abs().max()
                   for w in ("w1", "w3"))
        assert float(got[f"{ex}.w1.weight_scale_2"]) == pytest.approx(float(amax) / (448 * 6), rel=1e-6)


def test_inspect_gives_benchmark_moe_values(ckpt, tmp_path):
    """vLLM benchmark_moe.py's default (Mixtral) branch, which MiniMaxM2ForCausalLM takes: E = num_local_experts,
    topk = num_experts_per_tok, intermediate_size = intermediate_size (the experts' width), hidden_size."""
    r = run("inspect", ckpt)
    assert "benchmark_moe    E=8 topk=2 moe_intermediate_size=256 hidden_size=256" in r.stdout, r.stdout
    (tmp_path / "bench.json").write_text(json.dumps(config(synth_preset("bench-minimax-m2"))))
    r = run("inspect", tmp_path / "bench.json")
    assert "benchmark_moe    E=64 topk=8 moe_intermediate_size=1536 hidden_size=3072" in r.stdout, r.stdout


def test_bench_preset_has_the_releases_shapes():
    specs = {name: (tuple(shape), dtype) for name, shape, dtype in tensor_specs(synth_preset("bench-minimax-m2"))}
    want = {"self_attn.q_proj.weight": (6144, 3072), "self_attn.k_proj.weight": (1024, 3072),
            "self_attn.o_proj.weight": (3072, 6144), "self_attn.q_norm.weight": (6144,),
            "self_attn.k_norm.weight": (1024,), "block_sparse_moe.gate.weight": (64, 3072),
            "block_sparse_moe.experts.63.w1.weight": (1536, 3072),
            "block_sparse_moe.experts.63.w2.weight": (3072, 1536)}
    want = {f"model.layers.1.{n}": shape for n, shape in want.items()}
    assert {n: specs[n][0] for n in want} == want
    assert specs["model.layers.1.block_sparse_moe.experts.63.w2.weight"][1] == torch.float8_e4m3fn



def test_fp8_weight_without_its_scale_is_one_line(ckpt, tmp_path):
    """An FP8 expert weight stored without its weight_scale_inv (dropped from its shard and the index): one
    line naming the weight and the missing scale, exit 2, nothing written."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    gone = "model.layers.0.block_sparse_moe.experts.5.w3.weight_scale_inv"
    shard = bad / index["weight_map"].pop(gone)
    tensors = load_file(str(shard))
    del tensors[gone]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    err = one_line_error(run("pack", bad, tmp_path / "out", "-q", "--device", "cpu"))
    assert "model.layers.0.block_sparse_moe.experts.5.w3.weight" in err and "weight_scale_inv" in err, err
    assert not (tmp_path / "out" / "config.json").exists()
