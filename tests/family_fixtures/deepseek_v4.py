"""A tiny DeepSeek V4 (``DeepseekV4ForCausalLM``) checkpoint laid out as deepseek-ai/DeepSeek-V4-Flash is released.

Data first: :func:`config` is the release's ``config.json`` key for key at reduced sizes and :func:`tensors` the
release's tensor list (name, safetensors dtype, shape) as a function of the config alone; :func:`write` fills them
with seeded values and shards them one layer a file, as the release keeps an expert's ``w1`` / ``w3`` in one file
(Model Optimizer's DeepSeek V4 converter pairs them within a shard). Every fact is cited in docs/families.md
("DeepSeek V4"); in short:

- names: DeepSeek's own (``embed``, ``head``, ``norm``, ``hc_head_*``, ``layers.N.{attn,ffn}...``, ``mtp.0...``), no
  ``model.`` prefix; every quantized weight's scale is ``X.scale``;
- routed experts (every layer, the hash-routed ones included; the MTP layer's too): MXFP4, ``weight`` I8 [N, K/2] and
  ``scale`` F8_E8M0 [N, K/32];
- attention (``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``), shared experts, the indexer's ``wq_b`` and MTP
  ``e_proj`` / ``h_proj``: F8_E4M3 with an F8_E8M0 ``scale`` a 128x128 tile;
- BF16: embeddings, head, norms, router ``ffn.gate.weight``, the compressors' ``wkv`` / ``wgate`` and the indexer's
  ``weights_proj`` (both engines build those unquantized); F32: hyper-connection ``hc_*``, ``attn_sink``,
  compressor ``ape``, router ``gate.bias``; I64: the hash layers' ``gate.tid2eid`` [vocab, top-k];
- per layer, ``compress_ratios[i]``: 0 sliding window only, 4 a compressor with overlap (``ape`` [4, 2 * head_dim])
  and an indexer, 128 a compressor without (``ape`` [128, head_dim]); ``num_hash_layers`` first layers hash-routed.

At the release's sizes :func:`tensors` gives DeepSeek-V4-Flash's 69,187 tensors (tests/test_family_deepseek_v4.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

Spec = tuple[str, str, tuple[int, ...]]

#: DeepSeek-V4-Flash's config.json (https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json).
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02, "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4", "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43,
    "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8,
    "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}

#: The tiny preset's sizes: the structure kept (2 window layers of which 1 hash-routed, a ratio-4 layer with its
#: indexer, a ratio-128 layer, the MTP layer), widths the engines' kernels take (head_dim 512, FP8 K % 128 == 0).
TINY = {"hidden_size": 256, "num_hidden_layers": 4, "num_hash_layers": 1, "num_attention_heads": 8,
        "q_lora_rank": 128, "o_lora_rank": 128, "o_groups": 4, "index_n_heads": 4, "index_topk": 64,
        "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024,
        "compress_ratios": [0, 4, 128, 0, 0]}


#: The bench preset: DeepSeek-V4-Flash's width (hidden 4096, 64 heads of 512, experts of 2048, index 64 x 128) in 2
#: layers (a hash-routed window layer, a ratio-4 layer with its indexer) and the MTP layer, 32 of the 256 experts, a
#: vocabulary of 8192: 1.89 GB.
BENCH = {"num_hidden_layers": 2, "num_hash_layers": 1, "n_routed_experts": 32, "vocab_size": 8192,
         "compress_ratios": [0, 4, 0]}


def config(**sizes) -> dict:
    """The release's config with ``sizes`` (TINY by default) replaced, key order kept."""
    out = {**FLASH, **(sizes or TINY)}
    return {k: out[k] for k in FLASH}


def _fp8(name: str, n: int, k: int) -> Iterator[Spec]:
    yield f"{name}.weight", "F8_E4M3", (n, k)
    yield f"{name}.scale", "F8_E8M0", (math.ceil(n / 128), math.ceil(k / 128))


