"""What the engines will make of the output: its configs against the manifest (the output format's own
check) and every engine layer resolved, under vLLM's and SGLang's own matching rules, to the scheme written."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .. import engine_rules, formats, schemes
from ..errors import ConvertError
from ..jsonfile import read_json
from ..plan import Kind, Op
from .report import Report


class ModuleKinds(Protocol):
    """What the engine rules read of the module records (``offline.Modules`` gathers them as the records
    stream by): each module's kind, and each MoE layer's experts' kinds. Named here, so this module needs nothing
    of ``offline``, which calls it."""

    kinds: dict[str, str]  # module -> kind, MoE experts excepted
    experts: dict[str, set[str]]  # MoE layer's experts -> their kinds


def check_configs(output: Path, man: dict, rep: Report) -> None:
    """The configs the output format wrote, against the manifest (the format knows its files and keys)."""
    fmt = formats.get((man.get("recipe") or {}).get("output_format", formats.DEFAULT))
    rep.check("configs agree with the manifest", fmt.check_configs(output, man, read_json_or_problem))


def row_problems(where: str, m: dict) -> list[str]:
    """A fused module's source rows tile its tensor: each follows the previous, all rows covered."""
    if m["op"] == Op.NONE:
        return []
    problems, pos = [], 0
    for s in m["sources"]:
        a, b = s["rows"]
        n = 1 if m["op"] == Op.STACK else s["shape"][0]
        if a != pos or b - a != n:
            problems.append(f"module {m['name']}: source {s['name']} rows {a}:{b} do not follow at {pos} "
                            f"with its {n} rows ({where})")
        pos = b
    rows = m["tensors"][0]["shape"][0]
    if pos != rows:
        problems.append(f"module {m['name']}: sources cover {pos} rows of {rows} ({where})")
    return problems


def _layer_kinds(man: dict, mods: ModuleKinds
                 ) -> tuple[dict[str, tuple[str, tuple[str, ...]]], dict[str, dict[str, list[str]]]]:
    """Every layer an engine builds from the output -> (the scheme written: 'nvfp4', 'fp8-block' or 'keep';
    the engines that build it): each linear module, each MoE layer's experts as one layer, each engine
    packed module (by its own engines only); and per engine its packed modules {leaf name: member leaves}."""
    both = ("vllm", "sglang")
    kinds, experts = mods.kinds, mods.experts
    layers = {k: (v, both) for k, v in kinds.items() if k.rsplit(".", 2)[0] not in experts}
    layers.update({k: (next(iter(v)), both) for k, v in experts.items() if len(v) == 1})
    packed: dict[str, dict[str, list[str]]] = {e: {} for e in both}
    for g in man.get("engine_groups", []):
        ks = {kinds.get(mod) for mod in g["members"]}
        if len(ks) == 1 and None not in ks and ".experts." not in g["name"]:
            layers[g["name"]] = (ks.pop(), tuple(g["engines"]))
        for e in g["engines"]:
            packed[e][g["name"].rsplit(".", 1)[1]] = [mod.rsplit(".", 1)[1] for mod in g["members"]]
    return layers, packed


def check_engine_rules(man: dict, mods: ModuleKinds, rep: Report) -> None:
    """Each engine layer resolves, under vLLM's and SGLang's own matching rules, to the scheme written:
    the exclude list (quant_method modelopt), or quantized_layers and the exclude list (modelopt_mixed)."""
    prefix = man["mapping_table"].get("text_prefix", "")
    ignore = man["exclude_modules"]
    method = (man.get("recipe") or {}).get("quant_method", "modelopt")
    layers, packed = _layer_kinds(man, mods)
    problems: list[str] = []
    quantized_layers = man.get("quantized_layers") or {}
    for name, (kind, built_by) in sorted(layers.items()):
        if method in ("modelopt_mixed", "fp8"):  # fp8: NVIDIA's DeepSeek V4 hybrid, a quantized_layers map too
            try:
                got = engine_rules.mixed_algo(name, quantized_layers, packed["vllm"])
            except engine_rules.MixedShards as e:
                problems.append(f"vLLM: {e}")
                continue
            # a quantized layer resolves to one of its scheme's quant_algo names in ModelOpt's spelling, a kept one
            # to none
            ok = got in schemes.spelling(kind, "modelopt").algos if schemes.quantized(kind) else got is None
            if not ok and not (kind == Kind.KEEP and engine_rules.vllm_is_skipped(name, ignore, {})):
                problems.append(f"quantized_layers resolve {name} to {got}, but it is written {kind}")
            continue
        kept = kind == Kind.KEEP
        for engine in built_by:
            try:  # both engines first ask is_layer_skipped (a packed layer through its shards)
                got = engine_rules.vllm_is_skipped(name, ignore, packed[engine])
                if engine == "sglang":
                    got = got or engine_rules.sglang_is_excluded(name, ignore, prefix)
            except engine_rules.MixedShards as e:
                problems.append(f"{engine}: {e}")
                continue
            if got != kept:
                problems.append(f"{engine} would {'skip' if got else 'quantize'} {name}, which is written {kind}")
    rep.check("exclude list / quantized_layers under vLLM's and SGLang's matching rules", problems,
              f"{len(layers)} layers")

def read_json_or_problem(path: Path, problems: list[str]) -> dict | None:
    try:
        return read_json(path, path.name, want=None)
    except ConvertError as e:
        problems.append(f"{path.name}: unreadable ({e})")
        return None
