"""Synthetic checkpoints shaped like the real releases (names, shapes, dtypes, config, sharding).

The tiny presets are the built-in examples and test fixtures; the bench presets are a few GB with
real-size expert matrices. Values are deterministic for a seed (each tensor draws from its own
generator seeded by its name) with realistic spread: per-row scale variation and rare outliers.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from kimi_convert.kernels.reference import e2m1_codes, pack

from .errors import ConvertError
from .source import INDEX_NAME


@dataclass(frozen=True)
class Preset:
    arch: str  # "kimi_k3" or "kimi_linear"
    hidden: int
    layers: int
    kda_heads: int
    kda_head_dim: int
    conv: int
    mla_heads: int
    q_lora: int  # 0: plain q_proj (Kimi Linear)
    kv_lora: int
    nope: int
    rope: int
    v_head: int
    experts: int
    topk: int
    moe_inter: int
    latent: int  # routed_expert_hidden_size (== hidden: no latent projections)
    shared: int
    dense_inter: int
    first_dense: int
    vocab: int
    vision_hidden: int = 0
    vision_blocks: int = 0
    mxfp4_experts: bool = False
    full_rank_gate: bool = False
    fp8: bool = False  # DeepSeek-style FP8 weights with 128x128 weight_scale_inv
    shards: int = 4
    description: str = ""

    def kinds(self) -> list[str]:
        """K3's pattern: every fourth layer is MLA (full attention), the others KDA; DeepSeek: all MLA."""
        return ["mla" if i % 4 == 2 or self.arch == "deepseek_v3" else "kda" for i in range(self.layers)]


PRESETS: dict[str, Preset] = {
    "tiny-k3": Preset(
        "kimi_k3", hidden=128, layers=4, kda_heads=4, kda_head_dim=32, conv=4, mla_heads=4, q_lora=64,
        kv_lora=32, nope=32, rope=16, v_head=32, experts=8, topk=2, moe_inter=64, latent=64, shared=1,
        dense_inter=256, first_dense=1, vocab=1000, vision_hidden=64, vision_blocks=2, mxfp4_experts=True,
        full_rank_gate=True, description="Kimi K3 layout, hidden 128, 4 layers, 8 MXFP4 experts (~3 MB)",
    ),
    "tiny-kimi-linear": Preset(
        "kimi_linear", hidden=128, layers=4, kda_heads=4, kda_head_dim=32, conv=4, mla_heads=4, q_lora=0,
        kv_lora=32, nope=32, rope=16, v_head=32, experts=8, topk=2, moe_inter=64, latent=128, shared=1,
        dense_inter=256, first_dense=1, vocab=1000, description="Kimi Linear layout, hidden 128, 4 layers (~2 MB)",
    ),
    "tiny-deepseek-fp8": Preset(
        "deepseek_v3", hidden=256, layers=3, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=4, q_lora=96,
        kv_lora=64, nope=32, rope=32, v_head=32, experts=4, topk=2, moe_inter=128, latent=256, shared=1,
        dense_inter=384, first_dense=1, vocab=1000, fp8=True,
        description="DeepSeek V3 layout, FP8 weights with 128x128 block scales, hidden 256 (~2 MB)",
    ),
    "bench-kimi-linear": Preset(
        "kimi_linear", hidden=7168, layers=2, kda_heads=32, kda_head_dim=128, conv=4, mla_heads=32, q_lora=0,
        kv_lora=512, nope=128, rope=64, v_head=128, experts=6, topk=2, moe_inter=3072, latent=7168, shared=1,
        dense_inter=18432, first_dense=0, vocab=8192, shards=4,
        description="Kimi Linear layout at K3 width: bf16 experts 3072 x 7168, ~2.7 GB per 2 layers",
    ),
    "bench-k3": Preset(
        "kimi_k3", hidden=7168, layers=2, kda_heads=32, kda_head_dim=128, conv=4, mla_heads=32, q_lora=1536,
        kv_lora=512, nope=128, rope=64, v_head=128, experts=32, topk=8, moe_inter=3072, latent=3584, shared=2,
        dense_inter=18432, first_dense=0, vocab=8192, vision_hidden=256, vision_blocks=1, mxfp4_experts=True,
        full_rank_gate=True, shards=4,
        description="Kimi K3 at real width: MXFP4 experts 3072 x 3584, latent MoE, ~1.6 GB per 2 layers",
    ),
}


