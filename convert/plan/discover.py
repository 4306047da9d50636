"""Sources: which stored tensors form one logical tensor."""

from __future__ import annotations

import math
from collections import defaultdict

from ..checkpoint import Checkpoint
from ..errors import ConvertError
from ..safetensors_format import TensorInfo
from ..sources import EntryKind, Source
from .model import MXFP4_GROUP, Encoding, SourceTensor

# ---------------------------------------------------------------------------------------------
# Sources: which stored tensors form one logical tensor


def _module_of(name: str) -> tuple[str, str]:
    mod, _, suffix = name.rpartition(".")
    return mod, suffix


#: SourceTensor formats a checkpoint's ``quantization_config`` may declare: the formats this tool reads
#: (K3's MXFP4 experts in compressed-tensors, DeepSeek's 128x128 block FP8). Anything else is an
#: already-converted checkpoint, which converting again would only degrade.
SOURCE_FORMATS = {"compressed-tensors": {"mxfp4-pack-quantized"}, "fp8": {"e4m3"}}
_ORIGINAL = "convert the original (BF16, MXFP4 or block-FP8) checkpoint instead"


def check_convertible(ckpt: Checkpoint) -> None:
    """Refuse an input that is already a converted checkpoint (ours, ModelOpt's, llm-compressor's,
    GPTQ/AWQ...), before any planning: the plan would otherwise treat packed codes as weights and
    fail mid-write, or quietly quantize twice."""
    source = ckpt.source
    where = source.name
    if _is_file(source, "manifest.json"):
        made = _json_field(source, "manifest.json", "format")
        if made == "kimi-convert-manifest":
            raise ConvertError(f"{where}: this is an output of kimi-convert (manifest.json): {_ORIGINAL}; "
                               "check this one with `kimi-convert verify-manifest`")
    if _is_file(source, "hf_quant_config.json"):
        hq = source.entry("hf_quant_config.json")
        algo = ((_json_field(source, "hf_quant_config.json", "quantization") or {}).get("quant_algo")
                if hq is not None and hq.size < 1 << 26 else None)
        raise ConvertError(f"{where}: already quantized by NVIDIA Model Optimizer (hf_quant_config.json, "
                           f"quant_algo {algo or 'unknown'}): {_ORIGINAL}")
    for cfg in (ckpt.config, ckpt.config.get("text_config")):
        q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if isinstance(q, dict):
            _check_quant_config(q, where)
    for name, info in ckpt.tensors.items():
        mod, suffix = _module_of(name)
        quantized = (suffix in ("weight_scale_2", "weight_global_scale", "qweight", "qzeros", "SCB")
                     or (suffix == "weight" and info.dtype in ("U8", "I8", "I32") and f"{mod}.weight_scale" in
                         ckpt.tensors))
        if quantized:
            raise ConvertError(f"{info.file}: tensor {name}: {mod} is already quantized ({info.dtype} "
                               f"{suffix}): {_ORIGINAL}")


def _is_file(source: Source, rel: str) -> bool:
    e = source.entry(rel)
    return e is not None and e.kind is EntryKind.FILE


def _json_field(source: Source, rel: str, key: str):
    try:
        obj = source.read_json(rel, limit=64 << 20)
    except ConvertError:  # only a hint for the refusal: an unreadable marker file names no format
        return None
    return obj.get(key)


def _check_quant_config(q: dict, where: str) -> None:
    method = q.get("quant_method")
    formats = SOURCE_FORMATS.get(method)
    if formats is None:
        algo = q.get("quant_algo") or q.get("format") or q.get("bits")
        raise ConvertError(f"{where}: config.json: quantization_config says the input is already quantized "
                           f"({method}{f', {algo}' if algo else ''}): {_ORIGINAL}")
    found = {str(g.get("format", q.get("format"))) for g in (q.get("config_groups") or {}).values()
             if isinstance(g, dict)} or {str(q.get("format") or q.get("fmt") or next(iter(formats)))}
    if not found <= formats:
        raise ConvertError(f"{where}: config.json: quantization_config: {method} format "
                           f"{', '.join(sorted(found - formats))} is not a source format this tool reads "
                           f"({', '.join(sorted(formats))}): {_ORIGINAL}")