def _mxfp4(name: str, n: int, k: int) -> Iterator[Spec]:
    yield f"{name}.weight", "I8", (n, k // 2)
    yield f"{name}.scale", "F8_E8M0", (n, k // 32)


def _compressor(pre: str, h: int, dim: int, ratio: int) -> Iterator[Spec]:
    coff = 2 if ratio == 4 else 1  # ratio 4 overlaps its windows (vLLM compressor.py: coff = 1 + overlap)
    yield f"{pre}.ape", "F32", (ratio, coff * dim)
    yield f"{pre}.wkv.weight", "BF16", (coff * dim, h)
    yield f"{pre}.wgate.weight", "BF16", (coff * dim, h)
    yield f"{pre}.norm.weight", "BF16", (dim,)


def _attn(c: dict, pre: str, ratio: int) -> Iterator[Spec]:
    h, d, nh, g = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["o_groups"]
    yield from _fp8(f"{pre}.wq_a", c["q_lora_rank"], h)
    yield f"{pre}.q_norm.weight", "BF16", (c["q_lora_rank"],)
    yield from _fp8(f"{pre}.wq_b", nh * d, c["q_lora_rank"])
    yield from _fp8(f"{pre}.wkv", d, h)
    yield f"{pre}.kv_norm.weight", "BF16", (d,)
    yield from _fp8(f"{pre}.wo_a", g * c["o_lora_rank"], nh * d // g)
    yield from _fp8(f"{pre}.wo_b", h, g * c["o_lora_rank"])
    yield f"{pre}.attn_sink", "F32", (nh,)
    if ratio > 1:
        yield from _compressor(f"{pre}.compressor", h, d, ratio)
    if ratio == 4:
        yield from _fp8(f"{pre}.indexer.wq_b", c["index_n_heads"] * c["index_head_dim"], c["q_lora_rank"])
        yield f"{pre}.indexer.weights_proj.weight", "BF16", (c["index_n_heads"], h)
        yield from _compressor(f"{pre}.indexer.compressor", h, c["index_head_dim"], ratio)


def _ffn(c: dict, pre: str, hashed: bool) -> Iterator[Spec]:
    h, i, e = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    yield f"{pre}.gate.weight", "BF16", (e, h)
    yield (f"{pre}.gate.tid2eid", "I64", (c["vocab_size"], c["num_experts_per_tok"])) if hashed \
        else (f"{pre}.gate.bias", "F32", (e,))
    for x in range(e):
        yield from _mxfp4(f"{pre}.experts.{x}.w1", i, h)
        yield from _mxfp4(f"{pre}.experts.{x}.w2", h, i)
        yield from _mxfp4(f"{pre}.experts.{x}.w3", i, h)
    for w, (n, k) in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
        yield from _fp8(f"{pre}.shared_experts.{w}", n, k)


def _hc(c: dict, pre: str) -> Iterator[Spec]:
    m, h = c["hc_mult"], c["hidden_size"]
    for part in ("attn", "ffn"):
        yield f"{pre}.hc_{part}_fn", "F32", ((2 + m) * m, m * h)
        yield f"{pre}.hc_{part}_base", "F32", ((2 + m) * m,)
        yield f"{pre}.hc_{part}_scale", "F32", (3,)


def _block(c: dict, pre: str, ratio: int, hashed: bool) -> Iterator[Spec]:
    yield f"{pre}.attn_norm.weight", "BF16", (c["hidden_size"],)
    yield from _attn(c, f"{pre}.attn", ratio)
    yield f"{pre}.ffn_norm.weight", "BF16", (c["hidden_size"],)
    yield from _ffn(c, f"{pre}.ffn", hashed)
    yield from _hc(c, pre)


def _head(c: dict, pre: str) -> Iterator[Spec]:
    m, h = c["hc_mult"], c["hidden_size"]
    yield f"{pre}hc_head_fn", "F32", (m, m * h)
    yield f"{pre}hc_head_base", "F32", (m,)
    yield f"{pre}hc_head_scale", "F32", (1,)


def tensors(c: dict) -> list[list[Spec]]:
    """The release's tensors, one list a shard: embeddings first, one decoder layer a shard, then the head and
    the MTP layers (``mtp.{j}``: its own block, ``e_proj`` / ``h_proj`` FP8, ``enorm`` / ``hnorm`` / ``norm``,
    its ``hc_head_*``; the embedding and head are the main model's)."""
    h, n = c["hidden_size"], c["num_hidden_layers"]
    out = [[("embed.weight", "BF16", (c["vocab_size"], h))]]
    for i in range(n):
        out.append(list(_block(c, f"layers.{i}", c["compress_ratios"][i], i < c["num_hash_layers"])))
    out.append([("norm.weight", "BF16", (h,)), ("head.weight", "BF16", (c["vocab_size"], h)), *_head(c, "")])
    for j in range(c["num_nextn_predict_layers"]):
        pre = f"mtp.{j}"
        mtp = list(_block(c, pre, c["compress_ratios"][n + j], False))
        mtp += [*_fp8(f"{pre}.e_proj", h, h), *_fp8(f"{pre}.h_proj", h, h)]
        mtp += [(f"{pre}.{k}.weight", "BF16", (h,)) for k in ("enorm", "hnorm", "norm")]
        out.append(mtp + list(_head(c, f"{pre}.")))
    return out


def value_of(name: str, dtype: str, shape: tuple[int, ...], cfg: dict, seed: int):
    """Seeded values of one tensor, a pure function of its name: normal BF16 / F32 weights (norms near 1),
    E4M3 values of a normal draw, random E2M1 code bytes, E8M0 exponents near 2^-7 (FP8 tiles) or 2^-6 (MXFP4
    groups; one group of ``layers.{last}.ffn.experts.0.w2`` 2^-30, far below its tensor's others, so that NVIDIA's
    cast meets a block it cannot keep exactly), ``tid2eid`` expert ids."""
    import zlib

    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ seed)
    if dtype == "I64":
        return torch.randint(0, cfg["n_routed_experts"], shape, generator=g, dtype=torch.int64)
    if dtype == "I8":
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    if dtype == "F8_E8M0":
        mx = ".experts." in name  # not ".shared_experts."
        b = torch.randint(118, 124, shape, generator=g) if mx else torch.randint(115, 121, shape, generator=g)
        if name == f"layers.{cfg['num_hidden_layers'] - 1}.ffn.experts.0.w2.scale":
            b[0, 0] = 97
        return b.to(torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.randn(shape, generator=g)
    if dtype == "F8_E4M3":
        return (x * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    x = 1 + 0.1 * x if name.endswith("norm.weight") else 0.02 * x
    return x.to(torch.bfloat16 if dtype == "BF16" else torch.float32)


def write(out: Path, cfg: dict | None = None, seed: int = 0) -> Path:
    """The checkpoint in ``out``: config.json, one shard a list of :func:`tensors`, the index."""
    from safetensors.torch import save_file

    cfg = cfg or config()
    out.mkdir(parents=True, exist_ok=True)
    shards = tensors(cfg)
    weight_map, total = {}, 0
    for s, specs in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {name: value_of(name, dtype, shape, cfg, seed) for name, dtype, shape in specs}
        save_file(data, str(out / fname), metadata={"format": "pt"})
        for name, t in data.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


if __name__ == "__main__":
    import sys

    sizes = BENCH if sys.argv[2:] == ["bench"] else TINY
    print(write(Path(sys.argv[1]), config(**sizes)))