def _gen(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def weight(name: str, shape: tuple[int, ...], seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Gaussian rows of varying scale (log-normal), std ~ 1/sqrt(fan-in), and rare outliers."""
    g = _gen(seed, name)
    fan_in = shape[-1] if len(shape) > 1 else 1
    w = torch.randn(shape, generator=g, dtype=torch.float32)
    if len(shape) >= 2:
        rows = torch.exp(0.5 * torch.randn((*shape[:-1], 1), generator=g))
        w.mul_(rows / math.sqrt(fan_in))
        n_out = max(1, w.numel() // 20000)
        idx = torch.randint(0, w.numel(), (n_out,), generator=g)
        w.view(-1)[idx] *= 8 + 24 * torch.rand(n_out, generator=g)
    else:
        w.mul_(0.05).add_(1.0 if name.endswith("norm.weight") else 0.0)
    return w.to(dtype)


def mxfp4(name: str, shape: tuple[int, int], seed: int, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 tensor (packed codes, E8M0 scales) quantized from a realistic weight.

    ``wide`` scales a few blocks down by 2^-24 so the exponents span more than e4m3 can hold
    around one global scale (the case exact transcoding must refuse).
    """
    w = weight(name, shape, seed, torch.float32)
    n, k = shape
    blocks = w.view(n, k // 32, 32)
    if wide:
        blocks[0, 0].mul_(2.0**-24)
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    x = blocks / torch.exp2(exp).unsqueeze(-1)
    codes = e2m1_codes(x.reshape(n, k))
    return pack(codes), (exp + 127).to(torch.uint8)


def _kda(p: Preset, pre: str) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h, hd, heads = p.hidden, p.kda_head_dim, p.kda_heads
    P = heads * hd
    for x in ("q", "k", "v"):
        yield f"{pre}.{x}_proj.weight", (P, h), torch.bfloat16
        yield f"{pre}.{x}_conv1d.weight", (P, 1, p.conv), torch.float32
    yield f"{pre}.f_a_proj.weight", (hd, h), torch.bfloat16
    yield f"{pre}.f_b_proj.weight", (P, hd), torch.bfloat16
    if p.full_rank_gate:
        yield f"{pre}.g_proj.weight", (P, h), torch.bfloat16
        yield f"{pre}.A_log", (hd,), torch.float32
    else:
        yield f"{pre}.g_a_proj.weight", (hd, h), torch.bfloat16
        yield f"{pre}.g_b_proj.weight", (P, hd), torch.bfloat16
        yield f"{pre}.A_log", (1, 1, heads, 1), torch.float32
    yield f"{pre}.b_proj.weight", (heads, h), torch.bfloat16
    yield f"{pre}.dt_bias", (P,), torch.float32
    yield f"{pre}.o_norm.weight", (hd,), torch.bfloat16
    yield f"{pre}.o_proj.weight", (h, P), torch.bfloat16


def _mla(p: Preset, pre: str) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h, nh = p.hidden, p.mla_heads
    qk = p.nope + p.rope
    if p.q_lora:
        yield f"{pre}.q_a_proj.weight", (p.q_lora, h), torch.bfloat16
        yield f"{pre}.q_a_layernorm.weight", (p.q_lora,), torch.bfloat16
        yield f"{pre}.q_b_proj.weight", (nh * qk, p.q_lora), torch.bfloat16
    else:
        yield f"{pre}.q_proj.weight", (nh * qk, h), torch.bfloat16
    yield f"{pre}.kv_a_proj_with_mqa.weight", (p.kv_lora + p.rope, h), torch.bfloat16
    yield f"{pre}.kv_a_layernorm.weight", (p.kv_lora,), torch.bfloat16
    yield f"{pre}.kv_b_proj.weight", (nh * (p.nope + p.v_head), p.kv_lora), torch.bfloat16
    yield f"{pre}.o_proj.weight", (h, nh * p.v_head), torch.bfloat16
    if p.arch == "kimi_k3":
        yield f"{pre}.g_proj.weight", (nh * p.v_head, h), torch.bfloat16


def _mlp(pre: str, h: int, inter: int) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    yield f"{pre}.gate_proj.weight", (inter, h), torch.bfloat16
    yield f"{pre}.up_proj.weight", (inter, h), torch.bfloat16
    yield f"{pre}.down_proj.weight", (h, inter), torch.bfloat16


def _moe(p: Preset, pre: str) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h, hx, e = p.hidden, p.latent, p.experts
    yield f"{pre}.gate.weight", (e, h), torch.bfloat16
    yield f"{pre}.gate.e_score_correction_bias", (e,), torch.float32
    yield from _mlp(f"{pre}.shared_experts", h, p.moe_inter * p.shared)
    if hx != h:
        yield f"{pre}.routed_expert_down_proj.weight", (hx, h), torch.bfloat16
        yield f"{pre}.routed_expert_norm.weight", (hx,), torch.bfloat16
        yield f"{pre}.routed_expert_up_proj.weight", (h, hx), torch.bfloat16
    for i in range(e):
        for w, shape in (("w1", (p.moe_inter, hx)), ("w2", (hx, p.moe_inter)), ("w3", (p.moe_inter, hx))):
            yield f"{pre}.experts.{i}.{w}.weight", shape, (torch.uint8 if p.mxfp4_experts else torch.bfloat16)


def tensor_specs(p: Preset) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every stored tensor: name, logical shape, dtype (uint8 marks an MXFP4 weight, float8 an FP8
    block-scaled one)."""
    if p.arch == "deepseek_v3":
        yield from _deepseek(p)
        return
    lm = "language_model." if p.arch == "kimi_k3" else ""
    h = p.hidden
    yield f"{lm}model.embed_tokens.weight", (p.vocab, h), torch.bfloat16
    for i, kind in enumerate(p.kinds()):
        pre = f"{lm}model.layers.{i}"
        yield f"{pre}.input_layernorm.weight", (h,), torch.bfloat16
        yield f"{pre}.post_attention_layernorm.weight", (h,), torch.bfloat16
        yield from (_kda(p, f"{pre}.self_attn") if kind == "kda" else _mla(p, f"{pre}.self_attn"))
        if i < p.first_dense:
            yield from _mlp(f"{pre}.mlp", h, p.dense_inter)
        else:
            yield from _moe(p, f"{pre}.block_sparse_moe")
        if p.arch == "kimi_k3":
            for r in ("self_attention", "mlp"):
                yield f"{pre}.{r}_res_norm.weight", (h,), torch.bfloat16
                yield f"{pre}.{r}_res_proj.weight", (1, h), torch.bfloat16
    yield f"{lm}model.norm.weight", (h,), torch.bfloat16
    yield f"{lm}lm_head.weight", (p.vocab, h), torch.bfloat16
    if p.vision_blocks:
        vh = p.vision_hidden
        yield "vision_tower.patch_embed.proj.weight", (vh, 3, 14, 14), torch.bfloat16
        yield "vision_tower.patch_embed.proj.bias", (vh,), torch.bfloat16
        for j in range(p.vision_blocks):
            b = f"vision_tower.encoder.blocks.{j}"
            for mod, shape in (("wqkv", (3 * vh, vh)), ("wo", (vh, vh)), ("mlp.fc0", (4 * vh, vh)),
                               ("mlp.fc1", (vh, 4 * vh))):
                yield f"{b}.{mod}.weight", shape, torch.bfloat16
                yield f"{b}.{mod}.bias", (shape[0],), torch.bfloat16
            for n in ("norm0", "norm1"):
                yield f"{b}.{n}.weight", (vh,), torch.bfloat16
                yield f"{b}.{n}.bias", (vh,), torch.bfloat16
        yield "vision_tower.encoder.final_layernorm.weight", (vh,), torch.bfloat16
        yield "mm_projector.pre_norm.weight", (4 * vh,), torch.bfloat16
        yield "mm_projector.proj.0.weight", (h, 4 * vh), torch.bfloat16
        yield "mm_projector.proj.0.bias", (h,), torch.bfloat16
        yield "mm_projector.proj.2.weight", (h, h), torch.bfloat16
        yield "mm_projector.proj.2.bias", (h,), torch.bfloat16
        yield "mm_projector.post_norm.weight", (h,), torch.bfloat16


def _deepseek(p: Preset) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h = p.hidden
    for name, shape, dtype in _deepseek_bf16(p):
        fp8 = name.endswith("_proj.weight") and dtype == torch.bfloat16
        yield name, shape, (torch.float8_e4m3fn if fp8 else dtype)
    yield "lm_head.weight", (p.vocab, h), torch.bfloat16


def _deepseek_bf16(p: Preset) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h = p.hidden
    yield "model.embed_tokens.weight", (p.vocab, h), torch.bfloat16
    for i in range(p.layers):
        pre = f"model.layers.{i}"
        yield f"{pre}.input_layernorm.weight", (h,), torch.bfloat16
        yield f"{pre}.post_attention_layernorm.weight", (h,), torch.bfloat16
        yield from _mla(p, f"{pre}.self_attn")
        if i < p.first_dense:
            yield from _mlp(f"{pre}.mlp", h, p.dense_inter)
            continue
        yield f"{pre}.mlp.gate.weight", (p.experts, h), torch.bfloat16
        yield f"{pre}.mlp.gate.e_score_correction_bias", (p.experts,), torch.float32
        yield from _mlp(f"{pre}.mlp.shared_experts", h, p.moe_inter * p.shared)
        for e in range(p.experts):
            yield from _mlp(f"{pre}.mlp.experts.{e}", h, p.moe_inter)
    yield "model.norm.weight", (h,), torch.bfloat16


def fp8_block(name: str, shape: tuple[int, int], seed: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 e4m3 weight and its fp32 weight_scale_inv [ceil(M/128), ceil(N/128)], DeepSeek style."""
    w = weight(name, shape, seed, torch.float32)
    m, n = shape
    bm, bn = -(-m // block), -(-n // block)
    pad = torch.zeros(bm * block, bn * block)
    pad[:m, :n] = w
    amax = pad.view(bm, block, bn, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (pad.view(bm, block, bn, block) / scale[:, None, :, None]).view(bm * block, bn * block)[:m, :n]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float()


def _text_config(p: Preset) -> dict:
    kinds = p.kinds()
    cfg = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": p.hidden,
        "num_hidden_layers": p.layers,
        "vocab_size": p.vocab,
        "intermediate_size": p.dense_inter,
        "num_attention_heads": p.mla_heads,
        "num_key_value_heads": p.mla_heads,
        "q_lora_rank": p.q_lora or None,
        "kv_lora_rank": p.kv_lora,
        "qk_nope_head_dim": p.nope,
        "qk_rope_head_dim": p.rope,
        "v_head_dim": p.v_head,
        "num_experts": p.experts,
        "num_experts_per_token": p.topk,
        "num_shared_experts": p.shared,
        "moe_intermediate_size": p.moe_inter,
        "first_k_dense_replace": p.first_dense,
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "kda"],
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "mla"],
            "num_heads": p.kda_heads,
            "head_dim": p.kda_head_dim,
            "short_conv_kernel_size": p.conv,
        },
    }
    if p.arch == "kimi_k3":
        cfg["routed_expert_hidden_size"] = p.latent
        cfg["use_full_rank_gate"] = p.full_rank_gate
    return cfg


def _deepseek_config(p: Preset) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": p.hidden,
        "num_hidden_layers": p.layers, "vocab_size": p.vocab, "intermediate_size": p.dense_inter,
        "num_attention_heads": p.mla_heads, "q_lora_rank": p.q_lora, "kv_lora_rank": p.kv_lora,
        "qk_nope_head_dim": p.nope, "qk_rope_head_dim": p.rope, "v_head_dim": p.v_head,
        "n_routed_experts": p.experts, "num_experts_per_tok": p.topk, "n_shared_experts": p.shared,
        "moe_intermediate_size": p.moe_inter, "first_k_dense_replace": p.first_dense, "moe_layer_freq": 1,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    }


