"""Synthetic checkpoints of Qwen3.5 MoE (``Qwen3_5MoeForConditionalGeneration``) laid out as its release.

Kept apart from ``synth.py`` and ``synth_gqa.py`` so the family is a preset and a module, not a branch in
every other family's function. Every fact is cited in docs/families.md ("Qwen3.5 MoE"); in short
(Qwen/Qwen3.5-397B-A17B, Qwen/Qwen3.5-35B-A3B, transformers 5.20's ``Qwen3_5MoeConfig`` and
``Qwen3_5MoeForConditionalGeneration``):

- a nested config (``text_config``, ``vision_config``); text tensors under ``model.language_model.``, the
  vision tower under ``model.visual.``, ``lm_head.weight`` untied, the MTP block under ``mtp.``;
- layers alternate by ``layer_types`` (``full_attention_interval`` 4: three Gated DeltaNet layers, then
  one gated full-attention layer). A DeltaNet layer stores ``linear_attn.in_proj_qkv`` / ``in_proj_z`` /
  ``in_proj_b`` / ``in_proj_a`` (split, not Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba``),
  ``conv1d.weight`` [conv_dim, 1, K], ``A_log`` / ``dt_bias`` [value heads], ``norm.weight`` [head_dim],
  ``out_proj``; a full-attention layer ``self_attn.q_proj`` with twice the rows (query and its output
  gate, ``attn_output_gate``), ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm`` / ``k_norm`` [head_dim];
- every layer MoE: router ``mlp.gate`` [E, H], ``mlp.shared_expert.{gate,up,down}_proj``,
  ``mlp.shared_expert_gate`` [1, H], routed experts one 2-D BF16 tensor each,
  ``mlp.experts.N.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .synth_gqa import _mlp  # one dense MLP's three projections, as the Qwen3 MoE presets write them

if TYPE_CHECKING:
    from .synth import Preset

Spec = tuple[str, tuple[int, ...], torch.dtype]
BF16 = torch.bfloat16
ARCHES = ("qwen3_5_moe",)
LM = "model.language_model"


def layer_types(p: Preset) -> list[str]:
    """The release's rule (full_attention_interval 4): every fourth layer, 1-based, is full attention."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(p.layers)]


def _linear_attn(p: Preset, pre: str) -> Iterator[Spec]:
    h, d = p.hidden, p.kda_head_dim
    k, v = p.linear_k_heads * d, p.kda_heads * d
    conv_dim = 2 * k + v
    yield f"{pre}.dt_bias", (p.kda_heads,), BF16
    yield f"{pre}.A_log", (p.kda_heads,), BF16
    yield f"{pre}.conv1d.weight", (conv_dim, 1, p.conv), BF16
    yield f"{pre}.norm.weight", (d,), BF16
    yield f"{pre}.out_proj.weight", (h, v), BF16
    yield f"{pre}.in_proj_qkv.weight", (conv_dim, h), BF16
    yield f"{pre}.in_proj_z.weight", (v, h), BF16
    yield f"{pre}.in_proj_b.weight", (p.kda_heads, h), BF16
    yield f"{pre}.in_proj_a.weight", (p.kda_heads, h), BF16


def _full_attn(p: Preset, pre: str) -> Iterator[Spec]:
    h, hd = p.hidden, p.head_dim
    yield f"{pre}.q_proj.weight", (2 * p.attn_heads * hd, h), BF16  # query and its output gate
    yield f"{pre}.k_proj.weight", (p.kv_heads * hd, h), BF16
    yield f"{pre}.v_proj.weight", (p.kv_heads * hd, h), BF16
    yield f"{pre}.o_proj.weight", (h, p.attn_heads * hd), BF16
    yield f"{pre}.q_norm.weight", (hd,), BF16
    yield f"{pre}.k_norm.weight", (hd,), BF16


def _moe(p: Preset, pre: str) -> Iterator[Spec]:
    yield f"{pre}.gate.weight", (p.experts, p.hidden), BF16
    for e in range(p.experts):
        yield from _mlp(f"{pre}.experts.{e}", p.hidden, p.moe_inter)
    yield from _mlp(f"{pre}.shared_expert", p.hidden, p.dense_inter)
    yield f"{pre}.shared_expert_gate.weight", (1, p.hidden), BF16


def _layer(p: Preset, pre: str, kind: str) -> Iterator[Spec]:
    yield f"{pre}.input_layernorm.weight", (p.hidden,), BF16
    yield f"{pre}.post_attention_layernorm.weight", (p.hidden,), BF16
    if kind == "linear_attention":
        yield from _linear_attn(p, f"{pre}.linear_attn")
    else:
        yield from _full_attn(p, f"{pre}.self_attn")
    yield from _moe(p, f"{pre}.mlp")


