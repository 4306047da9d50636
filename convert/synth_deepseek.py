"""Synthetic checkpoints of DeepSeek V3 / R1 and Kimi K2 (``DeepseekV3ForCausalLM``) laid out as the releases.

Kept apart from ``synth.py``'s older ``tiny-deepseek-fp8`` (whose bytes tests/test_same_bytes.py pins) so
that the release layout is a preset and the functions here. Every fact is cited in docs/families.md
("DeepSeek V3 / R1 and Kimi K2"); in short:

- config.json: deepseek-ai/DeepSeek-V3 (and R1, the same keys) and moonshotai/Kimi-K2-Instruct
  (``model_type`` ``kimi_k2``, ``n_group``/``topk_group`` 1, no MTP layer), key for key, at reduced sizes;
  FP8 ``quantization_config {quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size
  [128, 128]}``.
- tensors: every decoder-layer linear (MLA q_a/q_b/kv_a_proj_with_mqa/kv_b/o, dense and shared-expert
  MLPs, routed experts ``mlp.experts.N.{gate,up,down}_proj``) FP8 e4m3 with an fp32
  ``weight_scale_inv`` [ceil(N/128), ceil(K/128)] next to it; the router ``mlp.gate.weight`` BF16 and its
  ``e_score_correction_bias`` FP32 (noaux_tc); norms, ``embed_tokens`` and ``lm_head`` BF16.
- the MTP layer (``num_nextn_predict_layers`` 1, DeepSeek only): ``model.layers.{num_hidden_layers}``, a
  full MoE decoder layer (FP8 as the others) plus ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H]
  and ``shared_head.{norm,head}``, all BF16 (both engines build eh_proj as a plain nn.Linear).
- head dims as released (qk_nope 128, qk_rope 64, v 128): vLLM's MLA prefill backends accept no other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .synth import Preset

Spec = tuple[str, tuple[int, ...], torch.dtype]
BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
ARCHES = ("deepseek_v3_release", "kimi_k2")


def _mla(p: Preset, pre: str) -> Iterator[Spec]:
    h, nh, qk = p.hidden, p.mla_heads, p.nope + p.rope
    yield f"{pre}.q_a_proj.weight", (p.q_lora, h), FP8
    yield f"{pre}.q_a_layernorm.weight", (p.q_lora,), BF16
    yield f"{pre}.q_b_proj.weight", (nh * qk, p.q_lora), FP8
    yield f"{pre}.kv_a_proj_with_mqa.weight", (p.kv_lora + p.rope, h), FP8
    yield f"{pre}.kv_a_layernorm.weight", (p.kv_lora,), BF16
    yield f"{pre}.kv_b_proj.weight", (nh * (p.nope + p.v_head), p.kv_lora), FP8
    yield f"{pre}.o_proj.weight", (h, nh * p.v_head), FP8


def _mlp(pre: str, h: int, inter: int) -> Iterator[Spec]:
    yield f"{pre}.gate_proj.weight", (inter, h), FP8
    yield f"{pre}.up_proj.weight", (inter, h), FP8
    yield f"{pre}.down_proj.weight", (h, inter), FP8


def _layer(p: Preset, i: int) -> Iterator[Spec]:
    pre, h = f"model.layers.{i}", p.hidden
    yield f"{pre}.input_layernorm.weight", (h,), BF16
    yield from _mla(p, f"{pre}.self_attn")
    yield f"{pre}.post_attention_layernorm.weight", (h,), BF16
    if i < p.first_dense:
        yield from _mlp(f"{pre}.mlp", h, p.dense_inter)
        return
    yield f"{pre}.mlp.gate.weight", (p.experts, h), BF16
    yield f"{pre}.mlp.gate.e_score_correction_bias", (p.experts,), FP32
    yield from _mlp(f"{pre}.mlp.shared_experts", h, p.moe_inter * p.shared)
    for e in range(p.experts):
        yield from _mlp(f"{pre}.mlp.experts.{e}", h, p.moe_inter)


def tensor_specs(p: Preset) -> Iterator[Spec]:
    """Every stored tensor: name, logical shape, dtype (float8 marks an FP8 weight with its scale)."""
    h = p.hidden
    yield "model.embed_tokens.weight", (p.vocab, h), BF16
    for i in range(p.layers):
        yield from _layer(p, i)
    for i in range(p.layers, p.layers + p.nextn):  # the MTP layer, after the last decoder layer
        yield from _layer(p, i)
        pre = f"model.layers.{i}"
        yield f"{pre}.embed_tokens.weight", (p.vocab, h), BF16
        yield f"{pre}.enorm.weight", (h,), BF16
        yield f"{pre}.hnorm.weight", (h,), BF16
        yield f"{pre}.eh_proj.weight", (h, 2 * h), BF16
        yield f"{pre}.shared_head.norm.weight", (h,), BF16
        yield f"{pre}.shared_head.head.weight", (p.vocab, h), BF16
    yield "model.norm.weight", (h,), BF16
    yield "lm_head.weight", (p.vocab, h), BF16


FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [128, 128]}
AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}


def _common(p: Preset) -> dict:
    """The keys DeepSeek-V3's and Kimi-K2-Instruct's config.json share, at the preset's sizes."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": AUTO_MAP,
        "aux_loss_alpha": 0.001,
        "ep_size": 1,
        "first_k_dense_replace": p.first_dense,
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "initializer_range": 0.02,
        "intermediate_size": p.dense_inter,
        "kv_lora_rank": p.kv_lora,
        "moe_intermediate_size": p.moe_inter,
        "moe_layer_freq": 1,
        "n_routed_experts": p.experts,
        "n_shared_experts": p.shared,
        "norm_topk_prob": True,
        "num_attention_heads": p.mla_heads,
        "num_experts_per_tok": p.topk,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.mla_heads,
        "num_nextn_predict_layers": p.nextn,
        "pretraining_tp": 1,
        "q_lora_rank": p.q_lora,
        "qk_nope_head_dim": p.nope,
        "qk_rope_head_dim": p.rope,
        "quantization_config": FP8_QUANTIZATION_CONFIG,
        "rms_norm_eps": 1e-06,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": p.v_head,
        "vocab_size": p.vocab,
    }


