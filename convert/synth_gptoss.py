"""Synthetic checkpoints of gpt-oss (openai/gpt-oss-20b, -120b) laid out as the release.

Kept apart from ``synth.py`` so that the family is presets and this module. Every fact is cited in
docs/families.md ("gpt-oss"); in short (the release's config.json and model.safetensors.index.json,
vLLM's ``models/gpt_oss.py`` ``GptOssForCausalLM.hf_to_vllm_mapper`` and ``_load_weights_mxfp4``,
transformers' ``integrations/mxfp4.py`` ``convert_moe_packed_tensors``):

- flat config, ``model.`` prefix; ``quantization_config {"quant_method": "mxfp4", "modules_to_not_convert":
  [self_attn, mlp.router, embed_tokens, lm_head]}``; attention q/k/v/o all with bias, ``self_attn.sinks``
  [num_attention_heads]; router ``mlp.router.{weight,bias}``; ``layer_types`` alternating sliding/full;
- routed experts one 3-D bank a layer: ``mlp.experts.gate_up_proj_blocks`` U8 [E, 2I, H/32, 16] (two E2M1
  codes a byte, low nibble first), ``gate_up_proj_scales`` U8 E8M0 [E, 2I, H/32], ``gate_up_proj_bias``
  BF16 [E, 2I], gate rows at even and up rows at odd indices (interleaved); ``down_proj_blocks`` [E, H,
  I/32, 16], ``down_proj_scales`` [E, H, I/32], ``down_proj_bias`` [E, H]; everything else BF16.

The codes come from the same realistic weights as the Kimi presets (``synth.mxfp4``, one expert's
[2I, H] or [H, I] matrix at a time); one block of the last layer's expert 0 down_proj is scaled by
2^-24 so NVIDIA's cast meets a non-lossless block, as the K3 presets do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from .synth import Preset

Spec = tuple[str, tuple[int, ...], torch.dtype]
BF16, U8 = torch.bfloat16, torch.uint8
ARCHES = ("gpt_oss",)
GROUP = 32  # values an E8M0 scale covers


def _attention(p: Preset, pre: str) -> Iterator[Spec]:
    h, hd = p.hidden, p.head_dim
    q, kv = p.attn_heads * hd, p.kv_heads * hd
    for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
        yield f"{pre}.{name}.weight", (rows, cols), BF16
        yield f"{pre}.{name}.bias", (rows,), BF16
    yield f"{pre}.sinks", (p.attn_heads,), BF16


def _experts(p: Preset, pre: str) -> Iterator[Spec]:
    """The stored bank (U8 codes and scales, BF16 biases) as the release names it."""
    e, h, i = p.experts, p.hidden, p.moe_inter
    for name, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        yield f"{pre}.{name}_blocks", (e, n, k // GROUP, 16), U8
        yield f"{pre}.{name}_scales", (e, n, k // GROUP), U8
        yield f"{pre}.{name}_bias", (e, n), BF16


def tensor_specs(p: Preset) -> Iterator[Spec]:
    """Every stored tensor (name, stored shape, stored dtype), in the release's order within a layer."""
    h = p.hidden
    yield "model.embed_tokens.weight", (p.vocab, h), BF16
    for li in range(p.layers):
        pre = f"model.layers.{li}"
        yield f"{pre}.input_layernorm.weight", (h,), BF16
        yield f"{pre}.post_attention_layernorm.weight", (h,), BF16
        yield from _attention(p, f"{pre}.self_attn")
        yield f"{pre}.mlp.router.weight", (p.experts, h), BF16
        yield f"{pre}.mlp.router.bias", (p.experts,), BF16
        yield from _experts(p, f"{pre}.mlp.experts")
    yield "model.norm.weight", (h,), BF16
    yield "lm_head.weight", (p.vocab, h), BF16


def _bank(p: Preset, name: str, seed: int, mxfp4: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's ``<name>_blocks`` [E, N, K/32, 16] and ``<name>_scales`` [E, N, K/32]."""
    base = name[: -len("_blocks")]
    wide_at = f"model.layers.{p.layers - 1}.mlp.experts.down_proj"
    e, n, kb, _ = next(s for nm, s, _ in tensor_specs(p) if nm == name)
    codes, scales = [], []
    for x in range(e):
        c, s = mxfp4(f"{base}.{x}", (n, kb * GROUP), seed, wide=(base == wide_at and x == 0))
        codes.append(c.view(n, kb, 16))
        scales.append(s)
    return torch.stack(codes), torch.stack(scales)


def shard_tensors(p: Preset, names: list[str], seed: int, weight: Callable, mxfp4: Callable
                  ) -> dict[str, torch.Tensor]:
    """The stored tensors ``names`` (a shard's), generated from their names (any sharding, same bytes) by
    ``synth``'s generators (handed in: ``synth`` imports this module)."""
    shapes = {nm: (s, d) for nm, s, d in tensor_specs(p)}
    out: dict[str, torch.Tensor] = {}
    for nm in names:
        shape, dtype = shapes[nm]
        if nm.endswith("_blocks"):
            out[nm], out[nm[: -len("_blocks")] + "_scales"] = _bank(p, nm, seed, mxfp4)
        elif nm.endswith("_scales"):
            continue  # written with its blocks
        else:
            out[nm] = weight(nm, shape, seed, dtype)
    return out


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1


def write(p: Preset, out: Path, seed: int, weight: Callable, mxfp4: Callable) -> tuple[dict[str, str], int]:
    """The shards (a layer's tensors never split; blocks with their scales), as ``synth._write_rest``
    takes them: the weight map and the total size."""
    from .write import default_mode

    names = [nm for nm, _, _ in tensor_specs(p)]
    n = max(1, min(p.shards, p.layers))
    per = -(-p.layers // n)
    groups: list[list[str]] = [[] for _ in range(n)]
    for nm in names:
        li = _layer_of(nm)
        groups[min(n - 1, max(0, li) // per) if li >= 0 else (0 if "embed" in nm else n - 1)].append(nm)
    weight_map: dict[str, str] = {}
    total = 0
    for s, group in enumerate(groups):
        fname = f"model-{s:05d}-of-{n - 1:05d}.safetensors"  # the release's 0-based shard names
        tensors = shard_tensors(p, group, seed, weight, mxfp4)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, default_mode())
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    return weight_map, total


def config(p: Preset) -> dict:
    """openai/gpt-oss-20b's config.json, key for key, at the preset's sizes."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": p.topk,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": p.moe_inter,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(p.layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": p.attn_heads,
        "num_experts_per_tok": p.topk,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads,
        "num_local_experts": p.experts,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": p.vocab,
    }


#: The side files the release ships besides weights and config (its tokenizer has no custom code).
SIDE_FILES = {
    "generation_config.json": '{\n  "bos_token_id": 199998,\n  "eos_token_id": [200002, 199999, 200012],\n'
                              '  "pad_token_id": 199999\n}\n',
    "tokenizer_config.json": '{\n  "tokenizer_class": "PreTrainedTokenizerFast",\n  "model_max_length": 131072\n}\n',
    ".gitattributes": "*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
}
