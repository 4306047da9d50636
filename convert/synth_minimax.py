"""Synthetic checkpoints of MiniMax-M2 (``MiniMaxM2ForCausalLM``) laid out as its release.

Kept apart from ``synth.py`` and ``synth_gqa.py`` so that the family is a preset and a module. Every fact
is cited in docs/families.md ("MiniMax-M2"); in short (MiniMaxAI/MiniMax-M2 and M2.1 ``config.json``):
flat config, ``model.`` prefix; attention q/k/v/o without bias, ``qk_norm_type`` ``per_layer``: one
RMSNorm over the whole projection (``q_norm`` [heads * head_dim], ``k_norm`` [kv_heads * head_dim]),
partial rotary (``rotary_dim`` 64 of ``head_dim`` 128); every layer MoE under ``block_sparse_moe``: the
router ``gate`` [E, H] with ``e_score_correction_bias`` [E] (``use_routing_bias``, sigmoid scoring), routed
experts one 2-D tensor each, ``experts.N.w1`` (gate) / ``w3`` (up) [I, H], ``w2`` (down) [H, I]; no
shared expert (``shared_intermediate_size`` 0); untied ``lm_head``. The release is FP8 (``quant_method``
``fp8``, ``fmt`` ``float8_e4m3fn``, ``weight_block_size`` [128, 128]): every ``*_proj`` and expert weight
F8_E4M3 with an fp32 ``weight_scale_inv`` per 128x128 tile; ``modules_to_not_convert`` (``gate``,
``e_score_correction_bias``, ``lm_head``), the embedding and the norms stay BF16. The config names
``num_mtp_modules`` 3; the preset stores no MTP layer (docs/families.md says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .synth import Preset

Spec = tuple[str, tuple[int, ...], torch.dtype]
BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
ARCHES = ("minimax_m2",)


def _attention(p: Preset, pre: str) -> Iterator[Spec]:
    h = p.hidden
    q, kv = p.attn_heads * p.head_dim, p.kv_heads * p.head_dim
    yield f"{pre}.q_proj.weight", (q, h), FP8
    yield f"{pre}.k_proj.weight", (kv, h), FP8
    yield f"{pre}.v_proj.weight", (kv, h), FP8
    yield f"{pre}.o_proj.weight", (h, q), FP8
    yield f"{pre}.q_norm.weight", (q,), BF16  # per_layer: one norm over every head's outputs
    yield f"{pre}.k_norm.weight", (kv,), BF16


def _moe(p: Preset, pre: str) -> Iterator[Spec]:
    yield f"{pre}.gate.weight", (p.experts, p.hidden), BF16
    yield f"{pre}.e_score_correction_bias", (p.experts,), FP32
    for e in range(p.experts):
        yield f"{pre}.experts.{e}.w1.weight", (p.moe_inter, p.hidden), FP8
        yield f"{pre}.experts.{e}.w2.weight", (p.hidden, p.moe_inter), FP8
        yield f"{pre}.experts.{e}.w3.weight", (p.moe_inter, p.hidden), FP8


def tensor_specs(p: Preset) -> Iterator[Spec]:
    """Every stored tensor of a MiniMax-M2 preset (float8 marks an FP8 block-scaled weight, whose
    ``weight_scale_inv`` the writer adds)."""
    h = p.hidden
    yield "model.embed_tokens.weight", (p.vocab, h), BF16
    for i in range(p.layers):
        pre = f"model.layers.{i}"
        yield f"{pre}.input_layernorm.weight", (h,), BF16
        yield f"{pre}.post_attention_layernorm.weight", (h,), BF16
        yield from _attention(p, f"{pre}.self_attn")
        yield from _moe(p, f"{pre}.block_sparse_moe")
    yield "model.norm.weight", (h,), BF16
    yield "lm_head.weight", (p.vocab, h), BF16


def config(p: Preset) -> dict:
    """MiniMaxAI/MiniMax-M2's config.json, key for key, at the preset's sizes (``rotary_dim`` half of
    ``head_dim``, as released: 64 of 128)."""
    return {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "attn_type_list": [1] * p.layers,
        "auto_map": {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
                     "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM"},
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "intermediate_size": p.moe_inter,
        "max_position_embeddings": 196608,
        "model_type": "minimax_m2",
        "mtp_transformer_layers": 1,
        "num_attention_heads": p.attn_heads,
        "num_experts_per_tok": p.topk,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads,
        "num_local_experts": p.experts,
        "num_mtp_modules": 3,
        "qk_norm_type": "per_layer",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "float8_e4m3fn",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
        },
        "rms_norm_eps": 1e-06,
        "rope_theta": 5000000,
        "rotary_dim": p.head_dim // 2,
        "scoring_func": "sigmoid",
        "shared_intermediate_size": 0,
        "tie_word_embeddings": False,
        "transformers_version": "4.46.1",
        "use_cache": True,
        "use_mtp": True,
        "use_qk_norm": True,
        "use_routing_bias": True,
        "vocab_size": p.vocab,
        "torch_dtype": "bfloat16",
    }


#: The side files besides weights and config (the release ships custom config/model code, named by
#: auto_map; the engines use their own classes and never import it).
SIDE_FILES = {
    "generation_config.json": '{\n  "bos_token_id": 200019,\n  "eos_token_id": 200020\n}\n',
    "tokenizer_config.json": '{\n  "tokenizer_class": "GPT2Tokenizer",\n  "model_max_length": 196608\n}\n',
    "configuration_minimax_m2.py": "# synthetic stand-in for the release's custom config code\n",
    ".gitattributes": "*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
}
