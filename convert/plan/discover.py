"""Sources: which stored tensors form one logical tensor (each source encoding's own discovery, run in
registry order: ``encodings/``), and the refusal of an input that is already a converted checkpoint."""

from __future__ import annotations

from collections import defaultdict

from .. import encodings, filenames
from ..checkpoint import Checkpoint
from ..errors import ConvertError
from ..sources import EntryKind, Source
from .model import SourceTensor


def _module_of(name: str) -> tuple[str, str]:
    mod, _, suffix = name.rpartition(".")
    return mod, suffix


def _original() -> str:
    """What every refusal of a converted checkpoint asks for, naming the registered source encodings."""
    return f"convert the original ({encodings.labels()}) checkpoint instead"


def check_convertible(ckpt: Checkpoint) -> None:
    """Refuse an input that is already a converted checkpoint (ours, ModelOpt's, llm-compressor's,
    GPTQ/AWQ...), before any planning: the plan would otherwise treat packed codes as weights and
    fail mid-write, or quietly quantize twice."""
    source = ckpt.source
    where = source.name
    if _is_file(source, filenames.MANIFEST):
        made = _json_field(source, filenames.MANIFEST, "format")
        if made == "kimi-convert-manifest":
            raise ConvertError(f"{where}: this is an output of kimi-convert (manifest.json): {_original()}; "
                               "check this one with `kimi-convert verify-manifest`")
    if _is_file(source, "hf_quant_config.json"):
        hq = source.entry("hf_quant_config.json")
        algo = ((_json_field(source, "hf_quant_config.json", "quantization") or {}).get("quant_algo")
                if hq is not None and hq.size < 1 << 26 else None)
        raise ConvertError(f"{where}: already quantized by NVIDIA Model Optimizer (hf_quant_config.json, "
                           f"quant_algo {algo or 'unknown'}): {_original()}")
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
                               f"{suffix}): {_original()}")


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
    """Refuse a ``quantization_config`` no source encoding reads (``encodings.source_formats``): anything
    else is an already-converted checkpoint, which converting again would only degrade."""
    method = q.get("quant_method")
    formats = encodings.source_formats().get(method)
    if formats is None:
        algo = q.get("quant_algo") or q.get("format") or q.get("bits")
        raise ConvertError(f"{where}: config.json: quantization_config says the input is already quantized "
                           f"({method}{f', {algo}' if algo else ''}): {_original()}")
    found = {str(g.get("format", q.get("format"))) for g in (q.get("config_groups") or {}).values()
             if isinstance(g, dict)} or {str(q.get("format") or q.get("fmt") or next(iter(formats)))}
    if not found <= formats:
        raise ConvertError(f"{where}: config.json: quantization_config: {method} format "
                           f"{', '.join(sorted(found - formats))} is not a source format this tool reads "
                           f"({', '.join(sorted(formats))}): {_original()}")


class Modules(defaultdict):
    """discover_sources' module map. It also holds, once made, the parents' children that each
    resolve_fusions call (one per engine) would otherwise derive again from 250,000 modules."""

    children: tuple[dict[str, dict[str, str]], list[str]] | None = None


def discover_sources(ckpt: Checkpoint) -> dict[str, dict[str, SourceTensor]]:
    """module -> {suffix: SourceTensor}: each stored tensor offered to the source encodings in registry
    order (``encodings.REGISTRY``); what none consumed is offered to the fallback (dense), after each
    encoding's refusal of stray parts (a scale without its weight)."""
    t, config = ckpt.tensors, ckpt.config
    for enc in encodings.REGISTRY:
        enc.check_config(config)
    consumed: set[str] = set()
    out: dict[str, dict[str, SourceTensor]] = Modules(dict)
    offer = encodings.claimers()
    for name in t:
        for enc in offer.get(name.rpartition(".")[2], ()):
            if claims := enc.claim(name, t, config):
                for c in claims:
                    out[c.module][c.suffix] = c.source
                    consumed.update(encodings.stored_name(p) for p in c.source.parts)
                break
    strays, leftover = encodings.strays(), encodings.fallbacks()
    for name in t:
        if name in consumed:
            continue
        for enc in strays.get(name.rpartition(".")[2], ()):
            enc.refuse_leftover(name, t)
        for enc in leftover:
            if claims := enc.claim(name, t, config):
                for c in claims:
                    out[c.module][c.suffix] = c.source
                break
    return out


def fp8_block_size(config: dict) -> tuple[int, int]:
    """The checkpoint's FP8 block size (``encodings.fp8_block.block_size``), what decoding needs."""
    return encodings.block_size(config)
