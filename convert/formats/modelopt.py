"""NVIDIA Model Optimizer's checkpoint format, as vLLM's and SGLang's ModelOpt loaders read it.

* a quantized module's tensors, their names and quant_algo: its scheme's ``SPELLINGS["modelopt"]``
  (``convert/schemes``): NVFP4 ``weight`` / ``weight_scale`` / ``weight_scale_2`` (F32 scalar, the global decode
  multiplier: ``value = code * weight_scale * weight_scale_2``) / ``input_scale`` where the recipe pins one;
  block FP8 (``FP8_PB_WO``) ``weight`` / ``weight_scale``.
* configs: ``hf_quant_config.json`` (``producer``, ``quantization``) and ``config.json``'s
  ``quantization_config`` (``quant_method`` ``modelopt`` with one ``quant_algo``, or ``modelopt_mixed`` with
  a ``quantized_layers`` map), the source's own ``quantization_config`` removed (also from the text config).

The rules of which layers the engines then quantize (exclude list, quantized_layers) are in
``convert/engine_rules.py``; docs/engines.md cites the engines' source for each.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING

from .. import schemes
from ..engine_rules import aliases
from ..schemes import GROUP_SIZE

if TYPE_CHECKING:
    from pathlib import Path

    from ..plan.model import Plan

NAME = "modelopt"
QUANT_METHODS = {"modelopt": {"W4A16_NVFP4", "NVFP4"}, "modelopt_mixed": {"MIXED_PRECISION"},
                 "fp8": {"MIXED_PRECISION"}}
#: NVIDIA's DeepSeek V4 hybrid (nvidia/DeepSeek-V4-Pro-NVFP4, Model Optimizer's
#: examples/deepseek/deepseek_v4/quantize_to_nvfp4.py ``_rewrite_config_json``): the source's block-FP8
#: quantization_config kept (its FP8 layers stay as stored), ``moe_quant_algo: NVFP4`` and a quantized_layers map
#: added. vLLM models/deepseek_v4/quant_config.py DeepseekV4FP8Config.get_quant_method and SGLang
#: configs/model_config.py (``nvfp4_moe_meta``) with layers/quantization/modelopt_quant.py HybridFp8NvFp4Config
#: route the routed experts to their ModelOpt NVFP4 MoE methods by it.
HYBRID = "fp8"
MIXED = ("modelopt_mixed", HYBRID)  # the methods whose config carries a quantized_layers map
CONFIG_FILES = ("hf_quant_config.json",)
CARD_TAGS = ("nvfp4", "modelopt", "kimi-convert", "quantized")
KINDS = schemes.spelled_by(NAME)  # the schemes that spell themselves in this format (schemes/*.SPELLINGS), and keep
RECORD_KEYS: dict = {}  # what this format adds to a module's manifest record


# -- what the manifest records ----------------------------------------------------------------------


def _algo_entry(kind: str, input_scale: float | None) -> dict:
    """One module's entry in the quantized_layers map: its quant_algo and what its scheme's spelling adds."""
    sp = schemes.spelling(kind, NAME)
    return {"quant_algo": sp.algo(input_scale), **dict(sp.layer_keys)}


# -- configs ----------------------------------------------------------------------------------------


def producer() -> dict:
    from .. import __version__

    return {"name": "kimi-convert", "version": __version__}


def quantized_layers(plan: Plan) -> dict[str, dict]:
    """MIXED_PRECISION's per-layer map: each quantized module (a MoE layer's experts as one bank),
    and each engine packed module whose members share one format, in every spelling the recipe asks for."""
    m, rec = plan.mapping, plan.recipe
    entry: dict[str, dict] = {}
    kind_of: dict[str, tuple[str, float | None]] = {}
    banks = m.expert_regexes()
    for it in plan.iter_items():  # one output shard's part at a time (a banked plan's, from its outline)
        if not schemes.quantized(it.kind):
            continue
        kind_of[it.name] = (it.kind, it.input_scale)
        name = it.name.rsplit(".", 2)[0] if any(rx.fullmatch(m.strip(it.name)) for rx in banks) else it.name
        entry[name] = _algo_entry(it.kind, it.input_scale)
    for g in plan.every_engine_group():
        if any(rx.fullmatch(m.strip(mod)) for mod in g.members for rx in banks):
            continue  # a MoE layer's experts are named once, as their bank
        kinds = {kind_of.get(mod) for mod in g.members}
        if len(kinds) == 1 and None not in kinds:
            entry[g.name] = _algo_entry(*kinds.pop())
    return {a: e for name, e in sorted(entry.items()) for a in aliases(name, rec.aliases)}


def manifest_layers(plan: Plan) -> dict[str, dict] | None:
    """What the manifest keeps of the per-layer map (None where the config has none)."""
    return quantized_layers(plan) if plan.recipe.quant_method in MIXED else None


def hf_quant_config(plan: Plan) -> dict:
    q: dict = {"quant_algo": plan.recipe.quant_algo, "kv_cache_quant_algo": None, "group_size": GROUP_SIZE}
    if plan.recipe.quant_method in MIXED:
        q["quantized_layers"] = quantized_layers(plan)
    q["exclude_modules"] = list(plan.exclude_modules)
    return {"producer": producer(), "quantization": q}


def _group(algo: str, targets: list[str]) -> dict:
    """The config group of one quant_algo, as the scheme that algo names spells it (``{"quant_algo": ...}`` for
    one whose spelling has none)."""
    sp = schemes.by_algo(NAME, algo)
    return sp.group(algo, targets) if sp is not None and sp.group is not None else {"quant_algo": algo,
                                                                                     "targets": targets}


def hybrid_config(config: dict, plan: Plan) -> dict:
    """NVIDIA's DeepSeek V4 config (``HYBRID``): the source's quantization_config with NVIDIA's keys added, as its
    converter's ``_rewrite_config_json`` writes them (one NVFP4 config group, the quantized_layers map, ``ignore``
    the exclude list)."""
    hq = hf_quant_config(plan)["quantization"]
    q = {k: v for k, v in (config.get("quantization_config") or {}).items() if k != "exclude_modules"}
    q.setdefault("activation_scheme", "dynamic")
    q.setdefault("weight_block_size", [128, 128])
    q.update({"quant_method": HYBRID, "moe_quant_algo": "NVFP4", "producer": producer(), "quant_algo": hq["quant_algo"],
              "kv_cache_quant_algo": None, "group_size": GROUP_SIZE,
              "config_groups": {"group_0": _group("NVFP4", ["Linear"])},
              "quantized_layers": hq["quantized_layers"], "ignore": hq["exclude_modules"]})
    return {**config, "quantization_config": q}


def output_config(config: dict, plan: Plan) -> dict:
    """The input's config.json with its quantization_config (also the one nested in the text config,
    which a loader would otherwise read the NVFP4 experts by, as MXFP4) replaced by the recipe's."""
    if plan.recipe.quant_method == HYBRID:
        return hybrid_config(config, plan)
    out = dict(config)
    key = plan.mapping.text_config
    if key and isinstance(out.get(key), dict):
        out[key] = {k: v for k, v in out[key].items() if k != "quantization_config"}
    hq = hf_quant_config(plan)["quantization"]
    q: dict = {}
    if "quantized_layers" in hq:
        by_algo: dict[str, list[str]] = defaultdict(list)
        for name, e in hq["quantized_layers"].items():
            by_algo[json.dumps(sorted(e.items()))].append(name)
        q["config_groups"] = {f"group_{i}": _group(dict(json.loads(k))["quant_algo"], sorted(v))
                              for i, (k, v) in enumerate(by_algo.items())}
        q["quantized_layers"] = hq["quantized_layers"]
    else:
        q["config_groups"] = {"group_0": _group(hq["quant_algo"], ["Linear"])}
        q["group_size"] = GROUP_SIZE
        q["kv_cache_quant_algo"] = None
    q["ignore"] = hq["exclude_modules"]
    q["quant_algo"] = hq["quant_algo"]
    q["producer"] = producer()
    q["quant_method"] = plan.recipe.quant_method
    out["quantization_config"] = q
    return out


