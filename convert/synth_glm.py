"""Synthetic checkpoints of the MLA GLM families laid out as their releases: GLM-5.x (``GlmMoeDsaForCausalLM``,
``model_type`` ``glm_moe_dsa``) and GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``, ``glm4_moe_lite``).

Both are DeepSeek-V3-shaped (MLA with q/kv LoRA, a dense first block, sigmoid router with an fp32
``e_score_correction_bias``, one shared expert, routed experts one 2-D BF16 tensor each, one MTP layer at
``model.layers.{num_hidden_layers}``); GLM-5.x adds DeepSeek V3.2's sparse-attention indexer on every
attention layer that computes its own top-k. Every fact is cited in docs/families.md ("GLM-5.x",
"GLM-4.7-Flash"); in short:

- config.json: GLM-5.1's (zai-org/GLM-5.1) and GLM-4.7-Flash's (zai-org/GLM-4.7-Flash) keys, at reduced sizes;
  GLM-5.2's adds ``index_topk_freq`` / ``index_skip_topk_offset`` (layers that reuse the previous top-k
  store no indexer).
- tensors (BF16 but the router bias): MLA ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``,
  ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; GLM-5's indexer
  ``self_attn.indexer.{wq_b,wk,weights_proj}.weight`` and ``k_norm.{weight,bias}`` (a LayerNorm);
  ``mlp.gate.weight`` / ``e_score_correction_bias`` (FP32); ``mlp.shared_experts.*``;
  ``mlp.experts.N.{gate,up,down}_proj.weight``.
- the MTP layer: a full MoE decoder layer (with its indexer) plus ``eh_proj`` [H, 2H], ``enorm``, ``hnorm``,
  ``shared_head.norm``; no ``embed_tokens`` nor ``shared_head.head`` (the draft takes the target's).
- head dims as released (qk_nope 192, qk_rope 64, v 256, kv_lora 512; index_head_dim 128): the engines'
  sparse MLA and indexer take these.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .synth import Preset

Spec = tuple[str, tuple[int, ...], torch.dtype]
BF16, FP32 = torch.bfloat16, torch.float32
ARCHES = ("glm_moe_dsa", "glm4_moe_lite")
SKIP_OFFSET = 3  # GLM-5.2's index_skip_topk_offset: the first two layers and every freq-th after compute top-k


def indexer_full(p: Preset, layer: int) -> bool:
    """Whether ``layer`` computes its own top-k (stores an indexer): both engines' rule, vLLM
    ``DeepseekV32Attention.__init__`` and SGLang ``configs/model_config.py`` ``dsa_layer_skips_topk``
    (``max(layer - offset + 1, 0) % index_topk_freq == 0``); the MTP layer always has one."""
    if p.arch != "glm_moe_dsa":
        return False
    if layer >= p.layers or p.index_freq <= 1:
        return True
    return max(layer - SKIP_OFFSET + 1, 0) % p.index_freq == 0


def _mla(p: Preset, pre: str) -> Iterator[Spec]:
    h, nh = p.hidden, p.mla_heads
    yield f"{pre}.q_a_proj.weight", (p.q_lora, h), BF16
    yield f"{pre}.q_a_layernorm.weight", (p.q_lora,), BF16
    yield f"{pre}.q_b_proj.weight", (nh * (p.nope + p.rope), p.q_lora), BF16
    yield f"{pre}.kv_a_proj_with_mqa.weight", (p.kv_lora + p.rope, h), BF16
    yield f"{pre}.kv_a_layernorm.weight", (p.kv_lora,), BF16
    yield f"{pre}.kv_b_proj.weight", (nh * (p.nope + p.v_head), p.kv_lora), BF16
    yield f"{pre}.o_proj.weight", (h, nh * p.v_head), BF16


def _indexer(p: Preset, pre: str) -> Iterator[Spec]:
    yield f"{pre}.wq_b.weight", (p.index_heads * p.index_head_dim, p.q_lora), BF16
    yield f"{pre}.wk.weight", (p.index_head_dim, p.hidden), BF16
    yield f"{pre}.k_norm.weight", (p.index_head_dim,), BF16
    yield f"{pre}.k_norm.bias", (p.index_head_dim,), BF16
    yield f"{pre}.weights_proj.weight", (p.index_heads, p.hidden), BF16


def _mlp(pre: str, h: int, inter: int) -> Iterator[Spec]:
    yield f"{pre}.gate_proj.weight", (inter, h), BF16
    yield f"{pre}.up_proj.weight", (inter, h), BF16
    yield f"{pre}.down_proj.weight", (h, inter), BF16


def _layer(p: Preset, i: int) -> Iterator[Spec]:
    pre, h = f"model.layers.{i}", p.hidden
    yield f"{pre}.input_layernorm.weight", (h,), BF16
    yield f"{pre}.post_attention_layernorm.weight", (h,), BF16
    yield from _mla(p, f"{pre}.self_attn")
    if indexer_full(p, i):
        yield from _indexer(p, f"{pre}.self_attn.indexer")
    if i < p.first_dense:
        yield from _mlp(f"{pre}.mlp", h, p.dense_inter)
        return
    yield f"{pre}.mlp.gate.weight", (p.experts, h), BF16
    yield f"{pre}.mlp.gate.e_score_correction_bias", (p.experts,), FP32
    yield from _mlp(f"{pre}.mlp.shared_experts", h, p.moe_inter * p.shared)
    for e in range(p.experts):
        yield from _mlp(f"{pre}.mlp.experts.{e}", h, p.moe_inter)


#: GLM-5.2-FP8's linear weights stored BF16 (the router and the indexer's weights_proj; public loaders of the
#: release); every other decoder-layer linear is FP8 e4m3 with a 128x128 weight_scale_inv.
FP8_KEPT = (".mlp.gate.weight", ".indexer.weights_proj.weight")


def tensor_specs(p: Preset) -> Iterator[Spec]:
    """Every stored tensor: name, shape, dtype (float8 marks an FP8 block weight with its weight_scale_inv)."""
    for name, shape, dtype in _bf16_specs(p):
        fp8 = p.fp8 and len(shape) == 2 and name.startswith("model.layers.") and not name.endswith(FP8_KEPT)
        yield name, shape, (torch.float8_e4m3fn if fp8 else dtype)


def _bf16_specs(p: Preset) -> Iterator[Spec]:
    h = p.hidden
    yield "lm_head.weight", (p.vocab, h), BF16
    yield "model.embed_tokens.weight", (p.vocab, h), BF16
    for i in range(p.layers + p.nextn):
        yield from _layer(p, i)
        if i >= p.layers:  # the MTP layer's own modules
            pre = f"model.layers.{i}"
            yield f"{pre}.eh_proj.weight", (h, 2 * h), BF16
            yield f"{pre}.enorm.weight", (h,), BF16
            yield f"{pre}.hnorm.weight", (h,), BF16
            yield f"{pre}.shared_head.norm.weight", (h,), BF16
    yield "model.norm.weight", (h,), BF16


def _common(p: Preset) -> dict:
    """The keys GLM-5.1's and GLM-4.7-Flash's config.json share, at the preset's sizes."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "eos_token_id": [154820, 154827, 154829],
        "first_k_dense_replace": p.first_dense,
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "intermediate_size": p.dense_inter,
        "kv_lora_rank": p.kv_lora,
        "max_position_embeddings": 202752,
        "moe_intermediate_size": p.moe_inter,
        "n_group": 1,
        "n_routed_experts": p.experts,
        "n_shared_experts": p.shared,
        "norm_topk_prob": True,
        "num_attention_heads": p.mla_heads,
        "num_experts_per_tok": p.topk,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.mla_heads,
        "num_nextn_predict_layers": p.nextn,
        "pad_token_id": 154820,
        "q_lora_rank": p.q_lora,
        "qk_nope_head_dim": p.nope,
        "qk_rope_head_dim": p.rope,
        "rms_norm_eps": 1e-05,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "v_head_dim": p.v_head,
        "vocab_size": p.vocab,
    }


