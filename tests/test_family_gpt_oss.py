"""gpt-oss presets: the stored layout is the release's (openai/gpt-oss-20b's index, docs/families.md
"gpt-oss"), and the 3-D MXFP4 banks decode (by the OCP MX rule, written out here) to the weights they
were quantized from."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kimi_convert.synth import PRESETS, write_synth

#: E2M1 code -> value (OCP MX spec, table of FP4 E2M1), low nibble first as transformers'
#: integrations/mxfp4.py convert_moe_packed_tensors reads the release.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _release_layer(i: int, h: int, inter: int, e: int, heads: int, kv: int, hd: int) -> dict:
    """One layer of gpt-oss-20b's model.safetensors.index.json, with its shapes and dtypes."""
    p = f"model.layers.{i}"
    out = {f"{p}.input_layernorm.weight": ("BF16", [h]), f"{p}.post_attention_layernorm.weight": ("BF16", [h]),
           f"{p}.mlp.router.weight": ("BF16", [e, h]), f"{p}.mlp.router.bias": ("BF16", [e]),
           f"{p}.self_attn.sinks": ("BF16", [heads])}
    for name, rows, cols in (("q_proj", heads * hd, h), ("k_proj", kv * hd, h), ("v_proj", kv * hd, h),
                             ("o_proj", h, heads * hd)):
        out[f"{p}.self_attn.{name}.weight"] = ("BF16", [rows, cols])
        out[f"{p}.self_attn.{name}.bias"] = ("BF16", [rows])
    for name, n, k in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
        out[f"{p}.mlp.experts.{name}_blocks"] = ("U8", [e, n, k // 32, 16])
        out[f"{p}.mlp.experts.{name}_scales"] = ("U8", [e, n, k // 32])
        out[f"{p}.mlp.experts.{name}_bias"] = ("BF16", [e, n])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synth("tiny-gpt-oss", tmp_path_factory.mktemp("gptoss") / "src")


def _stored(folder) -> dict:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in sorted(set(index.values())):
        with safe_open(str(folder / fname), "pt") as f:
            for k in f.keys():  # noqa: SIM118
                s = f.get_slice(k)
                out[k] = (s.get_dtype(), list(s.get_shape()))
    assert set(out) == set(index)
    return out


def test_tiny_is_the_release_layout(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["quantization_config"]["quant_method"] == "mxfp4"
    h, inter, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    want = {"model.embed_tokens.weight": ("BF16", [cfg["vocab_size"], h]), "model.norm.weight": ("BF16", [h]),
            "lm_head.weight": ("BF16", [cfg["vocab_size"], h])}
    for i in range(cfg["num_hidden_layers"]):
        want.update(_release_layer(i, h, inter, e, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                   cfg["head_dim"]))
    assert _stored(tiny) == want


def _decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1)
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    vals = torch.stack([lut[lo], lut[hi]], dim=-1).flatten(-2)  # [.., K/32, 32]
    vals = vals * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return vals.flatten(-2)


def test_banks_decode_to_their_experts_weights(tiny):
    """Each expert's [2I, H] gate_up matrix (rows interleaved as stored) is its seeded weight within
    MXFP4's bound (half a code step at the block's scale: 1/4 of the block scale, times 2 at the top)."""
    from kimi_convert.synth import weight

    name = "model.layers.0.mlp.experts.gate_up_proj"
    with safe_open(str(tiny / "model-00000-of-00001.safetensors"), "pt") as f:
        w = _decode(f.get_tensor(f"{name}_blocks"), f.get_tensor(f"{name}_scales"))
        scales = f.get_tensor(f"{name}_scales")
    p = PRESETS["tiny-gpt-oss"]
    assert w.shape == (p.experts, 2 * p.moe_inter, p.hidden)
    for x in range(p.experts):
        ref = weight(f"{name}.{x}", (2 * p.moe_inter, p.hidden), 0, torch.float32)
        step = torch.exp2(scales[x].float() - 127).repeat_interleave(32, dim=-1)
        assert ((w[x] - ref).abs() <= step + 1e-12).all()
