"""NVIDIA's Kimi K3 recipe computed with NVIDIA Model Optimizer's own functions: the oracle the
``nvidia-k3`` recipe is held to, tensor by tensor.

It follows Model Optimizer's ``examples/kimi/kimi_k3/quantize_to_nvfp4.py`` with the recipe
``models/moonshotai/Kimi-K3/ptq/nvfp4_experts-fp8_pb_attention`` (``--recipe``: the cast of the routed
experts, input_scale from the recipe's ``constant_amax``, 128x128 block FP8 attention), calling the same
``modelopt`` functions that script calls, shard by shard. It needs ``nvidia-modelopt`` (the tests that use it
are skipped without it).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

LM = r"language_model\.model\.layers\.\d+"
EXPERT_PACKED = re.compile(rf"^(?P<base>{LM}\.block_sparse_moe\.experts\.\d+\.w[123])\.weight_packed$")
ATTN_WEIGHT = re.compile(rf"^(?P<base>{LM}\.self_attn\.(?P<proj>[a-z_0-9]+))\.weight$")
FP8_PB_PROJ = {"q_proj", "k_proj", "v_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
               "g_proj", "b_proj", "f_a_proj", "f_b_proj"}


def recipe_input_scale() -> float:
    """The expert input_scale of ModelOpt's shipped recipe: constant_amax / (E2M1_MAX * E4M3_MAX)."""
    from modelopt.recipe import load_recipe
    from modelopt.torch.quantization.utils.numeric_utils import E2M1_MAX, E4M3_MAX

    cfg = load_recipe("models/moonshotai/Kimi-K3/ptq/nvfp4_experts-fp8_pb_attention").quantize.model_dump()
    entry = next(e for e in cfg["quant_cfg"] if isinstance(e, dict)
                 and e.get("quantizer_name") == "*block_sparse_moe.experts.*input_quantizer")
    return float(entry["cfg"]["constant_amax"]) / (E2M1_MAX * E4M3_MAX)


def _k_max(scale: torch.Tensor) -> int:
    from modelopt.torch.quantization.utils.numeric_utils import mxfp4_to_nvfp4_global_amax

    return mxfp4_to_nvfp4_global_amax(scale.contiguous().view(torch.uint8))[1]["k_max"]


def _cast(packed: torch.Tensor, scale: torch.Tensor, k_max: int) -> dict[str, torch.Tensor]:
    from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor
    from modelopt.torch.quantization.utils.numeric_utils import (
        E2M1_MAX,
        E4M3_KMAX,
        E4M3_KMIN,
        E4M3_MAX,
        mxfp4_to_nvfp4_per_block_amax,
    )

    shape = torch.Size((*packed.shape[:-1], packed.shape[-1] * 2))
    bf16 = MXFP4QTensor(shape, torch.bfloat16, packed).dequantize(dtype=torch.bfloat16, scale=scale,
                                                                   block_sizes=[32])
    amax = mxfp4_to_nvfp4_per_block_amax(packed.view(*packed.shape[:-1], scale.shape[-1], 16), scale)
    s2 = torch.tensor(2.0 ** (k_max - E4M3_KMAX), dtype=torch.float32).reshape(())
    sb = (amax / (E2M1_MAX * s2)).clamp(min=2**E4M3_KMIN, max=E4M3_MAX).to(torch.float8_e4m3fn)
    q, ws, _ = NVFP4QTensor.quantize(bf16, 16, sb, s2, try_tensorrt=False)
    return {"weight": q._quantized_data, "weight_scale": ws, "weight_scale_2": s2}


def _fp8_pb(w: torch.Tensor) -> dict[str, torch.Tensor]:
    from modelopt.torch.quantization.qtensor import FP8QTensor

    q, scale = FP8QTensor.quantize(w, block_sizes={-2: 128, -1: 128})
    return {"weight": q._quantized_data.contiguous(), "weight_scale": scale[:, None, :, None].float().contiguous()}


def convert_shard(path: Path, input_scale: float) -> dict[str, torch.Tensor]:
    """Every output tensor NVIDIA's converter writes for one input shard."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        bases = [m.group("base") for m in map(EXPERT_PACKED.match, keys) if m]
        pairs: dict[str, dict[str, str]] = defaultdict(dict)
        for b in bases:
            prefix, proj = b.rsplit(".", 1)
            pairs[prefix][proj] = b
        shared = {}
        for p in pairs.values():  # w1 and w3 share k_max when both are in this shard (as NVIDIA does)
            if "w1" in p and "w3" in p:
                k = max(_k_max(f.get_tensor(p[w] + ".weight_scale")) for w in ("w1", "w3"))
                shared[p["w1"]] = shared[p["w3"]] = k
        scales = {b + ".weight_scale" for b in bases}
        for key in keys:
            if key in scales:
                continue
            m = EXPERT_PACKED.match(key)
            if m:
                b = m.group("base")
                s = f.get_tensor(b + ".weight_scale")
                k = shared.get(b, _k_max(s))
                for suffix, t in _cast(f.get_tensor(key), s, k).items():
                    out[f"{b}.{suffix}"] = t
                out[f"{b}.input_scale"] = torch.tensor(input_scale, dtype=torch.float32).reshape(())
                continue
            a = ATTN_WEIGHT.match(key)
            if a and a.group("proj") in FP8_PB_PROJ:
                for suffix, t in _fp8_pb(f.get_tensor(key)).items():
                    out[f"{a.group('base')}.{suffix}"] = t
                continue
            out[key] = f.get_tensor(key)
    return out


def convert(folder: Path) -> dict[str, torch.Tensor]:
    """NVIDIA's output tensors for a whole checkpoint folder (shards named model-*-of-*.safetensors)."""
    scale = recipe_input_scale()
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(folder).glob("model-*-of-*.safetensors")):
        out.update(convert_shard(shard, scale))
    return out