def _glm5_config(p: Preset) -> dict:
    """zai-org/GLM-5.1's config.json (GLM-5's the same keys); with ``index_freq`` > 1, GLM-5.2's
    index sharing (``index_topk_freq``, ``index_skip_topk_offset``)."""
    cfg = {**_common(p), "architectures": ["GlmMoeDsaForCausalLM"], "dtype": "bfloat16", "ep_size": 1,
           "head_dim": p.rope, "index_head_dim": p.index_head_dim, "index_n_heads": p.index_heads,
           "index_topk": 2048, "indexer_rope_interleave": True, "initializer_range": 0.02, "moe_layer_freq": 1,
           "model_type": "glm_moe_dsa", "pretraining_tp": 1, "qk_head_dim": p.nope + p.rope,
           "rope_interleave": True, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
           "scoring_func": "sigmoid", "transformers_version": "5.4.0", "use_cache": True}
    if p.index_freq > 1:
        cfg.update(index_topk_freq=p.index_freq, index_skip_topk_offset=SKIP_OFFSET)
    if p.fp8:  # zai-org/GLM-5.2-FP8's quantization_config (its MTP layer's shared_head.norm named)
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["model.embed_tokens", "lm_head", f"model.layers.{p.layers}.shared_head.norm"]}
    return cfg


def _glm4_moe_lite_config(p: Preset) -> dict:
    """zai-org/GLM-4.7-Flash's config.json (vLLM's tests/transformers_utils copy of it, with its MTP layer)."""
    return {**_common(p), "architectures": ["Glm4MoeLiteForCausalLM"], "dtype": "bfloat16",
            "model_type": "glm4_moe_lite", "partial_rotary_factor": 1.0, "rope_scaling": None,
            "rope_theta": 1000000.0, "routed_scaling_factor": 1.8, "transformers_version": "5.0.0.dev0"}


CONFIGS = {"glm_moe_dsa": _glm5_config, "glm4_moe_lite": _glm4_moe_lite_config}


def config(p: Preset) -> dict:
    return dict(sorted(CONFIGS[p.arch](p).items()))


#: The side files these releases ship besides weights and config (transformers' own classes: no custom code).
SIDE_FILES = {
    "generation_config.json": '{\n  "eos_token_id": [154820, 154827, 154829],\n  "pad_token_id": 154820\n}\n',
    "tokenizer_config.json": '{\n  "model_max_length": 202752\n}\n',
    "chat_template.jinja": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\n",
    ".gitattributes": "*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
}
