"""compressed-tensors' NVFP4 checkpoint format (``quant_method: compressed-tensors``, ``format:
nvfp4-pack-quantized``), as llm-compressor's ``model_free_ptq`` writes it and vLLM's and SGLang's
compressed-tensors loaders read it. Each convention is taken from the peer's installed source
(docs/compressed-tensors.md cites file and function):

* NVFP4 module (its scheme's ``SPELLINGS["compressed-tensors"]``, ``convert/schemes/nvfp4.py``):
  ``weight_packed`` (U8 [N, K/2], E2M1 codes, even element in the low nibble),
  ``weight_scale`` (F8_E4M3 [N, K/16]), ``weight_global_scale`` (F32 [1], the reciprocal convention:
  ``448*6/amax``, the engines dequantize with ``code * weight_scale / weight_global_scale``), and
  ``input_global_scale`` (F32 [1], ``1/input_scale``) where the recipe pins an activation scale
  (``compressors/nvfp4/base.py: NVFP4PackedCompressor.compression_param_names``).
* the arithmetic is compressed-tensors' own (``kernels/src/ct_nvfp4.py``), not ModelOpt's: the global
  scale is rounded to the weight's dtype, a zero block scale becomes 0.125 (ModelOpt: 1.0), so some
  modules' bytes differ from the ModelOpt format's.
* ``config.json``'s ``quantization_config``: ``llmcompressor/entrypoints/model_free/save_utils.py:
  update_config`` (``version``, ``quant_method``, ``transform_config``, then ``QuantizationConfig.model_dump``:
  ``config_groups`` keyed by the preset scheme's name, ``format``, ``global_compression_ratio``, ``ignore``,
  ``kv_cache_scheme``, ``quantization_status: compressed``); no other config file.
* ``ignore``: every module the model-free matcher would otherwise quantize (a ``.weight`` whose module
  does not end in ``norm``: ``compressed_tensors/utils/match.py: match_quantizable_tensors``) and this tool
  keeps, by exact name: the plan's exclude list plus the stored non-linear weights (embeddings). Handing the
  same list to ``model_free_ptq(ignore=...)`` gives the same config.

Only ``nvfp4`` and ``keep`` modules: a recipe with ``fp8-block`` modules is refused for this format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import schemes

if TYPE_CHECKING:
    from pathlib import Path

    from ..plan.model import Plan

NAME = "compressed-tensors"
#: the compressed-tensors preset schemes a recipe may name (quant_algo): weight-only, and weights with
#: NVFP4 activations whose global scale is a constant (``input_global_scale``)
QUANT_METHODS = {"compressed-tensors": {"NVFP4A16", "NVFP4"}}
CONFIG_FILES: tuple[str, ...] = ()
CARD_TAGS = ("nvfp4", "compressed-tensors", "kimi-convert", "quantized")
KINDS = schemes.spelled_by(NAME)  # the schemes that spell themselves in this format (schemes/*.SPELLINGS), and keep
RECORD_KEYS = {"output_format": NAME}  # what this format adds to a module's manifest record
#: compressed-tensors' version whose format this module writes (``compressed_tensors.__version__``,
#: written as ``quantization_config.version`` by ``save_utils.update_config``)
CT_VERSION = "0.19.0"
PACK_FORMAT = schemes.nvfp4.CT_PACK_FORMAT
#: what a ModelOpt recipe's quant_algo becomes under ``pack --format compressed-tensors``
FROM_MODELOPT = {"W4A16_NVFP4": "NVFP4A16", "NVFP4": "NVFP4"}
_COPY = "copy"  # the plan's Kind value of a copied tensor (a StrEnum: compared as strings)


# -- what the manifest records ----------------------------------------------------------------------


def manifest_layers(plan: Plan) -> dict | None:
    return None


# -- configs ----------------------------------------------------------------------------------------


def ignore_list(plan: Plan) -> list[str]:
    """The plan's exclude list plus every stored ``X.weight`` the model-free matcher would take for a linear
    layer (``X`` not ending in ``norm``) that is not one here (embeddings): exact names, sorted as given."""
    extra = [n.removesuffix(".weight") for it in plan.iter_items() if it.kind == _COPY and (n := it.name).endswith(
        ".weight") and not n.removesuffix(".weight").endswith("norm")]
    return list(dict.fromkeys([*plan.exclude_modules, *sorted(extra)]))


def config_groups(plan: Plan) -> dict[str, dict]:
    """One group per preset scheme (its scheme's spelling: ``schemes/nvfp4.py``'s ``ct_group``): weight-only
    modules target ``Linear``; modules with a constant activation scale are named exactly (a name match wins over
    the class in the engines' target matching)."""
    groups = {}
    for kind in sorted(KINDS - {"keep"}):
        sp = schemes.spelling(kind, NAME)
        mods = [it for it in plan.iter_items() if it.kind == kind]
        w4a4 = sorted({it.name for it in mods if it.input_scale is not None})
        if w4a4:
            groups[sp.algo(1.0)] = sp.group(sp.algo(1.0), w4a4)
        if any(it.input_scale is None for it in mods) or not w4a4:
            groups[sp.algo(None)] = sp.group(sp.algo(None), ["Linear"])
    return groups


def quantization_config(plan: Plan) -> dict:
    """``save_utils.update_config``'s dict: version, quant_method, transform_config, then the model_dump."""
    return {"version": CT_VERSION, "quant_method": NAME, "transform_config": {},
            "config_groups": config_groups(plan), "format": PACK_FORMAT, "global_compression_ratio": None,
            "ignore": ignore_list(plan), "kv_cache_scheme": None, "quantization_status": "compressed"}


def output_config(config: dict, plan: Plan) -> dict:
    """The input's config.json with the recipe's quantization_config (the source's removed from the text config)."""
    out = dict(config)
    key = plan.mapping.text_config
    if key and isinstance(out.get(key), dict):
        out[key] = {k: v for k, v in out[key].items() if k != "quantization_config"}
    out["quantization_config"] = quantization_config(plan)
    return out


def config_files(config: dict, plan: Plan) -> dict[str, dict]:
    return {"config.json": output_config(config, plan)}


def check_configs(output: Path, man: dict, read) -> list[str]:
    """config.json against the manifest: quant_method, format, status, the exclude list inside ``ignore``."""
    problems: list[str] = []
    cfg = read(output / "config.json", problems)
    if cfg is None:
        return problems
    q = cfg.get("quantization_config") or {}
    want = {"quant_method": NAME, "format": PACK_FORMAT, "quantization_status": "compressed"}
    for k, v in want.items():
        if q.get(k) != v:
            problems.append(f"config.json: quantization_config.{k} is {q.get(k)!r}, not {v!r}")
    ignore = q.get("ignore") or []
    missing = [m for m in man["exclude_modules"] if m not in ignore]
    if missing:
        problems.append(f"config.json: quantization_config.ignore lacks {len(missing)} of the manifest's "
                        f"exclude_modules (first: {missing[0]})")
    text = cfg.get(man["mapping_table"].get("text_config") or "", {})
    if isinstance(text, dict) and "quantization_config" in text:
        problems.append("config.json: the text config still holds the source's quantization_config")
    return problems


def card_line(recipe: dict) -> str:
    return (f"compressed-tensors layout (`{PACK_FORMAT}`); recipe `{recipe['name']}`, scheme "
            f"{recipe['quant_algo']}")