def config(p: Preset) -> dict:
    if p.arch == "deepseek_v3":
        return _deepseek_config(p)
    text = _text_config(p)
    if p.arch == "kimi_linear":
        return {**text, "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"}}
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                     "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {"model_type": "moonvit", "hidden_size": p.vision_hidden,
                          "num_hidden_layers": p.vision_blocks, "patch_size": 14, "merge_kernel_size": [2, 2]},
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {
                "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "scale_dtype": "torch.uint8"},
                "input_activations": None,
            }},
            "ignore": ["re:^(?!.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$).*"],
        },
    }


SIDE_FILES = {
    "tokenizer_config.json": json.dumps({"tokenizer_class": "TikTokenTokenizer", "model_max_length": 262144,
                                         "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}},
                                        indent=2),
    "tiktoken.model": "".join(f"IQ== {i}\n" for i in range(64)),
    "chat_template.jinja": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}\n",
    "generation_config.json": json.dumps({"max_length": 262144, "eos_token_id": 163586}, indent=2),
    "tokenization_kimi.py": "# synthetic stand-in for the release's custom tokenizer code\n",
}


def _cuts(specs: list, shards: int) -> list[int]:
    """Equal-count shard boundaries, each moved onto the next k_proj/up_proj so that, as in real
    releases, fused groups take their members from two files."""
    per = -(-len(specs) // shards)
    cuts = [0]
    for b in range(per, len(specs), per):
        while b < len(specs) and not specs[b][0].endswith((".k_proj.weight", ".up_proj.weight")):
            b += 1
        if cuts[-1] < b < len(specs):
            cuts.append(b)
    return [*cuts, len(specs)]


def write_synth(preset: str, out: str | Path, seed: int = 0, layers: int | None = None,
                experts: int | None = None, overwrite: bool = False) -> Path:
    if preset not in PRESETS:
        raise ConvertError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if layers is not None:
        p = replace(p, layers=layers)
    if experts is not None:
        p = replace(p, experts=experts)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConvertError(f"{out}: not empty; pass --overwrite to replace it")
        if not (out / "config.json").exists():
            raise ConvertError(f"{out}: not empty and not a checkpoint; refusing to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = list(tensor_specs(p))
    weight_map: dict[str, str] = {}
    total = 0
    cuts = _cuts(specs, p.shards)
    n = len(cuts) - 1
    deferred: dict[str, torch.Tensor] = {}  # FP8 scales stored in another shard than their weight
    for s in range(n):
        fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = deferred if s == n - 1 else {}
        for name, shape, dtype in specs[cuts[s] : cuts[s + 1]]:
            if dtype == torch.float8_e4m3fn:
                base = name[: -len(".weight")]
                tensors[name], scale = fp8_block(name, shape, seed)
                (deferred if ".layers.1." in name and s < n - 1 else tensors)[f"{base}.weight_scale_inv"] = scale
            elif dtype == torch.uint8:
                wide = name.endswith("layers.1.block_sparse_moe.experts.0.w2.weight")
                base = name[: -len(".weight")]
                tensors[f"{base}.weight_packed"], tensors[f"{base}.weight_scale"] = mxfp4(name, shape, seed, wide)
            else:
                tensors[name] = weight(name, shape, seed, dtype)
        for k, v in tensors.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config(p), indent=2) + "\n")
    code = {"kimi_k3": "configuration_kimi_k3.py", "kimi_linear": "configuration_kimi.py"}.get(
        p.arch, "configuration_deepseek.py")
    for name, text in {**SIDE_FILES, code: "# synthetic stand-in for the release's custom config code\n"}.items():
        (out / name).write_text(text)
    return out