class _Modules(defaultdict):
    """discover_sources' module map. It also holds, once made, the parents' children that each
    resolve_fusions call (one per engine) would otherwise derive again from 250,000 modules."""

    children: tuple[dict[str, dict[str, str]], list[str]] | None = None


def discover_sources(ckpt: Checkpoint) -> dict[str, dict[str, SourceTensor]]:
    """module -> {suffix: SourceTensor}; MXFP4 and FP8 block-scaled weights become one logical weight."""
    t = ckpt.tensors
    consumed: set[str] = set()
    out: dict[str, dict[str, SourceTensor]] = _Modules(dict)
    block = fp8_block_size(ckpt.config)
    for name in t:
        mod, _, suffix = name.rpartition(".")
        if suffix == "weight_packed":
            src = out[mod]["weight"] = _mxfp4_source(mod, t)
            for p in src.parts:
                consumed.add(p.name)
        elif suffix == "weight" and t[name].dtype == "F8_E4M3":
            if f"{mod}.weight_scale_inv" not in t:
                raise ConvertError(f"{t[name].file}: tensor {name}: FP8 weight without its {mod}.weight_scale_inv")
            out[mod]["weight"] = _fp8_source(mod, t, block)
            consumed.update(p.name for p in out[mod]["weight"].parts)
    for name, info in t.items():
        if name in consumed:
            continue
        mod, _, suffix = name.rpartition(".")
        if suffix in ("weight_scale", "weight_scale_inv") and f"{mod}.weight" not in t:
            raise ConvertError(f"{info.file}: tensor {name}: scale without its weight {mod}.weight(_packed)")
        out[mod][suffix] = SourceTensor(mod, name, Encoding.DENSE, info.dtype, info.shape, (info,))
    return out


def _mxfp4_source(mod: str, t: dict[str, TensorInfo]) -> SourceTensor:
    packed = t[f"{mod}.weight_packed"]
    scale = t.get(f"{mod}.weight_scale")
    if scale is None:
        raise ConvertError(f"{packed.file}: tensor {packed.name}: MXFP4 weight without its {mod}.weight_scale")
    if packed.dtype != "U8" or len(packed.shape) != 2:
        raise ConvertError(f"{packed.file}: tensor {packed.name}: MXFP4 packed weight must be U8 [N, K/2], "
                           f"is {packed.dtype}{list(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    want = [n, math.ceil(k / MXFP4_GROUP)]
    if scale.dtype != "U8" or scale.shape != tuple(want) or k % MXFP4_GROUP:
        raise ConvertError(
            f"{scale.file}: tensor {scale.name}: MXFP4 scale must be U8 {want} for a [{n}, {k}] weight "
            f"(K a multiple of {MXFP4_GROUP}), is {scale.dtype}{list(scale.shape)}"
        )
    return SourceTensor(mod, f"{mod}.weight", Encoding.MXFP4, "MXFP4", (n, k), (packed, scale))


def fp8_block_size(config: dict) -> tuple[int, int]:
    q = config.get("quantization_config") or {}
    b = q.get("weight_block_size", [128, 128]) if isinstance(q, dict) else [128, 128]
    if not (isinstance(b, list) and len(b) == 2 and all(type(v) is int and v > 0 for v in b)):
        raise ConvertError(f"config.json: quantization_config.weight_block_size {b!r} is not [rows, cols]")
    return b[0], b[1]


def _fp8_source(mod: str, t: dict[str, TensorInfo], block: tuple[int, int]) -> SourceTensor:
    w, s = t[f"{mod}.weight"], t[f"{mod}.weight_scale_inv"]
    if len(w.shape) != 2:
        raise ConvertError(f"{w.file}: tensor {w.name}: FP8 block-scaled weight must be 2-D, is {list(w.shape)}")
    want = [math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])]
    if s.dtype not in ("F32", "BF16") or list(s.shape) != want:
        raise ConvertError(
            f"{s.file}: tensor {s.name}: FP8 scale must be F32 {want} for {list(w.shape)} with blocks "
            f"{list(block)}, is {s.dtype}{list(s.shape)}"
        )
    return SourceTensor(mod, w.name, Encoding.FP8_BLOCK, "F8_E4M3", w.shape, (w, s))
