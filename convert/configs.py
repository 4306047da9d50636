"""What the engines read besides the shards: ``config.json``'s ``quantization_config``,
``hf_quant_config.json`` (ModelOpt's), and the index. Pure functions of the plan (and the input's
config): their bytes are decided before any tensor is converted."""

from __future__ import annotations

import json
from collections import defaultdict

from . import __version__
from .plan import FP8, GROUP_SIZE, NVFP4, Plan, aliases, expert_regexes


def index_json(plan: Plan) -> dict:
    weight_map = {p.tensor.name: s.file for s in plan.shards for p in s.placed}
    total = sum(p.tensor.nbytes for s in plan.shards for p in s.placed)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def producer() -> dict:
    return {"name": "kimi-convert", "version": __version__}


def layer_algo(kind: str, input_scale: float | None) -> str:
    """ModelOpt's quant_algo of one module: NVFP4 with a (constant) input_scale is W4A4."""
    if kind == FP8:
        return "FP8_PB_WO"
    return "NVFP4" if input_scale is not None else "W4A16_NVFP4"


def quantized_layers(plan: Plan) -> dict[str, dict]:
    """MIXED_PRECISION's per-layer map: each quantized module (a MoE layer's experts as one bank),
    and each engine packed module whose members share one format, in every spelling the recipe asks for."""
    m, rec = plan.mapping, plan.recipe
    entry: dict[str, dict] = {}
    kind_of: dict[str, tuple[str, float | None]] = {}
    banks = expert_regexes(m)
    for it in plan.items:
        if it.kind not in (NVFP4, FP8):
            continue
        kind_of[it.name] = (it.kind, it.input_scale)
        name = it.name.rsplit(".", 2)[0] if any(rx.fullmatch(m.strip(it.name)) for rx in banks) else it.name
        entry[name] = _algo_entry(it.kind, it.input_scale)
    for g in plan.engine_groups:
        if any(rx.fullmatch(m.strip(mod)) for mod in g.members for rx in banks):
            continue  # a MoE layer's experts are named once, as their bank
        kinds = {kind_of.get(mod) for mod in g.members}
        if len(kinds) == 1 and None not in kinds:
            entry[g.name] = _algo_entry(*kinds.pop())
    return {a: e for name, e in sorted(entry.items()) for a in aliases(name, rec.aliases)}


def _algo_entry(kind: str, input_scale: float | None) -> dict:
    algo = layer_algo(kind, input_scale)
    return {"quant_algo": algo} if kind == FP8 else {"quant_algo": algo, "group_size": GROUP_SIZE}


def hf_quant_config(plan: Plan) -> dict:
    q: dict = {"quant_algo": plan.recipe.quant_algo, "kv_cache_quant_algo": None, "group_size": GROUP_SIZE}
    if plan.recipe.quant_method == "modelopt_mixed":
        q["quantized_layers"] = quantized_layers(plan)
    q["exclude_modules"] = list(plan.exclude_modules)
    return {"producer": producer(), "quantization": q}


def _group_config(algo: str) -> dict:
    """ModelOpt's compressed-tensors-style config group of one quant_algo (its convert_hf_config;
    written here because ModelOpt is not a dependency of this tool)."""
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    if algo == "NVFP4":
        return {"input_activations": dict(weights), "weights": weights}
    if algo == "W4A16_NVFP4":
        return {"weights": weights}
    return {"quant_algo": algo}


def output_config(config: dict, plan: Plan) -> dict:
    """The input's config.json with its quantization_config (also the one nested in the text config,
    which a loader would otherwise read the NVFP4 experts by, as MXFP4) replaced by the recipe's."""
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
        q["config_groups"] = {f"group_{i}": {**_group_config(dict(json.loads(k))["quant_algo"]), "targets": sorted(v)}
                              for i, (k, v) in enumerate(by_algo.items())}
        q["quantized_layers"] = hq["quantized_layers"]
    else:
        q["config_groups"] = {"group_0": {**_group_config(hq["quant_algo"]), "targets": ["Linear"]}}
        q["group_size"] = GROUP_SIZE
        q["kv_cache_quant_algo"] = None
    q["ignore"] = hq["exclude_modules"]
    q["quant_algo"] = hq["quant_algo"]
    q["producer"] = producer()
    q["quant_method"] = plan.recipe.quant_method
    out["quantization_config"] = q
    return out
