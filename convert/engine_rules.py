"""How serving engines read an exclude list, re-implemented from docs/nvfp4.md and docs/engines.md.

Used to prove that the exclude list pack writes selects exactly the kept modules under every
engine's rules (tests, and later verify-manifest), so no engine quantizes a kept module or skips a
quantized one, whatever its matching quirks (substrings, ``*`` crossing dots, fused-shard checks).
"""

from __future__ import annotations

import re
from fnmatch import fnmatch


class MixedShards(ValueError):
    """vLLM: 'Detected some but not all shards of {prefix} are quantized'."""


def vllm_is_skipped(prefix: str, ignore: list[str], packed: dict[str, list[str]]) -> bool:
    """vLLM's ``is_layer_skipped`` with its legacy substring and fnmatch tests."""
    proj = prefix.split(".")[-1]
    if proj in packed:
        flags = [prefix.replace(proj, shard) in ignore for shard in packed[proj]]
        if any(flags) != all(flags):
            raise MixedShards(f"Detected some but not all shards of {prefix} are quantized")
        skipped = all(flags)
    else:
        skipped = prefix in ignore
    return skipped or any(e in prefix for e in ignore) or any(fnmatch(prefix, e) for e in ignore)


#: SGLang's ModelOptQuantConfig.is_layer_excluded (layers/quantization/modelopt_quant.py) reads an exclude entry
#: whose last part is one of these as a fused MLA pattern: it excludes every module whose last part contains it, in
#: every layer (``kv_b_proj`` -> all layers' ``kv_b_proj``; ``q_a_proj`` -> all ``fused_qkv_a_proj_with_mqa``).
SGLANG_FUSED_TAILS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def sglang_exact(name: str) -> str:
    """``name`` as an exclude entry that SGLang's fused-pattern rule does not widen to every layer: a trailing ``*``
    (its last part is then no longer one of SGLANG_FUSED_TAILS; SGLang's and vLLM's globs still match the module
    itself, and nothing else of a layer's attention has that name as its start)."""
    return name + "*" if name.rpartition(".")[2] in SGLANG_FUSED_TAILS else name


def _sglang_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern.replace(".", r"\.").replace("*", r".*"))


def sglang_is_excluded(prefix: str, patterns: list[str], text_prefix: str = "language_model.") -> bool:
    """SGLang: each pattern full-matches the prefix, the prefix without the text prefix, or one part."""
    names = [prefix]
    if text_prefix and prefix.startswith(text_prefix):
        names.append(prefix[len(text_prefix) :])
    names += prefix.split(".")
    rxs = [_sglang_regex(p) for p in patterns]
    if any(rx.fullmatch(n) for rx in rxs for n in names):
        return True
    tails = {p.rpartition(".")[2] for p in patterns} & set(SGLANG_FUSED_TAILS)  # any layer's, as SGLang reads it
    return any(t in prefix.rpartition(".")[2] for t in tails)


def _candidates(prefix: str) -> list[str]:
    out = [prefix]
    if prefix.endswith(".lm_head"):
        out.append("lm_head")
    if prefix.startswith("language_model.model."):
        out.append("model.language_model." + prefix[len("language_model.model."):])
    return out


def mixed_algo(prefix: str, quantized_layers: dict[str, dict], packed: dict[str, list[str]]) -> str | None:
    """vLLM's ``ModelOptMixedPrecisionConfig._resolve_quant_algo`` (SGLang's is the same lookup): the
    layer itself, then a packed layer through its shards (one algo, or an error), then any child."""
    for c in _candidates(prefix):
        if c in quantized_layers:
            return quantized_layers[c]["quant_algo"].upper()
    base, _, leaf = prefix.rpartition(".")
    if leaf in packed:
        algos = {quantized_layers[f"{c}.{s}"]["quant_algo"].upper() for c in _candidates(base) for s in packed[leaf]
                 if f"{c}.{s}" in quantized_layers}
        if len(algos) > 1:
            raise MixedShards(f"Mixed quant_algo within fused layer {prefix}: {sorted(algos)}")
        if algos:
            return algos.pop()
    for c in _candidates(prefix):
        hit = next((v for k, v in quantized_layers.items() if k.startswith(c + ".")), None)
        if hit is not None:
            return hit["quant_algo"].upper()
    return None


def aliases(name: str, on: bool) -> list[str]:
    """Every spelling of a module name the engines' runtime prefixes probe (NVIDIA's converter writes
    them all): the checkpoint name, ``block_sparse_moe`` -> ``mlp`` (SGLang's mapper), and the names
    without ``language_model.model.`` and without ``language_model.``."""
    if not on:
        return [name]
    names = {name}
    if "block_sparse_moe" in name:
        names.add(name.replace("block_sparse_moe", "mlp"))
    for n in list(names):
        if n.startswith("language_model.model."):
            rest = n[len("language_model.model."):]
            names.update({"model." + rest, rest})
        elif n.startswith("language_model."):
            names.add(n[len("language_model."):])
    return sorted(names)