def _deepseek_v3_config(p: Preset) -> dict:
    """deepseek-ai/DeepSeek-V3's (and R1's) config.json: n_group 8 / topk_group 4 of 256 experts, here
    groups of two experts (n_group experts/2, topk_group half of them), yarn rope, one MTP layer."""
    groups = max(1, p.experts // 2)
    return {**_common(p), "bos_token_id": 0, "eos_token_id": 1, "max_position_embeddings": 163840,
            "model_type": "deepseek_v3", "n_group": groups, "topk_group": max(1, groups // 2),
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "type": "yarn"},
            "rope_theta": 10000, "routed_scaling_factor": 2.5, "transformers_version": "4.33.1"}


def _kimi_k2_config(p: Preset) -> dict:
    """moonshotai/Kimi-K2-Instruct's config.json: model_type kimi_k2, one expert group, no MTP layer."""
    return {**_common(p), "bos_token_id": 163584, "eos_token_id": 163585, "max_position_embeddings": 131072,
            "model_type": "kimi_k2", "n_group": 1, "topk_group": 1,
            "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
            "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "transformers_version": "4.48.3"}


CONFIGS = {"deepseek_v3_release": _deepseek_v3_config, "kimi_k2": _kimi_k2_config}


def config(p: Preset) -> dict:
    return dict(sorted(CONFIGS[p.arch](p).items()))


#: The side files these releases ship besides weights and config (custom config/model code, tokenizer).
SIDE_FILES = {
    "configuration_deepseek.py": "# synthetic stand-in for the release's custom config code\n",
    "modeling_deepseek.py": "# synthetic stand-in for the release's custom model code\n",
    "generation_config.json": '{\n  "bos_token_id": 0,\n  "eos_token_id": 1\n}\n',
    "tokenizer_config.json": '{\n  "model_max_length": 131072\n}\n',
    ".gitattributes": "*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
}