def _visual(p: Preset) -> Iterator[Spec]:
    """The Qwen3-VL-style vision tower (no deepstack mergers in Qwen3.5)."""
    v, pre = p.vision_hidden, "model.visual"
    yield f"{pre}.patch_embed.proj.weight", (v, 3, 2, 16, 16), BF16
    yield f"{pre}.patch_embed.proj.bias", (v,), BF16
    yield f"{pre}.pos_embed.weight", (p.vision_pos, v), BF16
    for b in range(p.vision_blocks):
        bp = f"{pre}.blocks.{b}"
        for n in ("norm1", "norm2"):
            yield f"{bp}.{n}.weight", (v,), BF16
            yield f"{bp}.{n}.bias", (v,), BF16
        for name, shape in (("attn.qkv", (3 * v, v)), ("attn.proj", (v, v)),
                            ("mlp.linear_fc1", (p.vision_inter, v)), ("mlp.linear_fc2", (v, p.vision_inter))):
            yield f"{bp}.{name}.weight", shape, BF16
            yield f"{bp}.{name}.bias", (shape[0],), BF16
    m = 4 * v  # spatial_merge_size 2: 2 x 2 patches merged
    yield f"{pre}.merger.norm.weight", (v,), BF16
    yield f"{pre}.merger.norm.bias", (v,), BF16
    yield f"{pre}.merger.linear_fc1.weight", (m, m), BF16
    yield f"{pre}.merger.linear_fc1.bias", (m,), BF16
    yield f"{pre}.merger.linear_fc2.weight", (p.hidden, m), BF16
    yield f"{pre}.merger.linear_fc2.bias", (p.hidden,), BF16


def tensor_specs(p: Preset) -> Iterator[Spec]:
    """Every stored tensor of a Qwen3.5 MoE preset: name, shape, dtype."""
    h = p.hidden
    yield f"{LM}.embed_tokens.weight", (p.vocab, h), BF16
    for i, kind in enumerate(layer_types(p)):
        yield from _layer(p, f"{LM}.layers.{i}", kind)
    yield f"{LM}.norm.weight", (h,), BF16
    yield "lm_head.weight", (p.vocab, h), BF16
    yield from _visual(p)
    for i in range(p.nextn):  # mtp_num_hidden_layers: one full-attention MoE layer and its projection
        yield from _layer(p, f"mtp.layers.{i}", "full_attention")
    if p.nextn:
        yield "mtp.fc.weight", (h, 2 * h), BF16
        yield "mtp.norm.weight", (h,), BF16
        yield "mtp.pre_fc_norm_embedding.weight", (h,), BF16
        yield "mtp.pre_fc_norm_hidden.weight", (h,), BF16


def config(p: Preset) -> dict:
    """Qwen/Qwen3.5-397B-A17B's config.json, key for key, at the preset's sizes."""
    rope = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
            "rope_theta": 10000000, "partial_rotary_factor": 0.25}
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
        "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": p.head_dim, "hidden_act": "silu",
        "hidden_size": p.hidden, "initializer_range": 0.02, "layer_types": layer_types(p),
        "linear_conv_kernel_dim": p.conv, "linear_key_head_dim": p.kda_head_dim,
        "linear_num_key_heads": p.linear_k_heads, "linear_num_value_heads": p.kda_heads,
        "linear_value_head_dim": p.kda_head_dim, "max_position_embeddings": 262144,
        "mamba_ssm_dtype": "float32", "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": p.moe_inter, "mtp_num_hidden_layers": p.nextn,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": p.attn_heads,
        "num_experts": p.experts, "num_experts_per_tok": p.topk, "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": p.dense_inter, "use_cache": True, "vocab_size": p.vocab,
        "rope_parameters": rope, "partial_rotary_factor": 0.25,
    }
    vision = {
        "deepstack_visual_indexes": [], "depth": p.vision_blocks, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": p.vision_hidden, "in_channels": 3, "initializer_range": 0.02,
        "intermediate_size": p.vision_inter, "model_type": "qwen3_5_moe", "num_heads": p.vision_heads,
        "num_position_embeddings": p.vision_pos, "out_hidden_size": p.hidden, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "image_token_id": 248056,
        "model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0", "video_token_id": 248057, "vision_config": vision,
        "vision_end_token_id": 248054, "vision_start_token_id": 248053,
    }


#: The side files the release ships besides weights and config (a tokenizer without custom code).
SIDE_FILES = {
    "generation_config.json": '{\n  "bos_token_id": 248044,\n  "eos_token_id": [248046, 248044]\n}\n',
    "tokenizer_config.json": '{\n  "tokenizer_class": "Qwen2Tokenizer",\n  "model_max_length": 262144\n}\n',
    ".gitattributes": "*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
}
