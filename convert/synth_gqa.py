"""Synthetic checkpoints of the GQA MoE families (Qwen3 MoE, GLM-4.5 MoE) laid out as their releases.

Kept apart from ``synth.py`` (the Kimi/DeepSeek layouts) so that a family is a preset and a function
here, not a branch in every Kimi function. Every fact below is cited in docs/families.md (the release's
config.json and its model.safetensors.index.json tensor names, the engines' loaders, transformers'
configuration classes); in short:

Qwen3 MoE (Qwen/Qwen3-30B-A3B): flat config, ``model.`` prefix, every tensor BF16; attention q/k/v/o
without bias, per-head RMSNorm ``q_norm``/``k_norm`` [head_dim]; every layer MoE (``mlp_only_layers``
empty, ``decoder_sparse_step`` 1): router ``mlp.gate`` [E, H] without bias, routed experts stored one
2-D tensor each, ``mlp.experts.N.{gate,up,down}_proj.weight``; no shared expert; untied ``lm_head``.

GLM-4.5 (zai-org/GLM-4.5, GLM-4.5-Air): flat config, ``model.`` prefix, BF16 with the router's
``e_score_correction_bias`` in FP32; q/k/v with bias (``attention_bias`` true), o without; q/k norm only
with ``use_qk_norm`` (GLM-4.5 true, Air false); the first ``first_k_dense_replace`` layers a dense MLP,
the others MoE with ``n_shared_experts`` shared experts (``mlp.shared_experts.*``) next to the routed
ones; ``num_nextn_predict_layers`` MTP layers stored after the last decoder layer as
``model.layers.{num_hidden_layers + i}`` (a full MoE decoder layer plus ``eh_proj``, ``enorm``,
``hnorm``, ``shared_head.norm``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .synth import Preset

Spec = tuple[str, tuple[int, ...], torch.dtype]
BF16, FP32 = torch.bfloat16, torch.float32


def _attention(p: Preset, pre: str) -> Iterator[Spec]:
    h, hd = p.hidden, p.head_dim
    q, kv = p.attn_heads * hd, p.kv_heads * hd
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        yield f"{pre}.{name}.weight", (rows, h), BF16
        if p.attn_bias:
            yield f"{pre}.{name}.bias", (rows,), BF16
    yield f"{pre}.o_proj.weight", (h, q), BF16
    if p.qk_norm:
        yield f"{pre}.q_norm.weight", (hd,), BF16
        yield f"{pre}.k_norm.weight", (hd,), BF16


def _mlp(pre: str, h: int, inter: int) -> Iterator[Spec]:
    yield f"{pre}.gate_proj.weight", (inter, h), BF16
    yield f"{pre}.up_proj.weight", (inter, h), BF16
    yield f"{pre}.down_proj.weight", (h, inter), BF16


def _moe(p: Preset, pre: str) -> Iterator[Spec]:
    yield f"{pre}.gate.weight", (p.experts, p.hidden), BF16
    if p.arch == "glm4_moe":
        yield f"{pre}.gate.e_score_correction_bias", (p.experts,), FP32
        yield from _mlp(f"{pre}.shared_experts", p.hidden, p.moe_inter * p.shared)
    for e in range(p.experts):
        yield from _mlp(f"{pre}.experts.{e}", p.hidden, p.moe_inter)


def _layer(p: Preset, i: int) -> Iterator[Spec]:
    pre = f"model.layers.{i}"
    yield f"{pre}.input_layernorm.weight", (p.hidden,), BF16
    yield f"{pre}.post_attention_layernorm.weight", (p.hidden,), BF16
    yield from _attention(p, f"{pre}.self_attn")
    if i < p.first_dense:
        yield from _mlp(f"{pre}.mlp", p.hidden, p.dense_inter)
    else:
        yield from _moe(p, f"{pre}.mlp")


def tensor_specs(p: Preset) -> Iterator[Spec]:
    """Every stored tensor of a GQA MoE preset: name, shape, dtype."""
    h = p.hidden
    yield "model.embed_tokens.weight", (p.vocab, h), BF16
    for i in range(p.layers):
        yield from _layer(p, i)
    for i in range(p.layers, p.layers + p.nextn):  # GLM's MTP layers: a decoder layer and its projection
        yield from _layer(p, i)
        pre = f"model.layers.{i}"
        yield f"{pre}.eh_proj.weight", (h, 2 * h), BF16
        yield f"{pre}.enorm.weight", (h,), BF16
        yield f"{pre}.hnorm.weight", (h,), BF16
        yield f"{pre}.shared_head.norm.weight", (h,), BF16
    yield "model.norm.weight", (h,), BF16
    yield "lm_head.weight", (p.vocab, h), BF16


def _qwen3_moe_config(p: Preset) -> dict:
    """Qwen/Qwen3-30B-A3B's config.json, key for key, at the preset's sizes."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "initializer_range": 0.02,
        "intermediate_size": p.dense_inter,
        "max_position_embeddings": 40960,
        "max_window_layers": p.layers,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": p.moe_inter,
        "norm_topk_prob": True,
        "num_attention_heads": p.attn_heads,
        "num_experts": p.experts,
        "num_experts_per_tok": p.topk,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": p.vocab,
    }


def _glm4_moe_config(p: Preset) -> dict:
    """zai-org/GLM-4.5's config.json, key for key, at the preset's sizes (``use_qk_norm`` as the preset
    says: GLM-4.5 true, GLM-4.5-Air false)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "pad_token_id": 151329,
        "eos_token_id": [151329, 151336, 151338],
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "partial_rotary_factor": 0.5,
        "initializer_range": 0.02,
        "intermediate_size": p.dense_inter,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "moe_intermediate_size": p.moe_inter,
        "norm_topk_prob": True,
        "num_attention_heads": p.attn_heads,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": p.experts,
        "n_shared_experts": p.shared,
        "routed_scaling_factor": 2.5,
        "num_experts_per_tok": p.topk,
        "first_k_dense_replace": p.first_dense,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "num_nextn_predict_layers": p.nextn,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0",
        "use_cache": True,
        "use_qk_norm": p.qk_norm,
        "vocab_size": p.vocab,
    }


CONFIGS = {"qwen3_moe": _qwen3_moe_config, "glm4_moe": _glm4_moe_config}
ARCHES = tuple(CONFIGS)


def config(p: Preset) -> dict:
    return CONFIGS[p.arch](p)


#: The side files these releases ship besides weights and config (a tokenizer without custom code).
SIDE_FILES = {
    "generation_config.json": '{\n  "bos_token_id": 151643,\n  "eos_token_id": 151645\n}\n',
    "tokenizer_config.json": '{\n  "tokenizer_class": "Qwen2Tokenizer",\n  "model_max_length": 131072\n}\n',
    ".gitattributes": "*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
}