def config_files(config: dict, plan: Plan) -> dict[str, dict]:
    """config.json and hf_quant_config.json, in the order pack writes them."""
    return {"config.json": output_config(config, plan), "hf_quant_config.json": hf_quant_config(plan)}


def check_configs(output: Path, man: dict, read) -> list[str]:
    """The written configs against the manifest: quant_method / quant_algo, the exclude list in both files,
    the source's quantization_config gone from the text config, and the two files agreeing."""
    problems: list[str] = []
    want = man["exclude_modules"]
    recipe = man.get("recipe") or {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}
    cfg = read(output / "config.json", problems)
    hq = read(output / "hf_quant_config.json", problems)
    if cfg is not None:
        q = cfg.get("quantization_config") or {}
        for key in ("quant_method", "quant_algo"):
            if q.get(key) != recipe[key]:
                problems.append(f"config.json: quantization_config.{key} is {q.get(key)!r}, not {recipe[key]!r}")
        if q.get("ignore") != want:
            problems.append("config.json: quantization_config.ignore differs from the manifest's exclude_modules")
        text = cfg.get(man["mapping_table"].get("text_config") or "", {})
        if isinstance(text, dict) and "quantization_config" in text:
            problems.append("config.json: the text config still holds the source's quantization_config")
    if hq is not None:
        q = hq.get("quantization") or {}
        if q.get("exclude_modules") != want:
            problems.append("hf_quant_config.json: exclude_modules differs from the manifest's")
        if cfg is not None and q.get("quant_algo") != (cfg.get("quantization_config") or {}).get("quant_algo"):
            problems.append("hf_quant_config.json: quant_algo differs from config.json's")
        if cfg is not None and q.get("quantized_layers") != (cfg.get("quantization_config") or {}).get(
                "quantized_layers"):
            problems.append("hf_quant_config.json: quantized_layers differs from config.json's")
    return problems


def card_line(recipe: dict) -> str:
    """The model card's sentence on the layout."""
    return (f"ModelOpt layout; recipe `{recipe['name']}`, `quant_method` {recipe['quant_method']}, "
            f"`quant_algo` {recipe['quant_algo']}")
